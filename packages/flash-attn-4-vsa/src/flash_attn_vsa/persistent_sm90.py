"""Persistent tiles for the fork's sm_90 forwards: the seventh delta (experimental: compiled for
sm_90a, GPU tests written, not yet run; not routed).

Why (a reading of the H200 grids, not yet measured as such): upstream's sm_90 forward launches
one CTA per tile (``SingleTileScheduler``), so every tile pays its start (the Q load and the
first key/value loads from L2 or HBM) and its end (the O store) with the tensor cores idle,
unless another CTA shares the SM. A sparse tile has few steps (about 26 128-key steps at 90%
and S=32768 against dense's 256), so that cost weighs ~10x more than in dense. The two-CTA
kernel (two CTAs share each SM) holds its ratio from 87.5% to 90% sparsity (0.86 both); the
kernels of one CTA per SM lose with sparsity (paired keys 0.95 -> 0.89-0.91), as a fixed
cost per tile would make them.

Persistent tiles: ``ctas`` CTAs (the SM count times the CTAs an SM holds) walk the tiles with
upstream's ``StaticPersistentTileScheduler`` (tile ``i``, ``i + ctas``, ...), so the producer
loads the next tile's keys and values while the consumers finish the current one. Upstream's
consumer stages O in Q's shared memory and lets the producer have Q back before its epilogue,
which a single tile per CTA makes harmless and persistence would not (the next tile's Q could
land in the O being stored), so `with_persistent_tiles` hands Q back only after the epilogue
(whose O store waits for its shared-memory reads).

- `persistent_tiles(ctas)`: while open on this thread, upstream's forward module sees our
  scheduler where it builds ``SingleTileScheduler`` (`install`, once per process; every other
  caller gets upstream's class). The grid is ``min(ctas, tiles)``, decided when the kernel is
  compiled (no device query, so a CPU compile works).
- `with_persistent_tiles(base)`: the kernel class whose consumer releases Q after its epilogue.

Upstream internals this relies on (fingerprinted): ``flash_fwd_sm90.SingleTileScheduler`` (a
module global read by ``__call__`` and handed to the kernel), ``StaticPersistentTileScheduler``
(its parameters and loop), ``mma``'s ``pipeline_q`` parameter and its single
``consumer_release_w_index`` per tile, and ``epilogue`` (its O store waiting for its reads).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flash_attn_vsa.sm90_operands import (
    PipelineStandIn,
    pushed,
    thread_stack,
    upstream_mma_arguments,
)

__all__ = ["install", "persistent_tiles", "scheduler_class", "with_persistent_tiles"]


@contextmanager
def persistent_tiles(ctas: int) -> Iterator[None]:
    """While open on this thread, upstream's sm_90 forward schedules its tiles over ``ctas``
    persistent CTAs."""
    if isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1:
        raise ValueError(f"ctas must be a positive int, got {ctas!r}")
    install()
    with pushed("ctas", ctas):
        yield


@functools.cache
def scheduler_class(ctas: int) -> type:
    """Upstream's static persistent scheduler with a grid of at most ``ctas`` CTAs."""
    import cutlass
    from cutlass import Int32
    from flash_attn.cute.tile_scheduler import StaticPersistentTileScheduler

    class PersistentTiles(StaticPersistentTileScheduler):
        @staticmethod
        def get_grid_shape(params: Any, *, loc: Any = None, ip: Any = None) -> Any:
            return (cutlass.min(Int32(ctas), params.total_blocks_cluster), Int32(1), Int32(1))

    PersistentTiles.__name__ = PersistentTiles.__qualname__ = f"PersistentTiles{ctas}"
    return PersistentTiles


class _SchedulerChoice:
    """``SingleTileScheduler`` as upstream's forward module sees it: upstream's class, or
    `scheduler_class` while `persistent_tiles` is open on the calling thread."""

    def __init__(self, upstream: type) -> None:
        self.upstream = upstream

    def _current(self) -> type:
        ctas = thread_stack("ctas")
        return scheduler_class(ctas[-1]) if ctas else self.upstream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current(), name)


@functools.cache
def install() -> None:
    """Once per process: ``flash_fwd_sm90.SingleTileScheduler`` becomes `_SchedulerChoice`."""
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    fwd_module.SingleTileScheduler = _SchedulerChoice(fwd_module.SingleTileScheduler)


class _QReleasedAfterEpilogue(PipelineStandIn):
    """Upstream's Q pipeline, except that the consumer's release of Q (which upstream issues
    before its epilogue) is held back until `release_now`, called after the epilogue (extra
    state: the list of held releases, shared by every rebuilt copy)."""

    def consumer_release_w_index(self, *args: Any, **kwargs: Any) -> None:
        self._extra[0].append((args, kwargs))

    def release_now(self) -> None:
        (held,) = self._extra
        if len(held) != 1:
            raise RuntimeError(
                "persistent tiles expect upstream's consumer to release Q once per tile, saw "
                f"{len(held)} releases before its epilogue; review persistent_sm90"
            )
        args, kwargs = held.pop()
        self._inner.consumer_release_w_index(*args, **kwargs)


@functools.cache
def with_persistent_tiles(base: type) -> type:
    """A subclass of the sm_90 forward kernel class ``base`` whose consumer hands Q back to
    the producer only after the tile's epilogue (safe under `persistent_tiles`)."""

    class PersistentTilesForward(base):  # type: ignore[misc, valid-type]
        """``base`` with Q released after the epilogue (and, where the producer is ours, Q
        loaded after the tile's first key block, so that those keys need not wait for it)."""

        q_after_first_key = True

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            bound = upstream_mma_arguments(self, args, kwargs)
            pipeline_q = _QReleasedAfterEpilogue(bound.arguments["pipeline_q"], [])
            bound.arguments["pipeline_q"] = pipeline_q
            with pushed("pipeline_q", pipeline_q):
                return base.mma(*bound.args, **bound.kwargs)

        def epilogue(self, *args: Any, **kwargs: Any) -> Any:
            result = base.epilogue(self, *args, **kwargs)
            thread_stack("pipeline_q")[-1].release_now()
            return result

    PersistentTilesForward.__name__ = f"{base.__name__}Persistent"
    PersistentTilesForward.__qualname__ = PersistentTilesForward.__name__
    return PersistentTilesForward

"""Persistent tiles for the fork's sm_90 forwards: the seventh delta (experimental, not routed:
on an H200 its first form was 1-2% slower than one tile per CTA, this one +0.7% on the paired
kernel and -3% to +1% on the two-CTA one; session 8).

Why (a reading of the H200 grids and counters): upstream's sm_90 forward launches
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
consumer stages O in Q's shared memory and hands Q back to the producer before its epilogue,
which a single tile per CTA makes harmless and persistence would not (the next tile's Q could
land in the O being stored). Session 7 held the release back until after the epilogue, and
the H200 measured that 1-2% slower than one tile per CTA (the next Q then waits for the whole
epilogue, session 8); `with_persistent_tiles` now gives O a buffer of its own (32 KB for a
128-row tile: the paired kernel's 160 KB become 192, the two-CTA kernel's 80 become 96 per
CTA), so upstream's early release is safe and the next tile's Q loads during the epilogue.

- `install` (once per process): upstream's forward module sees our scheduler where it builds
  ``SingleTileScheduler`` while a fork entry point builds a `fwd_sm90.ForwardKernel` with
  ``persistent`` CTAs on the calling thread (`build_scope.current`; the entry points take
  ``persistent=`` as an argument); every other caller gets upstream's class. The grid is
  ``min(ctas, tiles)``, decided when the kernel is compiled (no device query, so a CPU compile
  works).
- `with_persistent_tiles(base)`: the kernel class whose shared storage has its own O buffer
  (`storage_with_separate_o`).

Upstream internals this relies on (fingerprinted): ``flash_fwd_sm90.SingleTileScheduler`` (a
module global read by ``__call__`` and handed to the kernel), ``StaticPersistentTileScheduler``
(its parameters and loop), ``_get_shared_storage_cls`` (a ``cute.struct`` the kernel
allocates), ``kernel`` (its O tile made as ``storage.sQ.get_tensor(..., dtype=...)``, the only
tensor on ``sQ`` with a dtype) and ``epilogue`` (its O store waiting for its reads before the
warp that issued it meets the others at the next epilogue's barrier).
"""

from __future__ import annotations

import functools
from typing import Any

from flash_attn_vsa.build_scope import current

__all__ = [
    "install",
    "scheduler_class",
    "storage_with_separate_o",
    "with_persistent_tiles",
]


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
    `scheduler_class` of the kernel's CTAs while a fork entry point builds a persistent
    `fwd_sm90.ForwardKernel` on the calling thread."""

    def __init__(self, upstream: type) -> None:
        self.upstream = upstream

    def _current(self) -> type:
        kernel = current("fwd")
        return scheduler_class(kernel.persistent) if kernel and kernel.persistent else self.upstream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current(), name)


@functools.cache
def install() -> None:
    """Once per process: ``flash_fwd_sm90.SingleTileScheduler`` becomes `_SchedulerChoice`."""
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    fwd_module.SingleTileScheduler = _SchedulerChoice(fwd_module.SingleTileScheduler)


class _QueryView:
    """``storage.sQ`` as upstream's kernel sees it in `with_persistent_tiles` classes: Q's
    buffer, except that the one tensor upstream makes on it with an explicit ``dtype`` (its
    O staging tile, ``sO``) comes from the struct's own ``sO`` field instead."""

    def __init__(self, sq: Any, so: Any) -> None:
        self._sq, self._so = sq, so

    def get_tensor(self, layout: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
        if dtype is None:
            return self._sq.get_tensor(layout, *args, **kwargs)
        return self._so.get_tensor(layout, *args, dtype=dtype, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sq, name)


class _StorageView:
    """A shared-storage instance whose ``sQ`` is a `_QueryView`; everything else as is."""

    def __init__(self, storage: Any) -> None:
        self._storage = storage

    @property
    def sQ(self) -> Any:  # upstream's field name
        return _QueryView(self._storage.sQ, self._storage.sO)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


@functools.cache
def _separate_o_struct_class() -> type:
    """A ``cute.struct`` whose instances (made by ``SmemAllocator.allocate``) come wrapped in
    `_StorageView`."""
    from cutlass import cute

    class SeparateOStruct(cute.struct):
        def __call__(self, base: Any, *args: Any, **kwargs: Any) -> Any:
            return _StorageView(super().__call__(base, *args, **kwargs))

    return SeparateOStruct


def storage_with_separate_o(upstream_struct: Any, dtype: Any, o_cosize: Any, align: int) -> Any:
    """Upstream's shared storage (a ``cute.struct``) with one more field, ``sO``: ``o_cosize``
    elements of ``dtype`` aligned to ``align`` bytes, which upstream's kernel then stages O in
    (`_QueryView`) instead of Q's buffer."""
    from cutlass import cute

    fields = dict(upstream_struct._annotations)
    fields["sO"] = cute.struct.Align[cute.struct.MemRange[dtype, o_cosize], align]
    name = f"{upstream_struct._cls.__name__}SeparateO"
    return _separate_o_struct_class()(type(name, (), {"__annotations__": fields}))


@functools.cache
def with_persistent_tiles(base: type) -> type:
    """A subclass of the sm_90 forward kernel class ``base`` that stages O in a buffer of its
    own (safe on persistent CTAs: upstream hands Q back to the producer before its
    epilogue, so the next tile's Q loads while this tile's O is written and stored)."""

    class PersistentTilesForward(base):  # type: ignore[misc, valid-type]
        """``base`` with O staged apart from Q (and, where the producer is ours, Q loaded
        after the tile's first key block, so that those keys need not wait for it)."""

        q_after_first_key = True

        def _get_shared_storage_cls(self) -> Any:
            from cutlass import cute

            if self.Q_in_regs:  # upstream's V-in-Q's-buffer mode: not one our kernels use
                raise NotImplementedError("persistent tiles need Q and V in their own buffers")
            upstream = base._get_shared_storage_cls(self)
            o_cosize = cute.cosize(self.sO_layout)
            return storage_with_separate_o(upstream, self.dtype, o_cosize, self.buffer_align_bytes)

    PersistentTilesForward.__name__ = f"{base.__name__}Persistent"
    PersistentTilesForward.__qualname__ = PersistentTilesForward.__name__
    return PersistentTilesForward

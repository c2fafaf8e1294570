"""What the fork's sm_90 deltas (`bwd_sm90`, `fwd_sm90`) run: 64-token key blocks (64x64 sparse
blocks forward; 64x64 and 128x64 backward) at head dims 64 and 128, as many key heads as query
heads, and the argument checks that say so; and what the deltas share to run there: the launch
bound of two CTAs per SM (`BoundLauncher`) and upstream's compile caches scoped to our kernel
classes (`ScopedCompileCache`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

BLOCK_SIZE = (64, 64)
"""The sparse block (query tokens, key tokens) the forward delta runs."""

BWD_BLOCK_SIZES = ((64, 64), (128, 64))
"""The sparse blocks the backward delta runs."""

HEAD_DIMS = (64, 128)
"""Head dims (q/k and v alike) the deltas are compiled and tested for."""


class BoundLauncher:
    """An upstream kernel launcher (what a ``@cute.kernel`` call returns) that launches with a
    bound of ``ctas_per_sm`` CTAs per SM (so ptxas keeps registers within 64K / that many CTAs'
    threads) and the whole shared-memory carveout (stating it also spares the device query
    that a compile on a machine without a GPU cannot make)."""

    def __init__(self, inner: Any, ctas_per_sm: int) -> None:
        self._inner = inner
        self._ctas_per_sm = ctas_per_sm

    def launch(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["min_blocks_per_mp"] = self._ctas_per_sm
        kwargs.setdefault("preferred_smem_carveout", 100)
        return self._inner.launch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def check_call(
    q: Any,
    k: Any,
    v: Any,
    block_size: tuple[int, int],
    allowed: tuple[tuple[int, int], ...] = (BLOCK_SIZE,),
) -> None:
    """ValueError unless a delta running the ``allowed`` sparse blocks can run these inputs
    (shapes and block size only)."""
    if tuple(block_size) not in allowed:
        wanted = " or ".join(str(b) for b in allowed)
        raise ValueError(f"block_size must be {wanted} (query, key tokens), got {block_size}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] not in HEAD_DIMS:
            raise ValueError(f"{name}'s head dim must be one of {HEAD_DIMS}, got {t.shape[-1]}")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"k must have q's number of heads {q.shape[-2]} (no GQA here), got {k.shape[-2]}"
        )
    for name, t, block in (("q", q, block_size[0]), ("k", k, block_size[1])):
        if t.shape[1] % block:
            raise ValueError(
                f"{name}'s sequence length must be a multiple of {block}, got {t.shape[1]}"
            )


class ScopedCompileCache:
    """An upstream compile cache (``_flash_attn_fwd.compile_cache`` or the backward's) seen
    through a scope: where ``scope()`` names one of our kernels (a hashable key, ``None``
    elsewhere), compiled kernels go to and come from a dictionary of that key; everywhere else
    to and from upstream's cache. Upstream's compile key has the tile configuration but not the
    kernel class, and our kernels run upstream's configurations, so they must not share
    entries."""

    def __init__(self, upstream: Any, scope: Callable[[], Hashable | None]) -> None:
        self.upstream = upstream
        self.scope = scope
        self.own: dict[Hashable, dict[Any, Any]] = {}

    def _current(self) -> Any:
        key = self.scope()
        return self.upstream if key is None else self.own.setdefault(key, {})

    def __contains__(self, key: Any) -> bool:
        return key in self._current()

    def __getitem__(self, key: Any) -> Any:
        from flash_attn_vsa.launch_replay import recording_wrapper

        return recording_wrapper(self._current()[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._current()[key] = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.upstream, name)

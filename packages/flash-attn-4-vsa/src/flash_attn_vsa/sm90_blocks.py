"""What the fork's sm_90 deltas (`bwd_sm90`, `fwd_sm90`) run: 64x64 sparse blocks at head dims
64 and 128, as many key heads as query heads, and the argument checks that say so."""

from __future__ import annotations

from typing import Any

BLOCK_SIZE = (64, 64)
"""The sparse block (query tokens, key tokens) the deltas run."""

HEAD_DIMS = (64, 128)
"""Head dims (q/k and v alike) the deltas are compiled and tested for."""


def check_call(q: Any, k: Any, v: Any, block_size: tuple[int, int]) -> None:
    """ValueError unless the deltas can run these inputs (shapes and block size only)."""
    if tuple(block_size) != BLOCK_SIZE:
        raise ValueError(f"block_size must be {BLOCK_SIZE} (query, key tokens), got {block_size}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] not in HEAD_DIMS:
            raise ValueError(f"{name}'s head dim must be one of {HEAD_DIMS}, got {t.shape[-1]}")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"k must have q's number of heads {q.shape[-2]} (no GQA here), got {k.shape[-2]}"
        )
    for name, t in (("q", q), ("k", k)):
        if t.shape[1] % BLOCK_SIZE[0]:
            raise ValueError(f"{name}'s sequence length must be a multiple of 64, got {t.shape[1]}")

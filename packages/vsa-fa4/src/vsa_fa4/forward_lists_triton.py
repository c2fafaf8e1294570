"""The forward's full and partial key-block lists in one Triton launch (the GPU path of
`vsa_fa4.metadata.forward_lists`).

Why a kernel: the tensor-op version classifies and compacts every list slot through an int64
gather, three running counts, int64 scatter indices and a [B, H, NQ, 3W] buffer: by their
sizes about 0.5 GB of transients at Wan 2.1 720p (40 heads, 1440 query tiles, W = 180, 10.4 M
slots). On an H200 (2026-11-29, ``bench_video.py``) the op's inference peak there was 1436 MiB
with fa4's masked kernels against 1010 MiB with Triton's (dense attention: 738), the same
1.11x of dense for both on a tile-aligned latent (no partial lists to split). The kernel writes
the two lists and their counts and allocates nothing else.

`_split_full_partial`, one program per ``BLOCK_R`` query-block rows: walks each row's list in
``BLOCK_W``-slot chunks, classifies each used slot by its key block's valid size (full:
``valid >= kv_tile``, partial: ``0 < valid < kv_tile``, empty blocks dropped), ranks the two
classes with prefix sums and stores each block at its class's running offset (ascending order
kept, deterministic), then zeroes both lists' unused tails so every entry is a valid block
index: the same tensors as the tensor-op path.

Loops are ``while`` loops for Triton's interpreter (see `vsa_fa4.backward_lists_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vsa_fa4.lists import PackedSparseLists, SparseLists, empty_lists
from vsa_triton.launch_cache import launch

BLOCK_R = 16
BLOCK_W = 64


@triton.jit
def _split_full_partial(
    kv_idx_ptr,  # [R, W] listed key blocks per query-block row
    kv_cnt_ptr,  # [R] how many of them are used
    valid_ptr,  # [NKV] valid tokens per key block
    full_idx_ptr,  # out [R, KEEP] int32
    mask_idx_ptr,  # out [R, KEEP] int32
    full_cnt_ptr,  # out [R] int32
    mask_cnt_ptr,  # out [R] int32
    num_rows,
    width,
    keep,
    kv_tile,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PACK_VALID: tl.constexpr,  # partial entries as block | valid << 16 (PackedSparseLists)
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    rows = r.to(tl.int64)
    count = tl.load(kv_cnt_ptr + rows, mask=r_ok, other=0)
    n_full = tl.zeros([BLOCK_R], dtype=tl.int32)
    n_partial = tl.zeros([BLOCK_R], dtype=tl.int32)
    w0 = 0
    while w0 < width:
        w = w0 + tl.arange(0, BLOCK_W)
        used = r_ok[:, None] & (w[None, :] < count[:, None])
        kv = tl.load(kv_idx_ptr + rows[:, None] * width + w[None, :], mask=used, other=0)
        valid = tl.load(valid_ptr + kv, mask=used, other=0)
        full = (used & (valid >= kv_tile)).to(tl.int32)
        partial = (used & (valid > 0) & (valid < kv_tile)).to(tl.int32)
        full_slot = n_full[:, None] + tl.cumsum(full, axis=1) - 1
        partial_slot = n_partial[:, None] + tl.cumsum(partial, axis=1) - 1
        tl.store(full_idx_ptr + rows[:, None] * keep + full_slot, kv, mask=full > 0)
        entry = kv | (valid << 16) if PACK_VALID else kv
        tl.store(mask_idx_ptr + rows[:, None] * keep + partial_slot, entry, mask=partial > 0)
        n_full += tl.sum(full, axis=1)
        n_partial += tl.sum(partial, axis=1)
        w0 += BLOCK_W
    c0 = 0
    while c0 < keep:
        c = c0 + tl.arange(0, BLOCK_W)
        inside = r_ok[:, None] & (c[None, :] < keep)
        at = rows[:, None] * keep + c[None, :]
        zero = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.int32)
        tl.store(full_idx_ptr + at, zero, mask=inside & (c[None, :] >= n_full[:, None]))
        tl.store(mask_idx_ptr + at, zero, mask=inside & (c[None, :] >= n_partial[:, None]))
        c0 += BLOCK_W
    tl.store(full_cnt_ptr + rows, n_full, mask=r_ok)
    tl.store(mask_cnt_ptr + rows, n_partial, mask=r_ok)


def forward_lists_triton(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    kv_tile: int,
    pack_valid: bool = False,
) -> SparseLists:
    """`vsa_fa4.metadata.forward_lists` in one launch (same tensors, same values; a list
    width of 0 is the caller's case); ``pack_valid``: `PackedSparseLists`."""
    lead, width = kv_indices.shape[:-1], kv_indices.shape[-1]
    keep = min(width, kv_valid_sizes.shape[0])
    lists = empty_lists(lead, keep, keep, kv_indices.device)
    mask_cnt, mask_idx, full_cnt, full_idx = lists
    num_rows = full_cnt.numel()
    if num_rows:
        launch(
            _split_full_partial,
            (-(-num_rows // BLOCK_R),),
            kv_indices.contiguous(),
            kv_counts.contiguous(),
            kv_valid_sizes.contiguous(),
            full_idx,
            mask_idx,
            full_cnt,
            mask_cnt,
            num_rows,
            width,
            keep,
            kv_tile,
            BLOCK_R=BLOCK_R,
            BLOCK_W=BLOCK_W,
            PACK_VALID=pack_valid,
        )
    return PackedSparseLists(*lists) if pack_valid else lists

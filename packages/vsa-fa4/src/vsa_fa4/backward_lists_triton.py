"""The backward's key-block-owned lists in one Triton launch (the GPU path of
`vsa_fa4.metadata.backward_lists`).

Why a kernel: the same lists built from torch ops take about fifteen launches (a dense
[B, H, NKV, NQ] scatter, a cumulative sum along a strided axis, int64 scatter indices). On an
H200 at S=32768, H=12, 128x128 blocks they cost about 70 us of device time per backward
(2.5% of the block-sparse backward) and about 0.6 ms of host time (2026-11-29,
``benchmarks/diagnose_fa4_host.py``); this kernel writes the same tensors in one pass.

Work split: one program per (batch x head, chunk of ``BLOCK_KV`` key blocks). It walks the query
blocks in ascending chunks of ``BLOCK_Q``; for each chunk it marks which of its key blocks each
query block lists (a [BLOCK_Q, BLOCK_W, BLOCK_KV] comparison per ``BLOCK_W`` list slots), ranks
the hits per key block with a prefix sum along the query axis and stores each hit's query
block at its key block's running offset. The order is therefore ascending and deterministic;
then the unused tail of every list is zeroed (every entry stays a valid block index) and the
counts are split into full and partial by the key block's valid size.

``q_split`` > 1: each listed query block stands for that many physical query blocks (a 128-row
block of a paired schedule handed to the 64-row backward as two blocks): query block ``i``
becomes ``i * q_split + s`` for ``s < q_split`` and the counts scale with it.

Triton is imported when this module is; `vsa_fa4.metadata` imports it only for real CUDA
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vsa_fa4.metadata import SparseLists

BLOCK_Q = 32
BLOCK_W = 16
BLOCK_KV = 32


@triton.jit
def _kv_to_q_lists(
    kv_idx_ptr,  # [BH, NQ, W] listed key blocks per query block
    kv_cnt_ptr,  # [BH, NQ] how many of them are used
    valid_ptr,  # [NKV] valid tokens per key block
    q_idx_ptr,  # out [BH, NKV, NQ * Q_SPLIT] int32
    full_cnt_ptr,  # out [BH, NKV] int32
    mask_cnt_ptr,  # out [BH, NKV] int32
    num_q,
    num_kv,
    width,
    kv_tile,
    Q_SPLIT: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1) * BLOCK_KV + tl.arange(0, BLOCK_KV)
    kv_ok = kv < num_kv
    out_width = num_q * Q_SPLIT
    out_rows = q_idx_ptr + (bh * num_kv + kv) * out_width  # [BLOCK_KV] row starts
    offset = tl.zeros([BLOCK_KV], dtype=tl.int32)
    # while, not range(): Triton 3.6's interpreter cannot take range() bounds from scalar
    # arguments under NumPy >= 2.4 (it converts a one-element array with int()).
    q0 = 0
    while q0 < num_q:
        q = q0 + tl.arange(0, BLOCK_Q)
        q_ok = q < num_q
        count = tl.load(kv_cnt_ptr + bh * num_q + q, mask=q_ok, other=0)
        hit = tl.zeros([BLOCK_Q, BLOCK_KV], dtype=tl.int32)
        w0 = 0
        while w0 < width:
            w = w0 + tl.arange(0, BLOCK_W)
            used = q_ok[:, None] & (w[None, :] < count[:, None])
            listed = tl.load(
                kv_idx_ptr + (bh * num_q + q[:, None]) * width + w[None, :], mask=used, other=-1
            )
            match = listed[:, :, None] == kv[None, None, :]  # [BLOCK_Q, BLOCK_W, BLOCK_KV]
            hit = tl.maximum(hit, tl.max(match.to(tl.int32), axis=1))
            w0 += BLOCK_W
        rank = tl.cumsum(hit, axis=0)  # inclusive, per key block, in query order
        slot = (offset[None, :] + rank - 1) * Q_SPLIT
        store = (hit > 0) & kv_ok[None, :]
        for s in tl.static_range(Q_SPLIT):
            tl.store(out_rows[None, :] + slot + s, q[:, None] * Q_SPLIT + s, mask=store)
        offset += tl.sum(hit, axis=0)
        q0 += BLOCK_Q
    counts = offset * Q_SPLIT
    c0 = 0
    while c0 < out_width:
        col = c0 + tl.arange(0, BLOCK_Q)
        tail = (col[:, None] >= counts[None, :]) & (col[:, None] < out_width) & kv_ok[None, :]
        tl.store(out_rows[None, :] + col[:, None], tl.zeros_like(col)[:, None], mask=tail)
        c0 += BLOCK_Q
    if MASKED:
        valid = tl.load(valid_ptr + kv, mask=kv_ok, other=0)
        full = tl.where(valid >= kv_tile, counts, 0)
        partial = tl.where((valid > 0) & (valid < kv_tile), counts, 0)
    else:
        full = counts
        partial = tl.zeros_like(counts)
    tl.store(full_cnt_ptr + bh * num_kv + kv, full, mask=kv_ok)
    tl.store(mask_cnt_ptr + bh * num_kv + kv, partial, mask=kv_ok)


def backward_lists_triton(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    kv_tile: int,
    masked: bool = True,
    q_split: int = 1,
) -> SparseLists:
    """`vsa_fa4.metadata.backward_lists` in one launch (same tensors, same values)."""
    *lead, num_q, width = kv_indices.shape
    num_kv = kv_valid_sizes.shape[0]
    rows = 1
    for n in lead:
        rows *= n
    device = kv_indices.device
    q_indices = torch.empty(*lead, num_kv, num_q * q_split, dtype=torch.int32, device=device)
    full_cnt = torch.empty(*lead, num_kv, dtype=torch.int32, device=device)
    mask_cnt = torch.empty_like(full_cnt)
    if rows and num_kv and num_q:
        grid = (rows, triton.cdiv(num_kv, BLOCK_KV))
        _kv_to_q_lists[grid](
            kv_indices.contiguous(),
            kv_counts.contiguous(),
            kv_valid_sizes.contiguous(),
            q_indices,
            full_cnt,
            mask_cnt,
            num_q,
            num_kv,
            width,
            kv_tile,
            Q_SPLIT=q_split,
            MASKED=masked,
            BLOCK_Q=BLOCK_Q,
            BLOCK_W=BLOCK_W,
            BLOCK_KV=BLOCK_KV,
        )
    else:
        full_cnt.zero_()
        mask_cnt.zero_()
    if not masked:
        return SparseLists(mask_cnt, mask_cnt.unsqueeze(-1), full_cnt, q_indices)
    return SparseLists(mask_cnt, q_indices, full_cnt, q_indices)

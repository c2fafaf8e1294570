"""dQ from the dS the key-owned backward wrote (the fork's delta 12,
`flash_attn_vsa.bwd_sm90_ds_out`): the query-owned half of the dS-writing backward, in Triton.

One program per (batch x head, 64-row query block) walks the block's forward list in order and
accumulates ``dS[slot] @ K[key block]`` in float32 registers, then writes ``scale *`` the sum
in dQ's dtype: no atomics and a fixed order, so dQ is bitwise the same run to run. A pair's
slot is its key block's first slot plus the pair's place in that key block's backward list
(`vsa_fa4.backward_lists_triton.backward_lists_with_positions`); in a tile, row r's 16-byte
chunks are permuted by r % 8, as the key kernel stages them
(`flash_attn_vsa.bwd_sm90_ds_out.DS_SWIZZLE`). Key blocks with no valid token are never
walked by the key-owned kernel, so their slots hold nothing of theirs: the loads are masked
off for them (they add zero, as the reference's empty blocks do). K's rows past a partial
block's valid size are not read; dS is zero in those columns (P is, and V's padding is
finite), so they add zero. (Masking dS's columns too cost the loads their vectors.)

The loop runs to a loaded count with ``tl.range`` (its loads pipelined on the GPU); under
Triton's interpreter (the CPU tests) as a ``while`` loop, which is all Triton 3.6's interpreter
takes with a loaded bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vsa_fa4.lists import SparseLists
from vsa_triton.environment import interpreting
from vsa_triton.launch_cache import launch
from vsa_triton.tensor_args import bshd_strides

BLOCK = 64
"""Query and key block size (the dS tiles are BLOCK x BLOCK)."""


@dataclass(frozen=True)
class DqPassConfig:
    """How the dQ pass is compiled: ``stages`` of loads in flight along a list (Triton's
    software pipeline over the loop) and ``warps`` per program."""

    stages: int = 3
    warps: int = 4

    def __post_init__(self) -> None:
        for name in ("stages", "warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


SHIPPED_DQ_PASS = DqPassConfig()


@triton.jit
def _add_pair(
    acc, t, ds_ptr, k_head, kv_idx_ptr, positions_ptr, starts_row, valid_ptr, list_row,
    stride_ks, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """``acc`` plus the list entry ``t``'s dS tile times its key block (zero for an empty
    key block; only K's valid rows and dS's valid columns are read)."""
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    j = tl.load(kv_idx_ptr + list_row + t)
    valid = tl.load(valid_ptr + j)
    slot = (tl.load(starts_row + j) + tl.load(positions_ptr + list_row + t)).to(tl.int64)
    # the key kernel's tile layout: row r's 16-byte chunks permuted by r % 8 (DS_SWIZZLE)
    chunk = (rows[None, :] // 8) ^ (rows[:, None] % 8)
    tile = ds_ptr + slot * (BLOCK * BLOCK) + rows[:, None] * BLOCK + chunk * 8 + rows[None, :] % 8
    ds = tl.load(tile, mask=valid > 0, other=0.0)
    keys = j.to(tl.int64) * BLOCK + rows
    kb = tl.load(
        k_head + keys[:, None] * stride_ks + dims[None, :], mask=rows[:, None] < valid, other=0.0
    )
    return tl.dot(ds, kb, acc)


@triton.jit
def _dq_from_ds(
    ds_ptr,  # [slots * BLOCK, BLOCK] row-major dS tiles
    k_ptr,  # [B, S_k, H, D]
    dq_ptr,  # out [B, S_q, H, D]
    kv_idx_ptr,  # [BH, NQ, W] forward lists
    kv_cnt_ptr,  # [BH, NQ]
    positions_ptr,  # [BH, NQ, W] each entry's place in its key block's backward list
    slot_starts_ptr,  # [BH, NKV] first slot of each key block's list
    valid_ptr,  # [NKV] valid tokens per key block
    heads,
    num_q,
    num_kv,
    width,
    q_len,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_qb,
    stride_qs,
    stride_qh,
    scale,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    list_row = (bh * num_q + i) * width
    count = tl.load(kv_cnt_ptr + bh * num_q + i)
    k_head = k_ptr + b * stride_kb + h * stride_kh
    starts_row = slot_starts_ptr + bh * num_kv
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    if INTERPRET:  # the interpreter takes no loaded loop bound in range()
        t = 0
        while t < count:
            acc = _add_pair(acc, t, ds_ptr, k_head, kv_idx_ptr, positions_ptr, starts_row,
                            valid_ptr, list_row, stride_ks, BLOCK, HEAD_DIM)  # fmt: skip
            t += 1
    else:
        for t in tl.range(0, count, num_stages=STAGES):
            acc = _add_pair(acc, t, ds_ptr, k_head, kv_idx_ptr, positions_ptr, starts_row,
                            valid_ptr, list_row, stride_ks, BLOCK, HEAD_DIM)  # fmt: skip
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = i.to(tl.int64) * BLOCK + rows
    out = dq_ptr + b * stride_qb + h * stride_qh + q_rows[:, None] * stride_qs + dims[None, :]
    tl.store(out, (acc * scale).to(dq_ptr.dtype.element_ty), mask=q_rows[:, None] < q_len)


def slot_starts(lists: SparseLists) -> torch.Tensor:
    """Each key block's first dS slot [..., NKV] int32: the exclusive running sum of the
    backward ``lists``' counts (partial and full) over every (batch, head, key block) in
    order. The slots a call needs are at most the forward lists' used entries."""
    counts = (lists.full_block_cnt + lists.mask_block_cnt).flatten()
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    return starts.view(lists.full_block_cnt.shape)


def dq_from_ds(
    ds: torch.Tensor,
    k: torch.Tensor,
    dq: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    positions: torch.Tensor,
    slot_starts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    config: DqPassConfig = SHIPPED_DQ_PASS,
) -> torch.Tensor:
    """Write ``dq`` [B, S_q, H, D] (BSHD, head dim contiguous) = ``scale`` * the sum over each
    64-row query block's forward list (``kv_indices`` [B, H, NQ, W], ``kv_counts`` [B, H, NQ])
    of its dS tiles times K's key blocks; ``positions`` [B, H, NQ, W] and ``slot_starts``
    [B, H, NKV] say where each pair's tile is in ``ds`` [slots * 64, 64]. Rows of dq past the
    last query block are left as they are. ``config``: how the kernel is compiled. Returns
    ``dq``."""
    batch, q_len, heads, head_dim = dq.shape
    num_q, width = kv_indices.shape[-2:]
    num_kv = kv_valid_sizes.shape[0]
    if k.stride(-1) != 1 or dq.stride(-1) != 1:
        raise ValueError("k and dq need a contiguous head dim")
    if batch * heads and num_q:
        launch(
            _dq_from_ds,
            (batch * heads, num_q),
            ds,
            k,
            dq,
            kv_indices.contiguous(),
            kv_counts.contiguous(),
            positions.contiguous(),
            slot_starts.contiguous(),
            kv_valid_sizes.contiguous(),
            heads,
            num_q,
            num_kv,
            width,
            min(q_len, num_q * BLOCK),
            *bshd_strides(k),
            *bshd_strides(dq),
            scale,
            BLOCK=BLOCK,
            HEAD_DIM=head_dim,
            STAGES=config.stages,
            INTERPRET=interpreting(),
            num_warps=config.warps,
        )
    return dq

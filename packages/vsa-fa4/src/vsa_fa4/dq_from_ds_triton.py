"""dQ from the dS the key-owned backward wrote (the fork's delta 12,
`flash_attn_vsa.bwd_sm90_ds_out`): the query-owned half of the dS-writing backward, in Triton.

The grid runs query blocks fastest, so that the programs running at once read one head's K
(8 MB at S=32768), which stays in L2; with heads fastest they spanned every head's K and read
half of it from HBM (Nsight Compute, S=32768, H=12: L2 hit rate 31%, DRAM 85% busy, 1.59 ms).

`ds_slots` first builds the key-owned lists with each key block's first dS slot and each
forward list entry's slot (`vsa_fa4.backward_lists_triton.backward_lists_with_slots`), -1 for
a key block with no valid token (the key-owned kernel never walks it, so no tile is its).
Then `dq_from_ds`, one
program per (batch x head, 64-row query block), walks the block's forward list in order and
accumulates ``dS[slot] @ K[key block]`` in float32 registers, and writes ``scale *`` the sum in
dQ's dtype: no atomics and a fixed order, so dQ is bitwise the same run to run. In a tile, row
r's 16-byte chunks are permuted by r % 8, as the key kernel stages them
(`flash_attn_vsa.bwd_sm90_ds_out.DS_SWIZZLE`).

What the pass reads unmasked: K's padding rows (a partial key block's rows past its valid
size) must be finite, as the key-owned kernel requires too; dS is zero in those columns (P is,
and V's padding is finite), so they add zero. A slot of -1 adds zero. Each step's loads are
independent of the others' values (the slots are computed beforehand), so Triton's software
pipeline keeps them in flight (reading the slot start through the key block inside the loop
made each step wait for a dependent load: 1.63 ms at S=32768, H=12, 87.5%, H200, session 26;
masking dS's columns as well cost the loads their vectors: 2.26 ms).

The loop runs to a loaded count with ``tl.range``; under Triton's interpreter (the CPU tests)
as a ``while`` loop, which is all Triton 3.6's interpreter takes with a loaded bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vsa_fa4.backward_lists_triton import DsSlots, backward_lists_with_slots
from vsa_triton.environment import interpreting
from vsa_triton.launch_cache import launch
from vsa_triton.tensor_args import bshd_strides

BLOCK = 64
"""Query and key block size (the dS tiles are BLOCK x BLOCK)."""


@dataclass(frozen=True)
class DqPassConfig:
    """How the dQ pass is compiled: ``stages`` of loads in flight along a list (Triton's
    software pipeline over the loop) and ``warps`` per program."""

    stages: int = 5
    """H200, S=32768, H=12 (session 26, query blocks fastest): 5 stages 1.06 ms, 2-4 1.16."""
    warps: int = 4

    def __post_init__(self) -> None:
        for name in ("stages", "warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


SHIPPED_DQ_PASS = DqPassConfig()


@triton.jit
def _add_entry(
    acc, t, ds_ptr, k_head, kv_idx_ptr, slots_ptr, list_row, stride_ks,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """``acc`` plus list entry ``t``'s dS tile times its key block (zero for slot -1)."""
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    j = tl.load(kv_idx_ptr + list_row + t)
    slot = tl.load(slots_ptr + list_row + t)
    # the key kernel's tile layout: row r's 16-byte chunks permuted by r % 8 (DS_SWIZZLE)
    chunk = (rows[None, :] // 8) ^ (rows[:, None] % 8)
    offsets = rows[:, None] * BLOCK + chunk * 8 + rows[None, :] % 8
    ds = tl.load(ds_ptr + slot.to(tl.int64) * (BLOCK * BLOCK) + offsets, mask=slot >= 0, other=0.0)
    keys = j.to(tl.int64) * BLOCK + rows
    kb = tl.load(k_head + keys[:, None] * stride_ks + dims[None, :])
    return tl.dot(ds, kb, acc)


@triton.jit
def _dq_from_ds(
    ds_ptr,  # [slots * BLOCK, BLOCK] dS tiles
    k_ptr,  # [B, S_k, H, D]
    dq_ptr,  # out [B, S_q, H, D]
    kv_idx_ptr,  # [BH, NQ, W] forward lists
    kv_cnt_ptr,  # [BH, NQ]
    slots_ptr,  # [BH, NQ, W] each entry's dS slot (`ds_slots`)
    heads,
    num_q,
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
    i = tl.program_id(0)  # query blocks fastest: the programs running at once share a head's K
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    h = bh % heads
    list_row = (bh * num_q + i) * width
    count = tl.load(kv_cnt_ptr + bh * num_q + i)
    k_head = k_ptr + b * stride_kb + h * stride_kh
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    if INTERPRET:  # the interpreter takes no loaded loop bound in range()
        t = 0
        while t < count:
            acc = _add_entry(acc, t, ds_ptr, k_head, kv_idx_ptr, slots_ptr, list_row, stride_ks,
                             BLOCK, HEAD_DIM)  # fmt: skip
            t += 1
    else:
        for t in tl.range(0, count, num_stages=STAGES):
            acc = _add_entry(acc, t, ds_ptr, k_head, kv_idx_ptr, slots_ptr, list_row, stride_ks,
                             BLOCK, HEAD_DIM)  # fmt: skip
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = i.to(tl.int64) * BLOCK + rows
    out = dq_ptr + b * stride_qb + h * stride_qh + q_rows[:, None] * stride_qs + dims[None, :]
    tl.store(out, (acc * scale).to(dq_ptr.dtype.element_ty), mask=q_rows[:, None] < q_len)


def ds_slots(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    masked: bool = True,
    rotate_sms: int = 0,
) -> DsSlots:
    """The key-owned lists of 64x64 blocks (rotated by ``rotate_sms``, as `backward_lists`
    does) with their dS slots, from the forward lists: two launches and a memset
    (`backward_lists_with_slots`)."""
    return backward_lists_with_slots(
        kv_indices, kv_counts, kv_valid_sizes, BLOCK, masked, rotate_sms
    )


def dq_from_ds(
    ds: torch.Tensor,
    k: torch.Tensor,
    dq: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    config: DqPassConfig = SHIPPED_DQ_PASS,
) -> torch.Tensor:
    """Write ``dq`` [B, S_q, H, D] (BSHD, head dim contiguous) = ``scale`` * the sum over each
    64-row query block's forward list (``kv_indices`` [B, H, NQ, W], ``kv_counts`` [B, H, NQ])
    of its dS tiles (in ``ds`` [slots * 64, 64] at ``slots``, `ds_slots`) times K's key
    blocks (K's padding rows finite: see the module doc). Rows of dq past the last query block
    are left as they are. ``config``: how the kernel is compiled. Returns ``dq``."""
    batch, q_len, heads, _ = dq.shape
    num_q, width = kv_indices.shape[-2:]
    if k.stride(-1) != 1 or dq.stride(-1) != 1:
        raise ValueError("k and dq need a contiguous head dim")
    if batch * heads and num_q:
        launch(
            _dq_from_ds,
            (num_q, batch * heads),
            ds,
            k,
            dq,
            kv_indices.contiguous(),
            kv_counts.contiguous(),
            slots.contiguous(),
            heads,
            num_q,
            width,
            min(q_len, num_q * BLOCK),
            *bshd_strides(k),
            *bshd_strides(dq),
            scale,
            BLOCK=BLOCK,
            HEAD_DIM=dq.shape[-1],
            STAGES=config.stages,
            INTERPRET=interpreting(),
            num_warps=config.warps,
        )
    return dq

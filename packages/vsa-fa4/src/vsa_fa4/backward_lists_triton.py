"""The backward's key-block-owned lists in two Triton launches (the GPU path of
`vsa_fa4.metadata.backward_lists`).

Why kernels: the same lists built from torch ops take about fifteen launches (a dense
[B, H, NKV, NQ] scatter, a cumulative sum along a strided axis, int64 scatter indices). On an
H200 at S=32768, H=12 they cost about 70 us of device time per backward at 128x128 blocks
(2.5% of the block-sparse backward) and about 0.6 ms of host time (2026-11-29,
``research/fa4_adapter/diagnose_fa4_host.py``).

Two passes over a [B*H, NQ, NKV] byte map of selected (query block, key block) pairs, zeroed
first:

1. `_mark_selected`, one program per (batch x head, ``BLOCK_Q`` query blocks): writes a 1 at
   every listed pair (work and bytes proportional to the lists, no search);
2. `_rank_selected`, one program per (batch x head, ``BLOCK_KV`` key blocks): reads the map in
   [``BLOCK_Q``, ``BLOCK_KV``] tiles down the query axis, ranks each key block's hits with a
   prefix sum and stores the query block at its key block's running offset, so every list is
   ascending and the result deterministic; then zeroes each list's unused tail (every entry
   stays a valid block index) and splits the counts into full and partial by the key
   block's valid size.

With slots (`backward_lists_with_slots`, the dS-writing backward's), the map holds each
entry's place in its forward list plus one (int16), the marking pass also counts every key
block's entries (integer atomics), and the ranking pass places each key block's dS slots after
those of the head's earlier key blocks (summing their counts) and writes every forward entry's
slot: no scan and no third launch (a cumulative sum and an entry-slot kernel did this before:
four more device operations a head chunk).

A first version compared every list slot with every key block of a program (a
[query, slot, key] comparison reduced over slots, in a loop over query and slot chunks): its
long chain of dependent reductions made it slower on the H200 than the torch ops it replaced.

``q_split`` > 1: each listed query block stands for that many physical query blocks (a 128-row
block handed to a 64-row backward as two blocks; unused by the adapter since the fork's 128x64
backward): query block ``i`` becomes ``i * q_split + s`` for ``s < q_split`` and the counts
scale with it.

Loops are ``while`` loops: Triton 3.6's interpreter cannot take ``range()`` bounds from scalar
arguments under NumPy >= 2.4 (it converts a one-element array with ``int()``), and the CPU
tests run these kernels there. Triton is imported with this module; `vsa_fa4.metadata`
imports it only for real CUDA tensors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vsa_fa4.lists import SparseLists
from vsa_triton.launch_cache import launch

BLOCK_Q = 64
BLOCK_W = 32
BLOCK_KV = 32


@triton.jit
def _mark_selected(
    kv_idx_ptr,  # [BH, NQ, W] listed key blocks per query block
    kv_cnt_ptr,  # [BH, NQ] how many of them are used
    selected_ptr,  # out [BH, NQ, NKV] uint8 (int16 with SLOTS), zeroed by the caller
    entries_ptr,  # out with SLOTS [BH, NKV] int32, zeroed: each key block's forward entries
    num_q,
    num_kv,
    width,
    BLOCK_Q: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SLOTS: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < num_q
    count = tl.load(kv_cnt_ptr + bh * num_q + q, mask=q_ok, other=0)
    rows = bh * num_q + q  # [BLOCK_Q]
    w0 = 0
    while w0 < width:
        w = w0 + tl.arange(0, BLOCK_W)
        used = q_ok[:, None] & (w[None, :] < count[:, None])
        kv = tl.load(kv_idx_ptr + rows[:, None] * width + w[None, :], mask=used, other=0)
        if SLOTS:  # the entry's place in its forward list, plus one
            mark = (w[None, :] + 1 + tl.zeros([BLOCK_Q, BLOCK_W], dtype=tl.int32)).to(tl.int16)
            # integer sums: exact and the same in any order (lists hold no duplicates)
            one = tl.full([BLOCK_Q, BLOCK_W], 1, dtype=tl.int32)
            tl.atomic_add(entries_ptr + bh * num_kv + kv, one, mask=used, sem="relaxed")
        else:
            mark = tl.full([BLOCK_Q, BLOCK_W], 1, dtype=tl.uint8)
        tl.store(selected_ptr + rows[:, None] * num_kv + kv, mark, mask=used)
        w0 += BLOCK_W


@triton.jit
def _hits(selected_ptr, bh, q0, kv, kv_ok, num_q, num_kv, BLOCK_Q: tl.constexpr):
    """Query blocks ``q0 + [0, BLOCK_Q)``, their [BLOCK_Q, BLOCK_KV] marks (int32: 0 where not
    selected) on the key blocks ``kv`` from the map, and the 0/1 hits."""
    q = q0 + tl.arange(0, BLOCK_Q)
    tile = (bh * num_q + q[:, None]) * num_kv + kv[None, :]
    inside = (q[:, None] < num_q) & kv_ok[None, :]
    mark = tl.load(selected_ptr + tile, mask=inside, other=0).to(tl.int32)
    return q, mark, (mark > 0).to(tl.int32)


@triton.jit
def _first_slots(entries_ptr, bh, kv, kv_ok, num_q, num_kv, width, BLOCK_KV: tl.constexpr):
    """Key blocks ``kv``'s first dS slots: the head's region starts at ``bh * num_q * width``
    (its forward lists' capacity, which its backward lists' entries never exceed), and each
    key block's entries follow those of the key blocks before it in the head."""
    first = tl.program_id(1) * BLOCK_KV
    before = tl.zeros([BLOCK_KV], dtype=tl.int32)
    c0 = 0
    while c0 < first:  # the head's earlier key blocks, BLOCK_KV at a time
        c = c0 + tl.arange(0, BLOCK_KV)
        before += tl.load(entries_ptr + bh * num_kv + c, mask=c < first, other=0)
        c0 += BLOCK_KV
    mine = tl.load(entries_ptr + bh * num_kv + kv, mask=kv_ok, other=0)
    base = (bh * num_q * width).to(tl.int32) + tl.sum(before, axis=0)
    return base + tl.cumsum(mine, axis=0) - mine


@triton.jit
def _rank_selected(
    selected_ptr,  # [BH, NQ, NKV] uint8 (int16 with SLOTS)
    valid_ptr,  # [NKV] valid tokens per key block
    q_idx_ptr,  # out [BH, NKV, NQ * Q_SPLIT] int32
    full_cnt_ptr,  # out [BH, NKV] int32
    mask_cnt_ptr,  # out [BH, NKV] int32
    entries_ptr,  # with SLOTS [BH, NKV] int32: each key block's forward entries (the marks')
    starts_ptr,  # out with SLOTS [BH, NKV] int32: each key block's first dS slot
    slots_ptr,  # out with SLOTS [BH, NQ, W] int32: each forward entry's dS slot, -1 if none
    num_q,
    num_kv,
    kv_tile,
    rotate_sms,
    width,
    Q_SPLIT: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    SLOTS: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1) * BLOCK_KV + tl.arange(0, BLOCK_KV)
    kv_ok = kv < num_kv
    valid = tl.load(valid_ptr + kv, mask=kv_ok, other=0)
    if SLOTS:
        first_slot = _first_slots(entries_ptr, bh, kv, kv_ok, num_q, num_kv, width, BLOCK_KV)
        tl.store(starts_ptr + bh * num_kv + kv, first_slot, mask=kv_ok)
    out_width = num_q * Q_SPLIT
    out_rows = q_idx_ptr + (bh * num_kv + kv) * out_width  # [BLOCK_KV] row starts
    # Rotation (rotate_sms > 0, Q_SPLIT 1): a first pass counts each list and its entries
    # below the start, so the second pass can store entry r at (r - below) mod total.
    total = tl.zeros([BLOCK_KV], dtype=tl.int32)
    below = tl.zeros([BLOCK_KV], dtype=tl.int32)
    if rotate_sms > 0:
        order = bh * num_kv + kv
        start = ((order * num_q) // rotate_sms) % num_q
        q0 = 0
        while q0 < num_q:
            q, _, hit = _hits(selected_ptr, bh, q0, kv, kv_ok, num_q, num_kv, BLOCK_Q)
            total += tl.sum(hit, axis=0)
            below += tl.sum(tl.where(q[:, None] < start[None, :], hit, 0), axis=0)
            q0 += BLOCK_Q
    offset = tl.zeros([BLOCK_KV], dtype=tl.int32)
    q0 = 0
    while q0 < num_q:
        q, mark, hit = _hits(selected_ptr, bh, q0, kv, kv_ok, num_q, num_kv, BLOCK_Q)
        rank = tl.cumsum(hit, axis=0)  # inclusive, per key block, in query order
        place = offset[None, :] + rank - 1 - below[None, :]
        place = tl.where(place < 0, place + total[None, :], place)
        slot = place * Q_SPLIT
        for s in tl.static_range(Q_SPLIT):
            tl.store(out_rows[None, :] + slot + s, q[:, None] * Q_SPLIT + s, mask=hit > 0)
        if SLOTS:  # a key block with no valid token is walked by no kernel: no slot
            entry = (bh * num_q + q[:, None]) * width + mark - 1
            slot = tl.where(valid[None, :] > 0, first_slot[None, :] + place, -1)
            tl.store(slots_ptr + entry, slot, mask=hit > 0)
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
    rotate_sms: int = 0,
) -> SparseLists:
    """`vsa_fa4.metadata.backward_lists` in two launches and a memset (same tensors, same
    values)."""
    return _build(kv_indices, kv_counts, kv_valid_sizes, kv_tile, masked, q_split, rotate_sms)[0]


class DsSlots(NamedTuple):
    """Where the dS-writing backward's tiles go (`backward_lists_with_slots`)."""

    lists: SparseLists
    """The key-owned lists the kernel walks."""
    starts: torch.Tensor
    """Each key block's first slot [B, H, NKV] int32 (the kernel's aux tensor): step ``u`` of
    key block ``n``'s list writes slot ``starts[b, h, n] + u``."""
    slots: torch.Tensor
    """Each used forward entry's slot [B, H, NQ, W] int32, -1 where its key block has no valid
    token (no kernel walks it); entries past a list's count are left unwritten."""


def backward_lists_with_slots(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    kv_tile: int,
    masked: bool = True,
    rotate_sms: int = 0,
) -> DsSlots:
    """`backward_lists_triton` (one query block per list entry) with the dS slots of the
    dS-writing backward (`vsa_fa4.dq_from_ds_triton`), in the same two launches and memset:
    (batch x head) ``r``'s slots lie in ``[r * NQ * W, (r + 1) * NQ * W)`` (its forward lists'
    capacity), each key block's after those of the key blocks before it (the marking pass
    counts every key block's entries), in its backward list's order (after the rotation). A
    dS buffer of ``B * H * NQ * W`` tiles holds every slot."""
    if kv_indices.shape[-1] >= 1 << 15:  # the marks are int16
        raise ValueError(f"kv_indices lists must be shorter than 32768, got {kv_indices.shape}")
    lists, placed = _build(
        kv_indices, kv_counts, kv_valid_sizes, kv_tile, masked, 1, rotate_sms, slots=True
    )
    assert placed is not None
    return DsSlots(lists, *placed)


def _build(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    kv_tile: int,
    masked: bool,
    q_split: int,
    rotate_sms: int,
    slots: bool = False,
) -> tuple[SparseLists, tuple[torch.Tensor, torch.Tensor] | None]:
    *lead, num_q, width = kv_indices.shape
    num_kv = kv_valid_sizes.shape[0]
    rows = math.prod(lead)
    device = kv_indices.device
    q_indices = torch.empty(*lead, num_kv, num_q * q_split, dtype=torch.int32, device=device)
    full_cnt = torch.empty(*lead, num_kv, dtype=torch.int32, device=device)
    mask_cnt = torch.empty_like(full_cnt)
    placed = entries = None
    if slots:
        placed = torch.empty_like(full_cnt), torch.empty_like(kv_indices, dtype=torch.int32)
    if rows and num_kv and num_q:
        selected, entries = _zeroed_marks(rows, num_q, num_kv, slots, device)
        if width:
            launch(
                _mark_selected,
                (rows, -(-num_q // BLOCK_Q)),
                kv_indices.contiguous(),
                kv_counts.contiguous(),
                selected,
                full_cnt if entries is None else entries,  # not written without slots
                num_q,
                num_kv,
                width,
                BLOCK_Q=BLOCK_Q,
                BLOCK_W=BLOCK_W,
                SLOTS=slots,
            )
        launch(
            _rank_selected,
            (rows, -(-num_kv // BLOCK_KV)),
            selected,
            kv_valid_sizes.contiguous(),
            q_indices,
            full_cnt,
            mask_cnt,
            *((full_cnt,) * 3 if placed is None else (entries, *placed)),  # slots' only
            num_q,
            num_kv,
            kv_tile,
            rotate_sms,
            width,
            Q_SPLIT=q_split,
            MASKED=masked,
            BLOCK_Q=BLOCK_Q,
            BLOCK_KV=BLOCK_KV,
            SLOTS=slots,
        )
    else:
        full_cnt.zero_()
        mask_cnt.zero_()
        if placed is not None:
            placed[0].zero_()
    if not masked:
        return SparseLists(mask_cnt, mask_cnt.unsqueeze(-1), full_cnt, q_indices), placed
    return SparseLists(mask_cnt, q_indices, full_cnt, q_indices), placed


def _zeroed_marks(
    rows: int, num_q: int, num_kv: int, slots: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The zeroed byte map [rows, NQ, NKV] (int16 with ``slots``, else uint8) and, with
    ``slots``, the zeroed entry counts [rows * NKV] int32: one allocation and one memset."""
    if not slots:
        return torch.zeros(rows, num_q, num_kv, dtype=torch.uint8, device=device), None
    counts = rows * num_kv
    zeroed = torch.zeros(2 * counts + rows * num_q * num_kv, dtype=torch.int16, device=device)
    return zeroed[2 * counts :].view(rows, num_q, num_kv), zeroed[: 2 * counts].view(torch.int32)

"""The paired-key forward's lists in one Triton launch (the GPU path of
`vsa_fa4.metadata.paired_forward_lists`; the tensor-op definition is the fork's
`flash_attn_vsa.fwd_sm90_paired.pair_lists`).

Why a kernel: `pair_lists` is about 40 small tensor ops (61 aten calls) per forward, each a
launch of a few microseconds on the device; on an H200 (2026-11-30, ``bench_vsa.py --pacing
dense``) the 128x64 forward op ran 1.23 ms where its kernel alone runs ~1.15 ms (S=32768,
H=12, 90% sparse): the lists were most of the difference. One launch replaces them.

`_pair_rows`, one program per ``BLOCK_R`` rows of 64-token lists (full and partial classes
apart): output slot ``j`` of the full list is ``full[2j] | full[2j + 1] << 16`` while
``j < full_cnt // 2``, else 0; slot ``j`` of the mask list is the partial class's pair ``j``
(its second id `NO_BLOCK` past an odd count) while ``j < ceil(part_cnt / 2)``, then, when the
full class is odd, its last block paired with `NO_BLOCK`, then 0. Counts: ``full_cnt // 2``
and ``ceil(part_cnt / 2) + full_cnt % 2``. The same tensors as `pair_lists`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vsa_fa4.lists import empty_lists
from vsa_triton.launch_cache import launch

BLOCK_R = 16
BLOCK_P = 32


@triton.jit
def _pair_rows(
    full_idx_ptr,  # [R, WF] full key blocks per row, in list order
    full_cnt_ptr,  # [R]
    part_idx_ptr,  # [R, WP] partial key blocks per row
    part_cnt_ptr,  # [R]
    out_full_ptr,  # out [R, FULL_KEEP] int32 packed pairs
    out_mask_ptr,  # out [R, MASK_KEEP] int32 packed pairs
    out_full_cnt_ptr,  # out [R] int32
    out_mask_cnt_ptr,  # out [R] int32
    num_rows,
    full_width,
    part_width,
    full_keep,
    mask_keep,
    NO_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    rows = r.to(tl.int64)
    n_full = tl.load(full_cnt_ptr + rows, mask=r_ok, other=0).to(tl.int32)
    n_part = tl.load(part_cnt_ptr + rows, mask=r_ok, other=0).to(tl.int32)
    full_pairs = n_full // 2
    odd = (n_full % 2) == 1
    part_pairs = (n_part + 1) // 2
    # an odd full class's last block, paired with NO_BLOCK (it goes to the mask list)
    tail_at = tl.maximum(n_full - 1, 0)
    tail = tl.load(full_idx_ptr + rows * full_width + tail_at, mask=r_ok & odd, other=0)
    tail = tail.to(tl.int32) | (NO_BLOCK << 16)
    j0 = 0
    while j0 < full_keep:
        j = j0 + tl.arange(0, BLOCK_P)
        live = r_ok[:, None] & (j[None, :] < full_pairs[:, None])
        at = rows[:, None] * full_width + 2 * j[None, :]
        lo = tl.load(full_idx_ptr + at, mask=live, other=0).to(tl.int32)
        hi = tl.load(full_idx_ptr + at + 1, mask=live, other=0).to(tl.int32)
        out = tl.where(live, lo | (hi << 16), 0)
        inside = r_ok[:, None] & (j[None, :] < full_keep)
        tl.store(out_full_ptr + rows[:, None] * full_keep + j[None, :], out, mask=inside)
        j0 += BLOCK_P
    j0 = 0
    while j0 < mask_keep:
        j = j0 + tl.arange(0, BLOCK_P)
        live = r_ok[:, None] & (j[None, :] < part_pairs[:, None])
        at = rows[:, None] * part_width + 2 * j[None, :]
        lo = tl.load(part_idx_ptr + at, mask=live, other=0).to(tl.int32)
        second = live & (2 * j[None, :] + 1 < n_part[:, None])
        hi = tl.load(part_idx_ptr + at + 1, mask=second, other=NO_BLOCK).to(tl.int32)
        at_tail = (j[None, :] == part_pairs[:, None]) & odd[:, None]
        out = tl.where(live, lo | (hi << 16), tl.where(at_tail, tail[:, None], 0))
        inside = r_ok[:, None] & (j[None, :] < mask_keep)
        tl.store(out_mask_ptr + rows[:, None] * mask_keep + j[None, :], out, mask=inside)
        j0 += BLOCK_P
    tl.store(out_full_cnt_ptr + rows, full_pairs, mask=r_ok)
    tl.store(out_mask_cnt_ptr + rows, part_pairs + odd.to(tl.int32), mask=r_ok)


def pair_lists_triton(
    full_idx: torch.Tensor,
    full_cnt: torch.Tensor,
    part_idx: torch.Tensor,
    part_cnt: torch.Tensor,
    num_kv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flash_attn_vsa.fwd_sm90_paired.pair_lists` in one launch: the same four tensors
    ``(mask_cnt, mask_idx, full_cnt, full_idx)``, the same refusals."""
    from flash_attn_vsa.fwd_sm90_paired import NO_BLOCK, check_pairable, paired_widths

    check_pairable(full_idx.shape[-1], num_kv)
    full_keep, mask_keep = paired_widths(full_idx.shape[-1], part_idx.shape[-1], num_kv)
    out = empty_lists(full_cnt.shape, full_keep, mask_keep, full_idx.device)
    out_mask_cnt, out_mask, out_full_cnt, out_full = out
    num_rows = out_full_cnt.numel()
    if num_rows:
        launch(
            _pair_rows,
            (-(-num_rows // BLOCK_R),),
            full_idx.contiguous(),
            full_cnt.contiguous(),
            part_idx.contiguous(),
            part_cnt.contiguous(),
            out_full,
            out_mask,
            out_full_cnt,
            out_mask_cnt,
            num_rows,
            full_idx.shape[-1],
            part_idx.shape[-1],
            full_keep,
            mask_keep,
            NO_BLOCK=NO_BLOCK,
            BLOCK_R=BLOCK_R,
            BLOCK_P=BLOCK_P,
        )
    return tuple(out)

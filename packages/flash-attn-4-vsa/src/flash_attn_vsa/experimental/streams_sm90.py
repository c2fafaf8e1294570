"""The body of the two-stream forward (delta 6, experimental; `fwd_sm90_streams` beside it):
its packed lists (`stream_lists`), its mask (`stream_mask_mod`, `mask_class`) and the kernel
class (`_streams_class`, the paired-key producer's with each MMA warpgroup on its own half of
every stage).

Below `flash_attn_vsa.fwd_sm90` (whose `ForwardKernel` builds these classes), above
`flash_attn_vsa.paired_sm90` and `flash_attn_vsa.sm90_operands`. The entry points
(`block_sparse_forward_streams`, `kernel_class`) and the delta's description
are in `fwd_sm90_streams`, which re-exports this module's names.
"""

from __future__ import annotations

import functools
from typing import Any

from flash_attn_vsa import sm90_operands
from flash_attn_vsa.paired_sm90 import HEAD_DIM, KEY_BLOCK, NO_BLOCK

__all__ = [
    "BLOCK_SIZE",
    "HEAD_DIM",
    "KEY_BLOCK",
    "NO_BLOCK",
    "mask_class",
    "stream_lists",
    "stream_mask_mod",
]

BLOCK_SIZE = (128, KEY_BLOCK)
"""The block size FA4 sees: 128-row tiles (two 64-row query blocks), 64-key columns."""
STREAM_MASK_ATTR = "vsa_stream_mask_key_block"


# ---- lists ----------------------------------------------------------------------------------
def stream_lists(
    full_idx: Any, full_cnt: Any, part_idx: Any, part_cnt: Any
) -> tuple[Any, Any, Any, Any]:
    """FA4's four list tensors ``(mask_cnt, mask_idx, full_cnt, full_idx)`` of 128-row tiles
    ([..., NQ / 2, W] int32 packed entries), from 64-row query blocks' forward lists already
    split into full and partial key blocks ([..., NQ, W] indices, [..., NQ] counts, empty blocks
    dropped: vsa-fa4's ``forward_lists``; NQ even). Tensor ops only, no host sync.

    Per tile, block ``2t``'s list gives the low ids and ``2t + 1``'s the high ids: first their
    full blocks side by side while both have one (the full list), then, side by side, each
    one's remaining full blocks followed by its partial blocks, `NO_BLOCK` past the shorter
    (the partial list). Every selected block appears once, on its own side."""
    import torch

    if full_idx.shape[-2] % 2:
        raise ValueError(
            f"the number of 64-row query blocks must be even, got {full_idx.shape[-2]}"
        )
    width = full_idx.shape[-1]
    full_idx, part_idx = full_idx.to(torch.int32), part_idx.to(torch.int32)
    full_cnt, part_cnt = full_cnt.to(torch.int32), part_cnt.to(torch.int32)
    low_full, high_full = full_idx[..., 0::2, :], full_idx[..., 1::2, :]
    low_cnt, high_cnt = full_cnt[..., 0::2], full_cnt[..., 1::2]
    both = torch.minimum(low_cnt, high_cnt)
    slots = torch.arange(width, device=full_idx.device, dtype=torch.int32)
    side_by_side = slots < both.unsqueeze(-1)
    full = torch.where(side_by_side, low_full | (high_full << 16), 0)
    low_rest, low_n = _rest(low_full, low_cnt, part_idx[..., 0::2, :], part_cnt[..., 0::2], both)
    high_rest, high_n = _rest(
        high_full, high_cnt, part_idx[..., 1::2, :], part_cnt[..., 1::2], both
    )
    mask_cnt = torch.maximum(low_n, high_n)
    mask = torch.where(slots < mask_cnt.unsqueeze(-1), low_rest | (high_rest << 16), 0)
    return mask_cnt.contiguous(), mask.contiguous(), both.contiguous(), full.contiguous()


def _rest(full_idx: Any, full_cnt: Any, part_idx: Any, part_cnt: Any, skip: Any) -> Any:
    """One side's list past its first ``skip`` full blocks: the remaining full blocks, then
    the partial ones, then `NO_BLOCK` ([..., W], W the full list's width), and its length. A
    list holds at most W blocks in all, so W slots hold the rest."""
    import torch

    # the partial list may be narrower than the full one (vsa-fa4's lists of a layout without
    # partial blocks keep one unused partial slot), so each is read within its own width
    width, part_width = full_idx.shape[-1], part_idx.shape[-1]
    slot = torch.arange(width, device=full_idx.device, dtype=torch.int32)
    left = (full_cnt - skip).unsqueeze(-1)
    from_full = torch.gather(full_idx, -1, (slot + skip.unsqueeze(-1)).clamp(max=width - 1).long())
    part_slot = slot - left
    from_part = torch.gather(part_idx, -1, part_slot.clamp(0, part_width - 1).long())
    rest = torch.where(
        slot < left,
        from_full,
        torch.where(part_slot < part_cnt.unsqueeze(-1), from_part, NO_BLOCK),
    )
    return rest, left.squeeze(-1) + part_cnt


# ---- the mask -------------------------------------------------------------------------------
@functools.cache
def stream_mask_mod() -> Any:
    """The mask_mod of the partial list (valid sizes as ``aux_tensors[0]``). Only `mask_class`
    applies it (it needs the packed entry and the warpgroup, which a per-score mask_mod does
    not see); tracing its body anywhere else raises."""
    from flash_attn_vsa.paired_sm90 import marked_mask_mod

    return marked_mask_mod(
        "flash_attn_vsa.experimental.fwd_sm90_streams", "stream_mask_mod", STREAM_MASK_ATTR
    )


@functools.cache
def mask_class() -> type:
    """The ``AttentionMask`` of the streams kernel (`fwd_sm90_paired.packed_entry_mask_base`):
    `stream_mask_mod` keeps, per row, the columns below the valid size of the row's own block
    (the low id for the tile's rows 0-63, the high id for 64-127)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.mask import mask_r2p_lambda, r2p_bitmask_below, sm90_col_to_r2p_idx

    from flash_attn_vsa.paired_sm90 import packed_entry_mask_base

    class TwoStreamMask(packed_entry_mask_base()):
        what, marker, mask_mod_name = "two streams", STREAM_MASK_ATTR, "stream_mask_mod()"

        @cute.jit
        def limit_columns(
            self, acc_mn: cute.Tensor, n_block: cutlass.Int32, mine: Any, valid: cute.Tensor
        ) -> None:
            block = n_block & 0xFFFF
            if mine[0] >= KEY_BLOCK:  # the tile's second 64 rows: the high id
                block = n_block >> 16
            limit = cutlass.Int32(0)
            if block != NO_BLOCK:
                limit = valid[block]
            below = sm90_col_to_r2p_idx(limit - mine[1])
            mask_r2p_lambda(acc_mn, lambda s: r2p_bitmask_below(below, s))

    return TwoStreamMask


# ---- the kernel -----------------------------------------------------------------------------
def _own_half(thr_mma: Any, shape_mnk: Any, sA: Any, sB: Any) -> tuple[Any, Any]:
    """Partition hook: QK^T's B (key stages of 2 x 64 rows) and PV's B (transposed value
    stages, 2 x 64 keys) narrowed to this warpgroup's half; other calls unchanged."""
    import cutlass.cute as cute

    _, n, k = shape_mnk
    if cute.size(sB, mode=[0]) == 2 * n:  # QK^T: (keys, head dim, stages)
        halves = cute.flat_divide(sB, (n, cute.size(sB, mode=[1])))  # (n, D, 2, 1, stages)
        first, second_origin = halves[None, None, 0, 0, None], (0, 0, 1, 0, 0)
    elif cute.size(sB, mode=[1]) == 2 * k:  # PV: (head dim, keys, stages)
        halves = cute.flat_divide(sB, (cute.size(sB, mode=[0]), k))  # (D, k, 1, 2, stages)
        first, second_origin = halves[None, None, 0, 0, None], (0, 0, 0, 1, 0)
    else:
        return sA, sB
    # The consumer warpgroups follow the producer's (warpgroup 0): the tile's rows 0-63 are
    # warpgroup 1's. Same layout for both halves; the second starts a fixed distance on.
    warpgroup = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128) - 1
    step = cute.crd2idx(second_origin, halves.layout)
    return sA, cute.make_tensor(first.iterator + warpgroup * step, first.layout)


@functools.cache
def _streams_class() -> type:
    from flash_attn_vsa.paired_sm90 import _paired_class

    base = _paired_class()

    class FlashAttentionForwardSm90TwoStreams(base):
        """128x64 tiles; warpgroup 0 walks the first 64-row block's list, warpgroup 1 the
        second's, from one producer."""

        def _setup_attributes(self) -> None:
            if self.num_wg_mma != 2 or self.tile_n != KEY_BLOCK or self.tile_hdim != HEAD_DIM:
                raise ValueError(
                    "two streams need 128x64 tiles with two MMA warpgroups at head dim "
                    f"{HEAD_DIM}, got {self.tile_m}x{self.tile_n}, {self.num_wg_mma} "
                    f"warpgroups, head dim {self.tile_hdim}"
                )
            super()._setup_attributes()

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            with sm90_operands.partition_hooks(before=_own_half):
                return base.mma(self, *args, **kwargs)

    return FlashAttentionForwardSm90TwoStreams

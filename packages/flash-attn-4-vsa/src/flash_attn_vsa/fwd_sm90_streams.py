"""Two query streams per CTA on Hopper (sm_90): the 64x64 block-sparse forward with any key list
per 64-row query block, run as 128-row tiles whose two MMA warpgroups each walk their own
block's list. The fork's sixth delta (experimental: its GPU tests pass on an H200, which
measured it at 0.69-0.76 of dense against the two-CTA kernel's 0.79, session 8; vsa-fa4 runs it
only inside ``forward_variant(ForwardVariant(two_streams=True))``).

Why: the two-CTA kernel (delta 2) gives an SM two MMA warpgroups but nothing makes them take
turns, and each CTA lands its own keys; upstream's 128-row tiles (dense, and the paired-key
kernel at 0.90-0.95 of dense) run two warpgroups in one CTA that alternate through upstream's
warp-scheduler barriers, one's softmax under the other's MMAs, fed by one producer. Those
tiles need one key list per 128 query rows; VSA gives each 64-row query block its own. Here
the two 64-row blocks of a tile keep their own lists:

- **lists** (`stream_lists`): the 64-row query blocks ``2t`` and ``2t + 1`` form tile ``t``;
  entry ``i`` packs ``a``, the ``i``-th block of ``2t``'s list, and ``b``, the ``i``-th of
  ``2t + 1``'s, as ``a | b << 16`` (`NO_BLOCK` past the shorter list's end). Entries whose two
  blocks are full make FA4's full list; the rest (a partial block, `NO_BLOCK`) its partial
  list, masked by `stream_mask_mod()`;
- **producer**: the paired-key producer (`fwd_sm90_paired`, delta 4) loads each entry's ``a``
  into rows 0-63 and ``b`` into rows 64-127 of one key/value stage; the staged layouts are
  built with twice the tile's 64 rows (`sm90_operands.staged_rows_hook`);
- **consumer**: upstream's 128x64 consumer, except that each warpgroup partitions its own half
  of every stage (`sm90_operands.partition_hooks`), so warpgroup 0 (the tile's rows 0-63)
  multiplies against ``a`` and warpgroup 1 against ``b``;
- **mask**: on partial-list entries each warpgroup keeps the columns below its own block's
  valid size, none for `NO_BLOCK` (`mask_class()`); FA4's sequence-length mask, which would
  read a packed entry as a tile index, does not run.

A tile steps through ``max(len(a-list), len(b-list))`` entries; VSA's top-k gives the two
lists the same length except where key blocks are empty, so little is wasted.

Upstream internals this relies on (fingerprinted): those of `fwd_sm90_paired` and
`sm90_operands`, upstream's 128x64 forward tile for head dim 128 (``_tile_size_fwd_sm90``,
two MMA warpgroups), ``mma``'s operand partitions (QK^T: B = the key stage, rows first; PV:
B = the transposed value stage), and the consumer warpgroups following the producer's.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from flash_attn_vsa import sm90_operands
from flash_attn_vsa.fwd_sm90 import TWO_STREAMS, ForwardKernel, forward_scope
from flash_attn_vsa.fwd_sm90_paired import HEAD_DIM, KEY_BLOCK, NO_BLOCK

__all__ = [
    "BLOCK_SIZE",
    "HEAD_DIM",
    "KEY_BLOCK",
    "NO_BLOCK",
    "block_sparse_forward_streams",
    "kernel_class",
    "mask_class",
    "stream_lists",
    "stream_mask_mod",
    "streams_scope",
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
    from flash_attn_vsa.fwd_sm90_paired import marked_mask_mod

    return marked_mask_mod("flash_attn_vsa.fwd_sm90_streams", "stream_mask_mod", STREAM_MASK_ATTR)


@functools.cache
def mask_class() -> type:
    """The ``AttentionMask`` of the streams kernel (`fwd_sm90_paired.packed_entry_mask_base`):
    `stream_mask_mod` keeps, per row, the columns below the valid size of the row's own block
    (the low id for the tile's rows 0-63, the high id for 64-127)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.mask import mask_r2p_lambda, r2p_bitmask_below, sm90_col_to_r2p_idx

    from flash_attn_vsa.fwd_sm90_paired import packed_entry_mask_base

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


def kernel_class(q_in_registers: bool = False, persistent: bool | int = False) -> type:
    """The paired-key producer's class with each MMA warpgroup on its own half of every
    stage; with ``q_in_registers`` QK^T reads Q from registers (delta 5), with ``persistent``
    its CTAs walk the tiles (delta 7)."""
    return ForwardKernel(TWO_STREAMS, q_in_registers, persistent).kernel_class()


@functools.cache
def _streams_class() -> type:
    from flash_attn_vsa.fwd_sm90_paired import _paired_class

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


def streams_scope(
    q_in_registers: bool = False, persistent: bool | int = False
) -> contextlib.AbstractContextManager[None]:
    """Within this block, on this thread, upstream's ``_flash_attn_fwd`` compiles and runs
    ``kernel_class(q_in_registers, persistent)`` with key/value stages of two 64-token blocks
    and 64 x 64 K/V boxes (from a compile cache of its own)."""
    return forward_scope(ForwardKernel(TWO_STREAMS, q_in_registers, persistent))


def block_sparse_forward_streams(
    q: Any,
    k: Any,
    v: Any,
    block_sparse_tensors: Any,
    kv_valid_sizes: Any,
    *,
    softmax_scale: float,
    out: Any = None,
    lse: Any = None,
    q_in_registers: bool = False,
    persistent: bool | int = False,
) -> tuple[Any, Any]:
    """Block-sparse attention forward on sm_90 for 64-row query blocks with their own lists of
    64-token key blocks, two blocks per 128-row tile. ``block_sparse_tensors``: FA4
    ``BlockSparseTensorsTorch`` with `BLOCK_SIZE` whose lists are `stream_lists`' packed
    entries; ``kv_valid_sizes``: [S / 64] int32 real tokens per key block. BSHD ``q, k, v``
    (fp16/bf16, head dim `HEAD_DIM`, sequence lengths multiples of 128 and 64). Returns
    ``(out, lse)``; rows that see no key get out 0 and lse -inf. ``q_in_registers`` (delta
    5) and ``persistent`` (delta 7) as for the paired-key forward."""
    from flash_attn_vsa.fwd_sm90_paired import two_block_stage_forward

    return two_block_stage_forward(
        q, k, v, block_sparse_tensors, kv_valid_sizes, BLOCK_SIZE, "two streams",
        stream_mask_mod(), streams_scope(q_in_registers, persistent),
        softmax_scale=softmax_scale, out=out, lse=lse,
    )  # fmt: skip

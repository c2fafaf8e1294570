"""Partial key blocks as a per-block column limit on Hopper (sm_90): the fork's third delta.

A VSA key block is *partial* when only its first ``valid`` tokens are real (tile order puts a
tile's real tokens first, then padding). Upstream FA4 (4.0.0b36) masks such blocks through a
FlexAttention ``mask_mod``: on every block of a partial list, ``AttentionMask.apply_mask``
calls it once per accumulator element (32 calls per thread on a 64x64 tile), each with its own
index arithmetic and, in ours, a global load of the block's valid size. Measured on an H200 with
a quarter of the key blocks partial (``bench_vsa.py --partial-blocks 0.25``, 2026-11-29) the
KV64 backward fell from 0.71 to 0.61 of dense, i.e. a masked block cost ~1.7 unmasked ones;
at Wan 720p (24% partial tiles) the forward ran at 0.71 of dense instead of 0.85.

What such a mask keeps is simpler than a general mask_mod: the columns of one key block below
its valid size, the same shape as upstream's cheap sequence-length mask (a column limit applied
with one ``R2P`` bitmask per 32 columns). This delta applies it that way: one load of the
block's valid size per tile and thread, then the column-limit code.

- `valid_size_mask_mod(kv_tile)` is the mask_mod vsa-fa4 passes for partial key blocks (with
  the valid sizes as ``aux_tensors[0]``). It is a complete mask_mod, correct on its own, and it
  carries a marker (``KV_TILE_ATTR``) that says what it computes.
- `mask_class()` is a subclass of upstream's ``AttentionMask`` whose ``apply_mask`` sees that
  marker and applies the column limit instead of calling the mask_mod per element; every other
  call (no mask_mod, other mask_mods, causal or local masks, packed GQA) goes to upstream's.
- `install()` makes upstream's sm_90 forward and backward kernels build that subclass (they
  look ``AttentionMask`` up as a module global of ``flash_fwd_sm90`` / ``flash_bwd_sm90`` when
  they trace). Once per process; what it changes is only the handling of our marked mask_mod,
  so it is not scoped. `valid_size_mask_mod` installs it, so no kernel is ever traced with the
  marked mask_mod but without the subclass; the mask_mod's compile-cache hash
  (``__cute_hash__``) names this delta, so no cache holds a kernel traced otherwise.

Upstream internals this relies on (fingerprinted in ``upstream_api.json``): the
``AttentionMask`` dataclass and its ``apply_mask`` signature, the module globals
``flash_fwd_sm90.AttentionMask`` and ``flash_bwd_sm90.AttentionMask``, the block-sparse loops
passing ``mask_mod`` and ``aux_data`` to ``apply_mask`` for partial blocks only, and the R2P
helpers ``sm90_col_to_r2p_idx``, ``r2p_bitmask_below`` and ``mask_r2p_lambda``.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = [
    "KV_TILE_ATTR",
    "VALID_IN_LIST_ATTR",
    "install",
    "mask_class",
    "valid_in_list_mask_mod",
    "valid_size_mask_mod",
]

KV_TILE_ATTR = "vsa_valid_size_kv_tile"
"""Attribute of `valid_size_mask_mod`'s functions: the key tile whose valid sizes they read."""


def _log2_tile(kv_tile: int) -> int:
    if isinstance(kv_tile, bool) or not isinstance(kv_tile, int):
        raise ValueError(f"kv_tile must be a power of two, got {kv_tile!r}")
    if kv_tile <= 0 or kv_tile & (kv_tile - 1):
        raise ValueError(f"kv_tile must be a power of two, got {kv_tile}")
    return kv_tile.bit_length() - 1


@functools.cache
def valid_size_mask_mod(kv_tile: int) -> Any:
    """The mask_mod for ``kv_tile``-token key blocks whose valid sizes ([NKV] int32) come as
    ``aux_tensors[0]``: it keeps key ``kv_idx`` when its offset in its block is below the
    block's valid size. One function object per tile size (FA4 caches compiled kernels by it).

    Block arithmetic by shifts, not ``//`` and ``*``: key indices are never negative, so the
    two agree, but a signed division costs registers (compiled for sm_90a, the KV64 backward
    spilled 120 B of stack with ``//`` and none with shifts; it now runs `mask_class`'s column
    limit anyway, and this body is what any other caller of the mask_mod gets)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.utils import scalar_to_ssa

    log2_tile = _log2_tile(kv_tile)

    @cute.jit
    def keep_valid_keys(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        valid_sizes = aux_tensors[0]
        block = kv_idx[0] >> log2_tile
        end = (block << log2_tile) + valid_sizes[block]
        return kv_idx < scalar_to_ssa(end, cutlass.Int32)

    setattr(keep_valid_keys, KV_TILE_ATTR, kv_tile)
    keep_valid_keys.__cute_hash__ = f"flash_attn_vsa.mask_sm90.valid_size_mask_mod/{kv_tile}/v1"
    install()
    return keep_valid_keys


VALID_IN_LIST_ATTR = "vsa_valid_size_in_list"
"""Attribute of `valid_in_list_mask_mod`'s functions: the partial list's entries carry each key
block's valid size (``block | valid << 16``, `flash_attn_vsa.valid_in_list_sm90`)."""


@functools.cache
def valid_in_list_mask_mod(kv_tile: int) -> Any:
    """The marker mask_mod of a forward whose partial-list entries carry their key block's
    valid size (`flash_attn_vsa.valid_in_list_sm90`): the column limit then takes
    the size from the entry the consumer read at the top of the step instead of loading it
    after the step's QK^T (experiment 18: with that load, ptxas made each masked step wait for
    the previous step's P V product too). It has no per-element meaning (a column index does
    not say which entry it came from): only `mask_class`'s column limit applies it, and
    tracing it anywhere else fails."""
    import cutlass.cute as cute

    _log2_tile(kv_tile)

    @cute.jit
    def valid_size_from_entry(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        raise ValueError(
            "valid_in_list_mask_mod is applied only by flash_attn_vsa.mask_sm90's column limit "
            "in the fork's sm_90 forward built with valid sizes in its lists"
        )

    setattr(valid_size_from_entry, KV_TILE_ATTR, kv_tile)
    setattr(valid_size_from_entry, VALID_IN_LIST_ATTR, True)
    valid_size_from_entry.__cute_hash__ = f"flash_attn_vsa.mask_sm90.valid_in_list/{kv_tile}/v1"
    install()
    return valid_size_from_entry


@functools.cache
def mask_class() -> type:
    """Upstream's ``AttentionMask`` with the column-limit path for `valid_size_mask_mod`."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr
    from flash_attn.cute.mask import (
        AttentionMask,
        mask_r2p_lambda,
        r2p_bitmask_below,
        sm90_col_to_r2p_idx,
    )
    from flash_attn.cute.utils import AuxData
    from quack import layout_utils

    class ValidSizeMask(AttentionMask):
        def apply_mask(
            self,
            acc_S,
            batch_idx,
            head_idx,
            m_block,
            n_block,
            thr_mma,
            mask_seqlen,
            mask_causal,
            mask_local=False,
            mask_mod=None,
            aux_data=AuxData(),  # noqa: B008 (upstream's default, an immutable NamedTuple)
            fastdiv_mods=(None, None),
        ):
            # Decided while tracing (compile-time values): one of our masks, else upstream's.
            if self.own_mask(acc_S, n_block, thr_mma, mask_causal, mask_local, mask_mod, aux_data):
                return None
            return super().apply_mask(
                acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen,
                mask_causal, mask_local, mask_mod, aux_data, fastdiv_mods,
            )  # fmt: skip

        def own_mask(self, acc_S, n_block, thr_mma, mask_causal, mask_local, mask_mod, aux_data):
            """Apply ``mask_mod`` here and return True when it is ours and fits this tile;
            False hands the call to upstream. Subclasses (the paired-key forward's) extend
            it."""
            kv_tile = getattr(mask_mod, KV_TILE_ATTR, None)
            if (
                kv_tile is None
                or mask_causal
                or mask_local
                or kv_tile % self.tile_n  # a tile must lie inside one key block
                or self.qhead_per_kvhead_packgqa != 1
            ):
                return False
            if getattr(mask_mod, VALID_IN_LIST_ATTR, False):  # sizes in the list entries
                from flash_attn_vsa.valid_in_list_sm90 import entry_valid_size

                valid_sizes = entry_valid_size()
            else:
                valid_sizes = aux_data.tensors[0]
            self.keep_valid_columns(acc_S, n_block, thr_mma, valid_sizes, _log2_tile(kv_tile))
            return True

        @cute.jit
        def keep_valid_columns(
            self,
            acc_S: cute.Tensor,
            n_block: cutlass.Int32,
            thr_mma: cute.TiledMma,
            valid_sizes: cute.Tensor,
            log2_kv_tile: cutlass.Constexpr[int],
        ) -> None:
            """Set the scores of key columns at or past the block's valid size (and past
            ``seqlen_k``) to -inf. Column coordinates come from thread 0's partition (known at
            compile time) shifted by this thread's column offset, as upstream's seqlen mask."""
            swap = const_expr(self.swap_AB)
            col = 0 if const_expr(swap) else 1
            acc_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=swap)
            shape = (self.tile_n, self.tile_m) if const_expr(swap) else (self.tile_m, self.tile_n)
            coords = cute.make_identity_tensor(shape)
            mine = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(coords), transpose=swap)
            thread0 = layout_utils.reshape_acc_to_mn(
                thr_mma.get_slice(0).partition_C(coords), transpose=swap
            )
            if n_block < 0:  # upstream's convention for rows with no key block
                n_block = 0
            tile_start = n_block * self.tile_n
            block = tile_start >> log2_kv_tile
            end = (block << log2_kv_tile) + valid_sizes[block]
            if end > self.seqlen_k:
                end = self.seqlen_k
            limit = end - tile_start - mine[0][col]
            if const_expr(not swap):
                r2p_limit = sm90_col_to_r2p_idx(limit)
                mask_r2p_lambda(acc_mn, lambda s: r2p_bitmask_below(r2p_limit, s))
            else:
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    dropped = thread0[0, c][col] >= limit
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        acc_mn[r, c] = -Float32.inf if dropped else acc_mn[r, c]

    return ValidSizeMask


@functools.cache
def install() -> None:
    """Once per process: upstream's sm_90 forward and backward kernels trace `mask_class()`
    where they built ``AttentionMask`` (identical for every mask but ours)."""
    import flash_attn.cute.flash_bwd_sm90 as bwd_module
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    for module in (fwd_module, bwd_module):
        module.AttentionMask = mask_class()

"""The body of the paired-key forward (delta 4, `flash_attn_vsa.fwd_sm90_paired`): its packed
lists (`pair_lists`), its mask (`pair_mask_mod`, `mask_class`), the kernel class with its
producer (`_paired_class`) and the patch of upstream's forward module (`_install`), plus the
argument checks and run shared with the two-stream forward (`two_block_stage_forward`).

Below `flash_attn_vsa.fwd_sm90` (whose `ForwardKernel` builds these classes) and above nothing
of the fork but `build_scope`, `mask_sm90` and `sm90_blocks`, so that the forward modules
import each other one way. The entry points (`block_sparse_forward_paired`, `kernel_class`)
and the delta's description are in `fwd_sm90_paired`, which re-exports this module's names.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from flash_attn_vsa.build_scope import current

__all__ = [
    "BLOCK_SIZE",
    "HEAD_DIM",
    "KEY_BLOCK",
    "MAX_KEY_BLOCKS",
    "NO_BLOCK",
    "check_pairable",
    "mask_class",
    "pair_lists",
    "pair_mask_mod",
    "paired_widths",
    "pairing_refusal",
    "two_block_stage_forward",
]

KEY_BLOCK = 64
"""Tokens per key block; two make one 128-key tile."""
BLOCK_SIZE = (128, 2 * KEY_BLOCK)
"""The block size FA4 sees: 128-row query blocks, 128-key (paired) tiles."""
HEAD_DIM = 128
"""The one head dim this delta is written and compiled for (two 64-column halves)."""
NO_BLOCK = 0x7FFF
"""The second id of an odd tail's pair (ids are packed in 16 bits, kept positive): the producer
loads the first block again and the mask drops those columns."""
MAX_KEY_BLOCKS = NO_BLOCK
"""Key blocks per sequence the packing can address (ids below `NO_BLOCK`)."""
PAIR_MASK_ATTR = "vsa_pair_mask_key_block"


# ---- lists ----------------------------------------------------------------------------------
def pair_lists(
    full_idx: Any, full_cnt: Any, part_idx: Any, part_cnt: Any, num_kv: int
) -> tuple[Any, Any, Any, Any]:
    """FA4's four list tensors ``(mask_cnt, mask_idx, full_cnt, full_idx)`` of packed pairs,
    from 64-token forward lists already split into full and partial key blocks ([..., W]
    int32 indices in list order, [...] counts, empty blocks dropped: vsa-fa4's
    ``forward_lists``). Tensor ops only, no host sync.

    Full blocks pair among themselves into the full list; partial blocks pair among themselves
    into the mask list; a class with an odd count leaves a last block paired with `NO_BLOCK`,
    which goes to the mask list (the full class's after the partial pairs). Widths
    ``ceil(W / 2)`` (full) and ``ceil(W / 2) + 1`` (mask), clipped to the ``num_kv / 2``
    128-key tiles FA4 allows, which holds every entry when ``W < num_kv``."""
    import torch

    check_pairable(full_idx.shape[-1], num_kv)
    full_cnt, part_cnt = full_cnt.to(torch.int32), part_cnt.to(torch.int32)
    full_pairs = _packed_pairs(full_idx, full_cnt)
    part_pairs = _packed_pairs(part_idx, part_cnt)
    n_part = (part_cnt + 1) // 2
    last = (full_cnt // 2).clamp(max=full_pairs.shape[-1] - 1)  # the tail's slot when odd
    full_tail = torch.gather(full_pairs, -1, last.long().unsqueeze(-1))
    mask = torch.nn.functional.pad(part_pairs, (0, 1))
    odd = (full_cnt % 2).unsqueeze(-1)
    mask.scatter_(-1, n_part.long().unsqueeze(-1), torch.where(odd > 0, full_tail, 0))
    slots = torch.arange(full_pairs.shape[-1], device=full_pairs.device)
    full = torch.where(slots < (full_cnt // 2).unsqueeze(-1), full_pairs, 0)
    full_keep, mask_keep = paired_widths(full_idx.shape[-1], part_idx.shape[-1], num_kv)
    return (
        (n_part + full_cnt % 2).contiguous(),
        mask[..., :mask_keep].contiguous(),
        (full_cnt // 2).contiguous(),
        full[..., :full_keep].contiguous(),
    )


def pairing_refusal(width: int, num_kv: int) -> str | None:
    """Why lists ``width`` wide over ``num_kv`` key blocks cannot be paired (``num_kv`` even
    and addressable in 16 bits, every list narrower than ``num_kv``), or None if they can."""
    if not 0 < num_kv < MAX_KEY_BLOCKS or num_kv % 2:
        bounds = f"[2, {MAX_KEY_BLOCKS - 1}]"
        return f"num_kv must be even and in {bounds} to pair key blocks, got {num_kv}"
    if width >= num_kv:
        return f"lists must be narrower than num_kv={num_kv} to pair, got {width}"
    return None


def check_pairable(width: int, num_kv: int) -> None:
    """ValueError unless lists ``width`` wide over ``num_kv`` key blocks can be paired
    (`pairing_refusal`)."""
    reason = pairing_refusal(width, num_kv)
    if reason is not None:
        raise ValueError(reason)


def paired_widths(full_width: int, part_width: int, num_kv: int) -> tuple[int, int]:
    """The widths of `pair_lists`' full and mask index tensors for lists ``full_width`` and
    ``part_width`` wide: ``ceil(W / 2)`` pairs (at least one slot) and one more slot for the
    mask list (an odd full class's tail), both clipped to the ``num_kv / 2`` tiles FA4 allows
    (the full list keeps at least one slot)."""
    tiles = num_kv // 2
    full_pairs, part_pairs = max(1, -(-full_width // 2)), max(1, -(-part_width // 2))
    return max(1, min(full_pairs, tiles)), min(part_pairs + 1, tiles)


def _packed_pairs(idx: Any, cnt: Any) -> Any:
    """``idx[2j] | idx[2j+1] << 16`` for the ``ceil(cnt / 2)`` pairs of each row, the second id
    of an odd last pair `NO_BLOCK`, zeros after ([..., max(1, ceil(W / 2))] int32)."""
    import torch

    width = idx.shape[-1]
    extra = width % 2 if width else 2  # an even number of slots, at least one pair
    slots = torch.arange(width + extra, device=idx.device)
    padded = torch.nn.functional.pad(idx.to(torch.int32), (0, extra))
    padded = torch.where(slots < cnt.unsqueeze(-1), padded, NO_BLOCK)
    pairs = padded[..., 0::2] | (padded[..., 1::2] << 16)
    used = torch.arange(pairs.shape[-1], device=idx.device) < ((cnt + 1) // 2).unsqueeze(-1)
    return torch.where(used, pairs, 0).to(torch.int32)


# ---- the mask -------------------------------------------------------------------------------
@functools.cache
def pair_mask_mod() -> Any:
    """The mask_mod of paired tiles (valid sizes as ``aux_tensors[0]``). Only `mask_class`
    applies it (it needs the tile's packed pair, which a per-score mask_mod does not see);
    tracing its body anywhere else raises."""
    return marked_mask_mod("flash_attn_vsa.fwd_sm90_paired", "pair_mask_mod", PAIR_MASK_ATTR)


def marked_mask_mod(module: str, name: str, marker: str) -> Any:
    """A mask_mod that only a `packed_entry_mask_base` mask applies: it carries ``marker``
    (and a compile-cache hash naming ``module.name``), and tracing its body raises."""
    import cutlass.cute as cute

    @cute.jit
    def applied_by_the_kernels_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        raise RuntimeError(
            f"{name} is applied by {module}.mask_class(); it cannot run as a per-score mask_mod"
        )

    setattr(applied_by_the_kernels_mask, marker, KEY_BLOCK)
    applied_by_the_kernels_mask.__cute_hash__ = f"{module}.{name}/v1"
    return applied_by_the_kernels_mask


@functools.cache
def mask_class() -> type:
    """The ``AttentionMask`` of paired kernels (`packed_entry_mask_base`): `pair_mask_mod`
    keeps ``c < valid[a]`` and ``64 <= c < 64 + valid[b]``."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.mask import (
        mask_r2p_lambda,
        r2p_bitmask_above,
        r2p_bitmask_below,
        sm90_col_to_r2p_idx,
    )

    class PairedKeyMask(packed_entry_mask_base()):
        what, marker, mask_mod_name = "paired keys", PAIR_MASK_ATTR, "pair_mask_mod()"

        @cute.jit
        def limit_columns(
            self, acc_mn: cute.Tensor, n_block: cutlass.Int32, mine: Any, valid: cute.Tensor
        ) -> None:
            offset = mine[1]
            first = n_block & 0xFFFF
            second = n_block >> 16
            lookup = second
            if second == NO_BLOCK:
                lookup = first  # any in-range id: its size is not used
            second_end = KEY_BLOCK + valid[lookup]
            if second == NO_BLOCK:
                second_end = KEY_BLOCK
            below_first = sm90_col_to_r2p_idx(valid[first] - offset)
            from_second = sm90_col_to_r2p_idx(KEY_BLOCK - offset)
            below_second = sm90_col_to_r2p_idx(second_end - offset)
            mask_r2p_lambda(
                acc_mn,
                lambda s: (
                    r2p_bitmask_below(below_first, s)
                    | (r2p_bitmask_above(from_second, s) & r2p_bitmask_below(below_second, s))
                ),
            )

    return PairedKeyMask


@functools.cache
def packed_entry_mask_base() -> type:
    """Base ``AttentionMask`` of kernels whose list entries are packed block ids (this delta's
    and the two-stream one's; every call is theirs, decided while tracing). A full entry (no
    mask_mod) is left alone: every column is a real key, and upstream's sequence-length mask,
    which would read the entry as a tile index, must not run. The kernel's marked mask_mod
    (``marker``) runs the subclass's ``limit_columns(acc_mn, n_block, mine, valid)`` on this
    thread's scores as rows x columns, ``mine`` being its first score's (row, column) in the
    tile. Anything else is a ValueError naming the kernel (``what``) and its mask_mod."""
    import cutlass
    import cutlass.cute as cute
    from quack import layout_utils

    from flash_attn_vsa import mask_sm90

    class PackedEntryMask(mask_sm90.mask_class()):
        what = marker = mask_mod_name = ""

        def own_mask(self, acc_S, n_block, thr_mma, mask_causal, mask_local, mask_mod, aux_data):
            if mask_causal or mask_local or self.swap_AB or self.qhead_per_kvhead_packgqa != 1:
                raise ValueError(f"{self.what} support no causal, local, swapped or GQA masks")
            if mask_mod is None:
                return True
            if getattr(mask_mod, self.marker, None) != KEY_BLOCK:
                raise ValueError(f"{self.what} take {self.mask_mod_name} as their only mask_mod")
            self.keep_columns(acc_S, n_block, thr_mma, aux_data.tensors[0])
            return True

        @cute.jit
        def keep_columns(
            self,
            acc_S: cute.Tensor,
            n_block: cutlass.Int32,
            thr_mma: cute.TiledMma,
            valid_sizes: cute.Tensor,
        ) -> None:
            acc_mn = layout_utils.reshape_acc_to_mn(acc_S)
            coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
            mine = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(coords))[0]
            self.limit_columns(acc_mn, n_block, mine, valid_sizes)

    return PackedEntryMask


# ---- the kernel -----------------------------------------------------------------------------
@functools.cache
def _paired_class() -> type:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, pipeline
    from flash_attn.cute.block_sparse_utils import produce_block_sparse_loads
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from quack import copy_utils

    real_cpasync = _real_cpasync()

    class FlashAttentionForwardSm90PairedKeys(FlashAttentionForwardSm90):
        """Same consumer; the producer loads packed pairs of 64-token key blocks."""

        q_after_first_key = False
        """Load a tile's Q after its first key block instead of before it: on persistent CTAs
        (delta 7) Q's buffer frees only after the previous tile's epilogue, and the first keys
        need not wait for it."""

        @cute.jit
        def _pair_loader(self, mX, sX, atom, pipe, seqlen, batch_idx, head_idx):
            """``load(packed, producer_state)``: key blocks ``a`` and ``b`` (``a`` again for
            `NO_BLOCK`) of ``packed`` into the two 64-row halves of one stage."""
            mX_cur = seqlen.offset_batch_K(mX, batch_idx, dim=3)[None, None, head_idx]
            g_tiles = cute.flat_divide(mX_cur, (KEY_BLOCK, 64))  # (64, 64, blocks, halves)
            s_tiles = cute.flat_divide(sX, (KEY_BLOCK, 64))  # (64, 64, 2, halves, stages)
            s, g = real_cpasync.tma_partition(
                atom,
                0,
                cute.make_layout(1),
                cute.group_modes(s_tiles, 0, 2),
                cute.group_modes(g_tiles, 0, 2),
            )
            n_halves = self.tile_hdim // 64

            def load(src_idx, producer_state):
                packed = src_idx  # a list entry: the packed pair
                bar = pipe.producer_get_barrier(producer_state)
                first = packed & 0xFFFF
                second = packed >> 16
                if second == NO_BLOCK:
                    second = first
                for slot in cutlass.range_constexpr(2):
                    block = first if slot == 0 else second
                    for half in cutlass.range_constexpr(n_halves):
                        cute.copy(
                            atom,
                            g[None, block, half],
                            s[None, slot, half, producer_state.index],
                            tma_bar_ptr=bar,
                        )

            return load

        @cute.jit
        def load(
            self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k,
            pipeline_v, pipeline_q, gmem_tiled_copy_Q, mPageTable, blocksparse_tensors,
            block_info, SeqlenInfoCls, TileSchedulerCls,
        ):  # fmt: skip
            warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
            if warp_idx_in_wg == 0:
                q_phase = Int32(1)
                kv_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.num_stages
                )
                scheduler = TileSchedulerCls()
                work_tile = scheduler.initial_work_tile_info()
                while work_tile.is_valid_tile:
                    m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                    seqlen = SeqlenInfoCls(batch_idx)
                    mQ_cur = seqlen.offset_batch_Q(mQ, batch_idx, dim=3)[None, None, head_idx]
                    gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
                    load_Q, _, _ = copy_utils.tma_get_copy_fn(
                        tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True
                    )
                    q_loaded = cute.make_rmem_tensor((1,), Int32)  # this tile's Q issued yet
                    q_loaded[0] = 0

                    # Everything bound as arguments: the DSL refuses closures over outer names
                    # inside its staged if.
                    def load_q(pipe=pipeline_q, load_Q=load_Q, phase=q_phase, loaded=q_loaded):
                        pipe.producer_acquire_w_index_phase(0, phase)
                        load_Q(tma_bar_ptr=pipe.sync_object_full.get_barrier(0))
                        loaded[0] = 1

                    if cutlass.const_expr(not self.q_after_first_key):
                        load_q()
                    load_K = self._pair_loader(
                        mK, sK, tma_atom_K, pipeline_k, seqlen, batch_idx, head_idx
                    )
                    if cutlass.const_expr(self.q_after_first_key):
                        load_first_K = load_K

                        def load_K(
                            src_idx, producer_state, load_K=load_first_K, load_q=load_q,
                            loaded=q_loaded,
                        ):  # fmt: skip
                            load_K(src_idx, producer_state)
                            if loaded[0] == 0:
                                load_q()

                    load_V = self._pair_loader(
                        mV, sV, tma_atom_V, pipeline_v, seqlen, batch_idx, head_idx
                    )
                    kv_state = produce_block_sparse_loads(
                        blocksparse_tensors, batch_idx, head_idx, m_block, seqlen, kv_state,
                        load_K, load_V, pipeline_k, pipeline_v, self.intra_wg_overlap,
                    )  # fmt: skip
                    # A tile with no key block still needs its Q.
                    if cutlass.const_expr(self.q_after_first_key) and q_loaded[0] == 0:
                        load_q()
                    q_phase ^= 1
                    scheduler.prefetch_next_work()
                    scheduler.advance_to_next_work()
                    work_tile = scheduler.get_current_work()
                pipeline_v.producer_tail(kv_state)

    return FlashAttentionForwardSm90PairedKeys


def _real_cpasync() -> Any:
    from cutlass.cute.nvgpu import cpasync

    return cpasync


class _ScopedCpasync:
    """``cpasync`` as upstream's forward module sees it: while a fork entry point builds the
    paired-key kernel (or the two-stream one, same producer) on the calling thread the K/V TMA
    atoms (built with a multicast count) get a 64 x 64 box; elsewhere, and for every other
    call, the real module."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def make_tiled_tma_atom(self, op, gmem, smem_layout, tiler, *rest, **kwargs):
        kernel = current("fwd")
        if not rest or kernel is None or not kernel.two_block_stages:
            return self._real.make_tiled_tma_atom(op, gmem, smem_layout, tiler, *rest, **kwargs)
        from cutlass.utils import LayoutEnum
        from quack import sm90_utils

        box = (KEY_BLOCK, 64)
        sub = sm90_utils.make_smem_layout(gmem.element_type, LayoutEnum.ROW_MAJOR, box)
        return self._real.make_tiled_tma_atom(op, gmem, sub, box, *rest, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@functools.cache
def _install() -> None:
    """Once per process: upstream's forward module sees `_ScopedCpasync` and builds its mask
    from the kernel's `mask_class()` while a fork entry point builds the paired-key (or the
    two-stream) kernel on the calling thread (elsewhere, exactly what it saw before: the real
    module, `flash_attn_vsa.mask_sm90`'s class)."""
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    from flash_attn_vsa import mask_sm90

    mask_sm90.install()  # first: it sets the module global we wrap here
    outside = fwd_module.AttentionMask

    class ScopedMask(outside):  # a subclass, so issubclass/isinstance still hold
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            # Returns an instance of another class, so Python does not call __init__ again.
            kernel = current("fwd")
            own = kernel.mask_class() if kernel is not None else None
            return (own or outside)(*args, **kwargs)

    fwd_module.AttentionMask = ScopedMask
    fwd_module.cpasync = _ScopedCpasync(fwd_module.cpasync)


def two_block_stage_forward(
    q: Any,
    k: Any,
    v: Any,
    block_sparse_tensors: Any,
    kv_valid_sizes: Any,
    block_size: tuple[int, int],
    what: str,
    mask_mod: Any,
    kernel: Any,
    building: Callable[[Any], contextlib.AbstractContextManager[Any]],
    *,
    softmax_scale: float,
    out: Any,
    lse: Any,
    replay: bool = True,
) -> tuple[Any, Any]:
    """Check the arguments of a forward whose key/value stages hold two 64-token blocks (this
    delta's and the two-stream one's: ``block_size`` as FA4 sees it, head dim `HEAD_DIM`, one
    valid size per key block; ``what`` names it in errors), then run upstream's
    ``_flash_attn_fwd`` inside ``building(kernel)`` (the entry point's `fwd_sm90._building` of
    ``kernel``, a `fwd_sm90.ForwardKernel`)
    with ``mask_mod`` on the partial list (replayed after the first calls of a description
    unless ``replay`` is False: `launch_replay`)."""
    from flash_attn_vsa import launch_replay
    from flash_attn_vsa.sm90_blocks import check_call

    check_call(q, k, v, tuple(block_sparse_tensors.block_size or ()), (block_size,))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] != HEAD_DIM:
            raise ValueError(f"{name}'s head dim must be {HEAD_DIM} ({what}), got "
                             f"{t.shape[-1]}")  # fmt: skip
    if kv_valid_sizes.shape[0] != k.shape[1] // KEY_BLOCK:
        raise ValueError(
            f"kv_valid_sizes must have one entry per {KEY_BLOCK}-token key block "
            f"({k.shape[1] // KEY_BLOCK}), got {kv_valid_sizes.shape[0]}"
        )

    return launch_replay.forward(
        kernel, building, q, k, v, block_sparse_tensors, softmax_scale=softmax_scale,
        mask_mod=mask_mod, aux_tensors=[kv_valid_sizes], out=out, lse=lse, replay=replay,
    )  # fmt: skip

"""The KV64 backward with dQ reduced into global memory straight from registers: the fork's
eighth delta (experimental until measured on an H200; session 9).

Why (NOTES.md, session 8): the KV64 backward keeps one MMA warpgroup per 64-key tile, and its
tensor pipe is active 52-55% of the time whatever memory does; nothing shares the SM with it.
Upstream's sm_90 backward stages each (key tile, query tile) step's dQ in 32 KB of shared
memory (64x128 float32), where a producer warp sends it to L2 as one bulk reduce-add; with
those 32 KB and two stages of Q and dO a CTA needs 160 KB, so an SM holds one. Two CTAs per
SM were tried with one Q/dO stage each (experiment 4: 0.49 of dense; each CTA waits for every
load).

This delta drops the staging buffer: each MMA thread adds its dQ fragment to upstream's
float32 dQ accumulator with 16-byte ``red.global.add.v4.f32`` reductions, in the order
upstream's staging buffer holds it (thread ``t``'s values ``4k..4k+3`` at ``512 k + 4 t`` of
the block's chunk), so upstream's postprocess reads the same layout and a warp's reduction is
512 contiguous bytes. The bytes sent to L2 are the same; what goes is the shared-memory copy,
the handshake with the producer warp (two named barriers a step) and 32 KB per CTA. With a
single stage of P/dS and of dO (Q keeps two: it is read until a step's last MMA) a CTA needs
~98 KB, so **two CTAs share an SM** (``ctas_per_sm=2``: launch bound of two, ``setmaxnreg``
232 / 24), each walking its own key tile's list: two MMA warpgroups per SM, as dense has.

`kernel_class(ctas_per_sm)` is the kernel class (a subclass of `bwd_sm90.kernel_class`); the
step of one query block, `mma_one_m_block`, is ours (upstream's, minus what our configurations
never use: swapped S, P from registers, score mods), everything else upstream's.

Upstream internals this relies on (fingerprinted): ``FlashAttentionBackwardSm90``'s ``mma``
(parameter names: ``mdQaccum``, ``tidx``, ``r2s_tiled_copy_dQaccum``), its call of
``mma_one_m_block`` (keyword names) with the block-sparse loop's ``mask_fn`` a
``functools.partial`` carrying ``batch_idx`` and ``head_idx``, ``dQaccum_store`` (run by warp
1 only), ``_get_shared_storage_cls`` (a ``cute.struct`` whose field ``sdQaccum`` only the
staging path writes) and ``flash_attn.cute.copy_utils.atomic_add_fp32x4``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from flash_attn_vsa.sm90_operands import pushed, thread_stack

__all__ = ["MMA_REGISTERS_TWO_CTAS", "kernel_class", "storage_without_dq_staging"]

MMA_REGISTERS_TWO_CTAS = 232
"""Registers per thread of the MMA warpgroup when two CTAs share an SM; the producer warpgroup
gets 24, so that two CTAs of 2 x 128 threads fit the 64K register file."""
PRODUCER_REGISTERS = 24
VALUES_PER_REDUCTION = 4
"""float32 values per ``red.global.add.v4.f32`` (the r2s copy upstream stages dQ with moves 4
values a thread too)."""


def storage_without_dq_staging(upstream_struct: Any) -> Any:
    """Upstream's backward shared storage (a ``cute.struct``) without the dQ staging buffer and
    with its 1024-byte-aligned tiles first, so that no alignment padding is spent ahead of
    them (two CTAs must fit 228 KB with 1 KB each reserved). ``sdQaccum`` stays as a 16-byte
    field: upstream's kernel makes a tensor on it, which only the staging path writes."""
    import cutlass
    from cutlass import cute

    fields = dict(upstream_struct._annotations)
    fields["sdQaccum"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4], 16]
    tiles = ("sQ", "sV", "sK", "sdO", "sP", "sdS")
    ordered = {name: fields[name] for name in tiles if name in fields}
    ordered.update((name, kind) for name, kind in fields.items() if name not in ordered)
    name = f"{upstream_struct._cls.__name__}NoDqStaging"
    return cute.struct(type(name, (), {"__annotations__": ordered}))


@functools.cache
def _mma_signature() -> inspect.Signature:
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    return inspect.signature(FlashAttentionBackwardSm90.mma)


@functools.cache
def kernel_class(ctas_per_sm: int = 1) -> type:
    """The KV64 backward kernel class reducing dQ from registers, sized for ``ctas_per_sm``
    (1 or 2) CTAs per SM. One class object per value."""
    if ctas_per_sm not in (1, 2):
        raise ValueError(f"ctas_per_sm must be 1 or 2, got {ctas_per_sm!r}")
    from flash_attn_vsa.bwd_sm90 import kernel_class as kv64_class
    from flash_attn_vsa.sm90_blocks import BoundLauncher

    base = kv64_class()

    class FlashAttentionBackwardSm90DqFromRegisters(base):  # type: ignore[misc, valid-type]
        """The KV64 backward; each MMA thread reduces its own dQ values into global memory."""

        def _setup_attributes(self) -> None:
            _check_supported(self, ctas_per_sm)
            super()._setup_attributes()
            if ctas_per_sm == 2:
                self.num_mma_regs_wg0 = self.num_mma_regs_wg1 = MMA_REGISTERS_TWO_CTAS
                self.num_mma_regs = MMA_REGISTERS_TWO_CTAS
                self.num_producer_regs = PRODUCER_REGISTERS

        def _get_shared_storage_cls(self) -> Any:
            return storage_without_dq_staging(base._get_shared_storage_cls(self))

        def kernel(self, *args: Any, **kwargs: Any) -> Any:
            launcher = base.kernel(self, *args, **kwargs)
            return BoundLauncher(launcher, ctas_per_sm) if ctas_per_sm > 1 else launcher

        def dQaccum_store(self, *args: Any, **kwargs: Any) -> None:
            """No producer-side dQ store: the MMA threads reduce dQ themselves."""

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            bound = _mma_signature().bind(self, *args, **kwargs).arguments
            dq_target = (bound["mdQaccum"], bound["r2s_tiled_copy_dQaccum"], bound["tidx"])
            with pushed("dq_from_registers", dq_target):
                return base.mma(self, *args, **kwargs)

        mma_one_m_block = _one_query_block()

    suffix = "TwoCtas" if ctas_per_sm == 2 else ""
    cls = FlashAttentionBackwardSm90DqFromRegisters
    cls.__name__ = cls.__qualname__ = f"FlashAttentionBackwardSm90DqFromRegisters{suffix}"
    return cls


def _check_supported(kernel: Any, ctas_per_sm: int) -> None:
    """ValueError for configurations our `_mma_one_m_block` does not implement."""
    unsupported = {
        "SdP_swapAB": kernel.SdP_swapAB,
        "mma_dkv_is_rs": kernel.mma_dkv_is_rs,
        "score_mod": kernel.score_mod is not None,
        "score_mod_bwd": kernel.score_mod_bwd is not None,
        "deterministic": kernel.deterministic,
        "qhead_per_kvhead > 1": kernel.qhead_per_kvhead > 1,
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise ValueError(f"dQ from registers does not support {', '.join(used)}")
    if ctas_per_sm == 2 and kernel.num_wg_mma != 1:
        raise ValueError(
            f"two CTAs per SM need one MMA warpgroup (64-row query tiles), got {kernel.num_wg_mma}"
        )


@functools.cache
def _one_query_block() -> Any:
    """Our ``mma_one_m_block``, traced by the DSL (its loops and ``const_expr`` branches are
    rewritten by the DSL's preprocessor, which resolves ``cutlass`` through this closure)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.nvgpu import warpgroup
    from quack import copy_utils, layout_utils

    @cute.jit
    def mma_one_m_block(
        self: Any,
        m_block: Any,
        consumer_state_Q: Any,
        consumer_state_dO: Any,
        warp_group_idx: Any,
        mma_qk_fn: Any,
        mma_dov_fn: Any,
        mma_pdo_fn: Any,
        mma_dsq_fn: Any,
        mma_dsk_fn: Any,
        copy_P_r2s: Any,
        copy_dS_r2s: Any,
        pipeline_Q: Any,
        pipeline_dO: Any,
        tLSEsLSE: Any,
        tLSEsdPsum: Any,
        tdQsdQaccum: Any,
        softmax_scale_log2: Any,
        PdS_barrier: Any,
        is_dQ_wg: bool = True,
        mask_fn: Any = None,
        score_mod_fn: Any = None,
        score_mod_bwd_fn: Any = None,
        dKV_accumulate: Any = True,
    ) -> tuple[Any, Any]:
        """One query block of a key tile's list (keyword names as upstream's ``mma`` passes
        them): S and dP, P and dS into shared memory, dV += P^T dO, dQ = dS K reduced into
        global memory from registers, dK += dS^T Q."""

        dO_state = consumer_state_dO
        if cutlass.const_expr(self.Q_stage == self.dO_stage):
            dO_state = consumer_state_Q
        q_idx = consumer_state_Q.index
        do_idx = dO_state.index if cutlass.const_expr(self.dO_stage > 1) else 0
        pds_idx = q_idx if cutlass.const_expr(self.PdS_stage > 1) else 0

        pipeline_Q.consumer_wait(consumer_state_Q, pipeline_Q.consumer_try_wait(consumer_state_Q))
        acc_S = mma_qk_fn(A_idx=q_idx, wg_wait=-1)
        lse = copy_utils.load_s2r(tLSEsLSE[None, q_idx])
        pipeline_dO.consumer_wait(dO_state, pipeline_dO.consumer_try_wait(dO_state))
        acc_dP = mma_dov_fn(A_idx=do_idx, wg_wait=1)  # S is ready once this returns

        if cutlass.const_expr(mask_fn is not None):
            mask_fn(acc_S, m_block=m_block)
        S = layout_utils.reshape_acc_to_mn(acc_S)
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            row_lse = self._get_stat(lse, r, lane, shuffle=self.shuffle_LSE)
            for c in cutlass.range(cute.size(S, mode=[1]), unroll_full=True):
                S[r, c] = cute.math.exp2(S[r, c] * softmax_scale_log2 - row_lse, fastmath=True)
        dpsum = copy_utils.load_s2r(tLSEsdPsum[None, do_idx])
        P = _to_operand(acc_S, self.dtype)
        if cutlass.const_expr(self.PdS_stage == 1):
            PdS_barrier.arrive_and_wait()  # the previous step's dV MMA has read sP
        copy_P_r2s(P, dst_idx=pds_idx)

        warpgroup.wait_group(0)  # dP
        dP = layout_utils.reshape_acc_to_mn(acc_dP)
        for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
            row_dpsum = self._get_stat(dpsum, r, lane, shuffle=self.shuffle_dPsum)
            for c in cutlass.range(cute.size(dP, mode=[1]), unroll_full=True):
                dP[r, c] = S[r, c] * (dP[r, c] - row_dpsum)
        dS = _to_operand(acc_dP, self.dtype)
        cute.arch.fence_view_async_shared()
        PdS_barrier.arrive_and_wait()  # P visible to the MMAs; the previous dQ/dK MMAs read sdS
        copy_dS_r2s(dS, dst_idx=pds_idx)

        mma_pdo_fn(A_idx=pds_idx, B_idx=do_idx, zero_init=not dKV_accumulate, wg_wait=-1)
        cute.arch.fence_view_async_shared()
        PdS_barrier.arrive_and_wait()  # dS visible to the MMAs
        acc_dQ = mma_dsk_fn(A_idx=pds_idx, wg_wait=1)  # dV done once this returns
        pipeline_dO.consumer_release(dO_state)
        mma_dsq_fn(A_idx=pds_idx, B_idx=q_idx, zero_init=not dKV_accumulate, wg_wait=1)
        _reduce_dq(self, acc_dQ, m_block, mask_fn)  # overlaps the dK MMA
        warpgroup.wait_group(0)
        pipeline_Q.consumer_release(consumer_state_Q)

        consumer_state_Q.advance()
        consumer_state_dO.advance()
        return consumer_state_Q, consumer_state_dO

    return mma_one_m_block


def _to_operand(acc: Any, dtype: Any) -> Any:
    """An MMA accumulator as the 16-bit A operand of the next MMA."""
    from flash_attn.cute import utils
    from quack import layout_utils

    return utils.cvt_f16(layout_utils.reshape_acc_to_frgA(acc), dtype)


def _reduce_dq(kernel: Any, acc_dQ: Any, m_block: Any, mask_fn: Any) -> None:
    """Add this thread's dQ values to query block ``m_block``'s chunk of upstream's float32
    accumulator, in the order upstream's staging buffer (and so its postprocess) uses."""
    from cutlass import cute
    from flash_attn.cute import utils
    from flash_attn.cute.copy_utils import atomic_add_fp32x4

    mdQaccum, r2s_copy, tidx = thread_stack("dq_from_registers")[-1]
    tile = getattr(mask_fn, "keywords", {})
    if "head_idx" not in tile or "batch_idx" not in tile:
        raise NotImplementedError("dQ from registers runs the block-sparse loop only")
    block_values = kernel.tile_m * kernel.tile_hdim
    mdQ_head = mdQaccum[None, tile["head_idx"], tile["batch_idx"]]
    # Upstream's staging layout, made again here: layouts made at the host-side call may not
    # be used inside the kernel.
    chunks = cute.make_layout((block_values // kernel.num_wg_dQ, kernel.num_wg_dQ))
    gdQ = cute.make_tensor(utils.elem_pointer(mdQ_head, m_block * block_values), chunks)
    tdQgdQ = r2s_copy.get_slice(tidx).partition_D(gdQ)
    if cute.size(tdQgdQ, mode=[0]) != VALUES_PER_REDUCTION:
        raise NotImplementedError("dQ from registers expects 4 contiguous values per copy")
    values = cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQgdQ.shape))
    for i in range(0, cute.size(tdQgdQ), VALUES_PER_REDUCTION):
        atomic_add_fp32x4(
            values[i], values[i + 1], values[i + 2], values[i + 3], utils.elem_pointer(tdQgdQ, i)
        )

"""The KV64 backward with dQ reduced by the MMA warpgroup itself, in two halves through a 16 KB
buffer: the fork's eighth delta (experimental until measured on an H200; session 9).

Why (NOTES.md, session 8): the KV64 backward keeps one MMA warpgroup per 64-key tile, and its
tensor pipe is active 52-55% of the time whatever memory does; nothing shares the SM with it.
Upstream's sm_90 backward stages each (key tile, query tile) step's dQ in 32 KB of shared
memory (64x128 float32), where a producer warp sends it to L2 as one bulk reduce-add; with
those 32 KB and two stages of Q and dO a CTA needs 160 KB, so an SM holds one. Two CTAs per
SM were tried with one Q/dO stage each (experiment 4: 0.49 of dense; each CTA waits for every
load).

Session 9 first sent dQ from registers (16-byte ``red.global.add.v4.f32`` per thread, no
staging at all): correct, but 23% slower at one CTA per SM and 5% slower than the shipped
kernel at two (experiment 13: the L2 takes per-thread reductions far slower than bulk ones).
So the bulk reduce-add stays, from half the buffer: the MMA warpgroup writes dQ's first half
(its values in the order upstream's staging buffer holds them, so upstream's postprocess reads
the same accumulator), one of its threads issues the bulk reduce-add, waits until the bulk
copy has read the buffer (a few hundred cycles, while the step's dK MMA runs), and the second
half follows. No producer warp and no handshake with it: the issuing thread's bulk-async group
is the only state. With one stage of P/dS and of dO (Q keeps two: it is read until a step's
last MMA) a CTA needs 113 KB, so **two CTAs share an SM** (``ctas_per_sm=2``: launch bound of
two, ``setmaxnreg`` 232 / 24), each walking its own key tile's list: two MMA warpgroups per
SM, as dense has.

`kernel_class(ctas_per_sm)` is the kernel class (a subclass of `bwd_sm90.kernel_class`); the
step of one query block (``mma_one_m_block``) is ours (upstream's, minus what our
configurations never use: swapped S, P from registers, score mods), everything else
upstream's.

Upstream internals this relies on (fingerprinted): ``FlashAttentionBackwardSm90``'s ``mma``
(parameter names: ``mdQaccum``, ``sdQaccum``, ``tidx``, ``r2s_tiled_copy_dQaccum``), its call
of ``mma_one_m_block`` (keyword names) with the block-sparse loop's ``mask_fn`` a
``functools.partial`` carrying ``batch_idx`` and ``head_idx``, ``dQaccum_store`` (run by warp
1 only), ``_get_shared_storage_cls`` (a ``cute.struct`` with the field ``sdQaccum``) and
``NamedBarrierBwd.PdS`` (the MMA warpgroup's own barrier).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from flash_attn_vsa.sm90_operands import pushed, thread_stack

__all__ = ["HALVES", "MMA_REGISTERS_TWO_CTAS", "kernel_class", "storage_with_half_dq_buffer"]

MMA_REGISTERS_TWO_CTAS = 232
"""Registers per thread of the MMA warpgroup when two CTAs share an SM; the producer warpgroup
gets 24, so that two CTAs of 2 x 128 threads fit the 64K register file."""
PRODUCER_REGISTERS = 24
HALVES = 2
"""dQ goes to L2 in this many parts through one buffer of that fraction of its size."""


def storage_with_half_dq_buffer(upstream_struct: Any, dq_values: int) -> Any:
    """Upstream's backward shared storage (a ``cute.struct``) with a dQ buffer of
    ``dq_values // HALVES`` float32 values instead of ``dq_values``, and its 1024-byte-aligned
    tiles first, so that no alignment padding is spent ahead of them (two CTAs must fit
    228 KB with 1 KB each reserved)."""
    import cutlass
    from cutlass import cute

    fields = dict(upstream_struct._annotations)
    fields["sdQaccum"] = cute.struct.Align[
        cute.struct.MemRange[cutlass.Float32, dq_values // HALVES], 1024
    ]
    tiles = ("sQ", "sV", "sK", "sdO", "sP", "sdS", "sdQaccum")
    ordered = {name: fields[name] for name in tiles if name in fields}
    ordered.update((name, kind) for name, kind in fields.items() if name not in ordered)
    name = f"{upstream_struct._cls.__name__}HalfDq"
    return cute.struct(type(name, (), {"__annotations__": ordered}))


@functools.cache
def _mma_signature() -> inspect.Signature:
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    return inspect.signature(FlashAttentionBackwardSm90.mma)


def kernel_class(ctas_per_sm: int = 1, send_dq: bool = True) -> type:
    """The KV64 backward kernel class reducing dQ in halves from its MMA warpgroup, sized for
    ``ctas_per_sm`` (1 or 2) CTAs per SM. ``send_dq=False`` is an ablation for experiments:
    dQ is computed and never sent (dQ comes out zero), which bounds what any dQ path could
    give this structure. One class object per combination."""
    if ctas_per_sm not in (1, 2):
        raise ValueError(f"ctas_per_sm must be 1 or 2, got {ctas_per_sm!r}")
    return _kernel_class(ctas_per_sm, bool(send_dq))


@functools.cache
def _kernel_class(ctas_per_sm: int, send_dq: bool) -> type:
    from flash_attn_vsa.bwd_sm90 import kernel_class as kv64_class
    from flash_attn_vsa.sm90_blocks import BoundLauncher

    base = kv64_class()

    class FlashAttentionBackwardSm90HalfDq(base):  # type: ignore[misc, valid-type]
        """The KV64 backward; the MMA warpgroup sends its dQ to L2 itself, in halves."""

        def _setup_attributes(self) -> None:
            _check_supported(self)
            super()._setup_attributes()
            if ctas_per_sm == 2:
                self.num_mma_regs_wg0 = self.num_mma_regs_wg1 = MMA_REGISTERS_TWO_CTAS
                self.num_mma_regs = MMA_REGISTERS_TWO_CTAS
                self.num_producer_regs = PRODUCER_REGISTERS

        def _get_shared_storage_cls(self) -> Any:
            upstream = base._get_shared_storage_cls(self)
            return storage_with_half_dq_buffer(upstream, self.tile_m * self.tile_hdim)

        def kernel(self, *args: Any, **kwargs: Any) -> Any:
            launcher = base.kernel(self, *args, **kwargs)
            return BoundLauncher(launcher, ctas_per_sm) if ctas_per_sm > 1 else launcher

        def dQaccum_store(self, *args: Any, **kwargs: Any) -> None:
            """No producer-side dQ store: the MMA warpgroup reduces dQ itself."""

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            bound = _mma_signature().bind(self, *args, **kwargs).arguments
            names = ("mdQaccum", "sdQaccum", "r2s_tiled_copy_dQaccum", "tidx")
            with pushed("dq_halves", tuple(bound[n] for n in names)):
                result = base.mma(self, *args, **kwargs)
            _reductions_read()(bound["tidx"])
            return result

        mma_one_m_block = _one_query_block(send_dq)

    suffix = ("TwoCtas" if ctas_per_sm == 2 else "") + ("" if send_dq else "NoDq")
    cls = FlashAttentionBackwardSm90HalfDq
    cls.__name__ = cls.__qualname__ = f"FlashAttentionBackwardSm90HalfDq{suffix}"
    return cls


def _check_supported(kernel: Any) -> None:
    """ValueError for configurations our ``mma_one_m_block`` does not implement."""
    unsupported = {
        "SdP_swapAB": kernel.SdP_swapAB,
        "mma_dkv_is_rs": kernel.mma_dkv_is_rs,
        "score_mod": kernel.score_mod is not None,
        "score_mod_bwd": kernel.score_mod_bwd is not None,
        "deterministic": kernel.deterministic,
        "qhead_per_kvhead > 1": kernel.qhead_per_kvhead > 1,
        "more than one MMA warpgroup": kernel.num_wg_mma != 1,
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise ValueError(f"the half-buffer dQ backward does not support {', '.join(used)}")


@functools.cache
def _reductions_read() -> Any:
    """``wait(tidx)``: the issuing thread waits until its bulk reduce-adds have read their
    buffer (no CTA may exit with a bulk copy still reading its shared memory)."""
    from cutlass import cute

    @cute.jit
    def wait(tidx: Any) -> None:
        if tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    return wait


def _one_query_block(send_dq: bool = True) -> Any:
    """Our ``mma_one_m_block``, traced by the DSL (its loops and ``const_expr`` branches are
    rewritten by the DSL's preprocessor, which resolves ``cutlass`` through this closure)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.nvgpu import warpgroup
    from quack import copy_utils, layout_utils

    @cute.jit
    def reduce_dq_in_halves(self, acc_dQ, m_block, mask_fn, barrier) -> None:
        """dQ into L2 in `HALVES` bulk reduce-adds through one buffer: for each half, the
        issuing thread (MMA thread 0) waits until its previous reduce-add has read the buffer,
        every thread writes its values, and thread 0 sends them. The order of the values is
        upstream's staging order (thread t's 4k..4k+3 at 512 k + 4 t of the block's chunk)."""
        tdQs, chunk, sdQ, tidx = _dq_target(self, m_block, mask_fn)
        per_half = cute.size(tdQs)
        half_bytes = self.tile_m * self.tile_hdim // HALVES * 4
        for h in cutlass.range_constexpr(HALVES):
            values = cute.make_tensor(acc_dQ.iterator + h * per_half, cute.make_layout(tdQs.shape))
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            barrier.arrive_and_wait()  # the buffer is free
            cute.autovec_copy(values, tdQs)
            cute.arch.fence_view_async_shared()
            barrier.arrive_and_wait()  # every value written and visible to the bulk copy
            if tidx == 0:
                copy_utils.cpasync_reduce_bulk_add_f32(
                    sdQ.iterator, chunk + h * (half_bytes // 4), half_bytes
                )
                cute.arch.cp_async_bulk_commit_group()

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
        global memory in halves (`_reduce_dq_in_halves`), dK += dS^T Q."""

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
        if cutlass.const_expr(send_dq):
            reduce_dq_in_halves(self, acc_dQ, m_block, mask_fn, PdS_barrier)  # under the dK MMA
        warpgroup.wait_group(0)
        pipeline_Q.consumer_release(consumer_state_Q)

        consumer_state_Q.advance()
        consumer_state_dO.advance()
        return consumer_state_Q, consumer_state_dO

    return mma_one_m_block


def _dq_target(kernel: Any, m_block: Any, mask_fn: Any) -> tuple[Any, Any, Any, Any]:
    """(this thread's slice of the dQ buffer, query block ``m_block``'s chunk of upstream's
    float32 accumulator, the buffer, the MMA thread index), from what `mma` pushed."""
    from cutlass import cute
    from flash_attn.cute import utils

    mdQaccum, sdQaccum, r2s_copy, tidx = thread_stack("dq_halves")[-1]
    tile = getattr(mask_fn, "keywords", {})
    if "head_idx" not in tile or "batch_idx" not in tile:
        raise NotImplementedError("the half-buffer dQ backward runs the block-sparse loop only")
    block_values = kernel.tile_m * kernel.tile_hdim
    chunk = utils.elem_pointer(
        mdQaccum[None, tile["head_idx"], tile["batch_idx"]], m_block * block_values
    )
    # One half of upstream's staging layout, made here: layouts made by the host-side call
    # may not be used inside the kernel.
    half = cute.make_tensor(sdQaccum.iterator, cute.make_layout((block_values // HALVES, 1)))
    return r2s_copy.get_slice(tidx).partition_D(half), chunk, sdQaccum, tidx


def _to_operand(acc: Any, dtype: Any) -> Any:
    """An MMA accumulator as the 16-bit A operand of the next MMA."""
    from flash_attn.cute import utils
    from quack import layout_utils

    return utils.cvt_f16(layout_utils.reshape_acc_to_frgA(acc), dtype)

"""The KV64 backward with dQ sent to L2 in parts through small buffers of its own, so that two
CTAs share an SM: the fork's eighth delta (session 9; `vsa-fa4` runs it for 64x64 blocks).

Why (NOTES.md, session 8): the KV64 backward kept one MMA warpgroup per 64-key tile, its tensor
pipe active 52-55% of the time. Upstream's sm_90 backward stages each (key tile, query tile)
step's dQ in 32 KB of shared memory (64x128 float32), hands it to a producer warp over two named
barriers, and the producer sends it to L2 as one bulk reduce-add; before writing the next step's
dQ the MMA warpgroup waits until that reduce-add has read the buffer. With those 32 KB and two
stages of Q and dO a CTA needs 160 KB, so an SM holds one.

Here each MMA thread writes one part of its dQ values at a time to a buffer (in upstream's
staging order, thread ``t``'s values ``4k..4k+3`` at ``512 k + 4 t`` of the block's chunk, so
upstream's postprocess reads the same accumulator) and the part goes to L2 as a bulk reduce-add.
`DqStaging` says how: ``parts`` per step, ``buffers`` of ``1 / parts`` of the step's dQ each,
taken in turn, and who sends: MMA thread 0 (waiting, before a buffer is written again, until
the reduce-add that last used it has read it; the warpgroup meets at a named barrier twice a
part), or upstream's producer warp 1, idle once upstream's staging is gone (an mbarrier handover:
the MMA threads write, arrive, and wait only for a buffer not yet read; lane 0 of warp 1 issues
each reduce-add, waits for its read and hands the buffer back).

What session 9 measured (experiment 13, NOTES.md; S=32768, ratios to dense): two CTAs per SM
(113 KB each) with halves through one 16 KB buffer sent by the producer warp, 0.70 (shipped:
`bwd_sm90.KV64_CONFIG`), quarters sent by MMA thread 0 0.69-0.70, against 0.66 for upstream's
staging at one CTA; forms with more parts lose to their synchronization, and waiting for a
reduce-add's read inside the MMA warpgroup's path loses most (0.45). The same two-CTA kernel
with dQ computed and never sent (``send_dq=False``) runs 1.03: sending dQ, not the MMAs, is
what holds this backward now.

`kernel_class(ctas_per_sm, staging, send_dq)` is the kernel class (a subclass of
`bwd_sm90.kernel_class`); the step of one query block (``mma_one_m_block``) and warp 1's
``dQaccum_store`` are ours (the step upstream's, minus what our configurations never use:
swapped S, P from registers, score mods), everything else upstream's.

Upstream internals this relies on (fingerprinted): ``FlashAttentionBackwardSm90``'s ``mma``
(parameter names: ``mdQaccum``, ``sdQaccum``, ``tidx``, ``r2s_tiled_copy_dQaccum``), its call
of ``mma_one_m_block`` (keyword names) with the block-sparse loop's ``mask_fn`` a
``functools.partial`` carrying ``batch_idx`` and ``head_idx``, ``dQaccum_store`` (run by warp
1 only, ``sdQaccum`` its second argument), ``_get_shared_storage_cls`` (a ``cute.struct`` with
the field ``sdQaccum``) and ``NamedBarrierBwd`` (``PdS``, the MMA warpgroup's own barrier;
``dQEmptyWG0``, free once upstream's staging is gone).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from flash_attn_vsa.build_scope import trace_stack, traced

__all__ = ["MMA_REGISTERS_TWO_CTAS", "DqStaging", "kernel_class", "storage_with_dq_buffers"]

MMA_REGISTERS_TWO_CTAS = 232
"""Registers per thread of the MMA warpgroup when two CTAs share an SM; the producer warpgroup
gets 24, so that two CTAs of 2 x 128 threads fit the 64K register file."""
PRODUCER_REGISTERS = 24


@dataclass(frozen=True)
class DqStaging:
    """How a step's dQ goes to L2: in ``parts`` bulk reduce-adds, through ``buffers`` buffers of
    ``1 / parts`` of the step's dQ each, used in turn. Either ``buffers`` divides ``parts``
    (each part's buffer is known when the kernel is compiled) or ``parts == 1`` and ``buffers``
    equals the Q stages (the step's Q stage picks the buffer).

    ``sender``: ``"mma"``, MMA thread 0 issues each reduce-add and waits for its buffer, the
    warpgroup meeting at a named barrier twice a part; ``"producer"``, upstream's idle producer
    warp 1 issues them and waits, and the two sides hand buffers over through mbarriers (the
    MMA threads only arrive, and wait only for a buffer not yet read). The producer form needs
    each buffer used an even number of times a step (``parts // buffers`` even), so that every
    wait's phase is known when the kernel is compiled."""

    parts: int = 2
    buffers: int = 1
    sender: str = "mma"

    def __post_init__(self) -> None:
        for name in ("parts", "buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.sender not in ("mma", "producer"):
            raise ValueError(f"sender must be 'mma' or 'producer', got {self.sender!r}")

    def check(self, q_stages: int, step_values: int) -> None:
        """ValueError unless this staging runs with ``q_stages`` Q stages and steps of
        ``step_values`` dQ values."""
        if self.parts % self.buffers and not (self.parts == 1 and self.buffers == q_stages):
            raise ValueError(
                f"buffers ({self.buffers}) must divide parts ({self.parts}) or, with one part, "
                f"equal the Q stages ({q_stages})"
            )
        if step_values % (self.parts * 512):
            raise ValueError(f"parts ({self.parts}) must split the dQ tile in 512-value pieces")
        if self.sender == "producer" and (self.parts % self.buffers or self.uses_per_step % 2):
            raise ValueError(
                f"the producer sender needs parts ({self.parts}) an even multiple of buffers "
                f"({self.buffers})"
            )

    @property
    def uses_per_step(self) -> int:
        return max(self.parts // self.buffers, 1)

    def buffer_values(self, step_values: int) -> int:
        """float32 values of shared memory the buffers take (and, with the producer sender,
        their handover: an mbarrier each way and an address slot per buffer, 8 bytes each)."""
        handover = 3 * self.buffers * 2 if self.sender == "producer" else 0
        return step_values // self.parts * self.buffers + handover


def storage_with_dq_buffers(upstream_struct: Any, buffer_values: int) -> Any:
    """Upstream's backward shared storage (a ``cute.struct``) with ``buffer_values`` float32
    values for dQ instead of its staging buffer, and the 1024-byte-aligned tiles first, so that
    no alignment padding is spent ahead of them (two CTAs must fit 228 KB with 1 KB each
    reserved)."""
    import cutlass
    from cutlass import cute

    fields = dict(upstream_struct._annotations)
    fields["sdQaccum"] = cute.struct.Align[
        cute.struct.MemRange[cutlass.Float32, buffer_values], 1024
    ]
    tiles = ("sQ", "sV", "sK", "sdO", "sP", "sdS", "sdQaccum")
    ordered = {name: fields[name] for name in tiles if name in fields}
    ordered.update((name, kind) for name, kind in fields.items() if name not in ordered)
    name = f"{upstream_struct._cls.__name__}DqBuffers"
    return cute.struct(type(name, (), {"__annotations__": ordered}))


@functools.cache
def _mma_signature() -> inspect.Signature:
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    return inspect.signature(FlashAttentionBackwardSm90.mma)


DQ_PATHS = ("send", "none", "ds")
"""What the kernel does with dQ: ``send`` reduces it into L2 as ``staging`` says; ``none``
(an ablation for experiments) computes it (its MMA kept) and never sends it, so dQ comes out
zero, which bounds what any dQ path could give the kernel; ``ds`` computes no dQ at all and
writes each step's dS instead (delta 12, `flash_attn_vsa.bwd_sm90_ds_out`), for a separate
query-owned pass to compute dQ from."""


def kernel_class(
    ctas_per_sm: int = 1, staging: DqStaging = DqStaging(), send_dq: bool = True,
    dq_path: str | None = None,
) -> type:  # fmt: skip
    """The KV64 backward kernel class whose MMA warpgroup sends dQ itself as ``staging`` says,
    sized for ``ctas_per_sm`` (1 or 2) CTAs per SM. ``dq_path`` (one of `DQ_PATHS`) overrides
    ``send_dq`` (False: the ``none`` ablation). One class object per combination."""
    if ctas_per_sm not in (1, 2):
        raise ValueError(f"ctas_per_sm must be 1 or 2, got {ctas_per_sm!r}")
    if not isinstance(staging, DqStaging):
        raise ValueError(f"staging must be a DqStaging, got {staging!r}")
    if dq_path is None:
        dq_path = "send" if send_dq else "none"
    if dq_path not in DQ_PATHS:
        raise ValueError(f"dq_path must be one of {DQ_PATHS}, got {dq_path!r}")
    return _kernel_class(ctas_per_sm, staging, dq_path)


@functools.cache
def _kernel_class(ctas_per_sm: int, staging: DqStaging, dq_path: str) -> type:
    from flash_attn_vsa.bwd_sm90_kv64 import kernel_class as kv64_class
    from flash_attn_vsa.sm90_blocks import BoundLauncher

    base = kv64_class()

    class FlashAttentionBackwardSm90DqParts(base):  # type: ignore[misc, valid-type]
        """The KV64 backward; the MMA warpgroup sends its dQ to L2 itself, in parts."""

        dq_staging = staging

        def _setup_attributes(self) -> None:
            _check_supported(self)
            staging.check(self.Q_stage, self.tile_m * self.tile_hdim)
            super()._setup_attributes()
            if ctas_per_sm == 2:
                self.num_mma_regs_wg0 = self.num_mma_regs_wg1 = MMA_REGISTERS_TWO_CTAS
                self.num_mma_regs = MMA_REGISTERS_TWO_CTAS
                self.num_producer_regs = PRODUCER_REGISTERS

        def _get_shared_storage_cls(self) -> Any:
            upstream = base._get_shared_storage_cls(self)
            if dq_path == "ds":  # no dQ buffers: dS's staging tile and one word
                return storage_with_dq_buffers(upstream, DS_OUT_WORDS)
            values = staging.buffer_values(self.tile_m * self.tile_hdim)
            return storage_with_dq_buffers(upstream, values)

        def kernel(self, *args: Any, **kwargs: Any) -> Any:
            launcher = base.kernel(self, *args, **kwargs)
            return BoundLauncher(launcher, ctas_per_sm) if ctas_per_sm > 1 else launcher

        def dQaccum_store(self, mdQaccum: Any, sdQaccum: Any, *args: Any, **kwargs: Any) -> None:
            """Upstream's warp 1: with the producer sender, it sends the parts (`_producer`)."""
            if staging.sender == "producer" and dq_path != "ds":
                _producer()(self, sdQaccum)

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            bound = _mma_signature().bind(self, *args, **kwargs).arguments
            if dq_path == "ds":
                from flash_attn_vsa import bwd_sm90_ds_out

                with bwd_sm90_ds_out.traced_step_operands(bound):
                    result = base.mma(self, *args, **kwargs)
                    _reductions_read()(bound["tidx"])  # the last dS copy has read its tile
                return result
            names = ("mdQaccum", "sdQaccum", "r2s_tiled_copy_dQaccum", "tidx")
            if staging.sender == "producer":
                _handover_init()(self, bound["sdQaccum"], bound["tidx"])
            with traced("dq_parts", tuple(bound[n] for n in names)):
                result = base.mma(self, *args, **kwargs)
            if staging.sender == "producer":
                _handover_end()(self, bound["sdQaccum"], bound["tidx"])
            else:
                _reductions_read()(bound["tidx"])
            return result

        mma_one_m_block = _one_query_block(dq_path)

    if dq_path == "ds":
        name = "FlashAttentionBackwardSm90DsOut"
    else:
        name = f"FlashAttentionBackwardSm90Dq{staging.parts}Parts{staging.buffers}Buffers"
        name += "Producer" if staging.sender == "producer" else ""
    name += ("TwoCtas" if ctas_per_sm == 2 else "") + ("NoDq" if dq_path == "none" else "")
    cls = FlashAttentionBackwardSm90DqParts
    cls.__name__ = cls.__qualname__ = name
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
        raise ValueError(f"the dQ-parts backward does not support {', '.join(used)}")


def _part_values(kernel: Any) -> int:
    """float32 values in one part of a step's dQ (the step's tile_m x head-dim tile over the
    kernel's ``dq_staging.parts``)."""
    return kernel.tile_m * kernel.tile_hdim // kernel.dq_staging.parts


def _handover_words(kernel: Any, sdQaccum: Any) -> Any:
    """The producer sender's shared state after the dQ buffers, as an Int64 pointer ``w``:
    ``w + b`` is mbarrier ``free[b]`` (one arrival: the producer, once a part's reduce-add has
    read buffer ``b``), ``w + buffers + b`` is ``written[b]`` (128 arrivals: the MMA threads,
    once their values are in) and ``w + 2 buffers + b`` buffer ``b``'s address slot (MMA
    thread 0 writes where the part goes; 0 ends the producer's loop). A pointer rather than an
    object: values the DSL carries through run-time branches must be its own."""
    import cutlass
    from cutlass import cute

    staging = kernel.dq_staging
    part_values = _part_values(kernel)
    return cute.recast_ptr(sdQaccum.iterator + part_values * staging.buffers, dtype=cutlass.Int64)


def _handover_barrier() -> Any:
    """MMA warpgroup + producer warp (160 threads) on upstream's dQEmptyWG0 barrier, which
    nothing else uses once upstream's dQ staging is gone."""
    from cutlass import pipeline
    from flash_attn.cute.named_barrier import NamedBarrierBwd

    return pipeline.NamedBarrier(barrier_id=int(NamedBarrierBwd.dQEmptyWG0), num_threads=160)


@functools.cache
def _handover_init() -> Any:
    """MMA thread 0 initializes the handover's mbarriers; the producer warp waits for that at
    the barrier it meets first (`_producer`)."""
    import cutlass
    from cutlass import cute

    @cute.jit
    def init(kernel: Any, sdQaccum: Any, tidx: Any) -> None:
        words = _handover_words(kernel, sdQaccum)
        buffers = kernel.dq_staging.buffers
        if tidx == 0:
            for b in cutlass.range_constexpr(buffers):
                cute.arch.mbarrier_init(words + b, 1)
                cute.arch.mbarrier_init(words + buffers + b, 128)
            cute.arch.mbarrier_init_fence()
        _handover_barrier().arrive_and_wait()

    return init


@functools.cache
def _handover_end() -> Any:
    """After the last step: one more handover, of address 0, which ends the producer's loop.
    A step hands each buffer over an even number of times, so the handover after the last one
    is buffer 0's, with the phases of its first use."""
    import cutlass
    from cutlass import cute

    @cute.jit
    def end(kernel: Any, sdQaccum: Any, tidx: Any) -> None:
        words = _handover_words(kernel, sdQaccum)
        buffers = kernel.dq_staging.buffers
        cute.arch.mbarrier_wait(words, 1)  # free[0]
        if tidx == 0:
            cute.make_tensor(words + 2 * buffers, cute.make_layout(1))[0] = cutlass.Int64(0)
        cute.arch.mbarrier_arrive(words + buffers)  # written[0]

    return end


@functools.cache
def _producer() -> Any:
    """Warp 1's loop: for each part in turn, wait until the MMA threads have written it, send
    it (one bulk reduce-add from lane 0), and once the reduce-add of ``buffers - 1`` parts
    earlier has read its buffer, hand that buffer back. Ends at address 0."""
    import cutlass
    from cutlass import cute
    from quack import copy_utils

    @cute.jit
    def producer(kernel: Any, sdQaccum: Any) -> None:
        words = _handover_words(kernel, sdQaccum)
        buffers = kernel.dq_staging.buffers
        part_values = _part_values(kernel)
        _handover_barrier().arrive_and_wait()  # the mbarriers are initialized
        if cute.arch.lane_idx() == 0:
            part = cutlass.Int32(0)
            running = cutlass.Boolean(True)
            while running:
                b = part % buffers
                cute.arch.mbarrier_wait(words + buffers + b, (part // buffers) % 2)
                address = cute.make_tensor(words + 2 * buffers + b, cute.make_layout(1))[0]
                running = address != 0
                if running:
                    target = cute.make_ptr(
                        cutlass.Float32, address, cute.AddressSpace.gmem, assumed_align=16
                    )
                    source = sdQaccum.iterator + b * part_values
                    copy_utils.cpasync_reduce_bulk_add_f32(source, target, part_values * 4)
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(buffers - 1, read=True)
                    if part >= buffers - 1:
                        cute.arch.mbarrier_arrive(words + (part - (buffers - 1)) % buffers)
                    part += 1
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    return producer


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


DS_OUT_WORDS = 64 * 64 * 2 // 4 + 32
"""32-bit words of shared memory the ``ds`` path keeps in place of the dQ buffers: dS's 8 KB
staging tile, then the first-step word (`bwd_sm90_ds_out`)."""


def _one_query_block(dq_path: str = "send") -> Any:
    """Our ``mma_one_m_block``, traced by the DSL (its loops and ``const_expr`` branches are
    rewritten by the DSL's preprocessor, which resolves ``cutlass`` through this closure)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.nvgpu import warpgroup
    from quack import copy_utils, layout_utils

    from flash_attn_vsa import bwd_sm90_ds_out as ds_out

    @cute.jit
    def send_dq_in_parts(self, acc_dQ, m_block, q_idx, mask_fn, barrier) -> None:
        """dQ into L2 in ``staging.parts`` bulk reduce-adds (`DqStaging`). Sent by MMA thread
        0: for each part it waits until the reduce-add that last used the part's buffer has
        read it, every thread writes its values, and it sends them. Sent by the producer warp
        (`_producer`): every thread waits for the buffer's ``free`` mbarrier, writes, and
        arrives on ``written``; thread 0 first leaves the part's address in the slot."""
        staging = self.dq_staging
        part_values = _part_values(self)
        chunk, sdQ, r2s_copy, tidx = _dq_target(self, m_block, mask_fn)
        # One part of upstream's staging layout, made here: layouts made by the host-side
        # call may not be used inside the kernel.
        part_layout = cute.make_layout((part_values, 1))
        if cutlass.const_expr(staging.sender == "producer"):
            words = _handover_words(self, sdQ)
        for h in cutlass.range_constexpr(staging.parts):
            buffer = h % staging.buffers
            if cutlass.const_expr(staging.parts % staging.buffers):
                buffer = q_idx  # one part a step, a buffer per Q stage
            sdQ_part = cute.make_tensor(sdQ.iterator + buffer * part_values, part_layout)
            tdQs = r2s_copy.get_slice(tidx).partition_D(sdQ_part)
            values = cute.make_tensor(
                acc_dQ.iterator + h * cute.size(tdQs), cute.make_layout(tdQs.shape)
            )
            if cutlass.const_expr(staging.sender == "producer"):
                use = h // staging.buffers  # parity of the buffer's use (uses a step are even)
                cute.arch.mbarrier_wait(words + buffer, (use % 2) ^ 1)  # free[buffer]
                cute.autovec_copy(values, tdQs)
                cute.arch.fence_view_async_shared()
                if tidx == 0:
                    slot = cute.make_tensor(
                        words + 2 * staging.buffers + buffer, cute.make_layout(1)
                    )
                    slot[0] = (chunk + h * part_values).toint()
                cute.arch.mbarrier_arrive(words + staging.buffers + buffer)  # written[buffer]
            else:
                if tidx == 0:
                    cute.arch.cp_async_bulk_wait_group(staging.buffers - 1, read=True)
                barrier.arrive_and_wait()  # the buffer is free
                cute.autovec_copy(values, tdQs)
                cute.arch.fence_view_async_shared()
                barrier.arrive_and_wait()  # every value written and visible to the bulk copy
                if tidx == 0:
                    copy_utils.cpasync_reduce_bulk_add_f32(
                        sdQ_part.iterator, chunk + h * part_values, part_values * 4
                    )
                    cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def keep_dq(acc_dQ, sdQ_any) -> None:
        """The ablation's use of dQ: a sum no real dQ reaches decides a shared-memory store,
        so the dQ MMA stays in the kernel while nothing is sent."""
        total = acc_dQ[0]
        for i in cutlass.range_constexpr(1, cute.size(acc_dQ)):
            total = total + acc_dQ[i]
        if total == cutlass.Float32(3.0e38):
            sdQ_any[0] = total

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
        global memory in parts (``send_dq_in_parts``), dK += dS^T Q."""

        dO_state = consumer_state_dO
        if cutlass.const_expr(self.Q_stage == self.dO_stage):
            dO_state = consumer_state_Q
        q_idx = consumer_state_Q.index
        do_idx = dO_state.index if cutlass.const_expr(self.dO_stage > 1) else 0
        pds_idx = q_idx if cutlass.const_expr(self.PdS_stage > 1) else 0

        if cutlass.const_expr(dq_path == "ds"):
            ds_out.note_first_step(consumer_state_Q, dKV_accumulate, mask_fn)  # before barriers
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
        ds_address = None
        if cutlass.const_expr(dq_path == "ds"):
            # under the dV MMA; reads the first-step word between the PdS barriers
            ds_address = ds_out.stage_ds(self, acc_dP, consumer_state_Q)
        cute.arch.fence_view_async_shared()
        PdS_barrier.arrive_and_wait()  # dS visible to the MMAs (and the staged dS to TMA)
        if cutlass.const_expr(dq_path == "ds"):
            ds_out.send_ds(self, ds_address)
            mma_dsq_fn(A_idx=pds_idx, B_idx=q_idx, zero_init=not dKV_accumulate, wg_wait=1)
            pipeline_dO.consumer_release(dO_state)  # dV done once dK's MMA was issued
        else:
            acc_dQ = mma_dsk_fn(A_idx=pds_idx, wg_wait=1)  # dV done once this returns
            pipeline_dO.consumer_release(dO_state)
            mma_dsq_fn(A_idx=pds_idx, B_idx=q_idx, zero_init=not dKV_accumulate, wg_wait=1)
            if cutlass.const_expr(dq_path == "send"):
                send_dq_in_parts(self, acc_dQ, m_block, q_idx, mask_fn, PdS_barrier)  # under dK
            else:
                keep_dq(acc_dQ, _dq_target(self, m_block, mask_fn)[1])
        warpgroup.wait_group(0)
        pipeline_Q.consumer_release(consumer_state_Q)

        consumer_state_Q.advance()
        consumer_state_dO.advance()
        return consumer_state_Q, consumer_state_dO

    return mma_one_m_block


def _dq_target(kernel: Any, m_block: Any, mask_fn: Any) -> tuple[Any, Any, Any, Any]:
    """(query block ``m_block``'s chunk of upstream's float32 accumulator, the dQ buffers,
    upstream's staging copy, the MMA thread index), from what the kernel's ``mma`` pushed."""
    from flash_attn.cute import utils

    mdQaccum, sdQaccum, r2s_copy, tidx = trace_stack("dq_parts")[-1]
    tile = getattr(mask_fn, "keywords", {})
    if "head_idx" not in tile or "batch_idx" not in tile:
        raise NotImplementedError("the dQ-parts backward runs the block-sparse loop only")
    step_values = kernel.tile_m * kernel.tile_hdim
    chunk = utils.elem_pointer(
        mdQaccum[None, tile["head_idx"], tile["batch_idx"]], m_block * step_values
    )
    return chunk, sdQaccum, r2s_copy, tidx


def _to_operand(acc: Any, dtype: Any) -> Any:
    """An MMA accumulator as the 16-bit A operand of the next MMA."""
    from flash_attn.cute import utils
    from quack import layout_utils

    return utils.cvt_f16(layout_utils.reshape_acc_to_frgA(acc), dtype)

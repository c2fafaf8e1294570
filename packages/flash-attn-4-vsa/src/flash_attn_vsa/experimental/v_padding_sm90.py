"""Partial key blocks' V padding zeroed in shared memory (sm_90): the fork's eleventh delta
(experimental: vsa-fa4 runs it on request, ``ForwardVariant(zero_v_padding=True)``), so that the
64x64 forward reads V as it is, whatever its padding slots hold. Measured on an H200 (session
25, `bench_video.py`, forward, 87.5%): the op's inference peak 1.32x / 1.40x / 1.41x of dense
FA4's at Wan 2.1 480p / 720p / HunyuanVideo instead of 2.54x / 2.62x / 2.58x with the copy,
but its forward 10.4% / 13.5% / 13.9% slower back to back (7.6% / 15.3% / 14.6% one call
waited for). At the kernel level (experiment
19, a quarter of the key blocks partial) +3.4% over the forward without it: about 14% of a
partial step, half of it the proxy fence, half the stores.

Why (issue 19's memory target; NOTES.md, session 23): FA4's forward lands a partial key
block's whole 64-row V tile in shared memory, padding rows included, and P V multiplies them by
the zero probabilities the column limit (`mask_sm90`) gives their scores. 0 x NaN is NaN, so
vsa-core hands fa4 a copy of v with zeroed padding: at Wan 2.1 720p 900 MiB, the largest
single buffer of the op's inference peak after its output, and a write pass over v before the
fine kernel. Here the consumer warpgroup zeroes the rows at and past the block's valid size in
the V stage itself, after that stage lands and before the P V product that reads it; K's
padding needs nothing (the column limit sets its scores to -inf whatever they were).

Where, in upstream's consumer with intra-warpgroup overlap (the two-CTA 64x64 forward's): step
j issues QK^T of block j, waits for block j - 1's V stage, issues that block's P V, and waits
for both. The zeroing runs right before that P V is issued (the stage has landed; QK^T of
block j is in flight), on the stage P V reads, when block j - 1 is partial. Which it is, and
its valid size, the step reads from the lists again: upstream walks the partial list from its
end, so in a partial step block j - 1 is the partial list's next entry (delta 10's packed
entry, `valid_in_list_sm90`: block and size in one int32); in the first full step after the
partial list (the one upstream masks with the sequence length) it is the partial list's entry
0; later full steps zero nothing; the tile's last half-step (the last block's P V) zeroes when
the tile has no full block (the count upstream loads, recorded). Per partial block and thread:
at most eight 16-byte shared stores (rows at and past the valid size), a proxy fence (the
stores are generic-proxy writes, the wgmma an async-proxy read) and one named barrier over the
warpgroup (all four warps wrote rows the wgmma reads). With at least two key/value stages no
product in flight reads the stage being zeroed. Two other placements measured the same through
the whole op (NOTES.md, session 25): at the end of step j on block j's stage, and in step j
right after block j - 1's P V was issued.

`with_v_padding_zeroed(base)` subclasses a sm_90 forward kernel class built with
`valid_in_list_sm90.with_valid_sizes_in_list` (the entries come from its holder): its ``mma``
records V's stages, the thread index and the full counts while upstream traces it; its
overlapped step and last half-step wrap upstream's P V product with the zeroing.

Upstream internals this relies on (fingerprinted): ``FlashAttentionForwardSm90.mma`` taking
``sVt`` (V's stages transposed, ``layout_utils.transpose_view``), ``tidx`` (0-127 for one MMA
warpgroup) and ``blocksparse_tensors`` (a named tuple whose ``full_block_cnt`` the consumer
reads by element once per work tile); the block-sparse loop (``consume_block_sparse_loads``)
walking the partial list from its last entry, reading each entry right before its step, and
passing ``mma_one_n_block_intrawg_overlap`` its ``mask_fn`` as a ``functools.partial`` whose
``mask_mod`` is set on partial steps only and whose ``mask_seqlen`` is set on the first full
step only; ``mma_one_n_block_intrawg_overlap`` and ``last_half_block_overlap`` taking the P V
product as the keyword ``mma_pv_fn`` and calling it with the stage as ``B_idx`` after that
stage's wait; ``NamedBarrierFwd`` listing the named barriers the forward uses.
"""

from __future__ import annotations

import functools
from typing import Any

from flash_attn_vsa import build_scope, sm90_operands
from flash_attn_vsa.valid_in_list_sm90 import BLOCK_BITS, entry_valid_size

__all__ = ["with_v_padding_zeroed"]

_STACK = "v_padding"
WARPGROUP_THREADS = 128


class _VStages:
    """Trace-time: what the zeroing needs from upstream's ``mma`` (its V stages as
    [tile_n, head_dim_v, stages], the consumer's thread index) and, per work tile, the full
    list's count (recorded where upstream loads it)."""

    def __init__(self, sV: Any, tidx: Any) -> None:
        self.sV = sV
        self.tidx = tidx
        self.full_count: Any = None


class _RecordedCounts(sm90_operands.PipelineStandIn):
    """The full lists' counts tensor, recording in its `_VStages` the count upstream's consumer
    reads for its work tile (carried through upstream's loops as the wrapped tensor's values,
    like the fork's pipeline stand-ins)."""

    def __getitem__(self, index: Any) -> Any:
        result = self._inner[index]
        (stages,) = self._extra
        stages.full_count = result
        return result


@functools.cache
def _barrier_id() -> int:
    """A named barrier the forward does not use: the next after upstream's (0 is
    ``__syncthreads``)."""
    from flash_attn.cute.named_barrier import NamedBarrierFwd

    barrier = max(int(b) for b in NamedBarrierFwd) + 1
    if barrier > 15:
        raise RuntimeError("no named barrier left for v_padding_sm90 (16 per CTA)")
    return barrier


@functools.cache
def store_zeros_fn() -> Any:
    """The jitted stores of zeros into one V stage's rows ``first_row <= row < end_row`` by the
    warpgroup's threads (16-byte stores, at most eight a thread), without fence or barrier
    (experiment 19 builds its variants on it)."""
    import cutlass
    import cutlass.cute as cute
    from quack import copy_utils

    @cute.jit
    def store_zeros(
        stage: cute.Tensor, first_row: cutlass.Int32, end_row: cutlass.Int32, tidx: cutlass.Int32
    ):
        rows, cols = cute.size(stage, mode=[0]), cute.size(stage, mode=[1])
        vector = 128 // stage.element_type.width  # 16-byte stores
        tiled = copy_utils.tiled_copy_2d(
            stage.element_type, cols // vector, WARPGROUP_THREADS, vector
        )
        thread = tiled.get_slice(tidx)
        destination = thread.partition_D(stage)
        coords = thread.partition_D(cute.make_identity_tensor((rows, cols)))
        zeros = cute.make_rmem_tensor_like(destination[None, 0, None])
        zeros.fill(0)
        for m in cutlass.range_constexpr(cute.size(destination, mode=[1])):
            row = coords[0, m, 0][0]
            if row >= first_row and row < end_row:
                cute.copy(tiled, zeros, destination[None, m, None])

    return store_zeros


@functools.cache
def _zero_rows_fn() -> Any:
    """The jitted zeroing of one V stage's rows from ``first_row`` on, when ``needed`` (a
    dynamic ``if`` needs a jitted body), then the proxy fence and the warpgroup barrier."""
    import cutlass
    import cutlass.cute as cute

    barrier = _barrier_id()
    store_zeros = store_zeros_fn()

    @cute.jit
    def zero_rows_from(
        stage: cute.Tensor, first_row: cutlass.Int32, tidx: cutlass.Int32, needed: cutlass.Boolean
    ):
        if needed:
            store_zeros(stage, first_row, cute.size(stage, mode=[0]), tidx)
            cute.arch.fence_view_async_shared()  # generic-proxy stores before the wgmma reads
            cute.arch.barrier(barrier_id=barrier, number_of_threads=WARPGROUP_THREADS)

    return zero_rows_from


def _stages() -> _VStages:
    stages = build_scope.trace_stack(_STACK)
    if not stages:
        raise RuntimeError("v_padding_sm90's step ran outside its kernel class's mma")
    return stages[-1]


def _zeroing_before(product: Any, first_row: Any, needed: Any) -> Any:
    """``product`` (upstream's P V issue, called once its V stage landed, with the stage as
    ``B_idx``) preceded by the zeroing of that stage's rows from ``first_row`` on."""
    v = _stages()

    def zero_then_product(*args: Any, **kwargs: Any) -> Any:
        _zero_rows_fn()(v.sV[None, None, kwargs["B_idx"]], first_row, v.tidx, needed)
        return product(*args, **kwargs)

    return zero_then_product


@functools.cache
def with_v_padding_zeroed(base: type) -> type:
    """A subclass of the sm_90 forward kernel class ``base`` (built with valid sizes in its
    lists) whose consumer zeroes partial key blocks' V padding rows in shared memory (see the
    module doc)."""
    import cutlass
    from quack import layout_utils

    class VPaddingZeroed(base):  # type: ignore[misc, valid-type]
        """``base`` zeroing partial key blocks' V padding rows before P V reads them."""

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            if not self.intra_wg_overlap or self.num_stages < 2 or self.num_wg_mma != 1:
                raise ValueError(
                    "zeroing V's padding in shared memory needs one MMA warpgroup with "
                    "intra-warpgroup overlap and at least two key/value stages, got "
                    f"{self.num_wg_mma} warpgroups, overlap {self.intra_wg_overlap}, "
                    f"{self.num_stages} stages"
                )
            bound = sm90_operands.upstream_mma_arguments(self, args, kwargs)
            given = bound.arguments
            stages = _VStages(layout_utils.transpose_view(given["sVt"]), given["tidx"])
            sparse = given["blocksparse_tensors"]
            if sparse is None or sparse.full_block_cnt is None:
                raise ValueError("zeroing V's padding needs block-sparse full and partial lists")
            given["blocksparse_tensors"] = sparse._replace(
                full_block_cnt=_RecordedCounts(sparse.full_block_cnt, stages)
            )
            with build_scope.traced(_STACK, stages):
                return base.mma(*bound.args, **bound.kwargs)

        def mma_one_n_block_intrawg_overlap(self, smem_pipe_read: Any, **kwargs: Any) -> Any:
            # the P V of this step is the previous block's: partial when this step is a
            # partial one (the previous is the entry after it: upstream walks the partial
            # list from its end) or the first full step after the partial list (the previous
            # is the partial list's entry 0: upstream masks that step's sequence length, the
            # later full steps' not)
            mask_fn = kwargs["mask_fn"]
            partial_step = mask_fn.keywords.get("mask_mod") is not None
            first_full_after_partial = not partial_step and mask_fn.keywords.get("mask_seqlen")
            if partial_step or first_full_after_partial:
                held = entry_valid_size()
                previous = held.row[held.index + 1] if partial_step else held.row[0]
                kwargs["mma_pv_fn"] = _zeroing_before(
                    kwargs["mma_pv_fn"], previous >> BLOCK_BITS, cutlass.Boolean(True)
                )
            return super().mma_one_n_block_intrawg_overlap(smem_pipe_read, **kwargs)

        def last_half_block_overlap(self, *args: Any, **kwargs: Any) -> Any:
            # the last block: partial exactly when the tile has no full block (the partial
            # list's entry 0)
            held, v = entry_valid_size(), _stages()
            if held.row is None or v.full_count is None:
                raise RuntimeError(
                    "the last half-step ran before the lists were read; v_padding_sm90 needs a "
                    "review against this upstream version"
                )
            kwargs["mma_pv_fn"] = _zeroing_before(
                kwargs["mma_pv_fn"], held.row[0] >> BLOCK_BITS, v.full_count == 0
            )
            return super().last_half_block_overlap(*args, **kwargs)

    VPaddingZeroed.__name__ = VPaddingZeroed.__qualname__ = f"{base.__name__}VPaddingZeroed"
    return VPaddingZeroed

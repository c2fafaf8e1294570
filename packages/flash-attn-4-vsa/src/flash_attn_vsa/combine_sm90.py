"""VSA's combine in the forward's epilogue on Hopper (sm_90): the fork's ninth delta.

VSA's output is ``fine + gate * coarse[query block]``: the block-sparse attention's output plus
the coarse attention's (one row per 64-token query block, broadcast over its rows), weighted by
a gate shaped like the output (or by 1). Run as its own pass after the forward, that combine
reads the forward's output and the gate and writes the result: at Wan 2.1 720p (40 heads,
92,160 tokens) 0.9 GB read twice and written once, and a launch, for a result the forward's epilogue
already holds in registers. This delta adds ``gate * coarse`` to the forward's float32
accumulator before it is rounded and stored, so the op writes its output once, rounded once
(the separate pass rounds the fine output first, then the sum).

`with_combined_epilogue(base, gated)` subclasses a sm_90 forward kernel class (delta 2's
two-CTA class, with or without delta 5's Q in registers):

- the combine's operands arrive as the last aux tensors (``coarse`` [B, NQ, H, D], then with
  ``gated`` the gate [B, S, H, D], any stride 0), after the partial-block mask's valid sizes
  when the kernel has that mask (`mask_sm90` reads ``aux_tensors[0]``);
- its consumer (``mma``) pushes them on a trace-time stack (`build_scope.traced`) while
  upstream traces it, and its ``epilogue`` reads them there, adds the product to the
  accumulator in the MMA's own register partition, then runs upstream's epilogue.

Only the two-CTA 64x64 kernel takes it (`fwd_sm90.ForwardKernel` refuses it elsewhere): there a
query block is one CTA's tile, so a CTA reads one coarse row. No log-sum-exp is computed with
the combine (the entry point asks upstream's launcher for none: the output of an inference
call). Measured on an H200 (`research.fa4_fork.experiments.combined_epilogue`, session 18):
the epilogue adds no measurable time to the kernel and saves the pass (0.09 / 0.88 ms at Wan
2.1 480p / 720p).

Upstream internals this relies on (fingerprinted in ``upstream_api.json``): ``mma``'s parameter
``aux_data`` (an ``AuxData`` whose ``tensors`` are the launcher's aux tensors in order), ``mma``
calling ``self.epilogue(acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O,
tiled_mma, tidx, m_block, head_idx, batch_idx)`` once per work tile with the normalized float32
accumulator of the PV MMA ``tiled_mma``, before it converts and stores it.
"""

from __future__ import annotations

import functools
from typing import Any

from flash_attn_vsa import build_scope, sm90_operands

__all__ = [
    "COMBINE_KINDS",
    "GATED",
    "UNGATED",
    "check_operands",
    "combine_operands",
    "with_combined_epilogue",
]

UNGATED = "coarse"
"""``fine + coarse[query block]``: the aux tensors end with ``coarse``."""
GATED = "gated"
"""``fine + gate * coarse[query block]``: the aux tensors end with ``coarse, gate``."""
COMBINE_KINDS = ("", UNGATED, GATED)
"""What a `fwd_sm90.ForwardKernel`'s ``combine`` may be ("": no combine, upstream's epilogue)."""

_STACK = "combine"


def combine_operands(coarse: Any, gate: Any) -> tuple[str, list[Any]]:
    """The combine kind and the aux tensors to append for these operands (``gate`` None:
    ungated)."""
    if gate is None:
        return UNGATED, [coarse]
    return GATED, [coarse, gate]


def check_operands(q: Any, v: Any, coarse: Any, gate: Any, lse: Any) -> None:
    """ValueError naming the argument unless ``coarse`` is [B, S / 64, H, Dv] and ``gate``
    (when given) [B, S, H, Dv], both in q's dtype and on its device, and ``lse`` is None."""
    from flash_attn_vsa.sm90_blocks import BLOCK_SIZE

    batch, seq, heads, _ = q.shape
    dim = v.shape[-1]
    # torch.Size compares equal to a tuple: no conversion (this runs on every combined call)
    for name, t, expected in (
        ("coarse", coarse, (batch, seq // BLOCK_SIZE[0], heads, dim)),
        ("gate", gate, (batch, seq, heads, dim)),
    ):
        if t is None:
            continue
        if t.shape != expected:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got "
                f"{t.dtype}, {t.device}"
            )
    if lse is not None:
        raise ValueError("lse must be None with coarse (the combined forward returns none)")


def _add_gated_coarse(
    acc_O: Any,
    tiled_mma: Any,
    tidx: Any,
    m_block: Any,
    head_idx: Any,
    batch_idx: Any,
    tile_m: int,
    tile_d: int,
    coarse: Any,
    gate: Any,
) -> None:
    """acc_O += gate * coarse[batch, m_block, head] on this thread's part of the (tile_m,
    tile_d) output tile (the PV MMA's C partition; ``gate`` None: acc_O += coarse row)."""
    import cutlass.cute as cute
    from cutlass import Float32

    thr_mma = tiled_mma.get_slice(tidx)
    row = coarse[batch_idx, m_block, head_idx, None]  # (D,)
    # the block's coarse row, broadcast over its tile_m rows (row stride 0)
    rows_layout = cute.make_layout((tile_m, tile_d), stride=(0, row.layout.stride[0]))
    tCoarse = thr_mma.partition_C(cute.make_tensor(row.iterator, rows_layout))
    rCoarse = cute.make_fragment_like(tCoarse)
    cute.autovec_copy(tCoarse, rCoarse)
    added = rCoarse.load().to(Float32)
    if gate is not None:
        gate_tile = cute.local_tile(
            gate[batch_idx, None, head_idx, None], (tile_m, tile_d), (m_block, 0)
        )
        tGate = thr_mma.partition_C(gate_tile)
        rGate = cute.make_fragment_like(tGate)
        cute.autovec_copy(tGate, rGate)
        added = added * rGate.load().to(Float32)
    acc_O.store(acc_O.load() + added)


@functools.cache
def with_combined_epilogue(base: type, gated: bool) -> type:
    """A subclass of the sm_90 forward kernel class ``base`` whose epilogue adds VSA's
    ``gate * coarse[query block]`` (``gated``) or ``coarse[query block]`` to the output before
    storing it; the operands are the launch's last aux tensors (see the module doc)."""
    operand_count = 2 if gated else 1

    class CombinedEpilogue(base):  # type: ignore[misc, valid-type]
        """``base`` with VSA's combine in its epilogue."""

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            bound = sm90_operands.upstream_mma_arguments(self, args, kwargs)
            bound.apply_defaults()
            tensors = bound.arguments["aux_data"].tensors
            if tensors is None or len(tensors) < operand_count:
                raise ValueError(
                    f"the combined epilogue needs {operand_count} aux tensor(s) (coarse"
                    f"{', gate' if gated else ''}), got {0 if tensors is None else len(tensors)}"
                )
            operands = tuple(tensors[-operand_count:])
            with build_scope.traced(_STACK, operands):
                return base.mma(*bound.args, **bound.kwargs)

        def epilogue(
            self, acc_O: Any, lse: Any, mO: Any, mLSE: Any, sO: Any, seqlen: Any,
            gmem_tiled_copy_O: Any, tma_atom_O: Any, tiled_mma: Any, tidx: Any, m_block: Any,
            head_idx: Any, batch_idx: Any,
        ) -> Any:  # fmt: skip
            stack = build_scope.trace_stack(_STACK)
            if not stack:
                raise RuntimeError(
                    "upstream's sm_90 forward ran its epilogue outside its consumer (mma); "
                    "combine_sm90 needs a review against this upstream version"
                )
            coarse, *rest = stack[-1]
            _add_gated_coarse(
                acc_O, tiled_mma, tidx, m_block, head_idx, batch_idx, self.tile_m,
                self.tile_hdimv, coarse, rest[0] if rest else None,
            )  # fmt: skip
            return base.epilogue(
                self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O,
                tiled_mma, tidx, m_block, head_idx, batch_idx,
            )  # fmt: skip

    suffix = "CombinedGated" if gated else "Combined"
    CombinedEpilogue.__name__ = CombinedEpilogue.__qualname__ = f"{base.__name__}{suffix}"
    return CombinedEpilogue

"""Q in registers for the sm_90 forward's QK^T: the fork's fifth delta (shipped: vsa-fa4 runs
it in the two-CTA 64x64 forward).

Why (a count, NOTES.md): a Hopper wgmma m64nNk16 with both operands in shared memory reads
2 KB of A and 32N B of B per 2,048N FLOP. In the 64x64 forward QK^T is such a wgmma at N = 64
(128 B per clock at the tensor cores' peak, all of an SM's shared-memory bandwidth); PV already
takes P from registers (64 B per clock) and each CTA lands its own K and V (another 64 B per
clock). About 160 B per clock wanted against 128: a bound near 0.8 of the tensor-core peak that
dense's 128x128 tiles do not have. With Q in registers QK^T reads only K. Experiment 10 measured
it on an H200 (session 8): the two-CTA 64x64 forward +1.3-2.5% of dense, the paired 128x64 one
-2%, so vsa-fa4 runs it in the former only (``vsa_fa4.launch.Q_IN_REGISTERS_WHERE_FASTER``).

`with_q_in_registers(base)` subclasses a sm_90 forward kernel class (delta 2's two-CTA class):

- its QK^T tiled MMA takes A from registers (``_get_tiled_mma``);
- upstream's consumer (``mma``) is run with a stand-in for its Q pipeline whose consumer wait,
  once per work tile, also copies the tile's Q from shared memory into the MMA's A fragment
  (ldmatrix, 32 registers per thread at head dim 128), so every QK^T of the tile reads it there;
- the fragment is the one upstream's ``mma`` partitions, recorded by a partition hook
  (`flash_attn_vsa.sm90_operands`) while that ``mma`` is traced on this thread.

Q's shared memory stays allocated (upstream stages O there for the epilogue). The kernel body,
its pipelines and the epilogue are upstream's.

Upstream internals this relies on (fingerprinted in ``upstream_api.json``):
``FlashAttentionForwardSm90._get_tiled_mma`` returning the (QK^T, PV) tiled MMAs, ``mma``'s
parameters ``tiled_mma_qk``, ``sQ``, ``pipeline_q`` and ``tidx``, ``mma`` waiting on
``pipeline_q.consumer_wait_w_index_phase`` once per work tile before that tile's first QK^T
and partitioning QK^T's operands with ``sm90_utils.partition_fragment_ABC`` (see
`flash_attn_vsa.sm90_operands`), and ``quack.copy_utils.get_smem_load_atom``.
"""

from __future__ import annotations

import functools
from typing import Any

from flash_attn_vsa import sm90_operands

__all__ = ["with_q_in_registers"]


class _QFragment:
    """Filled while upstream's ``mma`` is traced: QK^T's A operand in registers."""

    fragment: Any = None

    def record(self, thr_mma, shape_mnk, sA, sB, acc, rA, rB) -> None:
        """Partition hook: keep the A fragment of the call that partitions Q for a
        register-A MMA (upstream's register-A MMA is PV, whose shared A operand is None)."""
        from cutlass.cute.nvgpu import warpgroup

        if sA is not None and thr_mma.op.a_src == warpgroup.OperandSource.RMEM:
            self.fragment = rA


def _copy_q_to_registers(tiled_mma_qk: Any, sQ: Any, tidx: Any, fragment: Any) -> None:
    """ldmatrix the tile's Q (tile_m x head dim) from shared memory into QK^T's A fragment."""
    import cutlass.cute as cute
    from quack import copy_utils

    atom = copy_utils.get_smem_load_atom(sQ.element_type, transpose=False)
    tiled_copy = cute.make_tiled_copy_A(atom, tiled_mma_qk)
    thr_copy = tiled_copy.get_slice(tidx)
    cute.copy(tiled_copy, thr_copy.partition_S(sQ), thr_copy.retile(fragment))


class _PipelineQToRegisters(sm90_operands.PipelineStandIn):
    """Upstream's Q pipeline, except that the consumer's wait for a tile's Q also copies it
    into the register fragment (extra state: the QK^T tiled MMA, sQ, tidx, the `_QFragment`)."""

    def consumer_wait_w_index_phase(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner.consumer_wait_w_index_phase(*args, **kwargs)
        tiled_mma_qk, sQ, tidx, q = self._extra
        if q.fragment is None:
            raise RuntimeError(
                "upstream's sm_90 forward waited for Q before partitioning QK^T's operands; "
                "q_regs_sm90 needs a review against this upstream version"
            )
        _copy_q_to_registers(tiled_mma_qk, sQ, tidx, q.fragment)
        return result


@functools.cache
def with_q_in_registers(base: type) -> type:
    """A subclass of the sm_90 forward kernel class ``base`` whose QK^T reads Q from registers
    (loaded once per tile). ``base`` keeps its launch and register split."""
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_helpers
    from cutlass import Float32
    from cutlass.cute.nvgpu import warpgroup

    class QInRegisters(base):  # type: ignore[misc, valid-type]
        """``base`` with QK^T's A operand (Q) in registers."""

        def _get_tiled_mma(self) -> tuple[Any, Any]:
            _, tiled_mma_pv = super()._get_tiled_mma()
            tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
                self.dtype,
                self.dtype,
                cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K,
                Float32,
                atom_layout_mnk=(self.tile_m // 64, 1, 1),
                tiler_mn=(64, self.tile_n),
                a_source=warpgroup.OperandSource.RMEM,
            )
            return tiled_mma_qk, tiled_mma_pv

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            bound = sm90_operands.upstream_mma_arguments(self, args, kwargs)
            given = bound.arguments
            q = _QFragment()
            given["pipeline_q"] = _PipelineQToRegisters(
                given["pipeline_q"], given["tiled_mma_qk"], given["sQ"], given["tidx"], q
            )
            with sm90_operands.partition_hooks(after=q.record):
                return base.mma(*bound.args, **bound.kwargs)

    QInRegisters.__name__ = QInRegisters.__qualname__ = f"{base.__name__}QInRegisters"
    return QInRegisters

"""Experiment 20 (session 25, CPU only): can one kernel argument carry two TMA atoms?

Design (b) of delta 11 (NOTES.md, session 25) needs a second V atom (a small box) in a kernel
whose launcher passes one. Upstream's ``self.kernel(...)`` takes fixed arguments, so the second
atom would ride inside the first argument's place. This compiles, for sm_90a on the CPU, a toy
kernel taking such a wrapper (prefetching both descriptors) beside one taking the two atoms as
two arguments. Found: the wrapper crosses the kernel boundary when it forwards the atoms'
``__extract_mlir_attributes__`` (the TMA atoms' ``cute_nvgpu.grid_constant``) as well as their
values. Returning no attributes fails at the launch (operands and argument attributes differ
in count); a wrapper without the method fails in the lowering (``failed to legalize
cute_nvgpu.prefetch_tma_desc``, seen with a first version). ::

    CUTE_DSL_ARCH=sm_90a uv run python -m research.fa4_fork.experiments.two_tma_atoms_cpu
"""

from __future__ import annotations

import os
import sys


class TwoAtoms:
    """Two TMA atoms as one DSL value (values and argument attributes, in order)."""

    def __init__(self, first, second, with_attributes: bool = True) -> None:
        self.first, self.second = first, second
        self.with_attributes = with_attributes

    def __extract_mlir_values__(self):
        import cutlass

        return cutlass.extract_mlir_values(self.first) + cutlass.extract_mlir_values(self.second)

    def __extract_mlir_attributes__(self):
        from cutlass.base_dsl.utils.mlir_value_tree import extract_mlir_attributes

        if not self.with_attributes:
            return []
        return extract_mlir_attributes(self.first) + extract_mlir_attributes(self.second)

    def __new_from_mlir_values__(self, values):
        import cutlass

        count = len(cutlass.extract_mlir_values(self.first))
        return TwoAtoms(
            cutlass.new_from_mlir_values(self.first, values[:count]),
            cutlass.new_from_mlir_values(self.second, values[count:]),
            self.with_attributes,
        )


def compile_case(case: str) -> str:
    """``"two_arguments"``, ``"wrapper"`` or ``"wrapper_without_attributes"``: "ok" or the
    compiler's first error line."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.tensor_utils import LayoutEnum
    from quack import sm90_utils

    # the DSL compiles the jitted bodies below against this module's globals
    globals().update(cutlass=cutlass, cute=cute, cpasync=cpasync)

    @cute.kernel
    def two_arguments(first: cute.CopyAtom, second: cute.CopyAtom):
        cpasync.prefetch_descriptor(first)
        cpasync.prefetch_descriptor(second)

    @cute.kernel
    def wrapped(atoms: TwoAtoms):
        cpasync.prefetch_descriptor(atoms.first)
        cpasync.prefetch_descriptor(atoms.second)

    @cute.jit
    def host(mV: cute.Tensor):
        op = cpasync.CopyBulkTensorTileG2SOp()
        atoms = []
        for rows in (64, 8):  # the stage's box and a small one
            smem = sm90_utils.make_smem_layout(mV.element_type, LayoutEnum.ROW_MAJOR, (rows, 64))
            atoms.append(cpasync.make_tiled_tma_atom(op, mV, smem, (rows, 64))[0])
        if cutlass.const_expr(case == "two_arguments"):
            launch = two_arguments(*atoms)
        else:
            launch = wrapped(TwoAtoms(*atoms, with_attributes=case == "wrapper"))
        launch.launch(grid=(1, 1, 1), block=(32, 1, 1))

    v = make_fake_compact_tensor(cutlass.BFloat16, (4096, 128), stride_order=(1, 0),
                                 assumed_align=16)  # fmt: skip
    try:
        cute.compile(host, v)
    except Exception as error:  # the DSL's compiler errors are of several types
        return str(error).strip().splitlines()[0][:160]
    return "ok"


def main() -> int:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    for case in ("two_arguments", "wrapper", "wrapper_without_attributes"):
        print(f"{case}: {compile_case(case)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

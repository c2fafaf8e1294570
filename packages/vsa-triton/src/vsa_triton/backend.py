"""The ``triton`` backend of vsa-core: portable Triton block-sparse attention.

Registered under the ``vsa.backends`` entry-point group. Triton and the kernels are imported
lazily (on the first call), never when this module is imported. ``supports()`` says exactly
why it refuses a call. Under ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter on
CPU tensors (for tests on machines without a GPU; fp16 only, bf16 dot products are wrong there).

Deterministic by construction, so it accepts ``deterministic=True`` calls (forward and
backward) without a separate path: every output element is written by one program, which sums
in a fixed order (`vsa_triton.kernels`: the forward and the dQ kernel own a query block and
walk its key list in list order; the dK/dV kernel owns a key block and walks its query list,
the CSR transpose sorted by query block; no atomics, no split reductions), and launch
configurations are fixed per shape (`vsa_triton.config`, no autotuning). The L2 rotation of
the forward's lists (`vsa_core.rotation`) depends only on the device and the shape.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, ClassVar

import torch

from vsa_core.backends.base import AttentionCall, Backend
from vsa_triton.environment import interpreting

if TYPE_CHECKING:
    from vsa_core.layout import BlockSparseLayout

BLOCK_SHAPES = ((64, 64), (128, 64), (128, 128), (64, 128))
HEAD_DIMS = (64, 128)
GPU_DTYPES = (torch.float16, torch.bfloat16)


class TritonBackend(Backend):
    """Block-sparse attention forward and backward in Triton (CUDA, sm_80 and newer)."""

    name: ClassVar[str] = "triton"
    key_padding_safe: ClassVar[bool] = True  # masked loads: padding rows are never read
    priority: ClassVar[int] = 10
    handles_deterministic: ClassVar[bool] = True  # always deterministic: see the module doc
    reads_raster: ClassVar[bool] = True  # every row through an index: a map costs one load
    fuses_combine: ClassVar[bool] = True

    def availability(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if not torch.cuda.is_available() and not interpreting():
            return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"
        return None

    def supports(self, call: AttentionCall) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if call.block_shape not in BLOCK_SHAPES:
            shapes = ", ".join(f"{q}x{k}" for q, k in BLOCK_SHAPES)
            return f"block shape {call.block_shape[0]}x{call.block_shape[1]} not in {shapes}"
        if call.head_dim not in HEAD_DIMS:
            return f"head dim {call.head_dim} not in {HEAD_DIMS}"
        if call.device.type == "cpu" and interpreting():
            if call.dtype != torch.float16:
                return "the Triton interpreter runs float16 only (its bf16 dot is wrong)"
            return None
        if call.device.type != "cuda":
            return f"needs a CUDA device, got {call.device.type}"
        if call.dtype not in GPU_DTYPES:
            return f"dtype {call.dtype} not supported (float16, bfloat16)"
        capability = call.capability
        if capability is not None and capability < (8, 0):
            return f"needs sm_80 or newer, got sm_{capability[0]}{capability[1]}"
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from vsa_triton.ops import attention

        return attention(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes,
            scale, layout.q_block, layout.kv_block,
        )  # fmt: skip

    def forward_rows(self, q, k, v, layout, scale, slot_rows):
        from vsa_triton.ops import attention_rows

        return attention_rows(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, slot_rows,
            scale, layout.q_block, layout.kv_block,
        )  # fmt: skip

    def forward_combined(self, q, k, v, layout, scale, coarse, gate, slot_rows=None):
        from vsa_triton.ops import attention_combined

        return attention_combined(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, slot_rows,
            coarse, gate, scale, layout.q_block, layout.kv_block,
        )  # fmt: skip

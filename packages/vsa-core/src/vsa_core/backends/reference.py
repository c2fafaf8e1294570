"""The built-in reference backend: pure PyTorch, any device, any float dtype, autograd."""

from __future__ import annotations

import torch

from vsa_core.backends.base import AttentionCall, Backend
from vsa_core.layout import BlockSparseLayout
from vsa_core.reference import reference_block_sparse_attn


class ReferenceBackend(Backend):
    """Gathers the selected blocks and runs masked softmax attention in float32 chunks.

    Always works, never fast: the fallback of ``backend="auto"`` and the CPU path.
    """

    name = "reference"
    priority = 0
    key_padding_safe = True  # masked with torch.where, never multiplied by 0
    handles_deterministic = True

    def supports(self, call: AttentionCall) -> str | None:
        if call.deterministic and call.requires_grad and call.device.type != "cpu":
            return (
                f"deterministic=True with gradients on {call.device.type}: the reference "
                "gathers key/value blocks with torch.gather, whose backward scatter-adds dK "
                "and dV with floating-point atomics on CUDA (the order of the adds changes "
                "run to run; other devices are unchecked); its forward is deterministic, and "
                "so is its backward on the CPU"
            )
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_block_sparse_attn(q, k, v, layout, scale)

"""How the Triton launches pass tensors: the strides every kernel takes and the one layout
condition they all need (the head dim contiguous). Shared by the attention ops (`vsa_triton.ops`)
and the coarse stage (`vsa_triton.coarse`)."""

from __future__ import annotations

import torch


def head_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its last (head) dim is strided."""
    return t if t.stride(-1) == 1 else t.contiguous()


def bshd_strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a [B, S, H, D] tensor; zeros for None (a kernel argument
    its flags say is never read)."""
    if t is None:
        return (0, 0, 0)
    strides = t.stride()  # one call, not three: launches pass 12-18 of these a training step
    return (strides[0], strides[1], strides[2])


def gate_strides(gate: torch.Tensor | None) -> tuple[int, int, int, int]:
    """A gate's four strides (0 where it broadcasts; zeros without a gate)."""
    return (0, 0, 0, 0) if gate is None else gate.stride()

"""`block_sparse_attn`: vsa-core's block-sparse attention on FA4, with an explicit schedule."""

from __future__ import annotations

import math

import torch

from vsa_core.layout import BlockSparseLayout
from vsa_core.validation import check_qkv
from vsa_fa4.backend import FA4Backend


def block_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockSparseLayout,
    *,
    schedule: str = "auto",
    scale: float | None = None,
    qkv_format: str = "bshd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`vsa_core.block_sparse_attn` on the FA4 backend, with the physical schedule explicit.

    Args:
        q, k, v: BSHD ([B, S, H, D], native) or BHSD with ``qkv_format="bhsd"`` (read through
            strides, no copy); float16 or bfloat16 on a CUDA device of sm_90 or sm_100.
        layout: the selection; its batch, heads and lengths must match q and k.
        schedule: ``"auto"`` (default: pair 64-token query blocks onto 128-row tiles when the
            layout says aligned pairs share key lists), ``"native"`` or ``"paired"`` (see
            `vsa_fa4.schedule`).
        scale: softmax scale, default ``1 / sqrt(D)``.
        qkv_format: ``"bshd"`` or ``"bhsd"``.

    Returns:
        ``(out, lse)``: out in q's format (a view of a BSHD tensor for BHSD); lse [B, H, Sq]
        float32, natural log, -inf for query rows that see no real key (their out is 0).

    Raises ``ValueError`` naming the reason when FA4 cannot run the call (see
    `FA4Backend.supports`).
    """
    check_qkv(q, k, v, qkv_format)
    if qkv_format == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if not isinstance(layout, BlockSparseLayout):
        raise ValueError(f"layout must be a BlockSparseLayout, got {type(layout).__name__}")
    batch, q_len, heads, dim = q.shape
    for what, have, want in (
        ("batch", layout.batch, batch),
        ("heads", layout.heads, heads),
        ("q_len (num_q_blocks * q_block)", layout.q_len, q_len),
        ("kv_len (num_kv_blocks * kv_block)", layout.kv_len, k.shape[1]),
    ):
        if have != want:
            raise ValueError(f"layout must have {what} = {want} to match q/k, got {have}")
    if layout.device != q.device:
        raise ValueError(f"layout must be on q's device {q.device}, got {layout.device}")
    if scale is None:
        scale = dim**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    out, lse = FA4Backend(schedule).forward(q, k, v, layout, float(scale))
    if qkv_format == "bhsd":
        out = out.transpose(1, 2)
    return out, lse

"""`block_sparse_attn`: vsa-core's block-sparse attention on FA4, with an explicit schedule."""

from __future__ import annotations

import torch

from vsa_core.layout import BlockSparseLayout, check_layout_matches
from vsa_core.validation import check_qkv, check_scale
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

    Raises ``ValueError`` naming the argument for inputs `vsa_core.block_sparse_attn` refuses
    (its own checks: `vsa_core.validation.check_qkv`, the layout against q and k,
    `vsa_core.validation.check_scale`), and naming the reason when FA4 cannot run the call (see
    `FA4Backend.supports`).
    """
    check_qkv(q, k, v, qkv_format)
    if qkv_format == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    check_layout_matches(layout, q, k)
    scale = check_scale(scale, q.shape[-1])
    out, lse = FA4Backend(schedule).forward(q, k, v, layout, scale)
    if qkv_format == "bhsd":
        out = out.transpose(1, 2)
    return out, lse

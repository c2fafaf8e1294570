"""Input checks at the public boundary.

Every check raises ``ValueError`` naming the argument and what was expected. Shape, dtype and
device checks read only metadata. Checks that read tensor *data* (index ranges, valid sizes) make
the host wait for the device, so they run only where user data enters and can be switched off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_positive_triple(name: str, value: Sequence[int]) -> tuple[int, int, int]:
    try:
        triple = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be three positive integers, got {value!r}") from None
    if (
        len(triple) != 3
        or any(v <= 0 for v in triple)
        or any(isinstance(v, bool) or int(v) != v for v in value)
    ):
        raise ValueError(f"{name} must be three positive integers, got {value!r}")
    return triple  # type: ignore[return-value]


def check_block_shape(block_shape: Sequence[int]) -> tuple[int, int]:
    try:
        pair = tuple(int(v) for v in block_shape)
    except (TypeError, ValueError):
        raise ValueError(
            f"block_shape must be two positive integers (q_block, kv_block), got {block_shape!r}"
        ) from None
    if len(pair) != 2 or any(v <= 0 for v in pair):
        raise ValueError(
            f"block_shape must be two positive integers (q_block, kv_block), got {block_shape!r}"
        )
    return pair  # type: ignore[return-value]


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str
) -> tuple[int, int, int, int, int]:
    """Check q/k/v agree; return (batch, q_len, kv_len, heads, head_dim)."""
    if qkv_format not in ("bshd", "bhsd"):
        raise ValueError(f"qkv_format must be 'bshd' or 'bhsd', got {qkv_format!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D ({qkv_format.upper()}), got shape {tuple(t.shape)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    seq_dim, head_dim_ = (1, 2) if qkv_format == "bshd" else (2, 1)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must have q's batch size {q.shape[0]}, got {t.shape[0]}")
        if t.shape[head_dim_] != q.shape[head_dim_]:
            raise ValueError(
                f"{name} must have q's number of heads {q.shape[head_dim_]} "
                f"(dim {head_dim_} of {qkv_format.upper()}), got {t.shape[head_dim_]}"
            )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k must have q's head dim {q.shape[3]}, got {k.shape[3]}")
    if v.shape[seq_dim] != k.shape[seq_dim]:
        raise ValueError(
            f"v must have k's sequence length {k.shape[seq_dim]}, got {v.shape[seq_dim]}"
        )
    if v.shape[3] != q.shape[3]:
        raise ValueError(f"v must have q's head dim {q.shape[3]}, got {v.shape[3]}")
    return q.shape[0], q.shape[seq_dim], k.shape[seq_dim], q.shape[head_dim_], q.shape[3]


def check_int_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Data check (syncs): every element of ``t`` lies in [low, high]."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi > high:
        raise ValueError(f"{name} values must lie in [{low}, {high}], got range [{lo}, {hi}]")


def check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on device {device}, got {t.device}")


def check_coarse_gate(
    gate: torch.Tensor | None, q: torch.Tensor, expected: str | None = None
) -> torch.Tensor | None:
    """A coarse gate must be None or a tensor in q's dtype and device, broadcastable to q.

    ``expected`` describes the required shape in the error (default: q's shape).
    """
    if gate is None:
        return None
    if not isinstance(gate, torch.Tensor):
        raise ValueError(f"coarse_gate must be a tensor or None, got {type(gate).__name__}")
    if gate.dtype != q.dtype or gate.device != q.device:
        raise ValueError(
            f"coarse_gate must have q's dtype {q.dtype} and device {q.device}, "
            f"got {gate.dtype} on {gate.device}"
        )
    try:
        shape = torch.broadcast_shapes(gate.shape, q.shape)
    except RuntimeError:
        shape = None
    if shape != q.shape:
        expected = expected or f"broadcast to q's shape {tuple(q.shape)}"
        raise ValueError(f"coarse_gate must {expected}, got {tuple(gate.shape)}")
    return gate

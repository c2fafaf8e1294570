"""Input checks at the public boundary.

Every check raises ``ValueError`` whose message starts with the argument's name and says what
was expected. Shape, dtype and device checks read only metadata. Checks that read tensor *data*
(index ranges, valid sizes) make the host wait for the device, so they run only where user data
enters and can be switched off.

Numbers: wherever the public API takes an integer it accepts a Python ``int``, a NumPy integer
or a 0-d integer tensor (`as_int`); wherever it takes a float, also a Python ``int``, a NumPy
number or a 0-d integer or floating tensor (`as_float`). ``bool`` is never a number here, and a
float is never an integer (``64.5`` and ``64.0`` are both refused, not truncated). Reading a
0-d CUDA tensor waits for the device; pass Python numbers on a hot path.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---- numbers ---------------------------------------------------------------------------------
def _is_bool(value: object) -> bool:
    # NumPy's bool scalar is ``numpy.bool_`` (NumPy 1) or ``numpy.bool`` (NumPy 2); vsa-core does
    # not depend on NumPy, so it is recognised by its type's name and module.
    kind = type(value)
    return isinstance(value, bool) or (
        kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")
    )


def _integer(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (see module doc), else None."""
    if type(value) is int:  # the common case, first (cheap, and plain under torch.compile)
        return value
    if _is_bool(value):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex:
            return None
        if value.dtype == torch.bool or value.device.type == "meta":
            return None
        return int(value.item())
    try:
        return operator.index(value)  # int, NumPy integers, 0-d NumPy integer arrays
    except TypeError:
        return None


def _real(value: object) -> float | None:
    """``value`` as a Python float if it is a real number (see module doc), else None."""
    if type(value) in (float, int):  # the common case, first
        return float(value)
    if _is_bool(value):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_complex or value.dtype == torch.bool:
            return None
        if value.device.type == "meta":
            return None
        return float(value.item())
    if isinstance(value, numbers.Real):  # int, float, Fraction, NumPy integers and floats
        return float(value)
    dtype = getattr(value, "dtype", None)
    if getattr(value, "ndim", None) == 0 and getattr(dtype, "kind", None) in ("i", "u", "f"):
        return float(value)  # a 0-d NumPy array
    return None


def _int_range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if lo == 1:
        return "a positive integer"
    if lo == 0:
        return "a non-negative integer"
    if lo is not None:
        return f"an integer >= {lo}"
    if hi is not None:
        return f"an integer <= {hi}"
    return "an integer"


def as_int(
    name: str, value: object, lo: int | None = None, hi: int | None = None, *, what: str = ""
) -> int:
    """``value`` as a Python int in [lo, hi] (either bound optional), else ``ValueError``.

    Accepts Python ints, NumPy integers and 0-d integer tensors; refuses bools, floats (even
    integral ones) and everything else. ``what`` explains the bounds in the message, e.g.
    ``"the number of tiles"``.
    """
    number = _integer(value)
    if number is None or (lo is not None and number < lo) or (hi is not None and number > hi):
        note = f" ({what})" if what else ""
        raise ValueError(f"{name} must be {_int_range(lo, hi)}{note}, got {value!r}")
    return number


def as_float(name: str, value: object, *, positive: bool = False, finite: bool = True) -> float:
    """``value`` as a Python float, else ``ValueError``.

    Accepts Python ints and floats, NumPy integers and floats, and 0-d integer or floating
    tensors; refuses bools. ``finite`` refuses NaN and infinities, ``positive`` values <= 0.
    """
    number = _real(value)
    bad = number is None or (finite and not math.isfinite(number)) or (positive and not number > 0)
    if bad:
        kind = "a positive" if positive else "a"
        kind += " finite number" if finite else " number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return number  # type: ignore[return-value]


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale: ``1 / sqrt(head_dim)`` for None, else a positive finite float."""
    if scale is None:
        return head_dim**-0.5
    number = _real(scale)
    if number is None or not 0 < number < math.inf:
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    return number


def as_flag(name: str, value: object) -> bool:
    """``value`` as a Python bool: ``True`` or ``False`` (or a NumPy bool), else ``ValueError``
    (a flag given as 1, "yes" or a tensor is a mistake worth naming)."""
    if type(value) is bool:
        return value
    if _is_bool(value):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def check_copy_to_tiles(copy_to_tiles: object, token_order: str) -> bool:
    """``copy_to_tiles`` as a bool; False only with ``token_order="raster"`` (there is nothing
    to copy from tile-order inputs)."""
    copy_to_tiles = as_flag("copy_to_tiles", copy_to_tiles)
    if not copy_to_tiles and token_order != "raster":
        raise ValueError(
            "copy_to_tiles=False needs token_order='raster' (tiled inputs are not copied)"
        )
    return copy_to_tiles


def check_topk(topk: object, num_tiles: int) -> int:
    """``topk`` as a Python int in [1, num_tiles]."""
    return as_int("topk", topk, 1, num_tiles, what="the number of tiles")


def _ints(name: str, value: object, count: int, expected: str) -> tuple[int, ...]:
    """``count`` positive integers from a sequence (a tuple, list, 1-D tensor or array)."""
    message = f"{name} must be {expected}, got {value!r}"
    if isinstance(value, (str, bytes)) or (isinstance(value, torch.Tensor) and value.dim() != 1):
        raise ValueError(message)
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(message) from None
    numbers_ = tuple(_integer(v) for v in items)
    if len(numbers_) != count or any(n is None or n <= 0 for n in numbers_):
        raise ValueError(message)
    return numbers_  # type: ignore[return-value]


def check_positive_triple(name: str, value: Sequence[int]) -> tuple[int, int, int]:
    return _ints(name, value, 3, "three positive integers")  # type: ignore[return-value]


def check_block_shape(block_shape: Sequence[int]) -> tuple[int, int]:
    return _ints(  # type: ignore[return-value]
        "block_shape", block_shape, 2, "two positive integers (q_block, kv_block)"
    )


# ---- tensors ---------------------------------------------------------------------------------
def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str
) -> tuple[int, int, int, int, int]:
    """Check q/k/v agree; return (batch, q_len, kv_len, heads, head_dim).

    Degenerate sizes: zero heads, a zero head dim or an empty sequence raise here, before any
    kernel; an empty batch passes (the ops answer it with `empty_batch_result`).
    """
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
    qs, ks, vs = q.shape, k.shape, v.shape  # read once: each .shape builds a torch.Size
    for name, t, ts in (("k", k, ks), ("v", v, vs)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if ts[0] != qs[0]:
            raise ValueError(f"{name} must have q's batch size {qs[0]}, got {ts[0]}")
        if ts[head_dim_] != qs[head_dim_]:
            raise ValueError(
                f"{name} must have q's number of heads {qs[head_dim_]} "
                f"(dim {head_dim_} of {qkv_format.upper()}), got {ts[head_dim_]}"
            )
    if ks[3] != qs[3]:
        raise ValueError(f"k must have q's head dim {qs[3]}, got {ks[3]}")
    if vs[seq_dim] != ks[seq_dim]:
        raise ValueError(f"v must have k's sequence length {ks[seq_dim]}, got {vs[seq_dim]}")
    if vs[3] != qs[3]:
        raise ValueError(f"v must have q's head dim {qs[3]}, got {vs[3]}")
    if 0 in (qs[head_dim_], qs[3], qs[seq_dim], ks[seq_dim]):
        _refuse_degenerate(q, k, seq_dim, head_dim_, qkv_format.upper())
    return qs[0], qs[seq_dim], ks[seq_dim], qs[head_dim_], qs[3]


def _refuse_degenerate(q, k, seq_dim: int, head_dim_: int, fmt: str) -> None:
    for name, t, dim, what in (
        ("q", q, head_dim_, "at least one head"),
        ("q", q, 3, "a head dim of at least 1"),
        ("q", q, seq_dim, "at least one token"),
        ("k", k, seq_dim, "at least one token"),
    ):
        if t.shape[dim] == 0:
            raise ValueError(f"{name} must have {what} (dim {dim} of {fmt}), got {tuple(t.shape)}")


def empty_batch_result(q: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """An op's output for an empty batch: zeros shaped like q (its format, dtype, device).

    With autograd it depends on q and on every other tensor in ``inputs`` that requires grad,
    so that gradients (all zero, of the inputs' shapes) flow back as for a non-empty batch.
    """
    out = torch.zeros_like(q)
    live = [t for t in (q, *inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if live and torch.is_grad_enabled():
        out = out + sum(t.sum() for t in live) * 0
    return out


def empty_batch_lse(q: torch.Tensor, heads: int, q_len: int) -> torch.Tensor:
    """`block_sparse_attn`'s lse [0, heads, q_len] for an empty batch (float64 for float64 q,
    else float32)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty(0, heads, q_len, dtype=dtype, device=q.device)


def check_int_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_valid_sizes(
    kv_valid_sizes: torch.Tensor,
    device: torch.device,
    kv_block: int,
    *,
    validate: bool,
    name: str = "kv_valid_sizes",
    device_of: str = "kv_indices'",
) -> None:
    """Valid sizes of key blocks: a non-empty 1-D integer tensor on ``device``; with
    ``validate`` (a data check, syncs) every value in [0, kv_block]."""
    check_int_tensor(name, kv_valid_sizes)
    if kv_valid_sizes.dim() != 1 or kv_valid_sizes.shape[0] == 0:
        raise ValueError(
            f"{name} must be a non-empty 1-D tensor [num_kv_blocks], "
            f"got shape {tuple(kv_valid_sizes.shape)}"
        )
    if kv_valid_sizes.device != device:
        raise ValueError(
            f"{name} must be on {device_of} device {device}, got {kv_valid_sizes.device}"
        )
    if validate:
        check_range(name, kv_valid_sizes, 0, kv_block)


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
    if not _broadcasts_to(gate.shape, q.shape):
        expected = expected or f"broadcast to q's shape {tuple(q.shape)}"
        raise ValueError(f"coarse_gate must {expected}, got {tuple(gate.shape)}")
    return gate


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (what ``torch.broadcast_shapes(shape,
    target) == target`` says, without its cost on every call: a few microseconds of host time
    per op matter at 480p)."""
    if len(shape) > len(target):
        return False
    offset = len(target) - len(shape)
    return all(s == 1 or s == target[offset + i] for i, s in enumerate(shape))


def as_device(device: object) -> torch.device:
    """A torch.device from a device or its name; ValueError naming ``device`` otherwise."""
    try:
        return torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device must be a torch.device or a device name such as 'cuda', got {device!r}"
        ) from None

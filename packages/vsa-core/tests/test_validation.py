"""Input checks: every failure is a ValueError that names the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vsa_core.tiling import VideoTiling
from vsa_core.validation import (
    FLOAT_DTYPES,
    as_float,
    as_int,
    check_block_shape,
    check_int_tensor,
    check_positive_triple,
    check_qkv,
    check_range,
    check_same_device,
    check_scale,
    check_topk,
    check_valid_sizes,
    empty_batch_lse,
    empty_batch_result,
)


@pytest.mark.parametrize(
    "value",
    [(0, 1, 1), (1, -2, 1), (1, 1), (1, 1, 1, 1), (1.5, 1, 1), ("a", 1, 1), None, 3, (True, 1, 1)],
)
def test_positive_triple_rejects(value):
    with pytest.raises(ValueError, match="latent_shape must be three positive integers"):
        check_positive_triple("latent_shape", value)


def test_positive_triple_accepts_int_like():
    out = check_positive_triple("x", (torch.tensor(2), np.int32(3), 4))
    assert out == (2, 3, 4) and all(type(v) is int for v in out)
    assert check_positive_triple("x", np.array([2, 3, 4])) == (2, 3, 4)
    assert check_positive_triple("x", torch.tensor([2, 3, 4])) == (2, 3, 4)


@pytest.mark.parametrize(
    "value", [(2, 3.0, 4), (2, np.float64(3), 4), (2, torch.tensor(3.0), 4), (np.True_, 3, 4)]
)
def test_positive_triple_refuses_floats_and_bools(value):
    # A float is refused even when integral: it is never silently truncated.
    with pytest.raises(ValueError, match="x must be three positive integers"):
        check_positive_triple("x", value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"latent_shape": (0, 4, 4)}, "latent_shape"),
        ({"latent_shape": (4, 4)}, "latent_shape"),
        ({"latent_shape": (4, 4, 4), "tile_shape": (4, 0, 4)}, "tile_shape"),
        ({"latent_shape": (4, 4, 4), "tile_shape": (4, 4, 2.5)}, "tile_shape"),
    ],
)
def test_video_tiling_rejects(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be three positive integers"):
        VideoTiling(**kwargs)


@pytest.mark.parametrize("value", [(0, 4), (4, -1), (4,), (4, 4, 4), None, ("a", 4)])
def test_block_shape_rejects(value):
    with pytest.raises(ValueError, match="block_shape must be two positive integers"):
        check_block_shape(value)


def test_block_shape_accepts():
    assert check_block_shape([64, 128]) == (64, 128)
    out = check_block_shape((np.int64(64), torch.tensor(128, dtype=torch.int32)))
    assert out == (64, 128) and all(type(v) is int for v in out)


@pytest.mark.parametrize(
    "value",
    [
        (64.5, 64),
        (64.0, 64),
        (True, 64),
        (64, False),
        (torch.tensor(64.0), 64),
        (np.float32(64), 64),
    ],
)
def test_block_shape_refuses_floats_and_bools(value):
    # Issue 21, row 5: (64.5, 64) used to become (64, 64) and (True, 64) became (1, 64).
    with pytest.raises(ValueError, match="block_shape must be two positive integers"):
        check_block_shape(value)


# ---- numbers -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [3, np.int64(3), np.int8(3), np.uint16(3), np.array(3), torch.tensor(3), torch.tensor(3).int()],
)
def test_as_int_accepts_python_numpy_and_0d_tensor_integers(value):
    got = as_int("n", value, 1, 5)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize(
    "value",
    [
        True,
        np.True_,
        torch.tensor(True),
        3.0,
        3.5,
        np.float64(3),
        torch.tensor(3.0),
        torch.tensor([3]),
        np.array([3]),
        "3",
        None,
        torch.tensor(3, device="meta"),
        3 + 0j,
    ],
)
def test_as_int_refuses_everything_else(value):
    with pytest.raises(ValueError, match=r"^n must be an integer in \[1, 5\], got "):
        as_int("n", value, 1, 5)


def test_as_int_bounds_and_messages():
    assert as_int("n", -7) == -7
    with pytest.raises(ValueError, match=r"^n must be a positive integer, got 0$"):
        as_int("n", 0, 1)
    with pytest.raises(ValueError, match=r"^n must be a non-negative integer, got -1$"):
        as_int("n", -1, 0)
    with pytest.raises(ValueError, match=r"^n must be an integer >= 2, got 1$"):
        as_int("n", 1, 2)
    with pytest.raises(ValueError, match=r"^n must be an integer <= 2, got 3$"):
        as_int("n", 3, None, 2)
    with pytest.raises(ValueError, match=r"^topk must be an integer in \[1, 4\] \(the number"):
        check_topk(5, 4)
    assert check_topk(np.int64(4), 4) == 4 and check_topk(torch.tensor(1), 4) == 1


@pytest.mark.parametrize(
    "value",
    [0.5, 1, np.float32(0.5), np.float16(0.5), np.int64(2), np.array(0.5), torch.tensor(0.5)],
)
def test_as_float_accepts_python_numpy_and_0d_tensor_numbers(value):
    got = as_float("x", value)
    assert got == float(value) and type(got) is float
    assert check_scale(value, 4) == got


@pytest.mark.parametrize(
    "value",
    [True, np.True_, torch.tensor(True), "0.5", None, torch.tensor([0.5]), 1j, np.array([0.5])],
)
def test_as_float_refuses_non_numbers(value):
    with pytest.raises(ValueError, match=r"^x must be a finite number, got "):
        as_float("x", value)
    if value is not None:  # None is the default scale
        with pytest.raises(ValueError, match=r"^scale must be a positive float or None, got "):
            check_scale(value, 4)


def test_as_float_bounds_and_scale():
    assert as_float("x", float("inf"), finite=False) == float("inf")
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="x must be a finite number"):
            as_float("x", bad)
    with pytest.raises(ValueError, match=r"^x must be a positive finite number, got 0.0$"):
        as_float("x", 0.0, positive=True)
    assert check_scale(None, 16) == 0.25
    for bad in (0, -0.5, float("nan"), float("inf"), np.float32("nan"), torch.tensor(-1.0)):
        with pytest.raises(ValueError, match="scale must be a positive float or None"):
            check_scale(bad, 16)


def _qkv(**shapes):
    base = {"q": (2, 8, 3, 4), "k": (2, 6, 3, 4), "v": (2, 6, 3, 4)}
    base.update(shapes)
    return [torch.zeros(s) for s in base.values()]


def test_check_qkv_returns_sizes():
    assert check_qkv(*_qkv(), "bshd") == (2, 8, 6, 3, 4)
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    assert check_qkv(q, k, v, "bhsd") == (2, 8, 6, 3, 4)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_check_qkv_accepts_float_dtypes(dtype):
    q, k, v = (t.to(dtype) for t in _qkv())
    check_qkv(q, k, v, "bshd")


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"q": (2, 8, 3)}, "q must be 4-D"),
        ({"k": (2, 6, 3, 4, 1)}, "k must be 4-D"),
        ({"k": (1, 6, 3, 4)}, "k must have q's batch size"),
        ({"v": (2, 6, 2, 4)}, "v must have q's number of heads"),
        ({"k": (2, 6, 3, 5), "v": (2, 6, 3, 5)}, "k must have q's head dim"),
        ({"v": (2, 6, 3, 5)}, "v must have q's head dim"),
        ({"v": (2, 5, 3, 4)}, "v must have k's sequence length"),
    ],
)
def test_check_qkv_shape_errors(shapes, message):
    with pytest.raises(ValueError, match=message):
        check_qkv(*_qkv(**shapes), "bshd")


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (
            {"q": (2, 8, 0, 4), "k": (2, 6, 0, 4), "v": (2, 6, 0, 4)},
            "q must have at least one head",
        ),
        (
            {"q": (2, 8, 3, 0), "k": (2, 6, 3, 0), "v": (2, 6, 3, 0)},
            "q must have a head dim of at least 1",
        ),
        ({"q": (2, 0, 3, 4)}, "q must have at least one token"),
        ({"k": (2, 0, 3, 4), "v": (2, 0, 3, 4)}, "k must have at least one token"),
    ],
)
def test_check_qkv_degenerate_sizes(shapes, message, fmt):
    # Issue 21, rows 2 and 6: zero heads crashed with SIGFPE in the coarse attention; a zero
    # head dim or sequence raised ZeroDivisionError. Now a ValueError names q or k first.
    q, k, v = _qkv(**shapes)
    if fmt == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(ValueError, match=f"^{message}"):
        check_qkv(q, k, v, fmt)


def test_check_qkv_passes_an_empty_batch():
    assert check_qkv(*_qkv(q=(0, 8, 3, 4), k=(0, 6, 3, 4), v=(0, 6, 3, 4)), "bshd") == (
        0,
        8,
        6,
        3,
        4,
    )


def test_empty_batch_result_is_differentiable_and_shaped_like_q():
    q = torch.zeros(0, 3, 8, 4, dtype=torch.float64, requires_grad=True)  # BHSD
    k = torch.zeros(0, 3, 6, 4, dtype=torch.float64, requires_grad=True)
    gate = torch.ones(1, 1, 3, 1, dtype=torch.float64, requires_grad=True)
    out = empty_batch_result(q, k, None, gate)
    assert out.shape == q.shape and out.dtype == q.dtype
    dq, dk, dgate = torch.autograd.grad(out.sum(), (q, k, gate))
    assert dq.shape == q.shape and dk.shape == k.shape
    assert torch.equal(dgate, torch.zeros_like(gate))
    with torch.no_grad():
        assert not empty_batch_result(q, k).requires_grad
    assert empty_batch_lse(q, 3, 8).shape == (0, 3, 8)
    assert empty_batch_lse(q, 3, 8).dtype == torch.float64
    assert empty_batch_lse(q.float(), 3, 8).dtype == torch.float32
    assert empty_batch_lse(q.half(), 3, 8).dtype == torch.float32


def test_check_valid_sizes():
    cpu = torch.device("cpu")
    check_valid_sizes(torch.tensor([0, 4]), cpu, 4, validate=True)
    check_valid_sizes(torch.tensor([9]), cpu, 4, validate=False)  # data unchecked
    cases = [
        (torch.tensor([1.5, 3.0]), "kv_valid_sizes must be an integer tensor"),
        (torch.tensor([True]), "kv_valid_sizes must be an integer tensor"),
        (torch.zeros(0, dtype=torch.int32), "kv_valid_sizes must be a non-empty 1-D"),
        (torch.zeros(1, 2, dtype=torch.int32), "kv_valid_sizes must be a non-empty 1-D"),
        (torch.tensor([4], device="meta"), "kv_valid_sizes must be on kv_indices' device cpu"),
        (torch.tensor([5]), r"kv_valid_sizes values must lie in \[0, 4\]"),
        (torch.tensor([-1]), r"kv_valid_sizes values must lie in \[0, 4\]"),
    ]
    for sizes, message in cases:
        with pytest.raises(ValueError, match=message):
            check_valid_sizes(sizes, cpu, 4, validate=True)


def test_check_qkv_dtype_device_format_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="qkv_format must be 'bshd' or 'bhsd'"):
        check_qkv(q, k, v, "bsd")
    with pytest.raises(ValueError, match="q must be float16, bfloat16, float32 or float64"):
        check_qkv(q.long(), k, v, "bshd")
    with pytest.raises(ValueError, match="v must be float16"):
        check_qkv(q, k, v.to(torch.complex64), "bshd")
    with pytest.raises(ValueError, match="k must have q's dtype"):
        check_qkv(q, k.half(), v, "bshd")
    with pytest.raises(ValueError, match="v must be on q's device"):
        check_qkv(q, k, v.to("meta"), "bshd")
    with pytest.raises(ValueError, match=r"k must be a torch\.Tensor"):
        check_qkv(q, k.numpy(), v, "bshd")


def test_check_int_tensor():
    check_int_tensor("idx", torch.zeros(2, 3, dtype=torch.int16), (2, 3))
    check_int_tensor("idx", torch.zeros(2, dtype=torch.uint8))
    for bad in (
        torch.zeros(2),
        torch.zeros(2, dtype=torch.bool),
        torch.zeros(2, dtype=torch.cfloat),
    ):
        with pytest.raises(ValueError, match="idx must be an integer tensor"):
            check_int_tensor("idx", bad)
    with pytest.raises(ValueError, match=r"idx must have shape \(2, 4\), got \(2, 3\)"):
        check_int_tensor("idx", torch.zeros(2, 3, dtype=torch.int32), (2, 4))
    with pytest.raises(ValueError, match=r"idx must be a torch\.Tensor"):
        check_int_tensor("idx", [1, 2])


def test_check_range():
    check_range("x", torch.tensor([0, 3, 5]), 0, 5)
    check_range("x", torch.zeros(0, dtype=torch.int32), 0, 0)  # empty: nothing to check
    with pytest.raises(ValueError, match=r"x values must lie in \[0, 4\], got range \[0, 5\]"):
        check_range("x", torch.tensor([0, 3, 5]), 0, 4)
    with pytest.raises(ValueError, match=r"x values must lie in \[0, 5\], got range \[-1, 3\]"):
        check_range("x", torch.tensor([-1, 3]), 0, 5)


def test_check_same_device():
    check_same_device("t", torch.zeros(1), torch.device("cpu"))
    with pytest.raises(ValueError, match="t must be on device meta"):
        check_same_device("t", torch.zeros(1), torch.device("meta"))

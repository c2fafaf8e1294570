"""Input checks: every failure is a ValueError that names the argument."""

from __future__ import annotations

import pytest
import torch

from vsa_core.tiling import VideoTiling
from vsa_core.validation import (
    FLOAT_DTYPES,
    check_block_shape,
    check_int_tensor,
    check_positive_triple,
    check_qkv,
    check_range,
    check_same_device,
)


@pytest.mark.parametrize(
    "value",
    [(0, 1, 1), (1, -2, 1), (1, 1), (1, 1, 1, 1), (1.5, 1, 1), ("a", 1, 1), None, 3, (True, 1, 1)],
)
def test_positive_triple_rejects(value):
    with pytest.raises(ValueError, match="latent_shape must be three positive integers"):
        check_positive_triple("latent_shape", value)


def test_positive_triple_accepts_int_like():
    assert check_positive_triple("x", [2, 3.0, 4]) == (2, 3, 4)
    out = check_positive_triple("x", (torch.tensor(2), 3, 4))
    assert out == (2, 3, 4) and all(type(v) is int for v in out)


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

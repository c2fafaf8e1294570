"""`vsa_fa4.block_sparse_attn`'s argument checks on the CPU: vsa-core's own (`check_qkv`, the
layout against q and k, `check_scale`), with vsa-core's messages, before anything of FA4 runs."""

from __future__ import annotations

import pytest
import torch

import vsa_core
from vsa_core.layout import BlockSparseLayout
from vsa_fa4 import block_sparse_attn


def inputs(batch=1, seq=256, heads=2, dim=64, fmt="bshd"):
    shape = (batch, seq, heads, dim) if fmt == "bshd" else (batch, heads, seq, dim)
    return (torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3))


def layout(batch=1, heads=2, blocks=4, block=64):
    topk = torch.arange(2).expand(batch, heads, blocks, 2)
    valid = torch.full((blocks,), block, dtype=torch.int32)
    return BlockSparseLayout.from_topk(topk, valid, (block, block))


CASES = [
    ("batch", dict(batch=2), {}, "layout must have batch = 2"),
    ("heads", dict(heads=3), {}, "layout must have heads = 3"),
    ("q_len", dict(seq=320), {}, r"layout must have q_len \(num_q_blocks \* q_block\) = 320"),
    ("layout type", {}, dict(layout="not a layout"), "layout must be a BlockSparseLayout"),
    ("scale", {}, dict(scale=-1.0), "scale must be a positive float or None"),
    ("scale bool", {}, dict(scale=True), "scale must be a positive float or None"),
    ("qkv_format", {}, dict(qkv_format="sbhd"), "qkv_format must be 'bshd' or 'bhsd'"),
]


@pytest.mark.parametrize(
    ("shape", "call", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_refuses_what_vsa_core_refuses_with_its_message(shape, call, match):
    q, k, v = inputs(**shape)
    kwargs = {"layout": layout(), **call}
    with pytest.raises(ValueError, match=match):
        block_sparse_attn(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=match):  # the same words as vsa-core's op
        vsa_core.block_sparse_attn(q, k, v, backend="reference", **kwargs)


def test_bhsd_is_checked_in_its_own_layout():
    q, k, v = inputs(heads=3, fmt="bhsd")
    with pytest.raises(ValueError, match="layout must have heads = 3"):
        block_sparse_attn(q, k, v, layout(), qkv_format="bhsd")
    q, k, v = inputs(fmt="bhsd")
    k = k[:, :1]
    with pytest.raises(ValueError, match="k must have q's number of heads 2"):
        block_sparse_attn(q, k, v, layout(), qkv_format="bhsd")

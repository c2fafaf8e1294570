"""The public ops against naive end-to-end float64 implementations, and their input checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vsa_naive import (
    FEW,
    SETTINGS,
    masked_attention,
    naive_from_tiles,
    naive_pool,
    naive_tiling,
    naive_to_tiles,
    naive_topk_mask,
    naive_vsa,
    random_block_mask,
    token_mask,
)

from vsa_core import BlockSparseLayout, VideoTiling, block_sparse_attn, video_sparse_attn


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


# ---- block_sparse_attn -------------------------------------------------------------------------
@SETTINGS
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    nq=st.integers(1, 4),
    nkv=st.integers(1, 4),
    qb=st.sampled_from([1, 2, 4]),
    kvb=st.sampled_from([2, 3]),
    dim=st.integers(1, 6),
    fmt=st.sampled_from(["bshd", "bhsd"]),
    backend=st.sampled_from(["auto", "reference"]),
    use_scale=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_block_sparse_attn_matches_naive(
    batch, heads, nq, nkv, qb, kvb, dim, fmt, backend, use_scale, seed
):
    gen = _gen(seed)
    q = _randn(gen, batch, nq * qb, heads, dim)
    k = _randn(gen, batch, nkv * kvb, heads, dim)
    v = _randn(gen, batch, nkv * kvb, heads, dim)
    valid = torch.randint(0, kvb + 1, (nkv,), generator=gen)
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, 0.6)
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    scale = 0.37 if use_scale else None
    want_out, want_lse = masked_attention(
        q, k, v, token_mask(block_mask, valid, qb, kvb), 0.37 if use_scale else dim**-0.5
    )
    if fmt == "bhsd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse = block_sparse_attn(q, k, v, layout, backend=backend, scale=scale, qkv_format=fmt)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads, nq * qb)
    if fmt == "bhsd":
        out = out.transpose(1, 2)  # BHSD output is the transposed BSHD result
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=0, atol=1e-10)


def test_block_sparse_attn_cross_attention_and_grads():
    gen = _gen(7)
    batch, heads, dim, qb, kvb, nq, nkv = 1, 2, 4, 4, 2, 2, 5
    q = _randn(gen, batch, heads, nq * qb, dim).requires_grad_()
    k = _randn(gen, batch, heads, nkv * kvb, dim).requires_grad_()
    v = _randn(gen, batch, heads, nkv * kvb, dim).requires_grad_()
    valid = torch.tensor([2, 1, 0, 2, 2])
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, 0.7)
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    weight = _randn(gen, batch, heads, nq * qb, dim)
    out, _ = block_sparse_attn(q, k, v, layout, qkv_format="bhsd")
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    mask = token_mask(block_mask, valid, qb, kvb)
    want_out, _ = masked_attention(*(t.transpose(1, 2) for t in (q, k, v)), mask, dim**-0.5)
    want = torch.autograd.grad((want_out.transpose(1, 2) * weight).sum(), (q, k, v))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_block_sparse_attn_low_precision(fmt, dtype, tol):
    gen = _gen(12)
    batch, heads, dim, qb, kvb, nq, nkv = 2, 2, 8, 4, 4, 3, 4
    q, k, v = (
        _randn(gen, batch, n * b, heads, dim, dtype=dtype)
        for n, b in ((nq, qb), (nkv, kvb), (nkv, kvb))
    )
    valid = torch.tensor([4, 1, 3, 4])
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, 0.6)
    block_mask[..., 0] = True
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    want, _ = masked_attention(q, k, v, token_mask(block_mask, valid, qb, kvb), dim**-0.5)
    if fmt == "bhsd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse = block_sparse_attn(q, k, v, layout, qkv_format=fmt)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out = out if fmt == "bshd" else out.transpose(1, 2)
    assert float((out.double() - want).norm() / want.norm()) < tol


# ---- video_sparse_attn -------------------------------------------------------------------------
def _clear_inputs(seed, batch, seq, heads, dim, valid, topk, garbage_padding=True):
    """Random tile-order q, k, v whose top-k selection is unambiguous (float32 vs float64).

    Deterministic: tries seeds from ``seed`` on until the naive k-th/(k+1)-th score gap is large.
    """
    num_tiles = len(valid)
    tile_tokens = seq // num_tiles
    for s in range(seed, seed + 100):
        gen = _gen(s)
        q, k, v = (_randn(gen, batch, seq, heads, dim) for _ in range(3))
        if garbage_padding:
            for t in (q, k, v):
                for n, size in enumerate(valid.tolist()):
                    t[:, n * tile_tokens + size : (n + 1) * tile_tokens] += 5.0
        _, margin = naive_topk_mask(naive_pool(q, valid), naive_pool(k, valid), valid, topk)
        if margin > 1e-4:
            return q, k, v
    raise AssertionError("no seed gave an unambiguous top-k selection")  # pragma: no cover


def _real_query_rows(valid, tile_tokens):
    """Real token rows: outputs at padding slots are not specified (the op reads query padding
    as zeros when gradients flow, as given otherwise), and an empty tile has no real row."""
    slots = torch.arange(tile_tokens)
    return (slots < torch.as_tensor(valid).unsqueeze(-1)).flatten()


VSA_CASES = [
    # (latent, tile, batch, heads, dim, topk)
    ((3, 5, 6), (2, 2, 4), 2, 2, 4, 3),
    ((2, 3, 3), (2, 2, 2), 1, 3, 3, 1),
    ((4, 4, 4), (4, 4, 4), 1, 2, 4, 1),  # one tile
    ((5, 3, 2), (2, 2, 2), 1, 1, 2, 6),  # topk = number of tiles
]


@pytest.mark.parametrize(("latent", "tile", "batch", "heads", "dim", "topk"), VSA_CASES)
@pytest.mark.parametrize("gate_kind", ["none", "full", "broadcast"])
@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
def test_video_sparse_attn_tiling_matches_naive(
    latent, tile, batch, heads, dim, topk, gate_kind, fmt
):
    tiling = VideoTiling(latent, tile)
    valid = torch.tensor([len(m) for m in naive_tiling(latent, tile)[1]])
    seq = tiling.padded_len
    q, k, v = _clear_inputs(11, batch, seq, heads, dim, valid, topk)
    gen = _gen(99)
    gate = {
        "none": None,
        "full": _randn(gen, batch, seq, heads, dim),
        "broadcast": _randn(gen, 1, 1, heads, 1),
    }[gate_kind]
    want, _, _ = naive_vsa(q, k, v, valid, topk, 0.45, gate)
    if fmt == "bhsd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        gate = None if gate is None else gate.transpose(1, 2).contiguous()
    with torch.no_grad():
        out = video_sparse_attn(
            q, k, v, topk=topk, tiling=tiling, coarse_gate=gate, scale=0.45, qkv_format=fmt
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    if fmt == "bhsd":
        out = out.transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)


@FEW
@given(
    num_tiles=st.integers(2, 7),
    tile_tokens=st.sampled_from([2, 3, 4]),
    heads=st.integers(1, 2),
    dim=st.integers(2, 4),
    seed=st.integers(0, 10**6),
    data=st.data(),
)
def test_video_sparse_attn_kv_valid_sizes_matches_naive(
    num_tiles, tile_tokens, heads, dim, seed, data
):
    gen = _gen(seed)
    valid = torch.randint(0, tile_tokens + 1, (num_tiles,), generator=gen, dtype=torch.int32)
    valid[0] = tile_tokens
    valid[-1] = max(int(valid[-1]), 1)
    non_empty = int((valid > 0).sum())
    topk = data.draw(st.integers(1, non_empty))
    seq = num_tiles * tile_tokens
    q, k, v = _clear_inputs(seed, 2, seq, heads, dim, valid, topk)
    gate = _randn(gen, 2, seq, heads, 1)
    want, block_mask, _ = naive_vsa(q, k, v, valid, topk, dim**-0.5, gate)
    # No empty key tile is ever selected while enough non-empty ones exist.
    assert not bool(block_mask[..., valid == 0].any())
    out = video_sparse_attn(q, k, v, topk=topk, kv_valid_sizes=valid, coarse_gate=gate)
    rows = _real_query_rows(valid, tile_tokens)
    torch.testing.assert_close(out[:, rows], want[:, rows], rtol=0, atol=1e-10)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
@pytest.mark.parametrize("with_gate", [False, True])
def test_video_sparse_attn_raster_order(fmt, with_gate):
    latent, tile, batch, heads, dim, topk = (3, 5, 6), (2, 2, 4), 2, 2, 4, 3
    tiling = VideoTiling(latent, tile)
    valid = torch.tensor([len(m) for m in naive_tiling(latent, tile)[1]])
    q_t, k_t, v_t = _clear_inputs(5, batch, tiling.padded_len, heads, dim, valid, topk, False)
    q, k, v = (naive_from_tiles(t, latent, tile) for t in (q_t, k_t, v_t))  # raster order
    gate = _randn(_gen(3), batch, tiling.seq_len, heads, dim) if with_gate else None
    gate_t = None if gate is None else naive_to_tiles(gate, latent, tile)
    want_tiled, _, _ = naive_vsa(q_t, k_t, v_t, valid, topk, dim**-0.5, gate_t)
    want = naive_from_tiles(want_tiled, latent, tile)

    def fmt_in(x):
        return None if x is None else (x if fmt == "bshd" else x.transpose(1, 2).contiguous())

    def fmt_out(x):
        return x if fmt == "bshd" else x.transpose(1, 2)

    out = video_sparse_attn(
        *(fmt_in(t) for t in (q, k, v)),
        topk=topk,
        tiling=tiling,
        coarse_gate=fmt_in(gate),
        qkv_format=fmt,
        token_order="raster",
    )
    assert out.shape == fmt_in(q).shape
    torch.testing.assert_close(fmt_out(out), want, rtol=0, atol=1e-10)
    # ... and it is the untiled result of the tiled call on the tiled inputs.
    tiled = video_sparse_attn(
        *(fmt_in(t) for t in (q_t, k_t, v_t)),
        topk=topk,
        tiling=tiling,
        coarse_gate=fmt_in(gate_t),
        qkv_format=fmt,
    )
    torch.testing.assert_close(out, tiling.from_tiles(tiled, fmt), rtol=0, atol=1e-12)


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
@pytest.mark.parametrize("gate_kind", ["none", "full", "per_head"])
def test_video_sparse_attn_grads_match_naive(fmt, gate_kind):
    num_tiles, tile_tokens, batch, heads, dim, topk = 5, 4, 1, 2, 3, 2
    valid = torch.tensor([4, 2, 0, 4, 1], dtype=torch.int32)
    seq = num_tiles * tile_tokens
    q, k, v = _clear_inputs(21, batch, seq, heads, dim, valid, topk)
    gen = _gen(8)
    gate = {
        "none": None,
        "full": _randn(gen, batch, seq, heads, dim),
        "per_head": _randn(gen, 1, 1, heads, 1),
    }[gate_kind]
    rows = _real_query_rows(valid, tile_tokens)
    weight = _randn(gen, batch, seq, heads, dim) * rows.view(1, -1, 1, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if gate is not None:
        leaves.append(gate.clone().requires_grad_())
    want_out, _, _ = naive_vsa(
        *leaves[:3], valid, topk, 0.6, leaves[3] if gate is not None else None
    )
    want = torch.autograd.grad((want_out * weight).sum(), leaves)

    def to_fmt(x):
        return x if fmt == "bshd" else x.transpose(1, 2).contiguous()

    op_leaves = [to_fmt(t.detach()).requires_grad_() for t in leaves]
    out = video_sparse_attn(
        *op_leaves[:3],
        topk=topk,
        kv_valid_sizes=valid,
        coarse_gate=op_leaves[3] if gate is not None else None,
        scale=0.6,
        qkv_format=fmt,
    )
    assert out.requires_grad
    got = torch.autograd.grad((out * to_fmt(weight)).sum(), op_leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, to_fmt(w), rtol=0, atol=1e-10)
    # The output is the same with and without autograd (in-place combine in no-grad mode).
    with torch.no_grad():
        out_ng = video_sparse_attn(
            *op_leaves[:3],
            topk=topk,
            kv_valid_sizes=valid,
            coarse_gate=op_leaves[3] if gate is not None else None,
            scale=0.6,
            qkv_format=fmt,
        )
    assert not out_ng.requires_grad
    real = (slice(None), rows) if fmt == "bshd" else (slice(None), slice(None), rows)
    torch.testing.assert_close(out_ng[real], out.detach()[real], rtol=0, atol=1e-12)


def test_video_sparse_attn_does_not_modify_inputs():
    valid = torch.tensor([3, 3, 1], dtype=torch.int32)
    q, k, v = _clear_inputs(2, 1, 9, 2, 2, valid, 2)
    gate = _randn(_gen(0), 1, 9, 2, 2)
    copies = [t.clone() for t in (q, k, v, gate)]
    with torch.no_grad():
        video_sparse_attn(q, k, v, topk=2, kv_valid_sizes=valid, coarse_gate=gate)
    for t, c in zip((q, k, v, gate), copies, strict=True):
        assert torch.equal(t, c)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 5e-3)])
def test_video_sparse_attn_low_precision(dtype, tol):
    tiling = VideoTiling((2, 4, 4), (2, 2, 2))
    valid = tiling.valid_sizes()
    q, k, v = _clear_inputs(4, 1, tiling.padded_len, 2, 8, valid, 2)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = video_sparse_attn(q, k, v, topk=2, tiling=tiling)
    assert out.dtype == dtype
    want, _, margin = naive_vsa(q, k, v, valid, 2, 8**-0.5)
    assert margin > 1e-2  # the rounded inputs still select unambiguously
    err = (out.double() - want).norm() / want.norm()
    assert err < tol


def test_video_sparse_attn_default_scale():
    valid = torch.tensor([4, 4, 2], dtype=torch.int32)
    q, k, v = _clear_inputs(6, 1, 12, 1, 9, valid, 2)
    want, _, _ = naive_vsa(q, k, v, valid, 2, 1 / 3)
    out = video_sparse_attn(q, k, v, topk=2, kv_valid_sizes=valid)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)


# ---- validation errors -------------------------------------------------------------------------
def _bsa_args():
    q = torch.zeros(2, 8, 3, 4)
    k = torch.zeros(2, 12, 3, 4)
    v = torch.zeros(2, 12, 3, 4)
    layout = BlockSparseLayout.from_block_mask(
        torch.ones(2, 3, 2, 3, dtype=torch.bool), torch.full((3,), 4), (4, 4)
    )
    return {"q": q, "k": k, "v": v, "layout": layout}


def _other_layout(batch=2, heads=3, nq=2, nkv=3, block=(4, 4)):
    return BlockSparseLayout.from_block_mask(
        torch.ones(batch, heads, nq, nkv, dtype=torch.bool), torch.full((nkv,), block[1]), block
    )


BSA_ERRORS = [
    ({"q": torch.zeros(8, 3, 4)}, "q must be 4-D"),
    ({"k": torch.zeros(2, 12, 3, 4, 1)}, "k must be 4-D"),
    ({"v": torch.zeros(2, 12, 3)}, "v must be 4-D"),
    ({"q": [[0.0]]}, "q must be a torch.Tensor"),
    ({"q": torch.zeros(2, 8, 3, 4, dtype=torch.int32)}, "q must be float16"),
    ({"k": torch.zeros(1, 12, 3, 4)}, "k must have q's batch size"),
    ({"v": torch.zeros(3, 12, 3, 4)}, "v must have q's batch size"),
    ({"k": torch.zeros(2, 12, 2, 4)}, "k must have q's number of heads"),
    ({"v": torch.zeros(2, 12, 4, 4)}, "v must have q's number of heads"),
    ({"k": torch.zeros(2, 12, 3, 5)}, "k must have q's head dim"),
    ({"v": torch.zeros(2, 12, 3, 5)}, "v must have q's head dim"),
    ({"v": torch.zeros(2, 8, 3, 4)}, "v must have k's sequence length"),
    ({"k": torch.zeros(2, 12, 3, 4, dtype=torch.float64)}, "k must have q's dtype"),
    ({"v": torch.zeros(2, 12, 3, 4, dtype=torch.float16)}, "v must have q's dtype"),
    ({"k": torch.zeros(2, 12, 3, 4, device="meta")}, "k must be on q's device"),
    ({"v": torch.zeros(2, 12, 3, 4, device="meta")}, "v must be on q's device"),
    ({"layout": "dense"}, "layout must be a BlockSparseLayout"),
    ({"layout": _other_layout(batch=1)}, "layout must have batch"),
    ({"layout": _other_layout(heads=2)}, "layout must have heads"),
    ({"layout": _other_layout(nq=3)}, r"layout must have q_len"),
    ({"layout": _other_layout(nkv=2)}, r"layout must have kv_len"),
    ({"layout": _other_layout(block=(2, 4), nq=3)}, r"layout must have q_len"),
    ({"layout": _other_layout().to("meta")}, "layout must be on q's device"),
    ({"scale": 0.0}, "scale must be a positive float"),
    ({"scale": -1.0}, "scale must be a positive float"),
    ({"scale": float("nan")}, "scale must be a positive float"),
    ({"scale": float("inf")}, "scale must be a positive"),
    ({"scale": "0.5"}, "scale must be a positive float"),
    ({"scale": True}, "scale must be a positive float"),
    ({"qkv_format": "sbhd"}, "qkv_format must be 'bshd' or 'bhsd'"),
    ({"qkv_format": "BSHD"}, "qkv_format must be 'bshd' or 'bhsd'"),
]


@pytest.mark.parametrize(("change", "message"), BSA_ERRORS)
def test_block_sparse_attn_errors(change, message):
    args = {**_bsa_args(), **change}
    q, k, v, layout = (args.pop(n) for n in ("q", "k", "v", "layout"))
    with pytest.raises(ValueError, match=message):
        block_sparse_attn(q, k, v, layout, **args)


def test_block_sparse_attn_bhsd_checks_heads_on_dim_1():
    args = _bsa_args()
    q, k, v = (t.transpose(1, 2) for t in (args["q"], args["k"], args["v"]))
    block_sparse_attn(q, k, v, args["layout"], qkv_format="bhsd")  # valid
    with pytest.raises(ValueError, match="k must have q's number of heads"):
        block_sparse_attn(q, k[:, :2], v, args["layout"], qkv_format="bhsd")
    # BSHD tensors read as BHSD: the sequence lengths become head counts.
    with pytest.raises(ValueError, match="k must have q's number of heads 8"):
        block_sparse_attn(args["q"], args["k"], args["v"], args["layout"], qkv_format="bhsd")


TILING = VideoTiling((3, 4, 8), (2, 2, 2))  # 16 tiles of 8 slots, 96 real tokens, 128 padded


def _vsa_args():
    q = torch.zeros(1, 128, 2, 4)
    return {"q": q, "k": q.clone(), "v": q.clone(), "topk": 2, "tiling": TILING}


VSA_ERRORS = [
    ({"q": torch.zeros(128, 2, 4)}, "q must be 4-D"),
    ({"k": torch.zeros(2, 128, 2, 4)}, "k must have q's batch size"),
    ({"v": torch.zeros(1, 128, 3, 4)}, "v must have q's number of heads"),
    ({"k": torch.zeros(1, 128, 2, 8)}, "k must have q's head dim"),
    ({"k": torch.zeros(1, 64, 2, 4), "v": torch.zeros(1, 64, 2, 4)}, "k must have q's sequence"),
    ({"v": torch.zeros(1, 64, 2, 4)}, "v must have k's sequence length"),
    ({"k": torch.zeros(1, 128, 2, 4, dtype=torch.float64)}, "k must have q's dtype"),
    ({"v": torch.zeros(1, 128, 2, 4, device="meta")}, "v must be on q's device"),
    ({"topk": 0}, r"topk must be an integer in \[1, 16\]"),
    ({"topk": -1}, "topk must be an integer"),
    ({"topk": 17}, r"topk must be an integer in \[1, 16\]"),
    ({"topk": 2.0}, "topk must be an integer"),
    ({"topk": True}, "topk must be an integer"),
    ({"topk": "2"}, "topk must be an integer"),
    ({"kv_valid_sizes": torch.full((16,), 8)}, "exactly one of tiling= and kv_valid_sizes="),
    ({"tiling": None}, "exactly one of tiling= and kv_valid_sizes="),
    ({"tiling": (3, 4, 4)}, "tiling must be a VideoTiling"),
    ({"tiling": VideoTiling((3, 4, 5), (2, 2, 2))}, "q must have tiling.padded_len"),
    ({"token_order": "raster"}, r"q must have tiling.seq_len \(T\*H\*W\) = 96"),
    (
        {"tiling": None, "kv_valid_sizes": torch.full((16,), 8), "token_order": "raster"},
        "token_order='raster' needs tiling=",
    ),
    ({"token_order": "tile"}, "token_order must be 'tiled' or 'raster'"),
    ({"qkv_format": "bsdh"}, "qkv_format must be 'bshd' or 'bhsd'"),
    ({"coarse_gate": torch.zeros(1, 127, 2, 4)}, "coarse_gate must broadcast to q's shape"),
    ({"coarse_gate": torch.zeros(1, 1, 1, 2, 4)}, "coarse_gate must broadcast to q's shape"),
    ({"coarse_gate": torch.zeros(1, 128, 2, 4, dtype=torch.float64)}, "coarse_gate must have q's"),
    ({"coarse_gate": torch.zeros(1, 128, 2, 4, device="meta")}, "coarse_gate must have q's"),
    ({"coarse_gate": 0.5}, "coarse_gate must be a tensor or None"),
    ({"scale": 0}, "scale must be a positive float"),
    ({"scale": -0.5}, "scale must be a positive float"),
    ({"scale": float("inf")}, "scale must be a positive"),
    ({"scale": "1"}, "scale must be a positive float"),
    ({"backend": "no-such-backend"}, "backend must be one of"),
    ({"backend": 3}, "backend must be a backend name"),
]

KV_VALID_ERRORS = [
    (torch.full((16,), 8.0), "kv_valid_sizes must be an integer tensor"),
    (torch.full((16,), True), "kv_valid_sizes must be an integer tensor"),
    (torch.full((4, 4), 8), "kv_valid_sizes must be a non-empty 1-D tensor"),
    (torch.zeros(0, dtype=torch.int32), "kv_valid_sizes must be a non-empty 1-D tensor"),
    (torch.full((16,), 8, device="meta"), "kv_valid_sizes must be on q's device"),
    (torch.full((5,), 8), r"multiple of len\(kv_valid_sizes\) = 5"),
    (torch.tensor([9] + [8] * 15), r"kv_valid_sizes values must lie in \[0, 8\]"),
    (torch.tensor([-1] + [8] * 15), r"kv_valid_sizes values must lie in \[0, 8\]"),
    ([8] * 16, "kv_valid_sizes must be a torch.Tensor"),
]


@pytest.mark.parametrize(("change", "message"), VSA_ERRORS)
def test_video_sparse_attn_errors(change, message):
    args = {**_vsa_args(), **change}
    q, k, v = (args.pop(n) for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=message):
        video_sparse_attn(q, k, v, **args)


@pytest.mark.parametrize(("kv_valid_sizes", "message"), KV_VALID_ERRORS)
def test_video_sparse_attn_kv_valid_sizes_errors(kv_valid_sizes, message):
    args = {**_vsa_args(), "tiling": None, "kv_valid_sizes": kv_valid_sizes}
    q, k, v = (args.pop(n) for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=message):
        video_sparse_attn(q, k, v, **args)


def test_video_sparse_attn_validate_false_skips_range_check():
    q = torch.randn(1, 16, 1, 2)
    sizes = torch.tensor([4, 4, 4, 5])  # 5 > tile size 4: only a data check catches it
    with pytest.raises(ValueError, match="kv_valid_sizes values must lie in"):
        video_sparse_attn(q, q, q, topk=1, kv_valid_sizes=sizes)
    assert math.isfinite(
        float(
            video_sparse_attn(
                q, q, q, topk=1, kv_valid_sizes=sizes[:3].repeat(2)[:4], validate=False
            ).sum()
        )
    )
    # Metadata checks still run without validate.
    with pytest.raises(ValueError, match="kv_valid_sizes must be an integer tensor"):
        video_sparse_attn(q, q, q, topk=1, kv_valid_sizes=sizes.float(), validate=False)


def test_video_sparse_attn_bhsd_error_names_bhsd():
    q = torch.zeros(1, 2, 128, 4)
    video_sparse_attn(q, q, q, topk=1, tiling=TILING, qkv_format="bhsd")  # valid
    with pytest.raises(ValueError, match=r"q must have tiling\.padded_len"):
        video_sparse_attn(q, q, q, topk=1, tiling=TILING)  # read as BSHD: seq 2
    with pytest.raises(ValueError, match="k must have q's number of heads"):
        video_sparse_attn(q, q[:, :1], q[:, :1], topk=1, tiling=TILING, qkv_format="bhsd")


def test_raster_order_asks_for_no_clean_copies_and_keeps_the_gradients(monkeypatch):
    """Raster tokens go through the stage's `pool_from_raster`, which tiles them with zero
    padding, so no zero-padded copies are asked of `pool_and_clean` (training included, where
    tile-order inputs need them); output and gradients still equal the tiled call's on the same
    zero-padded tiles."""
    from vsa_core.coarse import TorchCoarse

    asked = []
    original = TorchCoarse.pool_and_clean

    def recording(self, q, k, v, valid_sizes, clean, padding_index):
        asked.append(tuple(clean))
        return original(self, q, k, v, valid_sizes, clean, padding_index)

    monkeypatch.setattr(TorchCoarse, "pool_and_clean", recording)
    tiling = VideoTiling((3, 5, 6), (2, 2, 4))
    gen = _gen(11)
    raster = [_randn(gen, 1, tiling.seq_len, 2, 4).requires_grad_() for _ in range(3)]
    tiled = [tiling.to_tiles(t.detach()).requires_grad_() for t in raster]
    dout = _randn(gen, 1, tiling.seq_len, 2, 4)
    out = video_sparse_attn(*raster, topk=3, tiling=tiling, token_order="raster")
    grads = torch.autograd.grad(out, raster, dout)
    assert asked == [], "raster tokens are tiled with zero padding: nothing to clean"
    out_t = video_sparse_attn(*tiled, topk=3, tiling=tiling)
    grads_t = torch.autograd.grad(out_t, tiled, tiling.to_tiles(dout))
    assert asked and asked[0] != (False, False, False), "tiled inputs with padding are cleaned"
    torch.testing.assert_close(out, tiling.from_tiles(out_t), rtol=0, atol=1e-12)
    for g, g_t in zip(grads, grads_t, strict=True):
        torch.testing.assert_close(g, tiling.from_tiles(g_t), rtol=0, atol=1e-12)


# ---- a backend that fuses the combine: which path the op takes ------------------------------
class _FusingRecorder:
    """Built lazily (the registry's Backend base): a backend declaring ``fuses_combine`` that
    records which of its methods the op called and computes with the reference."""

    @staticmethod
    def make():
        from vsa_core.backends import Backend
        from vsa_core.backends.reference import ReferenceBackend

        class FusingRecorder(Backend):
            name = "fusing_recorder"
            priority = 1000
            fuses_combine = True

            def __init__(self):
                self.calls = []

            def supports(self, call):
                return None

            def forward(self, q, k, v, layout, scale):
                self.calls.append("forward")
                return ReferenceBackend().forward(q, k, v, layout, scale)

            def forward_combined(self, q, k, v, layout, scale, coarse, gate, slot_rows=None):
                self.calls.append("forward_combined")
                fine, _ = ReferenceBackend().forward(q, k, v, layout, scale)
                rows = coarse.repeat_interleave(layout.q_block, dim=1)
                return fine + (rows if gate is None else gate * rows)

        return FusingRecorder()


@pytest.mark.parametrize(
    ("token_order", "grad", "expected"),
    [
        ("tiled", False, "forward_combined"),
        ("tiled", True, "forward"),
        ("raster", False, "forward"),
    ],
)
def test_op_asks_a_fusing_backend_for_the_combined_forward_only_in_tile_order_inference(
    fresh_registry, token_order, grad, expected
):
    """Without gradients in tile order the op hands the combine to a backend that fuses it
    (`Backend.fuses_combine`: fa4's and triton's epilogues); with gradients, or raster inputs
    through copies (which the op's combine writes back to raster order), it runs the forward
    and combines itself. The results equal the reference backend's either way."""
    from vsa_core.backends import register_backend

    backend = _FusingRecorder.make()
    register_backend(backend)
    tiling = VideoTiling((5, 6, 7), tile_shape=(2, 2, 2))  # partial tiles on every axis
    seq = tiling.padded_len if token_order == "tiled" else tiling.seq_len
    gen = torch.Generator().manual_seed(0)
    q, k, v, gate = (torch.randn(1, seq, 2, 8, generator=gen) for _ in range(4))
    if token_order == "tiled":  # real tile-order inputs: zero padding, as to_tiles makes
        q, k, v, gate = (tiling.to_tiles(tiling.from_tiles(t)) for t in (q, k, v, gate))
    kwargs = {"tiling": tiling, "topk": 5, "coarse_gate": gate, "token_order": token_order}
    with torch.set_grad_enabled(grad):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        got = video_sparse_attn(*leaves, backend="fusing_recorder", **kwargs)
        want = video_sparse_attn(q, k, v, backend="reference", **kwargs)
    assert backend.calls == [expected]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("latent", "grad", "asks"),
    [((5, 6, 7), False, True), ((5, 6, 7), True, True), ((4, 6, 8), False, False),
     ((4, 6, 8), True, False)],
)  # fmt: skip
def test_op_asks_the_coarse_stage_for_the_split_lists_a_backend_reads(
    fresh_registry, monkeypatch, latent, grad, asks
):
    """A backend that reads a layout's `ForwardSplit` (``reads_forward_split``) gets it from
    the coarse stage's own selection pass (`CoarseStage.select_split`) on a latent with
    partial tiles, in inference (its combined forward) and in training (its forward); on a
    tile-aligned latent (no partial blocks) the op selects as before and attaches none."""
    from vsa_core.backends import register_backend
    from vsa_core.coarse import TorchCoarse
    from vsa_core.layout import ForwardSplit

    backend = _FusingRecorder.make()
    type(backend).reads_forward_split = True
    seen, asked = [], []

    def recording(method):
        def record(q, k, v, layout, *rest):
            seen.append(layout.forward_split)
            return method(q, k, v, layout, *rest)

        return record

    def select_split(self, q_pooled, k_pooled, valid_sizes, topk, kv_tile):
        asked.append(kv_tile)
        indices = self.select(q_pooled, k_pooled, valid_sizes, topk)
        return indices, ForwardSplit(indices, indices[..., 0], indices, indices[..., 0])

    for name in ("forward", "forward_combined"):
        monkeypatch.setattr(backend, name, recording(getattr(backend, name)))
    monkeypatch.setattr(TorchCoarse, "select_split", select_split)
    register_backend(backend)
    tiling = VideoTiling(latent, tile_shape=(2, 2, 2))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (tiling.to_tiles(torch.randn(1, tiling.seq_len, 2, 8, generator=gen)) for _ in "qkv")
    with torch.set_grad_enabled(grad):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        video_sparse_attn(*leaves, tiling=tiling, topk=3, backend="fusing_recorder",
                          coarse_backend="torch")  # fmt: skip
    assert asked == ([8] if asks else [])
    assert [s is not None for s in seen] == ([True] if asks else [False] * len(seen))


# ---- a backend that reads key padding as it is on some calls only -------------------------------
def _padding_reader(in_inference: bool = True):
    """A reference-backed backend whose `reads_key_padding_as_is` says yes for inference only
    (as fa4's 64x64 forward does; never if not ``in_inference``, as fa4's shipped forward)
    and that records whether v reached it with NaN padding."""
    from vsa_core.backends import Backend
    from vsa_core.backends.reference import ReferenceBackend

    class PaddingReader(Backend):
        name = "padding_reader"
        priority = 1000

        def __init__(self):
            self.nan_in_v = []

        def supports(self, call):
            return None

        def reads_key_padding_as_is(self, call):
            return in_inference and not call.requires_grad

        def forward(self, q, k, v, layout, scale):
            self.nan_in_v.append(bool(torch.isnan(v).any()))
            return ReferenceBackend().forward(q, k, v, layout, scale)  # masks with where

    return PaddingReader()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op", ["video", "block"])
def test_ops_skip_the_zeroed_copy_only_where_the_backend_reads_padding_as_is(
    fresh_registry, op, grad
):
    """`Backend.reads_key_padding_as_is` decides per call: in inference the backend above gets
    v with its NaN padding as the caller passed it (no zeroed copy: what saves fa4's 64x64
    inference a copy of v), in training a copy with zeroed padding; the output equals the
    reference's on zero padding either way."""
    from vsa_core.backends import register_backend

    backend = _padding_reader()
    register_backend(backend)
    tiling = VideoTiling((5, 6, 7), tile_shape=(2, 2, 2))  # partial tiles on every axis
    gen = torch.Generator().manual_seed(3)
    q, k, v = (tiling.to_tiles(torch.randn(1, tiling.seq_len, 2, 8, generator=gen))
               for _ in range(3))  # fmt: skip
    v_nan = v.clone().index_fill_(1, tiling.indices(v.device).padding_index, float("nan"))
    valid = tiling.valid_sizes(v.device)
    with torch.set_grad_enabled(grad):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v_nan)]
        if op == "video":
            got = video_sparse_attn(*leaves, tiling=tiling, topk=5, backend="padding_reader")
            want = video_sparse_attn(q, k, v, tiling=tiling, topk=5, backend="reference")
        else:
            mask = torch.rand(1, 2, valid.numel(), valid.numel(), generator=gen) < 0.4
            mask[..., 0] = True
            layout = BlockSparseLayout.from_block_mask(mask, valid, (8, 8))
            got, _ = block_sparse_attn(*leaves, layout, backend="padding_reader")
            want, _ = block_sparse_attn(q, k, v, layout, backend="reference")
    assert backend.nan_in_v == [not grad]
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- inference zeroes padding where it is instead of copying ---------------------------------
def _nan_padded(tiling, seed):
    """q, k, v in tile order ([1, padded, 2, 8], float64) with NaN in every padding slot."""
    gen = _gen(seed)
    padding = tiling.indices().padding_index
    return [
        tiling.to_tiles(_randn(gen, 1, tiling.seq_len, 2, 8)).index_fill_(1, padding, math.nan)
        for _ in range(3)
    ]


def _recording_cleans(monkeypatch):
    """What the op asks the torch stage for: ``("clean", flags)`` from `pool_and_clean`,
    ``("zero", flags)`` from `pool_zeroing_padding`."""
    from vsa_core.coarse import TorchCoarse

    asked = []
    for method, tag in (("pool_and_clean", "clean"), ("pool_zeroing_padding", "zero")):
        original = getattr(TorchCoarse, method)

        def recording(self, q, k, v, valid_sizes, flags, padding_index, original=original,
                      tag=tag):  # fmt: skip
            asked.append((tag, tuple(flags)))
            return original(self, q, k, v, valid_sizes, flags, padding_index)

        monkeypatch.setattr(TorchCoarse, method, recording)
    return asked


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
def test_inference_zeroes_v_padding_in_place_and_asks_for_no_copy(monkeypatch, fresh_registry, fmt):
    """Without autograd, for a backend that multiplies V's padding by zero probabilities, v's
    padding slots (NaN here) are zeroed in the caller's tensor and the coarse stage is asked
    for no copy; the backend sees no NaN, every real token of q, k and v is untouched and the
    output is the reference's on zero padding."""
    reader = _padding_reader(in_inference=False)
    fresh_registry.register_backend(reader)
    asked = _recording_cleans(monkeypatch)
    tiling = VideoTiling((5, 6, 7), tile_shape=(2, 2, 2))  # partial tiles on every axis
    q, k, v = _nan_padded(tiling, 4)
    want = video_sparse_attn(
        *(t.nan_to_num(0.0) for t in (q, k, v)), topk=5, tiling=tiling, backend="reference"
    )
    asked.clear()
    real = tiling.indices().tile_to_raster >= 0
    before = [t[:, real].clone() for t in (q, k, v)]
    args = (q, k, v) if fmt == "bshd" else tuple(t.transpose(1, 2) for t in (q, k, v))
    with torch.no_grad():
        got = video_sparse_attn(
            *args, topk=5, tiling=tiling, qkv_format=fmt, backend="padding_reader"
        )
    if fmt == "bhsd":
        got = got.transpose(1, 2)
    assert asked == [("zero", (False, False, True))] and reader.nan_in_v == [False]
    assert torch.equal(v[:, ~real], torch.zeros_like(v[:, ~real]))
    assert torch.isnan(k[:, ~real]).all() and torch.isnan(q[:, ~real]).all()  # not read
    for t, b in zip((q, k, v), before, strict=True):
        assert torch.equal(t[:, real], b)
    torch.testing.assert_close(got[:, real], want[:, real], rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["training", "inference-tensor", "expanded", "no-tiling"])
def test_padding_is_copied_where_it_cannot_or_must_not_be_written(
    monkeypatch, fresh_registry, case
):
    """With gradients, for an inference tensor outside inference mode, for a v whose elements
    share memory (an expand) and without a tiling, the caller's v is left as it was and the
    backend reads a zero-padded copy; the output is the same."""
    reader = _padding_reader(in_inference=False)
    fresh_registry.register_backend(reader)
    asked = _recording_cleans(monkeypatch)
    tiling = VideoTiling((5, 6, 7), tile_shape=(2, 2, 2))
    q, k, v = _nan_padded(tiling, 5)
    if case == "expanded":  # one head's values shared by both heads
        v = v[:, :, :1].expand(-1, -1, 2, -1)
    elif case == "inference-tensor":
        with torch.inference_mode():
            v = v.clone()
    want = video_sparse_attn(
        *(t.nan_to_num(0.0) for t in (q, k, v)), topk=5, tiling=tiling, backend="reference"
    )
    asked.clear()
    v_before = v.clone()
    where = {"kv_valid_sizes": tiling.valid_sizes()} if case == "no-tiling" else {"tiling": tiling}
    with torch.set_grad_enabled(case == "training"):
        leaves = [t.requires_grad_() if case == "training" else t for t in (q, k)]
        got = video_sparse_attn(*leaves, v, topk=5, backend="padding_reader", **where)
    assert asked == [("clean", (False, False, True))] or asked == [("clean", (True, True, True))]
    assert reader.nan_in_v == [False], "a zero-padded copy of v"
    assert torch.equal(v.isnan(), v_before.isnan())
    assert torch.equal(v.nan_to_num(0.0), v_before.nan_to_num(0.0))
    real = tiling.indices().tile_to_raster >= 0
    torch.testing.assert_close(got.detach()[:, real], want[:, real], rtol=0, atol=1e-12)

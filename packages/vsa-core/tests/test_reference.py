"""The pure-PyTorch reference against dense float64 attention with a token-level mask."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vsa_naive import SETTINGS, dense_attention, masked_attention, random_block_mask, token_mask

from vsa_core.layout import BlockSparseLayout
from vsa_core.reference import reference_block_sparse_attn


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _qkv(gen, batch, q_len, kv_len, heads, dim, dtype=torch.float64, requires_grad=False):
    q = torch.randn(batch, q_len, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_len, heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_len, heads, dim, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


def test_all_selected_full_blocks_equals_dense():
    gen = _gen(0)
    batch, heads, dim, qb, kvb, nq, nkv = 2, 3, 8, 4, 8, 3, 5
    q, k, v = _qkv(gen, batch, nq * qb, nkv * kvb, heads, dim)
    layout = BlockSparseLayout.from_block_mask(
        torch.ones(batch, heads, nq, nkv, dtype=torch.bool), torch.full((nkv,), kvb), (qb, kvb)
    )
    out, lse = reference_block_sparse_attn(q, k, v, layout, 0.3)
    want_out, want_lse = dense_attention(q, k, v, 0.3)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == q.shape and lse.shape == (batch, heads, nq * qb)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)


@SETTINGS
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    nq=st.integers(1, 4),
    nkv=st.integers(1, 5),
    qb=st.sampled_from([1, 2, 4]),
    kvb=st.sampled_from([1, 3, 4]),
    dim=st.integers(1, 6),
    p=st.sampled_from([0.3, 0.6, 1.0]),
    seed=st.integers(0, 2**31),
    scale=st.floats(0.05, 2.0),
)
def test_random_sparse_partial_matches_masked_dense(
    batch, heads, nq, nkv, qb, kvb, dim, p, seed, scale
):
    gen = _gen(seed)
    q, k, v = _qkv(gen, batch, nq * qb, nkv * kvb, heads, dim)
    valid = torch.randint(0, kvb + 1, (nkv,), generator=gen)
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, p)
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    out, lse = reference_block_sparse_attn(q, k, v, layout, scale)
    mask = token_mask(block_mask, valid, qb, kvb)
    want_out, want_lse = masked_attention(q, k, v, mask, scale)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    seen = mask.any(-1)
    assert torch.equal(torch.isinf(lse), ~seen)
    assert bool((lse[~seen] < 0).all())
    torch.testing.assert_close(lse[seen], want_lse[seen], rtol=0, atol=1e-10)
    # Padding keys really are ignored: garbage there changes nothing.
    k2, v2 = k.clone(), v.clone()
    for j, size in enumerate(valid.tolist()):
        k2[:, j * kvb + size : (j + 1) * kvb] = 1e3
        v2[:, j * kvb + size : (j + 1) * kvb] = -1e3
    out2, _ = reference_block_sparse_attn(q, k2, v2, layout, scale)
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)


def test_unseen_rows_zero_out_minus_inf_lse_and_finite_grads():
    gen = _gen(1)
    batch, heads, dim, qb, kvb, nq, nkv = 1, 2, 4, 2, 4, 4, 3
    q, k, v = _qkv(gen, batch, nq * qb, nkv * kvb, heads, dim, requires_grad=True)
    valid = torch.tensor([4, 0, 2])
    block_mask = torch.zeros(batch, heads, nq, nkv, dtype=torch.bool)
    block_mask[0, :, 0, 0] = True  # normal row
    block_mask[0, :, 1, 1] = True  # only an empty block
    # row 2: nothing selected
    block_mask[0, :, 3, [1, 2]] = True  # an empty block and a partial one
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    out, lse = reference_block_sparse_attn(q, k, v, layout, 0.5)
    unseen = slice(qb, 3 * qb)  # query blocks 1 and 2
    assert torch.equal(out[:, unseen], torch.zeros_like(out[:, unseen]))
    assert bool(torch.isneginf(lse[..., unseen]).all())
    assert bool(torch.isfinite(lse[..., :qb]).all() and torch.isfinite(lse[..., 3 * qb :]).all())
    want_out, _ = masked_attention(q, k, v, token_mask(block_mask, valid, qb, kvb), 0.5)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)

    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    ((out * weight).sum() + finite_lse.sum()).backward()
    for t in (q, k, v):
        assert bool(torch.isfinite(t.grad).all())
    # Rows that see nothing get zero query gradient; the empty block's keys/values get none.
    assert torch.equal(q.grad[:, unseen], torch.zeros_like(q.grad[:, unseen]))
    assert torch.equal(k.grad[:, kvb : 2 * kvb], torch.zeros_like(k.grad[:, kvb : 2 * kvb]))
    assert torch.equal(v.grad[:, kvb : 2 * kvb], torch.zeros_like(v.grad[:, kvb : 2 * kvb]))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_tiny_chunks_equal_default(requires_grad):
    gen = _gen(2)
    batch, heads, dim, qb, kvb, nq, nkv = 2, 2, 4, 2, 4, 7, 5
    q, k, v = _qkv(gen, batch, nq * qb, nkv * kvb, heads, dim, requires_grad=requires_grad)
    valid = torch.tensor([4, 1, 0, 3, 4])
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, 0.5)
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    out_a, lse_a = reference_block_sparse_attn(q, k, v, layout, 0.4)
    out_b, lse_b = reference_block_sparse_attn(q, k, v, layout, 0.4, chunk_bytes=1)
    out_c, lse_c = reference_block_sparse_attn(q, k, v, layout, 0.4, chunk_bytes=3000)
    for o, lse in ((out_b, lse_b), (out_c, lse_c)):
        torch.testing.assert_close(o, out_a, rtol=0, atol=1e-12)
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_a))
        torch.testing.assert_close(
            lse[torch.isfinite(lse)], lse_a[torch.isfinite(lse_a)], rtol=0, atol=1e-12
        )
    if requires_grad:
        weight = torch.randn(out_a.shape, generator=gen, dtype=torch.float64)
        grads_a = torch.autograd.grad((out_a * weight).sum(), (q, k, v))
        grads_b = torch.autograd.grad((out_b * weight).sum(), (q, k, v))
        for ga, gb in zip(grads_a, grads_b, strict=True):
            torch.testing.assert_close(gb, ga, rtol=0, atol=1e-12)


def test_gradcheck_partial_blocks():
    gen = _gen(3)
    batch, heads, dim, qb, kvb, nq, nkv = 1, 2, 3, 2, 3, 3, 3
    q, k, v = _qkv(gen, batch, nq * qb, nkv * kvb, heads, dim, requires_grad=True)
    valid = torch.tensor([3, 2, 1])
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, 0.6)
    block_mask[..., 0] = True  # every row sees a key: lse finite everywhere
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))

    def fn(q, k, v):
        out, lse = reference_block_sparse_attn(q, k, v, layout, 0.7, chunk_bytes=1)
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


def test_grads_match_masked_dense():
    gen = _gen(4)
    batch, heads, dim, qb, kvb, nq, nkv = 2, 2, 4, 3, 4, 3, 4
    q, k, v = _qkv(gen, batch, nq * qb, nkv * kvb, heads, dim, requires_grad=True)
    valid = torch.tensor([4, 3, 0, 1])
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, 0.5)
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    mask = token_mask(block_mask, valid, qb, kvb)
    wo = torch.randn(batch, nq * qb, heads, dim, generator=gen, dtype=torch.float64)
    wl = torch.randn(batch, heads, nq * qb, generator=gen, dtype=torch.float64)

    def loss(out, lse):
        return (out * wo).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * wl).sum()

    got = torch.autograd.grad(loss(*reference_block_sparse_attn(q, k, v, layout, 0.5)), (q, k, v))
    want = torch.autograd.grad(loss(*masked_attention(q, k, v, mask, 0.5)), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)]
)
def test_low_precision_dtypes(dtype, tol):
    gen = _gen(5)
    batch, heads, dim, qb, kvb, nq, nkv = 1, 2, 8, 4, 4, 3, 4
    q, k, v = _qkv(gen, batch, nq * qb, nkv * kvb, heads, dim)
    valid = torch.tensor([4, 2, 3, 4])
    block_mask = random_block_mask(gen, batch, heads, nq, nkv, 0.6)
    block_mask[..., 0] = True
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (qb, kvb))
    ql, kl, vl = (t.to(dtype) for t in (q, k, v))
    out, lse = reference_block_sparse_attn(ql, kl, vl, layout, 0.35)
    assert out.dtype == dtype
    assert lse.dtype == torch.float32
    # Compare against float64 attention of the same (rounded) inputs.
    want_out, want_lse = masked_attention(ql, kl, vl, token_mask(block_mask, valid, qb, kvb), 0.35)
    err = (out.double() - want_out).norm() / want_out.norm()
    assert err < tol
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=10 * tol)
    assert math.isfinite(float(lse.sum()))

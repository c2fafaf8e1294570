"""The coarse stage (pooling, coarse attention, top-k) against naive float64 loops."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vsa_naive import SETTINGS, naive_coarse_attention, naive_pool, naive_topk_mask

from vsa_core import coarse
from vsa_core.coarse import coarse_attention, pool_tiles, select_topk


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _with_garbage_padding(x, valid, tile_tokens, gen):
    """Fill every padding slot of tile-order x with large non-zero values."""
    x = x.clone()
    for n, size in enumerate(valid.tolist()):
        pad = x[:, n * tile_tokens + size : (n + 1) * tile_tokens]
        pad.copy_(100 + 50 * torch.rand(pad.shape, generator=gen, dtype=x.dtype))
    return x


@SETTINGS
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    num_tiles=st.integers(1, 6),
    tile_tokens=st.integers(1, 6),
    dim=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_pool_tiles_ignores_padding(batch, heads, num_tiles, tile_tokens, dim, seed):
    gen = _gen(seed)
    valid = torch.randint(0, tile_tokens + 1, (num_tiles,), generator=gen, dtype=torch.int32)
    x = torch.randn(batch, num_tiles * tile_tokens, heads, dim, generator=gen, dtype=torch.float64)
    x = _with_garbage_padding(x, valid, tile_tokens, gen)
    want = naive_pool(x, valid)

    got = pool_tiles(x, valid)
    assert got.shape == (batch, num_tiles, heads, dim)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    # BHSD storage seen through a BSHD view (the layout ops hand it over in).
    x_bhsd = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x_bhsd.is_contiguous() or heads == 1 or num_tiles * tile_tokens == 1
    torch.testing.assert_close(pool_tiles(x_bhsd, valid), want, rtol=0, atol=1e-12)

    # Any other strided view (a slice of the head dim) works too.
    wide = torch.cat([x, torch.randn(x.shape, generator=gen, dtype=x.dtype)], dim=-1)
    torch.testing.assert_close(pool_tiles(wide[..., :dim], valid), want, rtol=0, atol=1e-12)


def test_pool_tiles_gradient_is_mean_weights():
    valid = torch.tensor([3, 0, 1], dtype=torch.int32)
    x = torch.randn(1, 12, 2, 2, dtype=torch.float64, requires_grad=True)
    pool_tiles(x, valid).sum().backward()
    expected = torch.zeros(12, dtype=torch.float64)
    expected[0:3] = 1 / 3
    expected[8] = 1.0
    torch.testing.assert_close(x.grad[0, :, 0, 0], expected, rtol=0, atol=1e-15)


@SETTINGS
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    num_tiles=st.integers(1, 7),
    dim=st.integers(1, 5),
    seed=st.integers(0, 2**31),
    scale=st.floats(0.1, 3.0),
)
def test_coarse_attention_masks_empty_tiles(batch, heads, num_tiles, dim, seed, scale):
    gen = _gen(seed)
    valid = torch.randint(0, 3, (num_tiles,), generator=gen, dtype=torch.int32)
    valid[int(torch.randint(0, num_tiles, (1,), generator=gen))] = 2  # at least one non-empty
    qp, kp, vp = (
        torch.randn(batch, num_tiles, heads, dim, generator=gen, dtype=torch.float64)
        for _ in range(3)
    )
    got = coarse_attention(qp, kp, vp, valid, scale)
    want = naive_coarse_attention(qp, kp, vp, valid, scale)
    assert got.shape == (batch, num_tiles, heads, dim)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@SETTINGS
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 4),
    num_tiles=st.integers(1, 9),
    dim=st.integers(2, 6),
    seed=st.integers(0, 2**31),
    data=st.data(),
    tiny_chunks=st.booleans(),
)
def test_select_topk_picks_highest(batch, heads, num_tiles, dim, seed, data, tiny_chunks):
    gen = _gen(seed)
    valid = torch.randint(0, 4, (num_tiles,), generator=gen, dtype=torch.int32)
    valid[0] = 3
    non_empty = int((valid > 0).sum())
    topk = data.draw(st.integers(1, non_empty))
    qp = torch.randn(batch, num_tiles, heads, dim, generator=gen, dtype=torch.float64)
    kp = torch.randn(batch, num_tiles, heads, dim, generator=gen, dtype=torch.float64)
    want, margin = naive_topk_mask(qp, kp, valid, topk)
    # Continuous random scores have no ties; skip the vanishingly rare near-tie.
    if margin < 1e-4:
        return
    chunk = 1 if tiny_chunks else coarse.SELECTION_CHUNK_BYTES
    old, coarse.SELECTION_CHUNK_BYTES = coarse.SELECTION_CHUNK_BYTES, chunk
    try:
        layout = select_topk(qp, kp, valid, topk, tile_tokens=3)
    finally:
        coarse.SELECTION_CHUNK_BYTES = old
    assert layout.block_shape == (3, 3)
    assert layout.kv_counts.tolist() == [[[topk] * num_tiles] * heads] * batch
    assert torch.equal(layout.to_block_mask(), want)
    rows = layout.kv_indices.reshape(-1, topk).tolist()
    assert all(r == sorted(set(r)) for r in rows)  # ascending, distinct
    empty = set(torch.nonzero(valid == 0).flatten().tolist())
    assert not any(set(r) & empty for r in rows)
    assert layout.kv_valid_sizes.tolist() == valid.tolist()


def test_select_topk_never_prefers_empty_tiles():
    # Empty tiles with by far the largest raw scores must still lose to every non-empty tile.
    num_tiles = 5
    valid = torch.tensor([2, 0, 2, 0, 2], dtype=torch.int32)
    qp = torch.ones(1, num_tiles, 1, 2, dtype=torch.float64)
    kp = torch.tensor([0.1, 50.0, 0.2, 60.0, 0.3], dtype=torch.float64).view(1, 5, 1, 1)
    kp = kp.expand(1, 5, 1, 2).contiguous()
    layout = select_topk(qp, kp, valid, 3, tile_tokens=2)
    for row in layout.kv_indices.reshape(-1, 3).tolist():
        assert row == [0, 2, 4]
    # Asking for more than the non-empty tiles fills up with empty ones.
    layout = select_topk(qp, kp, valid, 5, tile_tokens=2)
    for row in layout.kv_indices.reshape(-1, 5).tolist():
        assert row == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pool_and_coarse_low_precision(dtype):
    gen = _gen(9)
    valid = torch.tensor([4, 2, 3, 1], dtype=torch.int32)
    x = torch.randn(2, 16, 2, 8, generator=gen, dtype=torch.float64)
    pooled = pool_tiles(x.to(dtype), valid)
    assert pooled.dtype == dtype
    torch.testing.assert_close(pooled.double(), naive_pool(x, valid), rtol=0, atol=5e-3)
    out = coarse_attention(pooled, pooled, pooled, valid, 0.3)
    assert out.dtype == dtype
    want = naive_coarse_attention(*(pooled.double(),) * 3, valid, 0.3)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=5e-3)


def test_select_topk_per_batch_and_head_independent():
    """Rows of different (batch, head) select independently (naive loop, one row at a time)."""
    gen = _gen(11)
    batch, heads, num_tiles, dim = 2, 3, 6, 4
    valid = torch.full((num_tiles,), 8, dtype=torch.int32)
    qp = torch.randn(batch, num_tiles, heads, dim, generator=gen, dtype=torch.float64)
    kp = torch.randn(batch, num_tiles, heads, dim, generator=gen, dtype=torch.float64)
    layout = select_topk(qp, kp, valid, 2, tile_tokens=8)
    for b, h, i in itertools.product(range(batch), range(heads), range(num_tiles)):
        scores = [float(qp[b, i, h] @ kp[b, j, h]) for j in range(num_tiles)]
        best = sorted(sorted(range(num_tiles), key=lambda j, s=scores: -s[j])[:2])
        assert layout.kv_indices[b, h, i].tolist() == best

"""VideoTiling against a loop-by-loop restatement of tile order."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vsa_naive import SETTINGS, naive_from_tiles, naive_tiling, naive_to_tiles

from vsa_core.tiling import VideoTiling

TILE_SHAPES = [(4, 4, 4), (4, 8, 8), (2, 8, 8), (1, 1, 1), (3, 5, 2), (1, 7, 3), (5, 1, 1)]
latent_shapes = st.tuples(*(st.integers(1, 13) for _ in range(3)))
tile_shapes = st.one_of(
    st.sampled_from(TILE_SHAPES), st.tuples(*(st.integers(1, 6) for _ in range(3)))
)


@SETTINGS
@given(latent=latent_shapes, tile=tile_shapes)
def test_counts_and_permutation(latent, tile):
    tiling = VideoTiling(latent, tile)
    idx = tiling.indices()
    seq = math.prod(latent)
    grid = tuple(-(-n // t) for n, t in zip(latent, tile, strict=True))
    assert tiling.grid_shape == grid
    assert tiling.num_tiles == math.prod(grid)
    assert tiling.seq_len == seq
    assert tiling.tile_tokens == math.prod(tile)
    assert tiling.padded_len == math.prod(grid) * math.prod(tile)
    assert tiling.has_padding == (tiling.padded_len != seq)

    r2t = idx.raster_to_tile.tolist()
    assert idx.raster_to_tile.dtype == torch.int64
    assert len(r2t) == seq
    assert len(set(r2t)) == seq  # injective
    assert all(0 <= s < tiling.padded_len for s in r2t)

    # tile_to_raster is its inverse on real slots and -1 on padding.
    t2r = idx.tile_to_raster.tolist()
    assert len(t2r) == tiling.padded_len
    for r, s in enumerate(r2t):
        assert t2r[s] == r
    assert sum(1 for x in t2r if x == -1) == tiling.padded_len - seq
    assert idx.nonpad_index.tolist() == sorted(r2t)


@SETTINGS
@given(latent=latent_shapes, tile=tile_shapes)
def test_matches_naive_tile_order(latent, tile):
    tiling = VideoTiling(latent, tile)
    expected_r2t, members = naive_tiling(latent, tile)
    valid = tiling.valid_sizes()
    assert valid.dtype == torch.int32
    # Valid sizes are the naive per-tile counts and sum to seq_len.
    assert valid.tolist() == [len(m) for m in members]
    assert int(valid.sum()) == tiling.seq_len
    assert all(0 < n <= tiling.tile_tokens for n in valid.tolist())
    # Within each tile the real tokens fill the first valid_size slots, in raster order.
    r2t = tiling.indices().raster_to_tile.tolist()
    for n, tokens in enumerate(members):
        assert [r2t[r] for r in tokens] == list(
            range(n * tiling.tile_tokens, n * tiling.tile_tokens + len(tokens))
        )
    assert r2t == expected_r2t


@SETTINGS
@given(
    latent=latent_shapes,
    tile=st.sampled_from(TILE_SHAPES),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    dim=st.integers(1, 4),
)
def test_to_from_tiles_round_trip(latent, tile, batch, heads, dim):
    tiling = VideoTiling(latent, tile)
    x = torch.randn(batch, tiling.seq_len, heads, dim, dtype=torch.float64)
    tiled = tiling.to_tiles(x)
    assert tiled.shape == (batch, tiling.padded_len, heads, dim)
    assert torch.equal(tiled, naive_to_tiles(x, latent, tile))
    assert torch.equal(tiling.from_tiles(tiled), x)

    # BHSD: the same, with the sequence on dim 2.
    xh = x.transpose(1, 2).contiguous()
    tiled_h = tiling.to_tiles(xh, "bhsd")
    assert tiled_h.shape == (batch, heads, tiling.padded_len, dim)
    assert torch.equal(tiled_h, tiled.transpose(1, 2))
    assert torch.equal(tiling.from_tiles(tiled_h, "bhsd"), xh)

    # Padding slots hold zeros; from_tiles ignores whatever padding holds.
    pad = tiling.indices().tile_to_raster == -1
    assert torch.count_nonzero(tiled[:, pad]) == 0
    garbage = tiled.clone()
    garbage[:, pad] = 7.0
    assert torch.equal(tiling.from_tiles(garbage), naive_from_tiles(garbage, latent, tile))
    assert torch.equal(tiling.from_tiles(garbage), x)


@SETTINGS
@given(
    latent=latent_shapes, tile=st.sampled_from(TILE_SHAPES), fmt=st.sampled_from(["bshd", "bhsd"])
)
def test_gradients_flow(latent, tile, fmt):
    tiling = VideoTiling(latent, tile)
    shape = (2, tiling.seq_len, 3, 2) if fmt == "bshd" else (2, 3, tiling.seq_len, 2)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(shape, dtype=torch.float64)
    (tiling.from_tiles(tiling.to_tiles(x, fmt), fmt) * weight).sum().backward()
    assert torch.equal(x.grad, weight)  # the round trip is the identity, and so is its gradient

    # from_tiles' gradient puts each token's gradient in its slot and zero in padding.
    seq_dim = 1 if fmt == "bshd" else 2
    pshape = list(shape)
    pshape[seq_dim] = tiling.padded_len
    y = torch.randn(pshape, dtype=torch.float64, requires_grad=True)
    g = torch.randn(shape, dtype=torch.float64)
    (tiling.from_tiles(y, fmt) * g).sum().backward()
    expected = torch.zeros(pshape, dtype=torch.float64)
    r2t, _ = naive_tiling(latent, tile)
    for r, slot in enumerate(r2t):
        expected.select(seq_dim, slot).copy_(g.select(seq_dim, r))
    assert torch.equal(y.grad, expected)


def test_wan_480p_numbers():
    tiling = VideoTiling((21, 30, 52))
    assert tiling.tile_shape == (4, 4, 4)
    assert tiling.grid_shape == (6, 8, 13)
    assert tiling.num_tiles == 624
    assert tiling.seq_len == 32760
    assert tiling.padded_len == 39936
    assert tiling.has_padding
    valid = tiling.valid_sizes()
    assert int(valid.sum()) == 32760
    # Full tiles hold 64 tokens; the last T tiles have 1 frame (21 = 5*4 + 1), the last H row
    # 2 rows (30 = 7*4 + 2), the last W column all 4 (52 = 13*4).
    assert int(valid[0]) == 64
    assert int(valid[-1]) == 1 * 2 * 4
    assert sorted(set(valid.tolist())) == [8, 16, 32, 64]


def test_caching_returns_same_tensors():
    a = VideoTiling((5, 6, 7), (2, 3, 4))
    b = VideoTiling([5, 6, 7], [2, 3, 4])
    assert a == b and hash(a) == hash(b)
    ia, ib = a.indices(), b.indices("cpu")
    assert ia is ib
    assert ia.raster_to_tile is ib.raster_to_tile
    assert a.valid_sizes() is b.valid_sizes(torch.device("cpu"))
    c = VideoTiling((5, 6, 7), (2, 3, 3))
    assert c != a
    assert c.indices() is not ia


def test_no_padding_is_identity_per_tile():
    # When the latent is one tile, tile order is raster order.
    tiling = VideoTiling((2, 3, 4), (2, 3, 4))
    assert not tiling.has_padding
    assert tiling.indices().raster_to_tile.tolist() == list(range(24))


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
def test_to_tiles_rejects_wrong_length(fmt):
    tiling = VideoTiling((3, 3, 3), (2, 2, 2))
    bad = torch.zeros(1, 26, 2, 4) if fmt == "bshd" else torch.zeros(1, 2, 26, 4)
    with pytest.raises(ValueError, match="x must have seq_len"):
        tiling.to_tiles(bad, fmt)
    with pytest.raises(ValueError, match="x must have padded_len"):
        tiling.from_tiles(bad, fmt)
    with pytest.raises(ValueError, match="x must be a 4-D"):
        tiling.to_tiles(torch.zeros(27, 2, 4), fmt)
    with pytest.raises(ValueError, match="qkv_format"):
        tiling.to_tiles(torch.zeros(1, 27, 2, 4), "sbhd")


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
def test_to_tiles_gradient_is_the_gather_and_keeps_only_the_index(fmt):
    """to_tiles' backward gathers the real slots (gradcheck in float64) and saves nothing of its
    input: a raster-order model would otherwise hold q, k, v and the gate of every layer."""
    tiling = VideoTiling((3, 5, 6), (2, 2, 4))
    shape = (2, tiling.seq_len, 2, 3) if fmt == "bshd" else (2, 2, tiling.seq_len, 3)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: tiling.to_tiles(t, fmt), (x,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tiling.to_tiles(x, fmt)
    assert saved, "the index is kept"
    assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for t in saved)
    assert all(not t.is_floating_point() for t in saved), [t.shape for t in saved]


def test_to_tiles_gradient_under_torch_compile_equals_eager():
    tiling = VideoTiling((2, 4, 8), (2, 4, 4))
    x = torch.randn(1, tiling.seq_len, 2, 16, requires_grad=True)
    grads = []
    for fn in (tiling.to_tiles, torch.compile(lambda t: tiling.to_tiles(t), fullgraph=True)):
        y = fn(x)
        weights = torch.arange(y.numel(), dtype=y.dtype).view_as(y)
        grads.append(torch.autograd.grad((y * weights).sum(), x)[0])
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)

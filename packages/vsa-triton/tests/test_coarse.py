"""The Triton coarse stage (`vsa_triton.coarse`) against float64 and vsa-core's torch path.

Compiled on a GPU; without one, under Triton's interpreter in the child process of
test_interpreter.py (float16 and float32 only there: its bf16 dot products are wrong).
"""

from __future__ import annotations

import os

import pytest
import torch

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.coarse import TorchCoarse, coarse_stage
from vsa_triton.coarse import (
    SelectConfig,
    TritonCoarse,
    _combine,
    pool_qkv,
    select_topk,
    select_with,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="no GPU: run under the Triton interpreter by test_interpreter.py",
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])
CASES = [
    ((5, 6, 7), (2, 2, 2), 3, 32),
    ((3, 4, 4), (2, 2, 2), 2, 64),
    ((9, 4, 5), (4, 2, 2), 1, 16),
]
if ON_GPU:
    CASES.append(((21, 30, 52), (4, 4, 4), 2, 128))


def _tiled(tiling, heads, dim, dtype, seed, padding=0.0):
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(3):
        x = tiling.to_tiles(torch.randn(2, tiling.seq_len, heads, dim, generator=gen))
        x[:, tiling.indices().tile_to_raster < 0] = padding
        tensors.append(x.to(DEVICE, dtype))
    return tensors


def _pooled64(x, valid):
    """float64 means over real tokens, written independently of both implementations."""
    batch, seq, heads, dim = x.shape
    n = valid.shape[0]
    out = torch.zeros(batch, n, heads, dim, dtype=torch.float64)
    tiles = x.detach().double().cpu().view(batch, n, seq // n, heads, dim)
    for t, size in enumerate(valid.tolist()):
        if size:
            out[:, t] = tiles[:, t, :size].mean(1)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_pool_reads_only_real_tokens(case, dtype):
    latent, tile, heads, dim = case
    tiling = VideoTiling(latent, tile)
    valid = tiling.valid_sizes(DEVICE)
    clean = _tiled(tiling, heads, dim, dtype, seed=1)
    for padding in (float("nan"), float("inf"), -1e30):
        dirty = _tiled(tiling, heads, dim, dtype, seed=1, padding=padding)
        got = pool_qkv(*dirty, valid)
        for g, c, x in zip(got, pool_qkv(*clean, valid), clean, strict=True):
            assert torch.equal(g, c), f"padding {padding} changed a pooled value"
            want = _pooled64(x, valid.cpu())
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
            torch.testing.assert_close(g.double().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES[:2])
def test_pool_gradient_matches_torch_path_and_is_zero_on_padding(case):
    latent, tile, heads, dim = case
    tiling = VideoTiling(latent, tile)
    valid = tiling.valid_sizes(DEVICE)
    xs = [x.requires_grad_() for x in _tiled(tiling, heads, dim, torch.float32, seed=2)]
    grads = [torch.randn_like(p) for p in TorchCoarse().pool(*xs, valid)]
    want = torch.autograd.grad(TorchCoarse().pool(*xs, valid), xs, grads)
    got = torch.autograd.grad(pool_qkv(*xs, valid), xs, grads)
    pad = tiling.indices(DEVICE).tile_to_raster < 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert bool((g[:, pad] == 0).all())


def _assert_is_topk(indices, qp, kp, valid, topk, tol):
    """Every row's choice is a top-k of its float64 scores, up to ``tol``: chosen scores >= the
    k-th score - tol >= unchosen scores - 2 tol; empty tiles score -inf; lists ascending."""
    scores = torch.einsum("bnhd,bmhd->bhnm", qp.double().cpu(), kp.double().cpu())
    scores[..., valid.cpu() == 0] = float("-inf")
    idx = indices.long().cpu()
    assert idx.shape == (*scores.shape[:-1], topk)
    if topk > 1:
        assert bool((idx[..., 1:] > idx[..., :-1]).all()), "lists must be strictly ascending"
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    kth = torch.topk(scores, topk, dim=-1).values[..., -1:]
    lowest_chosen = torch.where(chosen, scores, float("inf")).amin(-1, keepdim=True)
    highest_left = torch.where(chosen, float("-inf"), scores).amax(-1, keepdim=True)
    assert bool((lowest_chosen >= kth - tol).all())
    assert bool((highest_left <= kth + tol).all())


# the selection as shipped (the ranking in a kernel of its own, bisection with early exit),
# with all 32 passes, and ranked inside the score programs (before session 32); all must pick
# the same exact top-k
FUSED = SelectConfig(rank_apart=False, block_m=16)
SEARCHES = {
    "early-exit": SelectConfig(),
    "all-passes": SelectConfig(early_exit=False),
    "fused": FUSED,
    "two-warps-a-row": SelectConfig(rank_warps=2),
}
GPU_ONLY_SEARCHES = {"two-warps-a-row"}  # the interpreter runs no warps: the shipped one again
# under the interpreter the largest case takes ~40 s a search: there only the shipped one
SELECT_CASES = [
    pytest.param(case, config, id=f"{name}-case{i}")
    for name, config in SEARCHES.items()
    for i, case in enumerate(CASES)
    if ON_GPU or (name not in GPU_ONLY_SEARCHES and (i > 0 or config == SelectConfig()))
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("case", "config"), SELECT_CASES)
def test_select_is_an_exact_topk(case, config, dtype):
    latent, tile, heads, dim = case
    tiling = VideoTiling(latent, tile)
    valid = tiling.valid_sizes(DEVICE)
    qp, kp, _ = pool_qkv(*_tiled(tiling, heads, dim, dtype, seed=3), valid)
    n = tiling.num_tiles
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    for topk in sorted({1, max(1, n // 8), n // 2, n}):
        got = select_with(qp, kp, valid, topk, config)
        _assert_is_topk(got, qp, kp, valid, topk, tol)
        assert torch.equal(got, select_topk(qp, kp, valid, topk)), "differs from the shipped"


def _split64(indices, valid, tile_tokens):
    """The `ForwardSplit` of ``indices``, written independently of the kernel: per row, full
    tiles then partial ones packed with their sizes, empty ones dropped, zeros after."""
    idx, sizes = indices.long().cpu(), valid.long().cpu()
    full_idx, part_idx = torch.zeros_like(idx), torch.zeros_like(idx)
    full_cnt = torch.zeros(idx.shape[:-1], dtype=torch.long)
    part_cnt = torch.zeros_like(full_cnt)
    for row in torch.cartesian_prod(*(torch.arange(n) for n in idx.shape[:-1])):
        at = tuple(row.tolist())
        full = [t for t in idx[at].tolist() if sizes[t] >= tile_tokens]
        part = [t | int(sizes[t]) << 16 for t in idx[at].tolist() if 0 < sizes[t] < tile_tokens]
        full_idx[at][: len(full)] = torch.tensor(full, dtype=torch.long)
        part_idx[at][: len(part)] = torch.tensor(part, dtype=torch.long)
        full_cnt[at], part_cnt[at] = len(full), len(part)
    return full_idx, full_cnt, part_idx, part_cnt


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_m", 24), ("block_n", 0), ("num_warps", 3), ("elements_per_step", 2.0),
     ("rank_warps", -1), ("rank_warps", 3)],
)  # fmt: skip
def test_select_config_names_a_field_triton_cannot_compile(field, value):
    with pytest.raises(ValueError, match=field):
        SelectConfig(**{field: value})


@pytest.mark.parametrize("config", [SelectConfig(), FUSED], ids=["rank-apart", "fused"])
def test_select_split_writes_the_lists_split_by_tile_fullness(config):
    """`TritonCoarse.select_split` (with the config the op ships, and ranked inside the score
    programs): the same indices as `select`, and their `ForwardSplit` (full, partial with
    sizes, empty dropped) equal to one built from them independently; tilings with partial
    tiles and user sizes with empty tiles."""
    gen = torch.Generator().manual_seed(5)
    stage = TritonCoarse()
    tiling = VideoTiling((5, 6, 7), (2, 2, 2))
    user = torch.tensor([8, 3, 0, 8, 1, 7, 0, 8, 5, 8], dtype=torch.int32)
    for valid in (tiling.valid_sizes(DEVICE), user.to(DEVICE)):
        n = valid.shape[0]
        qp, kp = (torch.randn(2, n, 3, 16, generator=gen).to(DEVICE) for _ in range(2))
        for topk in sorted({1, n // 3, n}):
            indices, *split = select_with(qp, kp, valid, topk, config, 8)
            assert torch.equal(indices, stage.select(qp, kp, valid, topk))
            for got, want in zip(split, _split64(indices, valid, 8), strict=True):
                assert got.dtype == torch.int32 and torch.equal(got.long().cpu(), want), topk


def _coarse64(qp, kp, vp, valid, scale):
    """float64 dense attention between pooled tiles, empty key tiles left out, written
    independently of both implementations."""
    q, k, v = (t.double().cpu() for t in (qp, kp, vp))
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    scores[..., valid.cpu() == 0] = float("-inf")
    return torch.einsum("bhnm,bmhd->bnhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("dtype", "attend_after"),
    [*((dtype, True) for dtype in DTYPES), (torch.float32, False)],  # the other placement once
    ids=[*(f"{dtype}-after_scores" for dtype in DTYPES), "float32-in_score_loop"],
)
def test_select_and_attend_is_the_coarse_attention_and_the_selection(dtype, attend_after):
    """`TritonCoarse.select_and_attend` (one launch): the coarse output matches float64
    attention over the non-empty key tiles, the indices and split equal `select` /
    `select_split`'s; tilings with partial tiles and user sizes with empty tiles, lists of one
    tile to all, more tiles than one key step (64) reads; the attention inside the score loop
    and after it (`TritonCoarse.attend_after_scores`)."""
    gen = torch.Generator().manual_seed(6)
    stage = TritonCoarse()
    stage.attend_after_scores = attend_after
    user = torch.tensor([8, 3, 0, 8, 1, 7, 0, 8, 5, 8], dtype=torch.int32)
    long_user = torch.randint(0, 9, (70,), generator=gen, dtype=torch.int32)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for valid in (VideoTiling((5, 6, 7), (2, 2, 2)).valid_sizes(DEVICE), user, long_user):
        valid = valid.to(DEVICE)
        n = valid.shape[0]
        pooled = [torch.randn(2, n, 3, 16, generator=gen).to(DEVICE, dtype) for _ in range(3)]
        want = _coarse64(*pooled, valid, 0.3)
        for topk in sorted({1, n // 3, n}):
            for kv_tile in (None, 8) if topk == n else (8,):  # no split: once (interpreter time)
                coarse, indices, split = stage.select_and_attend(*pooled, valid, topk, 0.3, kv_tile)
                assert coarse.dtype == dtype and coarse.shape == pooled[0].shape
                torch.testing.assert_close(coarse.double().cpu(), want, rtol=tol, atol=tol)
                assert torch.equal(indices, stage.select(pooled[0], pooled[1], valid, topk))
                if kv_tile is None:
                    assert split is None
                    continue
                _, want_split = stage.select_split(pooled[0], pooled[1], valid, topk, kv_tile)
                for got, ref in zip(split, want_split, strict=True):
                    assert torch.equal(got, ref), topk


@pytest.mark.parametrize("config", list(SEARCHES.values()), ids=list(SEARCHES))
def test_select_ranks_empty_tiles_last_and_breaks_ties_low(config):
    gen = torch.Generator().manual_seed(4)
    n, dim = 12, 16
    qp = torch.randn(1, n, 2, dim, generator=gen)
    kp = torch.randn(1, n, 2, dim, generator=gen)
    kp[:, 7] = kp[:, 3]  # tiles 3 and 7 tie everywhere
    valid = torch.full((n,), 4, dtype=torch.int32)
    valid[[1, 5, 9]] = 0  # empty tiles
    qp, kp, valid = qp.to(DEVICE), kp.to(DEVICE), valid.to(DEVICE)
    for topk in range(1, n + 1):
        got = select_with(qp, kp, valid, topk, config).long().cpu()
        chosen = torch.zeros(1, 2, n, n, dtype=torch.bool).scatter_(-1, got, True)
        # an empty tile only when every non-empty one is taken, then the lowest-numbered
        empties = chosen[..., [1, 5, 9]].sum(-1)
        assert bool((empties == max(0, topk - 9)).all()), topk
        if 0 < topk - 9 < 3:
            assert bool(chosen[..., 1].all())
        # where tiles 3 and 7 straddle the cut, 3 (the lower) is taken
        straddles = chosen[..., 3] != chosen[..., 7]
        assert bool(chosen[..., 3][straddles].all())


@pytest.mark.parametrize("clean", [(True, True, True), (True, False, False), (False, False, True)])
def test_pool_and_clean_matches_the_torch_path_in_values_and_gradients(clean):
    """The clean copies hold the real tokens and zeros (NaN padding in the inputs); the
    gradients of all six outputs reach q, k and v as through the torch path's pool + copies,
    0 on padding, including the fine gradients of inputs passed through uncleaned."""
    latent, tile, heads, dim = CASES[0]
    tiling = VideoTiling(latent, tile)
    valid = tiling.valid_sizes(DEVICE)
    xs = _tiled(tiling, heads, dim, torch.float32, seed=8, padding=float("nan"))
    padding = tiling.indices().tile_to_raster < 0
    results = {}
    for stage in (TorchCoarse(), TritonCoarse()):
        leaves = [x.clone().requires_grad_() for x in xs]
        outs = stage.pool_and_clean(*leaves, valid, clean)
        gen = torch.Generator().manual_seed(9)
        upstream = [torch.randn(o.shape, generator=gen).to(DEVICE) for o in outs]
        # the fine gradient of an uncleaned input is nonzero on its padding, as a backend's
        # may be: both paths must still give 0 there
        grads = torch.autograd.grad(outs, leaves, upstream)
        results[stage.name] = (outs, grads)
    (want, want_grads), (got, got_grads) = results["torch"], results["triton"]
    for g, w, flag in zip(got[3:], want[3:], clean, strict=True):
        if flag:
            assert torch.equal(g, w), "a clean copy differs from the torch path's"
            assert not g[:, padding].any(), "a clean copy kept padding"
    for g, w in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert not g[:, padding].any(), "padding received a gradient"
        torch.testing.assert_close(g[:, ~padding], w[:, ~padding], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain = TritonCoarse().pool_and_clean(*xs, valid, clean)
    for g, w in zip(plain, got, strict=True):  # without autograd: the same six tensors
        torch.testing.assert_close(g, w.detach(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("zero", [(False, False, True), (True, True, True)])
@pytest.mark.parametrize("head_dim_contiguous", [True, False])
def test_pool_zeroing_padding_zeroes_where_the_torch_stage_does(zero, head_dim_contiguous):
    """Inference's pooling that zeroes padding in place (v's, in the op): the means are the
    torch stage's, the marked inputs' padding (NaN before) is 0, and every real token and
    every unmarked input is as it was; an input with a strided head dim gets the same."""
    latent, tile, heads, dim = CASES[0]
    tiling = VideoTiling(latent, tile)
    valid = tiling.valid_sizes(DEVICE)
    index = tiling.indices(DEVICE).padding_index
    padding = tiling.indices().tile_to_raster < 0
    xs = _tiled(tiling, heads, dim, torch.float32, seed=10, padding=float("nan"))
    results = {}
    for stage in (TorchCoarse(), TritonCoarse()):
        inputs = [  # strided: the same values, every element two apart
            x.clone() if head_dim_contiguous else torch.stack([x, x], dim=-1)[..., 0] for x in xs
        ]
        assert all(t.stride(-1) == (1 if head_dim_contiguous else 2) for t in inputs)
        pooled = stage.pool_zeroing_padding(*inputs, valid, zero, index)
        results[stage.name] = (pooled, inputs)
    (want, want_inputs), (got, got_inputs) = results["torch"], results["triton"]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for x, g, w, z in zip(xs, got_inputs, want_inputs, zero, strict=True):
        assert torch.equal(g[:, ~padding], x[:, ~padding]), "a real token changed"
        if z:
            assert torch.equal(g, w) and not g[:, padding].any(), "padding not zeroed"
        else:
            assert g[:, padding].isnan().all(), "an unmarked input was written"


def _raster(tiling, heads, dim, dtype, seed, count=3):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, tiling.seq_len, heads, dim, generator=gen).to(DEVICE, dtype)
        for _ in range(count)
    ]


@pytest.mark.parametrize("case", CASES[:3])
def test_pool_from_raster_matches_the_torch_path_in_values_and_gradients(case):
    """Raster-order q, k, v: the tiles equal `VideoTiling.to_tiles`' (zeros on padding), the
    means the torch path's; the gradients of all six outputs reach the raster inputs as through
    the torch path's to_tiles + pool, and the tiles' gradients on padding slots (NaN here)
    reach nothing."""
    latent, tile, heads, dim = case
    tiling = VideoTiling(latent, tile)
    xs = _raster(tiling, heads, dim, torch.float32, seed=21)
    padding = tiling.indices().tile_to_raster < 0
    runs = {}
    for stage in (TorchCoarse(), TritonCoarse()):
        leaves = [x.clone().requires_grad_() for x in xs]
        outs = stage.pool_from_raster(*leaves, tiling)
        gen = torch.Generator().manual_seed(22)
        upstream = [torch.randn(o.shape, generator=gen).to(DEVICE) for o in outs]
        for u in upstream[3:]:
            u[:, padding] = float("nan")
        runs[stage.name] = (outs, torch.autograd.grad(outs, leaves, upstream))
    (want, want_grads), (got, got_grads) = runs["torch"], runs["triton"]
    for g, w in zip(got[3:], want[3:], strict=True):
        assert torch.equal(g, w), "a tile-order copy differs from to_tiles'"
    for g, w in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(g).all(), "a padding slot's gradient reached a raster token"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain = TritonCoarse().pool_from_raster(*xs, tiling)
    for g, w in zip(plain, got, strict=True):  # without autograd: the same six tensors
        torch.testing.assert_close(g, w.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("gate_kind", ["none", "token", "head"])
@pytest.mark.parametrize("case", CASES[:3])
def test_combine_to_raster_matches_the_torch_path(case, gate_kind):
    """The output and the gate in raster order: values against float64, gradients of fine,
    coarse and the gate against the torch path's combine + from_tiles (fine's gradient is 0
    on padding), with and without autograd."""
    fine, coarse, _, tiling = _combine_inputs(case, torch.float32, "none", seed=23)
    heads, dim = fine.shape[2:]
    gen = torch.Generator().manual_seed(24)
    gate = {
        "none": None,
        "token": torch.randn(2, tiling.seq_len, heads, dim, generator=gen).to(DEVICE),
        "head": torch.randn(1, 1, heads, 1, generator=gen).to(DEVICE).expand(
            2, tiling.seq_len, heads, dim),
    }[gate_kind]  # fmt: skip
    padding = tiling.indices().tile_to_raster < 0
    index = tiling.indices(DEVICE).raster_to_tile
    tiled_gate = None if gate is None else tiling.to_tiles(gate.contiguous())
    want64 = _combined64(fine, coarse, tiled_gate, tiling.tile_tokens)[:, index.cpu()]
    leaves = [None if t is None else t.detach().clone().requires_grad_()
              for t in (fine, coarse, gate)]  # fmt: skip
    dout = torch.randn(2, tiling.seq_len, heads, dim, generator=gen).to(DEVICE)
    runs = {}
    for stage in (TorchCoarse(), TritonCoarse()):
        out = stage.combine_to_raster(*leaves, tiling)
        wrt = [t for t in leaves if t is not None]
        runs[stage.name] = (out, torch.autograd.grad(out, wrt, dout))
    (want, want_grads), (got, got_grads) = runs["torch"], runs["triton"]
    torch.testing.assert_close(got.double().cpu(), want64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not got_grads[0][:, padding].any(), "fine's padding received a gradient"
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        plain = TritonCoarse().combine_to_raster(fine, coarse, gate, tiling)
    torch.testing.assert_close(plain, got.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES[:2])
def test_whole_op_in_raster_order_agrees_with_the_torch_coarse_path(case):
    """token_order="raster" with a per-token gate: output and gradients of q, k, v and the
    gate equal the torch coarse path's (to_tiles, pool, combine, from_tiles)."""
    latent, tile, heads, dim = case
    tiling = VideoTiling(latent, tile)
    inputs = _raster(tiling, heads, dim, torch.float32, seed=25, count=5)
    topk = max(1, tiling.num_tiles // 3)
    runs = {}
    for name in ("torch", "triton"):
        leaves = [x.clone().requires_grad_() for x in inputs[:4]]
        out = video_sparse_attn(
            *leaves[:3], tiling=tiling, topk=topk, coarse_gate=leaves[3], backend="reference",
            coarse_backend=name, token_order="raster",
        )  # fmt: skip
        runs[name] = (out, torch.autograd.grad(out, leaves, inputs[4]))
    (want, want_grads), (got, got_grads) = runs["torch"], runs["triton"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _combine_inputs(case, dtype, gate_kind, seed):
    """fine [B, N*T, H, D], coarse [B, N, H, D] (a transposed view, as SDPA's output is) and
    a gate: None, per token, or per head broadcast (strides 0)."""
    latent, tile, heads, dim = case
    tiling = VideoTiling(latent, tile)
    gen = torch.Generator().manual_seed(seed)
    fine = torch.randn(2, tiling.padded_len, heads, dim, generator=gen)
    coarse = torch.randn(2, heads, tiling.num_tiles, dim, generator=gen).transpose(1, 2)
    gate = {
        "none": None,
        "token": torch.randn(2, tiling.padded_len, heads, dim, generator=gen),
        "head": torch.randn(1, 1, heads, 1, generator=gen).expand(2, tiling.padded_len, heads, dim),
    }[gate_kind]
    moved = [None if t is None else t.to(DEVICE, dtype) for t in (fine, coarse, gate)]
    return (*moved, tiling)


def _combined64(fine, coarse, gate, tile_tokens):
    """float64 fine + gate * coarse, each token's coarse row looked up by its tile, a loop
    written independently of both implementations."""
    fine, coarse = fine.detach().double().cpu(), coarse.detach().double().cpu()
    out = fine.clone()
    for token in range(fine.shape[1]):
        term = coarse[:, token // tile_tokens]
        out[:, token] += term if gate is None else gate.detach().double().cpu()[:, token] * term
    return out


@pytest.mark.parametrize("gate_kind", ["none", "token", "head"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_matches_float64_in_place_and_out_of_place(dtype, gate_kind):
    fine, coarse, gate, tiling = _combine_inputs(CASES[0], dtype, gate_kind, seed=6)
    want = _combined64(fine, coarse, gate, tiling.tile_tokens)
    valid = tiling.valid_sizes(DEVICE)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    with torch.no_grad():
        in_place = TritonCoarse().combine(fine.clone(), coarse, gate, valid)
    out_of_place = _combine(fine, coarse, gate, valid, False)
    for got in (in_place, out_of_place):
        torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("gate_kind", ["none", "token", "head"])
def test_combine_gradients_match_the_torch_path(gate_kind):
    fine, coarse, gate, tiling = _combine_inputs(CASES[1], torch.float32, gate_kind, seed=7)
    valid = tiling.valid_sizes(DEVICE)
    leaves = [None if t is None else t.detach().requires_grad_() for t in (fine, coarse, gate)]
    dout = torch.randn_like(fine)
    grads = {}
    for stage in (TorchCoarse(), TritonCoarse()):
        out = stage.combine(*leaves, valid)
        wrt = [t for t in leaves if t is not None]
        grads[stage.name] = (out, torch.autograd.grad(out, wrt, dout))
    (want, want_grads), (got, got_grads) = grads["torch"], grads["triton"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_combine_reads_no_gate_padding_when_asked():
    """gate_padding_as_zero: NaN in the gate's padding slots reaches no real output and no
    gradient; the result equals the torch path's (which cleans the gate by a copy)."""
    fine, coarse, gate, tiling = _combine_inputs(CASES[0], torch.float32, "token", seed=10)
    valid = tiling.valid_sizes(DEVICE)
    padding = tiling.indices().tile_to_raster < 0
    gate[:, padding] = float("nan")
    dout = torch.randn_like(fine)
    runs = {}
    for stage in (TorchCoarse(), TritonCoarse()):
        leaves = [t.detach().clone().requires_grad_() for t in (fine, coarse, gate)]
        out = stage.combine(*leaves, valid, True)
        runs[stage.name] = (out, torch.autograd.grad(out, leaves, dout))
    (want, want_grads), (got, got_grads) = runs["torch"], runs["triton"]
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in got_grads)
    assert not got_grads[2][:, padding].any(), "the gate's padding received a gradient"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES[:2])
def test_whole_op_agrees_with_the_torch_coarse_path(case):
    latent, tile, heads, dim = case
    tiling = VideoTiling(latent, tile)
    q, k, v = _tiled(tiling, heads, dim, torch.float32, seed=5)
    topk = max(1, tiling.num_tiles // 4)
    runs = {
        name: video_sparse_attn(
            q, k, v, tiling=tiling, topk=topk, backend="reference", coarse_backend=name
        )
        for name in ("torch", "triton")
    }
    torch.testing.assert_close(runs["triton"], runs["torch"], rtol=1e-5, atol=1e-5)


def test_auto_picks_triton_where_it_runs():
    x = torch.empty(1, 8, 1, 32, device=DEVICE, dtype=torch.float16)
    assert isinstance(coarse_stage("auto", x), TritonCoarse)
    assert isinstance(coarse_stage("auto", x.double()), TorchCoarse)
    with pytest.raises(ValueError, match="coarse_backend='triton' cannot run"):
        coarse_stage("triton", x.double())

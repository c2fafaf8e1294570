"""The kernels on raster-order tensors (a slot-to-row map, no tile-order copies) and the
forward with VSA's combine in its epilogue.

Two kinds of check: at the kernel API the raster forms must give bitwise what the tile-order
kernels give on the tiled copies (same arithmetic in the same order, only the addresses
differ); at the op, the fused and raster paths must agree with the reference backend's copy
path (float32 arithmetic, fp16 inputs) and with each other. On a CPU machine these run under
TRITON_INTERPRET=1 (float16); on a GPU the same tests run compiled, in bfloat16 too.
"""

from __future__ import annotations

import os

import pytest
import torch

from vsa_core import BlockSparseLayout, VideoTiling, video_sparse_attn
from vsa_triton import ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="no GPU: run under the Triton interpreter by test_interpreter.py",
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]
# partial tiles on every border (5x6x7 over 4x4x4: 8 tiles, one full, 210 of 512 slots real),
# and a latent whose tiles are all full, where tile order is still a permutation of raster order
TILINGS = [VideoTiling((5, 6, 7), (4, 4, 4)), VideoTiling((4, 8, 8), (4, 4, 4))]
if ON_GPU:
    TILINGS.append(VideoTiling((21, 30, 52), (4, 4, 4)))  # Wan 480p


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _raster_qkv(tiling, heads, dim, dtype, seed, count=3):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, tiling.seq_len, heads, dim)
    return [torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(count)]


def _layout(tiling, heads, seed):
    """Random lists over the tiling's tiles (one query tile with none), its valid sizes."""
    gen = torch.Generator().manual_seed(seed)
    n = tiling.num_tiles
    mask = torch.rand(1, heads, n, n, generator=gen) < 0.4
    mask[0, 0, 0] = False
    mask[0, -1, -1] = True
    valid = tiling.valid_sizes("cpu")
    return BlockSparseLayout.from_block_mask(mask, valid, (64, 64)).to(DEVICE)


def _lists(layout):
    return layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: "x".join(map(str, t.latent_shape)))
def test_raster_kernels_equal_the_tile_order_kernels_bitwise(tiling, dtype):
    """fwd_rows / bwd_rows on raster q, k, v give exactly the tile-order kernels' out, lse and
    gradients on the tiled copies (read back in raster order; lse on real slots)."""
    heads, dim = 2, 64
    layout = _layout(tiling, heads, seed=3)
    q, k, v, dout = _raster_qkv(tiling, heads, dim, dtype, seed=4, count=4)
    rows = tiling.indices(DEVICE).slot_rows
    scale = dim**-0.5
    out, lse = ops.forward_rows_impl(q, k, v, *_lists(layout), rows, scale, 64, 64)
    grads = ops.backward_rows_impl(dout, q, k, v, out, lse, *_lists(layout), rows, scale, 64, 64)

    tq, tk, tv, tdout = (tiling.to_tiles(t) for t in (q, k, v, dout))
    t_out, t_lse = ops.forward_impl(tq, tk, tv, *_lists(layout), scale, 64, 64)
    t_grads = ops.backward_impl(tdout, tq, tk, tv, t_out, t_lse, *_lists(layout), scale, 64, 64)

    real = tiling.indices(DEVICE).real_slots
    assert torch.equal(out, tiling.from_tiles(t_out))
    assert torch.equal(lse[..., real], t_lse[..., real])
    for name, got, want in zip("qkv", grads, t_grads, strict=True):
        assert torch.equal(got, tiling.from_tiles(want)), f"d{name}"


@pytest.mark.parametrize(
    ("raster", "gate_kind"),
    [(True, "token"), (True, "head"), (False, "none"), (False, "token")],
    ids=["raster-token", "raster-head", "tiled-none", "tiled-token"],
)
def test_forward_with_the_combine_in_its_epilogue_matches_float64(raster, gate_kind):
    """fwd_combined: fine + gate * coarse[query tile] against the plain forward's fine output
    combined in float64, on every real token (raster) or every slot (tile order)."""
    tiling = TILINGS[0]
    heads, dim = 2, 64
    layout = _layout(tiling, heads, seed=5)
    q, k, v = _raster_qkv(tiling, heads, dim, torch.float16, seed=6)
    gen = torch.Generator().manual_seed(7)
    coarse = torch.randn(1, heads, tiling.num_tiles, dim, generator=gen).to(DEVICE, q.dtype)
    coarse = coarse.transpose(1, 2)  # SDPA's output is such a view
    rows = tiling.indices(DEVICE).slot_rows if raster else None
    if not raster:
        q, k, v = (tiling.to_tiles(t) for t in (q, k, v))
    gate = {
        "none": None,
        "token": torch.randn(q.shape, generator=gen).to(DEVICE, q.dtype),
        "head": torch.randn(1, 1, heads, 1, generator=gen).to(DEVICE).expand(q.shape),
    }[gate_kind]
    scale = dim**-0.5
    got = ops.forward_combined_impl(q, k, v, *_lists(layout), rows, coarse, gate, scale, 64, 64)

    tq, tk, tv = (tiling.to_tiles(t) for t in (q, k, v)) if raster else (q, k, v)
    fine, _ = ops.forward_impl(tq, tk, tv, *_lists(layout), scale, 64, 64)
    tile_of = torch.arange(tiling.padded_len, device=DEVICE) // 64
    term = coarse.double()[:, tile_of]  # each slot's coarse row
    if gate is not None:
        term = (tiling.to_tiles(gate) if raster else gate).double() * term
    want = fine.double() + term
    if raster:
        want = tiling.from_tiles(want)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got.double() - want).abs().max().item() < 4e-3  # one fp16 rounding of |x| < 8


# a per-token gate only: without one the combine's kernels differ only in not reading it,
# which the epilogue test and test_coarse cover (this test is the suite's slowest)
@pytest.mark.parametrize("gate_kind", ["token"])
def test_whole_op_in_raster_order_reads_no_copies_and_matches_the_copy_path(gate_kind, monkeypatch):
    """video_sparse_attn(token_order="raster", backend="triton", copy_to_tiles=False): in
    inference the fused forward runs on the raster tensors themselves (no tile-order copy is
    passed), in training fwd_rows and the raster combine; outputs and gradients of q, k, v and
    the gate match the reference backend's copy path (to tile order, attend, combine, back)."""
    tiling = TILINGS[0]
    heads, dim = 2, 64
    q, k, v, gate, dout = _raster_qkv(tiling, heads, dim, torch.float16, seed=8, count=5)
    gate = None if gate_kind == "none" else gate
    topk = 4
    seen = []
    for name in ("_forward",):
        real = getattr(ops, name)

        def spy(*args, real=real, **kwargs):
            seen.append((args[0].shape[1], args[9] if len(args) > 9 else None))
            return real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)

    def run(backend, grad, copy_to_tiles=False):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        g = None if gate is None else gate.clone().requires_grad_(grad)
        out = video_sparse_attn(
            *leaves, tiling=tiling, topk=topk, coarse_gate=g, backend=backend,
            token_order="raster", copy_to_tiles=copy_to_tiles,
        )  # fmt: skip
        if not grad:
            return out, ()
        wrt = leaves + ([] if g is None else [g])
        return out, torch.autograd.grad(out, wrt, dout)

    with torch.no_grad():
        fused, _ = run("triton", grad=False)
    assert seen == [(tiling.seq_len, tiling.indices(DEVICE).slot_rows)] or (
        len(seen) == 1 and seen[0][0] == tiling.seq_len and seen[0][1] is not None
    ), seen
    seen.clear()
    trained, grads = run("triton", grad=True)
    assert len(seen) == 1 and seen[0][0] == tiling.seq_len, "training read tile-order copies"
    want, want_grads = run("reference", grad=True, copy_to_tiles=True)
    seen.clear()
    with torch.no_grad():
        copied, _ = run("triton", grad=False, copy_to_tiles=True)  # the default path
    assert len(seen) == 1 and seen[0] == (tiling.padded_len, None), "no copies by default?"
    assert _rel(copied, want) < 2e-3

    assert _rel(fused, want) < 2e-3
    assert _rel(trained, want) < 2e-3
    assert _rel(fused, trained) < 2e-3
    for name, got, ref in zip(["q", "k", "v", "gate"], grads, want_grads, strict=False):
        assert torch.isfinite(got).all(), name
        assert _rel(got, ref) < 5e-3, name


def test_tiled_inference_uses_the_fused_combine_and_matches_the_plain_path():
    """token_order="tiled" without gradients: the triton backend's fused combine equals the
    reference backend's separate combine (coarse stage the same), padding slots included."""
    tiling = TILINGS[0]
    heads, dim = 2, 64
    q, k, v, gate = (tiling.to_tiles(t) for t in _raster_qkv(tiling, heads, dim, torch.float16,
                                                            seed=9, count=4))  # fmt: skip
    with torch.no_grad():
        outs = [
            video_sparse_attn(q, k, v, tiling=tiling, topk=4, coarse_gate=gate, backend=name)
            for name in ("triton", "reference")
        ]
    real = tiling.indices(DEVICE).real_slots
    assert _rel(outs[0][:, real], outs[1][:, real]) < 2e-3


def test_raster_custom_ops_pass_opcheck():
    """fwd_rows (with its autograd), bwd_rows and fwd_combined: schemas, fake tensors and
    autograd registration as torch.library checks them (what torch.compile relies on)."""
    tiling = VideoTiling((5, 4, 4), (4, 4, 4))  # two tiles, one partial: opcheck runs it often
    heads, dim = 2, 64
    layout = _layout(tiling, heads, seed=12)
    q, k, v, dout = _raster_qkv(tiling, heads, dim, torch.float16, seed=13, count=4)
    rows = tiling.indices(DEVICE).slot_rows
    lists = _lists(layout)
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(
        ops.block_sparse_fwd_rows, (*leaves, *lists, rows, 0.125, 64, 64), test_utils=checks
    )
    out, lse = ops.forward_rows_impl(q, k, v, *lists, rows, 0.125, 64, 64)
    torch.library.opcheck(
        ops.block_sparse_bwd_rows,
        (dout, q, k, v, out, lse, *lists, rows, 0.125, 64, 64),
        test_utils=("test_schema", "test_faketensor"),
    )
    coarse = torch.randn(1, tiling.num_tiles, heads, dim).to(DEVICE, q.dtype)
    for raster, gate in ((rows, dout), (None, None)):
        args = (q, k, v) if raster is not None else tuple(tiling.to_tiles(t) for t in (q, k, v))
        torch.library.opcheck(
            ops.block_sparse_fwd_combined,
            (*args, *lists, raster, coarse, gate, 0.125, 64, 64),
            test_utils=("test_schema", "test_faketensor"),
        )

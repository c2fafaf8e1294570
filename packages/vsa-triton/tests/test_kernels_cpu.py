"""The Triton kernels against vsa-core's reference: forward, backward, edge cases.

On a CPU machine these run under TRITON_INTERPRET=1 (tiny shapes, float16); on a GPU the same
tests run compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

from vsa_core import BlockSparseLayout, block_sparse_attn
from vsa_triton.backend import TritonBackend

# Without a GPU these run only in the child process of test_interpreter.py (see conftest.py).
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="no GPU: run under the Triton interpreter by test_interpreter.py",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(64, 64), (128, 64), (128, 128), (64, 128)]


def _layout(block_shape, n_q, n_kv, seed, *, heads=2, density=0.5):
    gen = torch.Generator().manual_seed(seed)
    kv_block = block_shape[1]
    mask = torch.rand(1, heads, n_q, n_kv, generator=gen) < density
    mask[0, 0, 0] = False  # a query block with no key block
    mask[0, 0, 1] = True  # one with every key block
    mask[0, 1, 0] = False
    mask[0, 1, 0, 1] = True  # one with a single, empty key block
    valid = torch.randint(1, kv_block + 1, (n_kv,), generator=gen)
    valid[0] = kv_block
    valid[1] = 0  # an empty key block
    valid[-1] = kv_block // 3  # a partial one
    return BlockSparseLayout.from_block_mask(mask, valid, block_shape).to(DEVICE)


def _qkv(layout, dim, seed, qkv_format="bshd"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, layout.q_len, layout.heads, dim)] + [(1, layout.kv_len, layout.heads, dim)] * 2
    tensors = [torch.randn(s, generator=gen).to(DEVICE, torch.float16) for s in shapes]
    if qkv_format == "bhsd":
        tensors = [t.transpose(1, 2).contiguous() for t in tensors]
    return [t.requires_grad_() for t in tensors]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check_against_reference(layout, dim, seed, qkv_format="bshd"):
    q, k, v = _qkv(layout, dim, seed, qkv_format)
    out, lse = block_sparse_attn(q, k, v, layout, backend="triton", qkv_format=qkv_format)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = block_sparse_attn(
        q32, k32, v32, layout, backend="reference", qkv_format=qkv_format
    )
    rdq, rdk, rdv = torch.autograd.grad(ref, (q32, k32, v32), grad.float())

    for name, got, want in (("out", out, ref), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert torch.isfinite(got).all(), name
        assert _rel(got, want) < 2e-3, name
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert torch.allclose(lse[seen], ref_lse[seen], atol=2e-3)
    return out, lse, (dq, dk, dv)


@pytest.mark.parametrize("block_shape", SHAPES)
def test_forward_backward_match_reference(block_shape):
    layout = _layout(block_shape, n_q=3, n_kv=5, seed=sum(block_shape))
    _check_against_reference(layout, dim=64, seed=1)


def test_head_dim_128_and_bhsd_strides():
    layout = _layout((64, 64), n_q=2, n_kv=4, seed=3)
    _check_against_reference(layout, dim=128, seed=2, qkv_format="bhsd")


def test_rows_without_keys_give_zero_output_lse_minus_inf_and_zero_grads():
    layout = _layout((64, 64), n_q=3, n_kv=4, seed=4)
    out, lse, (dq, _, _) = _check_against_reference(layout, dim=64, seed=5)
    # head 0, query block 0 selects nothing; head 1, query block 0 only an empty block
    for head in (0, 1):
        rows = slice(0, 64)
        assert torch.all(out[0, rows, head] == 0)
        assert torch.all(lse[0, head, rows] == float("-inf"))
        assert torch.all(dq[0, rows, head] == 0)


def test_empty_and_unselected_key_blocks_get_zero_grads():
    layout = _layout((64, 64), n_q=3, n_kv=4, seed=6)
    _, _, (_, dk, dv) = _check_against_reference(layout, dim=64, seed=7)
    # key block 1 is empty (valid size 0): every one of its rows gets zero gradient
    assert torch.all(dk[0, 64:128] == 0) and torch.all(dv[0, 64:128] == 0)
    # padding rows of the partial last block too
    valid_last = int(layout.kv_valid_sizes[-1])
    assert torch.all(dk[0, 3 * 64 + valid_last :] == 0)


def test_garbage_in_padding_slots_never_leaks():
    layout = _layout((64, 64), n_q=2, n_kv=4, seed=8)
    q, k, v = _qkv(layout, 64, seed=9)
    with torch.no_grad():
        k[0, 64:128] = float("nan")  # key block 1 has valid size 0
        v[0, 64:128] = float("inf")
        padding = 3 * 64 + int(layout.kv_valid_sizes[-1])
        k[0, padding:] = float("nan")
        v[0, padding:] = float("nan")
    out, _ = block_sparse_attn(q, k, v, layout, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref, _ = block_sparse_attn(
        *(t.detach().float() for t in (q, k, v)), layout, backend="reference"
    )
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert _rel(out, ref) < 2e-3


def test_all_selected_single_block_matches_dense_attention():
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    layout = BlockSparseLayout.from_block_mask(mask, torch.tensor([64]), (64, 64)).to(DEVICE)
    q, k, v = (t.detach() for t in _qkv(layout, 64, seed=10))
    out, _ = block_sparse_attn(q, k, v, layout, backend="triton")
    dense = torch.softmax(q[0, :, 0].float() @ k[0, :, 0].float().T / 8, -1) @ v[0, :, 0].float()
    assert _rel(out[0, :, 0], dense) < 2e-3


def test_supports_explains_refusals():
    from vsa_core.backends import AttentionCall

    backend = TritonBackend()
    device = torch.device(DEVICE)
    dtype = torch.float16
    assert backend.supports(AttentionCall(device, dtype, 64, (64, 64), True)) is None
    assert "block shape 256x256" in backend.supports(
        AttentionCall(device, dtype, 64, (256, 256), False)
    )
    assert "head dim 96" in backend.supports(AttentionCall(device, dtype, 96, (64, 64), False))
    if DEVICE == "cpu":
        assert "float16 only" in backend.supports(
            AttentionCall(device, torch.bfloat16, 64, (64, 64), False)
        )


def test_supports_refuses_cpu_without_interpreter(monkeypatch):
    from vsa_core.backends import AttentionCall

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call = AttentionCall(torch.device("cpu"), torch.float16, 64, (64, 64), False)
    assert "needs a CUDA device" in TritonBackend().supports(call)


def test_custom_op_registration_passes_opcheck():
    from vsa_triton.ops import block_sparse_fwd

    layout = _layout((64, 64), n_q=2, n_kv=3, seed=11)
    q, k, v = _qkv(layout, 64, seed=12)
    args = (q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 0.125, 64, 64)
    torch.library.opcheck(
        block_sparse_fwd,
        args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


@pytest.mark.parametrize(
    ("forward", "backward"),
    [
        ((64, False), (64, 64)),  # one scalar-indexed block per step everywhere
        ((128, False), (128, 128)),  # gathered two-block tiles everywhere
        ((128, True), (64, 128)),  # dual-dot forward
    ],
)
def test_every_tiling_mode_matches_reference(monkeypatch, forward, backward):
    from vsa_triton import config

    tile, dual = forward
    tile_dkdv, tile_dq = backward
    key = (64, 64, 64)
    monkeypatch.setitem(config._FORWARD, key, config.ForwardConfig(tile, 4, 2, dual))
    monkeypatch.setitem(
        config._BACKWARD, key, config.BackwardConfig(tile_dkdv, 4, 2, tile_dq, 4, 2)
    )
    layout = _layout((64, 64), n_q=3, n_kv=5, seed=13)
    _check_against_reference(layout, dim=64, seed=14)


@pytest.mark.parametrize("tile_dkdv", [64, 128])
def test_dkdv_walks_tall_query_blocks_in_slices_or_whole(monkeypatch, tile_dkdv):
    """128-row query blocks: the dK/dV kernel in 64-row slices (the default) or whole."""
    from vsa_triton import config

    key = (128, 64, 64)
    monkeypatch.setitem(config._BACKWARD, key, config.BackwardConfig(tile_dkdv, 4, 2, 64, 4, 2))
    assert config.backward_config(*key).tile_dkdv == tile_dkdv
    layout = _layout((128, 64), n_q=3, n_kv=7, seed=21)
    _check_against_reference(layout, dim=64, seed=22)


def test_rotate_lists_kernel_matches_vsa_core():
    from vsa_core.rotation import rotate_lists, rotation_starts
    from vsa_triton.ops import rotate_lists as rotate_lists_triton

    layout = _layout((64, 64), n_q=5, n_kv=7, seed=10, heads=3)
    indices, counts = layout.kv_indices.contiguous(), layout.kv_counts.contiguous()
    for width in (1, 4, 11):
        want = rotate_lists(indices, counts, rotation_starts(indices.shape, 7, width, DEVICE))
        got = rotate_lists_triton(indices, counts, 7, width)
        assert torch.equal(got, want), width
    assert not torch.equal(got, indices.to(torch.int32))  # something did rotate


def test_forward_on_rotated_lists_matches_reference(monkeypatch):
    """The forward rotates its lists where `rotation_width` says so (an H200, when one head's K
    and V exceed its L2); forced here to 3 so that the interpreter and any GPU run the rotated
    path. The working set it asks about is one head's K and V."""
    from vsa_triton import ops

    asked = []
    monkeypatch.setattr(ops, "rotation_width", lambda device, ws=None: asked.append(ws) or 3)
    calls = []
    rotate = ops.rotate_lists
    monkeypatch.setattr(ops, "rotate_lists", lambda *a: calls.append(1) or rotate(*a))
    layout = _layout((64, 64), n_q=4, n_kv=6, seed=11)
    _check_against_reference(layout, dim=64, seed=12)
    assert calls
    assert asked[0] == layout.kv_len * 2 * 64 * 2  # K and V rows of one head, fp16

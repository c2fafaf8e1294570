"""``deterministic=True`` on a CUDA GPU: the whole op, forward and backward, run twice at a
realistic size on every backend that accepts it, bitwise equal (fa4's training with 64x64
blocks on sm_90 through its dS-writing backward); fa4's other backwards and the reference's
refused, their reasons named.

The latent is Wan 2.1 480p's (21x30x52: partial tiles on all three sides), 12 heads of 128,
bf16, 87.5% sparse, with a per-token coarse gate that requires a gradient, as a DiT's gate
projection gives: a few milliseconds a call on an H200, and large enough that an
order-dependent reduction shows (on an H200, 2026-12-01: the op without the flag on triton gave
dQ differing in 10 elements between two runs, from SDPA's flash backward in the coarse
attention; the reference's CUDA backward differed in 139,087 dK elements at a third of the
frames and 2 heads).
"""

from __future__ import annotations

import pytest
import torch

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.backends import AttentionCall, backend_entries, select_backend
from vsa_core.backends.registry import refusal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LATENT, HEADS, DIM = (21, 30, 52), 12, 128


def _inputs(requires_grad=True):
    tiling = VideoTiling(LATENT, tile_shape=(4, 4, 4))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, tiling.padded_len, HEADS, DIM)

    def rand():
        t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        return t.requires_grad_(requires_grad)

    q, k, v, gate = rand(), rand(), rand(), rand()
    dout = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    topk = max(1, round(0.125 * tiling.num_tiles))
    return tiling, topk, (q, k, v, gate), dout


def _call(requires_grad, deterministic=True):
    tile = 64
    return AttentionCall(
        torch.device("cuda"), torch.bfloat16, DIM, (tile, tile), requires_grad,
        query_rows=HEADS * VideoTiling(LATENT).padded_len, deterministic=deterministic,
    )  # fmt: skip


def _run(backend, requires_grad=True, deterministic=True):
    tiling, topk, (q, k, v, gate), dout = _inputs(requires_grad)
    out = video_sparse_attn(
        q, k, v, tiling=tiling, topk=topk, coarse_gate=gate, backend=backend,
        deterministic=deterministic,
    )  # fmt: skip
    if not requires_grad:
        return [out]
    return [out, *torch.autograd.grad(out, (q, k, v, gate), dout)]


def _assert_bitwise_equal(first, second):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dgate"), first, second, strict=False):
        differing = (a != b).sum().item()
        assert differing == 0, f"{name}: {differing} of {a.numel()} elements differ between runs"


def _accepting(requires_grad):
    names = []
    for name, entry in sorted(backend_entries().items()):
        if entry.backend is not None and refusal(entry.backend, _call(requires_grad)) is None:
            names.append(name)
    return names


@pytest.mark.parametrize("backend", ["auto", "triton", "fa4", "reference"])
def test_training_reruns_bitwise_equal_on_every_backend_that_accepts(backend):
    if backend != "auto" and backend not in _accepting(True):
        pytest.skip(f"{backend} does not accept deterministic training here")
    first = _run(backend)
    torch.cuda.synchronize()
    second = _run(backend)
    _assert_bitwise_equal(first, second)
    assert len(first) == 5 and all(torch.isfinite(t).all() for t in first)


@pytest.mark.parametrize("backend", ["auto", "triton", "fa4", "reference"])
def test_inference_reruns_bitwise_equal_on_every_backend_that_accepts(backend):
    if backend != "auto" and backend not in _accepting(False):
        pytest.skip(f"{backend} does not accept deterministic inference here")
    with torch.no_grad():
        first, second = _run(backend, False), _run(backend, False)
    _assert_bitwise_equal(first, second)


def test_deterministic_result_matches_the_default_op():
    """The deterministic path computes the same thing: against the default op (fa4 where
    installed), to bf16 accuracy."""
    fast, slow = _run("auto", deterministic=False), _run("auto")
    for name, a, b in zip(("out", "dq", "dk", "dv", "dgate"), fast, slow, strict=True):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, f"{name}: relative L2 {rel:.3g}"


def test_fa4_trains_deterministically_on_64x64_blocks_only():
    """fa4 accepts deterministic training with 64x64 blocks on sm_90 (its dS-writing backward,
    rerun bitwise above) and auto takes it there; other block shapes are refused with the
    reason, and so is every block shape off sm_90."""
    entry = backend_entries().get("fa4")
    if entry is None or entry.backend is None or entry.backend.availability() is not None:
        pytest.skip("fa4 is not available here")
    fa4 = entry.backend
    on_sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert (refusal(fa4, _call(True)) is None) == on_sm90
    if on_sm90:
        assert select_backend(_call(True), "auto").name == "fa4"
        twin = fa4.for_call(_call(True))
        assert twin.kernels.backward_for((64, 64)).dq_from_ds
        assert fa4.for_call(_call(True, deterministic=False)) is fa4
    wider = AttentionCall(torch.device("cuda"), torch.bfloat16, DIM, (128, 128), True,
                          deterministic=True)  # fmt: skip
    reason = refusal(fa4, wider)
    assert reason is not None and reason.startswith("deterministic=True with gradients")
    assert refusal(fa4, _call(False)) is None  # its forward stays


def test_reference_backward_on_cuda_is_refused():
    with pytest.raises(ValueError, match=r"backend='reference' cannot run this call: determin"):
        _run("reference")


def test_coarse_attention_reruns_bitwise_equal_at_wan_720p_tiles():
    """The coarse attention as the op runs it under the flag (SDPA's math backend), at Wan
    720p's 1,440 tiles and 40 heads, where SDPA's default (flash) backward gave dQ differing in
    507 elements between two runs on an H200 (2026-12-01)."""
    from vsa_core.ops import _coarse_attention

    gen = torch.Generator(device="cuda").manual_seed(2)
    shape = (1, 1440, 40, 128)
    pooled = [
        torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    ]
    dout = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    valid = torch.full((1440,), 64, device="cuda", dtype=torch.int32)

    def run():
        out = _coarse_attention(*pooled, valid, 128**-0.5, False, True)
        return [out, *torch.autograd.grad(out, pooled, dout)]

    _assert_bitwise_equal(run(), run())

"""The fa4 backend on a CUDA GPU (sm_90 / sm_100): FA4's kernels against vsa-core's reference.

Layouts have partial and empty key blocks (the padding slots of partial blocks hold large
finite garbage, which must not leak) and query blocks selecting 0..5 key blocks (odd and even
counts, rows with no key at all). Forward and backward are compared with the float32
reference: relative L2 <= 1e-2 for out, dq, dk, dv; lse within 1e-2 and -inf exactly where the
reference has it. Calls that upstream FA4 refuses on this device (see ``FA4Backend.supports``)
are checked to be refused with their reason instead. Then torch.compile, CUDA-graph replay with
changing inputs and layouts, BHSD, fp16, head dim 64 and the whole VSA op.

Run on the GPU host: ``source .gpu/b/env.sh && python3 -m pytest -m gpu packages/vsa-fa4 -q``.
The first call of each kernel configuration compiles it (a few seconds each).
"""

from __future__ import annotations

import pytest
import torch

from vsa_core import (
    AttentionCall,
    BlockSparseLayout,
    VideoTiling,
    block_sparse_attn,
    video_sparse_attn,
)
from vsa_core.backends import select_backend
from vsa_fa4 import block_sparse_attn as fa4_attn
from vsa_fa4 import ops
from vsa_fa4.backend import TRITON_FIRST_FROM_QUERY_LEN, FA4Backend
from vsa_fa4.schedule import BLOCK_SHAPES, make_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

Q_TOKENS, KV_TOKENS = 3072, 3584
HEADS = 4


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def _refusal(block_shape, head_dim=128, dtype=torch.bfloat16, grad=False) -> str | None:
    call = AttentionCall(torch.device("cuda"), dtype, head_dim, tuple(block_shape), grad)
    return FA4Backend().supports(call)


def make_layout(block_shape, *, batch=1, seed=0, q_tokens=Q_TOKENS, kv_tokens=KV_TOKENS):
    """Query block i selects i % 6 random key blocks; key blocks cycle through full, partial,
    empty, full, 1-token, full and almost-full valid sizes."""
    q_block, kv_block = block_shape
    num_q, num_kv = q_tokens // q_block, kv_tokens // kv_block
    pattern = [kv_block, kv_block // 2 + 3, 0, kv_block, 1, kv_block, kv_block - 1]
    valid = torch.tensor([pattern[i % len(pattern)] for i in range(num_kv)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(batch, HEADS, num_q, num_kv, generator=gen).argsort(-1)[..., :5]
    counts = (torch.arange(num_q) % 6).expand(batch, HEADS, num_q).contiguous()
    layout = BlockSparseLayout.from_indices(
        order.to(torch.int32),
        counts.to(torch.int32),
        kv_valid_sizes=valid,
        block_shape=block_shape,
    )
    return layout.to("cuda")


def make_inputs(layout, head_dim=128, dtype=torch.bfloat16, seed=1, requires_grad=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(seq):
        shape = (layout.batch, seq, layout.heads, head_dim)
        return torch.randn(shape, device="cuda", generator=gen, dtype=dtype)

    q, k, v = randn(layout.q_len), randn(layout.kv_len), randn(layout.kv_len)
    pad = padding_slots(layout)
    k[:, pad] = 30.0  # garbage in padding slots: finite, large, must be masked
    v[:, pad] = -30.0
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def padding_slots(layout) -> torch.Tensor:
    """[kv_len] bool on the GPU: the key slots past their block's valid size."""
    token = torch.arange(layout.kv_block, device="cuda")
    return (token >= layout.kv_valid_sizes.unsqueeze(-1)).flatten()


def rel_l2(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def reference(q, k, v, layout, dout=None):
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attn(q32, k32, v32, layout, backend="reference")
    grads = None
    if dout is not None:
        grads = torch.autograd.grad(out, (q32, k32, v32), dout.float())
    return out, lse, grads


def check_forward(out, lse, ref_out, ref_lse, layout):
    assert out.shape == ref_out.shape and out.dtype != torch.float32
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref_out) <= 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-2)
    # Query blocks with no key block (count 0): out exactly 0, lse -inf.
    empty = (layout.kv_counts == 0).repeat_interleave(layout.q_block, dim=-1)  # [B, H, Sq]
    assert bool(empty.any())
    assert bool((lse[empty] == float("-inf")).all())
    assert bool((out.permute(0, 2, 1, 3)[empty] == 0).all())


def check_backward(grads, ref_grads):
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert torch.isfinite(got).all(), name
        assert rel_l2(got, want) <= 1e-2, (name, rel_l2(got, want))


@pytest.mark.skipif(
    not torch.cuda.is_available() or _capability() != (9, 0), reason="the fork's kernels: sm_90"
)
def test_valid_sizes_in_the_lists_give_the_same_bits_as_plain_lists():
    """The 64x64 forward on lists whose partial entries carry their valid sizes (delta 10,
    shipped) is bitwise the forward on plain lists with the mask loading the sizes (an H200
    measured max |diff| 0.0 in experiment 17): output and lse, with partial and empty blocks."""
    from vsa_core.backends import register_backend, unregister_backend
    from vsa_fa4.launch import ForwardVariant, KernelChoice

    name = "fa4-test-plain-lists"
    register_backend(
        FA4Backend(kernels=KernelChoice(ForwardVariant(valid_in_list=False)), name=name)
    )
    try:
        layout = make_layout((64, 64))
        q, k, v = make_inputs(layout, requires_grad=False)
        packed = block_sparse_attn(q, k, v, layout, backend="fa4")
        plain = block_sparse_attn(q, k, v, layout, backend=name)
    finally:
        unregister_backend(name)
    for got, want in zip(packed, plain, strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(
    not torch.cuda.is_available() or _capability() != (9, 0), reason="the fork's kernels: sm_90"
)
def test_nan_in_v_padding_never_reaches_the_output_of_the_zeroing_forward():
    """Delta 11 (the fork's `experimental.v_padding_sm90`): the 64x64 forward zeroes partial
    blocks' V padding rows in shared memory, so NaN there (and in K's) leaves the output bitwise the
    output on finite padding, and the reference's within 1e-2, forward with lse and combined.
    The same kernel without the zeroing lets NaN through: the hazard the ops' zeroed copy of v
    guarded against, and what this test would catch."""
    from vsa_fa4.launch import ForwardVariant, KernelChoice

    layout = make_layout((64, 64))
    q, k, v = make_inputs(layout, requires_grad=False)
    pad = padding_slots(layout)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, pad], v_nan[:, pad] = float("inf"), float("nan")
    scale = 128**-0.5
    zeroing = FA4Backend(kernels=KernelChoice(ForwardVariant(zero_v_padding=True)))
    plain = FA4Backend()
    with torch.no_grad():
        got, got_lse = zeroing.forward(q, k_nan, v_nan, layout, scale)
        finite, finite_lse = plain.forward(q, k, v, layout, scale)
        leaked, _ = plain.forward(q, k, v_nan, layout, scale)
        coarse = torch.randn(1, layout.num_q_blocks, HEADS, 128, device="cuda").bfloat16()
        combined = zeroing.forward_combined(q, k_nan, v_nan, layout, scale, coarse, None)
        combined_finite = plain.forward_combined(q, k, v, layout, scale, coarse, None)
    assert torch.isnan(leaked).any(), "without the zeroing NaN padding reaches the output"
    assert torch.equal(got, finite) and torch.equal(got_lse, finite_lse)
    assert torch.equal(combined, combined_finite)
    want, _, _ = reference(q, k, v, layout)
    assert rel_l2(got, want) <= 1e-2


def test_video_sparse_attn_inference_reads_nan_padding_without_copies(monkeypatch):
    """The whole op in inference on tile-order inputs whose padding slots hold NaN: no zeroed
    copy of v is made (the pooling pass is asked for none) and the real tokens' output is
    bitwise the output on zero padding, gated combine included (the fa4 backend whose kernel
    choice zeroes V's padding in shared memory, `variant_backend`)."""
    if _refusal((64, 64)) is not None:
        pytest.skip(f"fa4 refuses 64x64: {_refusal((64, 64))}")
    from vsa_fa4.backend import variant_backend
    from vsa_fa4.launch import ForwardVariant
    from vsa_triton.coarse import TritonCoarse

    name = variant_backend(ForwardVariant(zero_v_padding=True))

    asked = []
    original = TritonCoarse.pool_and_clean

    def recording(self, q, k, v, valid_sizes, clean, padding_index):
        asked.append(tuple(clean))
        return original(self, q, k, v, valid_sizes, clean, padding_index)

    monkeypatch.setattr(TritonCoarse, "pool_and_clean", recording)
    tiling = VideoTiling((5, 18, 30), tile_shape=(4, 4, 4))  # partial tiles on every axis
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = [
        torch.randn(1, tiling.seq_len, 4, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    ]
    clean = [tiling.to_tiles(t) for t in x]
    pad = tiling.indices(clean[0].device).padding_index
    dirty = [t.clone().index_fill_(1, pad, float("nan")) for t in clean]
    with torch.no_grad():
        got = video_sparse_attn(*dirty[:3], tiling=tiling, topk=7, backend=name,
                                coarse_gate=dirty[3])  # fmt: skip
        want = video_sparse_attn(*clean[:3], tiling=tiling, topk=7, backend=name,
                                 coarse_gate=clean[3])  # fmt: skip
    assert asked and all(c == (False, False, False) for c in asked), asked
    real = tiling.indices(got.device).nonpad_index
    assert torch.equal(got[:, real], want[:, real])


# ---- forward and backward vs the reference, every block shape ------------------------------
@pytest.mark.skipif(
    not torch.cuda.is_available() or _capability() != (9, 0), reason="the fork's kernels: sm_90"
)
@pytest.mark.parametrize(
    "forward,backward",
    [("streams+qregs", "kv64-staged"), ("persistent", "kv64-dq-2parts-two-ctas"),
     ("no-qregs", None), ("no-valid-in-list", None)],
)  # fmt: skip
def test_explicit_kernel_choices_match_the_reference(forward, backward):
    """A backend carrying a `KernelChoice` (forward variant, backward tile configuration) runs
    those kernels through the whole op, passed down as arguments (issue 23), and they match the
    reference like the shipped ones."""
    from flash_attn_vsa.experimental.bwd_configs import EXPERIMENTAL_CONFIGS
    from vsa_core.backends import register_backend, unregister_backend
    from vsa_fa4.launch import ForwardVariant, KernelChoice

    variant = ForwardVariant.from_names(forward.split("+"))
    config = None if backward is None else EXPERIMENTAL_CONFIGS[backward]
    name = f"fa4-test-{forward}-{backward}"
    register_backend(FA4Backend(kernels=KernelChoice(variant, config), name=name))
    try:
        layout = make_layout((64, 64))
        q, k, v = make_inputs(layout)
        out, lse = block_sparse_attn(q, k, v, layout, backend=name)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref_out, ref_lse, ref_grads = reference(q, k, v, layout, dout)
        check_forward(out.detach(), lse, ref_out, ref_lse, layout)
        check_backward(grads, ref_grads)
    finally:
        unregister_backend(name)


@pytest.mark.skipif(
    not torch.cuda.is_available() or _capability() != (9, 0), reason="the fork's kernels: sm_90"
)
@pytest.mark.parametrize(
    "chunked,head_dim,all_full",
    [(False, 128, False), (True, 128, False), (False, 64, False), (False, 128, True)],
    ids=["one-chunk", "head-chunks", "d64", "all-full"],
)
def test_ds_backward_matches_the_reference_and_reruns_bitwise(
    chunked, head_dim, all_full, monkeypatch
):
    """The dS-writing backward (delta 12) and its dQ pass through the whole op: gradients
    match the reference on a layout with partial, empty and unselected key blocks and empty
    lists, and three runs on the same inputs (the third replays the kernel's launch) give the
    same bits in dq, dk and dv. ``head-chunks``: a dS budget of three heads' tiles makes two
    chunks of 2 heads that share one dS buffer; ``all-full``: every key block full, so the
    kernel runs without its mask (the dS buffers are then its only aux tensors)."""
    from flash_attn_vsa.bwd_sm90 import KV64_DS_CONFIG
    from vsa_core.backends import register_backend, unregister_backend
    from vsa_fa4.launch import KernelChoice

    layout = make_layout((64, 64))
    if all_full:  # every key block full: the kernel without a mask, two aux tensors
        layout = BlockSparseLayout.from_indices(
            layout.kv_indices.cpu(), layout.kv_counts.cpu(),
            kv_valid_sizes=torch.full_like(layout.kv_valid_sizes.cpu(), 64), block_shape=(64, 64),
        ).to("cuda")  # fmt: skip
        assert layout.kv_blocks_full
    tiles_per_head = layout.batch * layout.kv_indices.shape[2] * layout.kv_indices.shape[3]
    if chunked:
        monkeypatch.setattr(ops, "DS_BUDGET_BYTES", 3 * tiles_per_head * ops.DS_TILE_BYTES)
        chunks = ops.head_chunks(layout.batch, HEADS, layout.q_len, head_dim, tiles_per_head)
        assert [c.stop - c.start for c in chunks] == [2, 2]  # 3 heads a chunk at most: even
    name = "fa4-test-ds"
    register_backend(FA4Backend(kernels=KernelChoice(backward=KV64_DS_CONFIG), name=name))
    try:
        q, k, v = make_inputs(layout, head_dim)
        out, _ = block_sparse_attn(q, k, v, layout, backend=name)
        dout = torch.randn_like(out)
        runs = [torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for _ in range(3)]
        check_backward(runs[0], reference(q, k, v, layout, dout)[2])
        for again in runs[1:]:
            for got, first in zip(again, runs[0], strict=True):
                assert torch.equal(got, first)
    finally:
        unregister_backend(name)


@pytest.mark.skipif(
    not torch.cuda.is_available() or _capability() != (9, 0), reason="the fork's kernels: sm_90"
)
@pytest.mark.parametrize(
    "batch,heads,tokens",
    [(1, 1, 2), (1, 1, 64), (2, 1, 37), (1, 2, 3), (1, 1, 100)],
    ids=str,
)
def test_one_key_block_calls_train_through_every_launch(batch, heads, tokens):
    """Calls of one or two key blocks: with one key block, one head and batch 1 the
    dS-writing backward's slot starts [B, H, NKV] are (1, 1, 1) with strides (1, 1, 1), which
    upstream's launcher refused as an aux tensor (session 33: vsa-core's property test on the
    GPU, a one-token latent). Three calls (compile, recording, replay) each match the
    reference."""
    valid = [min(64, tokens - 64 * i) for i in range(-(-tokens // 64))]
    num_kv = len(valid)
    indices = torch.arange(num_kv, dtype=torch.int32).expand(batch, heads, num_kv, num_kv)
    counts = torch.full((batch, heads, num_kv), num_kv, dtype=torch.int32)
    layout = BlockSparseLayout.from_indices(
        indices.contiguous(), counts, kv_valid_sizes=torch.tensor(valid, dtype=torch.int32),
        block_shape=(64, 64),
    ).to("cuda")  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    shape = (batch, 64 * num_kv, heads, 64)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    for _call in ("compiles", "records", "replays"):
        out, _ = block_sparse_attn(q, k, v, layout, backend="fa4")
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
        ref_out, _, ref_grads = reference(q, k, v, layout, dout)
        assert rel_l2(out, ref_out) <= 1e-2
        check_backward(torch.autograd.grad(out, (q, k, v), dout), ref_grads)


@pytest.mark.parametrize("block_shape", BLOCK_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_and_backward_match_the_reference(block_shape):
    reason = _refusal(block_shape)
    if reason is not None:
        pytest.skip(f"fa4 refuses the forward here: {reason}")
    layout = make_layout(block_shape)
    q, k, v = make_inputs(layout)
    with torch.no_grad():
        out, lse = block_sparse_attn(q, k, v, layout, backend="fa4")
    dout = torch.randn_like(out)
    ref_out, ref_lse, ref_grads = reference(q, k, v, layout, dout)
    check_forward(out, lse, ref_out, ref_lse, layout)

    bwd_reason = _refusal(block_shape, grad=True)
    if bwd_reason is not None:
        # FA4 refuses this backward here (sm_100: 64-token key blocks): auto falls back.
        assert _capability() != (9, 0), bwd_reason
        with pytest.raises(ValueError, match="cannot run this call"):
            block_sparse_attn(q, k, v, layout, backend="fa4")
        call = AttentionCall.describe(q, k, v, layout)
        assert select_backend(call).name != "fa4"
        return
    out2, lse2 = block_sparse_attn(q, k, v, layout, backend="fa4")
    assert torch.equal(out2, out) and torch.equal(lse2, lse)  # the forward is deterministic
    grads = torch.autograd.grad(out2, (q, k, v), dout)
    check_backward(grads, ref_grads)


@pytest.mark.parametrize("block_shape", BLOCK_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_replayed_launches_match_the_reference(block_shape):
    """Launches are replayed from a description's third call on (`flash_attn_vsa.launch_replay`:
    the fork's entry points and upstream's own kernels alike): calls on new layouts and inputs
    of the same shapes, all kept allocated (so that the replays see new addresses), still match
    the reference, forward and backward, and both directions hold records."""
    from flash_attn_vsa import launch_replay

    if _refusal(block_shape, grad=True) is not None:
        pytest.skip(f"fa4 refuses training here: {_refusal(block_shape, grad=True)}")
    launch_replay.FORWARDS.clear()
    launch_replay.BACKWARDS.clear()
    alive = []
    for seed in range(4):
        layout = make_layout(block_shape, seed=seed)
        q, k, v = make_inputs(layout, seed=seed + 1)
        out, lse = block_sparse_attn(q, k, v, layout, backend="fa4")
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        alive.append((layout, q, k, v, out, lse, dout, grads))
    ref_out, ref_lse, ref_grads = reference(q, k, v, layout, dout)
    check_forward(out, lse, ref_out, ref_lse, layout)
    check_backward(grads, ref_grads)
    for cache in (launch_replay.FORWARDS, launch_replay.BACKWARDS):
        assert cache.records(), "no launch was recorded: every call ran upstream's launcher"


@pytest.mark.parametrize("kv_block", [64, 128])
@pytest.mark.parametrize("parent_q", [128, 256])
def test_paired_64_row_blocks_match_the_reference(kv_block, parent_q):
    """Layouts refined from coarser query blocks run paired on 128-row tiles (auto); the
    native 64-row path must agree."""
    parent = make_layout((parent_q, kv_block) if parent_q == 128 else (256, 256))
    layout = parent.refine((64, kv_block))
    assert layout.q_group_size >= 2
    backend = FA4Backend()
    plan = backend.plan(layout)
    assert plan.schedule == "paired" and plan.block_size == (128, kv_block)
    call = AttentionCall(torch.device("cuda"), torch.bfloat16, 128, (64, kv_block), False)
    if backend.supports(call) is not None:
        pytest.skip(f"fa4 refuses: {backend.supports(call)}")
    q, k, v = make_inputs(layout)
    grad = _capability() == (9, 0)  # KV64: the fork's backward
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    ref_out, ref_lse, ref_grads = reference(q, k, v, layout, dout if grad else None)
    for schedule in ("auto", "native"):
        if grad:
            out, lse = fa4_attn(q, k, v, layout, schedule=schedule)
            check_backward(torch.autograd.grad(out, (q, k, v), dout), ref_grads)
        else:
            with torch.no_grad():
                out, lse = fa4_attn(q, k, v, layout, schedule=schedule)
        check_forward(out.detach(), lse, ref_out, ref_lse, layout)


@pytest.mark.parametrize(
    "block_shape", [(64, 64), (128, 128), (256, 256)], ids=["64x64", "128x128", "256x256"]
)  # 64x64: the dS-writing backward, fa4's default for it
@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(64, torch.bfloat16), (128, torch.float16)],
    ids=["d64-bf16", "d128-fp16"],
)
def test_head_dim_64_and_fp16(block_shape, head_dim, dtype):
    reason = _refusal(block_shape, head_dim, dtype, grad=True)
    if reason is not None:
        pytest.skip(f"fa4 refuses: {reason}")
    layout = make_layout(block_shape, batch=2)
    q, k, v = make_inputs(layout, head_dim=head_dim, dtype=dtype)
    out, lse = block_sparse_attn(q, k, v, layout, backend="fa4")
    dout = torch.randn_like(out)
    ref_out, ref_lse, ref_grads = reference(q, k, v, layout, dout)
    check_forward(out.detach(), lse, ref_out, ref_lse, layout)
    check_backward(torch.autograd.grad(out, (q, k, v), dout), ref_grads)


def test_bhsd_inputs_through_strides():
    block_shape = (128, 128) if _capability() == (9, 0) else (256, 256)
    layout = make_layout(block_shape)
    q, k, v = (
        t.detach().transpose(1, 2).contiguous().requires_grad_() for t in make_inputs(layout)
    )
    out, lse = block_sparse_attn(q, k, v, layout, backend="fa4", qkv_format="bhsd")
    assert out.shape == q.shape
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = block_sparse_attn(q32, k32, v32, layout, backend="reference", qkv_format="bhsd")
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    assert rel_l2(out, ref) <= 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-2)
    check_backward(grads, ref_grads)


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 64)], ids=["64x64", "128x64"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_kv64_backward_runs_on_the_fork(block_shape, head_dim):
    """Upstream refuses KV64 backward on sm_90; the fork's kernel runs it."""
    if _capability() != (9, 0):
        pytest.skip("sm_90 only")
    layout = make_layout(block_shape, q_tokens=2048, kv_tokens=2048)
    q, k, v = make_inputs(layout, head_dim=head_dim)
    call = AttentionCall.describe(q, k, v, layout)
    assert FA4Backend().supports(call) is None
    # auto keeps fa4 first: TRAINING_RULE puts triton ahead only from
    # TRITON_FIRST_FROM_QUERY_LEN query tokens a head, far above this call's
    assert 0 < call.query_len < TRITON_FIRST_FROM_QUERY_LEN
    assert select_backend(call).name == "fa4"
    out, _ = block_sparse_attn(q, k, v, layout, backend="fa4")
    dout = torch.randn_like(out)
    _, _, ref_grads = reference(q, k, v, layout, dout)
    check_backward(torch.autograd.grad(out, (q, k, v), dout), ref_grads)


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 128)], ids=["64x64", "128x128"])
def test_backward_in_head_chunks_matches_the_reference(block_shape, monkeypatch):
    """A backward whose float32 dQ accumulator exceeds `ops.DQ_ACCUM_BUDGET_BYTES` runs in
    head chunks (Wan 720p: four): here a budget of three heads' accumulator makes two chunks
    of 2 heads, each launched on head-sliced views of every tensor (strided, offset), and
    the gradients still match the reference (the chunks of one size replay one record)."""
    if _refusal(block_shape, grad=True) is not None:
        pytest.skip(f"fa4 refuses training here: {_refusal(block_shape, grad=True)}")
    layout = make_layout(block_shape)
    q, k, v = make_inputs(layout)
    per_head = layout.batch * layout.q_len * q.shape[-1] * 4
    monkeypatch.setattr(ops, "DQ_ACCUM_BUDGET_BYTES", 3 * per_head)
    assert len(ops.head_chunks(layout.batch, HEADS, layout.q_len, q.shape[-1])) == 2
    for seed in range(3):  # the third call of a description replays its launch
        out, _ = block_sparse_attn(q, k, v, layout, backend="fa4")
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype,
                           generator=torch.Generator(device="cuda").manual_seed(seed))  # fmt: skip
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_backward(grads, reference(q, k, v, layout, dout)[2])


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 128), (256, 256)], ids=str)
def test_layouts_without_partial_blocks_run_without_mask_mod(block_shape):
    """A layout whose key blocks are all full (known on the host) skips the mask_mod; the
    results must still match the reference, forward and backward."""
    if _refusal(block_shape, grad=True) is not None:
        pytest.skip(f"fa4 refuses: {_refusal(block_shape, grad=True)}")
    q_block, kv_block = block_shape
    gen = torch.Generator().manual_seed(5)
    num_q, num_kv = 2048 // q_block, 2048 // kv_block
    order = torch.rand(1, HEADS, num_q, num_kv, generator=gen).argsort(-1)[..., :3]
    counts = (torch.arange(num_q) % 4).expand(1, HEADS, num_q).contiguous().to(torch.int32)
    valid = torch.full((num_kv,), kv_block, dtype=torch.int32)
    layout = BlockSparseLayout.from_indices(
        order.to(torch.int32), counts, kv_valid_sizes=valid, block_shape=block_shape
    ).to("cuda")
    assert layout.kv_blocks_full
    q, k, v = make_inputs(layout)
    out, lse = block_sparse_attn(q, k, v, layout, backend="fa4")
    dout = torch.randn_like(out)
    ref_out, ref_lse, ref_grads = reference(q, k, v, layout, dout)
    check_forward(out.detach(), lse, ref_out, ref_lse, layout)
    check_backward(torch.autograd.grad(out, (q, k, v), dout), ref_grads)


# ---- the whole VSA op ------------------------------------------------------------------------
def test_video_sparse_attn_inference_with_partial_tiles():
    if _refusal((64, 64)) is not None:
        pytest.skip(f"fa4 refuses 64x64: {_refusal((64, 64))}")
    tiling = VideoTiling((5, 18, 30), tile_shape=(4, 4, 4))  # partial tiles on every axis
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = [
        torch.randn(1, tiling.seq_len, 4, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(3)
    ]
    q, k, v = (tiling.to_tiles(t) for t in x)
    with torch.no_grad():
        out = video_sparse_attn(q, k, v, tiling=tiling, topk=7, backend="fa4")
        # Same bf16 inputs: the coarse stage selects the same tiles; the reference's fine
        # attention computes in float32.
        ref = video_sparse_attn(q, k, v, tiling=tiling, topk=7, backend="reference")
        # with a per-token gate (the combine in fa4's epilogue, gated)
        gate = tiling.to_tiles(torch.randn_like(x[0]))
        gated = video_sparse_attn(q, k, v, tiling=tiling, topk=7, backend="fa4", coarse_gate=gate)
        gated_ref = video_sparse_attn(
            q, k, v, tiling=tiling, topk=7, backend="reference", coarse_gate=gate
        )
    assert rel_l2(out, ref) <= 1e-2
    assert rel_l2(gated, gated_ref) <= 1e-2


def test_video_sparse_attn_training_with_partial_tiles_reads_the_split_lists(monkeypatch):
    """Training on a latent with partial tiles: fa4's forward reads the selection kernel's
    split lists (no list split of its own, session 24) over three calls (compiled, recorded,
    replayed), and out and the gradients of q, k, v and the gate match the reference op's
    (the same selection: same bf16 inputs, same coarse stage)."""
    if _refusal((64, 64), grad=True) is not None:
        pytest.skip(f"fa4 refuses 64x64 training: {_refusal((64, 64), grad=True)}")
    splits = []
    own_split = ops.forward_lists

    def spy(*args, **kwargs):
        splits.append(args)
        return own_split(*args, **kwargs)

    monkeypatch.setattr(ops, "forward_lists", spy)
    tiling = VideoTiling((5, 18, 30), tile_shape=(4, 4, 4))  # partial tiles on every axis
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaves():
        x = torch.randn(
            1, tiling.seq_len, 4, 128, device="cuda", generator=gen, dtype=torch.bfloat16
        )
        return tiling.to_tiles(x).requires_grad_()

    for _ in range(3):
        q, k, v, gate = leaves(), leaves(), leaves(), leaves()
        dout = torch.randn_like(q)
        got, want = (
            video_sparse_attn(q, k, v, tiling=tiling, topk=7, backend=name, coarse_gate=gate)
            for name in ("fa4", "reference")
        )
        grads = torch.autograd.grad(got, (q, k, v, gate), dout)
        ref_grads = torch.autograd.grad(want, (q, k, v, gate), dout)
        assert rel_l2(got, want) <= 1e-2
        for name, a, b in zip(("dq", "dk", "dv", "dgate"), grads, ref_grads, strict=True):
            assert torch.isfinite(a).all() and rel_l2(a, b) <= 1e-2, (name, rel_l2(a, b))
    assert not splits, "fa4's forward split the lists itself"


@pytest.mark.skipif(
    not torch.cuda.is_available() or _capability() != (9, 0), reason="the fork's kernels: sm_90"
)
@pytest.mark.parametrize("full", [False, True], ids=["partial", "full"])
@pytest.mark.parametrize("gated", ["none", "token", "head"])
def test_combined_forward_matches_the_reference(gated, full):
    """The 64x64 forward with VSA's combine in its epilogue (flash_attn_vsa.combine_sm90):
    fine + gate * coarse[query block] against the float32 reference, three calls on new
    inputs each (compiled, recorded, replayed: the replay must take the new operands); with
    partial key blocks (the mask's valid sizes come first among the aux tensors) and without
    (no mask: the combine's operands are the only aux tensors)."""
    layout = make_layout((64, 64))
    if full:
        # built on the CPU, where the layout can see that every block is full, then moved
        cpu = layout.to("cpu")
        valid = torch.full_like(cpu.kv_valid_sizes, 64)
        layout = BlockSparseLayout.from_indices(
            cpu.kv_indices, cpu.kv_counts, kv_valid_sizes=valid, block_shape=(64, 64)
        ).to("cuda")
        assert layout.kv_blocks_full
    plan = make_plan(layout.block_shape)
    for seed in range(3):
        q, k, v = make_inputs(layout, seed=seed, requires_grad=False)
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        coarse = (
            torch.randn(
                1,
                layout.num_q_blocks,
                HEADS,
                128,
                device="cuda",
                generator=gen,
                dtype=torch.bfloat16,
            )
            .transpose(1, 2)
            .contiguous()
            .transpose(1, 2)
        )
        gate = None
        if gated == "token":
            gate = torch.randn(q.shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        elif gated == "head":
            gate = torch.randn(HEADS, 1, device="cuda", generator=gen,
                               dtype=torch.bfloat16).expand(q.shape)  # fmt: skip
        out = ops.attention_combined(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 128**-0.5,
            plan, coarse, gate, kv_blocks_full=layout.kv_blocks_full,
        )  # fmt: skip
        fine, _, _ = reference(q, k, v, layout)
        rows = coarse.float().repeat_interleave(64, dim=1)
        want = fine + (rows if gate is None else gate.float() * rows)
        assert torch.isfinite(out).all() and out.dtype == torch.bfloat16
        assert rel_l2(out, want) <= 1e-2, (seed, rel_l2(out, want))
        # the same as the forward then the combine, to bf16 rounding (rounded once here)
        lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
        unfused, _ = ops.attention(
            q, k, v, *lists, 128**-0.5, plan, kv_blocks_full=layout.kv_blocks_full
        )
        unfused = unfused.float() + (rows if gate is None else gate.float() * rows)
        assert (out.float() - unfused).abs().max().item() <= 0.02 * want.abs().max().item()


# ---- torch.compile and CUDA graphs -------------------------------------------------------------
def _compile_case():
    block_shape = (256, 256)
    if _refusal(block_shape, grad=True) is not None:
        pytest.skip(f"fa4 refuses: {_refusal(block_shape, grad=True)}")
    return make_layout(block_shape, q_tokens=2048, kv_tokens=2048)


def test_torch_compile_fullgraph_forward_and_backward():
    layout = _compile_case()
    plan = make_plan(layout.block_shape)
    q, k, v = make_inputs(layout, requires_grad=False)

    def attention_layer(q, k, v, kv_indices, kv_counts, kv_valid_sizes):
        # physical_lists (256 -> 128 refine) and the custom op, traced as one graph.
        out, _ = ops.attention(q * 1.0, k, v, kv_indices, kv_counts, kv_valid_sizes, 0.088, plan)
        return (out.float() ** 2).sum()

    compiled = torch.compile(attention_layer, fullgraph=True)
    lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss = compiled(*leaves, *lists)
    loss.backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    eager_loss = attention_layer(*eager, *lists)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-3)
    for got, want in zip(leaves, eager, strict=True):  # dQ accumulates atomically: not bitwise
        assert torch.allclose(got.grad.float(), want.grad.float(), atol=1e-2, rtol=1e-2)


def test_cuda_graph_replay_with_changing_inputs_and_layouts():
    layout = _compile_case()
    q, k, v = make_inputs(layout)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    static_grad = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step():
        out, _ = fa4_attn(*static, layout)
        return out, torch.autograd.grad(out, static, static_grad)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture: compiles FA4's kernels, fills caches
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_grads = step()

    for seed in (3, 4):
        new_layout = make_layout(layout.block_shape, seed=seed, q_tokens=2048, kv_tokens=2048)
        new_inputs = make_inputs(new_layout, seed=seed)
        with torch.no_grad():
            for dst, src in zip(static, new_inputs, strict=True):
                dst.copy_(src)
            layout.kv_indices.copy_(new_layout.kv_indices)
            layout.kv_counts.copy_(new_layout.kv_counts)
        graph.replay()
        eager_out, eager_grads = step()
        assert torch.equal(graph_out, eager_out)
        for got, want in zip(graph_grads, eager_grads, strict=True):
            assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        ref_out, _, ref_grads = reference(*static, layout, static_grad)
        assert rel_l2(graph_out, ref_out) <= 1e-2
        check_backward(graph_grads, ref_grads)

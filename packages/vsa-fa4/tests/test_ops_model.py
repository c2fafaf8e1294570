"""The adapter end to end on the CPU, with a model of FA4's kernels (``fa4_model.py``).

Everything but the kernels is the real code path: schedule, physical lists, the custom ops
with their fake implementations and autograd, the forward/backward metadata. The model
computes what upstream FA4 computes from the tensors it is handed, in float64, so the
comparison with vsa-core's reference is exact up to float32 rounding (FA4's lse is float32):
any slip in the metadata (a partial block in the full list, an empty block kept, a wrong
transpose, a lost pair) shows as an O(1) error. What the model cannot show (the kernels
themselves, strides, bf16 numerics) is left to the GPU tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vsa_core import BlockSparseLayout
from vsa_core.reference import reference_block_sparse_attn
from vsa_fa4 import launch, metadata, ops
from vsa_fa4.schedule import make_plan

HEADS, DIM = 2, 16


def valid_sizes(kv_block: int) -> list[int]:
    """Full, partial, empty, full, 1-token, full, almost-full key blocks."""
    return [kv_block, kv_block // 2 + 3, 0, kv_block, 1, kv_block, kv_block - 1]


def counted_layout(block_shape, num_q: int = 6, seed: int = 0, batch: int = 1):
    """Query block i selects i % 6 key blocks (0..5: odd and even counts), at random."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.tensor(valid_sizes(block_shape[1]), dtype=torch.int32)
    num_kv = valid.shape[0]
    order = torch.rand(batch, HEADS, num_q, num_kv, generator=gen).argsort(-1)[..., :5]
    counts = (torch.arange(num_q) % 6).expand(batch, HEADS, num_q)
    return BlockSparseLayout.from_indices(
        order.to(torch.int32),
        counts.to(torch.int32).contiguous(),
        kv_valid_sizes=valid,
        block_shape=block_shape,
    )


def inputs(layout: BlockSparseLayout, seed: int = 1, dtype=torch.float64):
    """q, k, v leaves; key/value padding slots hold large garbage that must not leak."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(layout.batch, layout.q_len, HEADS, DIM, generator=gen, dtype=dtype)
    k, v = (
        torch.randn(layout.batch, layout.kv_len, HEADS, DIM, generator=gen, dtype=dtype)
        for _ in range(2)
    )
    token = torch.arange(layout.kv_block)
    pad = (token >= layout.kv_valid_sizes.unsqueeze(-1)).flatten()
    k[:, pad] = 1e3
    v[:, pad] = -1e3
    return [t.requires_grad_() for t in (q, k, v)]


def run_both(layout: BlockSparseLayout, schedule: str = "auto"):
    q, k, v = inputs(layout)
    scale = DIM**-0.5
    plan = make_plan(layout.block_shape, layout.q_group_size, layout.num_q_blocks, schedule)
    out, lse = ops.attention(
        q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, scale, plan,
        layout.q_group_size, layout.kv_blocks_full,
    )  # fmt: skip
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse = reference_block_sparse_attn(q, k, v, layout, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    return plan, (out, lse, *grads), (ref, ref_lse, *ref_grads)


def assert_close(got, want):
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape, name
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), name  # -inf lse exactly where expected
        # FA4's lse is float32 (the backward reads it), the rest float64 here: float32 rounding.
        torch.testing.assert_close(a[finite].double(), b[finite], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 64), (64, 128), (128, 128), (256, 256)])
def test_native_schedule_matches_the_reference(fa4_model, block_shape):
    layout = counted_layout(block_shape)
    plan, got, want = run_both(layout)
    assert plan.schedule == "native"
    assert_close(got, want)
    assert bool((got[1] == float("-inf")).any())  # rows with no key block (count 0)


@pytest.mark.parametrize("kv_block", [64, 128])
def test_paired_schedule_matches_the_reference(fa4_model, kv_block):
    layout = counted_layout((128, kv_block)).refine((64, kv_block))
    plan, got, want = run_both(layout)
    assert plan.schedule == "paired" and plan.block_size == (128, kv_block)
    assert_close(got, want)
    _, native, _ = run_both(layout, "native")
    assert_close(native, want)


def test_256_layout_refined_to_64x64_runs_paired(fa4_model):
    layout = counted_layout((256, 256), num_q=3).refine((64, 64))
    assert layout.q_group_size == 4
    plan, got, want = run_both(layout)
    assert plan.block_size == (128, 64)
    assert_close(got, want)


def test_batch_of_two_and_bhsd_strides(fa4_model):
    layout = counted_layout((128, 128), batch=2)
    plan = make_plan(layout.block_shape)
    q, k, v = inputs(layout)
    args = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, DIM**-0.5, plan)
    out, lse = ops.attention(q, k, v, *args)
    # The same data as BHSD tensors, handed over as transposed (non-contiguous) views.
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    out_t, lse_t = ops.attention(qt, kt, vt, *args)
    torch.testing.assert_close(out_t, out.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_t, lse, rtol=1e-12, atol=1e-12)
    assert out_t.is_contiguous()  # outputs are contiguous BSHD


def test_inference_builds_no_backward_metadata(fa4_model, monkeypatch):
    built = []
    original = metadata.backward_lists

    def spy(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, "backward_lists", spy)
    layout = counted_layout((128, 128))
    plan = make_plan(layout.block_shape)
    q, k, v = inputs(layout)
    args = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, DIM**-0.5, plan)
    with torch.no_grad():
        ops.attention(q, k, v, *args)
    ops.attention(*(t.detach() for t in (q, k, v)), *args)
    out, _ = ops.attention(q, k, v, *args)
    assert built == []  # a forward with autograd on builds nothing for backward yet
    out.sum().backward()
    assert built == [1]


def test_opcheck_forward_and_backward_ops(fa4_model):
    """Schema, autograd registration and fake implementations (output shapes and strides)
    agree with the real ops (AOT dispatch is covered by the torch.compile test below)."""
    layout = counted_layout((128, 64))
    plan = make_plan(layout.block_shape)
    q, k, v = inputs(layout)
    lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
    fwd_args = (q, k, v, *lists, DIM**-0.5, *plan.block_size)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.block_sparse_fwd, fwd_args, test_utils=checks)
    out, lse = ops.block_sparse_fwd(*(t.detach() for t in (q, k, v)), *fwd_args[3:])
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *fwd_args[3:])
    torch.library.opcheck(ops.block_sparse_bwd, bwd_args, test_utils=checks)


def test_torch_compile_fullgraph_traces_the_adapter(fa4_model):
    layout = counted_layout((256, 256), num_q=4)
    plan = make_plan(layout.block_shape)

    def layer(q, k, v, kv_indices, kv_counts, kv_valid_sizes):
        out, _ = ops.attention(q * 1.0, k, v, kv_indices, kv_counts, kv_valid_sizes, 0.25, plan)
        return (out**2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
    leaves = inputs(layout)
    compiled(*leaves, *lists).backward()
    eager = inputs(layout)
    layer(*eager, *lists).backward()
    for got, want in zip(leaves, eager, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-9)


def test_torch_compile_fullgraph_takes_an_explicit_kernel_choice(fa4_model, monkeypatch):
    """A non-shipped `KernelChoice` reaches the launches under ``torch.compile`` too (one graph:
    its string is a constant of the traced call)."""
    from flash_attn_vsa.experimental.bwd_configs import EXPERIMENTAL_CONFIGS

    seen = []
    run_fwd, run_bwd = fa4_model.run_forward, fa4_model.run_backward
    monkeypatch.setattr(
        launch, "run_forward", lambda *a, **k: (seen.append(k["variant"]), run_fwd(*a, **k))[1]
    )
    monkeypatch.setattr(
        launch, "run_backward", lambda *a, **k: (seen.append(k["config"]), run_bwd(*a, **k))[1]
    )
    staged = EXPERIMENTAL_CONFIGS["kv64-staged"]
    choice = launch.KernelChoice(launch.ForwardVariant(two_streams=True), staged)
    layout = counted_layout((64, 64), num_q=4)
    plan = make_plan(layout.block_shape)

    def layer(q, k, v, kv_indices, kv_counts, kv_valid_sizes):
        out, _ = ops.attention(
            q * 1.0, k, v, kv_indices, kv_counts, kv_valid_sizes, 0.25, plan, 1, False, choice
        )
        return (out**2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(*inputs(layout), layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes).backward()
    assert seen and seen == [choice.forward, staged]


def recording(fa4_model, monkeypatch):
    """Record the block size and ``masked`` flag of every launch the adapter makes."""
    from vsa_fa4 import launch

    calls = []

    def record(direction, run):
        def wrapper(*args, **kwargs):
            calls.append((direction, tuple(args[-2]), args[-1]))  # block_size, masked
            return run(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(launch, "run_forward", record("fwd", fa4_model.run_forward))
    monkeypatch.setattr(launch, "run_backward", record("bwd", fa4_model.run_backward))
    return calls


def full_layout(block_shape, num_q: int = 6, num_kv: int = 7):
    gen = torch.Generator().manual_seed(3)
    order = torch.rand(1, HEADS, num_q, num_kv, generator=gen).argsort(-1)[..., :4]
    counts = (torch.arange(num_q) % 5).expand(1, HEADS, num_q).to(torch.int32).contiguous()
    valid = torch.full((num_kv,), block_shape[1], dtype=torch.int32)
    return BlockSparseLayout.from_indices(
        order.to(torch.int32), counts, kv_valid_sizes=valid, block_shape=block_shape
    )


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 128), (256, 256), "paired"])
def test_layout_without_partial_blocks_launches_without_mask_mod(
    fa4_model, monkeypatch, block_shape
):
    calls = recording(fa4_model, monkeypatch)
    if block_shape == "paired":  # strided views of the lists: must reach FA4 contiguous
        layout = full_layout((128, 64)).refine((64, 64))
    else:
        layout = full_layout(block_shape)
    assert layout.kv_blocks_full and layout.refine((64, 64)).kv_blocks_full
    _, got, want = run_both(layout)
    assert [c[2] for c in calls] == [False, False]  # forward and backward, no mask_mod
    assert_close(got, want)


def test_partial_blocks_keep_the_mask_mod(fa4_model, monkeypatch):
    calls = recording(fa4_model, monkeypatch)
    layout = counted_layout((128, 128))
    assert not layout.kv_blocks_full
    _, got, want = run_both(layout)
    assert [c[2] for c in calls] == [True, True]
    assert_close(got, want)
    # Dropping the mask while blocks are partial lets the padding in: the model shows it.
    lying = dataclasses.replace(layout, kv_blocks_full=True)
    _, wrong, _ = run_both(lying)
    assert (wrong[0] - want[0]).abs().max() > 1.0


@pytest.mark.parametrize("schedule", ["native", "paired"])
def test_kv64_backward_keeps_128_row_query_blocks(fa4_model, monkeypatch, schedule):
    """KV64 backward goes to the fork's kernels with the forward's physical blocks: 128-row
    query blocks (logical 128x64, or paired 64x64) stay 128-row (its 128x64 tiles)."""
    calls = recording(fa4_model, monkeypatch)
    base = counted_layout((128, 64))
    layout = base if schedule == "native" else base.refine((64, 64))
    plan, got, want = run_both(layout)
    assert plan.block_size == (128, 64)
    assert [c[:2] for c in calls] == [("fwd", (128, 64)), ("bwd", (128, 64))]
    assert_close(got, want)


def test_head_chunks_cover_every_head_once_within_the_budget(monkeypatch):
    monkeypatch.setattr(ops, "DQ_ACCUM_BUDGET_BYTES", 3 * 2 * 100 * 16 * 4)
    chunks = ops.head_chunks(2, 8, 100, 16)
    assert chunks == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert ops.head_chunks(1, 8, 1, 16) == [slice(0, 8)]  # small calls: one launch
    assert ops.head_chunks(2, 8, 10**6, 128) == [slice(h, h + 1) for h in range(8)]
    # the dS buffer's budget: the module's, or the call's; as few chunks as it allows, even
    monkeypatch.setattr(ops, "DS_BUDGET_BYTES", 3 * 10 * ops.DS_TILE_BYTES)
    assert ops.head_chunks(1, 8, 1, 16, 10) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert ops.head_chunks(1, 8, 1, 16, 10, 5 * 10 * ops.DS_TILE_BYTES) == [
        slice(0, 4),
        slice(4, 8),
    ]
    assert ops.head_chunks(1, 8, 1, 16, 10, 1) == [slice(h, h + 1) for h in range(8)]


def test_a_ds_buffer_that_does_not_fit_says_what_needs_less():
    class Short:  # a q whose allocations fail as a full device's do
        def element_size(self):
            return 2

        def new_empty(self, shape):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    assert ops._ds_buffer(torch.empty(1, dtype=torch.bfloat16), 3, 2).shape == (3 * 2 * 64, 64)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        ops._ds_buffer(Short(), 1 << 17, 2)  # 2 heads of 131,072 tiles: 2.00 GiB
    message = str(caught.value)
    assert "2.00 GiB dS buffer (2 head(s) a launch" in message
    assert "ds_budget_bytes" in message and "KV64_CONFIG" in message
    assert "Tried to allocate 8.00 GiB" in message  # torch's own words kept


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 128)])
def test_backward_in_head_chunks_matches_the_reference(fa4_model, monkeypatch, block_shape):
    """One head per backward launch (a budget below one head's accumulator): views of every
    head-sliced tensor go to FA4 and the gradients still match the reference."""
    monkeypatch.setattr(ops, "DQ_ACCUM_BUDGET_BYTES", 1)
    calls = []
    run = fa4_model.run_backward

    def counting(*args, **kwargs):
        calls.append(args[1].shape[2])  # q's heads in this launch
        return run(*args, **kwargs)

    monkeypatch.setattr(launch, "run_backward", counting)
    layout = counted_layout(block_shape)
    _, got, want = run_both(layout)
    assert calls == [1] * HEADS
    assert_close(got, want)


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 64)])
def test_backward_on_rotated_lists_matches_the_reference(fa4_model, monkeypatch, block_shape):
    """The backward op rotates its lists by `ops.rotation_width` (here 3 instead of a device's
    SM count): some lists reach FA4 out of ascending order, and the gradients still match."""
    monkeypatch.setattr(ops, "rotation_width", lambda device: 3)
    seen = []
    run = fa4_model.run_backward

    def recording(*args, **kwargs):
        seen.append(args[9])  # the SparseLists of this launch
        return run(*args, **kwargs)

    monkeypatch.setattr(launch, "run_backward", recording)
    _, got, want = run_both(counted_layout(block_shape))
    lists = seen[0]
    counts = lists.full_block_cnt + lists.mask_block_cnt
    rotated = [
        bool((row[: int(n)].diff() < 0).any())
        for row, n in zip(lists.full_block_idx.flatten(0, -2), counts.flatten(), strict=True)
    ]
    assert any(rotated)
    assert_close(got, want)


def combined_inputs(layout: BlockSparseLayout, gated: str):
    """Detached q, k, v, a coarse output per query block and a gate: None, per token, or per
    head broadcast over tokens and channels (strides 0, as vsa-core hands a [H] gate over)."""
    q, k, v = (t.detach() for t in inputs(layout))
    gen = torch.Generator().manual_seed(3)
    coarse = torch.randn(layout.batch, layout.num_q_blocks, HEADS, DIM, generator=gen,
                         dtype=q.dtype)  # fmt: skip
    gate = None
    if gated == "token":
        gate = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    elif gated == "head":
        gate = torch.randn(HEADS, 1, generator=gen, dtype=q.dtype).expand(q.shape)
    return q, k, v, coarse, gate


@pytest.mark.parametrize("gated", ["none", "token", "head"])
@pytest.mark.parametrize("block_shape", [(64, 64), "64x64-full", (128, 128), "paired"])
def test_combined_forward_is_fine_plus_gated_coarse(fa4_model, monkeypatch, block_shape, gated):
    """fine + gate * coarse[query block]: in the 64x64 forward's epilogue (the launch gets the
    operands and no lse; with every key block full, no mask either), elsewhere the forward then
    an in-place multiply-add; both equal the reference's fine output plus the product."""
    calls = []
    original = fa4_model.run_forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("combine") is not None)
        masked.append(args[9] if len(args) > 9 else kwargs.get("masked", True))
        return original(*args, **kwargs)

    masked = []
    monkeypatch.setattr(launch, "run_forward", spy)
    layout = {
        "paired": lambda: counted_layout((128, 64)).refine((64, 64)),
        "64x64-full": lambda: full_layout((64, 64)),
    }.get(block_shape, lambda: counted_layout(block_shape))()
    plan = make_plan(layout.block_shape, layout.q_group_size, layout.num_q_blocks)
    q, k, v, coarse, gate = combined_inputs(layout, gated)
    scale = DIM**-0.5
    got = ops.attention_combined(
        q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, scale, plan,
        coarse, gate, layout.q_group_size, layout.kv_blocks_full,
    )  # fmt: skip
    fine, _ = reference_block_sparse_attn(q, k, v, layout, scale)
    rows = coarse.repeat_interleave(layout.q_block, dim=1)
    want = fine + (rows if gate is None else gate * rows)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert calls == [plan.block_size == (64, 64)]  # the epilogue exactly where it runs
    assert masked == [not layout.kv_blocks_full]


def test_opcheck_combined_forward_op(fa4_model):
    layout = counted_layout((64, 64))
    q, k, v, coarse, gate = combined_inputs(layout, "token")
    lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
    checks = ("test_schema", "test_faketensor")
    for g in (gate, None):
        args = (q, k, v, *lists, coarse, g, DIM**-0.5)
        torch.library.opcheck(ops.block_sparse_fwd_combined, args, test_utils=checks)


def test_combined_launch_refuses_what_its_kernel_cannot_run():
    from vsa_fa4.metadata import unmasked_forward_lists

    layout = counted_layout((128, 128))
    q, k, v, coarse, _ = combined_inputs(layout, "none")
    lists = unmasked_forward_lists(layout.kv_indices, layout.kv_counts, 7)
    out = torch.empty_like(q)
    common = (lists, layout.kv_valid_sizes, 0.1, (128, 128), False)
    with pytest.raises(ValueError, match="two-CTA 64x64"):
        launch.run_forward(q, k, v, out, None, *common, combine=(coarse, None))
    with pytest.raises(ValueError, match="lse must be None"):
        launch.run_forward(q, k, v, out, torch.empty(1), *common, combine=(coarse, None))


@pytest.mark.parametrize(("block_size", "masked"), [((128, 128), True), ((64, 64), False)])
def test_run_forward_refuses_valid_sizes_in_lists_where_no_kernel_reads_them(block_size, masked):
    """`PackedSparseLists` read as plain block ids would attend to wrong blocks: the launch
    refuses them outside the two-CTA 64x64 forward (masked), before any kernel runs."""
    lay = counted_layout(block_size)
    q, k, v = (t.detach().float() for t in inputs(lay))
    lists = metadata.forward_lists(
        lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes, block_size[1], pack_valid=True
    )
    out, lse = torch.empty_like(q), torch.empty(1, HEADS, q.shape[1])
    with pytest.raises(ValueError, match="PackedSparseLists"):
        launch.run_forward(
            q, k, v, out, lse, lists, lay.kv_valid_sizes, DIM**-0.5, block_size, masked
        )


def spy_lists(monkeypatch, model) -> list:
    """The lists each `launch.run_forward` call gets, in order (the model runs the call)."""
    seen = []
    original = model.run_forward

    def spy(*args, **kwargs):
        seen.append(args[5])
        return original(*args, **kwargs)

    monkeypatch.setattr(launch, "run_forward", spy)
    return seen


def coarse_stage_split(layout):
    """The `ForwardSplit` the coarse stage would attach to ``layout`` (64-token key tiles):
    its lists split by fullness, partial entries with their valid sizes (new tensors)."""
    from vsa_core.layout import ForwardSplit

    packed = metadata.forward_lists(
        layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64, pack_valid=True
    )
    return ForwardSplit(packed.full_block_idx, packed.full_block_cnt, packed.mask_block_idx,
                        packed.mask_block_cnt)  # fmt: skip


def test_combined_forward_reads_the_coarse_stages_split_lists(fa4_model, monkeypatch):
    """With a layout's `ForwardSplit` (written by the coarse stage while it selects) the
    combined 64x64 forward hands the kernel those very tensors as its packed lists (no split
    of its own) and the output stays the reference's; a variant that reads plain lists splits
    them itself."""
    seen = spy_lists(monkeypatch, fa4_model)
    layout = counted_layout((64, 64))
    split = coarse_stage_split(layout)
    plan = make_plan(layout.block_shape, layout.q_group_size, layout.num_q_blocks)
    q, k, v, coarse, gate = combined_inputs(layout, "token")
    scale = DIM**-0.5
    fine, _ = reference_block_sparse_attn(q, k, v, layout, scale)
    want = fine + gate * coarse.repeat_interleave(layout.q_block, dim=1)
    plain = launch.KernelChoice(launch.ForwardVariant(valid_in_list=False))
    for kernels in (launch.SHIPPED, plain):
        got = ops.attention_combined(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, scale, plan,
            coarse, gate, layout.q_group_size, layout.kv_blocks_full, kernels, split,
        )  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    shipped, unpacked = seen
    assert shipped.mask_block_idx is split.partial_idx and shipped.full_block_idx is split.full_idx
    assert not isinstance(unpacked, metadata.PackedSparseLists)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "custom-op"])
def test_training_forward_reads_the_split_lists_and_does_not_keep_them(
    fa4_model, monkeypatch, eager
):
    """In training too the 64x64 forward hands the kernel a layout's `ForwardSplit` as its
    packed lists; out, lse and the gradients stay the reference's, and the autograd graph
    keeps none of the split's tensors (the backward builds its own lists from the plain ones:
    holding the split would keep it alive until then). Eagerly (`EagerOrOp`'s autograd
    function) and through the custom op's registered autograd."""
    import gc
    import weakref

    seen = spy_lists(monkeypatch, fa4_model)
    if not eager:  # what torch.compile traces: the op itself, with its registered autograd
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layout = counted_layout((64, 64))
    split = coarse_stage_split(layout)
    watched = [weakref.ref(t) for t in split]
    plan = make_plan(layout.block_shape, layout.q_group_size, layout.num_q_blocks)
    q, k, v = inputs(layout)
    scale = DIM**-0.5
    out, lse = ops.attention(
        q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, scale, plan,
        layout.q_group_size, layout.kv_blocks_full, launch.SHIPPED, split,
    )  # fmt: skip
    (lists,) = seen
    assert lists.mask_block_idx is split.partial_idx and lists.full_block_idx is split.full_idx
    del split, lists, seen[:]
    gc.collect()
    assert all(ref() is None for ref in watched), "the autograd graph keeps the split lists"
    assert isinstance(out.grad_fn, torch.autograd.graph.Node)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse = reference_block_sparse_attn(q, k, v, layout, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert_close((out, lse, *grads), (ref, ref_lse, *ref_grads))


def test_the_backward_fills_no_zero_gradient_for_lse(fa4_model):
    """lse is non-differentiable and the backward reads no gradient of it: autograd must not
    allocate and zero-fill one (a float32 [B, H, S] fill on every training backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layout = counted_layout((64, 64))
    plan = make_plan(layout.block_shape)
    q, k, v = inputs(layout)
    args = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, DIM**-0.5, plan)
    out, lse = ops.attention(q, k, v, *args)
    fills = []

    class Fills(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            filled = name in ("zeros", "zeros_like", "new_zeros", "fill_", "zero_", "full")
            if filled and isinstance(result, torch.Tensor) and result.shape == lse.shape:
                fills.append(name)
            return result

    with Fills():
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert fills == []
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert not lse.requires_grad  # non-differentiable: nothing to backpropagate from it

"""Schedules, and what the ``fa4`` backend accepts or refuses (with which reason) per device.

No GPU is needed: CUDA calls are described with a patched compute capability, and the
installed ``flash_attn.cute`` is looked up (or patched away) without importing it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from flash_attn_vsa import UPSTREAM_VERSION
from vsa_core import AttentionCall, BlockSparseLayout
from vsa_fa4 import backend as backend_module
from vsa_fa4.backend import FA4Backend
from vsa_fa4.schedule import BLOCK_SHAPES, make_plan, native_plan, plan_refusal

CUDA = torch.device("cuda", 0)


def call(block_shape=(128, 128), *, device=CUDA, dtype=torch.bfloat16, head_dim=128, grad=False):
    return AttentionCall(device, dtype, head_dim, tuple(block_shape), grad)


@pytest.fixture
def gpu(monkeypatch):
    """Describe calls as on a GPU of the given capability, with flash_attn.cute installed."""
    monkeypatch.setattr(backend_module, "find_flash_attn_cute", lambda: True)

    def use(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
        return FA4Backend()

    return use


# ---- schedules -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("block_shape", "physical"),
    [((64, 64), (64, 64)), ((128, 64), (128, 64)), ((64, 128), (64, 128)),
     ((128, 128), (128, 128)), ((256, 256), (256, 128))],
)  # fmt: skip
def test_native_plans(block_shape, physical):
    plan = make_plan(block_shape)
    assert plan == native_plan(block_shape)
    assert plan.block_size == physical and plan.schedule == "native"
    assert plan.q_merge == 1 and plan.kv_split == block_shape[1] // physical[1]


def test_auto_pairs_64_row_blocks_only_when_the_layout_says_pairs_share_lists():
    assert make_plan((64, 64), q_group_size=2, num_q_blocks=8).block_size == (128, 64)
    assert make_plan((64, 128), q_group_size=4, num_q_blocks=8).block_size == (128, 128)
    assert make_plan((64, 64), q_group_size=1, num_q_blocks=8).schedule == "native"
    assert make_plan((64, 64), q_group_size=3, num_q_blocks=9).schedule == "native"
    assert make_plan((64, 64), q_group_size=2, num_q_blocks=8, schedule="native").q_tile == 64
    assert make_plan((128, 64), q_group_size=2, num_q_blocks=8).schedule == "native"


def test_make_plan_errors():
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_plan((64, 64), schedule="fast")
    with pytest.raises(ValueError, match=r"block shape must be one of .* got 32x32"):
        make_plan((32, 32))
    with pytest.raises(ValueError, match="q_group_size=1"):
        make_plan((64, 64), q_group_size=1, num_q_blocks=8, schedule="paired")
    with pytest.raises(ValueError, match="schedule='paired'"):
        make_plan((128, 128), q_group_size=2, num_q_blocks=8, schedule="paired")


def test_backend_plan_follows_the_layout_and_its_schedule():
    valid = torch.full((4,), 64, dtype=torch.int32)
    mask = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    layout = BlockSparseLayout.from_block_mask(mask, valid, (128, 64)).refine((64, 64))
    assert FA4Backend().plan(layout).block_size == (128, 64)
    assert FA4Backend("native").plan(layout).block_size == (64, 64)
    assert FA4Backend().plan(layout, schedule="native").block_size == (64, 64)
    with pytest.raises(ValueError, match="schedule must be one of"):
        FA4Backend("fast")


# ---- supports(): refusals before the architecture ------------------------------------------
def test_refuses_without_flash_attn_cute(monkeypatch):
    monkeypatch.setattr(backend_module, "find_flash_attn_cute", lambda: False)
    backend = FA4Backend()
    assert backend.supports(call()) == "flash_attn.cute (flash-attn-4) is not installed"
    assert backend.availability() == "flash_attn.cute (flash-attn-4) is not installed"


def test_lookups_find_flash_attn_cute_without_importing_it():
    code = (
        "import json, sys, torch\n"
        "from vsa_core import AttentionCall\n"
        "from vsa_fa4.backend import FA4Backend, find_flash_attn_cute\n"
        "call = AttentionCall(torch.device('cpu'), torch.bfloat16, 128, (64, 64), False)\n"
        "found = find_flash_attn_cute()\n"
        "FA4Backend().availability(), FA4Backend().supports(call)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'cutlass'))\n"
        "print(json.dumps([found, heavy]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    found, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert found is True  # flash-attn-4 is in the workspace's lockfile
    assert heavy == []


def test_refuses_a_cpu_call(gpu):
    gpu((9, 0))
    reason = FA4Backend().supports(call(device=torch.device("cpu")))
    assert reason == "needs a CUDA device (sm_90 or sm_100), got cpu"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"dtype": torch.float32}, "dtype torch.float32 not supported (float16, bfloat16)"),
        ({"head_dim": 96}, "head dim 96 not in (64, 128), the head dims vsa-fa4 runs"),
        ({"head_dim": 256}, "head dim 256 not in (64, 128), the head dims vsa-fa4 runs"),
        (
            {"block_shape": (32, 32)},
            "block shape 32x32 not in 64x64, 128x64, 64x128, 128x128, 256x256",
        ),
    ],
)
def test_refusal_reasons(gpu, kwargs, reason):
    backend = gpu((9, 0))
    assert backend.supports(call(**kwargs)) == reason


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (12, 0), (10, 3), (9, 1)])
def test_refuses_other_architectures(gpu, capability):
    backend = gpu(capability)
    expected = f"needs sm_90 or sm_100, got sm_{capability[0]}{capability[1]}"
    assert backend.supports(call()) == expected


# ---- supports() on sm_90 -------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_shape", BLOCK_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sm90_runs_every_forward(gpu, block_shape, head_dim, dtype):
    backend = gpu((9, 0))
    assert backend.supports(call(block_shape, head_dim=head_dim, dtype=dtype)) is None


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 64)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_kv64_backward_runs_on_the_fork(gpu, block_shape, head_dim):
    # Upstream refuses it; flash_attn_vsa.bwd_sm90 runs it (64x64 and 128x64 tiles).
    backend = gpu((9, 0))
    assert backend.supports(call(block_shape, head_dim=head_dim, grad=True)) is None
    plan = make_plan(block_shape)
    assert plan_refusal((9, 0), head_dim, plan, backward=True) is None


def test_sm90_backward_with_128_token_key_blocks(gpu):
    backend = gpu((9, 0))
    for block_shape in [(64, 128), (128, 128), (256, 256)]:
        assert backend.supports(call(block_shape, grad=True)) is None
    for block_shape in [(128, 128), (256, 256)]:
        assert backend.supports(call(block_shape, head_dim=64, grad=True)) is None
    # At head dim 64 upstream's sm_90 backward uses 128-row query tiles.
    assert backend.supports(call((64, 128), head_dim=64, grad=True)) == (
        f"backward with 64-token query blocks at head dim 64 on sm_90: upstream FA4 "
        f"{UPSTREAM_VERSION}'s backward query tile there is 128 rows"
    )


# ---- supports() on sm_100 ------------------------------------------------------------------
def test_sm100_runs_256_blocks_forward_and_backward(gpu):
    backend = gpu((10, 0))
    assert backend.supports(call((256, 256))) is None
    assert backend.supports(call((256, 256), head_dim=64, grad=True)) is None


@pytest.mark.parametrize(
    ("block_shape", "reason"),
    [
        ((64, 64), "64-token key blocks on sm_100: upstream FA4 {v}'s Blackwell block-sparse "
         "key tile is 128 tokens"),
        ((128, 64), "64-token key blocks on sm_100: upstream FA4 {v}'s Blackwell block-sparse "
         "key tile is 128 tokens"),
        ((128, 128), "128-token query blocks on sm_100: upstream FA4 {v}'s Blackwell "
         "block-sparse forward runs two 128-row query tiles per sparse block, so query blocks "
         "must be multiples of 256 tokens"),
        ((64, 128), "64-token query blocks on sm_100: upstream FA4 {v}'s Blackwell "
         "block-sparse forward runs two 128-row query tiles per sparse block, so query blocks "
         "must be multiples of 256 tokens"),
    ],
)  # fmt: skip
def test_sm100_refusals(gpu, block_shape, reason):
    backend = gpu((10, 0))
    assert backend.supports(call(block_shape)) == reason.format(v=UPSTREAM_VERSION)


def test_plan_refusal_judges_the_physical_plan():
    paired = make_plan((64, 128), q_group_size=2, num_q_blocks=4)
    assert plan_refusal((9, 0), 64, paired, backward=True) is None  # 128-row tiles: fine
    assert plan_refusal((9, 0), 64, native_plan((64, 128)), backward=True) is not None


# ---- availability() and forward() without a usable GPU -------------------------------------
def test_availability_on_this_machine(monkeypatch):
    monkeypatch.setattr(backend_module, "find_flash_attn_cute", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert FA4Backend().availability() == "no CUDA device (FA4's CuTe kernels need sm_90 or sm_100)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    assert FA4Backend().availability() == "no CUDA device of capability sm_90 or sm_100"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert FA4Backend().availability() is None


def test_forward_refuses_what_supports_refuses():
    valid = torch.full((2,), 64, dtype=torch.int32)
    layout = BlockSparseLayout.from_block_mask(
        torch.ones(1, 1, 2, 2, dtype=torch.bool), valid, (64, 64)
    )
    q = torch.zeros(1, 128, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the fa4 backend cannot run this call: needs a CUDA"):
        FA4Backend().forward(q, q, q, layout, 1.0)


def test_auto_ranks_fa4_below_triton_for_large_training_unpaired_64_row_blocks_on_sm90(gpu):
    backend = gpu((9, 0))
    tokens = backend_module.TRITON_FIRST_FROM_QUERY_LEN
    unpaired = dataclasses.replace(call((64, 64), grad=True), query_len=tokens)
    paired = dataclasses.replace(unpaired, q_group_size=4)
    assert backend.priority_for(unpaired) == 5 < 10 < backend.priority_for(paired) == 20
    assert "below triton" in backend.ranking_note(unpaired)
    assert backend.ranking_note(paired) is None
    assert backend.priority_for(dataclasses.replace(unpaired, q_group_size=3)) == 5
    # measured faster on fa4: all key blocks full (aligned latents), smaller problems
    assert backend.priority_for(dataclasses.replace(unpaired, kv_blocks_full=True)) == 20
    assert backend.priority_for(dataclasses.replace(unpaired, query_len=tokens - 1)) == 20
    # the rule reads a head's tokens, not the call's rows (HunyuanVideo vs Wan 720p)
    many_rows = dataclasses.replace(unpaired, query_len=tokens - 1, query_rows=10**8)
    assert backend.priority_for(many_rows) == 20
    # inference: fa4's two-CTA forward is ahead, with or without partial key blocks
    for full in (False, True):
        inference = dataclasses.replace(unpaired, requires_grad=False, kv_blocks_full=full)
        assert backend.priority_for(inference) == 20
    assert backend.priority_for(call((128, 64))) == 20
    assert gpu((10, 0)).priority_for(call((64, 64))) == 20


def test_fused_combine_is_offered_in_tile_order_only():
    backend = FA4Backend()
    assert backend.fuses_combine and not backend.reads_raster
    with pytest.raises(ValueError, match="slot_rows must be None"):
        backend.forward_combined(None, None, None, None, 0.1, None, None, slot_rows=object())


def test_reads_key_padding_as_is_only_where_its_forward_zeroes_v_padding(gpu):
    """Inference with unpaired 64x64 blocks on sm_90 runs the forward that zeroes partial
    blocks' V padding in shared memory (the fork's experimental.v_padding_sm90) when the
    kernel choice asks for it: the ops then skip v's zeroed copy. Training (the backward
    multiplies V and K padding), paired or other blocks (other kernels), sm_100 and the
    shipped choice (no zeroing) keep the copy."""
    from vsa_fa4.launch import ForwardVariant, KernelChoice

    gpu((9, 0))
    backend = FA4Backend(kernels=KernelChoice(ForwardVariant(zero_v_padding=True)))
    inference = call((64, 64))
    assert backend.reads_key_padding_as_is(inference)
    assert not backend.reads_key_padding_as_is(call((64, 64), grad=True))
    assert not backend.reads_key_padding_as_is(dataclasses.replace(inference, q_group_size=2))
    assert not backend.reads_key_padding_as_is(call((128, 64)))
    assert not backend.reads_key_padding_as_is(call((128, 128)))
    assert not FA4Backend().reads_key_padding_as_is(inference)  # shipped: the copy
    zeroing = KernelChoice(ForwardVariant(zero_v_padding=True))
    assert not FA4Backend(schedule="paired", kernels=zeroing).reads_key_padding_as_is(inference)
    for names in (["qregs"], ["zero-v-padding", "streams"], ["zero-v-padding", "no-valid-in-list"]):
        variant = FA4Backend(kernels=KernelChoice(ForwardVariant.from_names(names)))
        assert not variant.reads_key_padding_as_is(inference), names
    sm100 = dataclasses.replace(inference, capability=(10, 0))
    assert not backend.reads_key_padding_as_is(sm100)
    from vsa_core.backends import get_backend, unregister_backend

    name = backend_module.variant_backend(ForwardVariant(zero_v_padding=True))
    try:  # what the README tells users to pass as backend=
        assert name == "fa4+zero-v-padding"
        assert get_backend(name).reads_key_padding_as_is(inference)
    finally:
        unregister_backend(name)


def test_v_gets_a_zeroed_copy_where_the_kernel_cannot_zero_its_padding():
    """`reads_key_padding_as_is` cannot see the key count; a layout with 2^16 key blocks or
    more runs lists without valid sizes (no zeroing), so the backend zeroes v's padding
    itself there; below that, and in training, v goes to the kernels as it is."""
    from vsa_fa4.launch import ForwardVariant, KernelChoice

    backend = FA4Backend(kernels=KernelChoice(ForwardVariant(zero_v_padding=True)))
    q = torch.zeros(1, 64, 1, 8)
    for blocks, copied in ((3, False), ((1 << 16) + 1, True)):
        valid = torch.full((blocks,), 64, dtype=torch.int32)
        valid[1] = 5
        v = torch.full((1, 64 * blocks, 1, 8), float("nan"))
        mask = torch.ones(1, 1, 1, blocks, dtype=torch.bool)
        layout = BlockSparseLayout.from_block_mask(mask, valid, (64, 64))
        got = backend._v_for_kernels(q, v, layout, requires_grad=False)
        assert (got is not v) == copied
        if copied:  # real slots kept, padding zeroed
            assert torch.isnan(got[:, :69]).all() and not got[:, 69:128].isnan().any()
        assert backend._v_for_kernels(q, v, layout, requires_grad=True) is v


def test_deterministic_training_runs_the_ds_backward_on_64x64_blocks_on_sm90(gpu):
    """deterministic=True with gradients: accepted for 64x64 blocks on sm_90, where `for_call`
    hands the call a backend with the dS-writing backward (delta 12) on the native plan, the
    forward variant kept; refused, with the reason, for other blocks and off sm_90, and for a
    kernel choice whose backward reduces dQ."""
    from flash_attn_vsa.bwd_sm90 import KV64_CONFIG
    from vsa_fa4.launch import ForwardVariant, KernelChoice

    fa4 = gpu((9, 0))
    deterministic = dataclasses.replace(call((64, 64), grad=True), deterministic=True)
    assert fa4.supports(deterministic) is None
    twin = fa4.for_call(deterministic)
    assert twin is not fa4 and twin.name == fa4.name and twin.schedule == "native"
    assert twin.kernels.backward_for((64, 64)).dq_from_ds
    assert twin.kernels.forward == fa4.kernels.forward
    assert twin.for_call(deterministic) is twin and twin.supports(deterministic) is None
    for plain in (
        call((64, 64), grad=True),
        dataclasses.replace(deterministic, requires_grad=False),
    ):
        assert fa4.for_call(plain) is fa4
    variant = FA4Backend(kernels=KernelChoice(ForwardVariant(q_in_registers=False)))
    assert variant.for_call(deterministic).kernels.forward == variant.kernels.forward
    budgeted = FA4Backend(kernels=KernelChoice(ds_budget_bytes=1 << 30))
    assert budgeted.for_call(deterministic).kernels == budgeted.kernels  # its budget kept
    refused = [
        dataclasses.replace(call((128, 128), grad=True), deterministic=True),
        dataclasses.replace(deterministic, capability=(10, 0)),
    ]
    for other in refused:
        assert fa4.supports(other).startswith("deterministic=True with gradients runs on fa4")
    reducing = FA4Backend(kernels=KernelChoice(backward=KV64_CONFIG))
    assert reducing.supports(deterministic).startswith("deterministic=True with gradients")

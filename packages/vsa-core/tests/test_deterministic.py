"""``deterministic=True`` on the public ops: how it reaches the backend choice, the refusals it
causes, the coarse attention's SDPA backend under it, and bitwise-equal reruns on the CPU.

The CPU cannot show a nondeterministic kernel (the reference's CPU path has none), so the
tests of the choice check the routing itself: a backend that refuses deterministic calls must
not run them, and one that never declared the flag must be refused. The GPU tests
(test_deterministic_gpu.py) rerun the op at a realistic size on each backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vsa_core import BlockSparseLayout, VideoTiling, block_sparse_attn, video_sparse_attn
from vsa_core.backends import (
    OVERRIDE_ENV,
    AttentionCall,
    Backend,
    backend_entries,
    explain,
    register_backend,
    select_backend,
)
from vsa_core.backends.reference import ReferenceBackend
from vsa_core.backends.registry import refusal

pytestmark = pytest.mark.usefixtures("no_backend_override")


def _call(deterministic=True, requires_grad=True, device="cpu", dtype=torch.float32, **kw):
    kw.setdefault("head_dim", 4)
    kw.setdefault("block_shape", (4, 4))
    return AttentionCall(
        torch.device(device), dtype, requires_grad=requires_grad, deterministic=deterministic, **kw
    )


class Recorder(Backend):
    """Accepts every call (and, with ``declares``, says it reads ``call.deterministic``);
    refuses deterministic calls with ``refuse_deterministic``; records its forward calls and
    runs the reference."""

    def __init__(self, name, declares=True, refuse_deterministic=False, priority=1000):
        self.name, self.priority = name, priority
        self.handles_deterministic = declares
        self.refuse_deterministic = refuse_deterministic
        self.calls = 0

    def supports(self, call):
        if call.deterministic and self.refuse_deterministic:
            return f"{self.name}: deterministic=True is not for me"
        return None

    def forward(self, q, k, v, layout, scale):
        self.calls += 1
        return ReferenceBackend().forward(q, k, v, layout, scale)


def _layout():
    mask = torch.rand(1, 2, 3, 3, generator=torch.Generator().manual_seed(0)) < 0.6
    mask[..., 0] = True
    return BlockSparseLayout.from_block_mask(mask, torch.tensor([4, 4, 3]), (4, 4))


def _qkv(seq=12, heads=2, dim=4, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq, heads, dim, generator=gen, dtype=dtype) for _ in range(3)]


# ---- the call description and the registry --------------------------------------------------
def test_call_description_carries_the_flag():
    assert _call().deterministic is True
    assert AttentionCall(torch.device("cpu"), torch.float32, 4, (4, 4), True).deterministic is False
    q, k, v = _qkv()
    assert AttentionCall.describe(q, k, v, _layout(), deterministic=True).deterministic is True
    assert _call(True) != _call(False)  # part of the cached selection's key


def test_backend_that_does_not_declare_the_flag_is_refused(fresh_registry):
    old = Recorder("old-plugin", declares=False)
    register_backend(old)
    assert refusal(old, _call(deterministic=False)) is None
    reason = refusal(old, _call())
    assert "deterministic=True" in reason and "handles_deterministic" in reason
    assert dict(explain(_call()))["old-plugin"] == reason
    assert select_backend(_call(), "auto").name != "old-plugin"
    assert select_backend(_call(deterministic=False), "auto").name == "old-plugin"
    with pytest.raises(
        ValueError, match=r"backend='old-plugin' cannot run this call: .*deterministic"
    ):
        select_backend(_call(), "old-plugin")


def test_auto_steps_over_a_backend_that_refuses_deterministic_calls(fresh_registry):
    picky = Recorder("picky", refuse_deterministic=True)
    register_backend(picky)
    assert select_backend(_call(deterministic=False), "auto") is picky
    assert select_backend(_call(), "auto").name == "reference"
    with pytest.raises(ValueError, match=r"backend='picky' cannot run this call: picky: determ"):
        select_backend(_call(), "picky")


def test_override_variable_that_cannot_be_deterministic_raises(fresh_registry, monkeypatch):
    register_backend(Recorder("picky", refuse_deterministic=True))
    monkeypatch.setenv(OVERRIDE_ENV, "picky")
    with pytest.raises(ValueError, match=r"VSA_BACKEND='picky' \(environment variable\).*determ"):
        select_backend(_call(), "auto")


def test_reference_refuses_deterministic_gradients_off_the_cpu_only():
    reference = ReferenceBackend()
    assert reference.handles_deterministic
    assert reference.supports(_call(device="cpu")) is None
    assert reference.supports(_call(device="cuda", requires_grad=False)) is None
    reason = reference.supports(_call(device="cuda"))
    assert "deterministic=True with gradients on cuda" in reason and "torch.gather" in reason
    assert reference.supports(_call(device="cuda", deterministic=False)) is None


def _loaded(name):
    entry = backend_entries().get(name)
    if entry is None or entry.backend is None:
        pytest.skip(f"backend {name!r} is not installed")
    return entry.backend


_FA4_SHAPE = {"head_dim": 128, "dtype": torch.bfloat16, "capability": (9, 0)}


def test_fa4_trains_deterministically_on_64x64_blocks_and_refuses_other_backwards():
    """fa4 on sm_90 (a description: no GPU needed): deterministic training with 64x64 blocks
    accepted (its dS-writing backward), with 128x128 blocks refused with the reason; its
    deterministic inference accepted at both."""
    fa4 = _loaded("fa4")
    small, wide = dict(_FA4_SHAPE, block_shape=(64, 64)), dict(_FA4_SHAPE, block_shape=(128, 128))
    reason = refusal(fa4, _call(device="cuda", **wide))
    if reason is not None and "deterministic" not in reason:
        pytest.skip(f"fa4 refuses this call for another reason: {reason}")
    assert reason.startswith("deterministic=True with gradients runs on fa4 for 64x64 blocks")
    assert "not associative" in reason
    assert refusal(fa4, _call(device="cuda", **small)) is None
    for shape in (small, wide):
        assert refusal(fa4, _call(device="cuda", requires_grad=False, **shape)) is None
        assert refusal(fa4, _call(device="cuda", deterministic=False, **shape)) is None


def test_auto_takes_fa4_or_triton_for_deterministic_training_on_cuda():
    """What ``auto`` picks for a Wan-like CUDA call (a description: no GPU needed): fa4 when
    nothing is asked; for deterministic training fa4 with 64x64 blocks (its dS-writing
    backward) and triton with 128x128 ones; fa4 again for deterministic inference (its forward
    is reproducible)."""
    _loaded("fa4"), _loaded("triton")
    small, wide = dict(_FA4_SHAPE, block_shape=(64, 64)), dict(_FA4_SHAPE, block_shape=(128, 128))
    plain = select_backend(_call(device="cuda", deterministic=False, **wide), "auto").name
    if plain != "fa4":
        pytest.skip(f"auto picks {plain} for this description on this machine")
    assert select_backend(_call(device="cuda", **small), "auto").name == "fa4"
    assert select_backend(_call(device="cuda", **wide), "auto").name == "triton"
    inference = _call(device="cuda", requires_grad=False, **wide)
    assert select_backend(inference, "auto").name == "fa4"


# ---- the ops ----------------------------------------------------------------------------------
def test_block_sparse_attn_routes_the_flag(fresh_registry):
    picky = Recorder("picky", refuse_deterministic=True)
    register_backend(picky)
    q, k, v = (t.requires_grad_() for t in _qkv())
    block_sparse_attn(q, k, v, _layout())
    assert picky.calls == 1
    block_sparse_attn(q, k, v, _layout(), deterministic=True)
    assert picky.calls == 1  # auto went to the reference
    with pytest.raises(ValueError, match=r"backend='picky' cannot run this call: .*deterministic"):
        block_sparse_attn(q, k, v, _layout(), backend="picky", deterministic=True)


class Twinned(Recorder):
    """Runs deterministic training on a configured instance of itself (`Backend.for_call`),
    as vsa-fa4 does with its dS-writing backward."""

    def __init__(self, name):
        super().__init__(name)
        self.twin = Recorder(name)

    def for_call(self, call):
        return self.twin if call.deterministic and call.requires_grad else self


@pytest.mark.parametrize("op", ["block_sparse_attn", "video_sparse_attn"])
def test_ops_run_the_backend_that_for_call_names(fresh_registry, op):
    """The ops run what the chosen backend's `for_call` returns for the call: its twin for
    deterministic training, itself for the rest."""
    twinned = Twinned("twinned")
    register_backend(twinned)
    tiling, q, k, v, gate = _video_inputs()

    def run(**flags):
        if op == "block_sparse_attn":
            block_sparse_attn(q, k, v, _layout_for(q), **flags)
        else:
            video_sparse_attn(q, k, v, tiling=tiling, topk=3, coarse_gate=gate, **flags)

    run()
    run(deterministic=True)
    with torch.no_grad():
        run(deterministic=True)
    assert (twinned.calls, twinned.twin.calls) == (2, 1)


def _layout_for(q):
    blocks = q.shape[1] // 64
    mask = torch.ones(1, q.shape[2], blocks, blocks, dtype=torch.bool)
    return BlockSparseLayout.from_block_mask(mask, torch.full((blocks,), 64), (64, 64))


def _video_inputs(dtype=torch.float32, gate=True):
    tiling = VideoTiling((5, 6, 7), tile_shape=(4, 4, 4))  # partial tiles on every side
    gen = torch.Generator().manual_seed(3)
    x = [torch.randn(1, tiling.seq_len, 2, 16, generator=gen, dtype=dtype) for _ in range(3)]
    q, k, v = (tiling.to_tiles(t).requires_grad_() for t in x)
    g = torch.randn(1, tiling.padded_len, 2, 16, generator=gen, dtype=dtype).requires_grad_()
    return tiling, q, k, v, (g if gate else None)


def test_video_sparse_attn_routes_the_flag(fresh_registry):
    picky = Recorder("picky", refuse_deterministic=True)
    register_backend(picky)
    tiling, q, k, v, gate = _video_inputs()
    video_sparse_attn(q, k, v, tiling=tiling, topk=3, coarse_gate=gate)
    assert picky.calls == 1
    video_sparse_attn(q, k, v, tiling=tiling, topk=3, coarse_gate=gate, deterministic=True)
    assert picky.calls == 1
    with pytest.raises(ValueError, match=r"backend='picky' cannot run this call: .*deterministic"):
        video_sparse_attn(q, k, v, tiling=tiling, topk=3, backend="picky", deterministic=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_coarse_attention_runs_on_sdpa_math_when_deterministic(monkeypatch, deterministic):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(
            (
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tiling, q, k, v, _ = _video_inputs()
    before = torch.backends.cuda.flash_sdp_enabled()
    video_sparse_attn(q, k, v, tiling=tiling, topk=3, deterministic=deterministic)
    assert len(seen) == 1
    flash, efficient, cudnn, math = seen[0]
    assert math
    assert (flash or efficient or cudnn) != deterministic  # the defaults enable them all
    assert torch.backends.cuda.flash_sdp_enabled() == before  # restored after the call


def test_unaudited_coarse_stage_is_refused(monkeypatch):
    from vsa_core import coarse

    class Plugin(coarse.TorchCoarse):
        name = "plugin-test"

    stages = {**coarse.coarse_stages(), "plugin-test": Plugin()}
    monkeypatch.setattr(coarse, "coarse_stages", lambda: stages)
    tiling, q, k, v, _ = _video_inputs()
    out = video_sparse_attn(q, k, v, tiling=tiling, topk=3, coarse_backend="plugin-test")
    assert out.shape == q.shape
    with pytest.raises(ValueError, match=r"'plugin-test'.*not known to be deterministic"):
        video_sparse_attn(
            q, k, v, tiling=tiling, topk=3, coarse_backend="plugin-test", deterministic=True
        )


@pytest.mark.parametrize("value", [1, 0, "yes", None, torch.tensor(True)])
def test_flag_must_be_a_bool(value):
    tiling, q, k, v, _ = _video_inputs()
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        video_sparse_attn(q, k, v, tiling=tiling, topk=3, deterministic=value)
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        block_sparse_attn(*_qkv(), _layout(), deterministic=value)


def _run_video(inputs, **kwargs):
    tiling, q, k, v, gate = inputs
    out = video_sparse_attn(
        q, k, v, tiling=tiling, topk=3, coarse_gate=gate, deterministic=True, **kwargs
    )
    leaves = [t for t in (q, k, v, gate) if t is not None]
    grads = torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=_gen(9)))
    return [out, *grads]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_video_sparse_attn_reruns_bitwise_equal_on_cpu(dtype, gate):
    inputs = _video_inputs(dtype, gate)
    first, second = _run_video(inputs), _run_video(inputs)
    assert len(first) == (5 if gate else 4)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_block_sparse_attn_reruns_bitwise_equal_on_cpu():
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float32))

    def run():
        out, lse = block_sparse_attn(q, k, v, _layout(), deterministic=True)
        return [out, lse, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))]

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


class _Done:
    def wait(self):
        return None


def test_sequence_parallel_op_routes_the_flag(fresh_registry, monkeypatch):
    """The Ulysses op on a pretend group of 2 (its exchanges replaced by copies: this tests
    where the flag goes, not the exchange): ``auto`` is decided with the flag, every step's op
    runs with it, and a named backend that cannot run it raises."""
    from vsa_core import distributed

    def fake_all_to_all(recv, send, group=None, async_op=False):
        recv.copy_(send)
        return _Done()

    monkeypatch.setattr(distributed, "_rank_and_world", lambda group: (0, 2))
    monkeypatch.setattr(distributed.dist, "all_to_all_single", fake_all_to_all)
    picky = Recorder("picky", refuse_deterministic=True)
    register_backend(picky)
    tiling = VideoTiling((4, 8, 8), tile_shape=(4, 4, 4))  # 4 tiles, 2 per rank
    gen = torch.Generator().manual_seed(5)
    shard = (1, tiling.padded_len // 2, 4, 16)
    q, k, v = (torch.randn(shard, generator=gen).requires_grad_() for _ in range(3))

    def run(**kwargs):
        out = distributed.sequence_parallel_video_sparse_attn(
            q, k, v, topk=2, tiling=tiling, head_chunk=1, **kwargs
        )
        return [out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))]

    run()
    assert picky.calls == 2  # one step per local head
    first = run(deterministic=True)
    assert picky.calls == 2  # auto, decided with the flag, went elsewhere
    for a, b in zip(first, run(deterministic=True), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"backend='picky' cannot run this call: .*determin"):
        run(backend="picky", deterministic=True)
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        run(deterministic="no")

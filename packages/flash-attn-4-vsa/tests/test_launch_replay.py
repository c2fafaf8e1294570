"""Replayed launches (`flash_attn_vsa.launch_replay`): a record is the first call's compiled
kernel with the caller's tensors put back in their places, and only a launch that is exactly
that call is recorded. CPU tests drive a stand-in launcher through the fork's scoped compile
cache (as upstream's ``_flash_attn_fwd`` calls it); the GPU test replays the real kernels."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import sm90_cases as cases
import torch
from torch.utils._python_dispatch import _disable_current_modes

from flash_attn_vsa import (
    build_scope,
    bwd_sm90,
    fwd_sm90,
    launch_replay,
    mask_sm90,
    upstream_version,
)
from flash_attn_vsa.sm90_blocks import ScopedCompileCache


class Aux(NamedTuple):
    tensors: list
    scalars: tuple | None = None


def kernel(q, k, out, lse, scale, nothing, lists, aux, scratch=None):
    """A stand-in compiled kernel: device work the dispatcher does not see (as a CuTe call)."""
    assert nothing is None
    with _disable_current_modes():
        extra = 0.0 if scratch is None else scratch.sum()
        out.copy_(q * scale + k + lists[0].sum() + aux.tensors[0].sum() + extra)
        lse.copy_(out.float().sum(-1).transpose(1, 2))


def preprocess(scratch, q):
    """A second stand-in kernel (a pre-processing pass into a buffer the launcher made)."""
    with _disable_current_modes():
        scratch.copy_(q.float().abs().amax())


class Launcher:
    """Upstream's launcher as the fork sees it: it assembles arguments (views of the caller's
    tensors among them) and calls compiled kernels from compile caches. ``scratch``: it makes a
    buffer (``torch.full``), has a pre-processing kernel from ``pre_cache`` fill it, and the
    main kernel reads it."""

    def __init__(self, scratch=False, pre_cache=None, host_read=False, pointer=False):
        self.cache = ScopedCompileCache({"key": kernel}, lambda: None)
        self.pre_cache = pre_cache or ScopedCompileCache({"pre": preprocess}, lambda: None)
        self.calls = 0
        self.scratch, self.host_read, self.pointer = scratch, host_read, pointer

    def __call__(self, q, k, out, lse, lists, valid):
        self.calls += 1
        buffer = None
        if self.scratch:
            buffer = torch.full((3,), 2.0)
            self.pre_cache["pre"](buffer, q.detach())
        if self.host_read:
            int(lists.max())  # a launch that depends on the data
        lists_arg = (lists, lists.detach())
        if self.pointer:  # a launcher that hands the kernel an address, not the tensor
            lists_arg = (lists, lists.data_ptr())
        # the output detached, as upstream's launchers pass it: the kernel writes the view
        self.cache["key"](q, k.detach(), out.detach(), lse, 0.5, None, lists_arg, Aux([valid]),
                          scratch=buffer)  # fmt: skip
        return out, lse


def tensors(seed=0, seq=8):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, seq, 2, 4, generator=gen) for _ in "qk")
    out, lse = torch.empty_like(q), torch.empty(1, 2, seq)
    lists = torch.randint(0, 5, (1, 2, 3), generator=gen)
    valid = torch.randint(0, 5, (4,), generator=gen)
    return q, k, out, lse, lists, valid


def run(replay, launcher, ts, key="call"):
    q, k, out, lse, lists, valid = ts
    return replay.run(key, ts, lambda: launcher(q, k, out, lse, lists, valid))


def expected(ts, scratch=False):
    q, k, out, lse, lists, valid = (t.clone() for t in ts)
    buffer = None
    if scratch:
        buffer = torch.full((3,), 2.0)
        preprocess(buffer, q)
    kernel(q, k, out, lse, 0.5, None, (lists,), Aux([valid]), scratch=buffer)
    return out, lse


def check(got, ts, scratch=False):
    want = expected(ts, scratch)
    assert got[0] is ts[2] and got[1] is ts[3]  # the caller's outputs, written
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def replay_cpu(**kwargs):
    return launch_replay.LaunchReplay(devices=("cpu",), **kwargs)


def test_the_second_call_records_and_later_ones_replay_on_their_own_tensors():
    replay, launcher = replay_cpu(), Launcher()
    for seed in range(4):
        ts = tensors(seed)
        check(run(replay, launcher, ts), ts)
    assert launcher.calls == 2  # the first call (it may compile) and the recorded one
    record = replay.recorded("call", tensors(0))
    assert record.kernels == 1 and record.operations == ["aten.detach.default"] * 3


def test_buffers_and_kernels_the_launcher_adds_are_replayed_in_order():
    """A launch that makes a buffer, fills it with a pre-processing kernel and hands it to the
    main kernel replays all three steps on each call."""
    replay, launcher = replay_cpu(), Launcher(scratch=True)
    for seed in range(4):
        ts = tensors(seed)
        check(run(replay, launcher, ts), ts, scratch=True)
    assert launcher.calls == 2
    record = replay.recorded("call", tensors(0))
    assert record.kernels == 2 and "aten.full.default" in record.operations


@pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")
def test_a_kernel_from_any_upstream_compile_cache_is_recorded(monkeypatch):
    """The pre-processing kernel comes from another of upstream's launchers' caches: watched,
    it is a step of the program (unwatched, the replay would skip it and read a stale buffer)."""
    import flash_attn.cute.interface as interface

    def launcher_with_preprocess():
        pass

    launcher_with_preprocess.compile_cache = {"pre": preprocess}
    monkeypatch.setattr(interface, "_a_preprocessing_launcher", launcher_with_preprocess,
                        raising=False)  # fmt: skip
    launch_replay._watch_upstream_caches.__wrapped__()
    watched = interface._a_preprocessing_launcher.compile_cache
    replay, launcher = replay_cpu(), Launcher(scratch=True, pre_cache=watched)
    for seed in range(4):
        ts = tensors(seed)
        check(run(replay, launcher, ts), ts, scratch=True)
    assert replay.recorded("call", tensors(0)).kernels == 2


def test_a_launch_the_host_reads_data_for_always_runs_upstream():
    replay, launcher = replay_cpu(), Launcher(host_read=True)
    for seed in range(5):
        ts = tensors(seed)
        check(run(replay, launcher, ts), ts)
    assert launcher.calls == 5
    assert replay.recorded("call", tensors(0)) is False


def test_a_launch_passing_a_caller_address_as_a_number_always_runs_upstream():
    replay, launcher = replay_cpu(), Launcher(pointer=True)
    for seed in range(4):
        ts = tensors(seed)
        check(run(replay, launcher, ts), ts)
    assert launcher.calls == 4 and replay.recorded("call", tensors(0)) is False


def test_a_misaligned_tensor_is_another_description():
    """Same shapes, a q 4 bytes off the alignment of the recorded call's: not its record."""
    replay, launcher = replay_cpu(), Launcher()
    for seed in range(3):
        run(replay, launcher, tensors(seed))
    q, k, out, lse, lists, valid = tensors(3)
    shifted = torch.empty(q.numel() + 1)[1:].view_as(q).copy_(q)
    ts = (shifted, k, out, lse, lists, valid)
    assert replay.recorded("call", ts) is None
    check(run(replay, launcher, ts), ts)
    assert launcher.calls == 3


def test_a_new_description_records_again():
    replay, launcher = replay_cpu(), Launcher()
    for seed in range(3):
        run(replay, launcher, tensors(seed))
    for seed in range(3):
        ts = tensors(seed, seq=16)
        check(run(replay, launcher, ts), ts)
    run(replay, launcher, tensors(3), key="another scale")
    assert launcher.calls == 5


def test_coinciding_caller_tensors_replay_only_calls_where_they_coincide_alike():
    """The KV64 backward passes one tensor as both the full and the partial lists: such a call
    is recorded and replays on later calls whose tensors coincide the same way; a call whose
    tensors do not coincide is another description (its own first call, its own record)."""

    def aliased(seed):  # k is q
        q, _, out, lse, lists, valid = tensors(seed)
        return (q, q, out, lse, lists, valid)

    replay, launcher = replay_cpu(), Launcher()
    for seed in range(4):
        ts = aliased(seed)
        check(run(replay, launcher, ts), ts)
    assert launcher.calls == 2 and isinstance(
        replay.recorded("call", aliased(0)), launch_replay.RecordedLaunch
    )
    assert replay.recorded("call", tensors(0)) is None, "k is not q here: another description"
    ts = tensors(4)
    check(run(replay, launcher, ts), ts)
    assert launcher.calls == 3


def test_tensors_at_one_address_in_two_descriptions_are_a_description_of_their_own():
    """A call whose tensors share an address in different shapes (a view) is described
    apart from one with the same shapes at different addresses, and from one whose tensors
    share an address and a shape: the key tells which coincide in address and description."""
    buffer = torch.arange(8.0)
    apart = (torch.arange(8.0), torch.arange(8.0).view(2, 4))
    as_view = (buffer, buffer.view(2, 4))
    same = (buffer, buffer)
    keys = [launch_replay._full_key("call", ts) for ts in (apart, as_view, same)]
    assert len(set(keys)) == 3
    again = torch.arange(8.0)
    assert launch_replay._full_key("call", (again, again.view(2, 4))) == keys[1]


def test_no_replay_off_its_devices():
    replay, launcher = launch_replay.LaunchReplay(), Launcher()  # CUDA only
    for seed in range(3):
        run(replay, launcher, tensors(seed))
    assert launcher.calls == 3 and replay.recorded("call", tensors(0)) is None


def test_capacity_drops_the_oldest_record():
    replay, launcher = replay_cpu(capacity=2), Launcher()
    for key in ("a", "b", "c"):
        for _ in range(2):
            run(replay, launcher, tensors(0), key=key)
    assert [bool(replay.recorded(key, tensors(0))) for key in "abc"] == [False, True, True]
    assert replay.recorded("a", tensors(0)) is None


def test_outside_a_recording_the_caches_hand_out_the_kernel_itself():
    cache = ScopedCompileCache({"key": kernel}, lambda: None)
    assert cache["key"] is kernel
    assert build_scope.trace_stack(launch_replay.RECORDER) == ()


@pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")
def test_the_entry_point_runs_upstream_every_call_with_replay_false(monkeypatch):
    import flash_attn.cute.interface as interface

    fwd_sm90._install()  # wrap upstream's real cache first (once per process)
    calls = []

    def fake_fwd(q, k, v, out=None, lse=None, **kwargs):
        calls.append(kwargs["softmax_scale"])
        return out, lse

    monkeypatch.setattr(interface, "_flash_attn_fwd", fake_fwd)
    q = torch.empty(1, 128, 2, 128)
    bst = type("Tensors", (), {"block_size": (64, 64), "mask_block_cnt": None,
                               "mask_block_idx": None, "full_block_cnt": None,
                               "full_block_idx": None})()  # fmt: skip
    out, lse = torch.empty_like(q), torch.empty(1, 2, 128)
    for replay in (False, False, True, True):  # CPU tensors: never replayed
        got = fwd_sm90.block_sparse_forward_q64(
            q, q, q, bst, softmax_scale=0.5, out=out, lse=lse, replay=replay
        )
        assert got[0] is out
    assert calls == [0.5] * 4


@pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")
@pytest.mark.parametrize(
    "shape,declared",
    [((1, 1, 1), 2), ((1, 1, 1, 1), 3), ((1, 1, 5), None), ((2, 1, 1), None), ((4,), None)],
    ids=str,
)
def test_aux_tensors_upstream_cannot_read_get_a_declared_leading_dim(shape, declared):
    """The dS path's slot starts [B, H, NKV] of a one-key-block, one-head call are (1, 1, 1)
    with strides (1, 1, 1): upstream's launchers refuse such an aux tensor (no unique stride-1
    dimension) unless it declares one; tensors upstream reads as they are stay undeclared."""
    from flash_attn.cute.cute_dsl_utils import get_aux_tensor_metadata

    t = torch.zeros(shape, dtype=torch.int32)
    if declared is not None:
        with pytest.raises(ValueError, match="leading dimension"):
            get_aux_tensor_metadata([t])
    launch_replay.declare_leading_dims([t])
    assert getattr(t, "__leading_dim__", None) == declared
    ((_, _, strides),) = get_aux_tensor_metadata([t])
    assert strides.count(1) == 1  # one static stride-1 dimension, as for any larger call
    if declared is not None:
        assert strides[declared] == 1


# ---- GPU ----------------------------------------------------------------------------------------
needs_sm90 = [
    pytest.mark.gpu,
    pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4"),
    pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU"),
]


def needs_sm90_marks(test):
    for mark in reversed(needs_sm90):
        test = mark(test)
    return test


@pytest.mark.parametrize("masked", [True, False], ids=["partial-blocks", "full-blocks"])
@needs_sm90_marks
def test_replayed_forward_is_bitwise_the_launchers(masked):
    """From the third call of a description on, the forward replays the recorded launch on new
    tensors (inputs, lists, outputs): bitwise what upstream's launcher gives for them."""
    head_dim, dtype, scale = 128, cases.BF16, 128**-0.5
    masking = {"mask_mod": mask_sm90.valid_size_mask_mod(cases.BLOCK)} if masked else {}
    launch_replay.FORWARDS.clear()
    alive = []  # every call's tensors stay allocated: a replay sees new addresses
    for seed in (3, 4, 5):
        valid, selected = cases.case(seed=seed)
        q, k, v, _ = cases.inputs(head_dim, dtype, valid)
        q = q * (seed / 3)  # other inputs than the recorded call's
        aux = {"aux_tensors": [valid.cuda()]} if masked else {}
        got = []
        for replay in (True, False):
            tensors = cases.sparse_tensors(valid, selected, backward=False)
            out, lse = cases.nan_outputs(q)
            alive.append((q, k, v, tensors, out, lse))
            got.append(fwd_sm90.block_sparse_forward_q64(
                q, k, v, tensors, softmax_scale=scale, out=out, lse=lse, replay=replay,
                q_in_registers=True, **masking, **aux,
            ))  # fmt: skip
    torch.cuda.synchronize()
    (replayed, launched), recorded = got, launch_replay.FORWARDS.records()
    assert torch.equal(replayed[0], launched[0]) and torch.equal(replayed[1], launched[1])
    assert torch.isfinite(replayed[0]).all()
    assert len(recorded) == 1 and recorded[0].kernels == 1, recorded


@pytest.mark.parametrize("q_block", [64, 128])
@needs_sm90_marks
def test_replayed_backward_is_bitwise_the_launchers(q_block):
    """The backward's recorded launch (upstream's buffers, pre-processing, the KV64 kernel,
    post-processing) replayed on new tensors: what upstream's launcher gives, bitwise for dK
    and dV (dQ's reduce-adds are unordered, so to rounding)."""
    head_dim, dtype, scale = 128, cases.BF16, 128**-0.5
    mask_mod = mask_sm90.valid_size_mask_mod(cases.BLOCK)
    launch_replay.BACKWARDS.clear()
    alive = []  # every call's tensors stay allocated: a replay sees new addresses
    for seed in (3, 4, 5):
        valid, selected = cases.case(seed=seed, q_block=q_block)
        q, k, v, dout = cases.inputs(head_dim, dtype, valid)
        q, dout = q * (seed / 3), dout * (seed / 4)
        ref_out, ref_lse, _ = cases.reference(q, k, v, dout, valid, selected, scale)
        out, lse = ref_out.to(dtype).contiguous(), ref_lse.float().contiguous()
        got = []
        for replay in (True, False):
            tensors = cases.sparse_tensors(valid, selected, backward=True)
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            alive.append((q, k, v, dout, out, lse, tensors, grads))
            got.append(bwd_sm90.block_sparse_backward_kv64(
                q, k, v, out, dout, lse, tensors, softmax_scale=scale, mask_mod=mask_mod,
                aux_tensors=[valid.cuda()], dq=grads[0], dk=grads[1], dv=grads[2],
                replay=replay,
            ))  # fmt: skip
    torch.cuda.synchronize()
    (replayed, launched), recorded = got, launch_replay.BACKWARDS.records()
    # dK and dV are key-block owned (one CTA, its list in order): bitwise. dQ is reduce-added
    # across key blocks in whatever order the CTAs finish (not reproducible run to run, replay
    # or not: the H200 showed a 128x64 case differ once, session 18), so within rounding.
    (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = replayed, launched
    for a, b in ((dk_a, dk_b), (dv_a, dv_b)):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    assert torch.isfinite(dq_a).all()
    torch.testing.assert_close(dq_a.float(), dq_b.float(), rtol=2e-2, atol=2e-3)
    assert len(recorded) == 1 and recorded[0].kernels >= 1, recorded
    print("backward replay:", recorded[0].kernels, "kernels,", recorded[0].operations)

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

from flash_attn_vsa import build_scope, fwd_sm90, launch_replay, mask_sm90, upstream_version
from flash_attn_vsa.sm90_blocks import ScopedCompileCache


class Aux(NamedTuple):
    tensors: list
    scalars: tuple | None = None


def kernel(q, k, out, lse, scale, nothing, lists, aux):
    """A stand-in compiled kernel: device work the dispatcher does not see (as a CuTe call)."""
    assert nothing is None
    with _disable_current_modes():
        out.copy_(q * scale + k + lists[0].sum() + aux.tensors[0].sum())
        lse.copy_(out.float().sum(-1).transpose(1, 2))


class Launcher:
    """Upstream's launcher as the fork sees it: it assembles arguments (views of the caller's
    tensors among them) and calls a compiled kernel from the scoped compile cache."""

    def __init__(self, before=None, scratch=False, kernels=1):
        self.cache = ScopedCompileCache({"key": kernel}, lambda: None)
        self.calls = 0
        self.before, self.scratch, self.kernels = before, scratch, kernels

    def __call__(self, q, k, out, lse, lists, valid):
        self.calls += 1
        if self.before is not None:
            self.before(out)
        lists_arg = (lists, lists.detach()) if not self.scratch else (torch.zeros(2), lists)
        for _ in range(self.kernels):
            self.cache["key"](q, k.detach(), out, lse, 0.5, None, lists_arg, Aux([valid]))
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
    return replay.run(key, ts, lambda: launcher(q, k, out, lse, lists, valid), out, lse)


def expected(ts):
    q, k, out, lse, lists, valid = (t.clone() for t in ts)
    kernel(q, k, out, lse, 0.5, None, (lists,), Aux([valid]))
    return out, lse


def test_later_calls_run_the_recorded_kernel_on_their_own_tensors():
    replay, launcher = launch_replay.LaunchReplay(devices=("cpu",)), Launcher()
    first = tensors(0)
    assert run(replay, launcher, first)[0] is first[2]
    assert replay.recorded("call", first) is True
    for seed in (1, 2):
        ts = tensors(seed)
        got = run(replay, launcher, ts)
        assert got[0] is ts[2] and got[1] is ts[3]
        want = expected(ts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert launcher.calls == 1  # upstream's launcher ran for the first call only


def test_a_new_description_records_again():
    replay, launcher = launch_replay.LaunchReplay(devices=("cpu",)), Launcher()
    run(replay, launcher, tensors(0))
    other = tensors(1, seq=16)
    assert replay.recorded("call", other) is None
    got = run(replay, launcher, other)
    assert torch.equal(got[0], expected(other)[0])
    run(replay, launcher, tensors(2, seq=16))
    run(replay, launcher, tensors(3), key="another scale")
    assert launcher.calls == 3


@pytest.mark.parametrize(
    "launcher",
    [
        Launcher(before=lambda out: out.zero_()),  # device work besides the kernel
        Launcher(scratch=True),  # a tensor the launcher made (and filled)
        Launcher(kernels=2),  # two compiled calls
    ],
    ids=["device-work", "scratch-tensor", "two-kernels"],
)
def test_launches_that_are_not_one_plain_kernel_call_always_run_upstream(launcher):
    replay = launch_replay.LaunchReplay(devices=("cpu",))
    for seed in range(3):
        run(replay, launcher, tensors(seed))
    assert launcher.calls == 3
    assert replay.recorded("call", tensors(0)) is False


@pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")
def test_a_kernel_from_any_upstream_compile_cache_counts(monkeypatch):
    """A launch that also runs a kernel from another of upstream's caches (a pre-processing
    pass, say) is two compiled calls: never recorded."""
    import flash_attn.cute.interface as interface

    def preprocess(out):
        with _disable_current_modes():
            out.fill_(7.0)

    def launcher_with_preprocess():
        pass

    launcher_with_preprocess.compile_cache = {"pre": preprocess}
    monkeypatch.setattr(interface, "_a_preprocessing_launcher", launcher_with_preprocess,
                        raising=False)  # fmt: skip
    launch_replay._watch_upstream_caches.__wrapped__()
    watched = interface._a_preprocessing_launcher.compile_cache
    launcher = Launcher(before=lambda out: watched["pre"](out))
    replay = launch_replay.LaunchReplay(devices=("cpu",))
    for seed in range(2):
        run(replay, launcher, tensors(seed))
    assert launcher.calls == 2 and replay.recorded("call", tensors(0)) is False


def test_coinciding_caller_tensors_are_not_recorded_until_they_differ():
    replay, launcher = launch_replay.LaunchReplay(devices=("cpu",)), Launcher()
    q, _, out, lse, lists, valid = tensors(0)
    aliased = (q, q, out, lse, lists, valid)  # k is q: the record could not tell them apart
    run(replay, launcher, aliased)
    assert replay.recorded("call", aliased) is None
    run(replay, launcher, tensors(1))
    ts = tensors(2)
    assert torch.equal(run(replay, launcher, ts)[0], expected(ts)[0])
    assert launcher.calls == 2


def test_no_replay_off_its_devices_or_without_caller_outputs():
    replay, launcher = launch_replay.LaunchReplay(), Launcher()  # CUDA only
    for seed in range(2):
        run(replay, launcher, tensors(seed))
    q, k, out, lse, lists, valid = tensors(0)
    cpu = launch_replay.LaunchReplay(devices=("cpu",))
    for _ in range(2):
        cpu.run("call", (q, k, None, lse, lists, valid),
                lambda: launcher(q, k, out, lse, lists, valid), None, lse)  # fmt: skip
    assert launcher.calls == 4


def test_capacity_drops_the_oldest_record():
    replay, launcher = launch_replay.LaunchReplay(capacity=2, devices=("cpu",)), Launcher()
    for key in ("a", "b", "c"):
        run(replay, launcher, tensors(0), key=key)
    assert [replay.recorded(key, tensors(0)) for key in "abc"] == [None, True, True]


def test_the_recorder_sees_only_its_own_thread_and_scope():
    """Outside a recording the scoped cache hands out the kernel itself."""
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


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("masked", [True, False], ids=["partial-blocks", "full-blocks"])
def test_replayed_forward_is_bitwise_the_launchers(masked):
    """The second call of a description replays the recorded kernel on new tensors (new
    inputs, lists, outputs): bitwise what upstream's launcher gives for them."""
    head_dim, dtype, scale = 128, cases.BF16, 128**-0.5
    masking = {}
    if masked:
        masking = {"mask_mod": mask_sm90.valid_size_mask_mod(cases.BLOCK)}
    results = []
    for seed in (3, 4):
        valid, selected = cases.case(seed=seed)
        q, k, v, _ = cases.inputs(head_dim, dtype, valid)
        q = q * (seed / 3)  # other inputs than the recorded call's
        aux = {"aux_tensors": [valid.cuda()]} if masked else {}
        got = []
        for replay in (True, False):
            tensors = cases.sparse_tensors(valid, selected, backward=False)
            out, lse = cases.nan_outputs(q)
            got.append(fwd_sm90.block_sparse_forward_q64(
                q, k, v, tensors, softmax_scale=scale, out=out, lse=lse, replay=replay,
                q_in_registers=True, **masking, **aux,
            ))  # fmt: skip
        results.append(got)
    torch.cuda.synchronize()
    replayed, launched = results[1]
    assert torch.equal(replayed[0], launched[0]) and torch.equal(replayed[1], launched[1])
    assert torch.isfinite(replayed[0]).all()
    assert len(launch_replay.FORWARDS._records) > 0
    recorded = [r for r in launch_replay.FORWARDS._records.values() if r is not None]
    assert any(isinstance(r, launch_replay.RecordedLaunch) for r in recorded), (
        "no forward description was recorded: upstream's launch did more than one kernel call"
    )

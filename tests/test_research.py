"""CPU tests of ``research/``: every script imports as a module of the ``research`` package run
from the repository root (the documented way, ``python3 -m research...``), none edits
``sys.path`` but ``research.harness``, and the adapter-overhead diagnostic runs the adapter's
physical blocks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESEARCH = ROOT / "research"
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in RESEARCH.rglob("*.py")
    if p.name != "__init__.py"
)


def _root_on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def test_research_holds_the_moved_scripts():
    assert "research.harness" in MODULES
    assert "research.fa4_fork.experiments.kv64_bwd_configs" in MODULES
    assert "research.fa4_adapter.bench_fa4_overhead" in MODULES
    assert (RESEARCH / "fa4_fork" / "NOTES.md").is_file()
    assert (RESEARCH / "README.md").is_file()


def test_only_the_harness_edits_sys_path():
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted(RESEARCH.rglob("*.py"))
        if p.name != "harness.py" and re.search(r"sys\.path\.(insert|append)", p.read_text())
    ]
    assert offenders == []


def test_every_script_imports_as_a_module_from_the_repository_root():
    """The way the scripts run: ``python3 -m research.X`` with the repository root as the
    working directory (no PYTHONPATH); their GPU-only imports stay inside functions."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *MODULES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_an_experiment_runs_with_python_dash_m():
    proc = subprocess.run(
        [sys.executable, "-m", "research.fa4_fork.experiments.bwd_list_rotation", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--seqs" in proc.stdout


def test_harness_reaches_benchmarks_and_the_fork_tests():
    _root_on_path()
    from research import harness

    assert hasattr(harness.bench_common(), "time_interleaved")
    assert hasattr(harness.fork_test_module("sm90_cases"), "__file__")


def test_fa4_overhead_raw_tensors_follow_the_adapters_physical_plan():
    """The overhead diagnostic's raw arm must run the same physical blocks as the adapter:
    paired 64x64 layouts as 128x64 forward tiles, and 64x64 blocks for the fork's backward."""
    pytest.importorskip("flash_attn.cute.block_sparsity")
    _root_on_path()
    from research.fa4_adapter import bench_fa4_overhead
    from vsa_fa4.backend import FA4Backend

    base = bench_fa4_overhead.exact256_layout(2048, 2, 0.5, seed=0)
    layout = base.refine((64, 64))
    plan = FA4Backend().plan(layout)
    assert plan.block_size == (128, 64)
    fwd = bench_fa4_overhead.raw_tensors(layout, plan, backward=False)
    bwd = bench_fa4_overhead.raw_tensors(layout, plan, backward=True)
    assert tuple(fwd.block_size) == (128, 64) and tuple(bwd.block_size) == (64, 64)
    assert fwd.full_block_cnt.shape == (1, 2, 2048 // 128)
    assert bwd.full_block_cnt.shape == (1, 2, 2048 // 64)
    # every selected (64-row query block, 64-token key block) pair once, in both directions
    pairs = int(layout.kv_counts.sum())
    assert int(bwd.full_block_cnt.sum()) == pairs == 2 * int(fwd.full_block_cnt.sum())


def test_dit_ideal_bound_replaces_the_ops_time_by_the_ideal():
    _root_on_path()
    from research.dit_ideal_bound import bound

    step = {"dense_fa4_b2b_ms": 100.0, "vsa_b2b_ms": 60.0}
    # 10 layers: the op 2 ms a layer (rest of the step 40 ms), dense 8 ms at an ideal of 4x
    op = {"auto": {"b2b": 2.0}, "dense": {"b2b": 8.0, "ideal": 4.0}}
    row = bound(step, op, layers=10, view="b2b")
    assert row["rest_ms"] == 40.0
    assert row["ideal_step_ms"] == 60.0  # 40 + 10 x 8 / 4: the op already at its ideal here
    assert row["speedup"] == row["speedup_at_ideal"] == 100.0 / 60.0
    op["auto"]["b2b"] = 3.0  # a slower op: the same step leaves less for the rest
    assert bound(step, op, layers=10, view="b2b")["speedup_at_ideal"] == 100.0 / 50.0


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_break_backends_makes_a_backend_wrong(mode):
    """The break plugin's copies are wrong in the way they say (on the reference backend, CPU)."""
    _root_on_path()
    import torch

    from research.break_backends import broken_copy
    from vsa_core.backends.registry import get_backend
    from vsa_core.layout import BlockSparseLayout

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    lists = torch.tensor([[[0, 1], [1, 0]]] * 2).unsqueeze(0)  # [1, 2 heads, 2 blocks, 2]
    layout = BlockSparseLayout.from_indices(
        lists, kv_valid_sizes=torch.full((2,), 64), block_shape=(64, 64)
    )
    real = get_backend("reference")
    broken = broken_copy(real, mode)
    want, _ = real.forward(q, k, v, layout, 0.25)
    got, _ = broken.forward(q, k, v, layout, 0.25)
    (dv_want,) = torch.autograd.grad(want.sum(), v)
    (dv_got,) = torch.autograd.grad(got.sum(), v)
    if mode == "fwd":
        torch.testing.assert_close(got, want * 1.05)
        torch.testing.assert_close(dv_got, dv_want * 1.05)
    else:
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(dv_got, dv_want * 1.3)


def test_union_walk_model_counts_bytes_and_ring_stalls_by_hand():
    """Experiment 15's model on lists small enough to count by hand."""
    _root_on_path()
    import torch

    from research.fa4_fork.experiments import union_lists_forward as ul

    # disjoint interleaved lists: the union is both lists, walked without stalls by a deep ring
    assert ul.ring_time([[0, 2], [1, 3]], stages=8) == (2, 0)
    # one stage: a warpgroup cannot start past the other's pending block -> lockstep
    assert ul.ring_time([[0, 1], [2, 3]], stages=1) == (0, 4)
    # identical lists: both use every stage together, even with one stage
    assert ul.ring_time([[4, 7], [4, 7]], stages=1) == (2, 0)
    selects = torch.zeros(1, 2, 4, dtype=torch.bool)
    selects[0, 0, [0, 1]] = True
    selects[0, 1, [1, 2]] = True  # one shared block of two: |U| = 3 of 4 fetches
    ratios = ul.union_ratios(selects, torch.tensor([[0, 1]]))
    assert ratios == {"bytes_ratio": 0.75, "lockstep_steps": 1.5}
    # a slot past the count (index 0 here) must not unset the selected tile 0
    selected = ul.selection_matrix(torch.tensor([[[0, 0]]]), torch.tensor([[1]]), tiles=2)
    assert selected.tolist() == [[[True, False]]]
    members = ul.group_members((1, 2, 4), "hw4")
    assert members.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_triton_compile_probe_names_only_the_kernels_own_constexprs():
    """Every variant `compile_sm90` would compile is built from the shipped configs and sets
    only arguments its kernel has (a removed knob left behind fails here, without compiling)."""
    _root_on_path()
    from research.triton_kernels import compile_sm90

    variants = compile_sm90.variants()
    names = {name for name, *_ in variants}
    assert {"fwd-64x64", "fwd-64x64-raster-combine-has_gate", "dq-64x64-raster"} <= names
    for name, kernel, constexprs, _warps, _stages in variants:
        assert set(constexprs) <= set(kernel.arg_names), name


def _x(name, cat, ts, dur, correlation=None, tid=1):
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_latency_gaps_put_each_idle_stretch_on_the_launch_that_ended_it():
    _root_on_path()
    from research.op_latency_gaps import idle_gaps

    events = [
        _x("vsa_call", "user_annotation", 0, 50),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 5, 1),
        _x("pool", "kernel", 20, 100, 1),
        _x("cudaLaunchKernel", "cuda_runtime", 30, 5, 2),  # queued long before pool ends
        _x("select", "kernel", 125, 50, 2),
        _x("cuLaunchKernelEx", "cuda_driver", 200, 10, 3),  # after select ended: host-bound
        _x("fine", "kernel", 215, 20, 3),
        _x("cudaDeviceSynchronize", "cuda_runtime", 220, 20),
        _x("vsa_fa4/ops.py(1): backward_impl", "python_function", 190, 30),
        _x("torch/x.py(1): f", "python_function", 195, 20),
    ]
    summary = idle_gaps(events)
    assert summary["first_kernel_us"] == 20 and summary["device_busy_us"] == 170
    assert summary["idle_device_us"] == 5 and summary["idle_host_us"] == 40
    assert summary["tail_us"] == 5 and summary["wall_us"] == 240
    parts = ("first_kernel_us", "device_busy_us", "idle_host_us", "idle_device_us", "tail_us")
    assert sum(summary[p] for p in parts) == summary["wall_us"]
    select, fine = summary["gaps"]
    assert (select["before"], select["kind"], select["idle_us"]) == ("select", "device", 5)
    assert (fine["before"], fine["kind"], fine["idle_us"]) == ("fine", "host", 40)
    assert fine["issued_by"] == "vsa_fa4/ops.py(1): backward_impl"


def test_op_memory_model_counts_storages_until_freed_rounded_like_cuda():
    _root_on_path()
    import torch

    from research.op_memory_cpu import LiveStorage

    known = torch.zeros(1000)
    with LiveStorage([known]) as mode:
        view = known[:10] * 1  # a new storage: 40 bytes, counted as one 512-byte block
        known.add_(1)  # in place on a known storage: nothing new
        big = torch.empty(3000, dtype=torch.float32)  # 12,000 bytes -> 12,288
        alias = big.view(30, 100)  # the same storage: counted once
        assert mode.now == 512 + 12288 and mode.peak == mode.now
        del big, alias
        assert mode.now == 512
        small = torch.ones(1, dtype=torch.int8)
        assert mode.now == 1024 and mode.peak == 512 + 12288
    sizes = sorted(size for size, _ in mode.at_peak.values())
    assert sizes == [512, 12288]
    del view, small


def test_property_failure_search_takes_a_crash_for_a_failure():
    """Session 33's failing case raised inside the op: the search reports it as the failing
    case (its variants then run) instead of dying with the traceback."""
    _root_on_path()
    from hypothesis import strategies as st

    from research.fa4_adapter.property_failure import first_failure

    class Props:
        @staticmethod
        def draw_video_case(target, data):
            return {"n": data.draw(st.integers(0, 9), "n")}

        @staticmethod
        def check_video_case(target, case, record, backend):
            if case["n"] >= 5:
                raise ValueError("Aux tensor layout has no unique stride-1 leading dimension")
            record(1.0, 1.0, 0.0, "out")
            return True

        @staticmethod
        def _close(got, want, tol, what, terms=1):
            assert abs(got - want) <= tol, what

    case, ran = first_failure(Props, object(), cases=200, seed=0)
    assert case is not None and case["n"] >= 5
    assert ran >= 1

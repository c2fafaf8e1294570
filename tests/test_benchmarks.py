"""CPU tests of the benchmark harness: benchmarks/bench_vsa.py, bench_video.py, bench_common.py.

Tiny grids, reference arm only (every CUDA arm is skipped with a reason on a CPU): the JSON
structure, the correctness gate (a wrong arm is reported failing and is not timed), exact256
masks, the TFLOP/s formula, the markdown table, plots, torchrun replica files, bench_video's
arms and its two timing views (alternated turns, back to back and once), its FastVideo arms
(not installed; a stand-in package with FastVideo's call, gated on its own selection), its
sequence-parallel mode on two gloo processes, and the Python paths of the FlexAttention / SDPA /
FA4 arms that can run (or be checked) without a GPU.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_common as bc  # noqa: E402
import bench_video  # noqa: E402
import bench_vsa  # noqa: E402

from vsa_core.backends import AttentionCall, get_backend  # noqa: E402

CPU = torch.device("cpu")
TINY = ["--device", "cpu", "--seq-lens", "512", "--heads", "2", "--head-dim", "32"]
FAST = ["--warmup", "0", "--reps", "2", "--budget-s", "0.2"]
STATUSES = {"ok", "failed", "skipped", "error", "not_run"}


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def vsa_run(tmp_path_factory):
    """One tiny default-arm run on the CPU, shared by the structure tests."""
    out = tmp_path_factory.mktemp("bench_vsa") / "bench_vsa.json"
    argv = [
        *TINY,
        *FAST,
        "--sparsities",
        "dense",
        "0.5",
        "--block-shapes",
        "256x256",
        "64x64",
        "--modes",
        "fwd",
        "fwd+bwd",
        "--out",
        str(out),
    ]
    assert bench_vsa.main(argv) == 0
    return out, json.loads(out.read_text())


# ---- bench_vsa: output structure ------------------------------------------------------------
def test_json_has_metadata_config_and_one_result_per_cell(vsa_run):
    _, doc = vsa_run
    assert doc["benchmark"] == "bench_vsa" and doc["complete"] is True
    meta = doc["metadata"]
    for key in ("date_utc", "command", "device", "driver", "versions", "seed", "env"):
        assert key in meta, key
    assert meta["device"]["type"] == "cpu"
    assert "bench_vsa.py" in meta["command"] and "--seq-lens" in meta["command"]
    for dist in (
        "torch",
        "triton",
        "flash-attn-4",
        "nvidia-cutlass-dsl",
        "vsa-core",
        "vsa-triton",
        "vsa-fa4",
        "flash-attn-4-vsa",
    ):
        assert dist in meta["versions"], dist
    assert meta["versions"]["torch"] == torch.__version__.split("+")[0]
    cfg = doc["config"]
    assert cfg["seq_lens"] == [512] and cfg["masks"] == "exact256"
    arms = cfg["arms"]
    assert set(bench_vsa.KNOWN_ARMS) <= set(arms)
    sparse = [a for a in arms if a not in bench_vsa.DENSE_ARMS]
    expected = 2 * (len(bench_vsa.DENSE_ARMS) + len(sparse) * 2 * 2)
    assert len(doc["results"]) == expected
    keys = {tuple(r[f] for f in bench_vsa.KEY_FIELDS) for r in doc["results"]}
    assert len(keys) == expected, "each (S, mode, sparsity, block, arm) appears once"
    for r in doc["results"]:
        assert r["status"] in STATUSES
        if r["status"] != "ok":
            assert r["reason"], r


def test_reference_arm_is_gated_and_timed(vsa_run):
    _, doc = vsa_run
    ref = [r for r in doc["results"] if r["arm"] == "reference"]
    assert ref and all(r["status"] == "ok" for r in ref), [r.get("reason") for r in ref]
    for r in ref:
        assert r["gate"]["passed"] is True
        wanted = {"out"} if r["mode"] == "fwd" else {"out", "dq", "dk", "dv"}
        assert set(r["gate"]["tensors"]) == wanted
        assert r["median_ms"] > 0 and len(r["times_ms"]) == r["reps"] >= 1
        assert r["tflops"] == pytest.approx(
            bc.tflops(r["head_dim"], r["total_pairs"], r["mode"], r["median_ms"])
        )
        assert r["peak_mem_mib"] is None  # CPU: no CUDA memory statistics


def test_cuda_arms_are_skipped_with_reasons_on_cpu(vsa_run):
    _, doc = vsa_run
    by_arm: dict[str, list[dict]] = {}
    for r in doc["results"]:
        by_arm.setdefault(r["arm"], []).append(r)
    for arm in ("fa4_raw", "flex", "fa4_dense", "sdpa"):
        assert all(r["status"] == "skipped" for r in by_arm[arm]), arm
        assert all("CUDA" in r["reason"] for r in by_arm[arm]), arm
    for arm in ("triton", "fa4"):  # the backend's own refusal, verbatim
        backend = get_backend(arm)
        for r in by_arm[arm]:
            q_block, kv_block = (int(x) for x in r["block_shape"].split("x"))
            call = AttentionCall(CPU, torch.bfloat16, 32, (q_block, kv_block), r["mode"] != "fwd")
            assert r["status"] == "skipped"
            assert r["reason"] == backend.supports(call)


def test_sdpa_coarse_arm_runs_fa4_with_the_coarse_attention_as_its_own_launch():
    import bench_variants

    from vsa_core.coarse import CoarseStage, coarse_stages
    from vsa_triton.coarse import TritonCoarse

    assert bench_variants.register_variant(bench_variants.SDPA_COARSE_FA4)
    stage = coarse_stages()[bench_variants.SEPARATE_STAGE]
    assert isinstance(stage, TritonCoarse)
    assert type(stage).select_and_attend is CoarseStage.select_and_attend
    assert TritonCoarse.select_and_attend is not CoarseStage.select_and_attend
    assert get_backend(bench_variants.SDPA_COARSE_FA4).priority < 0  # auto never picks it
    assert bench_variants.coarse_backend_for("fa4_sdpa_coarse") == bench_variants.SEPARATE_STAGE
    assert bench_variants.coarse_backend_for("fa4") == "auto"


def test_attend_in_loop_arm_runs_fa4_with_the_coarse_attention_inside_the_score_loop():
    import bench_variants

    from vsa_core.coarse import coarse_stages
    from vsa_triton.coarse import TritonCoarse

    assert bench_variants.register_variant(bench_variants.ATTEND_IN_LOOP_FA4)
    stage = coarse_stages()[bench_variants.ATTEND_IN_LOOP_STAGE]
    assert isinstance(stage, TritonCoarse) and not stage.attend_after_scores
    assert TritonCoarse.attend_after_scores  # the shipped stage keeps its choice
    assert type(stage).select_and_attend is TritonCoarse.select_and_attend
    assert get_backend(bench_variants.ATTEND_IN_LOOP_FA4).priority < 0  # auto never picks it
    assert (
        bench_variants.coarse_backend_for("fa4_attend_in_loop")
        == bench_variants.ATTEND_IN_LOOP_STAGE
    )


def test_fa4_variant_arms_call_an_fa4_backend_carrying_their_forward_variant():
    from vsa_core.backends import get_backend
    from vsa_fa4 import launch

    arm = bench_vsa.build_arms(["vsa:fa4+streams+qregs"])[0]
    assert isinstance(arm, bench_vsa.Fa4VariantArm) and arm.backend_name == "fa4"
    assert arm.name == "vsa:fa4+streams+qregs"
    assert arm.run_backend == "fa4+qregs+streams"
    assert get_backend(arm.run_backend).kernels.forward == launch.ForwardVariant(True, True)
    assert get_backend("fa4").kernels == launch.SHIPPED
    streams = arm.__class__("vsa:fa4+streams")
    assert get_backend(streams.run_backend).kernels.forward == launch.ForwardVariant(
        two_streams=True
    )
    for bad in ("vsa:fa4+fast", "vsa:triton+streams"):
        with pytest.raises(ValueError, match="vsa:fa4\\+OPTION"):
            bench_vsa.build_arms([bad])
        with pytest.raises(SystemExit, match="vsa:fa4\\+OPTION"):
            bench_vsa.main(["--device", "cpu", "--arms", bad])


def test_markdown_table_on_stdout_and_in_md_file(vsa_run):
    out, doc = vsa_run
    text = out.with_suffix(".md").read_text()
    assert "| S | mode | sparsity | block |" in text
    assert "| 512 | fwd | dense | 256x256 |" in text
    assert "## Notes" in text and "`fa4_raw` skipped" in text
    assert text == bench_vsa.render_markdown(doc)


def test_plot_files_are_written(vsa_run):
    pytest.importorskip("matplotlib")
    _, doc = vsa_run
    files = doc["plots"]["files"]
    assert sorted(Path(f).name for f in files) == ["bench_vsa.fwd.png", "bench_vsa.fwd_bwd.png"]
    for f in files:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_skips_plots_with_a_reason(vsa_run, tmp_path, monkeypatch, capsys):
    _, doc = vsa_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    plt, why = bc.load_pyplot()
    assert plt is None and "matplotlib unavailable" in why
    doc = json.loads(json.dumps(doc))
    out = tmp_path / "again.json"
    text = bench_vsa.finish_doc(doc, out, want_plots=True)
    assert doc["plots"]["skipped"].startswith("matplotlib unavailable")
    assert "Plots skipped: matplotlib unavailable" in text
    assert "plots skipped" in capsys.readouterr().err
    assert json.loads(out.read_text())["plots"] == doc["plots"]


# ---- the correctness gate -------------------------------------------------------------------
class WrongArm(bench_vsa.VsaBackendArm):
    """The reference backend with a deliberately wrong output; counts its calls."""

    def __init__(self, damage):
        super().__init__("reference", arm_name="wrong")
        self.damage, self.calls = damage, 0

    def prepare(self, inputs, cell):
        runner = super().prepare(inputs, cell)
        inner = runner.run

        def run(state):
            self.calls += 1
            return {name: self.damage(t) for name, t in inner(state).items()}

        return bc.Runner(run, runner.setup, runner.info)


class RaisingArm(bench_vsa.Arm):
    name = "raises"

    def prepare(self, inputs, cell):
        raise RuntimeError("kernel exploded")


def _run_arms(arms, tmp_path, *extra):
    out = tmp_path / "gate.json"
    argv = [*TINY, *FAST, "--sparsities", "0.5", "--block-shapes", "128x64", "--out", str(out)]
    assert bench_vsa.main([*argv, "--no-plots", *extra], arms=arms) == 0
    return {(r["arm"], r["mode"]): r for r in json.loads(out.read_text())["results"]}


def test_wrong_arm_fails_the_gate_and_is_not_timed(tmp_path):
    wrong = WrongArm(lambda t: t + 0.1)
    nan = WrongArm(lambda t: torch.full_like(t, float("nan")))
    nan.name = "nan"
    arms = [bench_vsa.VsaBackendArm("reference"), wrong, RaisingArm(), nan]
    results = _run_arms(arms, tmp_path, "--modes", "fwd", "fwd+bwd")
    for mode in ("fwd", "fwd+bwd"):
        assert results[("reference", mode)]["status"] == "ok"
        bad = results[("wrong", mode)]
        assert bad["status"] == "failed" and bad["gate"]["passed"] is False
        assert "correctness gate" in bad["reason"] and "max abs err" in bad["reason"]
        assert "median_ms" not in bad and "tflops" not in bad and "times_ms" not in bad
        assert results[("nan", mode)]["status"] == "failed"
        assert "non-finite" in results[("nan", mode)]["reason"]
        err = results[("raises", mode)]
        assert err["status"] == "error" and "kernel exploded" in err["error"]
    assert wrong.calls == 2, "one gate call per mode, never a timed call"


def test_cells_past_gate_max_seq_are_timed_ungated_and_say_so(tmp_path):
    """A wrong arm passes only where the gate is off, and the record and the report say so."""
    wrong = WrongArm(lambda t: t + 0.1)
    seq = int(TINY[TINY.index("--seq-lens") + 1])
    results = _run_arms([wrong], tmp_path, "--modes", "fwd", "--gate-max-seq", str(seq - 1))
    rec = results[("wrong", "fwd")]
    assert rec["status"] == "ok" and "gate" not in rec and rec["median_ms"] > 0
    assert rec["ungated"] == f"S={seq} > --gate-max-seq {seq - 1}"
    doc = json.loads((tmp_path / "gate.json").read_text())
    assert doc["config"]["gate_max_seq"] == seq - 1
    assert f"timed without the correctness gate: S={seq}" in bench_vsa.render_markdown(doc)
    gated = _run_arms([WrongArm(lambda t: t + 0.1)], tmp_path, "--modes", "fwd",
                      "--gate-max-seq", str(seq))  # fmt: skip
    assert gated[("wrong", "fwd")]["status"] == "failed"


def test_gate_tolerance_is_rounding_floor_based():
    ref = torch.linspace(-300, 300, 1001)
    rounded = ref.to(torch.bfloat16)
    gate = bc.gate_check({"out": rounded}, {"out": ref}, torch.bfloat16)
    floor = bc.rounding_floor(ref, torch.bfloat16)
    assert gate.passed and floor > 0.1
    assert gate.tensors["out"]["tol"] == pytest.approx(max(1e-2, 8 * floor))
    assert not bc.gate_check({"out": ref + 9 * floor}, {"out": ref}, torch.bfloat16).passed
    small = torch.zeros(10)
    assert bc.gate_check({"out": small + 0.009}, {"out": small}, torch.bfloat16).passed
    assert not bc.gate_check({"out": small + 0.011}, {"out": small}, torch.bfloat16).passed


def test_float32_reference_matches_float64_autograd():
    torch.manual_seed(0)
    batch, seq, heads, dim, block = 1, 96, 2, 8, 32
    q, k, v, dout = (torch.randn(batch, seq, heads, dim, dtype=torch.float64) for _ in range(4))
    block_mask = torch.rand(batch, heads, 3, 3) < 0.6
    block_mask[0, 0, 1] = False  # a query block that sees nothing
    valid = torch.tensor([32, 20, 0])  # a partial and an empty key block
    got = bc.masked_attention_reference(
        q,
        k,
        v,
        0.3,
        block_mask=block_mask,
        block_shape=(block, block),
        kv_valid_sizes=valid,
        dout=dout,
        chunk_bytes=4096,  # several row chunks
    )
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ql, kl, vl = (t.transpose(1, 2) for t in leaves)
    keep = block_mask.repeat_interleave(block, 2).repeat_interleave(block, 3)
    keep = keep & (torch.arange(block) < valid.view(-1, 1)).reshape(-1)
    scores = (ql @ kl.transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = (probs @ vl).transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, dout)
    want = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    for name, ref in want.items():
        torch.testing.assert_close(got[name].double(), ref.detach(), atol=1e-5, rtol=1e-4)
    assert bool((got["out"][:, 32:64, 0] == 0).all())


# ---- masks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.875, 0.95])
def test_exact256_masks_select_the_same_token_pairs_at_every_block_shape(sparsity):
    args = bench_vsa.build_parser().parse_args(
        [*TINY, "--seq-lens", "2048", "--block-shapes", "256x256", "128x128", "128x64", "64x64"]
    )
    cfg = bench_vsa.make_config(args, CPU)
    layouts, refs = bench_vsa.cell_layouts(cfg, 2048, sparsity)
    base = layouts[(256, 256)]
    base_tokens = bench_vsa.token_mask(base)
    base_pairs = int(base.selected_token_pairs())
    for shape, layout in layouts.items():
        assert layout.block_shape == shape
        assert torch.equal(bench_vsa.token_mask(layout), base_tokens), shape
        assert int(layout.selected_token_pairs()) == base_pairs
        assert refs[shape][0] == refs[(256, 256)][0]
    blocks = base.to_block_mask()
    diagonal = torch.arange(base.num_q_blocks)
    assert bool(blocks[:, :, diagonal, diagonal].all()), "every row keeps its diagonal anchor"
    kept = max(1, round((1 - sparsity) * 8))
    assert bool((base.kv_counts == kept).all())


def test_native_masks_are_sampled_per_block_shape():
    args = bench_vsa.build_parser().parse_args(
        [*TINY, "--masks", "native", "--block-shapes", "128x64", "64x64"]
    )
    cfg = bench_vsa.make_config(args, CPU)
    layouts, refs = bench_vsa.cell_layouts(cfg, 512, 0.75)
    assert refs[(128, 64)][0] != refs[(64, 64)][0]
    for (q_block, kv_block), layout in layouts.items():
        assert layout.block_shape == (q_block, kv_block)
        assert bool((layout.kv_counts == round(0.25 * 512 / kv_block)).all())


# ---- metrics --------------------------------------------------------------------------------
def test_tflops_formula_and_derived_metrics():
    batch, heads, dim, seq = 1, 12, 128, 32768
    pairs = batch * heads * seq * seq
    dense = 4 * batch * heads * dim * seq * seq / 1e-3 / 1e12
    assert bc.tflops(dim, pairs, "fwd", 1.0) == pytest.approx(dense)
    assert bc.tflops(dim, pairs, "bwd", 1.0) == pytest.approx(2.5 * dense)
    assert bc.tflops(dim, pairs, "fwd+bwd", 1.0) == pytest.approx(3.5 * dense)
    base = {"seq_len": seq, "mode": "fwd", "head_dim": dim, "status": "ok"}
    results = [
        {**base, "arm": "fa4_dense", "total_pairs": pairs, "median_ms": 2.0},
        {**base, "arm": "fa4_raw", "total_pairs": pairs // 10, "median_ms": 0.25},
        {**base, "arm": "flex", "total_pairs": pairs // 10, "status": "failed"},
    ]
    bench_vsa.derive_metrics(results, peak=989.0)
    fa4, raw, flex = results
    assert raw["tflops"] == pytest.approx(dense / 10 / 0.25)
    assert raw["mfu"] == pytest.approx(raw["tflops"] / 989.0)
    assert raw["efficiency_vs_fa4_dense"] == pytest.approx(raw["tflops"] / fa4["tflops"])
    assert raw["speedup_vs_fa4_dense"] == pytest.approx(8.0)
    assert "tflops" not in flex


def test_peak_tflops_by_device_name():
    assert bc.peak_tflops_for("NVIDIA H200") == 989.0
    assert bc.peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert bc.peak_tflops_for("NVIDIA B200") == 2250.0
    assert bc.peak_tflops_for("NVIDIA GB200") == 2500.0
    assert bc.peak_tflops_for("x86_64") is None
    assert bc.peak_tflops_for("NVIDIA H200", override=700) == 700.0


# ---- GPU arms' Python paths that run (or can be checked) on a CPU ---------------------------
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_and_sdpa_arms_pass_the_gate_eagerly_on_cpu(tmp_path):
    flex = bench_vsa.FlexArm(compile=False, allow_cpu=True)
    sdpa = bench_vsa.SdpaArm(allow_cpu=True)
    arms = [flex, sdpa]
    results = _run_arms(arms, tmp_path, "--modes", "fwd", "--seq-lens", "256")
    assert results[("flex", "fwd")]["status"] == "ok", results[("flex", "fwd")]
    assert results[("sdpa", "fwd")]["status"] == "ok", results[("sdpa", "fwd")]
    assert results[("sdpa", "fwd")]["info"]["sdpa_backend"] == "math"


def test_fa4_block_sparse_tensors_describe_the_layout():
    stand_in = namedtuple(
        "BlockSparseTensorsTorch",
        "mask_block_cnt mask_block_idx full_block_cnt full_block_idx block_size",
    )
    layout = bench_vsa.sample_layout(1024, 1, 2, 0.75, (128, 64), seed=3)
    fwd, bwd = bench_vsa.fa4_block_sparse_tensors(stand_in, layout, need_backward=True)
    assert fwd.block_size == (128, 64) and bwd.block_size == (128, 64)
    for t in (fwd, bwd):
        assert all(x.dtype == torch.int32 and x.is_contiguous() for x in t[:4])
        assert int(t.mask_block_cnt.abs().sum()) == 0  # everything is a full block
    dense = layout.to_block_mask()  # [B, H, NQ, NKV]
    rebuilt = torch.zeros_like(dense)
    for b, h, i in itertools.product(*map(range, fwd.full_block_cnt.shape)):
        rebuilt[b, h, i, fwd.full_block_idx[b, h, i, : fwd.full_block_cnt[b, h, i]].long()] = True
    assert torch.equal(rebuilt, dense)
    transposed = torch.zeros_like(dense.transpose(-1, -2))
    for b, h, j in itertools.product(*map(range, bwd.full_block_cnt.shape)):
        rows = bwd.full_block_idx[b, h, j, : bwd.full_block_cnt[b, h, j]].long()
        transposed[b, h, j, rows] = True
    assert torch.equal(transposed, dense.transpose(-1, -2))
    assert bwd.full_block_idx.shape[-1] <= layout.num_q_blocks


def test_time_budget_marks_cells_not_run(tmp_path):
    arms = [bench_vsa.VsaBackendArm("reference")]
    results = _run_arms(arms, tmp_path, "--modes", "fwd", "--time-budget-min", "0")
    assert {r["status"] for r in results.values()} == {"not_run"}


# ---- torchrun replicas ----------------------------------------------------------------------
def test_replica_mode_writes_rank_files_and_an_aggregate(tmp_path, monkeypatch):
    out = tmp_path / "rep.json"
    argv = [*TINY, *FAST, "--sparsities", "0.5", "--block-shapes", "256x256", "--modes", "fwd"]
    argv += ["--out", str(out), "--no-plots", "--replica-timeout-s", "30"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-run")
    for rank in (1, 0):  # rank 0 last: it waits for rank 1's file, then aggregates
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert bench_vsa.main(argv, arms=[bench_vsa.VsaBackendArm("reference")]) == 0
    for rank in (0, 1):
        doc = json.loads(bc.rank_path(out, rank).read_text())
        assert doc["complete"] and doc["metadata"]["replica"]["rank"] == rank
    agg = json.loads(out.read_text())
    assert agg["replicas_found"] == [0, 1] and agg["replicas_missing"] == []
    (res,) = agg["results"]
    assert res["status"] == "ok" and set(res["replica_values"]["median_ms"]) == {"0", "1"}
    assert res["median_ms"] == pytest.approx(
        sorted(res["replica_values"]["median_ms"].values())[0] / 2
        + sorted(res["replica_values"]["median_ms"].values())[1] / 2
    )
    assert res["tflops"] > 0
    assert out.with_suffix(".md").exists()


def test_replica_env_parsing():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "abc"}
    rep = bc.replica_from_env(env)
    assert rep == bc.Replica(3, 8, 3, "abc")
    assert bc.replica_from_env({}) is None
    assert bc.rank_path(Path("/x/bench.json"), 3) == Path("/x/bench.rank3.json")


# ---- bench_video ----------------------------------------------------------------------------
def test_ideal_speedup_matches_the_issue():
    tiling = bench_video.VideoTiling((21, 45, 80))
    topk = bench_video.topk_for(0.875, tiling.num_tiles)
    ideal = bench_video.ideal_speedup(tiling.seq_len, tiling.padded_len, topk / tiling.num_tiles)
    assert (tiling.seq_len, tiling.padded_len) == (75600, 92160)
    assert ideal == pytest.approx(5.38, abs=0.01)


def test_bench_video_runs_the_reference_on_a_tiny_latent(tmp_path):
    out = tmp_path / "video.json"
    argv = ["--device", "cpu", *FAST, "--out", str(out)]
    assert bench_video.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["metadata"]["versions"]["vsa-core"]
    assert doc["config"]["arms"] == ["auto"] and doc["config"]["b2b_calls"] == 2
    assert len(doc["results"]) == 8  # tiny latent x 2 sparsities x 2 modes x (dense, auto)
    for dense, r in zip(doc["results"][::2], doc["results"][1::2], strict=True):
        assert (dense["arm"], dense["arm_kind"], r["arm"], r["arm_kind"]) == (
            "dense", "dense", "auto", "vsa")  # fmt: skip
        assert bench_video.cell_key(dense) == bench_video.cell_key(r)
        assert dense["status"] == r["status"] == "ok", r.get("reason")
        assert r["fine_backend"] == "reference" and dense["dense_arm"] == "sdpa"
        assert any("fa4_dense" in t and "CUDA" in t for t in dense["dense_tried"])
        assert r["gate"]["passed"] and dense["dense_gate"]["passed"]
        assert set(r["gate"]["tensors"]) == (
            {"out"} if r["mode"] == "fwd" else {"out", "dq", "dk", "dv"}
        )
        assert r["tokens_real"] == 6 * 7 * 9 and r["tokens_padded"] == 12 * 64
        kept = r["topk"] / r["num_tiles"]
        assert r["ideal_speedup"] == pytest.approx((378 / 768) ** 2 / kept)
        for rec in (dense, r):
            views = rec["timing"]
            assert rec["b2b_ms"] == views["back_to_back"]["median_ms"] > 0
            assert rec["once_ms"] == views["once"]["median_ms"] > 0
            assert rec["host_ms"] == views["host"]["median_ms"] > 0
            assert rec["b2b_calls"] == views["calls_per_turn"] in (1, 2)
            assert len(views["once"]["times_ms"]) == len(views["back_to_back"]["times_ms"]) >= 3
        for view in ("b2b", "once"):  # against dense of the same cell, same rounds
            assert r[f"dense_{view}_ms"] == dense[f"{view}_ms"]
            assert r[f"speedup_{view}"] == pytest.approx(dense[f"{view}_ms"] / r[f"{view}_ms"])
            assert r[f"fraction_of_ideal_{view}"] == pytest.approx(
                r[f"speedup_{view}"] / r["ideal_speedup"]
            )
        pieces = r["pool_ms"] + r["coarse_ms"] + r["select_ms"]
        assert r["coarse_select_share"] == pytest.approx(pieces / r["b2b_ms"])
        assert r["fine_ms"] > 0 and math.isfinite(r["coarse_select_share"])
        assert r["peak_mib"] is None and dense["peak_mib"] is None  # CPU: no CUDA stats
    text = out.with_suffix(".md").read_text()
    assert "## Speedup over dense (once / back to back)" in text
    assert "| latent | heads | sparsity | mode | dense ms once / b2b | auto | ideal |" in text
    assert "| 6x7x9 | 2 | 87.5% (k=2/12) | fwd | dense | sdpa |" in text
    assert "| 6x7x9 | 2 | 87.5% (k=2/12) | fwd | auto | reference |" in text


def test_bench_video_skips_a_refusing_backend(tmp_path):
    out = tmp_path / "video.json"
    argv = ["--device", "cpu", *FAST, "--out", str(out), "--backend", "fa4", "--modes", "fwd"]
    assert bench_video.main([*argv, "--sparsities", "0.875"]) == 0
    dense, fa4 = json.loads(out.read_text())["results"]
    assert dense["status"] == "ok" and "speedup_once" not in dense
    assert fa4["status"] == "skipped" and fa4["reason"].startswith("fa4 backend refuses")


def _video_config(*argv: str) -> bench_video.Config:
    args = bench_video.build_parser().parse_args(["--device", "cpu", *argv])
    return bench_video.make_config(args, CPU)


def test_bench_video_arms_and_timing_options():
    assert _video_config().arms == ["auto"]
    cfg = _video_config("--arms", "auto", "fa4", "triton", "fastvideo", "fa4", "fastvideo_tk")
    assert cfg.arms == ["auto", "fa4", "triton", "fastvideo", "fastvideo_tk"]
    assert cfg.as_dict()["arms"] == cfg.arms
    assert _video_config("--backend", "triton").arms == ["triton"]  # the old spelling
    cfg = _video_config("--b2b-calls", "4", "--b2b-turn-ms", "5", "--no-pieces")
    assert (cfg.b2b_calls, cfg.b2b_turn_ms, cfg.pieces) == (4, 5.0, False)
    assert (_video_config().b2b_calls, _video_config().pieces) == (2, True)  # CPU default
    with pytest.raises(SystemExit, match="dense always runs"):
        _video_config("--arms", "auto", "dense")
    with pytest.raises(SystemExit, match="at least 1"):
        _video_config("--b2b-calls", "0")
    for arms in (["auto", "fa4"], ["fastvideo"]):
        with pytest.raises(SystemExit, match="one fine backend"):
            _video_config("--sequence-parallel", "--arms", *arms)
    sp = _video_config("--sequence-parallel", "--backend", "triton")
    assert sp.backend == "triton" and sp.as_dict()["backend"] == "triton"


def test_bench_video_fastvideo_arms_report_not_installed(tmp_path, monkeypatch):
    import importlib.util

    import fastvideo_arm

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == fastvideo_arm.MODULE else real(name, *a),
    )
    pkg = fastvideo_arm.probe(CPU)
    assert pkg.unavailable == fastvideo_arm.NOT_INSTALLED and pkg.module is None
    assert pkg.why_not("fastvideo") == pkg.why_not("fastvideo_tk") == pkg.unavailable
    out = tmp_path / "video.json"
    argv = ["--device", "cpu", *FAST, "--modes", "fwd", "--sparsities", "0.875"]
    argv += ["--arms", "reference", "fastvideo", "fastvideo_tk", "--out", str(out)]
    assert bench_video.main(argv) == 0
    doc = json.loads(out.read_text())
    by_arm = {r["arm"]: r for r in doc["results"]}
    assert list(by_arm) == ["dense", "reference", "fastvideo", "fastvideo_tk"]
    assert by_arm["dense"]["status"] == by_arm["reference"]["status"] == "ok"
    for name in ("fastvideo", "fastvideo_tk"):
        assert by_arm[name]["status"] == "skipped"
        assert by_arm[name]["reason"].startswith("not installed: fastvideo-kernel")
        assert by_arm[name]["arm_kind"] == "fastvideo"
    text = out.with_suffix(".md").read_text()
    assert "| reference | fastvideo | fastvideo_tk |" in text and "not installed" in text


FAKE_FASTVIDEO = {
    "__init__.py": "from fastvideo_kernel.ops import video_sparse_attn\n",
    "_C/__init__.py": "",  # no compiled extension: the ThunderKittens arm must say so
    "block_sparse_attn.py": """
def _get_sm90_ops():
    try:
        from fastvideo_kernel._C import fastvideo_kernel_ops
    except Exception:
        return None, None
    return fastvideo_kernel_ops.block_sparse_fwd, fastvideo_kernel_ops.block_sparse_bwd
""",
    "ops.py": """
import math
import torch


def fused_block_mean(x, sizes, block):
    b, h, s, d = x.shape
    summed = x.float().view(b, h, s // block, block, d).sum(3)
    return (summed / sizes.float().view(1, 1, -1, 1)).to(x.dtype)


def fused_topk_mask(scores, topk):  # the LOWEST scores: a selection unlike ours
    picks = torch.topk(scores.float(), topk, dim=-1, largest=False).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picks, True)


def video_sparse_attn(q, k, v, sizes, q_sizes, topk, block_size, gate=None):
    block = math.prod(block_size)
    qc, kc, vc = (fused_block_mean(t, sizes, block) for t in (q, k, v))
    scores = torch.matmul(qc, kc.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
    coarse = (torch.softmax(scores.float(), -1) @ vc.float()).repeat_interleave(block, 2)
    mask = fused_topk_mask(scores, topk).repeat_interleave(block, 2)
    real = torch.arange(block) < sizes.view(-1, 1)
    keep = mask.repeat_interleave(block, 3) & real.view(-1)
    logits = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    fine = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1) @ v.float()
    return (fine + coarse * (1 if gate is None else gate.float())).to(q.dtype)
""",
}


@pytest.fixture
def fake_fastvideo(tmp_path, monkeypatch):
    """A stand-in fastvideo_kernel (torch, FastVideo's call and layout, no `_C`) on sys.path,
    with distribution metadata that pins torch 9.9.9."""
    root = tmp_path / "site"
    for name, text in FAKE_FASTVIDEO.items():
        path = root / "fastvideo_kernel" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    meta = root / "fastvideo_kernel-0.0.1.dist-info"
    meta.mkdir()
    meta.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: fastvideo-kernel\nVersion: 0.0.1\n"
        "Requires-Dist: torch==9.9.9\n"
    )
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [n for n in sys.modules if n.split(".")[0] == "fastvideo_kernel"]:
        del sys.modules[name]


def test_bench_video_fastvideo_arm_runs_and_is_gated_on_its_own_selection(
    tmp_path, monkeypatch, fake_fastvideo
):
    import functools

    import fastvideo_arm

    real_probe = fastvideo_arm.probe
    monkeypatch.setattr(fastvideo_arm, "probe", functools.partial(real_probe, require_cuda=False))
    out = tmp_path / "video.json"
    argv = ["--device", "cpu", *FAST, "--sparsities", "0.875", "--no-pieces", "--out", str(out)]
    assert bench_video.main([*argv, "--arms", "reference", "fastvideo", "fastvideo_tk"]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["arm"] for r in results] == ["dense", "reference", "fastvideo", "fastvideo_tk"] * 2
    for r in results:
        if r["arm"] == "fastvideo_tk":
            assert r["status"] == "skipped"
            assert "`_C` extension does not load" in r["reason"] and "torch==9.9.9" in r["reason"]
            continue
        assert r["status"] == "ok", r.get("reason")
        if r["arm"] != "fastvideo":
            continue
        assert r["gate"]["passed"] and r["gate_level"] == "max_abs"
        assert set(r["gate"]["tensors"]) == (
            {"out"} if r["mode"] == "fwd" else {"out", "dq", "dk", "dv"}
        )
        # its (bottom-k) selection is not ours, yet it passes: gated on its own selection
        assert r["selection"]["rows_identical_to_ours"] < 0.5
        assert r["selection"]["count_min"] == r["selection"]["count_max"] == r["topk"]
        assert r["info"]["impl"] == "triton" and r["info"]["environment"] == {}
        assert r["fastvideo"]["version"] == "0.0.1" and "sm90_probe" in r["fastvideo"]
        assert r["speedup_once"] == pytest.approx(r["dense_once_ms"] / r["once_ms"])
    routing = sys.modules["fastvideo_kernel.block_sparse_attn"]
    assert routing._get_sm90_ops() == (None, None)  # its failed `_C` probe, answered once
    text = out.with_suffix(".md").read_text()
    assert "fastvideo at 6x7x9 fwd: its selection equals ours on" in text


def test_fastvideo_inputs_are_bhsd_with_zeroed_padding():
    import fastvideo_arm

    x = torch.arange(2 * 4 * 3 * 2, dtype=torch.float32).view(2, 4, 3, 2) + 1
    real = torch.tensor([True, False, True, True])
    y = fastvideo_arm.to_fastvideo(x, real)
    assert y.shape == (2, 3, 4, 2) and y.is_contiguous()
    assert torch.equal(y[:, :, 1], torch.zeros(2, 3, 2))
    assert torch.equal(y.transpose(1, 2)[:, real], x[:, real])
    pkg = fastvideo_arm.Package(tk_unavailable="no _C")
    assert fastvideo_arm.routing_env(pkg, "fastvideo") == {}  # Triton is its only path
    pkg.tk_unavailable = None
    with_tk = fastvideo_arm.routing_env(pkg, "fastvideo")
    assert with_tk in ({"FASTVIDEO_VSA_TRITON": "1"}, {})  # {} only if already set


def _sp_env() -> dict[str, str]:
    """Two gloo ranks on the loopback interface, one thread each (a two-core runner)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith("TORCHELASTIC_")
    }
    env["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)
def test_bench_video_sequence_parallel_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "sp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(BENCHMARKS / "bench_video.py"), "--sequence-parallel", "--device", "cpu"]
    cmd += ["--warmup", "1", "--reps", "2", "--sparsities", "0.875", "--out", str(out)]
    done = subprocess.run(
        cmd, env=_sp_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["config"]["sequence_parallel"] is True
    assert doc["config"]["dtype"] == "fp32" and doc["config"]["budget_s"] is None
    assert doc["sequence_parallel"]["world_size"] == 2
    assert doc["sequence_parallel"]["process_group"] == "gloo"
    assert doc["metadata"]["replica"]["world_size"] == 2
    assert not list(tmp_path.glob("sp.rank*.json")), "one report, by rank 0"
    assert [r["mode"] for r in doc["results"]] == ["fwd", "fwd+bwd"]
    for r in doc["results"]:
        assert r["status"] == "ok", r.get("reason")
        assert r["world_size"] == 2 and r["fine_backend"] == "reference"
        assert r["op_gate"]["passed"] and r["dense_gate"]["passed"]
        gate = r["sp_gate"]
        assert gate["passed"] is True
        wanted = {"out"} if r["mode"] == "fwd" else {"out", "dq", "dk", "dv"}
        assert set(gate["tensors"]) == wanted
        assert all(t["criterion"] == "max_abs_err" for t in gate["tensors"].values())
        timing = r["sp_timing"]
        assert (timing["warmup"], timing["reps"]) == (1, 2) and len(timing["times_ms"]) == 2
        assert len(timing["rank_median_ms"]) == 2
        assert timing["median_ms"] >= min(timing["rank_median_ms"]) > 0  # max over ranks
        assert r["op_timing"]["reps"] == 2 and r["dense_timing"]["reps"] == 2  # fixed counts
        assert r["sp_ms"] == timing["median_ms"] > 0
        assert r["sp_speedup_vs_op"] == pytest.approx(r["op_ms"] / r["sp_ms"])
        assert r["sp_speedup_vs_dense"] == pytest.approx(r["dense_ms"] / r["sp_ms"])
        assert r["scaling_efficiency"] == pytest.approx(r["op_ms"] / (2 * r["sp_ms"]))
        assert "sp_peak_mib_per_rank" in r and r["sp_peak_mib"] is None  # CPU: no CUDA stats
    text = out.with_suffix(".md").read_text()
    assert "| SP ms | 1-GPU op ms |" in text and "| 6x7x9 | 2 |" in text
    assert "SP ms" in done.stdout


def test_bench_video_sequence_parallel_needs_torchrun():
    with pytest.raises(SystemExit, match="runs under torchrun"):
        bench_video.main(["--sequence-parallel", "--device", "cpu"])


# ---- command lines --------------------------------------------------------------------------
@pytest.mark.parametrize(("module", "flag"), [(bench_vsa, "--seq-lens"), (bench_video, "--shapes")])
def test_help(module, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert flag in text and "--out" in text and "--modes" in text


def test_time_interleaved_rotates_arms_and_keeps_setup_untimed():
    calls: list[str] = []

    def arm(name: str, sleep_s: float):
        def fn(state):
            assert state == f"{name}-state"
            calls.append(name)
            time.sleep(sleep_s)

        return fn, lambda: (calls.append(f"{name}-setup"), time.sleep(0.05), f"{name}-state")[2]

    arms = {"a": arm("a", 0.0), "b": arm("b", 0.004), "c": arm("c", 0.0)}
    times = bc.time_interleaved(arms, torch.device("cpu"), warmup=1, reps=3)
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    # the 50 ms setup is not timed (a margin a loaded machine's scheduling stays far below)
    assert min(times["b"]) >= 4.0 and max(times["a"]) < 25.0
    order = [c for c in calls if "-" not in c]
    # bc.balanced_orders(3): a rotation, its reverse, the next rotation
    assert order == ["a", "b", "c", "a", "b", "c", "c", "b", "a", "b", "c", "a"]


@pytest.mark.parametrize("n", range(1, 9))
def test_balanced_orders_balance_places_and_predecessors(n):
    from collections import Counter

    orders = bc.balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    # each arm in each place equally often, and behind each other arm equally often
    places = Counter((place, arm) for order in orders for place, arm in enumerate(order))
    assert set(places.values()) == {len(orders) // n}
    pairs = Counter(pair for order in orders for pair in itertools.pairwise(order))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
    if n % 2:  # odd n: every two rounds from an even place on, each adjacent pair both ways
        for start in range(0, len(orders), 2):
            two = Counter(p for o in orders[start : start + 2] for p in itertools.pairwise(o))
            assert all(two[(a, b)] == two[(b, a)] for a, b in two)
    if n >= 4:  # what rotation got wrong: within n rounds an arm follows more than one other
        behind = {b: {a for o in orders[:n] for a, x in itertools.pairwise(o) if x == b}
                  for b in range(n)}  # fmt: skip
        assert all(len(arms) > 1 for arms in behind.values())


def test_time_paced_alternates_the_arm_with_its_pacer_and_caps_reps_by_the_budget():
    calls: list[str] = []

    def runner(name: str, sleep_s: float):
        return bc.Runner(lambda _: (calls.append(name), time.sleep(sleep_s))[0])

    settings = SimpleNamespace(warmup=2, reps=50, budget_s=0.1)
    arm, dense = bc.time_paced(runner("arm", 0.001), runner("dense", 0.009), torch.device("cpu"),
                               settings)  # fmt: skip
    # ~10 ms per pair and a 0.1 s budget: about 10 timed rounds, not the 50 asked for
    assert 3 <= arm.reps == dense.reps == len(arm.times_ms) == len(dense.times_ms) <= 12
    assert min(dense.times_ms) >= 9.0 and max(arm.times_ms) < 9.0
    rounds = [calls[i : i + 2] for i in range(0, len(calls), 2)]
    assert all(sorted(r) == ["arm", "dense"] for r in rounds)  # each round calls both once


def test_time_views_alternates_arms_in_both_views_and_keeps_setup_untimed():
    calls: list[str] = []

    def runner(name: str, sleep_s: float) -> bc.Runner:
        def run(state):
            assert state == f"{name}-state"
            calls.append(name)
            time.sleep(sleep_s)

        setup = lambda: (calls.append("setup"), time.sleep(0.005), f"{name}-state")[2]  # noqa: E731
        return bc.Runner(run, setup)

    settings = SimpleNamespace(warmup=1, reps=4, budget_s=10.0)
    # a turn of 100 ms: a (~1 ms) fills it with its 3 calls even on a loaded machine (an
    # earlier 10 ms turn gave a only 2 under -n 8 on 2 cores), b (120 ms) gets one
    views = bc.time_views({"a": runner("a", 0.001), "b": runner("b", 0.120)}, CPU, settings,
                          max_calls=3, turn_ms=100.0)  # fmt: skip
    a, b = views["a"], views["b"]
    assert a.calls_per_turn == 3 and b.calls_per_turn == 1  # ~100 ms of calls, at most 3
    for v in (a, b):
        assert v.once.reps == v.back_to_back.reps == 4
        assert len(v.once.times_ms) == len(v.back_to_back.times_ms) == len(v.host.times_ms) == 4
        assert v.host.times_ms == v.once.times_ms  # on the CPU the wall clock is both
        assert set(v.as_dict()) == {"back_to_back", "once", "host", "calls_per_turn"}
    # the 5 ms setups are not timed; back to back is per call
    assert min(b.once.times_ms) >= 120.0 and max(a.once.times_ms) < 120.0
    assert min(b.back_to_back.times_ms) >= 120.0 and max(a.back_to_back.times_ms) < 120.0
    runs = [c for c in calls if c != "setup"]
    n = a.calls_per_turn
    # warm-up round, estimate round, then the once rounds alternate (two arms: the orders of
    # bc.balanced_orders(2) are the two rotations)
    assert runs[:12] == ["a", "b", "a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    # then back-to-back turns: n calls of a, one of b (a refill round, then 4 alternating rounds)
    b2b = runs[12:]
    assert (
        b2b == (["a"] * n + ["b"]) * 2 + ["b"] + ["a"] * n + ["a"] * n + ["b"] + ["b"] + ["a"] * n
    )


def test_time_views_caps_rounds_by_the_budget_and_interleaved_turns_can_synchronize():
    settings = SimpleNamespace(warmup=0, reps=50, budget_s=0.02)
    fn = bc.Runner(lambda _: time.sleep(0.004))
    views = bc.time_views({"x": fn, "y": fn}, CPU, settings, max_calls=2, turn_ms=1.0)
    assert views["x"].once.reps == 3 and views["x"].calls_per_turn == 1  # at least 3 rounds
    arms = {"x": (lambda _: time.sleep(0.001), None)}
    assert bc.interleaved_turns(arms, CPU, rounds=2, record=False) == {"x": []}
    turns = bc.interleaved_turns(arms, CPU, rounds=2, calls=3, synchronized=True)["x"]
    assert len(turns) == 2 and all(1.0 <= t.device_ms < 5.0 and t.host_ms > 0 for t in turns)


class CpuDenseArm(bench_vsa.SdpaArm):
    """SDPA (math) on the CPU under fa4_dense's name: the pacer and baseline of a CPU run."""

    name = "fa4_dense"

    def __init__(self):
        super().__init__(allow_cpu=True)


@pytest.mark.parametrize("pacing", ["dense", "none"])
def test_pacing_times_sparse_arms_beside_dense_and_compares_them_in_those_rounds(tmp_path, pacing):
    arms = [CpuDenseArm(), bench_vsa.VsaBackendArm("reference")]
    results = _run_arms(arms, tmp_path, "--modes", "fwd", "--pacing", pacing)
    dense, sparse = results[("fa4_dense", "fwd")], results[("reference", "fwd")]
    assert dense["status"] == sparse["status"] == "ok"
    assert "paced_dense_median_ms" not in dense  # the baseline itself is timed on its own
    if pacing == "none":
        assert "paced_dense_median_ms" not in sparse
        baseline = dense["median_ms"]
    else:
        assert len(sparse["paced_dense_times_ms"]) == sparse["reps"] == len(sparse["times_ms"])
        assert sparse["paced_dense_pairs"] == dense["total_pairs"]
        baseline = sparse["paced_dense_median_ms"]
    assert sparse["speedup_vs_fa4_dense"] == pytest.approx(baseline / sparse["median_ms"])
    ratio = (sparse["total_pairs"] / sparse["median_ms"]) / (dense["total_pairs"] / baseline)
    assert sparse["efficiency_vs_fa4_dense"] == pytest.approx(ratio)


def test_sample_layout_makes_the_asked_share_of_key_blocks_partial():
    full = bench_vsa.sample_layout(2048, 1, 2, 0.75, (64, 64), seed=3)
    assert full.kv_blocks_full and bool((full.kv_valid_sizes == 64).all())
    partial = bench_vsa.sample_layout(2048, 1, 2, 0.75, (64, 64), seed=3, partial=0.25)
    valid = partial.kv_valid_sizes
    assert not partial.kv_blocks_full
    assert int((valid < 64).sum()) == 8  # int(0.25 * 32 key blocks)
    assert bool(((valid >= 1) & (valid <= 64)).all())
    again = bench_vsa.sample_layout(2048, 1, 2, 0.75, (64, 64), seed=3, partial=0.25)
    assert torch.equal(again.kv_valid_sizes, valid)  # deterministic
    assert torch.equal(partial.kv_indices, full.kv_indices)  # the same selection


# ---- profile_video_op ------------------------------------------------------------------------
def test_profile_video_op_runs_once_per_selection_chunk_and_restores_it(tmp_path):
    import profile_video_op

    from vsa_core import coarse

    before = coarse.SELECTION_CHUNK_BYTES
    argv = ["--device", "cpu", "--shape", "tiny", "--backends", "reference", "--modes", "fwd",
            "--calls", "1", "--selection-chunk-mib", "0", "16", "--out", str(tmp_path)]  # fmt: skip
    assert profile_video_op.main(argv) == 0
    assert before == coarse.SELECTION_CHUNK_BYTES
    runs = json.loads((tmp_path / "profile_video_op.json").read_text())["runs"]
    assert [r["selection_chunk_bytes"] for r in runs] == [0, 16 << 20]
    assert all(r["ms_per_call"] > 0 and r["fine_kernels_ms"] == 0 for r in runs)  # no CUDA
    for mib in (0, 16):
        assert (tmp_path / f"reference-fwd-selection{mib}mib.kernels.txt").read_text()


def test_bench_video_fa4_variant_is_checked_recorded_and_entered(tmp_path, monkeypatch):
    from vsa_core.backends import get_backend
    from vsa_fa4 import launch

    with pytest.raises(SystemExit, match="--fa4-variant"):
        bench_video.main(["--device", "cpu", "--fa4-variant", "fast"])
    seen = []
    real = bench_video.run_cell
    monkeypatch.setattr(
        bench_video,
        "run_cell",
        lambda *a, **k: (seen.append(get_backend("fa4").kernels.forward), real(*a, **k))[1],
    )
    out = tmp_path / "v.json"
    argv = ["--device", "cpu", *FAST, "--modes", "fwd", "--fa4-variant", "streams,qregs"]
    assert bench_video.main([*argv, "--out", str(out)]) == 0
    assert seen and all(v == launch.ForwardVariant(True, True) for v in seen)
    assert get_backend("fa4").kernels == launch.SHIPPED  # the registry's own fa4 again
    doc = json.loads(out.read_text())
    assert doc["config"]["fa4_variant"] == ["streams", "qregs"]
    assert "fa4 forward variant: streams+qregs" in out.with_suffix(".md").read_text()


def test_bench_dit_smoke_run_on_a_tiny_wan_checks_vsa_against_dense(tmp_path):
    """bench_dit.py's CPU smoke run: the all-tiles check, then one untimed call per cell."""
    pytest.importorskip("diffusers")
    out = tmp_path / "dit.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_dit.py"), "--config", "tiny", "--device", "cpu",
         "--ways", "eager", "--sparsities", "0.5", "--backend", "reference", "--tile", "1", "2",
         "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=BENCHMARKS,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True  # rewritten after every row, complete at the end
    rows = doc["rows"]
    assert rows[0]["check"].startswith("all tiles") and rows[0]["rel_err"] < 1e-5
    assert [(r["mode"], r["way"]) for r in rows[1:]] == [("fwd", "eager"), ("train", "eager")]
    assert not any("error" in key for r in rows for key in r)


def test_bench_dit_no_check_goes_straight_to_the_cells(tmp_path):
    """``--no-check`` (a rerun of a config whose check an earlier run logged): no check row;
    a training cell with ``--gradient-checkpointing`` runs."""
    pytest.importorskip("diffusers")
    out = tmp_path / "dit.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_dit.py"), "--config", "tiny", "--device", "cpu",
         "--ways", "eager", "--modes", "train", "--sparsities", "0.5", "--backend", "reference",
         "--tile", "1", "2", "2", "--no-check", "--warmup", "1", "--b2b-rounds", "1",
         "--gradient-checkpointing", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=BENCHMARKS,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r.get("check"), r["mode"], r["way"]) for r in rows] == [(None, "train", "eager")]
    assert not any("error" in key for r in rows for key in r)


def test_bench_common_is_a_facade_over_the_modules_that_own_the_harness():
    """bench_common re-exports the harness (older scripts and research/ import it): each name
    is the same object as in the one module that owns it; the benchmark scripts import the
    owners."""
    import importlib

    owners = [importlib.import_module(n) for n in ("bench_timing", "bench_reference",
                                                   "bench_report", "bench_run")]  # fmt: skip
    for name in bc.__all__:
        homes = [m for m in owners if name in vars(m) and getattr(m, name) is getattr(bc, name)]
        assert len(homes) >= 1, name
    for name in ("time_views", "gate_check", "collect_metadata", "run_and_report", "Runner"):
        assert name in bc.__all__
    for script in BENCHMARKS.glob("*.py"):
        if script.name != "bench_common.py":
            assert "import bench_common" not in script.read_text(), script.name


@pytest.mark.parametrize("name", ["triton_copies", "triton_unfused", "fa4_unfused"])
def test_bench_variants_switch_off_only_their_capabilities(name):
    import bench_variants

    from vsa_core.backends import backend_entries
    from vsa_fa4.backend import FA4Backend
    from vsa_triton.backend import TritonBackend

    assert bench_variants.register_variant(name)
    assert not bench_variants.register_variant("not-a-variant")
    variant = backend_entries()[name].backend
    base = FA4Backend if name.startswith("fa4") else TritonBackend
    assert isinstance(variant, base) and variant.priority == -1  # auto never picks it
    assert not variant.fuses_combine and base.fuses_combine
    assert variant.reads_raster == (name == "triton_unfused" and base.reads_raster)

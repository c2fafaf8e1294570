"""The `vsa` command: info and demo run on a CPU machine and say true things."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from vsa_core import cli
from vsa_core.backends import Backend, register_backend, unregister_backend
from vsa_core.layout import BlockSparseLayout
from vsa_core.tiling import VideoTiling


def test_info_json_lists_every_backend_and_auto_choice(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["packages"]["vsa-core"] == "0.1.0"
    names = {b["name"]: b for b in info["backends"]}
    assert names["reference"]["state"] == "available"
    installed = {ep.name for ep in entry_points(group="vsa.backends")}  # vsa-core alone: reference
    assert "reference" in installed and installed <= set(names)
    for b in info["backends"]:
        # every backend that cannot run says why
        assert (b["state"] == "available") == (b["reason"] is None)
    if not torch.cuda.is_available():
        assert info["devices"] == []
        assert info["auto_picks"] == "reference"


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend='auto' picks:" in out
    assert "reference  available" in out
    assert "with deterministic=True: auto picks" in out
    assert "with copy_to_tiles=False: auto picks" in out


def _verdicts_with(capsys, capability: str, key: str) -> dict:
    """``vsa info --json``'s ``key`` section with two accepting backends registered above the
    installed ones: "without" (first by priority) and "with", which declares ``capability``."""

    class Without(Backend):
        name = "without"
        priority = 1000

        def supports(self, call):
            return None

    With = type("With", (Without,), {"name": "with", "priority": 999, capability: True})
    register_backend(Without())
    register_backend(With())
    assert cli.main(["info", "--json"]) == 0
    return json.loads(capsys.readouterr().out)[key]


def test_info_lists_each_backends_declared_capabilities(capsys, fresh_registry):
    """One line per capability a backend declares (its class attribute set), none otherwise;
    the JSON names them."""

    class Plain(Backend):
        name = "plain"
        priority = 1000

        def supports(self, call):
            return None

    Fused = type("Fused", (Plain,), {"name": "fused", "priority": 999, "fuses_combine": True})
    register_backend(Plain())
    register_backend(Fused())
    assert cli.main(["info", "--json"]) == 0
    backends = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert backends["plain"]["capabilities"] == []
    assert backends["fused"]["capabilities"] == ["fuses_combine"]
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    fused = lines.index(next(line for line in lines if line.startswith("  fused ")))
    assert lines[fused + 1].strip() == "- " + cli.CAPABILITIES["fuses_combine"]
    plain = lines.index(next(line for line in lines if line.startswith("  plain ")))
    assert not lines[plain + 1].strip().startswith("- ")


def test_info_says_which_backends_run_deterministic_training(capsys, fresh_registry):
    """A backend that does not declare deterministic support is refused with the reason, one
    that does is picked by auto for the typical training call."""
    deterministic = _verdicts_with(capsys, "handles_deterministic", "deterministic")
    assert deterministic["auto_picks"] == "with"
    assert deterministic["verdicts"]["with"] is None
    assert "does not declare deterministic=True" in deterministic["verdicts"]["without"]


def test_info_says_which_backends_read_raster_order(capsys, fresh_registry):
    """copy_to_tiles=False: a backend that reads raster order is picked, one that does not is
    refused with the argument to change."""
    in_place = _verdicts_with(capsys, "reads_raster", "raster_in_place")
    assert in_place["auto_picks"] == "with"
    assert in_place["verdicts"]["with"] is None
    assert "copy_to_tiles=True" in in_place["verdicts"]["without"]


class TrainsOnlyWideBlocks(Backend):
    """Runs every forward but refuses backward with 64-token key blocks; ranks itself first
    unless 64-row query blocks come unpaired."""

    name = "info-test"
    priority = 1000

    def supports(self, call):
        if call.requires_grad and call.block_shape[1] == 64:
            return "no backward with 64-token key blocks"
        return None

    def priority_for(self, call):
        unpaired = call.block_shape[0] == 64 and call.q_group_size == 1
        return -1 if unpaired and not call.kv_blocks_full else self.priority


def test_info_shape_table_gives_each_verdict_its_reason_and_auto(capsys):
    register_backend(TrainsOnlyWideBlocks())
    try:
        assert cli.main(["info", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["shapes"]
        assert cli.main(["info"]) == 0
        text = capsys.readouterr().out
    finally:
        unregister_backend("info-test")
    by_key = {
        (tuple(r["block_shape"]), r["q_group_size"], r["requires_grad"]): r
        for r in rows
        if not r["kv_blocks_full"]
    }
    assert len(rows) == 2 * len(cli.INFO_SHAPES)
    full = [r for r in rows if r["kv_blocks_full"]]
    # all-full key blocks lift the unpaired 64x64 rank; its backward is still refused
    assert [(r["block_shape"], r["requires_grad"], r["auto_picks"]) for r in full] == [
        ([64, 64], False, "info-test"),
        ([64, 64], True, "reference"),
    ]
    assert by_key[((128, 64), 1, True)]["verdicts"]["info-test"] == (
        "no backward with 64-token key blocks"
    )
    assert by_key[((128, 64), 1, True)]["auto_picks"] == "reference"  # refused: falls back
    assert by_key[((128, 64), 1, False)]["auto_picks"] == "info-test"
    assert by_key[((64, 64), 1, False)]["auto_picks"] == "reference"  # ranked below: unpaired
    assert by_key[((64, 64), 2, False)]["auto_picks"] == "info-test"
    assert by_key[((256, 256), 1, True)]["verdicts"]["info-test"] is None
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("128x64 "))
    assert "info-test ok/no[1]" in line and "auto: info-test / reference" in line
    assert "[1] no backward with 64-token key blocks" in text
    assert "(key blocks all full)" in text


def test_demo_small_latent_reports_error_and_mass(capsys):
    args = "demo --latent 5 9 10 --heads 2 --head-dim 16 --topk 4 --device cpu --repeats 1"
    code = cli.main(args.split())
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    text = "\n".join(lines)
    assert "18 tiles, 450 tokens (1152 padded)" in text  # 2 x 3 x 3 tiles of 4x4x4
    assert "backend: reference" in text
    accuracy = next(ln for ln in lines if "max |error|" in ln)
    max_error = float(accuracy.split("max |error| ")[1].split(",")[0])
    rel_l2 = float(accuracy.rsplit(" ", 1)[-1])
    assert 0 <= max_error < 1e-4
    assert 0 <= rel_l2 < 1e-5
    mass = next(ln for ln in lines if "capture" in ln)
    share = float(mass.split("capture ")[1].split("%")[0]) / 100
    assert 4 / 18 < share <= 1  # the coarse stage beats choosing tiles at random


def _bad_demo(capsys, argv):
    """Run ``vsa demo`` with a bad option; return its one stderr line (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err.rstrip("\n")


def test_demo_rejects_bad_topk(capsys):
    line = _bad_demo(capsys, ["--latent", "4", "4", "4", "--topk", "2", "--device", "cpu"])
    assert line == "vsa demo: --topk: an integer in [1, 1] (the number of tiles), got 2"


SMALL = ["--latent", "4", "4", "8", "--head-dim", "8", "--heads", "1", "--repeats", "1"]


@pytest.mark.parametrize(
    ("argv", "option", "expected"),
    [
        # issue 21, row 9: these used the defaults silently, or ended in a traceback
        (["--heads", "0"], "--heads", "a positive integer, got '0'"),
        (["--heads", "-2"], "--heads", "a positive integer, got '-2'"),
        (["--head-dim", "0"], "--head-dim", "a positive integer, got '0'"),
        (["--latent", "0", "5", "6"], "--latent", "a positive integer, got '0'"),
        (["--tile", "0", "4", "4"], "--tile", "a positive integer, got '0'"),
        (["--device", "foo"], "--device", "cpu, cuda, cuda:N or auto, got 'foo'"),
        (["--backend", "nope"], "--backend", "one of auto, "),
        (["--repeats", "0"], "--repeats", "a positive integer, got '0'"),
        (["--sparsity", "1"], "--sparsity", "a number in [0, 1), got '1'"),
        (["--sparsity", "nan"], "--sparsity", "a number in [0, 1), got 'nan'"),
        (["--topk", "0"], "--topk", "a positive integer, got '0'"),
        (["--topk", "3"], "--topk", "an integer in [1, 2] (the number of tiles), got 3"),
        (["--seed", "x"], "--seed", "an integer, got 'x'"),
        (["--heads", "2.5"], "--heads", "a positive integer, got '2.5'"),
        (["--dtype", "int8"], "--dtype", "invalid choice: 'int8'"),
        (["--latent", "1", "1"], "--latent", "expected 3 arguments"),
    ],
)
def test_demo_bad_option_is_one_line_and_exit_2(capsys, argv, option, expected):
    line = _bad_demo(capsys, [*SMALL, *argv])
    assert line.startswith(f"vsa demo: {option}: {expected}"), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_cuda_without_a_gpu(capsys):
    for name in ("cuda", "cuda:1"):
        line = _bad_demo(capsys, [*SMALL, "--device", name])
        assert line == f"vsa demo: --device: cpu or auto: no CUDA device is visible, got {name!r}"
    if "triton" not in {ep.name for ep in entry_points(group="vsa.backends")}:
        return  # vsa-core alone (the lowest-direct CI job): no triton backend to refuse
    line = _bad_demo(capsys, [*SMALL, "--backend", "triton", "--device", "cpu"])
    assert line.startswith("vsa demo: --backend: a backend that runs torch.float32 on cpu")
    assert "'triton' cannot run this call: " in line


def test_demo_misspelt_env_backend_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("VSA_BACKEND", "refrence")
    line = _bad_demo(capsys, [*SMALL, "--device", "cpu"])
    assert line.startswith("vsa demo: VSA_BACKEND: ") and line.endswith("got 'refrence'")


def test_demo_one_token_latent_reports_no_nan(capsys):
    # issue 21, row 9: one token has no spread; its features were NaN, so was "max error"
    assert cli.main(["demo", "--latent", "1", "1", "1", "--heads", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    accuracy = next(ln for ln in out.splitlines() if "max |error|" in ln)
    assert "nan" not in accuracy.lower() and "nan" not in out.lower()


def test_bad_option_from_the_console_has_no_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "vsa_core.cli", "demo", "--heads", "-2", "--device", "cpu"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr == "vsa demo: --heads: a positive integer, got '-2'\n"
    assert result.stdout == ""


def test_version_lists_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("vsa-core 0.1.0")
    assert out == cli.versions_line()


@pytest.mark.parametrize(
    ("runtime", "driver", "warns", "minor_note"),
    [
        ("13.0", (12, 9), True, False),  # a new major version needs a new driver
        ("12.8", (12, 4), True, True),  # minor version compatibility: run, but not JIT
        ("12.8", (12, 8), False, False),
        ("12.8", (13, 0), False, False),
        (None, (12, 8), False, False),  # a CPU build of torch
        ("12.8", None, False, False),  # no driver found
        ("weird", (12, 8), False, False),
    ],
)
def test_driver_warning(runtime, driver, warns, minor_note):
    text = cli.driver_warning(runtime, driver)
    assert (text is not None) == warns
    if warns:
        assert f"built for CUDA {runtime}" in text
        assert f"supports CUDA up to {driver[0]}.{driver[1]}" in text
        assert ("minor version compatibility" in text) == minor_note


def test_info_reports_the_driver_and_warns_when_it_is_too_old(capsys, monkeypatch):
    found = cli.driver_cuda_version()
    assert found is None or (isinstance(found, tuple) and len(found) == 2)
    monkeypatch.setattr(cli, "driver_cuda_version", lambda: (12, 2))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cuda_driver"] == "12.2" and len(info["warnings"]) == 1
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CUDA driver: 12.2" in out
    assert "warning: torch " in out and "built for CUDA 13.0" in out
    monkeypatch.setattr(cli, "driver_cuda_version", lambda: None)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CUDA driver: none found" in out and "warning:" not in out


def test_attention_mass_captured_is_one_with_all_tiles_selected():
    tiling = VideoTiling((3, 5, 6))
    gen = torch.Generator().manual_seed(0)
    q, k, _ = (tiling.to_tiles(t) for t in cli.synthetic_video_qkv((3, 5, 6), 2, 8, gen))
    n = tiling.num_tiles
    everything = torch.ones(1, 2, n, n, dtype=torch.bool)
    layout = BlockSparseLayout.from_block_mask(everything, tiling.valid_sizes(), (64, 64))
    assert cli.attention_mass_captured(q, k, layout, tiling) == pytest.approx(1.0, abs=1e-5)
    nothing = BlockSparseLayout.from_block_mask(~everything, tiling.valid_sizes(), (64, 64))
    assert cli.attention_mass_captured(q, k, nothing, tiling) == 0.0


def test_console_script_is_declared_and_module_runs():
    (script,) = entry_points(group="console_scripts", name="vsa")
    assert script.value == "vsa_core.cli:main"
    result = subprocess.run(
        [sys.executable, "-m", "vsa_core.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "info" in result.stdout and "demo" in result.stdout

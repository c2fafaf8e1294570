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
    assert {"reference", "triton", "fa4"} <= set(names)
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
    assert "64x64 (key blocks all full)" in text


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


def test_demo_rejects_bad_topk():
    with pytest.raises(SystemExit, match="--topk must lie in"):
        cli.main(["demo", "--latent", "4", "4", "4", "--topk", "2", "--device", "cpu"])


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

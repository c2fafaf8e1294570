"""The compile gate: the machinery on canned output, and the real gate (slow, ~30 s on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from flash_attn_vsa import compile_gate as cg
from flash_attn_vsa import upstream_version


def test_configs_cover_what_the_adapter_uses():
    names = [c.name for c in cg.CONFIGS]
    assert len(set(names)) == len(names)
    fwd_blocks = {c.block_size for c in cg.CONFIGS if c.direction == "fwd"}
    assert {None, (128, 128), (64, 64)} <= fwd_blocks
    for c in cg.CONFIGS:
        kind, *options = c.direction.split("+")
        assert kind in ("fwd", "bwd", "bwd-kv64", *cg.FORK_FORWARDS), c.direction
        if kind == "bwd-kv64":  # the option names a configuration under measurement
            from flash_attn_vsa.experimental.bwd_configs import EXPERIMENTAL_CONFIGS

            assert len(options) <= 1 and set(options) <= set(EXPERIMENTAL_CONFIGS), c.direction
        else:
            known = (*cg.FORK_FORWARD_OPTIONS, *cg.COMBINE_OPTIONS, cg.VALID_IN_LIST_OPTION)
            assert all(o in known for o in options), c.direction
    assert {c.direction.split("+")[0] for c in cg.CONFIGS} >= set(cg.FORK_FORWARDS)
    assert any(c.kernel == "FlashAttentionBackwardSm90KV64" for c in cg.CONFIGS)  # 128x64
    shipped_kv64 = "FlashAttentionBackwardSm90Dq2Parts1BuffersProducerTwoCtas"
    assert any(c.kernel == shipped_kv64 for c in cg.CONFIGS)
    assert any(c.kernel == "FlashAttentionForwardSm90TwoCtas" for c in cg.CONFIGS)
    combined = "FlashAttentionForwardSm90TwoCtasQInRegistersCombinedGated"  # vsa-fa4 inference
    assert any(c.kernel == combined for c in cg.CONFIGS)
    assert cg.HEAD_DIM == 128 and cg.DTYPE == "bfloat16"


def test_gate_environment_targets_sm90a_and_disables_caches():
    env = cg.gate_environment()
    assert env["CUTE_DSL_ARCH"] == "sm_90a"
    assert env["FLASH_ATTENTION_ARCH"] == "sm_90"
    assert env["FLASH_ATTENTION_NUM_SMS"] == "132"
    assert env["CUTE_DSL_DISABLE_FILE_CACHING"] == "1"
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
    assert "CUTE_DSL_DUMP_DIR" not in env
    assert cg.gate_environment(dump_dir="/x")["CUTE_DSL_DUMP_DIR"] == "/x"
    with pytest.raises(ValueError, match="arch"):
        cg.gate_environment("sm_80")


def test_select_configs():
    assert cg.select_configs(None) == list(cg.CONFIGS)
    assert [c.name for c in cg.select_configs(["fwd-dense"])] == ["fwd-dense"]
    with pytest.raises(ValueError, match="unknown"):
        cg.select_configs(["fwd-nope"])


def test_run_gate_parses_results_and_keeps_the_callers_environment(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen["cmd"], seen["env"] = cmd, env
        ok = {"name": "fwd-dense", "ok": True, "seconds": 1.5, "kernels": ["K"], "error": None}
        bad = {"name": "bwd-dense", "ok": False, "seconds": 0.5, "kernels": [], "error": "E: x"}
        stdout = "\n".join(
            [
                "noise from upstream",
                cg.ENV_PREFIX + json.dumps({"versions": {"a": "1"}, "import_seconds": 9.0}),
                cg.RESULT_PREFIX + json.dumps(ok),
                cg.RESULT_PREFIX + json.dumps(bad),
                cg.RESULT_PREFIX + '{"name": "fwd-sparse-q64-kv64", "ok": tr',  # cut short
            ]
        )
        return subprocess.CompletedProcess(cmd, -11, stdout, "Segmentation fault\n")

    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(cg.subprocess, "run", fake_run)
    dump_dir = tmp_path / "not" / "yet"
    report = cg.run_gate(["fwd-dense", "bwd-dense", "fwd-sparse-q64-kv64"], dump_dir=str(dump_dir))
    assert dump_dir.is_dir()  # made for CuTe DSL, which would keep nothing otherwise
    assert seen["env"]["CUTE_DSL_DUMP_DIR"] == str(dump_dir)

    assert seen["env"]["CUTE_DSL_ARCH"] == "sm_90a"
    assert "CUTE_DSL_ARCH" not in os.environ
    assert seen["cmd"][1:4] == ["-m", "flash_attn_vsa.compile_gate", "--worker"]
    assert [r.name for r in report.results] == ["fwd-dense", "bwd-dense", "fwd-sparse-q64-kv64"]
    assert [r.ok for r in report.results] == [True, False, False]
    assert report.results[2].error == "gate process ended (exit -11): Segmentation fault"
    assert report.versions == {"a": "1"} and report.import_seconds == 9.0
    assert not report.ok
    text = cg.format_report(report)
    assert "1/3 configurations compiled" in text and "Segmentation fault" in text
    assert json.loads(json.dumps(report.to_json()))["ok"] is False


def test_counting_compile_names_kernel_classes():
    class FlashKernel:
        def __call__(self):
            pass

    def plain():
        pass

    counter = cg._CountingCompile(lambda fn, *a, **k: ("compiled", fn))
    kernel = FlashKernel()
    assert counter(kernel, 1, options="x") == ("compiled", kernel)
    counter(kernel.__call__)
    counter(plain)
    assert counter.compiled == ["FlashKernel", "FlashKernel", "plain"]


def test_worker_refuses_to_run_without_its_environment(monkeypatch, capsys):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    assert cg.main(["--worker", "-c", "fwd-dense"]) == 2
    assert "needs" in capsys.readouterr().err


def test_list(capsys):
    assert cg.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in cg.CONFIGS)


@pytest.mark.slow
@pytest.mark.skipif(upstream_version() is None, reason="flash-attn-4 is not installed")
def test_every_configuration_compiles_for_sm90a_without_a_gpu():
    before = {k: v for k, v in os.environ.items() if k.startswith(("CUTE_DSL", "FLASH_ATT"))}
    report = cg.run_gate()
    print(cg.format_report(report))
    assert report.ok, cg.format_report(report)
    for config, result in zip(cg.CONFIGS, report.results, strict=True):
        assert result.name == config.name
        assert config.kernel in result.kernels, result
    after = {k: v for k, v in os.environ.items() if k.startswith(("CUTE_DSL", "FLASH_ATT"))}
    assert after == before

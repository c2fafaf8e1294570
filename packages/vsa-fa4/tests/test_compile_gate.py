"""The adapter's FA4 calls compile for sm_90a on a CPU (fake CUDA tensors, no GPU).

Slow (about 28 s on a 2-core CPU: a 6-9 s import of upstream, then 3-7 s per kernel), so the
test compiles one configuration per schedule and direction; ``python -m
vsa_fa4.compile_gate`` compiles them all (six kernels, about 36 s).
"""

from __future__ import annotations

import os

import pytest

from flash_attn_vsa import upstream_version
from vsa_fa4 import compile_gate as gate
from vsa_fa4.schedule import make_plan

TESTED = [
    "fwd-64x64",
    "fwd-64x64-combined",
    "fwd-64x64-paired",
    "fwd-256x256",
    "bwd-128x128",
    "bwd-64x64",
    "bwd-64x64-paired",
    "fwd-128x128-full",
]


def test_configurations_match_their_plans():
    assert set(TESTED) <= {c.name for c in gate.CONFIGS}
    for config in gate.CONFIGS:
        num_q = gate.SEQLEN // config.block_shape[0]
        plan = make_plan(config.block_shape, 2, num_q, config.schedule)
        assert plan.block_size == config.physical, config.name
        if config.direction == "bwd":
            # upstream's sm_90 backward takes 128-token keys, the fork's kernel 64-token ones
            fork = config.kernel != "FlashAttentionBackwardSm90"
            assert config.physical[1] == (64 if fork else 128), config.name
    with pytest.raises(ValueError, match="unknown"):
        gate.select_configs(["fwd-nope"])


def test_worker_refuses_to_run_without_its_environment(monkeypatch, capsys):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    assert gate.main(["--worker", "-c", "fwd-64x64"]) == 2
    assert "needs" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(upstream_version() is None, reason="flash-attn-4 is not installed")
def test_adapter_compiles_for_sm90a_without_a_gpu():
    before = {k: v for k, v in os.environ.items() if k.startswith(("CUTE_DSL", "FLASH_ATT"))}
    report = gate.run_gate(TESTED)
    print(gate.format_report(report))
    assert report.ok, gate.format_report(report)
    for name, result in zip(TESTED, report.results, strict=True):
        config = gate.select_configs([name])[0]
        assert result.name == name
        expected = config.kernel + ("+mask_mod" if config.masked else "")
        assert expected in result.kernels, result
        assert config.masked or f"{config.kernel}+mask_mod" not in result.kernels, result
    after = {k: v for k, v in os.environ.items() if k.startswith(("CUTE_DSL", "FLASH_ATT"))}
    assert after == before

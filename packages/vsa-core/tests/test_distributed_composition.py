"""Sequence parallelism composed with data parallelism: 4 gloo processes as a 2 x 2 mesh
(`sp_dp_worker.py`): outputs and all-reduced weight gradients equal one process's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_distributed import run_ranks

WORKER = Path(__file__).resolve().parent / "sp_dp_worker.py"
WORLD, SP = 4, 2

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def test_data_parallel_times_sequence_parallel_matches_one_process(tmp_path):
    args = ["--init-file", str(tmp_path / "rendezvous"), "--sp", str(SP)]
    text = run_ranks(WORKER, args, WORLD)
    for rank in range(WORLD):
        assert f"rank {rank}: gloo, world {WORLD}, data-parallel 2 x sequence-parallel 2" in text
        assert f"rank {rank}: OK" in text, text

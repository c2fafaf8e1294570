"""Sequence parallelism composed with data parallelism: 4 gloo processes as a 2 x 2 mesh
(`sp_dp_worker.py`): outputs and all-reduced weight gradients equal one process's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import TIMEOUT_S, _worker_env

WORKER = Path(__file__).resolve().parent / "sp_dp_worker.py"
WORLD, SP = 4, 2

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def test_data_parallel_times_sequence_parallel_matches_one_process(tmp_path):
    store = tmp_path / "rendezvous"
    command = [sys.executable, str(WORKER), "--init-file", str(store), "--sp", str(SP)]
    procs = [
        subprocess.Popen(
            [*command, "--rank", str(rank), "--world-size", str(WORLD)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_worker_env(),
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                outputs.append(proc.communicate()[0])
    text = "\n".join(outputs)
    assert all(p.returncode == 0 for p in procs), text
    for rank in range(WORLD):
        assert f"rank {rank}: gloo, world {WORLD}, data-parallel 2 x sequence-parallel 2" in text
        assert f"rank {rank}: OK" in text, text

"""Sequence-parallel VSA on two CUDA GPUs over NCCL, against the single-GPU op.

Runs ``torchrun --standalone --nproc-per-node=2 sp_worker.py --suite gpu``: on each rank, bf16
latents with partial tiles (up to 13x24x40, 8 heads, D=128, batch 1 and 2, BSHD and BHSD, full
and replicated coarse gates, with and without autograd); the rank's shard of the output and of
the q, k, v and gate gradients is compared with `video_sparse_attn` on the full inputs on the
same GPU (relative L2 error <= 1e-2 for the output, 2e-2 for gradients). The fine backend is
``auto`` (Triton where it accepts the call; the worker logs its pick) and ``reference``.

    uv run pytest -m gpu packages/vsa-core/tests/test_distributed_gpu.py -s
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parent / "sp_worker.py"
WORLD = 2
TIMEOUT_S = 900

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
        reason=f"needs {WORLD} CUDA devices",
    ),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
        reason="needs torch.distributed with NCCL",
    ),
]


def run_torchrun(worker: Path, args: list[str], world: int = WORLD) -> str:
    """``torchrun --standalone`` of ``worker`` on ``world`` local GPUs (NVLink multicast off);
    its output, after checking the exit status."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # No NVLink multicast (NVLS): this test needs plain NCCL all-to-all only.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={world}", str(worker), *args]
    result = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=TIMEOUT_S
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout
    return result.stdout


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_two_gpus_match_the_single_gpu_op(backend):
    text = run_torchrun(WORKER, ["--suite", "gpu", "--backend", backend])
    for rank in range(WORLD):
        assert f"rank {rank}: OK" in text, text
        # Issue 21, row 10: this test once ran gloo on the CPU; NCCL on rank r's own GPU now.
        first = next(ln for ln in text.splitlines() if ln.startswith(f"rank {rank}: "))
        assert first == f"rank {rank}: nccl, world {WORLD}, cuda:{rank}, backend {backend}", first
    assert "FAIL" not in text

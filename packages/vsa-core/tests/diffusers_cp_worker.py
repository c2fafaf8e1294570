"""One rank of the check of VSA under diffusers' Ulysses context parallelism; not a pytest module.

Every rank builds the same tiny random-weight diffusers WanTransformer3DModel twice: one plain
(the reference: `enable_vsa` on one process) and one with ``enable_parallelism`` (Ulysses over
the ranks) and `enable_vsa`, in both orders of the two calls, and compares their outputs in
float64; after `disable_vsa`, the parallel model's output with the plain dense model's. Prints
``rank R: OK`` or exits 1. CPU, gloo (what test_integration_diffusers.py launches, one process
per rank)::

    python diffusers_cp_worker.py --init-file /tmp/store --rank 0 --world-size 2 &
    python diffusers_cp_worker.py --init-file /tmp/store --rank 1 --world-size 2

Two GPUs, NCCL, bf16 with ``backend="auto"`` (what test_integration_diffusers_gpu.py launches)::

    torchrun --standalone --nproc-per-node=2 diffusers_cp_worker.py --suite gpu
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Suite:
    """What one suite runs: the CPU's float64 model on gloo (reference backend, exact), or a
    bf16 model on each rank's GPU over NCCL (``auto``, relative L2 against one GPU)."""

    device: str
    dtype: torch.dtype
    heads: int
    head_dim: int
    latent: tuple[int, int, int]  # frames, height, width before patching (1 x 2 x 2)
    tile: tuple[int, int, int]
    backend: str
    tolerance: float


SUITES = {
    # token grid 4 x 5 x 3 = 60 tokens (30 a rank), 2x2x2 tiles partial along two axes
    "cpu": Suite("cpu", torch.float64, 2, 16, (4, 10, 6), (2, 2, 2), "reference", 1e-10),
    # token grid 5 x 10 x 12 = 600 tokens, 4x4x4 tiles partial along two axes
    "gpu": Suite("cuda", torch.bfloat16, 4, 64, (5, 20, 24), (4, 4, 4), "auto", 2e-2),
}


def tiny_wan(suite: Suite, device: torch.device):
    import diffusers

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=suite.heads, attention_head_dim=suite.head_dim,
        in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, rope_max_seq_len=64,
    )  # fmt: skip
    return model.to(device, suite.dtype).eval()


def inputs(suite: Suite, device: torch.device):
    # a per-token timestep (Wan 2.2's form): diffusers 0.42.1's context-parallel hook fails on a
    # 1-D one (its warning path calls a logger method that does not exist)
    gen = torch.Generator().manual_seed(1)
    frames, height, width = suite.latent
    latent = torch.randn(1, 4, frames, height, width, generator=gen, dtype=torch.float64)
    text = torch.randn(1, 8, 16, generator=gen, dtype=torch.float64)
    tokens = frames * (height // 2) * (width // 2)
    return (
        latent.to(device, suite.dtype),
        torch.full((1, tokens), 500, device=device),
        text.to(device, suite.dtype),
    )


def error(got: torch.Tensor, want: torch.Tensor, suite: Suite) -> float:
    """Max abs error (float64) or relative L2 error (bf16)."""
    got, want = got.double(), want.double()
    if suite.dtype == torch.float64:
        return (got - want).abs().max().item()
    return ((got - want).norm() / want.norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    ap.add_argument("--init-file", help="gloo rendezvous file (cpu); torchrun's env for gpu")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world-size", type=int)
    args = ap.parse_args()
    suite = SUITES[args.suite]
    timeout = datetime.timedelta(seconds=300)
    if suite.device == "cuda":  # under torchrun: RANK, WORLD_SIZE, LOCAL_RANK in the environment
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group(
            "gloo", init_method=f"file://{args.init_file}", rank=args.rank,
            world_size=args.world_size, timeout=timeout,
        )  # fmt: skip
        device = torch.device("cpu")
        # diffusers picks a device as rank % accelerator count, which is 0 on a CPU machine
        torch.accelerator.device_count = lambda: 1
    rank, world = dist.get_rank(), dist.get_world_size()
    print(
        f"rank {rank}: {dist.get_backend()}, world {world}, {device}, {suite.backend}", flush=True
    )
    from diffusers import ContextParallelConfig

    from vsa_core.integrations.diffusers import disable_vsa, enable_vsa

    def run(model):
        with torch.no_grad():
            return model(*inputs(suite, device), return_dict=False)[0]

    failures = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = error(got, want, suite)
        print(f"rank {rank}: {what}: err {err:.3e}", flush=True)
        if not err < suite.tolerance:
            failures.append(f"{what}: err {err:.3e} >= {suite.tolerance:.0e}")

    vsa = dict(sparsity=0.5, tile=suite.tile, backend=suite.backend, coarse="add")
    try:
        reference = tiny_wan(suite, device)
        dense = run(reference)
        enable_vsa(reference, **vsa)
        want = run(reference)
        for order in ("parallel first", "vsa first"):
            model = tiny_wan(suite, device)
            config = ContextParallelConfig(ulysses_degree=world)
            if order == "parallel first":
                model.enable_parallelism(config=config)
                enable_vsa(model, **vsa)
            else:
                enable_vsa(model, **vsa)
                model.enable_parallelism(config=config)
            check(order, run(model), want)
            # diffusers' own processors again, still context-parallel: the dense model's output
            disable_vsa(model)
            check(f"{order}, disabled", run(model), dense)
    except Exception:
        failures.append(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    for failure in failures:
        print(f"rank {rank}: FAIL {failure}", flush=True)
    if failures:
        return 1
    print(f"rank {rank}: OK", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Leave without interpreter teardown: diffusers' device mesh keeps process-group objects
    # alive past destroy_process_group, and destroying them at exit once aborted a rank that had
    # printed OK ("terminate called without an active exception", a CI run of session 15).
    os._exit(code)

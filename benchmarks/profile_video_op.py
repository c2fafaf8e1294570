"""Where the whole op's device time goes: `video_sparse_attn` under torch.profiler, per backend.

For each backend and mode (forward, forward+backward) at one video latent: warm-up, then a few
profiled calls; writes the CUDA kernel table (self device time, top rows) per run and a JSON
summary (device ms per call, split into the fine-attention kernels and everything else). Used
to find why a faster fine kernel does not make a faster op. ::

    python3 benchmarks/profile_video_op.py --shape wan720p --backends fa4 triton --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import bench_common as bc
import bench_video as bv
import torch

from vsa_core import VideoTiling, video_sparse_attn

FINE_KERNEL_MARKS = (
    "flash_attn",
    "fwd_kernel",
    "bwd_delta_kernel",
    "bwd_dkdv_kernel",
    "bwd_dq_kernel",
)
"""Substrings of the fine-attention kernels' names: FA4's CuTe kernels (upstream's and the fork's
carry ``flash_attn`` in their mangled names) and vsa-triton's kernels (named as defined)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="wan720p", help="preset or TxHxW[:heads]")
    ap.add_argument("--backends", nargs="+", default=["fa4", "triton"])
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = bv.parse_shape(args.shape)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = SimpleNamespace(head_dim=128 if cuda else 32, batch=1, seed=0, coarse_gate=True,
                          dtype=torch.bfloat16 if cuda else torch.float32)  # fmt: skip
    tiling = VideoTiling(shape.latent, (4, 4, 4))
    topk = bv.topk_for(args.sparsity, tiling.num_tiles)
    inputs = bv.make_op_inputs(cfg, tiling, shape.heads, device)
    header = bc.gpu_result_header("profile_video_op") if cuda else {}
    summary = {**header, "command": " ".join(["python3", *sys.argv]), "shape": args.shape,
               "heads": shape.heads, "topk": topk, "runs": []}  # fmt: skip
    kind = "CUDA" if cuda else "CPU"
    acts = [getattr(torch.profiler.ProfilerActivity, kind)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for backend in args.backends:
        for mode in args.modes:
            attn = partial(video_sparse_attn, tiling=tiling, topk=topk, backend=backend,
                           validate=False)  # fmt: skip
            runner = bv.attn_runner(inputs, mode, attn)
            for _ in range(3):
                runner.run(runner.setup() if runner.setup else None)
            sync()
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(args.calls):
                    runner.run(runner.setup() if runner.setup else None)
                sync()
            events = prof.key_averages()
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            total = sum(getattr(e, key) for e in events) / 1e3 / args.calls
            fine = sum(
                getattr(e, key) for e in events if any(m in e.key for m in FINE_KERNEL_MARKS)
            ) / 1e3 / args.calls  # fmt: skip
            name = f"{backend}-{mode.replace('+', '_')}"
            table = events.table(sort_by=key, row_limit=args.rows)
            (args.out / f"{name}.kernels.txt").write_text(table)
            run = {"backend": backend, "mode": mode, "ms_per_call": total,
                   "fine_kernels_ms": fine, "other_ms": total - fine}  # fmt: skip
            summary["runs"].append(run)
            print(json.dumps(run), flush=True)
    (args.out / "profile_video_op.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

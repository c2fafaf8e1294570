"""Where the whole op's device time goes: `video_sparse_attn` under torch.profiler, per backend.

For each backend and mode (forward, forward+backward) at one video latent: warm-up, then a few
profiled calls; writes the CUDA kernel table (self device time, top rows) per run and a JSON
summary (device ms per call, split into the fine-attention kernels and everything else). Used
to find why a faster fine kernel does not make a faster op. ::

    python3 benchmarks/profile_video_op.py --shape wan720p --backends fa4 triton --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import bench_report as brep
import bench_video as bv
import torch

from vsa_core import VideoTiling, coarse, video_sparse_attn

FA4_MARK = "flash_attn"
"""A substring of FA4's CuTe kernels' mangled names (upstream's and the fork's)."""
TRITON_FINE_KERNELS = frozenset(
    {"fwd_kernel", "bwd_delta_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel", "rotate_lists_kernel",
     "_dq_from_ds"}
)  # fmt: skip
"""The Triton fine-attention kernels, by exact name: vsa-triton's, and vsa-fa4's dQ pass of
its dS-writing backward (``_dq_from_ds``; counted outside before session 29). Not fine:
the coarse stage's (``pool_fwd_kernel``, ``combine_fwd_kernel``...) and vsa-fa4's list
kernels (``_mark_selected``, ``_rank_selected``...), which build the kernels' lists."""


def is_fine_kernel(name: str) -> bool:
    return FA4_MARK in name or name in TRITON_FINE_KERNELS


def profile_calls(runner, calls: int, activities, sync):
    """Three warm-up calls, then ``calls`` profiled ones; the profiler."""
    for _ in range(3):
        runner.run(runner.setup() if runner.setup else None)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            runner.run(runner.setup() if runner.setup else None)
        sync()
    return prof


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
    ap.add_argument(
        "--selection-chunk-mib",
        type=int,
        nargs="+",
        help="run once per value with vsa_core.coarse.SELECTION_CHUNK_BYTES set to it (the "
        "score memory per head group of the top-k selection; fewer, larger groups launch fewer "
        "kernels); default: the library's value only",
    )
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
    header = brep.gpu_result_header("profile_video_op") if cuda else {}
    summary = {**header, "command": " ".join(["python3", *sys.argv]), "shape": args.shape,
               "heads": shape.heads, "topk": topk, "runs": []}  # fmt: skip
    kind = "CUDA" if cuda else "CPU"
    acts = [getattr(torch.profiler.ProfilerActivity, kind)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    library_chunk = coarse.SELECTION_CHUNK_BYTES
    for backend, mode, chunk_mib in itertools.product(
        args.backends, args.modes, args.selection_chunk_mib or [None]
    ):
        chunk = library_chunk if chunk_mib is None else chunk_mib << 20
        attn = partial(video_sparse_attn, tiling=tiling, topk=topk, backend=backend,
                       validate=False)  # fmt: skip
        coarse.SELECTION_CHUNK_BYTES = chunk
        try:
            prof = profile_calls(bv.attn_runner(inputs, mode, attn), args.calls, acts, sync)
        finally:
            coarse.SELECTION_CHUNK_BYTES = library_chunk
        events = prof.key_averages()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        total = sum(getattr(e, key) for e in events) / 1e3 / args.calls
        fine = sum(
            getattr(e, key) for e in events if is_fine_kernel(e.key)
        ) / 1e3 / args.calls  # fmt: skip
        name = f"{backend}-{mode.replace('+', '_')}"
        if chunk_mib is not None:
            name += f"-selection{chunk_mib}mib"
        (args.out / f"{name}.kernels.txt").write_text(
            events.table(sort_by=key, row_limit=args.rows)
        )
        run = {"backend": backend, "mode": mode, "ms_per_call": total, "fine_kernels_ms": fine,
               "other_ms": total - fine, "selection_chunk_bytes": chunk}  # fmt: skip
        summary["runs"].append(run)
        print(json.dumps(run), flush=True)
    (args.out / "profile_video_op.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which allocations make the op's peak: `video_sparse_attn` once under the CUDA allocator's
history, then the tensors alive at the peak (beyond the inputs), each with the innermost frame
of this repository's code that allocated it. Used to explain a peak that is a multiple of dense
attention's (bench_video's ``peak MiB`` column). ::

    python3 -m research.op_memory_breakdown --shape wan480p --backends fa4 triton --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from research.harness import benchmark_module
from vsa_core import VideoTiling, video_sparse_attn

bv = benchmark_module("bench_video")

OWN_CODE = ("vsa_core", "vsa_fa4", "vsa_triton", "flash_attn_vsa", "flash_attn")


def where(frames) -> str:
    """The innermost frame in our (or FA4's) code, else the innermost frame."""
    for f in frames:
        if any(part in f["filename"] for part in OWN_CODE):
            return f"{f['filename'].split('/src/')[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def live_at_peak(trace) -> tuple[int, list[tuple[int, str]]]:
    """Replay the allocator's trace: the largest live total and what was alive then."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return peak, at_peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="wan480p")
    ap.add_argument("--backends", nargs="+", default=["fa4", "triton"])
    ap.add_argument("--modes", nargs="+", default=["fwd"])
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = bv.parse_shape(args.shape)
    cfg = SimpleNamespace(head_dim=128, batch=1, seed=0, coarse_gate=True, dtype=torch.bfloat16)
    tiling = VideoTiling(shape.latent, (4, 4, 4))
    topk = bv.topk_for(args.sparsity, tiling.num_tiles)
    inputs = bv.make_op_inputs(cfg, tiling, shape.heads, torch.device("cuda"))
    report = []
    for backend in args.backends:
        for mode in args.modes:
            attn = partial(video_sparse_attn, tiling=tiling, topk=topk, backend=backend,
                           validate=False)  # fmt: skip
            runner = bv.attn_runner(inputs, mode, attn)
            for _ in range(2):  # compile and warm the caches outside the record
                runner.run(runner.setup() if runner.setup else None)
            torch.cuda.synchronize()
            arg = runner.setup() if runner.setup else None
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            runner.run(arg)
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak, alive = live_at_peak(snap["device_traces"][torch.cuda.current_device()])
            by_site: dict[str, list[int]] = {}
            for size, site in alive:
                by_site.setdefault(site, []).append(size)
            rows = sorted(((sum(s), len(s), site) for site, s in by_site.items()), reverse=True)
            sites = [{"mib": b / 2**20, "count": n, "site": s} for b, n, s in rows]
            entry = {"backend": backend, "mode": mode, "peak_mib": peak / 2**20, "sites": sites}
            report.append(entry)
            print(f"== {backend} {mode}: peak {peak / 2**20:.1f} MiB beyond the inputs")
            for b, n, s in rows[:15]:
                print(f"  {b / 2**20:8.1f} MiB  x{n:<3d} {s}")
    (args.out / "op_memory_breakdown.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

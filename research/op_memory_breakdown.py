"""Which allocations make the op's peak: `video_sparse_attn` once under the CUDA allocator's
history, then the tensors alive at the peak (beyond the inputs), each with the innermost frame
of this repository's code that allocated it. Used to explain a peak that is a multiple of dense
attention's (bench_video's ``peak MiB`` column). ::

    python3 -m research.op_memory_breakdown --shape wan480p --backends fa4 triton --out DIR
"""

from __future__ import annotations

import json
import sys

import torch

from .op_host_profile import op_arguments

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
    args, make_runner = op_arguments(argv, ["fwd"])
    report = []
    for backend in args.backends:
        for mode in args.modes:
            runner = make_runner(backend, mode)
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

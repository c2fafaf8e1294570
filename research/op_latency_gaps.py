"""Where a call waited for loses to calls back to back: the device's idle time inside one
`video_sparse_attn` call made right after a synchronize, from a torch.profiler trace.

`bench_video` times every arm two ways. Back to back, the host runs ahead and the device never
waits: the time is the device's. Called once and waited for, the device also waits (a) from the
call until its first kernel starts (the Python up to the first launch), (b) between kernels
where the host had not yet launched the next one when the previous one ended, and (c) from its
last kernel's end until the synchronize returns. Host time spent while the device is busy costs
nothing in either view; only (a), (b) and (c) separate them. At Wan 2.1 480p training on an H200
(session 29) the two views gave 3.17x and 3.95x over dense FA4: about 2 ms a call of waiting.

This puts each idle stretch of the device on the launch that ended it: the kernel that started
after it and whether the host launched that kernel after the previous one ended (``host``: the
device waited for the host) or before (``device``: launch latency or a stream dependency). With
``--stacks`` each launch is also put on the op's innermost Python function around it (Python
tracing slows the host, so the gaps are then larger than without it: attribute with it, size
without it). ::

    python3 -m research.op_latency_gaps --shapes wan480p --backends fa4 --modes fwd fwd+bwd \\
        --calls 5 --out $OUT/latency_gaps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memset", "gpu_memcpy"})
"""Trace categories of work that occupies the device."""
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
"""Trace categories of host API calls; a launch shares its device event's ``correlation``."""
SYNC_NAMES = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"})
CALL_MARK = "vsa_call"
"""The ``record_function`` range around the profiled call."""
OWN_PACKAGES = ("vsa_core", "vsa_fa4", "vsa_triton", "flash_attn_vsa")
"""Python functions of these packages name a launch's issuer (``--stacks``)."""


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _issuer(launch: dict, frames: list[dict]) -> str | None:
    """The innermost of our packages' Python functions on the launch's thread whose range holds
    the launch (``frames``: ``python_function`` events)."""
    best = None
    for f in frames:
        if f["tid"] != launch["tid"] or not any(p in f["name"] for p in OWN_PACKAGES):
            continue
        holds = f["ts"] <= launch["ts"] <= f["ts"] + f["dur"]
        if holds and (best is None or f["ts"] >= best["ts"]):
            best = f
    return None if best is None else best["name"]


def idle_gaps(events: list[dict], host_slack_us: float = 2.0) -> dict:
    """The device's idle stretches in one profiled call (Chrome-trace ``events`` of a profile
    holding one ``CALL_MARK`` range and the synchronize after it): a summary and one row per
    device event that followed an idle stretch. ``wall_us`` (the call's start to the
    synchronize's return) is ``first_kernel_us + device_busy_us + idle_host_us +
    idle_device_us + tail_us``. A stretch is ``host`` when the launch call of
    the work after it returned later than ``host_slack_us`` before the previous work ended (the
    device was idle because nothing was queued), else ``device``."""
    complete = [e for e in events if e.get("ph") == "X"]
    (call,) = [
        e for e in complete if e.get("name") == CALL_MARK and e.get("cat") != "gpu_user_annotation"
    ]
    work = sorted((e for e in complete if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not work:
        raise ValueError("the trace holds no device work: profile with CUDA activities")
    launches = {
        e["args"]["correlation"]: e
        for e in complete
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    syncs = [e for e in complete if e.get("name") in SYNC_NAMES and e["ts"] >= call["ts"]]
    frames = [e for e in complete if e.get("cat") == "python_function"]
    call_start = call["ts"]
    sync_end = max((s["ts"] + s["dur"] for s in syncs), default=work[-1]["ts"] + work[-1]["dur"])
    rows, busy, idle = [], 0.0, defaultdict(float)
    previous_end = work[0]["ts"]  # the stretch before the first kernel is ``first_kernel_us``
    for item in work:
        start, end = item["ts"], item["ts"] + item["dur"]
        gap = start - previous_end
        launch = launches.get(item.get("args", {}).get("correlation"))
        launched_end = None if launch is None else launch["ts"] + launch["dur"]
        if gap > 0:
            late = launched_end is not None and launched_end > previous_end - host_slack_us
            kind = "host" if late else "device"
            idle[kind] += gap
            row = {"before": _short(item["name"]), "idle_us": round(gap, 1), "kind": kind,
                   "launch_returned_us": None if launched_end is None
                   else round(launched_end - call_start, 1),
                   "start_us": round(start - call_start, 1)}  # fmt: skip
            if frames and launch is not None:
                row["issued_by"] = _issuer(launch, frames)
            rows.append(row)
        busy += max(0.0, end - max(start, previous_end))
        previous_end = max(previous_end, end)
    first = work[0]["ts"] - call_start
    tail = sync_end - previous_end
    return {
        "wall_us": round(sync_end - call_start, 1),
        "device_busy_us": round(busy, 1),
        "first_kernel_us": round(first, 1),
        "idle_host_us": round(idle["host"], 1),
        "idle_device_us": round(idle["device"], 1),
        "tail_us": round(tail, 1),
        "call_returned_us": round(call["ts"] + call["dur"] - call_start, 1),
        "work_items": len(work),
        "gaps": rows,
    }


def profile_once(run, stacks: bool) -> list[dict]:
    """One ``run()`` right after a synchronize, then a synchronize, under torch.profiler: the
    Chrome trace's events."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=stacks) as prof:
        # the profiler's first kernel launch requests its activity buffers (~1.7 ms on the
        # H100 host of session 31): spent here, not inside the call
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        with record_function(CALL_MARK):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def _runs(shape: str, backend: str):
    """mode -> a callable making one call of the op at ``shape`` (forward, or forward and
    backward), on `op_host_pieces.op_inputs`."""
    import torch

    from research.harness import benchmark_module
    from research.op_host_pieces import op_inputs
    from vsa_core import video_sparse_attn

    bv = benchmark_module("bench_video")
    tiling, q, k, v, gate = op_inputs(shape, requires_grad=True)
    topk = bv.topk_for(0.875, tiling.num_tiles)
    dout = torch.randn_like(q)

    def forward():
        return video_sparse_attn(q, k, v, topk=topk, tiling=tiling, coarse_gate=gate,
                                 backend=backend)  # fmt: skip

    def inference():
        with torch.no_grad():
            forward()

    return {
        "fwd": inference,
        "fwd+bwd": lambda: torch.autograd.grad(forward(), (q, k, v, gate), dout),
    }


def _summary(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: round(statistics.median(r[k] for r in runs), 1) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["wan480p"])
    ap.add_argument("--backends", nargs="+", default=["fa4"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--calls", type=int, default=5, help="profiled calls a cell (medians)")
    ap.add_argument("--stacks", action="store_true", help="name each launch's Python issuer")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)
    from research.harness import command_line

    cells = []
    for shape in args.shapes:
        for backend in args.backends:
            runs = _runs(shape, backend)
            for mode in args.modes:
                for _ in range(3):  # compile, record the replays
                    runs[mode]()
                calls = [idle_gaps(profile_once(runs[mode], args.stacks))
                         for _ in range(args.calls)]  # fmt: skip
                cell = {"shape": shape, "backend": backend, "mode": mode,
                        "median": _summary(calls), "calls": calls}  # fmt: skip
                print(json.dumps({k: cell[k] for k in ("shape", "backend", "mode", "median")}),
                      flush=True)  # fmt: skip
                for row in calls[len(calls) // 2]["gaps"]:
                    print("   ", json.dumps(row))
                cells.append(cell)
    if args.out:
        import torch

        meta = {"command": command_line(), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__}  # fmt: skip
        Path(args.out).write_text(json.dumps({**meta, "cells": cells}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

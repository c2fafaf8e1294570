"""Sweep the Triton selection kernel's `SelectConfig` on a GPU (research: the op ships one).

    python3 research/coarse_stage/sweep_select.py --out select_sweep.json

For each latent (Wan 2.1 480p and 720p, HunyuanVideo 720p with their head counts, 64-token
tiles, 87.5% sparse), the shipped config, the same without (or with) early exit, and two
other query tiles per program (with ``--warps-grid`` also 1 and 2 warps a program), times
``select_with`` on random pooled bf16 tensors (median of CUDA-event timings over back-to-back
calls) and checks that every config picks the same tiles as the shipped one.

``--rank-apart`` (session 32) sweeps instead the ranking in a kernel of its own, one, two or
four warps a row, behind score programs of 16, 32 or 64 query tiles, against the fused ranking
(``FUSED``, shipped before session 32),
and also times each config as the op calls it in inference (``op_ms``: the lists split for
64-token tiles and the coarse attention from the same scores, `_launch_select`), its outputs
checked against the shipped config's. ``ms`` and ``op_ms`` time one call waited for (the
host's launch included); ``op_graph_ms`` is the device time (CUDA-graph replay), and
``op_scores_graph_ms`` that of the score kernel alone (the ranking's launch skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from vsa_core import VideoTiling
from vsa_triton.coarse import SELECT, _launch_select, select_with

FUSED = dataclasses.replace(SELECT, rank_apart=False, block_m=16)
"""The selection as it shipped before session 32: ranked inside the score programs."""

LATENTS = {"wan480p": ((21, 30, 52), 12), "wan720p": ((21, 45, 80), 40),
           "hunyuan720p": ((33, 45, 80), 24)}  # fmt: skip


def _time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, reps: int) -> float:
    """Device time of one ``fn()``: ``reps`` calls captured in one CUDA graph, replayed between
    two events (the host's launch time and its waits left out), per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@contextlib.contextmanager
def _scores_only():
    """`_launch_select` without the ranking kernel's launch (a rank-apart config then times
    its score kernel alone: the scores and the coarse attention)."""
    from vsa_triton import coarse, coarse_kernels

    launch = coarse.launch
    coarse.launch = lambda kernel, *a, **k: (
        None if kernel is coarse_kernels.rank_rows_kernel else launch(kernel, *a, **k)
    )
    try:
        yield
    finally:
        coarse.launch = launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("select_sweep.json"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--latents", nargs="+", choices=sorted(LATENTS), default=sorted(LATENTS))
    ap.add_argument("--warps-grid", action="store_true",
                    help="also 1 and 2 warps a program (session 29: the bisection's reductions "
                         "then stay within a warp or two) at 4, 8, 16 and 32 query tiles a "
                         "program and 1024 or 2048 elements a step")  # fmt: skip
    ap.add_argument("--rank-apart", action="store_true",
                    help="instead: the ranking in a kernel of its own (SelectConfig.rank_apart) "
                         "at 16, 32 and 64 query tiles a score program, 1, 2 and 4 warps a row, "
                         "against the fused ranking; each also timed as the op's inference "
                         "call")  # fmt: skip
    args = ap.parse_args()
    rows = []
    for name in args.latents:
        latent, heads = LATENTS[name]
        tiling = VideoTiling(latent, (4, 4, 4))
        valid = tiling.valid_sizes("cuda")
        n = tiling.num_tiles
        gen = torch.Generator(device="cuda").manual_seed(0)
        qp, kp = (torch.randn(1, n, heads, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
                  for _ in range(2))  # fmt: skip
        topk = max(1, round(n * 0.125))
        want = select_with(qp, kp, valid, topk, SELECT)
        configs = [SELECT, dataclasses.replace(SELECT, early_exit=not SELECT.early_exit)] + [
            dataclasses.replace(SELECT, block_m=block_m) for block_m in (4, 8)
        ]
        if args.warps_grid:
            configs += [
                dataclasses.replace(
                    SELECT, num_warps=warps, block_m=block_m, elements_per_step=elements
                )
                for warps in (1, 2)
                for block_m in (4, 8, 16, 32)
                for elements in (1024, 2048)
            ]
        if args.rank_apart:  # against the fused ranking alone (compile time)
            configs = [FUSED] + [
                dataclasses.replace(SELECT, rank_apart=True, block_m=block_m, rank_warps=warps)
                for block_m in (16, 32, 64)
                for warps in (1, 2, 4)
            ]
        vp = torch.randn_like(qp)
        want_op = _launch_select(qp, kp, valid, topk, SELECT, 64, vp, 0.088, True)
        for config in configs:
            got = select_with(qp, kp, valid, topk, config)
            call = (qp, kp, valid, topk, config)
            ms = _time_ms(lambda call=call: select_with(*call), args.reps)
            row = {"latent": name, "tiles": n, "heads": heads, "topk": topk,
                   **dataclasses.asdict(config), "ms": round(ms, 4),
                   "same_as_shipped": bool(torch.equal(got, want))}  # fmt: skip
            if args.rank_apart:
                op_call = (qp, kp, valid, topk, config, 64, vp, 0.088, True)
                out, split, coarse = _launch_select(*op_call)
                op = lambda c=op_call: _launch_select(*c)  # noqa: E731
                row["op_ms"] = round(_time_ms(op, args.reps), 4)
                row["op_graph_ms"] = round(graph_ms(op, args.reps), 4)
                if config.rank_apart:
                    with _scores_only():
                        row["op_scores_graph_ms"] = round(graph_ms(op, args.reps), 4)
                row["op_same_as_shipped"] = bool(
                    torch.equal(out, want_op[0])
                    and all(torch.equal(a, b) for a, b in zip(split, want_op[1], strict=True))
                    and torch.equal(coarse, want_op[2])
                )
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

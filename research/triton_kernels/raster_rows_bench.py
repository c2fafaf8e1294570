"""The Triton attention kernels on raster-order tensors (rows through the tiling's map) against
the same kernels on tile-order copies, at Wan 2.1 latents, on a GPU.

Arms, timed back to back (CUDA events) and interleaved round by round so that all run at the
same clock: ``fwd_tiled`` (`forward_impl` on the tiled copies), ``fwd_raster``
(`forward_rows_impl`), ``fwd_combined_raster`` (with the fused combine), ``bwd_tiled`` and
``bwd_raster``; the raster results are first checked bitwise against the tiled ones. 87.5%
random top-k lists over the tiles, bf16, D=128. At commit e450f8a the script also timed
`ForwardConfig.row_ahead` 0 / 2 and a pattern mode for full tiles (one scalar per tile plus a
loop-invariant row pattern); both were slower than the shipped one-ahead map loads and were
removed (`benchmarks/results/2026-12-02-h200-raster_rows_bench-*.json`).
Needs only torch and triton on the host (no CuTe bundle)::

    PYTHONPATH=packages/vsa-core/src:packages/vsa-triton/src:. \\
        python3 -m research.triton_kernels.raster_rows_bench --out $OUT/raster_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from vsa_core import BlockSparseLayout, VideoTiling
from vsa_triton import ops

from .. import harness

SHAPES = {"wan480p": ((21, 30, 52), 12), "wan720p": ((21, 45, 80), 40)}


def _arms(tiling, heads, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, tiling.seq_len, heads, 128)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))  # fmt: skip
    n = tiling.num_tiles
    topk = max(1, round(0.125 * n))
    scores = torch.rand(1, heads, n, n, device="cuda", generator=gen)
    layout = BlockSparseLayout.from_topk(
        torch.topk(scores, topk, dim=-1).indices, tiling.valid_sizes("cuda"), (64, 64)
    )
    lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
    rows = tiling.indices("cuda").slot_rows
    tq, tk, tv, tdout = (tiling.to_tiles(t) for t in (q, k, v, dout))
    coarse = torch.randn(1, n, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 128**-0.5
    out_t, lse_t = ops.forward_impl(tq, tk, tv, *lists, scale, 64, 64)
    out_r, lse_r = ops.forward_rows_impl(q, k, v, *lists, rows, scale, 64, 64)
    arms = {
        "fwd_tiled": lambda: ops.forward_impl(tq, tk, tv, *lists, scale, 64, 64),
        "fwd_raster": lambda: ops.forward_rows_impl(q, k, v, *lists, rows, scale, 64, 64),
        "fwd_combined_raster": lambda: ops.forward_combined_impl(
            q, k, v, *lists, rows, coarse, None, scale, 64, 64
        ),
        "bwd_tiled": lambda: ops.backward_impl(
            tdout, tq, tk, tv, out_t, lse_t, *lists, scale, 64, 64
        ),
        "bwd_raster": lambda: ops.backward_rows_impl(
            dout, q, k, v, out_r, lse_r, *lists, rows, scale, 64, 64
        ),
    }
    # the same results from both orders: checked before timing
    assert torch.equal(out_r, tiling.from_tiles(out_t)), "raster forward differs"
    want = ops.backward_impl(tdout, tq, tk, tv, out_t, lse_t, *lists, scale, 64, 64)
    got = ops.backward_rows_impl(dout, q, k, v, out_r, lse_r, *lists, rows, scale, 64, 64)
    for g, w, which in zip(got, want, "qkv", strict=True):
        assert torch.equal(g, tiling.from_tiles(w)), f"raster d{which} differs"
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    events_ms = harness.benchmark_module("bench_timing").events_ms
    rows = []
    for name in args.shapes:
        latent, heads = SHAPES[name]
        arms = _arms(VideoTiling(latent), heads)
        for fn in arms.values():  # compile and warm
            fn()
        times = {arm: [] for arm in arms}
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                times[arm].append(events_ms(arms[arm], args.reps))
        for arm, ts in times.items():
            row = {"shape": name, "arm": arm, "median_ms": statistics.median(ts),
                   "min_ms": min(ts), "max_ms": max(ts)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        meta = {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

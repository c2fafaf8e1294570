"""The Triton attention kernels on raster-order tensors (rows through the tiling's map) against
the same kernels on tile-order copies, at Wan 2.1 latents, on a GPU.

Arms, timed back to back (CUDA events) and interleaved round by round so that all run at the
same clock: ``fwd_tiled`` (`forward_impl` on the tiled copies), ``fwd_raster_aheadN``
(`forward_rows_impl` with the forward's key rows loaded N loop steps before their use,
`ForwardConfig.row_ahead`), ``fwd_raster_pattern`` (full tiles' rows from one scalar and the
tiling's `RasterRows.tile_offsets`, `ForwardConfig.row_pattern`), ``fwd_combined_raster``
(the fused combine, rows as shipped), ``bwd_tiled``, ``bwd_raster_map`` and
``bwd_raster_pattern`` (`BackwardConfig.row_pattern`). Every raster form is first checked
bitwise against the tiled kernels' results. 87.5% random top-k lists over the tiles, bf16, D=128.
Needs only torch and triton on the host (no CuTe bundle)::

    PYTHONPATH=packages/vsa-core/src:packages/vsa-triton/src:. \\
        python3 -m research.triton_kernels.raster_rows_bench --out $OUT/raster_rows.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from vsa_core import BlockSparseLayout, VideoTiling
from vsa_triton import config, ops

SHAPES = {"wan480p": ((21, 30, 52), 12), "wan720p": ((21, 45, 80), 40)}


def _time(fn, reps: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


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
    raster = tiling.indices("cuda").raster_rows
    rows = (raster.slot_rows, raster.tile_offsets)
    tq, tk, tv, tdout = (tiling.to_tiles(t) for t in (q, k, v, dout))
    coarse = torch.randn(1, n, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 128**-0.5
    out_t, lse_t = ops.forward_impl(tq, tk, tv, *lists, scale, 64, 64)
    out_r, lse_r = ops.forward_rows_impl(q, k, v, *lists, *rows, scale, 64, 64)
    fwd_shipped = config.forward_config(64, 64, 128)
    bwd_shipped = config.backward_config(64, 64, 128)
    forwards = {f"ahead{a}": dataclasses.replace(fwd_shipped, row_ahead=a) for a in (0, 1, 2)}
    forwards["pattern"] = dataclasses.replace(fwd_shipped, row_pattern=True)
    backwards = {"map": bwd_shipped, "pattern": dataclasses.replace(bwd_shipped, row_pattern=True)}

    def configured(table, cfg, fn):
        def run():
            table[(64, 64, 128)] = cfg
            try:
                return fn()
            finally:
                table.pop((64, 64, 128), None)

        return run

    def fwd_rows():
        return ops.forward_rows_impl(q, k, v, *lists, *rows, scale, 64, 64)

    def bwd_rows():
        return ops.backward_rows_impl(dout, q, k, v, out_r, lse_r, *lists, *rows, scale, 64, 64)

    arms = {
        "fwd_tiled": lambda: ops.forward_impl(tq, tk, tv, *lists, scale, 64, 64),
        **{
            f"fwd_raster_{n}": configured(config._FORWARD, c, fwd_rows) for n, c in forwards.items()
        },
        "fwd_combined_raster": lambda: ops.forward_combined_impl(
            q, k, v, *lists, *rows, coarse, None, scale, 64, 64
        ),
        "bwd_tiled": lambda: ops.backward_impl(
            tdout, tq, tk, tv, out_t, lse_t, *lists, scale, 64, 64
        ),
        **{
            f"bwd_raster_{n}": configured(config._BACKWARD, c, bwd_rows)
            for n, c in backwards.items()
        },
    }
    # the same results from every form: checked before timing
    want = tiling.from_tiles(out_t)
    for name, cfg in forwards.items():
        got, _ = configured(config._FORWARD, cfg, fwd_rows)()
        assert torch.equal(got, want), f"forward {name} differs"
    want_grads = [tiling.from_tiles(g) for g in ops.backward_impl(
        tdout, tq, tk, tv, out_t, lse_t, *lists, scale, 64, 64)]  # fmt: skip
    for name, cfg in backwards.items():
        grads = configured(config._BACKWARD, cfg, bwd_rows)()
        for g, w, which in zip(grads, want_grads, "qkv", strict=True):
            assert torch.equal(g, w), f"backward {name} d{which} differs"
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
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
                times[arm].append(_time(arms[arm], args.reps))
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

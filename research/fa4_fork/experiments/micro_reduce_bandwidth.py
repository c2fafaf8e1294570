"""Micro-benchmark: how fast can fp32 tiles be added into a dQ-accumulation buffer in L2/HBM?

The sm_90 backward of FA4 (and our KV64 delta) adds a 64 x 128 fp32 dQ tile (32 KB) into a
global fp32 buffer for every visited (key tile, query tile) pair (bulk reduce-adds,
`UBLKRED.G.S.ADD.F32` in its SASS). With 64-token key tiles that is about 6 KB of reduced data
per MFLOP, twice dense's, and ~2.7 TB/s at the measured backward speed (fork NOTES.md). This
script measures what the device sustains for that access pattern: programs add 64 x 128 fp32
tiles into a buffer shaped like FA4's ``dq_accum`` (S x H x 128 fp32) at random query-tile
positions, with Triton's atomic adds (``red.global.add``, element-wise; a proxy for the bulk
reduce, not the same instruction), against a plain store and a non-atomic load-add-store of the
same tiles for scale. Reports GB/s of tile data per mode. ::

    python3 -m research.fa4_fork.experiments.micro_reduce_bandwidth --out DIR   # GPU
    TRITON_INTERPRET=1 python3 -m research.fa4_fork.experiments.micro_reduce_bandwidth \
        --smoke   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from research import harness

bc = harness.bench_common()

TILE_ROWS, HEAD_DIM = 64, 128


@triton.jit
def _add_tiles(acc_ptr, src_ptr, rows_ptr, row_stride, MODE: tl.constexpr,
               ROWS: tl.constexpr, DIM: tl.constexpr):  # fmt: skip
    """Program i adds source tile i (ROWS x DIM fp32) at row ``rows[i]`` of the accumulator:
    MODE 0 atomic add, 1 plain store, 2 load + add + store (not atomic)."""
    i = tl.program_id(0)
    row0 = tl.load(rows_ptr + i)
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, DIM)[None, :]
    tile = tl.load(src_ptr + i * ROWS * DIM + r * DIM + c)
    dst = acc_ptr + (row0 + r) * row_stride + c
    if MODE == 0:
        tl.atomic_add(dst, tile, sem="relaxed")
    elif MODE == 1:
        tl.store(dst, tile)
    else:
        tl.store(dst, tl.load(dst) + tile)


MODES = {"atomic_add": 0, "store": 1, "load_add_store": 2}


def run(seq: int, heads: int, tiles: int, reps: int, device: torch.device) -> list[dict]:
    """Time each mode adding ``tiles`` random 64 x 128 tiles into a [seq * heads, 128] buffer."""
    gen = torch.Generator().manual_seed(0)
    acc = torch.zeros(seq * heads, HEAD_DIM, dtype=torch.float32, device=device)
    src = torch.randn(tiles, TILE_ROWS, HEAD_DIM, generator=gen).to(device)
    # random query tiles of random heads, as a key tile's query list visits them
    rows = torch.randint(0, seq * heads // TILE_ROWS, (tiles,), generator=gen) * TILE_ROWS
    rows = rows.to(torch.int32).to(device)
    out = []
    for name, mode in MODES.items():

        def launch(_, mode=mode):
            _add_tiles[(tiles,)](acc, src, rows, acc.stride(0), MODE=mode, ROWS=TILE_ROWS,
                                 DIM=HEAD_DIM, num_warps=4)  # fmt: skip

        times = bc.time_interleaved({name: (launch, None)}, device, warmup=2, reps=reps)[name]
        ms = statistics.median(times)
        data = tiles * TILE_ROWS * HEAD_DIM * 4
        out.append({"mode": name, "ms": ms, "tile_GBps": data / ms / 1e6, "tiles": tiles,
                    "seq": seq, "heads": heads})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--tiles", type=int, default=200_000, help="tiles added per launch")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.seq, args.heads, args.tiles, args.reps = 256, 1, 8, 1
    records = run(args.seq, args.heads, args.tiles, args.reps, device)
    for rec in records:
        print(json.dumps(rec), flush=True)
    if args.out is not None:
        header = bc.gpu_result_header("micro_reduce_bandwidth") if device.type == "cuda" else {}
        args.out.mkdir(parents=True, exist_ok=True)
        command = harness.command_line()
        result = {**header, "command": command, "results": records}
        (args.out / "micro_reduce_bandwidth.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

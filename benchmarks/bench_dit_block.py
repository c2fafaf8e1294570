"""A DiT-style attention block with VSA, eager vs torch.compile vs CUDA-graph replay.

The block: a linear QKV projection, `video_sparse_attn` in tile order (coarse gate from a
linear projection, as VSA-trained models have), an output projection. Wan 2.1 1.3B's shape by
default (hidden 1536, 12 heads of 128) at its 480p latent. Per mode (inference forward, and a
training step: forward + backward) and per way of running it, the outputs are checked against
eager (bf16 tolerance) before anything is timed, then timed in both views: back to back
(device throughput) and one call waited for (latency). ::

    python3 benchmarks/bench_dit_block.py --latent 21 30 52 --heads 12 --out $OUT/dit_block.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import bench_timing as bt
import torch
from torch import nn

from vsa_core import VideoTiling, video_sparse_attn


class VSABlock(nn.Module):
    """QKV projection -> VSA (tile order) -> output projection."""

    def __init__(self, hidden: int, heads: int, tiling: VideoTiling, topk: int, backend: str):
        super().__init__()
        self.heads, self.tiling, self.topk, self.backend = heads, tiling, topk, backend
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.gate = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).unbind(2)
        gate = self.gate(x).view(batch, seq, self.heads, -1)
        attn = video_sparse_attn(
            q, k, v, tiling=self.tiling, topk=self.topk, coarse_gate=gate, backend=self.backend
        )
        return self.out(attn.reshape(batch, seq, hidden))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latent", type=int, nargs=3, default=[21, 30, 52])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--backends", nargs="+", default=["auto", "fa4", "triton"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    tiling = VideoTiling(tuple(args.latent))
    topk = max(1, round((1 - args.sparsity) * tiling.num_tiles))
    hidden = args.heads * args.head_dim
    x = torch.randn(1, tiling.padded_len, hidden, device="cuda", dtype=torch.bfloat16)
    rows = []
    for backend in args.backends:
        block = VSABlock(hidden, args.heads, tiling, topk, backend).cuda().to(torch.bfloat16)
        compiled = torch.compile(block, fullgraph=True)
        for mode in ("fwd", "train"):
            if mode == "fwd":

                def eager_call(fn=block):
                    with torch.no_grad():
                        return fn(x)

                def compiled_call(fn=compiled):
                    with torch.no_grad():
                        return fn(x)

            else:

                def eager_call(fn=block):
                    out = fn(x)
                    out.float().square().mean().backward()
                    return out

                def compiled_call(fn=compiled):
                    out = fn(x)
                    out.float().square().mean().backward()
                    return out

            ways = {"eager": eager_call, "compile": compiled_call}
            reference = eager_call().detach().clone()
            for way, fn in ways.items():
                row = {"backend": backend, "mode": mode, "way": way}
                try:
                    row["rel_err_vs_eager"] = rel(fn().detach(), reference)
                    row.update(bt.call_views(fn, args.reps, b2b_calls=5))
                except Exception as exc:  # a failure is a finding: record it, go on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
            if mode == "fwd":
                row = {"backend": backend, "mode": mode, "way": "cuda_graph"}
                try:
                    replay, out = bt.cuda_graph(eager_call)
                    replay()
                    row["rel_err_vs_eager"] = rel(out, reference)
                    row.update(bt.call_views(replay, args.reps, b2b_calls=5))
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
            block.zero_grad(set_to_none=True)
    result = {
        "command": " ".join(["python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "latent": args.latent,
        "heads": args.heads,
        "topk": topk,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

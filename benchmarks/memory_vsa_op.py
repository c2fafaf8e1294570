"""Peak extra GPU memory of `video_sparse_attn` against dense attention, inference and training.

"Extra" is what a call allocates beyond its inputs: peak allocated during the call minus the
allocation before it (outputs included, since the caller holds them). Dense attention is
PyTorch SDPA (flash backend) on the real, unpadded tokens; VSA runs on the tile-ordered padded
sequence, the way a model calls it. Also checks that the op makes no host synchronization
(``torch.cuda.set_sync_debug_mode("error")``) when given a tiling.

    python benchmarks/memory_vsa_op.py --out results.json   # Wan 2.1 720p latent, 40 heads
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch
import torch.nn.functional as F

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.backends import AttentionCall, select_backend

MiB = 2**20


def peak_extra(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MiB, result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latent", type=int, nargs=3, default=(21, 45, 80))
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sparsity", type=float, default=0.875)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("memory_vsa_op: needs a CUDA device", file=sys.stderr)
        return 2

    dev, dtype = torch.device("cuda"), torch.bfloat16
    tiling = VideoTiling(tuple(args.latent))
    topk = max(1, round((1 - args.sparsity) * tiling.num_tiles))
    shape = (1, tiling.padded_len, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(3))
    dense_shape = (1, args.heads, tiling.seq_len, args.head_dim)
    dq, dk, dv = (torch.randn(dense_shape, device=dev, dtype=dtype) for _ in range(3))
    gate = torch.randn(shape, device=dev, dtype=dtype)

    def vsa(gate_t=None):
        return video_sparse_attn(
            q, k, v, tiling=tiling, topk=topk, coarse_gate=gate_t, backend=args.backend
        )

    def dense():
        return F.scaled_dot_product_attention(dq, dk, dv)

    rows = {}
    with torch.no_grad():
        vsa(), dense()  # warm-up: caches, cuBLAS/cuDNN workspaces
        torch.cuda.set_sync_debug_mode("error")
        try:
            vsa(gate)
            rows["host_sync_free"] = True
        except RuntimeError as exc:
            rows["host_sync_free"] = f"no: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows["inference_vsa_mib"], out = peak_extra(vsa)
        del out
        rows["inference_vsa_gate_mib"], out = peak_extra(lambda: vsa(gate))
        del out
        rows["inference_dense_mib"], out = peak_extra(dense)
        del out

    for t in (q, k, v, dq, dk, dv, gate):
        t.requires_grad_(True)

    def train(fn):
        def step():
            out = fn()
            out.backward(torch.ones_like(out))
            return None

        return step

    train(lambda: vsa(gate))()  # warm-up
    for t in (q, k, v, dq, dk, dv, gate):
        t.grad = None
    rows["training_vsa_gate_mib"], _ = peak_extra(train(lambda: vsa(gate)))
    for t in (q, k, v, gate):
        t.grad = None  # the grads are part of the extra; free them before the dense run
    train(dense)()
    dq.grad = dk.grad = dv.grad = None
    rows["training_dense_mib"], _ = peak_extra(train(dense))

    rows["inference_ratio"] = rows["inference_vsa_gate_mib"] / rows["inference_dense_mib"]
    rows["training_ratio"] = rows["training_vsa_gate_mib"] / rows["training_dense_mib"]
    call = AttentionCall(dev, dtype, args.head_dim, (tiling.tile_tokens,) * 2, True)
    result = {
        "benchmark": "memory_vsa_op",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        "command": " ".join(sys.argv),
        "latent": args.latent,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "tokens_real": tiling.seq_len,
        "tokens_padded": tiling.padded_len,
        "topk": topk,
        "num_tiles": tiling.num_tiles,
        "backend": select_backend(call, args.backend).name,
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

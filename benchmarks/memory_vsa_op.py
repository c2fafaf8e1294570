"""Peak extra GPU memory of `video_sparse_attn` against dense attention, inference and training.

"Extra" is what a call allocates beyond its inputs: peak allocated during the call minus the
allocation before it (outputs and input gradients included, since the caller holds them).
Dense attention is PyTorch SDPA (flash) on the real tokens and, for comparison, on the padded
tile-order sequence that VSA runs on. VSA runs once per fine backend: the requested one and
``alloc-only``, a stand-in kernel that allocates and saves exactly what a fused kernel would
and computes nothing, so that its row is the memory of the op's own composition (pooling,
coarse stage, selection, combine) plus a kernel's outputs. Also checks that the op makes no
host synchronization (``torch.cuda.set_sync_debug_mode("error")``) when given a tiling.
``--token-order raster`` hands the op raster-order tokens (a diffusers model's) and adds, for
each backend that reads raster order, an arm ``vsa[NAME, in place]`` with
``copy_to_tiles=False``; ``--backends`` may name several backends, ``triton_copies`` among
them (`bench_variants`: the triton backend without raster reading and fused combine).

    python benchmarks/memory_vsa_op.py --out results.json   # Wan 2.1 720p latent, 40 heads
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_report as brep
import bench_timing as bt
from bench_variants import register_variant

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.backends import AttentionCall, Backend, register_backend, select_backend


class _AllocOnlyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        batch, seq, heads, _ = q.shape
        out = torch.zeros_like(q)
        lse = torch.zeros(batch, heads, seq, device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)  # what a fused kernel's backward needs
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class AllocOnlyBackend(Backend):
    """A fine-attention stand-in with a fused kernel's memory footprint and no work."""

    name = "alloc-only"
    priority = -100

    def supports(self, call):
        return None

    def forward(self, q, k, v, layout, scale):
        return _AllocOnlyFn.apply(q, k, v)


def inference(fn):
    def run():
        with torch.no_grad():
            fn()  # the output is freed on return, after the peak was taken

    return run


def training(fn, inputs):
    def run():
        out = fn()
        out.backward(torch.ones_like(out))
        del out
        grads = [t.grad for t in inputs]  # held by the caller until the step ends
        for t in inputs:
            t.grad = None
        del grads

    return run


def measure(fn) -> float:
    fn()  # warm-up: caches, cuBLAS/cuDNN workspaces
    return bt.peak_extra_mib(fn, torch.device("cuda"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latent", type=int, nargs=3, default=(21, 45, 80))
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sparsity", type=float, default=0.875)
    p.add_argument("--backends", nargs="+", default=["auto"])
    p.add_argument("--token-order", choices=("tiled", "raster"), default="tiled")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("memory_vsa_op: needs a CUDA device", file=sys.stderr)
        return 2

    register_backend(AllocOnlyBackend())
    for name in args.backends:
        register_variant(name)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    tiling = VideoTiling(tuple(args.latent))
    topk = max(1, round((1 - args.sparsity) * tiling.num_tiles))
    call = AttentionCall(dev, dtype, args.head_dim, (tiling.tile_tokens,) * 2, True)
    chosen = [select_backend(call, name) for name in args.backends]
    backends = [b.name for b in chosen]
    in_place = [b.name for b in chosen if b.reads_raster and args.token_order == "raster"]
    op_len = tiling.padded_len if args.token_order == "tiled" else tiling.seq_len

    def tensors(seq, layout):
        shape = (1, seq, args.heads, args.head_dim)
        if layout == "bhsd":
            shape = (1, args.heads, seq, args.head_dim)
        return [torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(4)]

    q, k, v, gate = tensors(op_len, "bshd")
    dense_real = tensors(tiling.seq_len, "bhsd")[:3]
    dense_padded = tensors(tiling.padded_len, "bhsd")[:3]

    def vsa(name, copy_to_tiles=True):
        return lambda: video_sparse_attn(
            q, k, v, tiling=tiling, topk=topk, coarse_gate=gate, backend=name,
            token_order=args.token_order, copy_to_tiles=copy_to_tiles,
        )  # fmt: skip

    def dense(qkv):
        return lambda: F.scaled_dot_product_attention(*qkv)

    rows = {}
    with torch.no_grad():
        vsa(backends[0])()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            vsa(backends[0])()
            rows["host_sync_free"] = True
        except RuntimeError as exc:
            rows["host_sync_free"] = f"no: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    arms = {
        **{f"vsa[{name}]": (vsa(name), [q, k, v, gate]) for name in backends},
        **{f"vsa[{name}, in place]": (vsa(name, False), [q, k, v, gate]) for name in in_place},
        "vsa[alloc-only]": (vsa("alloc-only"), [q, k, v, gate]),
        "dense_real_tokens": (dense(dense_real), dense_real),
        "dense_padded_tokens": (dense(dense_padded), dense_padded),
    }
    for arm, (fn, inputs) in arms.items():
        print(f"[memory] {arm}", flush=True)
        rows[arm] = {
            "inference_mib": measure(inference(fn)),
            "training_mib": measure(training(fn, inputs)),
        }
    base = rows["dense_real_tokens"]
    for arm in arms:
        for mode in ("inference", "training"):
            rows[arm][f"{mode}_vs_dense_real"] = rows[arm][f"{mode}_mib"] / base[f"{mode}_mib"]

    result = {
        **brep.gpu_result_header("memory_vsa_op"),
        "versions": brep.runtime_versions(
            {"cuda": torch.version.cuda, "vsa-core": version("vsa-core")}
        ),
        "command": " ".join(sys.argv),
        "dtype": "bfloat16",
        "latent": args.latent,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "tokens_real": tiling.seq_len,
        "tokens_padded": tiling.padded_len,
        "num_tiles": tiling.num_tiles,
        "topk": topk,
        "token_order": args.token_order,
        "coarse_gate": True,
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

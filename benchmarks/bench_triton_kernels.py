"""Triton block-sparse kernels vs dense FlashAttention-4, forward and backward, one H200 run.

B=1, S=32768, H=12, D=128, bf16; one 256-granular random layout (diagonal anchor + random rest,
``--keep`` of the blocks) refined exactly to each block shape, so every shape computes the same
token pairs. Sparse-aware TFLOP/s = 4 * B * H * D * selected token pairs / time (x2.5 for
backward); dense FA4 counts all S^2 pairs. Correctness (relative L2 vs the float32 reference)
is checked before timing. ``--sweep`` also times alternative launch configurations.

    python3 benchmarks/bench_triton_kernels.py --out results.json [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_report as brep

from vsa_core import BlockSparseLayout, block_sparse_attn

SHAPES = ((64, 64), (128, 64), (128, 128))


def bench_ms(fn, reps=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def safe_bench(fn):
    """bench_ms, or None when the configuration cannot run (e.g. out of shared memory)."""
    try:
        return bench_ms(fn)
    except Exception as exc:  # report and go on with the next configuration
        print(f"  configuration failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None


def exact256_layout(seq, heads, keep, seed):
    gen = torch.Generator().manual_seed(seed)
    n = seq // 256
    mask = (torch.rand(1, heads, n, n, generator=gen) < keep) | torch.eye(n, dtype=torch.bool)
    return BlockSparseLayout.from_block_mask(mask, torch.full((n,), 256), (256, 256)).to("cuda")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--keep", type=float, default=0.1, help="kept fraction of 256-blocks")
    p.add_argument("--sweep", choices=("fwd", "bwd", "all"), help="also time alternative configs")
    p.add_argument("--out")
    args = p.parse_args()
    B, S, H, D = 1, args.seq, args.heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    rows = []

    def record(arm, shape, mode, ms, pairs, extra=None):
        if ms is None:
            return
        # pairs: selected (query, key) token pairs summed over batch and heads
        flops = 4 * D * pairs * (2.5 if mode == "bwd" else 1.0)
        row = {
            "arm": arm,
            "block_shape": shape,
            "mode": mode,
            "ms": ms,
            "tflops": flops / ms / 1e9,
            **(extra or {}),
        }
        rows.append(row)
        print(
            f"{arm:<24} {shape!s:<11} {mode:<4} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s",
            flush=True,
        )

    # dense FA4
    try:
        from flash_attn.cute import flash_attn_func

        qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
        fwd = lambda: flash_attn_func(qd, kd, vd)  # noqa: E731
        out = fwd()
        out = out[0] if isinstance(out, tuple) else out
        record("fa4_dense", None, "fwd", bench_ms(fwd), B * H * S * S)
        bwd = lambda: torch.autograd.grad(out, (qd, kd, vd), dout, retain_graph=True)  # noqa: E731
        record("fa4_dense", None, "bwd", bench_ms(bwd), B * H * S * S)
    except Exception as exc:  # report, keep going
        print(f"fa4_dense skipped: {type(exc).__name__}: {exc}", flush=True)

    base = exact256_layout(S, H, args.keep, seed=0)
    from vsa_triton import config as cfgmod
    from vsa_triton.ops import block_sparse_bwd, block_sparse_fwd

    for shape in SHAPES:
        layout = base.refine(shape)
        pairs = int(layout.selected_token_pairs())
        ind, cnt, val = layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes
        scale = D**-0.5
        # correctness first
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = block_sparse_attn(qg, kg, vg, layout, backend="triton")
        grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
        ref, _ = block_sparse_attn(q32, k32, v32, layout, backend="reference")
        ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
        errors = {
            name: ((a.float() - b).norm() / b.norm()).item()
            for name, a, b in zip(
                ("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True
            )
        }
        del q32, k32, v32, ref, ref_grads, qg, kg, vg, grads
        print(f"triton {shape}: relative L2 {errors}", flush=True)
        ok = all(e <= 1e-2 for e in errors.values())
        if not ok:
            rows.append({"arm": "triton", "block_shape": shape, "failed": errors})
            continue
        out, lse = block_sparse_fwd(q, k, v, ind, cnt, val, scale, *shape)
        configs_f = [cfgmod.forward_config(*shape, D)]
        configs_b = [cfgmod.backward_config(*shape, D)]
        if args.sweep and shape == (64, 64) and args.sweep in ("fwd", "all"):
            configs_f += [
                cfgmod.ForwardConfig(t, w, st, dual)
                for (t, dual), w, st in itertools.product(
                    ((64, False), (128, True)), (4,), (2, 3, 4)
                )
            ]
        if args.sweep and shape == (64, 64) and args.sweep in ("bwd", "all"):
            # dK/dV and dQ kernels are independent: sweep one with the other at its default
            b0 = configs_b[0]
            configs_b += [
                dataclasses.replace(b0, tile_dkdv=t, num_warps_dkdv=w, num_stages_dkdv=st)
                for t, w, st in itertools.product((64, 128), (4, 8), (2, 3))
            ] + [
                dataclasses.replace(b0, tile_dq=t, num_warps_dq=w, num_stages_dq=st)
                for t, w, st in itertools.product((64, 128), (4, 8), (2, 3))
            ]
        for i, c in enumerate(dict.fromkeys(configs_f)):
            cfgmod._FORWARD[(*shape, D)] = c
            ms = safe_bench(
                functools.partial(block_sparse_fwd, q, k, v, ind, cnt, val, scale, *shape)
            )
            record(
                "triton" if i == 0 else "triton_sweep",
                shape,
                "fwd",
                ms,
                pairs,
                {"config": c.__dict__, "errors": errors},
            )
        cfgmod._FORWARD.pop((*shape, D), None)
        for i, c in enumerate(dict.fromkeys(configs_b)):
            cfgmod._BACKWARD[(*shape, D)] = c
            ms = safe_bench(
                functools.partial(
                    block_sparse_bwd, dout, q, k, v, out, lse, ind, cnt, val, scale, *shape
                )
            )
            record(
                "triton" if i == 0 else "triton_sweep",
                shape,
                "bwd",
                ms,
                pairs,
                {"config": c.__dict__},
            )
        cfgmod._BACKWARD.pop((*shape, D), None)

    dense = {r["mode"]: r["tflops"] for r in rows if r["arm"] == "fa4_dense"}
    for r in rows:
        if "tflops" in r and r["mode"] in dense:
            r["vs_fa4_dense"] = r["tflops"] / dense[r["mode"]]
    result = {
        **brep.gpu_result_header("bench_triton_kernels"),
        "command": " ".join(sys.argv),
        "versions": brep.runtime_versions(
            brep.distribution_versions(
                ("triton", "flash-attn-4", "nvidia-cutlass-dsl", "vsa-core", "vsa-triton")
            )
        ),
        "setup": {
            "B": B,
            "S": S,
            "H": H,
            "D": D,
            "dtype": "bfloat16",
            "keep": args.keep,
            "mask": "exact256 + diagonal",
        },
        "rows": rows,
    }
    print("\n| arm | block | mode | ms | TFLOP/s | vs FA4 dense |\n|---|---|---|---|---|---|")
    for r in rows:
        if "tflops" in r:
            print(
                f"| {r['arm']} | {r['block_shape']} | {r['mode']} | {r['ms']:.3f} | "
                f"{r['tflops']:.1f} | {r.get('vs_fa4_dense', float('nan')):.2f} |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

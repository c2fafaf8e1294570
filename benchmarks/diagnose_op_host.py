"""Where the whole op's time goes, in both views: host time to issue a call, device time back to
back, one call waited for, CUDA-graph replay; per (shape, fine backend, coarse backend, mode).

A diagnostic for issue 19 (the comparison users read is `bench_video.py`'s). Prints one JSON
line per cell and, with ``--profile``, a cProfile table of one forward call. Host time comes
twice: ``host_ms`` right after a synchronize, and ``host_warm_ms`` after the host spun 5 ms
(`bench_timing.call_views`: a core that waited long for the device issues any call slower);
``--backends dense_fa4`` adds FA4's dense call on the same tokens as the yardstick, and
``triton_copies`` the triton backend on the op's path without raster reading and fused combine
(`bench_variants`). ``--token-order raster`` gives the op raster-order tokens (T*H*W of them,
as a diffusers model holds them; dense FA4 then runs on the real tokens only; with
``--no-tile-copies`` the op's ``copy_to_tiles=False``) and adds the peak
extra memory of one forward call (``peak_extra_mib``: allocated during it beyond its inputs,
its output included; `memory_vsa_op.py` measures training too). ::

    python3 benchmarks/diagnose_op_host.py --shapes wan480p wan720p \
        --backends dense_fa4 fa4 triton --coarse triton --out $OUT/host.jsonl
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys

import bench_timing as bt
import torch
from bench_variants import register_variant

from vsa_core import VideoTiling, video_sparse_attn

SHAPES = {
    "wan480p": ((21, 30, 52), 12),
    "wan720p": ((21, 45, 80), 40),
    "hunyuan720p": ((33, 45, 80), 24),
    "aligned": ((20, 44, 80), 40),
}


DENSE = "dense_fa4"
"""``--backends`` name of the reference row: FA4's dense ``flash_attn_func`` on the same tokens
(its host time is what a raw upstream call costs in the same conditions)."""


def _dense_fa4(q, k, v):
    from flash_attn.cute import flash_attn_func

    return flash_attn_func(q, k, v)[0]


def _inputs(tiling: VideoTiling, heads: int, grad: bool, token_order: str = "tiled"):
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq = tiling.padded_len if token_order == "tiled" else tiling.seq_len
    shape = (1, seq, heads, 128)
    qkv = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "qkv"]
    gate = torch.rand(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    return [t.requires_grad_(grad) for t in qkv], gate


def graph_ms(fn) -> float | None:
    """Median replay time of ``fn`` captured in a CUDA graph (None if capture fails)."""
    try:
        replay, _ = bt.cuda_graph(fn)
        return statistics.median(bt.events_ms(replay, 10) for _ in range(3))
    except Exception as exc:  # capture failures are a finding, not a crash
        print(f"graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["wan480p"])
    ap.add_argument("--backends", nargs="+", default=["fa4", "triton"])
    ap.add_argument("--coarse", nargs="+", default=["torch", "triton"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="cProfile table of one forward call")
    ap.add_argument("--token-order", choices=("tiled", "raster"), default="tiled")
    ap.add_argument("--no-tile-copies", action="store_true", help="copy_to_tiles=False (raster)")
    args = ap.parse_args()
    for backend in args.backends:
        register_variant(backend)
    out = open(args.out, "a") if args.out else None  # noqa: SIM115
    profiles = []
    for name in args.shapes:
        latent, heads = SHAPES[name]
        tiling = VideoTiling(latent)
        topk = max(1, round((1 - args.sparsity) * tiling.num_tiles))
        for mode in args.modes:
            grad = mode != "fwd"
            (q, k, v), gate = _inputs(tiling, heads, grad, args.token_order)
            for backend in args.backends:
                for coarse in args.coarse if backend != DENSE else ["-"]:

                    def call(backend=backend, coarse=coarse, grad=grad, tensors=(q, k, v, gate),
                             order=args.token_order, copies=not args.no_tile_copies):  # fmt: skip
                        q_, k_, v_, gate_ = tensors
                        if backend == DENSE:
                            out = _dense_fa4(q_, k_, v_)
                        else:
                            out = video_sparse_attn(
                                q_, k_, v_, tiling=tiling, topk=topk,  # noqa: B023
                                coarse_gate=gate_, backend=backend, coarse_backend=coarse,
                                token_order=order, copy_to_tiles=copies,
                            )  # fmt: skip
                        if grad:
                            out.backward(out)
                        return out

                    row = {"shape": name, "mode": mode, "backend": backend, "coarse": coarse,
                           "token_order": args.token_order,
                           "copy_to_tiles": not args.no_tile_copies}  # fmt: skip
                    try:
                        with torch.no_grad() if not grad else torch.enable_grad():
                            row.update(bt.call_views(call, args.reps, warm_host=True))
                            if not grad:
                                row["graph_ms"] = graph_ms(call)
                            if args.token_order == "raster" and not grad:
                                row["peak_extra_mib"] = bt.peak_extra_mib(
                                    call, torch.device("cuda")
                                )
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"
                    line = json.dumps(row)
                    print(line, flush=True)
                    if out:
                        out.write(line + "\n")
                        out.flush()
                    if args.profile and not grad and "error" not in row:
                        prof = cProfile.Profile()
                        with torch.no_grad():
                            prof.enable()
                            call()
                            prof.disable()
                        text = io.StringIO()
                        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
                        profiles.append(f"## {name} {backend} coarse={coarse}\n{text.getvalue()}")
            q.grad = k.grad = v.grad = None
    if args.profile:
        with open(args.profile, "w") as f:
            f.write("\n".join(profiles))


if __name__ == "__main__":
    main()

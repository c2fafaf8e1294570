"""Where the host time of one `video_sparse_attn` call goes: cProfile over repeated calls
(forward, and forward + backward), per fine backend, tables by own time and by cumulative time.
The companion of `benchmarks/diagnose_op_host.py` (which times; this one attributes). ::

    python3 -m research.op_host_profile --shape wan480p --backends fa4 triton --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from research.harness import benchmark_module
from vsa_core import VideoTiling, video_sparse_attn

bv = benchmark_module("bench_video")


def profile_text(runner, calls: int, rows: int) -> str:
    for _ in range(3):
        runner.run(runner.setup() if runner.setup else None)
    torch.cuda.synchronize()
    args = [runner.setup() if runner.setup else None for _ in range(calls)]
    prof = cProfile.Profile()
    prof.enable()
    for arg in args:
        runner.run(arg)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"{calls} calls\n")
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def op_arguments(argv, modes: list[str], **extra) -> tuple[argparse.Namespace, Callable]:
    """The command line both op scripts take (shape, backends, modes, sparsity, out, and
    ``extra`` options with their defaults) and a function giving bench_video's runner of the
    op on CUDA bf16 inputs of that latent (gate on) for a backend and a mode."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="wan480p")
    ap.add_argument("--backends", nargs="+", default=["fa4", "triton"])
    ap.add_argument("--modes", nargs="+", default=modes)
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--out", type=Path, default=Path("."))
    for name, default in extra.items():
        ap.add_argument(f"--{name}", type=type(default), default=default)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = bv.parse_shape(args.shape)
    cfg = SimpleNamespace(head_dim=128, batch=1, seed=0, coarse_gate=True, dtype=torch.bfloat16)
    tiling = VideoTiling(shape.latent, (4, 4, 4))
    topk = bv.topk_for(args.sparsity, tiling.num_tiles)
    inputs = bv.make_op_inputs(cfg, tiling, shape.heads, torch.device("cuda"))

    def runner(backend: str, mode: str):
        attn = partial(video_sparse_attn, tiling=tiling, topk=topk, backend=backend,
                       validate=False)  # fmt: skip
        return bv.attn_runner(inputs, mode, attn)

    return args, runner


def main(argv=None) -> int:
    args, runner = op_arguments(argv, ["fwd", "fwd+bwd"], calls=20, rows=45)
    for backend in args.backends:
        for mode in args.modes:
            text = profile_text(runner(backend, mode), args.calls, args.rows)
            name = f"{args.shape}-{backend}-{mode.replace('+', '_')}.txt"
            (args.out / name).write_text(text)
            print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

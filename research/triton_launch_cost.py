"""Host time of the op's Triton launches at Wan 2.1 480p, and what a direct launch saves.

`op_host_pieces` (session 21) put the pooling piece at 137 us idle / 252 us busy on the H200's
host, against 17 us for an empty Triton kernel's launch. This times, each after a synchronize
(median over ``--reps``; `op_host_pieces.host_us`, idle and busy views), what the pooling and
the selection cost in parts: the whole ``_pool_clean`` (allocations, argument assembly, the
launch), the pooling kernel's launch alone on prebuilt outputs through Triton
(``kernel[grid](...)``: its binder, cache key and launcher), the same compiled kernel called
through its launcher directly (``CompiledKernel.run`` with the bound arguments), the same
through `vsa_triton.launch_cache.launch` (what the package's launches use since session 23),
the selection with its coarse attention (``_launch_select``), and yardsticks (an empty
kernel, ``torch.empty`` of the clean copy's size). One JSON line a piece. ::

    python3 -m research.triton_launch_cost --out $OUT/triton_launch_cost.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from research.op_host_pieces import _empty_triton_kernel, host_us


def _direct_launcher(fn, grid, args, kwargs):
    """A callable that launches ``fn``'s compiled kernel for these arguments through its
    launcher, skipping ``JITFunction.run``'s binder, cache key and checks (Triton 3.6's
    internals: a measurement, not a product path)."""
    from triton.runtime import driver

    compiled = fn[grid](*args, **kwargs)
    device = driver.active.get_current_device()
    binder = fn.device_caches[device][4]
    bound_args, _, _ = binder(*args, **kwargs)
    values = tuple(bound_args.values())
    stream = driver.active.get_current_stream(device)
    grid3 = (*grid, 1, 1)[:3]

    def launch():
        compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values), None, None,
                     *values)  # fmt: skip

    return launch


def pieces(reps: int):
    from vsa_core import VideoTiling
    from vsa_triton import coarse as tc
    from vsa_triton.launch_cache import launch
    from vsa_triton.tensor_args import bshd_strides

    tiling = VideoTiling((21, 30, 52), (4, 4, 4))
    gen = torch.Generator(device="cuda").manual_seed(0)
    dims = (1, tiling.padded_len, 12, 128)
    q, k, v = (torch.randn(dims, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))  # fmt: skip
    valid = tiling.valid_sizes(q.device)
    num_tiles = valid.shape[0]
    pooled = [tc._pooled_like(t, num_tiles) for t in (q, k, v)]
    clean_v = torch.empty_like(v)
    strides = (tiling.padded_len * 12 * 128, 12 * 128, 128)
    grid = (num_tiles, 12)
    args = (q, k, v, *pooled, q, k, clean_v, valid, valid, *bshd_strides(q), *bshd_strides(k),
            *bshd_strides(v), *bshd_strides(pooled[0]), *strides, 12)  # fmt: skip
    kwargs = dict(CLEAN_Q=False, CLEAN_K=False, CLEAN_V=True, RASTER=False,
                  **tc._tile_constants(64, 128))  # fmt: skip
    kernel = tc._kernels().pool_fwd_kernel
    empty = _empty_triton_kernel()
    x = torch.zeros(1024, device="cuda")
    qp, kp, vp = tc._pool_clean(q, k, v, valid, False, False, True)[:3]
    yield "empty_triton_launch", lambda: empty[(1,)](x, 1024, BLOCK=1024)
    yield "torch_empty_clean_copy", lambda: torch.empty_like(v)
    yield "pool_clean_whole", lambda: tc._pool_clean(q, k, v, valid, False, False, True)
    yield "pool_kernel_launch", lambda: kernel[grid](*args, **kwargs)
    yield "pool_kernel_launch_cache", lambda: launch(kernel, grid, *args, **kwargs)
    try:
        yield "pool_kernel_direct", _direct_launcher(kernel, grid, args, kwargs)
    except Exception as exc:
        print(f"direct launch unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    yield (
        "select_attend_whole",
        lambda: tc._launch_select(qp, kp, valid, 78, tc.SELECT, 64, vp, 0.088),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    lines = []
    for name, fn in pieces(args.reps):
        rec = {"shape": "wan480p", "piece": name, "host_us": host_us(fn, args.reps),
               "host_us_busy": host_us(fn, args.reps, busy=True),
               "torch": torch.__version__, "device": torch.cuda.get_device_name()}  # fmt: skip
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)


if __name__ == "__main__":
    main()

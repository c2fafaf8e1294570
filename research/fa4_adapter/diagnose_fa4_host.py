"""Where the fa4 adapter's host time goes, against raw FA4 calls (a diagnostic for issue 4).

`bench_fa4_overhead.py` measures the adapter's cost; this script explains it. Per block shape
(S=32768, H=12, D=128, bf16, 90% sparse, one exact256 mask refined to the shape) it writes
into ``--out-dir``:

- ``sync.json``: the synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode("warn")``)
  the adapter makes in a forward and in an autograd backward; must be empty;
- ``host.json``: median host milliseconds to issue one call of each piece, the device idle
  before it: raw FA4; the adapter's forward; its backward op body called directly on the main
  thread (``vsa_fa4.ops.backward_impl``); and the autograd backward (``torch.autograd.grad``);
- ``<shape>-<piece>.cprofile.txt``: cProfile of 20 calls of each piece on the main thread,
  the 40 most expensive functions by cumulative time;
- ``<shape>-bwd.torch_profiler.txt``: torch.profiler key averages (CPU and CUDA) over 5
  adapter backwards and 5 raw ones. ::

    python3 -m research.fa4_adapter.diagnose_fa4_host --out-dir $OUT/diag
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from research import harness

from .bench_fa4_overhead import exact256_layout, host_and_once_ms, raw_tensors

bc = harness.bench_common()


def cprofile_text(fn, calls: int = 20, rows: int = 40) -> str:
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(rows)
    return buf.getvalue()


def sync_calls(fn) -> list[str]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-shapes", nargs="+", default=["128x128", "256x256", "128x64", "64x64"])
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    from flash_attn_vsa.bwd_sm90 import block_sparse_backward_kv64
    from vsa_fa4 import block_sparse_attn
    from vsa_fa4.backend import FA4Backend
    from vsa_fa4.metadata import physical_lists
    from vsa_fa4.ops import backward_impl

    args.out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    seq, heads, dim, scale = 32768, 12, 128, 128**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, seq, heads, dim, device=dev, dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    base = exact256_layout(seq, heads, 0.9, seed=1)
    syncs, hosts = {}, {**bc.gpu_result_header("diagnose_fa4_host"), "cells": []}
    for label in args.block_shapes:
        shape = tuple(int(x) for x in label.split("x"))
        layout = (base if shape == (256, 256) else base.refine(shape)).to(dev)
        plan = FA4Backend().plan(layout)
        fwd_t, bwd_t = raw_tensors(layout, plan, False), raw_tensors(layout, plan, True)
        out, lse = block_sparse_attn(q, k, v, layout)
        lists = physical_lists(
            layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, plan, layout.q_group_size
        )
        kv64 = bwd_t.block_size == (64, 64)

        def raw_fwd(t=fwd_t):
            _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=t, return_lse=True)

        def raw_bwd(t=bwd_t, out=out, lse=lse, kv64=kv64):
            if kv64:
                block_sparse_backward_kv64(q, k, v, out, dout, lse, t, softmax_scale=scale)
            else:
                _flash_attn_bwd(
                    q, k, v, out, dout, lse, softmax_scale=scale, block_sparse_tensors=t
                )

        def adapter_fwd(lay=layout):
            block_sparse_attn(q, k, v, lay)

        def op_bwd(lists=lists, out=out, lse=lse, plan=plan, full=layout.kv_blocks_full):
            backward_impl(
                dout, q, k, v, out, lse, *lists, scale, plan.q_tile, plan.kv_tile, not full
            )

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def autograd_bwd(lay=layout, leaves=leaves):
            o, _ = block_sparse_attn(*leaves, lay)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.autograd.grad(o, leaves, dout)
            return (time.perf_counter() - t0) * 1e3

        pieces = {"raw_fwd": raw_fwd, "adapter_fwd": adapter_fwd, "raw_bwd": raw_bwd,
                  "op_bwd": op_bwd}  # fmt: skip
        for fn in (*pieces.values(), autograd_bwd, autograd_bwd):
            fn()  # compile and warm
        torch.cuda.synchronize()
        syncs[label] = {"adapter_fwd": sync_calls(adapter_fwd),
                        "autograd_bwd": sync_calls(autograd_bwd)}  # fmt: skip
        cell = {"block_shape": label, "physical": list(plan.block_size)}
        cell.update(
            {
                name: host_and_once_ms(lambda _, f=fn: f(), None, dev, reps=20)[0]
                for name, fn in pieces.items()
            }
        )
        cell["autograd_bwd"] = statistics.median(autograd_bwd() for _ in range(20))
        hosts["cells"].append(cell)
        print(json.dumps(cell), flush=True)
        for name, fn in pieces.items():
            (args.out_dir / f"{label}-{name}.cprofile.txt").write_text(cprofile_text(fn))
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                with torch.profiler.record_function("adapter_autograd_bwd"):
                    autograd_bwd()
                with torch.profiler.record_function("raw_bwd"):
                    raw_bwd()
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        table_gpu = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
        (args.out_dir / f"{label}-bwd.torch_profiler.txt").write_text(table + "\n\n" + table_gpu)
        (args.out_dir / "sync.json").write_text(json.dumps(syncs, indent=1))
        (args.out_dir / "host.json").write_text(json.dumps(hosts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

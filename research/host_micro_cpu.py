"""Two host-side costs measured on a CPU (no GPU needed), quoted in session 24's notes:

- the views of a backward in head chunks (`vsa_fa4.ops._head_ranges`: one ``split`` per
  tensor) against one ``narrow`` per view, for Wan 720p's four ranges of 40 heads over the
  eleven tensors the backward slices;
- `vsa_triton.launch_cache`'s per-call work for a 36-argument call (11 tensors, 17 ints, 8
  constexprs, as the pooling kernel's): ``bind`` and the call description's key.

Microseconds per call, best of ``--repeats`` loops. ::

    uv run python -m research.host_micro_cpu --out benchmarks/results/...json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from types import SimpleNamespace

import torch


def per_call_us(fn, calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return round(best, 2)


def head_views(calls: int, repeats: int) -> dict[str, float]:
    from vsa_fa4 import ops

    bshd = [torch.empty(1, 1000, 40, 128) for _ in range(9)]
    tensors = (*bshd[:5], torch.empty(1, 40, 1000), *bshd[5:8], *(torch.empty(1, 40, 10, 10),) * 2)
    chunks = ops.head_chunks(1, 40, 92160, 128)  # Wan 720p: four ranges

    def narrow():
        for h in chunks:
            tuple(t.narrow(d, h.start, h.stop - h.start)
                  for t, d in zip(tensors, ops._HEAD_DIMS, strict=True))  # fmt: skip

    def split():
        ops._head_ranges(tensors, chunks)

    return {
        "head_ranges": len(chunks),
        "narrow_per_view_us": per_call_us(narrow, calls, repeats),
        "split_per_tensor_us": per_call_us(split, calls, repeats),
    }


def launch_description(calls: int, repeats: int) -> dict[str, float]:
    from vsa_triton import launch_cache

    params = [SimpleNamespace(name=f"t{i}", is_constexpr=False, has_default=False)
              for i in range(28)]  # fmt: skip
    params += [SimpleNamespace(name=f"C{i}", is_constexpr=True, has_default=False)
               for i in range(8)]  # fmt: skip
    record = launch_cache._Kernel.__new__(launch_cache._Kernel)
    record.names = [p.name for p in params]
    record.name_set, record.defaults, record.records = frozenset(record.names), {}, {}
    args = (*(torch.empty(64) for _ in range(11)), *range(100, 117))
    kwargs = {f"C{i}": 64 for i in range(8)}
    values, options = record.bind(args, kwargs)
    return {
        "arguments": len(values),
        "bind_us": per_call_us(lambda: record.bind(args, kwargs), calls, repeats),
        "key_us": per_call_us(lambda: record.key(values, options, 0), calls, repeats),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    result = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["uv run python -m research.host_micro_cpu", *sys.argv[1:]]),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "head_views": head_views(args.calls, args.repeats),
        "launch_description": launch_description(args.calls, args.repeats),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

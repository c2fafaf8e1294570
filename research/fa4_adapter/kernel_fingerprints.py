"""Fingerprints of the PTX every fa4 route and every fork kernel configuration compiles to.

Written to show that a change of how kernels are *chosen* (issue 23: the kernel choice passed
as explicit arguments instead of thread-local scopes) changes nothing of *what* compiles. Each
route compiles for sm_90a on a CPU (fake CUDA tensors, as the compile gates do) in a process of
its own with ``CUTE_DSL_KEEP_PTX=1``, ``CUTE_DSL_DUMP_DIR`` and the caches off; its fingerprint
is the sorted SHA-256 of each PTX file it dumped, with the kernel's entry name (which spells the
Python module and class path of the kernel, so it moves with the code) replaced by ``KERNEL``.

Routes:

- ``fork:NAME``: every configuration of ``flash_attn_vsa.compile_gate`` (the fork's shipped and
  experimental kernels through its entry points);
- ``adapter:NAME``: every configuration of ``vsa_fa4.compile_gate`` (the shipped routes of
  vsa-fa4's op bodies);
- ``variant:NAME``: vsa-fa4's op bodies with a forward variant or a backward tile configuration
  other than the shipped ones (`VARIANTS`): before issue 23 chosen by
  ``launch.forward_variant`` / ``bwd_sm90.configs_scope``, after it passed as arguments.

::

    uv run python -m research.fa4_adapter.kernel_fingerprints --out fp.json [--jobs 2] [-r ROUTE]
    uv run python -m research.fa4_adapter.kernel_fingerprints --compare before.json after.json

For issue 23 (2026-12-01) each side ran from a worktree of its commit (677f3af before, afbce15
after), the packages taken from it ahead of the editable installs::

    git worktree add --detach /tmp/before 677f3af   # then copy this script into it
    cd /tmp/before && PYTHONPATH=$PWD/packages/flash-attn-4-vsa/src:$PWD/packages/vsa-fa4/src:\
        $PWD/packages/vsa-core/src /path/to/.venv/bin/python -m \
        research.fa4_adapter.kernel_fingerprints --out before.json

43/43 routes compiled to the same PTX and the same kernel classes
(``results/2026-12-01-kernel-fingerprints-issue23.txt`` and the two JSON files beside it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ARCH = "sm_90a"

VARIANTS: dict[str, dict[str, Any]] = {
    # name -> the logical block shape and schedule, and the forward variant's fields or the
    # backward's experimental configuration (flash_attn_vsa.experimental.bwd_configs)
    "fwd-64x64+no-qregs": {"block": (64, 64), "schedule": "native",
                           "forward": {"q_in_registers": False}},
    "fwd-64x64+streams": {"block": (64, 64), "schedule": "native",
                          "forward": {"two_streams": True}},
    "fwd-64x64+streams+qregs": {"block": (64, 64), "schedule": "native",
                                "forward": {"two_streams": True, "q_in_registers": True}},
    "fwd-64x64+persistent": {"block": (64, 64), "schedule": "native",
                             "forward": {"persistent": True}},
    "fwd-64x64+streams+persistent": {"block": (64, 64), "schedule": "native",
                                     "forward": {"two_streams": True, "persistent": True}},
    "fwd-64x64-paired+qregs": {"block": (64, 64), "schedule": "paired",
                               "forward": {"q_in_registers": True}},
    "fwd-64x64-paired+persistent": {"block": (64, 64), "schedule": "paired",
                                    "forward": {"persistent": True}},
    **{
        f"bwd-64x64+{name}": {"block": (64, 64), "schedule": "native", "backward": name}
        for name in (
            "kv64-staged",
            "kv64-dq-4parts-2buffers-two-ctas",
            "kv64-dq-1part-2buffers",
            "kv64-dq-2parts-two-ctas",
            "kv64-dq-8parts-4buffers-two-ctas",
            "kv64-dq-4parts-2buffers-producer-two-ctas",
            "kv64-dq-8parts-4buffers-producer-two-ctas",
            "kv64-two-ctas-no-dq",
            "kv64-no-dq",
        )
    },
}  # fmt: skip

RESULT_PREFIX = "fingerprint-route-result "


def routes() -> list[str]:
    from flash_attn_vsa import compile_gate as fork_gate
    from vsa_fa4 import compile_gate as adapter_gate

    return [
        *(f"fork:{c.name}" for c in fork_gate.CONFIGS),
        *(f"adapter:{c.name}" for c in adapter_gate.CONFIGS),
        *(f"variant:{name}" for name in VARIANTS),
    ]


def normalized_ptx_hash(text: str) -> str:
    """SHA-256 of a PTX file with its entry's name (and the names derived from it) replaced."""
    names = re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)", text)
    for i, name in enumerate(sorted(set(names), key=len, reverse=True)):
        text = text.replace(name, f"KERNEL{i}")
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint_dir(path: Path) -> list[str]:
    return sorted(normalized_ptx_hash(p.read_text()) for p in path.glob("*.ptx"))


def run_route(route: str, timeout: float = 600.0) -> dict[str, Any]:
    """Compile one route in a fresh process; its PTX fingerprint and what it compiled."""
    from flash_attn_vsa.compile_gate import gate_environment, run_worker

    kind, name = route.split(":", 1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fa4-fp-") as dump:
        env = gate_environment(ARCH, dump)
        if kind == "fork":
            module, args, prefixes = "flash_attn_vsa.compile_gate", ["-c", name], "fa4-compile-gate"
        elif kind == "adapter":
            module, args, prefixes = "vsa_fa4.compile_gate", ["-c", name], "vsa-fa4-compile-gate"
        else:
            module, args, prefixes = "research.fa4_adapter.kernel_fingerprints", [name], None
        output = run_worker(
            module,
            args,
            env,
            timeout,
            env_prefix=f"{prefixes}-env " if prefixes else "fingerprint-route-env ",
            result_prefix=f"{prefixes}-result " if prefixes else RESULT_PREFIX,
        )
        [result] = output.results_for([name])
        return {
            "ok": result.ok,
            "kernels": result.kernels,
            "error": result.error,
            "ptx": fingerprint_dir(Path(dump)),
            "seconds": round(time.perf_counter() - start, 1),
        }


# ---- the worker of the variant routes (in its own process, the gate's environment) ----------
def _variant_body(name: str) -> None:
    import torch

    from flash_attn_vsa.compile_gate import BATCH, HEAD_DIM, HEADS, SEQLEN, fake_cuda_qkv
    from vsa_fa4 import launch
    from vsa_fa4.metadata import physical_lists
    from vsa_fa4.ops import backward_impl, forward_impl
    from vsa_fa4.schedule import make_plan

    spec = VARIANTS[name]
    q_block, kv_block = spec["block"]
    num_q, num_kv = SEQLEN // q_block, SEQLEN // kv_block
    plan = make_plan(spec["block"], 2, num_q, spec["schedule"])
    variant = launch.ForwardVariant(**spec.get("forward", {}))
    config = None
    if "backward" in spec:
        from flash_attn_vsa.experimental import bwd_configs

        config = {**bwd_configs.EXPERIMENTAL_CONFIGS, **bwd_configs.ABLATIONS}[spec["backward"]]
    explicit = not hasattr(launch, "forward_variant")  # after issue 23: arguments, not scopes
    with fake_cuda_qkv() as (q, k, v):
        i32 = {"dtype": torch.int32, "device": "cuda"}
        kv_indices = torch.zeros(BATCH, HEADS, num_q, 3, **i32)
        kv_counts = torch.zeros(BATCH, HEADS, num_q, **i32)
        valid = torch.zeros(num_kv, **i32)
        phys = physical_lists(kv_indices, kv_counts, valid, plan, 2)
        args = (*phys, HEAD_DIM**-0.5, *plan.block_size, True)
        if explicit:
            kernels = launch.KernelChoice(variant, config).encode()
            out, lse = forward_impl(q, k, v, *args, kernels)
            if config is not None:
                backward_impl(torch.empty_like(out), q, k, v, out, lse, *args, kernels)
            return
        from flash_attn_vsa import bwd_sm90

        with launch.forward_variant(variant):
            out, lse = forward_impl(q, k, v, *args)
        if config is not None:
            with bwd_sm90.configs_scope({plan.block_size: config}):
                backward_impl(torch.empty_like(out), q, k, v, out, lse, *args)


def _worker(name: str) -> int:
    from flash_attn_vsa.compile_gate import serve_worker, timed_compile

    return serve_worker(
        ARCH,
        [name],
        lambda n, counter: timed_compile(n, counter, lambda: _variant_body(n), None),
        env_prefix="fingerprint-route-env ",
        result_prefix=RESULT_PREFIX,
    )


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per route: same / DIFFERENT / missing; a summary last."""
    lines, same = [], 0
    for route in sorted(set(before) | set(after)):
        a, b = before.get(route), after.get(route)
        if a is None or b is None:
            lines.append(f"{route:<60} missing {'before' if a is None else 'after'}")
            continue
        ok = a["ok"] and b["ok"] and a["ptx"] == b["ptx"] and a["ptx"]
        same += bool(ok)
        digest = hashlib.sha256("".join(b["ptx"]).encode()).hexdigest()[:12]
        status = "same" if ok else "DIFFERENT"
        lines.append(f"{route:<60} {status:<9} {len(b['ptx'])} ptx  {digest}")
    lines.append(f"{same}/{len(set(before) | set(after))} routes compile to the same PTX")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("-r", "--route", action="append", help="only these routes")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.worker or (rest and rest[0] == "--worker"):
        return _worker(args.worker or rest[1])
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        lines = compare(before, after)
        print("\n".join(lines))
        return 0 if lines[-1].startswith(f"{len(set(before) | set(after))}/") else 1
    chosen = args.route or routes()
    results: dict[str, Any] = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for route, result in zip(chosen, pool.map(run_route, chosen), strict=True):
            results[route] = result
            status = "ok" if result["ok"] else f"FAILED {result['error']}"
            print(f"{route:<60} {status} {len(result['ptx'])} ptx {result['seconds']} s",
                  flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())

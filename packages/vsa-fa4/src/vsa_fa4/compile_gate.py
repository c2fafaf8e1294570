"""Compile gate of the adapter: its FA4 calls compile for sm_90a on a machine without a GPU.

Follows ``flash_attn_vsa.compile_gate``'s recipe (and reuses its environment): a fresh
process with ``CUTE_DSL_ARCH=sm_90a``, ``FLASH_ATTENTION_ARCH=sm_90``,
``FLASH_ATTENTION_NUM_SMS=132`` and the kernel caches off runs the adapter's own op bodies
(`vsa_fa4.ops.forward_impl` / `backward_impl`: metadata construction, the partial-block
``mask_mod`` with the valid sizes in ``aux_tensors``, the FA4 call) on fake CUDA tensors under
``FakeTensorMode``, where upstream compiles its kernels and skips the launch. A configuration
passes when its call returns and compiles its kernel class with our ``mask_mod`` in it.

The configurations cover every distinct kernel the schedules produce at head dim 128, bf16:
forward for each physical tile, backward where upstream supports it on sm_90 (128-token key
blocks). ::

    python -m vsa_fa4.compile_gate            # table; exit 1 on a failure
    python -m vsa_fa4.compile_gate --list
    python -m vsa_fa4.compile_gate --json -c fwd-256x256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flash_attn_vsa.compile_gate import gate_environment

ARCH = "sm_90a"
BATCH, SEQLEN, HEADS, HEAD_DIM = 1, 1024, 2, 128
WIDTH = 3  # key-list width of the fake layouts
DTYPE = "bfloat16"
RESULT_PREFIX = "vsa-fa4-compile-gate-result "
ENV_PREFIX = "vsa-fa4-compile-gate-env "


@dataclass(frozen=True)
class GateConfig:
    name: str
    direction: str  # "fwd" or "bwd"
    block_shape: tuple[int, int]  # logical
    schedule: str
    physical: tuple[int, int]  # the physical sparse block the plan must produce
    kernel: str


CONFIGS: tuple[GateConfig, ...] = (
    GateConfig("fwd-64x64", "fwd", (64, 64), "native", (64, 64), "FlashAttentionForwardSm90"),
    GateConfig(
        "fwd-64x64-paired", "fwd", (64, 64), "paired", (128, 64), "FlashAttentionForwardSm90"
    ),
    GateConfig("fwd-128x128", "fwd", (128, 128), "native", (128, 128), "FlashAttentionForwardSm90"),
    GateConfig("fwd-256x256", "fwd", (256, 256), "native", (256, 128), "FlashAttentionForwardSm90"),
    GateConfig(
        "bwd-128x128", "bwd", (128, 128), "native", (128, 128), "FlashAttentionBackwardSm90"
    ),
    GateConfig(
        "bwd-256x256", "bwd", (256, 256), "native", (256, 128), "FlashAttentionBackwardSm90"
    ),
)
"""One configuration per distinct kernel (FA4 caches compiled kernels in the process, so a
second configuration with the same physical tile would compile nothing). Logical 128x64 runs
the paired kernel's tile (128x64); 64x128 adds a 64x128 forward and a Q64 backward kernel."""


@dataclass
class GateResult:
    name: str
    ok: bool
    seconds: float
    kernels: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class GateReport:
    results: list[GateResult]
    import_seconds: float | None = None
    returncode: int = 0
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)


def select_configs(names: Sequence[str] | None) -> list[GateConfig]:
    if not names:
        return list(CONFIGS)
    by_name = {c.name: c for c in CONFIGS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]


def run_gate(configs: Sequence[str] | None = None, *, timeout: float = 600.0) -> GateReport:
    """Compile the named configurations (default: all) in a fresh process."""
    selected = select_configs(configs)
    env = {**os.environ, **gate_environment(ARCH)}
    cmd = [sys.executable, "-m", "vsa_fa4.compile_gate", "--worker"]
    for config in selected:
        cmd += ["-c", config.name]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = f"(timed out after {timeout:.0f} s)"
        returncode = -1
    report = GateReport(results=[], returncode=returncode, stderr_tail=stderr[-4000:])
    seen: dict[str, GateResult] = {}
    for line in stdout.splitlines():
        try:
            if line.startswith(ENV_PREFIX):
                report.import_seconds = json.loads(line[len(ENV_PREFIX) :])["import_seconds"]
            elif line.startswith(RESULT_PREFIX):
                result = GateResult(**json.loads(line[len(RESULT_PREFIX) :]))
                seen[result.name] = result
        except (ValueError, TypeError, KeyError):
            continue
    for config in selected:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
        report.results.append(
            seen.get(config.name)
            or GateResult(
                config.name, False, 0.0, error=f"gate process ended ({returncode}): {last}"
            )
        )
    return report


# --------------------------------------------------------------------------------------------
# The worker (in the gate's process)


class _Counter:
    """Wraps ``cutlass.cute.compile``: records each compiled kernel's class and whether it
    carries a mask_mod (``name+mask_mod``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.compiled: list[str] = []

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        obj = getattr(fn, "__self__", fn)
        name = type(obj).__name__
        if getattr(obj, "mask_mod", None) is not None:
            name += "+mask_mod"
        self.compiled.append(name)
        return self.inner(fn, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _compile_one(config: GateConfig, counter: _Counter) -> GateResult:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vsa_fa4.metadata import physical_lists
    from vsa_fa4.ops import backward_impl, forward_impl
    from vsa_fa4.schedule import make_plan

    before = len(counter.compiled)
    start = time.perf_counter()
    try:
        q_block, kv_block = config.block_shape
        num_q, num_kv = SEQLEN // q_block, SEQLEN // kv_block
        plan = make_plan(config.block_shape, 2, num_q, config.schedule)
        if plan.block_size != config.physical:
            raise AssertionError(f"plan gives {plan.block_size}, expected {config.physical}")
        dtype = getattr(torch, DTYPE)
        with FakeTensorMode(allow_non_fake_inputs=True):
            shape = (BATCH, SEQLEN, HEADS, HEAD_DIM)
            q, k, v = (torch.empty(shape, dtype=dtype, device="cuda") for _ in range(3))
            i32 = {"dtype": torch.int32, "device": "cuda"}
            kv_indices = torch.zeros(BATCH, HEADS, num_q, WIDTH, **i32)
            kv_counts = torch.zeros(BATCH, HEADS, num_q, **i32)
            valid = torch.zeros(num_kv, **i32)
            phys = physical_lists(kv_indices, kv_counts, valid, plan, 2)
            args = (*phys, HEAD_DIM**-0.5, *plan.block_size)
            out, lse = forward_impl(q, k, v, *args)
            if config.direction == "bwd":
                backward_impl(torch.empty_like(out), q, k, v, out, lse, *args)
    except Exception as exc:
        message = " | ".join(f"{type(exc).__name__}: {exc}".strip().splitlines())[:2000]
        return GateResult(
            config.name, False, time.perf_counter() - start, counter.compiled[before:], message
        )
    seconds = time.perf_counter() - start
    kernels = counter.compiled[before:]
    wanted = config.kernel + "+mask_mod"
    if wanted not in kernels:
        error = f"returned without compiling {wanted} (compiled: {kernels or 'nothing'})"
        return GateResult(config.name, False, seconds, kernels, error)
    return GateResult(config.name, True, seconds, kernels)


def _worker(names: Sequence[str]) -> int:
    import warnings

    expected = gate_environment(ARCH)
    wrong = {k: os.environ.get(k) for k in expected if os.environ.get(k) != expected[k]}
    if wrong:
        print(f"the gate worker needs {expected}; differs: {wrong}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")  # upstream's fake-mode warnings are noise here
    start = time.perf_counter()
    import cutlass.cute
    import flash_attn.cute.interface  # noqa: F401  (timed here, not in the first config)

    import_seconds = time.perf_counter() - start
    counter = _Counter(cutlass.cute.compile)
    cutlass.cute.compile = counter
    print(ENV_PREFIX + json.dumps({"import_seconds": import_seconds}), flush=True)
    for config in select_configs(names):
        print(RESULT_PREFIX + json.dumps(asdict(_compile_one(config, counter))), flush=True)
    return 0


def format_report(report: GateReport) -> str:
    lines = [f"vsa-fa4 compile gate for {ARCH} (fake CUDA tensors, no GPU)"]
    if report.import_seconds is not None:
        lines.append(f"importing flash_attn.cute: {report.import_seconds:.1f} s")
    width = max([len(r.name) for r in report.results] + [6])
    for r in report.results:
        detail = ", ".join(r.kernels) if r.ok else (r.error or "")
        lines.append(
            f"{r.name:<{width}}  {'ok' if r.ok else 'FAILED':<6}  {r.seconds:5.1f} s  {detail}"
        )
    lines.append(f"{sum(r.ok for r in report.results)}/{len(report.results)} compiled")
    if not report.ok and report.stderr_tail.strip():
        lines += ["stderr (tail):", *report.stderr_tail.strip().splitlines()[-20:]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vsa_fa4.compile_gate", description=__doc__)
    parser.add_argument("-c", "--config", action="append", dest="configs", metavar="NAME")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            logical = f"logical {c.block_shape} {c.schedule:<7}"
            print(f"{c.name:<18} {c.direction} {logical} -> physical {c.physical}")
        return 0
    try:
        names = [c.name for c in select_configs(args.configs)]
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker:
        return _worker(names)
    report = run_gate(names)
    if args.json:
        print(json.dumps({"ok": report.ok, **asdict(report)}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

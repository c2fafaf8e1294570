"""Compile gate: every kernel configuration we use compiles for Hopper (sm_90a) without a GPU.

CuTe DSL compiles for a named architecture on a CPU-only machine when the target is given in
the environment before ``cutlass`` is imported and the kernel inputs are fake CUDA tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``): upstream's entry points then compile the
kernel and skip the launch. So a refresh that breaks a kernel is caught in CPU CI.

:func:`run_gate` runs the configurations of :data:`CONFIGS` in a fresh Python process (the
environment variables stay out of the calling process) and returns one result per
configuration: ok or failed, seconds, and the kernel classes that were compiled. A
configuration passes when its call returns and compiles its expected kernel class (the
process disables CuTe DSL's file cache and FA4's persistent cache, so nothing is loaded
instead of compiled). ::

    python -m flash_attn_vsa.compile_gate              # all, as a table; exit 1 on a failure
    python -m flash_attn_vsa.compile_gate --list       # the configurations
    python -m flash_attn_vsa.compile_gate --json -c fwd-dense
    python -m flash_attn_vsa.compile_gate --dump-dir DIR   # keep PTX and cubins for cuobjdump

The fork has no kernels of its own yet; its kernels join :data:`CONFIGS` as they land.
sm_100a (``--arch sm_100a``) also needs the CUDA driver library, i.e. a GPU host.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

ARCHS: dict[str, dict[str, str]] = {
    # CUTE_DSL_ARCH -> the rest of the environment that selects and sizes upstream's kernels.
    "sm_90a": {"FLASH_ATTENTION_ARCH": "sm_90", "FLASH_ATTENTION_NUM_SMS": "132"},
    "sm_100a": {"FLASH_ATTENTION_ARCH": "sm_100", "FLASH_ATTENTION_NUM_SMS": "148"},
}
DEFAULT_ARCH = "sm_90a"

# Shapes of the fake inputs. Compilation does not depend on the sequence length beyond the
# number of blocks being at least one; head dim and dtype are what the kernels specialize on.
BATCH, SEQLEN, HEADS, HEAD_DIM = 1, 1024, 2, 128
DTYPE = "bfloat16"

RESULT_PREFIX = "fa4-compile-gate-result "
ENV_PREFIX = "fa4-compile-gate-env "


@dataclass(frozen=True)
class GateConfig:
    """One kernel configuration: an upstream (or, later, fork) entry point and its inputs."""

    name: str
    direction: str  # "fwd" or "bwd"
    block_size: tuple[int, int] | None  # (q, kv) tokens per sparse block; None: dense
    kernel: str  # the kernel class that must be compiled (for sm_90a)
    why: str


CONFIGS: tuple[GateConfig, ...] = (
    GateConfig(
        "fwd-dense",
        "fwd",
        None,
        "FlashAttentionForwardSm90",
        "dense forward: the adapter's dense path and the benchmark baseline",
    ),
    GateConfig(
        "fwd-sparse-q128-kv128",
        "fwd",
        (128, 128),
        "FlashAttentionForwardSm90",
        "block-sparse forward, 128x128 blocks",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64",
        "fwd",
        (64, 64),
        "FlashAttentionForwardSm90",
        "block-sparse forward, 64x64 blocks (VSA's 4x4x4 tiles)",
    ),
    GateConfig(
        "bwd-dense",
        "bwd",
        None,
        "FlashAttentionBackwardSm90",
        "dense backward",
    ),
    GateConfig(
        "bwd-sparse-q128-kv128",
        "bwd",
        (128, 128),
        "FlashAttentionBackwardSm90",
        "block-sparse backward, 128x128 blocks (upstream refuses 64-token KV blocks)",
    ),
)


@dataclass
class GateResult:
    name: str
    ok: bool
    seconds: float
    kernels: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class GateReport:
    arch: str
    results: list[GateResult]
    versions: dict[str, str | None] = field(default_factory=dict)
    import_seconds: float | None = None
    returncode: int = 0
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def gate_environment(arch: str = DEFAULT_ARCH, dump_dir: str | None = None) -> dict[str, str]:
    """The environment variables the gate's process runs with (on top of the caller's)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    env = {
        "CUTE_DSL_ARCH": arch,
        **ARCHS[arch],
        # Compile for real: no CuTe DSL file cache, no FA4 persistent kernel cache.
        "CUTE_DSL_DISABLE_FILE_CACHING": "1",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0",
    }
    if dump_dir is not None:
        env.update(
            {"CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_KEEP_CUBIN": "1", "CUTE_DSL_DUMP_DIR": dump_dir}
        )
    return env


def select_configs(names: Sequence[str] | None) -> list[GateConfig]:
    if not names:
        return list(CONFIGS)
    by_name = {c.name: c for c in CONFIGS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]


def run_gate(
    configs: Sequence[str] | None = None,
    *,
    arch: str = DEFAULT_ARCH,
    dump_dir: str | None = None,
    timeout: float = 900.0,
) -> GateReport:
    """Compile the named configurations (default: all) in a fresh process; never raises for
    a failed compilation, which is reported in the results."""
    selected = select_configs(configs)
    env = {**os.environ, **gate_environment(arch, dump_dir)}
    cmd = [sys.executable, "-m", "flash_attn_vsa.compile_gate", "--worker", "--arch", arch]
    for config in selected:
        cmd += ["-c", config.name]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = _text(exc.stdout)
        stderr = _text(exc.stderr) + f"\n(timed out after {timeout:.0f} s)"
        returncode = -1
    report = GateReport(arch=arch, results=[], returncode=returncode, stderr_tail=stderr[-4000:])
    seen: dict[str, GateResult] = {}
    for line in stdout.splitlines():
        try:
            if line.startswith(ENV_PREFIX):
                info = json.loads(line[len(ENV_PREFIX) :])
                report.versions = info["versions"]
                report.import_seconds = info["import_seconds"]
            elif line.startswith(RESULT_PREFIX):
                result = GateResult(**json.loads(line[len(RESULT_PREFIX) :]))
                seen[result.name] = result
        except (ValueError, TypeError, KeyError):
            continue  # a line cut short by a crash: its configuration counts as failed
    for config in selected:
        if config.name in seen:
            report.results.append(seen[config.name])
        else:
            last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
            report.results.append(
                GateResult(
                    config.name, False, 0.0, error=f"gate process ended (exit {returncode}): {last}"
                )
            )
    return report


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


# --------------------------------------------------------------------------------------------
# The worker: runs in the gate's own process, with the environment above


class _CountingCompile:
    """Stands in for ``cutlass.cute.compile`` in the worker and records what it compiles."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.compiled: list[str] = []

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.compiled.append(self.kernel_name(fn))
        return self._inner(fn, *args, **kwargs)

    @staticmethod
    def kernel_name(fn: Any) -> str:
        """A kernel object's class; a bound method's class; else a function's name."""
        if hasattr(fn, "__func__") and hasattr(fn, "__self__"):
            return type(fn.__self__).__name__
        if inspect.isfunction(fn) or inspect.isclass(fn):
            return fn.__name__
        return type(fn).__name__

    def __getitem__(self, item: Any) -> Any:
        return self._inner[item]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _arch_number(arch: str) -> int:
    digits = "".join(ch for ch in arch if ch.isdigit())
    return int(digits)


def _sparse_tensors(torch: Any, block_size: tuple[int, int], direction: str) -> Any:
    """Fake FA4 block-sparse index tensors: partial ("mask") and full blocks, int32 on CUDA.

    Forward lists key blocks per query block ([B, H, q_blocks], [B, H, q_blocks, kv_blocks]);
    backward lists query blocks per key block (the transpose).
    """
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    q_blocks = -(-SEQLEN // block_size[0])
    kv_blocks = -(-SEQLEN // block_size[1])
    rows, cols = (q_blocks, kv_blocks) if direction == "fwd" else (kv_blocks, q_blocks)

    def index() -> tuple[Any, Any]:
        count = torch.empty(BATCH, HEADS, rows, dtype=torch.int32, device="cuda")
        idx = torch.empty(BATCH, HEADS, rows, cols, dtype=torch.int32, device="cuda")
        return count, idx

    mask_cnt, mask_idx = index()
    full_cnt, full_idx = index()
    return BlockSparseTensorsTorch(
        mask_block_cnt=mask_cnt,
        mask_block_idx=mask_idx,
        full_block_cnt=full_cnt,
        full_block_idx=full_idx,
        block_size=block_size,
    )


def _compile_one(config: GateConfig, arch: str, counter: _CountingCompile) -> GateResult:
    import torch
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = getattr(torch, DTYPE)
    before = len(counter.compiled)
    start = time.perf_counter()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            shape = (BATCH, SEQLEN, HEADS, HEAD_DIM)
            q, k, v = (torch.empty(shape, dtype=dtype, device="cuda") for _ in range(3))
            sparse = (
                _sparse_tensors(torch, config.block_size, config.direction)
                if config.block_size is not None
                else None
            )
            if config.direction == "fwd":
                # As in training: the log-sum-exp is returned for the backward pass.
                _flash_attn_fwd(
                    q,
                    k,
                    v,
                    block_sparse_tensors=sparse,
                    return_lse=True,
                    _arch=_arch_number(arch),
                )
            else:
                out, dout = torch.empty_like(q), torch.empty_like(q)
                lse = torch.empty(BATCH, HEADS, SEQLEN, dtype=torch.float32, device="cuda")
                _flash_attn_bwd(q, k, v, out, dout, lse, block_sparse_tensors=sparse)
    except Exception as exc:
        seconds = time.perf_counter() - start
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()
        return GateResult(
            config.name, False, seconds, counter.compiled[before:], " | ".join(message)[:2000]
        )
    seconds = time.perf_counter() - start
    kernels = counter.compiled[before:]
    if arch == "sm_90a" and config.kernel not in kernels:
        return GateResult(
            config.name,
            False,
            seconds,
            kernels,
            f"returned without compiling {config.kernel} (compiled: {kernels or 'nothing'})",
        )
    return GateResult(config.name, True, seconds, kernels)


def _worker(names: Sequence[str], arch: str) -> int:
    import warnings

    expected = gate_environment(arch)
    wrong = {k: os.environ.get(k) for k in expected if os.environ.get(k) != expected[k]}
    if wrong:
        print(f"the gate worker needs {expected}; differs: {wrong}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")  # upstream's fake-mode warnings are noise here
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "torch"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    start = time.perf_counter()
    import cutlass.cute
    import flash_attn.cute.interface  # noqa: F401  (timed here, not in the first config)

    import_seconds = time.perf_counter() - start
    counter = _CountingCompile(cutlass.cute.compile)
    cutlass.cute.compile = counter
    print(ENV_PREFIX + json.dumps({"versions": versions, "import_seconds": import_seconds}))
    sys.stdout.flush()
    for config in select_configs(names):
        result = _compile_one(config, arch, counter)
        print(RESULT_PREFIX + json.dumps(asdict(result)))
        sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------------------------
# Command line


def format_report(report: GateReport) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items()) or "versions unknown"
    lines = [f"FA4 compile gate for {report.arch} (fake CUDA tensors, no GPU): {versions}"]
    if report.import_seconds is not None:
        lines.append(f"importing flash_attn.cute: {report.import_seconds:.1f} s")
    width = max([len(r.name) for r in report.results] + [6])
    lines.append(f"{'config':<{width}}  result  seconds  compiled")
    for r in report.results:
        status = "ok" if r.ok else "FAILED"
        detail = ", ".join(r.kernels) if r.ok else (r.error or "")
        lines.append(f"{r.name:<{width}}  {status:<6}  {r.seconds:7.1f}  {detail}")
    passed = sum(r.ok for r in report.results)
    lines.append(f"{passed}/{len(report.results)} configurations compiled")
    if not report.ok and report.stderr_tail.strip():
        lines.append("gate process stderr (tail):")
        lines += ["  " + line for line in report.stderr_tail.strip().splitlines()[-20:]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flash_attn_vsa.compile_gate",
        description="Compile the FA4 kernel configurations we use for sm_90a, without a GPU.",
    )
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        dest="configs",
        metavar="NAME",
        help="a configuration to compile (repeatable; default: all, see --list)",
    )
    parser.add_argument("--arch", default=DEFAULT_ARCH, choices=sorted(ARCHS))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--dump-dir", help="keep the PTX and cubins of the compiled kernels here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole gate")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.list:
        for c in CONFIGS:
            blocks = "dense" if c.block_size is None else f"blocks {c.block_size}"
            print(f"{c.name:<24} {c.direction}  {blocks:<18} {c.kernel:<28} {c.why}")
        return 0
    try:
        names = [c.name for c in select_configs(args.configs)]
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker:
        return _worker(names, args.arch)
    dump_dir = os.path.abspath(args.dump_dir) if args.dump_dir else None
    report = run_gate(names, arch=args.arch, dump_dir=dump_dir, timeout=args.timeout)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

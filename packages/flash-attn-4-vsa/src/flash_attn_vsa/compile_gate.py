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

The fork's kernels are in :data:`CONFIGS` beside the upstream configurations the adapter uses.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    direction: str  # "fwd", "bwd" (upstream's entry points); ours: "bwd-kv64[+CONFIG]" and the fork
    # forwards `FORK_FORWARDS` with their variants (`FORK_FORWARD_OPTIONS`), e.g. "fwd-q64+q-regs"
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
        "fwd-sparse-q64-kv64-two-ctas",
        "fwd-q64",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtas",
        "the fork's block-sparse forward with 64x64 blocks, two CTAs per SM "
        "(flash_attn_vsa.fwd_sm90)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-ctas-q-in-registers",
        "fwd-q64+q-regs",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegisters",
        "the same with QK^T reading Q from registers (flash_attn_vsa.q_regs_sm90; what vsa-fa4 "
        "runs for 64x64 forwards)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-ctas-q-in-registers-combined",
        "fwd-q64+q-regs+combine",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegistersCombined",
        "the same with VSA's combine (fine + coarse) in its epilogue, no lse "
        "(flash_attn_vsa.combine_sm90; vsa-fa4's inference forward without a gate)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-ctas-q-in-registers-combined-gated",
        "fwd-q64+q-regs+combine-gated",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegistersCombinedGated",
        "the same with the gate (fine + gate * coarse; vsa-fa4's inference forward)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-ctas-q-in-registers-valid-in-list",
        "fwd-q64+q-regs+valid-in-list",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegistersValidInList",
        "the same with partial key blocks whose valid sizes ride in the list entries "
        "(flash_attn_vsa.valid_in_list_sm90; what vsa-fa4 runs for partial key blocks)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-ctas-q-in-registers-valid-in-list-zero-v-padding",
        "fwd-q64+q-regs+valid-in-list+zero-v-padding",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegistersValidInListVPaddingZeroed",
        "the same zeroing partial key blocks' V padding rows in shared memory "
        "(flash_attn_vsa.experimental.v_padding_sm90; vsa-fa4's zero_v_padding variant)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-ctas-q-in-registers-valid-in-list-zero-v-padding-combined-gated",
        "fwd-q64+q-regs+valid-in-list+zero-v-padding+combine-gated",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegistersValidInListVPaddingZeroedCombinedGated",
        "the same with the gated combine in its epilogue (that variant's inference forward "
        "of video_sparse_attn on tile-order inputs with partial tiles)",
    ),
    GateConfig(
        "fwd-sparse-q128-kv64-paired",
        "fwd-paired",
        (128, 128),
        "FlashAttentionForwardSm90PairedKeys",
        "the fork's 128x64 block-sparse forward over pairs of 64-token key blocks "
        "(flash_attn_vsa.fwd_sm90_paired)",
    ),
    GateConfig(
        "fwd-sparse-q128-kv64-paired-q-in-registers",
        "fwd-paired+q-regs",
        (128, 128),
        "FlashAttentionForwardSm90PairedKeysQInRegisters",
        "the same with QK^T reading Q from registers (flash_attn_vsa.q_regs_sm90; measured "
        "slower here, not routed)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-streams",
        "fwd-streams",
        (128, 64),
        "FlashAttentionForwardSm90TwoStreams",
        "the fork's 64x64 forward as two query streams per 128-row tile "
        "(flash_attn_vsa.experimental.fwd_sm90_streams; measured slower, not routed)",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-streams-q-in-registers",
        "fwd-streams+q-regs",
        (128, 64),
        "FlashAttentionForwardSm90TwoStreamsQInRegisters",
        "the same with QK^T reading Q from registers",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-streams-persistent",
        "fwd-streams+persistent",
        (128, 64),
        "FlashAttentionForwardSm90TwoStreamsPersistent",
        "the two-stream forward on persistent CTAs (flash_attn_vsa.experimental.persistent_sm90; "
        "experimental, not routed)",
    ),
    GateConfig(
        "fwd-sparse-q128-kv64-paired-persistent",
        "fwd-paired+persistent",
        (128, 128),
        "FlashAttentionForwardSm90PairedKeysPersistent",
        "the paired-key forward on persistent CTAs",
    ),
    GateConfig(
        "fwd-sparse-q64-kv64-two-ctas-persistent",
        "fwd-q64+persistent",
        (64, 64),
        "FlashAttentionForwardSm90TwoCtasPersistent",
        "the two-CTA forward on persistent CTAs (two per SM)",
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
    GateConfig(
        "bwd-sparse-q64-kv64",
        "bwd-kv64",
        (64, 64),
        "FlashAttentionBackwardSm90Dq2Parts1BuffersProducerTwoCtas",
        "the fork's block-sparse backward with 64x64 blocks, two CTAs per SM, dQ sent in halves "
        "by the producer warp (flash_attn_vsa.bwd_sm90, bwd_sm90_dq_parts)",
    ),
    GateConfig(
        "bwd-sparse-q128-kv64",
        "bwd-kv64",
        (128, 64),
        "FlashAttentionBackwardSm90KV64",
        "the fork's block-sparse backward with 128x64 blocks, two MMA warpgroups "
        "(flash_attn_vsa.bwd_sm90)",
    ),
    GateConfig(
        "bwd-sparse-q64-kv64-staged",
        "bwd-kv64+kv64-staged",
        (64, 64),
        "FlashAttentionBackwardSm90KV64",
        "the 64x64 backward shipped until session 9: one CTA per SM, dQ staged for upstream's "
        "producer warp (flash_attn_vsa.experimental.bwd_configs; kept for comparison)",
    ),
    GateConfig(
        "bwd-sparse-q64-kv64-ds",
        "bwd-kv64+kv64-ds",
        (64, 64),
        "FlashAttentionBackwardSm90DsOutTwoCtas",
        "the 64x64 backward writing dS for a separate dQ pass, two CTAs per SM "
        "(flash_attn_vsa.bwd_sm90_ds_out)",
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


def pick_by_name(configs: Sequence[Any], names: Sequence[str] | None) -> list[Any]:
    """The configurations named (in that order; all when ``names`` is empty), each having a
    ``name``; ValueError listing the known names for an unknown one."""
    if not names:
        return list(configs)
    by_name = {c.name: c for c in configs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]


def select_configs(names: Sequence[str] | None) -> list[GateConfig]:
    return pick_by_name(CONFIGS, names)


def run_gate(
    configs: Sequence[str] | None = None,
    *,
    arch: str = DEFAULT_ARCH,
    dump_dir: str | None = None,
    timeout: float = 900.0,
) -> GateReport:
    """Compile the named configurations (default: all) in a fresh process; never raises for
    a failed compilation, which is reported in the results. ``dump_dir`` (created if missing:
    CuTe DSL silently keeps nothing in a folder that does not exist) receives the PTX and
    cubins."""
    selected = select_configs(configs)
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
    cmd = ["--arch", arch, *(arg for config in selected for arg in ("-c", config.name))]
    output = run_worker(
        "flash_attn_vsa.compile_gate",
        cmd,
        gate_environment(arch, dump_dir),
        timeout,
        env_prefix=ENV_PREFIX,
        result_prefix=RESULT_PREFIX,
    )
    return GateReport(
        arch=arch,
        results=output.results_for([config.name for config in selected]),
        versions=output.info.get("versions", {}),
        import_seconds=output.info.get("import_seconds"),
        returncode=output.returncode,
        stderr_tail=output.stderr[-4000:],
    )


@dataclass
class WorkerOutput:
    """What a gate's worker process printed: its environment line, its results by name."""

    info: dict[str, Any]
    results: dict[str, GateResult]
    returncode: int
    stderr: str

    def results_for(self, names: Sequence[str], *, exit_label: str = "exit ") -> list[GateResult]:
        """The results of ``names`` in order; one the process did not report counts as failed."""
        last = self.stderr.strip().splitlines()[-1] if self.stderr.strip() else "no output"
        error = f"gate process ended ({exit_label}{self.returncode}): {last}"
        return [
            self.results.get(name) or GateResult(name, False, 0.0, error=error) for name in names
        ]


def run_worker(
    module: str,
    args: Sequence[str],
    environment: dict[str, str],
    timeout: float,
    *,
    env_prefix: str,
    result_prefix: str,
) -> WorkerOutput:
    """Run ``python -m module --worker *args`` with ``environment`` on top of the caller's and
    collect the lines it prints (see :func:`serve_worker`); never raises for a failed run."""
    cmd = [sys.executable, "-m", module, "--worker", *args]
    env = {**os.environ, **environment}
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = _text(exc.stdout)
        stderr = _text(exc.stderr) + f"\n(timed out after {timeout:.0f} s)"
        returncode = -1
    output = WorkerOutput(info={}, results={}, returncode=returncode, stderr=stderr)
    for line in stdout.splitlines():
        try:
            if line.startswith(env_prefix):
                output.info = json.loads(line[len(env_prefix) :])
            elif line.startswith(result_prefix):
                result = GateResult(**json.loads(line[len(result_prefix) :]))
                output.results[result.name] = result
        except (ValueError, TypeError, KeyError):
            continue  # a line cut short by a crash: its configuration counts as failed
    return output


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


# --------------------------------------------------------------------------------------------
# The worker: runs in the gate's own process, with the environment above


class CountingCompile:
    """Stands in for ``cutlass.cute.compile`` in the worker and records what it compiles
    (:meth:`kernel_name` of each compiled object)."""

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


_CountingCompile = CountingCompile


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
    forward = direction.startswith("fwd")
    rows, cols = (q_blocks, kv_blocks) if forward else (kv_blocks, q_blocks)

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


@contextmanager
def fake_cuda_qkv() -> Iterator[tuple[Any, Any, Any]]:
    """Fake-tensor mode with fake CUDA ``q, k, v`` of the gate's shape ([B, S, H, D], bf16):
    upstream's entry points compile their kernels in it and skip the launch."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = getattr(torch, DTYPE)
    with FakeTensorMode(allow_non_fake_inputs=True):
        shape = (BATCH, SEQLEN, HEADS, HEAD_DIM)
        q, k, v = (torch.empty(shape, dtype=dtype, device="cuda") for _ in range(3))
        yield q, k, v


def timed_compile(
    name: str, counter: CountingCompile, body: Callable[[], object], kernel: str | None
) -> GateResult:
    """Run ``body`` and report what it compiled; it passes when it returns having compiled
    ``kernel`` (any kernels, where ``kernel`` is None)."""
    before = len(counter.compiled)
    start = time.perf_counter()
    try:
        body()
    except Exception as exc:
        seconds = time.perf_counter() - start
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()
        return GateResult(
            name, False, seconds, counter.compiled[before:], " | ".join(message)[:2000]
        )
    seconds = time.perf_counter() - start
    kernels = counter.compiled[before:]
    if kernel is not None and kernel not in kernels:
        error = f"returned without compiling {kernel} (compiled: {kernels or 'nothing'})"
        return GateResult(name, False, seconds, kernels, error)
    return GateResult(name, True, seconds, kernels)


FORK_FORWARDS = {
    # direction -> (module, entry point, takes the key blocks' valid sizes)
    "fwd-q64": ("fwd_sm90", "block_sparse_forward_q64", False),
    "fwd-paired": ("fwd_sm90_paired", "block_sparse_forward_paired", True),
    "fwd-streams": ("experimental.fwd_sm90_streams", "block_sparse_forward_streams", True),
}
FORK_FORWARD_OPTIONS = {
    "q-regs": "q_in_registers",
    "persistent": "persistent",
    "zero-v-padding": "zero_v_padding",
}
"""A fork forward's direction is ``KIND[+OPTION...]``: the options are its variants, or
`COMBINE_OPTIONS` (the combine's operands, fake tensors)."""
COMBINE_OPTIONS = ("combine", "combine-gated")
VALID_IN_LIST_OPTION = "valid-in-list"


def _fork_forward(direction: str, q: Any, k: Any, v: Any, sparse: Any) -> None:
    import importlib

    import torch

    kind, *options = direction.split("+")
    module, entry, takes_valid = FORK_FORWARDS[kind]
    run = getattr(importlib.import_module(f"flash_attn_vsa.{module}"), entry)
    variants: dict[str, Any] = {
        FORK_FORWARD_OPTIONS[o]: True
        for o in options
        if o not in COMBINE_OPTIONS and o != VALID_IN_LIST_OPTION
    }
    if VALID_IN_LIST_OPTION in options:  # the partial lists' mask, its valid sizes in entries
        from flash_attn_vsa.mask_sm90 import valid_in_list_mask_mod

        variants["mask_mod"] = valid_in_list_mask_mod(64)
        variants["aux_tensors"] = [torch.empty(SEQLEN // 64, dtype=torch.int32, device="cuda")]
    if set(options) & set(COMBINE_OPTIONS):
        variants["coarse"] = q.new_empty((BATCH, SEQLEN // 64, HEADS, HEAD_DIM))
        if "combine-gated" in options:
            variants["gate"] = torch.empty_like(q)
    valid = (torch.empty(SEQLEN // 64, dtype=torch.int32, device="cuda"),) if takes_valid else ()
    run(q, k, v, sparse, *valid, softmax_scale=HEAD_DIM**-0.5, **variants)


def _fork_backward(config: GateConfig, *tensors: Any) -> None:
    """The fork's KV64 backward; ``bwd-kv64+NAME`` passes it
    `flash_attn_vsa.experimental.bwd_configs.EXPERIMENTAL_CONFIGS` [NAME] as its ``config``."""
    import torch

    from flash_attn_vsa import bwd_sm90

    _, *names = config.direction.split("+")
    tile_config = None
    if names:
        from flash_attn_vsa.experimental.bwd_configs import EXPERIMENTAL_CONFIGS

        tile_config = EXPERIMENTAL_CONFIGS[names[0]]
    extra: dict[str, Any] = {}
    if tile_config is not None and tile_config.dq_from_ds:  # its dS buffer and slot starts
        q = tensors[0]
        blocks = SEQLEN // 64
        extra["aux_tensors"] = [
            q.new_empty((BATCH * HEADS * blocks * blocks * 64, 64)),
            torch.empty(BATCH, HEADS, blocks, dtype=torch.int32, device="cuda"),
        ]
    bwd_sm90.block_sparse_backward_kv64(
        *tensors, softmax_scale=HEAD_DIM**-0.5, config=tile_config, **extra
    )


def _compile_one(config: GateConfig, arch: str, counter: CountingCompile) -> GateResult:
    def body() -> None:
        import torch
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

        with fake_cuda_qkv() as (q, k, v):
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
            elif config.direction.split("+")[0] in FORK_FORWARDS:
                _fork_forward(config.direction, q, k, v, sparse)
            else:
                out, dout = torch.empty_like(q), torch.empty_like(q)
                lse = torch.empty(BATCH, HEADS, SEQLEN, dtype=torch.float32, device="cuda")
                if config.direction.split("+")[0] == "bwd-kv64":
                    _fork_backward(config, q, k, v, out, dout, lse, sparse)
                else:
                    _flash_attn_bwd(q, k, v, out, dout, lse, block_sparse_tensors=sparse)

    return timed_compile(config.name, counter, body, config.kernel if arch == "sm_90a" else None)


def serve_worker(
    arch: str,
    configs: Sequence[Any],
    compile_one: Callable[[Any, Any], GateResult],
    *,
    env_prefix: str,
    result_prefix: str,
    info: dict[str, Any] | None = None,
    counter_type: type[CountingCompile] = CountingCompile,
) -> int:
    """The worker's side of :func:`run_worker`: check the environment, import upstream (timed),
    count what ``cutlass.cute.compile`` compiles, and print an environment line (``info`` and
    the import time), then one result line per configuration."""
    import warnings

    expected = gate_environment(arch)
    wrong = {k: os.environ.get(k) for k in expected if os.environ.get(k) != expected[k]}
    if wrong:
        print(f"the gate worker needs {expected}; differs: {wrong}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")  # upstream's fake-mode warnings are noise here
    start = time.perf_counter()
    import cutlass.cute
    import flash_attn.cute.interface  # noqa: F401  (timed here, not in the first config)

    import_seconds = time.perf_counter() - start
    counter = counter_type(cutlass.cute.compile)
    cutlass.cute.compile = counter
    print(env_prefix + json.dumps({**(info or {}), "import_seconds": import_seconds}), flush=True)
    for config in configs:
        print(result_prefix + json.dumps(asdict(compile_one(config, counter))), flush=True)
    return 0


def _worker(names: Sequence[str], arch: str) -> int:
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "torch"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    return serve_worker(
        arch,
        select_configs(names),
        lambda config, counter: _compile_one(config, arch, counter),
        env_prefix=ENV_PREFIX,
        result_prefix=RESULT_PREFIX,
        info={"versions": versions},
    )


# --------------------------------------------------------------------------------------------
# Command line


def format_results(
    results: Sequence[GateResult],
    import_seconds: float | None,
    *,
    header: bool = True,
    seconds: str = "{:7.1f}",
) -> list[str]:
    """The import time and a table row per result (config, ok/FAILED, seconds, kernels or
    error); ``seconds`` formats the time."""
    lines = []
    if import_seconds is not None:
        lines.append(f"importing flash_attn.cute: {import_seconds:.1f} s")
    width = max([len(r.name) for r in results] + [6])
    if header:
        lines.append(f"{'config':<{width}}  result  seconds  compiled")
    for r in results:
        status = "ok" if r.ok else "FAILED"
        detail = ", ".join(r.kernels) if r.ok else (r.error or "")
        lines.append(f"{r.name:<{width}}  {status:<6}  {seconds.format(r.seconds)}  {detail}")
    return lines


def format_report(report: GateReport) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items()) or "versions unknown"
    lines = [f"FA4 compile gate for {report.arch} (fake CUDA tensors, no GPU): {versions}"]
    lines += format_results(report.results, report.import_seconds)
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

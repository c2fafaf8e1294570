"""Compile gate of the adapter: its FA4 calls compile for sm_90a on a machine without a GPU.

Follows ``flash_attn_vsa.compile_gate``'s recipe (and reuses its environment): a fresh
process with ``CUTE_DSL_ARCH=sm_90a``, ``FLASH_ATTENTION_ARCH=sm_90``,
``FLASH_ATTENTION_NUM_SMS=132`` and the kernel caches off runs the adapter's own op bodies
(`vsa_fa4.ops.forward_impl` / `backward_impl`: metadata construction, the partial-block
``mask_mod`` with the valid sizes in ``aux_tensors``, the FA4 call) on fake CUDA tensors under
``FakeTensorMode``, where upstream compiles its kernels and skips the launch. A configuration
passes when its call returns and compiles its kernel class, with our ``mask_mod`` in it or
(configurations marked unmasked) without it.

The configurations cover every distinct kernel the schedules produce at head dim 128, bf16:
forward for each physical tile, backward with 128-token key blocks (upstream's kernel) and
64-token key blocks (the fork's, ``flash_attn_vsa.bwd_sm90``), with our ``mask_mod`` and, for
layouts without partial key blocks, without it. ::

    python -m vsa_fa4.compile_gate            # table; exit 1 on a failure
    python -m vsa_fa4.compile_gate --list
    python -m vsa_fa4.compile_gate --json -c fwd-256x256
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flash_attn_vsa.compile_gate import (
    BATCH,
    HEAD_DIM,
    HEADS,
    SEQLEN,
    CountingCompile,
    GateReport,
    GateResult,
    fake_cuda_qkv,
    format_results,
    gate_environment,
    pick_by_name,
    run_worker,
    serve_worker,
    timed_compile,
)

ARCH = "sm_90a"
WIDTH = 3  # key-list width of the fake layouts
RESULT_PREFIX = "vsa-fa4-compile-gate-result "
ENV_PREFIX = "vsa-fa4-compile-gate-env "


@dataclass(frozen=True)
class GateConfig:
    name: str
    direction: str  # "fwd", "bwd" or "fwd-combined" (inference with VSA's gated combine)
    block_shape: tuple[int, int]  # logical
    schedule: str
    physical: tuple[int, int]  # the physical sparse block the plan must produce
    kernel: str
    masked: bool = True  # partial key blocks possible: the kernels carry our mask_mod
    backward: str | None = None  # a ``flash_attn_vsa.bwd_sm90`` config's name (None: default)


CONFIGS: tuple[GateConfig, ...] = (
    GateConfig(  # shipped with Q in registers (vsa_fa4.launch.Q_IN_REGISTERS_WHERE_FASTER),
        # partial blocks' valid sizes in the list entries (flash_attn_vsa.valid_in_list_sm90)
        "fwd-64x64", "fwd", (64, 64), "native", (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegistersValidInList",
    ),
    GateConfig(  # inference: VSA's combine in the epilogue (flash_attn_vsa.combine_sm90)
        "fwd-64x64-combined", "fwd-combined", (64, 64), "native", (64, 64),
        "FlashAttentionForwardSm90TwoCtasQInRegistersValidInListCombinedGated",
    ),
    GateConfig(
        "fwd-64x64-paired", "fwd", (64, 64), "paired", (128, 64),
        "FlashAttentionForwardSm90PairedKeys",
    ),
    GateConfig("fwd-128x128", "fwd", (128, 128), "native", (128, 128), "FlashAttentionForwardSm90"),
    GateConfig("fwd-256x256", "fwd", (256, 256), "native", (256, 128), "FlashAttentionForwardSm90"),
    GateConfig(
        "bwd-128x128", "bwd", (128, 128), "native", (128, 128), "FlashAttentionBackwardSm90"
    ),
    GateConfig(
        "bwd-256x256", "bwd", (256, 256), "native", (256, 128), "FlashAttentionBackwardSm90"
    ),
    GateConfig(  # the default: dS written for the dQ pass (flash_attn_vsa.bwd_sm90_ds_out)
        "bwd-64x64", "bwd", (64, 64), "native", (64, 64), "FlashAttentionBackwardSm90DsOutTwoCtas",
    ),
    GateConfig(  # dQ by float32 reduce-adds (the default until session 27)
        "bwd-64x64-float32-dq", "bwd", (64, 64), "native", (64, 64),
        "FlashAttentionBackwardSm90Dq2Parts1BuffersProducerTwoCtas", backward="KV64_CONFIG",
    ),
    GateConfig(
        "bwd-64x64-paired", "bwd", (64, 64), "paired", (128, 64),
        "FlashAttentionBackwardSm90KV64",
    ),
    # Layouts known to have no partial key block: kernels without a mask_mod.
    GateConfig(
        "fwd-128x128-full", "fwd", (128, 128), "native", (128, 128), "FlashAttentionForwardSm90",
        masked=False,
    ),
    GateConfig(
        "bwd-64x64-full", "bwd", (64, 64), "native", (64, 64),
        "FlashAttentionBackwardSm90DsOutTwoCtas", masked=False,
    ),
)  # fmt: skip
"""One configuration per distinct kernel (FA4 caches compiled kernels in the process, so a
second configuration with the same physical tile would compile nothing; the dS-writing
backward's Triton passes, `vsa_fa4.dq_from_ds_triton`'s and the list kernels', do not run on
fake tensors and are skipped). Logical 128x64 runs
the paired kernel's tiles (128x64, forward and the fork's two-warpgroup backward, as
``bwd-64x64-paired``); 64x128 adds a 64x128 forward and a Q64 backward kernel."""


def select_configs(names: Sequence[str] | None) -> list[GateConfig]:
    return pick_by_name(CONFIGS, names)


def run_gate(configs: Sequence[str] | None = None, *, timeout: float = 600.0) -> GateReport:
    """Compile the named configurations (default: all) in a fresh process."""
    selected = select_configs(configs)
    output = run_worker(
        "vsa_fa4.compile_gate",
        [arg for config in selected for arg in ("-c", config.name)],
        gate_environment(ARCH),
        timeout,
        env_prefix=ENV_PREFIX,
        result_prefix=RESULT_PREFIX,
    )
    return GateReport(
        arch=ARCH,
        results=output.results_for([config.name for config in selected], exit_label=""),
        import_seconds=output.info.get("import_seconds"),
        returncode=output.returncode,
        stderr_tail=output.stderr[-4000:],
    )


# --------------------------------------------------------------------------------------------
# The worker (in the gate's process)


class _Counter(CountingCompile):
    """Records each compiled kernel's class and whether it carries a mask_mod
    (``name+mask_mod``)."""

    @staticmethod
    def kernel_name(fn: Any) -> str:
        name = CountingCompile.kernel_name(fn)
        if getattr(getattr(fn, "__self__", fn), "mask_mod", None) is not None:
            name += "+mask_mod"
        return name


def _compile_one(config: GateConfig, counter: _Counter) -> GateResult:
    def body() -> None:
        import torch

        from vsa_fa4.launch import KernelChoice
        from vsa_fa4.metadata import physical_lists
        from vsa_fa4.ops import backward_impl, forward_combined_impl, forward_impl
        from vsa_fa4.schedule import make_plan

        _skip_triton_launches()

        q_block, kv_block = config.block_shape
        num_q, num_kv = SEQLEN // q_block, SEQLEN // kv_block
        plan = make_plan(config.block_shape, 2, num_q, config.schedule)
        if plan.block_size != config.physical:
            raise AssertionError(f"plan gives {plan.block_size}, expected {config.physical}")
        with fake_cuda_qkv() as (q, k, v):
            i32 = {"dtype": torch.int32, "device": "cuda"}
            kv_indices = torch.zeros(BATCH, HEADS, num_q, WIDTH, **i32)
            kv_counts = torch.zeros(BATCH, HEADS, num_q, **i32)
            valid = torch.zeros(num_kv, **i32)
            phys = physical_lists(kv_indices, kv_counts, valid, plan, 2)
            args = (*phys, HEAD_DIM**-0.5, *plan.block_size, config.masked)
            if config.direction == "fwd-combined":
                coarse = q.new_empty((BATCH, num_q, HEADS, HEAD_DIM))
                combined = (coarse, torch.empty_like(q), HEAD_DIM**-0.5, config.masked)
                forward_combined_impl(q, k, v, *phys, *combined)
                return
            out, lse = forward_impl(q, k, v, *args)
            if config.direction == "bwd":
                kernels = ""
                if config.backward is not None:
                    from flash_attn_vsa import bwd_sm90

                    kernels = KernelChoice(backward=getattr(bwd_sm90, config.backward)).encode()
                backward_impl(torch.empty_like(out), q, k, v, out, lse, *args, kernels)

    kernel = config.kernel + ("+mask_mod" if config.masked else "")
    return timed_compile(config.name, counter, body, kernel)


def _skip_triton_launches() -> None:
    """The dS-writing backward's Triton launches (its lists with their places, and the dQ
    pass) do nothing here: Triton compiles for the device it finds, and there is none; their
    Python still runs and allocates (fake) outputs."""
    from vsa_fa4 import backward_lists_triton, dq_from_ds_triton

    def skip(*args: Any, **kwargs: Any) -> None:
        return None

    backward_lists_triton.launch = dq_from_ds_triton.launch = skip


def _worker(names: Sequence[str]) -> int:
    return serve_worker(
        ARCH,
        select_configs(names),
        _compile_one,
        env_prefix=ENV_PREFIX,
        result_prefix=RESULT_PREFIX,
        counter_type=_Counter,
    )


def format_report(report: GateReport) -> str:
    lines = [f"vsa-fa4 compile gate for {ARCH} (fake CUDA tensors, no GPU)"]
    lines += format_results(
        report.results, report.import_seconds, header=False, seconds="{:5.1f} s"
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
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

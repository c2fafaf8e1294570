"""Experiment 19 (session 25): what delta 11's zeroing of V's padding rows costs, part by part.

Delta 11 (`flash_attn_vsa.experimental.v_padding_sm90`) zeroes a partial key block's V padding
rows in shared memory before the P V product that reads them: per partial step and thread at
most eight 16-byte shared stores, a proxy fence (``fence.proxy.async``: generic-proxy stores
before an async-proxy wgmma read) and a named barrier over the warpgroup. Through the whole op
(`bench_video.py`, H200, session 25) the forward ran 10-14% slower than the shipped one, which
reads a zeroed copy of v instead, in each of three placements of the zeroing (after the step,
after the previous P V's issue, before the block's own P V): the placement is not what costs.

Arms, on the same lists and inputs, interleaved call by call (kernels only, through
`vsa_fa4.ops.attention`, as the op builds the lists), S=32768, 12 heads, 64x64, a quarter of
the key blocks partial:

- ``all_full``: the shipped forward on the same lists with every key block full;
- ``partial``: the shipped forward (reads v's padding zeroed by the caller: here, finite);
- ``zero``: delta 11's forward, with the zeroing reduced by ``--ablation``: ``none`` (as
  built), ``no_fence``, ``no_barrier``, ``no_stores`` (fence and barrier only),
  ``no_zeroing`` (the entry re-read and the branch, nothing else). The ablations are wrong
  where padding is not finite (timed only); each needs its own process, since the kernel's
  compile cache knows it by its `ForwardKernel` alone. ``pv_valid_steps`` is a design, not
  an ablation (correct, checked against ``partial``): a partial block's P V issues only the
  16-key k-steps below its valid size (the first always) and zeroes only the rows of the last
  one past the size (none for a multiple of 16), instead of all 64 rows. ::

    for a in none no_fence no_barrier no_stores no_zeroing; do
      python3 -m research.fa4_fork.experiments.v_padding_cost --ablation $a --out DIR
    done
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

ABLATIONS = ("none", "no_fence", "no_barrier", "no_stores", "no_zeroing", "pv_valid_steps")


def install_ablation(ablation: str) -> None:
    """Replace delta 11's zeroing body by the ablated one (before any compile)."""
    from flash_attn_vsa.experimental import v_padding_sm90 as delta

    if ablation == "none":
        return
    if ablation == "pv_valid_steps":
        delta._zeroing_before = _zeroing_before_valid_steps
        return
    stores = ablation not in ("no_stores", "no_zeroing")
    fence = ablation not in ("no_fence", "no_zeroing")
    barrier = ablation not in ("no_barrier", "no_zeroing")

    @functools.cache
    def ablated() -> object:
        import cutlass
        import cutlass.cute as cute

        barrier_id = delta._barrier_id()
        store_zeros = delta.store_zeros_fn()

        @cute.jit
        def zero_rows_from(
            stage: cute.Tensor, first_row: cutlass.Int32, tidx: cutlass.Int32,
            needed: cutlass.Boolean,
        ):  # fmt: skip
            if needed:
                if cutlass.const_expr(stores):
                    store_zeros(stage, first_row, cute.size(stage, mode=[0]), tidx)
                if cutlass.const_expr(fence):
                    cute.arch.fence_view_async_shared()
                if cutlass.const_expr(barrier):
                    cute.arch.barrier(
                        barrier_id=barrier_id, number_of_threads=delta.WARPGROUP_THREADS
                    )

        return zero_rows_from

    delta._zero_rows_fn = ablated


@functools.cache
def _valid_steps_fns() -> tuple:
    """The jitted pieces of ``pv_valid_steps``: the k-step limit, the zeroing of the rows
    between the valid size and that limit, and the P V product over the steps below it."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup

    from flash_attn_vsa.experimental import v_padding_sm90 as delta

    barrier_id = delta._barrier_id()
    threads = delta.WARPGROUP_THREADS
    store_zeros = delta.store_zeros_fn()

    @cute.jit
    def row_limit(first_row: cutlass.Int32, needed: cutlass.Boolean, step: cutlass.Constexpr,
                  rows: cutlass.Constexpr) -> cutlass.Int32:  # fmt: skip
        limit = cutlass.Int32(rows)
        if needed:  # the rows the issued k-steps read: the valid size rounded up to a step
            limit = (first_row + (step - 1)) // step * step
        return limit

    @cute.jit
    def zero_rows_between(stage: cute.Tensor, first_row: cutlass.Int32, end_row: cutlass.Int32,
                          tidx: cutlass.Int32, needed: cutlass.Boolean):  # fmt: skip
        if needed and first_row < end_row:
            store_zeros(stage, first_row, end_row, tidx)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)

    @cute.jit
    def product_below(tiled_mma, acc, tCrA, tCrB, limit: cutlass.Int32,
                      zero_init: cutlass.Constexpr, wg_wait: cutlass.Constexpr,
                      step: cutlass.Constexpr):  # fmt: skip
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
            if cutlass.const_expr(k == 0):
                cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            else:
                if k * step < limit:
                    cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        if cutlass.const_expr(wg_wait >= 0):
            warpgroup.wait_group(wg_wait)

    return row_limit, zero_rows_between, product_below


def _zeroing_before_valid_steps(product, first_row, needed):
    """``pv_valid_steps``'s stand-in for delta 11's `_zeroing_before`: ``product`` is
    upstream's ``partial(gemm_w_idx, tiled_mma_pv, acc_O, tOrP, tOrVt, ...)``."""
    import cutlass.cute as cute

    from flash_attn_vsa.experimental import v_padding_sm90 as delta

    v = delta._stages()
    tiled_mma, acc, tCrA, tCrB = product.args[:4]
    row_limit, zero_rows_between, product_below = _valid_steps_fns()

    def zero_then_product(*args, **kwargs):
        if args:
            raise RuntimeError("upstream's P V call passes keywords only")
        given = {**product.keywords, **kwargs}
        stage_index = given["B_idx"]
        stage = v.sV[None, None, stage_index]
        rows = cute.size(stage, mode=[0])
        step = rows // cute.size(tCrA.shape[2])
        limit = row_limit(first_row, needed, step, rows)
        zero_rows_between(stage, first_row, limit, v.tidx, needed)
        rB = tCrB[None, None, None, stage_index]
        product_below(tiled_mma, acc, tCrA, rB, limit, given["zero_init"],
                      given.get("wg_wait", -1), step)  # fmt: skip

    return zero_then_product


def run(args) -> int:
    import torch

    from research.fa4_fork.experiments.partial_block_cost import layouts_and_inputs
    from research.harness import benchmark_module
    from vsa_fa4 import ops
    from vsa_fa4.launch import SHIPPED, ForwardVariant, KernelChoice
    from vsa_fa4.schedule import make_plan

    install_ablation(args.ablation)
    bt = benchmark_module("bench_timing")
    scale = 128**-0.5
    layouts, (q, k, v) = layouts_and_inputs(args, 3)
    plan = make_plan((64, 64))
    zeroing = KernelChoice(ForwardVariant(zero_v_padding=True))

    def arm(layout, full, kernels):
        def call():
            lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
            return ops.attention(q, k, v, *lists, scale, plan, 1, full, kernels)[0]

        return call

    fns = {
        "all_full": arm(layouts["full"], True, SHIPPED),
        "partial": arm(layouts["partial"], False, SHIPPED),
        "zero": arm(layouts["partial"], False, zeroing),
    }
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(3):
                fn()
        diff = (fns["zero"]().float() - fns["partial"]().float()).abs().max().item()
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(bt.events_ms(fn, args.calls))
    row = {"ablation": args.ablation, **{n: statistics.median(t) for n, t in times.items()}}
    row["partial_over_full"] = row["partial"] / row["all_full"] - 1
    row["zero_over_partial"] = row["zero"] / row["partial"] - 1
    row["zero_vs_partial_max_abs"] = diff
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        doc = {"experiment": "v_padding_cost", "device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": " ".join(sys.argv), "row": row}  # fmt: skip
        (Path(args.out) / f"v_padding_cost-{args.ablation}.json").write_text(
            json.dumps(doc, indent=1)
        )
    return 0


def main(argv=None) -> int:
    from research.fa4_fork.experiments.partial_block_cost import add_run_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ablation", choices=ABLATIONS, default="none")
    add_run_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""Experiment 17 (prepared in session 18, not yet run): where the partial key blocks' cost
goes in the 64x64 forward and backward (issue 20, item 3).

Session 17 measured fa4 64x64 at S=32768, H=12, 87.5% native lists with a quarter of the key
blocks partial (`bench_vsa.py --partial-blocks 0.25`) +13.4% forward and +7.3% backward over
the same lists with every block full, while kernels compiled with the mask on all-full blocks
cost +0.4% / +0.0% (session 16): the cost is in the steps that visit a partial block. Such a
step differs from a full one by (a) the two lists: FA4 walks a query block's partial list and
its full list as two loops, each with its own first and last half-step; (b) the column limit,
whose one input is ``valid_sizes[block]``, a global load issued after the step's QK^T, just
before the mask (`mask_sm90.keep_valid_columns`): if its latency is exposed, each partial
step waits for it.

Arms, all on the same lists and inputs, interleaved call by call (kernels only, through
`vsa_fa4.ops.attention`, which builds FA4's lists on the device as the op does):

- ``all_full``: the lists with every key block full (valid sizes 64): one list, no mask;
- ``partial``: a quarter of the key blocks partial, the shipped mask (two lists + load);
- ``partial_no_load``: the same two lists and the same column-limit code, but the limit from a
  compile-time constant (``KV_TILE // 2``) instead of the load: wrong results (timed only),
  the difference to ``partial`` is the load's cost;
- ``partial_unmasked``: the same valid sizes but ``kv_blocks_full`` claimed: one list, no mask,
  padding attended (wrong results, timed only): the difference to ``partial`` is the split
  and the mask together, i.e. all that "partial blocks at no cost" can win;
- ``all_masked`` (added in session 19): the partial layout with every listed key block in the
  forward's masked list (the full list empty): one list, the shipped column limit (and its
  load) on every step; correct results. Against ``partial`` it prices the split into two
  loops; against ``all_full`` the mask with its load on every step. If it is within ~3% of
  ``all_full``, the fix needs no kernel change (only how vsa-fa4 builds the forward's lists);
- ``partial_unpacked`` (session 20): the partial lists without valid sizes in their entries,
  the mask loading ``valid_sizes[block]`` (what was shipped until session 20, when delta 10,
  `flash_attn_vsa.valid_in_list_sm90`, became ``partial``: session 19 ran it as the arm
  ``valid_in_list``); correct results (checked against ``partial``). The ablation arms above
  run on these lists too (their masks read plain block ids).

Predictions: if the load's latency is what costs, ``partial_no_load`` is within ~2% of
``partial_unmasked``, and the fix is to have the valid size before the mask (prefetched with
the block's index a step ahead, or staged in shared memory at the tile's start); if the two
lists are what cost, ``partial_no_load`` stays near ``partial``, and the fix is one list with
per-entry flags. ::

    python3 -m research.fa4_fork.experiments.partial_block_cost --out DIR   # H200
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ARMS = (
    "all_full", "partial", "partial_no_load", "partial_unmasked", "all_masked", "partial_unpacked"
)  # fmt: skip
ABLATED_ATTR = "vsa_research_constant_valid_size"


@functools.cache
def ablated_mask_mod(kv_tile: int):
    """A mask_mod marked like `mask_sm90.valid_size_mask_mod`'s (so the column-limit path takes
    it) whose limit comes from a constant: its own function object and compile-cache hash."""
    from flash_attn_vsa import mask_sm90

    shipped = mask_sm90.valid_size_mask_mod(kv_tile)

    def constant_valid(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return shipped(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)

    setattr(constant_valid, mask_sm90.KV_TILE_ATTR, kv_tile)
    setattr(constant_valid, ABLATED_ATTR, kv_tile // 2)
    constant_valid.__cute_hash__ = f"research.partial_block_cost/{kv_tile}/constant"
    return constant_valid


class _ConstantSizes:
    """Stands in for the valid-size tensor inside the traced mask: every block reads
    ``value`` (a compile-time constant: no load)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __getitem__(self, index):
        import cutlass

        return cutlass.Int32(self.value)


def install_ablation() -> None:
    """In this process only: the sm_90 kernels' mask class also knows `ablated_mask_mod`."""
    import flash_attn.cute.flash_bwd_sm90 as bwd_module
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    from flash_attn_vsa import mask_sm90

    mask_sm90.install()
    shipped = mask_sm90.mask_class()

    class AblatedMask(shipped):
        def own_mask(self, acc_S, n_block, thr_mma, mask_causal, mask_local, mask_mod, aux_data):
            constant = getattr(mask_mod, ABLATED_ATTR, None)
            if constant is None or mask_causal or mask_local:
                return super().own_mask(
                    acc_S, n_block, thr_mma, mask_causal, mask_local, mask_mod, aux_data
                )
            kv_tile = getattr(mask_mod, mask_sm90.KV_TILE_ATTR)
            log2 = kv_tile.bit_length() - 1
            self.keep_valid_columns(acc_S, n_block, thr_mma, _ConstantSizes(constant), log2)
            return True

    for module in (fwd_module, bwd_module):
        module.AttentionMask = AblatedMask


def layouts_and_inputs(args, count: int) -> tuple[dict, tuple]:
    """The 64x64 layouts at ``args``' sequence length, heads and sparsity on the GPU, ``"full"``
    (every key block full) and ``"partial"`` (a quarter of them partial), and ``count`` random
    bf16 tensors [1, S, H, 128] (q, k, v and, for a backward, dout)."""
    import torch

    from research.harness import benchmark_module

    bench_vsa = benchmark_module("bench_vsa")
    seq, heads = args.seq_len, args.heads
    layouts = {
        name: bench_vsa.sample_layout(seq, 1, heads, args.sparsity, (64, 64), 0, partial).to("cuda")
        for name, partial in (("full", 0.0), ("partial", 0.25))
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = tuple(
        torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(count)
    )
    return layouts, tensors


def run(args) -> int:
    import torch

    from research.harness import benchmark_module
    from vsa_fa4 import launch, ops
    from vsa_fa4.schedule import make_plan

    bt = benchmark_module("bench_timing")
    install_ablation()
    scale = 128**-0.5
    layouts, (q, k, v, dout) = layouts_and_inputs(args, 4)
    plan = make_plan((64, 64))
    original_masking = launch._masking
    original_lists = ops._forward_lists

    def lists_all_masked(kv_indices, kv_counts, kv_valid_sizes, kv_tile, masked, pack=False):
        # a threshold past the tile: no block counts as full, every listed one is masked
        return original_lists(kv_indices, kv_counts, kv_valid_sizes, kv_tile + 1, masked)

    def unpacked(*args):  # the lists without sizes in their entries (mask loads them)
        return False

    def masking_with(mask_mod):
        def masking(_, kv_valid_sizes, block_size, masked):
            return original_masking(lambda tile: mask_mod, kv_valid_sizes, block_size, masked)

        return masking

    def arm(name, backward):
        lay = layouts["full" if name == "all_full" else "partial"]
        full = name in ("all_full", "partial_unmasked")
        leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]

        def call():
            out, _ = ops.attention(*leaves, lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes,
                                   scale, plan, 1, full)  # fmt: skip
            if backward:
                out.backward(dout)
            return out

        # what each arm swaps in for the call (lists, masking), restored after it
        swaps = {
            "partial_unpacked": {"takes_valid_in_list": unpacked},
            "all_masked": {"_forward_lists": lists_all_masked, "takes_valid_in_list": unpacked},
            "partial_no_load": {
                "_masking": masking_with(ablated_mask_mod(64)),
                "takes_valid_in_list": unpacked,
            },
        }.get(name, {})

        def patched():
            with contextlib.ExitStack() as stack:
                for attr, value in swaps.items():
                    module = ops if attr == "_forward_lists" else launch
                    stack.enter_context(mock.patch.object(module, attr, value))
                return call()

        return patched

    if args.profile_arms:  # one forward call of each arm inside the profiler's window
        from .counters_one_call import profile_once

        with torch.no_grad():
            for name in args.profile_arms:
                profile_once(name, arm(name, False))
        return 0
    rows = []
    for direction in ("fwd", "fwd+bwd"):
        fns = {name: arm(name, direction != "fwd") for name in ARMS}
        with torch.enable_grad() if direction != "fwd" else torch.no_grad():
            for fn in fns.values():
                for _ in range(3):
                    fn()
            if direction == "fwd":  # the one reordered arm that must stay correct
                shipped = fns["partial"]().float()
                for other in ("all_masked", "partial_unpacked"):
                    diff = (fns[other]().float() - shipped).abs().max().item()
                    print(json.dumps({f"{other}_vs_partial_max_abs": diff}), flush=True)
            times = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times[name].append(bt.events_ms(fn, args.calls))
        row = {"direction": direction, **{n: statistics.median(t) for n, t in times.items()}}
        row["partial_over_full"] = row["partial"] / row["all_full"] - 1
        row["load_share"] = (row["partial"] - row["partial_no_load"]) / row["all_full"]
        row["split_and_mask_share"] = (row["partial"] - row["partial_unmasked"]) / row["all_full"]
        row["all_masked_over_full"] = row["all_masked"] / row["all_full"] - 1
        row["unpacked_over_full"] = row["partial_unpacked"] / row["all_full"] - 1
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        doc = {"experiment": "partial_block_cost", "device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": " ".join(sys.argv), "rows": rows}  # fmt: skip
        (Path(args.out) / "partial_block_cost.json").write_text(json.dumps(doc, indent=1))
    return 0


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments `layouts_and_inputs` and the timed rounds read (shared with experiment
    19, `v_padding_cost`)."""
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--sparsity", type=float, default=0.875)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument(
        "--profile-arms",
        nargs="*",
        choices=ARMS,
        default=[],
        help="instead of timing, run one forward call of each arm between cudaProfilerStart "
        "and Stop (for ncu --profile-from-start off; experiment 18)",
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Experiment 6 (prepared in session 5, not yet run): does the KV64 backward lose at long
sequences because its dQ reduce-adds spread over a whole head's query range, and does rotating
each key block's query list fix it?

The reading to test (fork NOTES.md, "Open"): FA4's backward CTAs each own a key block and walk
its ascending query list, reducing a 64x128 fp32 dQ tile per visited query block. After the
first wave CTAs start staggered, so the running key blocks' query positions spread over the
head: the reduce-adds' working set is the head's whole accumulator, 17 MB at S=32768 (inside
the H200's 50 MB L2) and 67 MB at S=131072 (not). ``vsa_fa4.metadata.backward_lists(...,
rotate_sms=N)`` starts each list at query block ``(order * NQ // N) % NQ`` (``order``: the key
block's place in the grid) and wraps around: with one CTA per SM, the key blocks running at one
moment then walk the same stretch of query blocks.

Arms per sequence length (H=12, D=128, 64x64 blocks, random top-k lists at 87.5%, all blocks
full): dense FA4 backward, the fork's KV64 backward on ascending lists, the same on rotated
lists; correctness first (rotated against ascending: the same sums in another order). ::

    python3 -m research.fa4_fork.experiments.bwd_list_rotation --out DIR    # H200
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .kv64_bwd_configs import emit_interleaved_times, rel_l2, start_log

BLOCK = 64


def topk_layout(seq: int, heads: int, keep: float, seed: int):
    """Random top-k lists of 64-token key blocks (the coarse stage's shape, random scores)."""
    from vsa_core import BlockSparseLayout

    n = seq // BLOCK
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(1, heads, n, n, device="cuda", generator=gen)
    picks = scores.topk(max(1, round(keep * n)), dim=-1, sorted=False).indices
    valid = torch.full((n,), BLOCK, dtype=torch.int32, device="cuda")
    return BlockSparseLayout.from_topk(picks, valid, (BLOCK, BLOCK), all_full=True)


def length_case(seq: int, heads: int, keep: float, dim: int):
    """Random bf16 q, k, v, dout [1, seq, heads, dim] and top-k lists, seeded by ``seq``."""
    torch.manual_seed(seq)
    tensors = [
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    ]
    return (*tensors, topk_layout(seq, heads, keep, seed=seq))


def run_length(emit, seq: int, heads: int, keep: float, reps: int, sms: int) -> None:
    """Correctness, then interleaved timing of the three arms at one sequence length."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    from flash_attn_vsa.bwd_sm90 import config_for
    from vsa_fa4 import launch
    from vsa_fa4.metadata import backward_lists
    from vsa_fa4.ops import forward_impl

    dim, scale = 128, 128**-0.5
    q, k, v, dout, lay = length_case(seq, heads, keep, dim)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    out, lse = forward_impl(q, k, v, idx, cnt, valid, scale, BLOCK, BLOCK, False)
    # rotated by the CTAs running at once (two per SM for the 64x64 kernel since session 9)
    running = sms * config_for((BLOCK, BLOCK)).ctas_per_sm
    lists = {
        "ascending": backward_lists(idx, cnt, valid, BLOCK, masked=False),
        "rotated": backward_lists(idx, cnt, valid, BLOCK, masked=False, rotate_sms=running),
    }
    grads = {name: [torch.empty_like(t) for t in (q, k, v)] for name in lists}

    def backward(name):
        launch.run_backward(dout, q, k, v, out, lse, *grads[name], lists[name], valid, scale,
                            (BLOCK, BLOCK), False)  # fmt: skip

    for name in lists:
        backward(name)
    torch.cuda.synchronize()
    errs = [rel_l2(a, b) for a, b in zip(grads["rotated"], grads["ascending"], strict=True)]
    emit({"case": "correct", "seq": seq, "rotated_vs_ascending_rel_l2": errs})
    if max(errs) > 1e-2:
        return
    d_out, d_lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]
    arms = {
        "dense": (
            lambda _: _flash_attn_bwd(q, k, v, d_out, dout, d_lse, softmax_scale=scale),
            None,
        ),
        "kv64_ascending": (lambda _: backward("ascending"), None),
        "kv64_rotated": (lambda _: backward("rotated"), None),
    }
    pairs = float(lay.selected_token_pairs().sum()) / heads
    emit_interleaved_times(emit, arms, rounds=2, reps=reps, pairs=pairs,
                           shape=(seq, heads, dim), factor=2.5, seq=seq, sms=sms)  # fmt: skip


def length_args(sass: bool = False, extra=None) -> argparse.Namespace:
    """Command line of the sequence-length sweeps (this experiment, 7, 9 and 13; ``sass``: with
    `kv64_bwd_configs.add_sass_args`; ``extra(parser)`` adds an experiment's own)."""
    from .kv64_bwd_configs import add_sass_args

    ap = argparse.ArgumentParser()
    if sass:
        add_sass_args(ap)
    if extra is not None:
        extra(ap)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--keep", type=float, default=0.125)
    ap.add_argument("--reps", type=int, default=10)
    return ap.parse_args()


def run_lengths(name: str, run_one, args: argparse.Namespace) -> int:
    """``run_one(emit, seq, heads, keep, reps, sms)`` at each of ``args.seqs``, logged to
    ``args.out/name.jsonl`` (this experiment and experiment 9)."""
    emit = start_log(args.out, name)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for seq in args.seqs:
        run_one(emit, seq, args.heads, args.keep, args.reps, sms)
    return 0


def main() -> int:
    return run_lengths("bwd_list_rotation", run_length, length_args())


if __name__ == "__main__":
    sys.exit(main())

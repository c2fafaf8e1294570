"""Experiment 5: key pairing in the forward, 128-row query blocks over pairs of 64-token key
blocks, against upstream's 128x64 tiles and dense FA4.

Session 5 ran this experiment's first version (its own kernel class, even counts and full
blocks only, pair ordinals in FA4's full list; commit 07768d2) and measured 0.78 -> 0.89 of
dense (``benchmarks/results/2026-11-29-h200-paired_kv_fwd.jsonl``; a two-CTA Q64 variant
gained nothing over delta 2). The kernel now ships as ``flash_attn_vsa.fwd_sm90_paired``
(odd counts, partial blocks, packed pairs in both lists); this script drives that module:
correctness (exact256-refined lists and random lists with odd counts and partial blocks,
NaN-poisoned outputs), then timing against upstream's 64-key tiles and dense, interleaved. ::

    python3 -m research.fa4_fork.experiments.paired_kv_fwd --out DIR       # H200
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from .kv64_bwd_configs import (
    check_forward,
    emit_interleaved_times,
    exact256_layout,
    fa4_tensors,
    one_length_args,
    random_layout,
    start_log,
)

Q_BLOCK, KEY_BLOCK = 128, 64


def paired_tensors(layout):
    """The shipped path's FA4 tensors of a 128x64 layout: vsa-fa4's full/partial split, then
    `fwd_sm90_paired.pair_lists`."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from flash_attn_vsa import fwd_sm90_paired as paired
    from vsa_fa4.metadata import forward_lists

    split = forward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, KEY_BLOCK)
    mask_cnt, mask_idx, full_cnt, full_idx = paired.pair_lists(
        *split.by_class(), layout.kv_valid_sizes.shape[0]
    )
    return BlockSparseTensorsTorch(
        mask_block_cnt=mask_cnt, mask_block_idx=mask_idx, full_block_cnt=full_cnt,
        full_block_idx=full_idx, block_size=paired.BLOCK_SIZE,
    )  # fmt: skip


def main() -> int:
    args = one_length_args()
    from flash_attn.cute.interface import _flash_attn_fwd, flash_attn_func

    from flash_attn_vsa.fwd_sm90_paired import block_sparse_forward_paired
    from vsa_core.reference import reference_block_sparse_attn

    emit = start_log(args.out, "paired_kv_fwd")
    torch.manual_seed(0)
    dim, scale = 128, 128**-0.5
    # ---- correctness: S=2048, H=4; odd counts and partial key blocks in the random lists
    seq, heads = 2048, 4
    q, k, v = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    # pairing needs lists narrower than num_kv (session 6's run refused padded ones)
    rand = random_layout(seq, heads, (Q_BLOCK, KEY_BLOCK), 0.3, seed=1, narrow=True)
    sizes = torch.tensor([64, 37, 64, 1, 64, 63, 0, 64], dtype=torch.int32)  # 0: an empty block
    partial_sizes = sizes.repeat(rand.num_kv_blocks // len(sizes) + 1)[: rand.num_kv_blocks]
    cases = {
        "exact256": exact256_layout(seq, heads, 0.75, seed=1).refine((Q_BLOCK, KEY_BLOCK)),
        "random_partial": dataclasses.replace(
            rand, kv_valid_sizes=partial_sizes.cuda(), kv_blocks_full=False
        ),
    }
    good = []
    for name, lay in cases.items():
        lay = lay.to("cuda")
        ref_out, _ = reference_block_sparse_attn(*(t.float() for t in (q, k, v)), lay, scale)

        def run(out, lse, lay=lay):
            block_sparse_forward_paired(q, k, v, paired_tensors(lay), lay.kv_valid_sizes,
                                        softmax_scale=scale, out=out, lse=lse)  # fmt: skip

        if check_forward(emit, {"q_block": Q_BLOCK, "mask": name, "variant": "paired"}, q,
                         ref_out, run):  # fmt: skip
            good.append(name)
    # ---- timing: S=32768, H=12, exact256 90% refined, all key blocks full
    if "exact256" not in good:
        return 1
    seq, heads = args.seq, args.heads
    q, k, v = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    lay = exact256_layout(seq, heads, 0.9, seed=2).refine((Q_BLOCK, KEY_BLOCK)).to("cuda")
    pairs = float(lay.selected_token_pairs().sum()) / heads
    native, paired = fa4_tensors(lay, False), paired_tensors(lay)

    def run_paired():
        block_sparse_forward_paired(q, k, v, paired, lay.kv_valid_sizes, softmax_scale=scale)

    arms = {
        "dense": (lambda _: flash_attn_func(q, k, v, softmax_scale=scale), None),
        "upstream_kv64": (
            lambda _: _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=native),
            None,
        ),
        "paired": (lambda _: run_paired(), None),
    }
    emit_interleaved_times(emit, arms, rounds=2, reps=args.reps, pairs=pairs,
                           shape=(seq, heads, dim), q_block=Q_BLOCK, mask="exact256")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

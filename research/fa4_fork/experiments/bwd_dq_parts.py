"""Experiment 13 (session 9): the KV64 backward with dQ sent by its MMA warpgroup through smaller
buffers, so that two CTAs can share an SM (delta 8, `flash_attn_vsa.bwd_sm90_dq_parts`).

Session 8's counters: one MMA warpgroup per 64-key tile keeps the tensor pipe 52-55% busy, and
nothing shares the SM with it (160 KB of shared memory a CTA, 32 of them dQ staging).

**13a (run; the variant is gone from the code, commit 97ede73 has it):** no staging at all,
each MMA thread sending its dQ values as 16-byte float32 reductions (``red.global.add.v4.f32``,
the same bytes to L2). Predicted within +-3% of the shipped kernel at one CTA per SM and up to
~1.3x at two. Measured (S=32768 / 131072, 87.5% random top-k, two rounds): shipped 0.667 /
0.708; one CTA 0.51 / 0.57; **two CTAs 0.63 / 0.41**; a 128x64 form 0.52 / 0.58 against 0.69 /
0.73. Per-thread reductions cost the L2 far more than bulk ones (at 128k, where the accumulator
misses L2, catastrophically so). But two CTAs per SM turned 0.51 into 0.63 (+24%) with the
same reductions: the partner warpgroup is worth having.

**13b (run):** keep the bulk reduce-add, from half the buffer (16 KB): the MMA warpgroup
writes one half, MMA thread 0 sends it and waits until the bulk copy has read it, then the
second half. Predicted 0-5% slower than shipped at one CTA, 0.72-0.80 at two. Measured: **0.45**
(one CTA) and **0.60 / 0.66** (two CTAs, S = 32k / 128k with lists rotated by 264): waiting for
a bulk reduce-add to read its buffer costs far more than writing it (the read is paced by L2
accepting the reduction). Ablations (dQ computed, never sent): **0.82** at one CTA (shipped
0.66; experiment 9's "no reductions" kept the staging writes and the handshake and got 0.68),
**1.16 / 1.27** at two CTAs, but there the compiler had dropped the unused dQ MMA (50 HGMMA
instead of 56; the ablation now keeps it).

**13c (run):** the MMA warpgroup sends dQ through buffers it takes in turn, so MMA thread 0
waits only for the reduce-add of ``buffers`` parts ago. Predicted: 1 part / 2 buffers (one CTA)
0.70-0.74; 4 parts / 2 buffers and 8 / 4 (two CTAs) 0.66-0.77; two CTAs without sending dQ
(its MMA now kept) 0.95-1.05. Measured (S = 32k / 128k): 1p/2b **0.62 / 0.67** (slower than
the staged kernel's 0.66 / 0.71: the warpgroup's own barriers cost more than the producer
warp's handshake); **4p/2b two CTAs 0.69-0.70 / 0.72** (shipped since); 8p/4b 0.62 / 0.64
(twice the barriers); no dQ sent 0.75 (one CTA) and **1.03 / 1.09** (two CTAs). Each part
costs the MMA warpgroup two named-barrier meetings and thread 0's wait: 8 parts lose 0.08 of
dense against 4.

**13d:** the producer warp (idle since upstream's dQ staging is gone) issues the reduce-adds
and waits for them; MMA threads and producer hand buffers over through mbarriers, so the MMA
threads never meet each other for dQ and wait only for a buffer not yet read
(``DqStaging(sender="producer")``). Predictions (before the run): 4p/2b 0.72-0.77 (the
barriers go; the SM->L2 port, ~94% busy by the shipped kernel's rate at 0.70, caps it near
0.75); 8p/4b about the same as 4p/2b (parts are cheap now); 2p/1b below both (the MMA threads
wait for each half's read).

Arms at each length (H=12, D=128, random top-k lists at 87.5%, all blocks full, lists rotated
by the CTAs running at once): dense FA4, the shipped 64x64 kernel and each configuration of
``flash_attn_vsa.experimental.bwd_configs`` (``EXPERIMENTAL_CONFIGS``, ``ABLATIONS``).
Gradients of every arm against the shipped kernel first (dQ to ~1e-5: the reductions' order
differs; dK and dV bit-equal at one CTA per SM, ~1e-4 at two, whose lists are rotated
differently), then interleaved timing, two rounds. ``--q-blocks 64 128`` also runs 128-row
query blocks: the shipped 128x64 kernel against the same lists split into 64-row blocks on the
shipped 64x64 kernel (``split-64x64``: 0.71 against 0.69 in bench_vsa, session 9, so vsa-fa4
might route 128x64 backwards there). ::

    python3 -m research.fa4_fork.experiments.bwd_dq_parts --out DIR   # H200
"""

from __future__ import annotations

import sys

import torch

KV = 64


def topk_lists(seq: int, heads: int, keep: float, q_block: int):
    """Random top-k lists of 64-token key blocks for ``q_block``-row query blocks."""
    from vsa_core import BlockSparseLayout

    nq, nk = seq // q_block, seq // KV
    gen = torch.Generator(device="cuda").manual_seed(seq + q_block)
    scores = torch.rand(1, heads, nq, nk, device="cuda", generator=gen)
    picks = scores.topk(max(1, round(keep * nk)), dim=-1, sorted=False).indices
    valid = torch.full((nk,), KV, dtype=torch.int32, device="cuda")
    return BlockSparseLayout.from_topk(picks, valid, (q_block, KV), all_full=True)


def inputs_and_forward(seq: int, heads: int, keep: float, q_block: int, scale: float):
    """The backward experiments' inputs: bf16 q, k, v, dout [1, seq, heads, 128] (seeded by
    ``seq``), `topk_lists`, and the forward's out and lse on them (all key blocks full)."""
    from vsa_fa4.ops import forward_impl

    torch.manual_seed(seq)
    q, k, v, dout = (
        torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    lay = topk_lists(seq, heads, keep, q_block)
    out, lse = forward_impl(
        q, k, v, lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes, scale, q_block, KV, False
    )
    return (q, k, v, dout), lay, (out, lse)


def run_block(emit, seq: int, heads: int, keep: float, reps: int, sms: int, q_block: int):
    """Check, then time, the shipped kernel and each experimental configuration of one block
    size (``q_block`` x 64) against dense."""
    from flash_attn_vsa import bwd_sm90
    from flash_attn_vsa.experimental import bwd_configs
    from vsa_fa4 import launch
    from vsa_fa4.metadata import backward_lists

    from .kv64_bwd_configs import rel_l2, time_backwards_against_dense

    scale, block = 128**-0.5, (q_block, KV)
    (q, k, v, dout), lay, (out, lse) = inputs_and_forward(seq, heads, keep, q_block, scale)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    configs = {"shipped": bwd_sm90.config_for(block)}
    named = {**bwd_configs.EXPERIMENTAL_CONFIGS, **bwd_configs.ABLATIONS}
    # (the dS-writing configuration needs its dQ pass: experiment 21, `bwd_ds_out`)
    configs.update(
        (name, c) for name, c in named.items() if c.m_block_size == q_block and not c.dq_from_ds
    )
    # arm -> (physical block, configuration, lists). Lists rotated by the CTAs running at once
    # (SMs x CTAs per SM), as the backward op does.
    arms = {
        name: (block, c, backward_lists(idx, cnt, valid, KV, masked=False,
                                        rotate_sms=sms * c.ctas_per_sm))
        for name, c in configs.items()
    }  # fmt: skip
    if q_block == 128:  # each 128-row block as two 64-row ones on the shipped 64x64 kernel
        c = bwd_sm90.KV64_CONFIG
        # each 64-row block keeps its 128-row parent's list (backward_lists' q_split does
        # this too, but not with rotated lists)
        idx64, cnt64 = idx.repeat_interleave(2, dim=2), cnt.repeat_interleave(2, dim=2)
        split = backward_lists(idx64, cnt64, valid, KV, masked=False,
                               rotate_sms=sms * c.ctas_per_sm)  # fmt: skip
        arms["split-64x64"] = ((64, KV), c, split)
    grads = {arm: [torch.full_like(t, float("nan")) for t in (q, k, v)] for arm in arms}

    def backward(arm):
        physical, config, lists = arms[arm]
        launch.run_backward(dout, q, k, v, out, lse, *grads[arm], lists, valid, scale,
                            physical, False, config=config)  # fmt: skip

    for arm in arms:
        backward(arm)
    torch.cuda.synchronize()
    for arm in arms:
        errs = [rel_l2(a, b) for a, b in zip(grads[arm], grads["shipped"], strict=True)]
        finite = all(bool(torch.isfinite(g).all()) for g in grads[arm])
        emit({"case": "vs_shipped", "seq": seq, "block": list(block), "arm": arm,
              "dq_dk_dv_rel_l2": errs, "finite": finite,
              "ablation": arms[arm][1].ablate_dq})  # fmt: skip
    calls = {arm: (lambda a=arm: backward(a)) for arm in arms}
    time_backwards_against_dense(emit, q, k, v, dout, scale, calls, lay, reps,
                                 block=list(block), sms=sms)  # fmt: skip


def main() -> int:
    from .bwd_list_rotation import length_args, run_lengths

    def q_blocks(ap):
        ap.add_argument("--q-blocks", type=int, nargs="+", default=[64], choices=[64, 128])

    args = length_args(extra=q_blocks)

    def run_length(emit, seq, heads, keep, reps, sms):
        for q_block in args.q_blocks:
            run_block(emit, seq, heads, keep, reps, sms, q_block)

    return run_lengths("bwd_dq_parts", run_length, args)


if __name__ == "__main__":
    sys.exit(main())

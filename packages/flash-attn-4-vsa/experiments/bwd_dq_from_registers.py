"""Experiment 13 (session 9): the KV64 backward with dQ reduced from registers (delta 8,
`flash_attn_vsa.bwd_sm90_dq_regs`), one and two CTAs per SM.

Session 8's counters: one MMA warpgroup per 64-key tile keeps the tensor pipe 52-55% busy, and
nothing shares the SM with it (160 KB of shared memory a CTA, 32 of them dQ staging). Dropping
the staging (each MMA thread sends its dQ values as 16-byte float32 reductions, the same bytes
to L2) lets two CTAs share an SM at one dO stage.

Predictions (written before the run). ``kv64-dq-regs`` (one CTA, same stages): within +-3% of
the shipped kernel (the handshake with the producer warp goes, the same bytes reach L2).
``kv64-dq-regs-two-ctas``: two MMA warpgroups per SM as dense has; if per-warpgroup latency
(barrier and scoreboard stalls, 48% of warp time) is what holds the tensor pipe at 52-55%, up
to ~1.3x (0.66 -> ~0.85) at S=32768, less at 131072 where the SM->L2 reductions already cost
13%: each 64-key tile reduces twice dense's dQ bytes per FLOP, so the port caps 64-key tiles
near 0.78 of dense unless reductions are merged. ``q128-kv64-dq-regs`` (a second dO and P/dS
stage in the staging's place): +0-5% over the shipped 128x64 kernel.

Arms at each length (H=12, D=128, random top-k lists at 87.5%, all blocks full, lists rotated
as shipped): dense FA4, the shipped 64x64 kernel and each 64x64 configuration of
``bwd_sm90.EXPERIMENTAL_CONFIGS``; then the shipped 128x64 kernel and ``q128-kv64-dq-regs`` on
lists of 128-row query blocks. Gradients of every arm against its shipped kernel first (the
reductions' order differs: rel. L2 ~1e-3 expected, not 0), then interleaved timing, two
rounds. ::

    python3 packages/flash-attn-4-vsa/experiments/bwd_dq_from_registers.py --out DIR   # H200
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def run_block(emit, seq: int, heads: int, keep: float, reps: int, sms: int, q_block: int):
    """Check, then time, the shipped kernel and each experimental configuration of one block
    size (``q_block`` x 64) against dense."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    from kv64_bwd_configs import emit_interleaved_times, rel_l2

    from flash_attn_vsa import bwd_sm90
    from vsa_fa4 import launch
    from vsa_fa4.metadata import backward_lists
    from vsa_fa4.ops import forward_impl

    dim, scale, block = 128, 128**-0.5, (q_block, KV)
    torch.manual_seed(seq)
    q, k, v, dout = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    lay = topk_lists(seq, heads, keep, q_block)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    out, lse = forward_impl(q, k, v, idx, cnt, valid, scale, q_block, KV, False)
    lists = backward_lists(idx, cnt, valid, KV, masked=False, rotate_sms=sms)
    configs = {"shipped": bwd_sm90.config_for(block)}
    configs.update(
        (name, c) for name, c in bwd_sm90.EXPERIMENTAL_CONFIGS.items() if c.m_block_size == q_block
    )
    grads = {arm: [torch.full_like(t, float("nan")) for t in (q, k, v)] for arm in configs}

    def backward(arm):
        with bwd_sm90.configs_scope({block: configs[arm]}):
            launch.run_backward(dout, q, k, v, out, lse, *grads[arm], lists, valid, scale, block,
                                False)  # fmt: skip

    for arm in configs:
        backward(arm)
    torch.cuda.synchronize()
    for arm in configs:
        errs = [rel_l2(a, b) for a, b in zip(grads[arm], grads["shipped"], strict=True)]
        finite = all(bool(torch.isfinite(g).all()) for g in grads[arm])
        emit({"case": "vs_shipped", "seq": seq, "block": list(block), "arm": arm,
              "dq_dk_dv_rel_l2": errs, "finite": finite})  # fmt: skip
    d_out, d_lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]
    timed = {"dense": (lambda _: _flash_attn_bwd(q, k, v, d_out, dout, d_lse,
                                                 softmax_scale=scale), None)}  # fmt: skip
    timed.update({arm: (lambda _, a=arm: backward(a), None) for arm in configs})
    pairs = float(lay.selected_token_pairs().sum()) / heads
    emit_interleaved_times(emit, timed, rounds=2, reps=reps, pairs=pairs,
                           shape=(seq, heads, dim), factor=2.5, seq=seq, block=list(block),
                           sms=sms)  # fmt: skip


def run_length(emit, seq: int, heads: int, keep: float, reps: int, sms: int) -> None:
    for q_block in (64, 128):
        run_block(emit, seq, heads, keep, reps, sms, q_block)


def main() -> int:
    from bwd_list_rotation import length_args, run_lengths

    return run_lengths("bwd_dq_from_registers", run_length, length_args())


if __name__ == "__main__":
    sys.exit(main())

"""Experiment 15 (session 10): what the sparse forwards lose to dense, split by the shape of
their lists. Same kernels, same tensors, only the lists change.

The question. The paired Q128/KV64 forward runs dense's 128x128 tile step and reaches 0.90-0.93
of dense at 87.5-90% sparsity (session 8: its tensor pipe active 78% against dense's 85%, the
L2-to-SM port at 53%). Two readings predict different things:

- **per-tile cost** (Q load, the first QK^T and softmax with no PV beside them, the last PV and
  the epilogue with no QK^T beside them): the loss grows as the list shortens, is the same
  for random, banded and identical lists of one length, and vanishes at full density;
- **per-step cost of gathered keys** (each step's two 64-row blocks come from anywhere: more
  L2 misses and latency than dense's sequential walk, no request merging between CTAs): the
  loss is there at any length for random lists, and banded or identical lists (neighbouring
  tiles read the same keys at about the same time, as in dense) recover it.

A fit of time against list length (random lists of 64, 128, 256 and 510 of 512 key blocks)
gives both: its intercept is the per-tile cost, its slope against dense's time per step the
per-step efficiency. Predicted: per-step ~0.97-1.0 of dense, per-tile ~1.5-2 steps, band and
same within 2% of random.

The two-CTA Q64/KV64 kernel (delta 2 with Q in registers, session 8: L2-to-SM port 87% busy)
runs on the same shapes: if the port is its bound because no CTA's K/V fetch serves another,
banded and identical lists (whose neighbouring query blocks ask for the same keys together)
move it toward the paired kernel's ratio, random ones at any length stay near 0.80. ::

    python3 -m research.fa4_fork.experiments.fwd_list_shapes --out DIR   # H200
"""

from __future__ import annotations

import sys

import torch

NUM_KV_BLOCK = 64
ARMS_BY_ROWS = {128: ("paired", "paired_persistent"), 64: ("two_cta_q_regs",)}


def list_shape(kind: str, heads: int, n_q: int, n_kv: int, keep: int, seed: int):
    """[1, heads, n_q, keep] key-block ids: ``random`` (each list its own draw), ``band`` (query
    block i reads the ``keep`` blocks around its own position, as local attention does) or
    ``same`` (one draw per head, every query block the same list)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.rand(1, heads, n_q, n_kv, generator=gen).topk(keep, dim=-1).indices
    if kind == "same":
        one = torch.rand(1, heads, 1, n_kv, generator=gen).topk(keep, dim=-1).indices
        return one.expand(1, heads, n_q, keep).contiguous()
    if kind == "band":
        centre = torch.arange(n_q) * n_kv // n_q
        start = (centre - keep // 2).clamp(0, n_kv - keep)
        ids = start[:, None] + torch.arange(keep)[None, :]
        return ids.expand(1, heads, n_q, keep).contiguous()
    raise ValueError(f"kind must be random, band or same, got {kind!r}")


def layout_of(kind: str, seq: int, heads: int, q_rows: int, keep: int, seed: int):
    from vsa_core import BlockSparseLayout

    n_q, n_kv = seq // q_rows, seq // NUM_KV_BLOCK
    ids = list_shape(kind, heads, n_q, n_kv, keep, seed)
    valid = torch.full((n_kv,), NUM_KV_BLOCK, dtype=torch.int32)
    lay = BlockSparseLayout.from_topk(ids, valid, (q_rows, NUM_KV_BLOCK), all_full=True)
    return lay.to("cuda")


def run(args) -> int:
    from flash_attn.cute.interface import _flash_attn_fwd

    from .kv64_bwd_configs import check_forward, emit_interleaved_times, reference, start_log
    from .q64_fwd_q_in_registers import forward, prepare

    emit = start_log(args.out, "fwd_list_shapes")
    dim, scale = 128, 128**-0.5
    seq, heads = args.seq, args.heads
    n_kv = seq // NUM_KV_BLOCK
    torch.manual_seed(0)
    good = set()
    small = [torch.randn(1, 2048, 4, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for q_rows, arms in ARMS_BY_ROWS.items():
        lay = layout_of("band", 2048, 4, q_rows, 9, seed=1)  # odd count: a NO_BLOCK tail
        ref_out = reference(*small, lay, scale)[0]
        for arm in arms:
            prepared = prepare(arm, lay)

            def run_arm(out, lse, arm=arm, prepared=prepared):
                forward(arm, small[0], small[1], small[2], prepared, scale, out, lse)

            if check_forward(emit, {"arm": arm}, small[0], ref_out, run_arm):
                good.add(arm)
    q, k, v = (torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    cases = [("random", keep) for keep in args.keeps]
    cases += [(kind, args.keeps[0]) for kind in ("band", "same")]
    for q_rows, arms in ARMS_BY_ROWS.items():
        for kind, keep in cases:
            keep = min(keep, n_kv - 2)  # the paired lists must stay narrower than num_kv
            layout = layout_of(kind, seq, heads, q_rows, keep, seed=keep)
            timed = {"dense": (lambda _: _flash_attn_fwd(q, k, v, softmax_scale=scale), None)}
            for arm in [a for a in arms if a in good]:
                prepared = prepare(arm, layout)
                timed[arm] = (lambda _, a=arm, p=prepared: forward(a, q, k, v, p, scale), None)
            pairs = float(layout.selected_token_pairs().sum()) / heads
            emit_interleaved_times(emit, timed, rounds=2, reps=args.reps, pairs=pairs,
                                   shape=(seq, heads, dim), lists=kind, keep=keep,
                                   q_rows=q_rows)  # fmt: skip
    return 0


def main() -> int:
    from .kv64_bwd_configs import one_length_parser

    ap = one_length_parser(reps=10)
    ap.add_argument(
        "--keeps",
        type=int,
        nargs="+",
        default=[64, 128, 256, 510],
        help="list lengths in 64-token key blocks (the first one also banded and same)",
    )
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())

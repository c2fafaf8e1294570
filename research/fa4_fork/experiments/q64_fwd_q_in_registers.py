"""Experiment 10 (prepared in session 7, not yet run): the two-CTA Q64/KV64 forward with Q held
in registers for QK^T.

The count (NOTES.md, "A count that frames what is left"): a wgmma m64nNk16 with both operands
in shared memory reads 2 KB of A and 32N B of B per 2,048N FLOP. The 64-key forward's QK^T is
such a wgmma at N = 64 (128 B per clock at the tensor cores' peak: all of an SM's
shared-memory bandwidth), its PV has P in registers already (64 B per clock), and each CTA
lands its own K and V (32 KB per 2.1 MFLOP, 64 B per clock): about 160 B per clock wanted
against 128 available, a bound near 0.8 of the tensor-core peak. With Q in registers QK^T
reads only K (64 B per clock) and the bound moves to about the peak. The measured kernel runs
at 0.58 of peak (0.78-0.86 of dense), so the bound is not known to be what stops it: this
experiment is the test.

The variant is delta 5 (``flash_attn_vsa.q_regs_sm90``, ``block_sparse_forward_q64(...,
q_in_registers=True)``): delta 2's class (two CTAs per SM, 232 registers for the MMA
warpgroup) with the QK^T MMA built with A from registers; when the consumer has waited for a
tile's Q it copies Q (64 x D) from shared memory into the A fragment with ldmatrix, once per
tile, and every QK^T of the tile reads it there. (Written here first in session 7, then moved
into the package with its GPU tests, so that a measured gain ships as a one-line routing
change.)

Arms (no mask_mod, S=32768, H=12, D=128): dense FA4, ``two_cta`` (delta 2 as shipped),
``two_cta_q_regs``; and for 128-row query blocks ``paired`` (delta 4 as shipped) and
``paired_q_regs`` (the same consumer change on its two warpgroups: QK^T at N = 128 reads 2 KB
of Q and 4 KB of K per wgmma, a third less with Q in registers). Correctness first (S=2048,
H=4, random 30% lists with an empty query block and unselected key blocks, NaN-poisoned
outputs, float32 reference), then timing on an exact256 90% mask refined to 64x64 and 128x64,
on native random 10% 64x64 lists (Bernoulli: lengths differ, which the two-stream kernel pays
for) and on native top-k 12.5% lists (VSA's shape: every 64-row block its own list, all of one
length), interleaved call by call with dense, two rounds. ``streams`` and ``streams_q_regs``
are delta 6 (`fwd_sm90_streams`) on the same 64x64 lists.

Predictions: if shared-memory bandwidth holds the Q64 forward, ``two_cta_q_regs`` gains up to
~20% (toward 0.95 of dense); if < 3%, it does not, and what is left is latency (a 64x64 step's
two short MMA chains per softmax). The paired kernel needs less shared memory per FLOP already
(~112 B per clock at peak by the same count): a few percent at most. ::

    python3 -m research.fa4_fork.experiments.q64_fwd_q_in_registers --out DIR  # H200

Every arm's kernel is a compile gate configuration, so ``python -m flash_attn_vsa.compile_gate
--dump-dir DIR`` keeps their PTX and cubins on the CPU.

Compiled on the CPU (session 7, sm_90a, cuobjdump): two-CTA both 128 registers at launch, no
stack; the variant's 40 ``HGMMA.64x64x16`` (QK^T) read A from registers (``HGMMA ... R24,
R148, gdesc[UR4]`` where delta 2 has ``R24, gdesc[UR16]``), after 8 ``LDSM.16.M88.4`` per
thread (Q's 32 registers) once per tile; 2,800 SASS instructions against 2,752. Paired: 168
registers, no stack either way, register-A ``HGMMA.64x128x16`` 72 against 32 (PV's), 4,000
instructions against 4,048.
"""

from __future__ import annotations

import sys

ARMS = {  # name -> (query rows per sparse block of the lists, kernel, variants)
    "two_cta": (64, "two_cta", {}),
    "two_cta_q_regs": (64, "two_cta", {"q_in_registers": True}),
    "two_cta_persistent": (64, "two_cta", {"persistent": True}),
    "two_cta_q_regs_persistent": (64, "two_cta", {"q_in_registers": True, "persistent": True}),
    "streams": (64, "streams", {}),
    "streams_q_regs": (64, "streams", {"q_in_registers": True}),
    "streams_persistent": (64, "streams", {"persistent": True}),
    "paired": (128, "paired", {}),
    "paired_q_regs": (128, "paired", {"q_in_registers": True}),
    "paired_persistent": (128, "paired", {"persistent": True}),
}


def stream_tensors(layout):
    """The two-stream kernel's FA4 tensors of a 64x64 layout: vsa-fa4's full/partial split,
    then `fwd_sm90_streams.stream_lists`."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from flash_attn_vsa.experimental import fwd_sm90_streams as streams
    from vsa_fa4.metadata import forward_lists

    split = forward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
    mask_cnt, mask_idx, full_cnt, full_idx = streams.stream_lists(*split.by_class())
    return BlockSparseTensorsTorch(
        mask_block_cnt=mask_cnt, mask_block_idx=mask_idx, full_block_cnt=full_cnt,
        full_block_idx=full_idx, block_size=streams.BLOCK_SIZE,
    )  # fmt: skip


def prepare(arm, layout):
    """The arm's prebuilt index tensors for ``layout`` (64x64 or 128x64 blocks)."""
    from .kv64_bwd_configs import fa4_tensors
    from .paired_kv_fwd import paired_tensors

    kernel = ARMS[arm][1]
    if kernel == "two_cta":
        return fa4_tensors(layout, False)
    if kernel == "streams":
        return stream_tensors(layout), layout.kv_valid_sizes
    return paired_tensors(layout), layout.kv_valid_sizes


def forward(arm, q, k, v, prepared, scale, out=None, lse=None):
    """One forward of ``arm``: delta 2, 6 or 4, as shipped or with its variants (Q in
    registers, delta 5; persistent tiles, delta 7)."""
    from flash_attn_vsa.experimental.fwd_sm90_streams import block_sparse_forward_streams
    from flash_attn_vsa.fwd_sm90 import block_sparse_forward_q64
    from flash_attn_vsa.fwd_sm90_paired import block_sparse_forward_paired

    _, kernel, variants = ARMS[arm]
    if kernel == "two_cta":
        return block_sparse_forward_q64(q, k, v, prepared, softmax_scale=scale, out=out,
                                        lse=lse, **variants)  # fmt: skip
    run = block_sparse_forward_streams if kernel == "streams" else block_sparse_forward_paired
    tensors, valid = prepared
    return run(q, k, v, tensors, valid, softmax_scale=scale, out=out, lse=lse,
               **variants)  # fmt: skip


def run(args) -> int:
    import torch
    from flash_attn.cute.interface import _flash_attn_fwd

    from .bwd_list_rotation import topk_layout
    from .kv64_bwd_configs import (
        check_forward,
        emit_interleaved_times,
        exact256_layout,
        random_layout,
        reference,
        start_log,
    )

    emit = start_log(args.out, "q64_fwd_q_in_registers")
    dim, scale = 128, 128**-0.5
    torch.manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, 2048, 4, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    good = []
    for q_block in (64, 128):
        lay = random_layout(2048, 4, (q_block, 64), 0.3, seed=1, narrow=True)
        ref_out = reference(q, k, v, dout, lay, scale)[0]
        for arm in [a for a, (qb, _, _) in ARMS.items() if qb == q_block and a in args.arms]:
            prepared = prepare(arm, lay)

            def run_arm(out, lse, arm=arm, prepared=prepared):
                forward(arm, q, k, v, prepared, scale, out, lse)

            if check_forward(emit, {"arm": arm}, q, ref_out, run_arm):
                good.append(arm)
    seq, heads = args.seq, args.heads
    q, k, v = (torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    base = exact256_layout(seq, heads, 0.9, seed=2)
    layouts = {  # (mask, query rows) -> layout
        ("exact256_90", 64): base.refine((64, 64)).to("cuda"),
        ("native_random_10", 64): random_layout(seq, heads, (64, 64), 0.1, seed=3, empty_kv=()),
        ("native_topk_12.5", 64): topk_layout(seq, heads, 0.125, seed=4),
        ("exact256_90", 128): base.refine((128, 64)).to("cuda"),
    }
    for (mask, q_block), layout in layouts.items():
        arms = {"dense": (lambda _: _flash_attn_fwd(q, k, v, softmax_scale=scale), None)}
        for arm in [a for a in good if ARMS[a][0] == q_block]:
            prepared = prepare(arm, layout)
            arms[arm] = (lambda _, a=arm, p=prepared: forward(a, q, k, v, p, scale), None)
        pairs = float(layout.selected_token_pairs().sum()) / heads
        emit_interleaved_times(emit, arms, rounds=2, reps=args.reps, pairs=pairs,
                               shape=(seq, heads, dim), mask=mask, q_block=q_block)  # fmt: skip
    return 0


def main() -> int:
    from .kv64_bwd_configs import one_length_parser

    ap = one_length_parser()
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

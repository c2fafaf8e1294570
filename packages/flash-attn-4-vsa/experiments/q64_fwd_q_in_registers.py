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

Arms (raw FA4 calls, no mask_mod, S=32768, H=12, D=128): dense FA4, ``two_cta`` (delta 2 as
shipped), ``two_cta_q_regs``; correctness first (S=2048, H=4, random 30% lists with an empty
query block and unselected key blocks, NaN-poisoned outputs, float32 reference), then timing
on an exact256 90% mask refined to 64x64 and on native random 10% lists, interleaved call by
call, two rounds.

Predictions: if shared-memory bandwidth holds the Q64 forward, ``two_cta_q_regs`` gains up to
~20% (toward 0.95 of dense); if < 3%, it does not, and what is left is latency (a 64x64 step's
two short MMA chains per softmax). ::

    python3 packages/flash-attn-4-vsa/experiments/q64_fwd_q_in_registers.py --out DIR  # H200
    python3 packages/flash-attn-4-vsa/experiments/q64_fwd_q_in_registers.py --sass DIR # CPU

Compiled on the CPU (session 7, sm_90a, cuobjdump): both 128 registers at launch, no stack;
the variant's 40 ``HGMMA.64x64x16`` (QK^T) read A from registers (``HGMMA ... R24, R148,
gdesc[UR4]`` where delta 2 has ``R24, gdesc[UR16]``), after 8 ``LDSM.16.M88.4`` per thread
(Q's 32 registers) once per tile; 2,800 SASS instructions against 2,752.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = ("two_cta", "two_cta_q_regs")


def forward(arm, q, k, v, tensors, scale, out=None, lse=None):
    """One forward of ``arm``: delta 2 as shipped, or with ``q_in_registers``."""
    from flash_attn_vsa.fwd_sm90 import block_sparse_forward_q64

    return block_sparse_forward_q64(q, k, v, tensors, softmax_scale=scale, out=out, lse=lse,
                                    q_in_registers=arm == "two_cta_q_regs")  # fmt: skip


def run(args) -> int:
    import torch
    from flash_attn.cute.interface import _flash_attn_fwd
    from kv64_bwd_configs import (
        check_forward,
        emit_interleaved_times,
        exact256_layout,
        fa4_tensors,
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
    lay = random_layout(2048, 4, (64, 64), 0.3, seed=1)
    ref_out = reference(q, k, v, dout, lay, scale)[0]
    tensors = fa4_tensors(lay, False)
    good = []
    for arm in ARMS:

        def run_arm(out, lse, arm=arm):
            forward(arm, q, k, v, tensors, scale, out, lse)

        if check_forward(emit, {"arm": arm}, q, ref_out, run_arm):
            good.append(arm)
    seq, heads = args.seq, args.heads
    q, k, v = (torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    layouts = {
        "exact256_90": exact256_layout(seq, heads, 0.9, seed=2).refine((64, 64)).to("cuda"),
        "native_random_10": random_layout(seq, heads, (64, 64), 0.1, seed=3, empty_kv=()),
    }
    for mask, layout in layouts.items():
        tensors = fa4_tensors(layout, False)
        arms = {"dense": (lambda _: _flash_attn_fwd(q, k, v, softmax_scale=scale), None)}
        for arm in good:
            arms[arm] = (lambda _, a=arm, t=tensors: forward(a, q, k, v, t, scale), None)
        pairs = float(layout.selected_token_pairs().sum()) / heads
        emit_interleaved_times(emit, arms, rounds=2, reps=args.reps, pairs=pairs,
                               shape=(seq, heads, dim), mask=mask)  # fmt: skip
    return 0


def compile_for_sass(dump_dir: str, arm: str | None) -> int:
    """Compile each arm for sm_90a on fake tensors (no GPU), one process per arm (CuTe DSL
    takes its target and dump folder from the process's environment); PTX and cubins are kept
    under ``dump_dir/<arm>/``."""
    from flash_attn_vsa import compile_gate as gate

    if arm is None:
        for name in ARMS:
            arm_dir = os.path.join(dump_dir, name)
            os.makedirs(arm_dir, exist_ok=True)
            env = {**os.environ, **gate.gate_environment(dump_dir=arm_dir)}
            cmd = [sys.executable, __file__, "--sass", dump_dir, "--sass-arm", name]
            if subprocess.run(cmd, env=env).returncode:
                return 1
            print(f"{name}: compiled into {arm_dir}", flush=True)
        return 0
    import torch

    with gate.fake_cuda_qkv() as (q, k, v):
        sparse = gate._sparse_tensors(torch, (64, 64), "fwd")
        forward(arm, q, k, v, sparse, gate.HEAD_DIM**-0.5)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sass", metavar="DIR", help="compile on the CPU, keep cubins; no timing")
    ap.add_argument("--sass-arm", help=argparse.SUPPRESS)  # one arm, in its own process
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.sass:
        return compile_for_sass(args.sass, args.sass_arm)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

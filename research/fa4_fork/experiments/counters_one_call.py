"""Experiment 11 (prepared in session 7, not yet run): hardware counters of one call of each
kernel we are trying to speed up, beside dense FA4's, for Nsight Compute.

Experiments 1-10 time variants and infer from differences; what holds each kernel back
(tensor pipe idle waiting on shared memory, on L2, on the dQ reductions, or on its own
dependency chain) is what the counters say directly. The counts in NOTES.md predict, per
kernel at the tensor-core peak: Q64 forward ~160 B per clock of shared memory (of 128), paired
~112, the KV64 backward ~194 (64x64) and ~206 (128x64). If those are the limits, the
shared-memory pipe runs near its peak where the tensor pipe does not.

The script runs each target once to compile and warm it, then once more between
``cudaProfilerStart`` and ``cudaProfilerStop``, so that ``ncu --profile-from-start off``
profiles exactly that call's kernels. S=32768 (``--seq``), H=12, D=128, random top-k 64x64 lists
at 87.5% (experiment 6's case) and their 128x64 refinement for the Q128 kernels; Triton at
``--triton-seqs`` too (its backward loses at long sequences, NOTES item 4). ::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        --section WarpStateStats --csv --page details \\
        python3 -m research.fa4_fork.experiments.counters_one_call > $OUT/ncu.csv

``--targets`` picks others (`TARGETS`; default `DEFAULT_TARGETS`); without ncu it only prints
each target's time.
"""

from __future__ import annotations

import argparse
import sys

import torch

BLOCK = 64
TARGETS = (
    "dense_fwd",
    "fa4_fwd64",
    "fa4_fwd64_q_regs",
    "fa4_fwd64_exact256",
    "fa4_streams",
    "fa4_paired",
    "fa4_paired_persistent",
    "dense_bwd",
    "fa4_bwd64",
    "fa4_bwd64_staged",
    "fa4_bwd64_no_dq",
    "fa4_bwd64_reduce0",
    "fa4_bwd128x64",
    "triton_bwd",
)


DEFAULT_TARGETS = ("dense_fwd", "fa4_fwd64", "fa4_streams", "fa4_paired", "dense_bwd", "fa4_bwd64")
"""What one sitting profiles (each target compiles first: ~15 s apiece on the H200)."""


def topk_128x64(seq: int, heads: int, keep: float):
    """Random top-k lists of 64-token key blocks per 128-token query block, all blocks full."""
    from vsa_core import BlockSparseLayout

    n_q, n_kv = seq // 128, seq // BLOCK
    gen = torch.Generator(device="cuda").manual_seed(seq + 1)
    scores = torch.rand(1, heads, n_q, n_kv, device="cuda", generator=gen)
    picks = scores.topk(max(1, round(keep * n_kv)), dim=-1, sorted=False).indices
    valid = torch.full((n_kv,), BLOCK, dtype=torch.int32, device="cuda")
    return BlockSparseLayout.from_topk(picks, valid, (128, BLOCK), all_full=True)


def build(seq: int, heads: int, keep: float):
    """name -> callable for the targets at one sequence length (inputs and lists prebuilt)."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    from flash_attn_vsa import bwd_sm90
    from flash_attn_vsa.experimental.bwd_configs import ABLATIONS
    from flash_attn_vsa.experimental.fwd_sm90_streams import block_sparse_forward_streams
    from flash_attn_vsa.fwd_sm90 import block_sparse_forward_q64
    from flash_attn_vsa.fwd_sm90_paired import block_sparse_forward_paired
    from vsa_core.rotation import rotation_width
    from vsa_fa4 import launch
    from vsa_fa4.metadata import backward_lists, forward_lists
    from vsa_fa4.ops import forward_impl
    from vsa_triton import ops as tri

    from .bwd_dq_reduce_share import reduce_scope
    from .bwd_list_rotation import length_case
    from .kv64_bwd_configs import exact256_layout
    from .paired_kv_fwd import paired_tensors
    from .q64_fwd_q_in_registers import stream_tensors

    dim, scale = 128, 128**-0.5
    q, k, v, dout, lay = length_case(seq, heads, keep, dim)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    lay128 = topk_128x64(seq, heads, keep)
    idx128, cnt128 = lay128.kv_indices, lay128.kv_counts
    out, lse = forward_impl(q, k, v, idx, cnt, valid, scale, BLOCK, BLOCK, False)
    out128, lse128 = forward_impl(q, k, v, idx128, cnt128, valid, scale, 128, BLOCK, False)
    d_out, d_lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]
    tensors_cls = launch._upstream()[0]
    fwd64 = launch._block_sparse(tensors_cls, forward_lists(idx, cnt, valid, BLOCK), (64, 64))
    # the same number of key blocks per query block, but four neighbouring query blocks share
    # each list (256-token selections refined): what K/V reuse between CTAs does for L2
    lay256 = exact256_layout(seq, heads, 1 - keep, seed=seq).refine((BLOCK, BLOCK)).to("cuda")
    fwd256 = launch._block_sparse(
        tensors_cls,
        forward_lists(lay256.kv_indices, lay256.kv_counts, lay256.kv_valid_sizes, BLOCK),
        (64, 64),
    )
    paired = paired_tensors(lay128)
    streams = stream_tensors(lay)
    sms = rotation_width(q.device)
    # rotated by the CTAs running at once, as the backward op does (two per SM since session 9)
    two = bwd_sm90.KV64_CONFIG.ctas_per_sm
    bwd64 = backward_lists(idx, cnt, valid, BLOCK, masked=False, rotate_sms=sms * two)
    bwd64_one = backward_lists(idx, cnt, valid, BLOCK, masked=False, rotate_sms=sms)
    bwd128 = backward_lists(idx128, cnt128, valid, BLOCK, masked=False, rotate_sms=sms)
    grads = [torch.empty_like(t) for t in (q, k, v)]

    def fa4_bwd(lists, o, s, block, config=None):
        launch.run_backward(dout, q, k, v, o, s, *grads, lists, valid, scale, block, False,
                            config=config)  # fmt: skip

    def fwd64_call(q_in_registers, tensors=fwd64):
        return block_sparse_forward_q64(
            q, k, v, tensors, softmax_scale=scale, q_in_registers=q_in_registers
        )

    def bwd64_reduce0():  # experiment 9's arm without the dQ reduce-adds (dQ comes out wrong)
        with reduce_scope("reduce_0"):
            fa4_bwd(bwd64_one, out, lse, (64, 64), staged)

    def bwd64_with(config, lists):  # another 64x64 configuration (experiment 13)
        fa4_bwd(lists, out, lse, (64, 64), config)

    staged = bwd_sm90.KV64_STAGED_CONFIG
    no_dq = ABLATIONS["kv64-two-ctas-no-dq"]

    return {
        "dense_fwd": lambda: _flash_attn_fwd(q, k, v, softmax_scale=scale),
        "fa4_fwd64": lambda: fwd64_call(False),
        "fa4_fwd64_q_regs": lambda: fwd64_call(True),
        "fa4_fwd64_exact256": lambda: fwd64_call(True, fwd256),
        "fa4_streams": lambda: block_sparse_forward_streams(
            q, k, v, streams, valid, softmax_scale=scale
        ),
        "fa4_paired": lambda: block_sparse_forward_paired(
            q, k, v, paired, valid, softmax_scale=scale
        ),
        "fa4_paired_persistent": lambda: block_sparse_forward_paired(
            q, k, v, paired, valid, softmax_scale=scale, persistent=True
        ),
        "dense_bwd": lambda: _flash_attn_bwd(q, k, v, d_out, dout, d_lse, softmax_scale=scale),
        "fa4_bwd64": lambda: fa4_bwd(bwd64, out, lse, (64, 64)),
        "fa4_bwd64_staged": lambda: bwd64_with(staged, bwd64_one),
        "fa4_bwd64_no_dq": lambda: bwd64_with(no_dq, bwd64),
        "fa4_bwd64_reduce0": bwd64_reduce0,
        "fa4_bwd128x64": lambda: fa4_bwd(bwd128, out128, lse128, (128, 64)),
        "triton_bwd": lambda: tri.block_sparse_bwd(
            dout, q, k, v, out, lse, idx, cnt, valid, scale, BLOCK, BLOCK
        ),
    }


def profile_once(name: str, call) -> None:
    """Warm (compile) the call, then run it once inside the profiler window, timed."""
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.cudart().cudaProfilerStart()
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"# {name}: {start.elapsed_time(end):.3f} ms", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", nargs="*", default=list(DEFAULT_TARGETS), choices=TARGETS)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--triton-seqs", type=int, nargs="*", default=[131072])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--keep", type=float, default=0.125)
    args = ap.parse_args()
    calls = build(args.seq, args.heads, args.keep)
    for name in args.targets:
        print(f"# S={args.seq} {name}", file=sys.stderr, flush=True)
        profile_once(f"S={args.seq} {name}", calls[name])
    if "triton_bwd" in args.targets:
        for seq in args.triton_seqs:
            del calls
            torch.cuda.empty_cache()
            calls = build(seq, args.heads, args.keep)
            profile_once(f"S={seq} triton_bwd", calls["triton_bwd"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

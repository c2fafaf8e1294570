"""Experiment 16 (session 10): the paired forward's fixed cost, and dense's own.

Experiment 15 fitted the paired Q128/KV64 forward's time against its list length (random
lists of 64-510 of 512 key blocks, S=32768, H=12): the slope is dense's time per key block
within 1% (its step runs at dense speed), the intercept ~0.12 ms, which is the whole of its
gap to dense at 87.5% sparsity (0.914). This run asks what the intercept is:

1. **Per call or per tile?** The paired forward at 64 keys per list with H = 6, 12, 24: a
   per-call cost stays, a per-tile cost doubles with H.
2. **What does the device run per call?** torch.profiler's kernel list of one paired call
   (any small kernel beside the attention kernel is a per-call cost).
3. **Is it ours or FA4's?** Dense FA4 itself with short key sequences (S_k = 4096, 8192,
   16384 against S_q = 32768): S_k = 4096 gives dense's kernel the paired kernel's 32
   128-key steps per tile, sequential. If dense loses about as much there, the per-tile cost
   is the sm_90 forward's design (both kernels share upstream's consumer), and 0.98 of dense
   at 87.5% sparsity asks a 32-step tile to beat dense's own 32-step tile.

4. (added after the first run) **The backward's own**: dense FA4's backward with S_q = 4096
   and 8192 against S_k = 32768, each 128-key tile walking 64 / 128 query blocks of 64 rows,
   as a sparse key tile walks its list (87.5% sparsity: 64).

Predicted: per tile (time ~ linear in H with a small intercept), only the attention kernel
on the device, dense at S_k = 4096 ~0.90-0.93 of dense at 32768. ::

    python3 -m research.fa4_fork.experiments.fwd_fixed_costs --out DIR   # H200
"""

from __future__ import annotations

import sys

import torch


def kernel_list(fn) -> list[dict]:
    """The device kernels of one ``fn()`` call (name, microseconds), after a warm-up call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        {"kernel": e.key[:160], "us": e.device_time_total}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]


def time_paired_heads(emit, seq: int, heads: int, dim: int, scale: float, reps: int) -> None:
    """The paired forward on random 64-key lists against dense, both at ``heads`` heads."""
    from flash_attn.cute.interface import _flash_attn_fwd

    from .fwd_list_shapes import layout_of
    from .kv64_bwd_configs import emit_interleaved_times
    from .q64_fwd_q_in_registers import forward, prepare

    q, k, v = (torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    layout = layout_of("random", seq, heads, 128, 64, seed=heads)
    prepared = prepare("paired", layout)
    timed = {
        "dense": (lambda _: _flash_attn_fwd(q, k, v, softmax_scale=scale), None),
        "paired": (lambda _: forward("paired", q, k, v, prepared, scale), None),
    }
    pairs = float(layout.selected_token_pairs().sum()) / heads
    emit_interleaved_times(emit, timed, rounds=2, reps=reps, pairs=pairs,
                           shape=(seq, heads, dim), heads=heads)  # fmt: skip


def time_dense_backward_short_q(emit, q, k, v, scale: float, seq_qs, reps: int) -> None:
    """Dense FA4 backward with the first ``seq_q`` queries against all keys, beside the full
    backward, interleaved (the ratio counts 2.5x the forward's FLOPs of each)."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    from .kv64_bwd_configs import emit_interleaved_times

    seq, heads, dim = q.shape[1], q.shape[2], q.shape[3]

    def backward(queries):
        out, lse = _flash_attn_fwd(queries, k, v, softmax_scale=scale, return_lse=True)[:2]
        dout = torch.randn_like(queries)
        return lambda _: _flash_attn_bwd(queries, k, v, out, dout, lse, softmax_scale=scale)

    for seq_q in seq_qs:
        timed = {"dense": (backward(q), None),
                 f"dense_bwd_q{seq_q}": (backward(q[:, :seq_q].contiguous()), None)}  # fmt: skip
        emit_interleaved_times(emit, timed, rounds=2, reps=reps, pairs=float(seq_q * seq),
                               shape=(seq, heads, dim), factor=2.5, seq_q=seq_q)  # fmt: skip


def run(args) -> int:
    from flash_attn.cute.interface import _flash_attn_fwd

    from .fwd_list_shapes import layout_of
    from .kv64_bwd_configs import emit_interleaved_times, start_log
    from .q64_fwd_q_in_registers import forward, prepare

    emit = start_log(args.out, "fwd_fixed_costs")
    dim, scale, seq = 128, 128**-0.5, args.seq
    torch.manual_seed(0)

    # 3. dense FA4 with short key sequences, interleaved with dense at S_k = S_q
    q, k, v = (torch.randn(1, seq, 12, dim, device="cuda", dtype=torch.bfloat16) for _ in "qkv")

    def dense(keys, values):
        return lambda _: _flash_attn_fwd(q, keys, values, softmax_scale=scale)

    for seq_k in args.dense_seq_k:
        short = (k[:, :seq_k].contiguous(), v[:, :seq_k].contiguous())
        timed = {"dense": (dense(k, v), None), f"dense_k{seq_k}": (dense(*short), None)}
        emit_interleaved_times(emit, timed, rounds=2, reps=args.reps, pairs=float(seq * seq_k),
                               shape=(seq, 12, dim), seq_k=seq_k)  # fmt: skip

    # 4. dense FA4's backward with short query sequences (each 128-key tile walks S_q / 64
    # query blocks, as a sparse key tile walks its list), interleaved with dense at S_q = S_k
    if args.dense_bwd_seq_q:
        time_dense_backward_short_q(emit, q, k, v, scale, args.dense_bwd_seq_q, args.reps)

    # 2. what one paired call runs on the device
    if args.kernel_list:
        layout = layout_of("random", seq, 12, 128, 64, seed=64)
        prepared = prepare("paired", layout)
        for arm, call in (
            ("paired", lambda: forward("paired", q, k, v, prepared, scale)),
            ("dense", lambda: _flash_attn_fwd(q, k, v, softmax_scale=scale)),
        ):
            emit({"case": "kernels", "arm": arm, "kernels": kernel_list(call)})

    # 1. the paired forward at 64 keys per list against the number of heads
    for heads in args.heads:
        time_paired_heads(emit, seq, heads, dim, scale, args.reps)
    return 0


def main() -> int:
    from .kv64_bwd_configs import one_length_parser

    ap = one_length_parser(reps=10, heads=False)
    # each part runs for the values given (none: the part is skipped)
    ap.add_argument("--heads", type=int, nargs="*", default=[6, 12, 24])
    ap.add_argument("--dense-seq-k", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--dense-bwd-seq-q", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--no-kernel-list", dest="kernel_list", action="store_false")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())

"""Experiment 8 (prepared in session 6, not yet run): why do two harnesses disagree about the
same kernel?

`bench_vsa.py` times an arm's calls back to back (``bench_common.time_fn``) and put upstream's
128x64 forward at 0.90-0.92 of dense FA4 and the fork's two-CTA Q64 forward at 0.86; the
experiments time arms interleaved call by call with dense (``time_interleaved``) and put the
same kernels at 0.78 and 0.78 (experiments 5 and 7), while the paired-key kernel came out 0.90
in both. The FLOPs are the same (1.07e8 pairs per head): the kernel itself takes 1.08 against
1.27 ms. Candidates, and the arm that separates them:

- clocks: a sparse call right after a 10 ms dense call runs on a GPU at its power limit
  (``after_dense``); the same call after a memset of equal length that only flushes the L2
  (``after_flush``) draws far less power. nvidia-smi logs SM clock and power alongside.
- L2 state: back to back (``blocked``), a call finds the lists, Q rows and LSE of the call
  before it in L2; after the memset it finds nothing.
- host gaps: each mode also runs the arm replayed from a CUDA graph (``graph``), which has no
  host cost; if the graph and the eager call differ, launch gaps were timed.

Arms: upstream 128x64 (`_flash_attn_fwd`), paired 128x64 (`fwd_sm90_paired`), two-CTA 64x64
(`fwd_sm90.block_sparse_forward_q64`), dense; S=32768, H=12, 90% exact256, all blocks full. ::

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50 > $OUT/smi.csv &
    python3 -m research.fa4_fork.experiments.harness_modes --out $OUT    # H200
"""

from __future__ import annotations

import statistics
import sys

import torch

from .kv64_bwd_configs import bench_common, exact256_layout, fa4_tensors, one_length_args, start_log
from .paired_kv_fwd import paired_tensors


def graphed(fn):
    """``fn`` captured once in a CUDA graph; the returned callable replays it."""
    fn()  # warm: compiles and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sparse_arms(seq: int, heads: int, scale: float) -> tuple[dict, dict, tuple]:
    """(name -> call) for the three sparse kernels, (name -> token pairs per head), (q, k, v)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    from flash_attn_vsa.fwd_sm90 import block_sparse_forward_q64
    from flash_attn_vsa.fwd_sm90_paired import block_sparse_forward_paired

    q, k, v = (
        torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    base = exact256_layout(seq, heads, 0.9, seed=2)
    lay128, lay64 = (base.refine(shape).to("cuda") for shape in ((128, 64), (64, 64)))
    up128 = fa4_tensors(lay128, False)
    paired = paired_tensors(lay128)
    q64 = fa4_tensors(lay64, False)

    def upstream_128x64():
        return _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=up128)

    def paired_128x64():
        valid = lay128.kv_valid_sizes
        return block_sparse_forward_paired(q, k, v, paired, valid, softmax_scale=scale)

    def two_cta_64x64():
        return block_sparse_forward_q64(q, k, v, q64, softmax_scale=scale)

    calls = {f.__name__: f for f in (upstream_128x64, paired_128x64, two_cta_64x64)}
    pairs = float(base.selected_token_pairs().sum()) / heads
    return calls, {name: pairs for name in calls}, (q, k, v)


def main() -> int:
    args = one_length_args()
    from flash_attn.cute.interface import flash_attn_func

    bc = bench_common()
    emit = start_log(args.out, "harness_modes")
    torch.manual_seed(0)
    scale = 128**-0.5
    calls, pairs, (q, k, v) = sparse_arms(args.seq, args.heads, scale)
    dense = lambda: flash_attn_func(q, k, v, softmax_scale=scale)  # noqa: E731
    flush_buf = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MB > 5x the L2
    flush = lambda: flush_buf.zero_()  # noqa: E731
    dev = torch.device("cuda")
    flops = 4 * args.heads * 128
    dense_ms = bc.time_fn(lambda _: dense(), dev, warmup=3, reps=args.reps).median_ms
    emit({"case": "time", "mode": "blocked", "arm": "dense", "ms": dense_ms})
    for variant in ("eager", "graph"):
        for name, call in calls.items():
            fn = graphed(call) if variant == "graph" else call
            modes = {
                "blocked": bc.time_fn(lambda _, f=fn: f(), dev, warmup=3, reps=args.reps).median_ms,
            }
            for mode, other in (("after_dense", dense), ("after_flush", flush)):
                times = bc.time_interleaved({"arm": (lambda _, f=fn: f(), None),
                                             "other": (lambda _, o=other: o(), None)},
                                            dev, warmup=3, reps=args.reps)  # fmt: skip
                modes[mode] = statistics.median(times["arm"])
                modes[mode + "_other_ms"] = statistics.median(times["other"])
            for mode, ms in modes.items():
                if mode.endswith("_other_ms"):
                    continue
                emit({"case": "time", "variant": variant, "mode": mode, "arm": name, "ms": ms,
                      "tflops": flops * pairs[name] / ms / 1e9,
                      "of_dense_blocked": dense_ms / ms * pairs[name] / args.seq**2,
                      "other_ms": modes.get(mode + "_other_ms")})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/bin/bash
# The H200 sitting prepared in session 7 (NOTES.md, "The next sitting") and run in session 8
# (its bench_vsa steps predate --pacing: they time arms on their own), as three device calls
# after `bash .gpu/a/unpack.sh`, each inside the 600 s a call may run (~24 min in all):
#   bash packages/flash-attn-4-vsa/experiments/next_sitting.sh kernels     # ~9.5 min
#   bash packages/flash-attn-4-vsa/experiments/next_sitting.sh backward    # ~7 min
#   bash packages/flash-attn-4-vsa/experiments/next_sitting.sh counters    # ~7.5 min
# Each packs its logs and JSON into $OUT/sitting.tgz (benchmarks/gpu_sitting.sh).
set -u
X=packages/flash-attn-4-vsa/experiments
T=packages/flash-attn-4-vsa/tests
bench="python3 benchmarks/bench_vsa.py --seq-lens 32768 --sparsities 0.875 0.9 --block-shapes 64x64 128x64 --modes fwd --arms fa4 vsa:fa4+qregs vsa:fa4+streams vsa:fa4+streams+qregs vsa:fa4+persistent vsa:fa4+streams+persistent fa4_dense"
case "${1:-}" in
kernels)
  # Deltas 5-7 correct first (17 cases), then experiment 10 (the forward variants, timed);
  # if a test failed, the per-block diagnosis instead of the timing.
  bash benchmarks/gpu_sitting.sh \
    "step fwd_gpu 330 python3 -m pytest -m gpu -q -p no:cacheprovider $T/test_fwd_sm90.py $T/test_fwd_sm90_paired.py $T/test_fwd_sm90_streams.py" \
    "if grep -q 'fwd_gpu rc=0' \$OUT/logs/steps.txt; then step exp10 240 python3 $X/q64_fwd_q_in_registers.py --out \$OUT; else step diagnose 240 python3 $X/diagnose_forward.py --out \$OUT; fi"
  ;;
backward)
  # Experiment 9 (the dQ reduce-adds' share), experiment 8 (why the harnesses disagree) with
  # the SM clock logged, and the quoted numbers on native lists.
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50 >"$OUT/smi.csv" &
  smi=$!
  bash benchmarks/gpu_sitting.sh \
    "step exp9 170 python3 $X/bwd_dq_reduce_share.py --out \$OUT" \
    "step exp8 110 python3 $X/harness_modes.py --out \$OUT" \
    "kill $smi" \
    "step bench_native 200 $bench --masks native --out \$OUT/bench_vsa-variants-native.json"
  ;;
counters)
  # Experiment 11 (one profiled call per kernel under Nsight Compute) and the quoted numbers
  # on exact256 masks.
  bash benchmarks/gpu_sitting.sh \
    "step exp11 330 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --csv --page details python3 $X/counters_one_call.py" \
    "step bench_exact256 200 $bench --masks exact256 --out \$OUT/bench_vsa-variants-exact256.json"
  ;;
*)
  echo "usage: $0 kernels|backward|counters" >&2
  exit 2
  ;;
esac

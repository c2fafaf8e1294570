#!/bin/bash
# The H200 sitting prepared in session 7 (NOTES.md, "The next sitting"), as two device calls
# after `bash .gpu/a/unpack.sh`, each well inside the 600 s a call may run:
#   bash packages/flash-attn-4-vsa/experiments/next_sitting.sh kernels    # ~9 min
#   bash packages/flash-attn-4-vsa/experiments/next_sitting.sh counters   # ~8 min
#   bash packages/flash-attn-4-vsa/experiments/next_sitting.sh bench      # ~4 min
# Each packs its logs and JSON into $OUT/sitting.tgz (benchmarks/gpu_sitting.sh).
set -u
X=packages/flash-attn-4-vsa/experiments
T=packages/flash-attn-4-vsa/tests
case "${1:-}" in
kernels)
  # Deltas 5 and 6 correct first, then experiments 10 (forward variants) and 9 (dQ reduce share).
  bash benchmarks/gpu_sitting.sh \
    "step fwd_gpu 240 python3 -m pytest -m gpu -q -p no:cacheprovider $T/test_fwd_sm90.py $T/test_fwd_sm90_paired.py $T/test_fwd_sm90_streams.py" \
    "step exp10 170 python3 $X/q64_fwd_q_in_registers.py --out \$OUT" \
    "step exp9 150 python3 $X/bwd_dq_reduce_share.py --out \$OUT"
  ;;
counters)
  # Experiment 8 (why the harnesses disagree) with the SM clock logged, then experiment 11
  # (one profiled call of each kernel under Nsight Compute).
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50 >"$OUT/smi.csv" &
  smi=$!
  bash benchmarks/gpu_sitting.sh \
    "step exp8 100 python3 $X/harness_modes.py --out \$OUT" \
    "kill $smi" \
    "step exp11 360 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --csv --page details python3 $X/counters_one_call.py"
  ;;
bench)
  # The numbers we quote: the shipped fa4 against its experimental forwards, same run.
  common="--seq-lens 32768 --sparsities 0.875 0.9 --block-shapes 64x64 128x64 --modes fwd --arms fa4 vsa:fa4+qregs vsa:fa4+streams vsa:fa4+streams+qregs fa4_dense"
  bash benchmarks/gpu_sitting.sh \
    "step bench_native 140 python3 benchmarks/bench_vsa.py $common --masks native --out \$OUT/bench_vsa-variants-native.json" \
    "step bench_exact256 140 python3 benchmarks/bench_vsa.py $common --masks exact256 --out \$OUT/bench_vsa-variants-exact256.json"
  ;;
*)
  echo "usage: $0 kernels|counters|bench" >&2
  exit 2
  ;;
esac

#!/bin/bash
# Experiment 18 (session 20): where a partial key block's step stalls in the 64x64 forward.
# Experiment 17 priced a quarter of the key blocks partial at +6-7% of the forward, i.e. each
# partial step ~1.25 full ones, and delta 10 (no valid-size load) won only 0.6 points. The
# SASS (compiled on the CPU) differs between the masked and the full loop by 32 FSEL, 2 R2P
# and 2 LDG in 357 against 325 instructions (+10%): not enough to explain +25% unless those
# instructions sit on the step's critical path or a stall grows. This run asks the counters:
# warp states per kernel (which stall reason grows from all-full to partial) and per-SASS
# stall samples (where), for the arms all_full, partial and partial_no_load of experiment 17
# (one forward call each, `partial_block_cost --profile-arms`).
# Usage on the H200, after `source .gpu/b/env.sh`:
#   bash research/fa4_fork/experiments/partial_step_stalls.sh $OUT [ARM...]
set -u
out=${1:?usage: partial_step_stalls.sh OUT_DIR [ARM...]}
shift
cd "$(dirname "$0")/../../.." || exit 1  # the repository root: experiments run as modules
arms=${*:-all_full partial partial_no_load}
ncu --clock-control none --profile-from-start off --kernel-name regex:'[Ff]lash' \
  --section WarpStateStats --section SourceCounters --section SchedulerStats \
  --section LaunchStats --section Occupancy --import-source no \
  -f -o "$out/partial_steps" \
  python3 -m research.fa4_fork.experiments.partial_block_cost --profile-arms $arms \
  >"$out/partial_steps.log" 2>&1
echo "ncu rc $?" >>"$out/partial_steps.log"
ncu --import "$out/partial_steps.ncu-rep" --page details --csv >"$out/partial_steps_details.csv" 2>&1
ncu --import "$out/partial_steps.ncu-rep" --page raw --csv >"$out/partial_steps_raw.csv" 2>&1
# per-instruction samples, one table per profiled kernel (the flag's spelling differs between
# ncu versions: both are tried)
ncu --import "$out/partial_steps.ncu-rep" --page source --csv --print-source sass \
  >"$out/partial_steps_source.csv" 2>&1 ||
  ncu --import "$out/partial_steps.ncu-rep" --page source --csv \
    >"$out/partial_steps_source.csv" 2>&1
ls -la "$out" >>"$out/partial_steps.log"

#!/bin/bash
# Experiment 12 (session 8): which part of L2 the 64-key kernels saturate. Experiment 11 showed
# "L2 Cache Throughput" at 86% (two-CTA Q64 forward) and 88% (KV64 backward) against 26% / 63%
# for dense and 53% for the paired Q128 forward, while their K/V bytes per second are only
# ~1.5x dense's: the percentage is the maximum of several L2 sub-unit counters, and this run
# names the one at the top (bytes, tag lookups, cross-partition fabric, reductions), beside the
# global loads that do not come from TMA (FA4's list reads). One ncu call per kernel; metrics the
# installed ncu does not know are left out (it refuses the whole list otherwise).
# Usage on the H200, after `source .gpu/b/env.sh`: bash research/fa4_fork/experiments/l2_breakdown.sh $OUT [TARGET...]
# (counters_one_call.py's targets; the first run's five by default).
set -u
out=${1:?usage: l2_breakdown.sh OUT_DIR [TARGET...]}
shift
targets=${*:-dense_fwd fa4_fwd64 fa4_paired dense_bwd fa4_bwd64}
cd "$(dirname "$0")/../../.." || exit 1  # the repository root: experiments run as modules
ncu --query-metrics --chip gh100 >"$out/ncu_metrics_gh100.txt" 2>&1
wanted="lts__t_bytes.sum lts__t_sectors.sum lts__t_requests.sum lts__t_tag_requests.sum
lts__t_sectors_srcunit_tex.sum lts__t_requests_srcunit_tex.sum lts__t_sectors_srcunit_ltcfabric.sum
lts__t_sectors_op_read.sum lts__t_sectors_op_write.sum lts__t_sectors_op_red.sum lts__t_sectors_op_atom.sum
lts__t_sectors_srcunit_tex_lookup_hit.sum lts__t_sectors_srcunit_tex_lookup_miss.sum
lts__d_sectors.sum lts__t_sectors_srcnode_gpc.sum lts__xbar2lts_cycles_active.avg
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
smsp__inst_executed_op_global_ld.sum smsp__inst_executed_op_global_red.sum
l1tex__m_xbar2l1tex_read_bytes.sum l1tex__m_l1tex2xbar_write_bytes.sum dram__bytes_read.sum
sm__cycles_elapsed.avg sm__cycles_active.avg sm__cycles_active.max sm__cycles_active.min
lts__t_sector_hit_rate.pct sm__inst_executed_pipe_tensor_op_gmma.sum
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed
lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed
lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed
lts__d_atomic_input_cycles_active.avg.pct_of_peak_sustained_elapsed
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum
smsp__warp_issue_stalled_gmma_per_warp_active.pct smsp__warp_issue_stalled_barrier_per_warp_active.pct
smsp__warp_issue_stalled_wait_per_warp_active.pct smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct"
known=$(for m in $wanted; do grep -q "^ *${m%%.*} " "$out/ncu_metrics_gh100.txt" && printf '%s,' "$m"; done)
echo "metrics: ${known}breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed" >"$out/l2_metrics_used.txt"
ncu --clock-control none --profile-from-start off --csv --page raw \
  --metrics "${known}breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,breakdown:gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed" \
  python3 -m research.fa4_fork.experiments.counters_one_call --targets $targets \
  >"$out/l2_breakdown.csv"

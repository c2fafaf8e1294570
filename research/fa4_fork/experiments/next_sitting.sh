#!/bin/bash
# The next H200 sitting (prepared in session 8), after `bash .gpu/a/unpack.sh` (move
# benchmarks/results aside for that call: with it the tree exceeds the 64 MiB a call carries):
#   bash research/fa4_fork/experiments/next_sitting.sh grid       # ~8 min
#   bash research/fa4_fork/experiments/next_sitting.sh bwd-counters   # ~8 min (session 9)
#   bash research/fa4_fork/experiments/next_sitting.sh bwd-split      # ~2 min (session 9)
# The whole kernel grid again with --pacing dense (the default since session 8), so that every
# ratio quoted in the READMEs (128x128 and 256x256 included, still from session 4's unpaced
# grid) comes from kernels timed at the same clock as dense; then the paired forward with and
# without persistent tiles on native lists of odd and even counts (experiment 10's arms).
# Session 7's sitting (kernels / backward / counters) ran in session 8; its logs are in
# benchmarks/results/ (2026-11-30). All three steps below ran in session 10 (grid without its
# persistent step, which experiment 15 replaced); results README rows of session 10.
set -u
X=research.fa4_fork.experiments
case "${1:-}" in
grid)
  bash benchmarks/gpu_sitting.sh \
    "step grid 420 python3 benchmarks/bench_vsa.py --seq-lens 32768 --sparsities 0.875 0.9 --block-shapes 256x256 128x128 128x64 64x64 --modes fwd bwd --arms fa4 triton fa4_dense --masks native --time-budget-min 6.5 --out \$OUT/bench_vsa-paced-grid.json" \
    "step persistent 120 python3 -m $X.q64_fwd_q_in_registers --out \$OUT --arms two_cta_q_regs two_cta_q_regs_persistent paired paired_persistent"
  ;;
bwd-counters)
  # Session 9 shipped the 64x64 backward on two CTAs per SM; experiment 13's ablation says
  # sending dQ is what is left (1.03 of dense without it, 0.70 with). Is it the SM->L2 port
  # (predicted ~95% busy) or the L2's reduction throughput? Nsight Compute on dense, the shipped
  # kernel, the staged one of session 8 and the shipped one with dQ never sent.
  bash benchmarks/gpu_sitting.sh \
    "step counters 300 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --csv --page details python3 -m $X.counters_one_call --targets dense_bwd fa4_bwd64 fa4_bwd64_staged fa4_bwd64_no_dq" \
    "step l2 200 bash research/fa4_fork/experiments/l2_breakdown.sh \$OUT dense_bwd fa4_bwd64 fa4_bwd64_no_dq"
  ;;
bwd-split)
  # The 128x64 backward against the same lists split into 64-row blocks on the two-CTA kernel
  # (bench_vsa, session 9: 64x64 0.71 / 0.69 against 128x64 0.69 / 0.68).
  bash benchmarks/gpu_sitting.sh \
    "step split128 150 python3 -m $X.bwd_dq_parts --out \$OUT --seqs 32768 131072 --q-blocks 128"
  ;;
session19)
  # Prepared in session 18 (the CuTe bundle unpacked first): experiment 17 (where a partial
  # key block's cost goes, issue 20 item 3), the fork's replay test with dQ compared to
  # rounding, the whole model's training memory with copy_to_tiles=False, and Nsight Compute
  # on the raster-row Triton forward against the tile-order one (the locality hypothesis of
  # session 17: L2 / DRAM sectors per request, TLB; one round, one rep each). "spread": session
  # 18 saw one arm's rounds spread 25% at Wan 720p (fa4 40.7-51.8 ms) while dense's spread 4%;
  # if the caching allocator's misses (cudaMalloc / cudaFree of ~1 GB buffers as the arms of
  # different sizes alternate) cause it, expandable segments shrink the spread.
  bash benchmarks/gpu_sitting.sh \
    "step partial 150 python3 -m $X.partial_block_cost --out \$OUT" \
    "step replay 120 python3 -m pytest -q -m gpu packages/flash-attn-4-vsa/tests/test_launch_replay.py" \
    "step dit 200 python3 benchmarks/bench_dit.py --config wan1.3b --modes train --no-tile-copies --arms vsa --out \$OUT/dit-no-tile-copies.json" \
    "step spread 200 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/bench_video.py --shapes wan720p --sparsities 0.875 --modes fwd --arms auto fa4 fa4_unfused triton --warmup 3 --reps 15 --no-pieces --out \$OUT/video720-expandable.json" \
    "step ncu 240 ncu --clock-control none --section MemoryWorkloadAnalysis --section SpeedOfLight --kernel-name regex:fwd_kernel --launch-count 4 --csv --page details python3 -m research.triton_kernels.raster_rows_bench --shapes wan480p --rounds 1 --reps 1"
  ;;
session21)
  # Prepared in session 20 (the CuTe bundle unpacked first; carry .whl for FastVideo and
  # diffusers): the GPU tests session 20 could not run (vsa-core's whole suite, the new
  # packed-vs-plain and select_topk_split opcheck tests), the coarse stage's split lists
  # against fa4's own list kernel through the whole op (fa4_presplit: turn
  # FA4Backend.reads_forward_split on if it wins in both views), and auto's rule regenerated
  # with the rule on query tokens a head.
  bash benchmarks/gpu_sitting.sh \
    "step gpu_core 480 bash -c 'source .gpu/b/extras.sh && python3 -m pytest -q -m gpu packages/vsa-core/tests packages/vsa-triton/tests/test_gpu.py'" \
    "step gpu_fa4 60 python3 -m pytest -q -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'same_bits or kernel_choices'" \
    "step presplit 300 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd --arms fa4 fa4_presplit --warmup 2 --reps 10 --no-pieces --time-budget-min 4.5 --out \$OUT/bench_video-presplit.json" \
    "step pieces 120 python3 -m research.op_host_pieces --shapes wan480p --backends fa4 --reps 30 --out \$OUT/pieces.jsonl"
  ;;
session22)
  # Prepared in session 21 (the CuTe bundle unpacked first; carry .whl): session 21 shipped
  # the selection kernel's coarse attention (ATTEND) and fa4 reading its split lists with
  # only part of the GPU tests run under their limits (3 select_and_attend cases, one NaN
  # padding property test). Run what did not: the opcheck of select_attend, the inference
  # op tests and the padding property tests for both backends (in two calls: each call is
  # limited to 10 minutes), then the before/after in one run (fa4_sdpa_coarse: SDPA +
  # selection; fa4_own_lists: fa4's own list kernel) at three latents, and the op's pieces.
  case "${2:-tests}" in
  tests)
    bash benchmarks/gpu_sitting.sh \
      "step triton 150 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_gpu.py packages/vsa-triton/tests/test_coarse.py -k 'opcheck or select_and_attend or split'" \
      "step ops 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_gpu_ops.py packages/vsa-core/tests/test_gpu_compile.py -k 'cuda_graph or host_sync or fine_attention'" \
      "step props 260 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_properties.py -k 'padding_never'"
    ;;
  bench)
    bash benchmarks/gpu_sitting.sh \
      "step bench 330 python3 benchmarks/bench_video.py --shapes wan480p wan720p hunyuan720p --sparsities 0.875 --modes fwd --arms fa4 fa4_sdpa_coarse fa4_own_lists --warmup 2 --reps 10 --no-pieces --time-budget-min 5 --out \$OUT/bench_video-coarse-two-launches.json" \
      "step pieces 120 python3 -m research.op_host_pieces --shapes wan480p --backends fa4 --reps 30 --out \$OUT/pieces.jsonl"
    ;;
  esac
  ;;
session23)
  # Prepared in session 23 (the CuTe bundle unpacked first; carry .gpu/b and .whl): session
  # 22's GPU checks that never ran (session 21's code) plus session 23's: the selection
  # kernel's attention after the scores (ATTEND_AFTER), the replay's cheaper steps; then the
  # Triton launches' host time in parts, the op's pieces, and the before/after in one run.
  case "${2:-tests}" in
  tests)
    bash benchmarks/gpu_sitting.sh \
      "step triton 150 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_gpu.py packages/vsa-triton/tests/test_coarse.py -k 'opcheck or select_and_attend or split'" \
      "step ops 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_gpu_ops.py packages/vsa-core/tests/test_gpu_compile.py -k 'cuda_graph or host_sync or fine_attention'" \
      "step fa4 150 python3 -m pytest -q -p no:warnings -m gpu packages/flash-attn-4-vsa/tests/test_launch_replay.py packages/vsa-fa4/tests/test_gpu.py -k 'replay or combined or cuda_graph'" \
      "step launch 90 python3 -m research.triton_launch_cost --out \$OUT/triton_launch_cost.jsonl"
    ;;
  props)
    bash benchmarks/gpu_sitting.sh \
      "step props 330 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_properties.py -k 'padding_never'" \
      "step pieces 150 python3 -m research.op_host_pieces --shapes wan480p --backends fa4 --reps 30 --out \$OUT/pieces.jsonl"
    ;;
  bench)
    bash benchmarks/gpu_sitting.sh \
      "step bench 570 python3 benchmarks/bench_video.py --shapes wan480p wan720p hunyuan720p --sparsities 0.875 --modes fwd --arms fa4 fa4_attend_in_loop fa4_sdpa_coarse --warmup 2 --reps 10 --no-pieces --time-budget-min 7 --out \$OUT/bench_video-attend-after.json"
    ;;
  second)
    # after the direct Triton launches (launch_cache) and the attention after the scores
    bash benchmarks/gpu_sitting.sh \
      "step triton 220 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_gpu.py packages/vsa-triton/tests/test_coarse.py -k 'direct or opcheck or select_and_attend or split'" \
      "step launch 60 python3 -m research.triton_launch_cost --out \$OUT/triton_launch_cost.jsonl" \
      "step pieces 60 python3 -m research.op_host_pieces --shapes wan480p --backends fa4 --reps 30 --out \$OUT/pieces.jsonl" \
      "step bench 230 python3 benchmarks/bench_video.py --shapes wan480p --sparsities 0.875 --modes fwd --arms fa4 fa4_attend_in_loop --warmup 2 --reps 10 --no-pieces --time-budget-min 2.5 --out \$OUT/bench_video-direct-launch.json"
    ;;
  block-props)
    bash benchmarks/gpu_sitting.sh \
      "step props 280 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_properties.py -k 'block_padding_never'"
    ;;
  esac
  ;;
session24)
  # Prepared in session 23 (carry .gpu/b and .whl; source .gpu/b/extras.sh first for the
  # fastvideo arm): the cheaper launch_cache description and the fa4 backward without head
  # views were never run on a GPU. Check them, time the launches, then the four Wan cells
  # with FastVideo in the same run (two calls: each is limited to 10 minutes). Session 24 added
  # the training step's host time in pieces (research.op_host_train).
  case "${2:-tests}" in
  tests)
    bash benchmarks/gpu_sitting.sh \
      "step triton 150 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_gpu.py" \
      "step fa4 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'backward or replay or combined'" \
      "step launch 40 python3 -m research.triton_launch_cost --out \$OUT/triton_launch_cost.jsonl" \
      "step pieces 40 python3 -m research.op_host_pieces --shapes wan480p --backends fa4 --reps 30 --out \$OUT/pieces.jsonl" \
      "step train 180 python3 -m research.op_host_train --out \$OUT/train_pieces.jsonl"
    ;;
  final)
    # session 24's own changes (vsa-fa4's list kernels through vsa_triton.launch_cache), then
    # the training step's host time in pieces and the inference pieces, before the bench
    bash benchmarks/gpu_sitting.sh \
      "step fa4 200 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py packages/vsa-fa4/tests/test_lists_triton.py -k 'backward or replay or lists'" \
      "step train 150 python3 -m research.op_host_train --reps 15 --out \$OUT/train_pieces.jsonl" \
      "step pieces 40 python3 -m research.op_host_pieces --shapes wan480p --backends fa4 --reps 30 --out \$OUT/pieces.jsonl"
    ;;
  profile)
    # session 24's changes not yet run on a GPU (the chunked backward's split views, training
    # on the selection's split lists), the training forward's host trace, the op's device
    # time split inside / outside the fine kernels (Wan 480p, fa4), and the kernel API's host
    # time over a raw FA4 call (64x64, S=32768, H=12)
    bash benchmarks/gpu_sitting.sh \
      "step chunks 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'head_chunks or training_with_partial or replay'" \
      "step trace 120 python3 -m research.op_host_train --shapes wan480p --backends fa4 --reps 9 --trace \$OUT/trace --out \$OUT/train_pieces.jsonl" \
      "step profile 120 python3 benchmarks/profile_video_op.py --shape wan480p --backends fa4 --modes fwd fwd+bwd --calls 3 --out \$OUT/profile" \
      "step overhead 100 python3 -m research.fa4_adapter.bench_fa4_overhead --block-shapes 64x64 --reps 20 --out \$OUT/bench_fa4_overhead-64x64.json"
    ;;
  bench)
    bash benchmarks/gpu_sitting.sh "source .gpu/b/extras.sh" \
      "step bench 570 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd fwd+bwd --arms auto fa4 triton fastvideo --warmup 2 --reps 6 --no-pieces --time-budget-min 8 --out \$OUT/bench_video-session24.json"
    ;;
  esac
  ;;
session25-cost)
  # experiment 19 (session 25): delta 11's cost part by part (stores, fence, barrier), one
  # process per ablation
  bash benchmarks/gpu_sitting.sh \
    "for a in none no_fence no_barrier no_stores no_zeroing; do step cost-\$a 120 python3 -m research.fa4_fork.experiments.v_padding_cost --ablation \$a --out \$OUT; done"
  ;;
session25-steps)
  # experiment 19's design arm: P V over the k-steps below a partial block's valid size
  bash benchmarks/gpu_sitting.sh \
    "for a in pv_valid_steps none; do step cost-\$a 100 python3 -m research.fa4_fork.experiments.v_padding_cost --ablation \$a --out \$OUT; done"
  ;;
session25-regress)
  # the ops' per-call copy decision (Backend.reads_key_padding_as_is) through every backend on
  # the GPU: vsa-core's GPU op and compile tests, fa4's whole-op and compile/graph tests
  bash benchmarks/gpu_sitting.sh \
    "step core 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_gpu_ops.py packages/vsa-core/tests/test_gpu_compile.py" \
    "step fa4 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'video_sparse_attn or torch_compile or cuda_graph or 64x64'"
  ;;
session25)
  # Prepared in session 25 (the CuTe bundle unpacked first): delta 11 (the 64x64 forward
  # zeroes partial blocks' V padding in shared memory, so inference makes no zeroed copy of
  # v): its GPU tests (NaN padding through the kernel and the whole op, the shipped paths'
  # equal bits), then the op with and without the copy (fa4_v_copy: the path before) at
  # three latents, time in both views and peak memory. The first two sittings ran while the
  # zeroing was the default (arms "fa4 fa4_v_copy"); since, it is the fa4_zero_v_padding arm.
  bash benchmarks/gpu_sitting.sh \
    "step tests 200 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'nan or valid_sizes_in_the_lists or video_sparse_attn or combined_forward'" \
    "step bench 330 python3 benchmarks/bench_video.py --shapes wan480p wan720p hunyuan720p --sparsities 0.875 --modes fwd --arms fa4 fa4_zero_v_padding --warmup 2 --reps 8 --no-pieces --time-budget-min 5 --out \$OUT/bench_video-v-padding.json"
  ;;
session26)
  # Prepared in session 26 (the CuTe bundle unpacked first): delta 12, the 64x64 backward
  # writing dS, and its Triton dQ pass (issue 20 item 2): the positions and dQ pass against
  # float64, the whole op's gradients against the reference and bitwise reruns, the shipped
  # backward unchanged; then experiment 21 (its time, whole and in parts, against dense and
  # the shipped backward).
  bash benchmarks/gpu_sitting.sh \
    "step tests 240 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-fa4/tests/test_gpu.py packages/flash-attn-4-vsa/tests/test_bwd_sm90.py -k 'ds or dq_pass or explicit_kernel or head_chunks or sm90_kv64 or bwd'" \
    "step ds 240 python3 -m $X.bwd_ds_out --out \$OUT --seqs 32768 --reps 10"
  ;;
session26b)
  # the dS tile staged in shared memory and sent as one bulk copy; the dQ pass's loads
  # pipelined (tl.range)
  bash benchmarks/gpu_sitting.sh \
    "step tests 200 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-fa4/tests/test_gpu.py -k 'ds or dq_pass'" \
    "step ds 240 python3 -m $X.bwd_ds_out --out \$OUT --seqs 32768 131072 --reps 10"
  ;;
session26c)
  # dS staged with its 16-byte chunks permuted by row (no bank conflicts), the slot from one
  # load a tile; the dQ pass without column masks, in five compilations; the no-dQ bound
  bash benchmarks/gpu_sitting.sh \
    "step tests 200 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-fa4/tests/test_gpu.py -k 'ds or dq_pass'" \
    "step ds 240 python3 -m $X.bwd_ds_out --out \$OUT --seqs 32768 --reps 10"
  ;;
session26d)
  # the dQ pass on precomputed entry slots (no dependent load in its loop), upstream's dQ
  # conversion skipped for the dS-writing backward; the whole op's training step with it
  bash benchmarks/gpu_sitting.sh \
    "step tests 200 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-fa4/tests/test_gpu.py packages/flash-attn-4-vsa/tests/test_launch_replay.py -k 'ds or dq_pass or replay'" \
    "step ds 150 python3 -m $X.bwd_ds_out --out \$OUT --seqs 32768 --reps 10" \
    "step bench 300 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd+bwd --arms fa4 fa4_ds_backward --warmup 2 --reps 5 --no-pieces --time-budget-min 4.5 --out \$OUT/bench_video-ds.json"
  ;;
session26e)
  # fa4's deterministic training (its dS-writing backward through Backend.for_call): the
  # GPU tests of the routing and reruns, then the whole op with --deterministic
  bash benchmarks/gpu_sitting.sh \
    "step tests 240 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_deterministic_gpu.py packages/vsa-triton/tests/test_deterministic.py packages/vsa-fa4/tests/test_gpu.py -k 'determin or ds or head_chunks'" \
    "step bench 300 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd+bwd --arms auto triton --deterministic --warmup 2 --reps 5 --no-pieces --time-budget-min 4.5 --out \$OUT/bench_video-deterministic.json"
  ;;
session26f)
  # what bounds the dQ pass (1.56 ms against floors of 0.42 tensor / 0.67 HBM): Nsight Compute
  bash benchmarks/gpu_sitting.sh \
    "step ncu 200 ncu --clock-control none --kernel-name regex:_dq_from_ds --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --csv --page details python3 -m $X.dq_pass_alone"
  ;;
session26g)
  # the dQ pass with query blocks fastest in its grid (one head's K in L2 at a time)
  bash benchmarks/gpu_sitting.sh \
    "step tests 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-fa4/tests/test_gpu.py -k 'ds or dq_pass'" \
    "step ds 150 python3 -m $X.bwd_ds_out --out \$OUT --seqs 32768 --reps 10" \
    "step ncu 100 ncu --clock-control none --kernel-name regex:_dq_from_ds --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --csv --page details python3 -m $X.dq_pass_alone"
  ;;
session26h)
  # the whole op's training step with the dS-writing backward (dQ pass: query blocks fastest,
  # 5 stages) against the shipped one
  bash benchmarks/gpu_sitting.sh \
    "step bench 200 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd+bwd --arms fa4 fa4_ds_backward --warmup 2 --reps 4 --no-pieces --time-budget-min 3 --out \$OUT/bench_video-ds.json"
  ;;
session27)
  # Prepared in session 26: the default question for the dS-writing backward. Its whole op at
  # Wan 480p in one launch (fa4_ds_backward_one_chunk: 4.8 GB of dS) against three chunks and
  # the shipped backward, both latents, both views; then the dQ pass's counters again.
  # First the GPU tests of what changed after session 26's sittings: the all-full layout
  # (no mask) on the dS path, and the review's list-kernel, slot and twin changes (checked on
  # the CPU under the interpreter and by compiling for sm_90 only).
  bash benchmarks/gpu_sitting.sh \
    "step tests 200 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py packages/vsa-fa4/tests/test_lists_triton.py packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-core/tests/test_deterministic_gpu.py -k 'ds_backward or lists or dq_pass or determin'" \
    "step bench 330 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd+bwd --arms fa4 fa4_ds_backward fa4_ds_backward_one_chunk --warmup 2 --reps 5 --no-pieces --time-budget-min 5 --out \$OUT/bench_video-ds-chunks.json" \
    "step ncu 100 ncu --clock-control none --kernel-name regex:_dq_from_ds --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --csv --page details python3 -m $X.dq_pass_alone --stages 5"
  ;;
session27b)
  # Prepared in session 27 after its first sitting (an H100: the dS-writing backward 7-41%
  # ahead of the float32-reduction one): fa4's 64x64 training now runs the dS path by
  # default. The training GPU tests on the new default, then the dS budget (head chunks)
  # against the float32 backward at both Wan latents, and HunyuanVideo with triton (auto's
  # training rule puts triton first there).
  bash benchmarks/gpu_sitting.sh \
    "step tests 170 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py packages/vsa-core/tests/test_deterministic_gpu.py -k 'backward or training or grad or determin or replay'" \
    "step bench 250 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd+bwd --arms fa4 fa4_float32_dq fa4_ds_4gib fa4_ds_8gib fa4_ds_backward_one_chunk --warmup 2 --reps 4 --no-pieces --time-budget-min 3.9 --out \$OUT/bench_video-ds-budgets.json" \
    "step hunyuan 150 python3 benchmarks/bench_video.py --shapes hunyuan720p --sparsities 0.875 --modes fwd+bwd --arms fa4 fa4_float32_dq fa4_ds_8gib triton --warmup 1 --reps 3 --no-pieces --time-budget-min 2.2 --out \$OUT/bench_video-ds-hunyuan.json"
  ;;
session27c)
  # Session 27, on an H200 (27b ran on an H100): fa4's new default (dS-writing backward, 8 GiB
  # of dS a launch) against the float32-reduction backward and the 2 GiB budget; then the
  # compiled and graph-captured op tests of vsa-core on the new default.
  bash benchmarks/gpu_sitting.sh \
    "step bench 230 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd+bwd --arms fa4 fa4_float32_dq fa4_ds_2gib --warmup 2 --reps 4 --no-pieces --time-budget-min 3.6 --out \$OUT/bench_video-ds-default.json" \
    "step core 110 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_gpu_compile.py packages/vsa-core/tests/test_gpu_ops.py packages/vsa-fa4/tests/test_gpu.py -k 'compile or graph or host_sync or fine_attention or fp16'"
  ;;
session27d)
  # Session 27's fallback on an H100 (no H200 came): vsa-core's compiled-op tests on the new
  # default, then experiment 21 (the dS-writing backward against the float32-reduction one
  # and dense, kernels only, S=32768) on the H100, then experiment 22 (head chunks with the
  # dQ pass on a second stream: does a small dS budget then cost nothing?). Worth running
  # on an H200 as well.
  bash benchmarks/gpu_sitting.sh \
    "step core 110 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_gpu_compile.py packages/vsa-core/tests/test_gpu_ops.py" \
    "step ds 130 python3 -m $X.bwd_ds_out --out \$OUT --seqs 32768 --reps 10" \
    "step overlap 150 python3 -m $X.ds_chunk_overlap --out \$OUT --seqs 32768 --reps 10"
  ;;
session28)
  # Session 28 (after session 27c/27d): the dS slots from the list kernels (four device
  # operations a head chunk fewer) and no zero-filled lse gradient. GPU tests of the dS path,
  # then the training step's host time in pieces against the previous commit's vsa-core and
  # vsa-fa4 (research/ab_old, untracked: b6c1178's sources first on the path).
  OLD="$PWD/research/ab_old/packages/vsa-fa4/src:$PWD/research/ab_old/packages/vsa-core/src"
  bash benchmarks/gpu_sitting.sh \
    "step tests 240 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-fa4/tests/test_gpu.py packages/vsa-core/tests/test_deterministic_gpu.py -k 'dq_pass or ds_backward or determin or head_chunks or torch_compile or cuda_graph or training'" \
    "step host_new 100 python3 -m research.op_host_train --shapes wan480p --backends fa4 --reps 15 --out \$OUT/host_new.jsonl" \
    "step host_old 100 env PYTHONPATH=$OLD:\$PYTHONPATH python3 -m research.op_host_train --shapes wan480p --backends fa4 --reps 15 --out \$OUT/host_old.jsonl" \
    "step host_new2 100 python3 -m research.op_host_train --shapes wan480p --backends fa4 --reps 15 --out \$OUT/host_new2.jsonl"
  ;;
session29)
  # Session 29, on an H200 if one comes. "tests": the dS path with upstream's preprocess no
  # longer zeroing the float32 dQ accumulator and inference zeroing v's padding where it is
  # (GPU tests; the kernels' profile at Wan 480p, where the preprocess took 123 us with the
  # zeroing in session 25; the forward at both Wan latents beside the variant that zeroes V's
  # padding in shared memory: session 25 measured peak memory 2.54x / 2.62x of dense with
  # the copy, 1.32x / 1.40x without). "bench": session 27c's comparison of fa4's training
  # backwards at both Wan latents, then the selection kernel at 1 and 2 warps a program.
  # "pool": the pooling kernel's variants and the padding fill (research.coarse_stage.
  # pool_variants), then vsa-core's compiled and eager GPU op tests on the in-place path.
  case "${2:-tests}" in
  tests)
    bash benchmarks/gpu_sitting.sh \
      "step tests 200 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_dq_from_ds.py packages/vsa-fa4/tests/test_gpu.py packages/flash-attn-4-vsa/tests/test_launch_replay.py -k 'dq_pass or ds_backward or determin or replay or head_chunks or training or padding or nan'" \
      "step profile 100 python3 benchmarks/profile_video_op.py --shape wan480p --backends fa4 --modes fwd fwd+bwd --calls 3 --out \$OUT/profile" \
      "step fwd 170 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd --arms fa4 fa4_zero_v_padding --warmup 2 --reps 6 --no-pieces --time-budget-min 2.5 --out \$OUT/bench_video-fwd-in-place.json"
    ;;
  bench)
    bash benchmarks/gpu_sitting.sh \
      "step bench 230 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd+bwd --arms fa4 fa4_float32_dq fa4_ds_2gib --warmup 2 --reps 4 --no-pieces --time-budget-min 3.6 --out \$OUT/bench_video-ds-default.json" \
      "step select 160 python3 research/coarse_stage/sweep_select.py --warps-grid --reps 20 --out \$OUT/sweep_select-warps.json"
    ;;
  pool)
    bash benchmarks/gpu_sitting.sh \
      "step pool 150 python3 -m research.coarse_stage.pool_variants --out \$OUT/pool_variants.json" \
      "step core 150 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_gpu_compile.py packages/vsa-core/tests/test_gpu_ops.py"
    ;;
  final)
    # the padding zeroed inside the pooling pass: GPU tests, then the forward at both latents
    bash benchmarks/gpu_sitting.sh \
      "step tests 170 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_coarse.py packages/vsa-core/tests/test_gpu_ops.py packages/vsa-fa4/tests/test_gpu.py -k 'zeroing or pool or padding or nan or combined or video'" \
      "step fwd 130 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd --arms fa4 fa4_zero_v_padding --warmup 2 --reps 6 --no-pieces --time-budget-min 1.8 --out \$OUT/bench_video-fwd-pool-zeroing.json" \
      "step profile 60 python3 benchmarks/profile_video_op.py --shape wan480p --backends fa4 --modes fwd --calls 3 --out \$OUT/profile"
    ;;
  esac
  ;;
session30)
  # Session 30 (no device was lent; prepared for the next sitting). "gaps": where a call waited
  # for loses to calls back to back (research.op_latency_gaps: the device's idle stretches in
  # one call after a synchronize, each put on the launch that ended it; once without Python
  # stacks for the sizes, once with them for the issuers), Wan 480p and 720p, fa4, forward and
  # forward+backward. "all": session 29's unrun "final" (GPU tests of the pooling pass that
  # zeroes v's padding, the forward at both latents), then "gaps".
  gaps_steps=(
    "step gaps 90 python3 -m research.op_latency_gaps --shapes wan480p wan720p --backends fa4 --modes fwd fwd+bwd --calls 5 --out \$OUT/latency_gaps.json"
    "step gaps_stacks 90 python3 -m research.op_latency_gaps --shapes wan480p --backends fa4 --modes fwd fwd+bwd --calls 3 --stacks --out \$OUT/latency_gaps-stacks.json"
  )
  case "${2:-all}" in
  gaps)
    bash benchmarks/gpu_sitting.sh "${gaps_steps[@]}"
    ;;
  all)
    bash benchmarks/gpu_sitting.sh \
      "step tests 170 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_coarse.py packages/vsa-core/tests/test_gpu_ops.py packages/vsa-fa4/tests/test_gpu.py -k 'zeroing or pool or padding or nan or combined or video'" \
      "step fwd 130 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd --arms fa4 fa4_zero_v_padding --warmup 2 --reps 6 --no-pieces --time-budget-min 1.8 --out \$OUT/bench_video-fwd-pool-zeroing.json" \
      "${gaps_steps[@]}"
    ;;
  esac
  ;;
session31)
  # Session 31. "tests": the GPU tests session 29's pooling pass (v's padding zeroed in it)
  # never ran, and session 31's training path (the coarse attention from the selection
  # kernel, its gradient recomputed after the fine backward). "ab": that path against
  # 22dc83b's vsa-core (SDPA after the fine forward's launch, research/ab_mid) and 54b9c58's
  # (SDPA before the selection, research/ab_old), both untracked; Wan 480p fa4, forward+
  # backward then forward, both views (bench_video), new first and last for drift.
  # Make them first: mkdir -p research/ab_old && git archive 54b9c58 packages/vsa-core/src |
  # tar -x -C research/ab_old (the same with 22dc83b for research/ab_mid).
  # ab() and the trees' paths serve both "ab" and "reorder"
  ab() {
    echo "step $1 125 $2 python3 benchmarks/bench_video.py --shapes wan480p --sparsities 0.875 --modes fwd+bwd fwd --arms fa4 --warmup 2 --reps 6 --no-pieces --out \$OUT/bench_video-$1.json"
  }
  old="env PYTHONPATH=$PWD/research/ab_old/packages/vsa-core/src:\$PYTHONPATH"
  mid="env PYTHONPATH=$PWD/research/ab_mid/packages/vsa-core/src:\$PYTHONPATH"
  case "${2:-tests}" in
  tests)
    bash benchmarks/gpu_sitting.sh \
      "step tests 330 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_coarse.py packages/vsa-core/tests/test_gpu_ops.py packages/vsa-core/tests/test_gpu_compile.py packages/vsa-fa4/tests/test_gpu.py -k 'zeroing or pool or padding or nan or combined or video or training or compile or graph'"
    ;;
  ab)
    bash benchmarks/gpu_sitting.sh "$(ab new '')" "$(ab old "$old")" "$(ab mid "$mid")" "$(ab new2 '')"
    ;;
  suite)
    # after the revert and the cheaper replay description: the fork's replay tests, then
    # vsa-core's and vsa-triton's GPU suites, then vsa-fa4's as far as time allows
    bash benchmarks/gpu_sitting.sh \
      "step replay_core_triton 140 python3 -m pytest -q -p no:warnings -m gpu packages/flash-attn-4-vsa/tests/test_launch_replay.py packages/vsa-core/tests packages/vsa-triton/tests" \
      "step fa4 100 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'replay or video_sparse_attn or combined'"
    ;;
  reorder)
    # after the revert of the selection-pass variant: the reorder (this tree) against
    # 54b9c58, alternating, twice each (for the H200's slower host)
    bash benchmarks/gpu_sitting.sh "$(ab old "$old")" "$(ab new '')" "$(ab old2 "$old")" "$(ab new2 '')"
    ;;
  esac
  ;;
session33)
  # Prepared in session 32 for the next sitting (about 560 s). "props": the failing fa4
  # property case found and diagnosed, then the property test with its traceback; "suite": the GPU suites in parts small enough to finish
  # (each stops at its first failure and prints it); "bench": the whole op at both Wan latents
  # with the ranking apart (issue 19's table cells, fa4 and triton, forward and
  # forward+backward, both views), the selection sweep with 32 tiles a score program too and
  # the ranking with its candidates compacted (research.coarse_stage.rank_variants)
  case "${2:-props}" in
  props)
    # a failing case drawn from the property's space, then the same case with the replay off,
    # the float32 dQ backward and the triton backend (research.fa4_adapter.property_failure);
    # then the property test itself, one seed, stopping at its first failure
    bash benchmarks/gpu_sitting.sh \
      "step diagnose 250 python3 -m research.fa4_adapter.property_failure --cases 80 --out \$OUT/property_failure.json" \
      "step prop 200 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-core/tests/test_properties.py -k 'video_sparse_attn_matches_the_model and gpu_fa4' --hypothesis-seed=1"
    ;;
  fix)
    # the one-key-block regression tests (upstream refused the dS path's (1, 1, 1) slot
    # starts), then the property test at two seeds, each stopping at its first failure
    bash benchmarks/gpu_sitting.sh \
      "step regress 150 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'one_key_block or ds_backward'" \
      "step prop1 170 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-core/tests/test_properties.py -k 'video_sparse_attn_matches_the_model and gpu_fa4' --hypothesis-seed=1" \
      "step prop2 170 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-core/tests/test_properties.py -k 'gpu_fa4' --hypothesis-seed=2"
    ;;
  suite)
    bash benchmarks/gpu_sitting.sh \
      "step core_ops 150 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/flash-attn-4-vsa/tests/test_launch_replay.py packages/vsa-core/tests --deselect packages/vsa-core/tests/test_properties.py" \
      "step triton 120 python3 -m pytest -x -q -p no:warnings --tb=short packages/vsa-triton/tests/test_coarse.py packages/vsa-triton/tests/test_gpu.py" \
      "step fa4 250 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-fa4/tests/test_gpu.py"
    ;;
  bench)
    bash benchmarks/gpu_sitting.sh \
      "step sweep 150 python3 research/coarse_stage/sweep_select.py --rank-apart --latents wan480p wan720p --reps 20 --out \$OUT/sweep_select-rank-apart.json" \
      "step rank 90 python3 -m research.coarse_stage.rank_variants --out \$OUT/rank_variants.json" \
      "step bench 300 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd fwd+bwd --arms fa4 triton --warmup 2 --reps 4 --no-pieces --time-budget-min 4.3 --out \$OUT/bench_video.json"
    ;;
  esac
  ;;
session34)
  # Prepared in session 33 (steps of at most ~170 s, so that none is cut): "tests": vsa-fa4's
  # GPU file in two halves (it was never run whole after the dS default), the fork's GPU
  # tests, the fa4 properties at two more seeds; "bench": issue 19's table cells on whatever
  # card comes (fa4 and triton, both Wan latents, both views)
  case "${2:-tests}" in
  tests)
    bash benchmarks/gpu_sitting.sh \
      "step fa4_a 170 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'not video and not combined and not compile and not graph'" \
      "step fa4_b 170 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'video or combined or compile or graph'" \
      "step fork 170 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/flash-attn-4-vsa/tests --deselect packages/flash-attn-4-vsa/tests/test_launch_replay.py" \
      "step props 60 python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-core/tests/test_properties.py -k 'video_sparse_attn_matches_the_model and gpu_fa4' --hypothesis-seed=3"
    ;;
  bench)
    bash benchmarks/gpu_sitting.sh \
      "step bench 420 python3 benchmarks/bench_video.py --shapes wan480p wan720p --sparsities 0.875 --modes fwd fwd+bwd --arms fa4 triton --warmup 2 --reps 4 --no-pieces --time-budget-min 6 --out \$OUT/bench_video.json"
    ;;
  esac
  ;;
session32c)
  # Session 32, third sitting: vsa-core's property test of video_sparse_attn on fa4 failed on
  # the GPU in both earlier sittings (the logs were cut by the step limits). Once with this
  # tree, once with the fork's launch_replay as it was before session 31's cheaper call
  # description (98307a3, research/ab_replay, untracked: make it with mkdir -p
  # research/ab_replay && git archive 98307a3 packages/flash-attn-4-vsa/src | tar -x -C
  # research/ab_replay), one hypothesis seed, stopping at the first failure. "session32c"
  # runs this tree's alone; "session32c ab [LIMIT]" both
  prop="python3 -m pytest -x -q -p no:warnings --tb=short -m gpu packages/vsa-core/tests/test_properties.py -k 'video_sparse_attn_matches_the_model and gpu_fa4' --hypothesis-seed=1"
  bash benchmarks/gpu_sitting.sh \
    "step prop_head ${3:-130} $prop" \
    ${2:+"step prop_old_replay 110 env PYTHONPATH=$PWD/research/ab_replay/packages/flash-attn-4-vsa/src:\$PYTHONPATH $prop"}
  ;;
session32b)
  # Session 32, second sitting: the sweep again with device times (CUDA-graph replay) and the
  # score kernel alone; the pooling pass on a heads-first grid (pool_variants); the selection
  # tests compiled (test_coarse.py is not marked gpu);
  # the diffusers integration tests with tracebacks (one failed in the first sitting, which
  # timed out before the rest); the rest of vsa-core's GPU suite and vsa-triton's
  bash benchmarks/gpu_sitting.sh \
    "step sweep 150 python3 research/coarse_stage/sweep_select.py --rank-apart --reps 20 --out \$OUT/sweep_select-rank-apart-graph.json" \
    "step pool 100 python3 -m research.coarse_stage.pool_variants --rounds 6 --out \$OUT/pool_variants-heads-first.json" \
    "step select_tests 70 python3 -m pytest -q -p no:warnings packages/vsa-triton/tests/test_coarse.py -k 'select or split'" \
    "step diffusers 100 python3 -m pytest -q -p no:warnings -m gpu --tb=long packages/vsa-core/tests/test_integration_diffusers_gpu.py" \
    "step rest 140 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-core/tests/test_properties.py packages/vsa-triton/tests"
  ;;
session32)
  # Session 32: the ranking in a kernel of its own (SelectConfig.rank_apart), swept against
  # the fused selection at three latents, plain and as the op's inference call; then session
  # 31's unrun suite (the cheaper replay description's GPU tests, vsa-core's and vsa-triton's
  # GPU suites, the rank-apart tests among them, then vsa-fa4's replay and video tests)
  bash benchmarks/gpu_sitting.sh \
    "step sweep 200 python3 research/coarse_stage/sweep_select.py --rank-apart --reps 20 --out \$OUT/sweep_select-rank-apart.json" \
    "step replay_core_triton 160 python3 -m pytest -q -p no:warnings -m gpu packages/flash-attn-4-vsa/tests/test_launch_replay.py packages/vsa-core/tests packages/vsa-triton/tests" \
    "step fa4 100 python3 -m pytest -q -p no:warnings -m gpu packages/vsa-fa4/tests/test_gpu.py -k 'replay or video_sparse_attn or combined'"
  ;;
*)
  echo "usage: $0 grid | bwd-counters | bwd-split | session19 | session21 | session22 [tests|bench] | session23 [tests|props|bench|second|block-props] | session24 [tests|final|profile|bench] | session25 | session25-cost | session25-regress | session25-steps | session26 | session26b | session26c | session26d | session26e | session26f | session26g | session26h | session27 | session27b | session27c | session27d | session28 | session29 [tests|bench|pool|final] | session30 [gaps|all] | session31 [tests|ab|suite|reorder] | session32 | session32b | session32c [ab [LIMIT]] | session33 [props|fix|suite|bench] | session34 [tests|bench]" >&2
  exit 2
  ;;
esac

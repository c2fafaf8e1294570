"""Host time of each piece of the whole op's inference forward, on a GPU, without a profiler.

`op_host_profile` (cProfile) shows where the Python goes but inflates every call ~2-3x, and
`diagnose_op_host` times only the whole call. This times, after a synchronize each time, how
long each piece takes to *return* (its launches queued, not run), with the op's own tensors:
the whole `video_sparse_attn`, then the pieces it calls in order (pooling, coarse attention,
selection, the selection with the coarse attention (the op's inference path since session 21),
layout, the fine backend's combined forward on the split lists the selection kernel wrote (as
the op runs it) and on plain lists (its own split first), and vsa-fa4's list kernel),
and yardsticks: an empty Triton kernel's launch, ``torch.empty``, dense FA4 on the same tokens.
Medians over ``--reps`` calls; one JSON line per (shape, piece). ::

    python3 -m research.op_host_pieces --shapes wan480p wan720p --out $OUT/pieces.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from research.harness import benchmark_module

bv = benchmark_module("bench_video")
SHAPES = ("wan480p", "wan720p")
"""`bench_video.PRESETS` this script times by default."""


BUSY_CYCLES = 6_000_000
"""``torch.cuda._sleep`` cycles queued before a call in the busy view (~3 ms at the H200's
~1.98 GHz): longer than any piece's host time, so a piece that waits for the device (an
implicit synchronization, a blocking allocation) shows it as milliseconds."""


def host_us(fn, reps: int, busy: bool = False, setup=None, cycles: int = BUSY_CYCLES) -> float:
    """Median microseconds for ``fn()`` to return (``fn(setup())`` with a ``setup``, which is
    not timed), each call right after a synchronize; with ``busy``, also after queueing
    ``cycles`` of device sleep (the device still working, as inside the op, where each piece
    is issued while the previous ones run). One untimed call first."""
    times = []
    for _ in range(reps + 1):
        arg = None if setup is None else setup()
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(cycles)
        start = time.perf_counter()
        fn() if setup is None else fn(arg)
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times[1:])


def time_rows(shape: str, backend: str, calls: dict, reps: int, lines: list[str], **kwargs):
    """Time each of ``calls`` (name -> fn, or name -> (fn, setup)) idle and busy (``kwargs``
    go to `host_us`), printing and appending one JSON line per piece to ``lines``."""
    for name, call in calls.items():
        fn, setup = call if isinstance(call, tuple) else (call, None)
        row = {"shape": shape, "backend": backend, "piece": name,
               "host_us": round(host_us(fn, reps, setup=setup, **kwargs), 1),
               "host_us_busy": round(host_us(fn, reps, True, setup, **kwargs), 1)}  # fmt: skip
        print(json.dumps(row), flush=True)
        lines.append(json.dumps(row))


def write_lines(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


def _empty_triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def nothing(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    return nothing


def op_inputs(shape: str, requires_grad: bool = False):
    """``(tiling, q, k, v, gate)``: a `bench_video.PRESETS` latent's tiling and bf16 tile-order
    inputs on the GPU (D = 128, batch 1, seed 0)."""
    from vsa_core import VideoTiling

    latent, heads = bv.PRESETS[shape]
    tiling = VideoTiling(latent, (4, 4, 4))
    gen = torch.Generator(device="cuda").manual_seed(0)
    dims = (1, tiling.padded_len, heads, 128)
    tensors = (
        torch.randn(dims, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(
            requires_grad
        )
        for _ in range(4)
    )
    return (tiling, *tensors)


def pieces(shape: str, backend: str):
    """name -> callable, every piece on the tensors the op itself would make."""
    import vsa_core.ops as ops
    from vsa_core import video_sparse_attn
    from vsa_core.coarse import coarse_stage, layout_from_selection
    from vsa_fa4 import ops as fa4_ops

    tiling, q, k, v, gate = op_inputs(shape)
    dims = q.shape
    topk = bv.topk_for(0.875, tiling.num_tiles)
    scale = 128**-0.5
    valid = tiling.valid_sizes(q.device)
    stage = coarse_stage("auto", q)
    chosen, padding_as_is = ops._backend_for(q, k, v, (64, 64), 1, False, backend, False)
    clean = ops._inputs_to_clean(False, False, padding_as_is)
    padding = ops._padding_index(tiling, q.device)
    pooled = stage.pool_and_clean(q, k, v, valid, clean, padding)
    coarse = ops._coarse_attention(*pooled[:3], valid, scale, False, False)
    selection = stage.select(pooled[0], pooled[1], valid, topk)
    layout = layout_from_selection(selection, valid, 64, all_full=False)
    # the op's inference layout: the selection kernel's split lists beside the plain ones
    coarse_split, selection_split, split = stage.select_and_attend(
        *pooled[:3], valid, topk, scale, 64, may_have_empty=False
    )
    split_layout = layout_from_selection(
        selection_split, valid, 64, all_full=False, forward_split=split
    )
    nothing, scratch = _empty_triton_kernel(), torch.zeros(1024, device="cuda")
    calls = {
        "op": lambda: video_sparse_attn(
            q, k, v, topk=topk, tiling=tiling, coarse_gate=gate, backend=backend
        ),
        "pool_and_clean": lambda: stage.pool_and_clean(q, k, v, valid, clean, padding),
        "coarse_attention": lambda: ops._coarse_attention(*pooled[:3], valid, scale, False, False),
        "select": lambda: stage.select(pooled[0], pooled[1], valid, topk),
        "select_and_attend": lambda: stage.select_and_attend(
            *pooled[:3], valid, topk, scale, 64, may_have_empty=False
        ),
        "layout_from_selection": lambda: layout_from_selection(
            selection, valid, 64, all_full=False
        ),
        "fine_forward_combined": lambda: chosen.forward_combined(
            *pooled[3:], split_layout, scale, coarse_split, gate
        ),
        "fine_forward_combined_own_split": lambda: chosen.forward_combined(
            *pooled[3:], layout, scale, coarse, gate
        ),
        "yardstick_empty_triton_launch": lambda: nothing[(1,)](scratch, 1024, BLOCK=1024),
        "yardstick_torch_empty": lambda: torch.empty(dims, device="cuda", dtype=torch.bfloat16),
    }
    if backend == "fa4":
        from flash_attn.cute import flash_attn_func

        lists_args = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64, True)
        calls["fa4_list_split"] = lambda: fa4_ops._forward_lists(*lists_args)
        calls.update(_fa4_launch_pieces(pooled[3:], layout, coarse, gate, scale))
        calls["yardstick_dense_fa4"] = lambda: flash_attn_func(q, k, v)
    return calls


def _fa4_launch_pieces(qkv, layout, coarse, gate, scale):
    """The combined forward below vsa-fa4's list kernel: `launch.run_forward` on prebuilt
    lists (the fork's entry point and its replayed launch)."""
    from vsa_fa4 import launch
    from vsa_fa4 import ops as fa4_ops

    q, k, v = qkv
    valid = layout.kv_valid_sizes.contiguous()
    lists = fa4_ops._forward_lists(layout.kv_indices, layout.kv_counts, valid, 64, True)
    out = torch.empty_like(q)

    def run_forward():
        launch.run_forward(q, k, v, out, None, lists, valid, scale, (64, 64), True,
                           combine=(coarse, gate))  # fmt: skip

    calls = {"fa4_run_forward": run_forward}
    calls.update(_replay_pieces(run_forward))
    return calls


def _replay_pieces(run_forward):
    """Inside `run_forward`'s replayed launch (`flash_attn_vsa.launch_replay`): the recorded
    program alone on the tensors the entry point passed it, then each of its steps (ATen
    operations and the compiled kernel's call) alone, so that the entry point's own Python,
    the program's and the compiled call's host time read apart."""
    from functools import partial

    from flash_attn_vsa import launch_replay

    for _ in range(3):  # the first call compiles, the second records
        run_forward()
    captured = []
    original = launch_replay.RecordedLaunch.__call__

    def capture(self, tensors):
        captured.append((self, list(tensors)))
        return original(self, tensors)

    launch_replay.RecordedLaunch.__call__ = capture
    try:
        run_forward()
    finally:
        launch_replay.RecordedLaunch.__call__ = original
    if not captured:
        print("run_forward was not replayed", file=sys.stderr)
        return {}
    record, tensors = captured[0]
    print(f"replayed program: {record.kernels} kernel(s), operations {record.operations}",
          file=sys.stderr)  # fmt: skip
    calls = {"fa4_replay_program": lambda: record(tensors)}
    made = [None] * record.made
    for i, (fn, args, kwargs, outputs) in enumerate(record._program):
        bound_args, bound_kwargs = args(tensors, made), kwargs(tensors, made)
        value = fn(*bound_args, **bound_kwargs)
        if outputs is not None:
            launch_replay._store(outputs, value, made)
        name = "kernel" if outputs is None else str(fn).replace(".", "_")
        calls[f"fa4_replay_step{i}_{name}"] = partial(fn, *bound_args, **bound_kwargs)
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(bv.PRESETS))
    parser.add_argument("--backends", nargs="*", default=["fa4", "triton"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    lines = []
    with torch.no_grad():
        for shape in args.shapes:
            for backend in args.backends:
                time_rows(shape, backend, pieces(shape, backend), args.reps, lines)
                torch.cuda.empty_cache()
    write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of the whole op's training step in pieces, on a GPU, without a profiler.

`op_host_pieces` covers inference. Issue 19 asks for <= 1.5 ms of host time to issue one
forward+backward; session 23 measured 1.82 ms at Wan 480p and 2.88 ms at Wan 720p (fa4), so
something grows with the latent. Here, each piece's time to *return* (launches queued) with
the device kept busy by a queued sleep (as inside a step, where each piece is issued while the
previous ones run) and with it idle, medians over ``--reps``:

- ``step``: forward with gradients and ``torch.autograd.grad`` together, ``forward`` alone,
  ``backward`` alone (each rep on a fresh graph);
- fa4 only: vsa-fa4's ``backward_impl`` on the op's tensors as shipped (head chunks within
  ``DQ_ACCUM_BUDGET_BYTES``) and with one chunk of all heads, then one chunk's backward lists
  and ``launch.run_backward`` on prebuilt lists.

One JSON line per (shape, backend, piece), then one with the replay status (and with
``--trace DIR`` the launch calls of one forward and one backward, whose torch.profiler tables
go to DIR). ::

    python3 -m research.op_host_train --shapes wan480p wan720p --out $OUT/train_pieces.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from research.harness import benchmark_module
from research.op_host_pieces import op_inputs, time_rows, write_lines

bv = benchmark_module("bench_video")
BUSY_CYCLES = 20_000_000
"""``torch.cuda._sleep`` cycles queued before a timed piece (~10 ms at ~1.98 GHz): longer than
any piece's host time, so the device never waits for the host inside a timed piece."""


def pieces(shape: str, backend: str):
    """name -> callable, or (callable of a setup's value, setup), on the op's own tensors."""
    from vsa_core import video_sparse_attn

    tiling, q, k, v, gate = op_inputs(shape, requires_grad=True)
    dout = torch.randn_like(q)
    topk = bv.topk_for(0.875, tiling.num_tiles)
    inputs = (q, k, v, gate)

    def forward():
        return video_sparse_attn(q, k, v, topk=topk, tiling=tiling, coarse_gate=gate,
                                 backend=backend)  # fmt: skip

    calls = {
        "step": lambda: torch.autograd.grad(forward(), inputs, dout),
        "forward": forward,
        "backward": (lambda out: torch.autograd.grad(out, inputs, dout), forward),
    }
    calls.update(_forward_pieces(q, k, v, gate, tiling, topk, backend))
    if backend == "fa4":
        calls.update(_fa4_backward_pieces(q, k, v, dout, tiling, topk))
    return calls


def _forward_pieces(q, k, v, gate, tiling, topk, backend):
    """The op's training forward in the pieces it calls, in order, with gradients on."""
    import vsa_core.ops as ops
    from vsa_core.coarse import coarse_stage, layout_from_selection

    valid = tiling.valid_sizes(q.device)
    stage = coarse_stage("auto", q)
    chosen, padding_as_is = ops._backend_for(q, k, v, (64, 64), 1, False, backend, False)
    clean = ops._inputs_to_clean(False, True, padding_as_is)
    padding = tiling.indices(q.device).padding_index
    pooled = stage.pool_and_clean(q, k, v, valid, clean, padding)
    scale = 128**-0.5
    coarse = ops._coarse_attention(*pooled[:3], valid, scale, False, False)
    with torch.no_grad():
        selection, split = stage.selection(pooled[0], pooled[1], valid, topk, None)
    layout = layout_from_selection(selection, valid, 64, all_full=False, forward_split=split)
    fine, _ = chosen.forward(*pooled[3:], layout, scale)

    def select():
        with torch.no_grad():
            stage.selection(pooled[0], pooled[1], valid, topk, None)

    return {
        "fwd_pool_and_clean": lambda: stage.pool_and_clean(q, k, v, valid, clean, padding),
        "fwd_coarse_attention": lambda: ops._coarse_attention(
            *pooled[:3], valid, scale, False, False
        ),
        "fwd_selection": select,
        "fwd_layout": lambda: layout_from_selection(selection, valid, 64, all_full=False),
        "fwd_fine": lambda: chosen.forward(*pooled[3:], layout, scale),
        "fwd_combine": lambda: stage.combine(fine, coarse, gate, valid, True, padding),
    }


def _fa4_backward_pieces(q, k, v, dout, tiling, topk):
    """vsa-fa4's backward below autograd, on lists from the op's own coarse stage."""
    from vsa_core.coarse import coarse_stage, layout_from_selection
    from vsa_core.rotation import rotation_width
    from vsa_fa4 import launch
    from vsa_fa4 import ops as fa4_ops
    from vsa_fa4.metadata import backward_lists

    q, k, v = (t.detach() for t in (q, k, v))
    valid = tiling.valid_sizes(q.device)
    stage = coarse_stage("auto", q)
    padding = tiling.indices(q.device).padding_index
    qp, kp, _ = stage.pool_and_clean(q, k, v, valid, (False, False, False), padding)[:3]
    layout = layout_from_selection(stage.select(qp, kp, valid, topk), valid, 64, all_full=False)
    lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
    scale = 128**-0.5
    out, lse = fa4_ops.forward_impl(q, k, v, *lists, scale, 64, 64)
    args = (dout, q, k, v, out, lse, *lists, scale, 64, 64)
    chunks = len(fa4_ops.head_chunks(1, q.shape[2], q.shape[1], q.shape[3]))

    def one_chunk():
        budget = fa4_ops.DQ_ACCUM_BUDGET_BYTES
        fa4_ops.DQ_ACCUM_BUDGET_BYTES = 1 << 62
        try:
            fa4_ops.backward_impl(*args)
        finally:
            fa4_ops.DQ_ACCUM_BUDGET_BYTES = budget

    valid_c = layout.kv_valid_sizes.contiguous()
    rotate = rotation_width(q.device) * launch.backward_ctas_per_sm((64, 64))
    bw_lists = backward_lists(layout.kv_indices, layout.kv_counts, valid_c, 64, True,
                              rotate_sms=rotate)  # fmt: skip
    grads = [torch.empty_like(t) for t in (q, k, v)]
    print(f"{q.shape}: {chunks} head chunk(s)", file=sys.stderr)

    def lists_all_heads():
        backward_lists(layout.kv_indices, layout.kv_counts, valid_c, 64, True, rotate_sms=rotate)

    def run_backward_all_heads():
        launch.run_backward(dout, q, k, v, out, lse, *grads, bw_lists, valid_c, scale, (64, 64))

    return {
        f"fa4_backward_impl_{chunks}_chunks": lambda: fa4_ops.backward_impl(*args),
        "fa4_backward_impl_one_chunk": one_chunk,
        "fa4_backward_lists_all_heads": lists_all_heads,
        "fa4_run_backward_all_heads": run_backward_all_heads,
    }


def _replay_status() -> dict[str, int]:
    """How many call descriptions replay their recorded launch, and how many run upstream's
    launcher for good (`flash_attn_vsa.launch_replay`), forward and backward."""
    from flash_attn_vsa import launch_replay

    status = {}
    for name, cache in (("forward", launch_replay.FORWARDS), ("backward", launch_replay.BACKWARDS)):
        records = list(cache._records.values())
        replayed = sum(isinstance(r, launch_replay.RecordedLaunch) for r in records)
        status[f"{name}_replayed"] = replayed
        status[f"{name}_launcher"] = sum(
            not isinstance(r, launch_replay.RecordedLaunch) and r > launch_replay.ATTEMPTS
            for r in records
        )
    return status


def trace(shape: str, backend: str, calls: dict, out_dir: str, rows: int = 40) -> dict[str, int]:
    """One training step's forward and backward (``calls``: `pieces`' for this shape and
    backend) under torch.profiler (host and CUDA runtime events): per phase, a table of host
    operations by their own time in ``out_dir`` and the number of launch calls (what the
    pieces timed alone may miss: the op's forward took 2.4x its pieces' sum on session 24's
    host)."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    forward, (backward, setup) = calls["forward"], calls["backward"]
    for _ in range(3):
        backward(setup())
    torch.cuda.synchronize()
    counts = {}
    for phase in ("forward", "backward"):
        out = setup() if phase == "backward" else None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward() if phase == "forward" else backward(out)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        path = Path(out_dir) / f"{shape}-{backend}-{phase}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table)
        counts[f"{phase}_launches"] = sum(
            e.count for e in prof.key_averages() if "LaunchKernel" in e.key or "cuLaunch" in e.key
        )
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["wan480p", "wan720p"],
                        choices=list(bv.PRESETS))  # fmt: skip
    parser.add_argument("--backends", nargs="*", default=["fa4", "triton"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out")
    parser.add_argument("--trace", metavar="DIR", help="also write torch.profiler tables here")
    args = parser.parse_args(argv)
    lines = []
    for shape in args.shapes:
        for backend in args.backends:
            calls = pieces(shape, backend)
            time_rows(shape, backend, calls, args.reps, lines, cycles=BUSY_CYCLES)
            launches = trace(shape, backend, calls, args.trace) if args.trace else {}
            del calls
            torch.cuda.empty_cache()
            status = {"shape": shape, "backend": backend, **_replay_status(), **launches}
            status = json.dumps(status)
            print(status, flush=True)
            lines.append(status)
    write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

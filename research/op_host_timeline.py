"""When the op's launches leave the host, on this CPU, and what that costs a call waited for
on a GPU: a model of the device's idle time from the host's timeline.

`research.op_host_cpu` runs the whole op with every launch stubbed; this records, in the same
setting, how far into the call each launch is issued (median over calls), then replays that
timeline against measured device times: kernel i starts at ``max(its launch x slowdown +
latency, the end of kernel i - 1)``. ``slowdown`` is how much slower the GPU host runs the
op's Python than this CPU (session 29's H200 host: 5.5 ms a training step at Wan 480p against
~0.55 ms here, about 10x). The modelled call, from its start to its last kernel's end, against
the device's own time is the model of `bench_video`'s "once" against "back to back": which
launches the device waits for, and how long.

Device times default to session 29's H100 profile at Wan 2.1 480p (fa4, 87.5%,
`benchmarks/results/logs/2026-12-05-h100-session29/s1/profile/`); the stubbed op runs a small
latent (its Python does not depend on the latent's size; the launches' own cost, a few us
each, is not in the timeline). ::

    uv run python -m research.op_host_timeline train     # or: fwd
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from research.op_host_cpu import stub_devices

DEVICE_US_WAN480P_H100 = {
    "fwd": {  # inference: pooling (zeroing v's padding), selection with the coarse attention,
        # the fine forward with the combine in its epilogue
        "pool_fwd_kernel": 139.0, "select_topk_kernel": 115.0, "cute_fwd": 2410.0,
    },
    "train": {
        "pool_fwd_kernel": 243.1, "sdpa_fwd": 14.2, "select_topk_kernel": 103.0,
        "cute_fwd": 2351.0, "combine_fwd_kernel": 117.3, "combine_bwd_kernel": 126.4,
        "_mark_selected": 24.2, "_rank_selected": 48.5,
        "cute_bwd": 95.2 + 4499.0,  # upstream's preprocess, then the key-owned kernel
        "_dq_from_ds": 1913.0, "sdpa_bwd": 30.0 + 4.5 + 3.4, "pool_bwd_kernel": 237.3,
    },
}  # fmt: skip
"""Device microseconds a call per launch (torch.profiler's self CUDA time over 3 calls)."""


def _hooks(marks: list[tuple[str, float]], start: list[float]) -> None:
    """Every stubbed launch of `op_host_cpu.stub_devices` appends (its name, seconds since
    ``start[0]``) to ``marks`` as it returns."""
    import flash_attn_vsa.launch_replay as replay
    import vsa_core.coarse as core_coarse
    import vsa_core.ops as core_ops
    import vsa_fa4.backward_lists_triton as backward_lists
    import vsa_fa4.dq_from_ds_triton as dq_from_ds
    import vsa_fa4.forward_lists_triton as forward_lists
    import vsa_triton.coarse as coarse
    import vsa_triton.ops as triton_ops

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter() - start[0]))

    stub = coarse.launch

    def launch(kernel, grid, *args, **kwargs):
        result = stub(kernel, grid, *args, **kwargs)
        mark(getattr(getattr(kernel, "fn", None), "__name__", str(kernel)))
        return result

    coarse.launch = triton_ops.launch = launch
    backward_lists.launch = forward_lists.launch = dq_from_ds.launch = launch
    for records, name in ((replay.FORWARDS, "cute_fwd"), (replay.BACKWARDS, "cute_bwd")):
        run = records.run

        def recorded(*args, _run=run, _name=name, **kwargs):
            result = _run(*args, **kwargs)
            mark(_name)
            return result

        records.run = recorded

    class CoarseAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, qp, kp, vp):
            mark("sdpa_fwd")
            return qp * 1.0

        @staticmethod
        def backward(ctx, grad):
            mark("sdpa_bwd")
            return grad, torch.zeros_like(grad), torch.zeros_like(grad)

    def attention(qp, kp, vp, *args, **kwargs):
        return CoarseAttention.apply(qp, kp, vp)

    # the op's own name and the coarse module's (the torch stage's `select_and_attend`)
    core_ops.coarse_attention = core_coarse.coarse_attention = attention


def launch_timeline(mode: str, calls: int = 300, warmup: int = 50) -> list[tuple[str, float]]:
    """(launch, median microseconds from the call's start to its issue) in issue order, and
    the call's return as ``"returned"``, for the stubbed op (`op_host_cpu`'s latent, gate and
    fa4 backend; ``mode`` "fwd": inference, "train": forward and backward)."""
    from vsa_core import VideoTiling, video_sparse_attn

    stub_devices()
    marks: list[tuple[str, float]] = []
    start = [0.0]
    _hooks(marks, start)
    tiling = VideoTiling((9, 18, 18), (4, 4, 4))
    train = mode == "train"
    q, k, v, gate = (
        torch.randn(1, tiling.padded_len, 2, 128, dtype=torch.bfloat16, requires_grad=train)
        for _ in range(4)
    )
    dout = torch.randn_like(q)
    runs = []
    for i in range(warmup + calls):
        marks.clear()
        start[0] = time.perf_counter()
        out = video_sparse_attn(q, k, v, tiling=tiling, topk=4, coarse_gate=gate,
                                backend="fa4", coarse_backend="triton")  # fmt: skip
        if train:
            torch.autograd.grad(out, (q, k, v, gate), dout)
        marks.append(("returned", time.perf_counter() - start[0]))
        if i >= warmup:
            runs.append(list(marks))
    names = [name for name, _ in runs[0]]
    if any([name for name, _ in run] != names for run in runs):
        raise RuntimeError("the launches' order changed between calls")
    return [(n, statistics.median(run[j][1] for run in runs) * 1e6) for j, n in enumerate(names)]


def simulate(
    timeline: list[tuple[str, float]],
    device_us: dict[str, float],
    slowdown: float,
    latency_us: float = 5.0,
) -> dict:
    """The modelled call (module doc): its length, the device's own time, and each idle
    stretch of the device (before the first kernel too) as (the launch it waited for, us)."""
    end, busy, idle = 0.0, 0.0, []
    for name, issued in timeline:
        if name not in device_us:
            continue
        start = max(issued * slowdown + latency_us, end)
        if start > end:
            idle.append((name, start - end))
        end = start + device_us[name]
        busy += device_us[name]
    return {"call_us": end, "device_us": busy, "idle": idle}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("fwd", "train"), nargs="?", default="train")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--slowdowns", type=float, nargs="+", default=[1, 4, 7, 10])
    args = ap.parse_args(argv)
    timeline = launch_timeline(args.mode, args.calls)
    print(f"{args.mode}: launches issued, us from the call's start on this CPU")
    for name, issued in timeline:
        print(f"  {name:20s} {issued:8.1f}")
    device = DEVICE_US_WAN480P_H100[args.mode]
    for slowdown in args.slowdowns:
        model = simulate(timeline, device, slowdown)
        waits = ", ".join(f"{n} {us:.0f}" for n, us in model["idle"] if us >= 1)
        print(f"slowdown {slowdown:>4g}: call {model['call_us']:7.0f} us, device "
              f"{model['device_us']:7.0f} us, once / back to back "
              f"{model['call_us'] / model['device_us']:.3f}; waits (us): {waits}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

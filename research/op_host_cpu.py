"""The whole op's host time on this CPU, inference and training, with every device launch
stubbed: the Python the op runs on the GPU host, profiled where there is no GPU.

`research.op_host_stub` times vsa-core alone (a null backend and stage). This runs the real
Triton coarse stage and the real fa4 backend down to the fork's replayed launches on CPU
tensors: the Triton launches (`vsa_triton.launch_cache.launch`, vsa-fa4's list kernels' too)
do nothing, except that the selection writes valid ascending lists; upstream's
``_flash_attn_fwd`` / ``_flash_attn_bwd`` are stand-ins that detach like upstream and return
the outputs, recorded and replayed by CPU `flash_attn_vsa.launch_replay.LaunchReplay`s; fa4's
capability checks pass (sm_90); the coarse attention is one multiply (SDPA's math on a CPU
would dominate). What it misses: the launches' own cost (Triton ~7-60 us, a CuTe kernel's
call ~7-16 us on H200 hosts), CUDA allocation (CPU allocation of these small tensors is
cheap), SDPA's host cost. A small latent with partial tiles (9x18x18, 2 heads). ::

    uv run python -m research.op_host_cpu fwd      # or: train [cProfile sort key]
    uv run python -m research.op_host_cpu train --deterministic   # fa4's dS-writing backward
    uv run python -m research.op_host_cpu block-train   # block_sparse_attn (or: block)

``block`` / ``block-train``: the kernel API alone, `block_sparse_attn` on a 64x64 layout of
random lists (all blocks full, 16 blocks, 4 a row), the issue's "host time over a raw FA4
call" without the launches.
"""

from __future__ import annotations

import argparse
import os

import torch

from research.op_host_stub import time_and_profile


def _upstream_forward(q, k, v, out=None, lse=None, **kwargs):
    """Upstream's forward launcher as the replay sees it: it detaches, returns the outputs."""
    for t in (q, k, v):
        t.detach()
    if out is None:
        out = torch.empty_like(q)
    if lse is None and kwargs.get("return_lse", True):
        lse = q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    return out, lse


def _upstream_backward(q, k, v, out, dout, lse, *args, dq=None, dk=None, dv=None, **kwargs):
    for t in (q, k, v, out, dout):
        t.detach()
    return tuple(torch.empty_like(x) if g is None else g for x, g in ((q, dq), (k, dk), (v, dv)))


def _stub_triton_launch(kernel, grid, *args, **kwargs):
    """vsa-triton's launches do nothing; the selection writes valid ascending lists."""
    if getattr(getattr(kernel, "fn", None), "__name__", "") == "select_topk_kernel":
        out = args[4]
        out.copy_(torch.arange(out.shape[-1], dtype=out.dtype).expand_as(out))


def stub_devices() -> None:
    """Every device launch of the op stubbed as the module doc says (imports come after the
    interpreter flag, which lets vsa-triton's stage take CPU tensors)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import flash_attn.cute.interface as upstream

    import flash_attn_vsa.fwd_sm90 as fwd_sm90
    import flash_attn_vsa.launch_replay as replay
    import vsa_core.ops as core_ops
    import vsa_fa4.backend as fa4_backend
    import vsa_fa4.backward_lists_triton as backward_lists
    import vsa_fa4.dq_from_ds_triton as dq_from_ds
    import vsa_fa4.forward_lists_triton as forward_lists
    import vsa_fa4.metadata as metadata
    import vsa_triton.coarse as coarse
    import vsa_triton.ops as triton_ops

    upstream._get_device_arch = lambda: 90
    for launcher, name in ((_upstream_forward, "_flash_attn_fwd"),
                           (_upstream_backward, "_flash_attn_bwd")):  # fmt: skip
        launcher.compile_cache = {}
        setattr(upstream, name, launcher)
    replay.FORWARDS = replay.LaunchReplay(devices=("cpu",))
    replay.BACKWARDS = replay.LaunchReplay(devices=("cpu",))
    fwd_sm90.check_call = lambda *args, **kwargs: None
    coarse.launch = triton_ops.launch = _stub_triton_launch
    metadata._triton_can_run = lambda t: True  # the list kernels' path, as on a GPU
    backward_lists.launch = forward_lists.launch = dq_from_ds.launch = _stub_triton_launch
    fa4_backend.FA4Backend._backward_deterministic = lambda self, call: True  # sm_90's route
    fa4_backend.FA4Backend._call_refusal = lambda self, call: None
    fa4_backend.plan_refusal = lambda *args, **kwargs: None
    # one autograd node where SDPA's would be, without its CPU math
    core_ops.coarse_attention = lambda qp, kp, vp, valid, scale, may_have_empty=True: qp * 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = ("fwd", "train", "block", "block-train")
    ap.add_argument("mode", choices=modes, nargs="?", default="fwd")
    ap.add_argument("sort", nargs="?", default="tottime", help="cProfile's sort key")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic=True (training: fa4's dS-writing backward)")  # fmt: skip
    args = ap.parse_args()
    stub_devices()
    from flash_attn_vsa import launch_replay

    if args.mode.startswith("block"):
        call = _block_call(args.mode == "block-train")
    else:
        call = _video_call(args.mode == "train", args.deterministic)
    for _ in range(20):
        call()
    per_call_us, profile_text = time_and_profile(call, args.calls, 3, args.sort, 35)
    replays = len(launch_replay.FORWARDS.records()), len(launch_replay.BACKWARDS.records())
    print(f"{args.mode}: {per_call_us:.0f} us a call, launches stubbed (replayed: fwd, bwd "
          f"{replays})")  # fmt: skip
    print(profile_text)


def _block_call(grad: bool):
    from vsa_core import BlockSparseLayout, block_sparse_attn

    blocks, width, heads = 16, 4, 2
    lists = torch.stack([torch.randperm(blocks)[:width] for _ in range(heads * blocks)])
    layout = BlockSparseLayout.from_topk(
        lists.view(1, heads, blocks, width), torch.full((blocks,), 64), (64, 64), all_full=True
    )
    q, k, v = (
        torch.randn(1, blocks * 64, heads, 128, dtype=torch.bfloat16, requires_grad=grad)
        for _ in range(3)
    )
    dout = torch.randn_like(q)

    def call():
        out, _ = block_sparse_attn(q, k, v, layout, backend="fa4")
        if grad:
            torch.autograd.grad(out, (q, k, v), dout)

    return call


def _video_call(grad: bool, deterministic: bool):
    from vsa_core import VideoTiling, video_sparse_attn

    tiling = VideoTiling((9, 18, 18), (4, 4, 4))
    q, k, v, gate = (
        torch.randn(1, tiling.padded_len, 2, 128, dtype=torch.bfloat16, requires_grad=grad)
        for _ in range(4)
    )
    dout = torch.randn_like(q)

    def call():
        out = video_sparse_attn(q, k, v, tiling=tiling, topk=4, coarse_gate=gate,
                                backend="fa4", coarse_backend="triton",
                                deterministic=deterministic)  # fmt: skip
        if grad:
            torch.autograd.grad(out, (q, k, v, gate), dout)

    return call


if __name__ == "__main__":
    main()

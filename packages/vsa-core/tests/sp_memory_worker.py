"""One rank of the sequence-parallel memory check (gloo, CPU); not a pytest module.

Measures with `sp_memory.LiveBytes` (peak bytes of the tensors allocated during a call, the
result held, the inputs not counted) on every rank: `sequence_parallel_video_sparse_attn` on
this rank's shard in inference (``torch.no_grad``) and training (forward and the q, k, v and
gate gradients; with and without ``recompute``), and, for the bounds, `video_sparse_attn` on
the whole inputs and on one step's inputs (the whole sequence, ``--head-chunk`` heads, one
batch row). Prints one line
``rank R: {json}``; test_distributed_memory.py checks the numbers::

    python sp_memory_worker.py --init-file /tmp/s --rank 0 --world-size 2 &
    python sp_memory_worker.py --init-file /tmp/s --rank 1 --world-size 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.distributed as dist
from sp_memory import peak_bytes

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.distributed import sequence_parallel_video_sparse_attn, shard_sequence

TILING = VideoTiling((5, 9, 10))  # 18 tiles of 64 tokens, partial ones included
HEADS, DIM, BATCH, TOPK = 8, 64, 2, 4
DTYPE = torch.float32


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init-file", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--head-chunk", type=int, default=1)
    args = p.parse_args(argv)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        print(f"rank {dist.get_rank()}: {json.dumps(measure(args.head_chunk))}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def measure(head_chunk: int) -> dict[str, object]:
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(5)
    shape = (BATCH, TILING.padded_len, HEADS, DIM)
    full = [torch.randn(shape, generator=gen, dtype=DTYPE) for _ in range(4)]  # q, k, v, gate
    dout = torch.randn(shape, generator=gen, dtype=DTYPE)
    local = [shard_sequence(t, tiling=TILING).clone() for t in full]
    dlocal = shard_sequence(dout, tiling=TILING).clone()
    kwargs = dict(topk=TOPK, tiling=TILING, backend="reference")

    def op(q, k, v, gate, **extra):
        return video_sparse_attn(q, k, v, coarse_gate=gate, **kwargs, **extra)

    def sp(q, k, v, gate, recompute=False):
        return sequence_parallel_video_sparse_attn(
            q, k, v, coarse_gate=gate, head_chunk=head_chunk, recompute=recompute, **kwargs
        )

    def sp_recompute(q, k, v, gate):
        return sp(q, k, v, gate, recompute=True)

    def inference(fn, tensors):
        with torch.no_grad():
            return peak_bytes(lambda: fn(*tensors))

    def training(fn, tensors, grad):
        leaves = [t.detach().requires_grad_() for t in tensors]

        def call():
            out = fn(*leaves)
            return out, torch.autograd.grad(out, leaves, grad)

        return peak_bytes(call)

    step = [t[:1, :, :head_chunk].contiguous() for t in full]  # one step's inputs
    with torch.no_grad():  # the tiling's cached index tensors: made before any measurement
        op(*step)
    sp_inf, _, sp_inf_allocs = inference(sp, local)
    sp_train = training(sp, local, dlocal)[0]
    sp_train_recompute = training(sp_recompute, local, dlocal)[0]
    step_leaves = [t.detach().requires_grad_() for t in step]
    step_kept = peak_bytes(lambda: op(*step_leaves))[1]  # its output and what it saves
    shard_bytes = local[0].numel() * local[0].element_size()
    step_inf = inference(op, step)
    return {
        "world": world,
        "head_chunk": head_chunk,
        "shard_bytes": shard_bytes,  # one of q, k, v, gate, out on this rank
        "step_bytes": step[0].numel() * step[0].element_size(),  # one of them in one step
        "sp_inference": sp_inf,
        "sp_inference_shard_sized": sum(a >= shard_bytes for a in sp_inf_allocs),
        "sp_training": sp_train,
        "sp_training_recompute": sp_train_recompute,
        "op_inference": inference(op, full)[0],
        "op_training": training(op, full, dout)[0],
        "op_step_inference": step_inf[0],
        "op_step_shard_sized": sum(a >= shard_bytes for a in step_inf[2]),
        "op_step_kept": step_kept,
        "op_step_training": training(op, step, dout[:1, :, :head_chunk].contiguous())[0],
    }


if __name__ == "__main__":
    sys.exit(main())

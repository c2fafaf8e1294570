"""One rank of a data-parallel x sequence-parallel mesh (gloo, CPU); not a pytest module.

The composition `vsa_core.distributed` documents: W = dp x sp ranks, rank r in data-parallel
group r // sp (which batch sample it trains on) and sequence-parallel group r % sp (which tile-
aligned slice of that sample's sequence it holds). Every rank runs a tiny attention block
(QKV projection, `sequence_parallel_video_sparse_attn` over its sequence-parallel group, output
projection) on its shard, backpropagates, and all-reduces the projection weights' gradients over
*all* ranks, as DDP or FSDP over the whole world would (each sequence shard contributes a
partial sum). The summed gradients and every rank's output shard must equal a single process
running `video_sparse_attn` on the whole batch (float64, to 1e-10). Prints ``rank R: OK``::

    for r in 0 1 2 3; do python sp_dp_worker.py --init-file /tmp/s --rank $r --sp 2 & done
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.distributed import sequence_parallel_video_sparse_attn, shard_sequence

TILING = VideoTiling((5, 9, 16), (2, 3, 4))  # 3 x 3 x 4 = 36 tiles, the last 12 partial
HEADS, DIM, CHANNELS, TOPK = 4, 8, 16, 5


def block(x, weights, attend):
    """QKV projection -> attention (``attend``) -> output projection, on [B, S, C]."""
    w_qkv, w_out = weights
    batch, seq, _ = x.shape
    q, k, v = (x @ w_qkv).view(batch, seq, 3, HEADS, DIM).unbind(2)
    return attend(q, k, v).reshape(batch, seq, HEADS * DIM) @ w_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init-file", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sp", type=int, default=2, help="ranks per sequence-parallel group")
    args = p.parse_args(argv)
    world, sp = args.world_size, args.sp
    dp = world // sp
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init_file}", rank=args.rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    rank = dist.get_rank()
    # every rank creates every group, in the same order (new_group is collective)
    sp_groups = [dist.new_group([d * sp + s for s in range(sp)]) for d in range(dp)]
    dist.barrier()
    sp_group, sample = sp_groups[rank // sp], rank // sp
    print(f"rank {rank}: gloo, world {world}, data-parallel {dp} x sequence-parallel {sp}")

    gen = torch.Generator().manual_seed(0)
    raster = torch.randn(dp, TILING.seq_len, CHANNELS, generator=gen, dtype=torch.float64)
    x = TILING.to_tiles(raster.unsqueeze(2)).squeeze(2)  # [dp, padded_len, C], zero padding
    init = [
        torch.randn(CHANNELS, 3 * HEADS * DIM, generator=gen, dtype=torch.float64) * 0.3,
        torch.randn(HEADS * DIM, CHANNELS, generator=gen, dtype=torch.float64) * 0.3,
    ]
    real = TILING.indices().real_slots.view(1, -1, 1).to(torch.float64)

    # the single-process reference: the whole batch, the whole sequence
    ref_w = [w.clone().requires_grad_() for w in init]
    ref_out = block(x, ref_w, lambda q, k, v: video_sparse_attn(q, k, v, topk=TOPK, tiling=TILING))
    (ref_out.square() * real).sum().backward()

    # this rank: its sample, its sequence slice; gradients summed over every rank
    weights = [w.clone().requires_grad_() for w in init]
    x_shard = shard_sequence(x[sample : sample + 1], sp_group, tiling=TILING)
    real_shard = shard_sequence(real, sp_group, tiling=TILING)

    def attend(q, k, v):
        return sequence_parallel_video_sparse_attn(
            q, k, v, topk=TOPK, tiling=TILING, group=sp_group
        )

    out = block(x_shard, weights, attend)
    (out.square() * real_shard).sum().backward()
    for w in weights:
        dist.all_reduce(w.grad)

    failures = []
    want_out = shard_sequence(ref_out[sample : sample + 1].detach(), sp_group, tiling=TILING)
    if not torch.allclose(out.detach() * real_shard, want_out * real_shard, rtol=0, atol=1e-10):
        failures.append("output shard")
    for name, got, want in zip(("w_qkv", "w_out"), weights, ref_w, strict=True):
        if not torch.allclose(got.grad, want.grad, rtol=1e-9, atol=1e-10):
            err = (got.grad - want.grad).abs().max().item()
            failures.append(f"{name} gradient (max abs err {err:.2e})")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: " + ("OK" if not failures else "FAIL " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

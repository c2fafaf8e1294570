"""Whether the fa4 path's FA4 launches replay in the whole op, per latent, and the op's host time
right after a synchronize (session 16 probe: at Wan 720p the forward's host time was twice
480p's, and a failed recording would run upstream's Python launcher on every call). ::

    python3 -m research.op_replay_probe   # on the GPU host, after .gpu/b/env.sh
"""

from __future__ import annotations

import time
from functools import partial

import torch

from vsa_core import VideoTiling, video_sparse_attn

LATENTS = [((21, 30, 52), 12), ((21, 45, 80), 40)]


def main() -> None:
    from flash_attn_vsa import launch_replay

    for latent, heads in LATENTS:
        tiling = VideoTiling(latent, (4, 4, 4))
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (1, tiling.padded_len, heads, 128)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)
        )
        gate = torch.rand(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        call = partial(video_sparse_attn, tiling=tiling, topk=round(0.125 * tiling.num_tiles),
                       backend="fa4", coarse_gate=gate, validate=False)  # fmt: skip
        for _ in range(4):
            call(q, k, v)
        torch.cuda.synchronize()
        host = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call(q, k, v)
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        states = {
            name: [type(r).__name__ if not isinstance(r, int) else r
                   for r in getattr(launch_replay, name)._records.values()]
            for name in ("FORWARDS", "BACKWARDS")
        }  # fmt: skip
        print(latent, heads, "host ms", round(sorted(host)[5], 3), states, flush=True)


if __name__ == "__main__":
    main()

"""The whole op with the coarse attention on each SDPA backend choice, interleaved (research,
GPU): does the backend the micro-benchmark (`coarse_sdpa_backends`) finds cheapest on the host
shorten the op's host time and its one-call latency?

Arms (the op's code unchanged; this process only replaces ``vsa_core.coarse``'s SDPA call):
``shipped`` (what the op calls now), ``default`` (PyTorch's own choice: cuDNN on sm_90 with
torch 2.11), ``flash_first`` (all backends, flash first) and ``aten_flash`` (ATen's flash op
called directly). Per (shape, mode) each round runs every arm through
`bench_timing.call_views` (host, once, back to back), rounds interleaved, medians. ::

    python3 -m research.coarse_stage.op_sdpa_ab --shapes wan480p --backends fa4 --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import types

import torch
import torch.nn.functional as F

from research.coarse_stage.coarse_sdpa_backends import BACKENDS
from research.harness import benchmark_module

ARMS = ("shipped", "default", "flash_first", "aten_flash")
SHAPES = {"wan480p": ((21, 30, 52), 12), "wan720p": ((21, 45, 80), 40)}


def _functional_with(backend_name: str):
    """A stand-in for ``torch.nn.functional`` whose SDPA runs on the named arm's backend."""
    from research.coarse_stage.coarse_sdpa_backends import _call

    backend = BACKENDS[backend_name]

    def sdpa(q, k, v, attn_mask=None, scale=None, **kwargs):
        if attn_mask is not None or kwargs:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                                  **kwargs)  # fmt: skip
        return _call(q, k, v, backend)

    return types.SimpleNamespace(scaled_dot_product_attention=sdpa)


def main(argv=None) -> int:
    import vsa_core.coarse as coarse_module
    from vsa_core import VideoTiling, video_sparse_attn

    bt = benchmark_module("bench_timing")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["wan480p"], choices=list(SHAPES))
    parser.add_argument("--backends", nargs="+", default=["fa4"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shipped = coarse_module.F
    stand_ins = {"shipped": shipped, **{a: _functional_with(a) for a in ARMS[1:]}}
    rows = []
    for shape in args.shapes:
        latent, heads = SHAPES[shape]
        tiling = VideoTiling(latent)
        topk = max(1, round(0.125 * tiling.num_tiles))
        gen = torch.Generator(device="cuda").manual_seed(0)
        dims = (1, tiling.padded_len, heads, 128)
        for mode in args.modes:
            grad = mode != "fwd"
            q, k, v, gate = (
                torch.randn(dims, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(4)
            )
            q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
            for backend in args.backends:

                def call(backend=backend, grad=grad, x=(q, k, v, gate), tiling=tiling, topk=topk):
                    out = video_sparse_attn(*x[:3], tiling=tiling, topk=topk, coarse_gate=x[3],
                                            backend=backend)  # fmt: skip
                    if grad:
                        out.backward(out)
                    return out

                views = {arm: [] for arm in ARMS}
                with torch.enable_grad() if grad else torch.no_grad():
                    for _ in range(args.rounds):
                        for arm in ARMS:
                            coarse_module.F = stand_ins[arm]
                            try:
                                views[arm].append(bt.call_views(call, 5, b2b_calls=5))
                            finally:
                                coarse_module.F = shipped
                for arm in ARMS:
                    row = {"shape": shape, "mode": mode, "backend": backend, "arm": arm}
                    for key in views[arm][0]:
                        row[key] = statistics.median(v[key] for v in views[arm])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

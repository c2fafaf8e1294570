"""The whole op's own host cost on a CPU: `video_sparse_attn` with every kernel stubbed out.

A fine backend and a coarse stage that only allocate their outputs (``torch.empty``) are
registered, and the coarse attention is replaced by an identity, so what is timed is vsa-core's
Python per call (argument checks, cached decisions, tiling indices, layout construction,
allocations): the floor under any backend's host time, which adds its kernel launches. Wan 2.1
480p shapes (12 heads, bf16), tile order, a per-token gate, inference. ::

    uv run python -m research.op_host_stub --out DIR/op_host_stub.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time

import torch

import vsa_core.ops as ops
from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.backends import Backend, register_backend
from vsa_core.coarse import CoarseStage, coarse_stages


class NullBackend(Backend):
    name = "null"
    priority = -5
    key_padding_safe = True
    fuses_combine = True

    def supports(self, call):
        return None

    def forward_combined(self, q, k, v, layout, scale, coarse, gate, slot_rows=None):
        return torch.empty_like(q)


class NullStage(CoarseStage):
    name = "null"
    priority = -5

    def supports(self, device_type, dtype, head_dim):
        return None

    def pool(self, q, k, v, valid_sizes):
        batch, _, heads, dim = q.shape
        return tuple(q.new_empty((batch, valid_sizes.shape[0], heads, dim)) for _ in range(3))

    def pool_and_clean(self, q, k, v, valid_sizes, clean, padding_index=None):
        return (*self.pool(q, k, v, valid_sizes), q, k, v)

    def select(self, q_pooled, k_pooled, valid_sizes, topk):
        batch, tiles, heads, _ = q_pooled.shape
        return torch.empty(batch, heads, tiles, topk, dtype=torch.int32)

    def select_and_attend(self, q_pooled, k_pooled, v_pooled, valid_sizes, topk, scale,
                          kv_tile=None, *, may_have_empty=True):  # fmt: skip
        # the op's inference path since session 21: no coarse attention's math on the CPU
        return q_pooled, self.select(q_pooled, k_pooled, valid_sizes, topk), None


def time_and_profile(call, calls: int, repeats: int = 1, sort: str = "tottime",
                     top: int = 12) -> tuple[float, str]:  # fmt: skip
    """Microseconds a call of ``call()`` (the best of ``repeats`` loops of ``calls``), then a
    cProfile of 200 more calls: ``top`` lines sorted by ``sort`` (`research.op_host_cpu`
    times the same way)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        call()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(sort).print_stats(top)
    return best, text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out")
    args = ap.parse_args()
    register_backend(NullBackend())
    coarse_stages()["null"] = NullStage()
    ops.coarse_attention = lambda q_pooled, *rest, **kw: q_pooled
    tiling = VideoTiling((21, 30, 52))
    q = torch.empty(1, tiling.padded_len, 12, 128, dtype=torch.bfloat16)
    gate = torch.empty_like(q)

    def call():
        return video_sparse_attn(q, q, q, tiling=tiling, topk=78, coarse_gate=gate,
                                 backend="null", coarse_backend="null")  # fmt: skip

    for _ in range(50):
        call()
    per_call_us, profile_text = time_and_profile(call, args.calls)
    print(f"{per_call_us:.1f} us per call")
    print(profile_text)
    if args.out:
        result = {
            "command": "python -m research.op_host_stub",
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "per_call_us": per_call_us,
            "profile_top": profile_text.splitlines()[:40],
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Experiment 4: 64-token key blocks, deeper pipelines and larger tiles (forward and backward).

Counted on the CPU first (sm_90a, shared storage struct sizes from upstream's classes,
cuobjdump for registers; 2026-11-29, session 4):

- Forward, Q128/KV64: upstream runs 128x64 tiles, two MMA warpgroups, **two** key/value
  stages (fixed in its interface), one CTA per SM; 99 KB of shared memory at 2 stages, 165 KB
  at 4, 198 KB at 5. A 64-key step is half the MMA work of dense's 128-key steps, so a
  gathered key block has half the time to arrive: deeper pipelines may help.
  Arms ``fwd128_stages{2,3,4,5}``.
- Forward, Q64/KV64 at two CTAs per SM (the fork's delta 2): 82,944 B dynamic at 2 stages,
  115,712 B at 3. cuobjdump reports 1 KB of static shared memory; if that is the 1 KB the
  hardware reserves per CTA, two 3-stage CTAs fit 228 KB exactly. Arms ``fwd64_two_cta_s{2,3}``.
- Backward, Q64/KV64 at two CTAs per SM: one stage of Q, dO and P/dS is 115,712 B dynamic,
  the same question; 128 registers at launch with 232/24, no stack. Arm ``bwd64_two_cta_s111``
  against the shipped ``bwd64_shipped`` (one CTA, 2/2/2 stages).
- Backward, Q128/KV64 with 128x64 tiles and **two** MMA warpgroups, each owning 64 query rows
  for S, dP and dQ (full 64x64x128 wgmmas) and half the head dim for dK, dV: twice the MMA
  work per pipeline step and a second warpgroup to overlap with (upstream's 2-warpgroup
  register split, 240/240/24, no stack). Stages Q1/dO1/PdS1 198,656 B, Q2/dO1/PdS1 231,424 B
  (+1 KB: the 227 KB limit exactly). Arms ``bwd128_s111``, ``bwd128_s211`` against the shipped
  path of the time, which ran each 128-row query block as two 64-row ones (``bwd128_split64``,
  called ``bwd128_shipped`` in the first run's records; ``bwd128_s211`` is shipped since).
- Backward, Q64/KV64, deeper Q/dO pipelines on the shipped tile (fewer stages always lost in
  experiment 2): ``bwd64_s331``, ``bwd64_s333``, ``bwd64_s441`` (added after the first run).

Correctness first (S=2048, H=4, random lists with an empty query block and key blocks nobody
selects, NaN-poisoned outputs, float32 reference; rel. L2 <= 1e-2), then timing at S=32768,
H=12, D=128 on an exact256 90% mask refined to each block shape, each group's arms interleaved
call by call with dense FA4, twice. ::

    python3 -m research.fa4_fork.experiments.kv64_tiles_and_stages --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .kv64_bwd_configs import (
    bench_common,
    emit_interleaved_times,
    exact256_layout,
    fa4_tensors,
    random_layout,
    reference,
    rel_l2,
    start_log,
)

bc = bench_common()


@dataclass(frozen=True)
class Arm:
    q_block: int  # query rows per sparse block (key blocks are 64 tokens)
    mode: str  # "fwd" or "bwd"
    stages: tuple[int, ...] = ()  # fwd: key/value stages; bwd: Q, dO, P/dS stages
    two_ctas: bool = False  # launched for two CTAs per SM
    tile_m: int = 64  # bwd: query rows per tile (128: two MMA warpgroups)
    lists_q: int = 0  # bwd: query rows per block in the lists (0: q_block)


ARMS = {
    "fwd128_stages2": Arm(128, "fwd", (2,)),
    "fwd128_stages3": Arm(128, "fwd", (3,)),
    "fwd128_stages4": Arm(128, "fwd", (4,)),
    "fwd128_stages5": Arm(128, "fwd", (5,)),
    "fwd64_two_cta_s2": Arm(64, "fwd", (2,), two_ctas=True),
    "fwd64_two_cta_s3": Arm(64, "fwd", (3,), two_ctas=True),
    "bwd64_shipped": Arm(64, "bwd", (2, 2, 2)),
    "bwd64_two_cta_s111": Arm(64, "bwd", (1, 1, 1), two_ctas=True),
    # deeper Q/dO pipelines for the shipped 64x64 tile (added after the first sitting; not yet
    # run): 182,272 / 215,040 / 216,064 B, 240 registers, no stack on sm_90a
    "bwd64_s331": Arm(64, "bwd", (3, 3, 1)),
    "bwd64_s333": Arm(64, "bwd", (3, 3, 3)),
    "bwd64_s441": Arm(64, "bwd", (4, 4, 1)),
    "bwd128_split64": Arm(128, "bwd", (2, 2, 2), lists_q=64),
    "bwd128_s111": Arm(128, "bwd", (1, 1, 1), tile_m=128),
    "bwd128_s211": Arm(128, "bwd", (2, 1, 1), tile_m=128),
}


def forward_class(arm: Arm):
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    from flash_attn_vsa import fwd_sm90

    base = fwd_sm90.kernel_class() if arm.two_ctas else FlashAttentionForwardSm90

    class StagedForward(base):
        def __init__(self, *args, **kwargs):
            kwargs["num_stages"] = arm.stages[0]
            super().__init__(*args, **kwargs)

    return StagedForward


def two_cta_backward_class():
    """The fork's KV64 backward class launched for two CTAs per SM, registers 232/24."""
    from flash_attn_vsa import bwd_sm90, fwd_sm90
    from flash_attn_vsa.sm90_blocks import BoundLauncher

    base = bwd_sm90.kernel_class()

    class TwoCtaBackward(base):
        def _setup_attributes(self):
            super()._setup_attributes()
            self.num_mma_regs_wg0 = self.num_mma_regs_wg1 = self.num_mma_regs = 232
            self.num_producer_regs = 24

        def kernel(self, *args, **kwargs):
            return BoundLauncher(base.kernel(self, *args, **kwargs), fwd_sm90.CTAS_PER_SM)

    return TwoCtaBackward


_CACHES: dict[str, dict] = {}


@contextmanager
def scope(name: str):
    """Upstream's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` build this arm's kernel (forward:
    its own compile cache, since upstream's key does not include the kernel class)."""
    import flash_attn.cute.interface as itf

    from flash_attn_vsa import bwd_sm90

    arm = ARMS[name]
    if arm.mode == "fwd":
        saved = itf.FlashAttentionForwardSm90, itf._flash_attn_fwd.compile_cache
        itf.FlashAttentionForwardSm90 = forward_class(arm)
        itf._flash_attn_fwd.compile_cache = _CACHES.setdefault(name, {})
        try:
            yield
        finally:
            itf.FlashAttentionForwardSm90, itf._flash_attn_fwd.compile_cache = saved
        return
    q, do, pds = arm.stages
    two_wg = arm.tile_m == 128
    cfg = bwd_sm90.TileConfig(
        m_block_size=arm.tile_m, n_block_size=64, num_stages_Q=q, num_stages_dO=do,
        num_stages_PdS=pds, AtomLayoutMSdP=2 if two_wg else 1, AtomLayoutNdKV=1,
        AtomLayoutMdQ=2 if two_wg else 1, num_wg=2 if two_wg else 1,
    )  # fmt: skip
    # This experiment's own arms (not the fork's configurations): upstream's backward builds
    # them through its module globals, swapped here for the call as for the forward arms.
    saved_bwd = itf._tile_size_bwd_sm90, itf.FlashAttentionBackwardSm90
    saved_cache = itf._flash_attn_bwd.compile_cache
    upstream_cfg = cfg.upstream()
    itf._tile_size_bwd_sm90 = lambda *args, **kwargs: upstream_cfg
    built = two_cta_backward_class() if arm.two_ctas else cfg.kernel_class()
    itf.FlashAttentionBackwardSm90 = built
    itf._flash_attn_bwd.compile_cache = _CACHES.setdefault(name, {})
    try:
        yield
    finally:
        itf._tile_size_bwd_sm90, itf.FlashAttentionBackwardSm90 = saved_bwd
        itf._flash_attn_bwd.compile_cache = saved_cache


def tensors_for(name: str, layout):
    arm = ARMS[name]
    if arm.mode == "fwd":
        return fa4_tensors(layout, False)
    lists_q = arm.lists_q or arm.q_block
    return fa4_tensors(layout.refine((lists_q, 64)) if lists_q != arm.q_block else layout, True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    emit = start_log(args.out, "kv64_tiles_and_stages")
    torch.manual_seed(0)
    dim, scale = 128, 128**-0.5

    def run(name, q, k, v, tensors, out=None, lse=None, dout=None, grads=(None,) * 3):
        with scope(name):
            if ARMS[name].mode == "fwd":
                return _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=tensors,
                                       return_lse=True, out=out, lse=lse)  # fmt: skip
            return _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale,
                                   block_sparse_tensors=tensors, dq=grads[0], dk=grads[1],
                                   dv=grads[2])  # fmt: skip

    # ---- correctness (forward arms first: the backward ones use a correct forward's output)
    seq, heads = 2048, 4
    q, k, v, dout = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    good = []
    for q_block in (128, 64):
        lay = random_layout(seq, heads, (q_block, 64), 0.3, seed=1)
        ref_out, ref_grads = reference(q, k, v, dout, lay, scale)
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale,
                                   block_sparse_tensors=fa4_tensors(lay, False),
                                   return_lse=True)[:2]  # fmt: skip
        for name in [n for n in args.arms if ARMS[n].q_block == q_block]:
            tensors = tensors_for(name, lay)
            try:
                if ARMS[name].mode == "fwd":
                    o = torch.full_like(q, float("nan"))
                    s = torch.full((1, heads, seq), float("nan"), device="cuda")
                    run(name, q, k, v, tensors, out=o, lse=s)
                    got, want = [o], [ref_out]
                else:
                    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                    run(name, q, k, v, tensors, out=out, lse=lse, dout=dout, grads=grads)
                    got, want = grads, ref_grads
                torch.cuda.synchronize()
                errs = [rel_l2(a, b) for a, b in zip(got, want, strict=True)]
                finite = all(bool(t.isfinite().all()) for t in got)
                emit({"case": "correct", "arm": name, "rel_l2": errs, "finite": finite})
                if finite and max(errs) <= 1e-2:
                    good.append(name)
            except Exception as exc:
                emit({"case": "correct", "arm": name, "error": bc.error_text(exc, 600)})

    # ---- timing: per (query block, mode) group, the group's arms interleaved with dense
    seq, heads = args.seq, args.heads
    q, k, v, dout = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    base = exact256_layout(seq, heads, 0.9, seed=2)
    dense_out, dense_lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]
    dense = {
        "fwd": lambda _: _flash_attn_fwd(q, k, v, softmax_scale=scale),
        "bwd": lambda _: _flash_attn_bwd(q, k, v, dense_out, dout, dense_lse, softmax_scale=scale),
    }
    for q_block in (128, 64):
        lay = base.refine((q_block, 64)).to("cuda")
        pairs = float(lay.selected_token_pairs().sum()) / heads
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale,
                                   block_sparse_tensors=fa4_tensors(lay, False),
                                   return_lse=True)[:2]  # fmt: skip
        for mode, factor in (("fwd", 1.0), ("bwd", 2.5)):
            names = [n for n in good if ARMS[n].q_block == q_block and ARMS[n].mode == mode]
            if not names:
                continue
            arms = {"dense": (dense[mode], None)}
            for name in names:
                tensors = tensors_for(name, lay)
                extra = {} if mode == "fwd" else {"out": out, "lse": lse, "dout": dout}
                arms[name] = (lambda _, n=name, t=tensors, x=extra: run(n, q, k, v, t, **x), None)
            emit_interleaved_times(emit, arms, rounds=2, reps=args.reps, pairs=pairs,
                                   shape=(seq, heads, dim), factor=factor, q_block=q_block,
                                   mode=mode)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

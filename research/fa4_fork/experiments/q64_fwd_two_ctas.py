"""Experiment: upstream's sm_90 Q64/KV64 block-sparse forward with two CTAs per SM.

With 64-row query blocks upstream's sm_90 forward runs one MMA warpgroup per CTA (plus the
producer warpgroup) and launches with ``min_blocks_per_mp=1``, giving the MMA warpgroup 256
registers and the producer 56: one CTA fills the register file, so each SM runs a single
MMA warpgroup and nothing overlaps its softmax with another warpgroup's MMAs (dense FA4 runs
two MMA warpgroups per CTA). Two CTAs per SM would run two independent 64-row query blocks,
each walking its own key list: the "two query streams per SM" schedule without a new kernel.

Checked on the CPU first (sm_90a cubins, cuobjdump, 2026-11-29): with the launcher asked for
``min_blocks_per_mp=2`` and ``setmaxnreg`` 232 (MMA) / 24 (producer), the kernel compiles to
128 registers at launch, no stack; shared memory at 2 stages is about 81 KB per CTA (two fit
in 228 KB; 3 stages would not).

Arms (raw FA4 calls with prebuilt index tensors, no mask_mod, outputs NaN-poisoned for the
correctness check): ``upstream`` (as shipped), ``two_cta_232`` and ``two_cta_224`` (two CTAs
per SM, MMA/producer registers 232/24 and 224/32), upstream's paired Q128/KV64 tiles and dense
FA4 for scale. Correctness on S=2048, H=4 (random 30% lists, an empty query block, unselected
key blocks) against a float32 reference; timing at S=32768, H=12, D=128 on an exact256 90%
mask refined to 64x64 and on a native random 64-granular mask (~10% kept, every query block
its own list), arms interleaved call by call. ::

    python3 -m research.fa4_fork.experiments.q64_fwd_two_ctas --out DIR
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from .kv64_bwd_configs import (
    check_forward,
    emit_interleaved_times,
    exact256_layout,
    fa4_tensors,
    one_length_args,
    random_layout,
    reference,
    start_log,
)

VARIANTS = {"upstream": None, "two_cta_232": 232, "two_cta_224": 224}


def two_cta_class(mma_regs: int):
    """Upstream's forward kernel class, launched for two CTAs per SM with ``mma_regs`` for the
    MMA warpgroup and the rest of 256 for the producer."""
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    class Launch:
        def __init__(self, inner):
            self._inner = inner

        def launch(self, *args, **kwargs):
            kwargs["min_blocks_per_mp"] = 2
            kwargs.setdefault("preferred_smem_carveout", 100)
            return self._inner.launch(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    class TwoCtasPerSm(FlashAttentionForwardSm90):
        def _setup_attributes(self):
            assert self.num_wg_mma == 1, "two CTAs per SM only fit with one MMA warpgroup"
            self.num_mma_regs, self.num_producer_regs = mma_regs, 256 - mma_regs
            super()._setup_attributes()

        def kernel(self, *args, **kwargs):
            return Launch(FlashAttentionForwardSm90.kernel(self, *args, **kwargs))

    return TwoCtasPerSm


_CACHES: dict[str, dict] = {}


@contextmanager
def variant(name: str):
    """Run ``_flash_attn_fwd`` with this variant's kernel class and its own compile cache
    (upstream's cache key does not include the class)."""
    import flash_attn.cute.interface as itf

    if VARIANTS[name] is None:
        yield
        return
    saved = itf.FlashAttentionForwardSm90, itf._flash_attn_fwd.compile_cache
    itf.FlashAttentionForwardSm90 = two_cta_class(VARIANTS[name])
    itf._flash_attn_fwd.compile_cache = _CACHES.setdefault(name, {})
    try:
        yield
    finally:
        itf.FlashAttentionForwardSm90, itf._flash_attn_fwd.compile_cache = saved


def main() -> int:
    args = one_length_args()
    from flash_attn.cute.interface import _flash_attn_fwd, flash_attn_func

    emit = start_log(args.out, "q64_fwd_two_ctas")
    torch.manual_seed(0)
    dim, scale = 128, 128**-0.5
    # ---- correctness: S=2048, H=4, native 64x64 lists, empty rows and columns
    seq, heads = 2048, 4
    q, k, v, dout = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    lay = random_layout(seq, heads, (64, 64), 0.3, seed=1)
    ref_out, _ = reference(q, k, v, dout, lay, scale)
    tensors = fa4_tensors(lay, False)
    good = []
    for name in VARIANTS:

        def run(out, lse, name=name):
            with variant(name):
                _flash_attn_fwd(
                    q, k, v, softmax_scale=scale, block_sparse_tensors=tensors,
                    return_lse=True, out=out, lse=lse,
                )  # fmt: skip

        if check_forward(emit, {"variant": name}, q, ref_out, run):
            good.append(name)
    # ---- timing
    seq, heads = args.seq, args.heads
    q, k, v = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    masks = {
        "exact256_90": exact256_layout(seq, heads, 0.9, seed=2).refine((64, 64)).to("cuda"),
        "native_10pct": random_layout(seq, heads, (64, 64), 0.1, seed=3, empty_kv=()),
    }
    for mask_name, lay in masks.items():
        pairs = float(lay.selected_token_pairs().sum()) / heads
        t64 = fa4_tensors(lay, False)
        arms = {"dense": (lambda _: flash_attn_func(q, k, v, softmax_scale=scale), None)}
        for name in good:
            arms[name] = (
                lambda _, t=t64, name=name: _run(_flash_attn_fwd, q, k, v, scale, t, name),
                None,
            )
        if lay.q_group_size % 2 == 0:  # upstream's paired 128x64 tiles for reference
            paired = fa4_tensors(
                type(lay)(
                    lay.kv_indices[:, :, ::2].contiguous(),
                    lay.kv_counts[:, :, ::2].contiguous(),
                    lay.kv_valid_sizes,
                    (128, 64),
                ),
                False,
            )
            arms["upstream_paired_q128"] = (
                lambda _, t=paired: _run(_flash_attn_fwd, q, k, v, scale, t, "upstream"),
                None,
            )
        emit_interleaved_times(emit, arms, rounds=1, reps=args.reps, pairs=pairs,
                               shape=(seq, heads, dim), mask=mask_name)  # fmt: skip
    return 0


def _run(fwd, q, k, v, scale, tensors, name):
    with variant(name):
        return fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=tensors, return_lse=True)


if __name__ == "__main__":
    sys.exit(main())

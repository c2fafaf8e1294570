"""Experiment 5 (prepared in session 4, not yet run on a GPU): key pairing in the forward.

Each 128-row key/value stage of upstream's sm_90 forward is filled with **two** selected
64-token key blocks, so the MMA warpgroups run the 128x128 tile of dense (QK^T at N = 128)
whatever the 64-token list is. Only the producer changes: our own `load` (upstream's reads one
list entry per stage) issues, per stage and per tensor (K, V), four TMA copies of 64 rows x
64 columns (two key blocks x two 64-column halves of head dim 128), into the four dense 8 KB
sub-tiles of the stage's swizzled layout (rows are the outer mode of upstream's stage layout,
so a 64-row half is two 8 KB pieces 16 KB apart). The barrier still expects the stage's bytes.

Interfaces to upstream's consumer, unchanged:
- FA4's block-sparse tensors describe 128-token key tiles: ``full_block_cnt`` = pairs per query
  block, ``full_block_idx`` = pair ordinals 0..n-1 (a valid 128-row tile index, which the
  consumer's key-length mask sees for the first block: it never masks when the count is even),
  ``mask_block_cnt`` = 0, and ``mask_block_idx`` carries each pair's two 64-token block ids
  packed as ``a | b << 16`` (the consumer never reads a list whose count is 0).
- The K/V TMA atoms are built inside upstream's ``__call__`` with the whole key tile as box;
  inside `paired_scope` the ``cpasync`` module upstream's forward sees is a proxy that builds
  the K/V atoms with a 64x64 box instead (told apart by their multicast argument).

Limits of this first version: even counts (top-k layouts with even k), no partial key blocks
(no mask_mod), head dim 128, no GQA. CPU: ``--compile-only`` compiles it for sm_90a on fake
tensors (Q128 and Q64 tiles). GPU: correctness against a float32 reference, then timing
against upstream's Q128/KV64 tiles and dense FA4. ::

    python3 packages/flash-attn-4-vsa/experiments/paired_kv_fwd.py --compile-only  # CPU
    python3 packages/flash-attn-4-vsa/experiments/paired_kv_fwd.py --out DIR       # H200
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv64_bwd_configs import (
    check_forward,
    emit_interleaved_times,
    exact256_layout,
    fa4_tensors,
    random_layout,
    reference,
    start_log,
)

PAIR = 2
KEY_BLOCK = 64


def even_random_layout(seq, heads, q_block, keep, seed):
    """Random 64-token key lists (arbitrary, non-adjacent blocks in any order) with an even
    count per query block: a row with an odd count drops its first selected block."""
    from vsa_core import BlockSparseLayout

    lay = random_layout(seq, heads, (q_block, KEY_BLOCK), keep, seed, empty_kv=()).to("cpu")
    mask = lay.to_block_mask()
    odd = mask.sum(-1) % PAIR == 1
    first = mask.int().argmax(-1, keepdim=True)
    mask.scatter_(-1, first, mask.gather(-1, first) & ~odd.unsqueeze(-1))
    return BlockSparseLayout.from_block_mask(mask, lay.kv_valid_sizes, lay.block_shape)


def pair_tensors(layout, device=None):
    """FA4 block-sparse tensors of a 64-token-key layout with even counts, paired: 128-token
    key tiles whose entries are pair ordinals, the two block ids packed in ``mask_block_idx``."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    idx, cnt = layout.kv_indices.to(torch.int32), layout.kv_counts.to(torch.int32)
    if bool((cnt % PAIR).any()):
        raise ValueError("paired forward needs an even number of key blocks per query block")
    if layout.kv_valid_sizes.shape[0] > 1 << 15:  # the second id is read with a signed shift
        raise ValueError("paired forward packs block ids in 16 bits: at most 32768 key blocks")
    seq_k = layout.kv_valid_sizes.shape[0] * KEY_BLOCK
    tiles = -(-seq_k // (PAIR * KEY_BLOCK))
    width = idx.shape[-1] + idx.shape[-1] % PAIR
    idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]))
    packed = idx[..., 0::2] | (idx[..., 1::2] << 16)
    packed = torch.nn.functional.pad(packed, (0, tiles - packed.shape[-1]))
    ordinals = torch.arange(tiles, dtype=torch.int32).expand_as(packed).contiguous()
    device = device or idx.device
    return BlockSparseTensorsTorch(
        mask_block_cnt=torch.zeros_like(cnt).to(device),
        mask_block_idx=packed.contiguous().to(device),
        full_block_cnt=(cnt // PAIR).contiguous().to(device),
        full_block_idx=ordinals.to(device),
        block_size=(layout.block_shape[0], PAIR * KEY_BLOCK),
    )


class _CpasyncProxy:
    """``cutlass.cute.nvgpu.cpasync`` as upstream's forward module sees it inside
    `paired_scope`: K/V TMA atoms (the calls that pass a multicast count) get a 64x64 box."""

    def __init__(self, real):
        self._real = real

    def make_tiled_tma_atom(self, op, gmem, smem_layout, tiler, *rest, **kwargs):
        if not rest:  # Q and O: unchanged
            return self._real.make_tiled_tma_atom(op, gmem, smem_layout, tiler, **kwargs)
        from cutlass.utils import LayoutEnum
        from quack import sm90_utils

        box = (KEY_BLOCK, 64)
        sub = sm90_utils.make_smem_layout(gmem.element_type, LayoutEnum.ROW_MAJOR, box)
        return self._real.make_tiled_tma_atom(op, gmem, sub, box, *rest, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


VARIANTS = {"paired": (False, 2), "paired_two_cta_s1": (True, 1)}
"""name -> (two CTAs per SM, key/value stages). Two CTAs fit only at one stage (a 64-row query
tile: 16 KB of Q plus 64 KB of K and V per stage); only for 64-row query tiles."""


@functools.cache
def paired_class(two_ctas: bool = False, stages: int = 2):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, pipeline
    from flash_attn.cute.block_sparse_utils import produce_block_sparse_loads
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from quack import copy_utils

    from flash_attn_vsa import fwd_sm90

    base = fwd_sm90.kernel_class() if two_ctas else FlashAttentionForwardSm90

    class PairedKeyForward(base):
        """Upstream's sm_90 forward with our producer: two 64-token key blocks per stage."""

        def __init__(self, *args, **kwargs):
            kwargs["num_stages"] = stages
            super().__init__(*args, **kwargs)

        @cute.jit
        def _pair_loader(self, mX, sX, atom, pipe, seqlen, batch_idx, head_idx, pairs):
            """``load(src_idx, producer_state)``: the pair ``pairs[src_idx]`` into one stage."""
            mX_cur = seqlen.offset_batch_K(mX, batch_idx, dim=3)[None, None, head_idx]
            g_tiles = cute.flat_divide(mX_cur, (KEY_BLOCK, 64))  # (64, 64, blocks, halves)
            s_tiles = cute.flat_divide(sX, (KEY_BLOCK, 64))  # (64, 64, 2, halves, stages)
            s, g = cpasync_real().tma_partition(
                atom,
                0,
                cute.make_layout(1),
                cute.group_modes(s_tiles, 0, 2),
                cute.group_modes(g_tiles, 0, 2),
            )
            n_halves = self.tile_hdim // 64

            def load(src_idx, producer_state):
                packed = pairs[src_idx]
                bar = pipe.producer_get_barrier(producer_state)
                for slot in cutlass.range_constexpr(PAIR):
                    block = (packed & 0xFFFF) if slot == 0 else (packed >> 16)
                    for half in cutlass.range_constexpr(n_halves):
                        cute.copy(
                            atom,
                            g[None, block, half],
                            s[None, slot, half, producer_state.index],
                            tma_bar_ptr=bar,
                        )

            return load

        @cute.jit
        def load(
            self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k,
            pipeline_v, pipeline_q, gmem_tiled_copy_Q, mPageTable, blocksparse_tensors,
            block_info, SeqlenInfoCls, TileSchedulerCls,
        ):  # fmt: skip
            warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
            if warp_idx_in_wg == 0:
                q_phase = Int32(1)
                kv_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.num_stages
                )
                scheduler = TileSchedulerCls()
                work_tile = scheduler.initial_work_tile_info()
                while work_tile.is_valid_tile:
                    m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                    seqlen = SeqlenInfoCls(batch_idx)
                    mQ_cur = seqlen.offset_batch_Q(mQ, batch_idx, dim=3)[None, None, head_idx]
                    gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
                    load_Q, _, _ = copy_utils.tma_get_copy_fn(
                        tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True
                    )
                    pipeline_q.producer_acquire_w_index_phase(0, q_phase)
                    load_Q(tma_bar_ptr=pipeline_q.sync_object_full.get_barrier(0))
                    q_phase ^= 1
                    pairs = blocksparse_tensors.mask_block_idx[batch_idx, head_idx, m_block, None]
                    load_K = self._pair_loader(
                        mK, sK, tma_atom_K, pipeline_k, seqlen, batch_idx, head_idx, pairs
                    )
                    load_V = self._pair_loader(
                        mV, sV, tma_atom_V, pipeline_v, seqlen, batch_idx, head_idx, pairs
                    )
                    kv_state = produce_block_sparse_loads(
                        blocksparse_tensors, batch_idx, head_idx, m_block, seqlen, kv_state,
                        load_K, load_V, pipeline_k, pipeline_v, self.intra_wg_overlap,
                    )  # fmt: skip
                    scheduler.prefetch_next_work()
                    scheduler.advance_to_next_work()
                    work_tile = scheduler.get_current_work()
                pipeline_v.producer_tail(kv_state)

    return PairedKeyForward


def cpasync_real():
    from cutlass.cute.nvgpu import cpasync

    return cpasync


_CACHES: dict[str, dict] = {}


@contextmanager
def paired_scope(variant: str = "paired"):
    """Upstream's ``_flash_attn_fwd`` builds `paired_class()` with 64x64 K/V TMA boxes and keeps
    it in a compile cache of its own (not thread-safe: an experiment)."""
    import flash_attn.cute.flash_fwd_sm90 as fwd_module
    import flash_attn.cute.interface as itf

    saved = itf.FlashAttentionForwardSm90, itf._flash_attn_fwd.compile_cache, fwd_module.cpasync
    itf.FlashAttentionForwardSm90 = paired_class(*VARIANTS[variant])
    itf._flash_attn_fwd.compile_cache = _CACHES.setdefault(variant, {})
    fwd_module.cpasync = _CpasyncProxy(cpasync_real())
    try:
        yield
    finally:
        itf.FlashAttentionForwardSm90, itf._flash_attn_fwd.compile_cache, fwd_module.cpasync = saved


def variants_for(q_block: int) -> list[str]:
    """The variants a query tile runs: two CTAs per SM only fit 64-row query tiles."""
    return [v for v, (two_ctas, _) in VARIANTS.items() if q_block == 64 or not two_ctas]


def compile_only() -> int:
    """Compile the paired forward for sm_90a on fake CUDA tensors (no GPU), Q128 and Q64."""
    for key, value in (("CUTE_DSL_ARCH", "sm_90a"), ("FLASH_ATTENTION_ARCH", "sm_90"),
                       ("FLASH_ATTENTION_NUM_SMS", "132")):  # fmt: skip
        if os.environ.get(key) != value:
            raise SystemExit(f"--compile-only needs {key}={value} in the environment")
    from flash_attn.cute.interface import _flash_attn_fwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq, heads = 2048, 2
    for q_block, variant in ((128, "paired"), (64, "paired"), (64, "paired_two_cta_s1")):
        lay = exact256_layout(seq, heads, 0.75, seed=0).refine((q_block, KEY_BLOCK))
        tensors = pair_tensors(lay, device="cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            q, k, v = (
                torch.empty(1, seq, heads, 128, dtype=torch.bfloat16, device="cuda")
                for _ in range(3)
            )
            fake = type(tensors)(*[t.to("cuda") if torch.is_tensor(t) else t for t in tensors])
            with paired_scope(variant):
                _flash_attn_fwd(q, k, v, block_sparse_tensors=fake, return_lse=True, _arch=90)
        print(f"compiled: Q{q_block} {variant} forward for sm_90a", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    from flash_attn.cute.interface import _flash_attn_fwd, flash_attn_func

    emit = start_log(args.out, "paired_kv_fwd")
    torch.manual_seed(0)
    dim, scale = 128, 128**-0.5
    good = []
    # ---- correctness: S=2048, H=4, exact256 75% refined (even counts), NaN-poisoned outputs
    seq, heads = 2048, 4
    q, k, v, dout = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    cases = [
        (q_block, name, lay.to("cuda"))
        for q_block in (128, 64)
        for name, lay in (
            ("exact256", exact256_layout(seq, heads, 0.75, seed=1).refine((q_block, KEY_BLOCK))),
            ("random_even", even_random_layout(seq, heads, q_block, 0.3, seed=1)),
        )
    ]
    for q_block, name, lay in cases:
        ref_out, _ = reference(q, k, v, dout, lay, scale)
        for variant in variants_for(q_block):
            label = {"q_block": q_block, "mask": name, "variant": variant}

            def run(out, lse, lay=lay, variant=variant):
                tensors = pair_tensors(lay)
                with paired_scope(variant):
                    _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=tensors,
                                    return_lse=True, out=out, lse=lse)  # fmt: skip

            if check_forward(emit, label, q, ref_out, run):
                good.append((q_block, name, variant))
    # ---- timing: S=32768, H=12, exact256 90% refined, against upstream's 64-key tiles
    seq, heads = args.seq, args.heads
    q, k, v = (
        torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    base = exact256_layout(seq, heads, 0.9, seed=2)
    for q_block, name in dict.fromkeys((qb, nm) for qb, nm, _ in good):
        if name == "exact256":
            lay = base.refine((q_block, KEY_BLOCK)).to("cuda")
        else:
            lay = even_random_layout(seq, heads, q_block, 0.1, seed=3).to("cuda")
        pairs = float(lay.selected_token_pairs().sum()) / heads
        paired, native = pair_tensors(lay), fa4_tensors(lay, False)

        def run_native(t):
            _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=t)

        def run_paired(_, t, variant):
            with paired_scope(variant):
                _flash_attn_fwd(q, k, v, softmax_scale=scale, block_sparse_tensors=t)

        arms = {
            "dense": (lambda _: flash_attn_func(q, k, v, softmax_scale=scale), None),
            "upstream_kv64": (lambda _, t=native: run_native(t), None),
        }
        for qb, nm, variant in good:
            if (qb, nm) == (q_block, name):
                arms[variant] = (functools.partial(run_paired, t=paired, variant=variant), None)
        if q_block == 64:  # the fork's two-CTA launch of the unpaired 64-key kernel
            from flash_attn_vsa.fwd_sm90 import block_sparse_forward_q64

            arms["two_cta_kv64"] = (
                lambda _, t=native: block_sparse_forward_q64(q, k, v, t, softmax_scale=scale),
                None,
            )
        emit_interleaved_times(emit, arms, rounds=2, reps=args.reps, pairs=pairs,
                               shape=(seq, heads, dim), q_block=q_block, mask=name)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Key pairing in the block-sparse forward on Hopper (sm_90): 128-row query blocks over two
64-token key blocks per 128-key tile. The fork's fourth delta (GPU tests pass on an H200;
vsa-fa4 routes 128x64 forwards at head dim 128 here).

Upstream FA4 (4.0.0b36) runs 128x64 sparse blocks on 128x64 tiles: QK^T at N = 64 issues
~140 instructions per MFLOP against ~110 at N = 128 and each tile step pays a full pipeline
round trip for half the work. Here the producer fills each 128-row key/value stage with
**two** selected 64-token blocks, four TMA copies of 64 x 64 per tensor (two blocks x two
halves of head dim 128, into the four 8 KB sub-tiles of the stage's swizzled layout), so
upstream's consumer runs dense's 128x128 tile whatever the 64-token list is. Measured on an
H200 (``research/fa4_fork/experiments/paired_kv_fwd.py``, ``research/fa4_fork/NOTES.md``
experiment 5 and session 6): 0.78 -> 0.89 of dense forward against upstream's 64-key tiles
in the interleaved harness; in ``bench_vsa`` 0.95 / 0.89-0.91 at 87.5 / 90% against
0.90-0.92, same error.

How the lists reach the kernel (`pair_lists` builds them from 64-token lists split into full
and partial blocks):

- every list entry is a **pair** packed as ``a | b << 16`` (64-token key block ids below
  `NO_BLOCK`); a class's odd last block is paired with `NO_BLOCK`, which the producer loads as
  ``a`` again and the mask drops;
- pairs of two full blocks go to FA4's full list, the rest (a partial block, an odd tail) to
  its partial ("mask") list with `pair_mask_mod()`, which keeps columns ``c < valid[a]`` and
  ``64 <= c < 64 + valid[b]`` (two R2P ranges; valid sizes [NKV] int32 as
  ``aux_tensors[0]``);
- while `block_sparse_forward_paired` has upstream build the kernel (`fwd_sm90._building`),
  upstream's forward builds its mask from `mask_class()` (the `ForwardKernel.mask_class`),
  which applies that mask_mod and skips upstream's sequence-length mask of a row's first tile
  (list entries are packed pairs, not tile indices; every key a pair names lies inside K).

The K/V TMA atoms are built inside upstream's ``__call__`` with the whole key tile as their
box; while this kernel is built the ``cpasync`` module upstream's forward module sees builds them
with a 64 x 64 box (K and V are the atoms built with a multicast count; Q and O are not).

Upstream internals this relies on (fingerprinted): those of `flash_attn_vsa.fwd_sm90` and
`flash_attn_vsa.mask_sm90`, plus ``FlashAttentionForwardSm90.load`` (its signature: we
override it), ``block_sparse_utils.produce_block_sparse_loads`` (it calls our loaders with the
list entries) and ``consume_block_sparse_loads`` (which tiles get which mask call), the module
globals ``flash_fwd_sm90.cpasync`` and ``flash_fwd_sm90.AttentionMask``, upstream's R2P
helpers, and quack's ``copy_utils.tma_get_copy_fn`` / ``sm90_utils.make_smem_layout``.
"""

from __future__ import annotations

from typing import Any

from flash_attn_vsa.fwd_sm90 import PAIRED_KEYS, ForwardKernel, _building
from flash_attn_vsa.paired_sm90 import (  # re-exported: this module's names before the split
    BLOCK_SIZE,
    HEAD_DIM,
    KEY_BLOCK,
    MAX_KEY_BLOCKS,
    NO_BLOCK,
    check_pairable,
    pair_lists,
    pair_mask_mod,
    paired_widths,
    two_block_stage_forward,
)
from flash_attn_vsa.paired_sm90 import (  # the rest of them, for callers and tests
    PAIR_MASK_ATTR as PAIR_MASK_ATTR,
)
from flash_attn_vsa.paired_sm90 import (
    _install as _install,
)
from flash_attn_vsa.paired_sm90 import (
    _packed_pairs as _packed_pairs,
)
from flash_attn_vsa.paired_sm90 import (
    _paired_class as _paired_class,
)
from flash_attn_vsa.paired_sm90 import (
    _real_cpasync as _real_cpasync,
)
from flash_attn_vsa.paired_sm90 import (
    _ScopedCpasync as _ScopedCpasync,
)
from flash_attn_vsa.paired_sm90 import (
    marked_mask_mod as marked_mask_mod,
)
from flash_attn_vsa.paired_sm90 import (
    mask_class as mask_class,
)
from flash_attn_vsa.paired_sm90 import (
    packed_entry_mask_base as packed_entry_mask_base,
)

__all__ = [
    "BLOCK_SIZE",
    "HEAD_DIM",
    "KEY_BLOCK",
    "MAX_KEY_BLOCKS",
    "NO_BLOCK",
    "block_sparse_forward_paired",
    "check_pairable",
    "kernel_class",
    "pair_lists",
    "pair_mask_mod",
    "paired_widths",
    "two_block_stage_forward",
]


def kernel_class(q_in_registers: bool = False, persistent: bool | int = False) -> type:
    """Upstream's sm_90 forward kernel class with our producer: two key blocks per stage; with
    ``q_in_registers`` QK^T reads Q from registers (delta 5), with ``persistent`` its CTAs
    walk the tiles (delta 7); both experimental."""
    return ForwardKernel(PAIRED_KEYS, q_in_registers, persistent).kernel_class()


def block_sparse_forward_paired(
    q: Any,
    k: Any,
    v: Any,
    block_sparse_tensors: Any,
    kv_valid_sizes: Any,
    *,
    softmax_scale: float,
    out: Any = None,
    lse: Any = None,
    q_in_registers: bool = False,
    persistent: bool | int = False,
    replay: bool = True,
) -> tuple[Any, Any]:
    """Block-sparse attention forward on sm_90, 128-row query blocks over pairs of 64-token key
    blocks. ``block_sparse_tensors``: FA4 ``BlockSparseTensorsTorch`` with `BLOCK_SIZE` whose
    lists hold `pair_lists`' packed pairs; ``kv_valid_sizes``: [S / 64] int32 real tokens per
    key block. BSHD ``q, k, v`` (fp16/bf16, head dim `HEAD_DIM`). Returns ``(out, lse)``.
    ``q_in_registers``: QK^T reads Q from registers (delta 5), ``persistent``: CTAs walk the
    tiles (delta 7); both experimental until measured. ``replay``: launches after the first of a
    description skip upstream's per-call Python (`launch_replay`); False runs it every call."""
    return two_block_stage_forward(
        q, k, v, block_sparse_tensors, kv_valid_sizes, BLOCK_SIZE, "paired keys",
        pair_mask_mod(), ForwardKernel(PAIRED_KEYS, q_in_registers, persistent), _building,
        softmax_scale=softmax_scale,
        out=out,
        lse=lse,
        replay=replay,
    )  # fmt: skip

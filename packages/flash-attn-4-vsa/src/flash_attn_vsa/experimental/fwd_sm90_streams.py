"""Two query streams per CTA on Hopper (sm_90): the 64x64 block-sparse forward with any key list
per 64-row query block, run as 128-row tiles whose two MMA warpgroups each walk their own
block's list. The fork's sixth delta (experimental: its GPU tests pass on an H200, which
measured it at 0.69-0.76 of dense against the two-CTA kernel's 0.79, session 8; vsa-fa4 runs it
only when asked, ``ForwardVariant(two_streams=True)`` passed to ``vsa_fa4.launch.run_forward``).

Why: the two-CTA kernel (delta 2) gives an SM two MMA warpgroups but nothing makes them take
turns, and each CTA lands its own keys; upstream's 128-row tiles (dense, and the paired-key
kernel at 0.90-0.95 of dense) run two warpgroups in one CTA that alternate through upstream's
warp-scheduler barriers, one's softmax under the other's MMAs, fed by one producer. Those
tiles need one key list per 128 query rows; VSA gives each 64-row query block its own. Here
the two 64-row blocks of a tile keep their own lists:

- **lists** (`stream_lists`): the 64-row query blocks ``2t`` and ``2t + 1`` form tile ``t``;
  entry ``i`` packs ``a``, the ``i``-th block of ``2t``'s list, and ``b``, the ``i``-th of
  ``2t + 1``'s, as ``a | b << 16`` (`NO_BLOCK` past the shorter list's end). Entries whose two
  blocks are full make FA4's full list; the rest (a partial block, `NO_BLOCK`) its partial
  list, masked by `stream_mask_mod()`;
- **producer**: the paired-key producer (`fwd_sm90_paired`, delta 4) loads each entry's ``a``
  into rows 0-63 and ``b`` into rows 64-127 of one key/value stage; the staged layouts are
  built with twice the tile's 64 rows (`sm90_operands`, from `ForwardKernel.staged_rows`);
- **consumer**: upstream's 128x64 consumer, except that each warpgroup partitions its own half
  of every stage (`sm90_operands.partition_hooks`), so warpgroup 0 (the tile's rows 0-63)
  multiplies against ``a`` and warpgroup 1 against ``b``;
- **mask**: on partial-list entries each warpgroup keeps the columns below its own block's
  valid size, none for `NO_BLOCK` (`mask_class()`); FA4's sequence-length mask, which would
  read a packed entry as a tile index, does not run.

A tile steps through ``max(len(a-list), len(b-list))`` entries; VSA's top-k gives the two
lists the same length except where key blocks are empty, so little is wasted.

Upstream internals this relies on (fingerprinted): those of `fwd_sm90_paired` and
`sm90_operands`, upstream's 128x64 forward tile for head dim 128 (``_tile_size_fwd_sm90``,
two MMA warpgroups), ``mma``'s operand partitions (QK^T: B = the key stage, rows first; PV:
B = the transposed value stage), and the consumer warpgroups following the producer's.
"""

from __future__ import annotations

from typing import Any

from flash_attn_vsa.experimental.streams_sm90 import (  # the body's names, re-exported
    BLOCK_SIZE,
    mask_class,
    stream_lists,
    stream_mask_mod,
)
from flash_attn_vsa.fwd_sm90 import TWO_STREAMS, ForwardKernel, _building
from flash_attn_vsa.paired_sm90 import HEAD_DIM, KEY_BLOCK, NO_BLOCK, two_block_stage_forward

__all__ = [
    "BLOCK_SIZE",
    "HEAD_DIM",
    "KEY_BLOCK",
    "NO_BLOCK",
    "block_sparse_forward_streams",
    "kernel_class",
    "mask_class",
    "stream_lists",
    "stream_mask_mod",
]


def kernel_class(q_in_registers: bool = False, persistent: bool | int = False) -> type:
    """The paired-key producer's class with each MMA warpgroup on its own half of every
    stage; with ``q_in_registers`` QK^T reads Q from registers (delta 5), with ``persistent``
    its CTAs walk the tiles (delta 7)."""
    return ForwardKernel(TWO_STREAMS, q_in_registers, persistent).kernel_class()


def block_sparse_forward_streams(
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
    """Block-sparse attention forward on sm_90 for 64-row query blocks with their own lists of
    64-token key blocks, two blocks per 128-row tile. ``block_sparse_tensors``: FA4
    ``BlockSparseTensorsTorch`` with `BLOCK_SIZE` whose lists are `stream_lists`' packed
    entries; ``kv_valid_sizes``: [S / 64] int32 real tokens per key block. BSHD ``q, k, v``
    (fp16/bf16, head dim `HEAD_DIM`, sequence lengths multiples of 128 and 64). Returns
    ``(out, lse)``; rows that see no key get out 0 and lse -inf. ``q_in_registers`` (delta
    5), ``persistent`` (delta 7) and ``replay`` (`launch_replay`) as for the paired-key
    forward."""
    return two_block_stage_forward(
        q, k, v, block_sparse_tensors, kv_valid_sizes, BLOCK_SIZE, "two streams",
        stream_mask_mod(), ForwardKernel(TWO_STREAMS, q_in_registers, persistent), _building,
        softmax_scale=softmax_scale, out=out, lse=lse, replay=replay,
    )  # fmt: skip

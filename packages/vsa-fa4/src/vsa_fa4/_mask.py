"""The CuTe ``mask_mod`` of partial key blocks (imports cutlass: load only to launch FA4).

FA4 calls a block-sparse ``mask_mod`` on the blocks of its *partial* ("mask") lists only, with
the signature ``(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)`` (``flash_attn.cute.
mask.call_mask_mod``; the indices are one-element ``TensorSSA`` values) and keeps a score where
it returns True. Ours keeps key token ``kv_idx`` when its offset inside its key block is below
that block's valid size: ``aux_tensors[0]`` is the physical ``kv_valid_sizes`` [NKV] int32, and
the key tile is a compile-time constant (one compiled kernel per key tile size).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from flash_attn.cute.utils import scalar_to_ssa


@functools.cache
def valid_size_mask_mod(kv_tile: int):
    """The mask_mod for ``kv_tile``-token physical key blocks (one function object per size, so
    FA4's compile cache, keyed on the function's hash, sees one kernel per size).

    Block arithmetic by shifts, not ``//`` and ``*``: key indices are never negative, so the two
    agree, but a signed division costs registers the kernel does not have. Compiled for sm_90a
    (cuobjdump, 2026-11-29), the KV64 backward with this mask_mod spilled 120 B of stack with
    ``//`` and spills none with shifts."""
    if kv_tile <= 0 or kv_tile & (kv_tile - 1):
        raise ValueError(f"kv_tile must be a power of two, got {kv_tile}")
    log2_tile = kv_tile.bit_length() - 1

    @cute.jit
    def keep_valid_keys(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        valid_sizes = aux_tensors[0]
        block = kv_idx[0] >> log2_tile
        end = (block << log2_tile) + valid_sizes[block]
        return kv_idx < scalar_to_ssa(end, cutlass.Int32)

    return keep_valid_keys

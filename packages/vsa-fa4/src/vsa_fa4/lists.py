"""FA4's block-sparse index tensors as vsa-fa4 builds them: `SparseLists` (the fields of
``BlockSparseTensorsTorch``) and `empty_lists` for a kernel to fill.

The one owner of this format in vsa-fa4: a leaf (torch only) that `vsa_fa4.metadata` (the
tensor-op builders, which re-export both names) and the Triton builders
(`vsa_fa4.forward_lists_triton`, `vsa_fa4.backward_lists_triton`,
`vsa_fa4.paired_lists_triton`) import, so that the builders and `metadata`, which picks
between them, import each other one way. The packed pairs inside the paired and two-stream
lists are the fork's (`flash_attn_vsa.fwd_sm90_paired.pair_lists`,
`flash_attn_vsa.experimental.fwd_sm90_streams.stream_lists`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PackedSparseLists", "SparseLists", "empty_lists"]


class SparseLists(NamedTuple):
    """FA4's block-sparse index tensors (the fields of ``BlockSparseTensorsTorch``), int32.

    Counts are [B, H, R]; indices [B, H, R, width] with the first ``count`` entries meaningful.
    Forward: R = query blocks, entries key blocks. Backward: R = key blocks, entries query
    blocks.
    """

    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor
    full_block_idx: torch.Tensor

    def by_class(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(full_idx, full_cnt, partial_idx, partial_cnt)``: the argument order of the fork's
        list packers (``pair_lists``, ``stream_lists``)."""
        return self.full_block_idx, self.full_block_cnt, self.mask_block_idx, self.mask_block_cnt


class PackedSparseLists(SparseLists):
    """Forward `SparseLists` whose partial entries are ``block | valid << 16`` (the key block's
    valid size in the high bits, `flash_attn_vsa.valid_in_list_sm90`); the full list holds plain
    block indices. Only the fork's two-CTA 64x64 forward reads this format
    (`vsa_fa4.launch.run_forward` refuses it elsewhere)."""


def empty_lists(
    lead: torch.Size, full_width: int, mask_width: int, device: torch.device
) -> SparseLists:
    """Uninitialized int32 `SparseLists` for a kernel to fill: counts ``lead``, index tensors
    ``lead + (full_width,)`` and ``lead + (mask_width,)``."""
    full_idx = torch.empty(*lead, full_width, dtype=torch.int32, device=device)
    mask_idx = torch.empty(*lead, mask_width, dtype=torch.int32, device=device)
    full_cnt = torch.empty(lead, dtype=torch.int32, device=device)
    return SparseLists(torch.empty_like(full_cnt), mask_idx, full_cnt, full_idx)

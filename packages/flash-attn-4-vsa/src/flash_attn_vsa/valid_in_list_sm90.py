"""Partial key blocks' valid sizes carried in the forward's list entries (sm_90): the fork's
tenth delta, which vsa-fa4 runs for every 64x64 forward with partial key blocks.

Why (experiments 17 and 18, NOTES.md sessions 19-20; H200, S=32768, 12 heads, 64x64, 87.5%, a
quarter of the key blocks partial): with the column limit's input loaded as
``valid_sizes[block]`` after the step's QK^T (`mask_sm90`), ptxas puts a second
``WARPGROUP.DEPBAR.LE gsb0, 0x0`` in each masked step, before the mask: the step waits for the
previous step's P V product as well as its own QK^T, so the softmax no longer overlaps it.
Nsight Compute puts 4,000 of the kernel's 154,000 stall samples on that wait (the barrier
stalls triple) and the kernel at +3.0% over the same lists all full. Here the partial list's
entries are ``block | valid << 16`` (`pack_valid_sizes`; vsa-fa4's list kernel writes them):
the consumer reads a step's entry at the top of the step, as upstream does, and the mask uses
the size it holds. The extra wait is gone (+1.0% under Nsight; timed back to back, +6.5%
against +7.7%: what the back-to-back run still pays is not measured apart, beside the masked
steps' other instructions: the kernel executes 6.2% more than on all-full lists, 32 FSEL a
masked step and warp among them); the output is bitwise the same.

`with_valid_sizes_in_list(base)` subclasses a sm_90 forward kernel class:

- its producer (``load``) and consumer (``mma``) see the partial list through `PackedEntries`,
  whose element reads answer ``entry & 0xFFFF`` (the block) and, for the consumer, keep
  ``entry >> 16`` (the valid size) in a trace-time holder (`build_scope.traced`);
- the column limit (`mask_sm90.mask_class` with `mask_sm90.valid_in_list_mask_mod`) takes the
  size from that holder (`entry_valid_size`): the value of the entry read at the top of the
  same step (upstream reads a step's index, then runs that step's QK^T and mask).

The full list is untouched. Key block ids must be below 2^16 and sizes at most the tile.

Upstream internals this relies on (fingerprinted): ``FlashAttentionForwardSm90.load`` and
``mma`` taking ``blocksparse_tensors`` (a ``BlockSparseTensors`` named tuple), the block-sparse
loops reading list entries by element (``idx[i]``) after slicing a query block's row
(``idx[b, h, m, None]``), and the consumer reading a partial step's entry before that step's
mask call.
"""

from __future__ import annotations

import functools
from typing import Any

from flash_attn_vsa import build_scope, sm90_operands

__all__ = ["PackedEntries", "entry_valid_size", "pack_valid_sizes", "with_valid_sizes_in_list"]

_STACK = "valid_in_list"
BLOCK_BITS = 16


class _HeldValidSize:
    """Trace-time holder of the valid size of the partial-list entry the consumer read last;
    inside the column limit it stands in for the valid-size tensor: any index answers the held
    size (the limit asks for the block of the step it masks, whose entry was read last)."""

    value: Any = None
    row: Any = None
    """The packed row (one query block's partial list, raw entries) and the index of the
    entry read last (delta 11, `experimental.v_padding_sm90`, reads the entries before it)."""
    index: Any = None

    def hold(self, value: Any, row: Any, index: Any) -> None:
        self.value, self.row, self.index = value, row, index

    def __getitem__(self, index: Any) -> Any:
        if self.value is None:
            raise RuntimeError(
                "the column limit ran before the consumer read a partial-list entry; "
                "valid_in_list_sm90 needs a review against this upstream version"
            )
        return self.value


def entry_valid_size() -> _HeldValidSize:
    """For `mask_sm90`'s column limit (and `experimental.v_padding_sm90`'s zeroing): the
    consumer's holder, as a valid-size tensor."""
    stack = build_scope.trace_stack(_STACK)
    if not stack:
        raise RuntimeError(
            "valid_in_list_mask_mod needs a forward built with valid sizes in its lists "
            "(flash_attn_vsa.valid_in_list_sm90)"
        )
    return stack[-1]


class PackedEntries:
    """A partial-list tensor whose entries are ``block | valid << 16``: slicing keeps the
    wrapper, an element read answers the block and (with a holder) keeps the size. Carried
    through upstream's loops as the wrapped tensor's values, like `sm90_operands`' stand-ins."""

    def __init__(self, inner: Any, held: _HeldValidSize | None) -> None:
        self._inner = inner
        self._held = held

    def __extract_mlir_values__(self) -> Any:
        import cutlass

        return cutlass.extract_mlir_values(self._inner)

    def __new_from_mlir_values__(self, values: Any) -> PackedEntries:
        import cutlass

        return PackedEntries(cutlass.new_from_mlir_values(self._inner, values), self._held)

    def __getitem__(self, index: Any) -> Any:
        result = self._inner[index]
        if isinstance(index, tuple) and any(i is None for i in index):
            return PackedEntries(result, self._held)  # a row of the list
        if self._held is not None:
            self._held.hold(result >> BLOCK_BITS, self._inner, index)
        return result & ((1 << BLOCK_BITS) - 1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _with_packed(blocksparse_tensors: Any, held: _HeldValidSize | None) -> Any:
    if blocksparse_tensors is None:
        raise ValueError("valid sizes in the lists need block-sparse tensors")
    packed = PackedEntries(blocksparse_tensors.mask_block_idx, held)
    return blocksparse_tensors._replace(mask_block_idx=packed)


@functools.cache
def with_valid_sizes_in_list(base: type) -> type:
    """A subclass of the sm_90 forward kernel class ``base`` whose partial list carries each
    entry's valid size (see the module doc)."""
    import inspect

    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    load_signature = inspect.signature(FlashAttentionForwardSm90.load)

    class ValidSizesInList(base):  # type: ignore[misc, valid-type]
        """``base`` reading partial-list entries as ``block | valid << 16``."""

        def load(self, *args: Any, **kwargs: Any) -> Any:
            bound = load_signature.bind(self, *args, **kwargs)
            bound.arguments["blocksparse_tensors"] = _with_packed(
                bound.arguments["blocksparse_tensors"], None
            )
            return base.load(*bound.args, **bound.kwargs)

        def mma(self, *args: Any, **kwargs: Any) -> Any:
            bound = sm90_operands.upstream_mma_arguments(self, args, kwargs)
            held = _HeldValidSize()
            bound.arguments["blocksparse_tensors"] = _with_packed(
                bound.arguments["blocksparse_tensors"], held
            )
            with build_scope.traced(_STACK, held):
                return base.mma(*bound.args, **bound.kwargs)

    ValidSizesInList.__name__ = ValidSizesInList.__qualname__ = f"{base.__name__}ValidInList"
    return ValidSizesInList


def pack_valid_sizes(mask_block_idx: Any, kv_valid_sizes: Any, mask_block_cnt: Any = None) -> Any:
    """A partial list [..., W] int32 with each entry's valid size in its high bits (torch ops;
    vsa-fa4's list kernel writes them directly). Unused entries (block 0) get block 0's size,
    which no step reads, or, given the lists' counts ``mask_block_cnt`` [...], stay 0 (what
    vsa-fa4's list kernel writes there)."""
    import torch

    if kv_valid_sizes.shape[0] > 1 << BLOCK_BITS:
        raise ValueError(
            f"valid sizes in the lists need fewer than {1 << BLOCK_BITS} key blocks, got "
            f"{kv_valid_sizes.shape[0]}"
        )
    valid = kv_valid_sizes.to(torch.int32)[mask_block_idx.long()]
    packed = mask_block_idx.to(torch.int32) | (valid << BLOCK_BITS)
    if mask_block_cnt is not None:
        slots = torch.arange(packed.shape[-1], device=packed.device)
        packed = torch.where(slots < mask_block_cnt.unsqueeze(-1), packed, 0)
    return packed.contiguous()

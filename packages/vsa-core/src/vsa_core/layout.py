"""The sparsity description every backend consumes: `BlockSparseLayout`.

The sequence of queries is cut into blocks of ``q_block`` tokens and the keys into blocks of
``kv_block`` tokens. For every (batch, head, query block) the layout stores a compact list of the
key blocks that query block attends to:

- ``kv_indices`` [B, H, NQ, W] int32: the first ``kv_counts[b, h, i]`` entries of row ``i`` are the
  selected key blocks, strictly ascending. Entries past the count are in ``[0, NKV)`` (so a
  kernel may prefetch them) but carry no meaning.
- ``kv_counts`` [B, H, NQ] int32.
- ``kv_valid_sizes`` [NKV] int32: real tokens of each key block; its first ``valid`` positions
  are real, the rest padding (see `vsa_core.tiling`). A block with valid size 0 is empty.

Backward passes are key-block owned and need the transpose: per key block, the query blocks
that attend to it. `BlockSparseLayout.kv_to_q` derives it on first use (and caches it) in a
compressed-row form whose size does not depend on the data, so neither building nor
transposing a layout makes the host wait for the device, and nothing is ever O(NQ x NKV).
Boolean block maps (`from_block_mask` / `to_block_mask`) are for compatibility and tests only.

A coarse stage that can write it while it selects attaches the lists' split by key-block
fullness (`ForwardSplit`, ``forward_split``): kernels that mask partial blocks only (fa4's)
then need no pass of their own to split them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vsa_core.validation import (
    as_device,
    as_int,
    check_block_shape,
    check_int_tensor,
    check_range,
    check_valid_sizes,
)

PACKED_BLOCK_BITS = 16
"""`ForwardSplit`'s partial entries are ``block | valid << PACKED_BLOCK_BITS``."""


class ForwardSplit(NamedTuple):
    """A layout's key lists with full and partial key blocks apart, int32, as a coarse stage
    wrote them while selecting (`vsa_core.coarse.CoarseStage.select_split`): per (batch, head,
    query block) the first ``full_cnt`` entries of ``full_idx`` [B, H, NQ, W] are the selected
    full key blocks (valid size == ``kv_block``), the first ``partial_cnt`` of ``partial_idx``
    the partial ones (``0 < valid < kv_block``), each ``block | valid << 16``; empty blocks
    are dropped, both ascending, unused entries 0. Only for layouts of fewer than 2^16 key
    blocks."""

    full_idx: torch.Tensor
    full_cnt: torch.Tensor
    partial_idx: torch.Tensor
    partial_cnt: torch.Tensor


@dataclass(frozen=True)
class KVToQLists:
    """The kv -> q transpose of a layout, compressed per (batch, head).

    For key block ``j`` of (b, h), the query blocks attending to it are
    ``q_indices[b, h, q_offsets[b, h, j] : q_offsets[b, h, j + 1]]``, ascending. Each (b, h) row
    of ``q_indices`` has the fixed length NQ * W; slots past ``q_offsets[b, h, NKV]`` are 0.
    """

    q_indices: torch.Tensor
    """[B, H, NQ * W] int32."""
    q_offsets: torch.Tensor
    """[B, H, NKV + 1] int32, q_offsets[..., 0] == 0."""
    q_counts: torch.Tensor
    """[B, H, NKV] int32."""

    def to_padded(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded form: ``(q_indices [B, H, NKV, width], q_counts [B, H, NKV])``.

        ``width`` defaults to the largest count, which reads it from the device (a host sync);
        pass a known bound to stay sync-free. Slots past a count hold 0.
        """
        num_kv = self.q_counts.shape[-1]
        if width is None:
            width = int(self.q_counts.max()) if self.q_counts.numel() else 0
        else:
            width = as_int("width", width, 0)
        width = max(width, 1)
        total = self.q_indices.shape[-1]
        slot = torch.arange(total, device=self.q_indices.device, dtype=torch.int64)
        # Entry i of a (b, h) row belongs to the key block whose offset range holds it.
        owner = torch.searchsorted(
            self.q_offsets[..., 1:].contiguous().to(torch.int64),
            slot.expand(*self.q_offsets.shape[:-1], total).contiguous(),
            right=True,
        )
        live = owner < num_kv
        rank = slot - torch.gather(self.q_offsets.to(torch.int64), -1, owner.clamp(max=num_kv))
        keep = live & (rank < width)
        flat_pos = torch.where(keep, owner * width + rank, num_kv * width)
        padded = torch.zeros(
            *self.q_offsets.shape[:-1],
            num_kv * width + 1,
            dtype=torch.int32,
            device=self.q_indices.device,
        )
        padded.scatter_(-1, flat_pos, torch.where(keep, self.q_indices, 0))
        return padded[..., :-1].reshape(*self.q_counts.shape, width), self.q_counts


@dataclass(frozen=True)
class BlockSparseLayout:
    """Which key blocks each query block attends to, per batch and head (see module doc).

    Build it with `from_topk` (the coarse stage does), `from_indices` (user data, validated),
    or `from_block_mask` (compatibility). The constructor itself trusts its arguments.
    """

    kv_indices: torch.Tensor
    kv_counts: torch.Tensor
    kv_valid_sizes: torch.Tensor
    block_shape: tuple[int, int]
    q_group_size: int = 1
    """Aligned groups of this many adjacent query blocks are known to share one key list
    (set by `refine` from a coarser parent); 1 when nothing is known."""
    kv_blocks_full: bool = False
    """True when every key block is known to be full (valid size == ``kv_block``), so kernels
    may skip per-token key masking. The constructors set it when the valid sizes are on the
    CPU (checked there, no device sync) or when told (``all_full=True``); `to` and `refine`
    keep it. False means "not known": masking stays on, which is always correct."""
    forward_split: ForwardSplit | None = None
    """The same lists split by key-block fullness, when the coarse stage wrote them
    (`ForwardSplit`); None otherwise. Derived data: every layout made from this one (`to`,
    `refine`, ...) leaves it out, so it never describes other lists."""

    # ---- shape ---------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.kv_indices.shape[0]

    @property
    def heads(self) -> int:
        return self.kv_indices.shape[1]

    @property
    def num_q_blocks(self) -> int:
        return self.kv_indices.shape[2]

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_valid_sizes.shape[0]

    @property
    def width(self) -> int:
        """Capacity of each key list (the largest possible count)."""
        return self.kv_indices.shape[3]

    @property
    def q_block(self) -> int:
        return self.block_shape[0]

    @property
    def kv_block(self) -> int:
        return self.block_shape[1]

    @property
    def q_len(self) -> int:
        return self.num_q_blocks * self.q_block

    @property
    def kv_len(self) -> int:
        return self.num_kv_blocks * self.kv_block

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    def to(self, device: torch.device | str) -> BlockSparseLayout:
        device = as_device(device)
        return BlockSparseLayout(
            self.kv_indices.to(device),
            self.kv_counts.to(device),
            self.kv_valid_sizes.to(device),
            self.block_shape,
            self.q_group_size,
            self.kv_blocks_full,
        )

    def slot_mask(self) -> torch.Tensor:
        """[B, H, NQ, W] bool: which list slots hold a selected block."""
        slots = torch.arange(self.width, device=self.device, dtype=torch.int32)
        return slots < self.kv_counts.unsqueeze(-1)

    def selected_token_pairs(self) -> torch.Tensor:
        """Number of (query token, real key token) pairs the layout selects, as a 0-d tensor.

        Counts every query slot of a block (padding included) against the real keys of each
        selected block: the work a kernel does, the FLOP count's basis.
        """
        sizes = self.kv_valid_sizes.to(torch.int64)[self.kv_indices.long()]
        return (sizes * self.slot_mask()).sum() * self.q_block

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def from_topk(
        cls,
        topk_indices: torch.Tensor,
        kv_valid_sizes: torch.Tensor,
        block_shape: tuple[int, int],
        *,
        all_full: bool = False,
        validate: bool = False,
    ) -> BlockSparseLayout:
        """From ``torch.topk(...).indices`` [B, H, NQ, k] (distinct, unordered): all k kept.

        ``all_full=True`` states that every key block is full (see ``kv_blocks_full``); the
        caller vouches for it (e.g. a tiling without padding).

        On the hot path (the coarse stage calls it every step), so by default only metadata is
        checked, without a device sync: integer dtypes, shapes (1 <= k <= NKV), devices and the
        block shape. ``validate=True`` adds the data checks (indices in [0, NKV) and distinct
        within a row, valid sizes in [0, kv_block]), which make the host wait for the device.
        """
        block_shape = check_block_shape(block_shape)
        check_int_tensor("topk_indices", topk_indices)
        if topk_indices.dim() != 4:
            raise ValueError(
                "topk_indices must be 4-D [batch, heads, num_q_blocks, k], "
                f"got shape {tuple(topk_indices.shape)}"
            )
        check_valid_sizes(
            kv_valid_sizes,
            topk_indices.device,
            block_shape[1],
            validate=validate,
            device_of="topk_indices'",
        )
        num_kv, width = kv_valid_sizes.shape[0], topk_indices.shape[-1]
        if not 1 <= width <= num_kv:
            raise ValueError(
                f"topk_indices must hold between 1 and num_kv_blocks = {num_kv} indices per row "
                f"(its last dim), got shape {tuple(topk_indices.shape)}"
            )
        kv_indices = torch.sort(topk_indices.to(torch.int32), dim=-1).values
        if validate:
            check_range("topk_indices", kv_indices, 0, num_kv - 1)
            if width > 1 and bool((kv_indices[..., 1:] == kv_indices[..., :-1]).any()):
                raise ValueError("topk_indices must not repeat a key block within one row")
        counts = torch.full(
            kv_indices.shape[:-1], kv_indices.shape[-1], dtype=torch.int32, device=kv_indices.device
        )
        full = all_full or _full_on_host(kv_valid_sizes, block_shape[1])
        return cls(kv_indices, counts, kv_valid_sizes.to(torch.int32), block_shape, 1, full)

    @classmethod
    def from_indices(
        cls,
        kv_indices: torch.Tensor,
        kv_counts: torch.Tensor | None = None,
        *,
        kv_valid_sizes: torch.Tensor,
        block_shape: tuple[int, int],
        validate: bool = True,
    ) -> BlockSparseLayout:
        """From user-supplied key lists [B, H, NQ, W] (any order) and counts [B, H, NQ].

        ``kv_counts`` None means every slot is used. The lists are sorted here. Metadata is
        always checked: integer dtypes, shapes (a width W >= 1, at least one key block),
        devices, the block shape. With ``validate`` (the default) the data is checked too:
        counts in [0, W], indices in [0, NKV), no duplicates within a list, valid sizes in
        [0, kv_block]. These checks read device data; pass ``validate=False`` on a hot path
        once the producer is trusted.
        """
        block_shape = check_block_shape(block_shape)
        check_int_tensor("kv_indices", kv_indices)
        if kv_indices.dim() != 4:
            raise ValueError(
                f"kv_indices must be 4-D [batch, heads, num_q_blocks, width], "
                f"got shape {tuple(kv_indices.shape)}"
            )
        if kv_indices.shape[-1] == 0:
            raise ValueError(
                "kv_indices must have a width (last dim) of at least 1, "
                f"got shape {tuple(kv_indices.shape)}"
            )
        device = kv_indices.device
        check_valid_sizes(kv_valid_sizes, device, block_shape[1], validate=validate)
        num_kv, width = kv_valid_sizes.shape[0], kv_indices.shape[-1]
        if kv_counts is None:
            kv_counts = torch.full(kv_indices.shape[:-1], width, dtype=torch.int32, device=device)
        check_int_tensor("kv_counts", kv_counts, kv_indices.shape[:-1])
        if kv_counts.device != device:
            raise ValueError(
                f"kv_counts must be on kv_indices' device {device}, got {kv_counts.device}"
            )
        kv_counts = kv_counts.to(torch.int32)
        if validate:
            check_range("kv_counts", kv_counts, 0, width)
        used = torch.arange(width, device=device) < kv_counts.unsqueeze(-1)
        if validate:
            check_range("kv_indices (selected entries)", kv_indices[used], 0, num_kv - 1)
        # Unused slots sort to the end, then are set to 0 so that every entry stays in range.
        keyed = torch.where(used, kv_indices.to(torch.int64), num_kv)
        ordered = torch.sort(keyed, dim=-1).values
        if validate and width > 1:
            repeated = (ordered[..., 1:] == ordered[..., :-1]) & used[..., 1:]
            if bool(repeated.any()):
                raise ValueError(
                    "kv_indices must not repeat a key block within one query block's list"
                )
        ordered = torch.where(used, ordered, 0).to(torch.int32)
        full = _full_on_host(kv_valid_sizes, block_shape[1])
        return cls(ordered, kv_counts, kv_valid_sizes.to(torch.int32), block_shape, 1, full)

    @classmethod
    def from_block_mask(
        cls,
        block_mask: torch.Tensor,
        kv_valid_sizes: torch.Tensor,
        block_shape: tuple[int, int],
        width: int | None = None,
    ) -> BlockSparseLayout:
        """From a boolean map [B, H, NQ, NKV] (compatibility and tests only).

        ``width`` defaults to NKV; pass the largest row count to save memory. Checks data
        (valid sizes in [0, kv_block], the largest row count), so the host waits for the device.
        """
        block_shape = check_block_shape(block_shape)
        if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
            raise ValueError(
                "block_mask must be a bool tensor [batch, heads, num_q_blocks, num_kv_blocks]"
            )
        check_valid_sizes(
            kv_valid_sizes,
            block_mask.device,
            block_shape[1],
            validate=True,
            device_of="block_mask's",
        )
        if block_mask.dim() != 4 or block_mask.shape[-1] != kv_valid_sizes.shape[0]:
            raise ValueError(
                "block_mask must have shape [batch, heads, num_q_blocks, "
                f"{kv_valid_sizes.shape[0]}] (last dim = len(kv_valid_sizes)), "
                f"got {tuple(block_mask.shape)}"
            )
        num_kv = block_mask.shape[-1]
        counts = block_mask.sum(-1, dtype=torch.int32)
        largest = max(int(counts.max()) if counts.numel() else 0, 1)
        width = num_kv if width is None else _width(width, largest, num_kv)
        # Stable sort of "not selected" puts the selected blocks first, in ascending order.
        order = torch.sort((~block_mask).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
        used = torch.arange(width, device=block_mask.device) < counts.unsqueeze(-1)
        indices = torch.where(used, order, 0).to(torch.int32)
        full = _full_on_host(kv_valid_sizes, block_shape[1])
        valid = kv_valid_sizes.to(torch.int32)
        return cls(indices, counts.clamp(max=width), valid, block_shape, 1, full)

    def to_block_mask(self) -> torch.Tensor:
        """[B, H, NQ, NKV] bool map of the selected blocks (compatibility and tests only)."""
        mask = torch.zeros(
            (*self.kv_counts.shape, self.num_kv_blocks + 1), dtype=torch.bool, device=self.device
        )
        target = torch.where(self.slot_mask(), self.kv_indices.long(), self.num_kv_blocks)
        mask.scatter_(-1, target, True)
        return mask[..., :-1]

    # ---- derived forms -------------------------------------------------------------------
    @functools.cached_property
    def kv_to_q(self) -> KVToQLists:
        """The transposed lists for key-block-owned backward passes (built once, sync-free)."""
        return transpose_kv_lists(self.kv_indices, self.kv_counts, self.num_kv_blocks)

    def refine(self, block_shape: tuple[int, int]) -> BlockSparseLayout:
        """The same token pairs at finer blocks (e.g. logical 256x256 -> physical 64x64).

        Both new block sizes must divide the old ones. Every child block inherits its parent's
        selection; the children of a partial key block get their valid sizes clamped (the
        parent's real tokens come first, so the first children are full, then one partial,
        then empty ones). Query children of one parent share a list, recorded in
        ``q_group_size``.
        """
        q_new, kv_new = check_block_shape(block_shape)
        if self.q_block % q_new or self.kv_block % kv_new:
            raise ValueError(
                f"block_shape must divide the layout's block shape {self.block_shape}, "
                f"got {(q_new, kv_new)}"
            )
        fq, fk = self.q_block // q_new, self.kv_block // kv_new
        child = torch.arange(fk, device=self.device, dtype=torch.int32)
        kv = (self.kv_indices.unsqueeze(-1) * fk + child).flatten(-2)
        kv = kv.repeat_interleave(fq, dim=2)
        counts = (self.kv_counts * fk).repeat_interleave(fq, dim=2)
        valid = (self.kv_valid_sizes.unsqueeze(-1) - child * kv_new).clamp(0, kv_new).flatten()
        return BlockSparseLayout(
            kv, counts, valid, (q_new, kv_new), self.q_group_size * fq, self.kv_blocks_full
        )

    def rows_share_kv_lists(self, group: int = 2) -> torch.Tensor:
        """[B, H, NQ // group] bool: whether each aligned group of query blocks has one list.

        A data check (no sync by itself) for backends that pair adjacent query blocks; a layout
        from `refine` already records this in ``q_group_size``.
        """
        try:
            group = as_int("group", group, 1)
        except ValueError:
            group = 0
        if group < 1 or self.num_q_blocks % group:
            raise ValueError(
                f"group must be a positive divisor of num_q_blocks={self.num_q_blocks}, got {group}"
            )
        lead = self.kv_counts.shape[:2]
        lists = torch.where(self.slot_mask(), self.kv_indices, -1)
        lists = lists.view(*lead, -1, group, self.width)
        counts = self.kv_counts.view(*lead, -1, group)
        same_lists = (lists == lists[..., :1, :]).all(-1).all(-1)
        return same_lists & (counts == counts[..., :1]).all(-1)


def _width(width: object, largest: int, num_kv: int) -> int:
    number = as_int("width", width)
    if not largest <= number <= num_kv:
        raise ValueError(
            f"width must lie in [{largest}, {num_kv}] (largest row count, at least 1; "
            f"num_kv_blocks), got {width!r}"
        )
    return number


def _full_on_host(kv_valid_sizes: torch.Tensor, kv_block: int) -> bool:
    """Whether every key block is full, when that can be read without a device sync."""
    if kv_valid_sizes.device.type != "cpu":
        return False
    return bool((kv_valid_sizes == kv_block).all())


def transpose_kv_lists(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_kv: int
) -> KVToQLists:
    """kv -> q transpose of compact key lists ([B, H, NQ, W] indices, [B, H, NQ] counts).

    Sync-free and O(B * H * NQ * W): a sort of (key block, query block) keys. Backends call it
    on raw tensors (e.g. inside a custom op's backward); layouts cache it as `kv_to_q`.
    """
    *lead, num_q, width = kv_indices.shape
    device = kv_indices.device
    slots = torch.arange(width, device=device, dtype=torch.int32)
    q_of_slot = torch.arange(num_q, device=device, dtype=torch.int64).view(num_q, 1)
    kv = torch.where(slots < kv_counts.unsqueeze(-1), kv_indices.long(), num_kv)
    # Sort by (key block, query block); unused slots carry key block NKV and sort last.
    keys = (kv * num_q + q_of_slot).reshape(*lead, num_q * width)
    keys = torch.sort(keys, dim=-1).values
    sorted_kv = keys // num_q
    live = sorted_kv < num_kv
    q_indices = torch.where(live, keys % num_q, 0).to(torch.int32)
    counts = torch.zeros(*lead, num_kv + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(-1, sorted_kv, torch.ones_like(sorted_kv, dtype=torch.int32))
    counts = counts[..., :num_kv]
    offsets = torch.zeros(*lead, num_kv + 1, dtype=torch.int32, device=device)
    offsets[..., 1:] = torch.cumsum(counts, dim=-1)
    return KVToQLists(q_indices, offsets, counts)


def check_layout_matches(layout: BlockSparseLayout, q: torch.Tensor, k: torch.Tensor) -> None:
    """ValueError unless ``layout`` is a `BlockSparseLayout` for BSHD q and k: the same batch,
    heads and lengths, and on q's device (what every block-sparse entry point checks)."""
    if not isinstance(layout, BlockSparseLayout):
        raise ValueError(f"layout must be a BlockSparseLayout, got {type(layout).__name__}")
    batch, q_len, heads, _ = q.shape
    expected = {
        "batch": (layout.batch, batch),
        "heads": (layout.heads, heads),
        "q_len (num_q_blocks * q_block)": (layout.q_len, q_len),
        "kv_len (num_kv_blocks * kv_block)": (layout.kv_len, k.shape[1]),
    }
    for what, (have, want) in expected.items():
        if have != want:
            raise ValueError(f"layout must have {what} = {want} to match q/k, got {have}")
    if layout.device != q.device:
        raise ValueError(f"layout must be on q's device {q.device}, got {layout.device}")

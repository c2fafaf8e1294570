"""From vsa-core's key lists to FA4's block-sparse index tensors (pure torch, sync-free).

FA4 (``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch``) takes, per (batch, head, row),
two compact lists: *full* blocks, attended without any token mask, and *partial* ("mask")
blocks, on which the kernel calls a ``mask_mod``. The forward's rows are query blocks listing
key blocks; the backward's rows are key blocks listing query blocks (its loops are key-block
owned). Here:

- a selected key block is **full** when its valid size equals the physical key tile,
  **partial** when ``0 < valid < kv_tile`` (the mask_mod then keeps key tokens below the
  block's valid size, read from ``aux_tensors``), and **dropped** when empty (valid 0);
- the forward lists keep the layout's ascending order and have the layout's width (clipped
  to the number of key blocks, which FA4 requires and no list can exceed);
- the backward lists are the kv -> q transpose padded to ``num_q_blocks`` (`backward_lists`:
  two Triton kernels on CUDA, `padded_transpose` and tensor ops elsewhere).
  Whether a (query, key) block pair is full or partial depends on the key block only, so one
  padded index tensor serves both backward lists and only the counts differ.

Static bound of the backward lists: a key block may be selected by every query block (in
video models a few "sink" tiles are), so the only width that holds for every layout without
reading its data is ``num_q_blocks`` (FA4's own limit). The layout's width ``W`` (the longest
*forward* list) is no bound for the transpose. The padded tensor costs ``4 * B * H * NKV * NQ``
bytes, built only in the backward: 3 MiB at 32k tokens, 12 heads, 128x128 blocks; 79 MiB at
Wan 720p (92,160 tokens, 40 heads, 128x128 blocks).

Nothing here reads device data on the host: every shape follows from tensor shapes and the
plan, so the functions run inside CUDA graphs and under ``torch.compile``.
"""

from __future__ import annotations

import importlib.util

import torch
from torch._subclasses.fake_tensor import FakeTensor

from vsa_core.layout import BlockSparseLayout, transpose_kv_lists
from vsa_core.rotation import rotate_lists, rotation_starts
from vsa_fa4.lists import PackedSparseLists, SparseLists
from vsa_fa4.lists import empty_lists as empty_lists  # re-exported (its home before lists.py)
from vsa_fa4.schedule import Plan


def physical_lists(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    plan: Plan,
    q_group_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A logical layout's lists re-expressed in ``plan``'s physical blocks.

    Key blocks are split ``plan.kv_split`` ways (`BlockSparseLayout.refine`: the children of a
    partial key block get clamped valid sizes, so some become full and some empty); with
    ``plan.q_merge == 2`` the list of each aligned pair's first query block stands for the pair
    (a strided view, no copy), which is exact because the pair shares its list.
    """
    if plan.kv_split > 1:
        layout = BlockSparseLayout(
            kv_indices, kv_counts, kv_valid_sizes, plan.logical, q_group_size
        ).refine((plan.logical[0], plan.kv_tile))
        kv_indices, kv_counts, kv_valid_sizes = (
            layout.kv_indices,
            layout.kv_counts,
            layout.kv_valid_sizes,
        )
    if plan.q_merge > 1:
        kv_indices = kv_indices[:, :, :: plan.q_merge]
        kv_counts = kv_counts[:, :, :: plan.q_merge]
    return kv_indices, kv_counts, kv_valid_sizes


def forward_lists(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    kv_tile: int,
    impl: str = "auto",
    pack_valid: bool = False,
) -> SparseLists:
    """Per query block: selected full key blocks and selected partial key blocks, apart.

    Physical lists in, ascending order kept, empty key blocks dropped, unused entries zero (a
    valid block index). ``impl``: ``"triton"`` (one kernel, no transients,
    `vsa_fa4.forward_lists_triton`), ``"torch"`` (tensor ops) or ``"auto"``, as for
    `backward_lists`. Both give identical tensors. ``pack_valid``: `PackedSparseLists`, each
    used partial entry ``block | valid << 16`` (unused ones stay zero).

    The tensor ops: one scatter places every slot, full blocks at the start of the first third
    of a [B, H, NQ, 3W] buffer, partial ones at the start of the second, the rest (unused
    slots, empty blocks) in the last, each class in its original order: destinations are
    distinct (deterministic), and the buffer starts as zeros.
    """
    lead, width = kv_indices.shape[:-1], kv_indices.shape[-1]
    num_kv = kv_valid_sizes.shape[0]
    device = kv_indices.device
    use_triton = _use_triton(impl, kv_indices)
    if width == 0:  # a layout that can select nothing: one unused slot keeps FA4's shapes
        zero = torch.zeros(lead, dtype=torch.int32, device=device)
        idx = torch.zeros(*lead, 1, dtype=torch.int32, device=device)
        return (PackedSparseLists if pack_valid else SparseLists)(
            zero, idx, zero.clone(), idx.clone()
        )
    if use_triton:
        from vsa_fa4.forward_lists_triton import forward_lists_triton

        return forward_lists_triton(kv_indices, kv_counts, kv_valid_sizes, kv_tile, pack_valid)
    slots = torch.arange(width, device=device, dtype=torch.int32)
    used = slots < kv_counts.unsqueeze(-1)
    valid = kv_valid_sizes[kv_indices.long()]
    full = used & (valid >= kv_tile)
    partial = used & (valid > 0) & (valid < kv_tile)
    # Inclusive running counts of each class along the list (int32: small transients).
    n_full = full.cumsum(-1, dtype=torch.int32)
    n_partial = partial.cumsum(-1, dtype=torch.int32)
    n_rest = slots + 1 - n_full - n_partial
    dest = torch.where(
        full, n_full - 1, torch.where(partial, width + n_partial - 1, 2 * width + n_rest - 1)
    )
    packed = torch.zeros(*lead, 3 * width, dtype=torch.int32, device=device)
    packed.scatter_(-1, dest.long(), kv_indices.to(torch.int32))
    keep = min(width, num_kv)  # FA4: a list's width must not exceed the number of key blocks
    lists = SparseLists(
        mask_block_cnt=n_partial[..., -1].contiguous(),
        mask_block_idx=packed[..., width : width + keep].contiguous(),
        full_block_cnt=n_full[..., -1].contiguous(),
        full_block_idx=packed[..., :keep].contiguous(),
    )
    return _with_valid_sizes(lists, kv_valid_sizes) if pack_valid else lists


def _with_valid_sizes(lists: SparseLists, kv_valid_sizes: torch.Tensor) -> PackedSparseLists:
    """``lists`` with each used partial entry ``block | valid << 16`` (the fork's tensor ops)."""
    from flash_attn_vsa.valid_in_list_sm90 import pack_valid_sizes

    packed = pack_valid_sizes(lists.mask_block_idx, kv_valid_sizes, lists.mask_block_cnt)
    return PackedSparseLists(*lists._replace(mask_block_idx=packed))


def unmasked_forward_lists(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_kv: int
) -> SparseLists:
    """`forward_lists` of a layout whose key blocks are all full: the lists as they are, all in
    the full slots, no partial list (no split, so a few tensor ops fewer per call). Made
    contiguous: the paired schedule hands over strided views, and FA4 compiles its kernels
    for the strides it first sees."""
    zero = torch.zeros(kv_counts.shape, dtype=torch.int32, device=kv_counts.device)
    keep = min(kv_indices.shape[-1], num_kv)
    indices = kv_indices[..., :keep] if keep else zero.unsqueeze(-1)
    return SparseLists(
        zero, zero.unsqueeze(-1), kv_counts.to(torch.int32).contiguous(), indices.contiguous()
    )


def paired_forward_lists(
    lists: SparseLists, num_kv: int, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paired-key forward's four list tensors ``(mask_cnt, mask_idx, full_cnt, full_idx)``
    of packed 64-token key-block pairs, from `forward_lists` (or `unmasked_forward_lists`):
    `flash_attn_vsa.fwd_sm90_paired.pair_lists`. ``impl`` as for `forward_lists`:
    ``"triton"`` is one launch (`vsa_fa4.paired_lists_triton`) where the tensor ops are ~40."""
    if _use_triton(impl, lists.full_block_idx):
        from vsa_fa4.paired_lists_triton import pair_lists_triton

        return pair_lists_triton(*lists.by_class(), num_kv)
    from flash_attn_vsa.fwd_sm90_paired import pair_lists

    return pair_lists(*lists.by_class(), num_kv)


DENSE_TRANSPOSE_MAX_ENTRIES = 1 << 24
"""Up to this many entries in the [B, H, NKV, NQ] backward index tensor the transpose is built
densely (a dozen tensor ops); beyond it with `vsa_core.layout.transpose_kv_lists` (a sort,
about 50 ops), whose transients stay O(B * H * NQ * W) instead of O(B * H * NKV * NQ) int64."""


def padded_transpose(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block, the ascending query blocks that select it: ([B, H, NKV, NQ] int32
    indices, 0 past the count; [B, H, NKV] int32 counts). Sync-free; the path depends on
    shapes only (see `DENSE_TRANSPOSE_MAX_ENTRIES`)."""
    *lead, num_q, width = kv_indices.shape
    entries = num_kv * num_q
    for n in lead:
        entries *= n
    if entries > DENSE_TRANSPOSE_MAX_ENTRIES:
        q_indices, q_counts = transpose_kv_lists(kv_indices, kv_counts, num_kv).to_padded(num_q)
        return q_indices.contiguous(), q_counts.to(torch.int32).contiguous()
    device = kv_indices.device
    used = torch.arange(width, device=device) < kv_counts.unsqueeze(-1)
    # selected[b, h, i, j]: query block i selects key block j (unused slots hit column NKV).
    selected = torch.zeros(*lead, num_q, num_kv + 1, dtype=torch.bool, device=device)
    selected.scatter_(-1, torch.where(used, kv_indices.long(), num_kv), True)
    by_key = selected[..., :num_kv].transpose(-1, -2)  # [B, H, NKV, NQ]
    rank = torch.cumsum(by_key, dim=-1, dtype=torch.int32)  # inclusive, ascending query order
    dest = torch.where(by_key, rank - 1, num_q).long()  # unselected -> a dropped last column
    q_indices = torch.zeros(*lead, num_kv, num_q + 1, dtype=torch.int32, device=device)
    queries = torch.arange(num_q, device=device, dtype=torch.int32).expand(by_key.shape)
    q_indices.scatter_(-1, dest, queries)
    return q_indices[..., :num_q].contiguous(), rank[..., -1].contiguous()


def backward_lists(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    kv_tile: int,
    masked: bool = True,
    q_split: int = 1,
    impl: str = "auto",
    rotate_sms: int = 0,
) -> SparseLists:
    """Per key block: the query blocks selecting it, as full or partial lists (physical lists
    in). Padded to ``num_q_blocks`` (see the module doc for why that bound); one index tensor
    is shared by both lists, the counts say which list a key block's queries are in (an empty
    key block is in neither: FA4 then writes zero dK/dV for it). ``masked=False``: every key
    block is known to be full, so all go in the full lists. ``q_split``: each listed query
    block stands for that many physical query blocks (``i -> i * q_split + s``), so that a
    128-row list can feed a 64-row backward without repeating it first (`ops.backward_impl`
    no longer needs it since the fork's backward runs 128x64 blocks; kept, and tested, for
    block shapes whose backward tile is finer than their query block).

    ``rotate_sms`` (0: off; the backward op passes `vsa_fa4.ops.rotation_width`): each list
    starts at its first query block at or past ``(order * NQ // rotate_sms) % NQ`` and wraps
    around, ``order`` being the key block's place in FA4's backward grid (key blocks fastest,
    then heads, then batch). Key blocks start one after another as CTAs free up, so with
    ascending lists the running ones are spread over the whole query range and their dQ
    reduce-adds touch a head's whole float32 accumulator (67 MB at S=131072, more than an
    H200's L2); rotated by the number of CTAs running at once, a key block starting later also
    starts further on, and the running ones walk the same stretch of query blocks together
    (`vsa_core.rotation`; needs ``q_split`` 1).

    ``impl``: ``"triton"`` (two kernels and a memset, `vsa_fa4.backward_lists_triton`),
    ``"torch"`` (tensor ops, also what runs under a fake tensor mode and on the CPU) or
    ``"auto"``: triton for real CUDA tensors when Triton imports, else torch. Both give
    identical tensors."""
    if rotate_sms < 0 or (rotate_sms and q_split != 1):
        raise ValueError(f"rotate_sms must be >= 0 and needs q_split 1, got {rotate_sms}")
    if _use_triton(impl, kv_indices):
        from vsa_fa4.backward_lists_triton import backward_lists_triton

        return backward_lists_triton(
            kv_indices, kv_counts, kv_valid_sizes, kv_tile, masked, q_split, rotate_sms
        )
    if q_split > 1:
        kv_indices = kv_indices.repeat_interleave(q_split, dim=-2)
        kv_counts = kv_counts.repeat_interleave(q_split, dim=-1)
    num_kv = kv_valid_sizes.shape[0]
    q_indices, q_counts = padded_transpose(kv_indices, kv_counts, num_kv)
    if rotate_sms:
        starts = rotation_starts(q_indices.shape, q_indices.shape[-1], rotate_sms, q_indices.device)
        q_indices = rotate_lists(q_indices, q_counts, starts)
    zero = torch.zeros_like(q_counts)
    if not masked:  # every key block full: everything in the full lists
        return SparseLists(zero, zero.unsqueeze(-1), q_counts, q_indices)
    full = kv_valid_sizes >= kv_tile
    partial = (kv_valid_sizes > 0) & (kv_valid_sizes < kv_tile)
    return SparseLists(
        mask_block_cnt=torch.where(partial, q_counts, zero),
        mask_block_idx=q_indices,
        full_block_cnt=torch.where(full, q_counts, zero),
        full_block_idx=q_indices,
    )


def _use_triton(impl: str, t: torch.Tensor) -> bool:
    """Whether a list builder called with ``impl`` on ``t`` runs its Triton kernel."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    return impl == "triton" or (impl == "auto" and _triton_can_run(t))


def _triton_can_run(t: torch.Tensor) -> bool:
    """Real (not fake) CUDA tensors and an importable Triton."""
    if t.device.type != "cuda" or isinstance(t, FakeTensor):
        return False
    return importlib.util.find_spec("triton") is not None

"""Torch-facing ops: ``torch.ops.vsa_fa4.fwd`` / ``torch.ops.vsa_fa4.bwd`` and `attention`.

Both are `torch.library.custom_op`s with fake implementations and autograd, so that
``torch.compile(fullgraph=True)`` traces through them and CUDA graphs capture them. They take a
layout's *physical* lists (see `vsa_fa4.schedule` and `vsa_fa4.metadata.physical_lists`) and
build FA4's index tensors inside, on the device, without a host sync:

- ``fwd`` builds the forward lists only (full and partial key blocks apart). Inference never
  builds backward metadata.
- ``bwd`` (run by autograd) builds the key-block-owned backward lists from the same saved
  physical lists, when and only when gradients are asked for.

Outputs are allocated here, contiguous BSHD (``out``, ``dq``, ``dk``, ``dv``) and [B, H, S]
(``lse``), and FA4 writes into them, so the fake implementations state their strides exactly.
BSHD is FA4's native layout; BHSD tensors arrive as transposed views and FA4 reads them through
their strides (no copy). FA4 itself is imported on the first launch (`vsa_fa4.launch`).

Which fork kernels run is the ops' last argument, ``kernels``: a `vsa_fa4.launch.KernelChoice`
encoded as a string ("" for the shipped kernels), decoded and handed to `vsa_fa4.launch`.
"""

from __future__ import annotations

import torch

from vsa_core.backends.custom_ops import (
    EagerOrOp,
    block_sparse_eager,
    register_block_sparse_autograd,
)
from vsa_core.coarse import combine_tiles
from vsa_core.layout import ForwardSplit
from vsa_core.rotation import rotation_width
from vsa_fa4 import launch
from vsa_fa4.metadata import (
    PackedSparseLists,
    backward_lists,
    forward_lists,
    physical_lists,
    unmasked_forward_lists,
)
from vsa_fa4.schedule import Plan


def _bshd(q: torch.Tensor, head_dim: int) -> torch.Tensor:
    batch, seq, heads, _ = q.shape
    return q.new_empty((batch, seq, heads, head_dim))


def _lse(q: torch.Tensor) -> torch.Tensor:
    batch, seq, heads, _ = q.shape
    return q.new_empty((batch, heads, seq), dtype=torch.float32)


def _forward_lists(kv_indices, kv_counts, kv_valid_sizes, kv_tile, masked, pack_valid=False):
    """FA4's forward lists: full and partial key blocks apart (``masked``; with ``pack_valid``
    the partial entries carry their valid sizes, `PackedSparseLists`), or all as full."""
    if masked:
        return forward_lists(kv_indices, kv_counts, kv_valid_sizes, kv_tile, pack_valid=pack_valid)
    return unmasked_forward_lists(kv_indices, kv_counts, kv_valid_sizes.shape[0])


def _lists_for(q, kv_indices, kv_counts, kv_valid_sizes, block_size, masked, variant,
               split=None):  # fmt: skip
    """The forward's lists for `launch.run_forward` on ``block_size`` blocks: with valid sizes in
    the partial entries wherever the kernel it runs reads them (`launch.takes_valid_in_list`),
    there taken as they are from ``split`` (a `ForwardSplit`'s tensors, the same format) when
    the coarse stage wrote one."""
    pack = masked and launch.takes_valid_in_list(q, kv_valid_sizes, block_size, variant)
    if pack and split is not None:
        full_idx, full_cnt, partial_idx, partial_cnt = split
        return PackedSparseLists(partial_cnt, partial_idx, full_cnt, full_idx)
    return _forward_lists(kv_indices, kv_counts, kv_valid_sizes, block_size[1], masked, pack)


def _given_split(split: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...] | None:
    """The four ``split_*`` tensors of an op's call, or None when none is given."""
    given = sum(t is not None for t in split)
    if given not in (0, 4):
        raise ValueError("give all four split_* tensors or none")
    return split if given else None


def forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    q_tile: int,
    kv_tile: int,
    masked: bool = True,
    kernels: str = "",
    split_full_idx: torch.Tensor | None = None,
    split_full_cnt: torch.Tensor | None = None,
    split_partial_idx: torch.Tensor | None = None,
    split_partial_cnt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4 block-sparse forward on [B, S, H, D] views with physical ``q_tile`` x ``kv_tile``
    lists ([B, H, Sq / q_tile, W] indices, [B, H, Sq / q_tile] counts, [Skv / kv_tile] valid
    sizes). ``masked=False`` promises that no key block is partial (no mask_mod compiled in).
    Returns (out [B, Sq, H, D], lse [B, H, Sq] float32, natural log, -inf for rows that see
    no key). ``kernels``: the fork kernels to run (`vsa_fa4.launch.KernelChoice.encode`; ""
    for the shipped ones). ``split_*``: the lists' `vsa_core.layout.ForwardSplit` (all four or
    none), as for `forward_combined_impl`; the backward never reads them (the op's autograd
    keeps none of them). The body of ``torch.ops.vsa_fa4.fwd`` (`block_sparse_fwd`); the
    compile gate calls it directly, since under a fake tensor mode the op would run its fake."""
    out, lse = _bshd(q, v.shape[-1]), _lse(q)
    variant = launch.KernelChoice.decode(kernels).forward
    split = _given_split((split_full_idx, split_full_cnt, split_partial_idx, split_partial_cnt))
    lists = _lists_for(q, kv_indices, kv_counts, kv_valid_sizes, (q_tile, kv_tile), masked,
                       variant, split)  # fmt: skip
    launch.run_forward(
        q, k, v, out, lse, lists, kv_valid_sizes.contiguous(), scale, (q_tile, kv_tile), masked,
        variant=variant,
    )  # fmt: skip
    return out, lse


block_sparse_fwd = torch.library.custom_op("vsa_fa4::fwd", forward_impl, mutates_args=())


@block_sparse_fwd.register_fake
def _(
    q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, q_tile, kv_tile, masked=True,
    kernels="", split_full_idx=None, split_full_cnt=None, split_partial_idx=None,
    split_partial_cnt=None,
):  # fmt: skip
    return _bshd(q, v.shape[-1]), _lse(q)


def forward_combined_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    coarse: torch.Tensor,
    gate: torch.Tensor | None,
    scale: float,
    masked: bool = True,
    kernels: str = "",
    split_full_idx: torch.Tensor | None = None,
    split_full_cnt: torch.Tensor | None = None,
    split_partial_idx: torch.Tensor | None = None,
    split_partial_cnt: torch.Tensor | None = None,
) -> torch.Tensor:
    """VSA's output ``fine + gate * coarse[query block]`` from the 64x64 forward with the
    combine in its epilogue (`vsa_fa4.launch.combines_in_epilogue`), no gradients and no lse:
    ``coarse`` [B, Sq / 64, H, D], ``gate`` like the output (any stride 0) or None (1); the
    other arguments as `forward_impl`'s at 64x64 physical blocks. ``split_*``: the lists'
    `vsa_core.layout.ForwardSplit` where the coarse stage wrote it (all four or none): the
    forward reads it as its `PackedSparseLists` instead of splitting the lists itself. The
    body of ``torch.ops.vsa_fa4.fwd_combined``."""
    out = _bshd(q, v.shape[-1])
    variant = launch.KernelChoice.decode(kernels).forward
    split = _given_split((split_full_idx, split_full_cnt, split_partial_idx, split_partial_cnt))
    lists = _lists_for(q, kv_indices, kv_counts, kv_valid_sizes, (64, 64), masked, variant,
                       split)  # fmt: skip
    launch.run_forward(
        q, k, v, out, None, lists, kv_valid_sizes.contiguous(), scale, (64, 64), masked,
        variant=variant, combine=(coarse, gate),
    )  # fmt: skip
    return out


block_sparse_fwd_combined = torch.library.custom_op(
    "vsa_fa4::fwd_combined", forward_combined_impl, mutates_args=()
)


@block_sparse_fwd_combined.register_fake
def _(q, k, v, kv_indices, kv_counts, kv_valid_sizes, coarse, gate, scale, masked=True,
      kernels="", split_full_idx=None, split_full_cnt=None, split_partial_idx=None,
      split_partial_cnt=None):  # fmt: skip
    return _bshd(q, v.shape[-1])


DQ_ACCUM_BUDGET_BYTES = 512 << 20
"""Most bytes of FA4's float32 dQ accumulator (B x H x S x D x 4, allocated inside each
backward call) one backward launch may take: larger calls run in head chunks. At Wan 2.1 720p
(40 heads, 92,160 tokens, D = 128) one call's accumulator is 1.9 GB, the largest part of what
fa4's training step needs beyond Triton's (7,684 against 5,593 MiB on an H200, 2026-11-29)."""


DS_BUDGET_BYTES = 8 << 30
"""Most bytes of the dS buffer (one 64x64 tile in q's dtype per listed (query block, key
block) pair: batch x NQ x W x 8 KB a head at 2 bytes) one backward launch of the dS-writing
backward may take (`flash_attn_vsa.bwd_sm90_ds_out`): larger calls run in head chunks, one
head a chunk at least. At S=32768 with 64 of 512 key blocks a head takes 256 MiB; at Wan 2.1
480p (624 query blocks, 78 listed, 12 heads) all heads 4.5 GiB, one launch; at Wan 2.1 720p
(1,440, 180) 2.0 GiB a head, four a launch; HunyuanVideo 720p (2,160, 270) 4.5 GiB a head.
Each chunk costs ~0.25-0.45 ms (the key kernel's last wave, a chunk's launches): on an H100
(session 27, whole op, forward+backward, once / back to back) Wan 480p ran 2.95x / 3.23x of
dense with this budget against 2.83x / 3.11x with 2 GiB (three chunks), Wan 720p 3.42x / 3.44x
against 3.17x / 3.24x (forty chunks). A smaller
budget: ``KernelChoice(ds_budget_bytes=...)``."""


DS_TILE_BYTES = 64 * 64 * 2
"""Bytes of one dS tile (64x64, 16-bit)."""


def head_chunks(
    batch: int,
    heads: int,
    q_len: int,
    head_dim: int,
    ds_tiles_per_head: int = 0,
    ds_budget_bytes: int | None = None,
) -> list[slice]:
    """Head ranges whose backward calls each keep FA4's dQ accumulator within
    `DQ_ACCUM_BUDGET_BYTES` and, with ``ds_tiles_per_head`` (the dS-writing backward's 64x64
    tiles a head), the dS buffer within ``ds_budget_bytes`` (None: `DS_BUDGET_BYTES`; one
    range, all heads, when the whole call does), in as few ranges as that allows, of sizes as
    even as they go."""
    per_head = batch * q_len * head_dim * 4
    step = max(1, min(heads, DQ_ACCUM_BUDGET_BYTES // max(per_head, 1)))
    if ds_tiles_per_head:
        budget = DS_BUDGET_BYTES if ds_budget_bytes is None else ds_budget_bytes
        step = max(1, min(step, budget // (ds_tiles_per_head * DS_TILE_BYTES)))
    step = -(-heads // -(-heads // step))  # as many chunks, as even as they go (12: 4+4+4)
    return [slice(h, min(h + step, heads)) for h in range(0, heads, step)]


def backward_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    q_tile: int,
    kv_tile: int,
    masked: bool = True,
    kernels: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of `forward_impl`, from FA4's key-block-owned backward (the
    body of ``torch.ops.vsa_fa4.bwd``). Large calls run as several launches over `head_chunks`
    (head-sliced views in and out; the lists of each chunk built just before it), so that the
    float32 dQ accumulator FA4 allocates per call stays within `DQ_ACCUM_BUDGET_BYTES`. The
    lists are rotated by `vsa_core.rotation.rotation_width` times the CTAs an SM runs at once
    (the KV64 backward's dQ reduce-adds stay within L2 at long sequences: 0.42 -> 0.71 of dense
    at S=131072 on an H200; a two-CTA kernel measured 0.42 rotated by the SM count, 0.66 by
    twice it). ``kernels`` as for `forward_impl` (its backward tile configuration here,
    `launch.KernelChoice.backward_for`: for 64x64 blocks by default the dS-writing backward,
    `_backward_from_ds`, whose dS buffer decides the chunks)."""
    dq, dk, dv = _bshd(q, q.shape[-1]), _bshd(k, k.shape[-1]), _bshd(v, v.shape[-1])
    valid = kv_valid_sizes.contiguous()
    batch, q_len, heads, head_dim = q.shape
    choice = launch.KernelChoice.decode(kernels)
    config = choice.backward_for((q_tile, kv_tile))
    rotate = rotation_width(q.device) * launch.backward_ctas_per_sm((q_tile, kv_tile), config)
    tensors = (dout, q, k, v, out, lse, dq, dk, dv, kv_indices, kv_counts)
    if config is not None and config.dq_from_ds:
        _backward_from_ds(tensors, valid, scale, (q_tile, kv_tile), masked, choice, rotate)
        return dq, dk, dv
    for chunk in _head_ranges(tensors, head_chunks(batch, heads, q_len, head_dim)):
        *grads_from, indices, counts = chunk
        lists = backward_lists(indices, counts, valid, kv_tile, masked, rotate_sms=rotate)
        launch.run_backward(
            *grads_from, lists, valid, scale, (q_tile, kv_tile), masked, config=config
        )
    return dq, dk, dv


def _backward_from_ds(
    tensors: tuple[torch.Tensor, ...],
    valid: torch.Tensor,
    scale: float,
    block_size: tuple[int, int],
    masked: bool,
    choice: launch.KernelChoice,
    rotate: int,
) -> None:
    """`backward_impl` on the dS-writing backward (delta 12): per head chunk, the key-owned
    kernel writes dK, dV and every pair's dS, then `dq_from_ds` computes dQ from them in a
    fixed order (no atomics: dq, dk and dv are bitwise reproducible). One dS buffer, sized
    for the largest chunk, serves every chunk in turn."""
    from vsa_fa4.dq_from_ds_triton import dq_from_ds, ds_slots

    if tuple(block_size) != (64, 64):
        raise ValueError(f"the dS-writing backward runs 64x64 blocks, got {block_size}")
    q, kv_indices = tensors[1], tensors[-2]
    batch, q_len, heads, head_dim = q.shape
    tiles_per_head = batch * kv_indices.shape[-2] * kv_indices.shape[-1]
    chunks = head_chunks(batch, heads, q_len, head_dim, tiles_per_head, choice.ds_budget_bytes)
    ds = _ds_buffer(q, tiles_per_head, max(c.stop - c.start for c in chunks))
    config = choice.backward_for(block_size)
    for chunk in _head_ranges(tensors, chunks):
        dout, q, k, v, out, lse, dq, dk, dv, indices, counts = chunk
        # contiguous once (a head chunk's are views): the marking pass and the dQ pass read them
        indices, counts = indices.contiguous(), counts.contiguous()
        placed = ds_slots(indices, counts, valid, masked, rotate)
        launch.run_backward(
            dout, q, k, v, out, lse, dq, dk, dv, placed.lists, valid, scale, block_size, masked,
            config=config, ds_out=(ds, placed.starts),
        )  # fmt: skip
        dq_from_ds(ds, k, dq, indices, counts, placed.slots, scale)


def _ds_buffer(q: torch.Tensor, tiles_per_head: int, heads: int) -> torch.Tensor:
    """The dS buffer of `_backward_from_ds` for launches of ``heads`` heads; where it does not
    fit, the out-of-memory error says what asked for it and what needs less."""
    rows = max(tiles_per_head * heads, 1) * 64
    try:
        return q.new_empty((rows, 64))
    except torch.OutOfMemoryError as error:
        size = rows * 64 * q.element_size() / 2**30
        raise torch.OutOfMemoryError(
            f"vsa-fa4's dS-writing backward (the default for 64x64 blocks) asked for a "
            f"{size:.2f} GiB dS buffer ({heads} head(s) a launch, 8 KB a selected block pair): "
            "a backend with a smaller vsa_fa4.launch.KernelChoice(ds_budget_bytes=...) runs "
            "more launches of fewer heads, and KernelChoice(backward=flash_attn_vsa.bwd_sm90."
            f"KV64_CONFIG) needs no dS buffer (float32 dQ reductions instead). {error}"
        ) from error


_HEAD_DIMS = (2, 2, 2, 2, 2, 1, 2, 2, 2, 1, 1)
"""Where `backward_impl`'s tensors hold heads: dim 2 of BSHD ones, dim 1 of lse and lists."""


def _head_ranges(
    tensors: tuple[torch.Tensor, ...], chunks: list[slice]
) -> list[tuple[torch.Tensor, ...]]:
    """Per head range, the tensors' views over it: the tensors themselves for one range (all
    heads), else one ``split`` per tensor (half the host time of a ``narrow`` per view: 56
    against 117 us for Wan 720p's four ranges on this project's CPU machine,
    `research.host_micro_cpu`)."""
    if len(chunks) == 1:
        return [tensors]
    sizes = [h.stop - h.start for h in chunks]
    views = [t.split(sizes, dim) for t, dim in zip(tensors, _HEAD_DIMS, strict=True)]
    return list(zip(*views, strict=True))


block_sparse_bwd = torch.library.custom_op("vsa_fa4::bwd", backward_impl, mutates_args=())


@block_sparse_bwd.register_fake
def _(
    dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, scale, q_tile, kv_tile,
    masked=True, kernels="",
):  # fmt: skip
    return _bshd(q, q.shape[-1]), _bshd(k, k.shape[-1]), _bshd(v, v.shape[-1])


SPLIT_INPUTS = 4
"""The forward op's last inputs, the ``split_*`` tensors: forward only (`vsa_core.backends.
custom_ops`' ``forward_only``): the backward neither takes nor keeps them."""

register_block_sparse_autograd(block_sparse_fwd, block_sparse_bwd, forward_only=SPLIT_INPUTS)
_eager_or_op = block_sparse_eager(
    block_sparse_fwd, forward_impl, backward_impl, forward_only=SPLIT_INPUTS
)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    plan: Plan,
    q_group_size: int = 1,
    kv_blocks_full: bool = False,
    kernels: launch.KernelChoice = launch.SHIPPED,
    forward_split: ForwardSplit | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of a logical layout's lists under ``plan`` (BSHD views in and
    out). Plain tensor ops and the custom op only, so it traces whole under torch.compile; in
    eager mode the op's functions run without the custom-op dispatcher (`EagerOrOp`).
    ``kv_blocks_full`` (a layout's flag) drops the partial-block mask_mod from the kernels;
    ``kernels`` picks the fork kernels (`vsa_fa4.launch.KernelChoice`, default the shipped
    ones); ``forward_split``: the lists' `ForwardSplit` (a layout's ``forward_split``), read
    by the forward in place of its own split where the plan runs the logical blocks as they
    are and its kernel reads valid sizes in the list entries."""
    kv_indices, kv_counts, kv_valid_sizes = physical_lists(
        kv_indices, kv_counts, kv_valid_sizes, plan, q_group_size
    )
    return _eager_or_op(
        q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, plan.q_tile, plan.kv_tile,
        not kv_blocks_full, kernels.encode(), *_split_for(plan, forward_split),
    )  # fmt: skip


def _split_for(plan: Plan, forward_split: ForwardSplit | None) -> tuple[torch.Tensor | None, ...]:
    """The ``split_*`` inputs of an op call under ``plan``: the split's tensors where its
    physical lists are the logical ones it was written for, else four Nones."""
    if forward_split is None or tuple(plan.logical) != plan.block_size:
        return (None,) * SPLIT_INPUTS
    return tuple(forward_split)


_combined_eager_or_op = EagerOrOp(block_sparse_fwd_combined, forward_combined_impl)


def attention_combined(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    plan: Plan,
    coarse: torch.Tensor,
    gate: torch.Tensor | None,
    q_group_size: int = 1,
    kv_blocks_full: bool = False,
    kernels: launch.KernelChoice = launch.SHIPPED,
    forward_split: ForwardSplit | None = None,
) -> torch.Tensor:
    """`attention` with VSA's combine, no gradients: ``fine + gate * coarse[query block]``
    (``coarse`` [B, NQ, H, D] of the logical query blocks, ``gate`` like q or None). In the
    forward's epilogue where the plan runs the 64x64 forward that takes it
    (`vsa_fa4.launch.combines_in_epilogue`), else the forward then one in-place multiply-add.
    ``forward_split``: the lists' `ForwardSplit` (a layout's ``forward_split``), read in place
    of the forward's own split where the plan runs the logical 64x64 blocks as they are."""
    if plan.q_merge == 1 and launch.combines_in_epilogue(
        q, kv_valid_sizes, plan.block_size, kernels.forward
    ):
        kv_indices, kv_counts, kv_valid_sizes = physical_lists(
            kv_indices, kv_counts, kv_valid_sizes, plan, q_group_size
        )
        return _combined_eager_or_op(
            q, k, v, kv_indices, kv_counts, kv_valid_sizes, coarse, gate, scale,
            not kv_blocks_full, kernels.encode(), *_split_for(plan, forward_split),
        )  # fmt: skip
    out, _ = attention(
        q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, plan, q_group_size,
        kv_blocks_full, kernels,
    )  # fmt: skip
    return combine_tiles(out, coarse, gate, out.shape[1] // coarse.shape[1])  # in place

"""Torch-facing block-sparse attention ops: ``torch.ops.vsa_triton.fwd`` / ``bwd``.

Registered with `torch.library.custom_op`, with fake (meta) implementations and autograd, so
that `torch.compile(fullgraph=True)` traces through them and CUDA graphs capture them: nothing
here reads device data on the host. In eager mode the backend calls the same functions without
the custom-op dispatcher (`attention`). Triton is imported on first use, not with this module.
"""

from __future__ import annotations

import functools
import math

import torch

from vsa_core.backends.custom_ops import (
    EagerOrOp,
    block_sparse_eager,
    register_block_sparse_autograd,
)
from vsa_core.rotation import rotation_width
from vsa_triton.config import backward_config, forward_config
from vsa_triton.launch_cache import launch
from vsa_triton.tensor_args import bshd_strides, gate_strides, head_dim_contiguous

LOG2E = 1.0 / math.log(2.0)


@functools.cache
def _kernels():
    from vsa_triton import kernels  # lazy: triton is imported on the first launch

    return kernels


def _interpreting() -> bool:
    from vsa_triton.environment import interpreting

    return interpreting()


def forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    q_block: int,
    kv_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention forward on [B, S, H, D] views; returns (out, lse [B, H, S]). The
    body of ``torch.ops.vsa_triton.fwd`` (`block_sparse_fwd`)."""
    return _forward(q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block)


def forward_rows_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    slot_rows: torch.Tensor,
    scale: float,
    q_block: int,
    kv_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_impl` on q, k, v in a latent's raster order ([B, T*H*W, H, D], self-attention):
    ``slot_rows`` ([padded_len] int32, `vsa_core.tiling.TilingIndices.slot_rows`) gives the row
    of each tile-order slot the layout speaks of (-1: padding, never read or written). out is
    in raster order like q; lse is per slot, [B, H, padded_len]. The body of
    ``torch.ops.vsa_triton.fwd_rows``."""
    return _forward(q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block,
                    slot_rows)  # fmt: skip


def forward_combined_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    slot_rows: torch.Tensor | None,
    coarse: torch.Tensor,
    gate: torch.Tensor | None,
    scale: float,
    q_block: int,
    kv_block: int,
) -> torch.Tensor:
    """VSA's output ``fine + gate * coarse[query block]`` with the combine in the forward's
    epilogue (no gradients): coarse [B, NQ, H, D], the gate (None: 1) shaped like q in q's
    token order, any stride 0; q, k, v in tile order, or in raster order with ``slot_rows``
    (see `forward_rows_impl`). The body of ``torch.ops.vsa_triton.fwd_combined``."""
    out, _ = _forward(q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block,
                      slot_rows, head_dim_contiguous(coarse), gate)  # fmt: skip
    return out


def _forward(q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block,
             slot_rows=None, coarse=None, gate=None):  # fmt: skip
    q, k, v = (head_dim_contiguous(t) for t in (q, k, v))
    batch, _, heads, dim = q.shape
    slots = _slots(q, slot_rows)
    out = torch.empty_like(q)
    # the combined forward is an inference output: no lse (nothing would read it)
    lse = None if coarse is not None else q.new_empty((batch, heads, slots), dtype=torch.float32)
    kv_indices, kv_counts = kv_indices.contiguous(), kv_counts.contiguous()
    kv_slots = _slots(k, slot_rows)
    head_kv_bytes = kv_slots * (k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size())
    width = rotation_width(q.device, head_kv_bytes)
    if width:
        kv_indices = rotate_lists(kv_indices, kv_counts, kv_valid_sizes.shape[0], width)
    cfg = forward_config(q_block, kv_block, dim)
    grid = (slots // q_block, batch * heads)
    launch(_kernels().fwd_kernel, grid,
        q, k, v, out, _or(lse, out),
        kv_indices, kv_counts, kv_valid_sizes,
        _or(slot_rows, kv_valid_sizes), _or(coarse, q), _or(gate, q),  # placeholders: unread
        *bshd_strides(q), *bshd_strides(k), *bshd_strides(v), *bshd_strides(out),
        kv_indices.stride(0), kv_indices.stride(1), kv_indices.stride(2),
        kv_counts.stride(0), kv_counts.stride(1),
        *bshd_strides(coarse), *gate_strides(gate),
        heads, slots, scale * LOG2E,
        Q_BLOCK=q_block, KV_BLOCK=kv_block, TILE_N=cfg.tile, HEAD_DIM=dim,
        INTERPRET=_interpreting(), DUAL=cfg.dual, RASTER=slot_rows is not None,
        COMBINE=coarse is not None, HAS_GATE=gate is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, lse


def _slots(x: torch.Tensor, slot_rows: torch.Tensor | None) -> int:
    """Tile-order length of a token tensor: its own, or the map's when it is in raster order."""
    return x.shape[1] if slot_rows is None else slot_rows.shape[0]


def _or(x: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    return placeholder if x is None else x


def rotate_lists(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_kv: int, width: int
) -> torch.Tensor:
    """The forward's key lists in the order it walks them: each rotated for the L2 cache as in
    `vsa_core.rotation` (one small kernel), run when one head's K and V exceed the L2: the
    forward at S=131072 on an H200 went from 0.50 to 0.58 of dense FA4, unchanged at S=32768
    and at Wan 720p, whose K and V fit (fork experiment 7). Contiguous lists in, new int32
    lists out."""
    rotated = torch.empty_like(kv_indices, dtype=torch.int32)
    rows, slots = kv_counts.numel(), kv_indices.shape[-1]
    if rows and slots:
        launch(_kernels().rotate_lists_kernel, (rows,),
            kv_indices, kv_counts, rotated, slots, num_kv, width,
            SLOTS_P2=triton_next_pow2(slots), num_warps=1,
        )  # fmt: skip
    return rotated


block_sparse_fwd = torch.library.custom_op("vsa_triton::fwd", forward_impl, mutates_args=())


@block_sparse_fwd.register_fake
def _(q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block):
    batch, seq_q, heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


block_sparse_fwd_rows = torch.library.custom_op(
    "vsa_triton::fwd_rows", forward_rows_impl, mutates_args=()
)


@block_sparse_fwd_rows.register_fake
def _(q, k, v, kv_indices, kv_counts, kv_valid_sizes, slot_rows, scale, q_block, kv_block):
    batch, _, heads, _ = q.shape
    lse = q.new_empty((batch, heads, slot_rows.shape[0]), dtype=torch.float32)
    return torch.empty_like(q), lse


block_sparse_fwd_combined = torch.library.custom_op(
    "vsa_triton::fwd_combined", forward_combined_impl, mutates_args=()
)


@block_sparse_fwd_combined.register_fake
def _(q, k, v, kv_indices, kv_counts, kv_valid_sizes, slot_rows, coarse, gate, scale, q_block,
      kv_block):  # fmt: skip
    return torch.empty_like(q)


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
    q_block: int,
    kv_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv): dK/dV owned per key block, dQ per query block, no atomics (the
    body of ``torch.ops.vsa_triton.bwd``)."""
    return _backward(dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, scale,
                     q_block, kv_block)  # fmt: skip


def backward_rows_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    slot_rows: torch.Tensor,
    scale: float,
    q_block: int,
    kv_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`backward_impl` in raster order (`forward_rows_impl`): dout and the gradients like q,
    lse per slot (the body of ``torch.ops.vsa_triton.bwd_rows``)."""
    return _backward(dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, scale,
                     q_block, kv_block, slot_rows)  # fmt: skip


def _backward(dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, scale, q_block,
              kv_block, slot_rows=None):  # fmt: skip
    from vsa_core.layout import transpose_kv_lists

    dout, q, k, v, out = (head_dim_contiguous(t) for t in (dout, q, k, v, out))
    batch, _, heads, dim = q.shape
    slots = lse.shape[-1]
    num_kv = kv_valid_sizes.shape[0]
    kv_indices, kv_counts = kv_indices.contiguous(), kv_counts.contiguous()
    lists = transpose_kv_lists(kv_indices, kv_counts, num_kv)
    kern = _kernels()
    cfg = backward_config(q_block, kv_block, dim)
    rows_map = _or(slot_rows, kv_valid_sizes)  # a placeholder without RASTER: never read
    raster = slot_rows is not None

    delta = torch.empty(batch, heads, slots, device=q.device, dtype=torch.float32)
    rows = 64
    launch(kern.bwd_delta_kernel, (triton_cdiv(slots, rows), batch * heads),
        out, dout, delta, rows_map, *bshd_strides(out), *bshd_strides(dout), heads, slots,
        ROWS=rows, HEAD_DIM=dim, RASTER=raster, num_warps=4,
    )  # fmt: skip

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launch(kern.bwd_dkdv_kernel, (num_kv, batch * heads),
        q, k, v, dout, lse, delta, dk, dv,
        lists.q_indices, lists.q_offsets, kv_valid_sizes, rows_map,
        *bshd_strides(q), *bshd_strides(k), *bshd_strides(v), *bshd_strides(dout),
        *bshd_strides(dk), *bshd_strides(dv),
        lists.q_indices.stride(0), lists.q_indices.stride(1),
        lists.q_offsets.stride(0), lists.q_offsets.stride(1),
        heads, slots, scale * LOG2E, scale,
        Q_BLOCK=q_block, KV_BLOCK=kv_block, TILE_M=cfg.tile_dkdv, HEAD_DIM=dim,
        INTERPRET=_interpreting(), RASTER=raster,
        num_warps=cfg.num_warps_dkdv, num_stages=cfg.num_stages_dkdv,
    )  # fmt: skip
    launch(kern.bwd_dq_kernel, (slots // q_block, batch * heads),
        q, k, v, dout, lse, delta, dq,
        kv_indices, kv_counts, kv_valid_sizes, rows_map,
        *bshd_strides(q), *bshd_strides(k), *bshd_strides(v), *bshd_strides(dout),
        *bshd_strides(dq),
        kv_indices.stride(0), kv_indices.stride(1), kv_indices.stride(2),
        kv_counts.stride(0), kv_counts.stride(1),
        heads, slots, scale * LOG2E, scale,
        Q_BLOCK=q_block, KV_BLOCK=kv_block, TILE_N=cfg.tile_dq, HEAD_DIM=dim,
        INTERPRET=_interpreting(), RASTER=raster,
        num_warps=cfg.num_warps_dq, num_stages=cfg.num_stages_dq,
    )  # fmt: skip
    return dq, dk, dv


block_sparse_bwd = torch.library.custom_op("vsa_triton::bwd", backward_impl, mutates_args=())


@block_sparse_bwd.register_fake
def _(dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_block_sparse_autograd(block_sparse_fwd, block_sparse_bwd)
attention = block_sparse_eager(block_sparse_fwd, forward_impl, backward_impl)
"""What the backend calls: ``torch.ops.vsa_triton.fwd`` under torch.compile, its plain
functions in eager mode (`vsa_core.backends.custom_ops.EagerOrOp`)."""

block_sparse_bwd_rows = torch.library.custom_op(
    "vsa_triton::bwd_rows", backward_rows_impl, mutates_args=()
)


@block_sparse_bwd_rows.register_fake
def _(dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, slot_rows, scale, q_block,
      kv_block):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


ROWS_SAVED_INPUTS = 7  # q, k, v, kv_indices, kv_counts, kv_valid_sizes, slot_rows
register_block_sparse_autograd(block_sparse_fwd_rows, block_sparse_bwd_rows, ROWS_SAVED_INPUTS)
attention_rows = block_sparse_eager(
    block_sparse_fwd_rows, forward_rows_impl, backward_rows_impl, ROWS_SAVED_INPUTS
)
"""`attention` on tensors in raster order (``torch.ops.vsa_triton.fwd_rows``)."""

attention_combined = EagerOrOp(block_sparse_fwd_combined, forward_combined_impl)
"""The forward with VSA's combine in its epilogue, no gradients
(``torch.ops.vsa_triton.fwd_combined``)."""


def triton_next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

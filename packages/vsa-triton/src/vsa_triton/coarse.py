"""VSA's coarse stage in Triton: ``torch.ops.vsa_triton.pool_qkv`` and ``select_topk``.

Registered as a ``vsa.coarse`` plug-in (`TritonCoarse`), which vsa-core's `video_sparse_attn`
runs instead of its torch path on CUDA tensors (see `vsa_core.coarse`). Two launches replace
the torch path's few dozen small ones:

- ``pool_qkv``: q, k and v pooled per tile in one launch, reading only real tokens (NaN or inf
  in padding slots never reach a pooled value); its backward writes the three token gradients
  in one launch (0 on padding).
- ``select_topk``: per (batch, head, query tile) the ``topk`` key tiles of highest pooled score,
  written as ascending int32 lists straight into the layout's ``kv_indices``. Scores are
  float32 dot products of the pooled tensors (fp16/bf16 operands on the tensor cores; float32
  operands without TF32), held in a scratch buffer of ``4 * B * H * N^2`` bytes (N tiles:
  ``N / 4096`` of q's own size with 64-token tiles in bf16) that is freed when the call
  returns. Ties at the k-th score go to the lower key-tile index (torch.topk leaves that
  order unspecified, so the torch path may pick another of exactly tied tiles).

Both are `torch.library.custom_op`s with fake implementations, so ``torch.compile`` traces
them and CUDA graphs capture them; neither reads device data on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from vsa_core.backends.custom_ops import EagerOrOp
from vsa_core.coarse import CoarseStage
from vsa_triton.backend import interpreting


@dataclass(frozen=True)
class SelectConfig:
    """How the selection kernel splits its work.

    ``block_m`` query tiles per program; ``elements_per_step`` scores one program ranks at once
    in the second phase (rows x padded tiles); ``block_n`` key tiles scored per dot product.
    Measured on an H200 at Wan 480p (12 heads, 624 tiles, 2026-12-01 profiles): 64 query tiles
    a program (120 programs) took 0.42 ms, 16 (468 programs) 0.16 ms: each program's rows
    bisect one after the other, so more, smaller programs run faster until the pooled keys
    each program reads from L2 dominate."""

    block_m: int = 16
    block_n: int = 64
    elements_per_step: int = 4096
    num_warps: int = 4


SELECT = SelectConfig()
MAX_HEAD_DIM = 256


@functools.cache
def _kernels():
    from vsa_triton import coarse_kernels  # lazy: triton is imported on the first launch

    return coarse_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _head_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bshd_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _tile_constants(tile_tokens: int, dim: int) -> dict[str, int]:
    """The pooling kernels' compile-time sizes and launch width (forward and backward alike)."""
    return {
        "TILE_TOKENS": tile_tokens, "SLOTS": _next_pow2(tile_tokens), "HEAD_DIM": dim,
        "DIM_P2": _next_pow2(dim), "num_warps": 4,
    }  # fmt: skip


def _pooled_like(x: torch.Tensor, num_tiles: int) -> torch.Tensor:
    batch, _, heads, dim = x.shape
    return x.new_empty((batch, num_tiles, heads, dim))


def _pool(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means of q, k and v ([B, N * T, H, D], tile order) over each tile's real tokens:
    three [B, N, H, D] tensors in the inputs' dtype (accumulated in float32)."""
    q, k, v = (_head_dim_contiguous(t) for t in (q, k, v))
    num_tiles = valid_sizes.shape[0]
    batch, seq, heads, dim = q.shape
    tile_tokens = seq // num_tiles
    pooled = [_pooled_like(t, num_tiles) for t in (q, k, v)]
    if pooled[0].numel():
        _kernels().pool_fwd_kernel[(num_tiles, batch * heads)](
            q, k, v, *pooled, valid_sizes,
            *_bshd_strides(q), *_bshd_strides(k), *_bshd_strides(v), *_bshd_strides(pooled[0]),
            heads, **_tile_constants(tile_tokens, dim),
        )  # fmt: skip
    return tuple(pooled)


pool_op = torch.library.custom_op("vsa_triton::pool_qkv", _pool, mutates_args=())


@pool_op.register_fake
def _(q, k, v, valid_sizes):
    num_tiles = valid_sizes.shape[0]
    return tuple(_pooled_like(t, num_tiles) for t in (q, k, v))


def _unpool(
    gq: torch.Tensor,
    gk: torch.Tensor,
    gv: torch.Tensor,
    valid_sizes: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `pool_qkv` w.r.t. q, k and v from those of its outputs: [B, seq_len, H, D]
    each, the pooled gradient over the tile's size on real tokens, 0 on padding."""
    gq, gk, gv = (g.contiguous() for g in (gq, gk, gv))
    num_tiles = valid_sizes.shape[0]
    batch, _, heads, dim = gq.shape
    tile_tokens = seq_len // num_tiles
    grads = [g.new_empty((batch, seq_len, heads, dim)) for g in (gq, gk, gv)]
    if grads[0].numel():
        _kernels().pool_bwd_kernel[(num_tiles, batch * heads)](
            gq, gk, gv, *grads, valid_sizes,
            *_bshd_strides(gq), *_bshd_strides(grads[0]),
            heads, **_tile_constants(tile_tokens, dim),
        )  # fmt: skip
    return tuple(grads)


unpool_op = torch.library.custom_op("vsa_triton::unpool_qkv", _unpool, mutates_args=())


@unpool_op.register_fake
def _(gq, gk, gv, valid_sizes, seq_len):
    batch, _, heads, dim = gq.shape
    return tuple(g.new_empty((batch, seq_len, heads, dim)) for g in (gq, gk, gv))


def _pool_setup(ctx, inputs, output):
    q, _, _, valid_sizes = inputs
    ctx.save_for_backward(valid_sizes)
    ctx.seq_len = q.shape[1]


def _pool_grads(ctx, grads, unpool):
    (valid_sizes,) = ctx.saved_tensors
    present = next(g for g in grads if g is not None)
    grads = [torch.zeros_like(present) if g is None else g for g in grads]
    return (*unpool(*grads, valid_sizes, ctx.seq_len), None)


pool_op.register_autograd(
    lambda ctx, gq, gk, gv: _pool_grads(ctx, (gq, gk, gv), unpool_op), setup_context=_pool_setup
)


class _PoolFunction(torch.autograd.Function):
    """`pool_op`'s autograd in eager mode, on the plain functions."""

    @staticmethod
    def forward(ctx, q, k, v, valid_sizes):
        output = _pool(q, k, v, valid_sizes)
        _pool_setup(ctx, (q, k, v, valid_sizes), output)
        return output

    @staticmethod
    def backward(ctx, gq, gk, gv):
        return _pool_grads(ctx, (gq, gk, gv), _unpool)


pool_qkv = EagerOrOp(pool_op, _pool, _PoolFunction)
"""Pool q, k and v (`_pool`): ``torch.ops.vsa_triton.pool_qkv`` under torch.compile, the plain
functions in eager mode (`vsa_core.backends.custom_ops.EagerOrOp`)."""


def _select(
    q_pooled: torch.Tensor, k_pooled: torch.Tensor, valid_sizes: torch.Tensor, topk: int
) -> torch.Tensor:
    """[B, H, N, topk] int32: per (batch, head, query tile) the ``topk`` key tiles of highest
    score ``q_pooled . k_pooled`` (empty key tiles last), ascending. Inputs [B, N, H, D] with
    the same strides."""
    return select_with(q_pooled, k_pooled, valid_sizes, topk, SELECT)


def select_with(
    q_pooled: torch.Tensor,
    k_pooled: torch.Tensor,
    valid_sizes: torch.Tensor,
    topk: int,
    config: SelectConfig,
) -> torch.Tensor:
    """`_select` with an explicit `SelectConfig` (for sweeps; the op uses ``SELECT``)."""
    q_pooled, k_pooled = (_head_dim_contiguous(t) for t in (q_pooled, k_pooled))
    if q_pooled.stride() != k_pooled.stride():
        q_pooled, k_pooled = q_pooled.contiguous(), k_pooled.contiguous()
    batch, num_tiles, heads, dim = q_pooled.shape
    out = torch.empty(batch, heads, num_tiles, topk, dtype=torch.int32, device=q_pooled.device)
    if out.numel() == 0:
        return out
    scores = torch.empty(
        batch * heads, num_tiles, num_tiles, dtype=torch.float32, device=q_pooled.device
    )
    tiles_p2 = _next_pow2(num_tiles)
    rows = max(1, min(config.block_m, config.elements_per_step // tiles_p2))
    _kernels().select_topk_kernel[(-(-num_tiles // config.block_m), batch * heads)](
        q_pooled, k_pooled, valid_sizes, scores, out,
        *_bshd_strides(q_pooled),
        num_tiles, heads, topk,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=dim, DIM_P2=_next_pow2(dim),
        TILES_P2=tiles_p2, ROWS=rows, IEEE=q_pooled.dtype == torch.float32,
        INTERPRET=interpreting(), num_warps=config.num_warps,
    )  # fmt: skip
    return out


select_op = torch.library.custom_op("vsa_triton::select_topk", _select, mutates_args=())


@select_op.register_fake
def _(q_pooled, k_pooled, valid_sizes, topk):
    batch, num_tiles, heads, _ = q_pooled.shape
    return q_pooled.new_empty((batch, heads, num_tiles, topk), dtype=torch.int32)


select_topk = EagerOrOp(select_op, _select)


def _gate_strides(gate: torch.Tensor | None) -> tuple[int, int, int, int]:
    """A gate's four strides (0 where it broadcasts; any values without a gate)."""
    return (0, 0, 0, 0) if gate is None else gate.stride()


def _combine_launch(fine, coarse, gate, out, tile_tokens):
    batch, seq, heads, dim = fine.shape
    num_tiles = seq // tile_tokens
    _kernels().combine_fwd_kernel[(num_tiles, batch * heads)](
        fine, coarse, fine if gate is None else gate, out,  # fine: a pointer never read as gate
        *_bshd_strides(fine), *_bshd_strides(coarse), *_gate_strides(gate),
        *_bshd_strides(out),
        heads, HAS_GATE=gate is not None, **_tile_constants(tile_tokens, dim),
    )  # fmt: skip
    return out


def _combine(
    fine: torch.Tensor, coarse: torch.Tensor, gate: torch.Tensor | None, tile_tokens: int
) -> torch.Tensor:
    """fine + gate * coarse[tile] ([B, N * T, H, D]; coarse [B, N, H, D]) in a new tensor."""
    fine, coarse = _head_dim_contiguous(fine), _head_dim_contiguous(coarse)
    out = torch.empty_like(fine, memory_format=torch.contiguous_format)
    return _combine_launch(fine, coarse, gate, out, tile_tokens) if out.numel() else out


def _combine_in_place(fine, coarse, gate, tile_tokens):
    """`_combine` written over ``fine`` (no gradient flows: the op owns ``fine``)."""
    if fine.stride(-1) != 1 or coarse.stride(-1) != 1:
        return _combine(fine, coarse, gate, tile_tokens)
    return _combine_launch(fine, coarse, gate, fine, tile_tokens) if fine.numel() else fine


combine_op = torch.library.custom_op("vsa_triton::combine", _combine, mutates_args=())


@combine_op.register_fake
def _(fine, coarse, gate, tile_tokens):
    return torch.empty_like(fine, memory_format=torch.contiguous_format)


def _combine_backward(
    dout: torch.Tensor,
    coarse: torch.Tensor,
    gate: torch.Tensor | None,
    tile_tokens: int,
    want_dgate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dcoarse) of `_combine` from dout: dgate = dout * coarse[tile] (an empty tensor
    when not wanted or without a gate), dcoarse = sum over each tile's slots of dout * gate."""
    dout, coarse = _head_dim_contiguous(dout), _head_dim_contiguous(coarse)
    batch, seq, heads, dim = dout.shape
    write_dgate = want_dgate and gate is not None
    dgate = torch.empty_like(dout) if write_dgate else dout.new_empty(0)
    dcoarse = torch.empty_like(coarse, memory_format=torch.contiguous_format)
    if dcoarse.numel() and seq:
        gate_ref = dout if gate is None else gate
        dgate_ref = dgate if write_dgate else dout
        _kernels().combine_bwd_kernel[(seq // tile_tokens, batch * heads)](
            dout, coarse, gate_ref, dgate_ref, dcoarse,
            *_bshd_strides(dout), *_bshd_strides(coarse), *_gate_strides(gate),
            *_bshd_strides(dgate_ref), *_bshd_strides(dcoarse),
            heads, HAS_GATE=gate is not None, WRITE_DGATE=write_dgate,
            **_tile_constants(tile_tokens, dim),
        )  # fmt: skip
    elif dcoarse.numel():
        dcoarse.zero_()
    return dgate, dcoarse


combine_backward_op = torch.library.custom_op(
    "vsa_triton::combine_backward", _combine_backward, mutates_args=()
)


@combine_backward_op.register_fake
def _(dout, coarse, gate, tile_tokens, want_dgate):
    dgate = torch.empty_like(dout) if want_dgate and gate is not None else dout.new_empty(0)
    return dgate, torch.empty_like(coarse, memory_format=torch.contiguous_format)


def _combine_setup(ctx, inputs, output):
    _, coarse, gate, tile_tokens = inputs
    ctx.save_for_backward(coarse, gate)
    ctx.tile_tokens = tile_tokens


def _combine_grads(ctx, dout, backward):
    coarse, gate = ctx.saved_tensors
    want_dgate = gate is not None and ctx.needs_input_grad[2]
    dgate, dcoarse = backward(dout, coarse, gate, ctx.tile_tokens, want_dgate)
    return dout, dcoarse, dgate if want_dgate else None, None


combine_op.register_autograd(
    lambda ctx, dout: _combine_grads(ctx, dout, combine_backward_op),
    setup_context=_combine_setup,
)


class _CombineFunction(torch.autograd.Function):
    """`combine_op`'s autograd in eager mode, on the plain functions."""

    @staticmethod
    def forward(ctx, fine, coarse, gate, tile_tokens):
        output = _combine(fine, coarse, gate, tile_tokens)
        _combine_setup(ctx, (fine, coarse, gate, tile_tokens), output)
        return output

    @staticmethod
    def backward(ctx, dout):
        return _combine_grads(ctx, dout, _combine_backward)


combine_tiles = EagerOrOp(combine_op, _combine_in_place, _CombineFunction)
"""VSA's output fine + gate * coarse (`vsa_core.coarse.CoarseStage.combine`): one launch
(backward: one), in place on ``fine`` in eager calls without gradients."""


class TritonCoarse(CoarseStage):
    """The coarse stage in Triton (CUDA; CPU tensors under ``TRITON_INTERPRET=1``)."""

    name: ClassVar[str] = "triton"
    priority: ClassVar[int] = 10

    def supports(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if device_type != "cuda" and not (device_type == "cpu" and interpreting()):
            return f"needs a CUDA device, got {device_type}"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype} not supported (float16, bfloat16, float32)"
        if not 16 <= head_dim <= MAX_HEAD_DIM:
            return f"head dim {head_dim} not in [16, {MAX_HEAD_DIM}]"
        return None

    def pool(self, q, k, v, valid_sizes):
        return pool_qkv(q, k, v, valid_sizes)

    def select(self, q_pooled, k_pooled, valid_sizes, topk):
        return select_topk(q_pooled, k_pooled, valid_sizes, topk)

    def combine(self, fine, coarse, gate, tile_tokens):
        return combine_tiles(fine, coarse, gate, tile_tokens)

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
from vsa_core.layout import PACKED_BLOCK_BITS, ForwardSplit
from vsa_triton.environment import interpreting
from vsa_triton.launch_cache import launch
from vsa_triton.tensor_args import bshd_strides, gate_strides, head_dim_contiguous


@dataclass(frozen=True)
class SelectConfig:
    """How the selection kernel splits its work.

    ``block_m`` query tiles per program; ``elements_per_step`` scores one program ranks at once
    in the second phase (rows x padded tiles); ``block_n`` key tiles scored per dot product.
    Measured on an H200 (`research/coarse_stage/sweep_select.py`, every config picking the same
    lists): with int32 keys (session 15,
    `benchmarks/results/2026-12-01-h200-sweep_select-int32.json`) 16 query tiles a program ran
    0.136 / 1.20 / 2.07 ms at Wan 480p (12 heads, 624 tiles) / Wan 720p (40, 1440) /
    HunyuanVideo (24, 2160), the fastest of the configs swept at all three (8: 0.168 / 1.24 /
    2.20; 4: 0.141 / 1.40 / 2.55; 8 without early exit 0.182 / 2.01 / 3.51). Before, with the
    whole [rows, tiles] block compared in int64 and 8 tiles a program, the same sweep measured
    0.176 / 1.71 / 2.63 ms (`2026-12-01-h200-sweep_select-early-exit.json`, 32 full passes
    0.266 / 3.35 / 5.38); int32 keys without early exit, earlier still, 0.186 / 1.91 / 3.34.
    Each program's rows bisect one after the other, so the program size trades rows in flight
    against the pooled keys each program reads from L2; 8 warps were slower everywhere. A radix
    search (four 8-bit histogram passes, row by row) picked the same lists but ran 1.4-2.6x
    slower at every latent (`2026-12-01-h200-sweep_select-radix.json`) and was removed; three
    thresholds a pass (packed counts) were slower still.

    Since session 32 the op ranks in a kernel of its own (``rank_apart``) behind score
    programs of 64 query tiles. Device time of the op's inference call (scores, coarse
    attention, ranking, split lists; CUDA-graph replay, H200,
    `benchmarks/results/2026-12-06-h200-sweep_select-rank-apart-graph-session32.json`):
    Wan 480p 0.113 -> 0.076 ms, Wan 720p 1.313 -> 1.082, HunyuanVideo 2.303 -> 1.992 (4
    warps a row; 16 tiles a score program 1.958); the same lists at every latent."""

    block_m: int = 64
    block_n: int = 64
    elements_per_step: int = 2048
    num_warps: int = 4
    early_exit: bool = True
    """Stop a row's bisection once its count at a threshold is exactly k (its top-k set is
    then known; with ``rank_apart`` False the program's rows pass together, so it stops when
    all of them are done)."""
    rank_apart: bool = True
    """Rank the scores in a second kernel, a program of `rank_warps_for` warps a row
    (`rank_rows_kernel`): the score kernel keeps ``block_m`` rows a program for reading the
    pooled keys once, while the ranking's reductions stay within a warp or a few and each row
    stops on its own (the fused ranking's rows wait for barriers and for each other). Without
    it ``block_m`` rows a program rank ``elements_per_step`` scores at a time after scoring."""
    rank_warps: int = 0
    """Warps a ranking program; 0: `rank_warps_for` the row's width."""

    def __post_init__(self) -> None:
        # Triton's blocks and warp counts are powers of two: anything else fails at compile
        # time deep inside Triton, or (a zero) launches nothing
        for name in ("block_m", "block_n", "elements_per_step", "num_warps"):
            value = getattr(self, name)
            if not _power_of_two(value):
                raise ValueError(f"{name} must be a power of two >= 1, got {value!r}")
        if not (self.rank_warps == 0 or _power_of_two(self.rank_warps)):
            raise ValueError(f"rank_warps must be 0 or a power of two, got {self.rank_warps!r}")

    def rank_warps_for(self, tiles_p2: int) -> int:
        """``rank_warps``, or for 0 one warp up to 2048 padded tiles a row and a warp per 1024
        beyond (a warp holding 4096 keys spills; session 32 on an H200: 1 / 2 / 4 warps, in
        ms, 0.076 / 0.081 / 0.090 at Wan 480p's 1024, 1.082 / 1.112 / 1.155 at Wan 720p's
        2048, 3.184 / 2.351 / 1.992 at HunyuanVideo's 4096)."""
        if self.rank_warps:
            return self.rank_warps
        return 1 if tiles_p2 <= 2048 else tiles_p2 // 1024


def _power_of_two(value: object) -> bool:
    return type(value) is int and value >= 1 and value & (value - 1) == 0


SELECT = SelectConfig()
MAX_HEAD_DIM = 256


@functools.cache
def _kernels():
    from vsa_triton import coarse_kernels  # lazy: triton is imported on the first launch

    return coarse_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tile_constants(tile_tokens: int, dim: int) -> dict[str, int]:
    """The pooling kernels' compile-time sizes and launch width (forward and backward alike)."""
    return {
        "TILE_TOKENS": tile_tokens, "SLOTS": _next_pow2(tile_tokens), "HEAD_DIM": dim,
        "DIM_P2": _next_pow2(dim), "num_warps": 4,
    }  # fmt: skip


def _pooled_like(x: torch.Tensor, num_tiles: int) -> torch.Tensor:
    batch, _, heads, dim = x.shape
    return x.new_empty((batch, num_tiles, heads, dim))


def _tiled_len(x: torch.Tensor, raster_rows: torch.Tensor | None) -> int:
    """Length of the tile-order sequence: x's own, or the tiling's padded length when x is in
    raster order (``raster_rows``, its tile_to_raster map, has one entry per tile-order slot)."""
    return x.shape[1] if raster_rows is None else raster_rows.shape[0]


def _copies(tensors, flags, raster_rows):
    """The contiguous tile-order copies `_pool_clean` writes (an empty tensor where not asked)."""
    return [
        t.new_empty((t.shape[0], _tiled_len(t, raster_rows), *t.shape[2:])) if c
        else t.new_empty(0)
        for t, c in zip(tensors, flags, strict=True)
    ]  # fmt: skip


def _pool_clean(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_sizes: torch.Tensor,
    clean_q: bool,
    clean_k: bool,
    clean_v: bool,
    raster_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means of q, k and v ([B, N * T, H, D], tile order) over each tile's real tokens (three
    [B, N, H, D] tensors in the inputs' dtype, accumulated in float32), then where ``clean_*``
    a copy of that input with its padding slots zeroed, written from the same loads (an empty
    tensor where not asked for). With ``raster_rows`` (a tiling's ``tile_to_raster``), q, k
    and v are in raster order ([B, T*H*W, H, D]) and the copies are their tile-order forms."""
    return _pool_launch(q, k, v, valid_sizes, (clean_q, clean_k, clean_v), (False,) * 3,
                        raster_rows)  # fmt: skip


def _pool_launch(q, k, v, valid_sizes, flags, zero, raster_rows):
    """`_pool_clean`'s launch; ``zero``: the inputs (tile order) whose padding slots the pass
    zeroes in place (`pool_zeroing_padding`)."""
    if any(zero):  # in place: the tensors themselves, in tile order
        assert raster_rows is None and all(
            t.stride(-1) == 1 for t, z in zip((q, k, v), zero, strict=True) if z
        )
    q, k, v = (head_dim_contiguous(t) for t in (q, k, v))
    num_tiles = valid_sizes.shape[0]
    batch, _, heads, dim = q.shape
    tiled = _tiled_len(q, raster_rows)
    pooled = [_pooled_like(t, num_tiles) for t in (q, k, v)]
    cleans = _copies((q, k, v), flags, raster_rows)
    if pooled[0].numel():
        strides = (tiled * heads * dim, heads * dim, dim)  # the clean copies' (contiguous BSHD)
        targets = [c if flag else t for c, t, flag in zip(cleans, (q, k, v), flags, strict=True)]
        launch(_kernels().pool_fwd_kernel, (num_tiles, batch * heads),
            q, k, v, *pooled, *targets, valid_sizes,  # targets: never written where not clean
            valid_sizes if raster_rows is None else raster_rows,  # the map: read if RASTER
            *bshd_strides(q), *bshd_strides(k), *bshd_strides(v), *bshd_strides(pooled[0]),
            *strides, heads, CLEAN_Q=flags[0], CLEAN_K=flags[1], CLEAN_V=flags[2],
            RASTER=raster_rows is not None, ZERO_Q=zero[0], ZERO_K=zero[1], ZERO_V=zero[2],
            **_tile_constants(tiled // num_tiles, dim),
        )  # fmt: skip
    return (*pooled, *cleans)


def pool_zeroing_padding(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_sizes: torch.Tensor,
    zero: tuple[bool, bool, bool],
    padding_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inference, eager mode, tile order: the tile means of q, k and v, and the padding slots
    (``padding_index``) of those ``zero`` marks zeroed in place by the same pass, which reads
    those tiles anyway (`CoarseStage.pool_zeroing_padding`; the op checked they can be
    written). An input whose head dim is not contiguous gets an index fill instead."""
    direct = []
    for t, z in zip((q, k, v), zero, strict=True):
        if z and t.stride(-1) != 1:
            t.index_fill_(1, padding_index, 0)
        direct.append(bool(z) and t.stride(-1) == 1)
    return _pool_launch(q, k, v, valid_sizes, (False,) * 3, tuple(direct), None)[:3]


pool_clean_op = torch.library.custom_op("vsa_triton::pool_clean", _pool_clean, mutates_args=())


@pool_clean_op.register_fake
def _(q, k, v, valid_sizes, clean_q, clean_k, clean_v, raster_rows=None):
    num_tiles = valid_sizes.shape[0]
    flags = (clean_q, clean_k, clean_v)
    return (
        *(_pooled_like(t, num_tiles) for t in (q, k, v)),
        *_copies((q, k, v), flags, raster_rows),
    )


def _unpool_add(
    gq: torch.Tensor,
    gk: torch.Tensor,
    gv: torch.Tensor,
    fq: torch.Tensor | None,
    fk: torch.Tensor | None,
    fv: torch.Tensor | None,
    valid_sizes: torch.Tensor,
    seq_len: int,
    raster_rows: torch.Tensor | None = None,
    fine_raster: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. q, k and v ([B, seq_len, H, D] each) from those of the pooled tensors
    (gq, gk, gv) and of the fine attention's inputs (fq, fk, fv, tile order; None where it had
    none): on real tokens the pooled gradient over the tile's size plus the fine one, 0 on
    padding. With ``raster_rows`` the gradients are in raster order (no padding rows), and
    with ``fine_raster`` the fine ones too (the fine attention read the raster inputs)."""
    gq, gk, gv = (g.contiguous() for g in (gq, gk, gv))
    fine = [None if f is None else head_dim_contiguous(f) for f in (fq, fk, fv)]
    num_tiles = valid_sizes.shape[0]
    batch, _, heads, dim = gq.shape
    tile_tokens = (seq_len if raster_rows is None else raster_rows.shape[0]) // num_tiles
    grads = [g.new_empty((batch, seq_len, heads, dim)) for g in (gq, gk, gv)]
    if grads[0].numel():
        fine_strides = [s for f in fine for s in bshd_strides(f)]
        launch(_kernels().pool_bwd_kernel, (num_tiles, batch * heads),
            gq, gk, gv, *(g if f is None else f for f, g in zip(fine, grads, strict=True)),
            *grads, valid_sizes, valid_sizes if raster_rows is None else raster_rows,
            *bshd_strides(gq), *bshd_strides(grads[0]), *fine_strides,
            heads, HAS_FQ=fq is not None, HAS_FK=fk is not None, HAS_FV=fv is not None,
            RASTER=raster_rows is not None, FINE_RASTER=fine_raster,
            **_tile_constants(tile_tokens, dim),
        )  # fmt: skip
    return tuple(grads)


unpool_add_op = torch.library.custom_op("vsa_triton::unpool_add", _unpool_add, mutates_args=())


@unpool_add_op.register_fake
def _(gq, gk, gv, fq, fk, fv, valid_sizes, seq_len, raster_rows=None, fine_raster=False):
    batch, _, heads, dim = gq.shape
    return tuple(g.new_empty((batch, seq_len, heads, dim)) for g in (gq, gk, gv))


def _pool_setup(ctx, inputs, output):
    q, _, _, valid_sizes, *flags = inputs
    raster_rows = flags.pop() if len(flags) == 4 else None
    ctx.save_for_backward(valid_sizes, raster_rows)
    ctx.seq_len = q.shape[1]
    pooled = output[0]  # its description only: an output kept on ctx would be a cycle
    ctx.pooled = (pooled.shape, pooled.dtype, pooled.device)
    ctx.flags = tuple(flags)


def _pool_grads(ctx, grads, unpool, passthrough):
    """The inputs' gradients from those of `_pool_clean`'s six outputs. ``passthrough``: the
    outputs of inputs not cleaned are the inputs themselves (eager), so their gradients count
    too; under the custom op they are empty placeholders, unused."""
    valid_sizes, raster_rows = ctx.saved_tensors
    shape, dtype, device = ctx.pooled
    pooled = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
              for g in grads[:3]]  # fmt: skip
    fine = [
        f if passthrough or flag else None for f, flag in zip(grads[3:], ctx.flags, strict=True)
    ]
    fine_raster = raster_rows is not None and not any(ctx.flags)  # no copies were made
    grads_qkv = unpool(*pooled, *fine, valid_sizes, ctx.seq_len, raster_rows, fine_raster)
    return (*grads_qkv, None, None, None, None, None)


pool_clean_op.register_autograd(
    lambda ctx, *grads: _pool_grads(ctx, grads, unpool_add_op, passthrough=False),
    setup_context=_pool_setup,
)


class _PoolCleanFunction(torch.autograd.Function):
    """`pool_clean_op`'s autograd in eager mode, on the plain functions; an input that is not
    cleaned is returned as itself, so the fine attention's gradient of it arrives here and is
    added in the same pass as the pooled one (no separate accumulation)."""

    @staticmethod
    def forward(ctx, q, k, v, valid_sizes, clean_q, clean_k, clean_v, raster_rows):
        flags = (clean_q, clean_k, clean_v)
        output = _pool_clean(q, k, v, valid_sizes, *flags, raster_rows)
        _pool_setup(ctx, (q, k, v, valid_sizes, *flags, raster_rows), output)
        return (*output[:3], *_fine_inputs(output[3:], (q, k, v), flags))

    @staticmethod
    def backward(ctx, *grads):
        return _pool_grads(ctx, grads, _unpool_add, passthrough=True)


def _fine_inputs(cleans, inputs, flags):
    return tuple(c if flag else x for c, x, flag in zip(cleans, inputs, flags, strict=True))


def pool_and_clean(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_sizes: torch.Tensor,
    clean: tuple[bool, bool, bool],
    raster_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(q_pooled, k_pooled, v_pooled, q_fine, k_fine, v_fine): the tile means of q, k and v
    and the tensors the fine attention reads (where ``clean``, a copy with padding zeroed,
    else the input): one launch, and one for the backward, which adds the fine attention's
    gradients and the pooled ones and zeroes padding. ``torch.ops.vsa_triton.pool_clean``
    under torch.compile, the plain functions in eager mode (see `EagerOrOp`).

    With ``raster_rows`` (a tiling's ``tile_to_raster``) q, k and v are in raster order and
    ``clean`` must be all True or all False: all True, the fine inputs are their zero-padded
    tile-order forms, written from the pooling's loads; all False, the inputs themselves (for
    a fine attention that reads raster order). The backward writes the gradients in raster
    order."""
    flags = tuple(bool(c) for c in clean)
    if raster_rows is not None and len(set(flags)) > 1:
        raise ValueError("raster-order inputs are copied to tile order all three or none")
    if torch.compiler.is_compiling():
        output = pool_clean_op(q, k, v, valid_sizes, *flags, raster_rows)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _PoolCleanFunction.apply(q, k, v, valid_sizes, *flags, raster_rows)
    else:
        output = _pool_clean(q, k, v, valid_sizes, *flags, raster_rows)
    return (*output[:3], *_fine_inputs(output[3:], (q, k, v), flags))


def pool_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile means of q, k and v over real tokens (`pool_and_clean` without copies)."""
    return pool_and_clean(q, k, v, valid_sizes, (False, False, False))[:3]


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
    split_tile: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`_select` with an explicit `SelectConfig` (for sweeps; the op uses ``SELECT``); with
    ``split_tile`` (the key tiles' token count) also the same lists split by tile fullness,
    written in the same launch: ``(indices, *ForwardSplit)`` (`_select_split`)."""
    out, split, _ = _launch_select(q_pooled, k_pooled, valid_sizes, topk, config, split_tile)
    return (out, *split) if split else out


def _launch_select(q_pooled, k_pooled, valid_sizes, topk, config, split_tile=None,
                   v_pooled=None, scale=1.0, attend_after=False):  # fmt: skip
    """The selection kernel's launch: ``(indices, split tensors or (), coarse or None)``; with
    ``v_pooled`` the coarse attention of the pooled tiles at softmax ``scale`` from the same
    scores (`select_attend`), contiguous [B, N, H, D] in q_pooled's dtype, computed inside the
    score loop or, with ``attend_after``, in a pass of its own after it (the kernel's
    ATTEND_AFTER)."""
    pooled = [head_dim_contiguous(t) for t in (q_pooled, k_pooled)]
    if v_pooled is not None:  # contiguous all three, as the coarse output is
        pooled = [t.contiguous() for t in (*pooled, v_pooled)]
    elif pooled[0].stride() != pooled[1].stride():
        pooled = [t.contiguous() for t in pooled]
    q_pooled, k_pooled = pooled[:2]
    batch, num_tiles, heads, dim = q_pooled.shape
    out = torch.empty(batch, heads, num_tiles, topk, dtype=torch.int32, device=q_pooled.device)
    split = _split_like(out) if split_tile is not None else ()
    coarse = None if v_pooled is None else torch.empty_like(q_pooled)
    if out.numel() == 0:
        return out, split, coarse
    scores = torch.empty(
        batch * heads, num_tiles, num_tiles, dtype=torch.float32, device=q_pooled.device
    )
    tiles_p2 = _next_pow2(num_tiles)
    rows = max(1, min(config.block_m, config.elements_per_step // tiles_p2))
    attend = {}
    if coarse is not None:
        attend = dict(
            vp=pooled[2],
            coarse_ptr=coarse,
            scale_log2=scale * LOG2_E,
            ATTEND=True,
            ATTEND_AFTER=attend_after,
        )
    launch(_kernels().select_topk_kernel, (-(-num_tiles // config.block_m), batch * heads),
        q_pooled, k_pooled, valid_sizes, scores, out, *(split or (out,) * 4),
        *bshd_strides(q_pooled),
        num_tiles, heads, topk, split_tile or 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=dim, DIM_P2=_next_pow2(dim),
        TILES_P2=tiles_p2, ROWS=rows, IEEE=q_pooled.dtype == torch.float32,
        INTERPRET=interpreting(), EARLY_EXIT=config.early_exit, SPLIT=bool(split),
        **(_split_constants(topk, config) if split else {}), **attend,
        RANK=not config.rank_apart, num_warps=config.num_warps,
    )  # fmt: skip
    if config.rank_apart:
        num_rows = batch * heads * num_tiles
        rows, split_rows = rank_rows_sizes(num_rows, tiles_p2, topk, interpreting())
        launch(_kernels().rank_rows_kernel, (-(-num_rows // rows),),
            scores, valid_sizes, out, *(split or (out,) * 4), num_rows, num_tiles, topk,
            split_tile or 0, TILES_P2=tiles_p2, TOPK_P2=_next_pow2(topk),
            EARLY_EXIT=config.early_exit, SPLIT=bool(split), ROWS=rows, SPLIT_ROWS=split_rows,
            num_warps=config.rank_warps_for(tiles_p2),
        )  # fmt: skip
    return out, split, coarse


LOG2_E = 1.4426950408889634
"""log2(e): the kernel's softmax runs on exp2 of scores times ``scale * LOG2_E``."""


INTERPRETED_RANK_ELEMENTS = 1 << 16
"""Scores one program of the ranking kernel takes under the Triton interpreter (rows x padded
tiles): there it ranks many rows a program, since each program costs Python."""


def rank_rows_sizes(num_rows: int, tiles_p2: int, topk: int, many: bool) -> tuple[int, int]:
    """`rank_rows_kernel`'s ``ROWS`` and ``SPLIT_ROWS``: a row a program (on a GPU), or with
    ``many`` (the interpreter, whose cost is per program) up to `INTERPRETED_RANK_ELEMENTS`
    scores a program; the split `SPLIT_ELEMENTS` list entries a step."""
    rows = min(_next_pow2(num_rows), max(1, INTERPRETED_RANK_ELEMENTS // tiles_p2)) if many else 1
    return rows, max(1, min(rows, SPLIT_ELEMENTS // _next_pow2(topk)))


SPLIT_ELEMENTS = 512
"""List entries the split phase of the selection kernel handles a step (rows x ``TOPK_P2``):
compiled for sm_90 (`research.coarse_stage.compile_select`), a step of 2048 took the kernel
from 139 to 196 registers at Wan 480p."""


def _split_constants(topk: int, config: SelectConfig) -> dict[str, int]:
    """The split phase's compile-time sizes: lists ``TOPK_P2`` wide, rows a step to hold
    `SPLIT_ELEMENTS` entries."""
    topk_p2 = _next_pow2(topk)
    rows = max(1, min(config.block_m, SPLIT_ELEMENTS // topk_p2))
    return {"TOPK_P2": topk_p2, "SPLIT_ROWS": rows}


def _split_like(indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Uninitialized `ForwardSplit` tensors (full idx, full cnt, partial idx, partial cnt) for
    [B, H, N, topk] ``indices``: the kernel writes every element."""
    counts = indices.new_empty(indices.shape[:-1])
    return indices.new_empty(indices.shape), counts, indices.new_empty(indices.shape), \
        torch.empty_like(counts)  # fmt: skip


def _select_split(
    q_pooled: torch.Tensor,
    k_pooled: torch.Tensor,
    valid_sizes: torch.Tensor,
    topk: int,
    kv_tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_select`'s indices and the same lists split by key-tile fullness for ``kv_tile``-token
    tiles (`vsa_core.layout.ForwardSplit`'s four tensors), in one launch."""
    return select_with(q_pooled, k_pooled, valid_sizes, topk, SELECT, kv_tile)


select_op = torch.library.custom_op("vsa_triton::select_topk", _select, mutates_args=())


@select_op.register_fake
def _(q_pooled, k_pooled, valid_sizes, topk):
    batch, num_tiles, heads, _ = q_pooled.shape
    return q_pooled.new_empty((batch, heads, num_tiles, topk), dtype=torch.int32)


select_topk = EagerOrOp(select_op, _select)

select_split_op = torch.library.custom_op(
    "vsa_triton::select_topk_split", _select_split, mutates_args=()
)


@select_split_op.register_fake
def _(q_pooled, k_pooled, valid_sizes, topk, kv_tile):
    batch, num_tiles, heads, _ = q_pooled.shape
    out = q_pooled.new_empty((batch, heads, num_tiles, topk), dtype=torch.int32)
    return (out, *_split_like(out))


select_topk_split = EagerOrOp(select_split_op, _select_split)


def _select_attend(
    q_pooled: torch.Tensor,
    k_pooled: torch.Tensor,
    v_pooled: torch.Tensor,
    valid_sizes: torch.Tensor,
    topk: int,
    scale: float,
    kv_tile: int,
    attend_after: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch for inference: ``(coarse, indices, *split)``: the coarse attention of the
    pooled tiles ([B, N, H, D], dense softmax attention at ``scale`` with empty key tiles
    left out, 0 for a query tile that sees none), `_select`'s indices from the same scores,
    and with ``kv_tile`` > 0 their `ForwardSplit` for ``kv_tile``-token tiles (four empty
    tensors for 0); ``attend_after``: see `_launch_select`. No gradient: the coarse
    attention's backward is SDPA's, on the other path."""
    split_tile = kv_tile if kv_tile > 0 else None
    out, split, coarse = _launch_select(
        q_pooled, k_pooled, valid_sizes, topk, SELECT, split_tile, v_pooled, scale, attend_after
    )
    return (coarse, out, *(split or _no_split(out)))


def _no_split(indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(indices.new_empty(0) for _ in range(4))


select_attend_op = torch.library.custom_op(
    "vsa_triton::select_attend", _select_attend, mutates_args=()
)


@select_attend_op.register_fake
def _(q_pooled, k_pooled, v_pooled, valid_sizes, topk, scale, kv_tile, attend_after=False):
    batch, num_tiles, heads, _ = q_pooled.shape
    out = q_pooled.new_empty((batch, heads, num_tiles, topk), dtype=torch.int32)
    coarse = torch.empty_like(q_pooled, memory_format=torch.contiguous_format)
    return (coarse, out, *(_split_like(out) if kv_tile > 0 else _no_split(out)))


select_attend = EagerOrOp(select_attend_op, _select_attend)


def _combine_launch(fine, coarse, gate, valid_sizes, gate_padding_as_zero, out, raster_rows,
                    fine_raster=False):  # fmt: skip
    batch, _, heads, dim = fine.shape
    num_tiles = valid_sizes.shape[0]
    tiled = raster_rows.shape[0] if fine_raster else fine.shape[1]
    launch(_kernels().combine_fwd_kernel, (num_tiles, batch * heads),
        fine, coarse, fine if gate is None else gate, out, valid_sizes,  # fine: never read as gate
        valid_sizes if raster_rows is None else raster_rows,  # the map: read if RASTER
        *bshd_strides(fine), *bshd_strides(coarse), *gate_strides(gate),
        *bshd_strides(out), heads, HAS_GATE=gate is not None,
        GATE_PADDING_AS_ZERO=gate_padding_as_zero, RASTER=raster_rows is not None,
        FINE_RASTER=fine_raster, **_tile_constants(tiled // num_tiles, dim),
    )  # fmt: skip
    return out


def _combined_like(fine: torch.Tensor, raster_len: int) -> torch.Tensor:
    """The combine's output: like ``fine`` (contiguous), or ``raster_len`` tokens long."""
    if not raster_len:
        return torch.empty_like(fine, memory_format=torch.contiguous_format)
    return fine.new_empty((fine.shape[0], raster_len, *fine.shape[2:]))


def _combine(
    fine: torch.Tensor,
    coarse: torch.Tensor,
    gate: torch.Tensor | None,
    valid_sizes: torch.Tensor,
    gate_padding_as_zero: bool,
    raster_rows: torch.Tensor | None = None,
    raster_len: int = 0,
    fine_raster: bool = False,
) -> torch.Tensor:
    """fine + gate * coarse[tile] ([B, N * T, H, D]; coarse [B, N, H, D]) in a new tensor;
    with ``gate_padding_as_zero`` the gate's padding slots are never read (0). With
    ``raster_rows`` (a tiling's ``tile_to_raster``) the output and the gate are in raster order,
    ``raster_len`` (T*H*W) tokens: padding slots are neither read from the gate nor written;
    ``fine`` is then in tile order, or with ``fine_raster`` in raster order too."""
    fine, coarse = head_dim_contiguous(fine), head_dim_contiguous(coarse)
    fine_raster = fine_raster and raster_rows is not None
    out = _combined_like(fine, raster_len if raster_rows is not None else 0)
    if not out.numel():
        return out
    return _combine_launch(fine, coarse, gate, valid_sizes, gate_padding_as_zero, out, raster_rows,
                           fine_raster)  # fmt: skip


def _combine_in_place(
    fine, coarse, gate, valid_sizes, gate_padding_as_zero, raster_rows=None, raster_len=0,
    fine_raster=False,
):  # fmt: skip
    """`_combine` written over ``fine`` (no gradient flows: the op owns ``fine``) where the
    output is in fine's order (tile order, or raster order for a raster ``fine``)."""
    fine_raster = fine_raster and raster_rows is not None
    in_order = raster_rows is None or fine_raster
    if not in_order or fine.stride(-1) != 1 or coarse.stride(-1) != 1:
        return _combine(fine, coarse, gate, valid_sizes, gate_padding_as_zero, raster_rows,
                        raster_len, fine_raster)  # fmt: skip
    if not fine.numel():
        return fine
    return _combine_launch(fine, coarse, gate, valid_sizes, gate_padding_as_zero, fine,
                           raster_rows, fine_raster)  # fmt: skip


combine_op = torch.library.custom_op("vsa_triton::combine", _combine, mutates_args=())


@combine_op.register_fake
def _(fine, coarse, gate, valid_sizes, gate_padding_as_zero, raster_rows=None, raster_len=0,
      fine_raster=False):  # fmt: skip
    return _combined_like(fine, raster_len if raster_rows is not None else 0)


def _combine_backward(
    dout: torch.Tensor,
    coarse: torch.Tensor,
    gate: torch.Tensor | None,
    valid_sizes: torch.Tensor,
    gate_padding_as_zero: bool,
    want_dgate: bool,
    raster_rows: torch.Tensor | None = None,
    tiled_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, dcoarse, dfine) of `_combine` from dout: dgate = dout * coarse[tile] (0 where the
    gate acts as 0; an empty tensor when not wanted or without a gate), dcoarse = sum over each
    tile's slots of dout * gate. dfine: dout itself in tile order (an empty tensor: the caller
    passes dout on); with ``raster_rows`` (dout, the gate and dgate in raster order) dout's
    tile-order form, ``tiled_len`` tokens, zero on padding, written from the same loads, or,
    with ``tiled_len`` 0 (the fine output was in raster order too), an empty tensor again."""
    dout, coarse = head_dim_contiguous(dout), head_dim_contiguous(coarse)
    batch, seq, heads, dim = dout.shape
    raster = raster_rows is not None
    fine_raster = raster and not tiled_len  # the fine output was raster: its gradient is dout
    write_dgate = want_dgate and gate is not None
    dgate = torch.empty_like(dout) if write_dgate else dout.new_empty(0)
    dcoarse = torch.empty_like(coarse, memory_format=torch.contiguous_format)
    copy_dfine = raster and not fine_raster
    dfine = dout.new_empty((batch, tiled_len, heads, dim)) if copy_dfine else dout.new_empty(0)
    num_tiles = valid_sizes.shape[0]
    tiled = raster_rows.shape[0] if raster else seq
    if dcoarse.numel() and tiled:
        gate_ref = dout if gate is None else gate
        dgate_ref = dgate if write_dgate else dout
        dfine_ref = dfine if copy_dfine else dout
        launch(_kernels().combine_bwd_kernel, (num_tiles, batch * heads),
            dout, coarse, gate_ref, dgate_ref, dcoarse, dfine_ref, valid_sizes,
            valid_sizes if raster_rows is None else raster_rows,
            *bshd_strides(dout), *bshd_strides(coarse), *gate_strides(gate),
            *bshd_strides(dgate_ref), *bshd_strides(dcoarse), *bshd_strides(dfine_ref),
            heads, HAS_GATE=gate is not None, WRITE_DGATE=write_dgate,
            GATE_PADDING_AS_ZERO=gate_padding_as_zero, RASTER=raster, FINE_RASTER=fine_raster,
            **_tile_constants(tiled // num_tiles, dim),
        )  # fmt: skip
    elif dcoarse.numel():
        dcoarse.zero_()
    return dgate, dcoarse, dfine


combine_backward_op = torch.library.custom_op(
    "vsa_triton::combine_backward", _combine_backward, mutates_args=()
)


@combine_backward_op.register_fake
def _(dout, coarse, gate, valid_sizes, gate_padding_as_zero, want_dgate, raster_rows=None,
      tiled_len=0):  # fmt: skip
    dgate = torch.empty_like(dout) if want_dgate and gate is not None else dout.new_empty(0)
    batch, _, heads, dim = dout.shape
    copy_dfine = raster_rows is not None and tiled_len
    dfine = dout.new_empty((batch, tiled_len, heads, dim) if copy_dfine else 0)
    return dgate, torch.empty_like(coarse, memory_format=torch.contiguous_format), dfine


def _combine_setup(ctx, inputs, output):
    fine, coarse, gate, valid_sizes, gate_padding_as_zero, *rest = inputs
    # the trailing arguments, their defaults where a caller left them out
    raster_rows, _raster_len, fine_raster = (*rest, *(None, 0, False)[len(rest) :])
    ctx.save_for_backward(coarse, gate, valid_sizes, raster_rows)
    ctx.gate_padding_as_zero = gate_padding_as_zero
    # 0: the fine output was in raster order, so its gradient is dout itself (no copy)
    ctx.tiled_len = 0 if fine_raster and raster_rows is not None else fine.shape[1]


def _combine_grads(ctx, dout, backward):
    coarse, gate, valid_sizes, raster_rows = ctx.saved_tensors
    want_dgate = gate is not None and ctx.needs_input_grad[2]
    dgate, dcoarse, dfine = backward(
        dout, coarse, gate, valid_sizes, ctx.gate_padding_as_zero, want_dgate, raster_rows,
        ctx.tiled_len,
    )  # fmt: skip
    dfine = dout if raster_rows is None or not ctx.tiled_len else dfine
    return dfine, dcoarse, dgate if want_dgate else None, None, None, None, None, None


combine_op.register_autograd(
    lambda ctx, dout: _combine_grads(ctx, dout, combine_backward_op),
    setup_context=_combine_setup,
)


class _CombineFunction(torch.autograd.Function):
    """`combine_op`'s autograd in eager mode, on the plain functions."""

    @staticmethod
    def forward(ctx, fine, coarse, gate, valid_sizes, gate_padding_as_zero, raster_rows=None,
                raster_len=0, fine_raster=False):  # fmt: skip
        inputs = (fine, coarse, gate, valid_sizes, gate_padding_as_zero, raster_rows, raster_len,
                  fine_raster)  # fmt: skip
        output = _combine(*inputs)
        _combine_setup(ctx, inputs, output)
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
    attend_after_scores: ClassVar[bool] = True
    """Where `select_and_attend`'s launch runs the coarse attention: in a pass of its own after
    the selection kernel's score loop (True: on sm_90 168 registers and 40-56 B of stack with
    the split, 229-231 without) or inside it (False: 255), per
    `research.coarse_stage.compile_select`
    (`benchmarks/results/2026-12-03-cpu-compile_select-attend-after.json`). H200, Wan 480p
    forward, one run (2026-12-03): the op 2.657 ms back to back against 2.726 inside the
    loop, 3.045 against 3.156 called once; Wan 720p and HunyuanVideo within 0.7% (one round
    each). ``bench_video``'s arm ``fa4_attend_in_loop`` times the other choice."""

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

    def pool_and_clean(self, q, k, v, valid_sizes, clean, padding_index=None):
        return pool_and_clean(q, k, v, valid_sizes, clean)

    def pool_zeroing_padding(self, q, k, v, valid_sizes, zero, padding_index):
        return pool_zeroing_padding(q, k, v, valid_sizes, zero, padding_index)

    def pool_from_raster(self, q, k, v, tiling):
        indices = tiling.indices(q.device)
        return pool_and_clean(q, k, v, indices.valid_sizes, (True,) * 3, indices.tile_to_raster)

    def pool_raster(self, q, k, v, tiling):
        indices = tiling.indices(q.device)
        return pool_and_clean(q, k, v, indices.valid_sizes, (False,) * 3, indices.tile_to_raster)

    def select(self, q_pooled, k_pooled, valid_sizes, topk):
        return select_topk(q_pooled, k_pooled, valid_sizes, topk)

    def select_split(self, q_pooled, k_pooled, valid_sizes, topk, kv_tile):
        """`select` and its `ForwardSplit` from the same launch (fewer than 2^16 tiles; more
        and the backend splits the lists itself)."""
        if valid_sizes.shape[0] > 1 << PACKED_BLOCK_BITS:
            return self.select(q_pooled, k_pooled, valid_sizes, topk), None
        indices, *split = select_topk_split(q_pooled, k_pooled, valid_sizes, topk, kv_tile)
        return indices, ForwardSplit(*split)

    def select_and_attend(self, q_pooled, k_pooled, v_pooled, valid_sizes, topk, scale,
                          kv_tile=None, *, may_have_empty=True):  # fmt: skip
        """The coarse attention, the selection and (with ``kv_tile``, fewer than 2^16 tiles)
        its `ForwardSplit` from one launch of the selection kernel (inference only; empty key
        tiles are always left out, so ``may_have_empty`` changes nothing here)."""
        if kv_tile is not None and valid_sizes.shape[0] > 1 << PACKED_BLOCK_BITS:
            kv_tile = None
        coarse, indices, *split = select_attend(
            q_pooled,
            k_pooled,
            v_pooled,
            valid_sizes,
            topk,
            scale,
            kv_tile or 0,
            self.attend_after_scores,
        )
        return coarse, indices, ForwardSplit(*split) if kv_tile else None

    def combine(
        self, fine, coarse, gate, valid_sizes, gate_padding_as_zero=False, padding_index=None
    ):
        return combine_tiles(fine, coarse, gate, valid_sizes, bool(gate_padding_as_zero))

    def combine_to_raster(self, fine, coarse, gate, tiling):
        indices = tiling.indices(fine.device)
        return combine_tiles(
            fine, coarse, gate, indices.valid_sizes, False, indices.tile_to_raster, tiling.seq_len
        )

    def combine_raster(self, fine, coarse, gate, tiling):
        indices = tiling.indices(fine.device)
        return combine_tiles(
            fine, coarse, gate, indices.valid_sizes, False, indices.tile_to_raster, tiling.seq_len,
            True,
        )  # fmt: skip

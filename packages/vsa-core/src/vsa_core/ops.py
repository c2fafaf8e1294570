"""The public operations: `block_sparse_attn` and `video_sparse_attn`.

Plan / run: the data-independent part of a call (tiling index tensors, valid sizes) is built
once per latent shape and device and cached by `VideoTiling`; the data-dependent part (which
tiles each query tile attends to) is a `BlockSparseLayout` value. `block_sparse_attn` runs a
layout you planned; `video_sparse_attn` plans it from the coarse stage and runs it.

Both take BSHD tensors ([batch, seq, heads, head_dim], the native format) or BHSD ones with
``qkv_format="bhsd"``, and answer in the format they were given.

``deterministic=True`` (both ops): bitwise-reproducible output and gradients, run to run, on
the same inputs, device, versions and settings. What each part of the op does for it:

- the fine attention goes to a backend that accepts deterministic calls (`Backend.
  handles_deterministic`; ``auto`` picks one, a named backend that cannot raises ValueError
  naming ``deterministic``): ``triton`` always (no atomics: every output element is summed by
  one program in list order), ``fa4`` without gradients, and with them for 64x64 blocks on
  sm_90, where it runs its dS-writing backward and a query-owned dQ pass in list order (its
  shipped backward reduce-adds float32 dQ partials across key tiles in scheduling order),
  ``reference`` except its backward off the CPU (``torch.gather``'s backward scatter-adds
  with atomics on CUDA);
- the coarse attention runs on SDPA's math backend (matmuls and a softmax, through autograd):
  the flash, memory-efficient and cuDNN backends' backwards may accumulate dQ with atomics;
- the coarse stage must be ``torch`` or ``triton`` (`DETERMINISTIC_COARSE_STAGES`), both
  free of atomics: pooling, its backward and the combine's backward sum each tile in one
  Triton program or one torch reduction; the selection (Triton: exact on integer images of
  the scores, ties to the lower tile; torch: a matmul and ``torch.topk``) only picks indices.

Limits: checked in eager mode (under ``torch.compile`` code that inductor generates around the
op's custom ops is inductor's; ``torch.use_deterministic_algorithms(True)`` governs it); torch's
matmuls (the coarse attention, the torch selection's scores) are reproducible as cuBLAS states:
same architecture and SM count, and with several CUDA streams ``CUBLAS_WORKSPACE_CONFIG``
set to ``:4096:8``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import torch

from vsa_core.backends import AttentionCall, select_backend
from vsa_core.backends.registry import backend_override, registry_generation
from vsa_core.coarse import coarse_attention, coarse_stage, layout_from_selection, zero_padding
from vsa_core.host_cache import resolved_once
from vsa_core.layout import BlockSparseLayout, _full_on_host, check_layout_matches
from vsa_core.tiling import VideoTiling
from vsa_core.validation import (
    as_flag,
    check_coarse_gate,
    check_copy_to_tiles,
    check_int_tensor,
    check_qkv,
    check_range,
    check_scale,
    check_topk,
    empty_batch_lse,
    empty_batch_result,
)

QKVFormat = Literal["bshd", "bhsd"]
TokenOrder = Literal["tiled", "raster"]

DETERMINISTIC_COARSE_STAGES = frozenset({"torch", "triton"})
"""Coarse stages audited for ``deterministic=True`` (no order-dependent reduction)."""


def block_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockSparseLayout,
    *,
    backend: str = "auto",
    scale: float | None = None,
    qkv_format: QKVFormat = "bshd",
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query block to the key blocks ``layout`` selects.

    Args:
        q: [B, NQ * q_block, H, D] (BSHD) or [B, H, NQ * q_block, D] (BHSD).
        k, v: [B, NKV * kv_block, H, D] or BHSD, same dtype and device as q.
        layout: the selection; its batch, heads and lengths must match q and k.
        backend: a backend name or ``"auto"`` (see `vsa_core.backends`).
        scale: softmax scale, default ``1 / sqrt(D)``.
        qkv_format: ``"bshd"`` or ``"bhsd"``.
        deterministic: bitwise-reproducible out, lse and gradients run to run (same inputs,
            device, versions): only a backend that runs the call so is used (see the module
            doc; ``auto`` picks one, a named backend that cannot raises ValueError). Costs the
            speed of the backend given up: with gradients fa4 is never used.

    Returns:
        ``(out, lse)``: out in q's format and dtype; lse [B, H, Sq] in float32 (float64 for
        float64 inputs), natural log, -inf for query rows that see no real key (their out is 0).
    """
    batch, q_len, _, heads, _ = check_qkv(q, k, v, qkv_format)
    q, k, v = (_as_bshd(t, qkv_format) for t in (q, k, v))
    check_layout_matches(layout, q, k)
    scale = check_scale(scale, q.shape[-1])
    deterministic = as_flag("deterministic", deterministic)
    if batch == 0:  # nothing to attend: empty results, out in q's format (differentiable)
        out = _from_bshd(empty_batch_result(q, k, v), qkv_format)
        return out, empty_batch_lse(q, heads, q_len)
    chosen, padding_as_is = _backend_for(
        q, k, v, layout.block_shape, layout.q_group_size, layout.kv_blocks_full, backend,
        deterministic,
    )  # fmt: skip
    if not (padding_as_is or layout.kv_blocks_full):
        v = zero_padding(v, layout.kv_valid_sizes)
        k = zero_padding(k, layout.kv_valid_sizes) if _requires_grad(q, k, v) else k
    out, lse = chosen.forward(q, k, v, layout, scale)
    return _from_bshd(out, qkv_format), lse


def video_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topk: int,
    tiling: VideoTiling | None = None,
    kv_valid_sizes: torch.Tensor | None = None,
    coarse_gate: torch.Tensor | None = None,
    backend: str = "auto",
    scale: float | None = None,
    qkv_format: QKVFormat = "bshd",
    token_order: TokenOrder = "tiled",
    validate: bool = True,
    coarse_backend: str = "auto",
    deterministic: bool = False,
    copy_to_tiles: bool = True,
) -> torch.Tensor:
    """Video Sparse Attention: ``out = fine + coarse * coarse_gate``.

    Each tile is pooled to one token; dense attention between pooled tiles gives the coarse
    output (broadcast to every token of a tile) and, per (batch, head, query tile), the ``topk``
    key tiles with the highest coarse scores; block-sparse attention over those tiles gives the
    fine output. Same semantics as FastVideo's ``video_sparse_attn``.

    Args:
        q, k, v: self-attention inputs, BSHD (or BHSD with ``qkv_format="bhsd"``).
        topk: key tiles per query tile, in [1, number of tiles].
        tiling: the latent's `VideoTiling`. Give exactly one of ``tiling`` and
            ``kv_valid_sizes``.
        kv_valid_sizes: [N] real tokens per tile, for inputs already in tile order; the tile size
            is then seq_len / N. Checked against [0, tile size] when ``validate`` (a host sync).
        coarse_gate: multiplies the coarse output, broadcastable to q's shape (and in q's token
            order); None means 1.
        backend: fine-attention backend name or ``"auto"``.
        scale: softmax scale of both stages, default ``1 / sqrt(D)``.
        qkv_format: ``"bshd"`` or ``"bhsd"``.
        token_order: ``"tiled"`` (default): the sequence is already in tile order, padded to
            ``tiling.padded_len`` (permute once per model, not per layer); ``"raster"``: the
            sequence is in T-H-W raster order (needs ``tiling``); the coarse stage tiles q, k
            and v as it pools them and writes the output back in raster order (with the
            Triton coarse stage in the same kernels, no separate permutation copies; the torch
            stage copies).
        validate: run data checks on user-supplied ``kv_valid_sizes``.
        coarse_backend: what runs the pooling and top-k selection (`vsa_core.coarse`):
            ``"auto"`` (the fastest installed implementation that accepts the tensors: Triton
            kernels on CUDA with vsa-triton, else torch ops), ``"torch"`` or a plug-in's name.
            The selections agree except between key tiles whose scores tie to float32
            rounding (the Triton kernels break exact ties towards the lower tile index).
        deterministic: bitwise-reproducible output and gradients (of q, k, v and the gate),
            run to run, on the same inputs, device, versions and settings (the module doc
            says how each part keeps it). ``auto`` then picks a backend that runs the call
            so (in training on a GPU fa4 for 64x64 tiles on sm_90, through its dS-writing
            backward, else ``triton``); a named
            ``backend`` or ``coarse_backend`` that cannot raises ValueError. The coarse
            attention runs on SDPA's math backend, which holds its [B, H, N, N] scores (N
            tiles) instead of streaming them. What it costs at Wan sizes: README, "Using it".
        copy_to_tiles: with ``token_order="raster"``: True (default) has the coarse stage
            write tile-order copies of q, k and v for the fine kernels (the fastest path);
            False has the fine backend read them where they are (``Backend.reads_raster``:
            ``triton``; ``auto`` picks such a backend, a named one that cannot raises
            ValueError): no copies, so less memory (at Wan 2.1 720p, 40 heads, inference
            peaks at 1.07x dense attention's extra memory instead of 5.97x, training at 1.29x
            instead of 1.85x), but slower kernels (H200: forward 5-16%, backward 30-41%;
            README, "Using it"). Must stay True with ``token_order="tiled"``.

    Returns:
        out in q's format, dtype and token order.

    Memory: the coarse output is never expanded to tokens. Without autograd the combine runs
    in place on the fine output; with autograd it is one fused multiply-add.

    Padding: with ``token_order="tiled"``, slots past a tile's real tokens carry no token and
    may hold anything (NaN included): pooling never reads them, and the fine kernels read
    them only where a padding value is multiplied by a zero probability (V's, in every
    backend; with gradients Q's and some backends' K's too), so those inputs are read with
    their padding zeroed. Without autograd and with a ``tiling``, the op **writes zeros into
    those inputs' padding slots** (v's; the Triton stage stores them in its pooling pass)
    instead of copying them: in eager mode, when the tensor can be written (not an inference
    tensor outside inference mode, no elements sharing memory). Otherwise, and with
    gradients, it reads zero-padded copies.
    """
    batch, seq, kv_seq, _, dim = check_qkv(q, k, v, qkv_format)
    if seq != kv_seq:
        raise ValueError(f"k must have q's sequence length {seq} (self-attention), got {kv_seq}")
    if token_order not in ("tiled", "raster"):
        raise ValueError(f"token_order must be 'tiled' or 'raster', got {token_order!r}")
    valid_sizes, tile_tokens = _resolve_tiles(
        tiling, kv_valid_sizes, seq, token_order, q.device, validate
    )
    topk = check_topk(topk, valid_sizes.shape[0])
    gate = check_coarse_gate(coarse_gate, q)
    seq_dim = 1 if qkv_format == "bshd" else 2
    seq_gate = gate is not None and gate.dim() == q.dim() and gate.shape[seq_dim] == seq
    scale = check_scale(scale, dim)
    deterministic = as_flag("deterministic", deterministic)
    copy_to_tiles = check_copy_to_tiles(copy_to_tiles, token_order)
    if batch == 0:  # nothing to attend: an empty output in q's format (differentiable)
        return empty_batch_result(q, k, v, gate)

    gate = None if gate is None else _as_bshd(gate.expand(q.shape), qkv_format)
    q, k, v = (_as_bshd(t, qkv_format) for t in (q, k, v))
    all_full = _tiles_all_full(tiling, valid_sizes, tile_tokens)
    block_shape = (tile_tokens, tile_tokens)
    training = _requires_grad(q, k, v) or (gate is not None and _requires_grad(gate))
    stage = coarse_stage(coarse_backend, q)
    if deterministic and stage.name not in DETERMINISTIC_COARSE_STAGES:
        known = ", ".join(sorted(DETERMINISTIC_COARSE_STAGES))
        raise ValueError(
            f"coarse_backend={coarse_backend!r} runs the coarse stage {stage.name!r}, which is "
            f"not known to be deterministic; with deterministic=True use one of {known}"
        )
    raster = token_order == "raster"
    # chosen before pooling: whether the fine backend reads raster order decides the copies;
    # described with the tile-order length whatever the order (the ranking's problem size)
    chosen, padding_as_is = _backend_for(
        q, k, v, block_shape, 1, all_full, backend, deterministic,
        valid_sizes.shape[0] * tile_tokens, not copy_to_tiles,
    )  # fmt: skip
    slot_rows = None
    if not copy_to_tiles:  # no tile-order copies: the kernels read raster rows
        assert tiling is not None
        slot_rows = tiling.indices(q.device).slot_rows
        q_pooled, k_pooled, v_pooled, q_fine, k_fine, v_fine = stage.pool_raster(q, k, v, tiling)
    elif raster:  # the stage tiles q, k, v as it pools them: zero padding, nothing to clean
        assert tiling is not None
        q_pooled, k_pooled, v_pooled, q_fine, k_fine, v_fine = stage.pool_from_raster(
            q, k, v, tiling
        )
    else:
        clean = _inputs_to_clean(all_full, training, padding_as_is)
        padding = _padding_index(tiling, q.device)
        zero = (False,) * 3 if training else _zeroable_in_place((q, k, v), clean, padding)
        if any(zero):  # inference: zeroed where they are, the rest (if any) copied
            assert padding is not None
            q_pooled, k_pooled, v_pooled = stage.pool_zeroing_padding(
                q, k, v, valid_sizes, zero, padding
            )
            q_fine, k_fine, v_fine = (
                zero_padding(x, valid_sizes, padding) if c and not z else x
                for x, c, z in zip((q, k, v), clean, zero, strict=True)
            )
        else:
            q_pooled, k_pooled, v_pooled, q_fine, k_fine, v_fine = stage.pool_and_clean(
                q, k, v, valid_sizes, clean, padding
            )
    combined = not training and chosen.fuses_combine and (slot_rows is not None or not raster)
    # the backend's forward reads the selection's split lists (tile-order q, k, v: not raster
    # rows), in inference and training alike
    reads_split = chosen.reads_forward_split and not all_full and slot_rows is None
    split_tile = tile_tokens if reads_split else None  # the backend's split, same pass
    # every tile of a VideoTiling holds a real token; user valid sizes may hold 0
    coarse = None
    if not training and not deterministic:  # no gradient: attention and selection together
        with torch.no_grad():
            coarse, selection, split = stage.select_and_attend(
                q_pooled, k_pooled, v_pooled, valid_sizes, topk, scale, split_tile,
                may_have_empty=tiling is None,
            )  # fmt: skip
        q_pooled = k_pooled = v_pooled = None  # memory for the fine stage
    else:
        with torch.no_grad():
            selection, split = stage.selection(q_pooled, k_pooled, valid_sizes, topk, split_tile)
    layout = layout_from_selection(
        selection, valid_sizes, tile_tokens, all_full=all_full, forward_split=split
    )
    del selection, split

    def attend() -> torch.Tensor:
        return _coarse_attention(
            q_pooled, k_pooled, v_pooled, valid_sizes, scale, tiling is None, deterministic
        )

    if combined:  # inference: the combine runs in the fine kernel's epilogue, no second pass
        coarse = attend() if coarse is None else coarse
        return _from_bshd(
            chosen.forward_combined(q_fine, k_fine, v_fine, layout, scale, coarse, gate,
                                    slot_rows),
            qkv_format,
        )  # fmt: skip
    if slot_rows is not None:
        fine, _ = chosen.forward_rows(q_fine, k_fine, v_fine, layout, scale, slot_rows)
    else:
        fine, _ = chosen.forward(q_fine, k_fine, v_fine, layout, scale)
    # the coarse attention after the fine kernel's launch: a call waited for starts its longest
    # kernel sooner (the device runs pooling, selection and fine attention back to back while
    # the host issues the coarse attention; research.op_host_timeline)
    coarse = attend() if coarse is None else coarse
    if slot_rows is not None:
        out = stage.combine_raster(fine, coarse, gate, tiling)
    elif raster:
        out = stage.combine_to_raster(fine, coarse, gate, tiling)
    else:
        gate_padding_as_zero = training and seq_gate and not all_full
        out = stage.combine(
            fine, coarse, gate, valid_sizes, gate_padding_as_zero, _padding_index(tiling, q.device)
        )
    return _from_bshd(out, qkv_format)


# ---- helpers ---------------------------------------------------------------------------------
def _coarse_attention(q_pooled, k_pooled, v_pooled, valid_sizes, scale, may_have_empty,
                      deterministic):  # fmt: skip
    """`coarse_attention`; with ``deterministic`` on SDPA's math backend, whose forward and
    backward are matmuls and a softmax through autograd (PyTorch's flash backward accumulates
    dQ with atomics, and the memory-efficient and cuDNN ones are documented nondeterministic)."""
    backends = nullcontext()
    if deterministic:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = sdpa_kernel(SDPBackend.MATH)
    with backends:
        return coarse_attention(
            q_pooled, k_pooled, v_pooled, valid_sizes, scale, may_have_empty=may_have_empty
        )


def _backend_for(q, k, v, block_shape, q_group_size, kv_blocks_full, backend, deterministic,
                 q_len=None, raster_inputs=False):  # fmt: skip
    """The fine backend for these inputs and a layout of this description (its lists do not
    matter: the op chooses before it selects), and whether it reads key padding as it is for
    such a call (`Backend.reads_key_padding_as_is`: no zeroed copies of k and v); ``q_len``:
    the layout's query length, when q is not in tile order; ``raster_inputs``: the backend must
    read raster-order q, k, v."""
    requires_grad = _requires_grad(q, k, v)
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a backend name or 'auto', got {backend!r}")
    q_len = q.shape[1] if q_len is None else q_len
    return _fine_backend(
        backend, backend_override(), registry_generation(),
        q.device, q.dtype, q.shape[-1], block_shape, requires_grad,
        q_group_size, kv_blocks_full, q.shape[0] * q_len * q.shape[2], q_len, deterministic,
        raster_inputs,
    )  # fmt: skip


def _tiles_all_full(tiling, valid_sizes, tile_tokens) -> bool:
    """Whether every tile is full: a tiling knows; user valid sizes are read on the host,
    except under torch.compile (a data-dependent branch there), which assumes partial tiles
    (always correct)."""
    if tiling is not None:
        return not tiling.has_padding
    return not torch.compiler.is_compiling() and _full_on_host(valid_sizes, tile_tokens)


def _padding_index(tiling: VideoTiling | None, device: torch.device) -> torch.Tensor | None:
    return None if tiling is None else tiling.indices(device).padding_index


def _zeroable_in_place(
    tensors: tuple[torch.Tensor, ...], clean: tuple[bool, ...], padding_index: torch.Tensor | None
) -> tuple[bool, ...]:
    """Inference only: which of the inputs ``clean`` marks get their padding slots zeroed
    where they are (`CoarseStage.pool_zeroing_padding`) instead of a zero-padded copy (at
    Wan 2.1 720p with 40 heads the copy of v is 900 MiB, as much as the output). Padding
    slots hold no token, so nothing the caller reads as a token changes. Kept as copies:
    without a tiling (the padding slots would need a look at the valid sizes), under
    ``torch.compile`` (a mutated input keeps ``mode="reduce-overhead"`` from capturing the
    graph), and for a tensor that cannot be written (an inference tensor outside inference
    mode, or elements that share memory, as in an ``expand``)."""
    if padding_index is None or not any(clean) or torch.compiler.is_compiling():
        return (False,) * len(tensors)
    return tuple(flag and _writable(t) for t, flag in zip(tensors, clean, strict=True))


def _writable(t: torch.Tensor) -> bool:
    """Whether an in-place fill of t is allowed and writes each element alone: not an
    inference tensor outside inference mode, and no two elements at one address (each
    dimension's stride, in increasing order, at least the span of the smaller ones)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return False
    span = 1
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def _requires_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _inputs_to_clean(padding_is_zero: bool, training: bool, key_padding_safe: bool):
    """Which of q, k, v the fine backend must read with their padding slots zeroed (none when
    there is no padding or the op made it: `VideoTiling.to_tiles` pads with zeros). When
    gradients flow, query padding rows feed dK and dV in every backend's backward; key padding
    only reaches backends that multiply it by zero probabilities (``key_padding_safe`` False):
    V always, K when gradients flow (its scores are masked by selection; dQ = dS K with dS = 0
    there, and 0 * NaN is NaN). Pooling never reads padding, so the coarse stage needs none."""
    if padding_is_zero:
        return (False, False, False)
    return (training, training and not key_padding_safe, not key_padding_safe)


@resolved_once
def _fine_backend(
    backend, _override, _generation, device, dtype, head_dim, block_shape, requires_grad,
    q_group_size, kv_blocks_full, query_rows, query_len, deterministic, raster_inputs,
):  # fmt: skip
    """The backend `select_backend` picks for a call so described (as it runs that call:
    `Backend.for_call`) and whether it reads key padding as it is there (decided once per
    description; the override variable and the registered backends are part of the key)."""
    call = AttentionCall(
        device, dtype, head_dim, block_shape, requires_grad, q_group_size, kv_blocks_full,
        query_rows=query_rows, query_len=query_len, deterministic=deterministic,
        raster_inputs=raster_inputs,
    )  # fmt: skip
    chosen = select_backend(call, backend).for_call(call)
    return chosen, chosen.reads_key_padding_as_is(call)


def _resolve_tiles(tiling, kv_valid_sizes, seq, token_order, device, validate):
    if (tiling is None) == (kv_valid_sizes is None):
        raise ValueError("give exactly one of tiling= and kv_valid_sizes=")
    if tiling is not None:
        if not isinstance(tiling, VideoTiling):
            raise ValueError(f"tiling must be a VideoTiling, got {type(tiling).__name__}")
        expected = tiling.padded_len if token_order == "tiled" else tiling.seq_len
        if seq != expected:
            what = "tiling.padded_len" if token_order == "tiled" else "tiling.seq_len (T*H*W)"
            raise ValueError(
                f"q must have {what} = {expected} tokens for token_order={token_order!r}, got {seq}"
            )
        return tiling.valid_sizes(device), tiling.tile_tokens
    if token_order == "raster":
        raise ValueError("token_order='raster' needs tiling=, not kv_valid_sizes=")
    check_int_tensor("kv_valid_sizes", kv_valid_sizes)
    if kv_valid_sizes.dim() != 1 or kv_valid_sizes.numel() == 0:
        raise ValueError(
            f"kv_valid_sizes must be a non-empty 1-D tensor [num_tiles], got shape "
            f"{tuple(kv_valid_sizes.shape)}"
        )
    if kv_valid_sizes.device != device:
        raise ValueError(
            f"kv_valid_sizes must be on q's device {device}, got {kv_valid_sizes.device}"
        )
    num_tiles = kv_valid_sizes.shape[0]
    if seq % num_tiles:
        raise ValueError(
            f"q's sequence length {seq} must be a multiple of len(kv_valid_sizes) = {num_tiles}"
        )
    if validate:
        check_range("kv_valid_sizes", kv_valid_sizes, 0, seq // num_tiles)
    return kv_valid_sizes.to(torch.int32), seq // num_tiles


def _as_bshd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    return x if qkv_format == "bshd" else x.transpose(1, 2)


_from_bshd = _as_bshd  # the transpose is its own inverse

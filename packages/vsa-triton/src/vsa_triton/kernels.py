"""Triton kernels of block-sparse attention over vsa-core's layouts.

Conventions shared by every kernel:

- q/k/v/out/dout are [B, S, H, D] addressed through strides, the head dim contiguous, so BSHD
  and BHSD tensors both run without copies. lse and delta are [B, H, S] float32, contiguous.
- The forward and dQ kernels own one query block and walk its key list ``kv_indices[b, h, i,
  :count]``. Key blocks are loaded ``TILE_N // KV_BLOCK`` at a time into one TILE_N-row tile
  (a gathered load: each row's address comes from its block's index), so 64-token key blocks
  still feed 128-wide dot products. A tile's rows past the list end, or past a block's valid
  size, are masked.
- The dK/dV kernel owns one key block and walks its query list (the CSR transpose,
  `vsa_core.layout.KVToQLists`), gathering ``TILE_M // Q_BLOCK`` query blocks per tile, or,
  with ``TILE_M`` below ``Q_BLOCK``, one ``TILE_M``-row slice of a query block per step.
- Softmax runs in base 2: ``qk_scale = scale * log2(e)``; the stored lse is natural-log.
  A row that sees no real key keeps m = -inf, l = 0 and ends with out = 0, lse = -inf, and
  contributes zero gradients (its lse is treated as +inf in backward, so p = 0).
- Masked loads replace padding with 0, so garbage (even NaN) in padding slots never leaks.
- Token placement (``RASTER``): q/k/v/out/dout and the gradients may be in a latent's raster
  order instead of tile order. Every row is then addressed through ``Rows``, the tiling's map
  from tile-order slot to raster row (-1 for padding slots, which are never read or written);
  lse and delta stay per slot ([B, H, padded length]). Without RASTER a slot is its own row and
  the map is never read (the compiled code is the same as before the map existed).
- ``COMBINE`` (forward, inference): the output is VSA's ``fine + gate * coarse[query tile]``,
  added in the epilogue in float32 and rounded once, so no separate combine pass runs.
- Loops over lists are ``for j in range(0, count, step)`` (software-pipelined on the GPU);
  Triton's interpreter cannot take a loaded bound there, so with ``INTERPRET`` the same step
  function runs under a ``while`` loop instead.
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _gather_rows(idx_row, valid_ptr, Rows, j, end, offs, BLOCK: tl.constexpr, TILE: tl.constexpr,
                 RASTER: tl.constexpr):
    """Rows of the key tile that starts at list slot j: (sequence row, row is real).

    A tile of one block takes a scalar index, so the compiler sees contiguous rows; a tile of
    several blocks gathers (each row's block index is loaded).
    """
    if TILE == BLOCK:
        block = tl.load(idx_row + j)
        real = offs < tl.load(valid_ptr + block)
        return _slot_rows(Rows, block * BLOCK + offs, real, RASTER), real
    slot = j + offs // BLOCK
    in_list = slot < end
    block = tl.load(idx_row + slot, mask=in_list, other=0)
    valid = tl.load(valid_ptr + block, mask=in_list, other=0)
    within = offs % BLOCK
    real = within < valid
    return _slot_rows(Rows, block * BLOCK + within, real, RASTER), real


@triton.jit
def _gather_q_rows(idx_row, j, end, offs, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Slots of the query tile that starts at list slot j: (tile-order slot, slot is in the
    list)."""
    if TILE == BLOCK:
        block = tl.load(idx_row + j)
        return block * BLOCK + offs, offs < BLOCK
    slot = j + offs // BLOCK
    in_list = slot < end
    block = tl.load(idx_row + slot, mask=in_list, other=0)
    return block * BLOCK + offs % BLOCK, in_list


@triton.jit
def _load_rows(base, rows, stride, offs_d, row_mask):
    return tl.load(base + rows[:, None] * stride + offs_d[None, :], mask=row_mask[:, None],
                   other=0.0)


@triton.jit
def _slot_rows(Rows, slots, mask, RASTER: tl.constexpr):
    """Rows of tile-order ``slots`` in the token tensors: the slots themselves, or with RASTER
    each slot's raster row from the map (row 0 where ``mask`` is off: callers mask the same)."""
    if RASTER:
        return tl.load(Rows + slots, mask=mask, other=0)
    return slots


@triton.jit
def _query_rows(Rows, slots, mask):
    """(raster rows, real) of query ``slots`` (RASTER only): the map's -1 marks padding."""
    mapped = tl.load(Rows + slots, mask=mask, other=-1)
    return tl.maximum(mapped, 0), mapped >= 0


@triton.jit
def _prefetched_rows(Rows, block, valid, offs, BLOCK: tl.constexpr, RASTER: tl.constexpr):
    """With RASTER, a key block's raster rows, loaded one loop step before their use so the
    K/V loads take loop-carried addresses (as the block index is prefetched); else unused:
    `_rows_now` computes the rows from the block index, as the kernels did before RASTER."""
    rows = offs  # loop-invariant where unused: the compiler drops it from the loop
    if RASTER:
        rows = tl.load(Rows + block * BLOCK + offs, mask=offs < valid, other=0)
    return rows


@triton.jit
def _rows_now(prefetched, block, offs, BLOCK: tl.constexpr, RASTER: tl.constexpr):
    if RASTER:
        return prefetched
    return block * BLOCK + offs


@triton.jit
def _fwd_step(q, k_base, v_base, idx_row, kv_valid_ptr, Rows, j, count, offs_n, offs_d,
              stride_ks, stride_vs, qk_scale, m_i, l_i, acc, KV_BLOCK: tl.constexpr,
              TILE_N: tl.constexpr, DUAL: tl.constexpr, RASTER: tl.constexpr):
    """One key tile of the online softmax.

    DUAL: two key blocks per step, each with a scalar index (contiguous loads) and its own dot
    products, sharing one softmax rescale; otherwise one tile of TILE_N rows (see _gather_rows).
    """
    if DUAL:
        rows, real = _gather_rows(idx_row, kv_valid_ptr, Rows, j, count, offs_n, KV_BLOCK,
                                  KV_BLOCK, RASTER)
        has_second = j + 1 < count
        second = tl.load(idx_row + j + 1, mask=has_second, other=0)
        valid2 = tl.load(kv_valid_ptr + second, mask=has_second, other=0)
        real2 = offs_n < valid2
        rows2 = _slot_rows(Rows, second * KV_BLOCK + offs_n, real2, RASTER)
        return _fwd_dual_tile(q, k_base, v_base, rows, real, rows2, real2, offs_d, stride_ks,
                              stride_vs, qk_scale, m_i, l_i, acc)
    rows, real = _gather_rows(idx_row, kv_valid_ptr, Rows, j, count, offs_n, KV_BLOCK, TILE_N,
                              RASTER)
    return _fwd_tile(q, k_base, v_base, rows, real, offs_d, stride_ks, stride_vs, qk_scale, m_i,
                     l_i, acc)


@triton.jit
def _fwd_dual_tile(q, k_base, v_base, rows, real, rows2, real2, offs_d, stride_ks, stride_vs,
                   qk_scale, m_i, l_i, acc):
    """Online-softmax update with two key blocks, two dots each, one shared rescale."""
    k = _load_rows(k_base, rows, stride_ks, offs_d, real)
    k2 = _load_rows(k_base, rows2, stride_ks, offs_d, real2)
    s = tl.where(real[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
    s2 = tl.where(real2[None, :], tl.dot(q, tl.trans(k2)) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s, 1), tl.max(s2, 1)))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf on empty rows
    p = tl.math.exp2(s - m_safe[:, None])
    p2 = tl.math.exp2(s2 - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1) + tl.sum(p2, 1)
    v = _load_rows(v_base, rows, stride_vs, offs_d, real)
    v2 = _load_rows(v_base, rows2, stride_vs, offs_d, real2)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    acc = acc + tl.dot(p2.to(v2.dtype), v2)
    return m_new, l_i, acc


@triton.jit
def _fwd_tile(q, k_base, v_base, rows, real, offs_d, stride_ks, stride_vs, qk_scale, m_i, l_i,
              acc):
    """Online-softmax update with the key rows ``rows`` (``real`` masks padding)."""
    k = _load_rows(k_base, rows, stride_ks, offs_d, real)
    v = _load_rows(v_base, rows, stride_vs, offs_d, real)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(real[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf on empty rows
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def fwd_kernel(
    Q, K, V, Out, Lse, kv_idx_ptr, kv_cnt_ptr, kv_valid_ptr, Rows, Coarse, Gate,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
    stride_pb, stride_pn, stride_ph, stride_gb, stride_gs, stride_gh, stride_gd,
    num_heads, seq_q, qk_scale,
    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, INTERPRET: tl.constexpr, DUAL: tl.constexpr,
    RASTER: tl.constexpr = False, COMBINE: tl.constexpr = False, HAS_GATE: tl.constexpr = False,
):
    """One (query block, batch x head). ``seq_q``: tile-order slots (lse's row length).
    COMBINE: out = fine + gate * Coarse[b, query block, h] (Coarse [B, NQ, H, D], strides
    stride_p*; the gate, with HAS_GATE, in the token tensors' order, any stride 0), and no lse
    (an inference output: nothing reads it, ``Lse`` is a placeholder)."""
    q_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = q_blk * Q_BLOCK + tl.arange(0, Q_BLOCK)
    offs_n = tl.arange(0, KV_BLOCK if DUAL else TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_base = Q + b * stride_qb + h * stride_qh
    if RASTER:
        q_rows, q_real = _query_rows(Rows, offs_m, offs_m < seq_q)
        q = _load_rows(q_base, q_rows, stride_qs, offs_d, q_real)
    else:
        q_rows = offs_m
        q_real = offs_m < seq_q
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :])
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    count = tl.load(kv_cnt_ptr + b * stride_cb + h * stride_ch + q_blk)
    idx_row = kv_idx_ptr + b * stride_ib + h * stride_ih + q_blk * stride_iq

    m_i = tl.full([Q_BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([Q_BLOCK], dtype=tl.float32)
    acc = tl.zeros([Q_BLOCK, HEAD_DIM], dtype=tl.float32)
    step = 2 if DUAL else TILE_N // KV_BLOCK
    if INTERPRET:
        j = 0
        while j < count:
            m_i, l_i, acc = _fwd_step(q, k_base, v_base, idx_row, kv_valid_ptr, Rows, j, count,
                                      offs_n, offs_d, stride_ks, stride_vs, qk_scale, m_i, l_i,
                                      acc, KV_BLOCK, TILE_N, DUAL, RASTER)
            j += step
    elif TILE_N == KV_BLOCK and not DUAL:
        # The next block's index and valid size (with RASTER, its rows) are loaded one
        # iteration ahead: the K/V loads then take their addresses from loop-carried values,
        # which lets the loop pipeline.
        block = tl.load(idx_row, mask=count > 0, other=0)
        valid = tl.load(kv_valid_ptr + block, mask=count > 0, other=0)
        ahead = _prefetched_rows(Rows, block, valid, offs_n, KV_BLOCK, RASTER)
        for j in range(0, count):
            more = j + 1 < count
            next_block = tl.load(idx_row + j + 1, mask=more, other=0)
            next_valid = tl.load(kv_valid_ptr + next_block, mask=more, other=0)
            next_ahead = _prefetched_rows(Rows, next_block, next_valid, offs_n, KV_BLOCK, RASTER)
            m_i, l_i, acc = _fwd_tile(q, k_base, v_base,
                                      _rows_now(ahead, block, offs_n, KV_BLOCK, RASTER),
                                      offs_n < valid, offs_d, stride_ks, stride_vs, qk_scale, m_i,
                                      l_i, acc)
            block = next_block
            valid = next_valid
            ahead = next_ahead
    elif DUAL:
        # Two prefetched (index, valid size) pairs, as in the single-block loop above.
        block = tl.load(idx_row, mask=count > 0, other=0)
        valid = tl.load(kv_valid_ptr + block, mask=count > 0, other=0)
        block2 = tl.load(idx_row + 1, mask=count > 1, other=0)
        valid2 = tl.load(kv_valid_ptr + block2, mask=count > 1, other=0)
        ahead = _prefetched_rows(Rows, block, valid, offs_n, KV_BLOCK, RASTER)
        ahead2 = _prefetched_rows(Rows, block2, valid2, offs_n, KV_BLOCK, RASTER)
        for j in range(0, count, 2):
            more = j + 2 < count
            next_block = tl.load(idx_row + j + 2, mask=more, other=0)
            next_valid = tl.load(kv_valid_ptr + next_block, mask=more, other=0)
            more2 = j + 3 < count
            next_block2 = tl.load(idx_row + j + 3, mask=more2, other=0)
            next_valid2 = tl.load(kv_valid_ptr + next_block2, mask=more2, other=0)
            next_ahead = _prefetched_rows(Rows, next_block, next_valid, offs_n, KV_BLOCK, RASTER)
            next_ahead2 = _prefetched_rows(Rows, next_block2, next_valid2, offs_n, KV_BLOCK,
                                           RASTER)
            m_i, l_i, acc = _fwd_dual_tile(q, k_base, v_base,
                                           _rows_now(ahead, block, offs_n, KV_BLOCK, RASTER),
                                           offs_n < valid,
                                           _rows_now(ahead2, block2, offs_n, KV_BLOCK, RASTER),
                                           offs_n < valid2, offs_d, stride_ks, stride_vs,
                                           qk_scale, m_i, l_i, acc)
            block, valid, block2, valid2 = next_block, next_valid, next_block2, next_valid2
            ahead, ahead2 = next_ahead, next_ahead2
    else:
        for j in range(0, count, step):
            m_i, l_i, acc = _fwd_step(q, k_base, v_base, idx_row, kv_valid_ptr, Rows, j, count,
                                      offs_n, offs_d, stride_ks, stride_vs, qk_scale, m_i, l_i,
                                      acc, KV_BLOCK, TILE_N, DUAL, RASTER)

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    if COMBINE:
        coarse = tl.load(Coarse + b * stride_pb + q_blk * stride_pn + h * stride_ph + offs_d)
        coarse = coarse.to(tl.float32)[None, :]
        if HAS_GATE:
            gate = tl.load(Gate + b * stride_gb + h * stride_gh + q_rows[:, None] * stride_gs
                           + offs_d[None, :] * stride_gd, mask=q_real[:, None], other=0.0)
            out = out + gate.to(tl.float32) * coarse
        else:
            out = out + coarse
    out_base = Out + b * stride_ob + h * stride_oh
    if RASTER:
        tl.store(out_base + q_rows[:, None] * stride_os + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=q_real[:, None])
    else:
        tl.store(out_base + offs_m[:, None] * stride_os + offs_d[None, :],
                 out.to(Out.dtype.element_ty))
    if not COMBINE:
        tl.store(Lse + bh.to(tl.int64) * seq_q + offs_m, lse)


@triton.jit
def rotate_lists_kernel(Idx, Cnt, Out, slots, span, width, SLOTS_P2: tl.constexpr):
    """One contiguous padded list per program (row ``r`` of [B, H, NQ, slots], ``r`` also its
    place in the forward's launch): the list rotated to begin at its first entry at or past
    ``(r * span // width) % span``, zeros past its count (`vsa_core.rotation.rotate_lists`)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SLOTS_P2)
    count = tl.load(Cnt + row)
    start = (row * span // width) % span
    used = offs < count
    entries = tl.load(Idx + row * slots + offs, mask=used, other=0)
    below = tl.sum((used & (entries < start)).to(tl.int32), axis=0)
    source = (offs + below) % tl.maximum(count, 1)
    rotated = tl.load(Idx + row * slots + source, mask=used, other=0)
    tl.store(Out + row * slots + offs, rotated, mask=offs < slots)


@triton.jit
def bwd_delta_kernel(
    Out, DOut, Delta, Rows,
    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    num_heads, seq_q,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, RASTER: tl.constexpr = False,
):
    """delta = rowsum(out * dout), the softmax-backward correction term, per slot (0 on
    padding slots with RASTER)."""
    row_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = row_blk * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < seq_q
    if RASTER:
        rows, real = _query_rows(Rows, offs_m, in_seq)
    else:
        rows, real = offs_m, in_seq
    o = _load_rows(Out + b * stride_ob + h * stride_oh, rows, stride_os, offs_d, real)
    do = _load_rows(DOut + b * stride_db + h * stride_dh, rows, stride_ds, offs_d, real)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * seq_q + offs_m, delta, mask=in_seq)


@triton.jit
def _lse_log2(Lse, rows, row_mask):
    """lse in base 2 for p = exp2(s - lse2); rows that saw nothing (-inf) give +inf: p = 0."""
    lse = tl.load(Lse + rows, mask=row_mask, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _dkdv_rows(Rows, slots, in_list, RASTER: tl.constexpr):
    """(rows of q / dout, rows that count) of query ``slots``: with RASTER through the map,
    padding slots dropped (their q and dout are never loaded), else the slots themselves."""
    if RASTER:
        rows, real = _query_rows(Rows, slots, in_list)
        return rows, in_list & real
    return slots, in_list


@triton.jit
def _dkdv_step(k, v, real_k, q_base, do_base, idx_row, Lse, Delta, Rows, j, end, offs_m, offs_d,
               stride_qs, stride_ds, qk_scale, dk, dv, Q_BLOCK: tl.constexpr,
               TILE_M: tl.constexpr, RASTER: tl.constexpr):
    """One gathered query tile of a key block's dK/dV (computed transposed: keys x queries)."""
    slots, in_list = _gather_q_rows(idx_row, j, end, offs_m, Q_BLOCK, TILE_M)
    rows, in_list = _dkdv_rows(Rows, slots, in_list, RASTER)
    return _dkdv_tile(k, v, real_k, q_base, do_base, Lse, Delta, slots, rows, in_list, offs_d,
                      stride_qs, stride_ds, qk_scale, dk, dv)


@triton.jit
def _dkdv_tile(k, v, real_k, q_base, do_base, Lse, Delta, slots, rows, in_list, offs_d,
               stride_qs, stride_ds, qk_scale, dk, dv):
    """dK/dV contribution of the query slots ``slots`` (lse and delta) held in ``rows`` (q and
    dout); ``in_list`` masks unused ones."""
    q = _load_rows(q_base, rows, stride_qs, offs_d, in_list)
    do = _load_rows(do_base, rows, stride_ds, offs_d, in_list)
    lse2 = _lse_log2(Lse, slots, in_list)
    delta = tl.load(Delta + slots, mask=in_list, other=0.0)
    s_t = tl.dot(k, tl.trans(q)) * qk_scale
    p_t = tl.math.exp2(s_t - lse2[None, :])
    p_t = tl.where(real_k[:, None] & in_list[None, :], p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _dkdv_slice(k, v, real_k, q_base, do_base, idx_row, Lse, Delta, Rows, t, offs_m, offs_d,
                stride_qs, stride_ds, qk_scale, dk, dv, Q_BLOCK: tl.constexpr,
                TILE_M: tl.constexpr, RASTER: tl.constexpr):
    """dK/dV contribution of slice ``t`` of the key block's query list: TILE_M rows of the
    query block at list slot ``t // (Q_BLOCK // TILE_M)``."""
    parts: tl.constexpr = Q_BLOCK // TILE_M
    block = tl.load(idx_row + t // parts)
    slots = block * Q_BLOCK + (t % parts) * TILE_M + offs_m
    rows, in_list = _dkdv_rows(Rows, slots, offs_m < TILE_M, RASTER)
    return _dkdv_tile(k, v, real_k, q_base, do_base, Lse, Delta, slots, rows, in_list, offs_d,
                      stride_qs, stride_ds, qk_scale, dk, dv)


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, q_idx_ptr, q_off_ptr, kv_valid_ptr, Rows,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_qib, stride_qih, stride_qob, stride_qoh,
    num_heads, seq_q, qk_scale, sm_scale,
    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, TILE_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, INTERPRET: tl.constexpr, RASTER: tl.constexpr = False,
):
    kv_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_n = kv_blk * KV_BLOCK + tl.arange(0, KV_BLOCK)
    offs_m = tl.arange(0, TILE_M)
    offs_d = tl.arange(0, HEAD_DIM)
    real_k = tl.arange(0, KV_BLOCK) < tl.load(kv_valid_ptr + kv_blk)
    k_rows = _slot_rows(Rows, offs_n, real_k, RASTER)

    k = _load_rows(K + b * stride_kb + h * stride_kh, k_rows, stride_ks, offs_d, real_k)
    v = _load_rows(V + b * stride_vb + h * stride_vh, k_rows, stride_vs, offs_d, real_k)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DOut + b * stride_db + h * stride_dh
    lse_row = Lse + bh.to(tl.int64) * seq_q
    delta_row = Delta + bh.to(tl.int64) * seq_q
    off_row = q_off_ptr + b * stride_qob + h * stride_qoh + kv_blk
    start = tl.load(off_row)
    end = tl.load(off_row + 1)
    idx_row = q_idx_ptr + b * stride_qib + h * stride_qih

    dk = tl.zeros([KV_BLOCK, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([KV_BLOCK, HEAD_DIM], dtype=tl.float32)
    step = TILE_M // Q_BLOCK
    if TILE_M < Q_BLOCK:
        # A query block taller than the tile is walked in TILE_M-row slices, one slice per
        # step: the tile's Q and dO stay small next to the dK/dV accumulators (whole 128-row
        # tiles spill 592-744 B on sm_90, NOTES.md).
        parts = Q_BLOCK // TILE_M
        if INTERPRET:
            t = start * parts
            while t < end * parts:
                dk, dv = _dkdv_slice(k, v, real_k, q_base, do_base, idx_row, lse_row, delta_row,
                                     Rows, t, offs_m, offs_d, stride_qs, stride_ds, qk_scale, dk,
                                     dv, Q_BLOCK, TILE_M, RASTER)
                t += 1
        else:
            for t in range(start * parts, end * parts):
                dk, dv = _dkdv_slice(k, v, real_k, q_base, do_base, idx_row, lse_row, delta_row,
                                     Rows, t, offs_m, offs_d, stride_qs, stride_ds, qk_scale, dk,
                                     dv, Q_BLOCK, TILE_M, RASTER)
    elif INTERPRET:
        j = start
        while j < end:
            dk, dv = _dkdv_step(k, v, real_k, q_base, do_base, idx_row, lse_row, delta_row, Rows,
                                j, end, offs_m, offs_d, stride_qs, stride_ds, qk_scale, dk, dv,
                                Q_BLOCK, TILE_M, RASTER)
            j += step
    elif TILE_M == Q_BLOCK:
        block = tl.load(idx_row + start, mask=start < end, other=0)  # prefetched: see fwd_kernel
        for j in range(start, end):
            next_block = tl.load(idx_row + j + 1, mask=j + 1 < end, other=0)
            slots = block * Q_BLOCK + offs_m
            rows, in_list = _dkdv_rows(Rows, slots, offs_m < Q_BLOCK, RASTER)
            dk, dv = _dkdv_tile(k, v, real_k, q_base, do_base, lse_row, delta_row, slots, rows,
                                in_list, offs_d, stride_qs, stride_ds, qk_scale, dk, dv)
            block = next_block
    else:
        for j in range(start, end, step):
            dk, dv = _dkdv_step(k, v, real_k, q_base, do_base, idx_row, lse_row, delta_row, Rows,
                                j, end, offs_m, offs_d, stride_qs, stride_ds, qk_scale, dk, dv,
                                Q_BLOCK, TILE_M, RASTER)

    dk_out = DK + b * stride_dkb + h * stride_dkh + k_rows[:, None] * stride_dks + offs_d[None, :]
    dv_out = DV + b * stride_dvb + h * stride_dvh + k_rows[:, None] * stride_dvs + offs_d[None, :]
    if RASTER:  # padding slots have no row
        tl.store(dk_out, (dk * sm_scale).to(DK.dtype.element_ty), mask=real_k[:, None])
        tl.store(dv_out, dv.to(DV.dtype.element_ty), mask=real_k[:, None])
    else:
        tl.store(dk_out, (dk * sm_scale).to(DK.dtype.element_ty))
        tl.store(dv_out, dv.to(DV.dtype.element_ty))


@triton.jit
def _dq_step(q, do, lse2, delta, k_base, v_base, idx_row, kv_valid_ptr, Rows, j, count, offs_n,
             offs_d, stride_ks, stride_vs, qk_scale, dq, KV_BLOCK: tl.constexpr,
             TILE_N: tl.constexpr, RASTER: tl.constexpr):
    """One gathered key tile of a query block's dQ."""
    rows, real = _gather_rows(idx_row, kv_valid_ptr, Rows, j, count, offs_n, KV_BLOCK, TILE_N,
                              RASTER)
    return _dq_tile(q, do, lse2, delta, k_base, v_base, rows, real, offs_d, stride_ks, stride_vs,
                    qk_scale, dq)


@triton.jit
def _dq_tile(q, do, lse2, delta, k_base, v_base, rows, real, offs_d, stride_ks, stride_vs,
             qk_scale, dq):
    """dQ contribution of the key rows ``rows``."""
    k = _load_rows(k_base, rows, stride_ks, offs_d, real)
    v = _load_rows(v_base, rows, stride_vs, offs_d, real)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    p = tl.where(real[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, kv_idx_ptr, kv_cnt_ptr, kv_valid_ptr, Rows,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
    num_heads, seq_q, qk_scale, sm_scale,
    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, INTERPRET: tl.constexpr, RASTER: tl.constexpr = False,
):
    q_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = q_blk * Q_BLOCK + tl.arange(0, Q_BLOCK)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)

    all_rows = offs_m < seq_q
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DOut + b * stride_db + h * stride_dh
    if RASTER:  # padding slots: q and dout 0, so p's row contributes nothing
        q_rows, q_real = _query_rows(Rows, offs_m, all_rows)
        q = _load_rows(q_base, q_rows, stride_qs, offs_d, q_real)
        do = _load_rows(do_base, q_rows, stride_ds, offs_d, q_real)
    else:
        q_rows, q_real = offs_m, all_rows
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :])
        do = tl.load(do_base + offs_m[:, None] * stride_ds + offs_d[None, :])
    lse2 = _lse_log2(Lse + bh.to(tl.int64) * seq_q, offs_m, all_rows)
    delta = tl.load(Delta + bh.to(tl.int64) * seq_q + offs_m)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    count = tl.load(kv_cnt_ptr + b * stride_cb + h * stride_ch + q_blk)
    idx_row = kv_idx_ptr + b * stride_ib + h * stride_ih + q_blk * stride_iq

    dq = tl.zeros([Q_BLOCK, HEAD_DIM], dtype=tl.float32)
    step = TILE_N // KV_BLOCK
    if INTERPRET:
        j = 0
        while j < count:
            dq = _dq_step(q, do, lse2, delta, k_base, v_base, idx_row, kv_valid_ptr, Rows, j,
                          count, offs_n, offs_d, stride_ks, stride_vs, qk_scale, dq, KV_BLOCK,
                          TILE_N, RASTER)
            j += step
    elif TILE_N == KV_BLOCK:
        block = tl.load(idx_row, mask=count > 0, other=0)  # prefetched: see fwd_kernel
        valid = tl.load(kv_valid_ptr + block, mask=count > 0, other=0)
        ahead = _prefetched_rows(Rows, block, valid, offs_n, KV_BLOCK, RASTER)
        for j in range(0, count):
            more = j + 1 < count
            next_block = tl.load(idx_row + j + 1, mask=more, other=0)
            next_valid = tl.load(kv_valid_ptr + next_block, mask=more, other=0)
            next_ahead = _prefetched_rows(Rows, next_block, next_valid, offs_n, KV_BLOCK, RASTER)
            dq = _dq_tile(q, do, lse2, delta, k_base, v_base,
                          _rows_now(ahead, block, offs_n, KV_BLOCK, RASTER), offs_n < valid,
                          offs_d, stride_ks, stride_vs, qk_scale, dq)
            block = next_block
            valid = next_valid
            ahead = next_ahead
    else:
        for j in range(0, count, step):
            dq = _dq_step(q, do, lse2, delta, k_base, v_base, idx_row, kv_valid_ptr, Rows, j,
                          count, offs_n, offs_d, stride_ks, stride_vs, qk_scale, dq, KV_BLOCK,
                          TILE_N, RASTER)

    dq_out = DQ + b * stride_dqb + h * stride_dqh + q_rows[:, None] * stride_dqs + offs_d[None, :]
    if RASTER:
        tl.store(dq_out, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_real[:, None])
    else:
        tl.store(dq_out, (dq * sm_scale).to(DQ.dtype.element_ty))
# fmt: on

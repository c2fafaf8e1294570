"""Triton kernels of VSA's coarse stage: tile pooling (forward and backward) and top-k selection.

Conventions:

- Token tensors are [B, N * T, H, D] in tile order (T slots per tile, the tile's real tokens
  first), addressed through strides with the head dim contiguous; pooled tensors are
  [B, N, H, D], likewise.
- Pooling reads only the first ``valid[n]`` slots of tile n: padding is never loaded, so NaN or
  inf there cannot reach a pooled value (nor, in backward, receive anything but 0). The same
  loads can write the clean copies (padding zeroed) that the fine attention reads, and the
  backward adds the fine attention's gradients of those copies to the pooled ones in one pass.
- Raster order (``RASTER``): the tensors a user holds (q, k, v going in, the output and the
  gate coming out, and their gradients) may instead be in the latent's raster order, read and
  written through the tiling's ``tile_to_raster`` map (each real slot's raster row): pooling then
  writes the tiled, zero-padded copies the fine attention reads from the same loads, and the
  combine writes the output in raster order, so tiling and untiling cost no pass of their own.
- Selection writes each (batch, head, query tile)'s ``TOPK`` chosen key tiles as an ascending
  int32 list, straight into the layout's ``kv_indices``; no sort and no boolean map. As the op
  runs it, one kernel stores the scores (and the coarse attention), a second ranks them a row a
  program (`rank_rows_kernel`); `select_topk_kernel` can also rank its own rows. The k-th
  largest score is found exactly by a search over the bits of an order-preserving integer
  image of the float32 scores (bisection, `SelectConfig`); ties at the threshold
  go to the lowest key-tile index. Empty key tiles score -inf, so they are chosen only when
  ``TOPK`` exceeds the non-empty tiles (then the lowest-numbered empty tiles).
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pool_one(src, dst, offs, mask, out, keep, inv, clean, clean_offs, in_tile,
              CLEAN: tl.constexpr, ZERO: tl.constexpr = False):
    x = tl.load(src + offs, mask=mask, other=0.0)
    if CLEAN:  # the tile as the fine attention reads it: real tokens, then zeros
        tl.store(clean + clean_offs, x, mask=in_tile)
    if ZERO:  # the input's own padding slots zeroed where they are (tile order, inference)
        tl.store(src + offs, tl.zeros_like(x), mask=in_tile & ~mask)
    tl.store(dst + out, (tl.sum(x.to(tl.float32), axis=0) * inv).to(dst.dtype.element_ty),
             mask=keep)


@triton.jit
def _tile_program(valid_ptr, heads, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_P2: tl.constexpr):
    """This program's tile, batch (int64), head, the tile's valid size, slot and dim ranges,
    and which dims are real."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    dims = tl.arange(0, DIM_P2)
    return (tile, (bh // heads).to(tl.int64), bh % heads, tl.load(valid_ptr + tile),
            tl.arange(0, SLOTS), dims, dims < HEAD_DIM)


@triton.jit
def _slot_rows(raster_rows, tile, slots, size, TILE_TOKENS: tl.constexpr, RASTER: tl.constexpr):
    """[SLOTS, 1] rows of the tile's slots in a tensor that may be in raster order: with RASTER
    each real slot's raster row from the tiling's map (padding slots: row 0, which the callers
    mask), else the slots' own tile-order rows."""
    tiled = tile.to(tl.int64) * TILE_TOKENS + slots
    if RASTER:
        return tl.load(raster_rows + tiled, mask=slots < size, other=0)[:, None]
    return tiled[:, None]


@triton.jit
def pool_fwd_kernel(
    q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs, s_ch,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    CLEAN_Q: tl.constexpr, CLEAN_K: tl.constexpr, CLEAN_V: tl.constexpr, RASTER: tl.constexpr,
    ZERO_Q: tl.constexpr = False, ZERO_K: tl.constexpr = False, ZERO_V: tl.constexpr = False,
):
    """One (tile, batch x head): the means of q, k and v over the tile's real tokens (pooled
    strides s_p* shared by qp, kp and vp) and, where CLEAN_*, the tile copied to qc / kc / vc
    in tile order with its padding slots zeroed (strides s_c* shared), from the same loads;
    where ZERO_* (tile order only), the input's own padding slots zeroed in place instead.
    With RASTER, q, k and v are read in raster order (``raster_rows``: the tiling's
    tile_to_raster)."""
    tile, b, h, size, slots, dims, keep = _tile_program(valid_ptr, heads, SLOTS, HEAD_DIM, DIM_P2)
    mask = (slots < size)[:, None] & keep[None, :]
    in_tile = (slots < TILE_TOKENS)[:, None] & keep[None, :]
    rows = (tile.to(tl.int64) * TILE_TOKENS + slots)[:, None]
    src = _slot_rows(raster_rows, tile, slots, size, TILE_TOKENS, RASTER)
    inv = 1.0 / tl.maximum(size, 1).to(tl.float32)
    out = b * s_pb + tile * s_pn + h * s_ph + dims
    c_offs = b * s_cb + h * s_ch + rows * s_cs + dims[None, :]
    _pool_one(q, qp, b * s_qb + h * s_qh + src * s_qs + dims[None, :], mask, out, keep, inv,
              qc, c_offs, in_tile, CLEAN_Q, ZERO_Q)
    _pool_one(k, kp, b * s_kb + h * s_kh + src * s_ks + dims[None, :], mask, out, keep, inv,
              kc, c_offs, in_tile, CLEAN_K, ZERO_K)
    _pool_one(v, vp, b * s_vb + h * s_vh + src * s_vs + dims[None, :], mask, out, keep, inv,
              vc, c_offs, in_tile, CLEAN_V, ZERO_V)


@triton.jit
def _unpool_one(g, d, src, offs, keep, in_tile, real, inv, f, f_offs, written,
                HAS_F: tl.constexpr):
    grad = tl.load(g + src, mask=keep, other=0.0).to(tl.float32) * inv
    tile_grad = tl.where(real, grad[None, :], 0.0)
    if HAS_F:  # the fine attention's gradient of the same tokens, on real slots only
        tile_grad += tl.load(f + f_offs, mask=real & in_tile, other=0.0).to(tl.float32)
    tl.store(d + offs, tile_grad.to(d.dtype.element_ty), mask=written)


@triton.jit
def pool_bwd_kernel(
    gq, gk, gv, fq, fk, fv, dq, dk, dv, valid_ptr, raster_rows,
    s_gb, s_gn, s_gh, s_xb, s_xs, s_xh, s_fqb, s_fqs, s_fqh, s_fkb, s_fks, s_fkh, s_fvb, s_fvs,
    s_fvh,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    HAS_FQ: tl.constexpr, HAS_FK: tl.constexpr, HAS_FV: tl.constexpr, RASTER: tl.constexpr,
    FINE_RASTER: tl.constexpr = False,
):
    """One (tile, batch x head): each real token's gradient is its tile's pooled gradient over
    the tile's size, plus (where HAS_F*) the fine attention's gradient fq / fk / fv of that
    token (tile order); padding slots get 0 (every slot is written). With RASTER the
    gradients dq / dk / dv are in raster order: each real token's row is written, once; with
    FINE_RASTER too the fine attention's gradients (it read the raster inputs themselves)."""
    tile, b, h, size, slots, dims, keep = _tile_program(valid_ptr, heads, SLOTS, HEAD_DIM, DIM_P2)
    inv = 1.0 / tl.maximum(size, 1).to(tl.float32)
    src = b * s_gb + tile * s_gn + h * s_gh + dims
    dst = _slot_rows(raster_rows, tile, slots, size, TILE_TOKENS, RASTER)
    rows = dst if FINE_RASTER else (tile.to(tl.int64) * TILE_TOKENS + slots)[:, None]
    offs = b * s_xb + h * s_xh + dst * s_xs + dims[None, :]
    in_tile = (slots < TILE_TOKENS)[:, None] & keep[None, :]
    real = (slots < size)[:, None]
    written = (real & in_tile) if RASTER else in_tile
    _unpool_one(gq, dq, src, offs, keep, in_tile, real, inv,
                fq, b * s_fqb + h * s_fqh + rows * s_fqs + dims[None, :], written, HAS_FQ)
    _unpool_one(gk, dk, src, offs, keep, in_tile, real, inv,
                fk, b * s_fkb + h * s_fkh + rows * s_fks + dims[None, :], written, HAS_FK)
    _unpool_one(gv, dv, src, offs, keep, in_tile, real, inv,
                fv, b * s_fvb + h * s_fvh + rows * s_fvs + dims[None, :], written, HAS_FV)


@triton.jit
def _order_key(scores):
    """int32 image of float32 scores whose signed order is the scores' (NaN above +inf)."""
    bits = scores.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _score_block(q, k_base, valid_ptr, score_rows, rows, dims, dim_ok, start, num_tiles, s_pn,
                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Scores of the program's query rows against key tiles [start, start + BLOCK_N), empty key
    tiles at -inf, stored to the rows' scratch."""
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols < num_tiles
    kt = tl.load(k_base + cols[None, :] * s_pn + dims[:, None],
                 mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
    s = tl.dot(q, kt, input_precision="ieee") if IEEE else tl.dot(q, kt)
    size = tl.load(valid_ptr + cols, mask=col_ok, other=0)
    s = tl.where((size > 0)[None, :], s, float("-inf"))
    tl.store(score_rows + rows[:, None] * num_tiles + cols[None, :], s,
             mask=(rows < num_tiles)[:, None] & col_ok[None, :])
    return s


@triton.jit
def _attend_block(acc, m, row_sum, s, v_base, start, dims, dim_ok, num_tiles, s_pn,
                  scale_log2, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One step of the coarse attention over key tiles [start, start + BLOCK_N): the online
    softmax of ``s`` (raw scores, -inf at empty and absent tiles) times the softmax scale, and
    its product with the tiles' pooled values, accumulated in float32 (``row_sum``: the
    softmax's running denominator). ``m``, the running maximum, starts finite (-1e30, not
    -inf) so that a step whose scores are all -inf rescales by 1, not NaN."""
    cols = start + tl.arange(0, BLOCK_N)
    vt = tl.load(v_base + cols[:, None] * s_pn + dims[None, :],
                 mask=(cols < num_tiles)[:, None] & dim_ok[None, :], other=0.0)
    m_new = tl.maximum(m, tl.max(s, axis=1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    pv = (tl.dot(p, vt, input_precision="ieee") if IEEE
          else tl.dot(p.to(vt.dtype), vt))
    return acc * alpha[:, None] + pv, m_new, row_sum


@triton.jit
def _score_step(q, kp, vp, base, valid_ptr, score_rows, rows, dims, dim_ok, start, num_tiles,
                s_pn, scale_log2, acc, m, row_sum, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                ATTEND: tl.constexpr):
    """Phase 1's step over key tiles [start, start + BLOCK_N): the scores stored, and with
    ATTEND the coarse attention's running state advanced (`_attend_block`; ``vp`` is None
    without it)."""
    s = _score_block(q, kp + base, valid_ptr, score_rows, rows, dims, dim_ok, start, num_tiles,
                     s_pn, BLOCK_N, IEEE)
    if ATTEND:
        acc, m, row_sum = _attend_block(acc, m, row_sum, s, vp + base, start, dims, dim_ok,
                                        num_tiles, s_pn, scale_log2, BLOCK_N, IEEE)
    return acc, m, row_sum


@triton.jit
def _store_coarse(coarse_ptr, base, rows, dims, dim_ok, num_tiles, s_pn, acc, row_sum):
    """The coarse output of the program's rows from the attention's final state; a row whose
    key tiles are all empty gets 0."""
    o = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(coarse_ptr + base + rows[:, None] * s_pn + dims[None, :],
             o.to(coarse_ptr.dtype.element_ty),
             mask=(rows < num_tiles)[:, None] & dim_ok[None, :])


@triton.jit
def _attend_stored(vp, coarse_ptr, base, score_rows, rows, dims, dim_ok, num_tiles, s_pn,
                   scale_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   DIM_P2: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """ATTEND_AFTER: the coarse attention of the program's rows as a pass of its own over the
    scores phase 1 stored (fewer registers live at once than inside the score loop: on sm_90
    168 with 40-56 B of stack where the split is written too, as the op runs it, 229-231
    without, against 255 inside the loop; `research.coarse_stage.compile_select`)."""
    acc = tl.zeros([BLOCK_M, DIM_P2], dtype=tl.float32)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if INTERPRET:
        start = 0
        while start < num_tiles:
            acc, m, row_sum = _attend_stored_block(vp, base, score_rows, rows, dims, dim_ok,
                                                   start, num_tiles, s_pn, scale_log2, acc,
                                                   m, row_sum, BLOCK_N, IEEE)
            start += BLOCK_N
    else:
        for start in range(0, num_tiles, BLOCK_N):
            acc, m, row_sum = _attend_stored_block(vp, base, score_rows, rows, dims, dim_ok,
                                                   start, num_tiles, s_pn, scale_log2, acc,
                                                   m, row_sum, BLOCK_N, IEEE)
    _store_coarse(coarse_ptr, base, rows, dims, dim_ok, num_tiles, s_pn, acc, row_sum)


@triton.jit
def _attend_stored_block(vp, base, score_rows, rows, dims, dim_ok, start, num_tiles, s_pn,
                         scale_log2, acc, m, row_sum, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    """`_attend_block` over key tiles [start, start + BLOCK_N) with the scores read back from
    the rows' scratch (-inf at empty tiles and past the last)."""
    cols = start + tl.arange(0, BLOCK_N)
    s = tl.load(score_rows + rows[:, None] * num_tiles + cols[None, :],
                mask=(rows < num_tiles)[:, None] & (cols < num_tiles)[None, :],
                other=float("-inf"))
    return _attend_block(acc, m, row_sum, s, vp + base, start, dims, dim_ok, num_tiles, s_pn,
                         scale_log2, BLOCK_N, IEEE)


@triton.jit
def _search_pass(key, lo, done, topk, unit):
    """One bisection pass over rows of int32 keys: ``lo`` (int64, one per row) moves up by
    ``unit`` where at least ``topk`` keys lie at or above ``lo + unit``. A row is done once
    that count is exactly ``topk``: its top-k set is then the keys at or above ``lo``. The
    threshold fits int32 (see `_kth_keys`), so the [rows, tiles] compare runs on int32."""
    trial = lo + unit
    count = tl.sum((key >= trial.to(tl.int32)[:, None]).to(tl.int32), axis=1)
    return tl.where(count >= topk, trial, lo), done | (count == topk)


@triton.jit
def _kth_keys(key, done, topk, EARLY_EXIT: tl.constexpr):
    """Per row of ``key`` ([ROWS, TILES_P2] int32, signed order), the k-th largest key: the
    largest threshold with at least ``topk`` keys at or above it, found by bisection from the
    smallest int32 up; with ``EARLY_EXIT`` the passes stop once every row's count hit
    ``topk`` exactly (about half of the 32 on random scores). Rows marked ``done`` on entry
    (past the last tile) take no part. The per-row thresholds are int64 (the first pass's unit,
    2^31, does not fit int32), but every threshold tried fits int32: after p passes ``lo`` is
    -2^31 plus a sum of distinct units above 2^(31-p), so ``lo + 2^(31-p)`` lies in
    [-2^31, 2^31 - 2^(31-p)]; the keys themselves stay int32 (int64 compares of the whole
    [rows, tiles] block cost 1.4-1.8x, `SelectConfig`)."""
    lo = tl.full(done.shape, -2147483648, tl.int64)
    if EARLY_EXIT:
        unit = tl.full([], 1 << 31, tl.int64)
        pending = tl.sum((done == 0).to(tl.int32), axis=0)
        while (unit > 0) & (pending > 0):
            lo, done = _search_pass(key, lo, done, topk, unit)
            pending = tl.sum((done == 0).to(tl.int32), axis=0)
            unit = unit >> 1
    else:
        for p in tl.static_range(32):
            lo, done = _search_pass(key, lo, done, topk, tl.full([], 1 << (31 - p), tl.int64))
    # the smallest key at or above lo: lo itself when the passes ran out, else the k-th key
    at_or_above = tl.where(key >= lo.to(tl.int32)[:, None], key, 2147483647)
    return tl.min(at_or_above, axis=1)


@triton.jit
def _chosen(score_rows, row, cols, num_rows, num_tiles, topk, EARLY_EXIT: tl.constexpr):
    """[rows, TILES_P2] mask of each row's top-k columns among the stored scores (rows of
    ``num_tiles`` scores from ``score_rows``): the keys above the k-th largest, then the tied
    ones from the lowest column until k are chosen. Rows past ``num_rows`` choose nothing."""
    key = _row_keys(score_rows, row, cols, num_rows, num_tiles)
    return _choose(key, _kth_keys(key, row >= num_rows, topk, EARLY_EXIT), topk, row, num_rows)


@triton.jit
def _row_keys(score_rows, row, cols, num_rows, num_tiles):
    """[rows, TILES_P2] int32 order keys of the stored scores (`_order_key`); columns past N
    and rows past ``num_rows`` take the smallest int32, below every score's key (-inf's
    included)."""
    live = (row < num_rows)[:, None] & (cols < num_tiles)[None, :]
    s = tl.load(score_rows + row[:, None].to(tl.int64) * num_tiles + cols[None, :], mask=live,
                other=0.0)
    return tl.where(live, _order_key(s), -2147483648)


@triton.jit
def _choose(key, kth, topk, row, num_rows):
    """The top-k mask from each row's k-th largest key ``kth``: the keys above it, then the
    tied ones from the lowest column until k are chosen; rows past ``num_rows`` none."""
    above = key > kth[:, None]
    tied = key == kth[:, None]
    room = topk - tl.sum(above.to(tl.int32), axis=1)
    tie_rank = tl.cumsum(tied.to(tl.int32), axis=1)
    return (above | (tied & (tie_rank <= room[:, None]))) & (row < num_rows)[:, None]


@triton.jit
def _store_split(out_ptr, full_idx_ptr, full_cnt_ptr, part_idx_ptr, part_cnt_ptr, valid_ptr,
                 first_row, num_tiles, bh, topk, kv_tile,
                 BLOCK_M: tl.constexpr, TOPK_P2: tl.constexpr, SPLIT_ROWS: tl.constexpr):
    """This program's rows of ``out`` (their top-k lists, read back) as `ForwardSplit` lists,
    SPLIT_ROWS rows at a time: each class ranked by a prefix sum (ascending kept), stored at
    its slot, the tails past each count zeroed, the counts stored. Read back rather than kept
    from the selection, whose [rows, tiles] masks are TILES_P2 wide: these are TOPK_P2 wide."""
    slot = tl.arange(0, TOPK_P2)
    for r in range(0, BLOCK_M, SPLIT_ROWS):
        row = first_row + r + tl.arange(0, SPLIT_ROWS)
        row_ok = row < num_tiles
        flat_row = bh.to(tl.int64) * num_tiles + row
        at = flat_row[:, None] * topk + slot[None, :]
        used = row_ok[:, None] & (slot < topk)[None, :]
        tile = tl.load(out_ptr + at, mask=used, other=0)
        valid = tl.load(valid_ptr + tile, mask=used, other=0)
        full = used & (valid >= kv_tile)
        partial = used & (valid > 0) & (valid < kv_tile)
        n_full = tl.sum(full.to(tl.int32), axis=1)
        n_part = tl.sum(partial.to(tl.int32), axis=1)
        base = flat_row[:, None] * topk
        full_slot = tl.cumsum(full.to(tl.int32), axis=1) - 1
        part_slot = tl.cumsum(partial.to(tl.int32), axis=1) - 1
        tl.store(full_idx_ptr + base + full_slot, tile, mask=full)
        tl.store(part_idx_ptr + base + part_slot, tile | (valid << 16), mask=partial)
        zero = tl.zeros([SPLIT_ROWS, TOPK_P2], dtype=tl.int32)
        tl.store(full_idx_ptr + at, zero, mask=used & (slot[None, :] >= n_full[:, None]))
        tl.store(part_idx_ptr + at, zero, mask=used & (slot[None, :] >= n_part[:, None]))
        tl.store(full_cnt_ptr + flat_row, n_full, mask=row_ok)
        tl.store(part_cnt_ptr + flat_row, n_part, mask=row_ok)


@triton.jit
def select_topk_kernel(
    qp, kp, valid_ptr, scores_ptr, out_ptr,
    full_idx_ptr, full_cnt_ptr, part_idx_ptr, part_cnt_ptr,
    s_pb, s_pn, s_ph,
    num_tiles, heads, topk, kv_tile,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr, TILES_P2: tl.constexpr, ROWS: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr, EARLY_EXIT: tl.constexpr, SPLIT: tl.constexpr = False,
    TOPK_P2: tl.constexpr = 1, SPLIT_ROWS: tl.constexpr = 1,
    vp=None, coarse_ptr=None, scale_log2=1.0, ATTEND: tl.constexpr = False,
    ATTEND_AFTER: tl.constexpr = False, RANK: tl.constexpr = True,
):
    """BLOCK_M query tiles of one (batch, head): their scores against every key tile, then
    each row's top-k as an ascending list.

    Phase 1 writes the rows' float32 scores (pooled q . pooled k; the softmax scale does not
    change the order) to this program's rows of ``scores_ptr`` ([B, H, N, N]); after a barrier,
    phase 2 reads them back ROWS rows at a time, finds each row's k-th largest key
    (`_kth_keys`), and writes the selected columns in ascending order. With SPLIT a third
    phase reads those lists back and writes them split by key-tile fullness
    (`vsa_core.layout.ForwardSplit`, ``kv_tile``-token tiles, `_store_split`): full tiles to
    ``full_idx``, partial ones as ``tile | valid << 16`` to ``part_idx``, empty ones dropped,
    each list ascending, unused slots zeroed, and both counts. With ATTEND phase 1 also runs
    the coarse attention of its rows (`_attend_block`: softmax of the scores times
    ``scale_log2``, the softmax scale times log2(e), over pooled values ``vp``, strided like
    the pooled q and k) and stores it to ``coarse_ptr`` (the same strides) in its dtype; with
    ATTEND_AFTER too, that attention runs after phase 1 instead, over the stored scores
    (`_attend_stored`). Without RANK the program stops after phase 1 (and the attention):
    `rank_rows_kernel` ranks the stored scores, one warp a row."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    base = b.to(tl.int64) * s_pb + h * s_ph
    q = tl.load(qp + base + rows[:, None] * s_pn + dims[None, :],
                mask=(rows < num_tiles)[:, None] & dim_ok[None, :], other=0.0)
    score_rows = scores_ptr + bh.to(tl.int64) * num_tiles * num_tiles
    acc = tl.zeros([BLOCK_M, DIM_P2], dtype=tl.float32)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot take a run-time bound in range()
        start = 0
        while start < num_tiles:
            acc, m, row_sum = _score_step(q, kp, vp, base, valid_ptr, score_rows, rows,
                                          dims, dim_ok, start, num_tiles, s_pn, scale_log2, acc,
                                          m, row_sum, BLOCK_N, IEEE,
                                          ATTEND and not ATTEND_AFTER)
            start += BLOCK_N
    else:
        for start in range(0, num_tiles, BLOCK_N):
            acc, m, row_sum = _score_step(q, kp, vp, base, valid_ptr, score_rows, rows,
                                          dims, dim_ok, start, num_tiles, s_pn, scale_log2, acc,
                                          m, row_sum, BLOCK_N, IEEE,
                                          ATTEND and not ATTEND_AFTER)
    if ATTEND and not ATTEND_AFTER:
        _store_coarse(coarse_ptr, base, rows, dims, dim_ok, num_tiles, s_pn, acc, row_sum)
    tl.debug_barrier()  # the next phases read scores other threads of this program wrote
    if ATTEND and ATTEND_AFTER:
        _attend_stored(vp, coarse_ptr, base, score_rows, rows, dims, dim_ok, num_tiles, s_pn,
                       scale_log2, BLOCK_M, BLOCK_N, DIM_P2, IEEE, INTERPRET)
    if RANK:
        cols = tl.arange(0, TILES_P2)
        for r in range(0, BLOCK_M, ROWS):
            row = pid_m * BLOCK_M + r + tl.arange(0, ROWS)
            chosen = _chosen(score_rows, row, cols, num_tiles, num_tiles, topk, EARLY_EXIT)
            slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
            dst = out_ptr + (bh.to(tl.int64) * num_tiles + row[:, None]) * topk + slot
            tl.store(dst, cols[None, :] + tl.zeros([ROWS, TILES_P2], dtype=tl.int32),
                     mask=chosen)
        if SPLIT:
            tl.debug_barrier()  # the split reads back lists other threads of this program wrote
            _store_split(out_ptr, full_idx_ptr, full_cnt_ptr, part_idx_ptr, part_cnt_ptr,
                         valid_ptr, pid_m * BLOCK_M, num_tiles, bh, topk, kv_tile, BLOCK_M,
                         TOPK_P2, SPLIT_ROWS)


@triton.jit
def rank_rows_kernel(
    scores_ptr, valid_ptr, out_ptr, full_idx_ptr, full_cnt_ptr, part_idx_ptr, part_cnt_ptr,
    num_rows, num_tiles, topk, kv_tile,
    TILES_P2: tl.constexpr, TOPK_P2: tl.constexpr, EARLY_EXIT: tl.constexpr,
    SPLIT: tl.constexpr, ROWS: tl.constexpr = 1, SPLIT_ROWS: tl.constexpr = 1,
):
    """Phase 2 (and the split) of `select_topk_kernel` as a kernel of its own over the
    ``num_rows`` = (batch x head) x N rows of the stored scores, ``ROWS`` a program: on a GPU
    one, in a program of one warp or a few, so that its reductions need no barrier between
    four warps and each row stops its bisection on its own, where the fused kernel's rows
    wait for the slowest of their program (the interpreter takes many rows a program: its
    cost is per program). The same lists as the fused kernel, bit for bit. The split reads the
    rows' lists back (`_store_split`), as the fused kernel does: from the chosen mask in
    registers it took the kernel from 80 to 158 registers at Wan 480p (sm_90, one warp)."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    row = first + tl.arange(0, ROWS)
    cols = tl.arange(0, TILES_P2)
    chosen = _chosen(scores_ptr, row, cols, num_rows, num_tiles, topk, EARLY_EXIT)
    slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
    tl.store(out_ptr + row[:, None] * topk + slot,
             cols[None, :] + tl.zeros([ROWS, TILES_P2], dtype=tl.int32), mask=chosen)
    if SPLIT:
        tl.debug_barrier()  # the split reads back the lists other threads of this program wrote
        # the rows as one (batch, head) of num_rows tiles: flat rows are what it indexes
        _store_split(out_ptr, full_idx_ptr, full_cnt_ptr, part_idx_ptr, part_cnt_ptr,
                     valid_ptr, first, num_rows, tl.full([], 0, tl.int32), topk, kv_tile, ROWS,
                     TOPK_P2, SPLIT_ROWS)


@triton.jit
def _combine_program(valid_ptr, raster_rows, heads, TILE_TOKENS: tl.constexpr,
                     SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                     RASTER: tl.constexpr):
    """This program's tile, batch (int64), head, its slots' tile-order rows and their rows in
    the raster-side tensors (the same rows without RASTER), dims, which dims are real, which
    (row, dim) elements exist (every slot of a tile, padding included) and which are real."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    slots = tl.arange(0, SLOTS)
    dims = tl.arange(0, DIM_P2)
    keep = dims < HEAD_DIM
    size = tl.load(valid_ptr + tile)
    rows = (tile.to(tl.int64) * TILE_TOKENS + slots)[:, None]
    user_rows = _slot_rows(raster_rows, tile, slots, size, TILE_TOKENS, RASTER)
    inside = (slots < TILE_TOKENS)[:, None] & keep[None, :]
    return (tile, (bh // heads).to(tl.int64), bh % heads, rows, user_rows, dims, keep, inside,
            inside & (slots < size)[:, None])


@triton.jit
def combine_fwd_kernel(
    fine, coarse, gate, out, valid_ptr, raster_rows,
    s_fb, s_fs, s_fh, s_cb, s_cn, s_ch, s_gb, s_gs, s_gh, s_gd, s_ob, s_os, s_oh,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    HAS_GATE: tl.constexpr, GATE_PADDING_AS_ZERO: tl.constexpr, RASTER: tl.constexpr,
    FINE_RASTER: tl.constexpr = False,
):
    """One (tile, batch x head): out = fine + gate * coarse[tile] on every slot of the tile, in
    float32, rounded once (``out`` may be ``fine`` itself: each element is read before it is
    written, by the same thread). The gate may broadcast: any of its strides may be 0; with
    GATE_PADDING_AS_ZERO its padding slots are never read (0). With RASTER, ``out`` and the
    gate are in raster order: only real slots are read from the gate and written to ``out``;
    with FINE_RASTER ``fine`` too."""
    tile, b, h, rows, user_rows, dims, keep, inside, real = _combine_program(
        valid_ptr, raster_rows, heads, TILE_TOKENS, SLOTS, HEAD_DIM, DIM_P2, RASTER)
    c = tl.load(coarse + b * s_cb + tile * s_cn + h * s_ch + dims, mask=keep, other=0.0)
    written = real if RASTER else inside
    fine_rows = user_rows if FINE_RASTER else rows
    x = tl.load(fine + b * s_fb + h * s_fh + fine_rows * s_fs + dims[None, :], mask=written,
                other=0.0)
    c = c.to(tl.float32)[None, :]
    if HAS_GATE:
        read = real if (GATE_PADDING_AS_ZERO or RASTER) else inside
        g = tl.load(gate + b * s_gb + h * s_gh + user_rows * s_gs + dims[None, :] * s_gd,
                    mask=read, other=0.0)
        y = x.to(tl.float32) + g.to(tl.float32) * c
    else:
        y = x.to(tl.float32) + c
    tl.store(out + b * s_ob + h * s_oh + user_rows * s_os + dims[None, :],
             y.to(out.dtype.element_ty), mask=written)


@triton.jit
def combine_bwd_kernel(
    dout, coarse, gate, dgate, dcoarse, dfine, valid_ptr, raster_rows,
    s_db, s_ds, s_dh, s_cb, s_cn, s_ch, s_gb, s_gs, s_gh, s_gd, s_xb, s_xs, s_xh, s_eb, s_en,
    s_eh, s_fb, s_fs, s_fh,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    HAS_GATE: tl.constexpr, WRITE_DGATE: tl.constexpr, GATE_PADDING_AS_ZERO: tl.constexpr,
    RASTER: tl.constexpr, FINE_RASTER: tl.constexpr = False,
):
    """One (tile, batch x head) of the combine's backward: dcoarse[tile] = sum over the tile's
    slots of dout * gate (of dout without a gate), in float32; dgate = dout * coarse[tile]
    (strides s_x* of dgate, s_e* of dcoarse). With RASTER, dout, the gate and dgate are in
    raster order (real slots only) and the fine output's gradient, dout in tile order with
    zeros on padding, is written to ``dfine`` (strides s_f*) from the same loads, unless
    FINE_RASTER (the fine output was in raster order too: its gradient is dout itself)."""
    tile, b, h, rows, user_rows, dims, keep, inside, real = _combine_program(
        valid_ptr, raster_rows, heads, TILE_TOKENS, SLOTS, HEAD_DIM, DIM_P2, RASTER)
    at_tile = b * s_cb + tile * s_cn + h * s_ch + dims
    d = tl.load(dout + b * s_db + h * s_dh + user_rows * s_ds + dims[None, :],
                mask=real if RASTER else inside, other=0.0)
    if RASTER and not FINE_RASTER:
        tl.store(dfine + b * s_fb + h * s_fh + rows * s_fs + dims[None, :], d, mask=inside)
    d = d.to(tl.float32)
    if HAS_GATE:
        read = real if (GATE_PADDING_AS_ZERO or RASTER) else inside
        g = tl.load(gate + b * s_gb + h * s_gh + user_rows * s_gs + dims[None, :] * s_gd,
                    mask=read, other=0.0)
        dc = tl.sum(d * g.to(tl.float32), axis=0)
        if WRITE_DGATE:  # 0 on slots whose gate acts as 0
            c = tl.load(coarse + at_tile, mask=keep, other=0.0).to(tl.float32)
            tl.store(dgate + b * s_xb + h * s_xh + user_rows * s_xs + dims[None, :],
                     tl.where(read, d * c[None, :], 0.0).to(dgate.dtype.element_ty),
                     mask=real if RASTER else inside)
    else:
        dc = tl.sum(d, axis=0)
    tl.store(dcoarse + b * s_eb + tile * s_en + h * s_eh + dims, dc.to(dcoarse.dtype.element_ty),
             mask=keep)

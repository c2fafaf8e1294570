"""Is the pooling kernel's forward held by its three load-reduce-store phases? (session 29)

In inference the Triton pooling pass only reads q, k and v (no copies are written) and on an
H100 it ran at 2.2 TB/s (Wan 480p: 302 MB in 139 us, `2026-12-05-h100-profile_video_op-
wan480p-session29.json`), while the combine kernels, same grid and access pattern, reach
2.8 TB/s. A program of the shipped kernel loads q's tile, reduces it across warps and stores,
then k's, then v's: the stores may alias the next tensor, so the compiler cannot issue the
next load before them. Two variants, built from the shipped kernel's own helpers, so their
outputs must be bitwise the shipped ones:

- ``split``: a third grid axis picks the tensor: three times the programs, one phase each;
- ``loads_first``: one program loads all three tiles, then reduces and stores each;
- ``heads_first`` (session 32): the grid's fast axis walks the heads of one tile, so that
  programs running together read whole token rows rather than one head's 256 bytes of many.

Each runs inference (no copies) and training (all three copies written) at Wan 2.1 480p and
720p, in alternating rounds, CUDA events around ``--calls`` calls back to back. Also the
inference path's fill of v's padding rows (31 us at Wan 480p on the H100, 0.7 TB/s):
``index_fill_`` against a Triton kernel that zeroes one padding row a program, and the
shipped pooling followed by ``index_fill_`` against a pooling kernel that zeroes v's padding
as it passes (``pool_zeroing_v``; the bytes column counts only the fill's). ::

    python3 -m research.coarse_stage.pool_variants --out $OUT/pool_variants.json
    TRITON_INTERPRET=1 python -m research.coarse_stage.pool_variants --check-only  # on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from vsa_core import VideoTiling
from vsa_triton import coarse
from vsa_triton.coarse_kernels import _pool_one, _slot_rows, _tile_program
from vsa_triton.tensor_args import bshd_strides

LATENTS = {"wan480p": ((21, 30, 52), 12), "wan720p": ((21, 45, 80), 40)}


@triton.jit
def _pool_tile(x, xp, xc, valid_ptr, raster_rows, s_b, s_s, s_h, s_pb, s_pn, s_ph, s_cb, s_cs,
               s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS: tl.constexpr,
               CLEAN: tl.constexpr, RASTER: tl.constexpr):  # fmt: skip
    mask = (slots < size)[:, None] & keep[None, :]
    in_tile = (slots < TILE_TOKENS)[:, None] & keep[None, :]
    rows = (tile.to(tl.int64) * TILE_TOKENS + slots)[:, None]
    src = _slot_rows(raster_rows, tile, slots, size, TILE_TOKENS, RASTER)
    inv = 1.0 / tl.maximum(size, 1).to(tl.float32)
    out = b * s_pb + tile * s_pn + h * s_ph + dims
    c_offs = b * s_cb + h * s_ch + rows * s_cs + dims[None, :]
    _pool_one(x, xp, b * s_b + h * s_h + src * s_s + dims[None, :], mask, out, keep, inv, xc,
              c_offs, in_tile, CLEAN)  # fmt: skip


@triton.jit
def _pool_all(q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows,
              s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs,
              s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS: tl.constexpr,
              CLEAN_Q: tl.constexpr, CLEAN_K: tl.constexpr, CLEAN_V: tl.constexpr,
              RASTER: tl.constexpr):  # fmt: skip
    """`_pool_tile` for q, k and v, one after the other (the shipped kernel's order)."""
    _pool_tile(q, qp, qc, valid_ptr, raster_rows, s_qb, s_qs, s_qh, s_pb, s_pn, s_ph, s_cb,
               s_cs, s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS, CLEAN_Q,
               RASTER)  # fmt: skip
    _pool_tile(k, kp, kc, valid_ptr, raster_rows, s_kb, s_ks, s_kh, s_pb, s_pn, s_ph, s_cb,
               s_cs, s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS, CLEAN_K,
               RASTER)  # fmt: skip
    _pool_tile(v, vp, vc, valid_ptr, raster_rows, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb,
               s_cs, s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS, CLEAN_V,
               RASTER)  # fmt: skip


@triton.jit
def pool_split_kernel(
    q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs, s_ch,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    CLEAN_Q: tl.constexpr, CLEAN_K: tl.constexpr, CLEAN_V: tl.constexpr, RASTER: tl.constexpr,
):  # fmt: skip
    """The shipped forward with program_id(2) choosing q (0), k (1) or v (2)."""
    tile, b, h, size, slots, dims, keep = _tile_program(valid_ptr, heads, SLOTS, HEAD_DIM, DIM_P2)
    which = tl.program_id(2)
    if which == 0:
        _pool_tile(q, qp, qc, valid_ptr, raster_rows, s_qb, s_qs, s_qh, s_pb, s_pn, s_ph, s_cb,
                   s_cs, s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS, CLEAN_Q,
                   RASTER)  # fmt: skip
    elif which == 1:
        _pool_tile(k, kp, kc, valid_ptr, raster_rows, s_kb, s_ks, s_kh, s_pb, s_pn, s_ph, s_cb,
                   s_cs, s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS, CLEAN_K,
                   RASTER)  # fmt: skip
    else:
        _pool_tile(v, vp, vc, valid_ptr, raster_rows, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb,
                   s_cs, s_ch, heads, tile, b, h, size, slots, dims, keep, TILE_TOKENS, CLEAN_V,
                   RASTER)  # fmt: skip


@triton.jit
def pool_loads_first_kernel(
    q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs, s_ch,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    CLEAN_Q: tl.constexpr, CLEAN_K: tl.constexpr, CLEAN_V: tl.constexpr, RASTER: tl.constexpr,
):  # fmt: skip
    """The shipped forward (tile order only) with the three tiles loaded before any store."""
    tile, b, h, size, slots, dims, keep = _tile_program(valid_ptr, heads, SLOTS, HEAD_DIM, DIM_P2)
    mask = (slots < size)[:, None] & keep[None, :]
    in_tile = (slots < TILE_TOKENS)[:, None] & keep[None, :]
    rows = (tile.to(tl.int64) * TILE_TOKENS + slots)[:, None]
    inv = 1.0 / tl.maximum(size, 1).to(tl.float32)
    xq = tl.load(q + b * s_qb + h * s_qh + rows * s_qs + dims[None, :], mask=mask, other=0.0)
    xk = tl.load(k + b * s_kb + h * s_kh + rows * s_ks + dims[None, :], mask=mask, other=0.0)
    xv = tl.load(v + b * s_vb + h * s_vh + rows * s_vs + dims[None, :], mask=mask, other=0.0)
    out = b * s_pb + tile * s_pn + h * s_ph + dims
    c_offs = b * s_cb + h * s_ch + rows * s_cs + dims[None, :]
    if CLEAN_Q:
        tl.store(qc + c_offs, xq, mask=in_tile)
    if CLEAN_K:
        tl.store(kc + c_offs, xk, mask=in_tile)
    if CLEAN_V:
        tl.store(vc + c_offs, xv, mask=in_tile)
    tl.store(qp + out, (tl.sum(xq.to(tl.float32), axis=0) * inv).to(qp.dtype.element_ty),
             mask=keep)  # fmt: skip
    tl.store(kp + out, (tl.sum(xk.to(tl.float32), axis=0) * inv).to(kp.dtype.element_ty),
             mask=keep)  # fmt: skip
    tl.store(vp + out, (tl.sum(xv.to(tl.float32), axis=0) * inv).to(vp.dtype.element_ty),
             mask=keep)  # fmt: skip


@triton.jit
def pool_heads_first_kernel(
    q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs, s_ch,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    CLEAN_Q: tl.constexpr, CLEAN_K: tl.constexpr, CLEAN_V: tl.constexpr, RASTER: tl.constexpr,
):  # fmt: skip
    """The shipped forward on a grid of (batch x head, tile): programs launched one after the
    other read one tile's heads, which lie side by side in each token's row (H x D x 2 bytes:
    3 KB at 12 heads), where the shipped grid's neighbours read one head of successive tiles,
    256 bytes of each row, and come back to the row's other heads a grid row later."""
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    dims = tl.arange(0, DIM_P2)
    keep = dims < HEAD_DIM
    b, h, size, slots = (bh // heads).to(tl.int64), bh % heads, tl.load(valid_ptr + tile), \
        tl.arange(0, SLOTS)  # fmt: skip
    _pool_all(q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows, s_qb, s_qs, s_qh, s_kb,
              s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs, s_ch, heads, tile, b, h,
              size, slots, dims, keep, TILE_TOKENS, CLEAN_Q, CLEAN_K, CLEAN_V, RASTER)  # fmt: skip


@triton.jit
def pool_zero_v_kernel(
    q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs, s_ch,
    heads,
    TILE_TOKENS: tl.constexpr, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    CLEAN_Q: tl.constexpr, CLEAN_K: tl.constexpr, CLEAN_V: tl.constexpr, RASTER: tl.constexpr,
):  # fmt: skip
    """Inference's pooling (tile order, no copies) that also zeroes v's padding slots where
    they are: the in-place fill folded into the pass that reads v anyway."""
    tile, b, h, size, slots, dims, keep = _tile_program(valid_ptr, heads, SLOTS, HEAD_DIM, DIM_P2)
    rows = (tile.to(tl.int64) * TILE_TOKENS + slots)[:, None]
    padding = (slots >= size)[:, None] & (slots < TILE_TOKENS)[:, None] & keep[None, :]
    zeros = tl.zeros((SLOTS, DIM_P2), dtype=v.dtype.element_ty)
    tl.store(v + b * s_vb + h * s_vh + rows * s_vs + dims[None, :], zeros, mask=padding)
    _pool_all(q, k, v, qp, kp, vp, qc, kc, vc, valid_ptr, raster_rows, s_qb, s_qs, s_qh, s_kb,
              s_ks, s_kh, s_vb, s_vs, s_vh, s_pb, s_pn, s_ph, s_cb, s_cs, s_ch, heads, tile, b, h,
              size, slots, dims, keep, TILE_TOKENS, False, False, False, RASTER)  # fmt: skip


@triton.jit
def zero_rows_kernel(x, rows, s_b, s_s, s_h, heads, HEADS_P2: tl.constexpr,
                     HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr):  # fmt: skip
    """Zeroes x[b, rows[i], :, :] for program (i, b): one padding slot of one batch entry."""
    row = tl.load(rows + tl.program_id(0)).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, DIM_P2)[None, :]
    zeros = tl.zeros((HEADS_P2, DIM_P2), dtype=x.dtype.element_ty)
    tl.store(x + b * s_b + row * s_s + h * s_h + d, zeros, mask=(h < heads) & (d < HEAD_DIM))


def zero_rows(x, padding_index):
    """x[:, padding_index] = 0 in place (x: BSHD, head dim contiguous), one Triton launch."""
    batch, _, heads, dim = x.shape
    zero_rows_kernel[(padding_index.numel(), batch)](
        x, padding_index, x.stride(0), x.stride(1), x.stride(2), heads,
        HEADS_P2=coarse._next_pow2(heads), HEAD_DIM=dim, DIM_P2=coarse._next_pow2(dim),
        num_warps=4,
    )  # fmt: skip


def _launch(kernel, grid, q, k, v, valid, clean):
    """A variant's launch on tile-order q, k, v: (pooled x3, copies x3), as `_pool_clean`."""
    num_tiles = valid.shape[0]
    _, tiled, heads, dim = q.shape
    pooled = [coarse._pooled_like(t, num_tiles) for t in (q, k, v)]
    cleans = coarse._copies((q, k, v), clean, None)
    targets = [c if f else t for c, t, f in zip(cleans, (q, k, v), clean, strict=True)]
    kernel[grid](
        q, k, v, *pooled, *targets, valid, valid,
        *bshd_strides(q), *bshd_strides(k), *bshd_strides(v), *bshd_strides(pooled[0]),
        tiled * heads * dim, heads * dim, dim, heads,
        CLEAN_Q=clean[0], CLEAN_K=clean[1], CLEAN_V=clean[2], RASTER=False,
        **coarse._tile_constants(tiled // num_tiles, dim),
    )  # fmt: skip
    return (*pooled, *cleans)


def variants(q, k, v, valid, clean):
    num_tiles, bh = valid.shape[0], q.shape[0] * q.shape[2]
    return {
        "shipped": lambda: coarse._pool_clean(q, k, v, valid, *clean),
        "split": lambda: _launch(pool_split_kernel, (num_tiles, bh, 3), q, k, v, valid, clean),
        "loads_first": lambda: _launch(
            pool_loads_first_kernel, (num_tiles, bh), q, k, v, valid, clean
        ),
        "heads_first": lambda: _launch(
            pool_heads_first_kernel, (bh, num_tiles), q, k, v, valid, clean
        ),
    }


def _inputs(latent, heads, device, dtype=torch.bfloat16):
    tiling = VideoTiling(latent, (4, 4, 4))
    gen = torch.Generator().manual_seed(0)
    shape = (1, tiling.padded_len, heads, 128)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    return tiling, q, k, v, tiling.valid_sizes(device)


def check(latent, heads, device) -> None:
    """Every variant's outputs bitwise the shipped ones (pooled means and copies), and the
    Triton row fill the same as ``index_fill_``."""
    tiling, q, k, v, valid = _inputs(latent, heads, device)
    padding = tiling.indices(device).padding_index
    filled = v.clone()
    zero_rows(filled, padding)
    if not torch.equal(filled, v.clone().index_fill_(1, padding, 0)):
        raise AssertionError("zero_rows differs from index_fill_")
    v_in_place = v.clone()
    got = _launch(pool_zero_v_kernel, (valid.shape[0], q.shape[0] * q.shape[2]), q, k,
                  v_in_place, valid, (False,) * 3)  # fmt: skip
    want = coarse._pool_clean(q, k, v, valid, False, False, False)
    if not (all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            and torch.equal(v_in_place, filled)):  # fmt: skip
        raise AssertionError("pool_zero_v: pooled means or v's padding differ")
    for clean in ((False, False, False), (True, True, True), (False, False, True)):
        runs = {name: fn() for name, fn in variants(q, k, v, valid, clean).items()}
        want = runs.pop("shipped")
        for name, got in runs.items():
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                if not torch.equal(a, b):
                    raise AssertionError(f"{name}, clean={clean}: output {i} differs")
    print(f"check {latent} x {heads} heads: variants bitwise equal to the shipped kernel")


def _time_ms(fn, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def bench(name, latent, heads, rounds, calls):
    tiling, q, k, v, valid = _inputs(latent, heads, "cuda")
    real_bytes = 3 * tiling.seq_len * heads * 128 * q.element_size()
    rows = []
    for mode, clean in (("inference", (False,) * 3), ("training", (True,) * 3)):
        arms = variants(q, k, v, valid, clean)
        for fn in arms.values():  # compile, warm
            fn()
        torch.cuda.synchronize()
        times = {arm: [] for arm in arms}
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                times[arm].append(_time_ms(arms[arm], calls))
        moved = real_bytes + (3 * q.numel() * q.element_size() if mode == "training" else 0)
        rows += _report(name, heads, mode, times, moved)
    padding = tiling.indices("cuda").padding_index
    bh = q.shape[0] * q.shape[2]
    no_copies = (False,) * 3
    fills = {
        "index_fill": lambda: v.index_fill_(1, padding, 0),
        "triton_rows": lambda: zero_rows(v, padding),
        "pool_then_index_fill": lambda: (coarse._pool_clean(q, k, v, valid, *no_copies),
                                         v.index_fill_(1, padding, 0)),
        "pool_zeroing_v": lambda: _launch(pool_zero_v_kernel, (valid.shape[0], bh), q, k, v,
                                          valid, no_copies),
    }  # fmt: skip
    for fn in fills.values():
        fn()
    times = {arm: [] for arm in fills}
    for r in range(rounds):
        for arm in list(fills) if r % 2 == 0 else list(reversed(fills)):
            times[arm].append(_time_ms(fills[arm], calls))
    rows += _report(name, heads, "padding_fill", times, padding.numel() * heads * 128 * 2)
    return rows


def _report(name, heads, mode, times, moved):
    """One row an arm: median and fastest ms over the rounds, and the bytes moved a call
    (``moved``: real tokens read, copies written, padding rows filled) per second."""
    rows = []
    for arm, ts in times.items():
        ms = statistics.median(ts)
        row = {"latent": name, "heads": heads, "mode": mode, "arm": arm, "ms": round(ms, 4),
               "min_ms": round(min(ts), 4), "tb_per_s": round(moved / ms / 1e9, 2)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--check-only", action="store_true", help="bitwise check on a small latent")
    args = ap.parse_args()
    if args.check_only:
        check((5, 6, 7), 2, "cuda" if torch.cuda.is_available() else "cpu")
        return
    rows = []
    for name, (latent, heads) in LATENTS.items():
        check(latent, heads, "cuda")
        rows += bench(name, latent, heads, args.rounds, args.calls)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

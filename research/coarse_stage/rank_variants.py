"""The selection's ranking with its candidates compacted (session 32; measured in a later one).

`vsa_triton.coarse_kernels.rank_rows_kernel` finds each row's k-th largest key by bisection
over all the row's padded keys, every pass (~18-22 of them at Wan latents, ~118 SASS
instructions each for 32 keys a lane): session 32 measured it at about twice its issue bound.
Most passes after the first few only separate keys inside a narrow window. This variant
(``compact``) bisects the whole row only until the window [lo, hi) holds at most ``CAND``
keys (the counts at both ends come free with each pass), then stores those candidates to the
row's own slots of the output list (the list is written over them at the end), reads them back
as a ``CAND``-wide block and finishes the bisection there, for the k-th key among them
(k minus the keys above the window). The k-th key is then the same as the shipped kernel's,
so the lists are bitwise the same.

    TRITON_INTERPRET=1 uv run python -m research.coarse_stage.rank_variants --check-only
    python3 -m research.coarse_stage.rank_variants --out $OUT/rank_variants.json   # GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from vsa_triton import coarse
from vsa_triton.coarse_kernels import _choose, _row_keys, _store_split

from .sweep_select import graph_ms

LATENTS = {"wan480p": (624, 12), "wan720p": (1440, 40), "hunyuan720p": (2160, 24)}
"""Key tiles a row and heads (64-token tiles), 12.5% of them kept."""


@triton.jit
def _kth_keys_compact(key, done, topk, scratch, row, CAND: tl.constexpr):
    """`_kth_keys` (early exit), its last passes over the window's candidates only; the
    candidates go through ``scratch`` (``CAND`` int32 a row from ``scratch + row * stride``,
    given as pointers [rows, 1]) when every pending row's window holds at most ``CAND``."""
    lo = tl.full(done.shape, -2147483648, tl.int64)
    cnt_lo = tl.full(done.shape, key.shape[1], tl.int32)  # at lo = INT_MIN: every column
    cnt_hi = tl.zeros(done.shape, tl.int32)  # keys at or above the window's top
    unit = tl.full([], 1 << 31, tl.int64)
    pending = tl.sum((done == 0).to(tl.int32), axis=0)
    widest = tl.max(tl.where(done, 0, cnt_lo - cnt_hi), axis=0)
    while (unit > 0) & (pending > 0) & (widest > CAND):
        trial = lo + unit
        count = tl.sum((key >= trial.to(tl.int32)[:, None]).to(tl.int32), axis=1)
        moved = count >= topk
        lo = tl.where(moved, trial, lo)
        cnt_lo = tl.where(moved, count, cnt_lo)
        cnt_hi = tl.where(moved, cnt_hi, count)
        done = done | (count == topk)
        unit = unit >> 1
        pending = tl.sum((done == 0).to(tl.int32), axis=0)
        widest = tl.max(tl.where(done, 0, cnt_lo - cnt_hi), axis=0)
    if (unit > 0) & (pending > 0):  # the window [lo, lo + 2 * unit) of each pending row
        top = lo + 2 * unit
        inside = (
            (done == 0)[:, None]
            & (key >= lo.to(tl.int32)[:, None])
            & (key.to(tl.int64) < top[:, None])
        )
        at = tl.cumsum(inside.to(tl.int32), axis=1) - 1
        tl.store(scratch + at, key, mask=inside)
        tl.debug_barrier()  # the candidates other threads stored
        slot = tl.arange(0, CAND)[None, :]
        pending_row = (done == 0)[:, None]
        cand = tl.load(scratch + slot, mask=pending_row & (slot < (cnt_lo - cnt_hi)[:, None]),
                       other=-2147483648)  # fmt: skip
        tl.debug_barrier()  # every read before the list is written over the candidates
        want = tl.where(done, 2147483647, topk - cnt_hi)  # done rows: never moved again
        while (unit > 0) & (pending > 0):
            trial = lo + unit
            count = tl.sum((cand >= trial.to(tl.int32)[:, None]).to(tl.int32), axis=1)
            lo = tl.where(count >= want, trial, lo)
            done = done | (count == want)
            unit = unit >> 1
            pending = tl.sum((done == 0).to(tl.int32), axis=0)
    at_or_above = tl.where(key >= lo.to(tl.int32)[:, None], key, 2147483647)
    return tl.min(at_or_above, axis=1)


@triton.jit
def rank_compact_kernel(
    scores_ptr, valid_ptr, out_ptr, full_idx_ptr, full_cnt_ptr, part_idx_ptr, part_cnt_ptr,
    num_rows, num_tiles, topk, kv_tile,
    TILES_P2: tl.constexpr, TOPK_P2: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr,
    SPLIT_ROWS: tl.constexpr, CAND: tl.constexpr,
):  # fmt: skip
    """`rank_rows_kernel` (early exit) with `_kth_keys_compact`; ``CAND`` <= ``topk``."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    row = first + tl.arange(0, ROWS)
    cols = tl.arange(0, TILES_P2)
    key = _row_keys(scores_ptr, row, cols, num_rows, num_tiles)
    kth = _kth_keys_compact(key, row >= num_rows, topk, out_ptr + row[:, None] * topk, row,
                            CAND)  # fmt: skip
    chosen = _choose(key, kth, topk, row, num_rows)
    slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
    tl.store(
        out_ptr + row[:, None] * topk + slot,
        cols[None, :] + tl.zeros([ROWS, TILES_P2], dtype=tl.int32),
        mask=chosen,
    )
    if SPLIT:
        tl.debug_barrier()  # the split reads back the lists other threads of this program wrote
        _store_split(out_ptr, full_idx_ptr, full_cnt_ptr, part_idx_ptr, part_cnt_ptr,
                     valid_ptr, first, num_rows, tl.full([], 0, tl.int32), topk, kv_tile, ROWS,
                     TOPK_P2, SPLIT_ROWS)  # fmt: skip


def candidates_for(topk: int) -> int:
    """The candidates' block: the largest power of two within the row's ``topk`` slots (their
    scratch), at most 256."""
    return min(256, 1 << (topk.bit_length() - 1))


def rank(scores, valid, topk, kv_tile, variant: str, warps: int = 1, one_row: bool = False):
    """The lists (and split) of ``scores`` ([rows, N] float32) by the shipped ranking kernel
    or the compact variant; ``one_row``: a row a program under the interpreter too (as on a
    GPU: with many rows a program the candidates' phase runs only once every row's window
    is narrow, which it seldom is before they are all done)."""
    num_rows, num_tiles = scores.shape
    out = torch.empty(num_rows, topk, dtype=torch.int32, device=scores.device)
    split = coarse._split_like(out)
    tiles_p2, topk_p2 = coarse._next_pow2(num_tiles), coarse._next_pow2(topk)
    rows, split_rows = coarse.rank_rows_sizes(
        num_rows, tiles_p2, topk, coarse.interpreting() and not one_row
    )
    common = dict(TILES_P2=tiles_p2, TOPK_P2=topk_p2, SPLIT=True, ROWS=rows,
                  SPLIT_ROWS=split_rows, num_warps=warps)  # fmt: skip
    grid = (-(-num_rows // rows),)
    args = (scores, valid, out, *split, num_rows, num_tiles, topk, kv_tile)
    if variant == "shipped":
        coarse._kernels().rank_rows_kernel[grid](*args, EARLY_EXIT=True, **common)
    else:
        rank_compact_kernel[grid](*args, CAND=candidates_for(topk), **common)
    return (out, *split)


def _scores(num_tiles: int, heads: int, device: str, seed: int = 0) -> torch.Tensor:
    """Scores as the op's are: pooled bf16 q . k in float32, with ties (a repeated key tile)
    and -inf for an empty tile."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qp, kp = (torch.randn(heads, num_tiles, 128, device=device, generator=gen)
              .to(torch.bfloat16).float() for _ in range(2))  # fmt: skip
    kp[:, 3] = kp[:, 1]
    scores = (qp @ kp.transpose(1, 2)).reshape(heads * num_tiles, num_tiles)
    scores[:, 5] = float("-inf")
    return scores.contiguous()


def check(num_tiles: int, heads: int, device: str) -> None:
    """The compact variant's lists and split bitwise the shipped kernel's, at several k."""
    scores = _scores(num_tiles, heads, device)
    valid = torch.randint(1, 65, (num_tiles,), device=device, dtype=torch.int32)
    valid[5] = 0
    for topk in sorted({1, 2, min(17, num_tiles), num_tiles // 8 or 1, num_tiles // 2, num_tiles}):
        want = rank(scores, valid, topk, 64, "shipped")
        got = rank(scores, valid, topk, 64, "compact", one_row=True)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if not torch.equal(a, b):
                raise AssertionError(f"compact differs, k={topk}, output {i}")
    print(f"check {num_tiles} tiles x {heads} heads: compact bitwise the shipped ranking")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check-only", action="store_true", help="bitwise check on small rows")
    args = ap.parse_args()
    if args.check_only:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for num_tiles in (12, 70, 300):
            check(num_tiles, 1, device)
        return
    rows = []
    for name, (num_tiles, heads) in LATENTS.items():
        check(num_tiles, heads, "cuda")
        scores = _scores(num_tiles, heads, "cuda")
        valid = torch.full((num_tiles,), 64, device="cuda", dtype=torch.int32)
        topk = round(0.125 * num_tiles)
        warps = coarse.SELECT.rank_warps_for(coarse._next_pow2(num_tiles))
        call = (scores, valid, topk, 64)
        arms = {v: (lambda v=v, c=call, w=warps: rank(*c, v, w))
                for v in ("shipped", "compact")}  # fmt: skip
        times = {v: [] for v in arms}
        for r in range(args.rounds):
            for v in arms if r % 2 == 0 else reversed(arms):
                times[v].append(graph_ms(arms[v], 20))
        for v, ts in times.items():
            row = {"latent": name, "tiles": num_tiles, "heads": heads, "topk": topk,
                   "warps": warps, "variant": v, "ms": round(statistics.median(ts), 4),
                   "min_ms": round(min(ts), 4)}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__}  # fmt: skip
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

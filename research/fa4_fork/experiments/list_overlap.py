"""Experiment 14 (session 9, CPU): how much could a backward save by merging the dQ reductions of
two key tiles whose query lists overlap?

Session 9 (experiment 13) left the KV64 backward bound by sending dQ: each 64-key tile reduces
its own 64x128 float32 dQ partial for every query tile in its list, twice dense's bytes per
FLOP. A CTA owning two key tiles could sum the two partials of a query tile both lists hold
before one reduce-add, saving ``|Q_a & Q_b| / (|Q_a| + |Q_b|)`` of the bytes. That depends on
how the coarse stage's top-k selections overlap between neighbouring key tiles, which this
script measures on **synthetic** pooled tile features (not a model's activations): Gaussian
noise over a (T, H, W) tile grid, smoothed over ``sigma`` tiles, so that ``sigma = 0`` is
independent tiles (random lists: expected overlap = the keep fraction) and larger ``sigma``
more spatially coherent content. A real model's q and k decide where VSA actually sits; this
gives the range and the pairing rule's effect.

Pairs: key tiles ``2i, 2i+1`` in the tiling's order (neighbours along the fastest grid axis,
what a two-key-tile CTA would take without reordering). Per (sigma, head): the mean over pairs
of the saved fraction of dQ reduce-adds, and the mean fraction of a list shared with its pair.
::

    uv run python -m research.fa4_fork.experiments.list_overlap --out DIR   # CPU, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from research import harness

GRID = (8, 12, 20)
"""Tiles (T, H, W) of 4x4x4 tokens: a 32x48x80 latent, 122,880 tokens (a 720p-like shape)."""


def smooth_field(grid: tuple[int, int, int], heads: int, dim: int, sigma: float, seed: int):
    """[1, N, heads, dim] Gaussian noise over the tile grid, smoothed by a separable Gaussian
    of ``sigma`` tiles along each axis (``sigma == 0``: unsmoothed), tile-major (W fastest)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(heads * dim, *grid, generator=gen)
    if sigma > 0:
        radius = max(1, int(3 * sigma))
        taps = torch.arange(-radius, radius + 1, dtype=torch.float32)
        kernel = torch.exp(-(taps**2) / (2 * sigma**2))
        kernel /= kernel.sum()
        for axis in (1, 2, 3):
            x = x.movedim(axis, -1)
            shape = x.shape
            flat = x.reshape(-1, 1, shape[-1])
            flat = torch.nn.functional.conv1d(
                torch.nn.functional.pad(flat, (radius, radius), mode="replicate"),
                kernel.view(1, 1, -1),
            )
            x = flat.reshape(shape).movedim(-1, axis)
        x = x / x.std()
    n = grid[0] * grid[1] * grid[2]
    return x.reshape(heads, dim, n).permute(2, 0, 1).unsqueeze(0).contiguous()


def selection_matrix(indices: torch.Tensor, counts: torch.Tensor, tiles: int) -> torch.Tensor:
    """[H, NQ, NK] bool: query tile i selects key tile j, from one layout's lists of batch 0
    ([H, NQ, k] indices, [H, NQ] counts). Summed, not scattered: a slot past a list's count
    (index 0, say) must not unset a selected tile 0."""
    heads, nq, width = indices.shape
    used = (torch.arange(width) < counts.unsqueeze(-1)).to(torch.int32)
    hits = torch.zeros(heads, nq, tiles, dtype=torch.int32)
    return hits.scatter_add_(-1, indices.long().clamp(min=0), used) > 0


def pair_savings(layout) -> tuple[float, float]:
    """(mean fraction of dQ reduce-adds saved by merging key tiles 2i and 2i+1, mean fraction
    of a key tile's query list its pair also holds) over heads and pairs."""
    idx, cnt = layout.kv_indices[0], layout.kv_counts[0]  # [H, NQ, k]
    nk = idx.shape[1]  # square tilings: as many key tiles as query tiles
    selects = selection_matrix(idx, cnt, nk)
    by_key = selects.transpose(1, 2)  # [H, NK, NQ]: key tile j's query list
    a, b = by_key[:, 0 : nk - 1 : 2], by_key[:, 1:nk:2]
    both = (a & b).sum(-1).float()
    sizes = a.sum(-1).float() + b.sum(-1).float()
    saved = (both / sizes.clamp(min=1)).mean().item()
    shared = (both / a.sum(-1).float().clamp(min=1)).mean().item()
    return saved, shared


def smooth_selection(grid: tuple[int, int, int], heads: int, dim: int, sigma: float, topk: int):
    """vsa-core's top-k layout (64-token tiles, all full) of q and k drawn independently as
    `smooth_field`s of ``sigma`` tiles over ``grid``."""
    from vsa_core.coarse import select_topk

    tiles = grid[0] * grid[1] * grid[2]
    q = smooth_field(grid, heads, dim, sigma, seed=1)
    k = smooth_field(grid, heads, dim, sigma, seed=2)
    return select_topk(q, k, torch.full((tiles,), 64, dtype=torch.int32), topk, 64, all_full=True)


def feature_arguments() -> argparse.ArgumentParser:
    """The options of the experiments on synthetic selections (this one and experiment 17)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--keep", type=float, default=0.125)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    return ap


def main() -> int:
    args = feature_arguments().parse_args()
    n = GRID[0] * GRID[1] * GRID[2]
    topk = max(1, round(args.keep * n))
    rows = []
    for sigma in args.sigmas:
        layout = smooth_selection(GRID, args.heads, args.dim, sigma, topk)
        saved, shared = pair_savings(layout)
        rows.append({"sigma_tiles": sigma, "keep": args.keep, "saved": saved, "shared": shared})
        print(f"sigma {sigma:4.1f}: pair shares {shared:.3f} of a list, saves {saved:.3f} of dQ")
    write_record(args.out, "list_overlap", grid_tiles=GRID, tiles=n, topk=topk,
                 heads=args.heads, dim=args.dim, rows=rows)  # fmt: skip
    return 0


def write_record(out: str, experiment: str, **fields) -> None:
    """``out``/``experiment``.json: the fields, the command line, torch's version, the device."""
    record = {"experiment": experiment, **fields, "command": harness.command_line(),
              "torch": torch.__version__, "device": "cpu"}  # fmt: skip
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{experiment}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    sys.exit(main())

"""Experiment 15 (session 16, CPU): how many K/V bytes would a Q64 forward save by walking the
union of several query tiles' key lists once (issue 20, item 1), and what ceiling does that give?

Today every 64-row query tile fetches its own selected K/V blocks (two CTAs per SM, Q in
registers: 0.79-0.80 of dense FA4, paced, S=32768, 87.5%). The session-10 counters put that
kernel on the L2->SM port (87% busy against dense's 32%; `NOTES.md`, session 10: ~0.89 of dense
at 100% of the port). A CTA whose two MMA warpgroups own two query tiles and whose producer loads
the sorted union of the two lists, each warpgroup using the stages its own list holds, moves
``|U| / (|L_a| + |L_b|)`` of today's K/V bytes for the same MMAs. How small that ratio gets
depends on how neighbouring query tiles' top-k selections overlap, which this script measures
on vsa-core's own `select_topk` over **synthetic** tile features (`list_overlap.smooth_field`:
Gaussian noise over the tile grid smoothed over ``sigma`` tiles; not a model's activations) and
on uniform random lists (the benchmark's ``native`` lists).

Groups of query tiles (tile order is W fastest, then H, then T):

- ``w2``: tiles 2i, 2i+1 (neighbours along W: what a 128-row tile of two 64-row blocks holds);
- ``w4``: four consecutive tiles along W;
- ``hw4``: 2 x 2 tiles over (H, W) within one frame.

Per group size, the mean over groups and heads of the bytes ratio ``|U| / sum |L_i|`` and of
``|U| / max |L_i|`` (the steps of a design that walks the union in lockstep, every warpgroup
waiting on every stage: the MMA cost of lockstep). For ``w2``, also what a ring of shared
stages costs warpgroups that walk their own lists independently (`ring_time`: a stage is
refilled only when both have passed it). The predicted forward, if the kernel stays
port-bound while its bytes shrink and the 128-row consumer's own ceiling caps it (the paired-key
kernel, which moves half of today's bytes per FLOP, measured 0.90-0.93 of dense): ``min(0.93,
0.80 / ratio)``; for ``w2`` with a 4-stage ring and lone steps at full cost, the consumer's
ceiling divided by that slowdown as well (``predicted_fwd_4_stages_worst``); and interpolated
between two kernels already measured, by the share of stages both warpgroups use
(`by_measured_kernels`). ::

    uv run python -m research.fa4_fork.experiments.union_lists_forward --out DIR   # CPU, ~1 min
"""

from __future__ import annotations

import sys

import torch

from research.fa4_fork.experiments.list_overlap import (
    feature_arguments,
    selection_matrix,
    smooth_selection,
    write_record,
)

GRIDS = {"wan480p": (6, 8, 13), "720p-like": (8, 12, 20)}
"""Tile grids (T, H, W) of 4x4x4 tiles: Wan 2.1 480p's 21x30x52 latent, and experiment 14's."""

SEPARATE_FWD = 0.80
"""The shipped Q64 forward (separate walks) against dense FA4, paced (fork NOTES, session 10)."""

CONSUMER_CEILING = 0.93
"""What a 128-row tile with two MMA warpgroups reaches when bytes do not bind: the paired-key
kernel's 0.90-0.93 of dense (fork NOTES, sessions 8-10)."""


STREAMS_FWD = 0.725
"""The two-streams kernel (delta 6: a 128-row tile whose warpgroups each take their own 64-key
block from every stage, so a stage's bytes feed one warpgroup each): 0.69-0.76 of dense."""

PAIRED_FWD = 0.914
"""The paired-key kernel at 87.5% (both warpgroups on every stage; exp. 15 of session 10)."""


def by_measured_kernels(bytes_ratio: float) -> float:
    """``w2``'s forward interpolated from two measured kernels: a shared block's stage feeds both
    warpgroups (the paired kernel's step), an unshared one feeds one (the two-streams kernel's
    bytes per FLOP); ``s = 2 - 2 * bytes_ratio`` of each list is shared. Time adds per block:
    1 / ((1 - s) / streams + s / paired)."""
    shared = min(max(2 - 2 * bytes_ratio, 0.0), 1.0)
    return 1 / ((1 - shared) / STREAMS_FWD + shared / PAIRED_FWD)


def group_members(grid: tuple[int, int, int], kind: str) -> torch.Tensor:
    """[groups, size] tile indices (tile order: W fastest) of each group; tiles left over at a
    grid edge (odd W) form no group."""
    t_n, h_n, w_n = grid
    index = torch.arange(t_n * h_n * w_n).view(t_n, h_n, w_n)
    if kind == "w2":
        return index[..., : w_n // 2 * 2].reshape(-1, 2)
    if kind == "w4":
        return index[..., : w_n // 4 * 4].reshape(-1, 4)
    if kind == "hw4":
        cut = index[:, : h_n // 2 * 2, : w_n // 2 * 2]
        blocks = cut.reshape(t_n, h_n // 2, 2, w_n // 2, 2).permute(0, 1, 3, 2, 4)
        return blocks.reshape(-1, 4)
    raise ValueError(f"kind must be 'w2', 'w4' or 'hw4', got {kind!r}")


def union_ratios(selects: torch.Tensor, members: torch.Tensor) -> dict[str, float]:
    """Means over (head, group) of |U| / sum |L_i| (bytes against separate walks) and of
    |U| / max |L_i| (steps of a lockstep union walk against one list's)."""
    lists = selects[:, members]  # [H, groups, size, NK]
    sizes = lists.sum(-1).float()
    union = lists.any(-2).sum(-1).float()
    return {
        "bytes_ratio": (union / sizes.sum(-1).clamp(min=1)).mean().item(),
        "lockstep_steps": (union / sizes.amax(-1).clamp(min=1)).mean().item(),
    }


def random_selection(heads: int, tiles: int, topk: int, seed: int) -> torch.Tensor:
    """Uniform random lists of ``topk`` key tiles per query tile (bench_vsa's native lists)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(heads, tiles, tiles, generator=gen).argsort(-1)[..., :topk]
    selects = torch.zeros(heads, tiles, tiles, dtype=torch.bool)
    return selects.scatter_(-1, order, True)


def ring_time(lists: list[list[int]], stages: int) -> tuple[int, int]:
    """Steps a CTA takes when each warpgroup walks its own sorted list (one step a block) over a
    producer that loads the sorted union into a ring of ``stages`` stages, loads free: union
    position p may be filled once every position up to p - stages is released by both
    warpgroups (a warpgroup releases its own block when done with it, another's as soon as its
    next own block lies past it). Returns (steps in which both warpgroups move, steps in which
    one does). Both lists of length L: (L, 0) when the ring never stalls; in lockstep over
    disjoint lists (0, 2L)."""
    union = sorted(set().union(*lists))
    where = {block: p for p, block in enumerate(union)}
    own = [[where[b] for b in sorted(lst)] for lst in lists]
    done = [0] * len(own)  # blocks each warpgroup has finished
    both = single = 0
    while any(d < len(o) for d, o in zip(done, own, strict=True)):
        # a warpgroup has released every position below its next own block
        released = min(o[d] if d < len(o) else len(union) for d, o in zip(done, own, strict=True))
        filled_below = released + stages  # positions < this are (or may be) in the ring
        moved = 0
        for i, o in enumerate(own):
            if done[i] < len(o) and o[done[i]] < filled_below:
                done[i] += 1
                moved += 1
        if not moved:  # cannot happen: the lowest next block is always within the ring
            raise AssertionError("ring deadlock")
        both, single = (both + 1, single) if moved == 2 else (both, single + 1)
    return both, single


def ring_slowdown(
    selects: torch.Tensor, stages: int, lone_cost: float, samples: int = 200
) -> float:
    """Mean CTA time over the time of L steps with both warpgroups busy, for ``w2`` pairs
    (tiles 2i, 2i+1, head 0, up to ``samples`` pairs) under `ring_time`; a step in which one
    warpgroup moves alone costs ``lone_cost`` of a step in which both do (0.5: the tensor
    pipe is all that binds, so a lone warpgroup runs twice as fast; 1.0: it gains nothing,
    its softmax no longer hidden under the other's MMAs)."""
    pairs = selects[0, : selects.shape[1] // 2 * 2].view(-1, 2, selects.shape[-1])[:samples]
    ratios = []
    for pair in pairs:
        lists = [row.nonzero().flatten().tolist() for row in pair]
        both, single = ring_time(lists, stages)
        ratios.append((both + lone_cost * single) / max(max(len(x) for x in lists), 1))
    return sum(ratios) / len(ratios)


def predicted(bytes_ratio: float) -> float:
    return min(CONSUMER_CEILING, SEPARATE_FWD / bytes_ratio)


def main() -> int:
    ap = feature_arguments()
    ap.add_argument("--grids", nargs="+", choices=sorted(GRIDS), default=sorted(GRIDS))
    args = ap.parse_args()

    rows = []
    for grid_name in args.grids:
        grid = GRIDS[grid_name]
        tiles = grid[0] * grid[1] * grid[2]
        topk = max(1, round(args.keep * tiles))
        sources = {"random lists": random_selection(args.heads, tiles, topk, seed=3)}
        for sigma in args.sigmas:
            layout = smooth_selection(grid, args.heads, args.dim, sigma, topk)
            lists = (layout.kv_indices[0], layout.kv_counts[0])
            sources[f"top-k, sigma {sigma:g}"] = selection_matrix(*lists, tiles)
        for source, selects in sources.items():
            for kind in ("w2", "w4", "hw4"):
                ratios = union_ratios(selects, group_members(grid, kind))
                row = {"grid": grid_name, "tiles": tiles, "topk": topk, "source": source,
                       "group": kind, **ratios,
                       "predicted_fwd": predicted(ratios["bytes_ratio"])}  # fmt: skip
                if kind == "w2":
                    row["ring_slowdown"] = {
                        f"{n} stages, lone step {c:g}": ring_slowdown(selects, n, c)
                        for n in (2, 4, 6) for c in (0.5, 1.0)
                    }  # fmt: skip
                    row["predicted_fwd_by_measured_kernels"] = by_measured_kernels(
                        ratios["bytes_ratio"]
                    )
                    lone = row["ring_slowdown"]["4 stages, lone step 1"]
                    row["predicted_fwd_4_stages_worst"] = min(
                        CONSUMER_CEILING / lone, SEPARATE_FWD / ratios["bytes_ratio"]
                    )
                rows.append(row)
                print(f"{grid_name:9s} {source:18s} {kind:3s}: bytes {ratios['bytes_ratio']:.3f}"
                      f" of separate walks, lockstep {ratios['lockstep_steps']:.2f}x a list's "
                      f"steps, predicted {row['predicted_fwd']:.2f} of dense"
                      + ("; independent walks, 2/4/6 stages x lone step 0.5/1: "
                         + "/".join(f"{v:.2f}x" for v in row["ring_slowdown"].values())
                         if "ring_slowdown" in row else ""))  # fmt: skip
    write_record(args.out, "union_lists_forward", keep=args.keep, heads=args.heads,
                 dim=args.dim, separate_fwd=SEPARATE_FWD, consumer_ceiling=CONSUMER_CEILING,
                 streams_fwd=STREAMS_FWD, paired_fwd=PAIRED_FWD, rows=rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Experiment 16: what VSA's combine in the 64x64 forward's epilogue (delta 8,
``flash_attn_vsa.combine_sm90``) costs inside the kernel and saves outside it.

The whole-op diagnosis (`benchmarks/diagnose_op_host.py --backends fa4 fa4_unfused`, session
18) measured the fused op at Wan 2.1 480p no faster back to back than the forward followed by
the coarse stage's combine pass (2.662 vs 2.661 ms), although the pass it removes reads the
fine output and the gate and writes the result (3 x 117 MiB at 480p: ~75 us at HBM speed,
plus a launch). So either the epilogue costs what the pass did, or the pass was cheaper than
counted. Arms, kernels only, on a Wan latent's own lists (the op's top-k over random tiles,
partial key blocks from the tiling, the mask_mod on), interleaved call by call:

- ``fine``: vsa-fa4's 64x64 forward with lse (what the op ran before, without its combine);
- ``fine+combine``: the same, then the Triton coarse stage's in-place combine (the old path);
- ``combined``: the forward with the gated combine in its epilogue, no lse;
- ``combined_ungated``: the same without a gate (coarse row only: no gate loads).

``combined - fine`` is the epilogue's cost, ``fine+combine - fine`` the pass's. ::

    python3 -m research.fa4_fork.experiments.combined_epilogue --shapes wan480p wan720p --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {"wan480p": ((21, 30, 52), 12), "wan720p": ((21, 45, 80), 40)}
ARMS = ("fine", "fine+combine", "combined", "combined_ungated")


def build(shape: str, sparsity: float = 0.875, seed: int = 0):
    """Tile-order q, k, v, gate, a coarse output, the tiling and a layout from the op's own
    selection kernel (one top-k list per query tile, Wan's partial tiles)."""
    import torch

    from vsa_core import VideoTiling
    from vsa_core.coarse import coarse_stage, layout_from_selection

    latent, heads = SHAPES[shape]
    tiling = VideoTiling(latent)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = (1, tiling.seq_len, heads, 128)
    q, k, v, gate = (
        tiling.to_tiles(torch.randn(tokens, device="cuda", generator=gen, dtype=torch.bfloat16))
        for _ in range(4)
    )
    valid = tiling.valid_sizes(q.device)
    num_tiles = valid.shape[0]
    topk = max(1, round(num_tiles * (1 - sparsity)))
    stage = coarse_stage("auto", q)
    pooled = stage.pool_and_clean(q, k, v, valid, (False, False, False))[:3]
    with torch.no_grad():
        selection = stage.select(pooled[0], pooled[1], valid, topk)
    layout = layout_from_selection(selection, valid, tiling.tile_tokens, all_full=False)
    coarse = pooled[2].contiguous()  # [B, N, H, D]: a stand-in for the coarse output
    return tiling, layout, q, k, v, gate, coarse, stage


def arm_fn(arm, tiling, layout, q, k, v, gate, coarse, stage):
    from vsa_fa4.ops import attention, attention_combined
    from vsa_fa4.schedule import make_plan

    plan = make_plan(layout.block_shape, layout.q_group_size, layout.num_q_blocks)
    lists = (layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 128**-0.5, plan)
    valid = tiling.valid_sizes(q.device)
    if arm == "fine":
        return lambda: attention(q, k, v, *lists)
    if arm == "fine+combine":

        def fine_then_combine():
            out, _ = attention(q, k, v, *lists)
            return stage.combine(out, coarse, gate, valid)

        return fine_then_combine
    combine_gate = None if arm == "combined_ungated" else gate
    return lambda: attention_combined(q, k, v, *lists, coarse, combine_gate)


def run(args) -> int:
    import torch

    from research.harness import benchmark_module

    bt = benchmark_module("bench_timing")
    rows = []
    for shape in args.shapes:
        built = build(shape)
        fns = {arm: arm_fn(arm, *built) for arm in ARMS}
        with torch.no_grad():
            ref = fns["fine+combine"]().float()
            for arm in ("combined",):
                got = fns[arm]().float()
                rel = ((got - ref).norm() / ref.norm()).item()
                print(f"{shape} {arm} vs fine+combine rel L2 {rel:.2e}", flush=True)
                assert rel < 1e-2, (shape, arm, rel)
            for fn in fns.values():  # compile and record every arm before timing
                for _ in range(3):
                    fn()
            times = {arm: [] for arm in ARMS}
            calls = args.calls if shape == "wan480p" else max(1, args.calls // 10)
            for _ in range(args.rounds):
                for arm, fn in fns.items():
                    times[arm].append(bt.events_ms(fn, calls))
        row = {"shape": shape, **{arm: sorted(t)[len(t) // 2] for arm, t in times.items()}}
        row["epilogue_cost_ms"] = row["combined"] - row["fine"]
        row["pass_cost_ms"] = row["fine+combine"] - row["fine"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        doc = {"experiment": "combined_epilogue", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "command": " ".join(sys.argv), "rows": rows}  # fmt: skip
        (Path(args.out) / "combined_epilogue.json").write_text(json.dumps(doc, indent=1))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Where a fork forward goes wrong, if it does: per 64-row query block, its relative error
against the float32 reference, with what the block's rows see (how many key blocks, partial
ones among them, its half of a 128-row tile, its partner block's list length).

For a first GPU run of session 7's deltas 5-7: when a GPU test fails, one call of this script
says whether the error sits in one warpgroup's rows (a tile's first or second 64), in tiles
whose two lists differ in length (`NO_BLOCK` padding), in blocks with partial keys, or
everywhere, instead of one relative-L2 number. Each arm runs vsa-fa4's real forward path
(`vsa_fa4.launch.run_forward`, partial key blocks masked) with the arm's
`vsa_fa4.launch.ForwardVariant` passed as ``variant``, into NaN-poisoned outputs, on the
fork's GPU-test case (`tests/sm90_cases.py`: S=1536, H=3, 64-row query block i selects i % 6
key blocks, key blocks full, partial or empty). ::

    python3 -m research.fa4_fork.experiments.diagnose_forward --out DIR \\
        --arms streams streams+qregs streams+persistent 128x64+persistent   # H200
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from research import harness

ARMS = {  # name -> (query rows per sparse block, ForwardVariant options)
    "64x64": (64, ()),
    "64x64+qregs": (64, ("qregs",)),
    "64x64+persistent": (64, ("persistent",)),
    "streams": (64, ("streams",)),
    "streams+qregs": (64, ("streams", "qregs")),
    "streams+persistent": (64, ("streams", "persistent")),
    "128x64": (128, ()),
    "128x64+qregs": (128, ("qregs",)),
    "128x64+persistent": (128, ("persistent",)),
}


def run_arm(arm: str, q, k, v, lists, valid, scale: float):
    """The arm's forward through vsa-fa4's launch, into NaN-poisoned (out, lse)."""
    cases = harness.fork_test_module("sm90_cases")

    from vsa_fa4 import launch

    q_block, options = ARMS[arm]
    variant = launch.ForwardVariant.from_names(options) if options else launch.SHIPPED_FORWARD
    out, lse = cases.nan_outputs(q)
    launch.run_forward(q, k, v, out, lse, lists, valid, scale, (q_block, cases.BLOCK),
                       variant=variant)  # fmt: skip
    return out, lse


def block_report(arm: str, got, ref_out, ref_lse, sel64, valid) -> list[dict]:
    """A record per (head, 64-row query block) whose out is off by more than 1e-2 (relative
    L2), not finite, or whose lse is wrong; then a summary record."""
    cases = harness.fork_test_module("sm90_cases")

    out, lse = got
    heads, n_q, _ = sel64.shape
    bad, worst = [], 0.0
    for h in range(heads):
        for i in range(n_q):
            rows = slice(i * cases.BLOCK, (i + 1) * cases.BLOCK)
            want, have = ref_out[0, rows, h].float(), out[0, rows, h].float()
            sees = torch.isfinite(ref_lse[0, h, rows])
            err = float((have - want).norm() / want.norm().clamp_min(1e-30)) if sees.any() else 0.0
            lse_ok = bool(torch.equal(torch.isfinite(lse[0, h, rows]), sees)) and (
                not sees.any()
                or float((lse[0, h, rows][sees] - ref_lse[0, h, rows][sees]).abs().max()) <= 1e-2
            )
            finite = bool(torch.isfinite(have).all())
            worst = max(worst, err)
            if err > 1e-2 or not lse_ok or not finite:
                blocks = torch.nonzero(sel64[h, i]).flatten().tolist()
                bad.append({
                    "arm": arm, "head": h, "q_block": i, "rel_l2": err, "lse_ok": lse_ok,
                    "finite": finite, "tile_half": i % 2, "blocks": len(blocks),
                    "partial": sum(0 < int(valid[b]) < cases.BLOCK for b in blocks),
                    "partner_blocks": int(sel64[h, i ^ 1].sum()),
                })  # fmt: skip
    return [*bad, {"arm": arm, "summary": True, "bad_blocks": len(bad), "worst_rel_l2": worst}]


def main() -> int:
    cases = harness.fork_test_module("sm90_cases")
    from vsa_core import BlockSparseLayout
    from vsa_fa4.metadata import forward_lists

    from .kv64_bwd_configs import jsonl_emitter

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    emit = jsonl_emitter(os.path.join(args.out, "diagnose_forward.jsonl"))
    scale = 128**-0.5
    for q_block in (64, 128):
        arms = [a for a in args.arms if ARMS[a][0] == q_block]
        if not arms:
            continue
        valid, selected = cases.case(seed=13, q_block=q_block)
        q, k, v, dout = cases.inputs(128, torch.bfloat16, valid)
        ref_out, ref_lse, _ = cases.reference(q, k, v, dout, valid, selected, scale)
        shape = (q_block, cases.BLOCK)
        layout = BlockSparseLayout.from_block_mask(selected[None], valid, shape).to("cuda")
        lists = forward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
        sel64 = selected.repeat_interleave(q_block // cases.BLOCK, 1)  # per 64-row block
        for arm in arms:
            try:
                got = run_arm(arm, q, k, v, lists, layout.kv_valid_sizes, scale)
                torch.cuda.synchronize()
            except Exception as exc:  # a compile or launch failure is a finding too
                emit({"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                continue
            for record in block_report(arm, got, ref_out, ref_lse, sel64, valid):
                emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

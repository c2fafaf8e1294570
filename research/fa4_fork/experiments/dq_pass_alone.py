"""The dS-writing backward's dQ pass alone (`vsa_fa4.dq_from_ds_triton`), for Nsight Compute
(experiment 21's follow-up, session 26): S=32768, H=12, D=128, 87.5% random top-k lists,
all blocks full, the lists' slots as the backward builds them, dS random (its values do not
change the pass's work). Runs the pass ``--calls`` times; under ncu, profile one of them::

    ncu --kernel-name regex:_dq_from_ds --launch-skip 2 --launch-count 1 \\
        python3 -m research.fa4_fork.experiments.dq_pass_alone       # H200
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from vsa_core.rotation import rotation_width
    from vsa_fa4.dq_from_ds_triton import DqPassConfig, dq_from_ds, ds_slots

    from .bwd_dq_parts import topk_lists

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--stages", type=int, default=DqPassConfig.stages)
    ap.add_argument("--warps", type=int, default=DqPassConfig.warps)
    args = ap.parse_args()
    lay = topk_lists(args.seq, args.heads, 0.125, 64)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    rotate = rotation_width(idx.device) * 2
    slots = ds_slots(idx, cnt, valid, False, rotate).slots
    k, dq = (
        torch.randn(1, args.seq, args.heads, 128, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    ds = torch.randn(idx.numel() * 64, 64, device="cuda", dtype=torch.bfloat16)
    config = DqPassConfig(args.stages, args.warps)
    for _ in range(args.calls):
        dq_from_ds(ds, k, dq, idx, cnt, slots, 128**-0.5, config)
    torch.cuda.synchronize()
    print("ran", args.calls, "calls")


if __name__ == "__main__":
    main()

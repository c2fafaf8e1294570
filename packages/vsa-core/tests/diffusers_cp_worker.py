"""One rank of the check of VSA under diffusers' Ulysses context parallelism; not a pytest module.

Every rank builds the same tiny random-weight diffusers WanTransformer3DModel twice: one plain
(the reference: `enable_vsa` on one process) and one with ``enable_parallelism`` (Ulysses over
the ranks) and `enable_vsa`, in both orders of the two calls, and compares their outputs in
float64; after `disable_vsa`, the parallel model's output with the plain dense model's. Prints
``rank R: OK`` or exits 1. CPU, gloo (what test_integration_diffusers.py launches, one process
per rank)::

    python diffusers_cp_worker.py --init-file /tmp/store --rank 0 --world-size 2 &
    python diffusers_cp_worker.py --init-file /tmp/store --rank 1 --world-size 2
"""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback

import torch
import torch.distributed as dist


def tiny_wan():
    import diffusers

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    return model.double().eval()


def inputs():
    # token grid 4 x 5 x 3 = 60 tokens (30 a rank), 2x2x2 tiles partial along two axes; a
    # per-token timestep (Wan 2.2's form): diffusers 0.42.1's context-parallel hook fails on a
    # 1-D one (its warning path calls a logger method that does not exist)
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(1, 4, 4, 10, 6, generator=gen, dtype=torch.float64)
    text = torch.randn(1, 8, 16, generator=gen, dtype=torch.float64)
    return latent, torch.full((1, 60), 500), text


def run(model):
    with torch.no_grad():
        return model(*inputs(), return_dict=False)[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-file", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    args = ap.parse_args()
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init_file}", rank=args.rank,
        world_size=args.world_size, timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    # diffusers picks a device as rank % accelerator count, which is 0 on a CPU machine
    torch.accelerator.device_count = lambda: 1
    from diffusers import ContextParallelConfig

    from vsa_core.integrations.diffusers import disable_vsa, enable_vsa

    failures = []
    vsa = dict(sparsity=0.5, tile=(2, 2, 2), backend="reference", coarse="add")
    try:
        reference = tiny_wan()
        dense = run(reference)
        enable_vsa(reference, **vsa)
        want = run(reference)
        for order in ("parallel first", "vsa first"):
            model = tiny_wan()
            config = ContextParallelConfig(ulysses_degree=args.world_size)
            if order == "parallel first":
                model.enable_parallelism(config=config)
                enable_vsa(model, **vsa)
            else:
                enable_vsa(model, **vsa)
                model.enable_parallelism(config=config)
            got = run(model)
            err = (got - want).abs().max().item()
            print(f"rank {args.rank}: {order}: max abs err {err:.3e}", flush=True)
            if not err < 1e-10:
                failures.append(f"{order}: max abs err {err:.3e}")
            # diffusers' own processors again, still context-parallel: the dense model's output
            disable_vsa(model)
            err = (run(model) - dense).abs().max().item()
            print(f"rank {args.rank}: {order}, disabled: max abs err {err:.3e}", flush=True)
            if not err < 1e-10:
                failures.append(f"{order}, disabled: max abs err {err:.3e}")
    except Exception:
        failures.append(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    for failure in failures:
        print(f"rank {args.rank}: FAIL {failure}", flush=True)
    if failures:
        return 1
    print(f"rank {args.rank}: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Find a case where vsa-core's `video_sparse_attn` property fails on the fa4 backend, and say
which part of the fa4 path it needs (session 32).

`test_properties.py::test_video_sparse_attn_matches_the_model[gpu_fa4]` failed on an H100 and
an H200 while the same property passed on the CPU through fa4's adapter with FA4's float64
model (`tests/test_fa4_model_properties.py`), so the failure lies in what only a GPU runs.
This draws cases from the property's own space (the GPU fa4 target's tiles, dtypes and head
dims; `latents`, features, gates and checks from ``test_properties``) until one fails or
``--cases`` ran, then runs that case again:

- ``shipped``: as the test does;
- ``replay_off``: the fork's launch replay off (every launch through upstream's launcher);
- ``float32_dq``: the float32-reduction backward instead of the dS-writing one;
- ``triton``: the Triton fine backend (the same coarse stage and op);

and writes each run's verdict per output (out, dq, dk, dv, dgate). ::

    python3 -m research.fa4_adapter.property_failure --cases 60 --out $OUT/property_failure.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
from pathlib import Path
from typing import Any

import torch

from research.harness import core_test_module


def draw_case(rng: random.Random, props: Any) -> dict[str, Any]:
    """One case of the property's space for the GPU fa4 target (as its strategies draw)."""
    target = props.GPU_FA4
    tile = rng.choice(target.tiles)
    while True:
        latent = []
        for t in tile:
            cap = max(8, t)
            grid = rng.randint(1, min(3, math.ceil(cap / t)))
            latent.append(rng.randint((grid - 1) * t + 1, min(grid * t, cap)))
        tiles = math.prod(math.ceil(n / t) for n, t in zip(latent, tile, strict=True))
        if tiles <= target.max_tiles:
            break
    return {
        "latent": tuple(latent), "tile": tile, "dtype": str(rng.choice(target.dtypes)),
        "head_dim": rng.choice(target.head_dims), "heads": rng.randint(1, 2),
        "qkv_format": rng.choice(["bshd", "bhsd"]), "token_order": rng.choice(["tiled", "raster"]),
        "coarse_gate": rng.choice(["none", "heads", "full"]), "scale": rng.choice([None, 0.3]),
        "seed": rng.randint(0, 2**31), "topk": rng.randint(1, tiles),
    }  # fmt: skip


def run_case(
    case: dict[str, Any], backend: str, props: Any, device: str = "cuda"
) -> dict[str, str] | None:
    """The property's body for one case: per output "ok" or the check's message; None when
    the case's selection is too close to a tie for its dtype (the property skips it)."""
    from vsa_core import VideoTiling, video_sparse_attn

    naive = core_test_module("vsa_naive")
    f64 = torch.float64
    dtype = getattr(torch, case["dtype"].removeprefix("torch."))
    latent, tile, dim, heads = case["latent"], case["tile"], case["head_dim"], case["heads"]
    fmt, order, gate_kind, scale = (case[k] for k in ("qkv_format", "token_order",
                                                     "coarse_gate", "scale"))  # fmt: skip
    tiling = VideoTiling(latent, tile)
    gen = torch.Generator().manual_seed(case["seed"])
    raster_to_tile, members = naive.naive_tiling(latent, tile)
    tile_of = torch.tensor([slot // tiling.tile_tokens for slot in raster_to_tile])
    q, k, v = (props._features(gen, tile_of, tiling.num_tiles, 1, heads, dim, 0.5)
               for _ in range(3))  # fmt: skip
    q, k, v = (t.to(dtype).to(f64) for t in (q, k, v))
    tiled = [naive.naive_to_tiles(t, latent, tile) for t in (q, k, v)]
    gate = props._gate(gate_kind, gen, tiled[0].shape)
    valid = torch.tensor([len(m) for m in members])
    eff_scale = dim**-0.5 if scale is None else scale
    gate64 = None if gate is None else gate.to(dtype).to(f64).requires_grad_()
    tiled = [t.requires_grad_() for t in tiled]
    want_t, _, margin = naive.naive_vsa(*tiled, valid, case["topk"], eff_scale, gate64)
    if margin <= props.MARGIN[dtype]:
        return None
    real = list(raster_to_tile)
    want = want_t[:, real]
    sources = tiled if order == "tiled" else (q, k, v)
    inputs = [props._fmt(t.detach(), fmt).to(device, dtype).requires_grad_() for t in sources]
    gate_in = None
    if gate is not None:
        gate_in = gate if order == "tiled" or gate_kind == "heads" else gate[:, real]
        gate_in = props._fmt(gate_in, fmt).to(device, dtype).requires_grad_()
    out = video_sparse_attn(*inputs, topk=case["topk"], tiling=tiling, coarse_gate=gate_in,
                            backend=backend, scale=scale, qkv_format=fmt,
                            token_order=order)  # fmt: skip

    def raster(x):
        x = props._unfmt(x, fmt).cpu()
        return x[:, real] if order == "tiled" else x

    verdicts = {"out": _verdict(props, raster(out), want, props.OUT_TOL[dtype], "out")}
    weight = torch.randn(want.shape, generator=gen, dtype=f64)
    leaves = [*tiled, *([gate64] if gate64 is not None else [])]
    want_grads = torch.autograd.grad((want * weight).sum(), leaves)
    dout = weight.to(dtype)
    if order == "tiled":
        dout = torch.zeros(1, tiling.padded_len, heads, dim, dtype=dtype)
        dout[:, real] = weight.to(dtype)
    mine = [*inputs, *([gate_in] if gate_in is not None else [])]
    grads = torch.autograd.grad(out, mine, props._fmt(dout, fmt).to(device))
    for name, g, w in zip(("dq", "dk", "dv", "dgate"), grads, want_grads, strict=False):
        if name == "dgate" and gate_kind == "heads":
            terms = tiling.padded_len * dim
            got = props._unfmt(g, fmt).cpu()
            verdicts[name] = _verdict(props, got, w, props.GRAD_TOL[dtype], name, terms)
        else:
            verdicts[name] = _verdict(props, raster(g), w[:, real], props.GRAD_TOL[dtype], name)
    return verdicts


def _verdict(props: Any, got, want, tol: float, what: str, terms: int = 1) -> str:
    try:
        props._close(got, want, tol, what, terms)
    except AssertionError as failure:
        return str(failure)
    return "ok"


@contextlib.contextmanager
def _variant(name: str):
    """The fa4 path changed for one diagnosis run (see the module doc); yields the backend."""
    if name == "replay_off":
        from flash_attn_vsa import launch_replay

        saved = [(r, r._on_devices) for r in (launch_replay.FORWARDS, launch_replay.BACKWARDS)]
        for record, _ in saved:
            record._on_devices = lambda t: False
        try:
            yield "fa4"
        finally:
            for record, test in saved:
                record._on_devices = test
    elif name == "float32_dq":
        from flash_attn_vsa import bwd_sm90
        from vsa_core.backends import register_backend, unregister_backend
        from vsa_fa4.backend import FA4Backend
        from vsa_fa4.launch import KernelChoice

        register_backend(FA4Backend(kernels=KernelChoice(backward=bwd_sm90.KV64_CONFIG)))
        try:
            yield "fa4"
        finally:
            unregister_backend(FA4Backend.name)
    else:
        yield {"shipped": "fa4", "triton": "triton"}[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    props = core_test_module("test_properties")
    rng = random.Random(args.seed)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cases_run": 0, "skipped_near_ties": 0}  # fmt: skip
    for _ in range(args.cases):
        case = draw_case(rng, props)
        verdicts = run_case(case, "fa4", props)
        if verdicts is None:
            report["skipped_near_ties"] += 1
            continue
        report["cases_run"] += 1
        print(json.dumps({"case": case, "shipped": verdicts}), flush=True)
        if any(v != "ok" for v in verdicts.values()):
            report["failing_case"] = case
            report["variants"] = {}
            for name in ("shipped", "replay_off", "float32_dq", "triton"):
                with _variant(name) as backend:
                    try:
                        report["variants"][name] = run_case(case, backend, props)
                    except Exception as error:  # a variant may refuse the case, or crash
                        report["variants"][name] = f"{type(error).__name__}: {error}"
                print(json.dumps({name: report["variants"][name]}), flush=True)
            break
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}, default=str))


if __name__ == "__main__":
    main()

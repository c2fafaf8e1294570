"""What bounds VSA's step-time speedup in a whole diffusers Wan model (issue 25).

Reads a `bench_dit.py` result (the model's step with dense FA4, VSA and no attention) and a
`bench_video.py` result at the same latent (the op alone and dense FA4 alone) and prints, per
view, the step with VSA's attention calls at the padding-limited ideal (dense FA4's time for
the same attention divided by the ideal speedup) and everything else as measured (the VSA step
minus its layers times the op's own time)::

    python3 -m research.dit_ideal_bound \\
        --dit benchmarks/results/2026-12-01-h200-bench_dit-wan1.3b-raster-fused.json \\
        --video benchmarks/results/2026-12-01-h200-bench_video-four-latents-session15.json \\
        --shape wan480p --layers 30
"""

from __future__ import annotations

import argparse
import json


def op_times(video: dict, shape: str, mode: str) -> dict[str, dict[str, float]]:
    """{arm: {view: ms}} of one bench_video cell (87.5%), arms dense and auto."""
    cells = [r for r in video["results"] if r["shape"] == shape and r["mode"] == mode]
    return {r["arm"]: {"once": r["once_ms"], "b2b": r["b2b_ms"], "ideal": r["ideal_speedup"]}
            for r in cells if r["arm"] in ("dense", "auto")}  # fmt: skip


def bound(step: dict, op: dict, layers: int, view: str) -> dict[str, float]:
    dense_step, vsa_step = step[f"dense_fa4_{view}_ms"], step[f"vsa_{view}_ms"]
    rest = vsa_step - layers * op["auto"][view]
    ideal_attention = op["dense"][view] / op["dense"]["ideal"]
    ideal_step = rest + layers * ideal_attention
    return {
        "view": view, "dense_fa4_ms": dense_step, "vsa_ms": vsa_step,
        "speedup": dense_step / vsa_step, "rest_ms": rest, "ideal_step_ms": ideal_step,
        "speedup_at_ideal": dense_step / ideal_step,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dit", required=True)
    ap.add_argument("--video", required=True)
    ap.add_argument("--shape", required=True, help="bench_video shape name, e.g. wan480p")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    with open(args.dit) as f:
        dit = json.load(f)
    with open(args.video) as f:
        video = json.load(f)
    for step in dit["rows"]:
        if "vsa_once_ms" not in step:
            continue
        mode = "fwd" if step["mode"] == "fwd" else "fwd+bwd"
        op = op_times(video, args.shape, mode)
        for view in ("once", "b2b"):
            row = {"mode": step["mode"], "way": step["way"], **bound(step, op, args.layers, view)}
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            )


if __name__ == "__main__":
    main()

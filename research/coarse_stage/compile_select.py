"""The Triton selection kernel compiled for sm_90 on a CPU, with and without its split outputs.

`TritonCoarse.select_split` has `select_topk_kernel` also write the lists split by key-tile
fullness (``SPLIT``; `vsa_core.layout.ForwardSplit`) so that fa4's combined forward needs no
list kernel of its own. Before a GPU times it, ptxas says what it costs the kernel: registers,
spills, SASS instructions and global stores, per latent (the tile count sets ``TILES_P2`` and
``ROWS``, as `vsa_triton.coarse.select_with` picks them; 12.5% of the tiles kept),
``SPLIT`` off and on, with and without the coarse attention (``ATTEND``,
`TritonCoarse.select_and_attend`), inside the score loop or after it (``ATTEND_AFTER``); with
the shipped config's ranking apart (session 32) the score kernel without its ranking and
`rank_rows_kernel` too. ::

    uv run python -m research.coarse_stage.compile_select --out DIR/compile_select.json
"""

from __future__ import annotations

import argparse
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from research.triton_kernels.compile_sm90 import _resources

LATENT_TILES = {"wan480p": 624, "wan720p": 1440, "hunyuan720p": 2160}
POINTERS = {
    "qp": "*bf16", "kp": "*bf16", "vp": "*bf16", "coarse_ptr": "*bf16", "valid_ptr": "*i32",
    "scores_ptr": "*fp32",
}  # fmt: skip
FLOATS = {"scale_log2"}
VARIANTS = [(False, False, False), (True, False, False), (False, True, False),
            (True, True, False), (False, True, True), (True, True, True)]  # fmt: skip
"""(SPLIT, ATTEND, ATTEND_AFTER): ATTEND_AFTER runs the attention after the score loop (the
stage's choice since session 23), without it inside the loop."""


def compile_select(num_tiles: int, split: bool, attend: bool = False,
                   attend_after: bool = False) -> dict:  # fmt: skip
    from vsa_triton import coarse, coarse_kernels

    config = coarse.SELECT
    tiles_p2 = coarse._next_pow2(num_tiles)
    constexprs = {
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "HEAD_DIM": 128, "DIM_P2": 128,
        "TILES_P2": tiles_p2, "ROWS": max(1, min(config.block_m, config.elements_per_step
                                                 // tiles_p2)),
        "IEEE": False, "INTERPRET": False, "EARLY_EXIT": config.early_exit, "SPLIT": split,
        "ATTEND": attend, "ATTEND_AFTER": attend_after, "RANK": not config.rank_apart,
        **(coarse._split_constants(round(0.125 * num_tiles), config) if split else {}),
    }  # fmt: skip
    return _compile(coarse_kernels.select_topk_kernel, constexprs, config.num_warps)


def _compile(kernel, constexprs: dict, num_warps: int) -> dict:
    """``kernel`` compiled for sm_90 with ``constexprs``: pointers 16-byte aligned (bf16 or as
    `POINTERS` names them, int32 otherwise), `FLOATS` float32, other arguments int32."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr") or name in POINTERS:
            signature[name] = POINTERS.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    resources = _resources(compiled.asm["cubin"])
    return {"shared_bytes": compiled.metadata.shared, **resources,
            "stg_in_ptx": compiled.asm["ptx"].count("st.global")}  # fmt: skip


def compile_rank(num_tiles: int, split: bool) -> dict:
    """`rank_rows_kernel` (the ranking apart from the scores, session 32) as the op launches
    it: `SelectConfig.rank_warps_for` warps a row."""
    from vsa_triton import coarse, coarse_kernels

    tiles_p2 = coarse._next_pow2(num_tiles)
    constexprs = {"TILES_P2": tiles_p2, "EARLY_EXIT": coarse.SELECT.early_exit, "SPLIT": split,
                  "TOPK_P2": coarse._next_pow2(round(0.125 * num_tiles)), "ROWS": 1,
                  "SPLIT_ROWS": 1}  # fmt: skip
    warps = coarse.SELECT.rank_warps_for(tiles_p2)
    return {"rank_warps": warps,
            **_compile(coarse_kernels.rank_rows_kernel, constexprs, warps)}  # fmt: skip


def main() -> None:
    from vsa_triton import coarse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for latent, tiles in LATENT_TILES.items():
        for split, attend, after in VARIANTS:
            row = {"latent": latent, "tiles": tiles, "split": split, "attend": attend,
                   "attend_after": after,
                   **compile_select(tiles, split, attend, after)}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
        if coarse.SELECT.rank_apart:
            for split in (False, True):
                row = {"latent": latent, "tiles": tiles, "split": split, "kernel": "rank",
                       **compile_rank(tiles, split)}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m research.coarse_stage.compile_select",
                       "triton": triton.__version__, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

"""Compile vsa-triton's attention kernels for sm_90 on a CPU and report what ptxas made of them.

No GPU needed: ``triton.compile`` with a ``GPUTarget("cuda", 90, 32)`` (shared/gpu/README.md).
Per kernel and variant: registers per thread, spill stores / loads, shared memory, the number of
SASS instructions and of ``HGMMA`` / ``LDG`` among them, and a fingerprint of the SASS (with
addresses stripped), so that a change meant to leave a compiled path alone can show it did.
The launch attributes mirror a torch launch of the shipped configurations: pointers and
strides divisible by 16, the head dim contiguous.

    uv run python -m research.triton_kernels.compile_sm90 --out DIR/compile.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT_ARGS = {"num_heads", "seq_q", "slots"}


def _signature(kernel, constexprs: dict, dtype: str, int64_ptrs: set[str]) -> tuple[dict, dict]:
    """Triton signature and attributes for ``kernel``: float tensors in ``dtype``, index
    tensors int32 (int64 where named in ``int64_ptrs``), lse-like buffers float32."""
    float32_ptrs = {"Lse", "Delta"}
    index_ptrs = {n for n in kernel.arg_names if n.endswith("_ptr")} | {"Rows"}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.startswith("stride_"):
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in INT_ARGS:
            signature[name] = "i32"
        elif name in ("qk_scale", "sm_scale"):
            signature[name] = "fp32"
        elif name in float32_ptrs:
            signature[name] = "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in index_ptrs:
            signature[name] = "*i64" if name in int64_ptrs else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _resources(cubin: bytes) -> dict:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    # addresses past 0xffff print with five digits and more: until session 20 the pattern took
    # four, so counts and fingerprints of larger kernels covered their first 4,096 lines only
    lines = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    body = "\n".join(re.sub(r"0x[0-9a-f]+", "#", line) for line in lines)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "sass_instructions": len(lines),
        "hgmma": sum("HGMMA" in line for line in lines),
        "ldg": sum(line.split()[0].startswith("LDG") for line in lines if line),
        "sass_fingerprint": hashlib.sha256(body.encode()).hexdigest()[:16],
    }


def compile_variant(kernel, constexprs: dict, num_warps: int, num_stages: int,
                    dtype: str = "bf16", int64_ptrs: set[str] = frozenset()) -> dict:  # fmt: skip
    known = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    signature, attrs = _signature(kernel, known, dtype, set(int64_ptrs))
    src = ASTSource(kernel, signature, constexprs=known, attrs=attrs)
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    return {"shared_bytes": compiled.metadata.shared, **_resources(compiled.asm["cubin"])}


def variants() -> list[tuple[str, object, dict, int, int]]:
    """(name, kernel, constexprs, warps, stages) of the shipped 64x64 and 128x128 configs,
    D=128; the constexprs a kernel does not have are dropped."""
    from vsa_triton import kernels
    from vsa_triton.config import backward_config, forward_config

    found = []
    for q_block, kv_block in ((64, 64), (128, 128)):
        fc = forward_config(q_block, kv_block, 128)
        bc = backward_config(q_block, kv_block, 128)
        shape = f"{q_block}x{kv_block}"
        base = {"Q_BLOCK": q_block, "KV_BLOCK": kv_block, "HEAD_DIM": 128, "INTERPRET": False}
        for extra in _layout_variants(kernels.fwd_kernel):
            found.append((f"fwd-{shape}{_tag(extra)}", kernels.fwd_kernel,
                          {**base, "TILE_N": fc.tile, "DUAL": fc.dual, **extra}, fc.num_warps,
                          fc.num_stages))  # fmt: skip
        for extra in _layout_variants(kernels.bwd_dq_kernel):
            found.append((f"dkdv-{shape}{_tag(extra)}", kernels.bwd_dkdv_kernel,
                          {**base, "TILE_M": bc.tile_dkdv, **extra}, bc.num_warps_dkdv,
                          bc.num_stages_dkdv))  # fmt: skip
            found.append((f"dq-{shape}{_tag(extra)}", kernels.bwd_dq_kernel,
                          {**base, "TILE_N": bc.tile_dq, **extra}, bc.num_warps_dq,
                          bc.num_stages_dq))  # fmt: skip
    return found


def _tag(extra: dict) -> str:
    """The variant's name suffix: its flags that are on (``-raster-combine``)."""
    return "".join(f"-{name.lower()}" for name, on in extra.items() if on)


def _layout_variants(kernel) -> list[dict]:
    """The token-placement variants a kernel compiles (none before RASTER existed). Commit
    e450f8a also compiled the row-prefetch and pattern experiments (removed since)."""
    names = kernel.arg_names
    out = [{}]
    if "RASTER" in names:
        out = [{"RASTER": False}, {"RASTER": True}]
    if "COMBINE" in names:
        out = [{**v, "COMBINE": False, "HAS_GATE": False} for v in out] + [
            {**v, "COMBINE": True, "HAS_GATE": g} for v in out for g in (False, True)
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file for the table")
    parser.add_argument("--only", help="compile only variants whose name contains this")
    args = parser.parse_args()
    rows = []
    for name, kernel, constexprs, warps, stages in variants():
        if args.only and args.only not in name:
            continue
        row = {"variant": name, "num_warps": warps, "num_stages": stages}
        try:
            row.update(compile_variant(kernel, constexprs, warps, stages))
        except Exception as exc:  # a variant the compiler refuses is a finding, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"triton": triton.__version__, "target": "cuda sm_90 (compiled on a CPU)"}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

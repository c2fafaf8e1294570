"""The registry of the fork's kernel deltas: one record per delta module, the single source of
the deltas table in ``UPSTREAM.md`` (and of what the docs may say about each).

A *delta* is one module of ``flash_attn_vsa`` that changes what an upstream FA4 kernel does.
Each `Delta` says which upstream piece it builds on (a symbol whose source the fingerprint
hashes, so a refresh shows any upstream change under it), whether it is **shipped** (`vsa-fa4`
runs it by default) or **experimental** (only on request), and where ``vsa_fa4.launch`` runs
it. The statuses and routes below were read from ``vsa_fa4.launch`` (``run_forward``,
``run_backward``, ``SHIPPED_FORWARD``, ``Q_IN_REGISTERS_WHERE_FASTER``) and from
``bwd_sm90.config_for``; a test checks that the modules exist and every module of the package is
accounted for (`SUPPORT`, `EXPERIMENTS`, `TOOLING`), that experimental deltas and only they live
in ``flash_attn_vsa.experimental`` (the package's lifecycle: shipped code at its top), and that
`PIN_TOOLS` are this tools package's modules.

It lives in ``flash-attn-4-vsa-tools`` (``tools/fa4-pin``, a workspace member that is not
published), beside the other pin tools: only maintainers run it, so the runtime wheel does not
carry it.

``UPSTREAM.md``'s table is generated from `DELTAS` between :data:`TABLE_BEGIN` and
:data:`TABLE_END`::

    uv run python -m flash_attn_vsa_tools.deltas --check    # exit 1 when the table is stale
    uv run python -m flash_attn_vsa_tools.deltas --write    # regenerate it

Pure data and text; importing this module imports nothing from upstream (nor torch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flash_attn_vsa_tools.upstream_md import workspace_upstream_md

__all__ = [
    "DELTAS",
    "EXPERIMENTAL_PACKAGE",
    "EXPERIMENTS",
    "PIN_TOOLS",
    "SUPPORT",
    "TABLE_BEGIN",
    "TABLE_END",
    "TOOLING",
    "TOOLS_SOURCE",
    "Delta",
    "by_module",
    "main",
    "module_file",
    "render_table",
    "replace_table",
    "table_section",
]

Status = Literal["shipped", "experimental"]

TABLE_BEGIN = (
    "<!-- fa4-deltas:begin (generated from flash_attn_vsa_tools/deltas.py, do not edit) -->"
)
TABLE_END = "<!-- fa4-deltas:end -->"
COMMAND = "uv run python -m flash_attn_vsa_tools.deltas --write"


@dataclass(frozen=True)
class Delta:
    """One kernel delta of the fork."""

    number: int
    """Its number in the docs ("delta 4"), in the order the deltas landed."""
    module: str
    """The module of ``flash_attn_vsa`` that holds it, dotted below the package (``"bwd_sm90"``,
    ``"experimental.persistent_sm90"``)."""
    title: str
    builds_on: str
    """The upstream symbol it subclasses, wraps or departs from (fingerprinted, source hashed)."""
    status: Status
    routed: str
    """Where ``vsa-fa4`` runs it: by default for shipped deltas, on request for experimental
    ones."""
    arch: str = "sm_90"
    offered_upstream: str = "no"

    @property
    def file(self) -> str:
        """Its file, relative to ``packages/flash-attn-4-vsa/``."""
        return module_file(self.module)


EXPERIMENTAL_PACKAGE = "experimental"
"""The subpackage of ``flash_attn_vsa`` that holds what ``vsa-fa4`` does not run by default."""


def module_file(module: str) -> str:
    """The file of a module of ``flash_attn_vsa`` (dotted below the package), relative to
    ``packages/flash-attn-4-vsa/``."""
    return f"src/flash_attn_vsa/{module.replace('.', '/')}.py"


_FWD = "flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90"
_BWD = "flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90"

DELTAS: tuple[Delta, ...] = (
    Delta(
        1,
        "bwd_sm90",
        "KV64 block-sparse backward",
        _BWD,
        "shipped",
        "`run_backward`: every backward with 64-token key blocks (64x64: vsa-fa4 passes "
        "`KV64_DS_CONFIG`, delta 12, by default and `KV64_CONFIG`, delta 8, on request; 128x64 "
        "`Q128_KV64_CONFIG`); the configurations of `experimental.bwd_configs` only when passed "
        "(`run_backward(config=...)`)",
    ),
    Delta(
        2,
        "fwd_sm90",
        "Q64/KV64 forward, two CTAs per SM",
        _FWD,
        "shipped",
        "`run_forward`: 64x64 forwards on unpaired lists (`block_sparse_forward_q64`)",
    ),
    Delta(
        3,
        "mask_sm90",
        "Partial key blocks as a column limit",
        "flash_attn.cute.mask.AttentionMask",
        "shipped",
        "`run_forward` / `run_backward` on layouts with partial key blocks: the mask_mod they "
        "pass (`valid_size_mask_mod`) installs it for upstream's and the fork's sm_90 kernels",
    ),
    Delta(
        4,
        "fwd_sm90_paired",
        "Paired-key forward (128x64 blocks, 128-key tiles)",
        _FWD,
        "shipped",
        "`run_forward`: 128x64 forwards at head dim 128 on sm_90 (64x64 layouts whose row pairs "
        "share lists are planned as 128x64)",
    ),
    Delta(
        5,
        "q_regs_sm90",
        "Q in registers for QK^T",
        _FWD,
        "shipped",
        "`run_forward`: the two-CTA 64x64 forward (`Q_IN_REGISTERS_WHERE_FASTER`, +1.3-2.5% on an "
        "H200); not the paired forward (-2%) unless `ForwardVariant(q_in_registers=True)`",
    ),
    Delta(
        6,
        "experimental.fwd_sm90_streams",
        "Two query streams per CTA",
        _FWD,
        "experimental",
        "on request: `run_forward(variant=ForwardVariant(two_streams=True))`, 64x64 forwards at "
        "head dim 128 (correct on an H200, 0.69-0.76 of dense against the two-CTA kernel's 0.79)",
    ),
    Delta(
        7,
        "experimental.persistent_sm90",
        "Persistent tiles for the fork's forwards",
        "flash_attn.cute.tile_scheduler.StaticPersistentTileScheduler",
        "experimental",
        "on request: `run_forward(variant=ForwardVariant(persistent=True))` (on an H200 +0.7% "
        "paired, -3% to +1% two-CTA)",
    ),
    Delta(
        8,
        "bwd_sm90_dq_parts",
        "KV64 backward, dQ sent in parts (two CTAs per SM)",
        _BWD,
        "shipped",
        "`run_backward`: 64x64 backwards (`bwd_sm90.KV64_CONFIG`: halves through one 16 KB "
        "buffer, sent by the producer warp); other `DqStaging` forms only when passed "
        "(`run_backward(config=...)`)",
    ),
    Delta(
        9,
        "combine_sm90",
        "VSA's combine in the forward's epilogue",
        "flash_attn.cute.flash_fwd.FlashAttentionForwardBase",
        "shipped",
        "`run_forward(combine=...)`: inference 64x64 forwards of the whole op "
        "(`vsa_fa4.ops.attention_combined`; on an H200 the epilogue costs nothing measurable and "
        "saves the 0.09 / 0.88 ms combine pass at Wan 480p / 720p)",
    ),
    Delta(
        10,
        "valid_in_list_sm90",
        "Partial key blocks' valid sizes in the forward's list entries",
        _FWD,
        "shipped",
        "every 64x64 forward with partial key blocks (`vsa_fa4.lists.PackedSparseLists` from "
        "the list kernel, `mask_sm90.valid_in_list_mask_mod`): on an H200 bitwise the output of "
        "the lists without sizes, and it drops the masked steps' extra wait for the previous "
        "P V product (Nsight: +1.0% over all-full blocks against +3.0%; timed back to back "
        "+6.5% against +7.7%: experiments 17 and 18)",
    ),
    Delta(
        11,
        "experimental.v_padding_sm90",
        "Partial key blocks' V padding zeroed in shared memory",
        _FWD,
        "experimental",
        "`vsa_fa4.launch.ForwardVariant(zero_v_padding=True)` (off in the shipped choice): the "
        "64x64 forward with valid sizes in its lists reads v's padding as it is, so inference "
        "makes no zeroed copy of v; on an H200 the op's peak memory 1.32-1.41x of dense "
        "instead of 2.54-2.62x, its forward 10-14% slower (session 25)",
    ),
    Delta(
        12,
        "bwd_sm90_ds_out",
        "The 64x64 backward writing dS instead of reducing dQ",
        _BWD,
        "shipped",
        "`vsa_fa4.ops.backward_impl` for every 64x64 backward whose kernel choice names no "
        "other (`KernelChoice.backward_for` -> `bwd_sm90.KV64_DS_CONFIG`, the default since "
        "session 27): per head chunk the key-owned kernel writes dK, dV and each pair's dS, "
        "then `vsa_fa4.dq_from_ds_triton` computes dQ in a fixed order; dq, dk and dv bitwise "
        "reproducible. H200, S=32768: 0.73 of dense against delta 8's 0.70 (session 26); "
        "whole op on an H100, forward+backward, once / back to back: Wan 480p 2.95x / 3.23x "
        "of dense against 2.57x / 2.91x, Wan 720p 3.42x / 3.44x against 2.45x / 2.47x "
        "(session 27)",
    ),
)
"""Every kernel delta, by number."""

SUPPORT: dict[str, str] = {
    "sm90_blocks": "what the sm_90 deltas run (block sizes, head dims, argument checks), the "
    "two-CTA launch bound and upstream's compile caches scoped to our kernel classes",
    "sm90_operands": "the stand-in for `flash_fwd_sm90.sm90_utils` through which deltas 5 and 6 "
    "reach upstream's operand partitions and staged layouts",
    "build_scope": "the one scope: the kernel a fork entry point is having upstream's launcher "
    "build on this thread (`current`, read by the stand-ins for upstream's module globals; "
    "entered only by the entry points, from their arguments) and the kernel classes' "
    "trace-time state; a leaf",
    "paired_sm90": "delta 4's body (packed pairs, mask, kernel class, the patch of upstream's "
    "forward module), below `fwd_sm90`'s `ForwardKernel`; `fwd_sm90_paired` re-exports it",
    "bwd_sm90_kv64": "delta 1's kernel class (the register split), a leaf below `bwd_sm90` and "
    "delta 8, which subclasses it; `bwd_sm90` re-exports it",
    "launch_replay": "the forward entry points' replayed launches: the one compiled kernel "
    "upstream's `_flash_attn_fwd` calls for a call description, recorded on its first call "
    "(through the compile caches, which hand kernels to its recorder) and called directly on "
    "later ones, skipping upstream's per-call Python; changes no kernel",
}
"""Modules the deltas share that change no kernel on their own."""

EXPERIMENTS: dict[str, str] = {
    "experimental.streams_sm90": "delta 6's body (packed entries, mask, kernel class), below "
    "`fwd_sm90`'s `ForwardKernel`; `experimental.fwd_sm90_streams` re-exports it",
    "experimental.bwd_configs": "the KV64 backward's configurations that vsa-fa4 does not run "
    "by default (deltas 1 and 8): `EXPERIMENTAL_CONFIGS` under measurement, `ABLATIONS` (dQ "
    "wrong on purpose, timing bounds), passed as `config=` to the KV64 backward",
}
"""Modules of ``flash_attn_vsa.experimental`` that are no delta of their own: an experimental
delta's body, and configurations of shipped deltas that are not routed."""

TOOLING: dict[str, str] = {
    "compile_gate": "every kernel configuration we use compiles for sm_90a on a CPU (in the "
    "package: `vsa_fa4.compile_gate` builds on it)",
}
"""Maintainer tooling for the pin (no kernel code) inside the package."""

PIN_TOOLS: dict[str, str] = {
    "fingerprint": "the recorded API of the upstream symbols we rely on (`upstream_api.json`)",
    "refresh": "`fa4-refresh`: moves the pin and runs the CPU gates",
    "upstream_md": "reads and updates the tool-kept parts of UPSTREAM.md",
    "deltas": "the registry of the deltas, from which this table is generated",
}
"""The pin's maintainer tooling in ``flash_attn_vsa_tools`` (`TOOLS_SOURCE`), outside the
runtime package."""

TOOLS_SOURCE = "tools/fa4-pin/src/flash_attn_vsa_tools"
"""Where `PIN_TOOLS` live, relative to the workspace root."""


def by_module() -> dict[str, Delta]:
    """`DELTAS` by module name."""
    return {d.module: d for d in DELTAS}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    """The generated deltas section of ``UPSTREAM.md``, markers included."""
    lines = [
        TABLE_BEGIN,
        "",
        "| # | Delta | Our file | Builds on (upstream) | Arch | Status | Where vsa-fa4 runs it "
        "| Offered upstream |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in DELTAS:
        lines.append(
            f"| {d.number} | {_cell(d.title)} | `{d.file}` | `{d.builds_on}` | {d.arch} "
            f"| {d.status} | {_cell(d.routed)} | {d.offered_upstream} |"
        )
    lines += ["", "Not deltas, also in the package:", ""]
    kinds = {"shared by the deltas": SUPPORT, "experimental": EXPERIMENTS, "pin tooling": TOOLING}
    for kind, modules in kinds.items():
        for name, what in modules.items():
            lines.append(f"- `{module_file(name)}` ({kind}): {what}")
    lines += ["", "Pin tooling, in the unpublished workspace member `tools/fa4-pin`:", ""]
    for name, what in PIN_TOOLS.items():
        lines.append(f"- `{TOOLS_SOURCE}/{name}.py`: {what}")
    lines += ["", TABLE_END]
    return "\n".join(lines)


def table_section(text: str) -> str | None:
    """The generated section of ``text`` (markers included), or None when it has none."""
    start = text.find(TABLE_BEGIN.split(" (")[0])  # the marker's words may be edited
    end = text.find(TABLE_END, start)
    if start < 0 or end < 0:
        return None
    return text[start : end + len(TABLE_END)]


def replace_table(text: str) -> str:
    """``text`` with its generated deltas section rendered from `DELTAS`."""
    current = table_section(text)
    if current is None:
        raise ValueError(f"UPSTREAM.md has no {TABLE_BEGIN!r} ... {TABLE_END!r} section")
    return text.replace(current, render_table(), 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flash_attn_vsa_tools.deltas",
        description="Check or regenerate UPSTREAM.md's deltas table from the registry.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when the table is stale")
    mode.add_argument("--write", action="store_true", help="regenerate the table in place")
    parser.add_argument("--path", type=Path, help="UPSTREAM.md (default: the workspace's)")
    args = parser.parse_args(argv)
    path = args.path or workspace_upstream_md()
    if not args.check and not args.write:
        print(render_table())
        return 0
    if path is None or not path.is_file():
        print("no UPSTREAM.md found (run in a workspace checkout or pass --path)", file=sys.stderr)
        return 2
    text = path.read_text()
    new_text = replace_table(text)
    if args.write:
        if new_text != text:
            path.write_text(new_text)
            print(f"wrote {path}")
        return 0
    if new_text != text:
        print(f"{path}: the deltas table differs from flash_attn_vsa_tools.deltas; run {COMMAND}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

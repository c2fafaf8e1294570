"""Full-op benchmark: `video_sparse_attn` at real video latents against dense attention.

The op (coarse pooling, coarse attention, top-k selection, fine block-sparse attention, combine)
runs forward and forward+backward on tile-order inputs with partial tiles: Wan-2.1 480p
(21x30x52, 12 heads) and 720p (21x45x80, 40 heads), HunyuanVideo 720p (33x45x80, 24 heads),
tile (4,4,4), D=128, at 87.5% and 90% sparsity (top-k = round((1 - sparsity) * tiles)). The dense
baseline is FA4 ``flash_attn_func`` when available, else PyTorch SDPA (cuDNN, else flash), on
the real (unpadded) tokens.

Arms (--arms): our op with each fine backend named (auto, fa4, triton, reference, ...), and
FastVideo's published op (`fastvideo_arm.py`: ``fastvideo``, its Triton composition, and
``fastvideo_tk``, its ThunderKittens sm_90 kernels where its compiled extension loads), all on
the same inputs; dense is always there. All arms of one cell are timed call by call in
alternation (round robin, each round in an order of `bench_timing.balanced_orders`:
`bench_timing.time_views`), in two views: back to back (N calls of an arm between two CUDA
events, nothing synchronized, the host runs ahead: device throughput) and once (CUDA events
around one call, then a synchronize, the median over calls: latency, with the host time before
the first kernel launch in full), plus the host time to issue one call (wall clock from the call
to its return, no synchronization).

Reported per cell and arm: both times, the host time, the speedup over dense in both views,
the padding-limited ideal speedup ((real tokens / padded tokens)^2 / kept fraction) and the
fraction of it reached, the time of our op's pieces (pool_tiles x3, coarse_attention,
select_topk, fine attention; timed apart, back to back) and the share of coarse+select, and
the peak GPU memory against dense's (max_memory_allocated beyond what was allocated before the
call; forward under no_grad, forward+backward including grads).

Correctness gates, before timing: our op's output (and q/k/v gradients) on real tokens against
a float32 composition of the same stages on the same selection (vsa-core's reference fine
attention); FastVideo's against the float32 composition on its own selection (its pooling and
top-k functions on its inputs), with a relative-L2 fallback recorded as such; the dense
baseline's output on 128 sampled query rows against float32 attention, its gradients for
finiteness. An arm that fails its gate is not timed. On a CPU it runs the reference backend on
a tiny latent.

    python benchmarks/bench_video.py --out results/bench_video.json
    python benchmarks/bench_video.py --shapes wan480p --arms auto fa4 triton fastvideo \
        --sparsities 0.875 --out results/bench_video_arms.json

Sequence parallel (--sequence-parallel, under torchrun): every rank runs vsa-core's Ulysses
`sequence_parallel_video_sparse_attn` on its tile-aligned slice of the sequence (NCCL on GPUs,
gloo on a CPU); rank 0 also runs the single-GPU op and the dense baseline on its GPU. Gates: the
single-GPU op against the float32 composition, then the gathered sequence-parallel output (and
q/k/v gradients) against the single-GPU op's (bf16: relative L2 error; on a CPU float32 and the
reference backend). Every rank makes exactly --warmup + --reps calls (no time budget), timed
between barriers with CUDA events; a call's time is the slowest rank's (all_reduce MAX). Rank 0
reports the time per call, the speedup over the single-GPU op and over dense, the scaling
efficiency (single-GPU op time / (N x sequence-parallel time)) and the peak memory of each rank.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_video.py --sequence-parallel \
        --shapes wan720p --out results/bench_video_sp2.json

``--deterministic``: every arm of our op (and the sequence-parallel op) runs with
``deterministic=True`` (``auto`` resolved for it: in training fa4's dS-writing backward for
64x64 blocks on sm_90, triton elsewhere); the same command without it, against the same dense
baseline, gives the cost.
The pieces (coarse attention and fine attention timed apart) stay the default ones.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_reference as bref
import bench_report as brep
import bench_run as brun
import bench_timing as bt
import bench_vsa
import fastvideo_arm as fva
from bench_variants import coarse_backend_for, register_variant

from vsa_core import BlockSparseLayout, VideoTiling, block_sparse_attn, video_sparse_attn
from vsa_core.backends import AttentionCall, get_backend, select_backend
from vsa_core.backends.registry import refusal as backend_refusal
from vsa_core.coarse import (
    coarse_attention,
    coarse_stage,
    layout_from_selection,
    pool_tiles,
    select_topk,
)
from vsa_core.distributed import (
    gather_sequence,
    sequence_parallel_video_sparse_attn,
    shard_sequence,
)
from vsa_core.reference import reference_block_sparse_attn

PRESETS: dict[str, tuple[tuple[int, int, int], int]] = {
    "wan480p": ((21, 30, 52), 12),
    "wan720p": ((21, 45, 80), 40),
    "hunyuan720p": ((33, 45, 80), 24),
    "tiny": ((6, 7, 9), 2),
}
GPU_DEFAULTS = {
    "shapes": ["wan480p", "wan720p", "hunyuan720p"],
    "head_dim": 128,
    "warmup": 3,
    "reps": 10,
    "budget_s": 3.0,
    "b2b_calls": 10,
}
CPU_DEFAULTS = {
    "shapes": ["tiny"],
    "head_dim": 32,
    "warmup": 1,
    "reps": 3,
    "budget_s": 1.0,
    "b2b_calls": 2,
}
DENSE_SAMPLE_ROWS = 128
DENSE = "dense"  # the dense baseline's arm name

KEY_FIELDS = ("shape", "heads", "sparsity", "mode", "arm")
VALUE_FIELDS = ("b2b_ms", "once_ms", "host_ms", "peak_mib", "pool_ms", "coarse_ms", "select_ms",
                "fine_ms")  # fmt: skip
DERIVED_FIELDS = (
    "dense_b2b_ms",
    "dense_once_ms",
    "dense_peak_mib",
    "speedup_b2b",
    "speedup_once",
    "fraction_of_ideal_b2b",
    "fraction_of_ideal_once",
    "coarse_select_ms",
    "coarse_select_share",
    "peak_mem_ratio",
)
# The sequence-parallel run's records: one per cell (the single-GPU op, dense and the SP op).
SP_KEY_FIELDS = ("shape", "heads", "sparsity", "mode")
SP_VALUE_FIELDS = (
    "op_ms",
    "dense_ms",
    "pool_ms",
    "coarse_ms",
    "select_ms",
    "fine_ms",
    "op_peak_mib",
    "dense_peak_mib",
)


@dataclass(frozen=True)
class Shape:
    name: str
    latent: tuple[int, int, int]
    heads: int


def parse_shape(text: str) -> Shape:
    """A preset name, or TxHxW[:heads] (heads default 12)."""
    if text in PRESETS:
        latent, heads = PRESETS[text]
        return Shape(text, latent, heads)
    dims, _, heads = text.partition(":")
    try:
        t, h, w = (int(x) for x in dims.lower().split("x"))
        n_heads = int(heads) if heads else 12
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be one of {', '.join(PRESETS)} or TxHxW[:heads], got {text!r}"
        ) from None
    return Shape(f"{t}x{h}x{w}", (t, h, w), n_heads)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_video.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        help="presets (wan480p, wan720p, hunyuan720p, tiny) or TxHxW[:heads]; "
        "default: wan480p wan720p hunyuan720p (CPU: tiny)",
    )
    g.add_argument("--heads", type=int, help="override every shape's head count")
    g.add_argument("--head-dim", type=int, help="default 128 (CPU: 32)")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--tile", type=int, nargs=3, default=(4, 4, 4), metavar=("T", "H", "W"))
    g.add_argument(
        "--sparsities",
        type=bench_vsa.parse_sparsity,
        nargs="+",
        default=[0.875, 0.9],
        help="fractions of key tiles skipped (default: 0.875 0.9)",
    )
    g.add_argument(
        "--arms",
        nargs="+",
        default=["auto"],
        metavar="ARM",
        help="the arms besides dense, timed in alternation: our op with a fine backend (auto, "
        "fa4, triton, reference, ...), fastvideo (FastVideo's Triton composition), fastvideo_tk "
        "(its ThunderKittens sm_90 kernels); default: auto",
    )
    g.add_argument(
        "--backend",
        dest="arms",
        type=lambda name: [name],
        default=argparse.SUPPRESS,
        metavar="NAME",
        help="one fine backend of our op alone: the same as --arms NAME",
    )
    g.add_argument(
        "--modes",
        type=brun.parse_mode,
        nargs="+",
        default=["fwd", "fwd+bwd"],
        help="fwd and/or fwd+bwd (alias fwdbwd); default both",
    )
    g.add_argument(
        "--dense",
        choices=("auto", "fa4", "sdpa"),
        default="auto",
        help="dense baseline: auto = FA4 when available, else SDPA",
    )
    g.add_argument("--no-coarse-gate", action="store_true", help="run without a coarse gate")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="our op's arms with deterministic=True (bitwise-reproducible results; auto and a "
        "named backend resolved for it, a backend that refuses is skipped with its reason)",
    )
    g.add_argument(
        "--fa4-variant",
        type=lambda text: tuple(text.split(",")),
        default=(),
        metavar="OPTIONS",
        help="the fork's experimental fa4 forwards where they fit, a comma list of qregs, "
        "streams, persistent (vsa_fa4.launch.ForwardVariant); default: the shipped kernels",
    )
    g.add_argument(
        "--dtype",
        choices=sorted(brun.DTYPES),
        help="default bf16 (with --sequence-parallel on a CPU: float32)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="under torchrun --nproc-per-node=N: the op sharded over the N ranks (Ulysses), "
        "against the single-GPU op and dense on one GPU; fixed --warmup/--reps, no --budget-s",
    )
    g.add_argument(
        "--sp-head-chunk",
        type=int,
        metavar="N",
        help="with --sequence-parallel: heads per pipeline step (the op's head_chunk); "
        "default: the op's (32 MiB per whole-sequence tensor)",
    )
    g.add_argument(
        "--sp-recompute",
        action="store_true",
        help="with --sequence-parallel: recompute=True (backward exchanges and runs each step "
        "again; no activations kept)",
    )
    t = p.add_argument_group("timing")
    t.add_argument("--warmup", type=int, help="default 3 (CPU: 1)")
    t.add_argument(
        "--reps",
        type=int,
        help="timed rounds per view (per piece: calls), at most (default 10; CPU: 3)",
    )
    t.add_argument(
        "--budget-s",
        type=float,
        help="about this many seconds of timed calls per arm and cell, both views together, "
        "and per piece (default 3)",
    )
    t.add_argument(
        "--b2b-calls",
        type=int,
        help="back-to-back view: at most this many calls of an arm between two CUDA events "
        "(default 10; CPU: 2)",
    )
    t.add_argument(
        "--b2b-turn-ms",
        type=float,
        default=20.0,
        help="back-to-back view: enough calls per turn for about this many ms of the arm's own "
        "time (default 20)",
    )
    t.add_argument(
        "--no-pieces",
        action="store_true",
        help="do not time our op's pieces (pool, coarse, select, fine) apart",
    )
    t.add_argument(
        "--time-budget-min",
        type=float,
        help="stop starting new cells after this many minutes; the rest are reported 'not_run'",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="JSON path; the .md table goes beside it")
    brun.add_run_options(o)
    return p


@dataclass
class Config:
    shapes: list[Shape]
    head_dim: int
    batch: int
    tile: tuple[int, int, int]
    sparsities: list[float]
    arms: list[str]
    modes: list[str]
    dense: str
    coarse_gate: bool
    dtype: torch.dtype
    warmup: int
    reps: int
    budget_s: float | None
    time_budget_min: float | None
    seed: int
    out: Path | None
    replica_timeout_s: float
    sequence_parallel: bool = False
    sp_head_chunk: int | None = None
    sp_recompute: bool = False
    fa4_variant: tuple[str, ...] = ()
    b2b_calls: int = 10
    b2b_turn_ms: float = 20.0
    pieces: bool = True
    deterministic: bool = False

    @property
    def backend(self) -> str:
        """The one fine backend of a sequence-parallel run (its only arm)."""
        return self.arms[0]

    @contextlib.contextmanager
    def fa4_variant_context(self) -> Iterator[None]:
        """Around each op cell: with `--fa4-variant`, the registry's ``fa4`` (the arm ``fa4``
        and what ``auto`` picks) is an fa4 backend carrying that forward variant, registered for
        the cell (the variant is the backend's argument, `vsa_fa4.launch.KernelChoice`)."""
        if not self.fa4_variant:
            yield
            return
        from vsa_core.backends import register_backend, unregister_backend
        from vsa_fa4.backend import FA4Backend
        from vsa_fa4.launch import ForwardVariant, KernelChoice

        variant = ForwardVariant.from_names(self.fa4_variant)
        register_backend(FA4Backend(kernels=KernelChoice(variant)))
        try:
            yield
        finally:
            unregister_backend(FA4Backend.name)

    def as_dict(self) -> dict[str, Any]:
        fields = {
            "shapes": [
                {"name": s.name, "latent": list(s.latent), "heads": s.heads} for s in self.shapes
            ],
            "head_dim": self.head_dim,
            "batch": self.batch,
            "tile": list(self.tile),
            "sparsities": self.sparsities,
            "arms": self.arms,
            "modes": self.modes,
            "dense": self.dense,
            "coarse_gate": self.coarse_gate,
            "dtype": brun.DTYPE_NAMES[self.dtype],
            "warmup": self.warmup,
            "reps": self.reps,
            "budget_s": self.budget_s,
            "time_budget_min": self.time_budget_min,
            "seed": self.seed,
            "fa4_variant": list(self.fa4_variant),
            "deterministic": self.deterministic,
        }
        if self.sequence_parallel:
            fields.update(
                sequence_parallel=True,
                backend=self.backend,
                sp_head_chunk=self.sp_head_chunk,
                sp_recompute=self.sp_recompute,
            )
        else:
            fields.update(b2b_calls=self.b2b_calls, b2b_turn_ms=self.b2b_turn_ms,
                          pieces=self.pieces)  # fmt: skip
        return fields


def make_config(args: argparse.Namespace, device: torch.device) -> Config:
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    shapes = []
    for item in pick("shapes"):
        shape = item if isinstance(item, Shape) else parse_shape(item)
        if args.heads is not None:
            shape = Shape(shape.name, shape.latent, args.heads)
        shapes.append(shape)
    if any(m == "bwd" for m in args.modes):
        raise SystemExit("bench_video runs fwd and fwd+bwd (the op's backward needs its forward)")
    sp = bool(args.sequence_parallel)
    arms = list(dict.fromkeys(args.arms))
    if sp and (len(arms) != 1 or arms[0] in fva.ARMS or arms[0] == DENSE):
        raise SystemExit("--sequence-parallel runs one fine backend of our op: --arms NAME")
    if DENSE in arms:
        raise SystemExit("dense always runs (--dense picks it): leave it out of --arms")
    if args.b2b_calls is not None and args.b2b_calls < 1:
        raise SystemExit("--b2b-calls must be at least 1")
    if args.dtype is not None:
        dtype = brun.DTYPES[args.dtype]
    else:  # sequence parallel on a CPU: float32, so that its gate is tight
        dtype = torch.float32 if sp and device.type != "cuda" else torch.bfloat16
    return Config(
        shapes=shapes,
        head_dim=pick("head_dim"),
        batch=args.batch,
        tile=tuple(args.tile),
        sparsities=list(dict.fromkeys(args.sparsities)),
        arms=arms,
        modes=list(dict.fromkeys(args.modes)),
        dense=args.dense,
        coarse_gate=not args.no_coarse_gate,
        dtype=dtype,
        warmup=pick("warmup"),
        reps=pick("reps"),
        budget_s=None if sp else pick("budget_s"),  # fixed counts: collectives in the op
        time_budget_min=args.time_budget_min,
        seed=args.seed,
        out=args.out,
        replica_timeout_s=args.replica_timeout_s,
        sequence_parallel=sp,
        sp_head_chunk=args.sp_head_chunk,
        sp_recompute=bool(args.sp_recompute),
        fa4_variant=_checked_fa4_variant(args.fa4_variant),
        b2b_calls=pick("b2b_calls"),
        b2b_turn_ms=args.b2b_turn_ms,
        pieces=not args.no_pieces,
        deterministic=bool(args.deterministic),
    )


# ---- metrics --------------------------------------------------------------------------------
def topk_for(sparsity: float, num_tiles: int) -> int:
    return max(1, min(num_tiles, round((1 - sparsity) * num_tiles)))


def ideal_speedup(tokens_real: int, tokens_padded: int, kept_fraction: float) -> float:
    """Speedup over dense attention on the real tokens if the op cost only its fine attention
    over the padded sequence: (real / padded)^2 / kept fraction."""
    return (tokens_real / tokens_padded) ** 2 / kept_fraction


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def cell_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(rec.get(f) for f in SP_KEY_FIELDS)


def derive_arms(results: list[dict[str, Any]]) -> None:
    """Each arm against the dense arm of its cell (in place): dense's times from the same
    rounds and the speedup over it in both views, the fraction of the ideal speedup reached,
    our op's coarse+select share (of its back-to-back time) and the peak memory ratio."""
    dense = {cell_key(r): r for r in results if r.get("arm") == DENSE and r.get("status") == "ok"}
    for r in results:
        if r.get("status") != "ok":
            continue
        pieces = [r.get(k) for k in ("pool_ms", "coarse_ms", "select_ms")]
        if all(_num(p) for p in pieces) and _num(r.get("b2b_ms")):
            r["coarse_select_ms"] = sum(pieces)
            r["coarse_select_share"] = r["coarse_select_ms"] / r["b2b_ms"]
        base = dense.get(cell_key(r))
        if base is None or r.get("arm") == DENSE:
            continue
        for view in ("b2b", "once"):
            mine, theirs = r.get(f"{view}_ms"), base.get(f"{view}_ms")
            if _num(mine) and _num(theirs) and mine > 0:
                r[f"dense_{view}_ms"] = theirs
                r[f"speedup_{view}"] = theirs / mine
                r[f"fraction_of_ideal_{view}"] = r[f"speedup_{view}"] / r["ideal_speedup"]
        r["dense_peak_mib"] = base.get("peak_mib")
        if _num(r.get("peak_mib")) and _num(r["dense_peak_mib"]) and r["dense_peak_mib"] > 0:
            r["peak_mem_ratio"] = r["peak_mib"] / r["dense_peak_mib"]


def derive(rec: dict[str, Any]) -> None:
    """A sequence-parallel run's cell: speedup, fraction of ideal, coarse+select share,
    memory ratio of its single-GPU op (in place)."""
    op, dense = rec.get("op_ms"), rec.get("dense_ms")
    if rec.get("status") == "ok" and isinstance(op, (int, float)):
        pieces = [rec.get(k) for k in ("pool_ms", "coarse_ms", "select_ms")]
        if all(isinstance(p, (int, float)) for p in pieces):
            rec["coarse_select_ms"] = sum(pieces)
            rec["coarse_select_share"] = rec["coarse_select_ms"] / op
        if isinstance(dense, (int, float)):
            rec["speedup"] = dense / op
            rec["fraction_of_ideal"] = rec["speedup"] / rec["ideal_speedup"]
    op_mem, dense_mem = rec.get("op_peak_mib"), rec.get("dense_peak_mib")
    if isinstance(op_mem, (int, float)) and isinstance(dense_mem, (int, float)) and dense_mem > 0:
        rec["peak_mem_ratio"] = op_mem / dense_mem


# ---- the op, its reference and its pieces ---------------------------------------------------
@dataclass
class OpInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor | None
    dout: torch.Tensor
    scale: float


def make_op_inputs(cfg: Config, tiling: VideoTiling, heads: int, device: torch.device) -> OpInputs:
    """Random tile-order inputs, padding slots included (no arm may read them, except as zeros:
    FastVideo's get them zeroed), and an output gradient that is zero at the padding slots, as
    in a model that drops the padding after the op (so no arm's key gradients depend on what
    the padding rows' outputs are)."""
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + tiling.padded_len * 31 + heads)
    shape = (cfg.batch, tiling.padded_len, heads, cfg.head_dim)

    def rand() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=cfg.dtype)

    q, k, v, dout = rand(), rand(), rand(), rand()
    gate = rand() if cfg.coarse_gate else None
    valid = tiling.valid_sizes(device)
    real = torch.arange(tiling.tile_tokens, device=device) < valid.view(-1, 1)
    dout = torch.where(real.view(1, -1, 1, 1), dout, dout.new_zeros(()))
    return OpInputs(q, k, v, gate, dout, cfg.head_dim**-0.5)


def op_leaves(inputs: OpInputs, mode: str) -> list[torch.Tensor]:
    """q, k, v (and the gate) as the leaves of ``mode`` (copies that require grad, except in
    fwd); runners may share them, since each call takes its gradients with autograd.grad."""
    tensors = [inputs.q, inputs.k, inputs.v] + ([inputs.gate] if inputs.gate is not None else [])
    return bt.make_leaves(tensors, mode, lambda t: t)


def attn_runner(
    inputs: OpInputs,
    mode: str,
    attn: Callable[..., Any],
    leaves: list[torch.Tensor] | None = None,
) -> bt.Runner:
    """``attn(q, k, v, coarse_gate=gate, scale=scale)`` on ``inputs`` as a runner of ``mode``
    (the gradients: dq, dk, dv and, with a gate, dgate), on ``leaves`` (`op_leaves`, made here
    when None)."""
    leaves = op_leaves(inputs, mode) if leaves is None else leaves
    scale = inputs.scale

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *gate: torch.Tensor) -> Any:
        return attn(q, k, v, coarse_gate=gate[0] if gate else None, scale=scale)

    names = ("dq", "dk", "dv", "dgate")[: len(leaves)]
    return bt.autograd_runner(forward, leaves, inputs.dout, mode, names=names)


def _variant_note(cfg: dict[str, Any]) -> str:
    """The report's mention of ``--fa4-variant`` (nothing without it)."""
    variant = cfg.get("fa4_variant")
    return f" (fa4 forward variant: {'+'.join(variant)})" if variant else ""


def _checked_fa4_variant(options: tuple[str, ...]) -> tuple[str, ...]:
    """``--fa4-variant``'s options, checked now (SystemExit naming the known ones) rather than
    in the first cell."""
    if options:
        from vsa_fa4 import launch

        try:
            launch.ForwardVariant.from_names(options)
        except ValueError as exc:
            raise SystemExit(f"--fa4-variant: {exc}") from None
    return options


def op_runner(
    inputs: OpInputs,
    tiling: VideoTiling,
    topk: int,
    backend: str,
    mode: str,
    leaves: list[torch.Tensor] | None = None,
    deterministic: bool = False,
) -> bt.Runner:
    attn = partial(video_sparse_attn, tiling=tiling, topk=topk, backend=backend, validate=False,
                   deterministic=deterministic,
                   coarse_backend=coarse_backend_for(backend))  # fmt: skip
    return attn_runner(inputs, mode, attn, leaves)


def op_selection(inputs: OpInputs, tiling: VideoTiling, topk: int) -> BlockSparseLayout:
    """The op's own selection: the top-k of its coarse scores, from the coarse stage the op
    runs (``coarse_backend="auto"``: the Triton kernels on CUDA). The torch path agrees
    except between key tiles whose scores tie to float32 rounding (a few rows in 10^4 at Wan
    720p), and one such row moves the output by more than bf16 rounding: the gate must see
    the op's own choice."""
    valid = tiling.valid_sizes(inputs.q.device)
    with torch.no_grad():
        stage = coarse_stage("auto", inputs.q)
        q_pooled, k_pooled, _ = stage.pool(inputs.q, inputs.k, inputs.v, valid)
        indices = stage.select(q_pooled, k_pooled, valid, topk)
    return layout_from_selection(
        indices, valid, tiling.tile_tokens, all_full=not tiling.has_padding
    )


def op_reference(
    inputs: OpInputs,
    tiling: VideoTiling,
    topk: int,
    need_grads: bool,
    layout: BlockSparseLayout | None = None,
) -> dict[str, torch.Tensor]:
    """Float32 composition of the op on ``layout`` (default: the op's own selection, from the
    same bf16 pooled tiles, hence the same top-k): reference fine attention + coarse attention
    over the real tokens, combined with the gate."""
    device = inputs.q.device
    valid = tiling.valid_sizes(device)
    tile_tokens = tiling.tile_tokens
    if layout is None:
        layout = op_selection(inputs, tiling, topk)
    q32, k32, v32 = (
        t.detach().float().requires_grad_(need_grads) for t in (inputs.q, inputs.k, inputs.v)
    )
    gate32 = None if inputs.gate is None else inputs.gate.detach().float()
    with bref.ieee_fp32_matmul(), torch.set_grad_enabled(need_grads):
        fine, _ = reference_block_sparse_attn(q32, k32, v32, layout, inputs.scale)
        pooled = [pool_tiles(t, valid) for t in (q32, k32, v32)]
        coarse = coarse_attention(*pooled, valid, inputs.scale)
        batch, seq, heads, dim = fine.shape
        per_tile = (batch, seq // tile_tokens, tile_tokens, heads, dim)
        add = coarse.unsqueeze(2)
        if gate32 is not None:
            add = gate32.view(per_tile) * add
        out = (fine.view(per_tile) + add).view(batch, seq, heads, dim)
        result = {"out": out.detach()}
        if need_grads:
            grads = torch.autograd.grad(out, (q32, k32, v32), inputs.dout.float())
            result.update(dq=grads[0], dk=grads[1], dv=grads[2])
    return result


def piece_runners(
    inputs: OpInputs, tiling: VideoTiling, topk: int, backends: Sequence[str], mode: str
) -> dict[str, bt.Runner]:
    """The op's stages as separate runners: pool (q, k, v), coarse, select, and the fine
    attention of each backend (``fine:NAME``)."""
    device = inputs.q.device
    valid = tiling.valid_sizes(device)
    tile_tokens, scale = tiling.tile_tokens, inputs.scale
    with torch.no_grad():
        pooled = [pool_tiles(t, valid) for t in (inputs.q, inputs.k, inputs.v)]
        layout = select_topk(pooled[0], pooled[1], valid, topk, tile_tokens)

    def select(_: Any) -> dict[str, torch.Tensor]:
        return {"indices": select_topk(pooled[0], pooled[1], valid, topk, tile_tokens).kv_indices}

    def coarse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return coarse_attention(q, k, v, valid, scale)

    runners = {"select": bt.Runner(select)}
    qkv = (inputs.q, inputs.k, inputs.v)
    fine_leaves = bt.make_leaves(qkv, mode, lambda t: t)
    for backend in dict.fromkeys(backends):

        def fine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: str = backend) -> Any:
            return block_sparse_attn(q, k, v, layout, backend=b, scale=scale)[0]

        runners[f"fine:{backend}"] = bt.autograd_runner(fine, fine_leaves, inputs.dout, mode)
    d_pooled = torch.randn_like(pooled[0])
    runners["coarse"] = bt.autograd_runner(
        coarse, bt.make_leaves(pooled, mode, lambda t: t), d_pooled, mode
    )
    leaves = bt.make_leaves(qkv, mode, lambda t: t)
    if mode == "fwd":

        def pool(_: Any) -> dict[str, torch.Tensor]:
            with torch.no_grad():
                return {f"p{i}": pool_tiles(t, valid) for i, t in enumerate(leaves)}

    else:

        def pool(_: Any) -> dict[str, torch.Tensor]:
            with torch.enable_grad():
                outs = [pool_tiles(t, valid) for t in leaves]
            grads = torch.autograd.grad(outs, leaves, [d_pooled] * 3)
            return {f"g{i}": g for i, g in enumerate(grads)}

    runners["pool"] = bt.Runner(pool)
    return runners


def resolve_fine_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    tiling: VideoTiling,
    mode: str,
    query_rows: int = 0,
    deterministic: bool = False,
) -> tuple[str | None, str | None]:
    """(backend that will run the fine attention, None) or (None, why it cannot). The call is
    described as the op describes it: key blocks all full when the latent needs no padding,
    ``query_rows`` = batch x heads x padded tokens and the padded tokens as the query length
    (auto's rule depends on the size),
    ``deterministic`` as asked."""
    tile = tiling.tile_tokens
    call = AttentionCall(device, dtype, head_dim, (tile, tile), mode != "fwd",
                         kv_blocks_full=not tiling.has_padding,
                         query_rows=query_rows, query_len=tiling.padded_len,
                         deterministic=deterministic)  # fmt: skip
    try:
        if name == "auto":
            return select_backend(call, "auto").name, None
        reason = backend_refusal(get_backend(name), call)
    except ValueError as exc:
        return None, str(exc)
    return (name, None) if reason is None else (None, f"{name} backend refuses: {reason}")


# ---- dense baseline -------------------------------------------------------------------------
def dense_arms(choice: str, device: torch.device) -> list[bench_vsa.Arm]:
    fa4, sdpa = bench_vsa.Fa4DenseArm(), bench_vsa.SdpaArm(allow_cpu=True)
    return {"fa4": [fa4], "sdpa": [sdpa]}.get(choice, [fa4, sdpa])


def prepare_dense(
    cfg: Config, shape: Shape, tokens: int, mode: str, device: torch.device
) -> tuple[bt.Runner | None, dict[str, Any]]:
    """Dense attention on the real tokens: the first arm that is available and passes its
    gate. Returns (its runner, fields naming the arm, its gate and the arms passed over), or
    (None, fields saying why none could run)."""
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + tokens * 17 + shape.heads + 1)
    dims = (cfg.batch, tokens, shape.heads, cfg.head_dim)
    q, k, v, dout = (
        torch.randn(dims, generator=gen).to(device=device, dtype=cfg.dtype) for _ in range(4)
    )
    inputs = bench_vsa.Inputs(q, k, v, dout, cfg.head_dim**-0.5)
    cell = bench_vsa.Cell(tokens, mode, None, None, None, cfg.batch * shape.heads * tokens**2)
    rows = torch.randperm(tokens, generator=gen)[:DENSE_SAMPLE_ROWS].sort().values.to(device)
    tried: list[str] = []
    for arm in dense_arms(cfg.dense, device):
        why = arm.unavailable(device)
        if why:
            tried.append(f"{arm.name}: {why}")
            continue
        runner = None
        try:
            runner = arm.prepare(inputs, cell)
            outputs = runner.once()
            bt.synchronize(device)
            ref = bref.masked_attention_reference(q.index_select(1, rows), k, v, inputs.scale)
            gate = bref.gate_check({"out": outputs["out"].index_select(1, rows)}, ref, cfg.dtype)
            for name in ("dq", "dk", "dv"):
                if name in outputs:
                    finite = bool(torch.isfinite(outputs[name]).all())
                    gate.tensors[name] = {"finite": finite, "checked": "finite only"}
                    if not finite:
                        gate.passed = False
                        gate.reason = f"{gate.reason}; {name}: non-finite".lstrip("; ")
            del outputs
            if not gate.passed:
                tried.append(f"{arm.name}: failed its gate ({gate.reason})")
                continue
            fields = {
                "dense_status": "ok",
                "dense_arm": arm.name,
                "dense_info": runner.info,
                "dense_gate": gate.as_dict(),
                "dense_tried": tried,
            }
            return runner, fields
        except Exception as exc:
            tried.append(f"{arm.name}: {brep.error_text(exc, 500)}")
            runner = None
            brun.recover_after_error(device)
    return None, {"dense_status": "unavailable", "dense_tried": tried}


def run_dense(
    cfg: Config, shape: Shape, tokens: int, mode: str, device: torch.device
) -> dict[str, Any]:
    """`prepare_dense`, then its arm timed on its own (the sequence-parallel run's baseline):
    a record with dense_ms, dense_peak_mib, the arm and its gate."""
    runner, fields = prepare_dense(cfg, shape, tokens, mode, device)
    if runner is None:
        return fields
    try:
        timing = bt.time_runner(runner, device, cfg)
        fields.update(dense_ms=timing.median_ms, dense_timing=timing.as_dict(),
                      dense_peak_mib=bt.peak_extra_mib(runner.once, device))  # fmt: skip
    except Exception as exc:
        fields["dense_tried"].append(f"{fields.pop('dense_arm')}: {brep.error_text(exc, 500)}")
        fields["dense_status"] = "unavailable"
        brun.recover_after_error(device)
    return fields


# ---- the run --------------------------------------------------------------------------------
def base_record(cfg: Config, shape: Shape, tiling: VideoTiling, sparsity: float, mode: str):
    topk = topk_for(sparsity, tiling.num_tiles)
    kept = topk / tiling.num_tiles
    return {
        "shape": shape.name,
        "latent": list(shape.latent),
        "tile": list(tiling.tile_shape),
        "heads": shape.heads,
        "head_dim": cfg.head_dim,
        "batch": cfg.batch,
        "dtype": brun.DTYPE_NAMES[cfg.dtype],
        "sparsity": sparsity,
        "mode": mode,
        "num_tiles": tiling.num_tiles,
        "topk": topk,
        "kept_fraction": kept,
        "tokens_real": tiling.seq_len,
        "tokens_padded": tiling.padded_len,
        "ideal_speedup": ideal_speedup(tiling.seq_len, tiling.padded_len, kept),
        "coarse_gate": cfg.coarse_gate,
        "status": None,
    }


def arm_kind(name: str) -> str:
    return DENSE if name == DENSE else ("fastvideo" if name in fva.ARMS else "vsa")


class ArmFailed(Exception):
    """An arm's call raised while the arms were timed together."""

    def __init__(self, arm: str, exc: BaseException) -> None:
        super().__init__(f"{arm}: {brep.error_text(exc)}")
        self.arm, self.cause = arm, exc


def _tagged(name: str, runner: bt.Runner) -> bt.Runner:
    """``runner`` whose calls raise `ArmFailed` naming ``name``."""

    def run(state: Any) -> Any:
        try:
            return runner.run(state)
        except Exception as exc:
            raise ArmFailed(name, exc) from exc

    return bt.Runner(run, runner.setup, runner.info)


@dataclass
class CellContext:
    """What every arm of one cell shares."""

    cfg: Config
    inputs: OpInputs
    tiling: VideoTiling
    topk: int
    mode: str
    device: torch.device
    log: Callable[[str], None]

    @property
    def wanted(self) -> tuple[str, ...]:
        return ("out",) if self.mode == "fwd" else ("out", "dq", "dk", "dv")

    def gate(
        self, runner: bt.Runner, ref: dict[str, torch.Tensor]
    ) -> tuple[bref.GateResult, dict[str, torch.Tensor]]:
        """One call of ``runner`` against ``ref`` on the real tokens; returns (the gate, the
        outputs checked)."""
        outputs = runner.once()
        bt.synchronize(self.device)
        got = {n: outputs[n] for n in self.wanted}
        rows = self.tiling.indices(self.device).nonpad_index
        return bref.gate_check(got, ref, self.cfg.dtype, rows=rows), got


def gate_our_arm(
    ctx: CellContext, rec: dict[str, Any], name: str, shared: dict[str, Any]
) -> bt.Runner | None:
    """Our op with backend ``name``: resolved, gated against the float32 composition on its
    selection (computed once per cell in ``shared``); its runner, or None (``rec`` says why)."""
    cfg = ctx.cfg
    rows = ctx.inputs.q.shape[0] * ctx.inputs.q.shape[1] * ctx.inputs.q.shape[2]
    fine, why = resolve_fine_backend(name, ctx.device, cfg.dtype, cfg.head_dim, ctx.tiling,
                                     ctx.mode, rows, cfg.deterministic)  # fmt: skip
    rec["fine_backend"] = fine
    if fine is None:
        rec.update(status="skipped", reason=why)
        return None
    ctx.log(f"{name}: gate")
    if "reference" not in shared:
        shared["reference"] = op_reference(ctx.inputs, ctx.tiling, ctx.topk, ctx.mode != "fwd",
                                           shared["layout"])  # fmt: skip
    if "leaves" not in shared:
        shared["leaves"] = op_leaves(ctx.inputs, ctx.mode)
    runner = op_runner(ctx.inputs, ctx.tiling, ctx.topk, fine, ctx.mode, shared["leaves"],
                       cfg.deterministic)  # fmt: skip
    gate, _ = ctx.gate(runner, shared["reference"])
    rec["gate"] = gate.as_dict()
    if not gate.passed:
        rec.update(status="failed", reason=f"correctness gate: {gate.reason}")
        return None
    return runner


def compare_selection(theirs: torch.Tensor, ours: BlockSparseLayout) -> dict[str, Any]:
    """How a [B, H, N, N] bool selection differs from our op's."""
    mine = ours.to_block_mask()
    counts = theirs.sum(-1)
    return {
        "rows": int(counts.numel()),
        "rows_identical_to_ours": float((mine == theirs).all(-1).float().mean()),
        "tiles_differing_per_row": float((mine != theirs).sum(-1).float().mean() / 2),
        "count_min": int(counts.min()),
        "count_max": int(counts.max()),
    }


def gate_fastvideo_arm(
    ctx: CellContext,
    rec: dict[str, Any],
    name: str,
    pkg: fva.Package | None,
    shared: dict[str, Any],
) -> bt.Runner | None:
    """FastVideo's arm ``name`` on our inputs (converted once), gated against the float32
    composition on its own selection (`fastvideo_arm.selection`); where the max-abs gate fails
    but the relative L2 errors of `bench_reference.match_check` (bf16: 1e-2 out, 2e-2 gradients)
    pass, it is timed with ``gate_level`` saying so. Its runner, or None (``rec`` says why)."""
    why = fva.NOT_INSTALLED if pkg is None else pkg.why_not(name)
    if pkg is not None:
        rec["fastvideo"] = {**pkg.info, "unavailable": pkg.unavailable,
                            "tk_unavailable": pkg.tk_unavailable}  # fmt: skip
    tile = ctx.tiling.tile_tokens
    if why is None and tile != fva.BLOCK:
        why = f"FastVideo's Triton / ThunderKittens path takes {fva.BLOCK}-token tiles, not {tile}"
    if why is None and ctx.inputs.scale != ctx.cfg.head_dim**-0.5:
        why = "FastVideo's op has no scale argument (it uses 1/sqrt(D))"
    if why is not None:
        rec.update(status="skipped", reason=why)
        return None
    assert pkg is not None
    ctx.log(f"{name}: gate (its own selection)")
    inputs, device = ctx.inputs, ctx.device
    valid = ctx.tiling.valid_sizes(device)
    prepared = fva.prepare(pkg, name, inputs.q, inputs.k, inputs.v, inputs.gate, inputs.dout,
                           valid, ctx.tiling.tile_shape, ctx.topk, ctx.mode)  # fmt: skip
    rec["info"] = prepared.runner.info
    mask = fva.selection(pkg, prepared, ctx.topk)
    rec["selection"] = compare_selection(mask, shared["layout"])
    width = max(1, rec["selection"]["count_max"])
    layout = BlockSparseLayout.from_block_mask(mask, valid, (tile, tile), width=width)
    del mask
    ref = op_reference(inputs, ctx.tiling, ctx.topk, ctx.mode != "fwd", layout)
    gate, got = ctx.gate(prepared.runner, ref)
    rec["gate"] = gate.as_dict()
    rec["gate_level"] = "max_abs"
    if not gate.passed:
        rows = ctx.tiling.indices(device).nonpad_index
        loose = bref.match_check(got, ref, ctx.cfg.dtype, rows=rows)
        rec["gate_rel_l2"] = loose.as_dict()
        if not loose.passed:
            rec.update(status="failed", reason=f"correctness gate: {gate.reason}")
            return None
        rec["gate_level"] = f"rel_l2 only (max-abs gate failed: {gate.reason})"
    return prepared.runner


def time_arms(
    ctx: CellContext, recs: dict[str, dict[str, Any]], runners: dict[str, bt.Runner]
) -> None:
    """The gated arms timed together in alternation (`bench_timing.time_views`), then each
    one's peak memory, into ``recs``. An arm whose call raises is reported as an error and the
    others are timed again without it."""
    timed = {name: _tagged(name, r) for name, r in runners.items()}
    while timed:
        ctx.log(f"time {', '.join(timed)} in alternation")
        try:
            views = bt.time_views(timed, ctx.device, ctx.cfg, max_calls=ctx.cfg.b2b_calls,
                                  turn_ms=ctx.cfg.b2b_turn_ms)  # fmt: skip
            break
        except ArmFailed as exc:
            recs[exc.arm].update(status="error", **brep.error_fields(exc.cause))
            del timed[exc.arm]
            brun.recover_after_error(ctx.device)
    else:
        return
    for name, view in views.items():
        recs[name].update(
            status="ok",
            b2b_ms=view.back_to_back.median_ms,
            once_ms=view.once.median_ms,
            host_ms=view.host.median_ms,
            b2b_calls=view.calls_per_turn,
            timing=view.as_dict(),
        )
        try:
            recs[name]["peak_mib"] = bt.peak_extra_mib(runners[name].once, ctx.device)
        except Exception as exc:
            recs[name]["peak_mib_error"] = brep.error_text(exc, 500)
            brun.recover_after_error(ctx.device)


def time_pieces(ctx: CellContext, recs: dict[str, dict[str, Any]], shared: dict[str, Any]) -> None:
    """Our op's pieces timed apart (back to back), once per cell and fine backend, into the
    records of our arms that were timed."""
    ours = [n for n, r in recs.items() if r["arm_kind"] == "vsa" and r["status"] == "ok"]
    if not ours or not ctx.cfg.pieces:
        return
    ctx.log("time pieces")
    fines = [recs[n]["fine_backend"] for n in ours]
    try:
        pieces = piece_runners(ctx.inputs, ctx.tiling, ctx.topk, fines, ctx.mode)
        times = {n: bt.time_runner(p, ctx.device, ctx.cfg).median_ms for n, p in pieces.items()}
    except Exception as exc:
        for n in ours:
            recs[n]["pieces_error"] = brep.error_text(exc, 500)
        brun.recover_after_error(ctx.device)
        return
    for n in ours:
        fine = times[f"fine:{recs[n]['fine_backend']}"]
        recs[n].update(pool_ms=times["pool"], coarse_ms=times["coarse"],
                       select_ms=times["select"], fine_ms=fine)  # fmt: skip


def run_cell(
    ctx: CellContext,
    base: dict[str, Any],
    dense: tuple[bt.Runner | None, dict[str, Any]],
    fastvideo: fva.Package | None,
) -> list[dict[str, Any]]:
    """Every arm of one cell, dense first, then ``--arms`` in their order: each gated (our
    arms, then FastVideo's), the gated ones timed together (`time_arms`), our op's pieces
    apart; one record per arm. Never raises."""
    recs = {rec["arm"]: rec for rec in arm_records(base, ctx.cfg.arms)}
    runners: dict[str, bt.Runner] = {}
    dense_runner, dense_fields = dense
    recs[DENSE].update(dense_fields)
    if dense_runner is None:
        tried = "; ".join(dense_fields.get("dense_tried") or [])
        recs[DENSE].update(status="skipped", reason=f"no dense arm could run: {tried}")
    else:
        runners[DENSE] = dense_runner
    shared: dict[str, Any] = {}
    order = [n for n in ctx.cfg.arms if n not in fva.ARMS]
    order += [n for n in ctx.cfg.arms if n in fva.ARMS]  # our float32 reference freed by then
    try:
        shared["layout"] = op_selection(ctx.inputs, ctx.tiling, ctx.topk)
        for name in order:
            if name in fva.ARMS:
                shared.pop("reference", None)
            try:
                if name in fva.ARMS:
                    runner = gate_fastvideo_arm(ctx, recs[name], name, fastvideo, shared)
                else:
                    runner = gate_our_arm(ctx, recs[name], name, shared)
            except Exception as exc:
                recs[name].update(status="error", **brep.error_fields(exc))
                brun.recover_after_error(ctx.device)
                continue
            if runner is not None:
                runners[name] = runner
        shared.pop("reference", None)
        time_arms(ctx, recs, runners)
        time_pieces(ctx, recs, shared)
    except Exception as exc:  # outside any one arm (the selection): every arm not yet done
        for rec in recs.values():
            if rec["status"] is None:
                rec.update(status="error", **brep.error_fields(exc))
        brun.recover_after_error(ctx.device)
    for rec in recs.values():
        if rec["status"] is None:  # gated but never timed (another arm's failure)
            rec.update(status="error", reason="not timed")
    return list(recs.values())


def cell_label(number: int, total: int, shape: Shape, sparsity: float, mode: str) -> str:
    return f"[{number}/{total}] {shape.name} x{shape.heads} heads {sparsity * 100:g}% {mode}"


# ---- the grid: one cell loop for the single-GPU and the sequence-parallel runs ---------------
class GridRun:
    """What a run does in its cells; `run_grid` walks them the same way for every run.

    The loop (shapes x modes x sparsities, in that order) makes the op's inputs once per shape
    (``inputs(shape, tiling)``) and the dense baseline once per (shape, mode) (``dense(shape,
    tiling, mode, log)``), each at the first cell that runs; a cell is ``not_run`` once
    ``budget_spent(started)``, ``skipped`` when ``unsupported(shape, tiling)`` says why, else
    ``run_cell(base, tiling, dense, inputs, log)`` measures its records inside
    ``--fa4-variant``'s context. Then ``derive(recs)``, a progress line per record
    (``summary(rec)``, where this process ``logs``) and a checkpoint. The subclasses say what
    differs: `SingleDevice` (one record per arm, the arms gated and timed together) and
    `SequenceParallel` (one record per cell on every rank, the ranks agreeing on every
    decision that changes what runs next); ``records(base)`` are a cell's records not yet run.
    """

    label_suffix = ""  # after each cell's progress label
    logs = True  # whether this process prints progress

    def __init__(self, cfg: Config, device: torch.device, replica: brun.Replica | None) -> None:
        self.cfg, self.device, self.replica = cfg, device, replica

    def log(self, msg: str) -> None:
        if self.logs:
            brun.log(msg, replica=self.replica)

    def start(self) -> None:
        """Before the first cell."""

    def end(self) -> None:
        """After the last cell."""

    def unsupported(self, shape: Shape, tiling: VideoTiling) -> str | None:
        return None

    def budget_spent(self, started: float) -> bool:
        return brun.budget_spent(self.cfg.time_budget_min, started)


def run_grid(
    grid: GridRun, *, on_result: Callable[[list[dict[str, Any]]], None] | None = None
) -> list[dict[str, Any]]:
    """Every cell of ``grid``'s config, in order (see `GridRun`); ``on_result(results)`` after
    each cell. Returns the records."""
    cfg, device = grid.cfg, grid.device
    torch.manual_seed(cfg.seed)
    total = len(cfg.shapes) * len(cfg.modes) * len(cfg.sparsities)
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    grid.start()
    cells = 0
    for shape in cfg.shapes:
        tiling = VideoTiling(shape.latent, cfg.tile)
        unsupported = grid.unsupported(shape, tiling)
        inputs: Any = None
        for mode in cfg.modes:
            dense: Any = None
            for sparsity in cfg.sparsities:
                cells += 1
                base = base_record(cfg, shape, tiling, sparsity, mode)
                label = cell_label(cells, total, shape, sparsity, mode) + grid.label_suffix

                def log(step: str, label: str = label) -> None:
                    grid.log(f"{label}: {step}")

                if grid.budget_spent(started):
                    recs = grid.records(base)
                    for rec in recs:
                        brun.mark_not_run(rec, cfg.time_budget_min)
                elif unsupported is not None:
                    recs = grid.records(base)
                    for rec in recs:
                        rec.update(status="skipped", reason=unsupported)
                else:
                    if dense is None:
                        dense = grid.dense(shape, tiling, mode, log)
                    if inputs is None:
                        inputs = grid.inputs(shape, tiling)
                    with cfg.fa4_variant_context():
                        recs = grid.run_cell(base, tiling, dense, inputs, log)
                grid.derive(recs)
                results.extend(recs)
                if grid.logs:  # (only rank 0's sequence-parallel records hold its numbers)
                    for rec in recs:
                        log(grid.summary(rec))
                if on_result is not None:
                    on_result(results)
            del dense
            brun.recover_after_error(device)
        del inputs
        brun.recover_after_error(device)
    grid.end()
    return results


def arm_records(base: dict[str, Any], arms: Sequence[str]) -> list[dict[str, Any]]:
    """A single-GPU cell's records: dense's, then one per arm of ``--arms``."""
    return [{**base, "arm": n, "arm_kind": arm_kind(n), "status": None} for n in [DENSE, *arms]]


class SingleDevice(GridRun):
    """The single-GPU run (under torchrun, every replica on its own): one record per arm, dense
    first; every arm of a cell gated, then the gated ones timed together (`run_cell`)."""

    def __init__(self, cfg: Config, device: torch.device, replica: brun.Replica | None) -> None:
        super().__init__(cfg, device, replica)
        self.fastvideo: fva.Package | None = None

    def start(self) -> None:
        if any(name in fva.ARMS for name in self.cfg.arms):
            self.fastvideo = fva.probe(self.device)
            found = self.fastvideo.unavailable or (
                f"{self.fastvideo.info.get('version')}, ThunderKittens: "
                f"{self.fastvideo.tk_unavailable or 'loads'}"
            )
            self.log(f"fastvideo-kernel: {found}")

    def records(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        return arm_records(base, self.cfg.arms)

    def dense(
        self, shape: Shape, tiling: VideoTiling, mode: str, log: Callable[[str], None]
    ) -> Any:
        log(f"dense baseline on {tiling.seq_len} real tokens: gate")
        return prepare_dense(self.cfg, shape, tiling.seq_len, mode, self.device)

    def inputs(self, shape: Shape, tiling: VideoTiling) -> OpInputs:
        return make_op_inputs(self.cfg, tiling, shape.heads, self.device)

    def run_cell(self, base: dict[str, Any], tiling: VideoTiling, dense: Any, inputs: Any,
                 log: Callable[[str], None]) -> list[dict[str, Any]]:  # fmt: skip
        ctx = CellContext(self.cfg, inputs, tiling, base["topk"], base["mode"], self.device, log)
        return run_cell(ctx, base, dense, self.fastvideo)

    def derive(self, recs: list[dict[str, Any]]) -> None:
        derive_arms(recs)

    def summary(self, rec: dict[str, Any]) -> str:
        return arm_summary(rec)


# ---- sequence parallel ----------------------------------------------------------------------
# Every rank runs the same cells in the same order and makes the same collective calls: the
# decisions that could differ between ranks (time budget, gates, errors) are agreed on with
# bt.any_rank before they change what runs next. Rank 0 alone runs the single-GPU op and the
# dense baseline (the other ranks wait in the next collective) and keeps the results.


def sp_unsupported(shape: Shape, tiling: VideoTiling, world: int) -> str | None:
    """Why the Ulysses split cannot run this latent on ``world`` ranks, or None."""
    if shape.heads % world:
        return f"heads {shape.heads} not divisible by the world size {world}"
    if tiling.num_tiles % world:
        return f"{tiling.num_tiles} tiles not divisible by the world size {world}"
    return None


def shard_inputs(inputs: OpInputs, tiling: VideoTiling) -> OpInputs:
    """This rank's slice of the sequence of every input (copies: the full ones can go)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, tiling=tiling).clone()

    gate = None if inputs.gate is None else local(inputs.gate)
    q, k, v, dout = (local(t) for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
    return OpInputs(q, k, v, gate, dout, inputs.scale)


def sp_op_runner(
    local: OpInputs,
    tiling: VideoTiling,
    topk: int,
    backend: str,
    mode: str,
    head_chunk: int | None = None,
    recompute: bool = False,
    deterministic: bool = False,
) -> bt.Runner:
    """`sequence_parallel_video_sparse_attn` on this rank's shards (outputs: its shards)."""
    attn = partial(
        sequence_parallel_video_sparse_attn,
        topk=topk,
        tiling=tiling,
        backend=backend,
        head_chunk=head_chunk,
        recompute=recompute,
        deterministic=deterministic,
    )
    return attn_runner(local, mode, attn)


def run_single_gpu_op(
    cfg: Config,
    rec: dict[str, Any],
    inputs: OpInputs,
    tiling: VideoTiling,
    fine: str,
    device: torch.device,
    log: Callable[[str], None],
) -> dict[str, torch.Tensor] | None:
    """Rank 0: the single-GPU op, gated against the float32 composition, timed (fixed counts)
    and measured into ``rec``; returns its outputs (the sequence-parallel gate's reference),
    None when it failed (``rec`` says why). Never raises."""
    ctx = CellContext(cfg, inputs, tiling, rec["topk"], rec["mode"], device, log)
    runner = None
    try:
        log("single-GPU op: gate")
        ref = op_reference(inputs, tiling, ctx.topk, ctx.mode != "fwd")
        runner = op_runner(inputs, tiling, ctx.topk, fine, ctx.mode,
                           deterministic=cfg.deterministic)  # fmt: skip
        gate, outputs = ctx.gate(runner, ref)
        del ref
        rec["op_gate"] = gate.as_dict()
        if not gate.passed:
            rec.update(status="failed", reason=f"correctness gate (single-GPU op): {gate.reason}")
            return None
        kept = {n: t.detach() for n, t in outputs.items()}
        del outputs
        log("single-GPU op: time")
        timing = bt.time_runner(runner, device, cfg)
        rec["op_ms"] = timing.median_ms
        rec["op_timing"] = timing.as_dict()
        rec["op_peak_mib"] = bt.peak_extra_mib(runner.once, device)
        return kept
    except Exception as exc:
        rec.update(status="error", **brep.error_fields(exc))
        brun.recover_after_error(device)
        return None
    finally:
        del runner


def run_sp_cell(
    cfg: Config,
    rec: dict[str, Any],
    full: OpInputs | None,
    local: OpInputs,
    tiling: VideoTiling,
    device: torch.device,
    rank: int,
    log: Callable[[str], None],
) -> None:
    """One cell on every rank: rank 0's single-GPU op, then the sequence-parallel op's gate
    (gathered output and gradients vs rank 0's), timing and peak memory, into ``rec``."""
    mode, topk = rec["mode"], rec["topk"]
    fine, why = resolve_fine_backend(cfg.backend, device, cfg.dtype, cfg.head_dim, tiling, mode,
                                     deterministic=cfg.deterministic)  # fmt: skip
    rec["fine_backend"] = fine
    if fine is None:  # the same answer on every rank: same device type, dtype, shape
        rec.update(status="skipped", reason=why)
        return
    wanted = ("out", "dq", "dk", "dv") if mode != "fwd" else ("out",)
    single = None
    if rank == 0:
        assert full is not None
        single = run_single_gpu_op(cfg, rec, full, tiling, fine, device, log)
    if bt.any_rank(rank == 0 and single is None, device):
        if rank != 0:
            rec.update(status="failed", reason="the single-GPU op failed on rank 0")
        return

    runner, failed = None, False
    try:
        log("sequence-parallel op: gate")
        runner = sp_op_runner(local, tiling, topk, fine, mode, cfg.sp_head_chunk,
                              cfg.sp_recompute, cfg.deterministic)  # fmt: skip
        outputs = runner.once()
        gathered = {n: gather_sequence(outputs[n]) for n in wanted}
        del outputs
        if rank == 0:
            assert single is not None
            rows = tiling.indices(device).nonpad_index
            gate = bref.match_check(gathered, single, cfg.dtype, rows=rows)
            rec["sp_gate"] = gate.as_dict()
            if not gate.passed:
                failed = True
                rec.update(
                    status="failed",
                    reason=f"correctness gate (sequence parallel vs single-GPU op): {gate.reason}",
                )
        del gathered, single
    except Exception as exc:
        failed = True
        rec.update(status="error", **brep.error_fields(exc))
        brun.recover_after_error(device)
    if bt.any_rank(failed, device):
        if not failed:
            rec.update(status="failed", reason="failed on another rank")
        return

    # No recovery from here on: a rank that raised in the middle of the op's collectives would
    # leave the others waiting, so an error ends the run (torchrun stops every rank).
    try:
        log(f"sequence-parallel op: time ({cfg.warmup} warm-up + {cfg.reps} timed calls)")
        timing = bt.time_fn_distributed(
            runner.run, device, setup=runner.setup, warmup=cfg.warmup, reps=cfg.reps
        )
        rec["sp_ms"] = timing.median_ms
        rec["sp_timing"] = timing.as_dict()
        peak = bt.peak_extra_mib(runner.once, device)
        per_rank = bt.gather_per_rank(peak, device) if device.type == "cuda" else None
        rec["sp_peak_mib_per_rank"] = per_rank
        rec["sp_peak_mib"] = max(x for x in per_rank if x is not None) if per_rank else None
        rec["status"] = "ok"
    finally:
        del runner


def derive_sp(rec: dict[str, Any]) -> None:
    """Speedups of the sequence-parallel op and its scaling efficiency (in place)."""
    sp, op, dense = rec.get("sp_ms"), rec.get("op_ms"), rec.get("dense_ms")
    if rec.get("status") != "ok" or not isinstance(sp, (int, float)) or sp <= 0:
        return
    if isinstance(op, (int, float)):
        rec["sp_speedup_vs_op"] = op / sp
        rec["scaling_efficiency"] = op / (rec["world_size"] * sp)
    if isinstance(dense, (int, float)):
        rec["sp_speedup_vs_dense"] = dense / sp


class SequenceParallel(GridRun):
    """The sequence-parallel run, on every rank: one record per cell (the single-GPU op and
    dense on rank 0, then the sequence-parallel op on every rank: `run_sp_cell`). The ranks
    agree on the time budget (`bench_timing.any_rank`); only rank 0 logs, and only its records
    hold the single-GPU op's and dense's numbers. A barrier after the last cell."""

    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        replica: brun.Replica | None,
        *,
        rank: int,
        world: int,
        process_group: str,
    ) -> None:
        super().__init__(cfg, device, replica)
        self.rank, self.world, self.process_group = rank, world, process_group
        self.label_suffix = f", {world} ranks"
        self.logs = rank == 0

    def end(self) -> None:
        bt.barrier(self.device)

    def unsupported(self, shape: Shape, tiling: VideoTiling) -> str | None:
        return sp_unsupported(shape, tiling, self.world)

    def budget_spent(self, started: float) -> bool:
        # every rank must agree, since the cell's collectives follow
        return self.cfg.time_budget_min is not None and bt.any_rank(
            super().budget_spent(started), self.device
        )

    def records(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        rec = dict(base)
        rec.update(backend=self.cfg.backend, world_size=self.world,
                   process_group=self.process_group)  # fmt: skip
        return [rec]

    def dense(
        self, shape: Shape, tiling: VideoTiling, mode: str, log: Callable[[str], None]
    ) -> Any:
        if self.rank != 0:
            return {}
        log(f"dense baseline on {tiling.seq_len} real tokens (rank 0)")
        return run_dense(self.cfg, shape, tiling.seq_len, mode, self.device)

    def inputs(self, shape: Shape, tiling: VideoTiling) -> tuple[OpInputs | None, OpInputs]:
        """The same full inputs on every rank, then its shards; rank 0 keeps the full ones."""
        full = make_op_inputs(self.cfg, tiling, shape.heads, self.device)
        local = shard_inputs(full, tiling)
        return (full if self.rank == 0 else None), local

    def run_cell(self, base: dict[str, Any], tiling: VideoTiling, dense: Any, inputs: Any,
                 log: Callable[[str], None]) -> list[dict[str, Any]]:  # fmt: skip
        (rec,) = self.records(base)
        rec.update(dense)  # rank 0's dense baseline (nothing on the other ranks)
        full, local = inputs
        run_sp_cell(self.cfg, rec, full, local, tiling, self.device, self.rank, log)
        return [rec]

    def derive(self, recs: list[dict[str, Any]]) -> None:
        for rec in recs:
            derive(rec)
            derive_sp(rec)

    def summary(self, rec: dict[str, Any]) -> str:
        return summary_line(rec)


def arm_summary(rec: dict[str, Any]) -> str:
    """One arm's progress line."""
    name = rec["arm"]
    if rec.get("fine_backend") and rec["fine_backend"] != name:
        name += f" ({rec['fine_backend']})"
    if rec["status"] != "ok":
        return f"{name}: {rec['status']}: {brep.first_line(rec.get('reason'), 200)}"
    text = (
        f"{name}: back to back {rec['b2b_ms']:.3f} ms, once {rec['once_ms']:.3f} ms, "
        f"host {rec['host_ms']:.3f} ms"
    )
    if "speedup_once" in rec:
        text += f"; over dense {rec['speedup_b2b']:.2f}x / {rec['speedup_once']:.2f}x"
    return text


def summary_line(rec: dict[str, Any]) -> str:
    if rec["status"] != "ok":
        return f"{rec['status']}: {brep.first_line(rec.get('reason'), 200)}"
    text = f"op {rec['op_ms']:.3f} ms"
    if "speedup" in rec:
        text += (
            f", dense {rec['dense_ms']:.3f} ms, speedup {rec['speedup']:.2f}x of ideal "
            f"{rec['ideal_speedup']:.2f}x"
        )
    if "sp_ms" in rec:
        text += f"; sequence parallel on {rec['world_size']} ranks {rec['sp_ms']:.3f} ms"
        if "sp_speedup_vs_op" in rec:
            text += (
                f", {rec['sp_speedup_vs_op']:.2f}x the single-GPU op "
                f"(scaling efficiency {rec['scaling_efficiency']:.0%})"
            )
        if "sp_speedup_vs_dense" in rec:
            text += f", {rec['sp_speedup_vs_dense']:.2f}x dense"
    return text


# ---- reporting ------------------------------------------------------------------------------
def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "" if not isinstance(value, (int, float)) else f"{value:{spec}}{suffix}"


def _latent(r: dict[str, Any]) -> str:
    return "x".join(str(x) for x in r["latent"])


def _sparsity(r: dict[str, Any]) -> str:
    return f"{r['sparsity'] * 100:g}% (k={r['topk']}/{r['num_tiles']})"


def _status(r: dict[str, Any], limit: int = 200) -> str:
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
    return brep.first_line(status, limit)


def _gate_word(r: dict[str, Any]) -> str:
    gate = r.get("gate") or r.get("dense_gate")
    if not gate:
        return ""
    if not gate.get("passed") and r.get("gate_level", "").startswith("rel_l2"):
        return "rel-L2 only"
    return "pass" if gate.get("passed") else "fail"


def speedup_table(results: list[dict[str, Any]], arms: list[str]) -> str:
    """One row per cell: dense's times, each arm's speedup over dense (once / back to back)
    and the ideal."""
    headers = ["latent", "heads", "sparsity", "mode", "dense ms once / b2b", *arms, "ideal"]
    cells: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in results:
        cells.setdefault(cell_key(r), {})[r["arm"]] = r
    rows = []
    for by_arm in cells.values():
        first = next(iter(by_arm.values()))
        dense = by_arm.get(DENSE, {})
        dense_text = dense.get("status") or ""
        if dense.get("status") == "ok":
            dense_text = f"{dense['once_ms']:.2f} / {dense['b2b_ms']:.2f}"
        row = [_latent(first), first["heads"], _sparsity(first), first["mode"], dense_text]
        for name in arms:
            r = by_arm.get(name)
            if r is None:
                row.append("")
            elif "speedup_once" in r:
                text = f"{r['speedup_once']:.2f}x / {r['speedup_b2b']:.2f}x"
                if r.get("fine_backend") and r["fine_backend"] != name:
                    text += f" ({r['fine_backend']})"
                row.append(text)
            else:
                row.append(r["status"] if r["status"] != "ok" else "ok, no dense")
        row.append(_fmt(first.get("ideal_speedup"), ".2f", "x"))
        rows.append(row)
    return brep.markdown_table(headers, rows)


def render_markdown(doc: dict[str, Any]) -> str:
    meta, cfg, results = doc["metadata"], doc["config"], doc["results"]
    dev = meta["device"]
    arms = list(cfg.get("arms") or [])
    lines = [
        "# bench_video: video_sparse_attn and FastVideo vs dense attention",
        "",
        f"- device: {dev.get('name')} ({dev.get('type')}), driver "
        f"{meta['driver'].get('driver_version')}",
        f"- date (UTC): {meta['date_utc']}; seed {meta['seed']}",
        f"- command: `{meta['command']}`",
        f"- tile {tuple(cfg['tile'])}, D={cfg['head_dim']}, B={cfg['batch']}, {cfg['dtype']}, "
        f"coarse gate: {cfg['coarse_gate']}; arms: dense, {', '.join(arms)}" + _variant_note(cfg),
        "- all arms of a cell timed call by call in alternation (round orders from a Williams "
        "design, `bench_timing.balanced_orders`: each arm follows each other arm equally "
        "often over a full cycle, n rounds for n arms if n is even, 2n if odd, where rows come "
        "in pairs, an order then its reverse; a cell capped at fewer rounds is balanced only "
        "as far as it got), "
        "medians over the rounds. **once** = CUDA events around one call, then a synchronize "
        "(latency; host time before the first kernel launch included); **b2b** = back to back, "
        f"N calls of an arm (enough for ~{cfg.get('b2b_turn_ms')} ms, at most "
        f"{cfg.get('b2b_calls')}) between two CUDA events, nothing synchronized, ms per call "
        "(device throughput); **host** = wall clock from the call to its return, no sync",
        "- speedup = dense time / arm time, same view, same rounds; ideal = (real/padded "
        "tokens)^2 / kept fraction; coarse+select = pool_tiles x3 + coarse_attention + "
        "select_topk timed apart, share of the b2b time; peak = max_memory_allocated beyond "
        "the inputs",
        "",
        "## Speedup over dense (once / back to back)",
        "",
        speedup_table(results, arms),
        "",
        "## Every arm",
        "",
    ]
    headers = ["latent", "heads", "sparsity", "mode", "arm", "fine", "once ms", "b2b ms", "N",
               "host ms", "vs dense once", "vs dense b2b", "of ideal (once)", "coarse+select",
               "peak MiB (vs dense)", "gate", "status"]  # fmt: skip
    rows = []
    for r in results:
        mem = _fmt(r.get("peak_mib"), ".0f")
        if mem and "peak_mem_ratio" in r:
            mem += f" ({r['peak_mem_ratio']:.2f}x)"
        fine = r.get("fine_backend") or r.get("dense_arm") or (r.get("info") or {}).get("impl")
        rows.append(
            [
                _latent(r),
                r["heads"],
                _sparsity(r),
                r["mode"],
                r["arm"],
                fine or "",
                _fmt(r.get("once_ms"), ".3f"),
                _fmt(r.get("b2b_ms"), ".3f"),
                r.get("b2b_calls", ""),
                _fmt(r.get("host_ms"), ".3f"),
                _fmt(r.get("speedup_once"), ".2f", "x"),
                _fmt(r.get("speedup_b2b"), ".2f", "x"),
                _fmt(r.get("fraction_of_ideal_once"), ".0%"),
                _fmt(r.get("coarse_select_share"), ".1%"),
                mem,
                _gate_word(r),
                _status(r),
            ]
        )
    lines.append(brep.markdown_table(headers, rows))
    notes = []
    unavailable = {"; ".join(r.get("dense_tried") or []) for r in results if r.get("dense_tried")}
    if unavailable:
        notes.append("Dense arms passed over: " + " | ".join(sorted(unavailable)))
    for r in results:
        sel = r.get("selection")
        if sel and r.get("status") in ("ok", "failed"):
            notes.append(
                f"{r['arm']} at {_latent(r)} {r['mode']}: its selection equals ours on "
                f"{sel['rows_identical_to_ours']:.1%} of (batch, head, query tile) rows "
                f"({sel['tiles_differing_per_row']:.2f} tiles differ per row on average); "
                f"gated against the float32 composition on its own selection "
                f"({r.get('gate_level', '')})"
            )
    fastvideo = next((r["fastvideo"] for r in results if r.get("fastvideo")), None)
    if fastvideo and fastvideo.get("unavailable"):
        notes.append(f"fastvideo-kernel {fastvideo.get('version')}: {fastvideo['unavailable']}")
    elif fastvideo:
        notes.append(
            f"fastvideo-kernel {fastvideo.get('version')} (requires "
            f"{fastvideo.get('torch_requirement')}); ThunderKittens: "
            f"{fastvideo.get('tk_unavailable') or 'loaded'}"
            + (f"; {fastvideo['sm90_probe']}" if fastvideo.get("sm90_probe") else "")
        )
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def render_markdown_sp(doc: dict[str, Any]) -> str:
    """The sequence-parallel run's table."""
    meta, cfg, results, sp = (
        doc["metadata"],
        doc["config"],
        doc["results"],
        doc["sequence_parallel"],
    )
    dev = meta["device"]
    lines = [
        "# bench_video: sequence-parallel video_sparse_attn vs the single-GPU op and dense",
        "",
        f"- device: {dev.get('name')} ({dev.get('type')}) x {sp['world_size']} ranks "
        f"({sp['process_group']}), driver {meta['driver'].get('driver_version')}",
        f"- date (UTC): {meta['date_utc']}; seed {meta['seed']}",
        f"- command: `{meta['command']}`",
        f"- tile {tuple(cfg['tile'])}, D={cfg['head_dim']}, B={cfg['batch']}, {cfg['dtype']}, "
        f"coarse gate: {cfg['coarse_gate']}; fine backend requested: {cfg['backend']}"
        + _variant_note(cfg)
        + f"; head_chunk {cfg.get('sp_head_chunk') or 'default'}, recompute "
        f"{bool(cfg.get('sp_recompute'))}",
        f"- {cfg['warmup']} warm-up + {cfg['reps']} timed calls on every rank, between barriers; "
        "a call's time is the slowest rank's (all_reduce MAX), median over the calls; the "
        "single-GPU op and dense run on rank 0's GPU",
        "- efficiency = single-GPU op time / (ranks x sequence-parallel time); peak = "
        "max_memory_allocated beyond the inputs, per rank (sequence parallel: the largest)",
        "",
    ]
    headers = [
        "latent",
        "heads",
        "sparsity",
        "mode",
        "fine",
        "ranks",
        "SP ms",
        "1-GPU op ms",
        "dense ms",
        "vs op",
        "vs dense",
        "efficiency",
        "peak MiB SP / 1-GPU op",
        "gate (SP vs op)",
        "status",
    ]
    rows = []
    for r in results:
        mem = ""
        if isinstance(r.get("sp_peak_mib"), (int, float)):
            mem = f"{r['sp_peak_mib']:.0f} / {_fmt(r.get('op_peak_mib'), '.0f')}"
        dense = _fmt(r.get("dense_ms"), ".3f")
        if dense and r.get("dense_arm"):
            dense += f" ({r['dense_arm']})"
        gate = ""
        tensors = (r.get("sp_gate") or {}).get("tensors") or {}
        errs = [t.get(t.get("criterion", ""), None) for t in tensors.values()]
        errs = [e for e in errs if isinstance(e, (int, float))]
        if tensors:
            crit = next(iter(tensors.values())).get("criterion", "err").replace("_", " ")
            gate = f"{crit} {max(errs):.1e}" if errs else "non-finite"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        rows.append(
            [
                "x".join(str(x) for x in r["latent"]),
                r["heads"],
                f"{r['sparsity'] * 100:g}% (k={r['topk']}/{r['num_tiles']})",
                r["mode"],
                r.get("fine_backend") or "",
                r.get("world_size", ""),
                _fmt(r.get("sp_ms"), ".3f"),
                _fmt(r.get("op_ms"), ".3f"),
                dense,
                _fmt(r.get("sp_speedup_vs_op"), ".2f", "x"),
                _fmt(r.get("sp_speedup_vs_dense"), ".2f", "x"),
                _fmt(r.get("scaling_efficiency"), ".0%"),
                mem,
                gate,
                brep.first_line(status, 200),
            ]
        )
    lines.append(brep.markdown_table(headers, rows))
    unavailable = {"; ".join(r.get("dense_tried") or []) for r in results if r.get("dense_tried")}
    if unavailable:
        lines += ["", "Dense arms passed over: " + " | ".join(sorted(unavailable))]
    return "\n".join(lines) + "\n"


def finish_doc(doc: dict[str, Any], out: Path | None) -> str:
    sequence_parallel = bool(doc.get("sequence_parallel"))
    if sequence_parallel:
        for rec in doc["results"]:
            derive(rec)
            derive_sp(rec)
    else:
        derive_arms(doc["results"])
    text = render_markdown_sp(doc) if sequence_parallel else render_markdown(doc)
    if out is not None:
        brep.write_json_and_markdown(out, doc, text)
    return text


def start_doc(
    cfg: Config,
    device: torch.device,
    argv: Sequence[str] | None,
    replica: brun.Replica | None,
    **extra: Any,
) -> dict[str, Any]:
    """The run's (incomplete) document: the machine, the command line, the config, ``extra``."""
    started_unix = time.time()
    command = sys.argv if argv is None else ["bench_video.py", *argv]
    meta = brep.collect_metadata(device, seed=cfg.seed, argv=command, replica=replica)
    return brun.result_doc("bench_video", started_unix=started_unix, metadata=meta,
                           config=cfg.as_dict(), **extra)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    return run_parsed(build_parser().parse_args(argv), argv)


def run_parsed(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """`main` on parsed arguments."""
    for name in args.arms:
        register_variant(name)  # a benchmark-only variant (`bench_variants`) named as an arm
    if args.sequence_parallel:
        return main_sequence_parallel(args, argv)
    replica = brun.replica_from_env()
    device = brun.pick_device(args.device, replica)
    cfg = make_config(args, device)
    doc = start_doc(cfg, device, argv, replica)
    meta = doc["metadata"]
    brun.log(f"bench_video on {meta['device'].get('name')} ({device})", replica=replica)
    return brun.run_and_report(
        doc,
        lambda checkpoint: run_grid(SingleDevice(cfg, device, replica), on_result=checkpoint),
        finish_doc,
        out=cfg.out,
        replica=replica,
        replica_timeout_s=cfg.replica_timeout_s,
        key_fields=KEY_FIELDS,
        value_fields=VALUE_FIELDS,
        drop_fields=DERIVED_FIELDS,
    )


def main_sequence_parallel(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--sequence-parallel``: every rank runs the grid; rank 0 writes and prints the report."""
    import torch.distributed as dist

    replica = brun.replica_from_env()
    if replica is None:
        raise SystemExit(
            "--sequence-parallel runs under torchrun: torchrun --standalone --nproc-per-node=N "
            "benchmarks/bench_video.py --sequence-parallel ..."
        )
    device = brun.pick_device(args.device, replica)
    cfg = make_config(args, device)
    process_group = "nccl" if device.type == "cuda" else "gloo"
    init: dict[str, Any] = {"timeout": datetime.timedelta(seconds=cfg.replica_timeout_s)}
    if device.type == "cuda":
        init["device_id"] = device
    dist.init_process_group(process_group, **init)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()

        grid = SequenceParallel(cfg, device, replica, rank=rank, world=world,
                                process_group=process_group)  # fmt: skip

        def run(checkpoint: brun.ResultsCallback | None) -> list[dict[str, Any]]:
            return run_grid(grid, on_result=checkpoint)

        if rank != 0:
            run(None)
            dist.barrier()  # see below: leave together with rank 0
            return 0
        sp_info = {
            "world_size": world,
            "process_group": process_group,
            "timing": f"{cfg.warmup} warm-up + {cfg.reps} timed calls per rank, between "
            "barriers; per call the max over ranks (all_reduce MAX), median over calls",
            "reference": "the single-GPU op and dense on rank 0 alone",
        }
        doc = start_doc(cfg, device, argv, replica, sequence_parallel=sp_info)
        meta = doc["metadata"]
        brun.log(
            f"bench_video --sequence-parallel on {world} x {meta['device'].get('name')} "
            f"({process_group})",
            replica=replica,
        )
        status = brun.run_and_report(
            doc,
            run,
            finish_doc,
            out=cfg.out,
            replica=None,  # one report: rank 0 holds every rank's numbers already
            replica_timeout_s=cfg.replica_timeout_s,
            key_fields=SP_KEY_FIELDS,
            value_fields=SP_VALUE_FIELDS,
        )
        # The other ranks wait here while rank 0 writes the report, so that no rank tears its
        # process group down while a peer still holds it open (once, on the two-core CI
        # runner, both gloo ranks aborted at exit with "terminate called without an active
        # exception" when rank 1 left first).
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


def exit_now(status: int) -> None:
    """Leave with ``status`` without the interpreter's teardown (streams flushed first). A
    sequence-parallel run exits so: on the two-core CI runner a gloo rank sometimes aborted
    after its work and the process group's destruction were done ("terminate called without
    an active exception", a C++ thread of the process group still joinable while the
    interpreter finalizes; the barriers above made it rarer, not gone), which turned a
    complete run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    parsed = build_parser().parse_args()
    code = run_parsed(parsed, None)
    if parsed.sequence_parallel:
        exit_now(code)
    sys.exit(code)

"""Full-op benchmark: `video_sparse_attn` at real video latents against dense attention.

The op (coarse pooling, coarse attention, top-k selection, fine block-sparse attention, combine)
runs forward and forward+backward on tile-order inputs with partial tiles: Wan-2.1 480p
(21x30x52, 12 heads) and 720p (21x45x80, 40 heads), HunyuanVideo 720p (33x45x80, 24 heads),
tile (4,4,4), D=128, at 87.5% and 90% sparsity (top-k = round((1 - sparsity) * tiles)). The dense
baseline is FA4 ``flash_attn_func`` when available, else PyTorch SDPA (cuDNN, else flash), on
the real (unpadded) tokens.

Reported per cell: op and dense median times, speedup, the padding-limited ideal speedup
((real tokens / padded tokens)^2 / kept fraction) and the fraction of it reached, the time of
the op's pieces (pool_tiles x3, coarse_attention, select_topk, fine attention) and the share of
coarse+select in the op, and the peak GPU memory of op vs dense (max_memory_allocated beyond
what was allocated before the call; forward under no_grad, forward+backward including grads).

Correctness gates, before timing: the op's output (and q/k/v gradients) on real tokens against
a float32 composition of the same stages on the same selection (vsa-core's reference fine
attention); the dense baseline's output on 128 sampled query rows against float32 attention,
its gradients for finiteness. On a CPU it runs the reference backend on a tiny latent.

    python benchmarks/bench_video.py --out results/bench_video.json

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
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc
import bench_vsa

from vsa_core import VideoTiling, block_sparse_attn, video_sparse_attn
from vsa_core.backends import AttentionCall, get_backend, select_backend
from vsa_core.coarse import coarse_attention, pool_tiles, select_topk
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
}
CPU_DEFAULTS = {"shapes": ["tiny"], "head_dim": 32, "warmup": 1, "reps": 3, "budget_s": 1.0}
DENSE_SAMPLE_ROWS = 128

KEY_FIELDS = ("shape", "heads", "sparsity", "mode")
VALUE_FIELDS = (
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
        "--backend",
        default="auto",
        help="fine-attention backend: auto, reference, triton, fa4, ... (default auto)",
    )
    g.add_argument(
        "--modes",
        type=bc.parse_mode,
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
        "--fa4-variant",
        type=lambda text: tuple(text.split(",")),
        default=(),
        metavar="OPTIONS",
        help="the fork's experimental fa4 forwards where they fit, a comma list of qregs, "
        "streams, persistent (vsa_fa4.launch.ForwardVariant); default: the shipped kernels",
    )
    g.add_argument(
        "--dtype",
        choices=sorted(bc.DTYPES),
        help="default bf16 (with --sequence-parallel on a CPU: float32)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="under torchrun --nproc-per-node=N: the op sharded over the N ranks (Ulysses), "
        "against the single-GPU op and dense on one GPU; fixed --warmup/--reps, no --budget-s",
    )
    t = p.add_argument_group("timing")
    t.add_argument("--warmup", type=int, help="default 3 (CPU: 1)")
    t.add_argument("--reps", type=int, help="timed calls, at most (default 10; CPU: 3)")
    t.add_argument("--budget-s", type=float, help="about this many seconds per timing (default 3)")
    t.add_argument(
        "--time-budget-min",
        type=float,
        help="stop starting new cells after this many minutes; the rest are reported 'not_run'",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="JSON path; the .md table goes beside it")
    bc.add_run_options(o)
    return p


@dataclass
class Config:
    shapes: list[Shape]
    head_dim: int
    batch: int
    tile: tuple[int, int, int]
    sparsities: list[float]
    backend: str
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
    fa4_variant: tuple[str, ...] = ()

    def fa4_variant_context(self) -> contextlib.AbstractContextManager[Any]:
        """Around each op cell: the fa4 forwards' variant (`--fa4-variant`), if any."""
        if not self.fa4_variant:
            return contextlib.nullcontext()
        from vsa_fa4 import launch

        return launch.forward_variant(launch.ForwardVariant.from_names(self.fa4_variant))

    def as_dict(self) -> dict[str, Any]:
        fields = {
            "shapes": [
                {"name": s.name, "latent": list(s.latent), "heads": s.heads} for s in self.shapes
            ],
            "head_dim": self.head_dim,
            "batch": self.batch,
            "tile": list(self.tile),
            "sparsities": self.sparsities,
            "backend": self.backend,
            "modes": self.modes,
            "dense": self.dense,
            "coarse_gate": self.coarse_gate,
            "dtype": bc.DTYPE_NAMES[self.dtype],
            "warmup": self.warmup,
            "reps": self.reps,
            "budget_s": self.budget_s,
            "time_budget_min": self.time_budget_min,
            "seed": self.seed,
            "fa4_variant": list(self.fa4_variant),
        }
        if self.sequence_parallel:
            fields["sequence_parallel"] = True
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
    if args.dtype is not None:
        dtype = bc.DTYPES[args.dtype]
    else:  # sequence parallel on a CPU: float32, so that its gate is tight
        dtype = torch.float32 if sp and device.type != "cuda" else torch.bfloat16
    return Config(
        shapes=shapes,
        head_dim=pick("head_dim"),
        batch=args.batch,
        tile=tuple(args.tile),
        sparsities=list(dict.fromkeys(args.sparsities)),
        backend=args.backend,
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
        fa4_variant=_checked_fa4_variant(args.fa4_variant),
    )


# ---- metrics --------------------------------------------------------------------------------
def topk_for(sparsity: float, num_tiles: int) -> int:
    return max(1, min(num_tiles, round((1 - sparsity) * num_tiles)))


def ideal_speedup(tokens_real: int, tokens_padded: int, kept_fraction: float) -> float:
    """Speedup over dense attention on the real tokens if the op cost only its fine attention
    over the padded sequence: (real / padded)^2 / kept fraction."""
    return (tokens_real / tokens_padded) ** 2 / kept_fraction


def derive(rec: dict[str, Any]) -> None:
    """Speedup, fraction of ideal, coarse+select share, memory ratio (in place)."""
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
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + tiling.padded_len * 31 + heads)
    shape = (cfg.batch, tiling.padded_len, heads, cfg.head_dim)

    def rand() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=cfg.dtype)

    q, k, v, dout = rand(), rand(), rand(), rand()
    gate = rand() if cfg.coarse_gate else None
    return OpInputs(q, k, v, gate, dout, cfg.head_dim**-0.5)


def attn_runner(inputs: OpInputs, mode: str, attn: Callable[..., Any]) -> bc.Runner:
    """``attn(q, k, v, coarse_gate=gate, scale=scale)`` on ``inputs`` as a runner of ``mode``
    (the gradients: dq, dk, dv and, with a gate, dgate)."""
    tensors = [inputs.q, inputs.k, inputs.v] + ([inputs.gate] if inputs.gate is not None else [])
    leaves = bc.make_leaves(tensors, mode, lambda t: t)
    scale = inputs.scale

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *gate: torch.Tensor) -> Any:
        return attn(q, k, v, coarse_gate=gate[0] if gate else None, scale=scale)

    names = ("dq", "dk", "dv", "dgate")[: len(leaves)]
    return bc.autograd_runner(forward, leaves, inputs.dout, mode, names=names)


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
    inputs: OpInputs, tiling: VideoTiling, topk: int, backend: str, mode: str
) -> bc.Runner:
    attn = partial(video_sparse_attn, tiling=tiling, topk=topk, backend=backend, validate=False)
    return attn_runner(inputs, mode, attn)


def op_reference(
    inputs: OpInputs, tiling: VideoTiling, topk: int, need_grads: bool
) -> dict[str, torch.Tensor]:
    """Float32 composition of the op on the op's own selection (the same bf16 coarse scores,
    hence the same top-k): reference fine attention + coarse attention, combined."""
    device = inputs.q.device
    valid = tiling.valid_sizes(device)
    tile_tokens = tiling.tile_tokens
    with torch.no_grad():
        layout = select_topk(
            pool_tiles(inputs.q, valid), pool_tiles(inputs.k, valid), valid, topk, tile_tokens
        )
    q32, k32, v32 = (
        t.detach().float().requires_grad_(need_grads) for t in (inputs.q, inputs.k, inputs.v)
    )
    gate32 = None if inputs.gate is None else inputs.gate.detach().float()
    with bc.ieee_fp32_matmul(), torch.set_grad_enabled(need_grads):
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
    inputs: OpInputs, tiling: VideoTiling, topk: int, backend: str, mode: str
) -> dict[str, bc.Runner]:
    """The op's stages as separate runners: pool (q, k, v), coarse, select, fine."""
    device = inputs.q.device
    valid = tiling.valid_sizes(device)
    tile_tokens, scale = tiling.tile_tokens, inputs.scale
    with torch.no_grad():
        pooled = [pool_tiles(t, valid) for t in (inputs.q, inputs.k, inputs.v)]
        layout = select_topk(pooled[0], pooled[1], valid, topk, tile_tokens)

    def select(_: Any) -> dict[str, torch.Tensor]:
        return {"indices": select_topk(pooled[0], pooled[1], valid, topk, tile_tokens).kv_indices}

    def fine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return block_sparse_attn(q, k, v, layout, backend=backend, scale=scale)[0]

    def coarse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return coarse_attention(q, k, v, valid, scale)

    runners = {"select": bc.Runner(select)}
    qkv = (inputs.q, inputs.k, inputs.v)
    runners["fine"] = bc.autograd_runner(
        fine, bc.make_leaves(qkv, mode, lambda t: t), inputs.dout, mode
    )
    d_pooled = torch.randn_like(pooled[0])
    runners["coarse"] = bc.autograd_runner(
        coarse, bc.make_leaves(pooled, mode, lambda t: t), d_pooled, mode
    )
    leaves = bc.make_leaves(qkv, mode, lambda t: t)
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

    runners["pool"] = bc.Runner(pool)
    return runners


def resolve_fine_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    tiling: VideoTiling,
    mode: str,
) -> tuple[str | None, str | None]:
    """(backend that will run the fine attention, None) or (None, why it cannot). The call is
    described as the op describes it: key blocks all full when the latent needs no padding."""
    tile = tiling.tile_tokens
    call = AttentionCall(device, dtype, head_dim, (tile, tile), mode != "fwd",
                         kv_blocks_full=not tiling.has_padding)  # fmt: skip
    try:
        if name == "auto":
            return select_backend(call, "auto").name, None
        reason = get_backend(name).supports(call)
    except ValueError as exc:
        return None, str(exc)
    return (name, None) if reason is None else (None, f"{name} backend refuses: {reason}")


# ---- dense baseline -------------------------------------------------------------------------
def dense_arms(choice: str, device: torch.device) -> list[bench_vsa.Arm]:
    fa4, sdpa = bench_vsa.Fa4DenseArm(), bench_vsa.SdpaArm(allow_cpu=True)
    return {"fa4": [fa4], "sdpa": [sdpa]}.get(choice, [fa4, sdpa])


def run_dense(
    cfg: Config, shape: Shape, tokens: int, mode: str, device: torch.device
) -> dict[str, Any]:
    """Dense attention on the real tokens: the first arm that is available and passes its
    gate is timed. Returns a record with dense_ms, dense_peak_mib, the arm and its gate."""
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
            bc.synchronize(device)
            ref = bc.masked_attention_reference(q.index_select(1, rows), k, v, inputs.scale)
            gate = bc.gate_check({"out": outputs["out"].index_select(1, rows)}, ref, cfg.dtype)
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
            timing = bc.time_runner(runner, device, cfg)
            return {
                "dense_status": "ok",
                "dense_arm": arm.name,
                "dense_info": runner.info,
                "dense_gate": gate.as_dict(),
                "dense_ms": timing.median_ms,
                "dense_timing": timing.as_dict(),
                "dense_peak_mib": bc.peak_extra_mib(runner.once, device),
                "dense_tried": tried,
            }
        except Exception as exc:
            tried.append(f"{arm.name}: {bc.error_text(exc, 500)}")
            bc.recover_after_error(device)
        finally:
            del runner
    return {"dense_status": "unavailable", "dense_tried": tried}


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
        "dtype": bc.DTYPE_NAMES[cfg.dtype],
        "sparsity": sparsity,
        "mode": mode,
        "num_tiles": tiling.num_tiles,
        "topk": topk,
        "kept_fraction": kept,
        "tokens_real": tiling.seq_len,
        "tokens_padded": tiling.padded_len,
        "ideal_speedup": ideal_speedup(tiling.seq_len, tiling.padded_len, kept),
        "backend": cfg.backend,
        "coarse_gate": cfg.coarse_gate,
        "status": None,
    }


def run_op_cell(
    cfg: Config,
    rec: dict[str, Any],
    inputs: OpInputs,
    tiling: VideoTiling,
    device: torch.device,
    log: Callable[[str], None],
) -> None:
    """Gate, time, measure and split one op cell into ``rec`` (in place); never raises."""
    mode, topk = rec["mode"], rec["topk"]
    fine, why = resolve_fine_backend(cfg.backend, device, cfg.dtype, cfg.head_dim, tiling, mode)
    rec["fine_backend"] = fine
    if fine is None:
        rec.update(status="skipped", reason=why)
        return
    runner = None
    try:
        log("gate")
        need_grads = mode != "fwd"
        ref = op_reference(inputs, tiling, topk, need_grads)
        runner = op_runner(inputs, tiling, topk, fine, mode)
        outputs = runner.once()
        bc.synchronize(device)
        wanted = ("out", "dq", "dk", "dv") if need_grads else ("out",)
        rows = tiling.indices(device).nonpad_index
        gate = bc.gate_check({n: outputs[n] for n in wanted}, ref, cfg.dtype, rows=rows)
        del outputs, ref
        rec["op_gate"] = gate.as_dict()
        if not gate.passed:
            rec.update(status="failed", reason=f"correctness gate: {gate.reason}")
            return
        log("time op")
        timing = bc.time_runner(runner, device, cfg)
        rec["op_ms"] = timing.median_ms
        rec["op_timing"] = timing.as_dict()
        rec["op_peak_mib"] = bc.peak_extra_mib(runner.once, device)
        del runner
        runner = None
        log("time pieces")
        pieces = piece_runners(inputs, tiling, topk, fine, mode)
        for name, piece in pieces.items():
            rec[f"{name}_ms"] = bc.time_runner(piece, device, cfg).median_ms
        del pieces
        rec["status"] = "ok"
    except Exception as exc:
        rec.update(status="error", **bc.error_fields(exc))
        bc.recover_after_error(device)
    finally:
        del runner


def cell_label(number: int, total: int, shape: Shape, sparsity: float, mode: str) -> str:
    return f"[{number}/{total}] {shape.name} x{shape.heads} heads {sparsity * 100:g}% {mode}"


def run_benchmark(
    cfg: Config,
    device: torch.device,
    *,
    replica: bc.Replica | None = None,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    torch.manual_seed(cfg.seed)
    total = len(cfg.shapes) * len(cfg.modes) * len(cfg.sparsities)
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    for shape in cfg.shapes:
        tiling = VideoTiling(shape.latent, cfg.tile)
        inputs: OpInputs | None = None
        for mode in cfg.modes:
            dense: dict[str, Any] | None = None
            for sparsity in cfg.sparsities:
                rec = base_record(cfg, shape, tiling, sparsity, mode)
                label = cell_label(len(results) + 1, total, shape, sparsity, mode)

                def log(step: str, label: str = label) -> None:
                    bc.log(f"{label}: {step}", replica=replica)

                if bc.budget_spent(cfg.time_budget_min, started):
                    bc.mark_not_run(rec, cfg.time_budget_min)
                else:
                    if dense is None:
                        log(f"dense baseline on {tiling.seq_len} real tokens")
                        dense = run_dense(cfg, shape, tiling.seq_len, mode, device)
                    rec.update(dense)
                    if inputs is None:
                        inputs = make_op_inputs(cfg, tiling, shape.heads, device)
                    with cfg.fa4_variant_context():
                        run_op_cell(cfg, rec, inputs, tiling, device, log)
                derive(rec)
                results.append(rec)
                log(summary_line(rec))
                if on_result is not None:
                    on_result(results)
        del inputs
        bc.recover_after_error(device)
    return results


# ---- sequence parallel ----------------------------------------------------------------------
# Every rank runs the same cells in the same order and makes the same collective calls: the
# decisions that could differ between ranks (time budget, gates, errors) are agreed on with
# bc.any_rank before they change what runs next. Rank 0 alone runs the single-GPU op and the
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
    local: OpInputs, tiling: VideoTiling, topk: int, backend: str, mode: str
) -> bc.Runner:
    """`sequence_parallel_video_sparse_attn` on this rank's shards (outputs: its shards)."""
    attn = partial(sequence_parallel_video_sparse_attn, topk=topk, tiling=tiling, backend=backend)
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
    mode, topk = rec["mode"], rec["topk"]
    need_grads = mode != "fwd"
    wanted = ("out", "dq", "dk", "dv") if need_grads else ("out",)
    runner = None
    try:
        log("single-GPU op: gate")
        ref = op_reference(inputs, tiling, topk, need_grads)
        runner = op_runner(inputs, tiling, topk, fine, mode)
        outputs = runner.once()
        bc.synchronize(device)
        rows = tiling.indices(device).nonpad_index
        gate = bc.gate_check({n: outputs[n] for n in wanted}, ref, cfg.dtype, rows=rows)
        del ref
        rec["op_gate"] = gate.as_dict()
        if not gate.passed:
            rec.update(status="failed", reason=f"correctness gate (single-GPU op): {gate.reason}")
            return None
        kept = {n: outputs[n].detach() for n in wanted}
        del outputs
        log("single-GPU op: time")
        timing = bc.time_runner(runner, device, cfg)
        rec["op_ms"] = timing.median_ms
        rec["op_timing"] = timing.as_dict()
        rec["op_peak_mib"] = bc.peak_extra_mib(runner.once, device)
        return kept
    except Exception as exc:
        rec.update(status="error", **bc.error_fields(exc))
        bc.recover_after_error(device)
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
    fine, why = resolve_fine_backend(cfg.backend, device, cfg.dtype, cfg.head_dim, tiling, mode)
    rec["fine_backend"] = fine
    if fine is None:  # the same answer on every rank: same device type, dtype, shape
        rec.update(status="skipped", reason=why)
        return
    wanted = ("out", "dq", "dk", "dv") if mode != "fwd" else ("out",)
    single = None
    if rank == 0:
        assert full is not None
        single = run_single_gpu_op(cfg, rec, full, tiling, fine, device, log)
    if bc.any_rank(rank == 0 and single is None, device):
        if rank != 0:
            rec.update(status="failed", reason="the single-GPU op failed on rank 0")
        return

    runner, failed = None, False
    try:
        log("sequence-parallel op: gate")
        runner = sp_op_runner(local, tiling, topk, fine, mode)
        outputs = runner.once()
        gathered = {n: gather_sequence(outputs[n]) for n in wanted}
        del outputs
        if rank == 0:
            assert single is not None
            rows = tiling.indices(device).nonpad_index
            gate = bc.match_check(gathered, single, cfg.dtype, rows=rows)
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
        rec.update(status="error", **bc.error_fields(exc))
        bc.recover_after_error(device)
    if bc.any_rank(failed, device):
        if not failed:
            rec.update(status="failed", reason="failed on another rank")
        return

    # No recovery from here on: a rank that raised in the middle of the op's collectives would
    # leave the others waiting, so an error ends the run (torchrun stops every rank).
    try:
        log(f"sequence-parallel op: time ({cfg.warmup} warm-up + {cfg.reps} timed calls)")
        timing = bc.time_fn_distributed(
            runner.run, device, setup=runner.setup, warmup=cfg.warmup, reps=cfg.reps
        )
        rec["sp_ms"] = timing.median_ms
        rec["sp_timing"] = timing.as_dict()
        peak = bc.peak_extra_mib(runner.once, device)
        per_rank = bc.gather_per_rank(peak, device) if device.type == "cuda" else None
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


def run_sequence_parallel(
    cfg: Config,
    device: torch.device,
    *,
    rank: int,
    world: int,
    process_group: str,
    replica: bc.Replica | None = None,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """The grid in sequence-parallel mode, on every rank (rank 0's results are the report)."""
    torch.manual_seed(cfg.seed)
    total = len(cfg.shapes) * len(cfg.modes) * len(cfg.sparsities)
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    for shape in cfg.shapes:
        tiling = VideoTiling(shape.latent, cfg.tile)
        unsupported = sp_unsupported(shape, tiling, world)
        full: OpInputs | None = None
        local: OpInputs | None = None
        for mode in cfg.modes:
            dense: dict[str, Any] | None = None
            for sparsity in cfg.sparsities:
                rec = base_record(cfg, shape, tiling, sparsity, mode)
                rec.update(world_size=world, process_group=process_group)
                label = cell_label(len(results) + 1, total, shape, sparsity, mode)
                label += f", {world} ranks"

                def log(step: str, label: str = label) -> None:
                    if rank == 0:
                        bc.log(f"{label}: {step}", replica=replica)

                # every rank must agree, since the cell's collectives follow
                if cfg.time_budget_min is not None and bc.any_rank(
                    bc.budget_spent(cfg.time_budget_min, started), device
                ):
                    bc.mark_not_run(rec, cfg.time_budget_min)
                elif unsupported is not None:
                    rec.update(status="skipped", reason=unsupported)
                else:
                    if rank == 0 and dense is None:
                        log(f"dense baseline on {tiling.seq_len} real tokens (rank 0)")
                        dense = run_dense(cfg, shape, tiling.seq_len, mode, device)
                    if rank == 0:
                        rec.update(dense or {})
                    if local is None:  # the same full inputs on every rank, then its shards
                        full = make_op_inputs(cfg, tiling, shape.heads, device)
                        local = shard_inputs(full, tiling)
                        if rank != 0:
                            full = None
                    with cfg.fa4_variant_context():
                        run_sp_cell(cfg, rec, full, local, tiling, device, rank, log)
                derive(rec)
                derive_sp(rec)
                results.append(rec)
                if rank == 0:  # the other ranks' records lack rank 0's numbers
                    log(summary_line(rec))
                if on_result is not None:
                    on_result(results)
        del full, local
        bc.recover_after_error(device)
    bc.barrier(device)
    return results


def summary_line(rec: dict[str, Any]) -> str:
    if rec["status"] != "ok":
        return f"{rec['status']}: {bc.first_line(rec.get('reason'), 200)}"
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


def render_markdown(doc: dict[str, Any]) -> str:
    meta, cfg, results = doc["metadata"], doc["config"], doc["results"]
    dev = meta["device"]
    lines = [
        "# bench_video: video_sparse_attn vs dense attention",
        "",
        f"- device: {dev.get('name')} ({dev.get('type')}), driver "
        f"{meta['driver'].get('driver_version')}",
        f"- date (UTC): {meta['date_utc']}; seed {meta['seed']}",
        f"- command: `{meta['command']}`",
        f"- tile {tuple(cfg['tile'])}, D={cfg['head_dim']}, B={cfg['batch']}, {cfg['dtype']}, "
        f"coarse gate: {cfg['coarse_gate']}; fine backend requested: {cfg['backend']}"
        + _variant_note(cfg),
        "- speedup = dense time / op time; ideal = (real/padded tokens)^2 / kept fraction; "
        "coarse+select = pool_tiles x3 + coarse_attention + select_topk, timed apart; "
        "peak = max_memory_allocated beyond the inputs",
        "",
    ]
    headers = [
        "latent",
        "heads",
        "sparsity",
        "mode",
        "fine",
        "op ms",
        "dense ms",
        "speedup",
        "ideal",
        "of ideal",
        "coarse+select",
        "peak MiB op / dense",
        "status",
    ]
    rows = []
    for r in results:
        mem = ""
        if isinstance(r.get("op_peak_mib"), (int, float)):
            mem = f"{r['op_peak_mib']:.0f} / {_fmt(r.get('dense_peak_mib'), '.0f')}"
            if "peak_mem_ratio" in r:
                mem += f" ({r['peak_mem_ratio']:.2f}x)"
        dense = _fmt(r.get("dense_ms"), ".3f")
        if dense and r.get("dense_arm"):
            dense += f" ({r['dense_arm']})"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        rows.append(
            [
                "x".join(str(x) for x in r["latent"]),
                r["heads"],
                f"{r['sparsity'] * 100:g}% (k={r['topk']}/{r['num_tiles']})",
                r["mode"],
                r.get("fine_backend") or "",
                _fmt(r.get("op_ms"), ".3f"),
                dense,
                _fmt(r.get("speedup"), ".2f", "x"),
                _fmt(r.get("ideal_speedup"), ".2f", "x"),
                _fmt(r.get("fraction_of_ideal"), ".0%"),
                _fmt(r.get("coarse_select_share"), ".1%"),
                mem,
                bc.first_line(status, 200),
            ]
        )
    lines.append(bc.markdown_table(headers, rows))
    unavailable = {"; ".join(r.get("dense_tried") or []) for r in results if r.get("dense_tried")}
    if unavailable:
        lines += ["", "Dense arms passed over: " + " | ".join(sorted(unavailable))]
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
        + _variant_note(cfg),
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
                bc.first_line(status, 200),
            ]
        )
    lines.append(bc.markdown_table(headers, rows))
    unavailable = {"; ".join(r.get("dense_tried") or []) for r in results if r.get("dense_tried")}
    if unavailable:
        lines += ["", "Dense arms passed over: " + " | ".join(sorted(unavailable))]
    return "\n".join(lines) + "\n"


def finish_doc(doc: dict[str, Any], out: Path | None) -> str:
    sequence_parallel = bool(doc.get("sequence_parallel"))
    for rec in doc["results"]:
        derive(rec)
        if sequence_parallel:
            derive_sp(rec)
    text = render_markdown_sp(doc) if sequence_parallel else render_markdown(doc)
    if out is not None:
        bc.write_json_and_markdown(out, doc, text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sequence_parallel:
        return main_sequence_parallel(args, argv)
    replica = bc.replica_from_env()
    device = bc.pick_device(args.device, replica)
    cfg = make_config(args, device)
    started_unix = time.time()
    command = sys.argv if argv is None else ["bench_video.py", *argv]
    meta = bc.collect_metadata(device, seed=cfg.seed, argv=command, replica=replica)
    doc = bc.result_doc(
        "bench_video", started_unix=started_unix, metadata=meta, config=cfg.as_dict()
    )
    bc.log(f"bench_video on {meta['device'].get('name')} ({device})", replica=replica)
    return bc.run_and_report(
        doc,
        lambda checkpoint: run_benchmark(cfg, device, replica=replica, on_result=checkpoint),
        finish_doc,
        out=cfg.out,
        replica=replica,
        replica_timeout_s=cfg.replica_timeout_s,
        key_fields=KEY_FIELDS,
        value_fields=VALUE_FIELDS,
        drop_fields=(
            "speedup",
            "fraction_of_ideal",
            "coarse_select_ms",
            "coarse_select_share",
            "peak_mem_ratio",
        ),
    )


def main_sequence_parallel(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--sequence-parallel``: every rank runs the grid; rank 0 writes and prints the report."""
    import torch.distributed as dist

    replica = bc.replica_from_env()
    if replica is None:
        raise SystemExit(
            "--sequence-parallel runs under torchrun: torchrun --standalone --nproc-per-node=N "
            "benchmarks/bench_video.py --sequence-parallel ..."
        )
    device = bc.pick_device(args.device, replica)
    cfg = make_config(args, device)
    process_group = "nccl" if device.type == "cuda" else "gloo"
    init: dict[str, Any] = {"timeout": datetime.timedelta(seconds=cfg.replica_timeout_s)}
    if device.type == "cuda":
        init["device_id"] = device
    dist.init_process_group(process_group, **init)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()

        def run(checkpoint: bc.ResultsCallback | None) -> list[dict[str, Any]]:
            return run_sequence_parallel(
                cfg,
                device,
                rank=rank,
                world=world,
                process_group=process_group,
                replica=replica,
                on_result=checkpoint,
            )

        if rank != 0:
            run(None)
            dist.barrier()  # see below: leave together with rank 0
            return 0
        started_unix = time.time()
        command = sys.argv if argv is None else ["bench_video.py", *argv]
        meta = bc.collect_metadata(device, seed=cfg.seed, argv=command, replica=replica)
        sp_info = {
            "world_size": world,
            "process_group": process_group,
            "timing": f"{cfg.warmup} warm-up + {cfg.reps} timed calls per rank, between "
            "barriers; per call the max over ranks (all_reduce MAX), median over calls",
            "reference": "the single-GPU op and dense on rank 0 alone",
        }
        doc = bc.result_doc(
            "bench_video",
            started_unix=started_unix,
            metadata=meta,
            config=cfg.as_dict(),
            sequence_parallel=sp_info,
        )
        bc.log(
            f"bench_video --sequence-parallel on {world} x {meta['device'].get('name')} "
            f"({process_group})",
            replica=replica,
        )
        status = bc.run_and_report(
            doc,
            run,
            finish_doc,
            out=cfg.out,
            replica=None,  # one report: rank 0 holds every rank's numbers already
            replica_timeout_s=cfg.replica_timeout_s,
            key_fields=KEY_FIELDS,
            value_fields=VALUE_FIELDS,
        )
        # The other ranks wait here while rank 0 writes the report, so that no rank tears its
        # process group down while a peer still holds it open (once, on the two-core CI
        # runner, both gloo ranks aborted at exit with "terminate called without an active
        # exception" when rank 1 left first).
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""Kernel benchmark: block-sparse attention of every backend against the references users pick.

Grid: sequence lengths x sparsities x block shapes x modes (fwd, bwd, fwd+bwd), at one batch,
head count, head dim and dtype. Per (sequence length, sparsity) one mask is sampled at 256-token
granularity (every query block keeps its diagonal block) and expanded to each finer block shape
(``--masks exact256``, the default), so every block shape selects exactly the same token pairs;
``--masks native`` samples at each block shape instead.

Arms (each skipped with a stated reason when it cannot run):

- ``reference``, ``triton``, ``fa4``: vsa-core's ``block_sparse_attn(..., backend=NAME)``; a
  backend that refuses a call is skipped with its own reason. Any other backend registered
  under the ``vsa.backends`` entry points (e.g. fork kernels) becomes an arm ``vsa:NAME``.
- ``fa4_raw``: upstream FlashAttention-4 ``_flash_attn_fwd`` / ``_flash_attn_bwd`` with
  block-sparse tensors prebuilt from the layout (metadata excluded from timing).
- ``flex``: PyTorch FlexAttention (compiled) with an equivalent ``BlockMask``.
- ``fa4_dense``, ``sdpa``: dense baselines (FA4 ``flash_attn_func``; SDPA with cuDNN, else
  flash), run once per (sequence length, mode).

Before anything is timed, every arm's output (and gradients) is checked against one float32
masked reference per cell: finite and max abs error <= max(1e-2, 8 x the dtype's rounding
floor). An arm that fails is reported and not timed. Metrics: median time (CUDA events,
warm-up excluded), sparse-aware TFLOP/s = 4*B*H*D*(selected token pairs per head) / time
(x2.5 for bwd, x3.5 for fwd+bwd), MFU against the device's dense bf16 peak, and efficiency
relative to dense FA4 measured in the same run: with ``--pacing dense`` (the default) each
sparse arm is timed call by call alternating with dense FA4 of its length and mode and compared
with dense's times from those rounds, so both run at the same clock (a GPU at its power cap
runs a short kernel timed on its own at a higher clock than dense). Output: JSON (with
metadata), a markdown table on stdout (progress goes to stderr) and PNG plots of TFLOP/s vs
sparsity.

    python benchmarks/bench_vsa.py --out results/bench_vsa.json
    torchrun --nproc-per-node=8 benchmarks/bench_vsa.py --out results/bench_vsa.json
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_reference as bref
import bench_report as brep
import bench_run as brun
import bench_timing as bt

from vsa_core import BlockSparseLayout, block_sparse_attn
from vsa_core.backends import AttentionCall, backend_entries, get_backend

SPARSE_ARMS = ("reference", "triton", "fa4", "fa4_raw", "flex")
DENSE_ARMS = ("fa4_dense", "sdpa")
KNOWN_ARMS = SPARSE_ARMS + DENSE_ARMS
VSA_BACKEND_ARMS = ("reference", "triton", "fa4")

GPU_DEFAULTS = {
    "seq_lens": [8192, 32768],
    "heads": 12,
    "head_dim": 128,
    "warmup": 5,
    "reps": 20,
    "budget_s": 3.0,
}
CPU_DEFAULTS = {
    "seq_lens": [512],
    "heads": 2,
    "head_dim": 32,
    "warmup": 1,
    "reps": 3,
    "budget_s": 1.0,
}
DEFAULT_SPARSITIES = ["dense", "0.5", "0.75", "0.875", "0.9", "0.95"]
DEFAULT_BLOCK_SHAPES = ["256x256", "128x128", "128x64", "64x64"]
DEFAULT_MODES = ["fwd", "bwd", "fwd+bwd"]
EXACT_BLOCK = 256

KEY_FIELDS = ("seq_len", "mode", "sparsity", "block_shape", "arm")
VALUE_FIELDS = ("median_ms", "min_ms", "max_ms", "peak_mem_mib", "paced_dense_median_ms")


# ---- configuration --------------------------------------------------------------------------
def parse_sparsity(text: str) -> float:
    """'dense' (or 0) -> 0.0; a fraction in [0, 1) or a percentage in [1, 100)."""
    if text.strip().lower() in ("dense", "0", "0.0"):
        return 0.0
    value = float(text)
    if value >= 1:
        value /= 100
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"sparsity must be 'dense' or in [0, 1), got {text!r}")
    return value


def sparsity_label(sparsity: float | None) -> str:
    if sparsity is None:
        return "dense kernel"
    return "dense" if sparsity == 0 else f"{sparsity * 100:g}%"


def parse_block_shape(text: str) -> tuple[int, int]:
    try:
        q, kv = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"block shape must be QxKV, e.g. 128x64; got {text!r}"
        ) from None
    if q <= 0 or kv <= 0:
        raise argparse.ArgumentTypeError(f"block sizes must be positive, got {text!r}")
    return q, kv


def block_label(shape: tuple[int, int] | None) -> str | None:
    return None if shape is None else f"{shape[0]}x{shape[1]}"


@dataclass
class Config:
    seq_lens: list[int]
    sparsities: list[float]
    block_shapes: list[tuple[int, int]]
    modes: list[str]
    arms: list[str]
    batch: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    masks: str
    seed: int
    warmup: int
    reps: int
    budget_s: float
    reference_max_seq: int
    peak_tflops: float | None
    gate_max_seq: int | None
    out: Path | None
    plots: bool
    time_budget_min: float | None
    replica_timeout_s: float
    partial_blocks: float = 0.0
    pacing: str = "dense"

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq_lens": self.seq_lens,
            "sparsities": self.sparsities,
            "block_shapes": [block_label(b) for b in self.block_shapes],
            "modes": self.modes,
            "arms": self.arms,
            "batch": self.batch,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "dtype": brun.DTYPE_NAMES[self.dtype],
            "masks": self.masks,
            "partial_blocks": self.partial_blocks,
            "pacing": self.pacing,
            "seed": self.seed,
            "warmup": self.warmup,
            "reps": self.reps,
            "budget_s_per_arm": self.budget_s,
            "reference_max_seq": self.reference_max_seq,
            "gate_max_seq": self.gate_max_seq,
            "peak_tflops_override": self.peak_tflops,
            "time_budget_min": self.time_budget_min,
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_vsa.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("grid")
    g.add_argument("--seq-lens", type=int, nargs="+", help="default: 8192 32768 (CPU: 512)")
    g.add_argument(
        "--sparsities",
        type=parse_sparsity,
        nargs="+",
        default=[parse_sparsity(s) for s in DEFAULT_SPARSITIES],
        help="'dense' or fractions of skipped key blocks (default: dense 0.5 0.75 0.875 0.9 0.95)",
    )
    g.add_argument(
        "--block-shapes",
        type=parse_block_shape,
        nargs="+",
        default=[parse_block_shape(s) for s in DEFAULT_BLOCK_SHAPES],
        help="QxKV block shapes (default: 256x256 128x128 128x64 64x64)",
    )
    g.add_argument(
        "--modes",
        type=brun.parse_mode,
        nargs="+",
        default=list(DEFAULT_MODES),
        help="fwd, bwd (backward only), fwd+bwd (alias fwdbwd); default: all three",
    )
    g.add_argument(
        "--arms",
        nargs="+",
        help=f"arms to run (default: {' '.join(KNOWN_ARMS)} plus vsa:NAME for every other "
        "registered vsa backend); vsa:fa4+OPTION[+OPTION] runs the fa4 backend with the fork's "
        "experimental forward kernels where they fit (options: qregs, streams, persistent)",
    )
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--heads", type=int, help="default 12 (CPU: 2)")
    g.add_argument("--head-dim", type=int, help="default 128 (CPU: 32)")
    g.add_argument("--dtype", choices=sorted(brun.DTYPES), default="bf16")
    g.add_argument(
        "--masks",
        choices=("exact256", "native"),
        default="exact256",
        help="exact256: one 256-granular mask per cell expanded to every block shape (same "
        "token pairs); native: sample at each block shape",
    )
    g.add_argument(
        "--partial-blocks",
        type=float,
        default=0.0,
        metavar="FRAC",
        help="fraction of the sampled key blocks made partial (valid sizes uniform in "
        "1..block-1; with exact256 the 256-token blocks, whose refined children come out full, "
        "partial or empty), so the kernels run their partial-block masks (default 0: all full)",
    )
    t = p.add_argument_group("timing")
    t.add_argument("--warmup", type=int, help="warm-up calls per arm (default 5; CPU: 1)")
    t.add_argument("--reps", type=int, help="timed calls per arm, at most (default 20; CPU: 3)")
    t.add_argument(
        "--budget-s",
        type=float,
        help="cap one arm's timed calls at about this many seconds (default 3; CPU: 1)",
    )
    t.add_argument(
        "--pacing",
        choices=("dense", "none"),
        default="dense",
        help="dense (default): time each sparse arm call by call alternating with fa4_dense of "
        "the same length and mode (when that arm is in the run), so both run at the same clock "
        "and power state, and compare them in those rounds (an H200 under sustained load caps "
        "its power and clocks ~1.5-1.65 GHz instead of 1.98: a short kernel timed on its own "
        "runs faster than beside dense, by up to ~15%%); none: every arm timed on its own",
    )
    t.add_argument(
        "--reference-max-seq",
        type=int,
        default=4096,
        help="run the (slow) reference arm only up to this sequence length (default 4096)",
    )
    t.add_argument(
        "--gate-max-seq",
        type=int,
        help="run the float32 correctness gate only up to this sequence length; longer cells "
        "are timed ungated and marked so (its quadratic reference outruns the timing past "
        "S ~ 64k); default: gate every cell",
    )
    t.add_argument(
        "--time-budget-min",
        type=float,
        help="stop starting new cells after this many minutes; the rest are reported 'not_run'",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--out", type=Path, help="JSON path; the .md table and .<mode>.png plots go beside it"
    )
    o.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    o.add_argument(
        "--peak-tflops",
        type=float,
        help="dense bf16 peak for MFU (default by device: H100/H200 989, B200 2250, GB200 2500)",
    )
    brun.add_run_options(o)
    return p


def make_config(args: argparse.Namespace, device: torch.device) -> Config:
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    arms = list(args.arms) if args.arms else default_arms()
    unknown = [a for a in arms if a not in KNOWN_ARMS and not a.startswith("vsa:")]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(KNOWN_ARMS)}, vsa:NAME")
    try:
        build_arms(arms)  # refuses malformed variant arms now rather than in the first cell
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    cfg = Config(
        seq_lens=list(pick("seq_lens")),
        sparsities=list(dict.fromkeys(args.sparsities)),
        block_shapes=list(dict.fromkeys(args.block_shapes)),
        modes=list(dict.fromkeys(args.modes)),
        arms=list(dict.fromkeys(arms)),
        batch=args.batch,
        heads=pick("heads"),
        head_dim=pick("head_dim"),
        dtype=brun.DTYPES[args.dtype],
        masks=args.masks,
        seed=args.seed,
        warmup=pick("warmup"),
        reps=pick("reps"),
        budget_s=pick("budget_s"),
        reference_max_seq=args.reference_max_seq,
        peak_tflops=args.peak_tflops,
        gate_max_seq=args.gate_max_seq,
        out=args.out,
        plots=not args.no_plots,
        pacing=args.pacing,
        time_budget_min=args.time_budget_min,
        replica_timeout_s=args.replica_timeout_s,
        partial_blocks=args.partial_blocks,
    )
    if not 0.0 <= cfg.partial_blocks <= 1.0:
        raise SystemExit(f"--partial-blocks must be in [0, 1], got {cfg.partial_blocks}")
    for s in cfg.seq_lens:
        for q_block, kv_block in cfg.block_shapes:
            if cfg.masks == "exact256" and (EXACT_BLOCK % q_block or EXACT_BLOCK % kv_block):
                raise SystemExit(
                    f"--masks exact256 needs block sizes that divide {EXACT_BLOCK}, got "
                    f"{q_block}x{kv_block}"
                )
            unit = EXACT_BLOCK if cfg.masks == "exact256" else math.lcm(q_block, kv_block)
            if s % unit:
                raise SystemExit(f"sequence length {s} must be a multiple of {unit}")
    return cfg


def default_arms() -> list[str]:
    extra = [f"vsa:{n}" for n in sorted(backend_entries()) if n not in VSA_BACKEND_ARMS]
    return [*KNOWN_ARMS, *extra]


# ---- masks ----------------------------------------------------------------------------------
def mask_seed(seed: int, seq_len: int, sparsity: float, block_shape: tuple[int, int]) -> int:
    return zlib.crc32(f"{seed}/{seq_len}/{sparsity!r}/{block_shape}".encode())


def sample_layout(
    seq_len: int,
    batch: int,
    heads: int,
    sparsity: float,
    block_shape: tuple[int, int],
    seed: int,
    partial: float = 0.0,
) -> BlockSparseLayout:
    """A random layout on the CPU: every query block keeps ``round((1 - sparsity) * NKV)`` key
    blocks (at least 1), always including the one holding its diagonal (its first query).
    ``partial``: that fraction of the key blocks (rounded down) gets a random valid size in
    1..block-1."""
    q_block, kv_block = block_shape
    num_q, num_kv = seq_len // q_block, seq_len // kv_block
    valid = torch.full((num_kv,), kv_block, dtype=torch.int32)
    if partial > 0:
        gen = torch.Generator().manual_seed(mask_seed(seed, seq_len, partial, block_shape) + 1)
        which = torch.randperm(num_kv, generator=gen)[: int(partial * num_kv)]
        valid[which] = torch.randint(1, kv_block, (len(which),), generator=gen, dtype=torch.int32)
    keep = max(1, min(num_kv, round((1 - sparsity) * num_kv)))
    if keep == num_kv:
        indices = torch.arange(num_kv, dtype=torch.int64).expand(batch, heads, num_q, num_kv)
    else:
        gen = torch.Generator().manual_seed(mask_seed(seed, seq_len, sparsity, block_shape))
        scores = torch.rand(batch, heads, num_q, num_kv, generator=gen)
        anchor = torch.arange(num_q) * q_block // kv_block
        scores[:, :, torch.arange(num_q), anchor] = 2.0  # above any uniform sample
        indices = torch.topk(scores, keep, dim=-1).indices
    return BlockSparseLayout.from_topk(indices, valid, block_shape)


def cell_layouts(
    cfg: Config, seq_len: int, sparsity: float
) -> tuple[dict[tuple[int, int], BlockSparseLayout], dict[tuple[int, int], tuple[Any, Any]]]:
    """Per block shape: its layout (on the CPU), and (reference key, layout the reference is
    computed from, or None for dense). exact256 shapes share one reference."""
    layouts: dict[tuple[int, int], BlockSparseLayout] = {}
    refs: dict[tuple[int, int], tuple[Any, Any]] = {}
    if cfg.masks == "exact256":
        base = sample_layout(
            seq_len, cfg.batch, cfg.heads, sparsity, (EXACT_BLOCK, EXACT_BLOCK), cfg.seed,
            cfg.partial_blocks,
        )  # fmt: skip
        for shape in cfg.block_shapes:
            layouts[shape] = base if shape == base.block_shape else base.refine(shape)
            refs[shape] = ("dense", None) if sparsity == 0 else (("exact256", sparsity), base)
        return layouts, refs
    for shape in cfg.block_shapes:
        layouts[shape] = sample_layout(
            seq_len, cfg.batch, cfg.heads, sparsity, shape, cfg.seed, cfg.partial_blocks
        )
        refs[shape] = (
            ("dense", None) if sparsity == 0 else (("native", sparsity, shape), layouts[shape])
        )
    return layouts, refs


def token_mask(layout: BlockSparseLayout) -> torch.Tensor:
    """[B, H, Sq, Skv] bool: the (query, real key) token pairs a layout selects (tests)."""
    blocks = layout.to_block_mask()
    tokens = blocks.repeat_interleave(layout.q_block, 2).repeat_interleave(layout.kv_block, 3)
    slot = torch.arange(layout.kv_block, device=layout.device)
    real = (slot < layout.kv_valid_sizes.view(-1, 1).to(layout.device)).reshape(-1)
    return tokens & real


# ---- arms -----------------------------------------------------------------------------------
@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    scale: float

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]


@dataclass
class Cell:
    seq_len: int
    mode: str
    sparsity: float | None  # None: a dense-baseline cell
    block_shape: tuple[int, int] | None
    layout: BlockSparseLayout | None
    total_pairs: int


class ArmRefused(Exception):
    """Raised by an arm's prepare when it cannot run a cell (reported as skipped)."""


class Arm:
    name = ""
    dense = False

    def unavailable(self, device: torch.device) -> str | None:
        """Why this arm cannot run at all on ``device`` (checked once), or None."""
        return None

    def refuse(self, cfg: Config, inputs: Inputs, cell: Cell) -> str | None:
        """Why this arm cannot run ``cell``, or None."""
        return None

    def prepare(self, inputs: Inputs, cell: Cell) -> bt.Runner:
        raise NotImplementedError

    def classify_error(self, exc: BaseException) -> str | None:
        """A skip reason when ``exc`` is a refusal rather than a failure, else None."""
        return None


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


def _bshd_view(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


class VsaBackendArm(Arm):
    """``vsa_core.block_sparse_attn(..., backend=NAME)``."""

    def __init__(self, backend: str, arm_name: str | None = None) -> None:
        self.backend_name = backend
        self.run_backend = backend  # the registry name the op is called with
        self.name = arm_name or backend
        self.backend: Any = None

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around every call of the op (a variant arm's settings)."""
        return contextlib.nullcontext()

    def unavailable(self, device: torch.device) -> str | None:
        try:
            self.backend = get_backend(self.backend_name)
        except ValueError as exc:
            return str(exc)
        return None

    def refuse(self, cfg: Config, inputs: Inputs, cell: Cell) -> str | None:
        if self.backend_name == "reference" and cell.seq_len > cfg.reference_max_seq:
            return (
                f"the reference runs only at S <= {cfg.reference_max_seq} "
                "(--reference-max-seq): it is a correctness arm, not a fast one"
            )
        assert cell.block_shape is not None
        call = AttentionCall(
            device=inputs.device,
            dtype=inputs.dtype,
            head_dim=inputs.head_dim,
            block_shape=cell.block_shape,
            requires_grad=cell.mode != "fwd",
        )
        return self.backend.supports(call)

    def prepare(self, inputs: Inputs, cell: Cell) -> bt.Runner:
        layout, name, scale = cell.layout, self.run_backend, inputs.scale

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with self.context():
                return block_sparse_attn(q, k, v, layout, backend=name, scale=scale)[0]

        leaves = bt.make_leaves((inputs.q, inputs.k, inputs.v), cell.mode, lambda t: t)
        return bt.autograd_runner(forward, leaves, inputs.dout, cell.mode)


class Fa4VariantArm(VsaBackendArm):
    """``vsa:fa4+OPTION[+OPTION]``: the fa4 backend with the fork's experimental forward kernels
    (``vsa_fa4.launch.ForwardVariant``) where they fit, the shipped ones elsewhere: the op is
    called with ``backend=`` an fa4 backend carrying the variant
    (``vsa_fa4.backend.variant_backend``)."""

    def __init__(self, arm_name: str) -> None:
        from vsa_fa4 import launch

        backend, *options = arm_name.removeprefix("vsa:").split("+")
        try:
            if backend != "fa4":
                raise ValueError(f"the backend must be fa4, got {backend!r}")
            self.variant = launch.ForwardVariant.from_names(options)
        except ValueError as exc:
            raise ValueError(
                f"a variant arm is vsa:fa4+OPTION[+OPTION]; got {arm_name!r}: {exc}"
            ) from None
        super().__init__("fa4", arm_name=arm_name)
        from vsa_fa4.backend import variant_backend

        self.run_backend = variant_backend(self.variant)


def cuda_only(device: torch.device, what: str) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device ({what}); running on {device.type}"
    return None


def fa4_block_sparse_tensors(
    tensor_cls: Any, layout: BlockSparseLayout, need_backward: bool
) -> tuple[Any, Any]:
    """FA4 ``BlockSparseTensorsTorch`` for forward (per query block: key blocks) and backward
    (per key block: query blocks). Every selected block is full (no partial key block here), so
    the lists go in the "full" slots and the "mask" lists (mask_mod blocks) are empty."""
    device = layout.device

    def pack(counts: torch.Tensor, indices: torch.Tensor) -> Any:
        counts = counts.to(torch.int32).contiguous()
        return tensor_cls(
            mask_block_cnt=torch.zeros_like(counts),
            mask_block_idx=torch.zeros((*counts.shape, 1), dtype=torch.int32, device=device),
            full_block_cnt=counts,
            full_block_idx=indices.to(torch.int32).contiguous(),
            block_size=tuple(layout.block_shape),
        )

    if bool((layout.kv_valid_sizes < layout.kv_block).any()):
        raise ArmRefused("partial key blocks would need a mask_mod; not wired in this harness")
    forward = pack(layout.kv_counts, layout.kv_indices)
    backward = None
    if need_backward:
        q_indices, q_counts = layout.kv_to_q.to_padded()
        backward = pack(q_counts, q_indices)
    return forward, backward


class Fa4RawArm(Arm):
    """Upstream FA4 ``_flash_attn_fwd`` / ``_flash_attn_bwd`` with prebuilt block-sparse tensors."""

    name = "fa4_raw"

    def unavailable(self, device: torch.device) -> str | None:
        reason = cuda_only(device, "upstream FA4 CuTe kernels")
        if reason:
            return reason
        try:
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
            from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
        except Exception as exc:
            return f"flash_attn.cute (flash-attn-4) not importable: {brep.error_text(exc, 300)}"
        self.fwd, self.bwd = _flash_attn_fwd, _flash_attn_bwd
        self.tensor_cls = BlockSparseTensorsTorch
        self.capability = torch.cuda.get_device_capability(device)
        self.version = brep.distribution_versions(["flash-attn-4"])["flash-attn-4"]
        return None

    def refuse(self, cfg: Config, inputs: Inputs, cell: Cell) -> str | None:
        assert cell.block_shape is not None
        kv_block = cell.block_shape[1]
        if cell.mode != "fwd" and self.capability[0] == 9 and kv_block not in (64, 128):
            return (
                f"upstream FA4 {self.version} sm_90 backward refuses {kv_block}-token KV blocks "
                "(Block sparsity expects sparse_block_size[1]=128)"
            )
        return None

    def kv64_backward(self, layout: BlockSparseLayout) -> tuple[Any, Any] | None:
        """On sm_90 upstream refuses KV64 backward: the fork's kernels (64x64 and 128x64
        blocks) and their tensors."""
        if self.capability[0] != 9 or layout.kv_block != 64:
            return None
        from flash_attn_vsa.bwd_sm90 import block_sparse_backward_kv64

        return block_sparse_backward_kv64, fa4_block_sparse_tensors(self.tensor_cls, layout, True)[
            1
        ]

    def classify_error(self, exc: BaseException) -> str | None:
        msg = str(exc)
        refusal = ("sparse_block_size", "Block sparsity", "block sparsity", "BLOCK_SIZE")
        if isinstance(exc, (ValueError, AssertionError, NotImplementedError)) and any(
            s in msg for s in refusal
        ):
            return f"upstream FA4 refuses: {brep.first_line(msg, 300)}"
        return None

    def prepare(self, inputs: Inputs, cell: Cell) -> bt.Runner:
        assert cell.layout is not None
        fwd_t, bwd_t = fa4_block_sparse_tensors(
            self.tensor_cls, cell.layout, need_backward=cell.mode != "fwd"
        )
        q, k, v, dout, scale = inputs.q, inputs.k, inputs.v, inputs.dout, inputs.scale
        fwd, bwd = self.fwd, self.bwd
        info = {"block_size": list(cell.layout.block_shape)}
        fork = self.kv64_backward(cell.layout) if cell.mode != "fwd" else None
        if fork is not None:
            fork_bwd, bwd_t = fork
            info["backward"] = "flash_attn_vsa.bwd_sm90 (upstream refuses KV64)"

            def bwd(q, k, v, out, dout, lse, softmax_scale, block_sparse_tensors):
                return fork_bwd(q, k, v, out, dout, lse, block_sparse_tensors,
                                softmax_scale=softmax_scale)  # fmt: skip

        def forward(return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
            res = fwd(
                q, k, v, softmax_scale=scale, block_sparse_tensors=fwd_t, return_lse=return_lse
            )
            return res[0], res[1]

        def backward(out: torch.Tensor, lse: torch.Tensor) -> dict[str, torch.Tensor]:
            grads = bwd(q, k, v, out, dout, lse, softmax_scale=scale, block_sparse_tensors=bwd_t)
            dq, dk, dv = grads[:3]
            return {"dq": dq, "dk": dk, "dv": dv}

        if cell.mode == "fwd":
            return bt.Runner(lambda _: {"out": forward(False)[0]}, info=info)
        if cell.mode == "bwd":
            out, lse = forward(True)
            assert lse is not None
            return bt.Runner(lambda _: backward(out, lse), info=info)

        def run_both(_: Any) -> dict[str, torch.Tensor]:
            out, lse = forward(True)
            assert lse is not None
            return {"out": out, **backward(out, lse)}

        return bt.Runner(run_both, info=info)


class Fa4DenseArm(Arm):
    """FA4 ``flash_attn_func``, dense."""

    name = "fa4_dense"
    dense = True

    def unavailable(self, device: torch.device) -> str | None:
        reason = cuda_only(device, "FA4 CuTe kernels")
        if reason:
            return reason
        try:
            from flash_attn.cute import flash_attn_func
        except Exception as exc:
            return f"flash_attn.cute (flash-attn-4) not importable: {brep.error_text(exc, 300)}"
        self.fn = flash_attn_func
        return None

    def prepare(self, inputs: Inputs, cell: Cell) -> bt.Runner:
        fn, scale = self.fn, inputs.scale

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _first(fn(q, k, v, softmax_scale=scale))

        leaves = bt.make_leaves((inputs.q, inputs.k, inputs.v), cell.mode, lambda t: t)
        return bt.autograd_runner(forward, leaves, inputs.dout, cell.mode)


def raise_dynamo_limits() -> None:
    """Every (sequence length, block shape, mode) is a new graph: keep dynamo from falling back
    to eager FlexAttention after its default 8 recompilations."""
    import torch._dynamo.config as dynamo_config

    for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), value))
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(
            dynamo_config.accumulated_recompile_limit, 4096
        )


def flex_block_mask(layout: BlockSparseLayout, eager: bool = False) -> Any:
    """A FlexAttention ``BlockMask`` selecting exactly the layout's token pairs.

    Without partial key blocks every selected block is a "full" block and the compiled kernel
    never evaluates a mask_mod, so none is given (one fixed function: no recompilation per
    mask). With partial key blocks, or for ``eager`` FlexAttention (which ignores the block
    lists and applies only the mask_mod), the mask_mod states the whole selection.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, heads, num_q, width = layout.kv_indices.shape
    num_kv = layout.num_kv_blocks
    indices = torch.zeros(batch, heads, num_q, num_kv, dtype=torch.int32, device=layout.device)
    used = min(width, num_kv)
    indices[..., :used] = layout.kv_indices[..., :used].to(torch.int32)
    counts = layout.kv_counts.to(torch.int32).contiguous()
    lengths = (layout.q_len, layout.kv_len)
    q_block, kv_block = layout.block_shape
    selected = layout.to_block_mask()
    valid = layout.kv_valid_sizes.to(torch.int32)

    def in_layout(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = kv_idx // kv_block
        return selected[b, h, q_idx // q_block, block] & ((kv_idx % kv_block) < valid[block])

    if not bool((layout.kv_valid_sizes < kv_block).any()):
        return BlockMask.from_kv_blocks(
            torch.zeros_like(counts),
            torch.zeros_like(indices),
            counts,
            indices,
            BLOCK_SIZE=tuple(layout.block_shape),
            mask_mod=in_layout if eager else None,
            seq_lengths=lengths,
        )
    return BlockMask.from_kv_blocks(
        counts,
        indices,
        BLOCK_SIZE=tuple(layout.block_shape),
        mask_mod=in_layout,
        seq_lengths=lengths,
    )


class FlexArm(Arm):
    """PyTorch FlexAttention with the layout's BlockMask, compiled (Triton backend)."""

    name = "flex"

    def __init__(self, compile: bool = True, allow_cpu: bool = False) -> None:
        self.compile, self.allow_cpu = compile, allow_cpu

    def unavailable(self, device: torch.device) -> str | None:
        if not self.allow_cpu:
            reason = cuda_only(device, "FlexAttention is benchmarked compiled, on the GPU")
            if reason:
                return reason
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except Exception as exc:
            return f"torch.nn.attention.flex_attention not importable: {brep.error_text(exc, 300)}"
        if self.compile:
            raise_dynamo_limits()
            self.fn = torch.compile(flex_attention, dynamic=False)
        else:
            self.fn = flex_attention
        return None

    def prepare(self, inputs: Inputs, cell: Cell) -> bt.Runner:
        assert cell.layout is not None
        layout = cell.layout
        block_mask = flex_block_mask(layout, eager=not self.compile)
        options: dict[str, Any] | None = None
        if inputs.device.type == "cuda":
            options = {"BACKEND": "TRITON"}
            if layout.q_block < 128 or layout.kv_block < 64:
                # The default forward tile (128 x 64 on sm_90) must divide the sparse blocks.
                options["fwd_BLOCK_M"] = min(64, layout.q_block)
                options["fwd_BLOCK_N"] = min(64, layout.kv_block)
        fn, scale = self.fn, inputs.scale

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return fn(q, k, v, block_mask=block_mask, scale=scale, kernel_options=options)

        leaves = bt.make_leaves((inputs.q, inputs.k, inputs.v), cell.mode, _bhsd)
        runner = bt.autograd_runner(forward, leaves, _bhsd(inputs.dout), cell.mode, _bshd_view)
        runner.info = {"kernel_options": options, "compiled": self.compile}
        return runner


class SdpaArm(Arm):
    """torch SDPA, dense: cuDNN attention, else the flash backend (CPU tests: math)."""

    name = "sdpa"
    dense = True

    def __init__(self, allow_cpu: bool = False) -> None:
        self.allow_cpu = allow_cpu

    def unavailable(self, device: torch.device) -> str | None:
        if not self.allow_cpu:
            return cuda_only(device, "cuDNN / flash SDPA")
        return None

    def prepare(self, inputs: Inputs, cell: Cell) -> bt.Runner:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if inputs.device.type == "cuda":
            candidates = [
                ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("flash", SDPBackend.FLASH_ATTENTION),
            ]
        else:
            candidates = [("math", SDPBackend.MATH)]
        leaves = bt.make_leaves((inputs.q, inputs.k, inputs.v), cell.mode, _bhsd)
        dout, scale = _bhsd(inputs.dout), inputs.scale
        failures: list[str] = []
        for label, backend in candidates:

            def forward(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _b: Any = backend
            ) -> torch.Tensor:
                with sdpa_kernel([_b]):
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)

            runner = bt.autograd_runner(forward, leaves, dout, cell.mode, _bshd_view)
            try:
                runner.once()
                bt.synchronize(inputs.device)
            except Exception as exc:
                failures.append(f"{label}: {brep.error_text(exc, 300)}")
                brun.recover_after_error(inputs.device)
                continue
            runner.info = {"sdpa_backend": label}
            if failures:
                runner.info["fallback_from"] = failures
            return runner
        raise RuntimeError("no SDPA backend ran: " + "; ".join(failures))


def build_arms(names: Sequence[str]) -> list[Arm]:
    arms: list[Arm] = []
    for name in names:
        if name in VSA_BACKEND_ARMS:
            arms.append(VsaBackendArm(name))
        elif name.startswith("vsa:") and "+" in name:
            arms.append(Fa4VariantArm(name))
        elif name.startswith("vsa:"):
            arms.append(VsaBackendArm(name[4:], arm_name=name))
        elif name == "fa4_raw":
            arms.append(Fa4RawArm())
        elif name == "flex":
            arms.append(FlexArm())
        elif name == "fa4_dense":
            arms.append(Fa4DenseArm())
        elif name == "sdpa":
            arms.append(SdpaArm())
        else:
            raise ValueError(f"unknown arm {name!r}")
    return arms


# ---- the run --------------------------------------------------------------------------------
def make_inputs(cfg: Config, seq_len: int, device: torch.device) -> Inputs:
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + seq_len)
    shape = (cfg.batch, seq_len, cfg.heads, cfg.head_dim)
    q, k, v, dout = (
        torch.randn(shape, generator=gen).to(device=device, dtype=cfg.dtype) for _ in range(4)
    )
    return Inputs(q, k, v, dout, cfg.head_dim**-0.5)


def base_record(cfg: Config, cell: Cell, arm: Arm) -> dict[str, Any]:
    full = cfg.batch * cfg.heads * cell.seq_len * cell.seq_len
    return {
        "seq_len": cell.seq_len,
        "mode": cell.mode,
        "sparsity": cell.sparsity,
        "sparsity_label": sparsity_label(cell.sparsity),
        "block_shape": block_label(cell.block_shape),
        "arm": arm.name,
        "kind": "dense" if arm.dense else "sparse",
        "batch": cfg.batch,
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "dtype": brun.DTYPE_NAMES[cfg.dtype],
        "total_pairs": cell.total_pairs,
        "kept_fraction": cell.total_pairs / full,
        "status": None,
    }


def run_cell(
    cfg: Config,
    arm: Arm,
    cell: Cell,
    inputs: Inputs,
    reference: Callable[[], dict[str, torch.Tensor]],
    arm_unavailable: str | None,
    announce: Callable[[], None] | None = None,
    pacer: bt.Runner | None = None,
) -> dict[str, Any]:
    """Gate, then time, one arm on one cell; every failure is caught and reported. With a
    ``pacer`` (fa4_dense's runner of the same length and mode, `--pacing dense`) the arm is
    timed alternating with it, and the pacer's times from those rounds are recorded as
    ``paced_dense_*``."""
    rec = base_record(cfg, cell, arm)
    device = inputs.device
    reason = arm_unavailable
    if reason is None:
        try:
            reason = arm.refuse(cfg, inputs, cell)
        except Exception as exc:
            reason = f"could not ask the arm: {brep.error_text(exc)}"
    if reason is not None:
        rec.update(status="skipped", reason=reason)
        return rec
    if announce is not None:
        announce()
    runner = None
    try:
        gated = cfg.gate_max_seq is None or cell.seq_len <= cfg.gate_max_seq
        ref = reference() if gated else None
        runner = arm.prepare(inputs, cell)
        rec["info"] = runner.info
        outputs = runner.once()
        bt.synchronize(device)
        wanted = {"fwd": ("out",), "bwd": ("dq", "dk", "dv")}.get(
            cell.mode, ("out", "dq", "dk", "dv")
        )
        missing = [n for n in wanted if n not in outputs]
        if missing:
            gate = bref.GateResult(False, reason=f"missing outputs {missing}")
        elif ref is None:
            gate = None
            rec["ungated"] = f"S={cell.seq_len} > --gate-max-seq {cfg.gate_max_seq}"
        else:
            gate = bref.gate_check({n: outputs[n] for n in wanted}, ref, inputs.dtype)
        del outputs
        if gate is not None:
            rec["gate"] = gate.as_dict()
            if not gate.passed:
                rec.update(status="failed", reason=f"correctness gate: {gate.reason}")
                return rec
        if pacer is None:
            timing = bt.time_runner(runner, device, cfg)
        else:
            timing, dense = bt.time_paced(runner, pacer, device, cfg)
            rec.update(
                paced_dense_median_ms=dense.median_ms,
                paced_dense_times_ms=dense.times_ms,
                paced_dense_pairs=cfg.batch * cfg.heads * cell.seq_len**2,
            )
        rec.update(timing.as_dict())
        rec["peak_mem_mib"] = bt.peak_extra_mib(runner.once, device)
        rec["status"] = "ok"
    except ArmRefused as exc:
        rec.update(status="skipped", reason=str(exc))
    except Exception as exc:
        skip = arm.classify_error(exc)
        if skip is not None:
            rec.update(status="skipped", reason=skip)
        else:
            rec.update(status="error", **brep.error_fields(exc))
        brun.recover_after_error(device)
    finally:
        del runner
    return rec


def derive_metrics(results: list[dict[str, Any]], peak: float | None) -> None:
    """TFLOP/s, MFU and efficiency vs dense FA4 (same sequence length and mode), in place. A
    paced arm is compared with dense FA4's times from its own rounds (``paced_dense_median_ms``),
    others with dense FA4's own cell."""
    dense: dict[tuple[int, str], dict[str, Any]] = {}
    for r in results:
        if r.get("status") == "ok" and isinstance(r.get("median_ms"), (int, float)):
            r["tflops"] = brep.tflops(r["head_dim"], r["total_pairs"], r["mode"], r["median_ms"])
            r["mfu"] = r["tflops"] / peak if peak else None
            if r["arm"] == "fa4_dense":
                dense[(r["seq_len"], r["mode"])] = r
    for r in results:
        base = dense.get((r["seq_len"], r["mode"]))
        if r.get("status") != "ok" or "tflops" not in r:
            continue
        if "paced_dense_median_ms" in r:
            dense_ms = r["paced_dense_median_ms"]
            dense_pairs = r["paced_dense_pairs"]
        elif base is not None:
            dense_ms, dense_pairs = base["median_ms"], base["total_pairs"]
        else:
            continue
        dense_tflops = brep.tflops(r["head_dim"], dense_pairs, r["mode"], dense_ms)
        r["efficiency_vs_fa4_dense"] = r["tflops"] / dense_tflops
        r["speedup_vs_fa4_dense"] = dense_ms / r["median_ms"]


def plan_cells(cfg: Config, arms: Sequence[Arm]) -> int:
    sparse = sum(1 for a in arms if not a.dense)
    dense = len(arms) - sparse
    per_s = len(cfg.modes) * (dense + sparse * len(cfg.sparsities) * len(cfg.block_shapes))
    return per_s * len(cfg.seq_lens)


def run_benchmark(
    cfg: Config,
    device: torch.device,
    arms: Sequence[Arm],
    *,
    replica: brun.Replica | None = None,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    torch.manual_seed(cfg.seed)
    unavailable = {}
    for arm in arms:
        try:
            unavailable[arm.name] = arm.unavailable(device)
        except Exception as exc:
            unavailable[arm.name] = f"availability check failed: {brep.error_text(exc)}"
        if unavailable[arm.name]:
            brun.log(f"arm {arm.name}: unavailable: {unavailable[arm.name]}", replica=replica)
    total = plan_cells(cfg, arms)
    done = 0
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    need_grads = any(m != "fwd" for m in cfg.modes)

    def record(rec: dict[str, Any], label: str) -> None:
        nonlocal done
        done += 1
        results.append(rec)
        status = rec["status"]
        if status == "ok":
            flops = brep.tflops(rec["head_dim"], rec["total_pairs"], rec["mode"], rec["median_ms"])
            detail = f"{rec['median_ms']:.3f} ms, {fmt_tflops(flops)} TFLOP/s"
        elif status == "failed":
            detail = rec["reason"]
        else:
            detail = brep.first_line(rec.get("reason"), 200)
        brun.log(f"[{done}/{total}] {label}: {status}: {detail}", replica=replica)
        if on_result is not None:
            on_result(results)

    def run_one(
        arm: Arm, cell: Cell, inputs: Inputs, ref: Callable[[], Any], pacer: Any = None
    ) -> None:
        label = (
            f"S={cell.seq_len} {cell.mode} {sparsity_label(cell.sparsity)} "
            f"{block_label(cell.block_shape) or '-'} {arm.name}"
        )
        if brun.budget_spent(cfg.time_budget_min, started):
            rec = base_record(cfg, cell, arm)
            brun.mark_not_run(rec, cfg.time_budget_min)
        else:

            def announce() -> None:
                brun.log(f"[{done + 1}/{total}] {label} ...", replica=replica)

            rec = run_cell(cfg, arm, cell, inputs, ref, unavailable[arm.name], announce, pacer)
        record(rec, label)

    for seq_len in cfg.seq_lens:
        inputs = make_inputs(cfg, seq_len, device)
        refs = References(inputs, need_grads, replica)
        dense_pairs = cfg.batch * cfg.heads * seq_len * seq_len
        pacers: dict[str, bt.Runner] = {}  # mode -> fa4_dense's runner (--pacing dense)
        for mode in cfg.modes:
            for arm in arms:
                if arm.dense:
                    cell = Cell(seq_len, mode, None, None, None, dense_pairs)
                    run_one(arm, cell, inputs, refs.getter("dense", None))
                    paces = arm.name == "fa4_dense" and cfg.pacing == "dense"
                    if paces and results[-1]["status"] == "ok":
                        pacers[mode] = arm.prepare(inputs, cell)
        for sparsity in cfg.sparsities:
            layouts, ref_specs = cell_layouts(cfg, seq_len, sparsity)
            layouts = {shape: lay.to(device) for shape, lay in layouts.items()}
            pairs = {shape: int(lay.selected_token_pairs()) for shape, lay in layouts.items()}
            for mode in cfg.modes:
                for shape in cfg.block_shapes:
                    ref = refs.getter(*ref_specs[shape])
                    cell = Cell(seq_len, mode, sparsity, shape, layouts[shape], pairs[shape])
                    for arm in arms:
                        if not arm.dense:
                            run_one(arm, cell, inputs, ref, pacers.get(mode))
            refs.keep_only("dense")
        refs.keep_only(None)
        del inputs, pacers
        brun.recover_after_error(device)
    return results


class References:
    """The float32 references of one sequence length, computed on first use and cached."""

    def __init__(self, inputs: Inputs, need_grads: bool, replica: brun.Replica | None) -> None:
        self.inputs, self.need_grads, self.replica = inputs, need_grads, replica
        self.cache: dict[Any, dict[str, torch.Tensor]] = {}

    def getter(
        self, key: Any, layout: BlockSparseLayout | None
    ) -> Callable[[], dict[str, torch.Tensor]]:
        return lambda: self.get(key, layout)

    def get(self, key: Any, layout: BlockSparseLayout | None) -> dict[str, torch.Tensor]:
        if key not in self.cache:
            inputs = self.inputs
            device = inputs.device
            brun.log(f"float32 reference S={inputs.q.shape[1]} {key}", replica=self.replica)
            lay = None if layout is None else layout.to(device)
            self.cache[key] = bref.masked_attention_reference(
                inputs.q,
                inputs.k,
                inputs.v,
                inputs.scale,
                block_mask=None if lay is None else lay.to_block_mask(),
                block_shape=None if lay is None else lay.block_shape,
                kv_valid_sizes=None if lay is None else lay.kv_valid_sizes,
                dout=inputs.dout if self.need_grads else None,
                chunk_bytes=(2 << 30) if device.type == "cuda" else (256 << 20),
            )
        return self.cache[key]

    def keep_only(self, key: Any) -> None:
        for k in [k for k in self.cache if k != key]:
            del self.cache[k]


# ---- reporting ------------------------------------------------------------------------------
def fmt_tflops(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.1f}"
    return f"{x:.3g}"


STATUS_MARK = {"failed": "FAIL", "error": "ERR", "skipped": "-", "not_run": "n/r"}


def partial_text(partial: float | None) -> str:
    """The header's note on partial key blocks (nothing when all are full)."""
    return f", {partial:.0%} of the sampled key blocks partial" if partial else ""


def render_markdown(doc: dict[str, Any]) -> str:
    meta, cfg, results = doc["metadata"], doc["config"], doc["results"]
    dev = meta["device"]
    peak = doc.get("peak_tflops")
    arms = list(dict.fromkeys(r["arm"] for r in results))
    lines = [
        "# bench_vsa: block-sparse attention kernels",
        "",
        f"- device: {dev.get('name')} ({dev.get('type')}"
        + (f", sm_{dev['capability'].replace('.', '')}" if dev.get("capability") else "")
        + f"), driver {meta['driver'].get('driver_version')}",
        f"- date (UTC): {meta['date_utc']}; seed {meta['seed']}",
        f"- command: `{meta['command']}`",
        f"- B={cfg['batch']}, H={cfg['heads']}, D={cfg['head_dim']}, {cfg['dtype']}; "
        f"masks: {cfg['masks']}{partial_text(cfg.get('partial_blocks'))}",
        "- cells: sparse-aware TFLOP/s = 4*B*H*D*(selected pairs per head) / median time "
        "(x2.5 bwd, x3.5 fwd+bwd); - skipped, FAIL correctness gate, ERR exception, n/r not run"
        + (f"; MFU = TFLOP/s / {peak:g}" if peak else ""),
    ]
    if meta.get("replica"):
        lines.append(
            f"- aggregate of {doc.get('replicas_found', '?')} replicas: medians over ranks"
        )
    index = {tuple(r.get(f) for f in KEY_FIELDS): r for r in results}

    def cell_text(r: dict[str, Any] | None, value: str) -> str:
        if r is None:
            return ""
        if r["status"] == "ok" and value in r:
            v = r[value]
            return fmt_tflops(v) if value == "tflops" else f"{v:.2f}"
        return STATUS_MARK.get(r["status"], r["status"] or "?") if r["status"] != "ok" else ""

    def table(value: str) -> str:
        rows = []
        for s in cfg["seq_lens"]:
            for mode in cfg["modes"]:
                row = [s, mode, "dense kernel", "-"]
                row += [cell_text(index.get((s, mode, None, None, a)), value) for a in arms]
                if any(row[4:]):
                    rows.append(row)
                for sp in cfg["sparsities"]:
                    for shape in cfg["block_shapes"]:
                        row = [s, mode, sparsity_label(sp), shape]
                        row += [cell_text(index.get((s, mode, sp, shape, a)), value) for a in arms]
                        if any(row[4:]):
                            rows.append(row)
        return brep.markdown_table(["S", "mode", "sparsity", "block", *arms], rows)

    lines += ["", "## TFLOP/s (sparse-aware)", "", table("tflops")]
    if any("efficiency_vs_fa4_dense" in r for r in results):
        paced = any("paced_dense_median_ms" in r for r in results)
        how = ", dense timed alternating with each arm (--pacing dense)" if paced else ""
        lines += [
            "",
            f"## Efficiency vs dense FA4 (TFLOP/s ratio, same S and mode{how})",
            "",
            table("efficiency_vs_fa4_dense"),
        ]
    if peak and any(r.get("mfu") for r in results):
        lines += ["", f"## MFU (vs {peak:g} TFLOP/s dense bf16 peak)", "", table("mfu")]
    notes: dict[tuple[str, str, str], int] = {}
    for r in results:
        if r["status"] in ("skipped", "error", "not_run"):
            key = (r["arm"], r["status"], brep.first_line(r.get("reason"), 300))
            notes[key] = notes.get(key, 0) + 1
    failed = [r for r in results if r["status"] == "failed"]
    ungated = sorted({r["ungated"] for r in results if r.get("ungated")})
    if notes or failed or ungated:
        lines += ["", "## Notes", ""]
        for why in ungated:
            lines.append(f"- timed without the correctness gate: {why}")
        for (arm, status, reason), count in notes.items():
            lines.append(f"- `{arm}` {status} in {count} cell(s): {reason}")
        for r in failed[:50]:
            gate = r.get("gate") or {}
            summary = bref.GateResult(False, gate.get("tensors", {})).summary()
            lines.append(
                f"- `{r['arm']}` FAILED the gate at S={r['seq_len']} {r['mode']} "
                f"{r['sparsity_label']} {r['block_shape']}: {summary}"
            )
    plots = doc.get("plots")
    if isinstance(plots, dict) and plots.get("skipped"):
        lines += ["", f"Plots skipped: {plots['skipped']}"]
    return "\n".join(lines) + "\n"


def write_plots(doc: dict[str, Any], out: Path) -> dict[str, Any]:
    plt, why = brep.load_pyplot()
    if plt is None:
        return {"skipped": why}
    cfg, results = doc["config"], doc["results"]
    dev = doc["metadata"]["device"].get("name")
    written = []
    markers = ["o", "s", "^", "v", "D", "P", "X", "*"]
    shape_marker = {s: markers[i % len(markers)] for i, s in enumerate(cfg["block_shapes"])}
    arms = list(dict.fromkeys(r["arm"] for r in results))
    colors = {a: f"C{i % 10}" for i, a in enumerate(arms)}
    for mode in cfg["modes"]:
        seqs = cfg["seq_lens"]
        fig, axes = plt.subplots(1, len(seqs), figsize=(6 * len(seqs), 4.5), squeeze=False)
        drew = False
        for ax, s in zip(axes[0], seqs, strict=True):
            ok = [r for r in results if r["seq_len"] == s and r["mode"] == mode and "tflops" in r]
            for arm in arms:
                for r in ok:
                    if r["arm"] == arm and r["kind"] == "dense":
                        ax.axhline(r["tflops"], color=colors[arm], ls="--", label=f"{arm} (dense)")
                        drew = True
                for shape in cfg["block_shapes"]:
                    pts = sorted(
                        (r["sparsity"] * 100, r["tflops"])
                        for r in ok
                        if r["arm"] == arm and r["block_shape"] == shape
                    )
                    if pts:
                        xs, ys = zip(*pts, strict=True)
                        ax.plot(
                            xs,
                            ys,
                            marker=shape_marker[shape],
                            color=colors[arm],
                            label=f"{arm} {shape}",
                        )
                        drew = True
            ax.set_title(f"S={s}, {mode}")
            ax.set_xlabel("sparsity (% of key blocks skipped)")
            ax.set_ylabel("TFLOP/s (sparse-aware)")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle(f"bench_vsa on {dev}: {mode}")
        fig.tight_layout()
        if drew:
            path = out.with_name(f"{out.stem}.{brun.mode_slug(mode)}.png")
            fig.savefig(path, dpi=120)
            written.append(str(path))
        plt.close(fig)
    return {"files": written}


def finish_doc(doc: dict[str, Any], out: Path | None, want_plots: bool) -> str:
    """Derived metrics, plots, markdown; writes JSON and .md when ``out`` is set."""
    derive_metrics(doc["results"], doc.get("peak_tflops"))
    if out is not None and want_plots:
        try:
            doc["plots"] = write_plots(doc, out)
        except Exception as exc:  # a plot must never cost the results
            doc["plots"] = {"skipped": f"plotting failed: {brep.error_text(exc, 300)}"}
        if doc["plots"].get("skipped"):
            print(f"bench_vsa: plots skipped: {doc['plots']['skipped']}", file=sys.stderr)
    elif want_plots:
        doc["plots"] = {"skipped": "no --out given"}
    text = render_markdown(doc)
    if out is not None:
        brep.write_json_and_markdown(out, doc, text)
    return text


def main(argv: Sequence[str] | None = None, arms: Sequence[Arm] | None = None) -> int:
    args = build_parser().parse_args(argv)
    replica = brun.replica_from_env()
    device = brun.pick_device(args.device, replica)
    cfg = make_config(args, device)
    arm_objs = list(arms) if arms is not None else build_arms(cfg.arms)
    cfg.arms = [a.name for a in arm_objs]
    started_unix = time.time()
    command = sys.argv if argv is None else ["bench_vsa.py", *argv]
    meta = brep.collect_metadata(device, seed=cfg.seed, argv=command, replica=replica)
    peak = brep.peak_tflops_for(meta["device"].get("name"), cfg.peak_tflops)
    doc = brun.result_doc(
        "bench_vsa",
        started_unix=started_unix,
        metadata=meta,
        config=cfg.as_dict(),
        peak_tflops=peak if device.type == "cuda" or cfg.peak_tflops else None,
    )
    # A replica's own report (rank 0 without --out) has no plots, not even a skip note.
    want_plots = cfg.plots and (replica is None or cfg.out is not None)

    def on_aggregate(
        agg: dict[str, Any], docs: dict[int, dict[str, Any]], missing: list[int]
    ) -> None:
        agg["rank_devices"] = {str(r): d["metadata"]["device"] for r, d in docs.items()}
        if missing:
            brun.log(
                f"aggregate without ranks {missing} (no complete file in time)", replica=replica
            )

    brun.log(
        f"bench_vsa on {meta['device'].get('name')} ({device}); arms: {', '.join(cfg.arms)}",
        replica=replica,
    )
    return brun.run_and_report(
        doc,
        lambda checkpoint: run_benchmark(
            cfg, device, arm_objs, replica=replica, on_result=checkpoint
        ),
        lambda d, out: finish_doc(d, out, want_plots),
        out=cfg.out,
        replica=replica,
        replica_timeout_s=cfg.replica_timeout_s,
        key_fields=KEY_FIELDS,
        value_fields=VALUE_FIELDS,
        drop_fields=("tflops", "mfu", "efficiency_vs_fa4_dense", "speedup_vs_fa4_dense"),
        before_rank_write=lambda d: derive_metrics(d["results"], d["peak_tflops"]),
        on_aggregate=on_aggregate,
    )


if __name__ == "__main__":
    sys.exit(main())

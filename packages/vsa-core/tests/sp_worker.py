"""One rank of the sequence-parallel VSA checks (`vsa_core.distributed`); not a pytest module.

Every rank builds the same full inputs, runs the single-process `video_sparse_attn` on them
(the reference), then runs `sequence_parallel_video_sparse_attn` on its own shard and compares
its shard of the output and of the q, k, v and gate gradients with the reference's. Mismatches
are collected, not raised, so that every rank makes the same collective calls to the end; the
process exits 1 if any check failed and prints ``rank R: OK`` otherwise.

CPU, gloo (what tests/test_distributed.py launches, one process per rank)::

    python sp_worker.py --init-file /tmp/store --rank 0 --world-size 2 &
    python sp_worker.py --init-file /tmp/store --rank 1 --world-size 2

GPUs, NCCL, bf16 against the single-GPU op (what tests/test_distributed_gpu.py launches);
``--suite gpu`` means CUDA and NCCL unless ``--device cpu`` says otherwise::

    torchrun --standalone --nproc-per-node=2 sp_worker.py --suite gpu

Each rank's first line says what runs: ``rank R: <process-group backend>, world W, <device>,
backend <fine backend>`` (e.g. ``rank 0: nccl, world 2, cuda:0, backend auto``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.backends import AttentionCall, select_backend
from vsa_core.distributed import (
    gather_sequence,
    heads_to_seq,
    seq_to_heads,
    sequence_parallel_video_sparse_attn,
    shard_sequence,
)


@dataclass(frozen=True)
class Case:
    name: str
    latent: tuple[int, int, int]
    heads: int
    dim: int
    batch: int
    topk: int
    dtype: torch.dtype
    gate: str = "full"  # "none", "full" [B,S,H,D], "seq" [B,S,1,1], "replicated" [1,1,H,1]
    qkv_format: str = "bshd"
    scale: float | None = None
    grad: bool = True
    tile: tuple[int, int, int] = (4, 4, 4)
    head_chunk: int | None = None  # heads per pipeline step (None: the op's default)
    recompute: bool = False
    token_order: str = "tiled"  # "raster": raster-order shards of T*H*W tokens


F64 = torch.float64
CPU_CASES = [
    Case("f64 full gate, B=2", (5, 9, 10), 4, 16, 2, 5, F64),
    Case("f64 bhsd, no gate, dense top-k", (5, 9, 10), 4, 16, 1, 18, F64, "none", "bhsd", 0.3),
    Case("f64 gate [B,S,1,1]", (5, 9, 10), 4, 16, 2, 3, F64, "seq"),
    Case("f64 gate [1,1,H,1] replicated", (5, 9, 10), 4, 16, 1, 4, F64, "replicated"),
    Case("f64 no_grad, bhsd gate", (5, 9, 10), 4, 16, 2, 5, F64, "full", "bhsd", grad=False),
    Case("f32 full gate, 8 heads", (5, 9, 10), 8, 16, 1, 6, torch.float32),
    Case(
        "f64 one head a step, recompute", (5, 9, 10), 8, 16, 2, 5, F64, head_chunk=1, recompute=True
    ),
    Case(
        "f64 replicated gate, 3 heads a step, B=2",
        (5, 9, 10),
        8,
        16,
        2,
        4,
        F64,
        "replicated",
        head_chunk=3,
    ),
    Case(
        "f64 gate [B,S,1,1], one head a step, recompute",
        (5, 9, 10),
        4,
        16,
        2,
        3,
        F64,
        "seq",
        "bhsd",
        head_chunk=1,
        recompute=True,
    ),
]
# raster order: (5, 9, 10) is 450 tokens; (4, 9, 10) has 9 tiles, which tile order cannot split
# over 2 ranks, and 360 tokens, which raster order can
CPU_CASES += [
    replace(CPU_CASES[0], name="f64 raster, full gate, B=2", token_order="raster"),
    replace(CPU_CASES[-1], name=f"raster: {CPU_CASES[-1].name}", token_order="raster"),
    Case(
        "f64 raster, replicated gate, no_grad, 9 tiles",
        (4, 9, 10),
        4,
        16,
        1,
        4,
        F64,
        "replicated",
        grad=False,
        token_order="raster",
    ),
]
BF16 = torch.bfloat16
GPU_CASES = [
    Case("bf16 partial tiles, B=2", (5, 9, 10), 4, 64, 2, 5, BF16),
    Case("bf16 13x24x40", (13, 24, 40), 8, 128, 1, 30, BF16),
    Case("bf16 bhsd, replicated gate", (13, 24, 40), 8, 128, 1, 30, BF16, "replicated", "bhsd"),
    Case("bf16 no_grad", (13, 24, 40), 8, 128, 1, 30, BF16, grad=False),
    Case("bf16 one head a step", (13, 24, 40), 8, 128, 1, 30, BF16, head_chunk=1),
    Case(
        "bf16 one head a step, recompute, B=2",
        (13, 24, 40),
        8,
        128,
        2,
        30,
        BF16,
        head_chunk=1,
        recompute=True,
    ),
    Case(
        "bf16 one head a step, no_grad", (13, 24, 40), 8, 128, 1, 30, BF16, grad=False, head_chunk=1
    ),
    Case("bf16 raster, partial tiles", (13, 22, 38), 8, 128, 1, 30, BF16, token_order="raster"),
]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}
BF16_REL_TOLERANCE = {"out": 1e-2, "grad": 2e-2}


class Checker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []

    def log(self, msg: str) -> None:
        print(f"rank {self.rank}: {msg}", flush=True)

    def close(self, case: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """float32/64: max abs error; bf16: relative L2 error against the single-device op."""
        if got.shape != want.shape:
            self.fail(f"{case}: {what} shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        got64, want64 = got.detach().double(), want.detach().double()
        if not torch.isfinite(got64).all():
            self.fail(f"{case}: {what} is not finite")
            return
        if got.dtype in TOLERANCE:
            err, tol = (got64 - want64).abs().max().item(), TOLERANCE[got.dtype]
            label = "max abs err"
        else:
            err = ((got64 - want64).norm() / want64.norm().clamp(min=1e-30)).item()
            tol = BF16_REL_TOLERANCE["out" if what == "out" else "grad"]
            label = "rel L2 err"
        if err > tol:
            self.fail(f"{case}: {what} {label} {err:.3e} > {tol:.0e}")
        else:
            self.log(f"{case}: {what} {label} {err:.3e}")

    def equal(self, case: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """Bit for bit (same shape, dtype and values)."""
        if got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want):
            self.log(f"{case}: {what} bit-identical")
        else:
            self.fail(f"{case}: {what} differs")

    def expect(self, case: str, fn: Callable[[], object], match: str) -> None:
        try:
            fn()
        except ValueError as exc:
            if match in str(exc):
                self.log(f"{case}: ValueError as expected")
            else:
                self.fail(f"{case}: ValueError without {match!r}: {exc}")
        else:
            self.fail(f"{case}: no ValueError")

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self.log(f"FAIL {msg}")


def make_inputs(case: Case, tiling: VideoTiling, device: torch.device) -> dict[str, torch.Tensor]:
    """Full BSHD inputs (the same on every rank), in the case's dtype."""
    gen = torch.Generator().manual_seed(1234 + case.heads * 7 + case.batch)
    seq = tiling.seq_len if case.token_order == "raster" else tiling.padded_len
    shape = (case.batch, seq, case.heads, case.dim)

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(s, generator=gen, dtype=torch.float64).to(device, case.dtype)

    tensors = {name: rand(*shape) for name in ("q", "k", "v", "dout")}
    batch, seq, heads, _ = shape
    gate_shape = {
        "full": shape,
        "seq": (batch, seq, 1, 1),
        "replicated": (1, 1, heads, 1),
    }.get(case.gate)
    if gate_shape is not None:
        tensors["gate"] = rand(*gate_shape)
    return tensors


def run_case(case: Case, check: Checker, device: torch.device, backend: str) -> None:
    tiling = VideoTiling(case.latent, case.tile)
    full = make_inputs(case, tiling, device)
    bhsd = case.qkv_format == "bhsd"

    def fmt(t: torch.Tensor) -> torch.Tensor:  # BSHD -> the case's format (a view)
        return t.transpose(1, 2) if bhsd else t

    seq_dim = 2 if bhsd else 1
    names = ["q", "k", "v"] + (["gate"] if "gate" in full else [])
    kwargs = dict(topk=case.topk, tiling=tiling, backend=backend, scale=case.scale)
    kwargs["qkv_format"] = case.qkv_format
    kwargs["token_order"] = case.token_order

    # The reference: the single-process op on the full inputs.
    ref_in = {n: fmt(full[n]).detach().clone().requires_grad_(case.grad) for n in names}
    with torch.set_grad_enabled(case.grad):
        ref_out = video_sparse_attn(
            ref_in["q"], ref_in["k"], ref_in["v"], coarse_gate=ref_in.get("gate"), **kwargs
        )
    ref_grads = {}
    if case.grad:
        grads = torch.autograd.grad(ref_out, [ref_in[n] for n in names], fmt(full["dout"]))
        ref_grads = dict(zip(names, grads, strict=True))

    # The distributed op on this rank's shards.
    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, dim=seq_dim) if t.shape[seq_dim] > 1 else t

    dist_in = {n: local(fmt(full[n])).detach().clone().requires_grad_(case.grad) for n in names}
    with torch.set_grad_enabled(case.grad):
        out = sequence_parallel_video_sparse_attn(
            dist_in["q"], dist_in["k"], dist_in["v"], coarse_gate=dist_in.get("gate"),
            head_chunk=case.head_chunk, recompute=case.recompute, **kwargs,
        )  # fmt: skip
    check.close(case.name, "out", out, local(ref_out))
    check.close(case.name, "gathered out", gather_sequence(out, dim=seq_dim), ref_out)
    if not case.grad:
        return
    grads = torch.autograd.grad(
        out, [dist_in[n] for n in names], shard_sequence(fmt(full["dout"]), dim=seq_dim)
    )
    for name, grad in zip(names, grads, strict=True):
        if name == "gate" and case.gate == "replicated":  # partial per rank: sum over ranks
            grad = grad.clone()
            dist.all_reduce(grad)
        check.close(case.name, f"d{name}", grad, local(ref_grads[name]))


def run_exchange_checks(check: Checker, device: torch.device) -> None:
    """seq_to_heads / heads_to_seq against slicing the full tensor, and their round trip."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(2, 6 * world, 2 * world, 3, generator=gen, dtype=torch.float64).to(device)
    mine = shard_sequence(full)
    swapped = seq_to_heads(mine)
    check.close("seq_to_heads", "out", swapped, full[:, :, 2 * rank : 2 * rank + 2])
    check.close("heads_to_seq", "round trip", heads_to_seq(swapped), mine)
    check.close("shard/gather", "round trip", gather_sequence(mine), full)


def run_step_checks(check: Checker, device: torch.device, backend: str) -> None:
    """The pipeline's steps do not change the result: every ``head_chunk`` (and B > 1, split
    into batch rows) gives, bit for bit, what the op gives on this rank's whole head group
    (what the unpipelined wrapper computed), output and gradients (with and without
    ``recompute``), in both formats. A
    ``head_chunk`` outside [1, H / W] raises."""
    world = dist.get_world_size()
    case = Case("steps", (5, 9, 10), 4 * world, 16, 2, 5, torch.float64)
    tiling = VideoTiling(case.latent, case.tile)
    full = make_inputs(case, tiling, device)
    names = ["q", "k", "v", "gate"]
    heads = case.heads // world
    kwargs = dict(topk=case.topk, tiling=tiling, backend=backend)

    # The reference: the op on each rank's head group over the whole sequence, then sharded
    # (without autograd too: the op's inference path zeroes no padding and combines in place).
    outs, grads, outs_no_grad = [], {n: [] for n in names}, []
    for r in range(world):
        part = {
            n: full[n][:, :, r * heads : (r + 1) * heads].clone().requires_grad_() for n in names
        }
        out = video_sparse_attn(part["q"], part["k"], part["v"], coarse_gate=part["gate"], **kwargs)
        dout = full["dout"][:, :, r * heads : (r + 1) * heads]
        for n, g in zip(
            names, torch.autograd.grad(out, [part[n] for n in names], dout), strict=True
        ):
            grads[n].append(g)
        outs.append(out.detach())
        with torch.no_grad():
            outs_no_grad.append(
                video_sparse_attn(
                    part["q"], part["k"], part["v"], coarse_gate=part["gate"], **kwargs
                )
            )
    want = shard_sequence(torch.cat(outs, 2))
    want_no_grad = shard_sequence(torch.cat(outs_no_grad, 2))
    want_grads = {n: shard_sequence(torch.cat(grads[n], 2)) for n in names}

    for bhsd in (False, True):
        fmt = (lambda t: t.transpose(1, 2)) if bhsd else (lambda t: t)
        seq_dim = 2 if bhsd else 1
        for chunk in (1, 2, 3, 4, None):
            label = f"head_chunk={chunk}" + (" bhsd" if bhsd else "")
            mine = {
                n: shard_sequence(fmt(full[n]), dim=seq_dim).clone().requires_grad_() for n in names
            }
            out = sequence_parallel_video_sparse_attn(
                mine["q"], mine["k"], mine["v"], coarse_gate=mine["gate"], head_chunk=chunk,
                qkv_format="bhsd" if bhsd else "bshd", **kwargs,
            )  # fmt: skip
            check.equal(label, "out", fmt(out), want)
            dout = shard_sequence(fmt(full["dout"]), dim=seq_dim)
            got = torch.autograd.grad(out, [mine[n] for n in names], dout)
            for n, g in zip(names, got, strict=True):
                check.equal(label, f"d{n}", fmt(g), want_grads[n])
            out = sequence_parallel_video_sparse_attn(
                mine["q"], mine["k"], mine["v"], coarse_gate=mine["gate"], head_chunk=chunk,
                qkv_format="bhsd" if bhsd else "bshd", recompute=True, **kwargs,
            )  # fmt: skip
            check.equal(label + " recompute", "out", fmt(out), want)
            got = torch.autograd.grad(out, [mine[n] for n in names], dout)
            for n, g in zip(names, got, strict=True):
                check.equal(label + " recompute", f"d{n}", fmt(g), want_grads[n])
            with torch.no_grad():
                again = sequence_parallel_video_sparse_attn(
                    mine["q"], mine["k"], mine["v"], coarse_gate=mine["gate"], head_chunk=chunk,
                    qkv_format="bhsd" if bhsd else "bshd", **kwargs,
                )  # fmt: skip
            check.equal(label, "no_grad out", fmt(again), want_no_grad)
    x = shard_sequence(full["q"]).clone()
    for bad in (0, heads + 1, 1.5):
        check.expect(
            f"head_chunk={bad}",
            lambda bad=bad: sequence_parallel_video_sparse_attn(x, x, x, head_chunk=bad, **kwargs),
            "head_chunk must be an integer",
        )


def run_error_checks(check: Checker, device: torch.device) -> None:
    """Bad inputs raise on every rank before any communication (so nothing hangs)."""
    world = dist.get_world_size()
    tiling = VideoTiling((5, 4, 4 * world))  # 2 * world tiles, the last ones partial
    local = tiling.padded_len // world
    x = torch.zeros(1, local, world + 1, 8, dtype=torch.float64, device=device)
    check.expect(
        f"{world + 1} heads",
        lambda: sequence_parallel_video_sparse_attn(x, x, x, topk=2, tiling=tiling),
        "divisible by the world size",
    )
    y = torch.zeros(1, local - 8, 4, 8, dtype=torch.float64, device=device)
    check.expect(
        "misaligned shard",
        lambda: sequence_parallel_video_sparse_attn(y, y, y, topk=2, tiling=tiling),
        "tile-aligned",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("cpu", "gpu"), default="cpu")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="default: the suite's (cpu: cpu, gpu: cuda)"
    )
    p.add_argument("--backend", default=None, help="fine backend (cpu: reference; gpu: auto)")
    p.add_argument("--init-file", help="file:// rendezvous (with --rank); default env://")
    p.add_argument("--rank", type=int)
    p.add_argument("--world-size", type=int)
    args = p.parse_args(argv)

    device_type, pg_backend = choose_runtime(args.suite, args.device)
    backend = args.backend or ("reference" if args.suite == "cpu" else "auto")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            print("sp_worker: --suite gpu / --device cuda needs a CUDA device", file=sys.stderr)
            return 2
        local_rank = int(os.environ.get("LOCAL_RANK", args.rank or 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    init: dict[str, object] = {"timeout": datetime.timedelta(seconds=600)}
    if args.init_file:
        init.update(
            init_method=f"file://{args.init_file}", rank=args.rank, world_size=args.world_size
        )
    dist.init_process_group(pg_backend, **init)
    check = Checker(dist.get_rank())
    try:
        cases = CPU_CASES if args.suite == "cpu" else GPU_CASES
        # The first line: what actually runs (issue 21: the GPU suite once ran gloo on the CPU).
        check.log(
            f"{dist.get_backend()}, world {dist.get_world_size()}, {device}, backend {backend}"
        )
        run_exchange_checks(check, device)
        run_error_checks(check, device)
        if args.suite == "cpu":
            run_step_checks(check, device, backend)
        world = dist.get_world_size()
        for case in cases:
            tiling = VideoTiling(case.latent, case.tile)
            split = tiling.seq_len if case.token_order == "raster" else tiling.num_tiles
            if case.heads % world or split % world:
                what = "tokens" if case.token_order == "raster" else "tiles"
                check.log(f"{case.name}: skipped (heads or {what} not divisible by {world})")
                continue
            if backend == "auto":
                check.log(f"{case.name}: auto picks {auto_backend(case, device)}")
            run_case(case, check, device, backend)
        dist.barrier()
    except Exception:
        check.fail(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    if check.failures:
        return 1
    check.log("OK")
    return 0


def choose_runtime(suite: str, device: str | None) -> tuple[str, str]:
    """(device type, process-group backend): the suite's device (cpu -> gloo, gpu -> cuda and
    NCCL) unless ``--device`` overrides it."""
    device_type = device or {"cpu": "cpu", "gpu": "cuda"}[suite]
    return device_type, "nccl" if device_type == "cuda" else "gloo"


def auto_backend(case: Case, device: torch.device) -> str:
    """The fine backend ``"auto"`` picks for a case's calls (with gradients when it has them)."""
    tile_tokens = VideoTiling(case.latent, case.tile).tile_tokens
    call = AttentionCall(device, case.dtype, case.dim, (tile_tokens, tile_tokens), case.grad)
    return select_backend(call, "auto").name


if __name__ == "__main__":
    sys.exit(main())

"""Shared machinery of the benchmark scripts `bench_vsa.py` and `bench_video.py` (and the
result header of the standalone GPU scripts `bench_triton_kernels.py` and `memory_vsa_op.py`).

Everything that needs a GPU library (triton, flash_attn, cutlass, matplotlib) is imported inside
the function that uses it, so this module imports on any machine with torch. Nothing here
decides what to benchmark; it times, checks, describes the machine and writes results:

- `time_fn`: median of N repetitions, CUDA events on a GPU (warm-up excluded), perf_counter on
  the CPU; an optional per-repetition ``setup`` runs outside the timed region.
- `time_interleaved` / `time_paced` / `time_views`: arms timed call by call in alternation
  (`interleaved_turns`, the order rotated per round); `time_views` gives each arm's
  back-to-back (device throughput) and one-call-then-synchronize (latency) times and the host
  time to issue one call.
- `masked_attention_reference`: float32 attention (and its gradients) under a block mask, by
  query-row chunks, written independently of vsa-core: the correctness gate's ground truth.
- `gate_check`: finite, and max abs error under max(1e-2, 8 x the input dtype's rounding floor).
- `collect_metadata`: device, driver, versions, seed, environment, command line, UTC date.
- `Replica`: one independent replica per GPU under ``torchrun``, rank-suffixed JSON files and
  an aggregate written by rank 0 once every rank's file is there (no process group needed).
- `result_doc` / `run_and_report`: a run's JSON document, rewritten as results come in, then
  printed and written once complete (under ``torchrun``: per rank, then rank 0's aggregate).
- `time_fn_distributed`, `match_check`, `any_rank`, `gather_per_rank`: a sequence-parallel op
  timed across the ranks of a process group (fixed repetitions between barriers, the slowest
  rank per repetition), and compared with the same op on one device.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

import torch

MiB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_NAMES[torch.float32] = "fp32"  # a name only: bench_video's sequence-parallel CPU runs

# FLOP multiplier of each mode relative to the forward pass (backward = 2.5 x forward).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
MODE_ALIASES = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fwd+bwd", "fwdbwd": "fwd+bwd"}

# Dense bf16 tensor-core peak (TFLOP/s, no structured sparsity) by device-name substring; the
# first match wins, so more specific names come first.
PEAK_BF16_TFLOPS = (("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100", 989.0))

DISTRIBUTIONS = (
    "torch",
    "triton",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "vsa-core",
    "vsa-triton",
    "vsa-fa4",
    "flash-attn-4-vsa",
    "fastvideo-kernel",
    "matplotlib",
)
ENV_NAMES = (
    "VSA_BACKEND",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NVIDIA_TF32_OVERRIDE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)
ENV_PREFIXES = ("TRITON_", "CUTE_DSL_", "FLASH_ATTENTION", "FA4_", "TORCHINDUCTOR_")

GATE_ABS_FLOOR = 1e-2
GATE_ROUNDING_FACTOR = 8.0


# ---- small helpers --------------------------------------------------------------------------
def budget_spent(time_budget_min: float | None, started: float) -> bool:
    """Whether a run's ``--time-budget-min`` has run out since ``started`` (time.monotonic)."""
    return time_budget_min is not None and time.monotonic() - started > time_budget_min * 60


def mark_not_run(rec: dict[str, Any], time_budget_min: float | None) -> None:
    """Record a cell the time budget left unstarted."""
    rec.update(status="not_run", reason=f"--time-budget-min {time_budget_min} spent")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def log(msg: str, *, replica: Replica | None = None) -> None:
    """Progress output: stderr, so that stdout carries only the final markdown table."""
    prefix = f"[rank {replica.rank}] " if replica is not None else ""
    print(f"{prefix}{msg}", file=sys.stderr, flush=True)


def parse_mode(text: str) -> str:
    mode = MODE_ALIASES.get(text.strip().lower())
    if mode is None:
        raise ValueError(f"mode must be one of fwd, bwd, fwd+bwd (or fwdbwd), got {text!r}")
    return mode


def mode_slug(mode: str) -> str:
    """A file-name-safe spelling of a mode."""
    return mode.replace("+", "_")


def error_text(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def traceback_tail(exc: BaseException, lines: int = 12) -> str:
    formatted = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(formatted.rstrip().splitlines()[-lines:])


def error_fields(exc: BaseException) -> dict[str, str]:
    """A result record's fields for an exception: one-line reason, full text, traceback tail."""
    return {
        "reason": first_line(error_text(exc)),
        "error": error_text(exc),
        "traceback": traceback_tail(exc),
    }


def first_line(text: str | None, limit: int = 160) -> str:
    if not text:
        return ""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def recover_after_error(device: torch.device) -> None:
    """Best effort after an arm failed: release cached blocks; never raises."""
    if device.type != "cuda":
        return
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(device)
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()


# ---- FLOPs, peaks ---------------------------------------------------------------------------
def attention_flops(head_dim: int, total_pairs: int, mode: str) -> float:
    """FLOPs of attention over ``total_pairs`` (query, key) pairs summed over batch and heads.

    Forward is 2 matmuls of 2 FLOPs per pair and head-dim element: 4 * D per pair, i.e.
    4 * B * H * D * P with P the pairs of one (batch, head); backward counts 2.5 x forward.
    """
    return 4.0 * head_dim * float(total_pairs) * MODE_FLOP_FACTOR[mode]


def tflops(head_dim: int, total_pairs: int, mode: str, ms: float) -> float:
    return attention_flops(head_dim, total_pairs, mode) / (ms * 1e-3) / 1e12


def peak_tflops_for(device_name: str | None, override: float | None = None) -> float | None:
    if override is not None:
        return float(override)
    if not device_name:
        return None
    for needle, peak in PEAK_BF16_TFLOPS:
        if needle.lower() in device_name.lower():
            return peak
    return None


# ---- timing and memory ----------------------------------------------------------------------
@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    warmup: int
    times_ms: list[float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "reps": self.reps,
            "warmup": self.warmup,
            "times_ms": self.times_ms,
        }


def _rep_times(
    fn: Callable[[Any], Any], state: Callable[[], Any], device: torch.device, reps: int
) -> list[float]:
    """The time (ms) of each of ``reps`` calls ``fn(state())``, ``state()`` untimed: CUDA events
    recorded on the current stream on a GPU, perf_counter on the CPU (`time_interleaved` with
    one arm and no warm-up)."""
    return time_interleaved({"fn": (fn, state)}, device, warmup=0, reps=reps)["fn"]


def reps_within_budget(reps: int, budget_s: float, call_s: float, min_reps: int = 3) -> int:
    """``reps`` capped at about ``budget_s`` of calls taking ``call_s`` each, never fewer than
    ``min_reps``."""
    return max(min_reps, min(reps, int(budget_s / max(call_s, 1e-9))))


def time_fn(
    fn: Callable[[Any], Any],
    device: torch.device,
    *,
    setup: Callable[[], Any] | None = None,
    warmup: int = 5,
    reps: int = 20,
    budget_s: float | None = None,
    min_reps: int = 3,
) -> Timing:
    """Median time of ``fn(setup())`` in milliseconds; ``setup`` (if any) is not timed.

    On CUDA each repetition is bracketed by CUDA events recorded on the current stream, so
    only the device work that ``fn`` enqueues counts (plus any launch gap it causes); the
    setup's work is enqueued before the start event. ``budget_s`` caps the repetitions at about
    that much time (never fewer than ``min_reps``), estimated from the last warm-up call, and
    ends the warm-up once it has taken that long (after at least one call).
    """

    def state() -> Any:
        return setup() if setup is not None else None

    def one_call() -> float:
        s = state()
        synchronize(device)
        t0 = time.perf_counter()
        fn(s)
        synchronize(device)
        return time.perf_counter() - t0

    warmed, spent, last = 0, 0.0, None
    while warmed < warmup:
        last = one_call()
        warmed += 1
        spent += last
        if budget_s is not None and spent > budget_s:
            break  # a slow arm (e.g. the reference) is warm after one call
    if budget_s is not None:
        est = last if last is not None else one_call()
        reps = reps_within_budget(reps, budget_s, est, min_reps)
    reps = max(1, reps)
    times = _rep_times(fn, state, device, reps)
    return Timing(statistics.median(times), min(times), max(times), reps, warmed, times)


def time_interleaved(
    arms: dict[str, tuple[Callable[[Any], Any], Callable[[], Any] | None]],
    device: torch.device,
    *,
    warmup: int = 3,
    reps: int = 20,
) -> dict[str, list[float]]:
    """Per arm, the time (ms) of each of ``reps`` calls ``fn(setup())``, arms interleaved.

    ``arms`` maps a name to ``(fn, setup)``. Every repetition calls each arm once, the order
    rotated by one per repetition, so that clock and thermal drift and the position in the
    sequence hit all arms alike; repetition ``i`` of two arms is a paired sample. Nothing
    synchronizes between calls (``warmup`` rounds first fill the device's queue), so on CUDA
    each call's time (events around ``fn``, the setup's work enqueued before the start event)
    is its device time, its host cost hidden as long as the host keeps ahead of the device.
    """
    interleaved_turns(arms, device, rounds=warmup, record=False)
    done = interleaved_turns(arms, device, rounds=max(1, reps))
    return {name: [t.device_ms for t in turns] for name, turns in done.items()}


@dataclass(frozen=True)
class Turn:
    """One arm's turn in a round of `interleaved_turns`, per call: ``device_ms`` between the
    CUDA events around the turn's calls (perf_counter on the CPU), ``host_ms`` the wall clock
    from the first call to the last one's return (no synchronization inside)."""

    device_ms: float
    host_ms: float


def interleaved_turns(
    arms: dict[str, tuple[Callable[[Any], Any], Callable[[], Any] | None]],
    device: torch.device,
    *,
    rounds: int,
    calls: int | dict[str, int] = 1,
    synchronized: bool = False,
    record: bool = True,
) -> dict[str, list[Turn]]:
    """``rounds`` rounds in which every arm takes one turn, the order rotated by one per round.

    ``arms`` maps a name to ``(fn, setup)``. A turn makes ``calls`` calls ``fn(setup())`` of its
    arm (an int, or per arm name) between two CUDA events (perf_counter marks on the CPU), the
    setups made before the start event; its `Turn` is per call (divided by ``calls``). With
    ``synchronized`` the device is synchronized before the start event and after the end event
    of every turn (nothing of another arm runs inside it, and host time before the first kernel
    launch counts in full); without, nothing synchronizes until the end (the host runs ahead
    and device time is what the events measure). Returns every recorded turn per arm, in order
    (empty lists with ``record=False``: warm-up rounds).
    """
    names = list(arms)
    done: list[tuple[str, int, Any, Any, float]] = []
    for i in range(max(0, rounds)):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn, setup = arms[name]
            n = max(1, calls[name] if isinstance(calls, dict) else calls)
            states = [setup() if setup is not None else None for _ in range(n)]
            if synchronized:
                synchronize(device)
            if device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            h0 = time.perf_counter()
            for state in states:
                fn(state)
            h1 = time.perf_counter()
            if device.type == "cuda":
                end.record()
            else:
                start, end = h0, h1
            if synchronized:
                synchronize(device)
            if record:
                done.append((name, n, start, end, h1 - h0))
            del states
    synchronize(device)
    turns: dict[str, list[Turn]] = {name: [] for name in names}
    for name, n, start, end, host_s in done:
        ms = float(start.elapsed_time(end)) if device.type == "cuda" else (end - start) * 1e3
        turns[name].append(Turn(ms / n, host_s * 1e3 / n))
    return turns


@dataclass
class ArmViews:
    """One arm's times from `time_views` (ms per call)."""

    back_to_back: Timing
    once: Timing
    host: Timing
    calls_per_turn: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "back_to_back": self.back_to_back.as_dict(),
            "once": self.once.as_dict(),
            "host": self.host.as_dict(),
            "calls_per_turn": self.calls_per_turn,
        }


def time_views(
    runners: dict[str, Runner],
    device: torch.device,
    settings: TimingSettings,
    *,
    max_calls: int = 10,
    turn_ms: float = 20.0,
) -> dict[str, ArmViews]:
    """Every runner timed in alternation with the others (`interleaved_turns`), in two views.

    - ``once`` (latency): one call per turn, synchronized before and after; CUDA events around
      the call, so host time before its first kernel launch shows up in full. ``host``: the
      wall clock of those same calls from the call to its return (no synchronization inside),
      the time the host needs to issue one call.
    - ``back_to_back`` (device throughput): each turn makes N calls between two CUDA events,
      nothing synchronizes, the host runs ahead; time per call = elapsed / N. N is enough calls
      for about ``turn_ms`` of the arm's own once-time, at least 1, at most ``max_calls``.

    After ``settings.warmup`` unrecorded rounds, one synchronized round estimates each arm's
    time; the rounds of each view are then capped so that both views together take about
    ``settings.budget_s`` per arm (never fewer than 3 rounds, at most ``settings.reps``). The
    once rounds run first, then one unrecorded back-to-back round refills the queue.
    """
    arms = {name: (r.run, r.setup) for name, r in runners.items()}
    interleaved_turns(arms, device, rounds=settings.warmup, record=False)
    estimate = interleaved_turns(arms, device, rounds=1, synchronized=True)
    est_ms = {name: max(turns[0].device_ms, 1e-6) for name, turns in estimate.items()}
    calls = {name: max(1, min(max_calls, math.ceil(turn_ms / ms))) for name, ms in est_ms.items()}
    round_s = sum(ms * (1 + calls[name]) for name, ms in est_ms.items()) / 1e3
    reps = reps_within_budget(settings.reps, settings.budget_s * len(arms), round_s)
    once = interleaved_turns(arms, device, rounds=reps, synchronized=True)
    interleaved_turns(arms, device, rounds=1, calls=calls, record=False)
    b2b = interleaved_turns(arms, device, rounds=reps, calls=calls)
    warmed = settings.warmup + 1

    def timing(times: list[float]) -> Timing:
        return Timing(statistics.median(times), min(times), max(times), reps, warmed, times)

    return {
        name: ArmViews(
            back_to_back=timing([t.device_ms for t in b2b[name]]),
            once=timing([t.device_ms for t in once[name]]),
            host=timing([t.host_ms for t in once[name]]),
            calls_per_turn=calls[name],
        )
        for name in arms
    }


def events_ms(fn: Callable[[], Any], calls: int) -> float:
    """Device ms per call of ``calls`` back-to-back calls between two CUDA events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / calls


def call_views(fn: Callable[[], Any], reps: int, b2b_calls: int = 10) -> dict[str, float]:
    """One arm on its own, both views (medians): ``host_ms`` to issue one call with the queue
    drained, ``once_ms`` one call between events then a synchronize (latency), ``b2b_ms``
    calls back to back (device throughput). Three warm-up calls first."""
    for _ in range(3):
        fn()
    host, once = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        once.append(events_ms(fn, 1))
    b2b = statistics.median(events_ms(fn, b2b_calls) for _ in range(3))
    return {"host_ms": statistics.median(host), "once_ms": statistics.median(once), "b2b_ms": b2b}


def cuda_graph(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """``fn`` captured in a CUDA graph after three warm-up calls on a side stream: (replay,
    the captured call's output, whose buffers each replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def peak_extra_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak memory allocated during ``fn()`` beyond what was allocated before (MiB); its
    result is held until the peak is read. None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del result
    return (peak - before) / MiB


# ---- arms' runners ------------------------------------------------------------------------
@dataclass
class Runner:
    """``run(setup())`` returns the arm's outputs as BSHD tensors named out, dq, dk, dv."""

    run: Callable[[Any], dict[str, torch.Tensor]]
    setup: Callable[[], Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def once(self) -> dict[str, torch.Tensor]:
        return self.run(self.setup() if self.setup is not None else None)


class TimingSettings(Protocol):
    """What ``time_runner`` reads from a benchmark's config."""

    warmup: int
    reps: int
    budget_s: float


def time_runner(runner: Runner, device: torch.device, settings: TimingSettings) -> Timing:
    """``time_fn`` of ``runner`` (its setup untimed) with the config's warm-up, reps, budget."""
    return time_fn(
        runner.run,
        device,
        setup=runner.setup,
        warmup=settings.warmup,
        reps=settings.reps,
        budget_s=settings.budget_s,
    )


def time_paced(
    runner: Runner, pacer: Runner, device: torch.device, settings: TimingSettings
) -> tuple[Timing, Timing]:
    """``runner`` and ``pacer`` (a baseline) timed call by call in alternation
    (`time_interleaved`), so that both run at the same clock and power state: returns
    (runner's timing, pacer's timing in the same rounds). Repetitions: the config's, capped at
    about ``settings.budget_s`` for the pair, estimated from one call of each after the
    warm-up rounds (never fewer than 3)."""
    arms = {"run": (runner.run, runner.setup), "pace": (pacer.run, pacer.setup)}
    warmup = max(1, settings.warmup)
    one = time_interleaved(arms, device, warmup=warmup, reps=1)
    pair_s = (one["run"][0] + one["pace"][0]) / 1000
    reps = reps_within_budget(settings.reps, settings.budget_s, pair_s)
    times = time_interleaved(arms, device, warmup=1, reps=reps)
    warmed = warmup + 2  # the estimate's round and one more to refill the queue

    def timing(t: list[float]) -> Timing:
        return Timing(statistics.median(t), min(t), max(t), reps, warmed, t)

    return timing(times["run"]), timing(times["pace"])


def make_leaves(
    tensors: Sequence[torch.Tensor], mode: str, transform: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    if mode == "fwd":
        return [transform(t) for t in tensors]
    return [transform(t).detach().clone().requires_grad_(True) for t in tensors]


def autograd_runner(
    forward: Callable[..., torch.Tensor],
    leaves: Sequence[torch.Tensor],
    dout: torch.Tensor,
    mode: str,
    to_bshd: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    names: Sequence[str] = ("dq", "dk", "dv"),
) -> Runner:
    """A runner for an arm whose forward is differentiable (autograd does the backward).

    bwd mode: the forward runs in ``setup`` (untimed), only ``autograd.grad`` is timed.
    """
    leaves = list(leaves)
    if mode == "fwd":

        def run_fwd(_: Any) -> dict[str, torch.Tensor]:
            with torch.no_grad():
                return {"out": to_bshd(forward(*leaves))}

        return Runner(run_fwd)
    if mode == "bwd":

        def setup() -> torch.Tensor:
            with torch.enable_grad():
                return forward(*leaves)

        def run_bwd(out: torch.Tensor) -> dict[str, torch.Tensor]:
            grads = torch.autograd.grad(out, leaves, dout)
            return {n: to_bshd(g) for n, g in zip(names, grads, strict=True)}

        return Runner(run_bwd, setup)

    def run_both(_: Any) -> dict[str, torch.Tensor]:
        with torch.enable_grad():
            out = forward(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
        result = {"out": to_bshd(out.detach())}
        result.update({n: to_bshd(g) for n, g in zip(names, grads, strict=True)})
        return result

    return Runner(run_both)


# ---- float32 reference and the correctness gate --------------------------------------------
@contextlib.contextmanager
def ieee_fp32_matmul():
    """Full-precision float32 matmuls (no TF32) for the duration of the block."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def masked_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    block_mask: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    kv_valid_sizes: torch.Tensor | None = None,
    dout: torch.Tensor | None = None,
    chunk_bytes: int = 1 << 30,
) -> dict[str, torch.Tensor]:
    """Float32 attention in which query block i sees key block j iff ``block_mask[b, h, i, j]``.

    q, k, v, dout: [B, S, H, D] (BSHD). ``block_mask`` [B, H, NQ, NKV] bool over blocks of
    ``block_shape`` (None: dense); key j of block n is real iff j < ``kv_valid_sizes[n]`` (None:
    all real). Rows that see no key get out = 0 and zero gradients. Returns float32 BSHD
    tensors: ``out``, and with ``dout`` also ``dq``, ``dk``, ``dv`` (explicit backward: P is
    recomputed per chunk from the log-sum-exp, dS = P * (dP - rowsum(dO * O))).
    """
    batch, q_len, heads, _ = q.shape
    kv_len = k.shape[1]
    device = q.device
    qf = q.detach().float().transpose(1, 2).contiguous()  # [B, H, Sq, D]
    kf = k.detach().float().transpose(1, 2).contiguous()
    vf = v.detach().float().transpose(1, 2).contiguous()

    key_real: torch.Tensor | None = None
    q_block = kv_block = 1
    if block_mask is not None or kv_valid_sizes is not None:
        if block_shape is None:
            raise ValueError("block_shape is needed with block_mask or kv_valid_sizes")
        q_block, kv_block = block_shape
    if kv_valid_sizes is not None:
        slot = torch.arange(kv_block, device=device)
        key_real = (slot < kv_valid_sizes.to(device).view(-1, 1)).reshape(-1)
        if bool(key_real.all()):
            key_real = None
    if block_mask is not None:
        block_mask = block_mask.to(device)
        if block_mask.shape[-1] * kv_block != kv_len or block_mask.shape[-2] * q_block != q_len:
            raise ValueError(
                f"block_mask {tuple(block_mask.shape)} with blocks {block_shape} does not cover "
                f"q_len={q_len}, kv_len={kv_len}"
            )

    def keep_of(r0: int, r1: int) -> torch.Tensor | None:
        if block_mask is None and key_real is None:
            return None
        keep = None
        if block_mask is not None:
            rows = torch.arange(r0, r1, device=device) // q_block
            keep = block_mask.index_select(2, rows).repeat_interleave(kv_block, dim=-1)
        if key_real is not None:
            keep = key_real.view(1, 1, 1, -1) if keep is None else keep & key_real
        return keep

    per_row = batch * heads * kv_len * 4 * (5 if dout is not None else 3)
    chunk = max(1, min(q_len, chunk_bytes // max(per_row, 1)))
    out = torch.empty_like(qf)
    lse = torch.empty(batch, heads, q_len, device=device, dtype=torch.float32)
    with ieee_fp32_matmul():
        for r0 in range(0, q_len, chunk):
            r1 = min(q_len, r0 + chunk)
            s = torch.matmul(qf[:, :, r0:r1], kf.transpose(-1, -2)).mul_(scale)
            keep = keep_of(r0, r1)
            if keep is not None:
                s.masked_fill_(~keep, float("-inf"))
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = s.sub_(m).exp_()
            denom = p.sum(dim=-1, keepdim=True)
            seen = denom > 0
            safe = torch.where(seen, denom, torch.ones_like(denom))
            out[:, :, r0:r1] = torch.where(seen, torch.matmul(p, vf) / safe, 0.0)
            lse[:, :, r0:r1] = torch.where(seen, m + torch.log(safe), float("-inf")).squeeze(-1)
            del s, p, keep
        result = {"out": out.transpose(1, 2)}
        if dout is None:
            return result
        dof = dout.detach().float().transpose(1, 2).contiguous()
        delta = (dof * out).sum(dim=-1)  # [B, H, Sq]
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        dq = torch.empty_like(qf)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for r0 in range(0, q_len, chunk):
            r1 = min(q_len, r0 + chunk)
            q_rows, do_rows = qf[:, :, r0:r1], dof[:, :, r0:r1]
            s = torch.matmul(q_rows, kf.transpose(-1, -2)).mul_(scale)
            keep = keep_of(r0, r1)
            if keep is not None:
                s.masked_fill_(~keep, float("-inf"))
            p = s.sub_(lse_safe[:, :, r0:r1].unsqueeze(-1)).exp_()
            dv += torch.matmul(p.transpose(-1, -2), do_rows)
            dp = torch.matmul(do_rows, vf.transpose(-1, -2))
            ds = p.mul_(dp.sub_(delta[:, :, r0:r1].unsqueeze(-1)))
            dq[:, :, r0:r1] = torch.matmul(ds, kf) * scale
            dk += torch.matmul(ds.transpose(-1, -2), q_rows) * scale
            del s, p, dp, ds, keep
    result.update(dq=dq.transpose(1, 2), dk=dk.transpose(1, 2), dv=dv.transpose(1, 2))
    return result


@dataclass
class GateResult:
    passed: bool
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, "tensors": self.tensors}

    def summary(self) -> str:
        parts = []
        for name, t in self.tensors.items():
            err = t["max_abs_err"]
            err_s = "non-finite" if err is None else f"{err:.2e}"
            parts.append(f"{name} {err_s}/{t['tol']:.1e}")
        return ", ".join(parts)


def rounding_floor(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs error of storing ``reference`` (float32) in ``dtype``: the error no kernel that
    returns ``dtype`` can beat."""
    ref = reference.float()
    return float((ref - ref.to(dtype).float()).abs().max()) if ref.numel() else 0.0


def gate_check(
    outputs: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    rows: torch.Tensor | None = None,
) -> GateResult:
    """Compare every output with its float32 reference (same BSHD shape).

    ``rows`` (optional) selects the sequence positions (dim 1) compared. Passes when every
    tensor is finite and its max abs error is at most max(1e-2, 8 x the rounding floor of
    ``dtype`` on the reference).
    """

    def judge(name: str, got: torch.Tensor, ref: torch.Tensor) -> tuple[dict[str, Any], str | None]:
        got32 = got.detach().float()
        finite = bool(torch.isfinite(got32).all())
        err = float((got32 - ref.float()).abs().max()) if finite and got32.numel() else None
        if finite and err is None:
            err = 0.0
        tol = max(GATE_ABS_FLOOR, GATE_ROUNDING_FACTOR * rounding_floor(ref, dtype))
        ok = finite and err is not None and err <= tol
        entry = {"max_abs_err": err, "tol": tol, "finite": finite, "passed": ok}
        if ok:
            return entry, None
        if not finite:
            return entry, "non-finite values"
        return entry, f"max abs err {err:.3e} > tol {tol:.3e}"

    return compare_tensors(
        outputs, reference, rows, judge, "the arm returned no tensors", mismatch_tol=GATE_ABS_FLOOR
    )


def compare_tensors(
    outputs: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    judge: Callable[[str, torch.Tensor, torch.Tensor], tuple[dict[str, Any], str | None]],
    empty_reason: str,
    *,
    mismatch_tol: float | None = None,
) -> GateResult:
    """Every output against its reference (``rows`` selects positions of dim 1): missing
    references and shape mismatches are failures, the rest is ``judge``'s call (its entry for
    the report, and why it failed or None). The reasons of all failures are joined."""
    gate = GateResult(passed=True)
    if not outputs:
        return GateResult(False, reason=empty_reason)
    for name, got in outputs.items():
        if name not in reference:
            return GateResult(False, gate.tensors, f"no reference for output {name!r}")
        ref = reference[name]
        if rows is not None:
            got, ref = got.index_select(1, rows), ref.index_select(1, rows)
        if tuple(got.shape) != tuple(ref.shape):
            entry = {"max_abs_err": None, "tol": mismatch_tol, "finite": False}
            why: str | None = f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
        else:
            entry, why = judge(name, got, ref)
        gate.tensors[name] = entry
        if why is not None:
            gate.passed = False
            gate.reason = f"{gate.reason}; {name}: {why}" if gate.reason else f"{name}: {why}"
    return gate


# ---- sequence parallel: timing and checks across the ranks of a process group ---------------
# Every function here is a collective of the default process group (torch.distributed must be
# initialized): every rank calls it, in the same order. NCCL needs CUDA tensors, gloo CPU ones,
# so the small exchange tensors live on the benchmark's device.
MATCH_MAX_ABS = {torch.float64: 1e-10, torch.float32: 2e-5}
MATCH_REL_L2 = {"out": 1e-2, "grad": 2e-2}


def barrier(device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(device_ids=[device.index if device.index is not None else 0])
    else:
        dist.barrier()


def all_ranks_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Elementwise max of ``values`` over the ranks (all_reduce MAX)."""
    import torch.distributed as dist

    t = torch.tensor([float(x) for x in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any: ranks agree on what to do next."""
    return all_ranks_max([1.0 if flag else 0.0], device)[0] > 0


def gather_per_rank(value: float | None, device: torch.device) -> list[float | None]:
    """Every rank's ``value``, in rank order (None: NaN in transit, None again)."""
    import torch.distributed as dist

    t = torch.tensor(
        [math.nan if value is None else float(value)], dtype=torch.float64, device=device
    )
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [None if math.isnan(x) else x for x in (float(p.item()) for p in parts)]


@dataclass
class DistributedTiming(Timing):
    """``Timing`` of the slowest rank per repetition, with every rank's own median."""

    rank_median_ms: list[float | None] = field(default_factory=list)
    wall_ms_per_call: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            **super().as_dict(),
            "over_ranks": "max per repetition (all_reduce MAX), then the median",
            "rank_median_ms": self.rank_median_ms,
            "wall_ms_per_call": self.wall_ms_per_call,
        }


def time_fn_distributed(
    fn: Callable[[Any], Any],
    device: torch.device,
    *,
    setup: Callable[[], Any] | None = None,
    warmup: int,
    reps: int,
) -> DistributedTiming:
    """Median time of ``fn(setup())`` (ms) when ``fn`` makes collective calls, on every rank.

    Every rank makes exactly ``warmup`` + ``reps`` calls (no time budget: ranks that chose
    different counts would hang in the op's collectives), with a barrier before and after the
    timed region. Each repetition is timed on each rank (CUDA events on the current stream on a
    GPU, perf_counter on the CPU); the per-repetition max over the ranks (all_reduce MAX) is
    the time of that call, whose median is reported. ``wall_ms_per_call``: the slowest rank's
    barrier-to-barrier wall time over ``reps``.
    """
    reps = max(1, reps)

    def state() -> Any:
        return setup() if setup is not None else None

    for _ in range(warmup):
        fn(state())
    synchronize(device)
    barrier(device)
    wall0 = time.perf_counter()
    times = _rep_times(fn, state, device, reps)
    barrier(device)
    wall_ms = (time.perf_counter() - wall0) * 1e3
    slowest = all_ranks_max([*times, wall_ms / reps], device)
    per_call, wall_per_call = slowest[:-1], slowest[-1]
    rank_medians = gather_per_rank(statistics.median(times), device)
    return DistributedTiming(
        statistics.median(per_call),
        min(per_call),
        max(per_call),
        reps,
        warmup,
        per_call,
        rank_medians,
        wall_per_call,
    )


def match_check(
    outputs: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    rows: torch.Tensor | None = None,
) -> GateResult:
    """Compare an op's outputs with the same op's computed another way (sequence parallel vs
    one device), both in ``dtype`` (same BSHD shapes; ``rows`` selects positions of dim 1).

    The tolerances of vsa-core's sequence-parallel tests: float32 / float64, max abs error at
    most 2e-5 / 1e-10 x max(1, max |reference|); bf16 / fp16, relative L2 error at most 1e-2
    for ``out`` and 2e-2 for gradients. Every tensor must be finite.
    """

    def judge(name: str, got: torch.Tensor, ref: torch.Tensor) -> tuple[dict[str, Any], str | None]:
        got64, ref64 = got.detach().double(), ref.detach().double()
        finite = bool(torch.isfinite(got64).all())
        entry: dict[str, Any] = {"finite": finite, "max_abs_err": None, "rel_l2_err": None}
        if finite:
            diff = got64 - ref64
            entry["max_abs_err"] = float(diff.abs().max()) if diff.numel() else 0.0
            entry["rel_l2_err"] = float(diff.norm() / ref64.norm().clamp(min=1e-30))
        if dtype in MATCH_MAX_ABS:
            scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
            entry.update(criterion="max_abs_err", tol=MATCH_MAX_ABS[dtype] * scale)
        else:
            tol = MATCH_REL_L2["out" if name == "out" else "grad"]
            entry.update(criterion="rel_l2_err", tol=tol)
        err = entry[entry["criterion"]]
        entry["passed"] = ok = finite and err is not None and err <= entry["tol"]
        if ok:
            return entry, None
        if not finite:
            return entry, "non-finite values"
        return entry, f"{entry['criterion'].replace('_', ' ')} {err:.3e} > tol {entry['tol']:.3e}"

    return compare_tensors(outputs, reference, rows, judge, "no tensors to compare")


# ---- machine description --------------------------------------------------------------------
def distribution_versions(names: Iterable[str] = DISTRIBUTIONS) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def env_snapshot(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    keep = {k: v for k, v in environ.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    return dict(sorted(keep.items()))


def driver_info() -> dict[str, Any]:
    """NVIDIA driver version from nvidia-smi, else the CUDA driver API version via libcuda,
    plus torch's CUDA runtime."""
    info: dict[str, Any] = {"torch_cuda_runtime": torch.version.cuda}
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        lines = [x.strip() for x in done.stdout.splitlines() if x.strip()]
        if done.returncode == 0 and lines:
            info["driver_version"] = lines[0]
            info["source"] = "nvidia-smi"
            return info
        info["nvidia_smi"] = f"exit {done.returncode}: {first_line(done.stderr)}"
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable ({error_text(exc, 200)})"
    if torch.cuda.is_available():
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            value = ctypes.c_int(0)
            if lib.cuDriverGetVersion(ctypes.byref(value)) == 0:
                major, minor = divmod(value.value, 1000)
                info["driver_version"] = f"CUDA driver API {major}.{minor // 10}"
                info["source"] = "libcuda cuDriverGetVersion"
        except OSError as exc:
            info["libcuda"] = error_text(exc, 200)
    info.setdefault("driver_version", None)
    return info


def describe_device(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "type": "cuda",
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total_memory_gib": round(props.total_memory / 2**30, 2),
            "multiprocessors": props.multi_processor_count,
        }
    return {
        "type": device.type,
        "name": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def collect_metadata(
    device: torch.device,
    *,
    seed: int,
    argv: Sequence[str] | None = None,
    replica: Replica | None = None,
) -> dict[str, Any]:
    argv = list(sys.argv if argv is None else argv)
    cudnn = None
    with contextlib.suppress(Exception):
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "date_utc": utc_now(),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "argv": argv,
        "host": platform.node(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": describe_device(device),
        "driver": driver_info(),
        "cudnn": cudnn,
        "versions": distribution_versions(),
        "seed": seed,
        "env": env_snapshot(),
        "replica": None if replica is None else replica.as_dict(),
    }


def gpu_result_header(benchmark: str) -> dict[str, Any]:
    """The first fields of a standalone GPU script's result: its name, UTC date, device name."""
    return {"benchmark": benchmark, "date": utc_now(), "device": torch.cuda.get_device_name()}


def runtime_versions(extra: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """Python and torch versions, then ``extra`` (a standalone GPU script's ``versions``)."""
    return {"python": platform.python_version(), "torch": torch.__version__, **(extra or {})}


# ---- output: JSON, markdown, plots ----------------------------------------------------------
def jsonable(value: Any) -> Any:
    """Non-finite floats become strings (strict JSON), tuples lists, tensors/dtypes strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return jsonable(value.item())
    return str(value)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomic write (temporary file + rename): a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(jsonable(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def write_json_and_markdown(out: Path, doc: dict[str, Any], markdown: str) -> None:
    """``doc`` as JSON at ``out`` and ``markdown`` beside it (same name, ``.md``)."""
    write_json(out, doc)
    out.with_suffix(".md").write_text(markdown)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return "" if x is None else str(x).replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def load_pyplot() -> tuple[Any, str | None]:
    """(matplotlib.pyplot with the Agg backend, None), or (None, why it is unavailable)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # missing or broken: plots are optional
        return None, f"matplotlib unavailable ({error_text(exc, 300)})"
    return plt, None


# ---- torchrun replicas ----------------------------------------------------------------------
@dataclass(frozen=True)
class Replica:
    """This process's place among ``torchrun`` replicas (from RANK / WORLD_SIZE / LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int
    run_id: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "run_id": self.run_id,
        }


def replica_from_env(environ: dict[str, str] | None = None) -> Replica | None:
    environ = dict(os.environ if environ is None else environ)
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    local = int(environ.get("LOCAL_RANK", rank))
    run_id = environ.get("TORCHELASTIC_RUN_ID") or "{}:{}".format(
        environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    )
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world})")
    return Replica(rank, world, local, run_id)


def pick_device(requested: str, replica: Replica | None) -> torch.device:
    """``auto``: cuda (cuda:LOCAL_RANK under torchrun) when available, else cpu."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda requested but torch sees no CUDA device")
        if device.index is None:
            index = replica.local_rank if replica is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def rank_path(out: Path, rank: int) -> Path:
    out = Path(out)
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix or '.json'}")


def wait_for_ranks(
    out: Path,
    replica: Replica,
    *,
    started_at: float,
    timeout_s: float,
    poll_s: float = 2.0,
) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Rank 0 waits for every rank's complete file of this run (same run id, started no earlier
    than ``started_at`` minus 10 minutes); returns (docs by rank, missing ranks)."""
    deadline = time.monotonic() + timeout_s
    found: dict[int, dict[str, Any]] = {}
    while True:
        for rank in range(replica.world_size):
            if rank in found:
                continue
            path = rank_path(out, rank)
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            rep = (doc.get("metadata") or {}).get("replica") or {}
            if (
                doc.get("complete")
                and rep.get("run_id") == replica.run_id
                and float(doc.get("started_unix", 0)) >= started_at - 600
            ):
                found[rank] = doc
        missing = [r for r in range(replica.world_size) if r not in found]
        if not missing or time.monotonic() >= deadline:
            return found, missing
        time.sleep(poll_s)


def aggregate_replicas(
    docs: dict[int, dict[str, Any]],
    key_fields: Sequence[str],
    value_fields: Sequence[str],
) -> list[dict[str, Any]]:
    """One result per key: rank 0's (or the lowest rank's) record, its ``value_fields`` replaced
    by the median over the ranks where that cell is ``ok``, plus per-rank values/statuses."""
    grouped: dict[tuple, dict[int, dict[str, Any]]] = {}
    order: list[tuple] = []
    for rank in sorted(docs):
        for res in docs[rank].get("results", []):
            key = tuple(json.dumps(res.get(f), sort_keys=True) for f in key_fields)
            if key not in grouped:
                grouped[key] = {}
                order.append(key)
            grouped[key][rank] = res
    merged = []
    for key in order:
        per_rank = grouped[key]
        base = dict(per_rank[min(per_rank)])
        ok = {r: res for r, res in per_rank.items() if res.get("status") == "ok"}
        base["replica_statuses"] = {str(r): res.get("status") for r, res in per_rank.items()}
        values: dict[str, dict[str, Any]] = {}
        for name in value_fields:
            vals = {r: res.get(name) for r, res in ok.items()}
            numeric = [v for v in vals.values() if isinstance(v, (int, float))]
            values[name] = {str(r): v for r, v in vals.items()}
            if numeric:
                base[name] = statistics.median(numeric)
        base["replica_values"] = values
        statuses = {res.get("status") for res in per_rank.values()}
        if ok and len(ok) < len(per_rank):
            base["status"] = "ok"
            base["note"] = (
                f"ok on ranks {sorted(ok)} of {sorted(per_rank)}; median over the ok ranks"
            )
        elif not ok and len(statuses) > 1:
            base["note"] = f"statuses per rank: {base['replica_statuses']}"
        merged.append(base)
    return merged


# ---- a run's document: checkpoints, completion, replica aggregate ---------------------------
def add_run_options(group: Any) -> None:
    """--seed, --device and --replica-timeout-s (an argparse group of a benchmark's parser)."""
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--device", default="auto", help="auto (cuda if available), cuda, cuda:N, cpu"
    )
    group.add_argument(
        "--replica-timeout-s",
        type=float,
        default=7200.0,
        help="under torchrun, how long rank 0 waits for the other ranks' files (default 7200)",
    )


def result_doc(
    benchmark: str,
    *,
    started_unix: float,
    metadata: dict[str, Any],
    config: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """A run's (still incomplete) JSON document; ``extra`` fields come before ``results``."""
    return {
        "benchmark": benchmark,
        "schema": 1,
        "complete": False,
        "started_unix": started_unix,
        "metadata": metadata,
        "config": config,
        **extra,
        "results": [],
    }


ResultsCallback = Callable[[list[dict[str, Any]]], None]


def run_and_report(
    doc: dict[str, Any],
    run: Callable[[ResultsCallback], list[dict[str, Any]]],
    finish: Callable[[dict[str, Any], Path | None], str],
    *,
    out: Path | None,
    replica: Replica | None,
    replica_timeout_s: float,
    key_fields: Sequence[str],
    value_fields: Sequence[str],
    drop_fields: Sequence[str] = (),
    before_rank_write: Callable[[dict[str, Any]], None] | None = None,
    on_aggregate: Callable[[dict[str, Any], dict[int, dict[str, Any]], list[int]], None]
    | None = None,
) -> int:
    """Run a benchmark into ``doc`` and report it; returns the exit status (0).

    ``run(checkpoint)`` returns the results; ``checkpoint(results)`` rewrites the incomplete
    JSON (``out``, under ``torchrun`` its rank file) at most every 5 s, so a killed run keeps
    what it measured. Then the document is marked complete and ``finish(doc, out)`` (derive,
    render, write; returns the markdown) is printed. Under ``torchrun`` every rank writes its
    complete rank file (after ``before_rank_write(doc)``) and only rank 0 reports: without
    ``out`` its own document, else the aggregate over the ranks' files (``aggregate_replicas``
    on ``key_fields`` / ``value_fields``; ``drop_fields`` removed from each result, to be
    derived again by ``finish``; ``on_aggregate(agg, docs, missing)`` adds to it).
    """
    write_to = out
    if replica is not None and out is not None:
        write_to = rank_path(out, replica.rank)

    last_write = [0.0]

    def checkpoint(results: list[dict[str, Any]]) -> None:
        """Rewrite the (incomplete) JSON at most every few seconds: a killed run keeps it."""
        if write_to is not None and time.monotonic() - last_write[0] > 5:
            doc["results"] = results
            write_json(write_to, doc)
            last_write[0] = time.monotonic()

    doc["results"] = run(checkpoint)
    doc["complete"] = True
    doc["finished_unix"] = time.time()
    if replica is None:
        print(finish(doc, out))
        return 0
    if write_to is not None:
        if before_rank_write is not None:
            before_rank_write(doc)
        write_json(write_to, doc)
    if replica.rank != 0:
        return 0
    if out is None:
        print(finish(doc, None))
        return 0
    docs, missing = wait_for_ranks(
        out, replica, started_at=doc["started_unix"], timeout_s=replica_timeout_s
    )
    agg = dict(doc)
    agg["results"] = aggregate_replicas(docs, key_fields, value_fields)
    for r in agg["results"]:
        for name in drop_fields:
            r.pop(name, None)
    agg["replicas_found"] = sorted(docs)
    agg["replicas_missing"] = missing
    agg["rank_files"] = [str(rank_path(out, r)) for r in sorted(docs)]
    if on_aggregate is not None:
        on_aggregate(agg, docs, missing)
    print(finish(agg, out))
    return 0

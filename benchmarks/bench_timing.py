"""Timing and memory of the benchmark scripts: what a benchmark calls and how it is timed.

- `Runner`, `make_leaves`, `autograd_runner`: an arm's call (its untimed ``setup`` and the
  timed ``run``) for forward, backward or both.
- `time_fn`: median of N repetitions, CUDA events on a GPU (warm-up excluded), perf_counter on
  the CPU; an optional per-repetition ``setup`` runs outside the timed region. `time_runner`:
  the same with a benchmark's warm-up, repetitions and budget (`reps_within_budget`).
- `time_interleaved` / `time_paced` / `time_views`: arms timed call by call in alternation
  (`interleaved_turns`, rounds in the orders of `balanced_orders`); `time_views` gives each arm's
  back-to-back (device throughput) and one-call-then-synchronize (latency) times and the host
  time to issue one call. `call_views`, `events_ms`, `cuda_graph`: one arm on its own.
- `peak_extra_mib`: peak GPU memory of one call beyond what was allocated before.
- `time_fn_distributed`, `any_rank`, `gather_per_rank`, `barrier`: an op that makes collective
  calls timed across the ranks of a process group (fixed repetitions between barriers, the
  slowest rank per repetition), and the ranks' agreement on what to do next.

Imports only torch (torch.distributed inside the functions that need it).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

MiB = 2**20


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    ``arms`` maps a name to ``(fn, setup)``. Every repetition calls each arm once, in the orders
    of `balanced_orders`, so that clock and thermal drift, the position in the sequence and the
    arm called just before hit all arms alike; repetition ``i`` of two arms is a paired sample.
    Nothing synchronizes between calls (``warmup`` rounds first fill the device's queue), so on CUDA
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


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` arms for successive rounds: a Williams design, a Latin square whose rows
    also give every arm each other arm as its predecessor equally often (``n`` rows for even
    ``n``, ``2 n`` for odd: the square's rows each followed by its reverse, so that any two
    rounds from an even place on give every adjacent pair both directions: a cell capped
    at a few rounds, short of the 2 n of a full cycle, is still balanced that far).

    Why not rotation: rotating one order keeps every arm behind the same neighbour in almost
    every round, and what the arm before leaves behind (the host's caches after another
    launcher's Python, the device's clocks after a long kernel) then biases one arm's time.
    Seen on an H200 (session 15, ``bench_video.py`` at Wan 480p, arms dense, auto, fa4, ...):
    ``auto``, behind dense FA4 in 4 of 5 rounds, issued the same fa4 call in 1.02 ms of host
    time where the ``fa4`` arm, behind ``auto``, took 0.77 ms (session 14: 1.04 / 0.93)."""
    if n <= 0:
        return [[]]
    first = [(j + 1) // 2 if j % 2 else (n - j // 2) % n for j in range(n)]
    rows = [[(a + r) % n for a in first] for r in range(n)]
    if n % 2 and n > 1:
        return [order for row in rows for order in (row, row[::-1])]
    return rows


def interleaved_turns(
    arms: dict[str, tuple[Callable[[Any], Any], Callable[[], Any] | None]],
    device: torch.device,
    *,
    rounds: int,
    calls: int | dict[str, int] = 1,
    synchronized: bool = False,
    record: bool = True,
) -> dict[str, list[Turn]]:
    """``rounds`` rounds in which every arm takes one turn, round ``i`` in the order
    ``balanced_orders(len(arms))[i % len]`` (each arm as often in each place, and after each
    other arm, over a full cycle of orders).

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
    orders = balanced_orders(len(names))
    done: list[tuple[str, int, Any, Any, float]] = []
    for i in range(max(0, rounds)):
        for name in (names[j] for j in orders[i % len(orders)]):
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


WARM_SPIN_S = 0.005
"""Seconds the host spins before a ``host_warm_ms`` call (see `call_views`)."""


def spin(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` (no sleep: the core stays awake)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def call_views(
    fn: Callable[[], Any],
    reps: int,
    b2b_calls: int = 10,
    warmup: int = 3,
    b2b_rounds: int = 3,
    warm_host: bool = False,
) -> dict[str, float]:
    """One arm on its own, both views (medians): ``host_ms`` to issue one call with the queue
    drained, ``once_ms`` one call between events then a synchronize (latency), ``b2b_ms``
    calls back to back (device throughput; median of ``b2b_rounds`` rounds of ``b2b_calls``).
    ``warmup`` calls first. In all ``warmup + 2 * reps + b2b_rounds * b2b_calls`` calls: a step
    of seconds (Wan 14B) wants the fewest.

    ``warm_host`` adds ``host_warm_ms`` (``reps`` more calls): the same host time, but the host
    spins `WARM_SPIN_S` after the synchronize before the call. Why: the host time of a call
    made right after a long wait grows with the wait, whatever the call runs. On an H200
    (session 16, bench_video) dense FA4's own call, the same Python at every shape, took 0.24 ms
    at Wan 480p (9 ms calls) and 0.50-0.67 ms at the 720p latents (150-264 ms calls), and the
    op's profile at Wan 720p had every function 1.5-2x its 480p time: the waiting core cools
    (its clock, its caches). ``host_warm_ms`` is the call's own cost."""
    if reps < 1 or b2b_calls < 1 or b2b_rounds < 1 or warmup < 0:
        raise ValueError(
            f"call_views needs reps, b2b_calls, b2b_rounds >= 1 and warmup >= 0, got "
            f"{reps}, {b2b_calls}, {b2b_rounds}, {warmup}"
        )
    for _ in range(warmup):
        fn()
    host, once = [], []
    for _ in range(reps):
        host.append(_issue_ms(fn))
        once.append(events_ms(fn, 1))
    b2b = statistics.median(events_ms(fn, b2b_calls) for _ in range(b2b_rounds))
    views = {"host_ms": statistics.median(host), "once_ms": statistics.median(once), "b2b_ms": b2b}
    if warm_host:
        views["host_warm_ms"] = statistics.median(_issue_ms(fn, WARM_SPIN_S) for _ in range(reps))
        torch.cuda.synchronize()
    return views


def _issue_ms(fn: Callable[[], Any], spin_s: float = 0.0) -> float:
    """Wall-clock ms to issue one call of ``fn`` with the device drained before it (after
    spinning ``spin_s`` seconds on the host)."""
    torch.cuda.synchronize()
    spin(spin_s)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


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


# ---- sequence parallel: timing across the ranks of a process group ----------------------------
# Every function here is a collective of the default process group (torch.distributed must be
# initialized): every rank calls it, in the same order. NCCL needs CUDA tensors, gloo CPU ones,
# so the small exchange tensors live on the benchmark's device.
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

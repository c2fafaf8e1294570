"""Replayed launches: the fork's entry points without upstream's per-call Python.

Upstream's launchers (``_flash_attn_fwd``, ``_flash_attn_bwd``) spend a fifth of a millisecond
or more of host time on every call (argument checks, a compile key of some sixty fields, the
assembly of the compiled kernels' arguments) before their compiled kernels run: at Wan 2.1 480p
that was most of what separated a forward call waited for from calls back to back. What they
compute there depends only on the call's description: the dtype, shape, strides, device and
address alignment of each tensor, the scalars, the kernel being built. So an entry point
records, on the second call of each description, what upstream's launcher does to the device, in
order: the ATen operations it runs (allocations, fills, views: a dispatch mode sees each) and
the compiled kernels it calls (every compile cache of upstream's launchers hands its kernels to
the recorder: the fork's scoped caches, `sm90_blocks.ScopedCompileCache`, and the others,
watched from the first recording on). Later calls of the same description run that program: the
ATen operations again on the new tensors, the compiled kernels called directly, the caller's
tensors put where the first call's were.

A record is kept only when every tensor the program reads is one of the caller's tensors (same
object, or same pointer, dtype, shape and strides; an ambiguous match between two non-empty
caller tensors is not recorded) or made by an earlier step of the program; every operation
returns tensors (an operation whose result the host reads, ``.item()`` say, makes the launch
data-dependent); and every other argument is a value the replay can rebuild (tuples, lists and
named tuples are rebuilt; ``None``, numbers, strings, enums, dtypes and devices are constants,
except a number equal to a caller tensor's address, which would be stale on a replay).
The first call of a description is not recorded (it may compile); a description whose
recording fails twice runs upstream's launcher on every call, as without replay.

Not seen, so assumed absent (the GPU tests compare replays with upstream's launches bitwise):
device work upstream would start other than through ATen or a compile cache of
``flash_attn.cute.interface``, and host state its launch depends on beyond the description
(environment variables read per call, say). Replay never applies to tensors off CUDA or to fake
tensors (a compile without a GPU), nor while torch.compile traces; the entry points take
``replay=False`` to run upstream's launcher always (the benchmarks' comparison). Records live in
bounded caches of launches already made (`FORWARDS`, `BACKWARDS`), like upstream's compile
caches, not settings.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from flash_attn_vsa import build_scope

__all__ = [
    "BACKWARDS",
    "FORWARDS",
    "UPSTREAM_KERNELS",
    "LaunchReplay",
    "RecordedLaunch",
    "backward",
    "backward_tensors",
    "declare_leading_dims",
    "forward",
    "forward_tensors",
    "no_scope",
]

RECORDER = "launch_record"
"""The `build_scope.traced` stack the recording entry point pushes its trace on."""

ATTEMPTS = 2
"""Recordings of a description that may fail before it runs upstream's launcher for good. The
first call of a description is never recorded: it may compile, which is more than later calls
do."""

_CONSTANT_TYPES = (
    type(None), bool, int, float, complex, str, enum.Enum, torch.dtype, torch.device,
    torch.layout, torch.memory_format,
)  # fmt: skip


class _Unrecordable(Exception):
    """The launch being recorded cannot be replayed (the message says why)."""


class _Caller:
    """The caller's tensor number ``index`` (a replay puts the new call's there)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Made:
    """The tensor the program's step made as its value number ``index``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _describe(t: torch.Tensor | None) -> Hashable:
    if t is None:
        return None
    return (t.dtype, t.shape, t.stride(), t.device)


def _owners(tensors: Sequence[torch.Tensor | None]) -> dict[tuple, int]:
    """Caller tensors by (pointer, description): where several coincide (the backward's full
    and partial lists are one tensor), the first. Which ones coincide is part of a call's
    description (`_full_key`), so a record only replays calls whose tensors coincide alike,
    where the first stands for the others."""
    owners: dict[tuple, int] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            owners.setdefault((t.data_ptr(), *_describe(t)), i)
    return owners


class _Trace:
    """What a recording sees, in order: ATen operations and compiled-kernel calls, with their
    tensors as references to the caller's tensors or to values earlier steps made."""

    def __init__(self, tensors: Sequence[torch.Tensor | None], owners: dict[tuple, int]) -> None:
        self.steps: list[tuple[Any, ...]] = []
        self.by_id = {id(t): _Caller(i) for i, t in enumerate(tensors) if t is not None}
        self.owners = owners
        self.pointers = {key[0] for key in owners if key[0]}
        self.made: list[torch.Tensor] = []  # kept alive while recording: ids stay unique
        self.in_kernel = False
        self.failure: str | None = None  # why the launch cannot be replayed

    def template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            ref = self.by_id.get(id(value))
            if ref is None:
                index = self.owners.get((value.data_ptr(), *_describe(value)))
                if index is None:
                    raise _Unrecordable("a tensor neither the caller's nor made by the launch")
                ref = _Caller(index)
            return ref
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)._make(self.template(v) for v in value)
        if isinstance(value, (tuple, list)):
            return type(value)(self.template(v) for v in value)
        if isinstance(value, dict):
            return {name: self.template(v) for name, v in value.items()}
        if type(value) is int and value in self.pointers:
            raise _Unrecordable("a caller tensor's address as a number (stale on a replay)")
        if isinstance(value, _CONSTANT_TYPES):
            return value
        raise _Unrecordable(f"an argument of type {type(value).__name__}")

    def bind(self, value: Any) -> Any:
        """Number the tensors an operation made (its outputs' template)."""
        if isinstance(value, torch.Tensor):
            ref = _Made(len(self.made))
            self.made.append(value)
            self.by_id[id(value)] = ref
            return ref
        if isinstance(value, (tuple, list)):
            return type(value)(self.bind(v) for v in value)
        if value is None:
            return None
        raise _Unrecordable(f"an operation whose result the host reads ({type(value).__name__})")

    def wrap(self, compiled: Any) -> Callable[..., Any]:
        """``compiled``, recorded when called (once, however many caches hand it out)."""
        if getattr(compiled, "trace", None) is self:
            return compiled

        def call(*args: Any, **kwargs: Any) -> Any:
            self.record(lambda: ("kernel", compiled, self.template(args), self.template(kwargs)))
            self.in_kernel = True  # what its wrapper does with the tensors is the kernel's
            try:
                return compiled(*args, **kwargs)
            finally:
                self.in_kernel = False

        call.trace = self  # type: ignore[attr-defined]
        return call

    def record(self, step: Callable[[], tuple[Any, ...]]) -> None:
        """Append ``step()`` unless the trace failed; a failure is noted, never raised into
        upstream's launch (which runs on, as without a recording)."""
        if self.failure is not None:
            return
        try:
            self.steps.append(step())
        except _Unrecordable as why:
            self.failure = str(why)


def recording_wrapper(compiled: Any) -> Any:
    """``compiled`` as a compile cache hands it out: recorded while an entry point records its
    launch on this thread (`LaunchReplay`), else unchanged."""
    traces = build_scope.trace_stack(RECORDER)
    return traces[-1].wrap(compiled) if traces else compiled


class _WatchedCache:
    """An upstream compile cache that hands its kernels out through `recording_wrapper`."""

    def __init__(self, upstream: Any) -> None:
        self.upstream = upstream

    def __contains__(self, key: Any) -> bool:
        return key in self.upstream

    def __getitem__(self, key: Any) -> Any:
        return recording_wrapper(self.upstream[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        self.upstream[key] = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.upstream, name)


@functools.cache
def _watch_upstream_caches() -> None:
    """Every compile cache of upstream's launchers (``flash_attn.cute.interface``: the forward
    and backward ones, their pre/post-processing, combine, scheduler metadata...) hands its
    kernels out through `recording_wrapper`, so that a recording sees every compiled call a
    launch makes, not only those of the caches the fork scopes (once per process)."""
    try:
        import flash_attn.cute.interface as interface
    except ImportError:  # no upstream: nothing of it can launch
        return
    for name in dir(interface):
        launcher = getattr(interface, name)
        cache = getattr(launcher, "compile_cache", None)
        if callable(launcher) and cache is not None and not isinstance(cache, _WatchedCache):
            launcher.compile_cache = _WatchedCache(cache)


class _RecordOps(TorchDispatchMode):
    """Records every ATen operation run while active (outside compiled kernels' wrappers)."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.trace.in_kernel:
            trace = self.trace

            def step() -> tuple[Any, ...]:
                args_t, kwargs_t = trace.template(args), trace.template(kwargs)
                return ("op", func, args_t, kwargs_t, trace.bind(result))

            trace.record(step)
        return result


Filler = Callable[[Sequence[Any], list[Any]], Any]
"""A template made into a function of (the call's tensors, the values made so far): built once
per record, so that a replay rebuilds only what holds a tensor."""


def _has_refs(template: Any) -> bool:
    if isinstance(template, (_Caller, _Made)):
        return True
    if isinstance(template, (tuple, list)):
        return any(_has_refs(v) for v in template)
    if isinstance(template, dict):
        return any(_has_refs(v) for v in template.values())
    return False


def _filler(template: Any) -> Filler:
    if isinstance(template, _Caller):
        index = template.index
        return lambda tensors, made: tensors[index]
    if isinstance(template, _Made):
        index = template.index
        return lambda tensors, made: made[index]
    if isinstance(template, tuple) and not _has_refs(template):
        return lambda tensors, made: template  # immutable and tensor-free: shared
    if isinstance(template, dict):
        parts = {name: _filler(v) for name, v in template.items()}
        return lambda tensors, made: {name: f(tensors, made) for name, f in parts.items()}
    if isinstance(template, (tuple, list)):
        items = [_filler(v) for v in template]
        rebuild = type(template)._make if hasattr(template, "_fields") else type(template)
        return lambda tensors, made: rebuild(f(tensors, made) for f in items)
    return lambda tensors, made: template


def _store(template: Any, value: Any, made: list[Any]) -> None:
    if isinstance(template, _Made):
        made[template.index] = value
    elif isinstance(template, (tuple, list)):
        for t, v in zip(template, value, strict=True):
            _store(t, v, made)


class RecordedLaunch:
    """A launch as a program (see the module doc): its steps, how many tensors they make, and
    the template of what the launcher returned."""

    def __init__(self, steps: list[tuple[Any, ...]], made: int, result: Any) -> None:
        self.steps = steps
        self.made = made
        self._program = [  # (function, its arguments, its keyword arguments, outputs)
            (_replayed(step[1]), _filler(step[2]), _filler(step[3]),
             step[4] if step[0] == "op" else None)
            for step in steps
        ]  # fmt: skip
        self._result = _filler(result)

    @property
    def kernels(self) -> int:
        """Compiled-kernel calls per replay."""
        return sum(step[0] == "kernel" for step in self.steps)

    @property
    def operations(self) -> list[str]:
        """The ATen operations a replay runs, in order."""
        return [str(step[1]) for step in self.steps if step[0] == "op"]

    def __call__(self, tensors: Sequence[torch.Tensor | None]) -> Any:
        made: list[Any] = [None] * self.made
        for fn, args, kwargs, outputs in self._program:
            value = fn(*args(tensors, made), **kwargs(tensors, made))
            if outputs is not None:
                _store(outputs, value, made)
        return self._result(tensors, made)


def _replayed(fn: Any) -> Callable[..., Any]:
    """What a replay calls for a recorded step's function: the Tensor method of the same ATen
    operation where one binds it directly (``aten.detach.default`` called as an overload costs
    ~1.5 us of Python a call, ``Tensor.detach`` ~0.5: upstream's launchers detach q, k, v and
    the output on every call), else the function itself."""
    return _SAME_AS_METHOD.get(fn, fn)


_SAME_AS_METHOD = {torch.ops.aten.detach.default: torch.Tensor.detach}


ALIGNMENT = 16
"""Bytes of address alignment a call's description records per tensor (the alignment compiled
kernels may assume: a misaligned tensor is another description)."""


def _full_key(
    key: Hashable,
    tensors: Sequence[torch.Tensor | None],
    on_devices: Callable[[torch.Tensor], bool] | None = None,
) -> Hashable | None:
    """``key`` and, per tensor, its description, its address's alignment and the earlier
    tensor at the same address (None if none). Where addresses coincide, the descriptions
    in the key tell which tensors coincide in address and description too (what `_owners`
    maps), so equal keys mean equal coincidences. With ``on_devices`` (`_device_test`),
    None instead when the call cannot be replayed: a tensor off those devices or a fake
    tensor (a compile without a GPU), or torch.compile tracing. One pass over the tensors,
    on every call: ~0.5 us a tensor here (an address dict of ints; a test of
    ``t.device.type`` costs ~0.3 us a tensor by itself)."""
    checked = on_devices is not None
    if checked and torch.compiler.is_compiling():
        return None
    first: dict[int, int] = {}
    described = []
    for i, t in enumerate(tensors):
        if t is None:
            described.append(None)
            continue
        # a plain tensor is neither fake nor a subclass: two isinstance checks saved per tensor
        if checked and (
            (
                type(t) is not torch.Tensor
                and (not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor))
            )
            or not on_devices(t)
        ):
            return None
        pointer = t.data_ptr()
        same_as = first.setdefault(pointer, i)
        # `_describe`'s fields, inline: no call per tensor on this path
        described.append((t.dtype, t.shape, t.stride(), t.device, pointer % ALIGNMENT,
                          None if same_as == i else same_as))  # fmt: skip
    return (key, tuple(described))


def _device_test(devices: frozenset[str]) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor is on one of ``devices`` (device types), by the tensor's own flag
    where there is one (``is_cuda``: ~0.05 us against ~0.3 for ``device.type``)."""
    if devices == {"cuda"}:
        return lambda t: t.is_cuda
    if devices == {"cpu"}:
        return lambda t: t.is_cpu
    return lambda t: t.device.type in devices


class LaunchReplay:
    """Recorded launches, by call description (at most ``capacity``; the oldest goes first),
    for tensors on ``devices`` (device types; other calls always run upstream's launcher)."""

    def __init__(self, capacity: int = 256, devices: Sequence[str] = ("cuda",)) -> None:
        self.capacity = capacity
        self.devices = frozenset(devices)
        self._on_devices = _device_test(self.devices)
        self._records: dict[Hashable, Any] = {}

    def run(
        self,
        key: Hashable,
        tensors: Sequence[torch.Tensor | None],
        upstream: Callable[[], Any],
        enabled: bool = True,
    ) -> Any:
        """``upstream()`` (the entry point's call of upstream's launcher), or its record for a
        call described by ``key`` (the non-tensor arguments, hashable) and ``tensors`` (every
        tensor the caller passes, outputs included); ``enabled=False`` (an entry point's
        ``replay=False``) always runs ``upstream()``."""
        full_key = _full_key(key, tensors, self._on_devices) if enabled else None
        if full_key is None:
            return upstream()
        calls = self._records.get(full_key, 0)  # calls not recorded so far, or the record
        if isinstance(calls, RecordedLaunch):
            return calls(tensors)
        if calls > ATTEMPTS:
            return upstream()
        if calls == 0:  # the first call may compile: never recorded
            result, made = upstream(), False
        else:
            result, made = self._record(upstream, tensors)
        if len(self._records) >= self.capacity and full_key not in self._records:
            self._records.pop(next(iter(self._records)))
        self._records[full_key] = made if made else calls + 1
        return result

    def recorded(self, key: Hashable, tensors: Sequence[torch.Tensor | None]) -> Any:
        """The `RecordedLaunch` of a call so described, False when it runs upstream's launcher
        for good, None when not (yet) decided."""
        record = self._records.get(_full_key(key, tensors))
        if isinstance(record, RecordedLaunch):
            return record
        return False if record is not None and record > ATTEMPTS else None

    def records(self) -> list[RecordedLaunch]:
        """The launches recorded so far (every description's that replays)."""
        return [r for r in self._records.values() if isinstance(r, RecordedLaunch)]

    def clear(self) -> None:
        self._records.clear()

    @staticmethod
    def _record(upstream, tensors) -> tuple[Any, RecordedLaunch | bool]:
        """Run ``upstream()`` recorded: its result and a `RecordedLaunch`, or False (not
        replayable)."""
        owners = _owners(tensors)
        _watch_upstream_caches()
        trace = _Trace(tensors, owners)
        ops = _RecordOps(trace)
        with build_scope.traced(RECORDER, trace), ops:
            result = upstream()
        if trace.failure is not None:
            return result, False
        try:
            result_template = trace.template(result)
        except _Unrecordable:
            return result, False
        return result, RecordedLaunch(trace.steps, len(trace.made), result_template)


FORWARDS = LaunchReplay()
"""Forward launches' records (their keys hold the fork's `fwd_sm90.ForwardKernel`, or
`UPSTREAM_KERNELS` for upstream's own kernels)."""

BACKWARDS = LaunchReplay()
"""Backward launches' records (their keys hold the fork's `bwd_sm90.TileConfig`, or
`UPSTREAM_KERNELS`)."""


def _list_tensors(block_sparse_tensors: Any) -> tuple[Any, ...]:
    bst = block_sparse_tensors
    return (bst.mask_block_cnt, bst.mask_block_idx, bst.full_block_cnt, bst.full_block_idx)


def declare_leading_dims(aux_tensors: Sequence[torch.Tensor] | None) -> None:
    """Give each aux tensor whose stride-1 dimension upstream cannot tell apart a declared
    one (``__leading_dim__``, upstream's attribute for it: its innermost stride-1 dimension).

    Upstream's launchers take an aux tensor's leading dimension to be its only stride-1
    dimension, or among several the only one longer than 1, and raise otherwise. A tensor
    with several stride-1 dimensions all of length 1 (the dS path's slot starts [B, H, NKV]
    of a one-key-block call with one head: (1, 1, 1), strides (1, 1, 1)) is such a tensor.
    The declaration only matters where upstream reads it (compile keys and compiles, not
    replays), so a launch's ``upstream()`` calls this: a replay pays nothing for it."""
    for t in aux_tensors or ():
        unit = [dim for dim, stride in enumerate(t.stride()) if stride == 1]
        if len(unit) > 1 and sum(t.shape[dim] > 1 for dim in unit) != 1:
            t.__leading_dim__ = unit[-1]


def forward(
    kernel: Any,
    building: Callable[[Any], AbstractContextManager[Any]],
    q: Any,
    k: Any,
    v: Any,
    block_sparse_tensors: Any,
    *,
    softmax_scale: float,
    mask_mod: Any,
    aux_tensors: Sequence[Any] | None,
    out: Any,
    lse: Any,
    replay: bool,
    return_lse: bool = True,
) -> tuple[Any, Any]:
    """A forward entry point's launch: upstream's ``_flash_attn_fwd`` inside
    ``building(kernel)`` (the entry point's scope of its `fwd_sm90.ForwardKernel`), replayed
    from `FORWARDS` after the first calls of a description unless ``replay`` is False.
    Returns ``(out, lse)`` (lse None when ``return_lse`` is False and none is given)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    def upstream() -> tuple[Any, Any]:
        declare_leading_dims(aux_tensors)
        with building(kernel):
            result = _flash_attn_fwd(
                q, k, v, softmax_scale=softmax_scale, mask_mod=mask_mod,
                aux_tensors=aux_tensors, block_sparse_tensors=block_sparse_tensors,
                return_lse=return_lse, out=out, lse=lse,
            )  # fmt: skip
        return result[0], result[1]

    tensors = forward_tensors(q, k, v, block_sparse_tensors, aux_tensors, out, lse)
    key = (kernel, tuple(block_sparse_tensors.block_size or ()), softmax_scale, mask_mod,
           len(aux_tensors or ()), return_lse)  # fmt: skip
    return FORWARDS.run(key, tensors, upstream, enabled=replay)


def backward(
    kernel: Any,
    building: Callable[[Any], AbstractContextManager[Any]],
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    dout: Any,
    lse: Any,
    block_sparse_tensors: Any,
    *,
    softmax_scale: float,
    mask_mod: Any,
    aux_tensors: Sequence[Any] | None,
    dq: Any,
    dk: Any,
    dv: Any,
    replay: bool,
) -> tuple[Any, Any, Any]:
    """A backward launch: upstream's ``_flash_attn_bwd`` inside ``building(kernel)`` (the
    entry point's scope of its `bwd_sm90.TileConfig`, or none for upstream's own kernels),
    replayed from `BACKWARDS` after the first calls of a description unless ``replay`` is
    False. Returns ``(dq, dk, dv)``."""
    from flash_attn.cute.interface import _flash_attn_bwd

    def upstream() -> tuple[Any, Any, Any]:
        declare_leading_dims(aux_tensors)
        with building(kernel):
            grads = _flash_attn_bwd(
                q, k, v, out, dout, lse, softmax_scale=softmax_scale, mask_mod=mask_mod,
                aux_tensors=aux_tensors, block_sparse_tensors=block_sparse_tensors,
                dq=dq, dk=dk, dv=dv,
            )  # fmt: skip
        return grads[0], grads[1], grads[2]

    tensors = backward_tensors(
        q, k, v, out, dout, lse, block_sparse_tensors, aux_tensors, dq, dk, dv
    )
    key = (kernel, tuple(block_sparse_tensors.block_size or ()), softmax_scale, mask_mod,
           len(aux_tensors or ()))  # fmt: skip
    return BACKWARDS.run(key, tensors, upstream, enabled=replay)


def no_scope(kernel: Any) -> AbstractContextManager[Any]:
    """The ``building`` of upstream's own kernels (called outside the fork's entry points)."""
    return nullcontext()


UPSTREAM_KERNELS = "upstream"
"""The ``kernel`` of a launch of upstream's own kernels (its records' key)."""


def forward_tensors(
    q: Any, k: Any, v: Any, block_sparse_tensors: Any, aux_tensors: Sequence[Any] | None,
    out: Any, lse: Any,
) -> tuple[Any, ...]:  # fmt: skip
    """Every tensor a forward entry point's caller passes."""
    lists = _list_tensors(block_sparse_tensors)
    return (q, k, v, out, lse, *lists, *(aux_tensors or ()))


def backward_tensors(
    q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, block_sparse_tensors: Any,
    aux_tensors: Sequence[Any] | None, dq: Any, dk: Any, dv: Any,
) -> tuple[Any, ...]:  # fmt: skip
    """Every tensor the backward entry point's caller passes."""
    lists = _list_tensors(block_sparse_tensors)
    return (q, k, v, out, dout, lse, dq, dk, dv, *lists, *(aux_tensors or ()))

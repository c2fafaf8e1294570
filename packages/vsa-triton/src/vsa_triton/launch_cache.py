"""Triton launches without ``JITFunction.run``'s per-call Python, once a call is known.

``kernel[grid](*args)`` for this package's pooling kernel (30 arguments) took 63 us of host
time on one H200 host and 17.9 us on a faster one, against 18 / 6.7 us for the compiled
kernel's own launcher with the same arguments (`research/triton_launch_cost.py`, 2026-12-03,
`benchmarks/results/2026-12-03-h200-triton_launch_cost*.jsonl`): the rest is Triton's binder,
its cache key (a string of the options every call) and its checks. This module's own
description of a call costs Python too: its first version took the launch to 16.7 us on the
fast host (1.2 us saved); the description was made cheaper since (~5 us less on this
project's CPU machine), not yet timed on a GPU.

`launch(kernel, grid, *args, **kwargs)` describes the call no coarser than Triton specializes
a compiled kernel: each tensor's dtype and whether its address is 16-byte aligned; every
other argument as it is (Triton specializes ints on their type range, on 1 and on
divisibility by 16, constexprs on their values); the launch options (``num_warps``...); the
current device. The first two calls of a description run through
``kernel[grid]`` as usual; when both got the same compiled kernel, later calls hand that
kernel's launcher the arguments directly (on the current device's current stream, as Triton
does). Two different kernels for one description mark it as Triton's own for good (the
description missed something Triton specializes on). Anything else runs ``kernel[grid]``:
the interpreter, a launch hook someone added (profilers), an argument of another type, a
kernel with pre-run hooks.

Triton is imported on the first launch, never with this module (vsa-fa4's list kernels launch
through it too). Internals of Triton this relies on
(3.6; checked on a GPU by this package's ``test_gpu.py``):
``JITFunction.params`` and ``arg_names``, ``kernel[grid](...)`` returning the
``CompiledKernel``, and its ``run(grid0, grid1, grid2, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *every_argument)``.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch

ATTEMPTS = 2
"""Calls of a description that run through ``kernel[grid]`` before it launches directly."""

_TRITONS_OWN = object()
"""A description's record when two calls compiled different kernels: always ``kernel[grid]``."""


class _NotDescribed(Exception):
    """An argument this module does not describe: the call runs through ``kernel[grid]``."""


class _Kernel:
    """One JIT kernel's parameters and its launches' records."""

    def __init__(self, kernel: Any) -> None:
        from triton.runtime.jit import JITFunction

        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction)  # not the interpreter's function
        params = kernel.params if self.direct else ()
        self.names = [p.name for p in params]
        self.constexpr = [p.is_constexpr for p in params]
        self.name_set = frozenset(self.names)
        self.defaults = {p.name: p.default for p in params if p.has_default}
        self.records: dict[Hashable, Any] = {}

    def bind(self, args: tuple, kwargs: dict) -> tuple[list[Any], tuple]:
        """Every parameter's value in order (defaults filled) and the launch options."""
        try:
            values = [*args, *(kwargs[name] if name in kwargs else self.defaults[name]
                               for name in self.names[len(args) :])]  # fmt: skip
        except KeyError:  # a parameter without a value: Triton's own error message
            raise _NotDescribed from None
        extra = kwargs.keys() - self.name_set
        return values, tuple(sorted((k, kwargs[k]) for k in extra)) if extra else ()

    def key(self, values: list[Any], options: tuple, device: int) -> Hashable:
        """The call's description: each tensor's dtype and whether its address is 16-byte
        aligned, every other value as it is (finer than what Triton specializes ints and
        floats on: sizes, strides and scales repeat call to call at one shape)."""
        described = [
            (v.dtype, not v.data_ptr() & 15) if type(v) is torch.Tensor
            else v if type(v) in _PLAIN else _other(v)
            for v in values
        ]  # fmt: skip
        return (device, tuple(described), options)


_PLAIN = frozenset((int, float, bool, str, type(None)))


def _other(value: Any) -> Hashable:
    """A value neither a plain tensor nor a plain scalar: itself if hashable and not a tensor
    (a Triton dtype constexpr, say); a tensor subclass goes to Triton's own launch (its
    description would hold the tensor)."""
    if isinstance(value, torch.Tensor):
        raise _NotDescribed
    hash(value)  # TypeError when unhashable: Triton's own launch
    return value


_KERNELS: dict[int, _Kernel] = {}
"""Records by kernel object id (the kernels are module-level objects that live as long as the
process; a dict by id costs a tenth of hashing a JITFunction)."""


def _kernel(kernel: Any) -> _Kernel:
    record = _KERNELS.get(id(kernel))
    if record is None or record.kernel is not kernel:
        record = _KERNELS[id(kernel)] = _Kernel(kernel)
    return record


@functools.cache
def _runtime() -> Any:
    from triton import knobs

    return knobs.runtime


def _hooked() -> bool:
    """Whether Triton would call a launch hook (a profiler's, say): then it launches."""
    runtime = _runtime()
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, directly through the compiled kernel's launcher once
    two calls of this description compiled the same kernel (see the module doc)."""
    record = _kernel(kernel)
    if not record.direct or kernel.pre_run_hooks or _hooked():
        kernel[grid](*args, **kwargs)  # the interpreter, or a launch someone watches
        return
    try:
        values, options = record.bind(args, kwargs)
        key = record.key(values, options, torch.cuda.current_device())
    except (_NotDescribed, TypeError):  # TypeError: an unhashable constexpr
        kernel[grid](*args, **kwargs)
        return
    seen = record.records.get(key)
    if seen is not None and not isinstance(seen, tuple) and seen is not _TRITONS_OWN:
        _run(seen, grid, values)
        return
    compiled = kernel[grid](*args, **kwargs)
    if seen is _TRITONS_OWN:
        return
    if seen is None:
        record.records[key] = (compiled, 1)
    elif seen[0] is not compiled:
        record.records[key] = _TRITONS_OWN
    else:
        record.records[key] = compiled if seen[1] + 1 >= ATTEMPTS else (compiled, seen[1] + 1)


def launches_directly(kernel: Any) -> bool:
    """Whether some description of ``kernel``'s calls launches through the compiled kernel's
    own launcher now (past its `ATTEMPTS`, not left to Triton)."""
    records = _kernel(kernel).records.values()
    return any(not isinstance(r, tuple) and r is not _TRITONS_OWN for r in records)


def _run(compiled: Any, grid: tuple[int, ...], values: list[Any]) -> None:
    from triton.runtime import driver

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    grid0, grid1, grid2 = (*grid, 1, 1)[:3]
    compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *values)  # fmt: skip

"""Triton launches without ``JITFunction.run``'s per-call Python, once a call is known.

``kernel[grid](*args)`` costs ~60 us of host time for this package's kernels (30 arguments)
on the H200's host, against ~18 us for the compiled kernel's own launcher with the same
arguments (`research/triton_launch_cost.py`, 2026-12-03): the rest is Triton's binder, its
cache key (a string of the options every call) and its checks. At Wan 2.1 480p the op's
inference path launches two such kernels before the fine attention, so that is ~90 us of the
~500 us the op takes to issue.

`launch(kernel, grid, *args, **kwargs)` describes the call no coarser than Triton specializes
a compiled kernel: each tensor's dtype and whether its address is 16-byte aligned; each int
as it is (Triton specializes on its type range, on 1 and on divisibility by 16); the type of
each float, bool and None; the value of each constexpr; the launch options (``num_warps``...);
the current device. The first two calls of a description run through
``kernel[grid]`` as usual; when both got the same compiled kernel, later calls hand that
kernel's launcher the arguments directly (on the current device's current stream, as Triton
does). Two different kernels for one description mark it as Triton's own for good (the
description missed something Triton specializes on). Anything else runs ``kernel[grid]``:
the interpreter, a launch hook someone added (profilers), an argument of another type, a
kernel with pre-run hooks.

Internals of Triton this relies on (3.6; checked by the tests of this module on a GPU):
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
        """The call's description: ints as they are (finer than what Triton specializes on:
        the sizes and strides repeat call to call at one shape), each tensor's dtype and
        whether its address is 16-byte aligned, other values' types, constexprs' values."""
        described: list[Hashable] = []
        for value, constant in zip(values, self.constexpr, strict=True):
            kind = type(value)
            if kind is int:
                described.append(value)
            elif kind is torch.Tensor or isinstance(value, torch.Tensor):
                described.append((value.dtype, not value.data_ptr() & 15))
            elif constant:
                described.append((kind, value))
            elif kind is float or kind is bool or value is None:
                described.append(kind)  # Triton does not specialize on their values
            else:
                raise _NotDescribed
        return (device, tuple(described), options)


@functools.cache
def _kernel(kernel: Any) -> _Kernel:
    return _Kernel(kernel)


def _hooked() -> bool:
    """Whether Triton would call a launch hook (a profiler's, say): then it launches."""
    from triton import knobs

    runtime = knobs.runtime
    return any(
        hook is not None and getattr(hook, "calls", True)
        for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook)
    )


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
        hash(key)
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


def _run(compiled: Any, grid: tuple[int, ...], values: list[Any]) -> None:
    from triton.runtime import driver

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    grid0, grid1, grid2 = (*grid, 1, 1)[:3]
    compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *values)  # fmt: skip

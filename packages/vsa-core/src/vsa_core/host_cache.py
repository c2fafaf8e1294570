"""Host-side decisions made once per set of arguments, also under ``torch.compile``.

Which backend runs a call, which coarse stage, which physical plan: these depend only on
shapes, dtypes, devices and names, never on tensor data. `resolved_once` evaluates such a
function once per distinct arguments and returns the cached result afterwards, so an op call
pays a dictionary lookup instead of asking every backend again (host time each layer pays).
Under ``torch.compile`` dynamo would otherwise trace into the decision (entry-point discovery,
device queries), which it cannot do in one graph; marked as a constant result, the decision
is run eagerly at trace time and the graph keeps only what it returned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class _Results:
    """Each decision is a class attribute of its own: dynamo reads a class attribute when the
    traced code reaches it, whereas a list or dict would be read as it was when the trace first
    touched it, before the decision was added."""


_names: dict[tuple[Hashable, ...], str] = {}


def resolved_once(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator: ``fn(*args)`` (hashable positional arguments: names, numbers, dtypes,
    devices, tuples) computed once per distinct ``args``; exceptions are not cached."""

    def result_name(*args: Hashable) -> str:
        key = (id(fn), *args)
        if key not in _names:
            result = fn(*args)
            name = f"result_{len(_names)}"
            setattr(_Results, name, result)
            _names[key] = name
        return _names[key]

    # What torch.compiler.assume_constant_result does, without importing torch._dynamo (and
    # with it triton) when vsa-core is imported; test_host_cache checks that dynamo honours it.
    result_name._dynamo_marked_constant = True  # type: ignore[attr-defined]

    @functools.wraps(fn)
    def cached(*args: Hashable) -> T:
        return getattr(_Results, result_name(*args))

    return cached

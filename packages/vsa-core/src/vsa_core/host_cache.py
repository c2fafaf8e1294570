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

import collections
import functools
import itertools
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class _Results:
    """Each decision is a class attribute of its own: dynamo reads a class attribute when the
    traced code reaches it, whereas a list or dict would be read as it was when the trace first
    touched it, before the decision was added."""


_names: dict[tuple[Hashable, ...], str] = {}
_counter = itertools.count()


def resolved_once(
    fn: Callable[..., T] | None = None, *, maxsize: int | None = None
) -> Callable[..., T]:
    """Decorator: ``fn(*args)`` (hashable positional arguments: names, numbers, dtypes,
    devices, tuples) computed once per distinct ``args``; exceptions are not cached.
    ``maxsize`` bounds how many results of ``fn`` are kept (the oldest goes first), for
    results that hold memory, such as a tiling's index tensors on a device."""
    if fn is None:
        return functools.partial(resolved_once, maxsize=maxsize)  # type: ignore[return-value]
    mine: collections.OrderedDict[tuple[Hashable, ...], str] = collections.OrderedDict()

    def result_name(*args: Hashable) -> str:
        key = (id(fn), *args)
        if key not in _names:
            result = fn(*args)
            name = f"result_{next(_counter)}"
            setattr(_Results, name, result)
            _names[key] = mine[key] = name
            if maxsize is not None and len(mine) > maxsize:
                old_key, old_name = mine.popitem(last=False)
                del _names[old_key]
                delattr(_Results, old_name)
        return _names[key]

    # What torch.compiler.assume_constant_result does, without importing torch._dynamo (and
    # with it triton) when vsa-core is imported; test_host_cache checks that dynamo honours it.
    result_name._dynamo_marked_constant = True  # type: ignore[attr-defined]

    @functools.wraps(fn)
    def cached(*args: Hashable) -> T:
        return getattr(_Results, result_name(*args))

    return cached

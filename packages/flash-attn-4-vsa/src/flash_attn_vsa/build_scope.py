"""The fork's one piece of thread state: what upstream's launcher is building on this thread.

Which kernel runs is chosen by arguments: vsa-fa4 passes a forward variant and a backward tile
configuration (frozen values) to the fork's entry points (`fwd_sm90.block_sparse_forward_q64`,
`fwd_sm90_paired.block_sparse_forward_paired`,
`experimental.fwd_sm90_streams.block_sparse_forward_streams`: ``q_in_registers`` and
``persistent``, a `fwd_sm90.ForwardKernel`; `bwd_sm90.block_sparse_backward_kv64`: ``config``,
a `bwd_sm90.TileConfig`). Those entry points then call upstream's launchers,
``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``, which take no kernel class,
tile configuration, mask class or scheduler as arguments: they construct them from module
globals (``interface.FlashAttentionForwardSm90``, ``interface.FlashAttentionBackwardSm90``,
``interface._tile_size_bwd_sm90``, ``flash_fwd_sm90.AttentionMask``, ``cpasync``,
``sm90_utils``, ``SingleTileScheduler``) and keep compiled kernels in a cache keyed without the
kernel class. So the fork replaces those globals, once per process, with stand-ins that ask
`current` what the call on this thread is building, and answer upstream's own object when
nothing of the fork is being built (other callers of upstream, other threads).

`building` is that scope, and this module is its one place: only the fork's entry points enter
it, from their explicit arguments, for the duration of the upstream call; callers never set it,
and no default is read from it (outside an entry point it is empty). A thread-local rather than
a global because two threads may build two different kernels at once (tested).

`traced` / `trace_stack` hold trace-time state of the same kind: while upstream traces a kernel
method, the fork's kernel classes (never callers) push what an upstream function called deeper
in that trace needs to see (`sm90_operands`' partition hooks of delta 5 and 6, the dQ buffers of
`bwd_sm90_dq_parts`); each is pushed and popped inside one method of a kernel class. The one
other pusher is `launch_replay`, around the first call of a description to upstream's launcher
(its recorder, which the scoped compile caches hand the compiled kernel to).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["building", "current", "trace_stack", "traced"]

_thread = threading.local()


def current(direction: str) -> Any:
    """The kernel description (``direction`` ``"fwd"``: a `fwd_sm90.ForwardKernel`; ``"bwd"``: a
    `bwd_sm90.TileConfig`) whose upstream launch is building on this thread now, or None."""
    stack = getattr(_thread, "building", ())
    if stack and stack[-1].direction == direction:
        return stack[-1]
    return None


@contextmanager
def building(kernel: Any) -> Iterator[None]:
    """While open, upstream's stand-ins build ``kernel`` (anything with a ``direction``) on this
    thread. For the fork's entry points only (see the module doc)."""
    saved = getattr(_thread, "building", ())
    _thread.building = (*saved, kernel)
    try:
        yield
    finally:
        _thread.building = saved


def trace_stack(name: str) -> tuple[Any, ...]:
    """The values the fork's kernel classes pushed under ``name`` on this thread (innermost
    last)."""
    return getattr(_thread, f"trace_{name}", ())


@contextmanager
def traced(name: str, value: Any) -> Iterator[None]:
    """Push ``value`` on this thread's trace-time stack ``name`` for the duration of the block
    (inside a kernel class's method that upstream traces)."""
    saved = trace_stack(name)
    setattr(_thread, f"trace_{name}", (*saved, value))
    try:
        yield
    finally:
        setattr(_thread, f"trace_{name}", saved)

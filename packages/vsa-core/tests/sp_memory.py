"""Peak memory of tensors on the CPU, for the sequence-parallel memory checks; not a pytest
module.

`LiveBytes` is a `TorchDispatchMode` that follows every storage allocated by an aten op while
it is active (an op's output whose storage is none of its inputs' and not one it already
follows) until the last tensor using it dies, and records the peak of their total bytes: what
``torch.cuda.max_memory_allocated`` minus the memory allocated before would show for the same
calls on a GPU (without the caching allocator's rounding to blocks). Storages allocated before
the mode was entered (the inputs) are not counted, nor is anything allocated outside aten ops.

`sp_memory_worker.py` runs it per rank around `sequence_parallel_video_sparse_attn`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated under the mode that are still referenced: ``live``,
    its maximum ``peak``, and ``allocations``, the sizes (bytes) of every storage allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocations: list[int] = []
        self._refs: dict[int, list[int]] = {}  # storage address -> [tensors alive, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._follow(t, inputs)
        return out

    def _follow(self, t: torch.Tensor, inputs: set[int]) -> None:
        address = _address(t)
        if address == 0:
            return
        ref = self._refs.get(address)
        if ref is None:
            if address in inputs:  # a view or an in-place result of something not followed
                return
            size = t.untyped_storage().nbytes()
            ref = self._refs[address] = [0, size]
            self.allocations.append(size)
            self.live += size
            self.peak = max(self.peak, self.live)
        ref[0] += 1
        weakref.finalize(t, self._release, address)

    def _release(self, address: int) -> None:
        ref = self._refs[address]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[address]
            self.live -= ref[1]


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, int, list[int]]:
    """(peak bytes, bytes still held by the result, allocation sizes) of ``fn()``, its result
    held until the peak is read (as bench_common.peak_extra_mib holds it on a GPU)."""
    with LiveBytes() as mode:
        result = fn()
        peak, held = mode.peak, mode.live
        del result
    return peak, held, mode.allocations

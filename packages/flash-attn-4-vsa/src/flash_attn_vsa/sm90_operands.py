"""Where the fork's sm_90 forward deltas reach into upstream's consumer: the operands it
partitions and the shared-memory layouts it allocates.

Upstream's sm_90 forward (``flash_attn.cute.flash_fwd_sm90``) partitions its MMA operands with
``sm90_utils.partition_fragment_ABC`` and builds its shared-memory layouts with
``sm90_utils.make_smem_layout``, ``sm90_utils`` being a module global (quack's module).
`install` replaces that global, once per process, with a stand-in whose two functions are
upstream's, except where the fork's kernels ask otherwise:

- `partition_hooks(before=..., after=...)`, a trace-time hook (`build_scope.traced`) that only
  the fork's kernel classes open, inside their own ``mma`` while upstream traces it:
  ``before(thr_mma, shape_mnk, sA, sB)`` may return other ``(sA, sB)`` to partition (delta 6
  hands each warpgroup its half of a key/value stage); ``after(thr_mma, shape_mnk, sA, sB,
  acc, rA, rB)`` sees what was made (delta 5 records QK^T's register A fragment). Hooks nest:
  an inner ``before`` sees what the outer one returned, every ``after`` sees the result.
- staged rows: while a fork entry point builds a `fwd_sm90.ForwardKernel` whose
  ``staged_rows`` is above 1 (`build_scope.current`), staged layouts (the key and value
  pipelines') get that many times the rows they ask for (delta 6's stages hold two 64-token
  key blocks while its tiles are 64 keys wide).

Kernels traced with no hook open and built by no fork entry point, upstream's own among them,
get exactly upstream's results.

Upstream internals this relies on (fingerprinted): the module global ``flash_fwd_sm90.sm90_utils``
and quack's ``sm90_utils.partition_fragment_ABC`` and ``sm90_utils.make_smem_layout``.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flash_attn_vsa.build_scope import current, trace_stack, traced

__all__ = [
    "PipelineStandIn",
    "install",
    "partition_hooks",
    "upstream_mma_arguments",
]


class PipelineStandIn:
    """A stand-in for one of upstream's pipelines handed to its consumer (``mma``): the wrapped
    pipeline for every method a subclass does not override. The pipeline is live across
    upstream's work-tile loop, so the DSL carries it as a runtime value: the stand-in hands
    over the wrapped pipeline's values and is rebuilt around them with the same ``extra``
    (trace-time state)."""

    def __init__(self, inner: Any, *extra: Any) -> None:
        self._inner = inner
        self._extra = extra

    def __extract_mlir_values__(self) -> Any:
        import cutlass

        return cutlass.extract_mlir_values(self._inner)

    def __new_from_mlir_values__(self, values: Any) -> PipelineStandIn:
        import cutlass

        return type(self)(cutlass.new_from_mlir_values(self._inner, values), *self._extra)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def upstream_mma_arguments(kernel: Any, args: Any, kwargs: Any) -> inspect.BoundArguments:
    """A call of upstream's sm_90 forward ``mma`` bound by upstream's parameter names (a
    subclass's ``mma`` may itself take ``*args, **kwargs``)."""
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    return _mma_signature(FlashAttentionForwardSm90).bind(kernel, *args, **kwargs)


@functools.cache
def _mma_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.mma)


@contextmanager
def partition_hooks(
    before: Callable[..., tuple[Any, Any]] | None = None,
    after: Callable[..., None] | None = None,
) -> Iterator[None]:
    """While open on this thread, the forward's ``partition_fragment_ABC`` runs these hooks
    (opened by the fork's kernel classes inside their ``mma``, while upstream traces it)."""
    install()
    with traced("partition", (before, after)):
        yield


@functools.cache
def install() -> None:
    """Once per process: ``flash_fwd_sm90.sm90_utils`` becomes the stand-in (see the module
    doc); with no hook open and no fork kernel being built it is upstream's module to every
    caller."""
    import cutlass.cute as cute
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    upstream = fwd_module.sm90_utils
    stand_in = types.ModuleType(upstream.__name__, upstream.__doc__)
    stand_in.__dict__.update(vars(upstream))

    def partition_fragment_ABC(thr_mma, shape_mnk, sA, sB, swap_AB=False):
        hooks = trace_stack("partition")
        for before, _ in hooks:
            if before is not None:
                sA, sB = before(thr_mma, shape_mnk, sA, sB)
        acc, rA, rB = upstream.partition_fragment_ABC(thr_mma, shape_mnk, sA, sB, swap_AB)
        for _, after in hooks:
            if after is not None:
                after(thr_mma, shape_mnk, sA, sB, acc, rA, rB)
        return acc, rA, rB

    def make_smem_layout(dtype, layout, tile, stage=None, *args, **kwargs):
        kernel = current("fwd")
        factor = 1 if kernel is None else kernel.staged_rows
        if factor != 1 and stage is not None:
            rows, *rest = cute.product_each(cute.shape(tile))
            tile = (rows * factor, *rest)
        return upstream.make_smem_layout(dtype, layout, tile, stage, *args, **kwargs)

    stand_in.partition_fragment_ABC = partition_fragment_ABC
    stand_in.make_smem_layout = make_smem_layout
    stand_in.upstream = upstream  # for a reader in a debugger: what this stands in for
    fwd_module.sm90_utils = stand_in

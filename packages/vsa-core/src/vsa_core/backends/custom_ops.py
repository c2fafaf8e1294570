"""Autograd wiring shared by backends that expose block-sparse attention as custom ops.

A backend's forward op takes ``(q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale,
q_block, kv_block, *extra)`` and returns ``(out, lse)``; its backward op takes ``(dout, q, k,
v, out, lse, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block, *extra)`` and
returns ``(dq, dk, dv)``, where ``extra`` are further non-tensor arguments of the backend's own
(passed through unchanged). An op may take further tensors right after ``kv_valid_sizes``
(``saved_inputs`` counts the tensor inputs, 6 by default): they are saved and passed to the
backward in the same place (``(dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes,
*more_tensors, scale, ...)``). Its last ``forward_only`` inputs (0 by default) serve the
forward alone: they are neither kept for the backward nor passed to it (fa4's forward takes
the coarse stage's split lists there, which its backward does not read; keeping them would
hold them until the backward). `register_block_sparse_autograd` connects the two: it saves
what the backward needs and marks ``lse`` non-differentiable (no backend propagates a gradient
through it, so a gradient there would otherwise be dropped silently).

`EagerOrOp` is how backends call such ops: under ``torch.compile`` the custom op (traceable,
with its fake implementation), in eager mode the op's plain functions, because the custom-op
dispatcher costs 30-80 us of host time per call (measured on this project's CPU machines,
2026-11-30), which a latency-bound caller pays on every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NUM_QKV = 3
NUM_SAVED_INPUTS = 6  # q, k, v, kv_indices, kv_counts, kv_valid_sizes


def _save(ctx, inputs, output, saved_inputs: int = NUM_SAVED_INPUTS, forward_only: int = 0):
    q, k, v, *lists = inputs[:saved_inputs]  # kv_indices, kv_counts, kv_valid_sizes, *more
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *lists)
    # scale, q_block, kv_block, *extra; the last ``forward_only`` inputs are not kept
    ctx.attrs = tuple(inputs[saved_inputs : len(inputs) - forward_only])
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)
    # no zero-filled gradient of lse (an allocation and a fill a backward, which reads none)
    ctx.set_materialize_grads(False)


def _gradients(ctx, dout, backward: Callable) -> tuple:
    none = [None] * (ctx.num_inputs - NUM_QKV)
    if dout is None:  # out reached no loss (only lse did, which carries no gradient)
        return None, None, None, *none
    saved = ctx.saved_tensors  # q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, ...
    dq, dk, dv = backward(dout, *saved, *ctx.attrs)
    return dq, dk, dv, *none


def register_block_sparse_autograd(
    forward_op, backward_op: Callable, saved_inputs: int = NUM_SAVED_INPUTS,
    forward_only: int = 0,
) -> None:  # fmt: skip
    """Register autograd for ``forward_op`` (a `torch.library.custom_op`) via ``backward_op``
    (``saved_inputs``, ``forward_only``: see the module doc)."""

    def backward(ctx, dout, _dlse):
        return _gradients(ctx, dout, backward_op)

    def setup_context(ctx, inputs, output):
        _save(ctx, inputs, output, saved_inputs, forward_only)

    forward_op.register_autograd(backward, setup_context=setup_context)


class EagerOrOp:
    """Call a custom op, or in eager mode its plain functions (same results, less host time).

    ``op`` is the `torch.library.custom_op`; ``forward`` its body; ``function`` an optional
    `torch.autograd.Function` that runs ``forward`` with the op's gradient (used when an input
    requires grad; None for ops without one). Under ``torch.compile`` (dynamo tracing) the op
    itself runs, so graphs see one opaque, traceable node."""

    def __init__(
        self, op: Any, forward: Callable, function: type[torch.autograd.Function] | None = None
    ) -> None:
        self.op, self.forward, self.function = op, forward, function

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.op(*args)
        if self.function is not None and _needs_grad(args):
            return self.function.apply(*args)
        return self.forward(*args)


def _needs_grad(args: tuple) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )


def block_sparse_eager(
    forward_op,
    forward_impl: Callable,
    backward_impl: Callable,
    saved_inputs: int = NUM_SAVED_INPUTS,
    forward_only: int = 0,
) -> EagerOrOp:
    """`EagerOrOp` of a block-sparse forward op (see module doc) whose eager backward calls
    ``backward_impl`` directly."""

    class BlockSparseFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_impl(*inputs)
            _save(ctx, inputs, output, saved_inputs, forward_only)
            return output

        @staticmethod
        def backward(ctx, dout, _dlse):
            return _gradients(ctx, dout, backward_impl)

    return EagerOrOp(forward_op, forward_impl, BlockSparseFunction)

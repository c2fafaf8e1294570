"""Autograd wiring shared by backends that expose block-sparse attention as custom ops.

A backend's forward op takes ``(q, k, v, kv_indices, kv_counts, kv_valid_sizes, scale,
q_block, kv_block, *extra)`` and returns ``(out, lse)``; its backward op takes ``(dout, q, k,
v, out, lse, kv_indices, kv_counts, kv_valid_sizes, scale, q_block, kv_block, *extra)`` and
returns ``(dq, dk, dv)``, where ``extra`` are further non-tensor arguments of the backend's own
(passed through unchanged). `register_block_sparse_autograd` connects the two: it saves
what the backward needs and marks ``lse`` non-differentiable (no backend propagates a gradient
through it, so a gradient there would otherwise be dropped silently).
"""

from __future__ import annotations

from collections.abc import Callable

NUM_QKV = 3
NUM_SAVED_INPUTS = 6  # q, k, v, kv_indices, kv_counts, kv_valid_sizes


def register_block_sparse_autograd(forward_op, backward_op: Callable) -> None:
    """Register autograd for ``forward_op`` (a `torch.library.custom_op`) via ``backward_op``."""

    def setup_context(ctx, inputs, output):
        q, k, v, kv_indices, kv_counts, kv_valid_sizes = inputs[:NUM_SAVED_INPUTS]
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes)
        ctx.attrs = tuple(inputs[NUM_SAVED_INPUTS:])  # scale, q_block, kv_block, *extra
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes = ctx.saved_tensors
        dq, dk, dv = backward_op(
            dout, q, k, v, out, lse, kv_indices, kv_counts, kv_valid_sizes, *ctx.attrs
        )
        return dq, dk, dv, *([None] * (NUM_SAVED_INPUTS - NUM_QKV + len(ctx.attrs)))

    forward_op.register_autograd(backward, setup_context=setup_context)

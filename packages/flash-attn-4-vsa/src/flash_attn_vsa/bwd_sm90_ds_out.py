"""The KV64 backward writing dS instead of reducing dQ: the fork's twelfth delta (the key-owned
half of a deterministic backward; issue 20, item 2).

Why (NOTES.md, session 10): the shipped 64x64 backward (delta 8) computes each (query block,
key tile) pair's dQ = dS K in its key-owned walk and reduce-adds it into a float32 accumulator
in L2, 32 KB per pair: 13.1 GB over the SM->L2 port at S=32768, 91.6% busy, which caps the
kernel at 0.765 of dense; and float32 additions in the order the CTAs happen to arrive make
dQ vary run to run. The same kernel with dQ computed and never sent runs at dense speed.

Here the walk computes no dQ at all: each step writes its dS tile (64x64, in q's dtype, 8 KB:
a quarter of the pair's dQ bytes, stored rather than reduced) to a buffer, and a separate
query-owned pass (`vsa_fa4.dq_from_ds_triton`) computes dQ = scale * sum over the query
block's list of dS K in registers, in list order, with no atomics: dQ, dK and dV are bitwise
reproducible run to run. The dQ MMA and its 64 accumulator registers per thread leave this
kernel.

Where a step's dS goes. The kernel takes two more aux tensors, after any the mask reads:

- ``ds`` [slots * 64, 64] in q's dtype: slot ``s`` holds rows ``64 s .. 64 s + 63`` (query
  rows of the block, key columns of the tile), each row's 16-byte chunks permuted
  (`DS_SWIZZLE`);
- ``slot_starts`` [B, H, NKV] int32: the first slot of each key tile's list.

Step ``u`` of key tile ``n``'s list (the list's order as stored, partial list then full list,
one of them empty for any key tile) writes slot ``slot_starts[b, h, n] + u``. At a tile's first
step every MMA thread writes ``slot_starts[b, h, n]`` minus the MMA consumer's Q pipeline count
to one shared word (before the step's first PdS barrier; a step reads it after that barrier
and before the next, so no read races the next tile's write), and a step's slot is the word
plus the count: one global load a tile. The step writes its dS into an 8 KB staging tile in
shared memory (where upstream's dQ buffers were), and after the PdS barrier that makes it
visible, MMA thread 0 sends it as one bulk copy; thread 0 waits for the copy's read at the
next step's start. On an H200 at S=32768, H=12, 87.5% (session 26, experiment 21) the kernel
runs 3.2 ms, the time of the shipped kernel with dQ never sent: writing dS costs nothing.
Stored straight from registers (16 32-bit stores a thread a step) it ran 4.25 ms; staged
row-major with the slot start loaded every step, 4.05 ms (8-way bank conflicts, and thread 0
waiting on the load ahead of the dK MMA).

`vsa_fa4` builds ``slot_starts`` (runs of slots that never overlap) and, for the dQ pass, each
forward list entry's slot with its lists (`vsa_fa4.backward_lists_triton`).

Upstream internals this relies on (fingerprinted): ``FlashAttentionBackwardSm90.mma``'s
parameters ``tiled_mma_SdP``, ``tidx``, ``aux_data`` (the launcher's aux tensors in order) and
``sdQaccum``; the block-sparse loop's ``mask_fn`` a ``functools.partial`` carrying
``batch_idx``, ``head_idx`` and ``n_block``, and its ``dKV_accumulate`` False exactly at a
tile's first step; ``consume_block_sparse_mma_bwd_sm90`` walking the partial list, then the
full list, in stored order.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from flash_attn_vsa.build_scope import trace_stack, traced

__all__ = [
    "DS_AUX_TENSORS",
    "DS_SWIZZLE",
    "STAGING_WORDS",
    "note_first_step",
    "send_ds",
    "stage_ds",
    "traced_step_operands",
]

DS_AUX_TENSORS = 2
"""Aux tensors the ``ds`` path appends: the dS buffer, then the slot starts."""

_STACK = "ds_out"


@contextmanager
def traced_step_operands(bound: dict[str, Any]) -> Iterator[None]:
    """While upstream traces the kernel's ``mma`` (arguments ``bound``), what each step needs:
    the S/dP MMA, the thread index, the aux tensors and the shared word."""
    aux = bound.get("aux_data")
    tensors = tuple(getattr(aux, "tensors", None) or ())
    if len(tensors) < DS_AUX_TENSORS:
        raise ValueError(
            f"the dS-writing backward needs its {DS_AUX_TENSORS} aux tensors (dS, slot starts) "
            f"after the mask's, got {len(tensors)} aux tensors"
        )
    operands = _StepOperands(
        bound["tiled_mma_SdP"], bound["tidx"], bound["sdQaccum"], tensors[-2], tensors[-1],
        bound["self"].dtype,
    )  # fmt: skip
    with traced(_STACK, operands):
        yield


class _StepOperands(NamedTuple):
    """What `traced_step_operands` pushes for the steps of one ``mma`` trace."""

    tiled_mma: Any  # the S / dP MMA, whose C partition the staged dS follows
    tidx: Any
    words: Any  # ``sdQaccum``: the staging tile, then the first-step word
    ds: Any  # aux: the dS buffer
    slot_starts: Any  # aux: each key tile's first slot
    dtype: Any


def _operands() -> _StepOperands:
    return trace_stack(_STACK)[-1]


STAGING_WORDS = 64 * 64 * 2 // 4
"""32-bit words of the dS staging buffer (one 64x64 16-bit tile, row-major) at the start of the
kernel's shared words; the first-step word follows it."""


def _staging() -> Any:
    """The dS staging tile in shared memory (the kernel's dtype): row-major with each row's
    16-byte chunks permuted by `DS_SWIZZLE`, so that the eight rows one store instruction
    writes fall in different banks."""
    from cutlass import cute

    operands = _operands()
    layout = cute.make_composed_layout(
        cute.make_swizzle(*DS_SWIZZLE), 0, cute.make_layout((64, 64), stride=(64, 1))
    )
    return cute.make_tensor(cute.recast_ptr(operands.words.iterator, dtype=operands.dtype), layout)


DS_SWIZZLE = (3, 3, 3)
"""The dS tiles' layout in the buffer (as staged; `vsa_fa4.dq_from_ds_triton` reads it back):
element (r, c) of a 64x64 tile at ``64 r + 8 ((c // 8) ^ (r % 8)) + c % 8``, CuTe's
``Swizzle<3, 3, 3>`` over the row-major offset."""


def _first_step_word() -> Any:
    """The shared Int32 holding this tile's first slot minus the Q pipeline count at its first
    step."""
    import cutlass
    from cutlass import cute

    return cute.make_tensor(
        cute.recast_ptr(_operands().words.iterator + STAGING_WORDS, dtype=cutlass.Int32),
        cute.make_layout(1),
    )


@functools.cache
def _jitted() -> tuple[Any, Any, Any]:
    import cutlass
    from cutlass import cute
    from quack import copy_utils

    @cute.jit
    def note_first_step(consumer_state_Q: Any, dKV_accumulate: Any, mask_fn: Any) -> None:
        """At a tile's first step (nothing accumulated yet), keep the tile's first slot minus
        the Q pipeline count, so that a step's slot is that plus its count (one global load
        a tile, not one a step in the MMAs' path); thread 0 waits until the last step's bulk
        copy has read the staging tile (the others write it only after the step's PdS
        barrier, which thread 0 reaches after this)."""
        operands = _operands()
        if operands.tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        if not dKV_accumulate:
            tile = getattr(mask_fn, "keywords", {})
            batch_idx, head_idx, n_block = (tile[k] for k in ("batch_idx", "head_idx", "n_block"))
            first = operands.slot_starts[batch_idx, head_idx, n_block]
            _first_step_word()[0] = first - consumer_state_Q.count

    @cute.jit
    def stage_ds(kernel: Any, acc_dS: Any, consumer_state_Q: Any) -> Any:
        """This step's dS (the float32 accumulator of dP, turned into dS in place) rounded to
        the kernel's dtype into the staging tile; returns where the tile goes (its slot's
        address in the dS buffer, from the first-step word read here, before the next PdS
        barrier)."""
        from flash_attn.cute import utils

        operands = _operands()
        slot = _first_step_word()[0] + consumer_state_Q.count
        tds = operands.tiled_mma.get_slice(operands.tidx).partition_C(_staging())
        cute.autovec_copy(utils.cvt_f16(acc_dS, kernel.dtype), tds)
        return (
            operands.ds.iterator + cutlass.Int64(slot) * (kernel.tile_m * kernel.tile_n)
        ).toint()

    @cute.jit
    def send_ds(kernel: Any, address: Any) -> None:
        """Thread 0 sends the staged tile to ``address`` as one bulk copy (after the PdS
        barrier that follows the staging writes and their proxy fence)."""
        if _operands().tidx == 0:
            target = cute.make_ptr(kernel.dtype, address, cute.AddressSpace.gmem, assumed_align=16)
            copy_utils.cpasync_bulk_s2g(_staging().iterator, target, 64 * 64 * 2)
            cute.arch.cp_async_bulk_commit_group()

    return note_first_step, stage_ds, send_ds


def note_first_step(consumer_state_Q: Any, dKV_accumulate: Any, mask_fn: Any) -> None:
    """Called by the step at its start, before any PdS barrier (`_jitted`)."""
    _jitted()[0](consumer_state_Q, dKV_accumulate, mask_fn)


def stage_ds(kernel: Any, acc_dS: Any, consumer_state_Q: Any) -> Any:
    """Called by the step between the PdS barrier before dS is staged for the MMAs and the one
    after (`_jitted`); returns the tile's address for `send_ds`."""
    return _jitted()[1](kernel, acc_dS, consumer_state_Q)


def send_ds(kernel: Any, address: Any) -> None:
    """Called by the step right after the PdS barrier that follows `stage_ds` (`_jitted`)."""
    _jitted()[2](kernel, address)

"""Experiment 22 (prepared in session 27, not yet run): does a small dS budget cost nothing
when head chunks overlap?

Since session 27 fa4's 64x64 training runs the dS-writing backward (delta 12) with
`vsa_fa4.ops.DS_BUDGET_BYTES` = 8 GiB of dS a launch, because each extra head chunk cost
0.25-0.45 ms on an H100 (the key kernel's last, partial wave, and the chunk's own small
launches): Wan 2.1 720p ran 3.17x of dense in forty chunks (2 GiB) and 3.42x in ten (8 GiB).
The memory is the price (5.9 GB beyond the inputs at Wan 480p against 1.3 GB for the
float32-reduction backward). The design tested here: two dS buffers of half the budget each,
chunk c's dQ pass on a second stream while chunk c+1's key kernel runs on the caller's, so each
key kernel's last wave shares the GPU with the other stream's work.

Arms, kernels only (B=1, D=128, bf16, random top-k lists, all blocks full, lists rotated as
the op does), against dense FA4's backward: ``float32`` (``KernelChoice(backward=KV64_CONFIG)``);
``serial-G`` (`vsa_fa4.ops.backward_impl` with a dS budget of G GiB, chunks one after another,
as shipped); ``overlap-G`` (`overlapped_backward`: G GiB in two buffers). First the gradients:
``overlap-G`` against ``serial-G/2`` (the same chunks: bitwise equal, or the streams raced).
At S=32768 and 12 heads the whole dS is 3 GiB (256 MiB a head). ::

    python3 -m research.fa4_fork.experiments.ds_chunk_overlap --out DIR --seqs 32768
"""

from __future__ import annotations

import sys

import torch

KV = 64
BUDGETS_GIB = (0.5, 1.0, 4.0)
"""dS budgets of the serial and overlapped arms: 2 heads a chunk (1 overlapped), 4 (2), all."""


def overlapped_backward(tensors, valid, scale, budget_bytes: int, rotate: int) -> None:
    """`vsa_fa4.ops._backward_from_ds` with two dS buffers of ``budget_bytes / 2`` and each
    chunk's dQ pass on a side stream (all key blocks full: no mask). ``tensors`` as
    `backward_impl` orders them; dq, dk, dv written in place."""
    from flash_attn_vsa.bwd_sm90 import KV64_DS_CONFIG
    from vsa_fa4 import launch, ops
    from vsa_fa4.dq_from_ds_triton import dq_from_ds, ds_slots

    q, kv_indices = tensors[1], tensors[-2]
    batch, q_len, heads, head_dim = q.shape
    tiles_per_head = batch * kv_indices.shape[-2] * kv_indices.shape[-1]
    chunks = ops.head_chunks(batch, heads, q_len, head_dim, tiles_per_head, budget_bytes // 2)
    most = max(c.stop - c.start for c in chunks)
    buffers = [q.new_empty((tiles_per_head * most * KV, KV)) for _ in range(2)]
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)  # the inputs and buffers are ready before the side stream reads
    read: list[torch.cuda.Event | None] = [None, None]  # the dQ pass that last read a buffer
    for n, chunk in enumerate(ops._head_ranges(tensors, chunks)):
        dout, q, k, v, out, lse, dq, dk, dv, indices, counts = chunk
        indices, counts = indices.contiguous(), counts.contiguous()
        placed = ds_slots(indices, counts, valid, False, rotate)
        ds = buffers[n % 2]
        if read[n % 2] is not None:
            main.wait_event(read[n % 2])  # its last dQ pass is done with it
        launch.run_backward(
            dout, q, k, v, out, lse, dq, dk, dv, placed.lists, valid, scale, (KV, KV), False,
            config=KV64_DS_CONFIG, ds_out=(ds, placed.starts),
        )  # fmt: skip
        written = torch.cuda.Event()
        written.record(main)
        with torch.cuda.stream(side):
            side.wait_event(written)
            dq_from_ds(ds, k, dq, indices, counts, placed.slots, scale)
            read[n % 2] = torch.cuda.Event()
            read[n % 2].record(side)
        for t in (ds, k, dq, indices, counts, placed.slots):
            t.record_stream(side)  # made on the caller's stream, read on the side one
    main.wait_stream(side)


def run_length(emit, seq: int, heads: int, keep: float, reps: int, sms: int) -> None:
    from flash_attn_vsa.bwd_sm90 import KV64_CONFIG
    from vsa_core.rotation import rotation_width
    from vsa_fa4 import launch
    from vsa_fa4.ops import backward_impl

    from .bwd_dq_parts import inputs_and_forward
    from .kv64_bwd_configs import time_backwards_against_dense

    scale = 128**-0.5
    (q, k, v, dout), lay, (out, lse) = inputs_and_forward(seq, heads, keep, KV, scale)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes.contiguous()
    rotate = rotation_width(q.device) * 2  # two CTAs an SM, as the op rotates

    def serial(budget: int):
        kernels = launch.KernelChoice(ds_budget_bytes=budget).encode()
        return lambda: backward_impl(dout, q, k, v, out, lse, idx, cnt, valid, scale, KV, KV,
                                     False, kernels)  # fmt: skip

    def overlapped(budget: int):
        def call():
            grads = [torch.empty_like(t) for t in (q, k, v)]
            overlapped_backward((dout, q, k, v, out, lse, *grads, idx, cnt), valid, scale,
                                budget, rotate)  # fmt: skip
            return grads

        return call

    float32 = launch.KernelChoice(backward=KV64_CONFIG).encode()
    calls = {"float32": lambda: backward_impl(dout, q, k, v, out, lse, idx, cnt, valid, scale,
                                              KV, KV, False, float32)}  # fmt: skip
    for gib in BUDGETS_GIB:
        budget = int(gib * 2**30)
        calls[f"serial-{gib:g}"] = serial(budget)
        calls[f"overlap-{gib:g}"] = overlapped(budget)
        same = [torch.equal(a, b) for a, b in
                zip(overlapped(budget)(), serial(budget // 2)(), strict=True)]  # fmt: skip
        emit({"case": "gradients", "seq": seq, "budget_gib": gib,
              "overlap_bitwise_serial_half_budget_dq_dk_dv": same})  # fmt: skip
    time_backwards_against_dense(emit, q, k, v, dout, scale, calls, lay, reps, sms=sms)


def main() -> int:
    from .bwd_list_rotation import length_args, run_lengths

    return run_lengths("ds_chunk_overlap", run_length, length_args())


if __name__ == "__main__":
    sys.exit(main())

"""Experiment 21 (session 26): the 64x64 backward that writes dS instead of reducing dQ, and a
query-owned pass that computes dQ from it (delta 12, `flash_attn_vsa.bwd_sm90_ds_out`, and
`vsa_fa4.dq_from_ds_triton`; issue 20, item 2).

Model (NOTES.md, session 26), S=32768, H=12, 64 of 512 key blocks a list (393,216 pairs):
- key-owned kernel: the shipped one with dQ computed and never sent ran 1.03-1.06 of dense
  (2.70 ms, ncu); without the dQ MMA (a fifth of the FLOPs) and with 8 KB of dS stored per
  pair (3.2 GB, ~1.4 TB/s over ~2.3 ms, a quarter of the shipped kernel's 13.1 GB of
  reduce-adds) **~2.3-2.5 ms**;
- dQ pass: per pair a 64x64x128 MMA reading 8 KB of dS from HBM (3.2 GB, ~0.7 ms at 4.8 TB/s)
  and 16 KB of K from L2: **~0.8-1.2 ms** if Triton keeps the loads in flight;
- together 3.1-3.7 ms against the shipped 3.98 ms (ncu; 4.1 paced): 0.78-0.93 of dense, and
  deterministic. The target is 0.85.

Arms at each length (D=128, random top-k lists, all blocks full, lists rotated as the op
does): dense FA4's backward; ``shipped`` (`vsa_fa4.ops.backward_impl` with
`flash_attn_vsa.bwd_sm90.KV64_CONFIG`, the float32-reduction backward: the shipped one until
session 27, which made ``ds`` the default; the arm keeps its name so that runs compare);
``ds`` (the same op with `flash_attn_vsa.bwd_sm90.KV64_DS_CONFIG`: lists with positions, the
key-owned kernel, the dQ pass); ``ds`` in parts: ``ds-lists`` (the lists and positions
alone), ``ds-keys`` (the key-owned kernel alone, on lists built once), ``ds-dq-sS-wW`` (the
dQ pass alone, compiled with S stages and W warps); and ``no-dq-bound``, the shipped kernel
with dQ computed and never sent (session 9's ablation: what the key-owned pass could at best
be). First the gradients: ``ds`` against ``shipped`` (relative L2), and each of them run
twice on the same inputs, bitwise equal or not (``ds`` must be; ``shipped``'s dQ need not). ::

    python3 -m research.fa4_fork.experiments.bwd_ds_out --out DIR --seqs 32768   # H200
"""

from __future__ import annotations

import sys

import torch

KV = 64


def _dq_pass_configs():
    from vsa_fa4.dq_from_ds_triton import DqPassConfig

    return [DqPassConfig(s, w) for s, w in ((2, 4), (3, 4), (4, 4), (5, 4))]


def run_length(emit, seq: int, heads: int, keep: float, reps: int, sms: int) -> None:
    from flash_attn_vsa.bwd_sm90 import KV64_CONFIG, KV64_DS_CONFIG
    from flash_attn_vsa.experimental.bwd_configs import ABLATIONS
    from vsa_core.rotation import rotation_width
    from vsa_fa4 import launch
    from vsa_fa4.backward_lists_triton import backward_lists_with_slots
    from vsa_fa4.dq_from_ds_triton import dq_from_ds, ds_slots
    from vsa_fa4.metadata import backward_lists
    from vsa_fa4.ops import backward_impl

    from .bwd_dq_parts import inputs_and_forward
    from .kv64_bwd_configs import rel_l2, time_backwards_against_dense

    scale = 128**-0.5
    (q, k, v, dout), lay, (out, lse) = inputs_and_forward(seq, heads, keep, KV, scale)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    ds_kernels = launch.KernelChoice(backward=KV64_DS_CONFIG).encode()
    float32_kernels = launch.KernelChoice(backward=KV64_CONFIG).encode()

    def op(kernels: str):
        return backward_impl(dout, q, k, v, out, lse, idx, cnt, valid, scale, KV, KV, False,
                             kernels)  # fmt: skip

    runs = {arm: [op(kernels), op(kernels)] for arm, kernels in (("shipped", float32_kernels),
                                                                 ("ds", ds_kernels))}  # fmt: skip
    torch.cuda.synchronize()
    for arm, (first, second) in runs.items():
        emit({"case": "gradients", "seq": seq, "arm": arm,
              "rel_l2_vs_shipped_dq_dk_dv": [rel_l2(a, b) for a, b in
                                              zip(first, runs["shipped"][0], strict=True)],
              "bitwise_rerun_dq_dk_dv": [bool(torch.equal(a, b)) for a, b in
                                         zip(first, second, strict=True)],
              "finite": all(bool(torch.isfinite(g).all()) for g in first)})  # fmt: skip
    del runs

    # the parts, on lists and buffers built once
    rotate = rotation_width(q.device) * KV64_DS_CONFIG.ctas_per_sm
    placed = ds_slots(idx, cnt, valid, False, rotate)
    ds = q.new_empty((idx.shape[1] * idx.shape[2] * idx.shape[3] * KV, KV))
    grads = [torch.empty_like(t) for t in (q, k, v)]

    def keys():
        launch.run_backward(dout, q, k, v, out, lse, *grads, placed.lists, valid, scale,
                            (KV, KV), False, config=KV64_DS_CONFIG,
                            ds_out=(ds, placed.starts))  # fmt: skip

    no_dq = ABLATIONS["kv64-two-ctas-no-dq"]
    plain = backward_lists(idx, cnt, valid, KV, masked=False, rotate_sms=rotate)

    def keys_no_dq():  # the shipped kernel with dQ computed and never sent: the bound
        launch.run_backward(dout, q, k, v, out, lse, *grads, plain, valid, scale, (KV, KV),
                            False, config=no_dq)  # fmt: skip

    def dq_pass(config):
        return lambda: dq_from_ds(ds, k, grads[0], idx, cnt, placed.slots, scale, config)

    calls = {
        "shipped": lambda: op(float32_kernels),
        "no-dq-bound": keys_no_dq,
        "ds": lambda: op(ds_kernels),
        "ds-lists": lambda: backward_lists_with_slots(idx, cnt, valid, KV, False, rotate),
        "ds-keys": keys,
        **{f"ds-dq-s{c.stages}-w{c.warps}": dq_pass(c) for c in _dq_pass_configs()},
    }
    time_backwards_against_dense(emit, q, k, v, dout, scale, calls, lay, reps, sms=sms)


def main() -> int:
    from .bwd_list_rotation import length_args, run_lengths

    return run_lengths("bwd_ds_out", run_length, length_args())


if __name__ == "__main__":
    sys.exit(main())

"""Experiment 9 (prepared in session 7, not yet run): what share of the KV64 backward's time
do its dQ reduce-adds take?

The count (NOTES.md, "A second count"): the sm_90 backward sends every visited (key tile,
query tile) pair's dQ to global memory as one bulk reduce-add of float32 from shared memory
(``cp.reduce.async.bulk ... add.f32``, SASS ``UBLKRED``), issued by one producer warp. A
64-row key tile does half the MMA work per reduced byte of dense's 128-row tiles: 6.1 against
3.0 KB per MFLOP, i.e. ~2.7 TB/s of reductions into L2 at our 0.69-0.71 of dense, ~3.2 TB/s
at the 0.85 target. Rotating the lists (experiment 6) fixed what the reductions cost beyond
the L2 and changed nothing at S=32768, where the backward still runs 0.69.

The ablation: the shipped kernel compiled with each reduce-add cut to a fraction of its bytes
(the first ``fraction`` of each warpgroup's dQ chunk; 0 drops the instruction). The dQ it
produces is wrong for fractions below 1; dK and dV are untouched (the check says so). Arms at
each sequence length (H=12, D=128, 64x64 blocks, random top-k lists at 87.5%, all blocks
full, lists rotated as shipped): dense FA4, ``shipped``, ``reduce_1`` (the proxy at full
size: the control, which must equal ``shipped`` in time and bits), ``reduce_0.25``,
``reduce_0``; interleaved call by call, two rounds.

Predictions. If the reductions bound the kernel, time falls with the fraction and ``reduce_0``
runs near the MMA-only ceiling (> 0.85 of dense): the lever is fewer or cheaper reductions
(two key tiles per CTA summing a shared query tile first, or a cluster pair reducing through
distributed shared memory). If ``reduce_0`` gains < 5%, the reductions are not what holds it
back, and what is left is one MMA warpgroup per 64x64 tile (nothing to overlap its softmax
with). ::

    python3 -m research.fa4_fork.experiments.bwd_dq_reduce_share --out DIR    # H200
    python3 -m research.fa4_fork.experiments.bwd_dq_reduce_share --sass DIR   # CPU

``--sass DIR`` compiles the arms for sm_90a on fake tensors (no GPU) and keeps their PTX and
cubins in ``DIR/<arm>/``. Done in session 7 (~13 s per arm): the shipped kernel and
``reduce_1`` are the same 2,160 SASS instructions with 2 ``UBLKRED`` (the partial and the full
list's loop), each ``cp.reduce.async.bulk ... add.f32`` of 32,768 B in the PTX;
``reduce_0.25`` the same with 8,192 B; ``reduce_0`` 2,136 instructions and no ``UBLKRED``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

BLOCK = 64
FRACTIONS = {"reduce_1": 1.0, "reduce_0.25": 0.25, "reduce_0": 0.0}
_CACHES: dict[str, dict] = {}


def cut_reduce(upstream_reduce, fraction: float):
    """A stand-in for ``copy_utils.cpasync_reduce_bulk_add_f32`` that sends only the first
    ``fraction`` of the bytes (a multiple of 16, as the instruction needs), or nothing."""

    def reduce(smem_ptr, gmem_ptr, store_bytes, *, loc=None, ip=None):
        kept = int(store_bytes * fraction) // 16 * 16
        if kept > 0:
            upstream_reduce(smem_ptr, gmem_ptr, kept, loc=loc, ip=ip)

    return reduce


@contextlib.contextmanager
def reduce_scope(arm: str) -> Iterator[None]:
    """While this is open, upstream's ``_flash_attn_bwd`` compiles (into this arm's own cache:
    the compile key does not see the change) and runs the backward with the arm's reduce."""
    import flash_attn.cute.block_sparse_utils as bsu
    import flash_attn.cute.interface as itf

    upstream_module = bsu.copy_utils
    proxy = types.SimpleNamespace(**vars(upstream_module))
    proxy.cpasync_reduce_bulk_add_f32 = cut_reduce(
        upstream_module.cpasync_reduce_bulk_add_f32, FRACTIONS[arm]
    )
    saved_cache = itf._flash_attn_bwd.compile_cache
    bsu.copy_utils = proxy
    itf._flash_attn_bwd.compile_cache = _CACHES.setdefault(arm, {})
    try:
        yield
    finally:
        bsu.copy_utils = upstream_module
        itf._flash_attn_bwd.compile_cache = saved_cache


def staged_config():
    """The kernel this experiment is about: session 8's 64x64 backward, dQ staged for upstream's
    producer warp (`bwd_sm90.KV64_STAGED_CONFIG`, passed as the backward's ``config``; session
    9 ships another, which sends dQ without the reduce this experiment cuts). Its arms are
    named "shipped" as in session 8."""
    from flash_attn_vsa import bwd_sm90

    return bwd_sm90.KV64_STAGED_CONFIG


def run_length(emit, seq: int, heads: int, keep: float, reps: int, sms: int) -> None:
    """Correctness of the control and of dK/dV, then interleaved timing, at one length."""
    import torch

    from vsa_fa4 import launch
    from vsa_fa4.metadata import backward_lists
    from vsa_fa4.ops import forward_impl

    from .bwd_list_rotation import length_case
    from .kv64_bwd_configs import rel_l2, time_backwards_against_dense

    dim, scale = 128, 128**-0.5
    q, k, v, dout, lay = length_case(seq, heads, keep, dim)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    out, lse = forward_impl(q, k, v, idx, cnt, valid, scale, BLOCK, BLOCK, False)
    lists = backward_lists(idx, cnt, valid, BLOCK, masked=False, rotate_sms=sms)
    arms = ["shipped", *FRACTIONS]
    grads = {arm: [torch.full_like(t, float("nan")) for t in (q, k, v)] for arm in arms}

    def backward(arm):
        call = (dout, q, k, v, out, lse, *grads[arm], lists, valid, scale, (BLOCK, BLOCK), False)
        scope = reduce_scope(arm) if arm != "shipped" else contextlib.nullcontext()
        with scope:
            return launch.run_backward(*call, config=staged_config())

    for arm in arms:
        backward(arm)
    torch.cuda.synchronize()
    for arm in FRACTIONS:
        errs = [rel_l2(a, b) for a, b in zip(grads[arm], grads["shipped"], strict=True)]
        emit({"case": "vs_shipped", "seq": seq, "arm": arm, "dq_dk_dv_rel_l2": errs})
    calls = {arm: (lambda a=arm: backward(a)) for arm in arms}
    time_backwards_against_dense(emit, q, k, v, dout, scale, calls, lay, reps, sms=sms)


def compile_for_sass(dump_dir: str, arm: str | None = None) -> int:
    """Compile the shipped kernel and each arm for sm_90a on fake tensors (no GPU), keeping
    each one's PTX and cubin under ``dump_dir/<arm>/`` (one process per arm)."""
    from flash_attn_vsa import compile_gate as gate

    from .kv64_bwd_configs import sass_in_processes

    if arm is None:
        return sass_in_processes(__spec__.name, dump_dir, ["shipped", *FRACTIONS])
    import torch

    from flash_attn_vsa.bwd_sm90 import block_sparse_backward_kv64

    with gate.fake_cuda_qkv() as (q, k, v):
        sparse = gate._sparse_tensors(torch, (BLOCK, BLOCK), "bwd")
        out, dout = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(gate.BATCH, gate.HEADS, gate.SEQLEN, device="cuda")
        call = (q, k, v, out, dout, lse, sparse)
        scope = reduce_scope(arm) if arm != "shipped" else contextlib.nullcontext()
        with scope:
            block_sparse_backward_kv64(
                *call, softmax_scale=gate.HEAD_DIM**-0.5, config=staged_config()
            )
    return 0


def main() -> int:
    from .bwd_list_rotation import length_args, run_lengths

    args = length_args(sass=True)
    if args.sass:
        return compile_for_sass(args.sass, args.sass_arm)
    return run_lengths("bwd_dq_reduce_share", run_length, args)


if __name__ == "__main__":
    sys.exit(main())

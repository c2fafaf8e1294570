"""Experiment 7 (session 6): do the kernels that *read* along a list lose at long sequences the
way the fa4 backward's dQ reduce-adds did (experiment 6), and does rotating the lists help them?

Count first. A forward visits, per (query block, selected key block), 32 KB of K and V for
2.1 MFLOP (64x64 blocks, D=128): 15 B per kFLOP, 9 TB/s at 600 TFLOP/s, twice the H200's HBM.
So a sparse forward runs at speed only while most K/V tiles come from L2. With ascending lists
the CTAs running at one moment are spread over the head's whole key range (CTAs free up one
after another), so the working set is a head's K and V: 16 MB at S=32768, 64 MB at S=131072
(L2: 50 MB). The Triton backward's dK/dV pass reads Q and dO along the key blocks' query lists
the same way, and its dQ pass K and V along the query blocks' key lists.

Rotation as in `vsa_fa4.metadata.backward_lists(rotate_sms=...)`: row ``order`` of the launch
grid starts at its first entry at or past ``(order * N // width) % N`` and wraps, so the
``width`` rows running at once walk the same stretch of the index range together. Orders:
``grid`` (query blocks fastest, ascending, as Triton launches them) and ``rev`` (query blocks
descending within a head, in case a kernel walks its m-blocks backwards). Widths: 264 (the
fa4 Q64 forward runs two CTAs per SM on 132 SMs) and 132.

Arms at S = 32768 and 131072, H=12, D=128, 64x64 blocks, random top-k lists at 87.5%, all
blocks full; correctness first (rotated against ascending). ::

    python3 -m research.fa4_fork.experiments.list_rotation_reads --out DIR    # H200
"""

from __future__ import annotations

import sys

import torch

from .bwd_list_rotation import length_args, length_case
from .kv64_bwd_configs import emit_interleaved_times, rel_l2, start_log

BLOCK = 64


def grid_order(lead: tuple[int, ...], rows: int, device, reverse: bool) -> torch.Tensor:
    """[*lead, rows] place of each row in a launch whose rows run fastest (reversed within
    each (batch, head) when ``reverse``)."""
    n = 1
    for size in lead:
        n *= size
    row = torch.arange(rows, device=device)
    if reverse:
        row = rows - 1 - row
    return (torch.arange(n, device=device).view(n, 1) * rows + row).view(*lead, rows)


def rotate_padded(indices, counts, span: int, width: int, reverse: bool = False):
    """Each ascending padded row [*, R, W] rotated to start at its first entry past its start
    (`vsa_core.rotation.rotate_lists`, with the start order of ``grid_order``)."""
    from vsa_core.rotation import rotate_lists

    *lead, rows, _ = indices.shape
    order = grid_order(tuple(lead), rows, indices.device, reverse)
    return rotate_lists(indices, counts, (order * span // width) % span)


def rotate_csr(lists, num_q: int, width: int):
    """`vsa_core.layout.KVToQLists` with each key block's segment rotated the same way."""
    q_idx, offsets, counts = lists.q_indices, lists.q_offsets, lists.q_counts
    *lead, total = q_idx.shape
    num_kv = counts.shape[-1]
    pos = torch.arange(total, device=q_idx.device).expand(*lead, total).contiguous()
    seg = torch.searchsorted(offsets[..., 1:].contiguous().long(), pos, right=True)
    live = seg < num_kv
    seg = seg.clamp(max=num_kv - 1)
    order = grid_order(tuple(lead), num_kv, q_idx.device, False)
    starts = ((order * num_q // width) % num_q).gather(-1, seg)
    below = torch.zeros(*lead, num_kv, dtype=torch.int64, device=q_idx.device)
    below.scatter_add_(-1, seg, ((q_idx < starts) & live).long())
    first = offsets.long().gather(-1, seg)
    n = counts.long().gather(-1, seg).clamp(min=1)
    source = first + (pos - first + below.gather(-1, seg)) % n
    rotated = torch.where(live, q_idx.gather(-1, torch.where(live, source, pos)), q_idx)
    return type(lists)(rotated.to(torch.int32), offsets, counts)


def run_length(emit, seq: int, heads: int, keep: float, reps: int) -> None:
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    import vsa_core.layout as core_layout
    from vsa_fa4.ops import forward_impl
    from vsa_triton import ops as tri

    dim, scale = 128, 128**-0.5
    q, k, v, dout, lay = length_case(seq, heads, keep, dim)
    idx, cnt, valid = lay.kv_indices, lay.kv_counts, lay.kv_valid_sizes
    n_kv = valid.shape[0]
    rows = {
        "asc": idx,
        "g264": rotate_padded(idx, cnt, n_kv, 264),
        "g132": rotate_padded(idx, cnt, n_kv, 132),
        "rev264": rotate_padded(idx, cnt, n_kv, 264, reverse=True),
    }

    def fa4(name):
        return forward_impl(q, k, v, rows[name], cnt, valid, scale, BLOCK, BLOCK, False)

    def triton_fwd(name):
        return tri.block_sparse_fwd(q, k, v, rows[name], cnt, valid, scale, BLOCK, BLOCK)

    transpose = core_layout.transpose_kv_lists
    out, lse = triton_fwd("asc")

    def triton_bwd(name, width):
        if width:
            core_layout.transpose_kv_lists = lambda *a: rotate_csr(transpose(*a), seq // BLOCK,
                                                                   width)  # fmt: skip
        try:
            return tri.block_sparse_bwd(dout, q, k, v, out, lse, rows[name], cnt, valid, scale,
                                        BLOCK, BLOCK)  # fmt: skip
        finally:
            core_layout.transpose_kv_lists = transpose

    # correctness: every rotated arm against its ascending arm
    base_fa4, base_tri = fa4("asc")[0], triton_fwd("asc")[0]
    base_bwd = triton_bwd("asc", 0)
    errs = {f"fa4_{n}": rel_l2(fa4(n)[0], base_fa4) for n in rows if n != "asc"}
    errs |= {f"triton_{n}": rel_l2(triton_fwd(n)[0], base_tri) for n in rows if n != "asc"}
    for w in (132, 264):
        got = triton_bwd(f"g{w}", w)
        errs[f"triton_bwd_g{w}"] = max(rel_l2(a, b) for a, b in zip(got, base_bwd, strict=True))
    emit({"case": "correct", "seq": seq, "rel_l2_vs_ascending": errs})
    if max(errs.values()) > 1e-2:
        return
    pairs = float(lay.selected_token_pairs().sum()) / heads
    shape = (seq, heads, dim)
    fwd_arms = {"dense": (lambda _: _flash_attn_fwd(q, k, v, softmax_scale=scale), None)}
    for n in rows:
        fwd_arms[f"fa4_{n}"] = (lambda _, n=n: fa4(n), None)
    for n in ("asc", "g264", "g132"):
        fwd_arms[f"triton_{n}"] = (lambda _, n=n: triton_fwd(n), None)
    emit_interleaved_times(emit, fwd_arms, rounds=2, reps=reps, pairs=pairs, shape=shape,
                           seq=seq, mode="fwd")  # fmt: skip
    d_out, d_lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]

    def dense_bwd(_):
        return _flash_attn_bwd(q, k, v, d_out, dout, d_lse, softmax_scale=scale)

    bwd_arms = {
        "dense": (dense_bwd, None),
        "triton_asc": (lambda _: triton_bwd("asc", 0), None),
        "triton_g132": (lambda _: triton_bwd("g132", 132), None),
        "triton_g264": (lambda _: triton_bwd("g264", 264), None),
    }
    emit_interleaved_times(emit, bwd_arms, rounds=2, reps=reps, pairs=pairs, shape=shape,
                           factor=2.5, seq=seq, mode="bwd")  # fmt: skip


def main() -> int:
    args = length_args()
    emit = start_log(args.out, "list_rotation_reads")
    for seq in args.seqs:
        run_length(emit, seq, args.heads, args.keep, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

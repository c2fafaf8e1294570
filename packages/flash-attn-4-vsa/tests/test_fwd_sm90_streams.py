"""The two-stream forward (`flash_attn_vsa.experimental.fwd_sm90_streams`).

CPU: `stream_lists` (every block of each 64-row query block's list exactly once, on its own
side, in the right list; zeros after; refusals) and the scope (the mask class's dispatch is
tested with the paired kernel's, `test_fwd_sm90_paired`). GPU (sm_90): 64-row query blocks
with their own lists (0..5 blocks, different lengths within a tile) over full, partial and
empty key blocks against the float32 reference, NaN-poisoned outputs fully written, with each
variant (Q in registers, persistent tiles).
"""

from __future__ import annotations

import pytest
import sm90_cases as cases
import torch
from test_fwd_sm90_paired import random_split_lists

from flash_attn_vsa import build_scope, fwd_sm90, upstream_version

needs_upstream = pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")
I32 = torch.int32


def streams():
    from flash_attn_vsa.experimental import fwd_sm90_streams

    return fwd_sm90_streams


def sides(entries, count):
    """([low ids], [high ids]) of the first ``count`` packed entries, NO_BLOCK left out."""
    low, high = [], []
    for value in entries[:count].tolist():
        for side, block in ((low, value & 0xFFFF), (high, value >> 16)):
            if block != streams().NO_BLOCK:
                side.append(block)
    return low, high


@needs_upstream
@pytest.mark.parametrize("seed,rows,num_kv,width", [(0, 40, 24, 9), (1, 30, 10, 9), (2, 6, 8, 1),
                                                    (3, 8, 200, 64), (4, 4, 6, 0)])  # fmt: skip
def test_stream_lists_keep_each_query_blocks_list_on_its_own_side(seed, rows, num_kv, width):
    full, n_full, part, n_part = random_split_lists(seed, rows, num_kv, max(width, 1))
    mask_cnt, mask_idx, full_cnt, full_idx = streams().stream_lists(full, n_full, part, n_part)
    assert all(t.dtype == I32 for t in (mask_cnt, mask_idx, full_cnt, full_idx))
    assert full_idx.shape == mask_idx.shape == (rows // 2, max(width, 1))
    for t in range(rows // 2):
        full_low, full_high = sides(full_idx[t], int(full_cnt[t]))
        mask_low, mask_high = sides(mask_idx[t], int(mask_cnt[t]))
        assert len(full_low) == len(full_high) == int(full_cnt[t])  # full: two real blocks
        for side, (got_full, got_mask) in enumerate(((full_low, mask_low),
                                                     (full_high, mask_high))):  # fmt: skip
            r = 2 * t + side
            want_full = full[r, : n_full[r]].tolist()
            want_part = part[r, : n_part[r]].tolist()
            assert set(got_full) <= set(want_full)  # the full list holds full blocks only
            assert sorted(got_full + got_mask) == sorted(want_full + want_part)
            assert len(got_full + got_mask) == len(want_full + want_part)  # each once
        assert int(full_cnt[t]) == min(n_full[2 * t], n_full[2 * t + 1])
        assert int(mask_cnt[t]) == max(len(mask_low), len(mask_high))  # no all-empty entry
        assert not full_idx[t, full_cnt[t] :].any() and not mask_idx[t, mask_cnt[t] :].any()


def token_mask_through_the_kernel(packed, valid, rows):
    """[rows * 64, keys] bool: the keys each query row attends to, read from `stream_lists`'
    output the way the kernel reads it: tile t's rows 0-63 take an entry's low id, rows 64-127
    its high id; a full-list entry keeps its blocks' 64 keys, a partial-list entry the first
    ``valid`` keys of each block, `NO_BLOCK` none."""
    mask_cnt, mask_idx, full_cnt, full_idx = packed
    keys = torch.zeros(rows * 64, valid.shape[0] * 64, dtype=torch.bool)
    for t in range(rows // 2):
        lists = ((full_idx[t, : full_cnt[t]], False), (mask_idx[t, : mask_cnt[t]], True))
        for entries, partial in lists:
            for entry in entries.tolist():
                for side in (0, 1):
                    block = (entry >> (16 * side)) & 0xFFFF
                    if block == streams().NO_BLOCK:
                        continue
                    width = int(valid[block]) if partial else 64
                    row = (2 * t + side) * 64
                    assert not keys[row, block * 64].item(), "a block visited twice"
                    keys[row : row + 64, block * 64 : block * 64 + width] = True
    return keys


@needs_upstream
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_lists_read_as_the_kernel_reads_them_select_the_original_token_pairs(seed):
    rows, num_kv, width = 12, 20, 9
    full, n_full, part, n_part = random_split_lists(seed, rows, num_kv, width)
    gen = torch.Generator().manual_seed(seed)
    valid = torch.randint(1, 64, (num_kv,), generator=gen, dtype=I32)  # partial sizes
    for r in range(rows):  # the blocks random_split_lists calls full are full
        valid[full[r, : n_full[r]].long()] = 64
    want = torch.zeros(rows * 64, num_kv * 64, dtype=torch.bool)
    for r in range(rows):
        for block in full[r, : n_full[r]].tolist() + part[r, : n_part[r]].tolist():
            want[r * 64 : r * 64 + 64, block * 64 : block * 64 + int(valid[block])] = True
    packed = streams().stream_lists(full, n_full, part, n_part)
    assert torch.equal(token_mask_through_the_kernel(packed, valid, rows), want)


@needs_upstream
def test_stream_lists_take_a_partial_list_narrower_than_the_full_one():
    # vsa-fa4's lists of a layout without partial blocks: full lists as they are, one unused
    # partial slot (the bench_vsa run of 2026-11-30 read past it: a device-side assert)
    full, n_full, _, _ = random_split_lists(5, 8, 30, 9)
    part, n_part = torch.zeros(8, 1, dtype=I32), torch.zeros(8, dtype=I32)
    mask_cnt, mask_idx, full_cnt, full_idx = streams().stream_lists(full, n_full, part, n_part)
    for t in range(4):
        got = [sides(full_idx[t], int(full_cnt[t])), sides(mask_idx[t], int(mask_cnt[t]))]
        for side in (0, 1):
            r = 2 * t + side
            assert sorted(got[0][side] + got[1][side]) == sorted(full[r, : n_full[r]].tolist())


@needs_upstream
def test_stream_lists_refuse_an_odd_number_of_query_blocks():
    full, n_full, part, n_part = random_split_lists(0, 3, 8, 4)
    with pytest.raises(ValueError, match="must be even, got 3"):
        streams().stream_lists(full, n_full, part, n_part)


@needs_upstream
def test_building_picks_the_streams_class_mask_and_two_block_stages():
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    from flash_attn_vsa import fwd_sm90_paired

    for q_in_registers in (False, True):
        with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_STREAMS, q_in_registers)):
            assert build_scope.current("fwd") == fwd_sm90.ForwardKernel(
                "two_streams", q_in_registers
            )
            cls = fwd_sm90._current_kernel_class()
            assert type(fwd_module.AttentionMask(128, 64, None)) is streams().mask_class()
            assert build_scope.current("fwd").staged_rows == 2
        assert cls is streams().kernel_class(q_in_registers=q_in_registers)
        assert issubclass(cls, fwd_sm90_paired.kernel_class())  # the paired-key producer
    assert build_scope.current("fwd") is None
    assert streams().kernel_class(True) is not streams().kernel_class()


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype,variant", cases.VARIANT_CASES)
def test_two_stream_forward_matches_the_reference(dtype, variant):
    def pack(split):
        return streams().stream_lists(
            split.full_block_idx, split.full_block_cnt, split.mask_block_idx, split.mask_block_cnt
        )

    # 64-row query blocks: block i selects i % 6 key blocks, so a tile's two lists differ
    c = cases.packed_forward_case(13, 64, dtype, pack, streams().BLOCK_SIZE)
    out, lse = cases.nan_outputs(c.q)
    got = streams().block_sparse_forward_streams(
        c.q, c.k, c.v, c.tensors, c.valid.cuda(), softmax_scale=c.scale, out=out, lse=lse,
        **variant,
    )  # fmt: skip
    cases.assert_forward_matches(got, (out, lse), c.ref_out, c.ref_lse)


@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
def test_two_stream_forward_refuses_other_block_sizes_and_head_dims():
    q, tensors, valid = cases.small_refusal_case()
    with pytest.raises(ValueError, match="block_size must be"):
        streams().block_sparse_forward_streams(
            q, q, q, tensors._replace(block_size=(64, 64)), valid, softmax_scale=0.1
        )
    small = q[..., :64].contiguous()
    with pytest.raises(ValueError, match="head dim must be 128"):
        streams().block_sparse_forward_streams(
            small, small, small, tensors._replace(block_size=streams().BLOCK_SIZE), valid,
            softmax_scale=0.1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="one entry per 64-token key block"):
        streams().block_sparse_forward_streams(
            q, q, q, tensors._replace(block_size=streams().BLOCK_SIZE), valid[:3],
            softmax_scale=0.1,
        )  # fmt: skip

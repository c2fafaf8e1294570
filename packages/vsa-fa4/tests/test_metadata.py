"""Index lists + valid sizes -> FA4's block-sparse tensors, against hand-computed expectations.

Tiny layouts (one batch, one head unless stated) whose FA4 lists are written out by hand:
the full/partial split with empty blocks dropped, the key-block-owned transposes of the
backward, 256 -> 128 key expansion and the pairing of 64-token query blocks. Then properties
on random layouts, and that nothing reads device data (everything runs under a fake mode).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vsa_core import BlockSparseLayout
from vsa_core.rotation import rotation_starts
from vsa_fa4 import metadata
from vsa_fa4.metadata import SparseLists, backward_lists, forward_lists, physical_lists
from vsa_fa4.schedule import make_plan

I32 = torch.int32


def t(data) -> torch.Tensor:
    return torch.tensor(data, dtype=I32)


def layout_of(rows: list[list[int]], valid: list[int], block_shape) -> BlockSparseLayout:
    """A [1, 1, len(rows), W] layout from explicit key lists (padded with 0)."""
    width = max(1, max(len(r) for r in rows))
    idx = [r + [0] * (width - len(r)) for r in rows]
    return BlockSparseLayout.from_indices(
        t([[idx]]),
        t([[[len(r) for r in rows]]]),
        kv_valid_sizes=t(valid),
        block_shape=block_shape,
    )


def listed(lists: SparseLists) -> dict[str, list[list[int]]]:
    """Each list of (batch 0, head 0) cut to its count: {"full": [...], "partial": [...]}."""

    def cut(idx: torch.Tensor, cnt: torch.Tensor) -> list[list[int]]:
        return [row[:n] for row, n in zip(idx[0, 0].tolist(), cnt[0, 0].tolist(), strict=True)]

    return {
        "full": cut(lists.full_block_idx, lists.full_block_cnt),
        "partial": cut(lists.mask_block_idx, lists.mask_block_cnt),
    }


def lists_of(layout: BlockSparseLayout, schedule: str = "auto"):
    plan = make_plan(layout.block_shape, layout.q_group_size, layout.num_q_blocks, schedule)
    phys = physical_lists(
        layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, plan, layout.q_group_size
    )
    return plan, phys


# ---- the forward split --------------------------------------------------------------------
def test_forward_split_full_partial_and_drops_empty_blocks():
    # Key blocks of 64 tokens: 0 full, 1 partial (30), 2 empty, 3 full.
    layout = layout_of([[2, 0, 1], [3, 1], [2], []], [64, 30, 0, 64], (64, 64))
    lists = forward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
    assert listed(lists) == {
        "full": [[0], [3], [], []],
        "partial": [[1], [1], [], []],
    }
    for tensor in lists:
        assert tensor.dtype == I32
    assert lists.full_block_cnt.shape == lists.mask_block_cnt.shape == (1, 1, 4)
    assert lists.full_block_idx.shape == lists.mask_block_idx.shape == (1, 1, 4, 3)
    for idx in (lists.full_block_idx, lists.mask_block_idx):
        assert idx.stride(-1) == 1  # FA4 reads the last dim contiguously
        assert int(idx.min()) >= 0 and int(idx.max()) < 4  # unused entries are valid indices


def test_forward_split_keeps_ascending_order_and_all_full_rows():
    layout = layout_of([[5, 1, 3, 0], [4, 2]], [64] * 6, (128, 64))
    lists = forward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
    assert listed(lists) == {"full": [[0, 1, 3, 5], [2, 4]], "partial": [[], []]}


def test_forward_lists_are_no_wider_than_the_number_of_key_blocks():
    # Width 5 over 3 key blocks (unused slots may be more than blocks): FA4 wants width <= 3.
    idx = t([[[[2, 0, 1, 0, 0]]]])
    layout = BlockSparseLayout(idx, t([[[3]]]), t([10, 64, 64]), (64, 64))
    lists = forward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
    assert lists.full_block_idx.shape[-1] == lists.mask_block_idx.shape[-1] == 3
    assert listed(lists) == {"full": [[2, 1]], "partial": [[0]]}


def test_forward_lists_of_a_zero_width_layout():
    layout = BlockSparseLayout(torch.zeros(1, 1, 2, 0, dtype=I32), t([[[0, 0]]]), t([64]), (64, 64))
    lists = forward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
    assert listed(lists) == {"full": [[], []], "partial": [[], []]}
    assert lists.full_block_idx.shape == (1, 1, 2, 1)


# ---- the backward transposes --------------------------------------------------------------
def test_backward_lists_transpose_and_split_by_key_block():
    layout = layout_of([[0, 1, 2], [1, 3], [2]], [64, 30, 0, 64], (64, 64))
    lists = backward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
    # Key block -> query blocks: 0 <- [0] (full), 1 <- [0, 1] (partial), 2 is empty
    # (dropped although selected), 3 <- [1] (full).
    assert listed(lists) == {"full": [[0], [], [], [1]], "partial": [[], [0, 1], [], []]}
    # Static width: the number of query blocks; one index tensor serves both lists.
    assert lists.full_block_idx.shape == (1, 1, 4, 3)
    assert lists.full_block_idx is lists.mask_block_idx
    assert lists.full_block_idx[0, 0].tolist() == [[0, 0, 0], [0, 1, 0], [0, 2, 0], [1, 0, 0]]


def test_backward_lists_hold_a_key_block_every_query_block_selects():
    # Forward width 1, but key block 0 is selected by all 4 query blocks: the transpose needs
    # width 4 (num_q_blocks), not the layout's width.
    layout = layout_of([[0], [0], [0], [0]], [64, 64], (64, 64))
    assert layout.width == 1
    lists = backward_lists(layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, 64)
    assert listed(lists)["full"] == [[0, 1, 2, 3], []]


# ---- 256 -> 128 key expansion --------------------------------------------------------------
def test_256_blocks_run_as_128_key_tiles():
    # Logical 256-token key blocks with valid sizes 256, 200, 100, 0 -> physical 128-token
    # blocks 0..7 with valid sizes 128, 128 | 128, 72 | 100, 0 | 0, 0.
    layout = layout_of([[1, 2], [0, 3]], [256, 200, 100, 0], (256, 256))
    plan, (kv_indices, kv_counts, valid) = lists_of(layout)
    assert plan.block_size == (256, 128) and plan.kv_split == 2 and plan.schedule == "native"
    assert valid.tolist() == [128, 128, 128, 72, 100, 0, 0, 0]
    assert kv_counts.tolist() == [[[4, 4]]]
    assert kv_indices[0, 0].tolist() == [[2, 3, 4, 5], [0, 1, 6, 7]]

    fwd = forward_lists(kv_indices, kv_counts, valid, plan.kv_tile)
    # Row 0: 2 full; 3 (72 of 128) and 4 (100 of 128) partial; 5 empty, dropped.
    # Row 1: 0 and 1 full; 6 and 7 (children of an empty block) dropped.
    assert listed(fwd) == {"full": [[2], [0, 1]], "partial": [[3, 4], []]}

    bwd = backward_lists(kv_indices, kv_counts, valid, plan.kv_tile)
    assert bwd.full_block_idx.shape == (1, 1, 8, 2)  # [B, H, NKV = 8, NQ = 2]
    assert listed(bwd) == {
        "full": [[1], [1], [0], [], [], [], [], []],
        "partial": [[], [], [], [0], [0], [], [], []],
    }


# ---- pairing of 64-token query blocks ------------------------------------------------------
def test_paired_query_blocks_share_the_first_rows_list():
    parent = layout_of([[0, 2], [1]], [64, 64, 20], (128, 64))
    layout = parent.refine((64, 64))  # 4 query blocks, aligned pairs share lists
    assert layout.q_group_size == 2
    plan, (kv_indices, kv_counts, valid) = lists_of(layout)
    assert plan.schedule == "paired" and plan.block_size == (128, 64) and plan.q_merge == 2
    assert kv_counts.tolist() == [[[2, 1]]]
    assert kv_indices[0, 0].tolist() == [[0, 2], [1, 0]]
    assert torch.equal(valid, layout.kv_valid_sizes)
    assert listed(forward_lists(kv_indices, kv_counts, valid, 64)) == {
        "full": [[0], [1]],
        "partial": [[2], []],
    }
    # The native schedule keeps the four 64-row blocks.
    plan, (kv_indices, kv_counts, _) = lists_of(layout, "native")
    assert plan.block_size == (64, 64) and kv_counts.tolist() == [[[2, 2, 1, 1]]]


def test_256_layout_refined_to_64x64_pairs_and_keeps_64_key_blocks():
    parent = layout_of([[1], [0]], [256, 100], (256, 256))
    layout = parent.refine((64, 64))
    assert layout.q_group_size == 4 and layout.num_q_blocks == 8
    plan, (kv_indices, kv_counts, valid) = lists_of(layout)
    assert plan.block_size == (128, 64)
    assert valid.tolist() == [64, 64, 64, 64, 64, 36, 0, 0]
    assert kv_counts.tolist() == [[[4, 4, 4, 4]]]
    fwd = forward_lists(kv_indices, kv_counts, valid, 64)
    assert listed(fwd) == {
        "full": [[4], [4], [0, 1, 2, 3], [0, 1, 2, 3]],
        "partial": [[5], [5], [], []],
    }


def test_unpaired_64_layouts_stay_native():
    layout = layout_of([[0], [1], [1], [0]], [64, 64], (64, 64))
    assert layout.q_group_size == 1
    plan, _ = lists_of(layout)
    assert plan.schedule == "native" and plan.block_size == (64, 64)
    with pytest.raises(ValueError, match="schedule='paired' needs"):
        lists_of(layout, "paired")


# ---- properties on random layouts ----------------------------------------------------------
def random_layout(seed: int, block_shape, num_q: int, num_kv: int, heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    kv_block = block_shape[1]
    valid = torch.randint(0, 3, (num_kv,), generator=gen)  # 0 empty, 1 partial, 2 full
    sizes = torch.where(valid == 2, kv_block, torch.randint(1, kv_block, (num_kv,), generator=gen))
    sizes = torch.where(valid == 0, 0, sizes).to(I32)
    width = min(5, num_kv)
    order = torch.rand(1, heads, num_q, num_kv, generator=gen).argsort(-1)[..., :width]
    counts = torch.randint(0, width + 1, (1, heads, num_q), generator=gen)
    return BlockSparseLayout.from_indices(
        order.to(I32), counts.to(I32), kv_valid_sizes=sizes, block_shape=block_shape
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_shape", [(64, 64), (128, 128), (256, 256)])
def test_lists_partition_the_selection_and_backward_is_its_transpose(seed, block_shape):
    layout = random_layout(seed, block_shape, num_q=6, num_kv=7)
    plan, (kv_indices, kv_counts, valid) = lists_of(layout)
    fwd = forward_lists(kv_indices, kv_counts, valid, plan.kv_tile)
    bwd = backward_lists(kv_indices, kv_counts, valid, plan.kv_tile)
    heads, rows, num_kv = kv_indices.shape[1], kv_indices.shape[2], valid.shape[0]
    fwd_pairs, bwd_pairs = set(), set()
    for h in range(heads):
        for m in range(rows):
            selected = kv_indices[0, h, m, : kv_counts[0, h, m]].tolist()
            full = fwd.full_block_idx[0, h, m, : fwd.full_block_cnt[0, h, m]].tolist()
            partial = fwd.mask_block_idx[0, h, m, : fwd.mask_block_cnt[0, h, m]].tolist()
            assert full == sorted(full) and partial == sorted(partial)
            assert full == [j for j in selected if valid[j] == plan.kv_tile]
            assert partial == [j for j in selected if 0 < valid[j] < plan.kv_tile]
            fwd_pairs |= {(h, m, j, "full") for j in full} | {(h, m, j, "mask") for j in partial}
        for n in range(num_kv):
            for kind, cnt, idx in (
                ("full", bwd.full_block_cnt, bwd.full_block_idx),
                ("mask", bwd.mask_block_cnt, bwd.mask_block_idx),
            ):
                queries = idx[0, h, n, : cnt[0, h, n]].tolist()
                assert queries == sorted(set(queries))
                bwd_pairs |= {(h, m, n, kind) for m in queries}
    assert fwd_pairs == bwd_pairs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_kv", [8, 12])
def test_paired_key_lists_select_the_same_token_pairs(seed, num_kv):
    """The 128x64 forward's lists as the fork's paired-key kernel reads them
    (``fwd_sm90_paired.pair_lists`` of `forward_lists`) select exactly the token pairs of the
    unpaired lists: full and partial blocks, odd counts, empty blocks dropped."""
    import fa4_model

    paired = pytest.importorskip("flash_attn_vsa.fwd_sm90_paired")
    layout = random_layout(seed, (128, 64), num_q=6, num_kv=num_kv)
    plan, (kv_indices, kv_counts, valid) = lists_of(layout)
    fwd = forward_lists(kv_indices, kv_counts, valid, plan.kv_tile)
    assert bool((fwd.full_block_cnt % 2).any() or (fwd.mask_block_cnt % 2).any())
    pair_lists = paired.pair_lists(
        fwd.full_block_idx, fwd.full_block_cnt, fwd.mask_block_idx, fwd.mask_block_cnt, num_kv
    )
    q_len, kv_len = layout.q_len, layout.kv_len
    want = fa4_model.forward_pairs(fwd, valid, (128, 64), q_len, kv_len)
    got = fa4_model.paired_forward_pairs(pair_lists, valid, 128, kv_len)
    assert torch.equal(got, want)


def test_metadata_reads_no_device_data():
    """Everything runs under a fake tensor mode, where reading data (``.item()``, a
    data-dependent shape) raises: so the construction is sync-free on a GPU."""
    layout = random_layout(0, (256, 256), num_q=4, num_kv=5)
    plan = make_plan(layout.block_shape)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in (layout.kv_indices, layout.kv_counts)]
        valid = mode.from_tensor(layout.kv_valid_sizes)
        kv_indices, kv_counts, valid = physical_lists(*fake, valid, plan)
        fwd = forward_lists(kv_indices, kv_counts, valid, plan.kv_tile)
        bwd = backward_lists(kv_indices, kv_counts, valid, plan.kv_tile)
    assert fwd.full_block_idx.shape == (1, 2, 4, 10)
    assert bwd.full_block_idx.shape == (1, 2, 10, 4)


@pytest.mark.parametrize("seed", range(4))
def test_dense_and_sorted_transposes_agree(seed, monkeypatch):
    """`padded_transpose` builds small transposes densely and large ones by sorting: both
    give the same lists (ascending query blocks, zeros past the count)."""
    gen = torch.Generator().manual_seed(seed)
    num_q, num_kv, width = 9 + seed, 7 + 2 * seed, 5
    kv = torch.rand(2, 3, num_q, num_kv, generator=gen).argsort(-1)[..., :width].to(torch.int32)
    counts = torch.randint(0, width + 1, (2, 3, num_q), generator=gen, dtype=torch.int32)
    dense = metadata.padded_transpose(kv, counts, num_kv)
    monkeypatch.setattr(metadata, "DENSE_TRANSPOSE_MAX_ENTRIES", 0)
    by_sort = metadata.padded_transpose(kv, counts, num_kv)
    for a, b in zip(dense, by_sort, strict=True):
        assert a.dtype == b.dtype == torch.int32 and a.is_contiguous()
        assert torch.equal(a, b)
    # and both are the transpose of the selection
    selected = torch.zeros(2, 3, num_q, num_kv, dtype=torch.bool)
    for b_, h, i in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(num_q)):
        selected[b_, h, i, kv[b_, h, i, : counts[b_, h, i]].long()] = True
    q_idx, q_cnt = dense
    assert torch.equal(q_cnt, selected.sum(2, dtype=torch.int32))
    for b_, h, j in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(num_kv)):
        want = torch.nonzero(selected[b_, h, :, j]).flatten().to(torch.int32)
        assert torch.equal(q_idx[b_, h, j, : len(want)], want)


@pytest.mark.parametrize("rotate_sms", [1, 3, 132])
def test_rotated_backward_lists_start_at_the_first_query_past_their_start(rotate_sms):
    layout = random_layout(0, (64, 64), num_q=9, num_kv=7)
    plan, (kv_indices, kv_counts, valid) = lists_of(layout)
    plain = backward_lists(kv_indices, kv_counts, valid, plan.kv_tile, impl="torch")
    turned = backward_lists(kv_indices, kv_counts, valid, plan.kv_tile, impl="torch",
                            rotate_sms=rotate_sms)  # fmt: skip
    assert torch.equal(plain.full_block_cnt, turned.full_block_cnt)
    assert torch.equal(plain.mask_block_cnt, turned.mask_block_cnt)
    starts = rotation_starts(plain.full_block_idx.shape, plain.full_block_idx.shape[-1], rotate_sms)
    # list lengths, empty key blocks included (their lists are built, neither count uses them)
    _, counts = metadata.padded_transpose(kv_indices, kv_counts, valid.shape[0])
    for key in itertools.product(*(range(n) for n in counts.shape)):
        n = int(counts[key])
        ascending = plain.full_block_idx[key][:n].tolist()
        cut = sum(q < int(starts[key]) for q in ascending)
        assert turned.full_block_idx[key][:n].tolist() == ascending[cut:] + ascending[:cut]
        assert not turned.full_block_idx[key][n:].any()
    with pytest.raises(ValueError, match="rotate_sms"):
        backward_lists(kv_indices, kv_counts, valid, plan.kv_tile, q_split=2, rotate_sms=3)

"""BlockSparseLayout and KVToQLists against naive loops over boolean block maps."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vsa_naive import SETTINGS

from vsa_core.layout import BlockSparseLayout


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows(block_mask):
    """Per (b, h, i): the ascending list of selected key blocks (naive)."""
    batch, heads, num_q, num_kv = block_mask.shape
    return {
        (b, h, i): [j for j in range(num_kv) if block_mask[b, h, i, j]]
        for b, h, i in itertools.product(range(batch), range(heads), range(num_q))
    }


def _check_lists(layout, block_mask):
    """The layout's compact lists hold exactly the map's selected blocks, ascending, in range."""
    assert layout.kv_indices.dtype == torch.int32 and layout.kv_counts.dtype == torch.int32
    for (b, h, i), expected in _rows(block_mask).items():
        count = int(layout.kv_counts[b, h, i])
        row = layout.kv_indices[b, h, i].tolist()
        assert count == len(expected)
        assert row[:count] == expected
        assert all(0 <= x < layout.num_kv_blocks for x in row)


block_maps = st.builds(
    lambda b, h, nq, nkv, p, seed: torch.rand(b, h, nq, nkv, generator=_gen(seed)) < p,
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(1, 7),
    st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]),
    st.integers(0, 2**31),
)


# ---- constructors ------------------------------------------------------------------------------
@SETTINGS
@given(nq=st.integers(1, 5), nkv=st.integers(1, 9), data=st.data(), seed=st.integers(0, 2**31))
def test_from_topk(nq, nkv, data, seed):
    k = data.draw(st.integers(1, nkv))
    scores = torch.rand(2, 3, nq, nkv, generator=_gen(seed))
    picks = torch.topk(scores, k, dim=-1, sorted=False).indices
    valid = torch.randint(0, 5, (nkv,), generator=_gen(seed + 1))
    layout = BlockSparseLayout.from_topk(picks, valid, (4, 4))
    assert layout.kv_counts.tolist() == [[[k] * nq] * 3] * 2
    assert layout.block_shape == (4, 4) and layout.width == k and layout.q_group_size == 1
    expected = torch.zeros(2, 3, nq, nkv, dtype=torch.bool)
    for b, h, i in itertools.product(range(2), range(3), range(nq)):
        for j in picks[b, h, i].tolist():
            expected[b, h, i, j] = True
    _check_lists(layout, expected)
    assert layout.kv_valid_sizes.dtype == torch.int32
    assert layout.kv_valid_sizes.tolist() == valid.tolist()


@SETTINGS
@given(block_mask=block_maps, seed=st.integers(0, 2**31), extra=st.integers(0, 2))
def test_from_indices_sorts_and_fills(block_mask, seed, extra):
    """Shuffled lists with garbage in unused slots become sorted lists with in-range fillers."""
    batch, heads, num_q, num_kv = block_mask.shape
    width = num_kv + extra
    gen = _gen(seed)
    indices = torch.randint(-50, 50, (batch, heads, num_q, width), generator=gen)
    counts = torch.zeros(batch, heads, num_q, dtype=torch.int64)
    for (b, h, i), sel in _rows(block_mask).items():
        perm = torch.randperm(len(sel), generator=gen).tolist()
        indices[b, h, i, : len(sel)] = torch.tensor([sel[p] for p in perm], dtype=torch.int64)
        counts[b, h, i] = len(sel)
    valid = torch.randint(0, 5, (num_kv,), generator=gen)
    layout = BlockSparseLayout.from_indices(
        indices, counts, kv_valid_sizes=valid, block_shape=(3, 4)
    )
    assert layout.width == width and layout.num_kv_blocks == num_kv
    _check_lists(layout, block_mask)
    assert torch.equal(layout.to_block_mask(), block_mask)


def test_from_indices_counts_default_to_width():
    indices = torch.tensor([[[[3, 1, 2], [0, 2, 1]]]])
    layout = BlockSparseLayout.from_indices(
        indices, kv_valid_sizes=torch.tensor([4, 4, 4, 4]), block_shape=(4, 4)
    )
    assert layout.kv_counts.tolist() == [[[3, 3]]]
    assert layout.kv_indices.tolist() == [[[[1, 2, 3], [0, 1, 2]]]]


def test_from_indices_validation_errors():
    valid = torch.tensor([4, 4, 2], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [2, 0]]]], dtype=torch.int32)
    counts = torch.tensor([[[2, 1]]], dtype=torch.int32)

    def build(indices=idx, kv_counts=counts, kv_valid_sizes=valid, block_shape=(4, 4), **kw):
        return BlockSparseLayout.from_indices(
            indices, kv_counts, kv_valid_sizes=kv_valid_sizes, block_shape=block_shape, **kw
        )

    build()  # the baseline is valid
    cases = [
        ({"indices": torch.tensor([[[[0, 3], [2, 0]]]])}, r"kv_indices \(selected entries\)"),
        ({"indices": torch.tensor([[[[-1, 1], [2, 0]]]])}, r"kv_indices \(selected entries\)"),
        ({"indices": torch.tensor([[[[1, 1], [2, 0]]]])}, "kv_indices must not repeat"),
        ({"kv_counts": torch.tensor([[[3, 1]]])}, "kv_counts values must lie in"),
        ({"kv_counts": torch.tensor([[[-1, 1]]])}, "kv_counts values must lie in"),
        ({"kv_valid_sizes": torch.tensor([4, 5, 2])}, "kv_valid_sizes values must lie in"),
        ({"kv_valid_sizes": torch.tensor([4, -1, 2])}, "kv_valid_sizes values must lie in"),
        ({"indices": idx[0]}, "kv_indices must be 4-D"),
        ({"indices": idx.float()}, "kv_indices must be an integer tensor"),
        ({"indices": idx.bool()}, "kv_indices must be an integer tensor"),
        ({"indices": [[[[0, 1]]]]}, "kv_indices must be a torch.Tensor"),
        ({"kv_counts": counts.float()}, "kv_counts must be an integer tensor"),
        ({"kv_counts": counts[0]}, "kv_counts must have shape"),
        ({"kv_valid_sizes": valid.view(1, 3)}, "kv_valid_sizes must be a non-empty 1-D"),
        ({"kv_valid_sizes": valid.double()}, "kv_valid_sizes must be an integer tensor"),
        ({"kv_valid_sizes": valid.to("meta")}, "kv_valid_sizes must be on kv_indices' device"),
        ({"kv_counts": counts.to("meta")}, "kv_counts must be on kv_indices' device"),
        ({"block_shape": (4, 0)}, "block_shape"),
        ({"block_shape": (4,)}, "block_shape"),
        ({"block_shape": "ab"}, "block_shape"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            build(**kwargs)


def test_from_indices_validate_false_skips_data_checks():
    # Out-of-range values and duplicates pass unchecked (the producer is trusted).
    layout = BlockSparseLayout.from_indices(
        torch.tensor([[[[1, 1, 9]]]]),
        torch.tensor([[[3]]]),
        kv_valid_sizes=torch.tensor([4, 99]),
        block_shape=(4, 4),
        validate=False,
    )
    assert layout.kv_indices.tolist() == [[[[1, 1, 9]]]]
    assert layout.kv_valid_sizes.tolist() == [4, 99]
    # Metadata checks still run.
    with pytest.raises(ValueError, match="kv_indices must be 4-D"):
        BlockSparseLayout.from_indices(
            torch.zeros(1, 1, 1, dtype=torch.int64),
            kv_valid_sizes=torch.tensor([4]),
            block_shape=(4, 4),
            validate=False,
        )


@SETTINGS
@given(block_mask=block_maps, narrow=st.booleans())
def test_block_mask_round_trip(block_mask, narrow):
    num_kv = block_mask.shape[-1]
    valid = torch.arange(num_kv) % 5
    width = max(int(block_mask.sum(-1).max()), 1) if narrow else None
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (2, 4), width=width)
    assert layout.width == (width if narrow else num_kv)
    _check_lists(layout, block_mask)
    assert torch.equal(layout.to_block_mask(), block_mask)


def test_from_block_mask_errors():
    valid = torch.tensor([4, 4])
    with pytest.raises(ValueError, match="block_mask must be a bool tensor"):
        BlockSparseLayout.from_block_mask(torch.ones(1, 1, 1, 2), valid, (4, 4))
    with pytest.raises(ValueError, match="block_mask must have shape"):
        BlockSparseLayout.from_block_mask(torch.ones(1, 1, 1, 3, dtype=torch.bool), valid, (4, 4))
    with pytest.raises(ValueError, match="block_shape"):
        BlockSparseLayout.from_block_mask(torch.ones(1, 1, 1, 2, dtype=torch.bool), valid, (0, 4))
    # A width below the largest row count would silently drop selected blocks; one above
    # num_kv_blocks cannot be filled.
    two_rows = torch.tensor([[[[True, False], [True, True]]]])
    with pytest.raises(ValueError, match=r"width must lie in \[2, 2\]"):
        BlockSparseLayout.from_block_mask(two_rows, valid, (4, 4), width=1)
    with pytest.raises(ValueError, match=r"width must lie in \[2, 2\]"):
        BlockSparseLayout.from_block_mask(two_rows, valid, (4, 4), width=3)


# ---- transpose ---------------------------------------------------------------------------------
def _check_kv_to_q(layout, block_mask):
    batch, heads, num_q, num_kv = block_mask.shape
    t = layout.kv_to_q
    assert t.q_indices.shape == (batch, heads, num_q * layout.width)
    assert t.q_offsets.shape == (batch, heads, num_kv + 1)
    assert t.q_counts.shape == (batch, heads, num_kv)
    for b, h in itertools.product(range(batch), range(heads)):
        offsets = t.q_offsets[b, h].tolist()
        assert offsets[0] == 0
        total = 0
        for j in range(num_kv):
            expected = [i for i in range(num_q) if block_mask[b, h, i, j]]  # naive transpose
            assert int(t.q_counts[b, h, j]) == len(expected)
            assert offsets[j + 1] - offsets[j] == len(expected)
            assert t.q_indices[b, h, offsets[j] : offsets[j + 1]].tolist() == expected
            total += len(expected)
        assert offsets[-1] == total
        assert t.q_indices[b, h, total:].tolist() == [0] * (num_q * layout.width - total)

    # Padded form, default width (largest count) and an explicit, wider one.
    max_count = int(block_mask.sum(2).max()) if block_mask.numel() else 0
    for width in (None, max(max_count, 1) + 2):
        padded, counts = t.to_padded(width)
        want_width = max(max_count, 1) if width is None else width
        assert padded.shape == (batch, heads, num_kv, want_width)
        assert torch.equal(counts, t.q_counts)
        for b, h, j in itertools.product(range(batch), range(heads), range(num_kv)):
            expected = [i for i in range(num_q) if block_mask[b, h, i, j]]
            row = padded[b, h, j].tolist()
            assert row == expected + [0] * (want_width - len(expected))


@SETTINGS
@given(block_mask=block_maps)
def test_kv_to_q_random(block_mask):
    valid = torch.full((block_mask.shape[-1],), 4)
    width = max(int(block_mask.sum(-1).max()), 1)
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (4, 4), width=width)
    _check_kv_to_q(layout, block_mask)
    assert layout.kv_to_q is layout.kv_to_q  # cached


def test_kv_to_q_edge_rows():
    """Rows with count 0, a key block nobody selects, and one everybody selects."""
    num_q, num_kv = 5, 6
    block_mask = torch.zeros(2, 2, num_q, num_kv, dtype=torch.bool)
    block_mask[..., 2] = True  # selected by all
    block_mask[0, 0, 1, [0, 4]] = True
    block_mask[1, 1, 3, [1, 5]] = True
    block_mask[0, 1, 4] = False  # a query block with no key block at all
    block_mask[1, 0, :, 2] = False  # a (b, h) with nothing selected
    # key block 3 is selected by no one anywhere
    layout = BlockSparseLayout.from_block_mask(block_mask, torch.full((num_kv,), 4), (4, 4))
    assert int(layout.kv_counts[0, 1, 4]) == 0
    _check_kv_to_q(layout, block_mask)
    t = layout.kv_to_q
    assert t.q_counts[..., 3].tolist() == [[0, 0], [0, 0]]
    assert t.q_counts[0, 0, 2] == num_q
    # A layout whose counts are all zero: padded width is 1, all counts 0.
    empty = BlockSparseLayout.from_block_mask(
        torch.zeros(1, 1, 3, 4, dtype=torch.bool), torch.full((4,), 4), (4, 4)
    )
    padded, counts = empty.kv_to_q.to_padded()
    assert padded.shape == (1, 1, 4, 1) and counts.sum() == 0


def test_to_padded_narrow_width_truncates():
    block_mask = torch.ones(1, 1, 4, 2, dtype=torch.bool)
    layout = BlockSparseLayout.from_block_mask(block_mask, torch.full((2,), 4), (4, 4))
    padded, counts = layout.kv_to_q.to_padded(2)
    assert padded.tolist() == [[[[0, 1], [0, 1]]]]
    assert counts.tolist() == [[[4, 4]]]


# ---- refine ------------------------------------------------------------------------------------
def _kron(parent_mask, fq, fk):
    """Naive Kronecker expansion of a block map."""
    batch, heads, num_q, num_kv = parent_mask.shape
    out = torch.zeros(batch, heads, num_q * fq, num_kv * fk, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(batch), range(heads), range(num_q), range(num_kv)):
        if parent_mask[b, h, i, j]:
            out[b, h, i * fq : (i + 1) * fq, j * fk : (j + 1) * fk] = True
    return out


def _clamped_children(valid, parent_block, child_block):
    out = []
    for size in valid:
        for c in range(parent_block // child_block):
            out.append(min(max(size - c * child_block, 0), child_block))
    return out


@SETTINGS
@given(
    block_mask=block_maps,
    child=st.sampled_from([(128, 128), (128, 64), (64, 64), (256, 256)]),
    seed=st.integers(0, 2**31),
)
def test_refine(block_mask, child, seed):
    num_kv = block_mask.shape[-1]
    valid = torch.randint(0, 257, (num_kv,), generator=_gen(seed))
    width = max(int(block_mask.sum(-1).max()), 1)
    parent = BlockSparseLayout.from_block_mask(block_mask, valid, (256, 256), width=width)
    fine = parent.refine(child)
    fq, fk = 256 // child[0], 256 // child[1]
    assert fine.block_shape == child
    assert fine.q_group_size == fq
    assert fine.num_q_blocks == parent.num_q_blocks * fq
    assert fine.num_kv_blocks == num_kv * fk
    assert fine.q_len == parent.q_len and fine.kv_len == parent.kv_len
    assert torch.equal(fine.to_block_mask(), _kron(block_mask, fq, fk))
    assert fine.kv_valid_sizes.tolist() == _clamped_children(valid.tolist(), 256, child[1])
    _check_lists(fine, _kron(block_mask, fq, fk))
    if fq > 1:
        assert bool(fine.rows_share_kv_lists(fq).all())
        assert bool(fine.rows_share_kv_lists(2).all())
    # The same token pairs: the finer layout selects as many (query, real key) pairs.
    assert int(fine.selected_token_pairs()) == int(parent.selected_token_pairs())
    # Refining twice equals refining once to the finest.
    if child == (128, 128):
        assert torch.equal(
            fine.refine((64, 64)).to_block_mask(), parent.refine((64, 64)).to_block_mask()
        )
        assert fine.refine((64, 64)).q_group_size == 4


def test_refine_partial_block_example():
    parent = BlockSparseLayout.from_block_mask(
        torch.ones(1, 1, 1, 2, dtype=torch.bool), torch.tensor([256, 150]), (256, 256)
    )
    assert parent.refine((64, 64)).kv_valid_sizes.tolist() == [64, 64, 64, 64, 64, 64, 22, 0]
    assert parent.refine((256, 128)).kv_valid_sizes.tolist() == [128, 128, 128, 22]
    with pytest.raises(ValueError, match="block_shape must divide"):
        parent.refine((96, 64))
    with pytest.raises(ValueError, match="block_shape"):
        parent.refine((0, 64))


def test_rows_share_kv_lists_detects_differences():
    gen = _gen(3)
    block_mask = torch.rand(2, 2, 6, 5, generator=gen) < 0.5
    # Make query blocks (0, 1) of (0, 0) equal and (2, 3) differ in one entry; 4, 5 equal.
    block_mask[0, 0, 1] = block_mask[0, 0, 0]
    block_mask[0, 0, 3] = block_mask[0, 0, 2]
    block_mask[0, 0, 3, 4] = ~block_mask[0, 0, 2, 4]
    block_mask[0, 0, 5] = block_mask[0, 0, 4]
    layout = BlockSparseLayout.from_block_mask(block_mask, torch.full((5,), 4), (4, 4))
    shared = layout.rows_share_kv_lists(2)
    assert shared.shape == (2, 2, 3)
    for b, h, g in itertools.product(range(2), range(2), range(3)):
        naive = torch.equal(block_mask[b, h, 2 * g], block_mask[b, h, 2 * g + 1])
        assert bool(shared[b, h, g]) == naive
    assert shared[0, 0].tolist() == [True, False, True]
    assert layout.rows_share_kv_lists(1).all()
    with pytest.raises(ValueError, match="group must be a positive divisor"):
        layout.rows_share_kv_lists(4)
    with pytest.raises(ValueError, match="group must be a positive divisor"):
        layout.rows_share_kv_lists(0)


def test_rows_share_ignores_unused_slots():
    # Same selected blocks, different garbage past the count: still shared.
    layout = BlockSparseLayout(
        torch.tensor([[[[1, 2, 0], [1, 2, 3]]]], dtype=torch.int32),
        torch.tensor([[[2, 2]]], dtype=torch.int32),
        torch.full((4,), 4, dtype=torch.int32),
        (4, 4),
    )
    assert layout.rows_share_kv_lists(2).tolist() == [[[True]]]


# ---- misc --------------------------------------------------------------------------------------
@SETTINGS
@given(block_mask=block_maps, seed=st.integers(0, 2**31), q_block=st.integers(1, 5))
def test_selected_token_pairs(block_mask, seed, q_block):
    num_kv = block_mask.shape[-1]
    valid = torch.randint(0, 7, (num_kv,), generator=_gen(seed))
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (q_block, 6))
    naive = 0
    for (_, _, _), sel in _rows(block_mask).items():
        naive += sum(q_block * int(valid[j]) for j in sel)
    assert int(layout.selected_token_pairs()) == naive


def test_shape_properties_and_to():
    block_mask = torch.zeros(2, 3, 4, 5, dtype=torch.bool)
    layout = BlockSparseLayout.from_block_mask(block_mask, torch.full((5,), 2), (8, 2), width=3)
    assert (layout.batch, layout.heads, layout.num_q_blocks, layout.num_kv_blocks) == (2, 3, 4, 5)
    assert (layout.width, layout.q_block, layout.kv_block) == (3, 8, 2)
    assert (layout.q_len, layout.kv_len) == (32, 10)
    assert layout.device == torch.device("cpu")
    moved = layout.to("meta")
    assert moved.device.type == "meta" and moved.block_shape == (8, 2)
    assert layout.slot_mask().shape == (2, 3, 4, 3)

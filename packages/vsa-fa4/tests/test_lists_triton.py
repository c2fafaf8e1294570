"""The Triton list builders equal the tensor-op ones: the backward's key-block-owned lists
(`vsa_fa4.backward_lists_triton`), the forward's full / partial split
(`vsa_fa4.forward_lists_triton`) and the paired-key forward's packed pairs
(`vsa_fa4.paired_lists_triton`, against the fork's `pair_lists`; lists narrower than an even
number of key blocks, masked and unmasked).

On a GPU the kernels run compiled; on a CPU machine under Triton's interpreter in a child
process (the interpreter must be chosen before triton is first imported). Shapes cross every
block boundary of the kernels (backward: 32 query blocks, 16 list slots, 32 key blocks;
forward: 16 rows, 64 list slots), with empty, partial and full key blocks, empty and full
lists, a key block every query block selects, ``q_split`` 1 and 2, masked and unmasked.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from interpreter_child import assert_checked_under_interpreter

from vsa_core import BlockSparseLayout
from vsa_fa4.metadata import (
    PackedSparseLists,
    backward_lists,
    forward_lists,
    paired_forward_lists,
    unmasked_forward_lists,
)

I32 = torch.int32


def random_lists(seed: int, num_q: int, num_kv: int, width: int, kv_tile: int, heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, (num_kv,), generator=gen)  # 0 empty, 1 partial, 2 full
    sizes = torch.where(kind == 2, kv_tile, torch.randint(1, kv_tile, (num_kv,), generator=gen))
    sizes = torch.where(kind == 0, 0, sizes).to(I32)
    width = min(width, num_kv)
    order = torch.rand(1, heads, num_q, num_kv, generator=gen).argsort(-1)[..., :width]
    counts = torch.randint(0, width + 1, (1, heads, num_q), generator=gen)
    counts[..., 0] = width  # at least one full-width list
    if num_q > 2 and width:  # key block 0 first in every list: selected by all (a "sink")
        rest = 1 + torch.rand(1, heads, num_q, num_kv - 1, generator=gen).argsort(-1)
        order = torch.cat([torch.zeros_like(rest[..., :1]), rest], -1)[..., :width]
        counts = torch.clamp(counts, min=1)
    if width == 0:  # lists that can select nothing (from_indices refuses them; layouts may not)
        return order.to(I32), counts.to(I32), sizes.to(I32)
    layout = BlockSparseLayout.from_indices(
        order.sort(-1).values.to(I32),
        counts.to(I32),
        kv_valid_sizes=sizes,
        block_shape=(64, kv_tile),
    )
    return layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes


CASES = [  # (num_q, num_kv, width)
    (1, 1, 1),
    (3, 5, 2),
    (33, 31, 17),
    (64, 70, 16),
    (70, 33, 33),
    (40, 65, 5),
    (5, 8, 0),
    (9, 150, 130),  # forward: list slots past two 64-slot chunks
    (6, 10, 9),  # paired: the mask list clipped to num_kv / 2 tiles
]
CHECKS_PER_CASE = 2 * (
    4 + 1 + 2
)  # per key tile: 4 backward variants, rotated, forward split, packed
PAIRED_CHECKS = 2 * sum(1 for _, num_kv, width in CASES if width < num_kv and num_kv % 2 == 0)
"""The paired lists' checks (masked and unmasked lists, 64-token key tiles): only where the
layout can be paired."""


def assert_same_lists(want, got, where: str) -> None:
    for name, a, b in zip(want._fields, want, got, strict=True):
        assert a.dtype == b.dtype == I32, name
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differs: {where}"


def compare_on(device: str) -> int:
    """Assert the kernel's lists equal the torch path's for every case; return the count."""
    checked = 0
    for seed, (num_q, num_kv, width) in enumerate(CASES):
        for kv_tile in (64, 128):
            idx, cnt, valid = (
                x.to(device) for x in random_lists(seed, num_q, num_kv, width, kv_tile)
            )
            where = f"num_q={num_q} num_kv={num_kv} width={width} kv_tile={kv_tile}"
            for masked in (True, False):
                for q_split in (1, 2):
                    args = (idx, cnt, valid, kv_tile, masked, q_split)
                    got = backward_lists(*args, impl="triton")
                    assert_same_lists(
                        backward_lists(*args, impl="torch"), got,
                        f"backward {where} masked={masked} q_split={q_split}",
                    )  # fmt: skip
                    assert (got.full_block_idx is got.mask_block_idx) == masked
                    checked += 1
            rotated = dict(masked=True, q_split=1, rotate_sms=7)
            assert_same_lists(
                backward_lists(idx, cnt, valid, kv_tile, impl="torch", **rotated),
                backward_lists(idx, cnt, valid, kv_tile, impl="triton", **rotated),
                f"rotated backward {where}",
            )
            checked += 1
            args = (idx, cnt, valid, kv_tile)
            got = forward_lists(*args, impl="triton")
            assert_same_lists(forward_lists(*args, impl="torch"), got, f"forward {where}")
            # every listed non-empty key block lands in exactly one of the two lists
            slots = torch.arange(idx.shape[-1], device=idx.device)
            listed = (slots < cnt.unsqueeze(-1)) & (valid[idx.long()] > 0)
            assert torch.equal(got.full_block_cnt + got.mask_block_cnt, listed.sum(-1).to(I32))
            checked += 1
            checked += compare_packed(got, idx, cnt, valid, kv_tile, where)
            if kv_tile == 64 and width < num_kv and num_kv % 2 == 0:
                checked += compare_paired(idx, cnt, valid, where)
    return checked


def compare_packed(plain, idx, cnt, valid, kv_tile, where: str) -> int:
    """Forward lists with valid sizes in the partial entries: the kernel's equal the torch
    path's, and decode to ``plain`` (the same lists without sizes) and each entry's size."""
    args = (idx, cnt, valid, kv_tile)
    got = forward_lists(*args, impl="triton", pack_valid=True)
    assert isinstance(got, PackedSparseLists)
    assert_same_lists(forward_lists(*args, impl="torch", pack_valid=True), got, f"packed {where}")
    entries = got.mask_block_idx.long()
    used = torch.arange(entries.shape[-1], device=entries.device) < got.mask_block_cnt[..., None]
    blocks = entries & 0xFFFF
    assert torch.equal(blocks.to(I32), plain.mask_block_idx), f"packed blocks: {where}"
    sizes = torch.where(used, valid.long()[blocks], 0)
    assert torch.equal(entries >> 16, sizes), f"packed sizes: {where}"
    for name in ("mask_block_cnt", "full_block_cnt", "full_block_idx"):
        assert torch.equal(getattr(got, name), getattr(plain, name)), f"packed {name}: {where}"
    return 1


def compare_paired(idx, cnt, valid, where: str) -> int:
    """The paired lists of the masked and the unmasked split: kernel against `pair_lists`."""
    num_kv = valid.shape[0]
    splits = {
        "masked": forward_lists(idx, cnt, valid, 64, impl="torch"),
        "unmasked": unmasked_forward_lists(idx, cnt, num_kv),
    }
    for name, lists in splits.items():
        want = paired_forward_lists(lists, num_kv, impl="torch")
        got = paired_forward_lists(lists, num_kv, impl="triton")
        for field, a, b in zip(("mask_cnt", "mask_idx", "full_cnt", "full_idx"), want, got,
                               strict=True):  # fmt: skip
            assert a.dtype == b.dtype == I32 and a.shape == b.shape, (field, a.shape, b.shape)
            assert torch.equal(a.cpu(), b.cpu()), f"paired {field} differs: {where} {name}"
    return len(splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_lists_equal_the_torch_lists_on_the_gpu():
    assert compare_on("cuda") == len(CASES) * CHECKS_PER_CASE + PAIRED_CHECKS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_repeated_calls_launched_directly_equal_the_torch_lists_on_the_gpu():
    """From the third call of one description on, the list kernels launch through the compiled
    kernel's own launcher (`vsa_triton.launch_cache`): new lists of the same shapes, each call's
    result still the torch path's."""
    from vsa_triton import launch_cache

    for seed in range(5):
        idx, cnt, valid = (t.cuda() for t in random_lists(seed, 33, 31, 17, 64))
        for build in (backward_lists, forward_lists):
            want = build(idx, cnt, valid, 64, impl="torch")
            assert_same_lists(want, build(idx, cnt, valid, 64, impl="triton"), f"seed {seed}")
    from vsa_fa4 import backward_lists_triton, forward_lists_triton

    kernels = (backward_lists_triton._rank_selected, forward_lists_triton._split_full_partial)
    for kernel in kernels:
        assert launch_cache.launches_directly(kernel), f"{kernel.fn.__name__} never went direct"


def test_auto_picks_torch_off_cuda():
    idx, cnt, valid = random_lists(0, 4, 4, 2, 64)
    assert backward_lists(idx, cnt, valid, 64).full_block_idx.device.type == "cpu"
    assert forward_lists(idx, cnt, valid, 64).full_block_idx.device.type == "cpu"
    for build in (backward_lists, forward_lists):
        with pytest.raises(ValueError, match="impl must be"):
            build(idx, cnt, valid, 64, impl="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel runs compiled")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="already interpreting"
)
def test_kernel_lists_equal_the_torch_lists_under_the_interpreter():
    pytest.importorskip("triton")
    assert_checked_under_interpreter(__file__, len(CASES) * CHECKS_PER_CASE + PAIRED_CHECKS)


if __name__ == "__main__":
    print(f"checked {compare_on(sys.argv[1])}")

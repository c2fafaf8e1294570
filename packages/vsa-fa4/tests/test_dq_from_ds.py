"""The dS-writing backward's two host-side pieces (delta 12's dQ pass, issue 20 item 2):

- `backward_lists_with_slots`: the same key-owned lists as `backward_lists_triton`, and each
  key block's first dS slot and every used forward entry's slot (`check_slots`: the slot the
  key kernel's step that handles the pair writes, no two key blocks' runs overlapping), rotated
  lists included;
- on the CPU, `vsa_fa4.ops.backward_impl` with the dS-writing backward, its key-owned kernel
  played by `fa4_model` (dS tiles stored as the kernel stores them), against the model's
  plain backward, in one launch and in head chunks sharing one dS buffer;
- `dq_from_ds`: dQ from dS tiles laid out by those slots (each row's 16-byte chunks permuted
  as the key kernel stages them), against a float64 sum over each query block's list. The
  slots of key blocks with no valid token hold NaN and K's rows past a partial block's size
  large finite garbage: neither may reach dQ (dS past a partial block's size is zero, as the
  key kernel writes it).

On a GPU the kernels run compiled; on a CPU machine under Triton's interpreter in a child
process (the interpreter must be chosen before triton is first imported).
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch
from fa4_model import swizzled
from interpreter_child import assert_checked_under_interpreter
from test_lists_triton import random_lists

CASES = [(1, 1, 1), (3, 5, 2), (33, 31, 17), (70, 33, 33), (40, 65, 5)]  # (num_q, num_kv, width)
HEAD_DIM = 32


def check_slots(idx, cnt, valid, placed, where: str) -> None:
    """Every used forward entry (query block ``i``, key block ``j``) of a key block with valid
    tokens has slot ``starts[j] + p`` with ``q_indices[j, p] == i`` and ``p`` below the key
    block's list count (the step of the key kernel that writes it), others -1; each (batch,
    head)'s slots lie in its region of ``NQ * W``; and the key blocks' runs of slots
    ``[starts[j], starts[j] + count)``, all that the kernel writes, never overlap."""
    lists = type(placed.lists)(*(t.cpu() for t in placed.lists))
    starts, slots, idx, cnt, valid = (
        t.cpu() for t in (placed.starts, placed.slots, idx, cnt, valid)
    )
    _, heads, num_q, width = idx.shape
    counts = lists.full_block_cnt + lists.mask_block_cnt  # a key block is in one list only
    runs = []
    for h in range(heads):
        region = (h * num_q * width, (h + 1) * num_q * width)
        for j in range(valid.numel()):
            if counts[0, h, j]:
                first = int(starts[0, h, j])
                assert region[0] <= first and first + counts[0, h, j] <= region[1], where
                runs.append((first, first + int(counts[0, h, j])))
        for i in range(num_q):
            for t in range(int(cnt[0, h, i])):
                j, slot = int(idx[0, h, i, t]), int(slots[0, h, i, t])
                if valid[j] == 0:
                    assert slot == -1, f"{where}: entry ({h}, {i}, {t}) of an empty key block"
                    continue
                place = slot - int(starts[0, h, j])
                assert 0 <= place < counts[0, h, j], f"{where}: entry ({h}, {i}, {t})"
                assert int(lists.full_block_idx[0, h, j, place]) == i, where
    runs.sort()
    for (_, end), (begin, _) in itertools.pairwise(runs):
        assert end <= begin, f"{where}: key blocks' slots overlap"


def expected_dq(tiles, k, idx, cnt, valid, scale):
    """float64: dq[b, 64 i + r, h] = scale * sum_t tiles[h, i, t] @ k[b, 64 j_t + :, h]."""
    _, heads, num_q, _ = idx.shape
    dq = torch.zeros(1, num_q * 64, heads, HEAD_DIM, dtype=torch.float64)
    for h in range(heads):
        for i in range(num_q):
            for t in range(int(cnt[0, h, i])):
                j, size = int(idx[0, h, i, t]), int(valid[int(idx[0, h, i, t])])
                if size == 0:
                    continue
                keys = k[0, 64 * j : 64 * j + size, h].double()
                dq[0, 64 * i : 64 * i + 64, h] += tiles[h, i, t][:, :size].double() @ keys
    return dq * scale


def compare_on(device: str) -> int:
    from vsa_fa4.backward_lists_triton import backward_lists_triton, backward_lists_with_slots
    from vsa_fa4.dq_from_ds_triton import dq_from_ds

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    checked = 0
    for seed, (num_q, num_kv, width) in enumerate(CASES):
        idx, cnt, valid = (x.to(device) for x in random_lists(seed, num_q, num_kv, width, 64))
        for rotate in (0, 7):
            where = f"num_q={num_q} num_kv={num_kv} width={width} rotate={rotate}"
            placed = backward_lists_with_slots(idx, cnt, valid, 64, True, rotate)
            plain = backward_lists_triton(idx, cnt, valid, 64, True, 1, rotate)
            for a, b in zip(plain, placed.lists, strict=True):
                assert torch.equal(a, b), where
            check_slots(idx, cnt, valid, placed, where)
            checked += 1
        # dQ from tiles placed where the key-owned kernel would write them
        gen = torch.Generator().manual_seed(seed)
        heads, width = idx.shape[1], idx.shape[-1]
        tiles = torch.randn(heads, num_q, width, 64, 64, generator=gen).to(dtype)
        k = torch.randn(1, num_kv * 64, heads, HEAD_DIM, generator=gen).to(dtype)
        for j, size in enumerate(valid.tolist()):  # finite padding garbage: must add zero
            k[0, 64 * j + size : 64 * j + 64] = 1.0e4
        slots_of = placed.slots.cpu()
        # B * H * NQ * W tiles, the size `_backward_from_ds` allocates: a slot past it raises
        ds = torch.full((max(idx.numel(), 1) * 64, 64), float("nan"), dtype=dtype)
        for h in range(heads):
            for i in range(num_q):
                for t in range(int(cnt[0, h, i])):
                    size = int(valid[int(idx[0, h, i, t])])
                    if size == 0:
                        continue
                    slot = int(slots_of[0, h, i, t])
                    tile = tiles[h, i, t].clone()
                    tile[:, size:] = 0.0  # the key kernel's dS past a partial block's size
                    ds[64 * slot : 64 * slot + 64] = swizzled(tile)
        dq = torch.full((1, num_q * 64, heads, HEAD_DIM), 7.0, dtype=dtype, device=device)
        dq_from_ds(ds.to(device), k.to(device), dq, idx, cnt, placed.slots, 0.125)
        want = expected_dq(tiles, k, idx.cpu(), cnt.cpu(), valid.cpu(), 0.125)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        err = (dq.cpu().double() - want).abs().max().item()
        assert err <= tol * max(want.abs().max().item(), 1.0), f"dq {where}: {err}"
        checked += 1
    return checked


def check_backward_on_the_model() -> int:
    """`vsa_fa4.ops.backward_impl` with the dS-writing backward (lists with places, slots, the
    dQ pass), the key-owned kernel replaced by `fa4_model` (its dS tiles written as the kernel
    writes them), against the model's plain backward: in one launch, and in head chunks that
    share one dS buffer (a budget of two heads' tiles: chunks of 2, 2 and 1), and on lists
    without a mask (every key block full). Two batches with lists of their own, fp16, partial
    and empty key blocks, empty lists."""
    import fa4_model
    from test_lists_triton import random_lists

    from flash_attn_vsa.bwd_sm90 import KV64_DS_CONFIG
    from vsa_fa4 import launch, ops

    launch.run_forward, launch.run_backward = fa4_model.run_forward, fa4_model.run_backward
    batch, heads, num_q, num_kv, dim = 2, 5, 6, 7, 32
    idx, cnt, valid = random_lists(11, num_q, num_kv, 4, 64, heads=heads)
    other = random_lists(13, num_q, num_kv, 4, 64, heads=heads)  # the second batch's lists
    idx, cnt = torch.cat([idx, other[0]]), torch.cat([cnt, other[1]])
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(batch, num_q * 64, heads, dim, generator=gen).half()
    k, v = (torch.randn(batch, num_kv * 64, heads, dim, generator=gen).half() for _ in range(2))
    dout = torch.randn(q.shape, generator=gen).half()
    for j, size in enumerate(valid.tolist()):  # finite padding garbage
        k[:, 64 * j + size : 64 * j + 64], v[:, 64 * j + size : 64 * j + 64] = 1.0e3, -1.0e3
    tiles = batch * num_q * idx.shape[-1]
    full = torch.full_like(valid, 64)  # every key block full: the lists without a mask
    kf, vf = (torch.randn(k.shape, generator=gen).half() for _ in range(2))  # no padding
    checked = 0
    for budget, sizes, masked in ((None, valid, True), (2 * tiles * ops.DS_TILE_BYTES, valid,
                                  True), (None, full, False)):  # fmt: skip
        if not masked:
            k, v = kf, vf
        args = (idx, cnt, sizes, 0.2, 64, 64, masked)
        out, lse = ops.forward_impl(q, k, v, *args)
        want = ops.backward_impl(dout, q, k, v, out, lse, *args)
        kernels = launch.KernelChoice(backward=KV64_DS_CONFIG, ds_budget_bytes=budget).encode()
        got = ops.backward_impl(dout, q, k, v, out, lse, *args, kernels)
        for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            err = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert err <= 2e-3, f"{name}, dS budget {budget} bytes, masked {masked}: {err}"
        checked += 1
    return checked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_positions_and_dq_pass_on_the_gpu():
    assert compare_on("cuda") == 3 * len(CASES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run compiled")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="already interpreting"
)
def test_positions_and_dq_pass_under_the_interpreter():
    pytest.importorskip("triton")
    assert_checked_under_interpreter(__file__, 3 * len(CASES) + MODEL_CHECKS)


MODEL_CHECKS = 3
"""`check_backward_on_the_model`'s checks (run on the CPU only)."""

if __name__ == "__main__":
    extra = check_backward_on_the_model() if sys.argv[1] == "cpu" else 0
    print(f"checked {compare_on(sys.argv[1]) + extra}")

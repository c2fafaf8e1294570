"""Shared GPU cases of the fork's sm_90 deltas: a block-sparse pattern of 64-token key blocks
(query blocks of 64 or 128 tokens) with full, partial and empty key blocks and 0..5 selected
key blocks per query block, FA4's index tensors
for it in either direction, and a float32 reference (forward and gradients)."""

from __future__ import annotations

import torch

SEQ, HEADS, BLOCK = 1536, 3, 64


def sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def lists(rows: list[list[list[int]]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[H][R] lists of ints -> counts [1, H, R], indices [1, H, R, width] (padded with 0)."""
    counts = torch.tensor([[len(r) for r in head] for head in rows], dtype=torch.int32)
    idx = torch.zeros(len(rows), len(rows[0]), width, dtype=torch.int32)
    for h, head in enumerate(rows):
        for r, row in enumerate(head):
            idx[h, r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return counts[None].cuda(), idx[None].cuda()


def case(seed: int, q_block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: query block i selects i % 6 key blocks; key blocks cycle full / partial /
    empty (valid sizes), block 5 is selected by no query block."""
    gen = torch.Generator().manual_seed(seed)
    n = SEQ // BLOCK
    n_q = SEQ // q_block
    pattern = [BLOCK, 37, 0, BLOCK, 1, BLOCK, 63]
    valid = torch.tensor([pattern[i % len(pattern)] for i in range(n)], dtype=torch.int32)
    selected = torch.zeros(HEADS, n_q, n, dtype=torch.bool)  # [H, q block, key block]
    for h in range(HEADS):
        for i in range(n_q):
            choices = [j for j in torch.randperm(n, generator=gen).tolist() if j != 5]
            selected[h, i, choices[: i % 6]] = True
    return valid, selected


def sparse_tensors(valid: torch.Tensor, selected: torch.Tensor, backward: bool):
    """FA4's ``BlockSparseTensorsTorch`` of the case: forward (per query block, its key blocks)
    or backward (per key block, the query blocks selecting it); full and partial key blocks in
    separate lists, empty ones in neither."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    n, n_q = valid.shape[0], selected.shape[1]
    full_rows, part_rows = [], []
    for h in range(HEADS):
        if backward:
            rows = [torch.nonzero(selected[h, :, j]).flatten().tolist() for j in range(n)]
            full_rows.append([r if valid[j] == BLOCK else [] for j, r in enumerate(rows)])
            part_rows.append([r if 0 < valid[j] < BLOCK else [] for j, r in enumerate(rows)])
        else:
            rows = [torch.nonzero(selected[h, i]).flatten().tolist() for i in range(n_q)]
            full_rows.append([[j for j in r if valid[j] == BLOCK] for r in rows])
            part_rows.append([[j for j in r if 0 < valid[j] < BLOCK] for r in rows])
    width = n_q if backward else n
    full_cnt, full_idx = lists(full_rows, width)
    part_cnt, part_idx = lists(part_rows, width)
    return BlockSparseTensorsTorch(
        mask_block_cnt=part_cnt,
        mask_block_idx=part_idx,
        full_block_cnt=full_cnt,
        full_block_idx=full_idx,
        block_size=(SEQ // n_q, BLOCK),
    )


def reference(q, k, v, dout, valid, selected, scale):
    """Float32 (out [B, S, H, D], lse [B, H, S], [dq, dk, dv]) of the case."""
    keys = torch.arange(BLOCK) < valid[:, None]  # [n, BLOCK] real key tokens
    q_block = SEQ // selected.shape[1]
    pairs = selected.repeat_interleave(q_block, 1).repeat_interleave(BLOCK, 2)
    pairs &= keys.flatten()[None, None, :]
    pairs = pairs[None].cuda()  # [1, H, S, S]
    qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    s = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~pairs, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.nan_to_num(0, 0, 0)[..., None]).nan_to_num(0.0) * pairs
    out = p @ vf
    out.backward(dout.float().transpose(1, 2))
    return out.transpose(1, 2), lse, [t.grad.transpose(1, 2) for t in (qf, kf, vf)]


def inputs(head_dim: int, dtype: torch.dtype, valid: torch.Tensor):
    """q, k, v, dout [1, SEQ, HEADS, head_dim] with finite garbage in the padding of partial
    key blocks (it must stay masked)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (
        torch.randn(1, SEQ, HEADS, head_dim, device="cuda", dtype=dtype, generator=gen)
        for _ in range(4)
    )
    pad = (torch.arange(BLOCK) >= valid[:, None]).flatten().cuda()
    k[:, pad], v[:, pad] = 30.0, -30.0
    return q, k, v, dout


def packed_forward_case(seed: int, q_block: int, dtype: torch.dtype, pack, block_size):
    """A forward case at head dim 128 for a fork kernel whose lists hold packed entries:
    ``pack(split)`` turns the case's full/partial forward lists into the kernel's four list
    tensors. A namespace of q, k, v, valid (on the CPU), scale, the split lists, the kernel's
    ``tensors`` and the float32 reference ``ref_out`` and ``ref_lse``."""
    from types import SimpleNamespace

    valid, selected = case(seed=seed, q_block=q_block)
    q, k, v, dout = inputs(128, dtype, valid)
    scale = 128**-0.5
    ref_out, ref_lse, _ = reference(q, k, v, dout, valid, selected, scale)
    split = sparse_tensors(valid, selected, backward=False)
    tensors = with_lists(split, pack(split), block_size)
    return SimpleNamespace(q=q, k=k, v=v, valid=valid, scale=scale, split=split,
                           tensors=tensors, ref_out=ref_out, ref_lse=ref_lse)  # fmt: skip


def with_lists(split, packed, block_size: tuple[int, int]):
    """``split``'s FA4 tensors with ``packed`` (a fork's four list tensors, in
    ``(mask_cnt, mask_idx, full_cnt, full_idx)`` order) and the block size FA4 is to see."""
    mask_cnt, mask_idx, full_cnt, full_idx = packed
    return split._replace(
        mask_block_cnt=mask_cnt,
        mask_block_idx=mask_idx,
        full_block_cnt=full_cnt,
        full_block_idx=full_idx,
        block_size=block_size,
    )


BF16, FP16 = torch.bfloat16, torch.float16
QREGS, PERSISTENT = {"q_in_registers": True}, {"persistent": 5}
"""The experimental variants of the fork's forwards, as keyword arguments: Q in registers
(delta 5) and persistent tiles on 5 CTAs (delta 7: few CTAs, so that each walks many tiles)."""
VARIANT_CASES = [
    (BF16, {}),
    (FP16, {}),
    (BF16, QREGS),
    (BF16, PERSISTENT),
    (FP16, {**QREGS, **PERSISTENT}),
]
"""(dtype, variant) pairs a forward's GPU test runs: both dtypes plain, each variant once."""


def nan_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` like q and ``lse`` [1, H, S], NaN-filled: a kernel must write every element."""
    out = torch.full_like(q, float("nan"))
    return out, torch.full((1, HEADS, SEQ), float("nan"), device="cuda")


def assert_forward_matches(got, written, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """A forward's ``got`` (out, lse) is the preallocated ``written`` pair and matches the
    float32 reference: out within relative L2 1e-2, lse within 1e-2 where a row sees keys and
    -inf exactly where it sees none (its out 0 there)."""
    got_out, got_lse = got
    assert got_out.data_ptr() == written[0].data_ptr()
    assert got_lse.data_ptr() == written[1].data_ptr()
    assert torch.isfinite(got_out).all()
    err = ((got_out.float() - ref_out).norm() / ref_out.norm()).item()
    assert err <= 1e-2, err
    sees_keys = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(got_lse), sees_keys)
    assert (got_lse[sees_keys] - ref_lse[sees_keys]).abs().max().item() <= 1e-2
    assert bool((got_out.transpose(1, 2)[~sees_keys] == 0).all())


def small_refusal_case(num_kv: int = 4):
    """(q [1, 64 * num_kv, 2, 128] bf16 zeros, forward tensors selecting nothing, valid sizes
    on the GPU) for the argument checks, which must refuse before any launch."""
    q = torch.zeros(1, BLOCK * num_kv, 2, 128, device="cuda", dtype=torch.bfloat16)
    selected = torch.zeros(HEADS, num_kv // 2, num_kv, dtype=torch.bool)
    tensors = sparse_tensors(torch.full((num_kv,), BLOCK, dtype=torch.int32), selected, False)
    return q, tensors, torch.full((num_kv,), BLOCK, dtype=torch.int32, device="cuda")

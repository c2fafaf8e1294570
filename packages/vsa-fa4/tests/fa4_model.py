"""A float64 model of what upstream FA4's block-sparse kernels compute, for CPU tests.

It consumes exactly what `vsa_fa4.launch` hands FA4 (our `SparseLists`, the physical block
size, the valid sizes the ``mask_mod`` reads) and follows upstream's semantics as read in
``flash_attn/cute`` (4.0.0b36):

- forward: a query row of sparse block ``m`` attends to every token of each block in its
  *full* list and, for each block in its *partial* ("mask") list, to the tokens the mask_mod
  keeps (offset inside the key block < the block's valid size); no block: out 0, lse -inf;
- backward: key-block owned; for key block ``n`` the pairs are the query blocks of its full
  list (every token) and of its partial list (mask_mod applied), with P = exp(S - lse) from
  the forward's lse, dV = P^T dO, dS = P (dP - rowsum(dO O)), dQ = scale dS K,
  dK = scale dS^T Q.

Without a mask_mod (``masked=False``) the partial lists are attended like full ones (every
token). A wrong split (a partial block in the full list, an empty block kept, a missing
transpose entry, a mask_mod dropped while a block is partial) changes the result, which the
tests compare with vsa-core's reference.
"""

from __future__ import annotations

import torch

from vsa_fa4.lists import PackedSparseLists


def _keep_keys(block: int, kv_tile: int, kv_len: int, valid: torch.Tensor | None) -> torch.Tensor:
    keep = torch.zeros(kv_len, dtype=torch.bool)
    start = block * kv_tile
    stop = start + (kv_tile if valid is None else int(valid[block]))
    keep[start:stop] = True
    return keep


def forward_pairs(lists, valid, block_size, q_len, kv_len, packed=False) -> torch.Tensor:
    """[B, H, Sq, Skv] bool: the (query, key) token pairs the forward lists select
    (``packed``: partial entries ``block | valid << 16``, `vsa_fa4.lists.PackedSparseLists`)."""
    q_tile, kv_tile = block_size
    cnt_m, idx_m, cnt_f, idx_f = (t.cpu() for t in lists)
    batch, heads, rows = cnt_m.shape
    pairs = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for m in range(rows):
                q_rows = slice(m * q_tile, (m + 1) * q_tile)
                for i in range(int(cnt_f[b, h, m])):
                    pairs[b, h, q_rows] |= _keep_keys(int(idx_f[b, h, m, i]), kv_tile, kv_len, None)
                for i in range(int(cnt_m[b, h, m])):
                    entry = int(idx_m[b, h, m, i])
                    if packed:  # block | valid << 16: the kernel masks by the entry's size
                        block, size = entry & 0xFFFF, entry >> 16
                        sizes = torch.zeros(block + 1, dtype=torch.int32)
                        sizes[block] = size
                        pairs[b, h, q_rows] |= _keep_keys(block, kv_tile, kv_len, sizes)
                    else:
                        pairs[b, h, q_rows] |= _keep_keys(entry, kv_tile, kv_len, valid)
    return pairs


def paired_forward_pairs(pair_lists, valid, q_tile, kv_len) -> torch.Tensor:
    """[B, H, Sq, Skv] bool: the token pairs of the fork's paired-key forward
    (``flash_attn_vsa.fwd_sm90_paired``) as read from its kernel and mask: each entry of a row's
    lists is ``a | b << 16`` (64-token key blocks); full-list entries attend to every token of
    ``a`` and ``b``, mask-list entries to the first ``valid`` tokens of each, and a second id of
    ``NO_BLOCK`` (0x7FFF) attends to nothing."""
    cnt_m, idx_m, cnt_f, idx_f = (t.cpu() for t in pair_lists)
    batch, heads, rows = cnt_m.shape
    pairs = torch.zeros(batch, heads, rows * q_tile, kv_len, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for m in range(rows):
                q_rows = slice(m * q_tile, (m + 1) * q_tile)
                for cnt, idx, sizes in ((cnt_f, idx_f, None), (cnt_m, idx_m, valid)):
                    for i in range(int(cnt[b, h, m])):
                        packed = int(idx[b, h, m, i])
                        for block in (packed & 0xFFFF, packed >> 16):
                            if block != 0x7FFF:
                                pairs[b, h, q_rows] |= _keep_keys(block, 64, kv_len, sizes)
    return pairs


def backward_pairs(lists, valid, block_size, q_len, kv_len) -> torch.Tensor:
    """[B, H, Sq, Skv] bool: the pairs the key-block-owned backward lists select."""
    q_tile, kv_tile = block_size
    cnt_m, idx_m, cnt_f, idx_f = (t.cpu() for t in lists)
    batch, heads, rows = cnt_m.shape
    pairs = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for n in range(rows):
                for cnt, idx, mask in ((cnt_f, idx_f, None), (cnt_m, idx_m, valid)):
                    keys = _keep_keys(n, kv_tile, kv_len, mask)
                    for i in range(int(cnt[b, h, n])):
                        m = int(idx[b, h, n, i])
                        pairs[b, h, m * q_tile : (m + 1) * q_tile] |= keys
    return pairs


def _check_contiguous(lists) -> None:
    # FA4 compiles its kernels for the index tensors' strides (the first call's): hand it
    # contiguous tensors only.
    for name, t in zip(lists._fields, lists, strict=True):
        assert t.is_contiguous(), f"{name} is not contiguous"


def run_forward(
    q,
    k,
    v,
    out,
    lse,
    lists,
    kv_valid_sizes,
    scale,
    block_size,
    masked=True,
    variant=None,
    combine=None,
) -> None:
    """``vsa_fa4.launch.run_forward``'s semantics (``variant``, which kernel computes it, does
    not change them); with ``combine`` (coarse, gate) out is ``fine + gate * coarse[query
    block]`` in float64 before rounding, and lse is not written (the launch requires None)."""
    _check_contiguous(lists)
    valid = kv_valid_sizes.cpu() if masked else None
    packed = isinstance(lists, PackedSparseLists)
    assert not packed or (masked and tuple(block_size) == (64, 64)), "run_forward refuses it"
    pairs = forward_pairs(lists, valid, block_size, q.shape[1], k.shape[1], packed)
    qd, kd, vd = (t.double().permute(0, 2, 1, 3) for t in (q, k, v))  # [B, H, S, D]
    scores = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~pairs, float("-inf"))
    seen = pairs.any(-1, keepdim=True)
    row_max = torch.where(seen, scores.amax(-1, keepdim=True), 0.0)
    probs = torch.where(pairs, torch.exp(scores - row_max), 0.0)
    denom = probs.sum(-1, keepdim=True)
    result = torch.matmul(probs, vd) / torch.where(seen, denom, 1.0)
    result = result.permute(0, 2, 1, 3)  # [B, S, H, D]
    if combine is not None:
        assert lse is None and tuple(block_size) == (64, 64)
        coarse, gate = combine
        rows = coarse.double().repeat_interleave(block_size[0], dim=1)
        result = result + (rows if gate is None else gate.double() * rows)
        out.copy_(result.to(out.dtype))
        return
    out.copy_(result.to(out.dtype))
    lse.copy_(torch.where(seen, row_max + torch.log(denom), float("-inf")).squeeze(-1))


def run_backward(
    dout, q, k, v, out, lse, dq, dk, dv, lists, kv_valid_sizes, scale, block_size, masked=True,
    config=None, ds_out=None,
) -> None:  # fmt: skip
    """``vsa_fa4.launch.run_backward``'s semantics (whatever the tile ``config``); with
    ``ds_out`` (the dS buffer and slot starts of the fork's dS-writing backward, delta 12) dq
    is left as it is and each key block's list writes its dS tiles as that kernel does
    (`write_ds_tiles`)."""
    _check_contiguous(lists)
    valid = kv_valid_sizes.cpu() if masked else None
    pairs = backward_pairs(lists, valid, block_size, q.shape[1], k.shape[1])
    qd, kd, vd, od, dod = (t.double().permute(0, 2, 1, 3) for t in (q, k, v, out, dout))
    lse_d = lse.double().unsqueeze(-1)
    scores = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    probs = torch.where(pairs, torch.exp(scores - torch.where(pairs, lse_d, 0.0)), 0.0)
    d_v = torch.matmul(probs.transpose(-1, -2), dod)
    d_p = torch.matmul(dod, vd.transpose(-1, -2))
    delta = (dod * od).sum(-1, keepdim=True)
    d_s = probs * (d_p - delta)
    d_q = torch.matmul(d_s, kd) * scale
    d_k = torch.matmul(d_s.transpose(-1, -2), qd) * scale
    targets = ((dk, d_k), (dv, d_v))
    if ds_out is None:
        targets = ((dq, d_q), *targets)
    else:
        assert config is not None and config.dq_from_ds and tuple(block_size) == (64, 64)
        write_ds_tiles(d_s.to(q.dtype), lists, *ds_out)
    for dst, src in targets:
        dst.copy_(src.permute(0, 2, 1, 3).to(dst.dtype))


def write_ds_tiles(d_s, lists, ds, slot_starts) -> None:
    """The dS-writing kernel's stores: step ``u`` of key block ``n``'s list (partial list, then
    full list, as stored) writes the (query block, key block) tile of ``d_s`` [B, H, Sq, Skv]
    to slot ``slot_starts[b, h, n] + u`` of ``ds``, each row's 16-byte chunks permuted by row
    % 8 (`flash_attn_vsa.bwd_sm90_ds_out.DS_SWIZZLE`)."""
    cnt_m, idx_m, cnt_f, idx_f = (t.cpu() for t in lists)
    batch, heads, blocks = cnt_m.shape
    for b in range(batch):
        for h in range(heads):
            for n in range(blocks):
                step = int(slot_starts[b, h, n])
                for cnt, idx in ((cnt_m, idx_m), (cnt_f, idx_f)):
                    for i in range(int(cnt[b, h, n])):
                        m = int(idx[b, h, n, i])
                        tile = d_s[b, h, 64 * m : 64 * m + 64, 64 * n : 64 * n + 64]
                        ds[64 * step : 64 * step + 64] = swizzled(tile)
                        step += 1


def swizzle_columns() -> tuple[torch.Tensor, torch.Tensor]:
    """Where element (r, c) of a 64x64 dS tile lies in its slot: row r, column `cols` [r, c]."""
    rows = torch.arange(64)[:, None]
    cols = ((torch.arange(64)[None, :] // 8) ^ (rows % 8)) * 8 + torch.arange(64)[None, :] % 8
    return rows, cols


def swizzled(tile: torch.Tensor) -> torch.Tensor:
    """A 64x64 tile as the key kernel stages it: row r's 16-byte chunk c at chunk c ^ (r % 8)."""
    rows, cols = swizzle_columns()
    out = torch.empty_like(tile)
    out[rows, cols] = tile
    return out


def ds_slots(kv_indices, kv_counts, kv_valid_sizes, masked=True, rotate_sms=0):
    """`vsa_fa4.dq_from_ds_triton.ds_slots` on the CPU: the backward lists from metadata's
    torch path, each (batch, head)'s slots from its own region of its forward lists' capacity
    (as the kernel lays them out; within a region the key blocks' runs are packed here, where
    the kernel leaves room for empty key blocks' entries), and each used forward entry's slot
    found by walking its key block's list (-1 where the key block is in no list: no valid
    token)."""
    from vsa_fa4.backward_lists_triton import DsSlots
    from vsa_fa4.metadata import backward_lists

    lists = backward_lists(
        kv_indices, kv_counts, kv_valid_sizes, 64, masked, impl="torch", rotate_sms=rotate_sms
    )
    counts = lists.mask_block_cnt + lists.full_block_cnt  # a key block is in one list only
    batch, heads, blocks = counts.shape
    region = torch.arange(batch * heads).view(batch, heads, 1) * kv_indices[0, 0].numel()
    starts = (region + torch.cumsum(counts, -1) - counts).to(torch.int32)
    slots = torch.full_like(kv_indices, -1)
    for b in range(batch):
        for h in range(heads):
            for n in range(blocks):
                for u in range(int(counts[b, h, n])):
                    m = int(lists.full_block_idx[b, h, n, u])
                    used = kv_indices[b, h, m, : int(kv_counts[b, h, m])]
                    (place,) = (used == n).nonzero()[0].tolist()
                    slots[b, h, m, place] = int(starts[b, h, n]) + u
    return DsSlots(lists, starts, slots)


def dq_from_ds(ds, k, dq, kv_indices, kv_counts, slots, scale):
    """`vsa_fa4.dq_from_ds_triton.dq_from_ds` in float64 on the CPU: each query block's dQ
    from its list's dS tiles (un-swizzled) and K's key blocks, every row of K read as the
    kernel does; a query block with nothing listed gets zeros."""
    rows, cols = swizzle_columns()
    batch, heads, num_q, _ = kv_indices.shape
    for b in range(batch):
        for h in range(heads):
            for i in range(num_q):
                acc = torch.zeros(64, k.shape[-1], dtype=torch.float64)
                for t in range(int(kv_counts[b, h, i])):
                    slot, n = int(slots[b, h, i, t]), int(kv_indices[b, h, i, t])
                    if slot < 0:
                        continue
                    tile = ds[64 * slot : 64 * slot + 64][rows, cols].double()
                    acc += tile @ k[b, 64 * n : 64 * n + 64, h].double()
                dq[b, 64 * i : 64 * i + 64, h] = (acc * scale).to(dq.dtype)
    return dq

"""Independent, deliberately naive float64 implementations the vsa-core tests compare against.

Nothing here imports vsa_core: every function restates the definition with Python loops or
dense masked attention, so a test that compares vsa_core to these cannot pass by construction.
Tensors are BSHD ([batch, seq, heads, head_dim]) unless a name says otherwise.
"""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import HealthCheck, settings

# Hypothesis settings of the suite: moderate example counts, no deadline (the CI machine is small).
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- tiling ------------------------------------------------------------------------------------
def naive_tiling(latent_shape, tile_shape):
    """Tile order by the definition.

    Returns ``(raster_to_tile, members)``: ``raster_to_tile[r]`` is the tile-order slot of raster
    token ``r``, and ``members[n]`` lists the raster indices of tile ``n``'s tokens in raster
    order (tiles in raster order over the tile grid).
    """
    T, H, W = latent_shape
    tt, th, tw = tile_shape
    gh, gw = -(-H // th), -(-W // tw)
    gt = -(-T // tt)
    tile_tokens = tt * th * tw
    members = [[] for _ in range(gt * gh * gw)]
    for r, (t, h, w) in enumerate(itertools.product(range(T), range(H), range(W))):
        members[((t // tt) * gh + h // th) * gw + w // tw].append(r)
    raster_to_tile = [0] * (T * H * W)
    for n, tokens in enumerate(members):
        for rank, r in enumerate(tokens):
            raster_to_tile[r] = n * tile_tokens + rank
    return raster_to_tile, members


def naive_to_tiles(x, latent_shape, tile_shape):
    """[B, T*H*W, H, D] raster order -> [B, padded, H, D] tile order, zero padding (loops)."""
    raster_to_tile, members = naive_tiling(latent_shape, tile_shape)
    tile_tokens = math.prod(tile_shape)
    out = torch.zeros(x.shape[0], len(members) * tile_tokens, *x.shape[2:], dtype=x.dtype)
    for r, slot in enumerate(raster_to_tile):
        out[:, slot] = x[:, r]
    return out


def naive_from_tiles(x, latent_shape, tile_shape):
    raster_to_tile, _ = naive_tiling(latent_shape, tile_shape)
    return torch.stack([x[:, slot] for slot in raster_to_tile], dim=1)


# ---- masks and attention ---------------------------------------------------------------------
def random_block_mask(gen, batch, heads, num_q, num_kv, p=0.5):
    return torch.rand(batch, heads, num_q, num_kv, generator=gen) < p


def token_mask(block_mask, valid_sizes, q_block, kv_block):
    """[B, H, NQ, NKV] block map -> [B, H, NQ*qb, NKV*kvb] token map (real keys only), by loops."""
    batch, heads, num_q, num_kv = block_mask.shape
    valid = [int(s) for s in valid_sizes]
    mask = torch.zeros(batch, heads, num_q * q_block, num_kv * kv_block, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(batch), range(heads), range(num_q), range(num_kv)):
        if block_mask[b, h, i, j]:
            mask[b, h, i * q_block : (i + 1) * q_block, j * kv_block : j * kv_block + valid[j]] = (
                True
            )
    return mask


def dense_attention(q, k, v, scale):
    """Plain softmax attention in float64: (out [B, Sq, H, D], lse [B, H, Sq])."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), torch.logsumexp(scores, dim=-1)


def masked_attention(q, k, v, mask, scale):
    """Softmax attention over the keys ``mask`` [B, H, Sq, Skv] allows, in float64.

    Rows that allow no key give out 0 and lse -inf (and no NaN in gradients).
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    seen = mask.any(dim=-1, keepdim=True)
    filled = torch.where(mask, scores, torch.full_like(scores, -math.inf))
    filled = torch.where(seen, filled, torch.zeros_like(scores))  # keep softmax finite
    probs = torch.softmax(filled, dim=-1) * seen
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    lse = torch.where(
        seen.squeeze(-1),
        torch.logsumexp(filled, dim=-1),
        torch.full(seen.shape[:-1], -math.inf, dtype=torch.float64),
    )
    return out, lse


# ---- coarse stage ------------------------------------------------------------------------------
def naive_pool(x, valid_sizes):
    """Mean over each tile's real tokens, [B, N*T, H, D] -> [B, N, H, D] (0 for empty tiles)."""
    num_tiles = len(valid_sizes)
    tile_tokens = x.shape[1] // num_tiles
    tiles = []
    for n, size in enumerate(int(s) for s in valid_sizes):
        start = n * tile_tokens
        if size == 0:
            tiles.append(torch.zeros_like(x[:, 0]))
        else:
            tiles.append(x[:, start : start + size].mean(dim=1))
    return torch.stack(tiles, dim=1)


def naive_coarse_attention(qp, kp, vp, valid_sizes, scale):
    """Dense attention between pooled tiles with empty key tiles masked (float64)."""
    key_real = torch.tensor([int(s) > 0 for s in valid_sizes])
    mask = key_real.view(1, 1, 1, -1).expand(qp.shape[0], qp.shape[2], qp.shape[1], -1)
    return masked_attention(qp, kp, vp, mask, scale)[0]


def naive_topk_mask(qp, kp, valid_sizes, topk):
    """Top-k key tiles per (b, h, query tile) by float64 pooled score, empty tiles last.

    Returns ``(block_mask [B, H, N, N] bool, margin)``, ``margin`` the smallest gap between the
    k-th and (k+1)-th score over all rows (inf where no (k+1)-th finite score exists): a
    test needs it well above float32 rounding for the selection to be unambiguous. Rows of
    empty query tiles are left out of the margin (their scores all tie).
    """
    batch, num_tiles, heads, _ = qp.shape
    scores = torch.einsum("bnhd,bmhd->bhnm", qp.double(), kp.double())
    empty = torch.tensor([int(s) == 0 for s in valid_sizes])
    scores = scores.masked_fill(empty, -math.inf)
    block_mask = torch.zeros(batch, heads, num_tiles, num_tiles, dtype=torch.bool)
    margin = math.inf
    for b, h, i in itertools.product(range(batch), range(heads), range(num_tiles)):
        row = [float(s) for s in scores[b, h, i]]
        order = sorted(range(num_tiles), key=lambda j, row=row: -row[j])
        for j in order[:topk]:
            block_mask[b, h, i, j] = True
        # An empty query tile pools to 0 and ties every key: its selection is not defined.
        if int(valid_sizes[i]) > 0 and topk < num_tiles and math.isfinite(row[order[topk]]):
            margin = min(margin, row[order[topk - 1]] - row[order[topk]])
    return block_mask, margin


def naive_vsa(q, k, v, valid_sizes, topk, scale, gate=None):
    """End-to-end VSA on tile-order BSHD tensors in float64 (differentiable w.r.t. q, k, v, gate).

    Returns ``(out, block_mask, margin)``.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    num_tiles = len(valid_sizes)
    tile_tokens = q.shape[1] // num_tiles
    qp, kp, vp = (naive_pool(t, valid_sizes) for t in (q, k, v))
    coarse = naive_coarse_attention(qp, kp, vp, valid_sizes, scale)
    block_mask, margin = naive_topk_mask(qp.detach(), kp.detach(), valid_sizes, topk)
    mask = token_mask(block_mask, valid_sizes, tile_tokens, tile_tokens)
    fine, _ = masked_attention(q, k, v, mask, scale)
    coarse_tokens = coarse.repeat_interleave(tile_tokens, dim=1)
    if gate is None:
        return fine + coarse_tokens, block_mask, margin
    return fine + gate.to(torch.float64) * coarse_tokens, block_mask, margin

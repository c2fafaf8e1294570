"""The coarse stage of VSA: pool each tile to one token, attend at tile resolution, pick top-k.

All functions take BSHD tensors in tile order ([B, N * tile_tokens, H, D], see
`vsa_core.tiling`). Padding slots may hold anything (after a linear layer they are no longer
zero): pooling weighs only each tile's real tokens, and empty tiles (valid size 0) are masked out
of the coarse attention and never win a top-k slot unless k exceeds the non-empty tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vsa_core.layout import BlockSparseLayout

# Scores of the top-k selection are computed a group of heads at a time, within this budget.
SELECTION_CHUNK_BYTES = 16 * 2**20


def pool_tiles(x: torch.Tensor, valid_sizes: torch.Tensor) -> torch.Tensor:
    """Mean over each tile's real tokens: [B, N*T, H, D] -> [B, N, H, D] (differentiable).

    A tile with no real token pools to 0.
    """
    batch, seq, heads, dim = x.shape
    num_tiles = valid_sizes.shape[0]
    tile_tokens = seq // num_tiles
    slots = torch.arange(tile_tokens, device=x.device)
    sizes = valid_sizes.to(device=x.device)
    weights = (slots < sizes.unsqueeze(-1)).to(x.dtype) / sizes.clamp(min=1).unsqueeze(-1).to(
        x.dtype
    )
    # One small matmul per tile, on a view of x in its own memory order (no masked copy).
    if not x.is_contiguous() and x.transpose(1, 2).is_contiguous():  # a BHSD tensor
        x_tiles = x.transpose(1, 2).view(batch, heads, num_tiles, tile_tokens, dim)
        pooled = torch.matmul(weights.unsqueeze(1), x_tiles)  # [B, H, N, 1, D]
        return pooled.squeeze(3).transpose(1, 2)
    x_tiles = x.reshape(batch, num_tiles, tile_tokens, heads * dim)
    pooled = torch.matmul(weights.unsqueeze(1), x_tiles)  # [B, N, 1, H*D]
    return pooled.view(batch, num_tiles, heads, dim)


def coarse_attention(
    q_pooled: torch.Tensor,
    k_pooled: torch.Tensor,
    v_pooled: torch.Tensor,
    valid_sizes: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dense attention between pooled tiles, empty key tiles masked -> [B, N, H, D].

    Differentiable; its output is the coarse branch of VSA at tile resolution.
    """
    key_mask = (valid_sizes > 0).to(q_pooled.device).view(1, 1, 1, -1)
    out = F.scaled_dot_product_attention(
        q_pooled.transpose(1, 2),
        k_pooled.transpose(1, 2),
        v_pooled.transpose(1, 2),
        attn_mask=key_mask,
        scale=scale,
    )
    return out.transpose(1, 2)


@torch.no_grad()
def select_topk(
    q_pooled: torch.Tensor,
    k_pooled: torch.Tensor,
    valid_sizes: torch.Tensor,
    topk: int,
    tile_tokens: int,
    *,
    all_full: bool = False,
) -> BlockSparseLayout:
    """Top-k key tiles per (batch, head, query tile) by coarse score, as a layout.

    The layout comes straight from the ``topk`` indices (no boolean map), with block shape
    (tile_tokens, tile_tokens). Scores are built a group of heads at a time, so their memory
    stays under ``SELECTION_CHUNK_BYTES`` beyond the [B, H, N, k] result. ``all_full=True``
    states that no tile is partial (a tiling without padding), recorded in the layout's
    ``kv_blocks_full`` so kernels can skip key masking.
    """
    batch, num_tiles, heads, _ = q_pooled.shape
    empty = (valid_sizes == 0).to(q_pooled.device)
    per_head = batch * num_tiles * num_tiles * 4
    group = max(1, min(heads, SELECTION_CHUNK_BYTES // max(per_head, 1)))
    picks = []
    for start in range(0, heads, group):
        stop = min(start + group, heads)
        qh = q_pooled[:, :, start:stop].transpose(1, 2).float()
        kh = k_pooled[:, :, start:stop].transpose(1, 2).float()
        scores = torch.matmul(qh, kh.transpose(-1, -2))  # the scale does not change the order
        scores.masked_fill_(empty, float("-inf"))
        picks.append(torch.topk(scores, topk, dim=-1, sorted=False).indices)
    indices = torch.cat(picks, dim=1)
    block_shape = (tile_tokens, tile_tokens)
    return BlockSparseLayout.from_topk(indices, valid_sizes, block_shape, all_full=all_full)

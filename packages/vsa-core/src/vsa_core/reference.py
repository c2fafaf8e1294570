"""Pure-PyTorch block-sparse attention: the ground truth of every test and the CPU backend.

Queries are processed a chunk of query blocks at a time: the selected key/value blocks of the
chunk are gathered, masked (unused list slots, padding past each block's valid size) and
attended to in float32 (float64 for float64 inputs). With autograd on, every chunk is
checkpointed, so neither forward nor backward ever holds more than one chunk's scores: memory
stays bounded by ``chunk_bytes`` whatever the sequence length.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from vsa_core.layout import BlockSparseLayout

DEFAULT_CHUNK_BYTES = 256 * 2**20


def reference_block_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockSparseLayout,
    scale: float,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention on BSHD tensors; returns (out [B, Sq, H, D], lse [B, H, Sq]).

    ``lse`` is float32 (float64 for float64 inputs). Rows that see no real key (no selected
    block, or only empty ones) get out = 0 and lse = -inf, with zero gradients. Shapes are
    assumed checked (see `vsa_core.ops`).
    """
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, q_len, heads, dim = q.shape
    # Per query block a chunk holds the gathered K/V blocks (input dtype and compute dtype
    # copies) and the scores, probabilities and mask of [qb, W * kvb] per head.
    gathered = 2 * dim * (q.element_size() + torch.finfo(compute_dtype).bits // 8)
    per_q_block = batch * heads * layout.width * layout.kv_block * (gathered + 13 * layout.q_block)
    chunk = max(1, min(layout.num_q_blocks, chunk_bytes // max(per_q_block, 1)))
    # [B, H, NKV, kvb, D] views of the keys/values (no copy; cast per chunk after the gather).
    kb, vb = _blocked(k, layout.kv_block), _blocked(v, layout.kv_block)
    use_checkpoint = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # Chunks are written into preallocated results: no list of chunks plus a concatenated copy.
    out = q.new_empty(batch, q_len, heads, dim)
    lse = torch.empty(batch, heads, q_len, dtype=compute_dtype, device=q.device)
    for start in range(0, layout.num_q_blocks, chunk):
        stop = min(start + chunk, layout.num_q_blocks)
        rows = slice(start * layout.q_block, stop * layout.q_block)
        args = (
            q[:, rows],
            kb,
            vb,
            layout.kv_indices[:, :, start:stop],
            layout.kv_counts[:, :, start:stop],
            layout.kv_valid_sizes,
            scale,
            compute_dtype,
        )
        if use_checkpoint:
            out_chunk, lse_chunk = checkpoint(_attend_chunk, *args, use_reentrant=False)
        else:
            out_chunk, lse_chunk = _attend_chunk(*args)
        out[:, rows] = out_chunk
        lse[:, :, rows] = lse_chunk
    return out, lse


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.unflatten(1, (x.shape[1] // block, block)).permute(0, 3, 1, 2, 4)


def _attend_chunk(
    q: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, _, kv_block, dim = kb.shape
    n_q, width = kv_indices.shape[2], kv_indices.shape[3]
    q_block = q.shape[1] // n_q
    # [B, H, n_q, qb, D]
    qc = q.to(compute_dtype).unflatten(1, (n_q, q_block)).permute(0, 3, 1, 2, 4)
    idx = kv_indices.long()
    flat = idx.reshape(batch, heads, n_q * width, 1, 1).expand(-1, -1, -1, kv_block, dim)
    # Gathered key/value blocks: [B, H, n_q, W * kvb, D]
    k_sel = torch.gather(kb, 2, flat).to(compute_dtype).view(batch, heads, n_q, -1, dim)
    v_sel = torch.gather(vb, 2, flat).to(compute_dtype).view(batch, heads, n_q, -1, dim)

    slot_used = torch.arange(width, device=q.device) < kv_counts.unsqueeze(-1)
    token_real = torch.arange(kv_block, device=q.device) < kv_valid_sizes[idx].unsqueeze(-1)
    keep = (slot_used.unsqueeze(-1) & token_real).view(batch, heads, n_q, 1, width * kv_block)
    # Padding slots may hold anything, even NaN (torch.empty): zero them, since 0 * NaN = NaN.
    keep_rows = keep.transpose(-1, -2)
    k_sel = torch.where(keep_rows, k_sel, 0.0)
    v_sel = torch.where(keep_rows, v_sel, 0.0)

    scores = torch.matmul(qc, k_sel.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    # Row max is a shift only (out and lse do not depend on it): no gradient through it.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    seen = denom > 0
    safe_denom = torch.where(seen, denom, torch.ones_like(denom))
    out = torch.matmul(probs, v_sel) / safe_denom
    lse = torch.where(seen, row_max + torch.log(safe_denom), float("-inf"))
    # Back to [B, n_q*qb, H, D] and [B, H, n_q*qb]
    out = out.permute(0, 2, 3, 1, 4).reshape(batch, n_q * q_block, heads, dim)
    lse = lse.reshape(batch, heads, n_q * q_block)
    return out, lse

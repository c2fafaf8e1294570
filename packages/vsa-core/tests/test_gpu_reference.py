"""The reference backend on a CUDA device in bf16, against float64 masked attention on the CPU.

Skipped cleanly where no CUDA device is present (the CI machine).
"""

from __future__ import annotations

import pytest
import torch
from vsa_naive import (
    masked_attention,
    naive_from_tiles,
    naive_pool,
    naive_tiling,
    naive_to_tiles,
    naive_topk_mask,
    naive_vsa,
    random_block_mask,
    token_mask,
)

from vsa_core import BlockSparseLayout, VideoTiling, block_sparse_attn, video_sparse_attn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel_l2(got, want):
    return float((got.double().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
def test_reference_cuda_bf16_matches_float64(fmt):
    gen = torch.Generator().manual_seed(0)
    batch, heads, dim, block, num_blocks = 1, 4, 64, 64, 24
    seq = block * num_blocks
    q, k, v = (
        torch.randn(batch, seq, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3)
    )
    valid = torch.randint(1, block + 1, (num_blocks,), generator=gen)
    valid[::3] = block
    block_mask = random_block_mask(gen, batch, heads, num_blocks, num_blocks, 0.3)
    block_mask[..., 0] = True  # every row sees a key
    layout = BlockSparseLayout.from_block_mask(block_mask, valid, (block, block)).to("cuda")
    # The float64 truth is computed from the bf16-rounded inputs.
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    want_out, want_lse = masked_attention(
        q16, k16, v16, token_mask(block_mask, valid, block, block), dim**-0.5
    )
    inputs = [t.cuda() for t in (q16, k16, v16)]
    if fmt == "bhsd":
        inputs = [t.transpose(1, 2).contiguous() for t in inputs]
    out, lse = block_sparse_attn(*inputs, layout, backend="reference", qkv_format=fmt)
    assert out.is_cuda and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    if fmt == "bhsd":
        out = out.transpose(1, 2)
    assert _rel_l2(out, want_out) <= 1e-2
    assert _rel_l2(lse, want_lse) <= 1e-3


def test_video_sparse_attn_cuda_float32_matches_naive_float64():
    """End to end on CUDA in float32 (raster order, partial tiles) against the naive float64
    implementation, on inputs whose top-k selection is unambiguous at float32 precision."""
    latent, tile, heads, dim, topk = (7, 14, 16), (4, 4, 4), 2, 64, 8
    tiling = VideoTiling(latent, tile)
    valid = torch.tensor([len(m) for m in naive_tiling(latent, tile)[1]])
    for seed in range(100):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (
            torch.randn(1, tiling.seq_len, heads, dim, generator=gen, dtype=torch.float64)
            for _ in range(3)
        )
        q_t, k_t, v_t = (naive_to_tiles(t, latent, tile) for t in (q, k, v))
        _, margin = naive_topk_mask(naive_pool(q_t, valid), naive_pool(k_t, valid), valid, topk)
        if margin > 1e-5:
            break
    else:  # pragma: no cover
        pytest.fail("no seed gave an unambiguous top-k selection")
    gate = torch.randn(1, tiling.seq_len, heads, 1, generator=gen, dtype=torch.float64)
    want_t, _, _ = naive_vsa(
        q_t, k_t, v_t, valid, topk, dim**-0.5, naive_to_tiles(gate, latent, tile)
    )
    want = naive_from_tiles(want_t, latent, tile)
    out = video_sparse_attn(
        *(t.float().cuda() for t in (q, k, v)),
        topk=topk,
        tiling=tiling,
        coarse_gate=gate.float().cuda(),
        token_order="raster",
    )
    assert out.is_cuda and out.dtype == torch.float32 and out.shape == q.shape
    assert _rel_l2(out, want) <= 1e-4

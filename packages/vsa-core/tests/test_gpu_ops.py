"""The public op on a CUDA device: bf16 accuracy and no host synchronization."""

from __future__ import annotations

import pytest
import torch

from vsa_core import VideoTiling, block_sparse_attn, video_sparse_attn
from vsa_core.coarse import pool_tiles, select_topk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _inputs(tiling: VideoTiling, heads: int, dim: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, tiling.padded_len, heads, dim)
    return [
        torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4)
    ]


def test_video_sparse_attn_makes_no_host_sync():
    tiling = VideoTiling((9, 22, 30))
    q, k, v, gate = _inputs(tiling, 4, 64)
    video_sparse_attn(q, k, v, tiling=tiling, topk=8, coarse_gate=gate)  # warm caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            video_sparse_attn(q, k, v, tiling=tiling, topk=8, coarse_gate=gate)
        for t in (q, k, v, gate):
            t.requires_grad_(True)
        out = video_sparse_attn(q, k, v, tiling=tiling, topk=8, coarse_gate=gate)
        layout = select_topk(
            pool_tiles(q, tiling.valid_sizes("cuda")),
            pool_tiles(k, tiling.valid_sizes("cuda")),
            tiling.valid_sizes("cuda"),
            8,
            tiling.tile_tokens,
        )
        _ = layout.kv_to_q  # the transpose for backward is sync-free too
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, gate))


def test_fine_attention_bf16_on_cuda_matches_float64():
    tiling = VideoTiling((12, 32, 32))  # 192 tiles, 24 selected per query tile
    q, k, v, _ = _inputs(tiling, 8, 128)
    valid = tiling.valid_sizes("cuda")
    layout = select_topk(pool_tiles(q, valid), pool_tiles(k, valid), valid, 24, tiling.tile_tokens)
    out, lse = block_sparse_attn(q, k, v, layout, backend="reference")
    ref, ref_lse = block_sparse_attn(*(t.double() for t in (q, k, v)), layout, backend="reference")
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel <= 1e-2
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3)

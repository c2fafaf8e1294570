"""The Triton backend on a CUDA GPU: realistic sizes in bf16, torch.compile, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from vsa_core import BlockSparseLayout, block_sparse_attn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def exact256_layout(seq: int, heads: int, keep: float, seed: int) -> BlockSparseLayout:
    """A random 256-granular layout (diagonal anchor + random rest), as the benchmarks use."""
    gen = torch.Generator().manual_seed(seed)
    n = seq // 256
    mask = torch.rand(1, heads, n, n, generator=gen) < keep
    mask |= torch.eye(n, dtype=torch.bool)
    valid = torch.full((n,), 256)
    valid[-1] = 200  # one partial block at the end
    return BlockSparseLayout.from_block_mask(mask, valid, (256, 256)).to("cuda")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("block_shape", [(64, 64), (128, 64), (128, 128)])
def test_realistic_size_bf16_forward_backward(block_shape):
    heads, dim = 12, 128
    layout = exact256_layout(32768, heads, keep=0.1, seed=0).refine(block_shape)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(
            1,
            32768,
            heads,
            dim,
            device="cuda",
            generator=gen,
            dtype=torch.bfloat16,
            requires_grad=True,
        )
        for _ in range(3)
    )
    out, lse = block_sparse_attn(q, k, v, layout, backend="triton")
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = block_sparse_attn(q32, k32, v32, layout, backend="reference")
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    assert _rel(out, ref) <= 1e-2
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert _rel(got, want) <= 1e-2, name
    assert torch.allclose(lse, ref_lse, atol=1e-2)


def _small_case(seed=0):
    layout = exact256_layout(2048, 4, keep=0.3, seed=seed).refine((64, 64))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(1, 2048, 4, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(3)
    )
    return layout, q, k, v


def test_torch_compile_fullgraph_forward_and_backward():
    from vsa_triton.ops import block_sparse_fwd

    layout, q, k, v = _small_case()

    def attention_layer(q, k, v, kv_indices, kv_counts, kv_valid_sizes):
        out, _ = block_sparse_fwd(
            q * 1.0, k, v, kv_indices, kv_counts, kv_valid_sizes, 128**-0.5, 64, 64
        )
        return (out.float() ** 2).sum()

    compiled = torch.compile(attention_layer, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss = compiled(*leaves, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes)
    loss.backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_layer(*eager, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes).backward()
    for got, want in zip(leaves, eager, strict=True):
        assert torch.allclose(got.grad.float(), want.grad.float(), atol=1e-2, rtol=1e-2)


def test_cuda_graph_replay_with_changing_inputs():
    layout, q, k, v = _small_case()
    static = [t.clone().requires_grad_() for t in (q, k, v)]
    static_grad = torch.randn_like(q)

    def step():
        out, _ = block_sparse_attn(*static, layout, backend="triton")
        return out, torch.autograd.grad(out, static, static_grad)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compile kernels, allocate caches, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_grads = step()

    for seed in (1, 2):
        layout_new, q2, k2, v2 = _small_case(seed)
        with torch.no_grad():
            for dst, src in zip(static, (q2, k2, v2), strict=True):
                dst.copy_(src)
            layout.kv_indices.copy_(layout_new.kv_indices)
            layout.kv_counts.copy_(layout_new.kv_counts)
        graph.replay()
        eager_out, eager_grads = step()
        assert torch.equal(graph_out, eager_out)
        for got, want in zip(graph_grads, eager_grads, strict=True):
            assert torch.equal(got, want)


def test_coarse_ops_pass_torch_library_opcheck():
    from vsa_core import VideoTiling
    from vsa_triton.coarse import (
        combine_op,
        pool_clean_op,
        pool_qkv,
        select_attend_op,
        select_op,
        select_split_op,
    )

    tiling = VideoTiling((5, 6, 7), (2, 2, 2))
    valid = tiling.valid_sizes("cuda")
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (
        torch.randn(2, tiling.padded_len, 2, 32, device="cuda", generator=gen)
        .to(torch.bfloat16)
        .requires_grad_()
        for _ in range(3)
    )
    torch.library.opcheck(pool_clean_op, (q, k, v, valid, True, False, True))
    torch.library.opcheck(pool_clean_op, (q, k, v, valid, False, False, False))
    qp, kp, vp = pool_qkv(q.detach(), k.detach(), v.detach(), valid)
    torch.library.opcheck(select_op, (qp, kp, valid, 5))
    torch.library.opcheck(select_split_op, (qp, kp, valid, 5, 8))
    torch.library.opcheck(select_attend_op, (qp, kp, vp, valid, 5, 0.2, 8))
    torch.library.opcheck(select_attend_op, (qp, kp, vp, valid, 5, 0.2, 0))
    coarse = vp.detach().clone().requires_grad_()
    torch.library.opcheck(combine_op, (q, coarse, k, valid, True))
    torch.library.opcheck(combine_op, (q, coarse, None, valid, False))


def test_direct_launches_compute_what_tritons_launches_do():
    """`vsa_triton.launch_cache`: the pooling kernel, called past its attempts on
    fresh inputs (launched through the compiled kernel's launcher), and on a misaligned view
    (a new description: Triton's launch), gives the float64 tile means every time."""
    from vsa_triton import launch_cache
    from vsa_triton.coarse import _kernels, _pool_clean

    gen = torch.Generator(device="cuda").manual_seed(3)
    valid = torch.tensor([64, 17, 64, 1], dtype=torch.int32, device="cuda")
    for step in range(6):
        base = torch.randn(4 * 64 * 2 * 64 + 8, device="cuda", dtype=torch.bfloat16,
                           generator=gen)  # fmt: skip
        offset = 1 if step == 5 else 0  # 2 bytes past: not 16-byte aligned
        q, k, v = (base[offset : offset + 4 * 64 * 2 * 64].view(1, 256, 2, 64) for _ in "qkv")
        pooled = _pool_clean(q, k, v, valid, False, False, True)
        for got, x in zip(pooled[:3], (q, k, v), strict=True):
            tiles = x.double().view(1, 4, 64, 2, 64)
            want = torch.stack(
                [tiles[:, t, : int(n)].mean(1) for t, n in enumerate(valid.tolist())], 1
            )
            torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
        clean = pooled[5].view(1, 4, 64, 2, 64)
        assert torch.equal(clean[:, 1, 17:], torch.zeros_like(clean[:, 1, 17:]))
    assert launch_cache.launches_directly(_kernels().pool_fwd_kernel)

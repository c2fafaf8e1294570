"""Host-side decisions cached per call description (`vsa_core.host_cache`), and the whole op
traced by torch.compile in one graph (which needs those decisions to be constants)."""

from __future__ import annotations

import pytest
import torch

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core.host_cache import resolved_once


def test_resolved_once_computes_once_per_arguments_and_does_not_cache_errors():
    calls = []

    @resolved_once
    def decide(name, size):
        calls.append((name, size))
        if size < 0:
            raise ValueError("size must be >= 0")
        return {"name": name, "size": size}

    first = decide("a", 1)
    assert decide("a", 1) is first and decide("a", 2) is not first
    assert calls == [("a", 1), ("a", 2)]
    for _ in range(2):
        with pytest.raises(ValueError, match="size"):
            decide("a", -1)
    assert calls.count(("a", -1)) == 2


def test_a_bounded_cache_keeps_the_newest_results():
    calls = []

    @resolved_once(maxsize=2)
    def build(n):
        calls.append(n)
        return [n]

    first = build(1)
    build(2)
    assert build(1) is first and calls == [1, 2]
    build(3)  # evicts 1, the oldest
    assert build(2) == [2] and calls == [1, 2, 3]
    assert build(1) is not first and calls == [1, 2, 3, 1]


def test_the_whole_op_compiles_into_one_graph_with_the_same_values_and_gradients():
    # a shape, head dim and dtype no other test uses, so that no decision is cached yet: the
    # trace itself must make them (dynamo would otherwise trace entry-point discovery)
    tiling = VideoTiling((5, 5, 7), (2, 2, 2))
    gen = torch.Generator().manual_seed(0)
    shape = (1, tiling.padded_len, 2, 24)
    leaves = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    gate = torch.rand(shape, generator=gen, dtype=torch.float64)

    def layer(q, k, v):
        out = video_sparse_attn(q, k, v, tiling=tiling, topk=3, coarse_gate=gate)
        return (out * out).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    eager_inputs = [t.clone().requires_grad_() for t in leaves]
    traced_inputs = [t.clone().requires_grad_() for t in leaves]
    traced = compiled(*traced_inputs)  # first: nothing cached yet
    eager = layer(*eager_inputs)
    eager.backward()
    traced.backward()
    torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)
    for got, want in zip(traced_inputs, eager_inputs, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)

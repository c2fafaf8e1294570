"""``deterministic=True`` on the Triton backend and coarse stage.

Two kinds of check:

- A source audit (runs everywhere): no kernel of vsa-triton uses an atomic operation, the
  order-dependent reduction a GPU would run in a different order each time. The Triton
  interpreter runs a grid's programs one after another, so a rerun on the CPU cannot see one;
  this audit can.
- Reruns: the public ops with ``deterministic=True`` on the ``triton`` backend and coarse stage,
  twice, bitwise equal (out, lse and every gradient). Compiled on a GPU; without one in a child
  process under ``TRITON_INTERPRET=1`` (float16: the interpreter's bf16 dot is wrong), started
  by test_interpreter.py with the other kernel tests (conftest.py says why a child).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

import vsa_triton
from vsa_core import BlockSparseLayout, VideoTiling, block_sparse_attn, video_sparse_attn
from vsa_core.backends import AttentionCall, select_backend

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
RUNS_KERNELS = INTERPRETING or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the installed package's own files (a wheel's as much as the workspace's editable install)
SOURCES = Path(vsa_triton.__file__).resolve().parent


# ---- the source audit -----------------------------------------------------------------------
def atomic_calls(source: str) -> list[str]:
    """Every call of an atomic operation in ``source`` (``tl.atomic_add``, ``atomic_cas``, ...,
    however the module is named), as ``name:line``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.startswith("atomic_"):
                found.append(f"{name}:{node.lineno}")
    return found


def test_audit_finds_an_atomic_reduction():
    source = "import triton.language as tl\n\ndef k(p, x):\n    tl.atomic_add(p, x)\n"
    assert atomic_calls(source) == ["atomic_add:4"]
    assert atomic_calls("def k(p):\n    return p + 1\n") == []


def test_no_vsa_triton_kernel_uses_atomics():
    files = sorted(SOURCES.glob("*.py"))
    assert {"kernels.py", "coarse_kernels.py"} <= {f.name for f in files}
    found = {f.name: atomic_calls(f.read_text()) for f in files}
    assert not any(found.values()), f"atomics break deterministic=True: {found}"


# ---- reruns ---------------------------------------------------------------------------------
def _layout(block_shape, n_q, n_kv, seed, heads=2):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, heads, n_q, n_kv, generator=gen) < 0.6
    mask[..., 0] = True
    valid = torch.full((n_kv,), block_shape[1])
    valid[-1] = block_shape[1] // 3  # a partial key block
    return BlockSparseLayout.from_block_mask(mask, valid, block_shape).to(DEVICE)


def _leaves(*shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=gen).to(DEVICE, torch.float16).requires_grad_() for s in shapes
    ]


if RUNS_KERNELS:

    @pytest.mark.parametrize("block_shape", [(64, 64), (128, 64)])
    def test_block_sparse_attn_reruns_bitwise_equal(block_shape):
        layout = _layout(block_shape, 3, 5, seed=0)
        q, k, v = _leaves(
            *[(1, n, 2, 64) for n in (layout.q_len, layout.kv_len, layout.kv_len)], seed=1
        )
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q)

        def run():
            out, lse = block_sparse_attn(q, k, v, layout, backend="triton", deterministic=True)
            return [out, lse, *torch.autograd.grad(out, (q, k, v), dout)]

        for a, b in zip(run(), run(), strict=True):
            assert torch.equal(a, b)

    def test_auto_takes_triton_for_deterministic_training():
        """Where fa4 does not train deterministically (not installed, or blocks other than
        64x64 on sm_90: vsa-core's test_deterministic_gpu covers fa4's side)."""
        call = AttentionCall(
            torch.device(DEVICE), torch.float16, 64, (128, 128), True, deterministic=True
        )
        assert select_backend(call, "auto").name == "triton"

    @pytest.mark.parametrize("gate", ["token", "head"])
    def test_video_sparse_attn_reruns_bitwise_equal(gate):
        tiling = VideoTiling((5, 6, 7), tile_shape=(4, 4, 4))  # partial tiles on every side
        shape = (1, tiling.padded_len, 2, 64)
        gate_shape = shape if gate == "token" else (1, 1, 2, 1)
        q, k, v, g = _leaves(shape, shape, shape, gate_shape, seed=3)
        dout = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(q)

        def run():
            out = video_sparse_attn(
                q, k, v, tiling=tiling, topk=3, coarse_gate=g, backend="triton",
                coarse_backend="triton", deterministic=True,
            )  # fmt: skip
            return [out, *torch.autograd.grad(out, (q, k, v, g), dout)]

        first, second = run(), run()
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b)
        assert all(t.abs().sum() > 0 for t in first)  # every gradient reached

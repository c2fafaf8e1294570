"""A pytest plugin that breaks the fast backends on purpose, to check that a GPU test fails when
the thing it names is wrong (the project's rule: check each test once by breaking the thing).

It shadows the registered ``fa4`` and ``triton`` backends (`vsa_core.backends.register_backend`)
with copies whose forward output is 5% off (``BREAK=fwd``) or whose v gradient is 30% off
(``BREAK=bwd``). From the repository root, on the GPU host::

    BREAK=fwd python3 -m pytest -p research.break_backends \\
        packages/vsa-core/tests/test_integration_diffusers_gpu.py   # expect failures

Session 15 found with it that the diffusers dense check compared only the model's output, where
a 5% attention error arrives as 0.14% (`benchmarks/results/README.md`, session 15 rows).
"""

from __future__ import annotations

import copy
import os

import torch

FORWARD_ERROR = 1.05
GRADIENT_ERROR = 1.3


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * GRADIENT_ERROR


def broken_copy(backend, mode: str):
    """A copy of ``backend`` whose forward is wrong in the way ``mode`` names."""
    if mode not in ("fwd", "bwd"):
        raise ValueError(f"BREAK must be 'fwd' or 'bwd', got {mode!r}")
    broken = copy.copy(backend)

    def forward(q, k, v, layout, scale):
        if mode == "bwd":
            v = _ScaledGradient.apply(v)
        out, lse = backend.forward(q, k, v, layout, scale)
        return (out * FORWARD_ERROR if mode == "fwd" else out), lse

    object.__setattr__(broken, "forward", forward)
    return broken


def pytest_configure(config):
    from vsa_core.backends.registry import backend_entries, register_backend

    mode = os.environ.get("BREAK", "fwd")
    for name in ("fa4", "triton"):
        entry = backend_entries().get(name)
        if entry is not None and entry.backend is not None:
            register_backend(broken_copy(entry.backend, mode))

"""Without a GPU the kernels run in Triton's interpreter on CPU tensors (float16 only)."""

from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _interpret_without_gpu(monkeypatch):
    # Triton decides interpreted-vs-compiled when the kernels module is first imported, and the
    # backend reads the variable at call time: set it for every test of this package on a CPU
    # machine, and only for these tests.
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")

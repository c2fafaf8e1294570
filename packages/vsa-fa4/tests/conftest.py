"""Shared setup of the vsa-fa4 tests.

``fa4_model.py`` (a CPU model of upstream FA4's block-sparse semantics) sits beside this file;
pytest runs with ``--import-mode=importlib``, which does not put this folder on ``sys.path``,
so it is added here. The ``fa4_model`` fixture routes the adapter's FA4 launches to the model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def fa4_model(monkeypatch):
    """Run the adapter on the CPU with the model standing in for FA4's kernels."""
    import fa4_model as model

    from vsa_fa4 import dq_from_ds_triton, launch

    monkeypatch.setattr(launch, "run_forward", model.run_forward)
    monkeypatch.setattr(launch, "run_backward", model.run_backward)
    # the dS-writing backward's Triton passes (64x64 blocks' default backward)
    monkeypatch.setattr(dq_from_ds_triton, "ds_slots", model.ds_slots)
    monkeypatch.setattr(dq_from_ds_triton, "dq_from_ds", model.dq_from_ds)
    return model

"""Shared setup of the vsa-core tests.

The test modules import their independent (naive, float64) implementations from
``vsa_naive.py`` beside this file; pytest runs with ``--import-mode=importlib``, which does not
put this folder on ``sys.path``, so it is added here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def fresh_registry():
    """Remove any backend a test registered, whatever the test's outcome."""
    from vsa_core.backends import registry

    before = dict(registry._registered)
    try:
        yield registry
    finally:
        registry._registered.clear()
        registry._registered.update(before)


@pytest.fixture
def no_backend_override(monkeypatch):
    """The test sees no ``VSA_BACKEND`` from the environment it runs in."""
    from vsa_core.backends import OVERRIDE_ENV

    monkeypatch.delenv(OVERRIDE_ENV, raising=False)

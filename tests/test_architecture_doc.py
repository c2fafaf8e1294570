"""ARCHITECTURE.md names modules and objects: each must exist, so the page cannot drift from
the code unnoticed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"
PACKAGES = "vsa_core|vsa_triton|vsa_fa4|flash_attn_vsa|flash_attn_vsa_tools"
NAMES = sorted(set(re.findall(rf"`((?:{PACKAGES})(?:\.\w+)+)", DOC.read_text())))


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then walk the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_page_names_code():
    assert len(NAMES) > 10, NAMES


@pytest.mark.parametrize("dotted", NAMES)
def test_every_named_module_and_object_exists(dotted):
    _resolve(dotted)

"""Shared setup of the flash-attn-4-vsa tests: ``sm90_cases.py`` (the GPU cases of the sm_90
deltas) sits beside this file; pytest runs with ``--import-mode=importlib``, which does not put
this folder on ``sys.path``, so it is added here."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

"""The one place where research scripts reach code that is not an installed package.

Every research script is a module of the ``research`` package and runs from the repository
root::

    python3 -m research.fa4_fork.experiments.kv64_bwd_configs --out DIR     # GPU host
    uv run python -m research.fa4_fork.experiments.list_overlap --out DIR    # CPU

Scripts import each other relatively (``from .kv64_bwd_configs import rel_l2``) and the
workspace packages (``vsa_core``, ``vsa_fa4``, ``flash_attn_vsa``, ...) as installed. Two folders
are not packages: ``benchmarks/`` (its scripts import ``bench_common`` by plain name), the
fork's ``tests/`` (``sm90_cases``) and vsa-core's (``test_properties``); the functions below
put them on ``sys.path`` on first use, so no script edits ``sys.path`` itself.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the folder holding ``research/``)."""

BENCHMARKS = ROOT / "benchmarks"
FORK_TESTS = ROOT / "packages" / "flash-attn-4-vsa" / "tests"
CORE_TESTS = ROOT / "packages" / "vsa-core" / "tests"


def _import_from(folder: Path, name: str) -> ModuleType:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def benchmark_module(name: str) -> ModuleType:
    """A module of ``benchmarks/`` by its plain name (``"bench_vsa"``), as its scripts import
    each other."""
    return _import_from(BENCHMARKS, name)


def bench_common() -> ModuleType:
    """``benchmarks/bench_common.py``: timing, result headers, versions, error texts."""
    return benchmark_module("bench_common")


def fork_test_module(name: str) -> ModuleType:
    """A helper module of the fork's tests (``"sm90_cases"``: the GPU cases of its deltas)."""
    return _import_from(FORK_TESTS, name)


def core_test_module(name: str) -> ModuleType:
    """A module of vsa-core's tests (``"test_properties"``, whose float64 model ``vsa_naive``
    sits beside it)."""
    return _import_from(CORE_TESTS, name)


def command_line() -> str:
    """The command that started this process as it is typed on the GPU host:
    ``python3 -m MODULE ARGS...`` for a module run, else ``python3 SCRIPT ARGS...``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return " ".join(["python3", *head, *sys.argv[1:]])

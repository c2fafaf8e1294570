"""Runs the kernel tests under the Triton interpreter in a child process (CPU machines)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


INTERPRETED = (
    ("test_kernels_cpu.py", None),
    ("test_coarse.py", "select_and_attend"),
    ("test_coarse.py", "not select_and_attend"),
    ("test_deterministic.py", None),
    ("test_raster_native.py", None),
)
"""The kernel test files run under the interpreter, one child process each (``-k`` halves of
test_coarse.py, 31 + 168 s on two cores, 2026-12-06), so that a parallel run, ``pytest -n
auto``, spreads them over its workers: together they are the suite's longest part (335 s of a
578 s run on two cores when they ran as one child, 2026-12-03)."""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests run compiled")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="already interpreting"
)
@pytest.mark.parametrize(("name", "select"), INTERPRETED, ids=lambda x: x or "all")
def test_kernel_suite_under_the_triton_interpreter(name, select):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    chosen = [] if select is None else ["-k", select]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(Path(__file__).parent / name), *chosen],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary, summary
    print(summary)

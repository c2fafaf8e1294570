"""Runs a test module's checks under Triton's interpreter in a child process (the interpreter
must be chosen before triton is first imported, and these tests' process has imported it).
The module, run as ``python MODULE cpu``, prints ``checked N``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def assert_checked_under_interpreter(module_file: str, expected: int) -> None:
    """Run ``module_file cpu`` with ``TRITON_INTERPRET=1``; it must pass ``expected`` checks."""
    result = subprocess.run(
        [sys.executable, str(Path(module_file)), "cpu"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.strip() == f"checked {expected}"

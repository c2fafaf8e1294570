"""Importing the pin tools imports neither flash_attn nor cutlass (nor torch): they do so only
when a check runs."""

from __future__ import annotations

import json
import subprocess
import sys

MODULES = (
    "flash_attn_vsa_tools",
    "flash_attn_vsa_tools.deltas",
    "flash_attn_vsa_tools.fingerprint",
    "flash_attn_vsa_tools.refresh",
    "flash_attn_vsa_tools.upstream_md",
)
HEAVY = ("flash_attn", "cutlass", "torch", "triton")


def test_modules_import_nothing_heavy():
    code = (
        "import importlib, json, sys\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(heavy))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []

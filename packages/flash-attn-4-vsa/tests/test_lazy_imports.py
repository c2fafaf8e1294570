"""Importing any module of flash_attn_vsa imports neither flash_attn nor cutlass (nor torch)."""

from __future__ import annotations

import json
import subprocess
import sys

MODULES = (
    "flash_attn_vsa",
    "flash_attn_vsa.compile_gate",
    "flash_attn_vsa.fwd_sm90",
    "flash_attn_vsa.fwd_sm90_paired",
    "flash_attn_vsa.experimental",
    "flash_attn_vsa.experimental.fwd_sm90_streams",
    "flash_attn_vsa.experimental.persistent_sm90",
    "flash_attn_vsa.experimental.bwd_configs",
    "flash_attn_vsa.bwd_sm90",
    "flash_attn_vsa.mask_sm90",
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


SHIPPED = (
    "flash_attn_vsa",
    "flash_attn_vsa.bwd_sm90",
    "flash_attn_vsa.bwd_sm90_dq_parts",
    "flash_attn_vsa.fwd_sm90",
    "flash_attn_vsa.fwd_sm90_paired",
    "flash_attn_vsa.q_regs_sm90",
    "flash_attn_vsa.mask_sm90",
    "flash_attn_vsa.compile_gate",
)


def test_shipped_modules_import_nothing_experimental():
    """`flash_attn_vsa.experimental` is loaded only by a request for one of its kernels or
    configurations (the shipped modules import it inside those branches only)."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {SHIPPED!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('flash_attn_vsa.exp'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []

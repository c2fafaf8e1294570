"""The fork keeps one piece of thread state, `flash_attn_vsa.build_scope` (what upstream's
launcher is building on this thread, entered only by the entry points), and no scope a caller
could enter to pick a kernel: which kernel runs is the entry points' arguments."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

import flash_attn_vsa
from flash_attn_vsa import build_scope

PACKAGE = Path(flash_attn_vsa.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_thread_state_lives_in_build_scope_only(path):
    source = path.read_text()
    if path.name == "build_scope.py":
        assert source.count("threading.local()") == 1
        return
    imported = _imports(ast.parse(source))
    assert not {"threading", "contextvars"} & imported, path
    assert "threading.local" not in source and "ContextVar" not in source, path


def test_no_caller_scope_picks_a_kernel():
    from flash_attn_vsa import bwd_sm90, fwd_sm90, fwd_sm90_paired, sm90_operands
    from flash_attn_vsa.experimental import fwd_sm90_streams, persistent_sm90

    gone = {
        bwd_sm90: ("configs_scope", "kv64_scope"),
        fwd_sm90: ("forward_scope", "two_cta_scope", "current_scope", "current_kernel_class"),
        fwd_sm90_paired: ("paired_scope",),
        fwd_sm90_streams: ("streams_scope",),
        persistent_sm90: ("persistent_tiles",),
        sm90_operands: ("staged_rows_hook", "thread_stack", "pushed"),
    }
    for module, names in gone.items():
        for name in names:
            assert not hasattr(module, name), f"{module.__name__}.{name}"
    assert not (PACKAGE / "fwd_sm90_scope.py").exists()


def test_building_is_per_thread_and_by_direction():
    class Kernel:
        def __init__(self, direction):
            self.direction = direction

    fwd, bwd = Kernel("fwd"), Kernel("bwd")
    seen = []
    with build_scope.building(fwd):
        assert build_scope.current("fwd") is fwd and build_scope.current("bwd") is None
        with build_scope.building(bwd):
            assert build_scope.current("bwd") is bwd and build_scope.current("fwd") is None
        thread = threading.Thread(target=lambda: seen.append(build_scope.current("fwd")))
        thread.start()
        thread.join()
        with build_scope.traced("hooks", 1), build_scope.traced("hooks", 2):
            assert build_scope.trace_stack("hooks") == (1, 2)
        assert build_scope.trace_stack("hooks") == ()
    assert seen == [None]
    assert build_scope.current("fwd") is None

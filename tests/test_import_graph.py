"""The import graph of the package sources (packages/*/src, and the maintainer tools of
tools/*/src): no cycles, no upward imports.

Every ``import`` / ``from ... import`` statement counts, at module level, inside functions
(the lazy imports that keep triton, cutlass and FlashAttention off the import path) and under
``if TYPE_CHECKING:``, read with ``ast`` without importing anything. A cycle made only of lazy
imports still ties the modules together (each needs the other to work), so it is a cycle here.

The packages depend one way (ARCHITECTURE.md): vsa-triton -> vsa-core; vsa-fa4 -> vsa-core,
vsa-triton and flash-attn-4-vsa (and upstream ``flash_attn``, which the fork builds on);
flash-attn-4-vsa -> upstream ``flash_attn`` only; vsa-core -> torch and the standard library
only. The pin tools (tools/fa4-pin, never published) may import the fork and upstream; no
package imports them.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, set[str]] = {
    "vsa_core": set(),
    "vsa_triton": {"vsa_core"},
    "vsa_fa4": {"vsa_core", "vsa_triton", "flash_attn_vsa", "flash_attn"},
    "flash_attn_vsa": {"flash_attn"},
    "flash_attn_vsa_tools": {"flash_attn_vsa", "flash_attn"},
}
"""For each package, the other packages of the stack it may import."""
STACK = {*ALLOWED, "flash_attn"}
"""The packages whose direction is checked (ours and upstream FlashAttention)."""
CORE_THIRD_PARTY = {"torch"}
"""What vsa-core may import besides itself and the standard library."""

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Cycles that exist and are to be removed; each entry must still be a cycle (the test below
fails once it is gone, so that the entry goes too)."""


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``root/packages/*/src`` and
    ``root/tools/*/src``."""
    modules = {}
    for src in sorted([*root.glob("packages/*/src"), *root.glob("tools/*/src")]):
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imports(module: str, path: Path) -> Iterable[tuple[list[str], int]]:
    """For every import statement of ``path`` (anywhere in it): the dotted names it needs and
    its line. ``import a.b`` needs ``a.b``; ``from m import x, y`` needs ``m.x`` and ``m.y``
    (each either a submodule or a name of ``m``: the caller resolves them)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield [alias.name for alias in node.names], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield [f"{base}.{alias.name}" for alias in node.names], node.lineno


def graph(root: Path) -> tuple[dict[str, set[str]], dict[str, list[tuple[str, str]]]]:
    """The edges between modules of the package sources, and per module the imports that leave
    the workspace as ``(top-level name, "file:line")``. A needed name resolves to the longest
    module it names: ``from pkg import sub`` is an edge to ``pkg.sub`` (not to ``pkg``),
    ``from pkg.mod import f`` one to ``pkg.mod``."""
    modules = module_files(root)
    tops = {m.split(".")[0] for m in modules}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    external: dict[str, list[tuple[str, str]]] = {m: [] for m in modules}
    for module, path in modules.items():
        for names, line in imports(module, path):
            for name in names:
                top = name.split(".")[0]
                if top not in tops:
                    external[module].append((top, f"{path.relative_to(root)}:{line}"))
                    continue
                target = name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges[module].add(target)
    return edges, external


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in edges:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe(component: frozenset[str], edges: dict[str, set[str]]) -> str:
    inner = sorted(f"{a} -> {b}" for a in component for b in edges[a] if b in component)
    return "; ".join(inner)


EDGES, EXTERNAL = graph(ROOT)


def test_the_graph_sees_the_packages():
    tops = {m.split(".")[0] for m in EDGES}
    assert tops == set(ALLOWED), tops
    assert len(EDGES) > 40, len(EDGES)
    # lazy imports count: vsa_fa4.ops imports the launch module at module level, and
    # flash_attn_vsa.fwd_sm90 the paired kernel's body inside a method
    assert "vsa_fa4.launch" in EDGES["vsa_fa4.ops"]
    assert "flash_attn_vsa.paired_sm90" in EDGES["flash_attn_vsa.fwd_sm90"]


def test_no_import_cycles():
    new = [c for c in cycles(EDGES) if c not in KNOWN_CYCLES]
    assert not new, "import cycles in the package sources:\n" + "\n".join(
        describe(c, EDGES) for c in new
    )


def test_known_cycles_are_still_there():
    """Remove an entry from KNOWN_CYCLES once its cycle is gone. (A loop, not a parametrize:
    pytest 8.0, the dev floor, cannot name the tests of an empty parameter set.)"""
    found = cycles(EDGES)
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no cycle any more: {gone}"


def test_no_upward_imports():
    wrong = []
    for module, targets in EDGES.items():
        own = module.split(".")[0]
        for target in targets:
            top = target.split(".")[0]
            if top != own and top not in ALLOWED[own]:
                wrong.append(f"{module} imports {target}")
    for module, imports in EXTERNAL.items():
        own = module.split(".")[0]
        for top, where in imports:
            if top in STACK and top != own and top not in ALLOWED[own]:
                wrong.append(f"{module} imports {top} ({where})")
            if own == "vsa_core" and top not in CORE_THIRD_PARTY | set(sys.stdlib_module_names):
                wrong.append(f"vsa_core may import torch and the standard library only: {top} "
                             f"({where})")  # fmt: skip
    assert not wrong, "\n".join(sorted(wrong))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_a_lazy_cycle_and_an_upward_import(tmp_path):
    _write(
        tmp_path,
        {
            "packages/a/src/pkg/__init__.py": "",
            "packages/a/src/pkg/one.py": "from pkg import two\n",
            "packages/a/src/pkg/two.py": "def f():\n    from pkg.one import x\n",
            "packages/a/src/pkg/three.py": "from pkg import one, two\n",
        },
    )
    edges, _ = graph(tmp_path)
    assert cycles(edges) == [frozenset({"pkg.one", "pkg.two"})]
    assert "pkg" not in edges["pkg.three"]  # `from pkg import sub` needs the submodule only

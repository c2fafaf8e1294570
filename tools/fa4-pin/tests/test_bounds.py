"""The bounds beside the flash-attn-4 pin that the refresh workflow watches (issue 24).

``.github/workflows/fa4-refresh.yml`` ("Watch the nvidia-cutlass-dsl and quack-kernels bounds")
looks up the newest release of each watched package on PyPI every week and fails the run when it
falls outside the range declared in ``packages/flash-attn-4-vsa/pyproject.toml``. These checks,
without the network, keep that watch meaningful: each watched package is declared once, as a
range with an upper bound (not an exact pin, so that an install beside another stack, e.g.
vLLM's exact cutlass-dsl, can resolve; not open-ended, so that a new minor release goes through
the gates before it is allowed), and the locked version lies inside it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flash_attn_vsa_tools import refresh

ROOT = Path(__file__).resolve().parents[3]
WORKFLOW = ROOT / ".github" / "workflows" / "fa4-refresh.yml"
pytestmark = pytest.mark.skipif(not WORKFLOW.is_file(), reason="needs the workspace checkout")

_CLAUSE = re.compile(r"^\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<version>[^,\s]+)\s*$")


def _watched() -> list[str]:
    found = re.search(r"^\s*WATCHED = \((?P<names>[^)]*)\)", WORKFLOW.read_text(), re.M)
    assert found, "fa4-refresh.yml no longer names the watched packages (WATCHED = (...))"
    return re.findall(r'"([^"]+)"', found.group("names"))


def _declared(name: str) -> str:
    """The version specifier of ``name`` in flash-attn-4-vsa's dependencies."""
    text = (ROOT / refresh.PYPROJECT).read_text()
    pattern = re.compile(rf"^{re.escape(name)}(\[[^\]]*\])?(?P<spec>[<>=!~].*)$")
    found = [m.group("spec") for r in refresh.read_dependencies(text) if (m := pattern.match(r))]
    assert len(found) == 1, f"{name} is declared {len(found)} times in {refresh.PYPROJECT}"
    return found[0]


def _locked(name: str) -> str:
    lock = (ROOT / refresh.LOCKFILE).read_text()
    found = re.findall(rf'^name = "{re.escape(name)}"\nversion = "([^"]+)"', lock, re.M)
    assert len(found) == 1, f"uv.lock holds {len(found)} versions of {name}"
    return found[0]


def contains(specifier: str, version: str) -> bool:
    """Whether ``version`` satisfies a comma-separated specifier of ==, !=, <, <=, >, >=."""
    key = refresh.parse_version(version).key()
    ops = {
        "==": lambda k: key == k,
        "!=": lambda k: key != k,
        ">=": lambda k: key >= k,
        "<=": lambda k: key <= k,
        ">": lambda k: key > k,
        "<": lambda k: key < k,
    }
    for clause in specifier.split(","):
        match = _CLAUSE.match(clause)
        assert match, f"unsupported clause {clause!r}"
        if not ops[match["op"]](refresh.parse_version(match["version"]).key()):
            return False
    return True


@pytest.mark.parametrize(
    ("specifier", "version", "inside"),
    [
        (">=4.8.0,<4.9", "4.8.0", True),
        (">=4.8.0,<4.9", "4.8.1", True),
        (">=4.8.0,<4.9", "4.9.0", False),
        (">=4.8.0,<4.9", "4.7.1", False),
        (">=0.6.5,<0.7", "0.6.10", True),
        ("==4.8.1", "4.8.0", False),
    ],
)
def test_contains(specifier, version, inside):
    assert contains(specifier, version) is inside


def test_the_workflow_watches_cutlass_dsl_and_quack():
    assert set(_watched()) >= {"nvidia-cutlass-dsl", "quack-kernels"}


@pytest.mark.parametrize("name", ["nvidia-cutlass-dsl", "quack-kernels"])
def test_each_watched_package_is_a_bounded_range_holding_the_locked_version(name):
    specifier = _declared(name)
    ops = [_CLAUSE.match(c)["op"] for c in specifier.split(",")]
    assert "==" not in ops, f"{name} is pinned exactly ({specifier}); declare a range"
    assert ">=" in ops and "<" in ops, f"{name} needs a lower and an upper bound ({specifier})"
    assert contains(specifier, _locked(name)), f"uv.lock's {name} is outside {specifier}"


def test_cutlass_dsl_admits_the_release_vllm_pins():
    # vLLM 0.33 pins nvidia-cutlass-dsl 4.8.0; its PTX matched 4.8.1's for every fa4 route
    # (benchmarks/results/2026-12-01-issue24-install-checks.md, section 8).
    assert contains(_declared("nvidia-cutlass-dsl"), "4.8.0")

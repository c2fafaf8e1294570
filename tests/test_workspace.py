"""Cross-package checks of the workspace that run on a CPU-only machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import import_module
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli on Python 3.10
    import tomli as tomllib

from vsa_core.backends.base import AttentionCall, Backend

# (import name, distribution name) of every member package.
PACKAGES = [
    ("vsa_core", "vsa-core"),
    ("vsa_triton", "vsa-triton"),
    ("vsa_fa4", "vsa-fa4"),
    ("flash_attn_vsa", "flash-attn-4-vsa"),
]

EXPECTED_BACKENDS = ["reference", "triton", "fa4"]

# Backends registered by this workspace whose kernels are not written yet (none now: the fa4
# adapter landed; its CPU refusal is checked below like the Triton backend's).
STUB_BACKENDS: list[str] = []

HEAVY_MODULES = ("triton", "cutlass", "flash_attn")


def _backend_entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group="vsa.backends")}


def _load(target: str) -> type[Backend]:
    module_name, _, attr = target.partition(":")
    return getattr(import_module(module_name), attr)


def _cpu_call() -> AttentionCall:
    return AttentionCall(
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        head_dim=128,
        block_shape=(64, 64),
        requires_grad=False,
    )


def test_backend_entry_points_are_registered():
    names = _backend_entry_points()
    missing = [name for name in EXPECTED_BACKENDS if name not in names]
    assert not missing, f"vsa.backends lacks {missing}; found {sorted(names)}"


@pytest.mark.parametrize("name", EXPECTED_BACKENDS)
def test_backend_entry_point_loads_a_backend(name):
    ep = _backend_entry_points()[name]
    cls = ep.load()
    assert isinstance(cls, type) and issubclass(cls, Backend), f"{ep.value} is not a Backend"
    assert cls is not Backend
    assert cls.name == name, f"{ep.value}.name is {cls.name!r}, registered as {name!r}"


def test_importing_plugins_keeps_heavy_modules_out():
    code = (
        "import json, sys\n"
        "import vsa_triton, vsa_triton.backend\n"
        "import vsa_fa4, vsa_fa4.backend\n"
        "import flash_attn_vsa\n"
        f"heavy = {HEAVY_MODULES!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing the plugin packages imported {loaded}"


@pytest.mark.parametrize(("module_name", "dist_name"), PACKAGES)
def test_version_matches_distribution(module_name, dist_name):
    assert import_module(module_name).__version__ == version(dist_name)


def test_flash_attn_vsa_upstream_pin_matches_installed():
    import flash_attn_vsa

    assert flash_attn_vsa.upstream_version() == flash_attn_vsa.UPSTREAM_VERSION


def test_stub_backends_refuse_honestly():
    for target in STUB_BACKENDS:
        backend = _load(target)()
        reason = backend.supports(_cpu_call())
        assert isinstance(reason, str) and reason.strip(), f"{target}.supports gave {reason!r}"

        unavailable = backend.availability()
        assert isinstance(unavailable, str) and unavailable.strip()

        q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
        with pytest.raises(NotImplementedError):
            backend.forward(q, q, q, layout=None, scale=1.0)  # type: ignore[arg-type]


def test_fa4_backend_refuses_a_cpu_call_honestly():
    from vsa_core import BlockSparseLayout

    backend = _load("vsa_fa4.backend:FA4Backend")()
    reason = backend.supports(_cpu_call())
    assert isinstance(reason, str) and "CUDA" in reason, reason
    if not torch.cuda.is_available():
        unavailable = backend.availability()
        assert isinstance(unavailable, str) and unavailable.strip()

    valid = torch.full((1,), 64, dtype=torch.int32)
    layout = BlockSparseLayout.from_block_mask(
        torch.ones(1, 1, 1, 1, dtype=torch.bool), valid, (64, 64)
    )
    q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot run this call: needs a CUDA device"):
        backend.forward(q, q, q, layout, 1.0)


def test_triton_backend_refuses_a_cpu_call_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backend = _load("vsa_triton.backend:TritonBackend")()
    reason = backend.supports(_cpu_call())
    assert isinstance(reason, str) and "CUDA" in reason


# --------------------------------------------------------------------------------------------
# Packaging metadata of each member (what PyPI users get)

ROOT = Path(__file__).resolve().parents[1]

# Words every full text of each declared license contains.
LICENSE_TEXT = {
    "Apache-2.0": ("Apache License", "Version 2.0, January 2004"),
    "BSD-3-Clause": ("Redistribution and use in source and binary forms", "Neither the name of"),
}

# The newest Python the packages are classified (and CI-tested) for.
NEWEST_PYTHON = (3, 13)


def _project(dist_name: str) -> tuple[Path, dict]:
    directory = ROOT / "packages" / dist_name
    return directory, tomllib.loads((directory / "pyproject.toml").read_text())


def test_root_license_is_apache():
    text = (ROOT / "LICENSE").read_text()
    assert all(words in text for words in LICENSE_TEXT["Apache-2.0"])


@pytest.mark.parametrize(("module_name", "dist_name"), PACKAGES)
def test_license_file_matches_the_declared_license(module_name, dist_name):
    directory, pyproject = _project(dist_name)
    project = pyproject["project"]
    expression = project["license"]
    assert isinstance(expression, str) and expression in LICENSE_TEXT, expression
    assert "LICENSE" in project.get("license-files", []), "LICENSE is not in license-files"
    for name in project["license-files"]:
        assert (directory / name).is_file(), f"{dist_name}: license file {name} is missing"
    text = (directory / "LICENSE").read_text()
    missing = [words for words in LICENSE_TEXT[expression] if words not in text]
    assert not missing, f"{dist_name}/LICENSE is not the {expression} text: lacks {missing}"
    # PEP 639: with a license expression, "License ::" classifiers are deprecated.
    assert not [c for c in project.get("classifiers", []) if c.startswith("License ::")]


@pytest.mark.parametrize(("module_name", "dist_name"), PACKAGES)
def test_py_typed_is_in_the_wheel_target(module_name, dist_name):
    directory, pyproject = _project(dist_name)
    packages = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert f"src/{module_name}" in packages, packages
    assert (directory / "src" / module_name / "py.typed").is_file()
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]


@pytest.mark.parametrize(("module_name", "dist_name"), PACKAGES)
def test_changelog_has_the_current_version_and_unreleased(module_name, dist_name):
    directory, pyproject = _project(dist_name)
    current = pyproject["project"]["version"]
    changelog = directory / "CHANGELOG.md"
    assert changelog.is_file(), f"{dist_name} has no CHANGELOG.md"
    headings = re.findall(r"^## (\S+)", changelog.read_text(), re.MULTILINE)
    assert "Unreleased" in headings, f"{changelog}: no '## Unreleased' section"
    assert current in headings, f"{changelog}: no '## {current}' section"
    assert current == import_module(module_name).__version__


@pytest.mark.parametrize(("module_name", "dist_name"), PACKAGES)
def test_classifiers_cover_requires_python(module_name, dist_name):
    _, pyproject = _project(dist_name)
    project = pyproject["project"]
    allowed = SpecifierSet(project["requires-python"])
    prefix = "Programming Language :: Python :: 3."
    classified = sorted(
        (3, int(c[len(prefix) :])) for c in project["classifiers"] if c.startswith(prefix)
    )
    expected = [
        (3, minor)
        for minor in range(NEWEST_PYTHON[1] + 1)
        if allowed.contains(f"3.{minor}", prereleases=True)
    ]
    assert expected, f"{dist_name}: requires-python {allowed} admits none of 3.0-3.13"
    assert classified == expected, (
        f"{dist_name}: Python classifiers {classified} != the versions requires-python "
        f"{allowed} admits up to {NEWEST_PYTHON}: {expected}"
    )

"""flash-attn-4-vsa-tools stays a maintainer package: never published, not in the runtime wheel."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import flash_attn_vsa

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
TOOLS = ROOT / "tools" / "fa4-pin"
FORK = ROOT / "packages" / "flash-attn-4-vsa"
MOVED = ("fingerprint.py", "refresh.py", "upstream_md.py", "deltas.py", "upstream_api.json")


def _pyproject(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())


def test_the_tools_package_is_never_uploaded():
    project = _pyproject(TOOLS)["project"]
    assert "Private :: Do Not Upload" in project["classifiers"]
    assert project["scripts"] == {"fa4-refresh": "flash_attn_vsa_tools.refresh:main"}
    release = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    published = re.search(r"packages='([^']+)'", release).group(1).split("|")
    assert "flash-attn-4-vsa-tools" not in published


def test_the_runtime_package_holds_no_pin_tooling():
    assert "scripts" not in _pyproject(FORK)["project"]
    source = Path(flash_attn_vsa.__file__).resolve().parent
    assert not [name for name in MOVED if (source / name).exists()]


def test_uv_sync_installs_the_tools_for_developers():
    root = _pyproject(ROOT)
    assert "tools/*" in root["tool"]["uv"]["workspace"]["members"]
    assert "flash-attn-4-vsa-tools" in root["project"]["dependencies"]

"""The lowest-direct job's floors: pin the ones uv may miss, then check what was installed.

    python .ci/lowest-floors.py constraints MEMBER_DIR... > floors.txt
    python .ci/lowest-floors.py check --python VENV_PYTHON MEMBER_DIR...

`uv pip install --resolution lowest-direct` does not always reach a declared minimum: with the
dev group's `matplotlib>=3.8` in the same resolution, uv 0.13.9 picked torch 2.11.0 although
vsa-fa4 declares `torch>=2.10` (and resolves torch 2.10.0 once that is pinned: the resolution
exists). A lowest job that silently tests a higher version than the one declared proves nothing
about the floor, so:

- `constraints` prints `NAME==FLOOR` for the PINNED packages (torch), FLOOR being the highest
  `>=` bound that the given members declare for it (the others' lower bounds are then moot);
- `check` prints, for every third-party dependency of the given members, the highest declared
  floor next to the installed version, and fails when a PINNED package is not at its floor.
  Others are reported, not failed: their floor can be unreachable together with the rest
  (vsa-triton's `triton>=3.4` under torch 2.10, which requires triton 3.6.0).

Runs on any Python >= 3.10 with `packaging` (and `tomli` below 3.11).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

PINNED = ("torch",)
SIBLINGS = {"vsa-core", "vsa-triton", "vsa-fa4", "flash-attn-4-vsa", "flash-attn-4-vsa-tools"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(
    members: list[str], environment: dict[str, str] | None = None
) -> dict[str, Version | None]:
    """Highest `>=` (or `==`) bound per third-party dependency of the members; None: no floor."""
    result: dict[str, Version | None] = {}
    for member in members:
        with (Path(member) / "pyproject.toml").open("rb") as f:
            dependencies = tomllib.load(f)["project"].get("dependencies", [])
        for line in dependencies:
            req = Requirement(line)
            name = canonical(req.name)
            if name in SIBLINGS:
                continue
            if req.marker is not None and not req.marker.evaluate(environment):
                continue
            bounds = [
                Version(spec.version)
                for spec in req.specifier
                if spec.operator in (">=", "==", "~=") and "*" not in spec.version
            ]
            low = max(bounds, default=None)
            old = result.get(name)
            result[name] = low if old is None else (old if low is None else max(old, low))
    return result


def installed(python: str) -> tuple[dict[str, Version], dict[str, str]]:
    code = (
        "import importlib.metadata as md, json, packaging.markers as m;"
        "print(json.dumps([{d.metadata['Name']: d.version for d in md.distributions()},"
        " m.default_environment()]))"
    )
    try:
        out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
        versions, environment = json.loads(out.stdout)
    except subprocess.CalledProcessError:
        # The venv may lack packaging: ask for the versions only, and use our own environment.
        code = (
            "import importlib.metadata as md, json;"
            "print(json.dumps({d.metadata['Name']: d.version for d in md.distributions()}))"
        )
        out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
        versions, environment = json.loads(out.stdout), default_environment()
    return {canonical(k): Version(v) for k, v in versions.items()}, environment


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["constraints", "check"])
    parser.add_argument("--python", help="the venv's interpreter (check)")
    parser.add_argument("members", nargs="+")
    args = parser.parse_args()

    if args.mode == "constraints":
        for name, low in floors(args.members).items():
            if name in PINNED and low is not None:
                print(f"{name}=={low}")
        return 0

    if not args.python:
        parser.error("check needs --python")
    versions, environment = installed(args.python)
    failures = []
    print(f"{'package':<28} {'declared floor':<16} installed")
    for name, low in sorted(floors(args.members, environment).items()):
        have = versions.get(name)
        at_floor = (
            low is not None and have is not None and have.release[: len(low.release)] == low.release
        )
        note = "" if at_floor or low is None else "  (above the floor)"
        if name in PINNED and not at_floor:
            note = "  FAIL: a pinned floor not reached"
            failures.append(f"{name}: installed {have}, declared floor {low}")
        print(f"{name:<28} {low!s:<16} {have}{note}")
    for failure in failures:
        print(f"::error::lowest-direct did not install the declared floor: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

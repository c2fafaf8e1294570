#!/usr/bin/env python3
"""Pin every action in .github/workflows to the commit SHA of its tag, or check existing pins.

    python3 .github/pin-actions.py          # rewrite `uses: owner/repo@vX.Y.Z` in place
    python3 .github/pin-actions.py --check  # verify each `@<sha> # vX.Y.Z` against its tag

Needs `git` and access to github.com (each tag is resolved with `git ls-remote`, annotated tags
dereferenced to their commit). A pinned line keeps its tag as a comment:

    - uses: actions/checkout@<40 hex digits> # v5.0.0

Local (`./...`) and docker references are left alone. Dependabot keeps the pins and the comments
up to date afterwards.

The pins now in the workflows were set where github.com was unreachable, from public files that
pin the same SHA with the same tag comment; .github/PINS.md records the evidence for each.
`--check` is how to re-verify them against the tags themselves.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parent / "workflows"
USES = re.compile(
    r"^(?P<head>\s*(?:-\s+)?uses:\s+)(?P<action>[\w.-]+/[\w.-]+(?:/[\w./-]+)?)@(?P<ref>[\w./-]+)"
    r"(?P<tail>[ \t]*(?:#.*)?)$"
)
SHA = re.compile(r"^[0-9a-f]{40}$")
TAG_COMMENT = re.compile(r"#\s*(?P<tag>v?\d[\w.-]*)")


def resolve(action: str, tag: str) -> str:
    """The commit a tag of an action's repository points at (annotated tags dereferenced)."""
    owner_repo = "/".join(action.split("/")[:2])
    try:
        out = subprocess.run(
            ["git", "ls-remote", f"https://github.com/{owner_repo}", f"refs/tags/{tag}*"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        detail = (getattr(e, "stderr", None) or "").strip().splitlines()
        raise SystemExit(
            f"{owner_repo}: could not list its tags ({detail[-1] if detail else e}); "
            "this needs github.com"
        ) from None
    refs = dict(reversed(line.split("\t")) for line in out.splitlines() if "\t" in line)
    sha = refs.get(f"refs/tags/{tag}^{{}}") or refs.get(f"refs/tags/{tag}")
    if sha is None:
        raise SystemExit(f"{owner_repo}: no tag {tag}")
    return sha


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify pins, change nothing")
    args = parser.parse_args()
    cache: dict[tuple[str, str], str] = {}
    problems = 0
    for path in sorted(WORKFLOWS.glob("*.y*ml")):
        lines = path.read_text().splitlines(keepends=True)
        changed = False
        for i, line in enumerate(lines):
            m = USES.match(line.rstrip("\n"))
            if not m:
                continue
            action, ref = m["action"], m["ref"]
            where = f"{path.name}:{i + 1}: {action}@{ref}"
            if SHA.match(ref):
                comment = TAG_COMMENT.search(m["tail"])
                if comment is None:
                    print(f"{where}: pinned, but no `# vX.Y.Z` comment to check it against")
                    problems += 1
                    continue
                tag = comment["tag"]
                key = (action, tag)
                cache[key] = cache.get(key) or resolve(action, tag)
                status = "ok" if cache[key] == ref else f"MISMATCH: {tag} is {cache[key]}"
                problems += status != "ok"
                print(f"{where} # {tag}: {status}")
                continue
            if args.check:
                print(f"{where}: not pinned")
                problems += 1
                continue
            key = (action, ref)
            cache[key] = cache.get(key) or resolve(action, ref)
            lines[i] = f"{m['head']}{action}@{cache[key]} # {ref}\n"
            changed = True
            print(f"{where} -> {cache[key]}")
        if changed:
            path.write_text("".join(lines))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

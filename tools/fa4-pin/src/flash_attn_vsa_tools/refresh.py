"""``fa4-refresh``: move the upstream FlashAttention-4 pin and run the CPU gates.

Run in a checkout of the workspace (``uv run fa4-refresh``)::

    fa4-refresh                  # to the newest flash-attn-4 on PyPI (pre-releases count)
    fa4-refresh --to 4.0.0b37    # to a given release
    fa4-refresh --dry-run        # change nothing: show the edits, gate what is installed
    fa4-refresh --force --to 4.0.0b36   # redo the current pin (e.g. to record its commit)

A refresh, in order:

1. finds the target release (``--to``, else the newest non-yanked release on the index);
2. bumps the exact pin in ``packages/flash-attn-4-vsa/pyproject.toml`` and
   ``UPSTREAM_VERSION`` in ``flash_attn_vsa/__init__.py``;
3. relocks only that package (``uv lock --upgrade-package flash-attn-4``) and syncs;
4. runs the API fingerprint check, then regenerates the record (the readable diff is printed
   and goes into the summary);
5. runs the compile gate (:mod:`flash_attn_vsa.compile_gate`);
6. updates ``UPSTREAM.md`` (pinned release, upstream commit when the tag can be resolved,
   generated symbols list, refresh history);
7. prints the GPU gates to run next: the fork's GPU tests and the benchmark against the
   previous pin.

A failed relock or sync puts the edited files back. Exit status: 0 when the gates passed (or
there was nothing to do), 1 when the fingerprint moved or a configuration failed to compile
(the files stay edited, for review), 2 when the refresh could not be carried out.
``--summary`` and ``--report`` write a markdown summary and a JSON report (the workflow
``.github/workflows/fa4-refresh.yml`` uses them for its pull request).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flash_attn_vsa import UPSTREAM_DISTRIBUTION

PACKAGE_DIR = Path("packages/flash-attn-4-vsa")
PYPROJECT = PACKAGE_DIR / "pyproject.toml"
INIT = PACKAGE_DIR / "src/flash_attn_vsa/__init__.py"
TOOLS_DIR = Path("tools/fa4-pin")
RECORD = TOOLS_DIR / "src/flash_attn_vsa_tools/upstream_api.json"
UPSTREAM_MD = Path("UPSTREAM.md")
LOCKFILE = Path("uv.lock")
EDITED_FILES = (PYPROJECT, INIT, LOCKFILE, RECORD, UPSTREAM_MD)

INDEX_URL = "https://pypi.org/pypi"
UPSTREAM_GIT = "https://github.com/Dao-AILab/flash-attention"
UPSTREAM_TAG_PREFIX = "fa4-v"  # upstream's setuptools-scm tag_regex is ^fa4-v(?P<version>.+)$
BENCHMARK_SCRIPT = Path("benchmarks/bench_vsa.py")


# --------------------------------------------------------------------------------------------
# Versions (the PEP 440 subset PyPI releases use; no dependency on `packaging`)

_VERSION = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>\d+)!)?
    (?P<release>\d+(?:\.\d+)*)
    (?:[-_.]?(?P<pre_l>alpha|beta|preview|pre|rc|a|b|c)[-_.]?(?P<pre_n>\d+)?)?
    (?:-(?P<post_n1>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d+)?)?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.IGNORECASE | re.VERBOSE,
)
_PRE_LETTER = {"a": "a", "alpha": "a", "b": "b", "beta": "b", "c": "rc", "rc": "rc"}
_PRE_LETTER.update({"pre": "rc", "preview": "rc"})
_PRE_RANK = {"a": 0, "b": 1, "rc": 2}


@dataclass(frozen=True)
class Version:
    """A parsed release version; compares like PEP 440 (local labels are ignored)."""

    epoch: int
    release: tuple[int, ...]
    pre: tuple[str, int] | None
    post: int | None
    dev: int | None

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None

    def key(self) -> tuple[Any, ...]:
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        if self.pre is None and self.post is None and self.dev is not None:
            pre: tuple[Any, ...] = (0,)  # 1.0.dev1 sorts before 1.0a1
        elif self.pre is None:
            pre = (2,)
        else:
            pre = (1, _PRE_RANK[self.pre[0]], self.pre[1])
        post = (0,) if self.post is None else (1, self.post)
        dev = (1,) if self.dev is None else (0, self.dev)
        return (self.epoch, tuple(release), pre, post, dev)

    def __lt__(self, other: Version) -> bool:
        return self.key() < other.key()

    def __le__(self, other: Version) -> bool:
        return self.key() <= other.key()

    def __gt__(self, other: Version) -> bool:
        return self.key() > other.key()

    def __ge__(self, other: Version) -> bool:
        return self.key() >= other.key()

    def __str__(self) -> str:
        text = (f"{self.epoch}!" if self.epoch else "") + ".".join(map(str, self.release))
        if self.pre is not None:
            text += f"{self.pre[0]}{self.pre[1]}"
        if self.post is not None:
            text += f".post{self.post}"
        if self.dev is not None:
            text += f".dev{self.dev}"
        return text


def parse_version(text: str) -> Version:
    """Parse a release version (``4.0.0b36``, ``4.0.0.beta36``, ``4.0.1``, ``4.0.0rc1``...)."""
    match = _VERSION.match(text)
    if match is None:
        raise ValueError(f"not a PEP 440 version: {text!r}")
    g = match.groupdict()
    pre = None
    if g["pre_l"]:
        pre = (_PRE_LETTER[g["pre_l"].lower()], int(g["pre_n"] or 0))
    post = None
    if g["post_n1"] is not None:
        post = int(g["post_n1"])
    elif g["post_l"]:
        post = int(g["post_n2"] or 0)
    dev = int(g["dev_n"] or 0) if g["dev_l"] else None
    return Version(
        epoch=int(g["epoch"] or 0),
        release=tuple(int(p) for p in g["release"].split(".")),
        pre=pre,
        post=post,
        dev=dev,
    )


def normalize_version(text: str) -> str:
    return str(parse_version(text))


def newest_release(index_json: dict[str, Any]) -> str:
    """The newest release in a PyPI JSON API document (``/pypi/<name>/json``).

    Pre-releases count (upstream ships betas); releases without files, or whose files are all
    yanked, and versions that do not parse are skipped.
    """
    candidates: list[tuple[Version, str]] = []
    for text, files in index_json.get("releases", {}).items():
        if not files or all(f.get("yanked", False) for f in files):
            continue
        try:
            candidates.append((parse_version(text), text))
        except ValueError:
            continue
    if not candidates:
        raise ValueError("the index lists no usable release")
    return max(candidates, key=lambda c: c[0].key())[1]


def fetch_index(name: str, index_url: str = INDEX_URL, timeout: float = 30.0) -> dict[str, Any]:
    """The PyPI JSON API document of ``name`` (network)."""
    url = f"{index_url.rstrip('/')}/{name}/json"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


# --------------------------------------------------------------------------------------------
# Files: the pin, the version constant, the dependency list


def _pin_pattern(name: str) -> re.Pattern[str]:
    # "name==v" or "name[extras]==v" inside a quoted requirement; "name-suffix" does not match.
    return re.compile(
        rf'"(?P<req>{re.escape(name)}(?P<extras>\[[^\]]*\])?==)(?P<version>[^";\s]+)"'
    )


def read_pin(pyproject_text: str, name: str = UPSTREAM_DISTRIBUTION) -> tuple[str, str]:
    """(requirement, version) of the exact pin ``name[...]==version``; it must occur once."""
    found = list(_pin_pattern(name).finditer(pyproject_text))
    if len(found) != 1:
        raise ValueError(f'expected one exact pin of {name} ("{name}[...]==X"), found {len(found)}')
    match = found[0]
    return match.group("req") + match.group("version"), match.group("version")


def rewrite_pin(pyproject_text: str, version: str, name: str = UPSTREAM_DISTRIBUTION) -> str:
    """``pyproject_text`` with the exact pin of ``name`` moved to ``version``."""
    read_pin(pyproject_text, name)  # exactly one
    return _pin_pattern(name).sub(lambda m: f'"{m.group("req")}{version}"', pyproject_text)


_CONSTANT = re.compile(r'^UPSTREAM_VERSION = "(?P<version>[^"]*)"$', re.MULTILINE)


def read_upstream_constant(init_text: str) -> str:
    found = _CONSTANT.findall(init_text)
    if len(found) != 1:
        raise ValueError(
            f'expected one line UPSTREAM_VERSION = "..." in __init__.py, found {found}'
        )
    return found[0]


def rewrite_upstream_constant(init_text: str, version: str) -> str:
    read_upstream_constant(init_text)
    return _CONSTANT.sub(f'UPSTREAM_VERSION = "{version}"', init_text)


def read_dependencies(pyproject_text: str) -> list[str]:
    """The ``dependencies = [...]`` list of ``[project]`` (one quoted requirement per line)."""
    project = re.search(r"^\[project\]\s*$(?P<body>.*?)(?=^\[|\Z)", pyproject_text, re.M | re.S)
    if project is None:
        raise ValueError("no [project] table")
    deps = re.search(r"^dependencies = \[(?P<list>.*?)^\]", project.group("body"), re.M | re.S)
    if deps is None:
        raise ValueError("no multi-line dependencies = [...] in [project]")
    return re.findall(r'"([^"]+)"', deps.group("list"))


def alongside_requirements(pyproject_text: str) -> list[str]:
    """The upstream stack pinned beside flash-attn-4 (everything but torch and upstream)."""
    out = []
    for req in read_dependencies(pyproject_text):
        name = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()
        if name not in ("torch", UPSTREAM_DISTRIBUTION):
            out.append(req)
    return out


# --------------------------------------------------------------------------------------------
# Upstream commit of a release


def match_tag(ls_remote_output: str, version: str) -> tuple[str, str] | None:
    """(tag, commit) of the upstream tag whose version is ``version``, from ``git ls-remote``.

    Upstream tags releases ``fa4-v<version>`` in any PEP 440 spelling (``fa4-v4.0.0.beta36``
    is 4.0.0b36). An annotated tag's peeled line (``^{}``) gives the commit.
    """
    wanted = parse_version(version).key()
    plain: dict[str, str] = {}
    peeled: dict[str, str] = {}
    for line in ls_remote_output.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("refs/tags/"):
            continue
        sha, ref = parts
        tag = ref[len("refs/tags/") :]
        is_peeled = tag.endswith("^{}")
        tag = tag.removesuffix("^{}")
        if not tag.startswith(UPSTREAM_TAG_PREFIX):
            continue
        try:
            if parse_version(tag[len(UPSTREAM_TAG_PREFIX) :]).key() != wanted:
                continue
        except ValueError:
            continue
        (peeled if is_peeled else plain)[tag] = sha
    for tag in sorted(plain):
        return tag, peeled.get(tag, plain[tag])
    return None


def resolve_upstream_commit(version: str, timeout: float = 60.0) -> tuple[str, str] | None:
    """(tag, commit) of ``version`` in the upstream repository, or None (network, git)."""
    git = shutil.which("git")
    if git is None:
        return None
    try:
        done = subprocess.run(
            [git, "ls-remote", "--tags", UPSTREAM_GIT, f"refs/tags/{UPSTREAM_TAG_PREFIX}*"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return match_tag(done.stdout, version)


# --------------------------------------------------------------------------------------------
# What to run next


def gpu_gate_commands(previous: str, target: str, root: Path) -> list[str]:
    """The GPU gates of a refresh, as commands for an H200 host with the staged bundle."""
    bench = f"python3 {BENCHMARK_SCRIPT} --arms fa4 fa4_raw fa4_dense"
    missing = "" if (root / BENCHMARK_SCRIPT).is_file() else "  # (script not written yet)"
    today = datetime.date.today().isoformat()
    return [
        "python3 -m pytest -m gpu packages/flash-attn-4-vsa packages/vsa-fa4",
        f"{bench} --out benchmarks/results/{today}-h200-bench_vsa-fa4-{target}.json{missing}",
        f"# the same benchmark at the previous pin {previous} (a checkout of the commit before"
        " the refresh, staged the same way), same host and session:",
        f"{bench} --out /tmp/bench_vsa-fa4-{previous}.json{missing}",
        "# then compare the two: no arm slower than at the previous pin beyond run-to-run noise",
    ]


# --------------------------------------------------------------------------------------------
# The refresh


@dataclass
class Outcome:
    previous: str
    target: str
    dry_run: bool
    action: str = "refreshed"  # refreshed | up-to-date | dry-run | failed
    installed: str | None = None
    fingerprint_status: str = "not run"  # unchanged | moved | error | not run
    fingerprint_diff: list[str] = field(default_factory=list)
    gate: dict[str, Any] | None = None
    gate_text: str = ""
    upstream: tuple[str, str] | None = None
    changed_files: list[str] = field(default_factory=list)
    planned_edits: list[str] = field(default_factory=list)
    gpu_commands: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.action == "failed":
            return 2
        if self.action == "up-to-date":
            return 0
        gate_failed = self.gate is not None and not self.gate.get("ok")
        return 1 if self.fingerprint_status != "unchanged" or gate_failed else 0

    @property
    def title(self) -> str:
        if self.action == "failed":
            return f"flash-attn-4 {self.previous} -> {self.target}: refresh failed"
        if self.action == "up-to-date":
            return f"flash-attn-4 {self.previous} is the newest release"
        verdict = "CPU gates passed" if self.exit_code == 0 else "needs review"
        if self.fingerprint_status == "moved":
            verdict = "upstream API moved, needs review"
        elif self.fingerprint_status == "error":
            verdict = "fingerprint check failed"
        elif self.gate is not None and not self.gate.get("ok"):
            verdict = "compile gate failed"
        prefix = "dry run: " if self.dry_run else ""
        return f"{prefix}flash-attn-4 {self.previous} -> {self.target} ({verdict})"

    def to_json(self) -> dict[str, Any]:
        return {
            "previous": self.previous,
            "target": self.target,
            "dry_run": self.dry_run,
            "action": self.action,
            "installed": self.installed,
            "fingerprint": {"status": self.fingerprint_status, "diff": self.fingerprint_diff},
            "compile_gate": self.gate,
            "upstream_tag": self.upstream[0] if self.upstream else None,
            "upstream_commit": self.upstream[1] if self.upstream else None,
            "changed_files": self.changed_files,
            "planned_edits": self.planned_edits,
            "gpu_commands": self.gpu_commands,
            "error": self.error,
            "title": self.title,
            "exit_code": self.exit_code,
        }


def find_workspace_root(start: Path) -> Path:
    for candidate in [start, *start.parents]:
        pyproject = candidate / "pyproject.toml"
        if (
            (candidate / PYPROJECT).is_file()
            and pyproject.is_file()
            and "[tool.uv.workspace]" in pyproject.read_text()
        ):
            return candidate
    raise FileNotFoundError(
        f"no workspace with {PYPROJECT} above {start}: run fa4-refresh in a checkout"
    )


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        raise FileNotFoundError("uv is not on PATH")
    return uv


def run_command(cmd: Sequence[str], cwd: Path) -> tuple[int, str]:
    """Run a command, echoing it; (exit status, combined output)."""
    print("$ " + " ".join(cmd), flush=True)
    try:
        done = subprocess.run(
            list(cmd), cwd=cwd, capture_output=True, text=True, check=False, timeout=1800
        )
    except subprocess.TimeoutExpired:
        return 124, f"{cmd[0]} timed out after 1800 s"
    return done.returncode, (done.stdout + done.stderr)


def _installed_upstream() -> str | None:
    # Read fresh metadata (uv sync may just have replaced the distribution).
    from importlib.metadata import PackageNotFoundError, distributions

    try:
        for dist in distributions(name=UPSTREAM_DISTRIBUTION):
            return dist.version
    except PackageNotFoundError:
        return None
    return None


def update_upstream_md(
    text: str,
    *,
    target: str,
    requirement: str,
    alongside: list[str],
    upstream: tuple[str, str] | None,
    record: dict[str, Any] | None,
    history: str | None,
) -> str:
    """``UPSTREAM.md`` after a refresh to ``target`` (pure)."""
    from flash_attn_vsa_tools import upstream_md as md

    text = md.set_table_row(text, "Pinned release", md.pinned_release_cell(target, requirement))
    tag, commit = upstream if upstream else (None, None)
    text = md.set_table_row(text, "Upstream commit", md.upstream_commit_cell(target, tag, commit))
    text = md.set_table_row(text, "Pinned alongside", md.alongside_cell(alongside))
    if record is not None:
        text = md.replace_symbols_section(text, record)
    if history:
        text = md.add_history_line(text, history)
    return text


def _check_fingerprint(root: Path, outcome: Outcome) -> dict[str, Any] | None:
    from flash_attn_vsa_tools import fingerprint

    try:
        current = fingerprint.current_record_subprocess()
    except Exception as exc:
        outcome.fingerprint_status = "error"
        outcome.fingerprint_diff = [str(exc)]
        return None
    recorded = json.loads((root / RECORD).read_text())
    lines = fingerprint.diff_records(recorded, current, compare_version=False)
    outcome.fingerprint_status = "moved" if lines else "unchanged"
    outcome.fingerprint_diff = lines
    print(fingerprint.format_diff(lines), flush=True)
    return current


def _run_gate(outcome: Outcome) -> None:
    from flash_attn_vsa import compile_gate

    report = compile_gate.run_gate()
    outcome.gate = report.to_json()
    outcome.gate_text = compile_gate.format_report(report)
    print(outcome.gate_text, flush=True)


def refresh(
    root: Path,
    *,
    to: str | None,
    dry_run: bool,
    force: bool = False,
    skip_gate: bool = False,
    index_url: str = INDEX_URL,
) -> Outcome:
    """Carry out (or, with ``dry_run``, rehearse) a refresh; see the module docstring."""
    paths = {p: root / p for p in EDITED_FILES}
    originals = {p: path.read_text() for p, path in paths.items() if path.is_file()}
    requirement, previous = read_pin(originals[PYPROJECT])
    constant = read_upstream_constant(originals[INIT])
    if constant != previous:
        outcome = Outcome(previous, previous, dry_run, action="failed")
        outcome.error = (
            f"{PYPROJECT} pins {previous} but UPSTREAM_VERSION in {INIT} is {constant}; "
            "make them agree first"
        )
        return outcome

    if to is not None:
        target = normalize_version(to)
    else:
        print(f"looking up the newest {UPSTREAM_DISTRIBUTION} on {index_url}", flush=True)
        target = normalize_version(newest_release(fetch_index(UPSTREAM_DISTRIBUTION, index_url)))
    outcome = Outcome(previous, target, dry_run)
    outcome.gpu_commands = gpu_gate_commands(previous, target, root)
    print(f"{UPSTREAM_DISTRIBUTION}: pinned {previous}, target {target}", flush=True)

    same = parse_version(target).key() == parse_version(previous).key()
    if same and not dry_run and not force:
        outcome.action = "up-to-date"
        return outcome
    if to is None and parse_version(target) < parse_version(previous) and not force:
        outcome.action = "up-to-date"  # the index is behind our pin; never downgrade silently
        return outcome

    new_pyproject = rewrite_pin(originals[PYPROJECT], target)
    new_init = rewrite_upstream_constant(originals[INIT], target)
    new_requirement, _ = read_pin(new_pyproject)
    if same:
        outcome.planned_edits = [f"nothing to bump: {PYPROJECT} already pins {requirement}"]
    else:
        outcome.planned_edits = [
            f"{PYPROJECT}: {requirement} -> {new_requirement}",
            f'{INIT}: UPSTREAM_VERSION = "{constant}" -> "{target}"',
            f"{LOCKFILE}: uv lock --upgrade-package {UPSTREAM_DISTRIBUTION}",
            f"{RECORD}: regenerated from {target}",
            f"{UPSTREAM_MD}: pinned release, upstream commit, symbols, history",
        ]

    if dry_run:
        outcome.action = "dry-run"
        print("dry run, no file is changed; the refresh would edit:", flush=True)
        for line in outcome.planned_edits:
            print("  " + line, flush=True)
        outcome.installed = _installed_upstream()
        if outcome.installed != target:
            print(
                f"the gates below run against the installed {UPSTREAM_DISTRIBUTION} "
                f"{outcome.installed}, not {target}",
                flush=True,
            )
        _check_fingerprint(root, outcome)
        if not skip_gate:
            _run_gate(outcome)
        return outcome

    def restore(reason: str, resync: bool = False) -> Outcome:
        for p, text in originals.items():
            paths[p].write_text(text)
        if resync:  # put the environment back on the restored lockfile
            run_command([uv, "sync", "--locked", "--inexact"], root)
        outcome.action = "failed"
        outcome.error = reason + " (edited files restored)"
        return outcome

    uv = _uv()
    paths[PYPROJECT].write_text(new_pyproject)
    paths[INIT].write_text(new_init)
    rc, output = run_command([uv, "lock", "--upgrade-package", UPSTREAM_DISTRIBUTION], root)
    if rc != 0:
        return restore(
            f"uv lock failed:\n{output.strip()}\nIf upstream's requirements moved (e.g. "
            f"nvidia-cutlass-dsl), move those pins in {PYPROJECT} too and run again."
        )
    rc, output = run_command([uv, "sync", "--locked", "--inexact"], root)
    if rc != 0:
        return restore(f"uv sync failed:\n{output.strip()}", resync=True)
    outcome.installed = _installed_upstream()
    if outcome.installed != target:
        return restore(
            f"after uv sync, {UPSTREAM_DISTRIBUTION} {outcome.installed} is installed", resync=True
        )

    current = _check_fingerprint(root, outcome)
    if current is not None:
        from flash_attn_vsa_tools import fingerprint

        fingerprint.write_record(current, paths[RECORD])
    if not skip_gate:
        _run_gate(outcome)

    outcome.upstream = resolve_upstream_commit(target)
    gate = outcome.gate
    gate_words = (
        "compile gate skipped"
        if gate is None
        else f"compile gate {sum(r['ok'] for r in gate['results'])}/{len(gate['results'])}"
    )
    history = (
        f"{datetime.date.today().isoformat()}: {previous} -> {target} "
        f"(fingerprint {outcome.fingerprint_status}, {gate_words}, GPU gates pending)"
    )
    paths[UPSTREAM_MD].write_text(
        update_upstream_md(
            originals[UPSTREAM_MD],
            target=target,
            requirement=new_requirement,
            alongside=alongside_requirements(new_pyproject),
            upstream=outcome.upstream,
            record=current,
            history=history,
        )
    )
    outcome.changed_files = [
        str(p) for p, path in paths.items() if path.is_file() and path.read_text() != originals[p]
    ]
    return outcome


# --------------------------------------------------------------------------------------------
# Output


def render_summary(outcome: Outcome) -> str:
    """Markdown for a pull request body or a job summary."""
    lines = [f"## {outcome.title}", ""]
    if outcome.action == "dry-run":
        lines += ["Dry run: no file was changed. The refresh would edit:", ""]
        lines += [f"- {e}" for e in outcome.planned_edits] + [""]
        if outcome.installed != outcome.target:
            lines += [
                f"The gates ran against the installed {outcome.installed}, not {outcome.target}.",
                "",
            ]
    if outcome.error:
        lines += ["### Error", "", "```", outcome.error, "```", ""]
    if outcome.upstream:
        tag, commit = outcome.upstream
        lines += [f"Upstream tag `{tag}` at `{commit}`.", ""]
    if outcome.fingerprint_status != "not run":
        lines += ["### API fingerprint", ""]
        if outcome.fingerprint_status == "unchanged":
            lines += ["Every upstream symbol we rely on is unchanged.", ""]
        else:
            lines += [
                "Review each change against our deltas in `UPSTREAM.md`:",
                "",
                "```",
                *outcome.fingerprint_diff,
                "```",
                "",
            ]
    if outcome.gate_text:
        lines += ["### Compile gate (sm_90a, CPU)", "", "```", outcome.gate_text, "```", ""]
    if outcome.gpu_commands and outcome.action != "up-to-date":
        lines += [
            "### GPU gates (before merging)",
            "",
            "On an H200 host with the offline bundle (`shared/gpu/README.md`):",
            "",
            "```bash",
            *outcome.gpu_commands,
            "```",
            "",
        ]
    if outcome.changed_files:
        lines += ["### Changed files", ""] + [f"- `{f}`" for f in outcome.changed_files] + [""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fa4-refresh",
        description="Move the exact flash-attn-4 pin of flash-attn-4-vsa and run the CPU gates.",
    )
    parser.add_argument("--to", metavar="VERSION", help="target release (default: newest)")
    parser.add_argument("--dry-run", action="store_true", help="change nothing; run the gates")
    parser.add_argument(
        "--force", action="store_true", help="refresh even when already at the target"
    )
    parser.add_argument("--skip-gate", action="store_true", help="do not run the compile gate")
    parser.add_argument("--index-url", default=INDEX_URL, help="PyPI JSON API base URL")
    parser.add_argument("--root", type=Path, help="workspace root (default: found from cwd)")
    parser.add_argument("--summary", type=Path, help="write a markdown summary here")
    parser.add_argument("--report", type=Path, help="write a JSON report here")
    args = parser.parse_args(argv)

    try:
        root = (args.root or find_workspace_root(Path.cwd())).resolve()
        outcome = refresh(
            root,
            to=args.to,
            dry_run=args.dry_run,
            force=args.force,
            skip_gate=args.skip_gate,
            index_url=args.index_url,
        )
    except (OSError, ValueError) as exc:
        print(f"fa4-refresh: {exc}", file=sys.stderr)
        return 2

    print()
    if outcome.error:
        print(f"fa4-refresh: {outcome.error}", file=sys.stderr)
    print(outcome.title)
    if outcome.action not in ("up-to-date", "failed"):
        print("\nNext, the GPU gates (H200 host, offline bundle, see shared/gpu/README.md):")
        for command in outcome.gpu_commands:
            print("  " + command)
    if outcome.changed_files:
        print("\nChanged: " + ", ".join(outcome.changed_files))
    if args.summary:
        args.summary.write_text(render_summary(outcome))
    if args.report:
        args.report.write_text(json.dumps(outcome.to_json(), indent=2) + "\n")
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())

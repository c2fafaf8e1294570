"""Reading and updating ``UPSTREAM.md``: the parts that tools write or check.

``UPSTREAM.md`` at the workspace root is written for people, but four parts of it are kept in
step with the code by tools:

- the table rows ``Pinned release``, ``Upstream commit`` and ``Pinned alongside`` (written by
  ``fa4-refresh``; the tests check them against ``pyproject.toml``),
- the list of upstream symbols, generated from the fingerprint record between
  :data:`SYMBOLS_BEGIN` and :data:`SYMBOLS_END`,
- the deltas table under ``## Our deltas``, generated from the registry in
  ``flash_attn_vsa_tools.deltas`` (which holds its rendering and its markers),
- the refresh history, one line per refresh, newest first, after :data:`HISTORY_MARKER`.

Pure text functions; nothing here imports upstream or touches the network.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SYMBOLS_BEGIN = "<!-- fa4-symbols:begin (generated from upstream_api.json, do not edit) -->"
SYMBOLS_END = "<!-- fa4-symbols:end -->"
HISTORY_MARKER = "<!-- fa4-refresh-history (newest first; fa4-refresh adds a line) -->"


# --------------------------------------------------------------------------------------------
# Generated symbols section


def _kind_cell(entry: dict[str, Any]) -> str:
    kind = str(entry.get("kind"))
    methods = entry.get("methods") or {}
    if methods:
        kind += " (" + ", ".join(f"`{m}`" for m in methods) + ")"
    if "source_sha256" in entry:
        kind += ", source hashed"
    return kind


def render_symbols_section(record: dict[str, Any]) -> str:
    """The markdown table of upstream symbols in ``record``, between the markers."""
    lines = [
        SYMBOLS_BEGIN,
        "",
        f"Recorded from `{record.get('distribution')}` {record.get('version')}; signatures and "
        "source hashes are in `tools/fa4-pin/src/flash_attn_vsa_tools/upstream_api.json`.",
        "",
        "| Upstream symbol | Kind | What we rely on it for |",
        "|---|---|---|",
    ]
    for entry in record.get("symbols", []):
        name = f"`{entry['module']}.{entry['name']}`"
        why = str(entry.get("why", "")).replace("|", "\\|")
        lines.append(f"| {name} | {_kind_cell(entry)} | {why} |")
    lines += ["", SYMBOLS_END]
    return "\n".join(lines)


def symbols_section(text: str) -> str | None:
    """The generated section of ``text`` (markers included), or None when it has none."""
    start = text.find(SYMBOLS_BEGIN)
    end = text.find(SYMBOLS_END)
    if start < 0 or end < start:
        return None
    return text[start : end + len(SYMBOLS_END)]


def replace_symbols_section(text: str, record: dict[str, Any]) -> str:
    current = symbols_section(text)
    if current is None:
        raise ValueError(f"UPSTREAM.md has no {SYMBOLS_BEGIN!r} ... {SYMBOLS_END!r} section")
    return text.replace(current, render_symbols_section(record), 1)


# --------------------------------------------------------------------------------------------
# Table rows of the header table


def table_row(text: str, label: str) -> str | None:
    """The value cell of the two-column row ``| label | value |``, or None."""
    match = re.search(rf"^\| {re.escape(label)} \| (.*) \|[ \t]*$", text, flags=re.MULTILINE)
    return match.group(1) if match else None


def set_table_row(text: str, label: str, value: str) -> str:
    """``text`` with the value cell of row ``label`` replaced; the row must exist once."""
    pattern = re.compile(rf"^\| {re.escape(label)} \| .* \|[ \t]*$", flags=re.MULTILINE)
    found = pattern.findall(text)
    if len(found) != 1:
        raise ValueError(f"expected one '| {label} | ... |' row in UPSTREAM.md, found {len(found)}")
    return pattern.sub(lambda _: f"| {label} | {value} |", text, count=1)


def pinned_release_cell(version: str, requirement: str) -> str:
    return f"`{version}` (`{requirement}` in `packages/flash-attn-4-vsa/pyproject.toml`)"


def upstream_commit_cell(version: str, tag: str | None, commit: str | None) -> str:
    if tag and commit:
        return f"`{commit}` (tag `{tag}`)"
    return (
        f"not recorded: the commit the upstream tag of {version} points to "
        "(upstream builds releases from tags `fa4-v<version>`, e.g. `fa4-v4.0.0.beta36` for "
        "`4.0.0b36`; `git ls-remote https://github.com/Dao-AILab/flash-attention "
        "'refs/tags/fa4-v*'` lists them)"
    )


def alongside_cell(requirements: list[str]) -> str:
    return ", ".join(f"`{r}`" for r in requirements)


# --------------------------------------------------------------------------------------------
# Refresh history


def add_history_line(text: str, line: str) -> str:
    """``text`` with ``- line`` added as the newest entry after :data:`HISTORY_MARKER`."""
    if HISTORY_MARKER not in text:
        raise ValueError(f"UPSTREAM.md has no {HISTORY_MARKER!r} marker")
    return text.replace(HISTORY_MARKER, f"{HISTORY_MARKER}\n- {line}", 1)


def workspace_upstream_md() -> Path | None:
    """UPSTREAM.md of the workspace this package is checked out in, if any."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "UPSTREAM.md"
        if candidate.is_file() and (parent / "packages" / "flash-attn-4-vsa").is_dir():
            return candidate
    return None

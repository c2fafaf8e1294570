"""Reading and updating ``UPSTREAM.md``: the parts that tools write or check.

``UPSTREAM.md`` at the workspace root is written for people, but four parts of it are kept in
step with the code by tools:

- the table rows ``Pinned release``, ``Upstream commit`` and ``Pinned alongside`` (written by
  ``fa4-refresh``; the tests check them against ``pyproject.toml``),
- the list of upstream symbols, generated from the fingerprint record between
  :data:`SYMBOLS_BEGIN` and :data:`SYMBOLS_END`,
- the deltas table under ``## Our deltas`` (written by hand, one row per delta, parsed by
  :func:`parse_deltas` so that tests can check each row),
- the refresh history, one line per refresh, newest first, after :data:`HISTORY_MARKER`.

Pure text functions; nothing here imports upstream or touches the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SYMBOLS_BEGIN = "<!-- fa4-symbols:begin (generated from upstream_api.json, do not edit) -->"
SYMBOLS_END = "<!-- fa4-symbols:end -->"
HISTORY_MARKER = "<!-- fa4-refresh-history (newest first; fa4-refresh adds a line) -->"
DELTAS_HEADING = "## Our deltas"
DELTA_COLUMNS = ("Delta", "Our file", "Builds on (upstream)", "Arch", "Offered upstream")


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
        "source hashes are in `packages/flash-attn-4-vsa/src/flash_attn_vsa/upstream_api.json`.",
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
# Deltas table


@dataclass(frozen=True)
class Delta:
    """One row of the deltas table."""

    name: str
    file: str
    builds_on: str
    arch: str
    offered_upstream: str


def _strip_code(cell: str) -> str:
    cell = cell.strip()
    if len(cell) >= 2 and cell.startswith("`") and cell.endswith("`"):
        return cell[1:-1]
    return cell


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^{re.escape(heading)}[ \t]*$", text, flags=re.MULTILINE)
    if match is None:
        raise ValueError(f"UPSTREAM.md has no '{heading}' section")
    body = text[match.end() :]
    following = re.search(r"^## ", body, flags=re.MULTILINE)
    return body[: following.start()] if following else body


def parse_deltas(text: str) -> list[Delta]:
    """The rows of the deltas table under ``## Our deltas`` (code blocks are skipped).

    Raises ValueError when the table header is missing or a row does not have the five
    columns of :data:`DELTA_COLUMNS`.
    """
    section = _section(text, DELTAS_HEADING)
    in_fence = False
    header_seen = False
    deltas: list[Delta] = []
    for line in section.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or not stripped.startswith("|"):
            continue
        cells = [c.strip() for c in stripped.strip("|").split("|")]
        if not header_seen:
            if tuple(cells) != DELTA_COLUMNS:
                raise ValueError(
                    f"the deltas table header must be | {' | '.join(DELTA_COLUMNS)} |, "
                    f"found {stripped}"
                )
            header_seen = True
            continue
        if set(stripped.replace("|", "").strip()) <= {"-", ":", " "}:
            continue  # the separator row
        if len(cells) != len(DELTA_COLUMNS) or not all(cells):
            raise ValueError(f"a deltas row needs {len(DELTA_COLUMNS)} non-empty cells: {line}")
        deltas.append(Delta(*(_strip_code(c) for c in cells)))
    if not header_seen:
        raise ValueError("UPSTREAM.md has no deltas table under '## Our deltas'")
    return deltas


# --------------------------------------------------------------------------------------------
# Refresh history


def add_history_line(text: str, line: str) -> str:
    """``text`` with ``- line`` added as the newest entry after :data:`HISTORY_MARKER`."""
    if HISTORY_MARKER not in text:
        raise ValueError(f"UPSTREAM.md has no {HISTORY_MARKER!r} marker")
    return text.replace(HISTORY_MARKER, f"{HISTORY_MARKER}\n- {line}", 1)

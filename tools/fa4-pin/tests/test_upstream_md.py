"""UPSTREAM.md stays in step with the code: pin rows, generated symbols list (the deltas table:
`test_deltas.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import flash_attn_vsa
from flash_attn_vsa_tools import fingerprint as fp
from flash_attn_vsa_tools import refresh
from flash_attn_vsa_tools import upstream_md as md

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM_MD = ROOT / "UPSTREAM.md"
PACKAGE = ROOT / "packages" / "flash-attn-4-vsa"

pytestmark = pytest.mark.skipif(
    not UPSTREAM_MD.is_file(), reason="not in a workspace checkout (no UPSTREAM.md)"
)


def _text() -> str:
    return UPSTREAM_MD.read_text()


def test_pinned_release_row_matches_pyproject_and_constant():
    requirement, version = refresh.read_pin((PACKAGE / "pyproject.toml").read_text())
    assert version == flash_attn_vsa.UPSTREAM_VERSION
    assert md.table_row(_text(), "Pinned release") == md.pinned_release_cell(version, requirement)


def test_pinned_alongside_row_matches_pyproject():
    pyproject = (PACKAGE / "pyproject.toml").read_text()
    expected = md.alongside_cell(refresh.alongside_requirements(pyproject))
    assert md.table_row(_text(), "Pinned alongside") == expected


def test_upstream_commit_row_is_present():
    cell = md.table_row(_text(), "Upstream commit")
    assert cell, "UPSTREAM.md lacks the 'Upstream commit' row"


def test_symbols_section_is_generated_from_the_record():
    section = md.symbols_section(_text())
    assert section is not None
    assert section == md.render_symbols_section(fp.load_record()), (
        f"UPSTREAM.md's symbols list is stale: {fp.REGENERATE_COMMAND}"
    )


def test_history_marker_is_present():
    assert md.HISTORY_MARKER in _text()


# The parsers on synthetic text.


def test_table_rows_and_history():
    text = "| | |\n|---|---|\n| Pinned release | `1` |\n\n" + md.HISTORY_MARKER + "\n- old\n"
    assert md.table_row(text, "Pinned release") == "`1`"
    changed = md.set_table_row(text, "Pinned release", "`2`")
    assert md.table_row(changed, "Pinned release") == "`2`"
    with pytest.raises(ValueError, match="found 0"):
        md.set_table_row(text, "Upstream commit", "x")
    assert md.add_history_line(text, "new").endswith(md.HISTORY_MARKER + "\n- new\n- old\n")


def test_commit_cell_with_and_without_a_resolved_tag():
    assert md.upstream_commit_cell("4.0.0b37", "fa4-v4.0.0.beta37", "ab" * 20) == (
        f"`{'ab' * 20}` (tag `fa4-v4.0.0.beta37`)"
    )
    assert "git ls-remote" in md.upstream_commit_cell("4.0.0b37", None, None)

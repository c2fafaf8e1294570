"""UPSTREAM.md stays in step with the code: pin rows, generated symbols list, deltas table."""

from __future__ import annotations

from pathlib import Path

import pytest

import flash_attn_vsa
from flash_attn_vsa import fingerprint as fp
from flash_attn_vsa import refresh
from flash_attn_vsa import upstream_md as md

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


def test_deltas_table_rows_are_complete_and_fingerprinted():
    record = {f"{e['module']}.{e['name']}": e for e in fp.load_record()["symbols"]}
    for delta in md.parse_deltas(_text()):
        assert (PACKAGE / delta.file).is_file(), f"{delta.name}: no file {delta.file}"
        assert delta.builds_on in record, (
            f"{delta.name} builds on {delta.builds_on}, which is not in the fingerprint: add it "
            f"to SYMBOLS (source=True) and run {fp.REGENERATE_COMMAND}"
        )
        assert "source_sha256" in record[delta.builds_on], (
            f"{delta.name} builds on {delta.builds_on}: track its source (source=True)"
        )
        assert delta.arch.startswith("sm_"), f"{delta.name}: arch {delta.arch!r}"


def test_history_marker_is_present():
    assert md.HISTORY_MARKER in _text()


# The parsers on synthetic text.

_ROW = (
    "| KV64 backward | `src/flash_attn_vsa/bwd.py` "
    "| `flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90` | sm_90 | no |"
)

_DELTAS = f"""# x

## Our deltas

Format:

```
| Delta | Our file | Builds on (upstream) | Arch | Offered upstream |
| not | a | real | row | here |
```

| Delta | Our file | Builds on (upstream) | Arch | Offered upstream |
|---|---|---|---|---|
{_ROW}

## Next section

| Delta | ignored |
"""


def test_parse_deltas_reads_rows_and_skips_code_blocks():
    assert md.parse_deltas(_DELTAS) == [
        md.Delta(
            "KV64 backward",
            "src/flash_attn_vsa/bwd.py",
            "flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90",
            "sm_90",
            "no",
        )
    ]


def test_parse_deltas_rejects_bad_tables():
    with pytest.raises(ValueError, match="non-empty cells"):
        md.parse_deltas(_DELTAS.replace("| sm_90 | no |", "| sm_90 |"))
    with pytest.raises(ValueError, match="header"):
        md.parse_deltas(
            _DELTAS.replace("| Delta | Our file | Builds on (upstream) |", "| A | B | C |")
        )
    with pytest.raises(ValueError, match="no deltas table"):
        md.parse_deltas("## Our deltas\n\nNone.\n")
    with pytest.raises(ValueError, match="no '## Our deltas'"):
        md.parse_deltas("# nothing\n")


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

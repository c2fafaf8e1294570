"""The registry of kernel deltas (`flash_attn_vsa_tools.deltas`) against the package, the
fingerprint, the docstrings and UPSTREAM.md's generated table, so that prose cannot drift from
code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import flash_attn_vsa
from flash_attn_vsa_tools import deltas
from flash_attn_vsa_tools import fingerprint as fp

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM_MD = ROOT / "UPSTREAM.md"
SOURCE = Path(flash_attn_vsa.__file__).resolve().parent
PACKAGE_DIR = ROOT / "packages" / "flash-attn-4-vsa"
"""The fork's source tree (the package may be installed elsewhere, as CI's lowest/latest
jobs install it)."""


def _package_modules() -> set[str]:
    """Every module of ``flash_attn_vsa`` but the package ``__init__`` files, dotted below the
    package (``"experimental.bwd_configs"``)."""
    return {
        ".".join(p.relative_to(SOURCE).with_suffix("").parts)
        for p in SOURCE.rglob("*.py")
        if p.stem != "__init__"
    }


def test_every_module_of_the_package_is_in_the_registry():
    modules = _package_modules()
    registered = [
        *(d.module for d in deltas.DELTAS),
        *deltas.SUPPORT,
        *deltas.EXPERIMENTS,
        *deltas.TOOLING,
    ]
    assert len(registered) == len(set(registered)), registered
    missing = sorted(modules - set(registered))
    assert not missing, f"modules missing from flash_attn_vsa_tools.deltas: {missing}"
    assert sorted(set(registered) - modules) == [], "registry entries without a module"


def test_pin_tools_are_the_tools_package():
    # the source tree's files (CI's lowest/latest jobs install the package, not editable)
    tools = ROOT / deltas.TOOLS_SOURCE
    assert tools.is_dir(), tools
    modules = {p.stem for p in tools.glob("*.py") if p.stem != "__init__"}
    assert modules == set(deltas.PIN_TOOLS)
    assert not set(deltas.PIN_TOOLS) & {m.rpartition(".")[2] for m in _package_modules()}


def test_the_package_is_laid_out_by_lifecycle():
    """Experimental deltas and the experiments' modules in ``flash_attn_vsa.experimental``,
    shipped deltas and what they share at the package's top."""
    prefix = deltas.EXPERIMENTAL_PACKAGE + "."
    for d in deltas.DELTAS:
        assert d.module.startswith(prefix) == (d.status == "experimental"), d
    assert all(name.startswith(prefix) for name in deltas.EXPERIMENTS)
    assert not any(name.startswith(prefix) for name in [*deltas.SUPPORT, *deltas.TOOLING])


def test_deltas_are_numbered_and_well_formed():
    assert [d.number for d in deltas.DELTAS] == list(range(1, len(deltas.DELTAS) + 1))
    for d in deltas.DELTAS:
        assert d.status in ("shipped", "experimental"), d
        assert d.arch.startswith("sm_"), d
        assert d.routed and d.title, d
        assert (PACKAGE_DIR / d.file).is_file(), d.file
    assert deltas.by_module()["q_regs_sm90"].status == "shipped"


def test_every_delta_builds_on_a_fingerprinted_source():
    record = {f"{e['module']}.{e['name']}": e for e in fp.load_record()["symbols"]}
    for d in deltas.DELTAS:
        assert d.builds_on in record, (
            f"{d.module} builds on {d.builds_on}, which is not in the fingerprint: add it to "
            f"SYMBOLS (source=True) and run {fp.REGENERATE_COMMAND}"
        )
        assert "source_sha256" in record[d.builds_on], (
            f"{d.module} builds on {d.builds_on}: track its source (source=True)"
        )


def _first_paragraph(module: str) -> str:
    """The first paragraph of the module's docstring, read without importing it."""
    path = PACKAGE_DIR / deltas.module_file(module)
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


@pytest.mark.parametrize("delta", deltas.DELTAS, ids=lambda d: d.module)
def test_module_docstring_states_the_registry_status(delta):
    head = _first_paragraph(delta.module).lower()
    if delta.status == "experimental":
        assert "experimental" in head, head
    else:
        for stale in ("experimental", "not routed", "not yet run", "does not route"):
            assert stale not in head, f"{delta.module} is shipped, its docstring says {stale!r}"


def test_package_docstring_lists_shipped_and_experimental_deltas_as_the_registry():
    doc = flash_attn_vsa.__doc__ or ""
    shipped_part = doc.split("Shipped", 1)[1].split("Experimental", 1)[0]
    experimental_part = doc.split("Experimental", 1)[1].split("\n\n", 1)[0]
    named = re.compile(r"``flash_attn_vsa\.([\w.]+)``")
    modules = {d.module for d in deltas.DELTAS}  # the deltas named, not other modules
    assert set(named.findall(shipped_part)) & modules == {
        d.module for d in deltas.DELTAS if d.status == "shipped"
    }
    assert set(named.findall(experimental_part)) & modules == {
        d.module for d in deltas.DELTAS if d.status == "experimental"
    }


@pytest.mark.skipif(not UPSTREAM_MD.is_file(), reason="not in a workspace checkout")
def test_upstream_md_table_is_generated_from_the_registry():
    section = deltas.table_section(UPSTREAM_MD.read_text())
    assert section is not None, "UPSTREAM.md has no generated deltas table"
    assert section == deltas.render_table(), (
        f"UPSTREAM.md's deltas table differs from flash_attn_vsa_tools.deltas: {deltas.COMMAND}"
    )


def test_check_and_write_on_a_copy(tmp_path, capsys):
    doc = tmp_path / "UPSTREAM.md"
    doc.write_text(f"# x\n\n{deltas.TABLE_BEGIN}\n| stale |\n{deltas.TABLE_END}\n\nafter\n")
    assert deltas.main(["--check", "--path", str(doc)]) == 1
    assert deltas.main(["--write", "--path", str(doc)]) == 0
    assert deltas.main(["--check", "--path", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# x\n\n") and text.endswith("\n\nafter\n")
    assert "| 8 | KV64 backward, dQ sent in parts" in text
    doc.write_text("# no table\n")
    with pytest.raises(ValueError, match="no"):
        deltas.main(["--check", "--path", str(doc)])
    capsys.readouterr()

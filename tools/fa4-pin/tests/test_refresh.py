"""fa4-refresh without network: versions, file rewrites and the whole flow on a temp workspace.

The flow tests copy the real files into a temporary workspace and replace the index lookup,
``uv``, the fingerprint subprocess and the compile gate with stand-ins, so nothing here touches
the network, the real pin or the real lockfile.
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import flash_attn_vsa
from flash_attn_vsa import compile_gate
from flash_attn_vsa_tools import deltas, fingerprint, refresh
from flash_attn_vsa_tools import upstream_md as md

ROOT = Path(__file__).resolve().parents[3]
IN_CHECKOUT = (ROOT / "UPSTREAM.md").is_file()
checkout_only = pytest.mark.skipif(not IN_CHECKOUT, reason="needs the workspace checkout")


# --------------------------------------------------------------------------------------------
# Versions


@pytest.mark.parametrize(
    ("lower", "higher"),
    [
        ("4.0.0b4", "4.0.0b36"),  # numeric, not lexicographic
        ("4.0.0b36", "4.0.0rc1"),
        ("4.0.0rc1", "4.0.0"),
        ("4.0.0", "4.0.0.post1"),
        ("4.0.0.dev1", "4.0.0a1"),
        ("4.0.0a1", "4.0.0a1.post1"),
        ("4.0.0b36.dev2", "4.0.0b36"),
        ("4.0.0", "4.0.1b1"),
        ("4.0.9", "4.0.10"),
        ("9.9", "1!0.1"),
    ],
)
def test_version_order(lower, higher):
    assert refresh.parse_version(lower) < refresh.parse_version(higher)
    assert refresh.parse_version(higher) > refresh.parse_version(lower)


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("4.0.0b36", "4.0.0b36"),
        ("4.0.0.beta36", "4.0.0b36"),
        ("v4.0.0-beta.36", "4.0.0b36"),
        ("4.0.0RC1", "4.0.0rc1"),
        ("4.0.0c1", "4.0.0rc1"),
        ("4.0.0-1", "4.0.0.post1"),
        ("4.0.0.alpha", "4.0.0a0"),
        ("4.0.0dev3", "4.0.0.dev3"),
    ],
)
def test_version_normalization(text, normal):
    assert refresh.normalize_version(text) == normal


def test_versions_equal_across_spellings_and_trailing_zeros():
    v = refresh.parse_version
    assert v("4.0.0.beta36").key() == v("4.0.0b36").key()
    assert v("1.0").key() == v("1.0.0").key()
    assert v("4.0.0b36").is_prerelease and not v("4.0.0").is_prerelease


@pytest.mark.parametrize("bad", ["", "four", "4.0.0-beta-x", "4..0"])
def test_bad_versions_are_refused(bad):
    with pytest.raises(ValueError, match="PEP 440"):
        refresh.parse_version(bad)


def _file(yanked: bool = False) -> dict:
    return {"filename": "x.whl", "yanked": yanked}


def test_newest_release_counts_betas_and_skips_yanked_empty_and_junk():
    index = {
        "releases": {
            "4.0.0b4": [_file()],
            "4.0.0b36": [_file()],
            "4.0.0b9": [_file()],
            "4.0.0b37": [_file(yanked=True)],
            "4.0.0b38": [],
            "not-a-version": [_file()],
        }
    }
    assert refresh.newest_release(index) == "4.0.0b36"
    index["releases"]["4.0.0"] = [_file(), _file(yanked=True)]
    assert refresh.newest_release(index) == "4.0.0"
    with pytest.raises(ValueError, match="no usable release"):
        refresh.newest_release({"releases": {"1.0": []}})


# --------------------------------------------------------------------------------------------
# Files


@checkout_only
def test_pin_rewrite_on_a_copy_of_the_real_pyproject(tmp_path):
    original = (ROOT / refresh.PYPROJECT).read_text()
    copy = tmp_path / "pyproject.toml"
    copy.write_text(original)

    requirement, version = refresh.read_pin(copy.read_text())
    assert version == flash_attn_vsa.UPSTREAM_VERSION
    assert requirement == f"flash-attn-4[cu13]=={version}"

    copy.write_text(refresh.rewrite_pin(copy.read_text(), "4.0.0b99"))
    new = copy.read_text()
    assert refresh.read_pin(new) == ("flash-attn-4[cu13]==4.0.0b99", "4.0.0b99")
    changed = [
        (a, b) for a, b in zip(original.splitlines(), new.splitlines(), strict=True) if a != b
    ]
    assert changed == [(f'    "{requirement}",', '    "flash-attn-4[cu13]==4.0.0b99",')]
    assert (ROOT / refresh.PYPROJECT).read_text() == original


def test_pin_must_be_exact_and_unique():
    assert refresh.read_pin('"flash-attn-4==1.0"') == ("flash-attn-4==1.0", "1.0")
    # The fork's own name, or a range, is not the pin.
    with pytest.raises(ValueError, match="found 0"):
        refresh.read_pin('"flash-attn-4-vsa==1.0", "flash-attn-4>=1.0"')
    with pytest.raises(ValueError, match="found 2"):
        refresh.read_pin('"flash-attn-4==1.0", "flash-attn-4[cu13]==1.0"')


@checkout_only
def test_constant_rewrite_on_the_real_init():
    text = (ROOT / refresh.INIT).read_text()
    assert refresh.read_upstream_constant(text) == flash_attn_vsa.UPSTREAM_VERSION
    new = refresh.rewrite_upstream_constant(text, "4.0.0b99")
    assert refresh.read_upstream_constant(new) == "4.0.0b99"
    assert len(new.splitlines()) == len(text.splitlines())
    with pytest.raises(ValueError):
        refresh.read_upstream_constant("x = 1\n")


@checkout_only
def test_dependencies_of_the_real_pyproject():
    text = (ROOT / refresh.PYPROJECT).read_text()
    deps = refresh.read_dependencies(text)
    assert f"flash-attn-4[cu13]=={flash_attn_vsa.UPSTREAM_VERSION}" in deps
    alongside = refresh.alongside_requirements(text)
    assert not any(r.startswith(("torch>", "torch=", "flash-attn-4[")) for r in alongside)
    assert any(r.startswith("nvidia-cutlass-dsl") for r in alongside)


LS_REMOTE = """\
1111111111111111111111111111111111111111\trefs/tags/fa4-v4.0.0.beta35
2222222222222222222222222222222222222222\trefs/tags/fa4-v4.0.0.beta36
3333333333333333333333333333333333333333\trefs/tags/fa4-v4.0.0.beta36^{}
4444444444444444444444444444444444444444\trefs/tags/fa4-v4.0.0.beta4
5555555555555555555555555555555555555555\trefs/tags/v2.8.3
"""


def test_match_tag_follows_pep440_spelling_and_peels_annotated_tags():
    assert refresh.match_tag(LS_REMOTE, "4.0.0b36") == ("fa4-v4.0.0.beta36", "3" * 40)
    assert refresh.match_tag(LS_REMOTE, "4.0.0b35") == ("fa4-v4.0.0.beta35", "1" * 40)
    assert refresh.match_tag(LS_REMOTE, "4.0.0b4") == ("fa4-v4.0.0.beta4", "4" * 40)
    assert refresh.match_tag(LS_REMOTE, "2.8.3") is None
    assert refresh.match_tag("", "4.0.0b36") is None


def test_gpu_gate_commands_name_the_tests_and_both_pins(tmp_path):
    commands = refresh.gpu_gate_commands("4.0.0b36", "4.0.0b37", tmp_path)
    assert commands[0] == "python3 -m pytest -m gpu packages/flash-attn-4-vsa packages/vsa-fa4"
    text = "\n".join(commands)
    assert "4.0.0b36" in text and "4.0.0b37" in text
    assert "not written yet" in text  # tmp_path has no benchmark script


@checkout_only
def test_update_upstream_md_on_a_copy_of_the_real_file():
    text = (ROOT / "UPSTREAM.md").read_text()
    record = fingerprint.load_record()
    record = {**record, "version": "4.0.0b99"}
    new = refresh.update_upstream_md(
        text,
        target="4.0.0b99",
        requirement="flash-attn-4[cu13]==4.0.0b99",
        alongside=["nvidia-cutlass-dsl[cu13]==9.9"],
        upstream=("fa4-v4.0.0.beta99", "f" * 40),
        record=record,
        history="2030-01-01: 4.0.0b36 -> 4.0.0b99 (test)",
    )
    assert md.table_row(new, "Pinned release") == md.pinned_release_cell(
        "4.0.0b99", "flash-attn-4[cu13]==4.0.0b99"
    )
    assert md.table_row(new, "Upstream commit") == f"`{'f' * 40}` (tag `fa4-v4.0.0.beta99`)"
    assert md.table_row(new, "Pinned alongside") == "`nvidia-cutlass-dsl[cu13]==9.9`"
    assert "Recorded from `flash-attn-4` 4.0.0b99" in md.symbols_section(new)
    assert f"{md.HISTORY_MARKER}\n- 2030-01-01: 4.0.0b36 -> 4.0.0b99 (test)\n- " in new
    assert deltas.table_section(new) == deltas.table_section(text)
    # Nothing else moved.
    assert new.count("\n") == text.count("\n") + 1


# --------------------------------------------------------------------------------------------
# The whole flow, on a temporary workspace


@pytest.fixture
def workspace(tmp_path):
    if not IN_CHECKOUT:
        pytest.skip("needs the workspace checkout")
    for rel in (refresh.PYPROJECT, refresh.INIT, refresh.RECORD, refresh.UPSTREAM_MD):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    (tmp_path / "pyproject.toml").write_text('[tool.uv.workspace]\nmembers = ["packages/*"]\n')
    (tmp_path / "uv.lock").write_text('name = "flash-attn-4"\nversion = "4.0.0b36"\n')
    return tmp_path


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


class Stand:
    """Stand-ins for the network, uv, the fingerprint subprocess and the gate."""

    def __init__(self, monkeypatch, root: Path, *, newest: str = "4.0.0b37", moved: bool = False):
        self.root = root
        self.commands: list[list[str]] = []
        self.lock_fails = False
        self.gate_ok = True
        self.installed = flash_attn_vsa.UPSTREAM_VERSION
        self.newest = newest
        self.moved = moved
        monkeypatch.setattr(refresh, "fetch_index", self.fetch_index)
        monkeypatch.setattr(refresh, "run_command", self.run_command)
        monkeypatch.setattr(refresh, "_installed_upstream", lambda: self.installed)
        monkeypatch.setattr(refresh, "_uv", lambda: "uv")
        monkeypatch.setattr(refresh, "resolve_upstream_commit", self.resolve)
        monkeypatch.setattr(fingerprint, "current_record_subprocess", self.fingerprint)
        monkeypatch.setattr(compile_gate, "run_gate", self.gate)

    def fetch_index(self, name, index_url=refresh.INDEX_URL, timeout=30.0):
        assert name == "flash-attn-4"
        return {"releases": {"4.0.0b36": [_file()], self.newest: [_file()]}}

    def run_command(self, cmd, cwd):
        self.commands.append(list(cmd))
        if cmd[1] == "lock":
            if self.lock_fails:
                return 1, "No solution found: nvidia-cutlass-dsl>=9 is required"
            pin = refresh.read_pin((self.root / refresh.PYPROJECT).read_text())[1]
            (self.root / "uv.lock").write_text(f'name = "flash-attn-4"\nversion = "{pin}"\n')
        if cmd[1] == "sync":
            self.installed = refresh.read_pin((self.root / refresh.PYPROJECT).read_text())[1]
        return 0, ""

    def resolve(self, version, timeout=60.0):
        return (f"fa4-v{version}", "c" * 40)

    def fingerprint(self, timeout=600.0):
        record = json.loads((self.root / refresh.RECORD).read_text())
        record["version"] = self.installed
        if self.moved:
            record["symbols"][0]["parameters"] = record["symbols"][0]["parameters"][1:]
        return record

    def gate(self, configs=None, **kwargs):
        result = compile_gate.GateResult("fwd-dense", self.gate_ok, 2.0, ["K"])
        return compile_gate.GateReport("sm_90a", [result], {"flash-attn-4": self.installed}, 9.0)


def test_refresh_bumps_relocks_checks_and_records(workspace, monkeypatch):
    stand = Stand(monkeypatch, workspace)
    outcome = refresh.refresh(workspace, to=None, dry_run=False)

    assert (outcome.previous, outcome.target, outcome.action) == (
        "4.0.0b36",
        "4.0.0b37",
        "refreshed",
    )
    assert stand.commands == [
        ["uv", "lock", "--upgrade-package", "flash-attn-4"],
        ["uv", "sync", "--locked", "--inexact"],
    ]
    assert refresh.read_pin((workspace / refresh.PYPROJECT).read_text())[1] == "4.0.0b37"
    assert refresh.read_upstream_constant((workspace / refresh.INIT).read_text()) == "4.0.0b37"
    assert json.loads((workspace / refresh.RECORD).read_text())["version"] == "4.0.0b37"
    text = (workspace / "UPSTREAM.md").read_text()
    assert "`4.0.0b37` (`flash-attn-4[cu13]==4.0.0b37`" in text
    assert f"`{'c' * 40}` (tag `fa4-v4.0.0b37`)" in text
    assert (
        "4.0.0b36 -> 4.0.0b37 (fingerprint unchanged, compile gate 1/1, GPU gates pending)" in text
    )
    assert md.symbols_section(text) == md.render_symbols_section(
        json.loads((workspace / refresh.RECORD).read_text())
    )
    assert set(outcome.changed_files) == {str(p) for p in refresh.EDITED_FILES}
    assert outcome.fingerprint_status == "unchanged"
    assert outcome.exit_code == 0
    assert outcome.title == "flash-attn-4 4.0.0b36 -> 4.0.0b37 (CPU gates passed)"
    summary = refresh.render_summary(outcome)
    assert "Every upstream symbol we rely on is unchanged." in summary
    assert "python3 -m pytest -m gpu packages/flash-attn-4-vsa packages/vsa-fa4" in summary


def test_refresh_reports_a_moved_api_and_a_failed_gate(workspace, monkeypatch):
    stand = Stand(monkeypatch, workspace, moved=True)
    stand.gate_ok = False
    outcome = refresh.refresh(workspace, to="4.0.0.beta40", dry_run=False)

    assert outcome.target == "4.0.0b40"
    assert outcome.fingerprint_status == "moved"
    assert any("parameter removed: q:" in line for line in outcome.fingerprint_diff)
    assert outcome.exit_code == 1
    assert "upstream API moved" in outcome.title
    summary = refresh.render_summary(outcome)
    assert "parameter removed: q:" in summary and "### Compile gate" in summary
    # The regenerated record is the moved one, ready for review in the pull request.
    record = json.loads((workspace / refresh.RECORD).read_text())
    assert not record["symbols"][0]["parameters"][0].startswith("q:")


def test_failed_relock_restores_every_file(workspace, monkeypatch):
    stand = Stand(monkeypatch, workspace)
    stand.lock_fails = True
    before = _snapshot(workspace)
    outcome = refresh.refresh(workspace, to="4.0.0b37", dry_run=False)
    assert outcome.action == "failed" and outcome.exit_code == 2
    assert "nvidia-cutlass-dsl" in outcome.error and "restored" in outcome.error
    assert _snapshot(workspace) == before


def test_dry_run_changes_nothing_and_runs_the_gates(workspace, monkeypatch):
    stand = Stand(monkeypatch, workspace)
    before = _snapshot(workspace)
    outcome = refresh.refresh(workspace, to=None, dry_run=True)
    assert outcome.action == "dry-run"
    assert stand.commands == []
    assert _snapshot(workspace) == before
    assert outcome.fingerprint_status == "unchanged"
    assert outcome.gate is not None and outcome.gate["ok"]
    assert any("flash-attn-4[cu13]==4.0.0b37" in e for e in outcome.planned_edits)
    summary = refresh.render_summary(outcome)
    assert "Dry run: no file was changed" in summary
    assert "not 4.0.0b37" in summary  # the gates ran on the installed pin


def test_dry_run_against_the_current_pin(workspace, monkeypatch):
    Stand(monkeypatch, workspace, newest="4.0.0b36")
    outcome = refresh.refresh(workspace, to=None, dry_run=True)
    assert (outcome.previous, outcome.target) == ("4.0.0b36", "4.0.0b36")
    assert outcome.planned_edits[0].startswith("nothing to bump")
    assert outcome.exit_code == 0


def test_up_to_date_does_nothing(workspace, monkeypatch):
    stand = Stand(monkeypatch, workspace, newest="4.0.0b35")  # index behind the pin
    before = _snapshot(workspace)
    assert refresh.refresh(workspace, to=None, dry_run=False).action == "up-to-date"
    assert refresh.refresh(workspace, to="4.0.0b36", dry_run=False).action == "up-to-date"
    assert stand.commands == []
    assert _snapshot(workspace) == before


def test_main_writes_summary_and_report(workspace, monkeypatch, capsys):
    Stand(monkeypatch, workspace)
    summary, report = workspace / "summary.md", workspace / "report.json"
    code = refresh.main(
        ["--root", str(workspace), "--dry-run", "--summary", str(summary), "--report", str(report)]
    )
    assert code == 0
    data = json.loads(report.read_text())
    assert data["action"] == "dry-run" and data["target"] == "4.0.0b37"
    assert data["exit_code"] == 0 and data["title"].startswith("dry run: ")
    assert summary.read_text().startswith("## dry run: flash-attn-4 4.0.0b36 -> 4.0.0b37")
    out = capsys.readouterr().out
    assert "Next, the GPU gates" in out


def test_main_outside_a_workspace(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert refresh.main([]) == 2
    assert "run fa4-refresh in a checkout" in capsys.readouterr().err


def test_console_script_is_declared():
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("fa4-refresh") == "flash_attn_vsa_tools.refresh:main"

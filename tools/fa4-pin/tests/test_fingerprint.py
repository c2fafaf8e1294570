"""The upstream API fingerprint: computation, readable differences, and the installed upstream.

Everything but the last test works on small synthetic modules and runs in a few milliseconds;
the last one computes the fingerprint of the installed flash-attn-4 in a subprocess (about
10 s: importing ``flash_attn.cute`` imports torch, cutlass and quack).
"""

from __future__ import annotations

import itertools
import json
import textwrap

import pytest

from flash_attn_vsa import upstream_version
from flash_attn_vsa_tools import fingerprint as fp

_COUNTER = itertools.count()

V1 = """
from dataclasses import dataclass
from typing import NamedTuple, Optional

LIMIT = 128

def entry(q, k, v, *, block: Optional[int] = None, scale: float = 1.0) -> int:
    return 0

def helper(a, b=2):
    return a + b

class Index(NamedTuple):
    count: int
    idx: int
    size: Optional[tuple] = None

@dataclass(frozen=True)
class Config:
    tile_m: int
    tile_n: int = 128

class Base:
    def __init__(self, dtype, head_dim: int = 128):
        pass

class Kernel(Base):
    def __init__(self, *args, overlap: bool = True, **kwargs):
        pass

    def __call__(self, mQ, mK, stream=None):
        pass
"""

# What an upstream release could do to the same names.
V2 = """
from dataclasses import dataclass
from typing import NamedTuple, Optional

LIMIT = 256

def entry(k, q, v, *, block: Optional[int] = 64, causal: bool = False) -> int:
    return 0

def helper(a, b=2):
    return a * b

class Index(NamedTuple):
    count: int
    idx: int
    size: Optional[tuple] = None
    order: Optional[int] = None

@dataclass(frozen=True)
class Config:
    tile_m: int
    tile_n: int = 128

class Base:
    def __init__(self, dtype, head_dim: int = 128):
        pass

class Kernel:
    def __init__(self, *args, overlap: bool = True, **kwargs):
        pass
"""


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """Write ``source`` as a fresh importable module and return its name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str) -> str:
        name = f"fa4_fingerprint_fake_{next(_COUNTER)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return make


def _symbols(module: str) -> list[fp.Symbol]:
    return [
        fp.Symbol(module, "LIMIT", "a constant"),
        fp.Symbol(module, "entry", "the entry point"),
        fp.Symbol(module, "helper", "a helper whose behaviour we assume", source=True),
        fp.Symbol(module, "Index", "index tensors"),
        fp.Symbol(module, "Config", "tile config"),
        fp.Symbol(module, "Kernel", "kernel class", methods=("__init__", "__call__")),
    ]


def _record(module: str, version: str = "1.0") -> dict:
    return fp.compute_record(_symbols(module), distribution="fake", version=version)


def _by_name(record: dict) -> dict:
    return {e["name"]: e for e in record["symbols"]}


def test_entries_hold_kind_signature_fields_methods_and_source(make_module):
    entries = _by_name(_record(make_module(V1)))

    assert entries["LIMIT"]["kind"] == "value"
    assert entries["LIMIT"]["value"] == "128"

    entry = entries["entry"]
    assert entry["kind"] == "function"
    assert entry["parameters"] == [
        "q",
        "k",
        "v",
        "*",
        "block: Optional[int] = None",
        "scale: float = 1.0",
    ]
    assert entry["returns"] == "int"
    assert "source_sha256" not in entry

    assert entries["helper"]["source_sha256"] and len(entries["helper"]["source_sha256"]) == 16

    assert entries["Index"]["kind"] == "namedtuple"
    assert entries["Index"]["fields"] == ["count: int", "idx: int", "size: Optional[tuple] = None"]
    assert entries["Config"]["kind"] == "dataclass"
    assert entries["Config"]["fields"] == ["tile_m: int", "tile_n: int = 128"]

    kernel = entries["Kernel"]
    assert kernel["kind"] == "class"
    assert kernel["bases"] == [f"{kernel['module']}.Base"]
    assert kernel["methods"]["__init__"]["parameters"] == [
        "self",
        "*args",
        "overlap: bool = True",
        "**kwargs",
    ]
    assert kernel["methods"]["__call__"]["parameters"] == ["self", "mQ", "mK", "stream=None"]


def test_a_module_global_is_recorded_by_name_not_by_its_install_path(make_module):
    module = make_module("import json as codec\n")
    symbols = [fp.Symbol(module, "codec", "a module global")]
    record = fp.compute_record(symbols, distribution="fake", version="1.0")
    entry = _by_name(record)["codec"]
    assert entry["kind"] == "module" and entry["value"] == "json"


def test_record_is_stable_and_json_round_trips(make_module):
    module = make_module(V1)
    first, second = _record(module), _record(module)
    assert first == second
    assert json.loads(fp.dump_record(first)) == first
    assert fp.diff_records(first, second) == []
    assert fp.format_diff([]) == "The upstream API matches the record."


def test_missing_module_and_attribute_are_findings_not_crashes(make_module):
    module = make_module(V1)
    record = fp.compute_record(
        [
            fp.Symbol("fa4_no_such_module_anywhere", "x", "gone"),
            fp.Symbol(module, "no_such_attribute", "gone"),
        ],
        distribution="fake",
        version="1",
    )
    gone_module, gone_attr = record["symbols"]
    assert gone_module["kind"] == "missing"
    assert "ModuleNotFoundError" in gone_module["error"]
    assert gone_attr["kind"] == "missing"
    assert "AttributeError" in gone_attr["error"]


def test_diff_says_what_moved(make_module):
    old = _record(make_module(V1), version="1.0")
    new = _record(make_module(V2), version="2.0")
    # Same module name in both records, as for two releases of one package.
    for entry in new["symbols"]:
        entry["module"] = old["symbols"][0]["module"]
    for entry in new["symbols"]:
        if entry["name"] == "Kernel":
            entry["bases"] = ["builtins.object"]  # V2's Kernel no longer derives from Base

    lines = fp.diff_records(old, new)
    text = "\n".join(lines)

    assert lines[0] == "fake: the record is of 1.0, the installed release is 2.0"
    assert "  ~ value: 128 -> 256" in lines
    assert "  - parameter removed: scale: float = 1.0" in lines
    assert "  + parameter added: causal: bool = False" in lines
    assert (
        "  ~ parameter changed: block: Optional[int] = None  ->  block: Optional[int] = 64" in lines
    )
    assert "  ~ parameter order changed: k (#2 -> #1), q (#1 -> #2)" in lines
    assert "  + field added: order: Optional[int] = None" in lines
    assert "  ~ method __call__: no longer defined" in lines
    assert any(line.startswith("  ~ bases: ") for line in lines)
    assert "source changed" in text and "helper" in text
    # Unchanged symbols say nothing.
    assert "Config" not in text

    assert fp.diff_records(old, new, compare_version=False)[0] != lines[0]
    readable = fp.format_diff(lines)
    assert readable.startswith("The upstream API differs from the record")
    assert fp.REGENERATE_COMMAND in readable


def test_diff_reports_a_symbol_that_disappeared_and_spec_changes(make_module):
    module = make_module(V1)
    old = _record(module)
    new = json.loads(json.dumps(old))
    entry = next(e for e in new["symbols"] if e["name"] == "entry")
    entry.clear()
    entry.update(
        {"module": module, "name": "entry", "kind": "missing", "error": "AttributeError: x"}
    )
    helper = next(e for e in new["symbols"] if e["name"] == "helper")  # source-tracked
    helper.clear()
    helper.update({"module": module, "name": "helper", "kind": "missing", "error": "E: y"})
    assert fp.diff_records(old, new) == [
        f"{module}.entry (missing)",
        "  ! no longer found: AttributeError: x",
        f"{module}.helper (missing)",
        "  ! no longer found: E: y",
    ]

    fewer = json.loads(json.dumps(old))
    fewer["symbols"] = [e for e in fewer["symbols"] if e["name"] != "Index"]
    assert fp.diff_records(fewer, old) == [
        f"{module}.Index (namedtuple): in SYMBOLS but not in the record"
    ]
    assert fp.diff_records(old, fewer) == [
        f"{module}.Index: in the record but no longer in SYMBOLS"
    ]


def test_checked_in_record_covers_exactly_symbols():
    record = fp.load_record()
    assert record["format"] == fp.RECORD_FORMAT
    assert record["distribution"] == "flash-attn-4"
    recorded = [(e["module"], e["name"], e["why"]) for e in record["symbols"]]
    assert recorded == [(s.module, s.name, s.why) for s in fp.SYMBOLS], (
        f"SYMBOLS changed without regenerating the record: {fp.REGENERATE_COMMAND}"
    )
    for symbol, entry in zip(fp.SYMBOLS, record["symbols"], strict=True):
        assert sorted(entry.get("methods", {})) == sorted(symbol.methods), symbol.qualname
        assert ("source_sha256" in entry) == symbol.source, symbol.qualname
        assert entry["kind"] != "missing", f"{symbol.qualname}: {entry.get('error')}"


def test_checked_in_record_is_written_canonically():
    assert fp.RECORD_PATH.read_text() == fp.dump_record(fp.load_record())


@pytest.mark.slow
@pytest.mark.skipif(upstream_version() is None, reason="flash-attn-4 is not installed")
def test_installed_upstream_matches_the_record():
    current = fp.current_record_subprocess()
    lines = fp.diff_records(fp.load_record(), current)
    if lines:
        pytest.fail(fp.format_diff(lines), pytrace=False)


def test_diff_reports_a_changed_symbols_entry(make_module):
    module = make_module(V1)
    old = _record(module)
    new = json.loads(json.dumps(old))
    kernel = next(e for e in new["symbols"] if e["name"] == "Kernel")
    del kernel["methods"]["__call__"]  # SYMBOLS now tracks fewer methods of Kernel
    assert fp.diff_records(old, new) == [
        f"{module}.Kernel: its SYMBOLS entry changed (methods or source tracking)"
    ]

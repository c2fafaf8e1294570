"""API fingerprint of the upstream FlashAttention-4 symbols this fork and the adapter rely on.

``SYMBOLS`` names every upstream module attribute that ``flash-attn-4-vsa`` or ``vsa-fa4`` uses.
Its fingerprint (kind, call signature, fields of records, signatures of the methods we use and,
where asked, a hash of the source) is checked in as ``upstream_api.json`` beside this module.
When upstream moves, :func:`diff_records` says what changed in a few readable lines; a refresh
reviews those lines against our deltas and then regenerates the record.

Commands (run in the workspace, e.g. ``uv run python -m flash_attn_vsa_tools.fingerprint``)::

    python -m flash_attn_vsa_tools.fingerprint         # check the installed upstream; exit 1, diff
    python -m flash_attn_vsa_tools.fingerprint --write # regenerate the record (and UPSTREAM.md)
    python -m flash_attn_vsa_tools.fingerprint --json  # print the current fingerprint

Computing a fingerprint imports the upstream modules (``flash_attn.cute``, hence ``cutlass``
and ``torch``), about 10 s on a CPU. Importing *this* module imports neither; the checks run
the computation in a subprocess (:func:`current_record_subprocess`) so that the calling process
stays clean.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import inspect
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flash_attn_vsa import UPSTREAM_DISTRIBUTION, upstream_version

RECORD_FORMAT = 1
RECORD_PATH = Path(__file__).with_name("upstream_api.json")
REGENERATE_COMMAND = "uv run python -m flash_attn_vsa_tools.fingerprint --write"


@dataclass(frozen=True)
class Symbol:
    """One upstream module attribute we rely on.

    ``methods`` lists the methods of a class whose signatures we depend on (we call, override
    or subclass them). ``source=True`` also records a hash of the source: use it for what we
    subclass or whose behaviour (not only its signature) our code assumes, so that any upstream
    edit there is flagged for review.
    """

    module: str
    name: str
    why: str
    methods: tuple[str, ...] = ()
    source: bool = False

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


_IFACE = "flash_attn.cute.interface"
_BSP = "flash_attn.cute.block_sparsity"

SYMBOLS: tuple[Symbol, ...] = (
    Symbol(
        _IFACE,
        "_flash_attn_fwd",
        "forward entry point the adapter calls (dense and block-sparse); compile gate; "
        "fwd_sm90 runs it with FlashAttentionForwardSm90 (a module global it constructs) and "
        "its compile_cache (in, get, set) scoped to our kernel class; launch_replay records what "
        "it does on the device per call description (ATen operations and compiled calls through "
        "the interface's compile caches, checked when recorded) and replays that on later calls",
        source=True,
    ),
    Symbol(
        _IFACE,
        "_flash_attn_bwd",
        "backward entry point the adapter calls (dense and block-sparse); compile gate; "
        "bwd_sm90 runs it with stand-ins for _tile_size_bwd_sm90, FlashAttentionBackwardSm90 "
        "_bwd_preprocess and _bwd_postprocess_convert (it must look all four up as module "
        "globals, pass the preprocess its dQ accumulator by the parameter name dq_accum, "
        "and call the dQ conversion once for sm_90 without GQA) and its compile_cache "
        "(in, get, set) scoped to our kernel class; launch_replay records and replays it as "
        "the forward's",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.cute_dsl_utils",
        "_resolve_aux_leading_dim",
        "how upstream's launchers read an aux tensor's leading dimension (its only stride-1 "
        "dimension, or the only one longer than 1, else the __leading_dim__ attribute): "
        "launch_replay.declare_leading_dims declares one for the tensors it refuses (the dS "
        "path's slot starts of a one-key-block call)",
        source=True,
    ),
    Symbol(
        _IFACE,
        "flash_attn_func",
        "public autograd entry: the dense baseline of tests and benchmarks",
    ),
    Symbol(
        _IFACE,
        "FwdConfig",
        "sm_90 forward tile configuration (tile_m, tile_n, ...)",
    ),
    Symbol(
        _IFACE,
        "BwdConfig",
        "sm_90 backward tile configuration; the KV64 backward delta departs from it",
    ),
    Symbol(
        _IFACE,
        "_tile_size_fwd_sm90",
        "sm_90 forward tile choice, which must fit our sparse block sizes",
        source=True,
    ),
    Symbol(
        _IFACE,
        "_fit_sm90_fwd_tile_to_block_sparsity",
        "shrinks sm_90 forward tiles to 64-token sparse blocks",
        source=True,
    ),
    Symbol(
        _IFACE,
        "_bwd_postprocess_convert",
        "the backward's float32-accumulator conversion: bwd_sm90's stand-in skips it for the "
        "dS-writing configuration (delta 12) and hands upstream's body its compile_cache, "
        "which the body reads through the module global",
        source=True,
    ),
    Symbol(
        _IFACE,
        "_bwd_preprocess",
        "the backward's preprocess (dO.O sums, lse in log2, zeroing the float32 dQ "
        "accumulator): bwd_sm90's stand-in calls it without the accumulator for the "
        "dS-writing configuration (delta 12: nothing reads it there) and hands upstream's body "
        "its compile_cache, which the body reads through the module global; the parameter "
        "dq_accum by name",
        source=True,
    ),
    Symbol(
        _IFACE,
        "_tile_size_bwd_sm90",
        "sm_90 backward tile choice (why KV64 sparse blocks are refused)",
        source=True,
    ),
    Symbol(
        _IFACE,
        "_get_fwd_config",
        "forward tiles per arch: vsa-fa4's sm_100 rule (two 128-row query stages per sparse "
        "block) follows it",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.mask",
        "call_mask_mod",
        "the mask_mod calling convention vsa-fa4's partial-block mask follows "
        "(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.utils",
        "scalar_to_ssa",
        "the partial-block mask_mod (mask_sm90) returns its bound through it",
    ),
    Symbol(
        "flash_attn.cute.mask",
        "AttentionMask",
        "mask_sm90 subclasses it: its apply_mask (signature, fields tile_n / swap_AB / "
        "seqlen_info / qhead_per_kvhead_packgqa, upstream's column-coordinate convention) is "
        "what the column-limit path stands in for on our mask_mod",
        methods=("apply_mask",),
        source=True,
    ),
    Symbol(
        "flash_attn.cute.mask",
        "sm90_col_to_r2p_idx",
        "mask_sm90's column limit in R2P element space (sm_90 accumulator columns)",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.mask",
        "r2p_bitmask_below",
        "mask_sm90's 32-column keep bitmask below a limit",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.mask",
        "mask_r2p_lambda",
        "mask_sm90 applies its bitmasks through it",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.utils",
        "AuxData",
        "apply_mask's aux_data: mask_sm90 reads the valid sizes as its tensors[0]",
    ),
    Symbol(
        "flash_attn.cute.block_sparse_utils",
        "consume_block_sparse_loads",
        "the sm_90 block-sparse forward loop: mask_mod (ours: mask_sm90's column limit) on the "
        "partial lists only; experimental.v_padding_sm90 reads its order (the partial list "
        "from its last entry, each entry read right before its step) and its mask_fn "
        "partials (mask_mod on partial steps, mask_seqlen on the first full step)",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.block_sparse_utils",
        "consume_block_sparse_mma_bwd_sm90",
        "the sm_90 block-sparse backward loop: mask_mod (ours: mask_sm90's column limit) on the "
        "partial lists only",
        source=True,
    ),
    Symbol(
        _BSP,
        "BlockSparseTensorsTorch",
        "the block-sparse index format the adapter builds (torch side)",
    ),
    Symbol(
        _BSP,
        "BlockSparseTensors",
        "the same index tensors as the CuTe kernels take them",
    ),
    Symbol(
        _BSP,
        "normalize_block_sparse_config",
        "forward shape and block-size rules for our index tensors",
    ),
    Symbol(
        _BSP,
        "normalize_block_sparse_config_bwd",
        "backward (Q-direction) shape and block-size rules",
    ),
    Symbol(
        _BSP,
        "to_cute_block_sparse_tensors",
        "converts the torch index tensors for the kernels",
    ),
    Symbol(
        "flash_attn.cute.flash_fwd",
        "FlashAttentionForwardBase",
        "base of the forward kernels: FlashAttentionForwardSm90 passes its arguments on to it; "
        "persistent_sm90 relies on its epilogue's O store waiting for its reads; "
        "combine_sm90 overrides epilogue (by its parameters) and adds to acc_O before it",
        methods=("__init__", "epilogue"),
        source=True,
    ),
    Symbol(
        "flash_attn.cute.flash_fwd_sm90",
        "FlashAttentionForwardSm90",
        "the Hopper forward kernel class fwd_sm90 subclasses (its register split is set in "
        "__call__ before _setup_attributes, which the subclass overrides, and __call__ "
        "launches through self.kernel(...).launch(min_blocks_per_mp=...)); q_regs_sm90 "
        "overrides _get_tiled_mma and wraps mma (by its parameter names), combine_sm90 wraps "
        "mma too (reads its aux_data, the launcher's aux tensors in order); persistent_sm90 "
        "extends _get_shared_storage_cls with an O buffer, which kernel's sO (the one tensor "
        "it makes on storage.sQ with a dtype) is redirected to; experimental.v_padding_sm90 "
        "wraps mma (sVt, tidx, blocksparse_tensors' full_block_cnt) and the P V product "
        "(mma_pv_fn, called with B_idx after its stage's wait) of "
        "mma_one_n_block_intrawg_overlap and last_half_block_overlap",
        methods=(
            "__init__",
            "__call__",
            "_setup_attributes",
            "_get_shared_storage_cls",
            "kernel",
            "load",
            "mma",
            "_get_tiled_mma",
            "first_half_block_overlap",
            "mma_one_n_block_intrawg_overlap",
            "last_half_block_overlap",
        ),
        source=True,
    ),
    Symbol(
        "flash_attn.cute.flash_bwd_sm90",
        "FlashAttentionBackwardSm90",
        "the Hopper backward kernel class bwd_sm90 subclasses (its register split is set in "
        "__call__ before _setup_attributes, which the subclass overrides); bwd_sm90_dq_parts "
        "replaces mma_one_m_block (called by keyword names, the block-sparse loop's mask_fn a "
        "partial with batch_idx and head_idx) and dQaccum_store (run by warp 1), wraps mma (by "
        "its parameter names: mdQaccum, sdQaccum, r2s_tiled_copy_dQaccum, tidx) and rebuilds "
        "_get_shared_storage_cls's struct with its own dQ buffers; bwd_sm90_ds_out reads "
        "mma's tiled_mma_SdP, tidx, sdQaccum and aux_data (the launcher's aux tensors)",
        methods=(
            "__init__",
            "__call__",
            "_setup_attributes",
            "_get_shared_storage_cls",
            "kernel",
            "mma",
            "mma_one_m_block",
            "dQaccum_store",
        ),
        source=True,
    ),
    Symbol(
        "flash_attn.cute.named_barrier",
        "NamedBarrierBwd",
        "bwd_sm90_dq_parts meets the producer warp on dQEmptyWG0 (unused once upstream's dQ "
        "staging is gone) and uses PdS as the MMA warpgroup's own barrier",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.named_barrier",
        "NamedBarrierFwd",
        "experimental.v_padding_sm90 takes the next named barrier after the forward's for its "
        "warpgroup barrier",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.block_sparse_utils",
        "_get_curr_blocksparse_tensors",
        "the consumer reads its work tile's counts by element and its lists by row: "
        "valid_in_list_sm90 wraps the partial rows, experimental.v_padding_sm90 records the "
        "full count",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.block_sparse_utils",
        "consume_block_sparse_mma_bwd_sm90",
        "the sm_90 backward consumer loop: passes mask_fn partials carrying batch_idx, "
        "head_idx and n_block, from which bwd_sm90_dq_parts finds a step's dQ accumulator and "
        "bwd_sm90_ds_out its key tile's first dS slot; dKV_accumulate False exactly at a "
        "tile's first step; the partial list walked, then the full list, in stored order",
        source=True,
    ),
    Symbol(
        _IFACE,
        "_get_device_arch",
        "vsa-fa4 routes 128x64 forwards to the paired-key kernel on the arch FA4 compiles for",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.block_sparse_utils",
        "produce_block_sparse_loads",
        "the sm_90 forward producer loop: fwd_sm90_paired's load calls it with loaders that "
        "take list entries (packed pairs) as src_idx",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.mask",
        "r2p_bitmask_above",
        "fwd_sm90_paired's pair mask: the second key block's columns start at 64",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.flash_fwd_sm90",
        "cpasync",
        "the module global the sm_90 forward builds its TMA atoms with; fwd_sm90_paired wraps "
        "it (64 x 64 K/V boxes while its kernel is built)",
    ),
    Symbol(
        "flash_attn.cute.flash_fwd_sm90",
        "sm90_utils",
        "the module global the sm_90 forward partitions its MMA operands and builds its shared "
        "layouts with; sm90_operands stands in for it (hooks for q_regs_sm90 and the streams "
        "forward while their kernels are traced)",
    ),
    Symbol(
        "flash_attn.cute.flash_fwd_sm90",
        "SingleTileScheduler",
        "the module global the sm_90 forward's __call__ takes its tile scheduler from; "
        "persistent_sm90 stands in for it while a persistent kernel is built",
    ),
    Symbol(
        "flash_attn.cute.tile_scheduler",
        "StaticPersistentTileScheduler",
        "persistent_sm90's scheduler (with its own grid size)",
        methods=("create", "to_underlying_arguments", "get_grid_shape", "advance_to_next_work"),
        source=True,
    ),
    Symbol(
        "quack.sm90_utils",
        "partition_fragment_ABC",
        "sm90_operands' stand-in calls it (q_regs_sm90 keeps the register A fragment it makes)",
        source=True,
    ),
    Symbol(
        "quack.copy_utils",
        "get_smem_load_atom",
        "q_regs_sm90 copies Q into registers with its ldmatrix atom",
        source=True,
    ),
    Symbol(
        "quack.copy_utils",
        "tma_get_copy_fn",
        "fwd_sm90_paired's producer loads Q through it, as upstream's does",
        source=True,
    ),
    Symbol(
        "quack.sm90_utils",
        "make_smem_layout",
        "fwd_sm90_paired's 64 x 64 K/V TMA box layout",
        source=True,
    ),
    Symbol(
        "flash_attn.cute.flash_fwd_sm90",
        "AttentionMask",
        "the module global the sm_90 forward builds its mask from; mask_sm90.install() sets "
        "it to its subclass",
    ),
    Symbol(
        "flash_attn.cute.flash_bwd_sm90",
        "AttentionMask",
        "the module global the sm_90 backward builds its mask from; mask_sm90.install() sets "
        "it to its subclass",
    ),
)


# --------------------------------------------------------------------------------------------
# Computing a fingerprint


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_TYPING = re.compile(r"(?<![\w.])typing\.")


def _clean(text: str) -> str:
    """Drop memory addresses and ``typing.`` prefixes from reprs, so that a fingerprint is the
    same in every process and does not depend on how a Python version spells annotations."""
    return _TYPING.sub("", _ADDRESS.sub("", text))


def _parameters(sig: inspect.Signature) -> list[str]:
    """A signature as a list of parameter strings, with the ``/`` and ``*`` markers inspect uses."""
    out: list[str] = []
    params = list(sig.parameters.values())
    star_done = False
    for i, param in enumerate(params):
        if param.kind is param.VAR_POSITIONAL:
            star_done = True
        if param.kind is param.KEYWORD_ONLY and not star_done:
            out.append("*")
            star_done = True
        out.append(_clean(str(param)))
        is_last_positional_only = param.kind is param.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not param.POSITIONAL_ONLY
        )
        if is_last_positional_only:
            out.append("/")
    return out


def _returns(sig: inspect.Signature) -> str | None:
    if sig.return_annotation is inspect.Signature.empty:
        return None
    return _clean(inspect.formatannotation(sig.return_annotation))


def _signature_entry(obj: Any) -> dict[str, Any]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as exc:
        return {"signature_error": f"{type(exc).__name__}: {exc}"}
    entry: dict[str, Any] = {"parameters": _parameters(sig)}
    returns = _returns(sig)
    if returns is not None:
        entry["returns"] = returns
    return entry


def _source_hash(obj: Any) -> str:
    try:
        text = inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError) as exc:
        return f"unavailable ({type(exc).__name__})"
    text = "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        if issubclass(obj, tuple) and hasattr(obj, "_fields"):
            return "namedtuple"
        if dataclasses.is_dataclass(obj):
            return "dataclass"
        return "class"
    if inspect.isroutine(obj) or hasattr(obj, "__wrapped__"):
        return "function"
    if callable(obj):
        return "callable"
    return "value"


def _resolve(module_name: str, name: str) -> Any:
    return getattr(importlib.import_module(module_name), name)


def symbol_entry(symbol: Symbol) -> dict[str, Any]:
    """The fingerprint of one symbol, as stored in the record."""
    entry: dict[str, Any] = {"module": symbol.module, "name": symbol.name, "why": symbol.why}
    try:
        obj = _resolve(symbol.module, symbol.name)
    except Exception as exc:  # any import or attribute failure is a finding, not a crash
        entry["kind"] = "missing"
        entry["error"] = _clean(f"{type(exc).__name__}: {exc}")
        return entry
    kind = _kind(obj)
    entry["kind"] = kind
    if kind in ("function", "callable"):
        entry.update(_signature_entry(obj))
    elif kind in ("namedtuple", "dataclass"):
        sig = _signature_entry(obj)
        entry["fields"] = sig.get("parameters", [])
        if "signature_error" in sig:
            entry["signature_error"] = sig["signature_error"]
    elif kind == "class":
        entry["bases"] = [f"{b.__module__}.{b.__qualname__}" for b in obj.__bases__]
    elif kind == "module":  # its name only: a module's repr holds the install path
        entry["value"] = obj.__name__
    else:
        entry["value"] = _clean(repr(obj))
    if symbol.methods:
        methods: dict[str, Any] = {}
        mro = obj.__mro__ if inspect.isclass(obj) else type(obj).__mro__
        for method in symbol.methods:
            # Defined by the class or a base (not by the metaclass, as type.__call__ is).
            if any(method in vars(klass) for klass in mro):
                methods[method] = _signature_entry(getattr(obj, method))
            else:
                methods[method] = {"missing": True}
        entry["methods"] = methods
    if symbol.source:
        entry["source_sha256"] = _source_hash(obj)
    return entry


def compute_record(
    symbols: Iterable[Symbol] = SYMBOLS,
    *,
    distribution: str = UPSTREAM_DISTRIBUTION,
    version: str | None = None,
) -> dict[str, Any]:
    """The fingerprint of ``symbols`` in this process (imports the upstream modules)."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(distribution)
        except PackageNotFoundError:
            version = None
    return {
        "format": RECORD_FORMAT,
        "distribution": distribution,
        "version": version,
        "regenerate": REGENERATE_COMMAND,
        "symbols": [symbol_entry(s) for s in symbols],
    }


def current_record_subprocess(timeout: float = 600.0) -> dict[str, Any]:
    """The fingerprint of the installed upstream, computed in a fresh Python process."""
    done = subprocess.run(
        [sys.executable, "-m", "flash_attn_vsa_tools.fingerprint", "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            "computing the upstream fingerprint failed "
            f"(exit {done.returncode}):\n{done.stderr[-4000:]}"
        )
    return json.loads(done.stdout)


# --------------------------------------------------------------------------------------------
# The record


def load_record(path: Path = RECORD_PATH) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def dump_record(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2) + "\n"


def write_record(record: dict[str, Any], path: Path = RECORD_PATH) -> None:
    Path(path).write_text(dump_record(record))


# --------------------------------------------------------------------------------------------
# Differences, in words


def _param_name(text: str) -> str:
    if text in ("*", "/"):
        return text
    head = re.split(r"[:=]", text, maxsplit=1)[0].strip()
    return head


def _diff_lists(label: str, old: Sequence[str], new: Sequence[str]) -> list[str]:
    """Readable differences between two parameter (or field) lists."""
    lines: list[str] = []
    old_by = {_param_name(p): p for p in old}
    new_by = {_param_name(p): p for p in new}
    for name, text in old_by.items():
        if name not in new_by:
            lines.append(f"  - {label} removed: {text}")
    for name, text in new_by.items():
        if name not in old_by:
            lines.append(f"  + {label} added: {text}")
    for name, text in old_by.items():
        if name in new_by and new_by[name] != text:
            lines.append(f"  ~ {label} changed: {text}  ->  {new_by[name]}")
    common_old = [_param_name(p) for p in old if _param_name(p) in new_by]
    common_new = [_param_name(p) for p in new if _param_name(p) in old_by]
    if common_old != common_new:
        moved = [
            f"{name} (#{common_old.index(name) + 1} -> #{i + 1})"
            for i, name in enumerate(common_new)
            if common_old.index(name) != i
        ]
        lines.append(f"  ~ {label} order changed: " + ", ".join(moved))
    return lines


def _diff_signature(prefix: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for key in ("signature_error",):
        if old.get(key) != new.get(key):
            lines.append(f"  ~ {prefix}{key}: {old.get(key)!r} -> {new.get(key)!r}")
    label = f"{prefix}parameter"
    lines += _diff_lists(label, old.get("parameters", []), new.get("parameters", []))
    if old.get("returns") != new.get("returns"):
        lines.append(f"  ~ {prefix}return annotation: {old.get('returns')} -> {new.get('returns')}")
    return lines


def diff_entry(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Readable differences of one symbol; empty when it did not move."""
    if old.get("kind") != new.get("kind"):
        if new.get("kind") == "missing":
            return [f"  ! no longer found: {new.get('error')}"]
        if old.get("kind") == "missing":
            return [f"  ~ found again, now a {new.get('kind')} (was: {old.get('error')})"]
        return [f"  ~ kind changed: {old.get('kind')} -> {new.get('kind')}"]
    lines: list[str] = []
    if old.get("kind") == "missing":
        if old.get("error") != new.get("error"):
            lines.append(f"  ~ still missing: {new.get('error')}")
        return lines
    lines += _diff_signature("", old, new)
    lines += _diff_lists("field", old.get("fields", []), new.get("fields", []))
    if old.get("bases") != new.get("bases"):
        lines.append(f"  ~ bases: {old.get('bases')} -> {new.get('bases')}")
    if old.get("value") != new.get("value"):
        lines.append(f"  ~ value: {old.get('value')} -> {new.get('value')}")
    old_methods, new_methods = old.get("methods", {}), new.get("methods", {})
    for method in sorted(set(old_methods) | set(new_methods)):
        before, after = old_methods.get(method), new_methods.get(method)
        if before is None or after is None:
            continue  # a change of the spec, reported by diff_records
        if before.get("missing") != after.get("missing"):
            state = "no longer defined" if after.get("missing") else "defined again"
            lines.append(f"  ~ method {method}: {state}")
            continue
        lines += _diff_signature(f"{method}() ", before, after)
    if old.get("source_sha256") != new.get("source_sha256"):
        lines.append(
            f"  ~ source changed (sha256 {old.get('source_sha256')} -> "
            f"{new.get('source_sha256')}): read the upstream diff of this symbol"
        )
    return lines


def _key(entry: dict[str, Any]) -> str:
    return f"{entry['module']}.{entry['name']}"


def _spec_shape(entry: dict[str, Any]) -> tuple[Any, ...]:
    return (sorted(entry.get("methods", {})), "source_sha256" in entry)


def diff_records(
    recorded: dict[str, Any], current: dict[str, Any], *, compare_version: bool = True
) -> list[str]:
    """Readable differences between the checked-in record and the current fingerprint.

    Empty when nothing moved. Covers the upstream version (unless ``compare_version`` is
    false), every symbol's kind, signature, fields, bases, method signatures and source hash,
    and symbols added to or removed from ``SYMBOLS`` without regenerating the record.
    """
    lines: list[str] = []
    if compare_version and recorded.get("version") != current.get("version"):
        lines.append(
            f"{current.get('distribution', UPSTREAM_DISTRIBUTION)}: the record is of "
            f"{recorded.get('version')}, the installed release is {current.get('version')}"
        )
    old = {_key(e): e for e in recorded.get("symbols", [])}
    new = {_key(e): e for e in current.get("symbols", [])}
    for key, entry in new.items():
        if key not in old:
            lines.append(f"{key} ({entry.get('kind')}): in SYMBOLS but not in the record")
    for key in old:
        if key not in new:
            lines.append(f"{key}: in the record but no longer in SYMBOLS")
    for key, entry in new.items():
        if key not in old:
            continue
        both_found = "missing" not in (old[key].get("kind"), entry.get("kind"))
        if both_found and _spec_shape(old[key]) != _spec_shape(entry):
            lines.append(f"{key}: its SYMBOLS entry changed (methods or source tracking)")
        changes = diff_entry(old[key], entry)
        if changes:
            lines.append(f"{key} ({entry.get('kind')})")
            lines += changes
    return lines


def format_diff(lines: Sequence[str]) -> str:
    if not lines:
        return "The upstream API matches the record."
    return (
        "The upstream API differs from the record (flash_attn_vsa_tools/upstream_api.json):\n"
        + "\n".join(lines)
        + "\n\nReview each change against our deltas (UPSTREAM.md), then regenerate the record:"
        + f"\n    {REGENERATE_COMMAND}"
    )


# --------------------------------------------------------------------------------------------
# Command line


def write(record: dict[str, Any], upstream_md: Path | None) -> list[Path]:
    """Write the record and, when given, the generated symbols section of UPSTREAM.md."""
    from flash_attn_vsa_tools import upstream_md as md

    written = [RECORD_PATH]
    write_record(record)
    if upstream_md is not None:
        text = upstream_md.read_text()
        new_text = md.replace_symbols_section(text, record)
        if new_text != text:
            upstream_md.write_text(new_text)
            written.append(upstream_md)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flash_attn_vsa_tools.fingerprint",
        description="Check the installed upstream flash-attn-4 API against the checked-in record.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print the current fingerprint as JSON")
    mode.add_argument(
        "--write",
        action="store_true",
        help="regenerate upstream_api.json and the symbols section of UPSTREAM.md",
    )
    args = parser.parse_args(argv)

    if upstream_version() is None:
        print(f"{UPSTREAM_DISTRIBUTION} is not installed", file=sys.stderr)
        return 2
    current = compute_record()
    if args.json:
        print(json.dumps(current, indent=2))
        return 0
    if args.write:
        from flash_attn_vsa_tools.upstream_md import workspace_upstream_md

        for path in write(current, workspace_upstream_md()):
            print(f"wrote {path}")
        return 0
    lines = diff_records(load_record(), current)
    print(format_diff(lines))
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())

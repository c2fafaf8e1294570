"""A benchmark run's life: its options, device, progress, time budget, replicas, document.

- `add_run_options`, `parse_mode`, `mode_slug`, `DTYPES`: the command-line vocabulary every
  benchmark shares; `pick_device`; `log` (progress on stderr, stdout keeps the table);
  `budget_spent` / `mark_not_run` (``--time-budget-min``); `recover_after_error`.
- `Replica`: one independent replica per GPU under ``torchrun``, rank-suffixed JSON files and
  an aggregate written by rank 0 once every rank's file is there (no process group needed:
  `wait_for_ranks`, `aggregate_replicas`).
- `result_doc` / `run_and_report`: a run's JSON document, rewritten as results come in, then
  printed and written once complete (under ``torchrun``: per rank, then rank 0's aggregate).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bench_report import write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_NAMES[torch.float32] = "fp32"  # a name only: bench_video's sequence-parallel CPU runs

MODE_ALIASES = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fwd+bwd", "fwdbwd": "fwd+bwd"}


def budget_spent(time_budget_min: float | None, started: float) -> bool:
    """Whether a run's ``--time-budget-min`` has run out since ``started`` (time.monotonic)."""
    return time_budget_min is not None and time.monotonic() - started > time_budget_min * 60


def mark_not_run(rec: dict[str, Any], time_budget_min: float | None) -> None:
    """Record a cell the time budget left unstarted."""
    rec.update(status="not_run", reason=f"--time-budget-min {time_budget_min} spent")


def log(msg: str, *, replica: Replica | None = None) -> None:
    """Progress output: stderr, so that stdout carries only the final markdown table."""
    prefix = f"[rank {replica.rank}] " if replica is not None else ""
    print(f"{prefix}{msg}", file=sys.stderr, flush=True)


def parse_mode(text: str) -> str:
    mode = MODE_ALIASES.get(text.strip().lower())
    if mode is None:
        raise ValueError(f"mode must be one of fwd, bwd, fwd+bwd (or fwdbwd), got {text!r}")
    return mode


def mode_slug(mode: str) -> str:
    """A file-name-safe spelling of a mode."""
    return mode.replace("+", "_")


def recover_after_error(device: torch.device) -> None:
    """Best effort after an arm failed: release cached blocks; never raises."""
    if device.type != "cuda":
        return
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(device)
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()


# ---- torchrun replicas ----------------------------------------------------------------------
@dataclass(frozen=True)
class Replica:
    """This process's place among ``torchrun`` replicas (from RANK / WORLD_SIZE / LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int
    run_id: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "run_id": self.run_id,
        }


def replica_from_env(environ: dict[str, str] | None = None) -> Replica | None:
    environ = dict(os.environ if environ is None else environ)
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    local = int(environ.get("LOCAL_RANK", rank))
    run_id = environ.get("TORCHELASTIC_RUN_ID") or "{}:{}".format(
        environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    )
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world})")
    return Replica(rank, world, local, run_id)


def pick_device(requested: str, replica: Replica | None) -> torch.device:
    """``auto``: cuda (cuda:LOCAL_RANK under torchrun) when available, else cpu."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda requested but torch sees no CUDA device")
        if device.index is None:
            index = replica.local_rank if replica is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def rank_path(out: Path, rank: int) -> Path:
    out = Path(out)
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix or '.json'}")


def wait_for_ranks(
    out: Path,
    replica: Replica,
    *,
    started_at: float,
    timeout_s: float,
    poll_s: float = 2.0,
) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Rank 0 waits for every rank's complete file of this run (same run id, started no earlier
    than ``started_at`` minus 10 minutes); returns (docs by rank, missing ranks)."""
    deadline = time.monotonic() + timeout_s
    found: dict[int, dict[str, Any]] = {}
    while True:
        for rank in range(replica.world_size):
            if rank in found:
                continue
            path = rank_path(out, rank)
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            rep = (doc.get("metadata") or {}).get("replica") or {}
            if (
                doc.get("complete")
                and rep.get("run_id") == replica.run_id
                and float(doc.get("started_unix", 0)) >= started_at - 600
            ):
                found[rank] = doc
        missing = [r for r in range(replica.world_size) if r not in found]
        if not missing or time.monotonic() >= deadline:
            return found, missing
        time.sleep(poll_s)


def aggregate_replicas(
    docs: dict[int, dict[str, Any]],
    key_fields: Sequence[str],
    value_fields: Sequence[str],
) -> list[dict[str, Any]]:
    """One result per key: rank 0's (or the lowest rank's) record, its ``value_fields`` replaced
    by the median over the ranks where that cell is ``ok``, plus per-rank values/statuses."""
    grouped: dict[tuple, dict[int, dict[str, Any]]] = {}
    order: list[tuple] = []
    for rank in sorted(docs):
        for res in docs[rank].get("results", []):
            key = tuple(json.dumps(res.get(f), sort_keys=True) for f in key_fields)
            if key not in grouped:
                grouped[key] = {}
                order.append(key)
            grouped[key][rank] = res
    merged = []
    for key in order:
        per_rank = grouped[key]
        base = dict(per_rank[min(per_rank)])
        ok = {r: res for r, res in per_rank.items() if res.get("status") == "ok"}
        base["replica_statuses"] = {str(r): res.get("status") for r, res in per_rank.items()}
        values: dict[str, dict[str, Any]] = {}
        for name in value_fields:
            vals = {r: res.get(name) for r, res in ok.items()}
            numeric = [v for v in vals.values() if isinstance(v, (int, float))]
            values[name] = {str(r): v for r, v in vals.items()}
            if numeric:
                base[name] = statistics.median(numeric)
        base["replica_values"] = values
        statuses = {res.get("status") for res in per_rank.values()}
        if ok and len(ok) < len(per_rank):
            base["status"] = "ok"
            base["note"] = (
                f"ok on ranks {sorted(ok)} of {sorted(per_rank)}; median over the ok ranks"
            )
        elif not ok and len(statuses) > 1:
            base["note"] = f"statuses per rank: {base['replica_statuses']}"
        merged.append(base)
    return merged


# ---- a run's document: checkpoints, completion, replica aggregate ---------------------------
def add_run_options(group: Any) -> None:
    """--seed, --device and --replica-timeout-s (an argparse group of a benchmark's parser)."""
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--device", default="auto", help="auto (cuda if available), cuda, cuda:N, cpu"
    )
    group.add_argument(
        "--replica-timeout-s",
        type=float,
        default=7200.0,
        help="under torchrun, how long rank 0 waits for the other ranks' files (default 7200)",
    )


def result_doc(
    benchmark: str,
    *,
    started_unix: float,
    metadata: dict[str, Any],
    config: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """A run's (still incomplete) JSON document; ``extra`` fields come before ``results``."""
    return {
        "benchmark": benchmark,
        "schema": 1,
        "complete": False,
        "started_unix": started_unix,
        "metadata": metadata,
        "config": config,
        **extra,
        "results": [],
    }


ResultsCallback = Callable[[list[dict[str, Any]]], None]


def run_and_report(
    doc: dict[str, Any],
    run: Callable[[ResultsCallback], list[dict[str, Any]]],
    finish: Callable[[dict[str, Any], Path | None], str],
    *,
    out: Path | None,
    replica: Replica | None,
    replica_timeout_s: float,
    key_fields: Sequence[str],
    value_fields: Sequence[str],
    drop_fields: Sequence[str] = (),
    before_rank_write: Callable[[dict[str, Any]], None] | None = None,
    on_aggregate: Callable[[dict[str, Any], dict[int, dict[str, Any]], list[int]], None]
    | None = None,
) -> int:
    """Run a benchmark into ``doc`` and report it; returns the exit status (0).

    ``run(checkpoint)`` returns the results; ``checkpoint(results)`` rewrites the incomplete
    JSON (``out``, under ``torchrun`` its rank file) at most every 5 s, so a killed run keeps
    what it measured. Then the document is marked complete and ``finish(doc, out)`` (derive,
    render, write; returns the markdown) is printed. Under ``torchrun`` every rank writes its
    complete rank file (after ``before_rank_write(doc)``) and only rank 0 reports: without
    ``out`` its own document, else the aggregate over the ranks' files (``aggregate_replicas``
    on ``key_fields`` / ``value_fields``; ``drop_fields`` removed from each result, to be
    derived again by ``finish``; ``on_aggregate(agg, docs, missing)`` adds to it).
    """
    write_to = out
    if replica is not None and out is not None:
        write_to = rank_path(out, replica.rank)

    last_write = [0.0]

    def checkpoint(results: list[dict[str, Any]]) -> None:
        """Rewrite the (incomplete) JSON at most every few seconds: a killed run keeps it."""
        if write_to is not None and time.monotonic() - last_write[0] > 5:
            doc["results"] = results
            write_json(write_to, doc)
            last_write[0] = time.monotonic()

    doc["results"] = run(checkpoint)
    doc["complete"] = True
    doc["finished_unix"] = time.time()
    if replica is None:
        print(finish(doc, out))
        return 0
    if write_to is not None:
        if before_rank_write is not None:
            before_rank_write(doc)
        write_json(write_to, doc)
    if replica.rank != 0:
        return 0
    if out is None:
        print(finish(doc, None))
        return 0
    docs, missing = wait_for_ranks(
        out, replica, started_at=doc["started_unix"], timeout_s=replica_timeout_s
    )
    agg = dict(doc)
    agg["results"] = aggregate_replicas(docs, key_fields, value_fields)
    for r in agg["results"]:
        for name in drop_fields:
            r.pop(name, None)
    agg["replicas_found"] = sorted(docs)
    agg["replicas_missing"] = missing
    agg["rank_files"] = [str(rank_path(out, r)) for r in sorted(docs)]
    if on_aggregate is not None:
        on_aggregate(agg, docs, missing)
    print(finish(agg, out))
    return 0

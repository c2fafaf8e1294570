"""Backend discovery and selection.

Backends are plug-ins: any installed distribution may register a `Backend` subclass under the
``vsa.backends`` entry-point group. ``backend="auto"`` picks the highest-priority backend (its
``priority_for(call)``, by default its class ``priority``) whose ``supports()`` accepts the
call; the built-in ``reference`` backend accepts everything, so auto always finds one. The one
override is the ``VSA_BACKEND`` environment variable, which replaces ``"auto"`` (an explicit
``backend=`` argument in code wins over it). A named backend that refuses a call raises
``ValueError`` with its reason: never a silent fallback. A deterministic call
(``AttentionCall.deterministic``) goes only to backends that declare they handle it
(``Backend.handles_deterministic``) and accept it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from importlib.metadata import entry_points

from vsa_core.backends.base import AttentionCall, Backend

ENTRY_POINT_GROUP = "vsa.backends"
OVERRIDE_ENV = "VSA_BACKEND"


@dataclass(frozen=True)
class BackendEntry:
    """A discovered backend, or why it could not be loaded."""

    name: str
    backend: Backend | None
    load_error: str | None = None
    origin: str = ""


_registered: dict[str, Backend] = {}
_generation = [0]  # bumped whenever the registered backends change: selections are cached


def register_backend(backend: Backend) -> None:
    """Register a backend instance in this process (for plug-ins that are not installed
    distributions, and for tests). It shadows an entry point of the same name."""
    if not isinstance(backend, Backend) or not backend.name:
        raise ValueError("backend must be a Backend instance with a non-empty name")
    _registered[backend.name] = backend
    _generation[0] += 1


def unregister_backend(name: str) -> None:
    _registered.pop(name, None)
    _generation[0] += 1


def registry_generation() -> int:
    """A number that changes whenever backends are registered or unregistered (a cache key
    for decisions that depend on the set of backends)."""
    return _generation[0]


@functools.lru_cache(maxsize=1)
def _discovered() -> dict[str, BackendEntry]:
    found: dict[str, BackendEntry] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        origin = ep.value
        try:
            cls = ep.load()
            backend = cls()
            if not isinstance(backend, Backend):
                raise TypeError(f"{origin} is not a vsa_core Backend")
            found[ep.name] = BackendEntry(ep.name, backend, origin=origin)
        except Exception as exc:  # a broken plug-in must not break the others
            found[ep.name] = BackendEntry(
                ep.name, None, f"failed to load: {type(exc).__name__}: {exc}", origin
            )
    return found


def backend_entries() -> dict[str, BackendEntry]:
    """Every known backend by name, including the ones that failed to load."""
    entries = dict(_discovered())
    for name, backend in _registered.items():
        entries[name] = BackendEntry(name, backend, origin="register_backend")
    return entries


def get_backend(name: str, *, source: str = "backend") -> Backend:
    """The backend called ``name``; ``source`` names where the name came from in errors (the
    ``backend`` argument, or the ``VSA_BACKEND`` environment variable)."""
    entries = backend_entries()
    where = f"{source} (environment variable)" if source == OVERRIDE_ENV else source
    if name not in entries:
        known = ", ".join(sorted(["auto", *entries]))
        raise ValueError(f"{where} must be one of {known}; got {name!r}")
    entry = entries[name]
    if entry.backend is None:
        what = f"{where} names backend {name!r}, which" if source == OVERRIDE_ENV else where
        if source != OVERRIDE_ENV:
            what += f" {name!r}"
        raise ValueError(f"{what} is installed but unusable: {entry.load_error}")
    return entry.backend


def refusal(backend: Backend, call: AttentionCall) -> str | None:
    """Why ``backend`` cannot run ``call`` (None: it can): its ``supports()``, for a
    deterministic call also whether it handles the flag at all, and for a call on raster-order
    tensors whether it reads them (``Backend.reads_raster``)."""
    reason = backend.supports(call)
    if reason is None and call.deterministic and not backend.handles_deterministic:
        reason = (
            f"backend {backend.name!r} does not declare deterministic=True support "
            "(Backend.handles_deterministic): its results are not known to be bitwise "
            "reproducible"
        )
    if reason is None and call.raster_inputs and not backend.reads_raster:
        reason = (
            f"backend {backend.name!r} reads tile-order tensors only (Backend.reads_raster): "
            "it needs copy_to_tiles=True"
        )
    return reason


def explain(call: AttentionCall) -> list[tuple[str, str | None]]:
    """(name, refusal reason or None) for every backend, highest priority first."""
    rows = []
    for entry in _by_priority(call):
        if entry.backend is None:
            rows.append((entry.name, entry.load_error))
        else:
            rows.append((entry.name, refusal(entry.backend, call)))
    return rows


def backend_override() -> str:
    """``VSA_BACKEND`` as set now, stripped ("" when unset). Eager calls read it on every call;
    a compiled graph reads it once, when traced (dynamo of torch 2.4 cannot trace
    ``os.environ.get``)."""
    return os.environ.get(OVERRIDE_ENV, "").strip()


# What torch.compiler.assume_constant_result does, without importing torch._dynamo when
# vsa-core is imported (as vsa_core.host_cache does for its cached decisions).
backend_override._dynamo_marked_constant = True  # type: ignore[attr-defined]


def select_backend(call: AttentionCall, backend: str = "auto") -> Backend:
    """The backend that will run ``call``: see the module doc for the rules.

    Decided once per (call description, ``backend``, ``VSA_BACKEND``, registered backends) and
    cached: every op call asks, and asking every backend again costs host time on each layer.
    Backends' ``supports`` and ``priority_for`` must therefore depend on the call alone."""
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a backend name or 'auto', got {backend!r}")
    return _select(call, backend, backend_override(), _generation[0])


@functools.lru_cache(maxsize=256)
def _select(call: AttentionCall, backend: str, override: str, _generation: int) -> Backend:
    requested, source = backend, "backend"
    if backend == "auto" and override:
        requested, source = override, OVERRIDE_ENV
    if requested != "auto":
        chosen = get_backend(requested, source=source)
        reason = refusal(chosen, call)
        if reason is not None:
            where = " (environment variable)" if source == OVERRIDE_ENV else ""
            raise ValueError(f"{source}={requested!r}{where} cannot run this call: {reason}")
        return chosen
    for entry in _by_priority(call):
        if entry.backend is not None and refusal(entry.backend, call) is None:
            return entry.backend
    refusals = "; ".join(f"{name}: {why}" for name, why in explain(call))
    raise ValueError(f"no backend supports this call ({refusals})")


def _by_priority(call: AttentionCall | None = None) -> list[BackendEntry]:
    """Backends, highest priority first (for ``call``: each backend's `priority_for` it)."""

    def rank(entry: BackendEntry) -> int:
        if entry.backend is None:
            return -1
        return entry.backend.priority if call is None else entry.backend.priority_for(call)

    return sorted(backend_entries().values(), key=lambda e: (-rank(e), e.name))

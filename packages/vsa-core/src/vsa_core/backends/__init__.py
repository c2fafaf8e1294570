"""Backend plug-in interface and registry."""

from vsa_core.backends.base import AttentionCall, Backend
from vsa_core.backends.registry import (
    ENTRY_POINT_GROUP,
    OVERRIDE_ENV,
    backend_entries,
    explain,
    get_backend,
    register_backend,
    select_backend,
    unregister_backend,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "OVERRIDE_ENV",
    "AttentionCall",
    "Backend",
    "backend_entries",
    "explain",
    "get_backend",
    "register_backend",
    "select_backend",
    "unregister_backend",
]

"""What the process environment says about running Triton (a leaf: no other vsa_triton import)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET`` set and not 0): kernels then
    take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

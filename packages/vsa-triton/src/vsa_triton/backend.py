"""The ``triton`` backend of vsa-core (a stub until the Triton kernels land).

Registered under the ``vsa.backends`` entry-point group as ``triton``. This release ships no
kernels, so the backend refuses every call with a reason instead of pretending to run. Triton is
imported lazily, inside ``availability()`` only, never when this module is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from vsa_core.backends.base import AttentionCall, Backend
from vsa_triton import __version__

if TYPE_CHECKING:
    from vsa_core.layout import BlockSparseLayout

NO_KERNELS = f"vsa-triton {__version__} ships no kernels yet"


def _machine_report() -> str:
    """What this machine offers the future kernels: triton importable? a CUDA device?"""
    try:
        import triton  # lazy: only when someone asks about availability
    except Exception as exc:  # a broken install is as unusable as a missing one
        found = f"triton not importable ({type(exc).__name__}: {exc})"
    else:
        found = f"triton {getattr(triton, '__version__', '(unknown version)')} importable"
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        device = f"CUDA device {torch.cuda.get_device_name(0)!r}"
    else:
        device = "no CUDA device"
    return f"{found}, {device}"


class TritonBackend(Backend):
    """Portable Triton block-sparse attention (forward and backward): not shipped yet."""

    name: ClassVar[str] = "triton"
    priority: ClassVar[int] = 10

    def supports(self, call: AttentionCall) -> str | None:
        return NO_KERNELS

    def availability(self) -> str | None:
        return f"{NO_KERNELS} ({_machine_report()})"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(NO_KERNELS)

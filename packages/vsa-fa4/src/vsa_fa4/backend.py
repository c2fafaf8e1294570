"""The ``fa4`` backend of vsa-core (a stub until the FlashAttention-4 adapter lands).

Registered under the ``vsa.backends`` entry-point group as ``fa4``. This release ships no
kernels, so the backend refuses every call with a reason instead of pretending to run.
``flash_attn`` and ``cutlass`` are never imported here: ``availability()`` only looks for
``flash_attn.cute`` with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from typing import TYPE_CHECKING, ClassVar

import torch

from vsa_core.backends.base import AttentionCall, Backend
from vsa_fa4 import __version__

if TYPE_CHECKING:
    from vsa_core.layout import BlockSparseLayout

NO_KERNELS = f"vsa-fa4 {__version__} ships no kernels yet"

# FlashAttention-4's CuTe kernels target Hopper (sm_90) and Blackwell (sm_100 family).
SUPPORTED_MAJORS = (9, 10)


def _find_flash_attn_cute() -> bool:
    """Whether ``flash_attn.cute`` is installed, without importing it.

    ``find_spec`` of a submodule imports the parent package, so look for ``flash_attn`` first
    and then resolve ``cute`` against its search path without executing ``flash_attn``.
    """
    try:
        parent = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return False
    if parent is None or parent.submodule_search_locations is None:
        return False
    search_path = list(parent.submodule_search_locations)
    return importlib.machinery.PathFinder.find_spec("flash_attn.cute", search_path) is not None


def _capable_devices() -> list[str]:
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        if major in SUPPORTED_MAJORS:
            found.append(f"cuda:{index} (sm_{major}{minor})")
    return found


def _machine_report() -> str:
    cute = "flash_attn.cute found" if _find_flash_attn_cute() else "flash_attn.cute not found"
    if not torch.cuda.is_available():
        device = "no CUDA device"
    else:
        devices = _capable_devices()
        device = (
            f"capable devices: {', '.join(devices)}"
            if devices
            else "no CUDA device of capability 9.x or 10.x"
        )
    return f"{cute}, {device}"


class FA4Backend(Backend):
    """Block-sparse attention through FlashAttention-4's CuTe kernels: not shipped yet."""

    name: ClassVar[str] = "fa4"
    priority: ClassVar[int] = 20

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

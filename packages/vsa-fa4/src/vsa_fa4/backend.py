"""The ``fa4`` backend of vsa-core: block-sparse attention on FlashAttention-4's CuTe kernels.

Registered under the ``vsa.backends`` entry-point group as ``fa4`` (priority 20, ahead of
``triton``). ``flash_attn``, ``cutlass`` and the kernels are imported on the first launch,
never with this module: ``supports()`` and ``availability()`` only look for ``flash_attn.cute``
with ``importlib`` and read the device's compute capability.

``supports()`` accepts a call only where upstream FA4 (the release flash-attn-4-vsa pins) runs
it, judged from the logical block shape with the native schedule (the pairing of 64-token
query blocks depends on the layout, which a call description does not carry); every refusal
names its reason, so ``backend="auto"`` falls back to Triton with an explanation.

One input contract is stricter than vsa-core's: padding slots of *partial* key blocks must hold
finite values (FA4 masks their scores but multiplies the zero probabilities with V, so a NaN
there leaks; ``VideoTiling.to_tiles`` writes zeros). No check reads the data for it.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
from typing import TYPE_CHECKING, ClassVar

import torch

from vsa_core.backends.base import AttentionCall, Backend
from vsa_core.host_cache import resolved_once
from vsa_fa4.schedule import (
    ARCHS,
    BLOCK_SHAPES,
    HEAD_DIMS,
    SCHEDULES,
    Plan,
    make_plan,
    native_plan,
    plan_refusal,
)

if TYPE_CHECKING:
    from vsa_core.layout import BlockSparseLayout

DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def find_flash_attn_cute() -> bool:
    """Whether ``flash_attn.cute`` is installed, without importing it (cached per process).

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


NOT_INSTALLED = "flash_attn.cute (flash-attn-4) is not installed"
ARCH_NAMES = " or ".join(ARCHS.values())


def _capable_devices() -> list[str]:
    found = []
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        if capability in ARCHS:
            found.append(f"cuda:{index} ({ARCHS[capability]})")
    return found


def _shape(block_shape: tuple[int, int]) -> str:
    return f"{block_shape[0]}x{block_shape[1]}"


class FA4Backend(Backend):
    """Block-sparse attention through FlashAttention-4's CuTe kernels (sm_90, sm_100).

    ``schedule`` picks the physical tiles (see `vsa_fa4.schedule`): ``"auto"`` (what the
    registry instantiates), ``"native"`` or ``"paired"``. To run the registry's ``fa4`` with
    another schedule, ``vsa_core.backends.register_backend(FA4Backend(schedule="native"))``.
    """

    name: ClassVar[str] = "fa4"
    priority: ClassVar[int] = 20

    def __init__(self, schedule: str = "auto") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.schedule = schedule

    def availability(self) -> str | None:
        if not find_flash_attn_cute():
            return NOT_INSTALLED
        if not torch.cuda.is_available():
            return f"no CUDA device (FA4's CuTe kernels need {ARCH_NAMES})"
        if not _capable_devices():
            return f"no CUDA device of capability {ARCH_NAMES}"
        return None

    def supports(self, call: AttentionCall) -> str | None:
        reason = self._call_refusal(call)
        if reason is not None:
            return reason
        return plan_refusal(
            call.capability, call.head_dim, native_plan(call.block_shape), call.requires_grad
        )

    def priority_for(self, call: AttentionCall) -> int:
        """Below Triton (10) for training with 64-token query blocks on sm_90 that cannot pair
        onto 128-row tiles (``q_group_size`` odd, as for the coarse stage's own layouts); else
        `priority`.

        Measured on an H200 (2026-11-29, benchmarks/results/, whole VSA op, 40 heads, 87.5%,
        speedup over dense FA4, fwd / fwd+bwd): at Wan 2.1 720p (21x45x80, 24% of the key
        tiles partial) fa4 3.23x / 2.95x once the fork masked partial blocks as a column limit
        (same run, per call: forward 52.3 ms against Triton's 56.0, forward+backward 223.7
        against 204.4), Triton 3.09x / 3.22x; at a tile-aligned 20x44x80 latent fa4 5.06x /
        4.39x, Triton 4.13x / 4.43x, with fa4 needing 1.40x of dense attention's memory in
        training against Triton's 1.02x. Session 6 (backward in head chunks, rotated lists):
        Wan 720p forward+backward fa4 3.25x at 6,129 MiB peak, Triton 3.20x at 5,593 MiB; a
        tie in time, so the lower memory decides. So fa4 goes first for unpaired 64-row
        blocks in inference only. Paired 64-token layouts (refined from coarser blocks) run
        faster on fa4 (forward 0.89 vs 0.66 of dense, exact256 masks), so they keep fa4
        first."""
        unpaired_q64 = call.block_shape[0] == 64 and call.q_group_size % 2
        if call.capability == (9, 0) and unpaired_q64 and call.requires_grad:
            return 5
        return self.priority

    def _call_refusal(self, call: AttentionCall) -> str | None:
        """Refusals that do not depend on the schedule."""
        if not find_flash_attn_cute():
            return NOT_INSTALLED
        if tuple(call.block_shape) not in BLOCK_SHAPES:
            shapes = ", ".join(_shape(s) for s in BLOCK_SHAPES)
            return f"block shape {_shape(call.block_shape)} not in {shapes}"
        if call.head_dim not in HEAD_DIMS:
            return f"head dim {call.head_dim} not in {HEAD_DIMS}, the head dims vsa-fa4 runs"
        if call.dtype not in DTYPES:
            return f"dtype {call.dtype} not supported (float16, bfloat16)"
        if call.device.type != "cuda":
            return f"needs a CUDA device ({ARCH_NAMES}), got {call.device.type}"
        return None

    def plan(self, layout: BlockSparseLayout, schedule: str | None = None) -> Plan:
        """The physical plan this backend runs ``layout`` with (``schedule`` overrides the
        backend's own)."""
        return make_plan(
            layout.block_shape,
            layout.q_group_size,
            layout.num_q_blocks,
            self.schedule if schedule is None else schedule,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
        schedule: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from vsa_fa4.ops import attention

        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        plan = _checked_plan(
            self.schedule if schedule is None else schedule, q.device, q.dtype, q.shape[-1],
            layout.block_shape, layout.q_group_size, layout.num_q_blocks, requires_grad,
        )  # fmt: skip
        return attention(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, scale, plan,
            layout.q_group_size, layout.kv_blocks_full,
        )  # fmt: skip


@resolved_once
def _checked_plan(
    schedule: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_shape: tuple[int, int],
    q_group_size: int,
    num_q_blocks: int,
    requires_grad: bool,
) -> Plan:
    """The physical plan of a call so described, or ValueError with the reason fa4 cannot run
    it (decided once per description: every forward asks)."""
    call = AttentionCall(device, dtype, head_dim, block_shape, requires_grad, q_group_size)
    backend = FA4Backend(schedule)
    reason = backend._call_refusal(call)
    plan = None
    if reason is None:
        plan = make_plan(block_shape, q_group_size, num_q_blocks, schedule)
        reason = plan_refusal(call.capability, head_dim, plan, requires_grad)
    if reason is not None:
        where = "" if plan is None else f" with physical blocks {_shape(plan.block_size)}"
        raise ValueError(f"the fa4 backend cannot run this call{where}: {reason}")
    assert plan is not None
    return plan

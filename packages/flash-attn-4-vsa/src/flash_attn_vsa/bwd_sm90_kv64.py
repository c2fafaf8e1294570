"""The KV64 backward's kernel class (delta 1, `flash_attn_vsa.bwd_sm90`): upstream's sm_90
backward with registers sized for one MMA warpgroup.

A leaf below `bwd_sm90` (configurations, scopes, the entry point) and `bwd_sm90_dq_parts`
(delta 8, which subclasses this class), so that those two import each other one way:
`bwd_sm90` re-exports `kernel_class` and the register counts.
"""

from __future__ import annotations

import functools

__all__ = ["MMA_REGISTERS", "PRODUCER_REGISTERS", "kernel_class"]

MMA_REGISTERS = 240
"""Registers per thread of the lone MMA warpgroup (the producer warpgroup keeps 24)."""
PRODUCER_REGISTERS = 24


@functools.cache
def kernel_class() -> type:
    """Upstream's sm_90 backward kernel class with registers sized for one MMA warpgroup."""
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    class FlashAttentionBackwardSm90KV64(FlashAttentionBackwardSm90):
        """Same kernel; with a single MMA warpgroup it gets `MMA_REGISTERS` registers per
        thread (upstream's split for three warpgroups, 160, spills this tile)."""

        def _setup_attributes(self) -> None:
            if self.num_wg_mma == 1:
                self.num_mma_regs_wg0 = MMA_REGISTERS
                self.num_mma_regs_wg1 = MMA_REGISTERS
                self.num_mma_regs = MMA_REGISTERS
                self.num_producer_regs = PRODUCER_REGISTERS
            super()._setup_attributes()

    return FlashAttentionBackwardSm90KV64

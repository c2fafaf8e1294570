"""Block-sparse forward with 64x64 blocks on Hopper (sm_90), two CTAs per SM: the fork's second
delta.

For 64-row sparse query blocks upstream FA4 (4.0.0b36) runs its sm_90 forward kernel class,
``flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90``, with 64x64 tiles: one MMA
warpgroup and one producer warpgroup per CTA, registers 256 / 56 and a launch bound of one CTA
per SM. So each SM runs a single MMA warpgroup, and nothing overlaps its softmax with another
warpgroup's MMAs (dense FA4 runs two per CTA): 0.55 of dense forward on an H200.

This delta launches the same kernel for **two CTAs per SM**: the launch bound asks for two
blocks per multiprocessor (128 registers per thread at launch) and ``setmaxnreg`` gives the
MMA warpgroup 232 and the producer 24, so two CTAs' 512 threads fit the register file; at two
key/value stages a CTA needs about 81 KB of shared memory, two fit in 228 KB. Each SM then
runs two independent 64-row query blocks, each walking its own key list. Measured on an H200
(``research/fa4_fork/experiments/q64_fwd_two_ctas.py``, ``research/fa4_fork/NOTES.md``,
experiment 3): 0.78 of dense instead of 0.55, output identical in error to upstream's.

`kernel_class()` is the subclass (register split and launch bound; the kernel body is
upstream's), `block_sparse_forward_q64` runs upstream's ``_flash_attn_fwd`` with it. This module
also describes every fork forward as a frozen value, `ForwardKernel` (kind, Q in registers,
persistent CTAs), which the fork's forward entry points (this one, `fwd_sm90_paired`'s,
`experimental.fwd_sm90_streams`') build from their arguments and have upstream build through
`_building` (`flash_attn_vsa.build_scope`: upstream's launcher takes its kernel class from a
module global, so a stand-in there asks what the entry point on this thread is building).
Upstream's compile cache key does not include the kernel class, so such kernels are compiled
into and looked up in a cache of their own.

Upstream internals this relies on (fingerprinted in ``upstream_api.json``):
``interface._flash_attn_fwd`` constructing ``interface.FlashAttentionForwardSm90`` (a module
global) and keeping its compiled kernels in ``_flash_attn_fwd.compile_cache`` (``in``, item get
and set), and ``FlashAttentionForwardSm90`` choosing ``num_mma_regs`` / ``num_producer_regs``
before ``_setup_attributes`` and launching from ``__call__`` through ``self.kernel(...)``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from flash_attn_vsa import build_scope, mask_sm90
from flash_attn_vsa.combine_sm90 import (
    COMBINE_KINDS,
    GATED,
    check_operands,
    combine_operands,
    with_combined_epilogue,
)
from flash_attn_vsa.sm90_blocks import (
    BLOCK_SIZE,
    HEAD_DIMS,
    BoundLauncher,
    ScopedCompileCache,
    check_call,
)

__all__ = [
    "BLOCK_SIZE",
    "CTAS_PER_SM",
    "HEAD_DIMS",
    "KINDS",
    "ForwardKernel",
    "block_sparse_forward_q64",
    "check_call",
    "kernel_class",
    "sm_count",
]

CTAS_PER_SM = 2
MMA_REGISTERS = 232
"""Registers per thread of the MMA warpgroup; the producer warpgroup gets the rest of 256
(24), so that two CTAs of 2 x 128 threads fit the 64K register file."""
PRODUCER_REGISTERS = 256 - MMA_REGISTERS


def kernel_class(q_in_registers: bool = False, persistent: bool | int = False) -> type:
    """Upstream's sm_90 forward kernel class, sized and launched for two CTAs per SM; with
    ``q_in_registers`` QK^T reads Q from registers (delta 5, what vsa-fa4 runs), with
    ``persistent`` its CTAs walk the tiles (delta 7, experimental: vsa-fa4 asks for it only on
    request). One class object per variant."""
    return ForwardKernel(TWO_CTAS, q_in_registers, persistent).kernel_class()


@functools.cache
def _two_cta_class() -> type:
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    class FlashAttentionForwardSm90TwoCtas(FlashAttentionForwardSm90):
        """Same kernel body; one MMA warpgroup (64-row tiles) with `MMA_REGISTERS` registers,
        the producer with `PRODUCER_REGISTERS`, two CTAs per SM."""

        def _setup_attributes(self) -> None:
            if self.num_wg_mma != 1:
                raise ValueError(
                    "two CTAs per SM need one MMA warpgroup (64-row query tiles), got "
                    f"{self.num_wg_mma}"
                )
            self.num_mma_regs = MMA_REGISTERS
            self.num_producer_regs = PRODUCER_REGISTERS
            super()._setup_attributes()

        def kernel(self, *args: Any, **kwargs: Any) -> Any:
            launcher = FlashAttentionForwardSm90.kernel(self, *args, **kwargs)
            return BoundLauncher(launcher, CTAS_PER_SM)

    return FlashAttentionForwardSm90TwoCtas


TWO_CTAS = "two_ctas"
PAIRED_KEYS = "paired_keys"
TWO_STREAMS = "two_streams"
KINDS = (TWO_CTAS, PAIRED_KEYS, TWO_STREAMS)
"""The fork's sm_90 forward kernels: this module's two-CTA one, `fwd_sm90_paired`'s and
`experimental.fwd_sm90_streams`'s."""


@dataclass(frozen=True)
class ForwardKernel:
    """One of the fork's sm_90 forward kernels, as its entry point has upstream build it:
    ``kind`` (one of `KINDS`), with Q in registers for QK^T (delta 5, `q_regs_sm90`) or not,
    with VSA's combine in its epilogue (``combine``, delta 9, `combine_sm90`: "" for none) or
    not, and on persistent CTAs (delta 7, `experimental.persistent_sm90`): ``persistent`` True for
    as many as the GPU holds at once, a positive int for that many (tests use a few, so that
    each walks many tiles), False for one CTA per tile (upstream's launch). Stored as the
    number of CTAs (0: not persistent), so that equal kernels compare and hash equal.
    ``valid_in_list``: partial-list entries carry their key block's valid size (delta 10,
    `valid_in_list_sm90`); ``zero_v_padding`` (with it): the consumer zeroes partial blocks' V
    padding rows in shared memory, so V's padding slots may hold anything (delta 11,
    `experimental.v_padding_sm90`)."""

    kind: str
    q_in_registers: bool = False
    persistent: int = 0
    combine: str = ""
    valid_in_list: bool = False
    zero_v_padding: bool = False
    direction: ClassVar[str] = "fwd"  # what `build_scope.current` tells apart

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.combine not in COMBINE_KINDS:
            raise ValueError(f"combine must be one of {COMBINE_KINDS}, got {self.combine!r}")
        if self.combine and (self.kind != TWO_CTAS or self.persistent):
            raise ValueError(
                "the combined epilogue runs in the two-CTA 64x64 kernel only (one query block "
                f"a CTA), not in {self.kind!r}{' on persistent CTAs' if self.persistent else ''}"
            )
        if self.valid_in_list and self.kind != TWO_CTAS:
            raise ValueError(
                f"valid sizes in the lists: the two-CTA kernel only, not {self.kind!r}"
            )
        if self.zero_v_padding and not self.valid_in_list:
            raise ValueError("zero_v_padding reads the valid sizes in the lists: valid_in_list")
        if not isinstance(self.persistent, int) or self.persistent < 0:
            raise ValueError(
                f"persistent must be a bool or a positive number of CTAs, got {self.persistent!r}"
            )
        ctas = sm_count() * self.ctas_per_sm if self.persistent is True else int(self.persistent)
        object.__setattr__(self, "persistent", ctas)

    @property
    def two_block_stages(self) -> bool:
        """Whether its key/value stages hold two 64-token blocks (the paired-key producer)."""
        return self.kind in (PAIRED_KEYS, TWO_STREAMS)

    @property
    def staged_rows(self) -> int:
        """Times the rows of a tile its key/value stages hold (`sm90_operands`: the two-stream
        kernel's stages hold two 64-token blocks for 64-key tiles)."""
        return 2 if self.kind == TWO_STREAMS else 1

    @property
    def ctas_per_sm(self) -> int:
        return CTAS_PER_SM if self.kind == TWO_CTAS else 1

    def kernel_class(self) -> type:
        """The kernel class: the kind's, with the variants' subclasses on top."""
        if self.kind == TWO_CTAS:
            cls = _two_cta_class()
        elif self.kind == PAIRED_KEYS:
            from flash_attn_vsa.paired_sm90 import _paired_class

            cls = _paired_class()
        else:
            from flash_attn_vsa.experimental.streams_sm90 import _streams_class

            cls = _streams_class()
        if self.q_in_registers:
            from flash_attn_vsa.q_regs_sm90 import with_q_in_registers

            cls = with_q_in_registers(cls)
        if self.persistent:
            from flash_attn_vsa.experimental.persistent_sm90 import with_persistent_tiles

            cls = with_persistent_tiles(cls)
        if self.valid_in_list:
            from flash_attn_vsa.valid_in_list_sm90 import with_valid_sizes_in_list

            cls = with_valid_sizes_in_list(cls)
        if self.zero_v_padding:
            from flash_attn_vsa.experimental.v_padding_sm90 import with_v_padding_zeroed

            cls = with_v_padding_zeroed(cls)
        if self.combine:
            cls = with_combined_epilogue(cls, self.combine == GATED)
        return cls

    def mask_class(self) -> type | None:
        """The ``AttentionMask`` this kernel's lists need (packed entries: the paired and
        two-stream kernels'), or None for the one every other kernel builds."""
        if self.kind == PAIRED_KEYS:
            from flash_attn_vsa import paired_sm90

            return paired_sm90.mask_class()
        if self.kind == TWO_STREAMS:
            from flash_attn_vsa.experimental import streams_sm90

            return streams_sm90.mask_class()
        return None


def _current_kernel_class() -> type:
    """The sm_90 forward kernel class upstream's interface builds on this thread now: the
    `ForwardKernel` a fork entry point is building (`ForwardKernel.kernel_class`), upstream's
    own elsewhere."""
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    kernel = build_scope.current("fwd")
    return FlashAttentionForwardSm90 if kernel is None else kernel.kernel_class()


@functools.cache
def _install() -> None:
    """Once per process: upstream's forward builds the kernel class of the `ForwardKernel` a
    fork entry point is building on the calling thread, from that kernel's own compile cache,
    and exactly what it did before everywhere else (other threads included)."""
    import flash_attn.cute.interface as interface

    upstream_class = interface.FlashAttentionForwardSm90

    class ScopedKernelClass(upstream_class):  # a subclass, so issubclass/isinstance still hold
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            # Returns an instance of another class, so Python does not call __init__ again.
            return _current_kernel_class()(*args, **kwargs)

    interface.FlashAttentionForwardSm90 = ScopedKernelClass
    fwd = interface._flash_attn_fwd
    fwd.compile_cache = ScopedCompileCache(fwd.compile_cache, lambda: build_scope.current("fwd"))


@contextmanager
def _building(kernel: ForwardKernel) -> Iterator[None]:
    """For the fork's forward entry points only: within this block, on this thread, upstream's
    ``_flash_attn_fwd`` compiles and runs its sm_90 forward as ``kernel``
    (`ForwardKernel.kernel_class`), from that kernel's own compile cache; the two-stream
    kernel's stages get two blocks' rows (`sm90_operands`), persistent kernels their scheduler
    (`experimental.persistent_sm90` over ``kernel.persistent`` CTAs). Upstream's launcher takes
    none of these as arguments (see `flash_attn_vsa.build_scope`)."""
    if not isinstance(kernel, ForwardKernel):
        raise ValueError(f"kernel must be a ForwardKernel, got {kernel!r}")
    _install()
    if kernel.two_block_stages:
        from flash_attn_vsa import paired_sm90

        paired_sm90._install()
    if kernel.staged_rows != 1:
        from flash_attn_vsa import sm90_operands

        sm90_operands.install()
    if kernel.persistent:
        from flash_attn_vsa.experimental import persistent_sm90

        persistent_sm90.install()
    with build_scope.building(kernel):
        yield


def sm_count() -> int:
    """Multiprocessors of the current CUDA device, or (compiling without a GPU) FA4's
    ``FLASH_ATTENTION_NUM_SMS``, or 132 (an H100 / H200)."""
    import os

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return int(os.environ.get("FLASH_ATTENTION_NUM_SMS", "132"))


@functools.cache
def _one_cta_a_tile(
    q_in_registers: bool, combine: str, valid_in_list: bool, zero_v_padding: bool
) -> ForwardKernel:
    """The two-CTA `ForwardKernel` without persistent CTAs, made once (its checks cost ~1.5 us
    of a call's host time)."""
    return ForwardKernel(TWO_CTAS, q_in_registers, False, combine, valid_in_list, zero_v_padding)


def block_sparse_forward_q64(
    q: Any,
    k: Any,
    v: Any,
    block_sparse_tensors: Any,
    *,
    softmax_scale: float,
    mask_mod: Any = None,
    aux_tensors: list[Any] | None = None,
    out: Any = None,
    lse: Any = None,
    q_in_registers: bool = False,
    persistent: bool | int = False,
    replay: bool = True,
    coarse: Any = None,
    gate: Any = None,
    zero_v_padding: bool = False,
) -> tuple[Any, Any]:
    """Block-sparse attention forward on sm_90 with 64x64 sparse blocks, two CTAs per SM.

    Arguments as upstream's ``_flash_attn_fwd``: BSHD ``q, k, v`` (fp16/bf16),
    ``block_sparse_tensors`` an FA4 ``BlockSparseTensorsTorch`` in the forward direction (per
    64-token query block: its key blocks, full and partial lists apart) with
    ``block_size=(64, 64)``, optional ``mask_mod`` + ``aux_tensors`` applied on the partial
    lists, optional preallocated ``out`` [B, S, H, D] and ``lse`` [B, H, S] float32. Returns
    ``(out, lse)``; rows that see no key get out 0 and lse -inf. ``q_in_registers``: QK^T
    reads Q from registers (delta 5, `q_regs_sm90`), ``persistent``: CTAs walk the tiles
    (delta 7, `experimental.persistent_sm90`, experimental). vsa-fa4 runs this forward with Q
    in registers and without persistent CTAs unless asked otherwise. ``replay``: after the first
    calls of a description, replay what upstream's launcher did on the device without its
    per-call Python (`launch_replay`); False runs upstream's launcher every call.
    ``coarse`` [B, S / 64, H, D] (and ``gate``, like ``out``, any stride 0; None: 1): the
    output is ``fine + gate * coarse[query block]``, added in the epilogue (delta 9,
    `combine_sm90`); no log-sum-exp is computed then (``lse`` must be None: the combined
    output is an inference output) and the returned lse is None.
    ``zero_v_padding`` (partial lists with valid sizes in their entries only, the mask_mod
    `mask_sm90.valid_in_list_mask_mod`): partial key blocks' V padding rows are zeroed in
    shared memory (delta 11, `experimental.v_padding_sm90`), so v's padding slots may hold
    anything, NaN and inf included; without it they must be finite.
    """
    from flash_attn_vsa import launch_replay

    check_call(q, k, v, tuple(block_sparse_tensors.block_size or ()))
    combine = ""
    if coarse is not None:
        check_operands(q, v, coarse, gate, lse)
        combine, operands = combine_operands(coarse, gate)
        aux_tensors = [*(aux_tensors or ()), *operands]
    elif gate is not None:
        raise ValueError("gate needs coarse (the combine's other operand)")
    # the mask_mod says what the partial list holds (delta 10: entries with valid sizes)
    valid_in_list = bool(getattr(mask_mod, mask_sm90.VALID_IN_LIST_ATTR, False))
    if zero_v_padding and not valid_in_list:
        raise ValueError(
            "zero_v_padding needs lists with valid sizes in their entries "
            "(mask_mod=mask_sm90.valid_in_list_mask_mod)"
        )
    kernel = (
        ForwardKernel(TWO_CTAS, q_in_registers, persistent, combine, valid_in_list, zero_v_padding)
        if persistent  # its CTA count follows the current device's SMs
        else _one_cta_a_tile(q_in_registers, combine, valid_in_list, zero_v_padding)
    )
    return launch_replay.forward(
        kernel, _building, q, k, v,
        block_sparse_tensors, softmax_scale=softmax_scale, mask_mod=mask_mod,
        aux_tensors=aux_tensors, out=out, lse=lse, replay=replay, return_lse=not combine,
    )  # fmt: skip

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
(``experiments/q64_fwd_two_ctas.py``, NOTES.md, experiment 3): 0.78 of dense instead of 0.55,
output identical in error to upstream's.

`kernel_class()` is the subclass (register split and launch bound; the kernel body is
upstream's), `block_sparse_forward_q64` runs upstream's ``_flash_attn_fwd`` with it.
Upstream's compile cache key does not include the kernel class, so inside `two_cta_scope`
kernels are compiled into and looked up in a cache of our own.

Upstream internals this relies on (fingerprinted in ``upstream_api.json``):
``interface._flash_attn_fwd`` constructing ``interface.FlashAttentionForwardSm90`` (a module
global) and keeping its compiled kernels in ``_flash_attn_fwd.compile_cache`` (``in``, item get
and set), and ``FlashAttentionForwardSm90`` choosing ``num_mma_regs`` / ``num_producer_regs``
before ``_setup_attributes`` and launching from ``__call__`` through ``self.kernel(...)``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flash_attn_vsa.sm90_blocks import BLOCK_SIZE, HEAD_DIMS, check_call

__all__ = [
    "BLOCK_SIZE",
    "CTAS_PER_SM",
    "HEAD_DIMS",
    "block_sparse_forward_q64",
    "check_call",
    "current_kernel_class",
    "current_scope",
    "forward_scope",
    "kernel_class",
    "two_cta_scope",
]

CTAS_PER_SM = 2
MMA_REGISTERS = 232
"""Registers per thread of the MMA warpgroup; the producer warpgroup gets the rest of 256
(24), so that two CTAs of 2 x 128 threads fit the 64K register file."""
PRODUCER_REGISTERS = 256 - MMA_REGISTERS


class _TwoCtaLauncher:
    """Upstream's kernel launcher, launched with a bound of `CTAS_PER_SM` CTAs per SM."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def launch(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["min_blocks_per_mp"] = CTAS_PER_SM
        # The whole carveout for shared memory (two CTAs of ~81 KB); stating it also spares
        # the device query that a compile on a machine without a GPU cannot make.
        kwargs.setdefault("preferred_smem_carveout", 100)
        return self._inner.launch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def kernel_class(q_in_registers: bool = False) -> type:
    """Upstream's sm_90 forward kernel class, sized and launched for two CTAs per SM; with
    ``q_in_registers``, QK^T reads Q from registers (delta 5, `q_regs_sm90`; not measured yet,
    so vsa-fa4 does not ask for it). One class object per variant."""
    if q_in_registers:
        from flash_attn_vsa.q_regs_sm90 import with_q_in_registers

        return with_q_in_registers(_two_cta_class())
    return _two_cta_class()


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
            return _TwoCtaLauncher(FlashAttentionForwardSm90.kernel(self, *args, **kwargs))

    return FlashAttentionForwardSm90TwoCtas


_active = threading.local()

TWO_CTAS = "two_ctas"
TWO_CTAS_Q_IN_REGISTERS = "two_ctas_q_in_registers"
PAIRED_KEYS = "paired_keys"
PAIRED_KEYS_Q_IN_REGISTERS = "paired_keys_q_in_registers"
TWO_STREAMS = "two_streams"
TWO_STREAMS_Q_IN_REGISTERS = "two_streams_q_in_registers"
"""Forward scopes: `kernel_class()` (this module), `fwd_sm90_paired.kernel_class()` and
`fwd_sm90_streams.kernel_class()`, each plain or with Q in registers (delta 5)."""
SCOPES = (
    TWO_CTAS,
    TWO_CTAS_Q_IN_REGISTERS,
    PAIRED_KEYS,
    PAIRED_KEYS_Q_IN_REGISTERS,
    TWO_STREAMS,
    TWO_STREAMS_Q_IN_REGISTERS,
)
PAIRED_SCOPES = (PAIRED_KEYS, PAIRED_KEYS_Q_IN_REGISTERS)
STREAMS_SCOPES = (TWO_STREAMS, TWO_STREAMS_Q_IN_REGISTERS)
TWO_BLOCK_STAGE_SCOPES = PAIRED_SCOPES + STREAMS_SCOPES
"""Scopes whose key/value stages hold two 64-token blocks (the paired-key producer's)."""
Q_IN_REGISTERS_SCOPES = (
    TWO_CTAS_Q_IN_REGISTERS,
    PAIRED_KEYS_Q_IN_REGISTERS,
    TWO_STREAMS_Q_IN_REGISTERS,
)


def current_scope() -> str | None:
    """The innermost forward scope active on this thread (one of `SCOPES`) or None."""
    stack = getattr(_active, "stack", ())
    return stack[-1] if stack else None


def current_kernel_class() -> type:
    """The sm_90 forward kernel class upstream's interface builds on this thread now:
    `kernel_class()` inside `two_cta_scope`, the paired-key class inside
    ``fwd_sm90_paired.paired_scope``, the two-stream class inside
    ``fwd_sm90_streams.streams_scope`` (each with Q in registers where the scope says so),
    upstream's own elsewhere."""
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    scope = current_scope()
    if scope in (TWO_CTAS, TWO_CTAS_Q_IN_REGISTERS):
        return kernel_class(q_in_registers=scope == TWO_CTAS_Q_IN_REGISTERS)
    if scope in PAIRED_SCOPES:
        from flash_attn_vsa import fwd_sm90_paired

        return fwd_sm90_paired.kernel_class(q_in_registers=scope == PAIRED_KEYS_Q_IN_REGISTERS)
    if scope in STREAMS_SCOPES:
        from flash_attn_vsa import fwd_sm90_streams

        return fwd_sm90_streams.kernel_class(q_in_registers=scope == TWO_STREAMS_Q_IN_REGISTERS)
    return FlashAttentionForwardSm90


class _ScopedCompileCache:
    """Upstream's forward compile cache, except inside one of our scopes on the calling thread,
    where compiled kernels go to and come from a dictionary of that scope (upstream's key does
    not include the kernel class, so the variants must not share entries)."""

    def __init__(self, upstream: Any) -> None:
        self.upstream = upstream
        self.own: dict[str, dict[Any, Any]] = {}

    def _current(self) -> Any:
        scope = current_scope()
        return self.upstream if scope is None else self.own.setdefault(scope, {})

    def __contains__(self, key: Any) -> bool:
        return key in self._current()

    def __getitem__(self, key: Any) -> Any:
        return self._current()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._current()[key] = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.upstream, name)


@functools.cache
def _install() -> None:
    """Once per process: upstream's forward builds `kernel_class()` and uses our compile cache
    inside `two_cta_scope` on the calling thread, and exactly what it did before everywhere
    else (other threads included)."""
    import flash_attn.cute.interface as interface

    upstream_class = interface.FlashAttentionForwardSm90

    class ScopedKernelClass(upstream_class):  # a subclass, so issubclass/isinstance still hold
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            # Returns an instance of another class, so Python does not call __init__ again.
            return current_kernel_class()(*args, **kwargs)

    interface.FlashAttentionForwardSm90 = ScopedKernelClass
    fwd = interface._flash_attn_fwd
    fwd.compile_cache = _ScopedCompileCache(fwd.compile_cache)


@contextmanager
def forward_scope(scope: str) -> Iterator[None]:
    """Within this block, on this thread, upstream's ``_flash_attn_fwd`` compiles and runs its
    sm_90 forward as the class of ``scope`` (one of `SCOPES`), from that scope's own compile
    cache."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    _install()
    _active.stack = (*getattr(_active, "stack", ()), scope)
    try:
        yield
    finally:
        _active.stack = _active.stack[:-1]


def two_cta_scope(q_in_registers: bool = False) -> contextlib.AbstractContextManager[None]:
    """Within this block, on this thread, upstream's ``_flash_attn_fwd`` compiles and runs its
    sm_90 forward as ``kernel_class(q_in_registers)`` (from its own compile cache)."""
    return forward_scope(TWO_CTAS_Q_IN_REGISTERS if q_in_registers else TWO_CTAS)


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
) -> tuple[Any, Any]:
    """Block-sparse attention forward on sm_90 with 64x64 sparse blocks, two CTAs per SM.

    Arguments as upstream's ``_flash_attn_fwd``: BSHD ``q, k, v`` (fp16/bf16),
    ``block_sparse_tensors`` an FA4 ``BlockSparseTensorsTorch`` in the forward direction (per
    64-token query block: its key blocks, full and partial lists apart) with
    ``block_size=(64, 64)``, optional ``mask_mod`` + ``aux_tensors`` applied on the partial
    lists, optional preallocated ``out`` [B, S, H, D] and ``lse`` [B, H, S] float32. Returns
    ``(out, lse)``; rows that see no key get out 0 and lse -inf. ``q_in_registers``: QK^T
    reads Q from registers (delta 5, `q_regs_sm90`; experimental until measured).
    """
    from flash_attn.cute.interface import _flash_attn_fwd

    check_call(q, k, v, tuple(block_sparse_tensors.block_size or ()))
    with two_cta_scope(q_in_registers):
        result = _flash_attn_fwd(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            mask_mod=mask_mod,
            aux_tensors=aux_tensors,
            block_sparse_tensors=block_sparse_tensors,
            return_lse=True,
            out=out,
            lse=lse,
        )
    return result[0], result[1]

"""Block-sparse backward with 64-token key blocks on Hopper (sm_90): the fork's first delta.

Upstream FA4 (4.0.0b36) runs its sm_90 backward at head dim 128 with 128-row key tiles held by
two MMA warpgroups, and its block-sparse backward requires the sparse key block to equal that
tile, so it refuses VSA's 64-token key blocks. Its kernel class,
``flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90``, is parameterised by tile shape,
warpgroup layouts and pipeline stages, though, and the whole backward (preprocess, block-sparse
main loop, postprocess) is correct at 64x64 tiles under every warpgroup layout we measured on
an H200 (``research/fa4_fork/experiments/kv64_bwd_configs.py``; the journal,
``research/fa4_fork/NOTES.md``). What it lacks is a configuration that is fast there:

- shrinking the two-warpgroup layout to 64 key rows leaves each warpgroup a 32-row or 32-wide
  slice: 0.48-0.62 of dense backward;
- **one MMA warpgroup owning the whole 64x64 tile**, S = Q K^T unswapped (M = 64 query rows),
  P and dS through shared memory: 0.71 (0.66 paced, session 8). Upstream sizes registers only
  for two or three MMA warpgroups, giving a lone one 160 registers and spilling (592 B of
  stack); our subclass gives it 240 (no spills).

Since session 9 the 64x64 backward runs that tile **two CTAs per SM**, dQ leaving in halves
through a 16 KB buffer sent by the producer warp (`KV64_CONFIG`, delta 8 in
`bwd_sm90_dq_parts`): upstream's 32 KB dQ staging does not fit two CTAs.

128-token query blocks over 64-token key blocks run 128x64 tiles with two MMA warpgroups, each
owning 64 query rows (`Q128_KV64_CONFIG`): 0.67-0.68 of dense against 0.64-0.65 for the same
blocks split into 64-row ones.

This module is that delta: the tile configurations (`config_for` a block size: the shipped
ones; others, such as those under measurement in `flash_attn_vsa.experimental.bwd_configs`,
are passed as ``config=`` to the entry point), `kernel_class()` (the subclass with the register
split; `TileConfig.kernel_class` picks delta 8's where a configuration asks for it) and
`block_sparse_backward_kv64`, which runs upstream's ``_flash_attn_bwd`` building both for the
duration of the call. Everything else (preprocess, postprocess, block-sparse iteration,
mask_mod on partial blocks) is upstream's.

Upstream internals this relies on (fingerprinted in ``upstream_api.json``):
``interface._tile_size_bwd_sm90`` and ``interface.FlashAttentionBackwardSm90`` (looked up as
module globals by ``_flash_attn_bwd`` when it builds a kernel: it takes neither as an argument,
so stand-ins there ask what the entry point on this thread is building, `_building` over
`flash_attn_vsa.build_scope`), ``BwdConfig``'s fields, and
``FlashAttentionBackwardSm90._setup_attributes`` running after its register split is chosen.
Upstream's compile cache keys the configuration (tile shape, stages, layouts, thread count) but
not the kernel class, so kernels built by the entry point go to and come from a cache of their
class (`sm90_blocks.ScopedCompileCache` over ``_flash_attn_bwd.compile_cache``: ``in``, item get
and set).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar

from flash_attn_vsa import build_scope
from flash_attn_vsa.bwd_sm90_kv64 import (  # re-exported
    MMA_REGISTERS as MMA_REGISTERS,
)
from flash_attn_vsa.bwd_sm90_kv64 import (
    PRODUCER_REGISTERS as PRODUCER_REGISTERS,
)
from flash_attn_vsa.bwd_sm90_kv64 import kernel_class
from flash_attn_vsa.sm90_blocks import BWD_BLOCK_SIZES, HEAD_DIMS, ScopedCompileCache, check_call

__all__ = [
    "BWD_BLOCK_SIZES",
    "HEAD_DIMS",
    "KV64_CONFIG",
    "KV64_DS_CONFIG",
    "KV64_STAGED_CONFIG",
    "KV64_TWO_CTAS_BASE",
    "Q128_KV64_CONFIG",
    "TileConfig",
    "block_sparse_backward_kv64",
    "check_call",
    "config_for",
]


@dataclass(frozen=True)
class TileConfig:
    """Our copy of the fields of upstream's ``interface.BwdConfig`` that we set."""

    m_block_size: int = 64
    n_block_size: int = 64
    num_stages_Q: int = 2
    num_stages_dO: int = 2
    num_stages_PdS: int = 2
    SdP_swapAB: bool = False
    dKV_swapAB: bool = False
    dQ_swapAB: bool = False
    AtomLayoutMSdP: int = 1
    AtomLayoutNdKV: int = 1
    AtomLayoutMdQ: int = 1
    num_wg: int = 1
    dq_parts: int = 0
    """Ours, not upstream's: 0 stages dQ as upstream does (32 KB, handed to a producer warp);
    n > 0 sends it in n parts through buffers of the kernel's own (`bwd_sm90_dq_parts`)."""
    dq_buffers: int = 1
    """Ours: with ``dq_parts``, the buffers of one part each that the parts take in turn."""
    dq_sender: str = "mma"
    """Ours: with ``dq_parts``, who issues the reduce-adds (`bwd_sm90_dq_parts.DqStaging`)."""
    ctas_per_sm: int = 1
    """Ours: CTAs per SM the kernel is sized and launched for (2 needs ``dq_parts``)."""
    ablate_dq: bool = False
    """Ours, experiments only (with ``dq_parts``): dQ computed and never sent, so dQ comes out
    zero; bounds what any dQ path could give the kernel."""
    dq_from_ds: bool = False
    """Ours (with ``dq_parts``, which then only sizes nothing): no dQ in this kernel; each step
    writes its dS to the buffer in the call's last aux tensors, for a query-owned pass to
    compute dQ from (delta 12, `bwd_sm90_ds_out`). The call leaves dq as it was (upstream's
    dQ conversion is skipped for it)."""
    direction: ClassVar[str] = "bwd"  # what `build_scope.current` tells apart

    def upstream(self) -> Any:
        from flash_attn.cute.interface import BwdConfig

        theirs = {f.name for f in fields(BwdConfig)}
        return BwdConfig(**{k: v for k, v in asdict(self).items() if k in theirs})

    def kernel_class(self) -> type:
        """The kernel class this configuration runs."""
        if self.dq_parts:
            from flash_attn_vsa import bwd_sm90_dq_parts as parts

            staging = parts.DqStaging(self.dq_parts, self.dq_buffers, self.dq_sender)
            path = "ds" if self.dq_from_ds else "none" if self.ablate_dq else "send"
            return parts.kernel_class(self.ctas_per_sm, staging, dq_path=path)
        if self.ctas_per_sm != 1 or self.ablate_dq or self.dq_from_ds:
            raise ValueError("ctas_per_sm > 1, ablate_dq and dq_from_ds need dq_parts")
        return kernel_class()


@functools.cache
def _kernel_class(config: TileConfig) -> type:
    """``config.kernel_class()``, looked up once per configuration (upstream's backward asks
    on every call, for its compile cache)."""
    return config.kernel_class()


@functools.cache
def _upstream_config(config: TileConfig) -> Any:
    """``config.upstream()``, built once per configuration (``asdict`` costs ~50 us a call on
    the H200 host, on every backward)."""
    return config.upstream()


KV64_STAGED_CONFIG = TileConfig()
"""One MMA warpgroup per 64x64 tile, S unswapped, P and dS staged in shared memory, two
stages of Q and dO, dQ staged in 32 KB for upstream's producer warp (the fastest of upstream's
layouts; shipped until session 9: 0.66 of dense at S=32768)."""

Q128_KV64_CONFIG = TileConfig(
    m_block_size=128,
    num_stages_Q=2,
    num_stages_dO=1,
    num_stages_PdS=1,
    AtomLayoutMSdP=2,
    AtomLayoutNdKV=1,
    AtomLayoutMdQ=2,
    num_wg=2,
)
"""128-row query tiles over a 64-row key tile, two MMA warpgroups: each owns 64 query rows for
S, dP and dQ (full 64x64x128 wgmmas) and half the head dim for dK and dV. Two stages of Q, one
of dO and P/dS: 226 KB of shared memory at head dim 128, the most a CTA may have. On an H200
0.67-0.68 of dense backward where the same blocks split into two 64-row ones run at 0.64-0.65
(one stage of Q: 0.41; NOTES.md, experiment 4)."""

KV64_TWO_CTAS_BASE = replace(KV64_STAGED_CONFIG, num_stages_dO=1, num_stages_PdS=1, ctas_per_sm=2)
"""64x64 tiles for two CTAs per SM: one stage of dO and of P/dS (Q keeps two), 96 KB before dQ's
buffers (a CTA may have 113 KB); the base of `KV64_CONFIG` and of the two-CTA configurations in
`flash_attn_vsa.experimental.bwd_configs` (it runs only with ``dq_parts``)."""

KV64_CONFIG = replace(KV64_TWO_CTAS_BASE, dq_parts=2, dq_buffers=1, dq_sender="producer")
"""The shipped 64x64 backward (delta 8, `bwd_sm90_dq_parts`): two CTAs per SM (113 KB of shared
memory each), each with one MMA warpgroup whose dQ goes to L2 in halves through a 16 KB buffer,
sent by upstream's otherwise idle producer warp (mbarrier handover). On an H200 (experiment
13d, S = 32k / 128k, lists rotated by the CTAs running at once: `ctas_per_sm`) 0.70 / 0.72 of
dense against 0.65-0.66 / 0.68-0.69 for the staged kernel of session 8 (`KV64_STAGED_CONFIG`);
the same kernel with dQ never sent runs 1.02-1.05: sending dQ is what is left."""


KV64_DS_CONFIG = replace(KV64_TWO_CTAS_BASE, dq_parts=2, dq_from_ds=True)
"""The 64x64 backward writing dS for a separate dQ pass (delta 12, `bwd_sm90_ds_out`): two
CTAs per SM like `KV64_CONFIG`, without its dQ MMA and reduce-adds."""


def config_for(block_size: tuple[int, int]) -> TileConfig:
    """The shipped tile configuration of a sparse block in `BWD_BLOCK_SIZES` (what
    `block_sparse_backward_kv64` runs when it is given no ``config``)."""
    return KV64_CONFIG if tuple(block_size) == (64, 64) else Q128_KV64_CONFIG


def _building_config(*args: Any, **kwargs: Any) -> Any:
    """``interface._tile_size_bwd_sm90`` as upstream's backward sees it (see `_install`)."""
    config = build_scope.current("bwd")
    if config is not None:
        return _upstream_config(config)
    return _building_config.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]


@functools.cache
def _install() -> None:
    """Once per process: upstream's sm_90 backward takes its configuration (``BwdConfig``), its
    kernel class and its compile cache from the `TileConfig` a fork entry point is building on
    the calling thread (`_building`), and for one that writes dS skips its dQ conversion
    (`_building_postprocess`) and the zeroing of its float32 dQ accumulator
    (`_building_preprocess`); exactly what it took before everywhere else (other callers of
    upstream, other threads)."""
    import flash_attn.cute.interface as interface

    _building_config.__wrapped__ = interface._tile_size_bwd_sm90  # type: ignore[attr-defined]
    interface._tile_size_bwd_sm90 = _building_config
    upstream_class = interface.FlashAttentionBackwardSm90

    class ScopedKernelClass(upstream_class):  # a subclass, so issubclass/isinstance still hold
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            # Returns an instance of another class, so Python does not call __init__ again.
            config = build_scope.current("bwd")
            built = upstream_class if config is None else _kernel_class(config)
            return built(*args, **kwargs)

    interface.FlashAttentionBackwardSm90 = ScopedKernelClass
    bwd = interface._flash_attn_bwd
    bwd.compile_cache = ScopedCompileCache(bwd.compile_cache, _building_class)
    postprocess = interface._bwd_postprocess_convert
    _building_postprocess.__wrapped__ = postprocess  # type: ignore[attr-defined]
    # upstream's function reads its cache through the module global: the stand-in carries it
    _building_postprocess.compile_cache = postprocess.compile_cache  # type: ignore[attr-defined]
    interface._bwd_postprocess_convert = _building_postprocess
    preprocess = interface._bwd_preprocess
    _building_preprocess.__wrapped__ = preprocess  # type: ignore[attr-defined]
    _building_preprocess.compile_cache = preprocess.compile_cache  # type: ignore[attr-defined]
    # where upstream's backward passes the accumulator when it passes it positionally
    _building_preprocess.dq_accum_at = list(inspect.signature(preprocess).parameters).index(
        "dq_accum"
    )  # type: ignore[attr-defined]
    interface._bwd_preprocess = _building_preprocess


def _building_preprocess(*args: Any, **kwargs: Any) -> Any:
    """``interface._bwd_preprocess`` as upstream's backward sees it (see `_install`): while a
    configuration that writes dS is building on this thread, upstream's preprocess without the
    dQ accumulator (so it does not zero it: B x H x S x D float32, 200 MB at Wan 480p, that
    nothing reads on that path, since its kernel sends no dQ and the conversion is skipped);
    else upstream's own preprocess."""
    config = build_scope.current("bwd")
    if config is not None and config.dq_from_ds:
        at = _building_preprocess.dq_accum_at  # type: ignore[attr-defined]
        if len(args) > at:
            args = (*args[:at], None, *args[at + 1 :])
        else:
            kwargs["dq_accum"] = None
    return _building_preprocess.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]


def _building_postprocess(*args: Any, **kwargs: Any) -> Any:
    """``interface._bwd_postprocess_convert`` as upstream's backward sees it (see `_install`):
    nothing while a configuration that writes dS is building on this thread (its dQ comes
    from the dS pass; upstream's float32 accumulator, which the conversion reads, stays zero),
    else upstream's own conversion."""
    config = build_scope.current("bwd")
    if config is not None and config.dq_from_ds:
        return None
    return _building_postprocess.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]


def _building_class() -> type | None:
    """The kernel class the `TileConfig` being built on this thread runs (the compile cache's
    key), or None."""
    config = build_scope.current("bwd")
    return None if config is None else _kernel_class(config)


@contextmanager
def _building(config: TileConfig) -> Iterator[None]:
    """For the fork's backward entry point only: within this block, on this thread, upstream's
    ``_flash_attn_bwd`` builds its sm_90 kernel with ``config`` and its kernel class
    (`TileConfig.kernel_class`), compiled into that class's own cache (upstream takes neither
    as an argument: see `flash_attn_vsa.build_scope`)."""
    if not isinstance(config, TileConfig):
        raise ValueError(f"config must be a TileConfig, got {config!r}")
    _install()
    _kernel_class(config)  # refuses a configuration it cannot run, before upstream is called
    with build_scope.building(config):
        yield


def block_sparse_backward_kv64(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    dout: Any,
    lse: Any,
    block_sparse_tensors: Any,
    *,
    softmax_scale: float,
    mask_mod: Any = None,
    aux_tensors: list[Any] | None = None,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    config: TileConfig | None = None,
    replay: bool = True,
) -> tuple[Any, Any, Any]:
    """Block-sparse attention backward on sm_90 with 64-token key blocks (64x64 or 128x64
    sparse blocks).

    Arguments as upstream's ``_flash_attn_bwd``: BSHD ``q, k, v, out, dout`` (fp16/bf16), ``lse``
    [B, H, S] float32 from the forward, ``block_sparse_tensors`` an FA4
    ``BlockSparseTensorsTorch`` in the backward direction (per 64-token key block: the query
    blocks that attend to it, full and partial lists apart) with ``block_size`` (64, 64) or
    (128, 64),
    optional ``mask_mod`` + ``aux_tensors`` applied on the partial lists, and optional
    preallocated ``dq, dk, dv``. Returns ``(dq, dk, dv)``. Key blocks no query block attends to
    get zero dk/dv. ``config``: the tile configuration to build (a `TileConfig`, e.g. one of
    `flash_attn_vsa.experimental.bwd_configs`'), by default the shipped one for the block size
    (`config_for`). ``replay``: after the first calls of a description, replay what upstream's
    launcher did on the device (allocations, pre-processing, the kernel, post-processing)
    without its per-call Python (`launch_replay`); False runs upstream's launcher every call.
    """
    from flash_attn_vsa import launch_replay

    block_size = tuple(block_sparse_tensors.block_size or ())
    check_call(q, k, v, block_size, BWD_BLOCK_SIZES)
    return launch_replay.backward(
        config_for(block_size) if config is None else config, _building, q, k, v, out, dout,
        lse, block_sparse_tensors, softmax_scale=softmax_scale, mask_mod=mask_mod,
        aux_tensors=aux_tensors, dq=dq, dk=dk, dv=dv, replay=replay,
    )  # fmt: skip

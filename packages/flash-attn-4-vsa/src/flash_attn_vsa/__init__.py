"""VSA's kernel deltas over an exactly pinned upstream FlashAttention-4 (CuTe DSL).

This package holds the few CuTe DSL kernels and patches that Video Sparse Attention needs on
top of upstream FlashAttention-4 (PyPI ``flash-attn-4``, ``flash_attn/cute`` in
github.com/Dao-AILab/flash-attention). Upstream is pinned exactly; ``UPSTREAM.md`` at the
repository root records the pin, our deltas and the refresh procedure. Each delta is one
module; their registry (what each builds on upstream, shipped or experimental, where vsa-fa4
runs it), from which UPSTREAM.md's table is generated, is maintainer tooling outside this
package (``flash_attn_vsa_tools.deltas`` in the workspace's unpublished ``tools/fa4-pin``).

Shipped (vsa-fa4 runs them by default): ``flash_attn_vsa.bwd_sm90`` (block-sparse backward with
64-token key blocks on Hopper), ``flash_attn_vsa.bwd_sm90_dq_parts`` (its 64x64 form on two CTAs
per SM, dQ sent in parts by the producer warp), ``flash_attn_vsa.fwd_sm90`` (the 64x64
block-sparse forward, two CTAs per SM), ``flash_attn_vsa.q_regs_sm90`` (Q in registers for
QK^T, in that two-CTA forward), ``flash_attn_vsa.mask_sm90`` (partial key blocks masked as one
column limit per tile), ``flash_attn_vsa.fwd_sm90_paired`` (128x64 blocks over pairs of
64-token key blocks) and ``flash_attn_vsa.combine_sm90`` (VSA's combine in the two-CTA
forward's epilogue, for inference), ``flash_attn_vsa.valid_in_list_sm90`` (partial key
blocks' valid sizes carried in the two-CTA forward's list entries) and
``flash_attn_vsa.bwd_sm90_ds_out`` (the 64x64 backward writing dS for a query-owned dQ pass:
bitwise reproducible gradients; run for the kernel choice that asks for it). Experimental, in
``flash_attn_vsa.experimental`` (correct on an H200 but measured slower; only on request, a
``vsa_fa4.launch.ForwardVariant`` passed down):
``flash_attn_vsa.experimental.fwd_sm90_streams`` (two 64-row query streams per 128-row tile)
``flash_attn_vsa.experimental.persistent_sm90`` (persistent CTAs walking the tiles) and
``flash_attn_vsa.experimental.v_padding_sm90`` (partial key blocks' V padding zeroed in shared
memory, so inference needs no zeroed copy of v: less memory, a slower forward); the
backward's configurations under measurement are there too
(``flash_attn_vsa.experimental.bwd_configs``, passed as ``config=`` to
``bwd_sm90.block_sparse_backward_kv64``).

Which kernel runs is an argument of the entry points (``q_in_registers``, ``persistent``,
``config``: frozen values), never thread or global state a caller sets. Upstream's launchers
take their kernel class and tile configuration from module globals, so the entry points enter
the one scope that answers those globals for the duration of the call
(``flash_attn_vsa.build_scope``, which says why).

The pin is kept checkable by ``flash_attn_vsa.compile_gate`` (every kernel configuration we
use compiles for sm_90a on a CPU; vsa-fa4's own gate builds on it) and, outside the runtime
package, by the maintainer tools of ``tools/fa4-pin`` (``flash-attn-4-vsa-tools``, never
published): the API fingerprint of the upstream symbols we rely on and the ``fa4-refresh``
command that moves the pin and runs both.

Importing this package does not import ``flash_attn`` or ``cutlass``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__version__ = "0.1.0"

UPSTREAM_DISTRIBUTION = "flash-attn-4"
"""The PyPI distribution this package builds on."""

UPSTREAM_VERSION = "4.0.0b36"
"""The upstream release this package is written against (pinned exactly in its dependencies)."""

__all__ = ["UPSTREAM_DISTRIBUTION", "UPSTREAM_VERSION", "__version__", "upstream_version"]


def upstream_version() -> str | None:
    """Version of the installed ``flash-attn-4`` distribution, or None when it is not installed.

    Read from the distribution metadata; ``flash_attn`` itself is not imported. Compare it with
    ``UPSTREAM_VERSION`` to detect an environment that drifted from the pin.
    """
    try:
        return version(UPSTREAM_DISTRIBUTION)
    except PackageNotFoundError:
        return None

"""The KV64 backward's tile configurations that ``vsa-fa4`` does not run by default (deltas 1
and 8, `flash_attn_vsa.bwd_sm90`, `flash_attn_vsa.bwd_sm90_dq_parts`): those under measurement
or kept for comparison (`EXPERIMENTAL_CONFIGS`) and those whose dQ is wrong on purpose, timing
bounds only (`ABLATIONS`). Any of them runs in place of the shipped ``bwd_sm90.config_for``
when passed as ``config=`` to ``bwd_sm90.block_sparse_backward_kv64`` (or
``vsa_fa4.launch.run_backward``); the compile gate compiles ``kv64-staged``
(``bwd-kv64+kv64-staged``).
"""

from __future__ import annotations

from dataclasses import replace

from flash_attn_vsa.bwd_sm90 import (
    KV64_DS_CONFIG,
    KV64_STAGED_CONFIG,
    KV64_TWO_CTAS_BASE,
    TileConfig,
)

__all__ = ["ABLATIONS", "EXPERIMENTAL_CONFIGS"]

EXPERIMENTAL_CONFIGS: dict[str, TileConfig] = {
    "kv64-staged": KV64_STAGED_CONFIG,
    "kv64-ds": KV64_DS_CONFIG,
    "kv64-dq-4parts-2buffers-two-ctas": replace(KV64_TWO_CTAS_BASE, dq_parts=4, dq_buffers=2),
    "kv64-dq-1part-2buffers": replace(KV64_STAGED_CONFIG, dq_parts=1, dq_buffers=2),
    "kv64-dq-2parts-two-ctas": replace(KV64_TWO_CTAS_BASE, dq_parts=2),
    "kv64-dq-8parts-4buffers-two-ctas": replace(KV64_TWO_CTAS_BASE, dq_parts=8, dq_buffers=4),
    "kv64-dq-4parts-2buffers-producer-two-ctas": replace(
        KV64_TWO_CTAS_BASE, dq_parts=4, dq_buffers=2, dq_sender="producer"
    ),
    "kv64-dq-8parts-4buffers-producer-two-ctas": replace(
        KV64_TWO_CTAS_BASE, dq_parts=8, dq_buffers=4, dq_sender="producer"
    ),
}
"""Configurations under measurement or kept for comparison (session 9), by name
(`bwd_sm90_dq_parts`: the MMA warpgroup sends dQ in parts through buffers of its own); passed
as ``config=`` to ``bwd_sm90.block_sparse_backward_kv64``."""

ABLATIONS: dict[str, TileConfig] = {
    "kv64-two-ctas-no-dq": replace(KV64_TWO_CTAS_BASE, dq_parts=2, ablate_dq=True),
    "kv64-no-dq": replace(KV64_STAGED_CONFIG, dq_parts=2, ablate_dq=True),
}
"""Configurations whose dQ is wrong on purpose (`TileConfig.ablate_dq`): timing bounds only."""

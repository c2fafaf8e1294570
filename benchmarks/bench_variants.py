"""Backend variants that only benchmarks register, to time an op's paths side by side in one
run (the before and after of a change, at the same clock).

- ``triton_copies``: the triton backend with its raster reading and fused combine turned off
  (`Backend.reads_raster`, `Backend.fuses_combine`), so `video_sparse_attn` takes the path it
  took before they existed: tile-order copies of raster q, k, v written by the pooling kernel,
  and a separate combine pass.
- ``triton_unfused``: the triton backend with only the fused combine turned off: it still
  reads raster rows (``copy_to_tiles=False``), then combines in a separate in-place pass.
"""

from __future__ import annotations

COPYING_TRITON = "triton_copies"
UNFUSED_TRITON = "triton_unfused"
_SWITCHED_OFF = {
    COPYING_TRITON: {"reads_raster": False, "fuses_combine": False},
    UNFUSED_TRITON: {"fuses_combine": False},
}


def register_variant(name: str) -> bool:
    """Register the variant called ``name`` (True), or do nothing for any other name (False)."""
    if name not in _SWITCHED_OFF:
        return False
    from vsa_core.backends import register_backend
    from vsa_triton.backend import TritonBackend

    # priority -1: auto never picks a variant
    variant = type(name, (TritonBackend,), {"name": name, "priority": -1, **_SWITCHED_OFF[name]})
    register_backend(variant())
    return True

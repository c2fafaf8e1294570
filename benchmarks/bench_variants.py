"""Backend variants that only benchmarks register, to time an op's paths side by side in one
run (the before and after of a change, at the same clock).

- ``triton_copies``: the triton backend with its raster reading and fused combine turned off
  (`Backend.reads_raster`, `Backend.fuses_combine`), so `video_sparse_attn` takes the path it
  took before they existed: tile-order copies of raster q, k, v written by the pooling kernel,
  and a separate combine pass.
"""

from __future__ import annotations

COPYING_TRITON = "triton_copies"


def register_variant(name: str) -> bool:
    """Register the variant called ``name`` (True), or do nothing for any other name (False)."""
    if name != COPYING_TRITON:
        return False
    from vsa_core.backends import register_backend
    from vsa_triton.backend import TritonBackend

    class CopyingTriton(TritonBackend):
        name = COPYING_TRITON
        priority = -1  # never picked by auto
        reads_raster = False
        fuses_combine = False

    register_backend(CopyingTriton())
    return True

"""vsa-fa4: vsa-core's block-sparse layouts on FlashAttention-4's CuTe kernels (``fa4``).

- `block_sparse_attn`: block-sparse attention on FA4 with an explicit ``schedule``.
- `vsa_fa4.backend.FA4Backend`: the ``fa4`` backend vsa-core discovers (entry point).
- `vsa_fa4.schedule`: logical -> physical block shapes, and what upstream FA4 accepts where.
- `vsa_fa4.metadata`: index lists -> FA4's block-sparse tensors (pure torch, sync-free).
- `vsa_fa4.ops`: the ``torch.ops.vsa_fa4.fwd`` / ``bwd`` custom ops (fake impls, autograd).

Importing this package imports neither ``flash_attn`` nor ``cutlass`` (nor triton); FA4 is
imported on the first launch.
"""

from vsa_fa4.api import block_sparse_attn
from vsa_fa4.schedule import SCHEDULES, Plan, make_plan

__version__ = "0.1.0"

__all__ = ["SCHEDULES", "Plan", "__version__", "block_sparse_attn", "make_plan"]

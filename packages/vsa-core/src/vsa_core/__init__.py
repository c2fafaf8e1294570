"""vsa-core: Video Sparse Attention's metadata, selection, reference and public ops.

The pieces, in the order a call uses them:

- `VideoTiling`: (T, H, W) latent -> tile order with padding, and back.
- `BlockSparseLayout`: the sparsity description every backend consumes.
- `vsa_core.coarse`: tile pooling, coarse attention, top-k selection.
- `block_sparse_attn`, `video_sparse_attn`: the public ops, dispatching to backends.
- `vsa_core.backends`: the plug-in registry (``vsa.backends`` entry points).
"""

from vsa_core.backends import AttentionCall, Backend, select_backend
from vsa_core.layout import BlockSparseLayout, KVToQLists
from vsa_core.ops import block_sparse_attn, video_sparse_attn
from vsa_core.tiling import TilingIndices, VideoTiling

__version__ = "0.1.0"

__all__ = [
    "AttentionCall",
    "Backend",
    "BlockSparseLayout",
    "KVToQLists",
    "TilingIndices",
    "VideoTiling",
    "__version__",
    "block_sparse_attn",
    "select_backend",
    "video_sparse_attn",
]

"""Video tiling: how a (T, H, W) latent's tokens map onto fixed-size 3D tiles.

VSA attends tile by tile. A latent of shape (T, H, W) is cut into a grid of (t, h, w) tiles
(``ceil`` division, so tiles at the far borders may be partial). In *tile order* the tokens of
tile 0 come first, then tile 1, ...; tiles are in raster order over the tile grid and the tokens
of one tile in raster order within it. Every tile occupies ``tile_tokens`` slots: its valid
tokens first, then zero padding. So a partial tile is fully described by its valid size, and a
kernel masks key position ``j`` of a tile exactly when ``j >= valid_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from vsa_core.host_cache import resolved_once
from vsa_core.validation import as_device, check_positive_triple

QKVFormat = Literal["bshd", "bhsd"]


@dataclass(frozen=True)
class TilingIndices:
    """Index tensors of a tiling on one device (int64 for indexing, int32 for kernels)."""

    raster_to_tile: torch.Tensor
    """[seq_len] int64: position in the padded tile order of each raster-order token."""
    tile_to_raster: torch.Tensor
    """[padded_len] int64: raster index of each tile-order slot, -1 for padding."""
    nonpad_index: torch.Tensor
    """[seq_len] int64: the tile-order slots that hold real tokens, ascending."""
    valid_sizes: torch.Tensor
    """[num_tiles] int32: number of real tokens in each tile."""
    real_slots: torch.Tensor
    """[padded_len] bool: which tile-order slots hold real tokens (False for padding)."""
    padding_index: torch.Tensor
    """[padded_len - seq_len] int64: the tile-order slots that are padding, ascending."""
    slot_rows: torch.Tensor
    """[padded_len] int32: ``tile_to_raster`` for kernels that address raster-order tensors
    slot by slot (a backend's ``forward_rows``)."""


@dataclass(frozen=True)
class VideoTiling:
    """Tiling of a (T, H, W) latent into (t, h, w) tiles.

    A value object: two tilings with equal shapes are equal and share cached index tensors.
    Shapes are three positive integers each (Python, NumPy or 0-d tensor integers; stored as
    Python ints); floats and bools are refused.

    >>> tiling = VideoTiling((21, 30, 52))           # Wan 480p latent, 4x4x4 tiles
    >>> tiling.num_tiles, tiling.seq_len, tiling.padded_len
    (624, 32760, 39936)
    """

    latent_shape: tuple[int, int, int]
    tile_shape: tuple[int, int, int] = (4, 4, 4)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "latent_shape", check_positive_triple("latent_shape", self.latent_shape)
        )
        object.__setattr__(self, "tile_shape", check_positive_triple("tile_shape", self.tile_shape))
        # the sizes, computed once (the op reads them on every call); not fields, so equality,
        # hashing and repr stay those of the two shapes
        pairs = zip(self.latent_shape, self.tile_shape, strict=True)
        object.__setattr__(self, "_grid", tuple(math.ceil(n / t) for n, t in pairs))

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        """Number of tiles along T, H and W."""
        return self._grid  # type: ignore[attr-defined]

    @property
    def num_tiles(self) -> int:
        return math.prod(self._grid)  # type: ignore[attr-defined]

    @property
    def tile_tokens(self) -> int:
        """Tokens per tile, padding included (the block size kernels see)."""
        return math.prod(self.tile_shape)

    @property
    def seq_len(self) -> int:
        """Number of real tokens, T * H * W."""
        return math.prod(self.latent_shape)

    @property
    def padded_len(self) -> int:
        """Length of the tile-order sequence, num_tiles * tile_tokens."""
        return self.num_tiles * self.tile_tokens

    @property
    def has_padding(self) -> bool:
        return self.padded_len != self.seq_len

    def indices(self, device: torch.device | str = "cpu") -> TilingIndices:
        """The index tensors of this tiling on ``device`` (built once per device, then cached)."""
        return _tiling_indices(self.latent_shape, self.tile_shape, _canonical(device))

    def valid_sizes(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[num_tiles] int32 number of real tokens per tile."""
        return self.indices(device).valid_sizes

    def to_tiles(self, x: torch.Tensor, qkv_format: QKVFormat = "bshd") -> torch.Tensor:
        """Raster order -> tile order with zero padding (differentiable).

        ``x`` is [B, seq_len, H, D] for ``"bshd"`` or [B, H, seq_len, D] for ``"bhsd"``; the
        result has ``padded_len`` along the sequence dimension and the same format.
        """
        dim = _seq_dim(qkv_format)
        _check_seq_len("x", x, dim, self.seq_len, "seq_len (T*H*W)")
        index = self.indices(x.device).raster_to_tile
        return _ScatterToTiles.apply(x, index, dim, self.padded_len)

    def from_tiles(self, x: torch.Tensor, qkv_format: QKVFormat = "bshd") -> torch.Tensor:
        """Tile order -> raster order, dropping the padding (differentiable)."""
        dim = _seq_dim(qkv_format)
        _check_seq_len("x", x, dim, self.padded_len, "padded_len")
        return x.index_select(dim, self.indices(x.device).raster_to_tile)


class _ScatterToTiles(torch.autograd.Function):
    """``x`` scattered to ``index`` along ``dim`` of a zero tensor ``padded_len`` long. Its
    backward is a gather and keeps only the index: autograd's ``index_copy`` would keep ``x``
    too, holding every raster input of a raster-order call alive until backward (inside a
    model, q, k, v and the gate of every layer, beside the tiled copies attention keeps)."""

    @staticmethod
    def forward(ctx, x, index, dim, padded_len):
        shape = list(x.shape)
        shape[dim] = padded_len
        ctx.save_for_backward(index)
        ctx.dim = dim
        # out of place: under torch.compile (2.11) the in-place index_copy_ here gave zero
        # gradients, silently (test_tiling checks compiled against eager)
        return x.new_zeros(shape).index_copy(dim, index, x)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(ctx.dim, index), None, None, None


def _canonical(device: torch.device | str) -> torch.device:
    """ "cuda" and "cuda:0" (when current) are one device: give them one cache entry, so that a
    cached tensor is never rebuilt (a host-to-device copy, i.e. a sync) under another name."""
    device = as_device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _seq_dim(qkv_format: str) -> int:
    if qkv_format == "bshd":
        return 1
    if qkv_format == "bhsd":
        return 2
    raise ValueError(f"qkv_format must be 'bshd' or 'bhsd', got {qkv_format!r}")


def _check_seq_len(name: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be a 4-D tensor, got shape {tuple(x.shape)}")
    if x.shape[dim] != expected:
        raise ValueError(
            f"{name} must have {what} = {expected} tokens along dim {dim}, "
            f"got shape {tuple(x.shape)}"
        )


@resolved_once(maxsize=64)  # per (shape, tile, device), also under torch.compile
def _tiling_indices(
    latent_shape: tuple[int, int, int], tile_shape: tuple[int, int, int], device: torch.device
) -> TilingIndices:
    # Built on the CPU once, then moved: this runs once per (shape, tile, device).
    (T, H, W), (tt, th, tw) = latent_shape, tile_shape
    gt, gh, gw = (math.ceil(n / t) for n, t in zip(latent_shape, tile_shape, strict=True))
    t_idx = torch.arange(T).view(T, 1, 1)
    h_idx = torch.arange(H).view(1, H, 1)
    w_idx = torch.arange(W).view(1, 1, W)
    tile_id = ((t_idx // tt) * gh + h_idx // th) * gw + w_idx // tw
    # Rank of a token inside its tile counts only the tile's real tokens (valid ones first): the
    # tile's real extent along each axis is min(tile, latent - tile start).
    ext_h = torch.clamp(H - (h_idx // th) * th, max=th)
    ext_w = torch.clamp(W - (w_idx // tw) * tw, max=tw)
    rank = ((t_idx % tt) * ext_h + h_idx % th) * ext_w + w_idx % tw
    tile_tokens = tt * th * tw
    raster_to_tile = (tile_id * tile_tokens + rank).reshape(-1)

    valid = torch.bincount(tile_id.reshape(-1), minlength=gt * gh * gw).to(torch.int32)
    tile_to_raster = torch.full((gt * gh * gw * tile_tokens,), -1, dtype=torch.int64)
    tile_to_raster[raster_to_tile] = torch.arange(T * H * W)
    nonpad_index = torch.sort(raster_to_tile).values
    return TilingIndices(
        raster_to_tile=raster_to_tile.to(device),
        tile_to_raster=tile_to_raster.to(device),
        nonpad_index=nonpad_index.to(device),
        valid_sizes=valid.to(device),
        real_slots=(tile_to_raster >= 0).to(device),
        padding_index=(tile_to_raster < 0).nonzero().flatten().to(device),
        slot_rows=tile_to_raster.to(torch.int32).to(device),
    )

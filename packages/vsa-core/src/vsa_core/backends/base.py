"""The backend plug-in interface.

A backend is a class registered under the ``vsa.backends`` entry-point group. The registry
instantiates it without arguments, asks ``supports(call)`` whether it can run a call (``None``
means yes, a string is the reason for refusing), and runs ``forward``. Autograd is the backend's
business: ``forward`` must return tensors that are differentiable w.r.t. q, k and v whenever the
backend accepted a call with ``call.requires_grad``.

Deterministic calls (``call.deterministic``, the ops' ``deterministic=True``): a backend that
accepts one promises bitwise-equal results, forward and (when ``call.requires_grad``) backward,
run to run on the same inputs, device and versions: no reduction whose order depends on thread
scheduling (floating-point atomics, split reductions combined in arrival order). A backend says
so by setting ``handles_deterministic = True`` and reading the field in ``supports()`` (refusing,
with the reason, the calls it cannot run that way); the registry refuses deterministic calls to
backends that do not set it (plug-ins written before the field existed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from vsa_core.layout import BlockSparseLayout


@dataclass(frozen=True)
class AttentionCall:
    """What a backend needs to know to accept or refuse a block-sparse attention call."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    block_shape: tuple[int, int]
    requires_grad: bool
    q_group_size: int = 1
    """Aligned groups of this many query blocks share one key list (the layout's
    ``q_group_size``): backends that pair query blocks may rank themselves by it."""
    kv_blocks_full: bool = False
    """Every key block is known to be full (the layout's ``kv_blocks_full``): backends whose
    kernels skip key masking then may rank themselves by it."""

    capability: tuple[int, int] | None = None
    """CUDA compute capability of the device (read from the device when not given), None off
    CUDA (and for a CUDA description on a machine without a driver). A field, not a lookup,
    so that the call's description (a cache key of `vsa_core.backends.select_backend`) says
    which architecture it is for."""

    query_rows: int = 0
    """Query token rows of the call (batch x heads x query length), for backends whose
    ranking depends on the problem size; 0 when unknown."""

    query_len: int = 0
    """Query tokens per (batch, head) sequence (the layout's ``q_len``), for backends whose
    ranking depends on the sequence length; 0 when unknown."""

    deterministic: bool = False
    """The caller asks for bitwise-reproducible results (forward, and backward when
    ``requires_grad``): see the module doc."""

    raster_inputs: bool = False
    """q, k, v stay in a tiling's raster order and the backend reads them there
    (`Backend.forward_rows`; `video_sparse_attn(..., copy_to_tiles=False)`): only backends
    with ``reads_raster`` qualify."""

    def __post_init__(self) -> None:
        if self.capability is None and self.device.type == "cuda":
            try:
                capability = tuple(torch.cuda.get_device_capability(self.device))
            except (RuntimeError, AssertionError):  # no driver: a description only
                return
            object.__setattr__(self, "capability", capability)

    @classmethod
    def describe(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        deterministic: bool = False,
    ) -> AttentionCall:
        return cls(
            device=q.device,
            dtype=q.dtype,
            head_dim=q.shape[-1],
            block_shape=layout.block_shape,
            requires_grad=torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad),
            q_group_size=layout.q_group_size,
            kv_blocks_full=layout.kv_blocks_full,
            query_rows=q.shape[0] * q.shape[1] * q.shape[2],
            query_len=q.shape[1],
            deterministic=deterministic,
        )


class Backend:
    """Base class of block-sparse attention backends.

    Subclasses set ``name`` and ``priority`` (higher runs first under ``backend="auto"``; the
    reference is 0) and implement ``supports`` and ``forward``.
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    key_padding_safe: ClassVar[bool] = False
    """True when the padding slots of partial key blocks never reach a real output or
    gradient whatever they hold (NaN and inf included): the kernels never read them. Where
    False, the ops hand the backend a copy of v with zeroed padding, and of k when gradients
    flow; the backend must mask padding keys' scores by selection (not by adding -inf), so
    that K's padding cannot reach a forward output."""
    handles_deterministic: ClassVar[bool] = False
    """True when ``supports()`` reads ``call.deterministic`` and accepts a deterministic call
    only where its results are bitwise reproducible (see the module doc). Where False the
    registry refuses every deterministic call for the backend."""

    reads_raster: ClassVar[bool] = False
    """True when `forward_rows` is implemented: the same attention on q, k, v in a tiling's
    raster order, each tile-order slot read through a slot-to-row map, so `video_sparse_attn`
    with ``token_order="raster"`` makes no tile-order copies of them."""
    fuses_combine: ClassVar[bool] = False
    """True when `forward_combined` is implemented: VSA's ``fine + gate * coarse`` written by
    the fine attention's own epilogue, for calls without gradients (in tile order, and in
    raster order too when ``reads_raster``)."""
    reads_forward_split: ClassVar[bool] = False
    """True when `forward` and `forward_combined` use a layout's ``forward_split`` (its lists
    split by key-block fullness, `vsa_core.layout.ForwardSplit`) where one is attached:
    `video_sparse_attn` then asks the coarse stage to write it while it selects
    (`CoarseStage.select_split`) for its tile-order calls with partial tiles, inference and
    training, so the backend runs no split pass of its own."""

    def supports(self, call: AttentionCall) -> str | None:
        """Return None when this backend can run ``call``, else the reason it cannot."""
        raise NotImplementedError

    def reads_key_padding_as_is(self, call: AttentionCall) -> bool:
        """Whether ``call``'s kernels keep key padding from every real output and gradient
        whatever it holds (see ``key_padding_safe``), so that the ops hand k and v over
        without zeroed copies. Default: ``key_padding_safe``, for every call. A backend safe
        on some calls only says so here (fa4: inference with 64x64 blocks, whose forward
        zeroes V's padding rows in shared memory); like `supports`, it may depend on the call
        alone (the ops decide once per call description)."""
        return self.key_padding_safe

    def for_call(self, call: AttentionCall) -> Backend:
        """The backend that runs ``call`` once this one is chosen for it (default: itself). A
        backend whose kernels for some calls differ from its default returns a configured
        instance of itself for them (fa4: its dS-writing backward for deterministic
        training); the ops ask once per call description, after `supports` accepted it."""
        return self

    def priority_for(self, call: AttentionCall) -> int:
        """This backend's rank for ``call`` under ``backend="auto"`` (default: ``priority``).
        Override to step back on calls another backend is measured to run faster."""
        return self.priority

    def ranking_note(self, call: AttentionCall) -> str | None:
        """Why `priority_for` ranks ``call`` away from ``priority`` (shown by ``vsa info``),
        or None when it does not."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block-sparse attention on BSHD tensors.

        q: [B, NQ * q_block, H, D], k and v: [B, NKV * kv_block, H, D] (strides may be those of
        a BHSD tensor transposed to BSHD). Returns ``out`` [B, Sq, H, D] in q's dtype and
        ``lse`` [B, H, Sq] in float32 (float64 for float64 inputs; natural log; -inf for rows
        that see no valid key).
        """
        raise NotImplementedError

    def forward_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
        slot_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` (self-attention) on [B, T*H*W, H, D] tensors in a tiling's raster order:
        ``slot_rows`` ([layout.q_len] int32, `vsa_core.tiling.TilingIndices.slot_rows`) is the
        row of each tile-order slot the layout speaks of, -1 for padding slots (none exist in
        the tensors: never read, never written). Returns out in raster order like q and lse
        per slot, [B, H, layout.q_len]. Only called when ``reads_raster``."""
        raise NotImplementedError

    def forward_combined(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
        coarse: torch.Tensor,
        gate: torch.Tensor | None,
        slot_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """VSA's output ``fine + gate * coarse[query block]`` from one pass, no gradients:
        ``coarse`` [B, NQ, H, D] (one row per query block), ``gate`` like q (any stride may be
        0; None: 1); q, k, v in tile order, or with ``slot_rows`` in raster order as in
        `forward_rows`. Only called when ``fuses_combine`` (and, with ``slot_rows``,
        ``reads_raster``)."""
        raise NotImplementedError

    def availability(self) -> str | None:
        """None when the backend can run somewhere on this machine, else why it cannot at all.

        Used by ``vsa info``; the default asks nothing of the machine.
        """
        return None

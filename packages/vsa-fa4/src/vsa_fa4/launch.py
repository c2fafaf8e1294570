"""The calls into upstream FA4 (``flash_attn.cute``), imported on first use.

`run_forward` / `run_backward` take our `SparseLists` and the physical valid sizes, wrap them
into ``BlockSparseTensorsTorch`` with the physical block size, pass the valid sizes to the
partial-block ``mask_mod`` through ``aux_tensors`` (only when ``masked``: a kernel compiled with
a mask_mod is slower even on full blocks, so layouts known to have no partial key block run
without it) and write into outputs the caller allocated
(so that the custom ops' fake implementations know every output's strides). Everything FA4
needs is on the device; nothing here reads device data. Under
``torch._subclasses.fake_tensor.FakeTensorMode`` upstream compiles its kernel and skips the
launch, which is how the compile gate checks this path on a CPU.

Which kernels run is an argument, never thread or global state: `run_forward` takes a
`ForwardVariant` (``variant=``, default `SHIPPED_FORWARD`) and `run_backward` a tile
configuration of the fork's KV64 backward (``config=``, default the shipped one for the block),
and hand them to the fork's entry points as their ``q_in_registers`` / ``persistent`` /
``config`` arguments. `KernelChoice` carries both down from the backend and the ops (as a
string through the custom ops' schema: `KernelChoice.encode`).

Every launch, the fork's and upstream's own (128-token key blocks), is replayed after the first
calls of its description without upstream's per-call Python (`flash_attn_vsa.launch_replay`).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from vsa_fa4.metadata import PackedSparseLists, SparseLists, paired_forward_lists

if TYPE_CHECKING:
    from flash_attn_vsa.bwd_sm90 import TileConfig

Q_IN_REGISTERS_WHERE_FASTER = frozenset({"two_ctas", "streams"})
"""The fork's forwards whose QK^T is faster with Q in registers (delta 5) on an H200: the
two-CTA 64x64 forward (+1.3-2.5% of dense, 6 of 6 interleaved measurements) and the two-stream
one (+1-1.7%); not the paired 128x64 forward (-2%). The fork's journal
(``research/fa4_fork/NOTES.md``), experiment 10 (2026-11-30)."""


@dataclass(frozen=True)
class ForwardVariant:
    """Which of the fork's experimental forward kernels the fa4 forwards use where they fit.

    ``q_in_registers``: QK^T reads Q from registers (`flash_attn_vsa.q_regs_sm90`, delta 5) in
    the 64x64, 128x64 and two-stream forwards; ``None`` (the default): only in the kernels an
    H200 measured faster that way (`Q_IN_REGISTERS_WHERE_FASTER`). ``two_streams``: 64x64
    forwards run two 64-row query blocks per 128-row tile, one per warpgroup, each with its own
    list (`flash_attn_vsa.experimental.fwd_sm90_streams`, delta 6; head dim 128, an even number
    of query blocks, sm_90). ``persistent``: the fork's forwards walk their tiles on persistent
    CTAs (`flash_attn_vsa.experimental.persistent_sm90`, delta 7). Those two are off in
    `SHIPPED_FORWARD`: the H200 measured them slower (experiment 10). ``valid_in_list``
    (shipped on): the 64x64 forward's partial entries carry their valid sizes (delta 10,
    `takes_valid_in_list`); off, the lists hold plain block ids and the mask loads the sizes
    (what ran before; the same output). ``zero_v_padding`` (off in `SHIPPED_FORWARD`; with
    ``valid_in_list``): that forward zeroes partial key blocks' V padding rows in shared
    memory (delta 11, `zeroes_v_padding`), so inference reads v without a zeroed copy: peak
    memory 1.32x / 1.40x of dense instead of 2.54x / 2.62x at Wan 2.1 480p / 720p, but the
    op's forward 10-14% slower (H200, session 25); off, v's padding must be finite (the ops
    then copy it). Benchmarks compare variants by passing one
    (`run_forward`'s ``variant``, a `KernelChoice`, or an fa4 backend registered with one:
    `vsa_fa4.backend.variant_backend`)."""

    q_in_registers: bool | None = None
    two_streams: bool = False
    persistent: bool = False
    valid_in_list: bool = True
    zero_v_padding: bool = False

    def kernel_options(self, kernel: str) -> dict[str, bool]:
        """The keyword arguments the fork's forward entry point ``kernel`` (``"two_ctas"``,
        ``"paired"`` or ``"streams"``) takes for this variant."""
        q_in_registers = self.q_in_registers
        if q_in_registers is None:
            q_in_registers = kernel in Q_IN_REGISTERS_WHERE_FASTER
        return {"q_in_registers": q_in_registers, "persistent": self.persistent}

    @classmethod
    def from_names(cls, names: Sequence[str]) -> ForwardVariant:
        """The variant with the named options on (`VARIANT_NAMES`: the short names benchmarks
        and tools take, e.g. ``["streams", "qregs"]``) or, for ``no-NAME``
        (`NEGATED_NAMES`), off; ValueError for an unknown name."""
        known = {**{n: (f, True) for n, f in VARIANT_NAMES.items()}, **NEGATED_NAMES}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ValueError(
                f"forward variant options must be among {sorted(known)}, got {list(names)}"
            )
        return cls(**dict(known[n] for n in names))

    @property
    def label(self) -> str:
        """The variant as `from_names` takes it, joined by ``+`` (``"shipped"`` for
        `SHIPPED_FORWARD`; a shipped option turned off reads ``no-NAME``)."""
        names = [short for short, field in VARIANT_NAMES.items() if getattr(self, field) is True]
        off = [n for n, (field, value) in NEGATED_NAMES.items() if getattr(self, field) is value]
        return "+".join(off + names) or "shipped"


VARIANT_NAMES = {
    "qregs": "q_in_registers",
    "streams": "two_streams",
    "persistent": "persistent",
    "zero-v-padding": "zero_v_padding",
}
"""Short names of `ForwardVariant`'s fields, as benchmarks and tools take them."""

NEGATED_NAMES = {
    "no-qregs": ("q_in_registers", False),
    "no-valid-in-list": ("valid_in_list", False),
}
"""Short names that turn a shipped option off (field, value)."""


SHIPPED_FORWARD = ForwardVariant()
"""What the forwards run unless a variant is passed."""


@dataclass(frozen=True)
class KernelChoice:
    """The fork kernels an fa4 call runs, passed down explicitly (backend -> ops -> launch ->
    the fork's entry points): ``forward``, the `ForwardVariant` of the fork's forwards;
    ``backward``, the tile configuration (``flash_attn_vsa.bwd_sm90.TileConfig``, e.g. one of
    ``flash_attn_vsa.experimental.bwd_configs``) of the KV64 backward, None for the default of
    each block size (`backward_for`: the dS-writing backward for 64x64 blocks); ``ds_budget_
    bytes``, with a backward that writes dS (``TileConfig.dq_from_ds``), the most bytes its dS
    buffer may take in one launch (None: `vsa_fa4.ops.DS_BUDGET_BYTES`; calls beyond it run in
    head chunks). The custom ops carry it as `encode`'s string ("" for `SHIPPED`)."""

    forward: ForwardVariant = SHIPPED_FORWARD
    backward: TileConfig | None = None
    ds_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.forward, ForwardVariant):
            raise ValueError(f"forward must be a ForwardVariant, got {self.forward!r}")
        if self.backward is not None:
            from flash_attn_vsa.bwd_sm90 import TileConfig

            if not isinstance(self.backward, TileConfig):
                raise ValueError(f"backward must be a TileConfig or None, got {self.backward!r}")
        if self.ds_budget_bytes is not None:
            budget = self.ds_budget_bytes
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ValueError(f"ds_budget_bytes must be a positive int, got {budget!r}")
            if self.backward is not None and not self.backward.dq_from_ds:
                raise ValueError("ds_budget_bytes needs a backward that writes dS (dq_from_ds)")
        key = ""
        if (self.forward, self.backward, self.ds_budget_bytes) != (SHIPPED_FORWARD, None, None):
            backward = None if self.backward is None else asdict(self.backward)
            data = {"forward": asdict(self.forward), "backward": backward}
            if self.ds_budget_bytes is not None:
                data["ds_budget_bytes"] = self.ds_budget_bytes
            key = json.dumps(data, sort_keys=True)
        object.__setattr__(self, "_key", key)  # not a field: made once, read when traced

    def backward_for(self, block_size: tuple[int, int]) -> TileConfig | None:
        """The KV64 backward's tile configuration for ``block_size``: ``backward`` where
        chosen; else for 64x64 blocks the dS-writing one (``bwd_sm90.KV64_DS_CONFIG``, bitwise
        reproducible; through the whole op, forward+backward, 11-51% faster than the float32
        dQ reductions of ``bwd_sm90.KV64_CONFIG`` on an H100 in both views, one call waited
        for and back to back (session 27, 8 GiB of dS a launch), within 4% either way on an
        H200 with a 2 GiB budget (session 26)), the
        fork's own default (``bwd_sm90.config_for``) for other 64-token key blocks, and None
        where upstream's kernels run (`run_backward`)."""
        if self.backward is not None:
            return self.backward
        if tuple(block_size) != (64, 64):
            return None
        from flash_attn_vsa.bwd_sm90 import KV64_DS_CONFIG

        return KV64_DS_CONFIG

    def encode(self) -> str:
        """This choice as a string (a custom op argument; made once, when the choice is made,
        so that ``torch.compile`` reads a constant); `decode` reverses it."""
        return self._key  # type: ignore[attr-defined]

    @staticmethod
    def decode(key: str) -> KernelChoice:
        """The choice `encode` wrote (cached: the ops decode it on every call)."""
        return _decoded(key)


@functools.cache
def _decoded(key: str) -> KernelChoice:
    if not key:
        return SHIPPED
    data = json.loads(key)
    backward = None
    if data["backward"] is not None:
        from flash_attn_vsa.bwd_sm90 import TileConfig

        backward = TileConfig(**data["backward"])
    return KernelChoice(ForwardVariant(**data["forward"]), backward, data.get("ds_budget_bytes"))


SHIPPED = KernelChoice()
"""The shipped kernels everywhere."""


@functools.cache  # its imports cost ~2 us a call
def _upstream() -> tuple[Any, Any]:
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from flash_attn_vsa.mask_sm90 import valid_size_mask_mod

    return BlockSparseTensorsTorch, valid_size_mask_mod


def _block_sparse(cls: Any, lists: SparseLists, block_size: tuple[int, int]) -> Any:
    return cls(
        mask_block_cnt=lists.mask_block_cnt,
        mask_block_idx=lists.mask_block_idx,
        full_block_cnt=lists.full_block_cnt,
        full_block_idx=lists.full_block_idx,
        block_size=tuple(block_size),
    )


def _masking(
    mask_mod: Any, kv_valid_sizes: torch.Tensor, block_size: tuple[int, int], masked: bool
) -> dict[str, Any]:
    """FA4's mask_mod arguments for partial key blocks (both None when no block is partial)."""
    if not masked:
        return {"mask_mod": None, "aux_tensors": None}
    return {"mask_mod": mask_mod(block_size[1]), "aux_tensors": [kv_valid_sizes]}


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """FA4 launches on the current device's current stream: make q's device current (a no-op
    when it already is, and on machines without CUDA, where fake tensors compile only)."""
    if (
        device.type == "cuda"
        and device.index is not None
        and torch.cuda.is_available()
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def run_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    lists: SparseLists,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    block_size: tuple[int, int],
    masked: bool = True,
    variant: ForwardVariant = SHIPPED_FORWARD,
    combine: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> None:
    """FA4 block-sparse forward into ``out`` [B, Sq, H, D] and ``lse`` [B, H, Sq] (float32).

    64x64 blocks (only sm_90 runs them) go to the fork's two-CTA-per-SM launch of upstream's
    kernel with Q in registers (`flash_attn_vsa.fwd_sm90`: 0.79 of dense instead of 0.55 on
    an H200); 128x64 blocks at head dim 128 on sm_90 to the fork's paired-key kernel
    (`fwd_sm90_paired`); everything else to upstream's ``_flash_attn_fwd``. ``variant`` picks
    the fork's experimental kernels where they fit (handed to the fork's entry points as their
    arguments, `ForwardVariant.kernel_options`).

    ``combine`` (coarse [B, Sq / 64, H, D], gate like ``out`` or None): ``out`` receives VSA's
    ``fine + gate * coarse[query block]`` from the two-CTA kernel's epilogue and no lse is
    written (``lse`` must be None); only where `combines_in_epilogue` holds."""
    if not isinstance(variant, ForwardVariant):
        raise ValueError(f"variant must be a ForwardVariant, got {variant!r}")
    valid_in_list = isinstance(lists, PackedSparseLists)  # partial entries carry valid sizes
    if valid_in_list and not (
        masked and takes_valid_in_list(q, kv_valid_sizes, block_size, variant)
    ):
        raise ValueError(
            "lists with valid sizes in their entries (PackedSparseLists) go to the fork's "
            "two-CTA 64x64 forward only, masked (takes_valid_in_list)"
        )
    epilogue = {}  # the combine's operands for the two-CTA 64x64 forward
    if combine is not None:
        if lse is not None:
            raise ValueError("lse must be None with combine (the combined forward writes none)")
        if not combines_in_epilogue(q, kv_valid_sizes, block_size, variant):
            raise ValueError(
                "combine runs in the two-CTA 64x64 forward only (combines_in_epilogue)"
            )
        epilogue = dict(zip(("coarse", "gate"), combine, strict=True))
    if _pairs_keys(q, lists, kv_valid_sizes, block_size):
        # 128-key tiles of packed pairs; the pair mask handles partial blocks and odd tails,
        # so ``masked`` does not matter here
        from flash_attn_vsa import fwd_sm90_paired as paired

        packed = paired_forward_lists(lists, kv_valid_sizes.shape[0])
        run = (paired.block_sparse_forward_paired, paired.BLOCK_SIZE, packed)
        _run_packed(
            *run, q, k, v, out, lse, kv_valid_sizes, scale, variant.kernel_options("paired")
        )
        return
    if variant.two_streams and _runs_two_streams(q, kv_valid_sizes, block_size):
        # query blocks 2t and 2t + 1 side by side in 128-row tile t
        from flash_attn_vsa.experimental import fwd_sm90_streams as streams

        run = (
            streams.block_sparse_forward_streams,
            streams.BLOCK_SIZE,
            streams.stream_lists(*lists.by_class()),
        )
        _run_packed(
            *run, q, k, v, out, lse, kv_valid_sizes, scale, variant.kernel_options("streams")
        )
        return
    tensors_cls, mask_mod = _upstream()
    if valid_in_list:
        from flash_attn_vsa.mask_sm90 import valid_in_list_mask_mod

        mask_mod = valid_in_list_mask_mod
    masking = _masking(mask_mod, kv_valid_sizes, block_size, masked)
    tensors = _block_sparse(tensors_cls, lists, block_size)
    with _on_device(q.device):
        if tuple(block_size) == (64, 64):
            from flash_attn_vsa.fwd_sm90 import block_sparse_forward_q64

            block_sparse_forward_q64(
                q, k, v, tensors, softmax_scale=scale, **masking, out=out, lse=lse,
                **epilogue, **variant.kernel_options("two_ctas"),
                zero_v_padding=valid_in_list and variant.zero_v_padding,
            )  # fmt: skip
            return
        from flash_attn_vsa import launch_replay

        # upstream's own kernels, its launches replayed like the fork's entry points'
        launch_replay.forward(
            launch_replay.UPSTREAM_KERNELS, launch_replay.no_scope, q, k, v, tensors,
            softmax_scale=scale, **masking, out=out, lse=lse, replay=True,
        )  # fmt: skip


def takes_valid_in_list(
    q: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    block_size: tuple[int, int],
    variant: ForwardVariant = SHIPPED_FORWARD,
) -> bool:
    """Whether `run_forward`'s kernel for this call reads `PackedSparseLists` (partial entries
    ``block | valid << 16``, `flash_attn_vsa.valid_in_list_sm90`): the fork's two-CTA 64x64
    forward, for fewer than 2^16 key blocks, unless the variant turns it off. It drops the
    masked steps' extra wait for the previous P V product (NOTES.md, experiment 18): bitwise
    the same output."""
    from flash_attn_vsa.valid_in_list_sm90 import BLOCK_BITS

    return (
        variant.valid_in_list
        and kv_valid_sizes.shape[0] <= 1 << BLOCK_BITS
        and _runs_two_ctas(q, kv_valid_sizes, block_size, variant)
    )


def zeroes_v_padding(
    q: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    block_size: tuple[int, int],
    variant: ForwardVariant = SHIPPED_FORWARD,
) -> bool:
    """Whether `run_forward`'s kernel for this call (with partial key blocks) zeroes their V
    padding rows in shared memory (the fork's `experimental.v_padding_sm90`, delta 11), so that v's
    padding slots may hold anything, NaN and inf included: the valid-in-list forward
    (`takes_valid_in_list`) when the variant turns it on. Costs at most eight 16-byte shared
    stores a thread, a proxy fence and a warpgroup barrier per partial block."""
    return may_zero_v_padding(block_size, variant) and takes_valid_in_list(
        q, kv_valid_sizes, block_size, variant
    )


def may_zero_v_padding(block_size: tuple[int, int], variant: ForwardVariant) -> bool:
    """`zeroes_v_padding`'s verdict before the tensors are known (the backend asks it of a
    call description): the variant zeroes, with valid sizes in the lists, on 64x64 blocks,
    not as the two-stream kernel. False is final; True leaves the key-block count (at most
    2^16) and the two-stream kernel's own fit to `zeroes_v_padding`."""
    return (
        variant.zero_v_padding
        and variant.valid_in_list
        and not variant.two_streams
        and tuple(block_size) == (64, 64)
    )


def _runs_two_ctas(
    q: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    block_size: tuple[int, int],
    variant: ForwardVariant,
) -> bool:
    """Whether `run_forward` runs this call on the fork's two-CTA 64x64 forward (not the
    two-stream kernel a variant may ask for), the kernel deltas 9 and 10 extend."""
    return tuple(block_size) == (64, 64) and not (
        variant.two_streams and _runs_two_streams(q, kv_valid_sizes, block_size)
    )


def combines_in_epilogue(
    q: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    block_size: tuple[int, int],
    variant: ForwardVariant = SHIPPED_FORWARD,
) -> bool:
    """Whether `run_forward` can add VSA's combine in the forward's epilogue for this call: the
    fork's two-CTA 64x64 kernel runs it (`flash_attn_vsa.combine_sm90`), not on persistent
    CTAs and not where the variant runs the two-stream kernel instead."""
    return not variant.persistent and _runs_two_ctas(q, kv_valid_sizes, block_size, variant)


def _pairs_keys(
    q: torch.Tensor, lists: SparseLists, kv_valid_sizes: torch.Tensor, block_size: tuple[int, int]
) -> bool:
    """Whether this forward runs on the fork's paired-key kernel: 128x64 blocks, head dim 128,
    sm_90 (the arch FA4 compiles for: the device's, or ``FLASH_ATTENTION_ARCH``), lists and a
    key count `pair_lists` can pair (`pairing_refusal`: an odd count of key blocks, possible
    when the keys are not the queries' length, runs upstream's kernel)."""
    from flash_attn_vsa import fwd_sm90_paired as paired
    from flash_attn_vsa.paired_sm90 import pairing_refusal

    return (
        tuple(block_size) == (paired.BLOCK_SIZE[0], paired.KEY_BLOCK)
        and pairing_refusal(lists.full_block_idx.shape[-1], kv_valid_sizes.shape[0]) is None
        and _two_block_stages_fit(q)
    )


def _two_block_stages_fit(q: torch.Tensor) -> bool:
    """What the fork's kernels with two 64-token key blocks per stage (paired keys, two
    streams) need of every call: head dim 128 and sm_90 (the arch FA4 compiles for: the
    device's, or ``FLASH_ATTENTION_ARCH``)."""
    from flash_attn.cute.interface import _get_device_arch

    from flash_attn_vsa.fwd_sm90_paired import HEAD_DIM

    return q.shape[-1] == HEAD_DIM and _get_device_arch() // 10 == 9


def _run_packed(
    kernel: Any,
    block_size: tuple[int, int],
    packed: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    options: dict[str, bool],
) -> None:
    """Run a fork forward whose lists hold packed entries (``packed``: FA4's four list tensors
    in `SparseLists` order) into ``out`` and ``lse``, with the kernel ``options``
    (`ForwardVariant.kernel_options`)."""
    tensors = _block_sparse(_upstream()[0], SparseLists(*packed), block_size)
    with _on_device(q.device):
        kernel(
            q, k, v, tensors, kv_valid_sizes, softmax_scale=scale, out=out, lse=lse,
            **options,
        )  # fmt: skip


def _runs_two_streams(
    q: torch.Tensor, kv_valid_sizes: torch.Tensor, block_size: tuple[int, int]
) -> bool:
    """Whether a forward fits the two-stream kernel: 64x64 blocks, head dim 128, an even
    number of 64-row query blocks, key block ids that pack in 16 bits, sm_90."""
    from flash_attn_vsa.experimental import fwd_sm90_streams as streams

    return (
        tuple(block_size) == (streams.KEY_BLOCK, streams.KEY_BLOCK)
        and (q.shape[1] // streams.KEY_BLOCK) % 2 == 0
        and kv_valid_sizes.shape[0] < streams.NO_BLOCK
        and _two_block_stages_fit(q)
    )


def _runs_on_fork_kv64(block_size: tuple[int, int]) -> bool:
    """Whether `run_backward` runs ``block_size`` on the fork's KV64 backward (64-token key
    blocks) rather than upstream's."""
    return block_size[1] == 64


def backward_ctas_per_sm(block_size: tuple[int, int], config: TileConfig | None = None) -> int:
    """CTAs an SM runs at once of the backward kernel `run_backward` picks for ``block_size``
    (and ``config``): the fork's KV64 configuration says (the shipped 64x64 backward runs two),
    upstream's kernels one."""
    if not _runs_on_fork_kv64(block_size):
        return 1
    if config is not None:
        return config.ctas_per_sm
    from flash_attn_vsa.bwd_sm90 import config_for

    return config_for(block_size).ctas_per_sm


def run_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    lists: SparseLists,
    kv_valid_sizes: torch.Tensor,
    scale: float,
    block_size: tuple[int, int],
    masked: bool = True,
    config: TileConfig | None = None,
    ds_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """FA4 block-sparse backward (key-block-owned ``lists``) into ``dq``, ``dk``, ``dv``.

    64-token key blocks (64x64 and 128x64 physical blocks) run on the fork's sm_90 kernels
    (`flash_attn_vsa.bwd_sm90`; upstream refuses them) with the tile configuration ``config``
    (None: the shipped one for the block size), everything else on upstream's
    ``_flash_attn_bwd`` (``config`` must then be None). ``ds_out``: (the dS buffer, the slot
    starts) for a ``config`` that writes dS (``dq_from_ds``: dq is then left as it was, for
    `vsa_fa4.dq_from_ds_triton` to compute), and only for one."""
    tensors_cls, mask_mod = _upstream()
    fork = _runs_on_fork_kv64(block_size)
    if config is not None and not fork:
        raise ValueError(
            f"a backward tile config applies to 64-token key blocks only, got blocks {block_size}"
        )
    writes_ds = config is not None and config.dq_from_ds
    if writes_ds != (ds_out is not None):
        raise ValueError("ds_out must be given exactly when the config writes dS (dq_from_ds)")
    masking = _masking(mask_mod, kv_valid_sizes, block_size, masked)
    if ds_out is not None:
        masking["aux_tensors"] = [*(masking["aux_tensors"] or ()), *ds_out]
    tensors = _block_sparse(tensors_cls, lists, block_size)
    with _on_device(q.device):
        if fork:
            from flash_attn_vsa.bwd_sm90 import block_sparse_backward_kv64

            block_sparse_backward_kv64(
                q, k, v, out, dout, lse, tensors, softmax_scale=scale, **masking, dq=dq, dk=dk,
                dv=dv, config=config,
            )  # fmt: skip
            return
        from flash_attn_vsa import launch_replay

        # upstream's own kernels, its launches replayed like the fork's entry points'
        launch_replay.backward(
            launch_replay.UPSTREAM_KERNELS, launch_replay.no_scope, q, k, v, out, dout, lse,
            tensors, softmax_scale=scale, **masking, dq=dq, dk=dk, dv=dv, replay=True,
        )  # fmt: skip

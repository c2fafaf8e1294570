"""VSA in Hugging Face diffusers' Wan transformers: `enable_vsa` / `disable_vsa`.

::

    from vsa_core.integrations.diffusers import enable_vsa
    enable_vsa(pipe.transformer, sparsity=0.875)   # every block's self-attention runs VSA
    video = pipe(prompt).frames                     # cross-attention to the text stays dense

`enable_vsa` installs `VSAWanAttnProcessor` on the self-attention (``attn1``) of every block
of a ``WanTransformer3DModel`` (Wan 2.1 / 2.2) and a forward pre-hook on the transformer that
records the latent's token grid (frames, height, width after patching) for the processors.
Each processor computes q, k, v exactly as diffusers' own (projections, RMS norms, rotary
embedding on raster-order tokens) and calls `vsa_core.video_sparse_attn` with
``token_order="raster"``: the coarse stage tiles the tokens as it pools them and the combine
writes the output back in raster order, so no linear layer pays for padding tokens and (with
the Triton coarse stage) no separate permutation copies are made per layer.

The coarse branch: VSA adds ``gate * coarse`` to the fine output. ``coarse="gate"`` (the
default) adds a per-layer gate projection ``attn1.to_gate_compress`` (a ``Linear(dim, dim)``,
named after FastVideo's VSA layers), zero-initialised so that an untrained model starts from
fine attention alone; its weights live in the transformer's state dict as
``blocks.N.attn1.to_gate_compress.{weight,bias}`` and load with ``load_state_dict``.
``coarse="add"`` adds the coarse output with gate 1, ``coarse="drop"`` leaves it out (gate 0).
With every tile selected and ``coarse="drop"`` the model computes dense attention, which is how
the tests check the processor against diffusers' own.

Context parallelism: under diffusers' Ulysses context parallelism (``transformer.
enable_parallelism(config=ContextParallelConfig(ulysses_degree=W))``, before or after
`enable_vsa`), each rank's blocks hold a contiguous slice of the raster tokens, and the
processors run `vsa_core.distributed.sequence_parallel_video_sparse_attn` over the Ulysses
group with ``token_order="raster"``: the result is the single-process model's (heads and the
token count T*H*W divisible by W). Ring attention and diffusers' uneven ("anything") splits are
refused with a ValueError. Checked on CPU processes over gloo (diffusers 0.42.1, which needs a
per-token timestep there: its context-parallel hook fails on a 1-D one); not yet on GPUs.

diffusers is an optional dependency (the workspace's ``diffusers`` group); this module does
not import it: it works with the transformer object it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

import torch
from torch import nn

from vsa_core.distributed import sequence_parallel_video_sparse_attn
from vsa_core.ops import video_sparse_attn
from vsa_core.tiling import VideoTiling
from vsa_core.validation import as_flag, as_float, as_int, check_positive_triple

Coarse = Literal["gate", "add", "drop"]
GATE_NAME = "to_gate_compress"
_STATE = "_vsa_state"


@dataclass
class VSASettings:
    """What `enable_vsa` installed: shared by the transformer's processors."""

    tile: tuple[int, int, int]
    topk: int | None
    sparsity: float | None
    backend: str
    coarse: Coarse
    deterministic: bool = False
    copy_to_tiles: bool = True
    grid: tuple[int, int, int] | None = None
    """The current forward's token grid (frames, height, width after patching)."""
    originals: dict[int, Any] = field(default_factory=dict)
    hook: Any = None

    keep: tuple[int, int] = field(init=False, default=(1, 1))
    """``1 - sparsity`` as an exact fraction (numerator, denominator), derived from ``sparsity``:
    `topk_for` computes in integers, since under ``torch.compile`` a float attribute that
    changed between compiles becomes a symbolic float whose rounding dynamo cannot always lift
    (torch 2.11: compiling a block for a second sparsity failed in training)."""

    def __post_init__(self) -> None:
        if self.sparsity is not None:
            keep = Fraction(1 - self.sparsity).limit_denominator(1 << 20)
            self.keep = (keep.numerator, keep.denominator)

    def topk_for(self, tiling: VideoTiling) -> int:
        """Key tiles per query tile: ``topk``, or ``(1 - sparsity) * tiles`` rounded half to
        even, at least 1."""
        if self.topk is not None:
            return min(self.topk, tiling.num_tiles)
        numerator, denominator = self.keep
        quotient, remainder = divmod(numerator * tiling.num_tiles, denominator)
        if 2 * remainder > denominator or (2 * remainder == denominator and quotient % 2):
            quotient += 1
        return max(1, quotient)


def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (x[2i], x[2i+1]), as Wan applies it."""
    acc = torch.promote_types(x.dtype, torch.float32)
    even, odd = x[..., 0::2].to(acc), x[..., 1::2].to(acc)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def _qkv(attn: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(hidden_states).chunk(3, dim=-1)
    return attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)


def _ulysses(parallel_config: Any):
    """diffusers' context-parallel config from a processor's ``_parallel_config`` (set by
    ``transformer.enable_parallelism``), or None without one; ValueError for the kinds VSA does
    not run (ring attention, uneven "anything" splits)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        return None
    if cp.ring_degree != 1 or getattr(cp, "ulysses_anything", False):
        raise ValueError(
            "VSA runs under diffusers' Ulysses context parallelism only (a ContextParallelConfig "
            f"with ring_degree=1 and ulysses_anything=False), got ring_degree={cp.ring_degree}, "
            f"ulysses_anything={getattr(cp, 'ulysses_anything', False)}"
        )
    return cp


class VSAWanAttnProcessor:
    """Self-attention of a diffusers Wan block through `video_sparse_attn` (see module doc)."""

    _parallel_config = None
    """diffusers' parallel config: ``transformer.enable_parallelism`` sets it on processors that
    have the attribute (and `enable_vsa` copies the model's, when that came first). With Ulysses
    context parallelism each rank's blocks see a contiguous slice of the raster tokens, and the
    processor runs `sequence_parallel_video_sparse_attn` over the Ulysses group."""

    def __init__(self, settings: VSASettings) -> None:
        self.settings = settings

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        settings = self.settings
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(
                "VSAWanAttnProcessor runs self-attention only (no encoder_hidden_states, no "
                "attention_mask); enable_vsa installs it on attn1"
            )
        if settings.grid is None:
            raise RuntimeError("the latent grid is unknown: call the transformer, not the block")
        tiling = VideoTiling(settings.grid, settings.tile)
        cp = _ulysses(self._parallel_config)
        ranks = 1 if cp is None else cp.ulysses_degree
        if hidden_states.shape[1] * ranks != tiling.seq_len:
            shard = "" if cp is None else f" on each of {ranks} context-parallel ranks"
            raise ValueError(
                f"hidden_states has {hidden_states.shape[1]} tokens{shard}, the latent grid "
                f"{settings.grid} has {tiling.seq_len}"
            )
        query, key, value = _qkv(attn, hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        out = self.attend(query, key, value, tiling, lambda: self._gate(attn, hidden_states, query))
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def attend(self, query, key, value, tiling: VideoTiling, gate) -> torch.Tensor:
        """The attention itself on raster-order BSHD q, k, v (``gate()`` gives the coarse gate).

        The one step a subclass replaces to run the same block with another attention (the
        step-time benchmark's dense arms do): everything around it stays identical.
        """
        settings = self.settings
        kwargs = dict(
            topk=settings.topk_for(tiling), tiling=tiling, coarse_gate=gate(),
            backend=settings.backend, token_order="raster", deterministic=settings.deterministic,
            copy_to_tiles=settings.copy_to_tiles,
        )  # fmt: skip
        cp = _ulysses(self._parallel_config)
        if cp is None:
            return video_sparse_attn(query, key, value, **kwargs)
        mesh = getattr(cp, "_ulysses_mesh", None)  # diffusers' (private) Ulysses device mesh
        if mesh is None:
            raise RuntimeError(
                "diffusers' ContextParallelConfig has no Ulysses mesh (_ulysses_mesh, as in "
                "diffusers 0.42): call transformer.enable_parallelism first, or this diffusers "
                "version keeps it elsewhere"
            )
        group = mesh.get_group()  # the ranks that hold this latent's other slices
        return sequence_parallel_video_sparse_attn(query, key, value, group=group, **kwargs)

    def _gate(self, attn: nn.Module, hidden_states: torch.Tensor, query: torch.Tensor):
        coarse = self.settings.coarse
        if coarse == "add":
            return None
        if coarse == "drop":
            return query.new_zeros((1, 1, 1, 1))
        gate = getattr(attn, GATE_NAME)(hidden_states)
        return gate.unflatten(2, (attn.heads, -1)).type_as(query)


def enable_vsa(
    transformer: nn.Module,
    *,
    topk: int | None = None,
    sparsity: float | None = None,
    tile: tuple[int, int, int] = (4, 4, 4),
    backend: str = "auto",
    coarse: Coarse = "gate",
    deterministic: bool = False,
    copy_to_tiles: bool = True,
) -> VSASettings:
    """Run every block's self-attention of a diffusers ``WanTransformer3DModel`` with VSA.

    Give exactly one of ``topk`` (key tiles per query tile) and ``sparsity`` (the fraction of
    key tiles skipped, e.g. 0.875). ``coarse``: see the module doc; ``"gate"`` adds the
    zero-initialised ``attn1.to_gate_compress`` projections (kept if already there, e.g.
    loaded). ``deterministic``: every call bitwise reproducible (see `video_sparse_attn`; the
    rest of the model is yours to make so). ``copy_to_tiles=False``: the fine backend reads
    each layer's raster q, k, v where they are (`video_sparse_attn`'s ``copy_to_tiles``: less
    memory, slower kernels). Returns the settings the processors share;
    `disable_vsa` undoes it all.
    """
    if hasattr(transformer, _STATE):
        raise ValueError("transformer already runs VSA: call disable_vsa first")
    blocks = getattr(transformer, "blocks", None)
    patch = getattr(getattr(transformer, "config", None), "patch_size", None)
    if blocks is None or patch is None or not all(hasattr(b, "attn1") for b in blocks):
        raise ValueError(
            "transformer must be a diffusers WanTransformer3DModel (blocks with attn1, "
            "config.patch_size)"
        )
    if (topk is None) == (sparsity is None):
        raise ValueError("give exactly one of topk= and sparsity=")
    if topk is not None:
        topk = as_int("topk", topk, 1, None)
    if sparsity is not None:
        sparsity = as_float("sparsity", sparsity)
        if not 0 <= sparsity < 1:
            raise ValueError(f"sparsity must lie in [0, 1), got {sparsity}")
    if coarse not in ("gate", "add", "drop"):
        raise ValueError(f"coarse must be 'gate', 'add' or 'drop', got {coarse!r}")
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a backend name or 'auto', got {backend!r}")
    deterministic = as_flag("deterministic", deterministic)
    copy_to_tiles = as_flag("copy_to_tiles", copy_to_tiles)
    settings = VSASettings(
        check_positive_triple("tile", tile), topk, sparsity, backend, coarse, deterministic,
        copy_to_tiles,
    )  # fmt: skip
    patch = tuple(patch)

    def record_grid(module, args, kwargs):
        latent = kwargs.get("hidden_states", args[0] if args else None)
        frames, height, width = latent.shape[-3:]
        settings.grid = (frames // patch[0], height // patch[1], width // patch[2])

    for index, block in enumerate(blocks):
        attn = block.attn1
        if coarse == "gate" and not hasattr(attn, GATE_NAME):
            dim = attn.to_out[0].out_features
            gate = nn.Linear(dim, dim, device=attn.to_out[0].weight.device)
            nn.init.zeros_(gate.weight)
            nn.init.zeros_(gate.bias)
            setattr(attn, GATE_NAME, gate.to(attn.to_out[0].weight.dtype))
        settings.originals[index] = attn.processor
        processor = VSAWanAttnProcessor(settings)
        processor._parallel_config = getattr(transformer, "_parallel_config", None)
        attn.set_processor(processor)
    settings.hook = transformer.register_forward_pre_hook(record_grid, with_kwargs=True)
    setattr(transformer, _STATE, settings)
    return settings


def disable_vsa(transformer: nn.Module, *, keep_gates: bool = False) -> None:
    """Restore diffusers' processors (and, unless ``keep_gates``, drop the gate projections)."""
    settings = getattr(transformer, _STATE, None)
    if settings is None:
        raise ValueError("transformer does not run VSA (enable_vsa was not called on it)")
    for index, block in enumerate(transformer.blocks):
        original = settings.originals[index]
        if hasattr(original, "_parallel_config"):  # enable_parallelism may have come since
            original._parallel_config = getattr(block.attn1.processor, "_parallel_config", None)
        block.attn1.set_processor(original)
        if not keep_gates and hasattr(block.attn1, GATE_NAME):
            delattr(block.attn1, GATE_NAME)
    settings.hook.remove()
    delattr(transformer, _STATE)

"""Schedules: which physical FA4 block-sparse tiles run a logical `BlockSparseLayout`.

A layout's logical block shape (query tokens x key tokens per block) is what the user selected;
FA4's kernels see a *physical* sparse block shape, and this module decides it. It is pure
Python (no torch data, no FA4 import), so the rules are testable anywhere and ``supports()``
stays cheap.

- Key blocks wider than 128 tokens (logical 256) run as 128-token physical key tiles
  (`BlockSparseLayout.refine`): FA4's sm_90 forward needs the sparse key block to equal its
  key tile (at most 128 at the head dims we run), and 128-token key tiles let the half-full
  and empty halves of a partial 256 block be masked or skipped on their own.
- ``schedule="paired"`` (the *coalescing adapter*): when adjacent 64-token query blocks are
  known to share one key list (``layout.q_group_size`` even, as after ``refine`` from a
  coarser parent), each aligned pair runs as one 128-row physical query tile (two consumer
  warpgroups on one key stream on sm_90) instead of two 64-row tiles. Arbitrary 64-token
  lists stay on the native 64-row path.
- ``schedule="native"``: physical query blocks = logical ones.
- ``schedule="auto"`` (default): ``"paired"`` when the layout allows it, else ``"native"``.

The same module holds the rules of what upstream FA4 (the pinned release) and the fork accept
per architecture, with the reason for each refusal (`plan_refusal`). Native 64x64 forwards run
on the fork's two-CTA-per-SM launch (`flash_attn_vsa.fwd_sm90`). Backward passes with
64-token key blocks on sm_90 run on the fork's kernels (`flash_attn_vsa.bwd_sm90`: 64x64 sparse
blocks with one MMA warpgroup, two CTAs per SM, dQ sent through a 16 KB buffer by the producer
warp (`bwd_sm90_dq_parts`); 128x64 ones with two MMA warpgroups, one CTA per SM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flash_attn_vsa import UPSTREAM_VERSION

ScheduleName = Literal["auto", "native", "paired"]
SCHEDULES: tuple[str, ...] = ("auto", "native", "paired")

BLOCK_SHAPES: tuple[tuple[int, int], ...] = ((64, 64), (128, 64), (64, 128), (128, 128), (256, 256))
"""Logical block shapes (q_block, kv_block) the adapter runs."""

HEAD_DIMS: tuple[int, ...] = (64, 128)
"""Head dims the adapter runs (and its tests cover)."""

MAX_KV_TILE = 128
"""Widest physical key tile: wider logical key blocks are refined to it."""

ARCHS: dict[tuple[int, int], str] = {(9, 0): "sm_90", (10, 0): "sm_100"}
"""Compute capabilities the adapter runs on, and their names."""


@dataclass(frozen=True)
class Plan:
    """How one logical layout runs: the physical sparse block FA4 sees.

    ``q_tile`` / ``kv_tile`` are FA4's sparse block size (``BlockSparseTensorsTorch.block_size``);
    ``q_merge`` logical query blocks share one physical query block (2 when paired), and each
    logical key block is cut into ``kv_split`` physical key blocks (2 for 256-token blocks).
    """

    logical: tuple[int, int]
    q_tile: int
    kv_tile: int
    schedule: str
    """The resolved schedule: ``"native"`` or ``"paired"``."""

    @property
    def q_merge(self) -> int:
        return self.q_tile // self.logical[0]

    @property
    def kv_split(self) -> int:
        return self.logical[1] // self.kv_tile

    @property
    def block_size(self) -> tuple[int, int]:
        return (self.q_tile, self.kv_tile)


def native_plan(block_shape: tuple[int, int]) -> Plan:
    """The plan of a block shape without pairing (what ``supports()`` judges a call by)."""
    q_block, kv_block = block_shape
    return Plan((q_block, kv_block), q_block, min(kv_block, MAX_KV_TILE), "native")


def can_pair(block_shape: tuple[int, int], q_group_size: int, num_q_blocks: int) -> bool:
    """Whether adjacent 64-token query blocks may run as one 128-row tile: aligned pairs are
    known to share their key list (``q_group_size`` even) and the count of blocks is even."""
    return block_shape[0] == 64 and q_group_size % 2 == 0 and num_q_blocks % 2 == 0


def make_plan(
    block_shape: tuple[int, int],
    q_group_size: int = 1,
    num_q_blocks: int = 0,
    schedule: str = "auto",
) -> Plan:
    """The physical plan of a layout with this block shape under ``schedule``.

    Raises ``ValueError`` for an unknown schedule, a block shape the adapter does not run, or
    ``"paired"`` on a layout whose adjacent query blocks are not known to share key lists.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    block_shape = (int(block_shape[0]), int(block_shape[1]))
    if block_shape not in BLOCK_SHAPES:
        raise ValueError(f"block shape must be one of {_shapes_text()}, got {_shape(block_shape)}")
    plan = native_plan(block_shape)
    pairable = can_pair(block_shape, q_group_size, num_q_blocks)
    if schedule == "paired" and not pairable:
        raise ValueError(
            "schedule='paired' needs 64-token query blocks whose aligned pairs share one key "
            f"list (layout.q_group_size even, as after refine() from a coarser layout) and an "
            f"even number of query blocks; got block shape {_shape(block_shape)}, "
            f"q_group_size={q_group_size}, num_q_blocks={num_q_blocks}"
        )
    if schedule == "paired" or (schedule == "auto" and pairable):
        return Plan(block_shape, 2 * block_shape[0], plan.kv_tile, "paired")
    return plan


def plan_refusal(
    capability: tuple[int, int], head_dim: int, plan: Plan, backward: bool
) -> str | None:
    """Why FA4 (the pinned upstream release, or the fork's kernels where it has one) cannot
    run ``plan`` here, or None when it can.

    Mirrors upstream's tile rules at the head dims in `HEAD_DIMS` (``_tile_size_fwd_sm90``,
    ``_fit_sm90_fwd_tile_to_block_sparsity``, ``_tile_size_bwd_sm90`` and the sm_100
    configuration in ``_get_fwd_config`` / ``_flash_attn_bwd``); their sources are fingerprinted
    by flash-attn-4-vsa, so a refresh that moves them is flagged for review here.
    """
    arch = ARCHS.get(tuple(capability))
    if arch is None:
        return f"needs {' or '.join(ARCHS.values())}, got sm_{capability[0]}{capability[1]}"
    q_tile, kv_tile = plan.block_size
    upstream = f"upstream FA4 {UPSTREAM_VERSION}"
    if arch == "sm_90":
        if backward and kv_tile == 64:
            return None  # the fork's KV64 backward (flash_attn_vsa.bwd_sm90), any query tile
        if backward and head_dim <= 64 and q_tile % 128:
            return (
                f"backward with {q_tile}-token query blocks at head dim {head_dim} on sm_90: "
                f"{upstream}'s backward query tile there is 128 rows"
            )
        return None
    # sm_100: 128x128 tiles; the forward runs two 128-row query stages per CTA.
    if kv_tile % 128:
        return (
            f"{kv_tile}-token key blocks on sm_100: {upstream}'s Blackwell block-sparse key "
            "tile is 128 tokens"
        )
    if q_tile % 256:
        return (
            f"{q_tile}-token query blocks on sm_100: {upstream}'s Blackwell block-sparse forward "
            "runs two 128-row query tiles per sparse block, so query blocks must be multiples "
            "of 256 tokens"
        )
    return None


def _shape(block_shape: tuple[int, int]) -> str:
    return f"{block_shape[0]}x{block_shape[1]}"


def _shapes_text() -> str:
    return ", ".join(_shape(s) for s in BLOCK_SHAPES)

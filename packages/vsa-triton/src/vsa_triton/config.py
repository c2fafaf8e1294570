"""Launch configurations of the Triton kernels, keyed on (q_block, kv_block, head_dim).

Chosen by measurement on an H200 (see the package README for the runs); the tables override
the defaults per shape, and benchmarks override them to sweep alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardConfig:
    tile: int  # key rows per inner-loop step (a multiple of kv_block)
    num_warps: int
    num_stages: int
    dual: bool = False  # two key blocks per step, scalar-indexed, two dots (tile = 2 kv_block)


@dataclass(frozen=True)
class BackwardConfig:
    tile_dkdv: int  # query rows per step of the dK/dV kernel (a multiple or divisor of q_block)
    num_warps_dkdv: int
    num_stages_dkdv: int
    tile_dq: int  # key rows per step of the dQ kernel (a multiple of kv_block)
    num_warps_dq: int
    num_stages_dq: int


_FORWARD: dict[tuple[int, int, int], ForwardConfig] = {}
_BACKWARD: dict[tuple[int, int, int], BackwardConfig] = {}


def forward_config(q_block: int, kv_block: int, head_dim: int) -> ForwardConfig:
    # One scalar-indexed key block per step: its rows are contiguous and its index prefetched,
    # so the loads pipeline. Gathered 128-row tiles for 64-token blocks measured slower on the
    # H200 (register spills of the per-row addresses), see the package README.
    default = ForwardConfig(tile=kv_block, num_warps=4 if q_block == 64 else 8, num_stages=3)
    return _FORWARD.get((q_block, kv_block, head_dim), default)


def backward_config(q_block: int, kv_block: int, head_dim: int) -> BackwardConfig:
    # dK/dV walks query blocks 64 rows at a time: a whole 128-row query block per step spills
    # 592 B (128x64) and 744 B (128x128) of registers on sm_90, 64-row slices none and 72 B
    # (cuobjdump, 2026-11-29; not yet timed, see NOTES.md).
    default = BackwardConfig(
        tile_dkdv=min(q_block, 64), num_warps_dkdv=4 if kv_block == 64 else 8, num_stages_dkdv=2,
        tile_dq=kv_block, num_warps_dq=4 if q_block == 64 else 8, num_stages_dq=2,
    )  # fmt: skip
    return _BACKWARD.get((q_block, kv_block, head_dim), default)

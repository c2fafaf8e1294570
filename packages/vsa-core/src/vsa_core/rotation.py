"""Rotated block lists: the order in which a kernel walks each list, chosen for the L2 cache.

A block-sparse kernel launches one program per list (a query block's key blocks, or a key
block's query blocks) and walks it. Programs start one after another as SMs free up, so with
ascending lists the programs running at one moment are spread over the whole index range.
Rotating list ``order`` (its place in the launch) to start at its first entry at or past
``(order * span // width) % span`` and wrap around makes a program that starts later also start
further on: with ``width`` programs running at once, they walk the same stretch together.

Whether that helps depends on the kernel, so each backend opts in where it was measured (H200,
2026-11-29, ratios to dense FA4 at S=131072 / 32768, 64x64 blocks, 87.5% sparse): the fa4
KV64 backward 0.42 -> 0.71 / unchanged (its dQ reduce-adds, fork experiment 6), the Triton
forward 0.50 -> 0.58 / unchanged (fork experiment 7), but at Wan 720p (92,160 tokens: one
head's K and V 47 MB, inside the 50 MB L2) the whole op's forward did not move (3.11x ->
3.07x of dense, +40 MiB), so the Triton forward rotates only when a head's K and V exceed the
L2; the fa4 Q64 forward got slower (0.80 -> 0.63-0.69) and the Triton backward did not move,
so they keep ascending lists. The
order of a list changes a result only by float rounding of its sums.
"""

from __future__ import annotations

import math

import torch


def rotation_width(device: torch.device, working_set_bytes: int | None = None) -> int:
    """Programs running at once for the kernels that rotate: the SM count of an sm_90 device
    (one program per SM; a caller whose kernel runs several CTAs per SM multiplies, as the fa4
    backward does), else 0 (no rotation: other GPUs are unmeasured). With
    ``working_set_bytes`` (what one head's lists index, e.g. its K and V), also 0 while that
    fits the device's L2: there rotation measured no gain."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) != (9, 0):
        return 0
    if working_set_bytes is not None and working_set_bytes <= props.L2_cache_size:
        return 0
    return props.multi_processor_count


def rotation_starts(
    shape: torch.Size | tuple[int, ...], span: int, width: int, device: torch.device | None = None
) -> torch.Tensor:
    """[*lead, rows] int64 start of each list of a [*lead, rows, slots] index tensor launched
    rows fastest: ``(order * span // width) % span``."""
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    *lead, rows, _ = shape
    order = torch.arange(math.prod(lead) * rows, device=device).view(*lead, rows)
    return (order * span // width) % max(span, 1)


def rotate_lists(indices: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Each ascending list (``indices[..., :count]``) rotated to begin at its first entry at or
    past its start; int32, zeros past the count."""
    slots = torch.arange(indices.shape[-1], device=indices.device)
    used = slots < counts.unsqueeze(-1)
    below = ((indices < starts.unsqueeze(-1)) & used).sum(-1, keepdim=True)
    source = (slots + below) % counts.clamp(min=1).unsqueeze(-1)
    return torch.where(used, torch.gather(indices, -1, source), 0).to(torch.int32)

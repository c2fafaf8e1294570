"""The FastVideo arms of `bench_video.py`: FastVideo's published VSA op on our op's inputs.

FastVideo publishes its kernels as ``fastvideo-kernel`` on PyPI (import name
``fastvideo_kernel``): an optional benchmark dependency, imported lazily here and never by the
packages; when it is missing or cannot run, every FastVideo arm is skipped with the reason.
Nothing of FastVideo's code is copied into this repository: the arms call its public entry
point, and the gate calls the two functions that entry point uses for its selection.

Two arms, one entry point (``fastvideo_kernel.video_sparse_attn``, read from 0.3.5):

- ``fastvideo``: its Triton composition (Triton tile pooling, torch matmul + softmax for the
  coarse attention, a Triton top-k mask kernel, Triton block-sparse forward and backward).
  Where its compiled extension also loads, ``FASTVIDEO_VSA_TRITON=1`` is set around each call
  (the package reads it per call) so that this arm stays on Triton.
- ``fastvideo_tk``: the same composition with the ThunderKittens sm_90 block-sparse kernels of
  its compiled ``_C`` extension (``block_sparse_fwd`` / ``block_sparse_bwd``). The wheel is
  built for one torch version (0.3.5: torch 2.12.0); when ``_C`` does not load, the arm is
  skipped with the import error.

Its call: ``video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk,
block_size=(4, 4, 4), compress_attn_weight=gate)`` on [B, H, S, D] tensors in tile order, each
tile padded to 64 slots (``block_size`` is the tile's shape; an int n means (n, n, n)), with
the real tokens per tile in ``variable_block_sizes``. It pools a tile as the sum of all 64
slots divided by the real count (so the padding must be zero), computes the coarse scores in
the input dtype with scale 1/sqrt(D) (fixed), selects the top-k key tiles per query tile on
those scores (ties at the threshold go to the lower tile index), attends over the selected
tiles' real keys with the same scale, and returns coarse * gate + fine. Our op pools the real
tokens only, scores in float32 and takes ``scale`` as an argument: the inputs given to
FastVideo are ours converted once, outside the timed region (BSHD -> BHSD contiguous, padding
slots zeroed; the gate and the output gradient transposed likewise), and its outputs come back
as BSHD views (a transpose, no copy). Its selection can differ from ours where bf16 scores tie
or round differently, so its gate is the float32 composition on its own selection.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import bench_report as brep
import bench_timing as bt
import torch

DIST = "fastvideo-kernel"
MODULE = "fastvideo_kernel"
ARMS = {"fastvideo": "triton", "fastvideo_tk": "tk"}
BLOCK = 64  # the tile volume of FastVideo's Triton / ThunderKittens path
NOT_INSTALLED = (
    "not installed: fastvideo-kernel is an optional benchmark dependency "
    "(benchmarks/README.md, 'FastVideo arms', says how to get it)"
)
# Environment variables fastvideo_kernel reads on every call to pick its fine kernels.
_ROUTING_ENV = ("FASTVIDEO_VSA_TRITON", "FASTVIDEO_KERNEL_VSA_FORCE_TRITON", "FASTVIDEO_VSA_SM100A")


@dataclass
class Package:
    """What this process found of fastvideo-kernel (`probe`, once per run)."""

    unavailable: str | None = None  # why no FastVideo arm can run
    tk_unavailable: str | None = None  # why the ThunderKittens arm cannot run
    module: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def why_not(self, arm: str) -> str | None:
        """Why ``arm`` cannot run here, or None."""
        if self.unavailable is not None:
            return self.unavailable
        return self.tk_unavailable if ARMS[arm] == "tk" else None


def _version() -> str | None:
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_requirement() -> str | None:
    """The torch pin in fastvideo-kernel's metadata (e.g. ``torch==2.12.0``), if any."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError, TypeError):
        for req in importlib.metadata.requires(DIST) or []:
            name = req.split(";")[0].strip()
            if name.replace(" ", "").startswith("torch") and not name.startswith("torchvision"):
                return name
    return None


def probe(device: torch.device, *, require_cuda: bool = True) -> Package:
    """Find, import and describe fastvideo-kernel; never raises.

    Where its ``_C`` extension does not load, the package's per-call probe of it
    (``block_sparse_attn._get_sm90_ops``, which retries the failed import on every forward
    call) is answered from this first result instead, and the cost of one retry is recorded:
    where the wheel matches its torch the import succeeds once and costs nothing after.
    ``require_cuda=False`` (tests) goes on without a CUDA device.
    """
    pkg = Package()
    pkg.info = {"distribution": DIST, "version": _version(), "torch_requirement": None}
    if importlib.util.find_spec(MODULE) is None:
        pkg.unavailable = NOT_INSTALLED
        return pkg
    pkg.info["torch_requirement"] = _torch_requirement()
    if require_cuda and device.type != "cuda":
        pkg.unavailable = "FastVideo's VSA runs on CUDA only (its ops are registered for cuda)"
        return pkg
    try:
        pkg.module = importlib.import_module(MODULE)
    except Exception as exc:
        pkg.unavailable = f"import failed: {brep.error_text(exc, 500)}"
        return pkg
    pkg.info["module_file"] = getattr(pkg.module, "__file__", None)
    pkg.info["entry_point"] = f"{MODULE}.video_sparse_attn"
    try:
        ops = importlib.import_module(f"{MODULE}._C.fastvideo_kernel_ops")
        missing = [n for n in ("block_sparse_fwd", "block_sparse_bwd") if not hasattr(ops, n)]
        if missing:
            pkg.tk_unavailable = f"its `_C` extension loads but lacks {', '.join(missing)}"
    except Exception as exc:
        pkg.tk_unavailable = (
            f"its compiled `_C` extension does not load: {brep.error_text(exc, 500)}"
        )
        need = pkg.info["torch_requirement"]
        if need:
            pkg.tk_unavailable += f" (the wheel requires {need}; this is torch {torch.__version__})"
    if pkg.tk_unavailable is None and device.type != "cuda":
        pkg.tk_unavailable = "its ThunderKittens kernels need a CUDA device"
    if pkg.tk_unavailable is None:
        capability = torch.cuda.get_device_capability(device)
        if capability != (9, 0):
            pkg.tk_unavailable = (
                f"its ThunderKittens VSA kernels are built for sm_90; this device is "
                f"sm_{capability[0]}{capability[1]}"
            )
    routing = importlib.import_module(f"{MODULE}.block_sparse_attn")
    probe_fn = getattr(routing, "_get_sm90_ops", None)
    if callable(probe_fn):
        costs = []
        for _ in range(3):
            t0 = time.perf_counter()
            found = probe_fn()
            costs.append((time.perf_counter() - t0) * 1e3)
        pkg.info["sm90_probe_ms_per_call"] = statistics.median(costs)
        if not all(f is not None for f in found):
            routing._get_sm90_ops = lambda: found
            pkg.info["sm90_probe"] = (
                "its `_C` import failed; fastvideo_kernel.block_sparse_attn._get_sm90_ops, "
                "which retries that import on every forward call (sm90_probe_ms_per_call each), "
                "answers from the first try in this run"
            )
    return pkg


@contextlib.contextmanager
def _environ(changes: dict[str, str | None]) -> Iterator[None]:
    """Set (value) or unset (None) environment variables for the block."""
    before = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def routing_env(pkg: Package, arm: str) -> dict[str, str | None]:
    """The environment changes that route ``arm``'s calls to its kernels (only those that
    differ from the current environment)."""
    if ARMS[arm] == "triton":
        wanted: dict[str, str | None] = {"FASTVIDEO_VSA_TRITON": "1"}
        if pkg.tk_unavailable is not None:  # Triton is its only path here
            wanted = {}
    else:
        wanted = {name: None for name in _ROUTING_ENV}
    return {n: v for n, v in wanted.items() if os.environ.get(n) != v}


def to_fastvideo(x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """A BSHD tile-order tensor as FastVideo takes it: BHSD, contiguous, and with ``real`` (a
    bool [S] of the real slots) its padding slots zeroed."""
    if real is not None:
        x = torch.where(real.view(1, -1, 1, 1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.transpose(1, 2).contiguous()


@dataclass
class Prepared:
    """An arm's runner and what its gate needs."""

    runner: bt.Runner
    q: torch.Tensor  # FastVideo's BHSD inputs (padding zeroed)
    k: torch.Tensor
    valid_sizes: torch.Tensor  # int32 [N] on the device


def prepare(
    pkg: Package,
    arm: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    dout: torch.Tensor,
    valid_sizes: torch.Tensor,
    tile_shape: tuple[int, int, int],
    topk: int,
    mode: str,
) -> Prepared:
    """``arm``'s runner of ``mode`` on our op's BSHD tile-order inputs (converted once here);
    its outputs are BSHD views named out, dq, dk, dv (and dgate with a gate)."""
    fv = pkg.module
    tile_shape = tuple(tile_shape)
    tiles = valid_sizes.shape[0]
    real = (torch.arange(BLOCK, device=q.device) < valid_sizes.to(q.device).view(-1, 1)).view(-1)
    assert real.numel() == q.shape[1] == tiles * BLOCK
    tensors = [to_fastvideo(t, real) for t in (q, k, v)]
    if gate is not None:
        tensors.append(to_fastvideo(gate, None))
    leaves = bt.make_leaves(tensors, mode, lambda t: t)
    vbs = valid_sizes.to(device=q.device, dtype=torch.int32).contiguous()
    env = routing_env(pkg, arm)
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = (
        (lambda: _environ(env)) if env else contextlib.nullcontext
    )

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *g: torch.Tensor) -> Any:
        with scope():
            return fv.video_sparse_attn(q, k, v, vbs, vbs, topk, tile_shape, g[0] if g else None)

    names = ("dq", "dk", "dv", "dgate")[: len(leaves)]
    runner = bt.autograd_runner(
        forward, leaves, to_fastvideo(dout, None), mode, lambda t: t.transpose(1, 2), names
    )
    runner.info = {
        "impl": ARMS[arm],
        "call": f"{MODULE}.video_sparse_attn(q, k, v, vbs, vbs, topk, {tile_shape}, gate), BHSD",
        "environment": {n: v for n, v in env.items()},
        **pkg.info,
    }
    return Prepared(runner, tensors[0], tensors[1], vbs)


@torch.no_grad()
def selection(pkg: Package, prepared: Prepared, topk: int) -> torch.Tensor:
    """FastVideo's own selection on ``prepared``'s inputs: [B, H, N, N] bool, from the pooling
    and top-k functions its entry point calls (``fastvideo_kernel.ops``), on the same scores."""
    ops = importlib.import_module(f"{MODULE}.ops")
    q_pooled = ops.fused_block_mean(prepared.q, prepared.valid_sizes, BLOCK)
    k_pooled = ops.fused_block_mean(prepared.k, prepared.valid_sizes, BLOCK)
    scores = torch.matmul(q_pooled, k_pooled.transpose(-2, -1)) / (prepared.q.shape[-1] ** 0.5)
    return ops.fused_topk_mask(scores, topk)

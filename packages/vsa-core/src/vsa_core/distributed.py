"""Sequence-parallel VSA over ``torch.distributed`` (Ulysses style).

Each of the W ranks of a process group holds a contiguous, tile-aligned slice of the tile-order
(padded) sequence for all heads. An all-to-all swaps that for the whole sequence and H / W heads,
`video_sparse_attn` runs there with the tiling of the whole latent (tile pooling, coarse
attention, top-k selection and fine attention all see every tile), and a second all-to-all swaps
back::

    rank r:  q, k, v [B, S / W, H, D]      tokens r * S/W ... (r+1) * S/W - 1 of the tile order
      -- all-to-all -->  [B, S, H / W, D]  heads r * H/W ... (r+1) * H/W - 1, every token
      -- video_sparse_attn(tiling=the whole latent's tiling) -->
      -- all-to-all -->  out [B, S / W, H, D]

Since each head still attends over the whole latent, the result is the single-device op's (the
same pooled tiles, the same top-k selection), not an approximation; only the rounding of
reductions over differently shaped tensors may differ. Requirements: H divisible by W, and the
number of tiles divisible by W, so that every rank holds ``tiling.padded_len / W`` tokens, a
whole number of tiles (`shard_sequence` cuts a full tensor that way).

Pipeline: rank r's H / W heads (and the batch rows) are taken in steps of ``head_chunk``
heads of one batch row. Per step and tensor one ``torch.distributed.all_to_all_single`` (NCCL
for CUDA tensors, gloo for CPU ones, so the CPU tests run the very code that GPUs run) swaps
[S / W tokens, W x head_chunk heads] for [S tokens, head_chunk heads]; `video_sparse_attn` runs
on the step ([1, S, head_chunk, D]; the coarse stage of a head needs only that head), and its
output travels back. The exchanges are asynchronous (``async_op=True``; ``wait()`` on a work
handle orders the current stream after it, no host synchronization): step i+1's q, k, v (and
gate) are packed and in flight while step i's op runs, and step i's output is in flight while
step i+1's runs; only the first step's input and the last step's output exchanges are not
overlapped (on NCCL the exchanges share one stream and run in the order issued). Each step's
result is the op's on those heads, bit for bit (per-head computations, the same fine backend:
``backend="auto"`` is decided once for the rank's [B, S, H / W, D] call), so ``head_chunk``
changes memory and time, never the result.

Copies: the send buffer of q, k, v and the gate is one packing copy each (strided inputs,
BHSD views and expanded gates included); what is received is the op's input as it lies (a
view, no copy); the op's output is sent as it is; the received output is written once into
the output shard. A gate without a sequence dimension is not exchanged (each step takes its
heads).

Memory per rank (inference; u = S x head_chunk x D elements, one step's tensor; n = 3, or 4
with a gate that has a sequence dimension; all of it measured on the CPU by
tests/test_distributed_memory.py, bound included)::

    peak <= [B, S/W, H, D] output shard
            + the op's own peak on one step ([1, S, head_chunk, D])
            + n u  (this step's received q, k, v, gate)
            + 2 n u  (the next step's send and receive buffers, in flight)
            + 2 u  (the previous step's output and its receive buffer, in flight)

Wan 2.1 720p (S = 92,160 padded tokens, 40 heads, D=128, bf16, B=1, per-token gate) on 2
ranks: the output shard is 450 MiB and u = 22.5 MiB at the default head_chunk of 1, so about
450 + 27 + 90 + 180 + 45 = 792 MiB, against about 1,090 MiB for the single-GPU op (900 of it
its output). The unpipelined wrapper (before issue 22) peaked at 5,400 MiB in its first
exchange: one packed send buffer of q, k, v and the gate (1,800 MiB), its receive buffer
(1,800 MiB) and a contiguous copy of each part (1,800 MiB). The floor with overlap is the
output shard plus the next step's receive buffers and this step's inputs; at W = 2 that is
above 0.6x the single-GPU op, at W >= 4 (shard 225 MiB at 4 ranks) below.

Training (autograd): each step's graph is kept from forward to backward, so besides the
output shard and the gradient shards every step's received inputs (n x [B, S, H / W, D] over
all steps) and what the op saves are kept (about the unpipelined wrapper's activations); the
backward is pipelined like the forward (output gradient of step i+1 in flight during step i's
backward, step i's input gradients during step i+1's). ``recompute=True`` keeps nothing: the
backward exchanges each step's inputs again and runs its forward again (the op's training
path, as in the forward) before its backward, for one more forward and input exchange::

    peak <= output shard + gradient shards + the op's forward+backward peak on one step
            + (3 (n + 1) + 2 n + 1) u  (this step's inputs and output gradient, the next
              step's in flight, the previous step's input gradients in flight, and one step
              tensor more that the CPU measurement shows the op's backward holding)

Wan 720p on 2 ranks: 450 + 1,800 + about 140 + 24 x 22.5 = about 2,930 MiB, against about
5,600-6,100 MiB for the single-GPU op's forward+backward.

Backward: gradients of q, k, v and the coarse gate come back sharded like the inputs (a
replicated gate's: this rank's heads' part, see ``coarse_gate``). `seq_to_heads` and
`heads_to_seq` are the two whole-tensor exchanges on their own (autograd functions whose
backward is the reverse exchange; received buffers used as they lie for B = 1).

Composing with data parallelism (DDP, FSDP) and across hosts: give the op a *sequence-parallel
subgroup* and let the data-parallel wrapper own the world. With W = dp x sp ranks, rank r trains
on batch shard r // sp and holds sequence slice r % sp; `torch.distributed.new_group` makes the
dp groups of sp ranks each (every rank creates every group, in the same order), and each rank
passes its own as ``group=``. Weights outside the op are replicated on every rank and each
sequence shard contributes a partial gradient, so their gradients are all-reduced over all W
ranks (what DDP or FSDP over the default group does; FSDP's sharding group may be the whole
world or the dp groups). tests/test_distributed_composition.py runs that 2 x 2 mesh on four
gloo processes and matches one process to 1e-10. Ulysses needs heads divisible by the
sequence-parallel size: keep sp within a node (NVLink carries the all-to-alls) and scale across
nodes with data parallelism. Where heads < sp is wanted (long latents, few heads), a hybrid is
needed: Ulysses inside a node and ring attention (key/value blocks passed around, the top-k
selection computed once on the gathered pooled tiles) or head replication across nodes; this
module does not implement it.

Raster order (``token_order="raster"``): a model that keeps its tokens in T-H-W raster order
(as `vsa_core.integrations.diffusers` does) shards them as they lie: rank r holds raster tokens
r * S/W ... with S = ``tiling.seq_len`` (divisible by W; the tile count need not be). The
exchanges are the same; each step's `video_sparse_attn` gets the whole raster sequence of its
heads and tiles it while pooling (`video_sparse_attn`'s ``token_order="raster"``), so no padding
crosses the exchanges and the output shard comes back in raster order.

Every rank of the group must make the same calls with the same shapes (as for any collective).
Input checks are local and run before any communication: inputs that are wrong on every rank
raise everywhere, but a rank whose inputs alone are wrong raises while the others wait in the
all-to-all until the process group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vsa_core.backends import AttentionCall, select_backend
from vsa_core.ops import QKVFormat, TokenOrder, video_sparse_attn
from vsa_core.tiling import VideoTiling
from vsa_core.validation import (
    as_flag,
    as_int,
    check_coarse_gate,
    check_copy_to_tiles,
    check_qkv,
    check_scale,
    check_topk,
    empty_batch_result,
)

__all__ = [
    "gather_sequence",
    "heads_to_seq",
    "seq_to_heads",
    "sequence_parallel_video_sparse_attn",
    "shard_sequence",
]

ProcessGroup = dist.ProcessGroup if dist.is_available() else object


def sequence_parallel_video_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topk: int,
    tiling: VideoTiling,
    coarse_gate: torch.Tensor | None = None,
    group: ProcessGroup | None = None,
    backend: str = "auto",
    scale: float | None = None,
    qkv_format: QKVFormat = "bshd",
    head_chunk: int | None = None,
    recompute: bool = False,
    deterministic: bool = False,
    token_order: TokenOrder = "tiled",
    copy_to_tiles: bool = True,
) -> torch.Tensor:
    """`video_sparse_attn` on a sequence sharded over the ranks of ``group`` (Ulysses).

    Call it on every rank of ``group`` with that rank's shard; the result on each rank is its
    shard of what `video_sparse_attn` gives on the full (gathered) inputs. Differentiable.

    Args:
        q, k, v: this rank's shard, BSHD [B, S / W, H, D] (or [B, H, S / W, D] with
            ``qkv_format="bhsd"``): tokens ``r * S/W`` to ``(r+1) * S/W - 1`` of the tile-order,
            padded sequence (S = ``tiling.padded_len``, W the group's size, r this rank's
            index in it), every head. H must be divisible by W and ``tiling.num_tiles`` too.
        topk: key tiles per query tile, in [1, ``tiling.num_tiles``] (a Python or NumPy
            integer, or a 0-d integer tensor).
        tiling: the `VideoTiling` of the whole latent (not of the shard).
        coarse_gate: multiplies the coarse output; None means 1. Either sharded like q
            (broadcastable to q's local shape with the local sequence length S / W, e.g. the
            full [B, S / W, H, D] or [B, S / W, H, 1]), or without a sequence dimension
            (e.g. [1, 1, H, 1] in BSHD), which is taken as the same value on every rank: its
            gradient on a rank then covers only the H / W heads that rank attended over, and
            the sum over ranks (as for any replicated parameter) is the full gradient.
        group: the process group (default: the default group).
        backend: fine-attention backend name or ``"auto"``, as for `video_sparse_attn`.
        scale: softmax scale, default ``1 / sqrt(D)`` (a Python or NumPy number, or a 0-d
            tensor).
        qkv_format: ``"bshd"`` or ``"bhsd"``.
        head_chunk: heads per pipeline step (of this rank's H / W), in [1, H / W]; None: the
            most whose whole-sequence tensor (S x head_chunk x D elements) fits in 32 MiB, at
            least 1 (1 at Wan 2.1 720p with D=128 in bf16). Smaller steps need less memory
            (see the module doc), larger ones fewer calls of the op. The result does not
            depend on it.
        recompute: with autograd, keep no step's activations for backward: backward exchanges
            q, k, v (and the gate) again and runs each step's forward again before its
            backward (activation checkpointing of the op, see the module doc for the memory);
            costs one more forward and input exchange. The result and gradients do not
            depend on it.
        deterministic: as for `video_sparse_attn`: bitwise-reproducible output and
            gradient shards run to run (each step's op runs with it; ``auto`` is decided with
            it; the exchanges move data without arithmetic, and a replicated gate's gradient
            sums the steps in a fixed order).
        token_order: ``"tiled"`` (default): the shards are slices of the padded tile-order
            sequence, as above; ``"raster"``: they are slices of the T-H-W raster sequence
            (S = ``tiling.seq_len``, divisible by W; the tile count need not be), as a model
            that keeps raster tokens holds them, and the output shard is raster too: each
            step's op tiles while it pools (`video_sparse_attn`'s ``token_order``), so no
            padding crosses the exchanges.
        copy_to_tiles: as for `video_sparse_attn` (``token_order="raster"`` only): False has
            each step's fine backend read the raster tokens where they are (less memory,
            slower kernels); ``auto`` is decided with it.

    Returns:
        this rank's shard of the output, in q's format and dtype. An empty batch (B = 0, on
        every rank, as for any collective) gives an empty output without communicating.

    Raises:
        ValueError: mismatched q/k/v, no heads, a zero head dim, H or ``tiling.num_tiles`` not
            divisible by W, a local sequence length other than ``tiling.padded_len / W`` (the
            split is not at tile boundaries; raster order: other than ``tiling.seq_len / W``),
            a coarse_gate that is not sharded like q, a head_chunk outside [1, H / W], a
            token_order other than "tiled" / "raster", or a bad topk / scale.
        RuntimeError: torch.distributed is not initialized.
    """
    rank, world = _rank_and_world(group)
    token_order = _check_token_order(token_order)
    batch, seq_local, heads, dim = _check_inputs(
        q, k, v, tiling, topk, world, qkv_format, token_order
    )
    topk = check_topk(topk, tiling.num_tiles)
    scale = check_scale(scale, dim)
    gate = _check_gate(coarse_gate, q, qkv_format, seq_local)
    heads_local = heads // world
    chunk = _check_head_chunk(head_chunk, heads_local, seq_local * world, dim, q.element_size())
    deterministic = as_flag("deterministic", deterministic)
    copy_to_tiles = check_copy_to_tiles(copy_to_tiles, token_order)
    if batch == 0:  # the same on every rank: no exchange, nothing to wait for
        return empty_batch_result(q, k, v, coarse_gate)
    if world == 1:
        return video_sparse_attn(
            q,
            k,
            v,
            topk=topk,
            tiling=tiling,
            coarse_gate=coarse_gate,
            backend=backend,
            scale=scale,
            qkv_format=qkv_format,
            deterministic=deterministic,
            token_order=token_order,
            copy_to_tiles=copy_to_tiles,
        )

    q, k, v = (_as_bshd(t, qkv_format) for t in (q, k, v))
    gate_seq = gate is not None and not (gate.shape[1] == 1 and seq_local != 1)
    if gate_seq:  # sharded like q: exchanged like q, at its own last dim
        gate = gate.expand(batch, seq_local, heads, gate.shape[3])
    units = tuple(
        (b, start, min(chunk, heads_local - start))
        for b in range(batch)
        for start in range(0, heads_local, chunk)
    )
    inputs = (q, k, v, gate)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    # decided for the rank's whole call, as the unpipelined wrapper did; a named backend is
    # checked here too, before any exchange
    grad_qkv = training and any(t.requires_grad for t in (q, k, v))
    backend = _resolve_backend(
        backend, q, batch * tiling.padded_len * heads_local, tiling, grad_qkv, deterministic,
        not copy_to_tiles,
    )  # fmt: skip
    plan = _Plan(
        group, world, rank, heads_local, units, gate_seq, tiling, topk, backend, scale,
        bool(recompute), deterministic, token_order, copy_to_tiles,
    )  # fmt: skip
    out = _UlyssesAttention.apply(plan, *inputs) if training else _forward(plan, *inputs)
    return _as_bshd(out, qkv_format)


def seq_to_heads(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The first Ulysses all-to-all: [B, S / W, H, D] sequence shards -> [B, S, H / W, D].

    Rank r receives heads ``r * H/W`` to ``(r+1) * H/W - 1`` of the whole sequence, the shards
    in rank order. Differentiable (its backward is `heads_to_seq`). BSHD, H divisible by W.
    """
    _, world = _rank_and_world(group)
    _check_4d("x", x)
    if x.shape[2] % world:
        raise ValueError(
            f"x must have a number of heads divisible by the world size {world}, "
            f"got shape {tuple(x.shape)}"
        )
    return x if world == 1 else _AllToAll.apply(group, world, True, x)[0]


def heads_to_seq(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The second Ulysses all-to-all: [B, S, H / W, D] -> [B, S / W, H, D] sequence shards.

    The inverse of `seq_to_heads`. Differentiable (its backward is `seq_to_heads`). BSHD, S
    divisible by W.
    """
    _, world = _rank_and_world(group)
    _check_4d("x", x)
    if x.shape[1] % world:
        raise ValueError(
            f"x must have a sequence length divisible by the world size {world}, "
            f"got shape {tuple(x.shape)}"
        )
    return x if world == 1 else _AllToAll.apply(group, world, False, x)[0]


def shard_sequence(
    x: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    tiling: VideoTiling | None = None,
    dim: int = 1,
    token_order: TokenOrder = "tiled",
) -> torch.Tensor:
    """This rank's contiguous slice of a full sequence: the input layout of
    `sequence_parallel_video_sparse_attn`.

    Args:
        x: the full tensor (the same on every rank), e.g. [B, S, H, D] in tile order.
        group: the process group (default: the default group).
        tiling: if given, ``x`` must hold ``tiling.padded_len`` tokens along ``dim`` and the
            number of tiles must be divisible by the world size (a tile-aligned split); with
            ``token_order="raster"``, ``tiling.seq_len`` tokens (raster order), divisible by
            the world size.
        dim: the sequence dimension (1 for BSHD, 2 for BHSD).
        token_order: ``"tiled"`` or ``"raster"``: which sequence ``x`` holds (checked against
            ``tiling``; without a tiling it changes nothing).

    Returns:
        ``x.narrow(dim, r * S/W, S/W)`` for rank r of W: a view, differentiable.
    """
    rank, world = _rank_and_world(group)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(dim, x)
    token_order = _check_token_order(token_order)
    length = x.shape[dim]
    if tiling is not None:
        if not isinstance(tiling, VideoTiling):
            raise ValueError(f"tiling must be a VideoTiling or None, got {type(tiling).__name__}")
        expected, what = _sharded_sequence(tiling, world, token_order)
        if length != expected:
            raise ValueError(
                f"x must hold {what} = {expected} tokens along dim {dim} "
                f"(token_order={token_order!r}), got shape {tuple(x.shape)}"
            )
    if length % world:
        raise ValueError(
            f"x's length {length} along dim {dim} must be divisible by the world size {world}"
        )
    size = length // world
    return x.narrow(dim, rank * size, size)


def gather_sequence(
    x: torch.Tensor, group: ProcessGroup | None = None, *, dim: int = 1
) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of `shard_sequence`).

    Every rank's ``x`` must have the same shape; the result, on every rank, is the shards
    concatenated in rank order along ``dim``. Not differentiable (it returns a tensor without
    autograd history): meant for checks and final outputs.
    """
    _, world = _rank_and_world(group)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(dim, x)
    x = x.detach()
    if world == 1:
        return x.clone()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


# ---- the pipelined op -----------------------------------------------------------------------
_STEP_BYTES = 32 * 2**20  # the default step: the most heads whose S x heads x D tensor fits


@dataclass(frozen=True)
class _Plan:
    """One call's fixed parts: the group, this rank's heads and the steps over them."""

    group: ProcessGroup | None
    world: int
    rank: int
    heads_local: int  # H / W
    units: tuple[tuple[int, int, int], ...]  # (batch row, first local head, heads) per step
    gate_seq: bool  # the gate has a sequence dimension: exchanged with q, k, v
    tiling: VideoTiling
    topk: int
    backend: str
    scale: float
    recompute: bool  # training: backward exchanges and runs each step again
    deterministic: bool = False  # each step's op runs with deterministic=True
    token_order: TokenOrder = "tiled"  # the sequence the shards slice (and each step's op's)
    copy_to_tiles: bool = True  # each step's op's (raster order only)


class _Pending:
    """One all-to-all in flight: ``wait()`` orders the current stream after it (NCCL; gloo
    blocks) and returns the received buffer; the send buffer is dropped then."""

    def __init__(self, send: torch.Tensor, group: ProcessGroup | None) -> None:
        self.send: torch.Tensor | None = send
        self.recv = torch.empty_like(send)
        self.work = dist.all_to_all_single(self.recv, send, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.send = self.work = None  # a work object may hold its tensors
        return self.recv


def _to_heads_start(x: torch.Tensor, unit: tuple[int, int, int], plan: _Plan) -> _Pending:
    """Start sending batch row b, heads ``j * H/W + start ...`` (count of them) of the local
    tokens of ``x`` [B, S/W, H, Dx] (any strides) to rank j: the send buffer [W, S/W, count, Dx]
    is the one copy. The received buffer [W, S/W, count, Dx] is the whole sequence (rank j's
    tokens are chunk j) of this rank's heads: a contiguous [1, S, count, Dx] as it lies."""
    b, start, count = unit
    chunks = x[b].unflatten(1, (plan.world, plan.heads_local)).narrow(2, start, count)
    send = x.new_empty(plan.world, x.shape[1], count, x.shape[3])
    send.copy_(chunks.permute(1, 0, 2, 3))
    return _Pending(send, plan.group)


def _to_heads_wait(pending: _Pending) -> torch.Tensor:
    recv = pending.wait()
    return recv.view(1, -1, *recv.shape[2:])


def _to_seq_start(y: torch.Tensor, plan: _Plan) -> _Pending:
    """Start sending tokens ``j * S/W ...`` of ``y`` [1, S, count, Dy] (this rank's heads) to
    rank j: y itself is the send buffer (contiguous, no copy)."""
    y = y.contiguous()
    return _Pending(y.view(plan.world, -1, *y.shape[2:]), plan.group)


def _to_seq_finish(pending: _Pending, dest: torch.Tensor, unit: tuple[int, int, int], plan: _Plan):
    """Wait for `_to_seq_start`'s exchange and write what came (rank j's heads of this rank's
    tokens) into ``dest`` [B, S/W, H, Dy] at batch row b, heads ``j * H/W + start ...``."""
    b, start, count = unit
    recv = pending.wait()  # [W (source rank), S/W, count, Dy]
    dest[b].unflatten(1, (plan.world, plan.heads_local)).narrow(2, start, count).copy_(
        recv.permute(1, 0, 2, 3)
    )


def _gate_unit(gate: torch.Tensor, unit: tuple[int, int, int], plan: _Plan) -> torch.Tensor:
    """A replicated gate's part (no sequence dimension) for a step's batch row and heads."""
    b, start, count = unit
    if gate.shape[0] != 1:
        gate = gate.narrow(0, b, 1)
    if gate.shape[2] != 1:
        gate = gate.narrow(2, plan.rank * plan.heads_local + start, count)
    return gate


def _step(
    plan: _Plan,
    parts: list[torch.Tensor],
    gate: torch.Tensor | None,
    unit: tuple[int, int, int],
    needs: tuple[bool, ...] | None,
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """`video_sparse_attn` on one step's received q, k, v (and gate): (its inputs, its output).
    ``needs`` None: without autograd; otherwise on detached leaves, those of q, k, v, gate
    that ``needs`` names requiring a gradient, with autograd on."""
    if not plan.gate_seq:
        parts = [*parts, None if gate is None else _gate_unit(gate, unit, plan)]
    if needs is not None:
        parts = [
            None if t is None else t.detach().requires_grad_(need)
            for t, need in zip(parts, needs, strict=True)
        ]
    with torch.set_grad_enabled(needs is not None):
        y = video_sparse_attn(
            parts[0],
            parts[1],
            parts[2],
            topk=plan.topk,
            tiling=plan.tiling,
            coarse_gate=parts[3],
            backend=plan.backend,
            scale=plan.scale,
            deterministic=plan.deterministic,
            token_order=plan.token_order,
            copy_to_tiles=plan.copy_to_tiles,
        )
    return parts, y


def _forward(
    plan: _Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    *,
    keep: list | None = None,
    needs: tuple[bool, ...] | None = None,
) -> torch.Tensor:
    """The op, step by step: step i+1's q, k, v (and gate) are in flight while step i's
    `video_sparse_attn` runs, and step i's output is in flight while step i+1's runs.

    ``needs`` None: without autograd (inference). Otherwise each step runs with autograd
    (`_step` with ``needs``: the op's training path, which zeroes padding rows) and ``keep``
    receives its (inputs, output) for `_backward`, or, None (``recompute``), nothing: every
    buffer and graph is dropped once used."""
    batch, seq_local, heads, dim = q.shape
    out = q.new_empty(batch, seq_local, heads, dim)
    sent = [q, k, v] + ([gate] if plan.gate_seq else [])

    def start(unit):
        return [_to_heads_start(t, unit, plan) for t in sent]

    incoming = start(plan.units[0])
    outgoing = None
    for i, unit in enumerate(plan.units):
        parts = [_to_heads_wait(p) for p in incoming]
        # Step i+1's packing is issued before step i's op, so that its exchange overlaps it.
        incoming = start(plan.units[i + 1]) if i + 1 < len(plan.units) else []
        parts, y = _step(plan, parts, gate, unit, needs)
        if keep is not None:
            keep.append((parts, y))
        y = y.detach()  # the send buffer: without the step's graph (dropped with recompute)
        del parts
        previous, outgoing = outgoing, (_to_seq_start(y, plan), unit)
        del y
        if previous is not None:
            _to_seq_finish(previous[0], out, previous[1], plan)
        del previous
    assert outgoing is not None
    _to_seq_finish(outgoing[0], out, outgoing[1], plan)
    return out


def _backward(
    plan: _Plan,
    keep: list | None,
    inputs: tuple[torch.Tensor | None, ...],
    grad_out: torch.Tensor,
    needs: tuple[bool, ...],
) -> list[torch.Tensor | None]:
    """The gradients of `_forward`'s inputs, pipelined like the forward: step i+1's output
    gradient (and, with ``keep`` None, its q, k, v and gate again: recomputation) is in flight
    while step i's backward runs, step i's input gradients while step i+1's runs. Gradients
    sharded like q are written into one buffer each; a replicated gate's are summed into a
    zero one."""
    q, k, v, gate = inputs
    grads = [
        None
        if not need
        else (t.new_zeros(t.shape) if i == 3 and not plan.gate_seq else t.new_empty(t.shape))
        for i, (t, need) in enumerate(zip(inputs, needs, strict=True))
    ]
    wanted = [j for j in range(4) if needs[j]]
    exchanged = [j for j in wanted if j < 3 or plan.gate_seq]
    sent = [grad_out] if keep is not None else [grad_out, q, k, v] + [gate] * plan.gate_seq

    def start(unit):
        return [_to_heads_start(t, unit, plan) for t in sent]

    incoming = start(plan.units[0])
    outgoing: list = []
    for i, unit in enumerate(plan.units):
        grad_unit, *parts = [_to_heads_wait(p) for p in incoming]
        incoming = start(plan.units[i + 1]) if i + 1 < len(plan.units) else []
        if keep is not None:
            (parts, y), keep[i] = keep[i], None  # the step's graph goes with its backward
        else:
            parts, y = _step(plan, parts, gate, unit, needs)
        got = dict(
            zip(wanted, torch.autograd.grad(y, [parts[j] for j in wanted], grad_unit), strict=True)
        )
        del parts, y, grad_unit
        previous, outgoing = outgoing, [(j, _to_seq_start(got[j], plan), unit) for j in exchanged]
        if needs[3] and not plan.gate_seq:  # replicated gate: this step's part, summed
            _gate_unit(grads[3], unit, plan).add_(got[3])
        del got
        for j, pending, previous_unit in previous:
            _to_seq_finish(pending, grads[j], previous_unit, plan)
        del previous
    for j, pending, unit in outgoing:
        _to_seq_finish(pending, grads[j], unit, plan)
    return grads


class _UlyssesAttention(torch.autograd.Function):
    """`_forward` with autograd: each step's graph is kept for `_backward`, or, with
    ``plan.recompute``, only the inputs (this rank's shards, the caller's tensors) and
    `_backward` exchanges and runs each step again."""

    @staticmethod
    def forward(ctx, plan, q, k, v, gate):
        ctx.needs = tuple(ctx.needs_input_grad[1:5])
        ctx.plan = plan
        if plan.recompute:
            ctx.keep = None
            ctx.save_for_backward(q, k, v, gate)
            return _forward(plan, q, k, v, gate, needs=ctx.needs)
        ctx.keep = []
        ctx.inputs = tuple(None if t is None else t.detach() for t in (q, k, v, gate))
        return _forward(plan, q, k, v, gate, keep=ctx.keep, needs=ctx.needs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.plan.recompute:
            inputs = ctx.saved_tensors
        else:
            if ctx.keep is None:
                raise RuntimeError(
                    "sequence_parallel_video_sparse_attn: a second backward through the same "
                    "call (its steps' graphs went with the first; recompute=True keeps none)"
                )
            inputs = ctx.inputs
        keep, ctx.keep = ctx.keep, None
        grads = _backward(ctx.plan, keep, inputs, grad_out, ctx.needs)
        return (None, *grads)


def _resolve_backend(
    name: str,
    q: torch.Tensor,
    query_rows: int,
    tiling: VideoTiling,
    grad: bool,
    deterministic: bool = False,
    raster_inputs: bool = False,
) -> str:
    """The fine backend ``name`` (or what ``"auto"`` picks) for the op on this rank's whole
    sequence and heads (the rank's [B, S, H / W, D] call; `VSA_BACKEND` honoured; ValueError
    where it cannot run it). Each step runs it by name: a step's own smaller call could rank
    the backends differently (the choice may depend on the number of query rows)."""
    call = AttentionCall(
        q.device,
        q.dtype,
        q.shape[-1],
        (tiling.tile_tokens, tiling.tile_tokens),
        grad,
        1,
        not tiling.has_padding,
        query_rows=query_rows,
        query_len=tiling.padded_len,
        deterministic=deterministic,
        raster_inputs=raster_inputs,
    )
    return select_backend(call, name).name


def _check_head_chunk(
    head_chunk: object, heads_local: int, seq: int, dim: int, element_size: int
) -> int:
    """Heads per step: ``head_chunk`` checked, or the default (see the op's doc)."""
    if head_chunk is None:
        return max(1, min(heads_local, _STEP_BYTES // max(1, seq * dim * element_size)))
    message = (
        f"head_chunk must be an integer in [1, {heads_local}] (H / W) or None, got {head_chunk!r}"
    )
    try:
        number = as_int("head_chunk", head_chunk)
    except ValueError:
        raise ValueError(message) from None
    if not 1 <= number <= heads_local:
        raise ValueError(message)
    return number


# ---- the all-to-all, with autograd ----------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """The Ulysses exchange for several tensors at once, differentiable.

    ``to_heads``: [B, s, H, D_i] sequence shards -> [B, s * W, H / W, D_i]; otherwise the
    inverse. The backward of one direction is the exchange in the other.
    """

    @staticmethod
    def forward(ctx, group, world, to_heads, *tensors):
        ctx.group, ctx.world, ctx.to_heads = group, world, to_heads
        return tuple(_exchange(tensors, group, world, to_heads=to_heads))

    @staticmethod
    def backward(ctx, *grads):
        back = _exchange(grads, ctx.group, ctx.world, to_heads=not ctx.to_heads)
        return (None, None, None, *back)


def _exchange(
    tensors: tuple[torch.Tensor, ...] | list[torch.Tensor],
    group: ProcessGroup | None,
    world: int,
    *,
    to_heads: bool,
) -> list[torch.Tensor]:
    """One all-to-all per tensor (each [B, S, H, D_i]), all in flight at once.

    Each send buffer is [W, B, s, h, D_i] with chunk j going to rank j: packing it is a copy
    of the input (strided inputs, e.g. BHSD views, are fine), none when the input already lies
    that way (B = 1 and ``to_heads`` False). The received buffer is the output as it lies for
    B = 1 (a view); for B > 1 the output is one copy of it.
    """
    pending = []
    for t in tensors:
        batch, seq, heads, width = t.shape
        if to_heads:  # chunk j: heads j * H/W ... of every local token
            chunks = t.unflatten(2, (world, heads // world)).permute(2, 0, 1, 3, 4)
        else:  # chunk j: tokens j * S/W ... of the local heads
            chunks = t.unflatten(1, (world, seq // world)).permute(1, 0, 2, 3, 4)
        pending.append(_Pending(chunks.contiguous(), group))
    outputs = []
    for p in pending:
        recv = p.wait()  # [W (source rank), B, shard, h, width]
        world_, batch, shard, heads_chunk, width = recv.shape
        if to_heads:  # source ranks' token shards, in rank order
            out = recv.permute(1, 0, 2, 3, 4).reshape(batch, world_ * shard, heads_chunk, width)
        else:  # source ranks' heads, in rank order
            out = recv.permute(1, 2, 0, 3, 4).reshape(batch, shard, world_ * heads_chunk, width)
        outputs.append(out.contiguous())
    return outputs


# ---- checks ---------------------------------------------------------------------------------
def _rank_and_world(group: ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group "
            "on every rank first"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    return rank, dist.get_world_size(group)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiling: VideoTiling,
    topk: int,
    world: int,
    qkv_format: str,
    token_order: str = "tiled",
) -> tuple[int, int, int, int]:
    """Check a rank's shards; return (batch, local sequence length, heads, head_dim)."""
    batch, seq, kv_seq, heads, dim = check_qkv(q, k, v, qkv_format)
    if seq != kv_seq:
        raise ValueError(f"k must have q's sequence length {seq} (self-attention), got {kv_seq}")
    if not isinstance(tiling, VideoTiling):
        raise ValueError(
            f"tiling must be the VideoTiling of the whole latent, got {type(tiling).__name__}"
        )
    if heads % world:
        raise ValueError(
            f"the number of heads {heads} must be divisible by the world size {world} "
            "(each rank attends over heads / world heads of the whole sequence)"
        )
    total, _ = _sharded_sequence(tiling, world, token_order)
    expected = total // world
    if token_order == "raster" and seq != expected:
        raise ValueError(
            f"q must hold this rank's contiguous slice of the raster sequence "
            f"(token_order='raster'): tiling.seq_len / world = {total} / {world} = "
            f"{expected} tokens, got {seq}"
        )
    if seq != expected:
        raise ValueError(
            f"q must hold this rank's contiguous, tile-aligned slice of the tile-order sequence: "
            f"tiling.padded_len / world = {tiling.padded_len} / {world} = {expected} tokens "
            f"({tiling.num_tiles // world} tiles of {tiling.tile_tokens}), got {seq}"
            + ("" if seq % tiling.tile_tokens == 0 else " (not a multiple of the tile size)")
        )
    check_topk(topk, tiling.num_tiles)
    return batch, seq, heads, dim


def _check_dim(dim: object, x: torch.Tensor) -> int:
    """A dimension of ``x`` (negative counts from the end) as a Python int."""
    message = f"dim must be a dimension of x (shape {tuple(x.shape)}), got {dim!r}"
    try:
        number = as_int("dim", dim)
    except ValueError:
        raise ValueError(message) from None
    if not -x.dim() <= number < x.dim():
        raise ValueError(message)
    return number


def _check_token_order(token_order: object) -> TokenOrder:
    if token_order not in ("tiled", "raster"):
        raise ValueError(f"token_order must be 'tiled' or 'raster', got {token_order!r}")
    return token_order  # type: ignore[return-value]


def _sharded_sequence(tiling: VideoTiling, world: int, token_order: str) -> tuple[int, str]:
    """The sequence the shards slice, as (its length, its name in messages): the T*H*W raster
    tokens, or the padded tile order in whole tiles; ValueError where ``world`` does not split
    it so."""
    if token_order == "raster":
        if tiling.seq_len % world:
            raise ValueError(
                f"tiling.seq_len = {tiling.seq_len} (T*H*W) must be divisible by the world size "
                f"{world}: with token_order='raster' each rank holds a contiguous slice of the "
                "raster sequence"
            )
        return tiling.seq_len, "tiling.seq_len"
    if tiling.num_tiles % world:
        raise ValueError(
            f"tiling.num_tiles = {tiling.num_tiles} must be divisible by the world size {world}: "
            f"each rank holds a contiguous slice of whole tiles ({tiling.tile_tokens} tokens "
            "each) of the tile-order sequence"
        )
    return tiling.padded_len, "tiling.padded_len"


def _check_gate(
    gate: torch.Tensor | None, q: torch.Tensor, qkv_format: str, seq_local: int
) -> torch.Tensor | None:
    """The gate as a 4-D BSHD view broadcastable to the local q, or None."""
    gate = check_coarse_gate(
        gate,
        q,
        f"be sharded like q: broadcastable to q's local shape {tuple(q.shape)} "
        f"(sequence length {seq_local} = this rank's slice, or 1)",
    )
    if gate is None:
        return None
    gate = gate[(None,) * (4 - gate.dim())]
    return _as_bshd(gate, qkv_format)


def _check_4d(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 4-D BSHD tensor [B, S, H, D], got {shape}")


def _as_bshd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    return x if qkv_format == "bshd" else x.transpose(1, 2)

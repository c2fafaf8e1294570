"""Sequence-parallel VSA (`vsa_core.distributed`) on the CPU.

The main test launches two processes (gloo, a file rendezvous, the loopback interface) that run
`sp_worker.py` beside this file: each compares its shard of the output and of the q, k, v and
gate gradients with the single-process `video_sparse_attn` on the same full inputs (float64 to
1e-10, float32 to 2e-5). The input checks, and the world-size-1 path, run in this process with
the group's rank and size stubbed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vsa_core import VideoTiling, video_sparse_attn
from vsa_core import distributed as vd

WORKER = Path(__file__).resolve().parent / "sp_worker.py"
WORLD = 2
TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def _worker_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a two-core runner
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    return env


def run_ranks(worker: Path, args: list[str], world: int) -> str:
    """Start ``world`` gloo processes of ``worker`` (``args`` + ``--rank r --world-size W``),
    wait for them, and return their joined output; fails if any exits non-zero."""
    command = [sys.executable, str(worker), *args]
    procs = [
        subprocess.Popen(
            [*command, "--rank", str(rank), "--world-size", str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_worker_env(),
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                outputs.append(proc.communicate()[0])
    text = "\n".join(outputs)
    assert all(p.returncode == 0 for p in procs), text
    return text


def test_two_gloo_ranks_match_the_single_process_op(tmp_path):
    text = run_ranks(WORKER, ["--init-file", str(tmp_path / "rendezvous")], WORLD)
    for rank in range(WORLD):
        assert f"rank {rank}: OK" in text, text
        first = next(ln for ln in text.splitlines() if ln.startswith(f"rank {rank}: "))
        assert first == f"rank {rank}: gloo, world {WORLD}, cpu, backend reference", first
    assert "dgate" in text and "FAIL" not in text


@pytest.mark.parametrize(
    ("suite", "device", "want"),
    [
        ("cpu", None, ("cpu", "gloo")),
        ("gpu", None, ("cuda", "nccl")),  # issue 21, row 10: was ("gpu", "gloo")
        ("gpu", "cpu", ("cpu", "gloo")),
        ("cpu", "cuda", ("cuda", "nccl")),
    ],
)
def test_worker_runtime_follows_the_suite(suite, device, want):
    from sp_worker import choose_runtime

    assert choose_runtime(suite, device) == want


# ---- in-process: checks, with the group's rank and size stubbed ------------------------------
TILING = VideoTiling((5, 9, 10))  # 18 tiles of 64 tokens, partial ones included


@pytest.fixture
def world2(monkeypatch):
    monkeypatch.setattr(vd, "_rank_and_world", lambda group: (1, 2))


@pytest.fixture
def world1(monkeypatch):
    monkeypatch.setattr(vd, "_rank_and_world", lambda group: (0, 1))


def _qkv(seq, heads=4, dim=8, batch=1, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype) for _ in range(3)]


def test_needs_an_initialized_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q, k, v = _qkv(TILING.padded_len // 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=TILING)
    with pytest.raises(RuntimeError, match="init_process_group"):
        vd.shard_sequence(q)


def test_copy_to_tiles_false_needs_raster_order_and_a_backend_that_reads_it(world2):
    q, k, v = _qkv(TILING.padded_len // 2)
    with pytest.raises(ValueError, match="copy_to_tiles=False needs token_order='raster'"):
        vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=TILING, copy_to_tiles=False)
    q, k, v = _qkv(TILING.seq_len // 2)
    with pytest.raises(ValueError, match=r"reads tile-order tensors only.*copy_to_tiles=True"):
        vd.sequence_parallel_video_sparse_attn(
            q, k, v, topk=2, tiling=TILING, token_order="raster", copy_to_tiles=False,
            backend="reference",
        )  # fmt: skip


def test_heads_must_divide_by_the_world_size(world2):
    q, k, v = _qkv(TILING.padded_len // 2, heads=3)
    with pytest.raises(ValueError, match=r"number of heads 3 must be divisible by the world size"):
        vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=TILING)
    with pytest.raises(ValueError, match="heads divisible by the world size 2"):
        vd.seq_to_heads(q)


@pytest.mark.parametrize("seq", [TILING.padded_len // 2 - 32, TILING.padded_len // 2 - 64])
def test_the_split_must_be_tile_aligned(world2, seq):
    q, k, v = _qkv(seq)
    with pytest.raises(ValueError, match=r"tile-aligned slice.*1152 / 2 = 576 tokens") as exc:
        vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=TILING)
    assert ("not a multiple of the tile size" in str(exc.value)) == (seq % 64 != 0)


def test_the_tile_count_must_divide_by_the_world_size(world2):
    tiling = VideoTiling((4, 9, 10))  # 9 tiles
    q, k, v = _qkv(tiling.padded_len // 2 - 32)
    with pytest.raises(ValueError, match=r"num_tiles = 9 must be divisible by the world size 2"):
        vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=tiling)
    with pytest.raises(ValueError, match="num_tiles = 9"):
        vd.shard_sequence(torch.zeros(1, tiling.padded_len, 1, 1), tiling=tiling)


def test_the_gate_must_be_sharded_like_q(world2):
    seq = TILING.padded_len // 2
    q, k, v = _qkv(seq)
    unsharded = torch.ones(1, TILING.padded_len, 4, 8, dtype=torch.float64)
    for bad in (unsharded, torch.ones(3, 1, 1, dtype=torch.float64)):
        with pytest.raises(ValueError, match="coarse_gate must be sharded like q"):
            vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=TILING, coarse_gate=bad)
    with pytest.raises(ValueError, match="coarse_gate must have q's dtype"):
        vd.sequence_parallel_video_sparse_attn(
            q, k, v, topk=2, tiling=TILING, coarse_gate=torch.ones(1, seq, 4, 8)
        )


def test_other_input_checks(world2):
    seq = TILING.padded_len // 2
    q, k, v = _qkv(seq)
    op = vd.sequence_parallel_video_sparse_attn
    with pytest.raises(ValueError, match=r"topk must be an integer in \[1, 18\]"):
        op(q, k, v, topk=19, tiling=TILING)
    with pytest.raises(ValueError, match="tiling must be the VideoTiling of the whole latent"):
        op(q, k, v, topk=2, tiling=(5, 9, 10))
    with pytest.raises(ValueError, match="k must have q's sequence length"):
        op(q, k[:, :64], v[:, :64], topk=2, tiling=TILING)
    with pytest.raises(ValueError, match="scale"):
        op(q, k, v, topk=2, tiling=TILING, scale=-1.0)
    with pytest.raises(ValueError, match="qkv_format"):
        op(q, k, v, topk=2, tiling=TILING, qkv_format="sbhd")
    with pytest.raises(ValueError, match="sequence length divisible by the world size 2"):
        vd.heads_to_seq(q[:, :5])
    with pytest.raises(ValueError, match="4-D BSHD"):
        vd.seq_to_heads(q[0])


def test_shard_sequence_takes_this_ranks_slice(world2):
    x = torch.arange(2 * TILING.padded_len, dtype=torch.float64).view(2, -1, 1, 1)
    mine = vd.shard_sequence(x, tiling=TILING)
    assert torch.equal(mine, x[:, 576:])
    assert torch.equal(vd.shard_sequence(x.transpose(1, 2), dim=2), x[:, 576:].transpose(1, 2))
    with pytest.raises(ValueError, match=r"tiling\.padded_len = 1152"):
        vd.shard_sequence(x[:, :-2], tiling=TILING)
    with pytest.raises(ValueError, match="divisible by the world size 2"):
        vd.shard_sequence(x[:, :-1])
    with pytest.raises(ValueError, match="dim must be a dimension"):
        vd.shard_sequence(x, dim=4)


def test_raster_shards_are_slices_of_the_raster_sequence(world2):
    op = vd.sequence_parallel_video_sparse_attn
    half = TILING.seq_len // 2  # 225 of 450
    q, k, v = _qkv(half - 1)
    with pytest.raises(ValueError, match=r"raster sequence.*450 / 2 = 225 tokens, got 224"):
        op(q, k, v, topk=2, tiling=TILING, token_order="raster")
    odd = VideoTiling((5, 9, 9))  # 405 tokens
    q, k, v = _qkv(202)
    with pytest.raises(ValueError, match=r"seq_len = 405 \(T\*H\*W\) must be divisible"):
        op(q, k, v, topk=2, tiling=odd, token_order="raster")
    with pytest.raises(ValueError, match="token_order must be 'tiled' or 'raster'"):
        op(*_qkv(half), topk=2, tiling=TILING, token_order="raster_order")
    x = torch.arange(TILING.seq_len, dtype=torch.float64).view(1, -1, 1, 1)
    assert torch.equal(vd.shard_sequence(x, tiling=TILING, token_order="raster"), x[:, half:])
    with pytest.raises(ValueError, match=r"tiling\.seq_len = 450 tokens"):
        vd.shard_sequence(x[:, :-2], tiling=TILING, token_order="raster")
    with pytest.raises(ValueError, match=r"tiling\.padded_len = 1152"):
        vd.shard_sequence(x, tiling=TILING)  # raster tokens taken for tile order


def test_world_of_one_is_the_plain_op_in_raster_order(world1):
    q, k, v = _qkv(TILING.seq_len, batch=2)
    got = vd.sequence_parallel_video_sparse_attn(
        q, k, v, topk=3, tiling=TILING, backend="reference", token_order="raster"
    )
    want = video_sparse_attn(q, k, v, topk=3, tiling=TILING, backend="reference",
                             token_order="raster")  # fmt: skip
    assert torch.equal(got, want)


def test_world_of_one_is_the_plain_op(world1):
    q, k, v = _qkv(TILING.padded_len, batch=2)
    gate = torch.rand_like(q)
    want = video_sparse_attn(q, k, v, topk=4, tiling=TILING, coarse_gate=gate)
    got = vd.sequence_parallel_video_sparse_attn(q, k, v, topk=4, tiling=TILING, coarse_gate=gate)
    assert torch.equal(got, want)
    assert vd.seq_to_heads(q) is q and vd.heads_to_seq(q) is q
    assert torch.equal(vd.shard_sequence(q, tiling=TILING), q)
    assert torch.equal(vd.gather_sequence(q), q)


# ---- issue 21: numbers of any integer / float kind, degenerate sizes --------------------------
def test_numpy_and_0d_tensor_numbers_are_accepted(world1):
    q, k, v = _qkv(TILING.padded_len)
    want = video_sparse_attn(q, k, v, topk=4, tiling=TILING, scale=0.5)
    op = vd.sequence_parallel_video_sparse_attn
    for topk, scale in ((np.int64(4), np.float32(0.5)), (torch.tensor(4), torch.tensor(0.5))):
        assert torch.equal(op(q, k, v, topk=topk, tiling=TILING, scale=scale), want)
    assert torch.equal(vd.shard_sequence(q, dim=np.int64(1)), q)
    for bad in (1.0, True, torch.tensor(1.0)):
        with pytest.raises(ValueError, match="dim must be a dimension of x"):
            vd.shard_sequence(q, dim=bad)
    for bad in (4.0, True, np.float64(4)):
        with pytest.raises(ValueError, match=r"^topk must be an integer in \[1, 18\]"):
            op(q, k, v, topk=bad, tiling=TILING)


def test_empty_batch_gives_an_empty_shard_without_communicating(world2):
    # With the rank and size stubbed and no process group, any exchange would raise.
    q, k, v = (t.requires_grad_() for t in _qkv(TILING.padded_len // 2, batch=0))
    gate = torch.ones(1, 1, 4, 1, dtype=torch.float64, requires_grad=True)
    out = vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=TILING, coarse_gate=gate)
    assert out.shape == q.shape and out.dtype == q.dtype
    grads = torch.autograd.grad(out.sum(), (q, k, v, gate))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, gate.shape]


@pytest.mark.parametrize(
    ("shape", "message"),
    [((1, 576, 0, 8), "q must have at least one head"), ((1, 576, 4, 0), "q must have a head dim")],
)
def test_degenerate_sizes_raise_before_any_exchange(world2, shape, message):
    x = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"^{message}"):
        vd.sequence_parallel_video_sparse_attn(x, x, x, topk=2, tiling=TILING)


# ---- issue 22: the pipelined op -------------------------------------------------------------
@pytest.mark.parametrize("grad", [False, True])
def test_auto_is_decided_once_for_the_ranks_whole_call(world2, monkeypatch, grad):
    """The steps run the backend "auto" picks for [B, S, H / W, D] (a step's smaller call
    could rank backends differently: vsa-fa4's rule depends on the query rows)."""
    from vsa_core.backends import get_backend

    calls, plans = [], []

    def select(call, backend="auto"):
        calls.append((call, backend))
        return get_backend("reference")

    def forward(plan, q, k, v, gate, **_):
        plans.append(plan)
        return torch.zeros_like(q)

    monkeypatch.setattr(vd, "select_backend", select)
    monkeypatch.setattr(vd, "_forward", forward)
    q, k, v = (t.requires_grad_(grad) for t in _qkv(TILING.padded_len // 2, heads=8, batch=2))
    vd.sequence_parallel_video_sparse_attn(q, k, v, topk=2, tiling=TILING, recompute=True)
    [(call, backend)] = calls
    assert backend == "auto" and call.query_rows == 2 * TILING.padded_len * 4
    assert call.requires_grad == grad and call.block_shape == (64, 64)
    assert not call.kv_blocks_full  # TILING has partial tiles
    [plan] = plans
    assert plan.backend == "reference" and plan.recompute
    assert plan.units == ((0, 0, 4), (1, 0, 4))  # (batch row, first head, heads): 32 KB each


def test_default_steps_hold_32_mib_per_tensor():
    wan720p, wan480p = VideoTiling((21, 45, 80)), VideoTiling((21, 30, 52))
    assert vd._check_head_chunk(None, 20, wan720p.padded_len, 128, 2) == 1  # 22.5 MiB a head
    assert vd._check_head_chunk(None, 6, wan480p.padded_len, 128, 2) == 3  # 9.75 MiB a head
    assert vd._check_head_chunk(None, 2, 1024, 8, 8) == 2  # small: every local head at once
    assert vd._check_head_chunk(None, 4, 2**30, 128, 2) == 1  # at least one head
    assert vd._check_head_chunk(np.int64(3), 4, 1024, 8, 8) == 3

"""Experiment: which sm_90 backward tile configurations give a correct, fast KV64 backward?

Upstream FA4 4.0.0b36 runs its sm_90 backward for head_dim 128 with 128-row key tiles and
refuses 64-token key blocks. Its kernel class takes the tile shape, warpgroup layouts and
stages as arguments, so this script runs it (through upstream's ``_flash_attn_bwd``, with the
configuration function swapped in for the call) with 64x64 tiles under several warpgroup
layouts, checks dq/dk/dv against a float32 reference (including key blocks no query selects,
with NaN-poisoned outputs), and times the correct ones against dense FA4 backward and upstream's
128x128 block-sparse backward on the same token pairs. GPU only; results as JSON lines.

    python3 -m research.fa4_fork.experiments.kv64_bwd_configs --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import contextmanager

import torch

from research import harness
from vsa_core import BlockSparseLayout


def tile_config(stages: str, swap: bool, num_wg: int, n_dkv: int = 1) -> dict:
    """A 64x64 ``BwdConfig``: stages "Q,dO,PdS", S swapped or not, MMA warpgroups, and how the
    dK/dV MMA splits key rows over them (``AtomLayoutNdKV``)."""
    q, do, pds = (int(x) for x in stages.split(","))
    return dict(m_block_size=64, n_block_size=64, num_stages_Q=q, num_stages_dO=do,
                num_stages_PdS=pds, SdP_swapAB=swap, dKV_swapAB=False, dQ_swapAB=False,
                AtomLayoutMSdP=1, AtomLayoutNdKV=n_dkv, AtomLayoutMdQ=1, num_wg=num_wg)  # fmt: skip


CONFIGS = {
    # two MMA warpgroups, FA3's hdim-128 layout shrunk to 64 key rows (each WG: 32 key rows)
    "fa3like": tile_config("2,2,2", swap=True, num_wg=2, n_dkv=2),
    # two MMA warpgroups splitting N: S/dP by key columns, dK/dV/dQ by head-dim halves
    "split": tile_config("2,2,2", swap=False, num_wg=2),
    "split_s1": tile_config("1,1,1", swap=False, num_wg=2),
    # one MMA warpgroup owning the whole 64-row key tile (P^T and dS^T stay in registers)
    "one_wg": tile_config("2,2,2", swap=True, num_wg=1),
    "one_wg_s1": tile_config("1,1,1", swap=True, num_wg=1),
    # one MMA warpgroup, S unswapped: P and dS go through shared memory (the one shipped)
    "one_wg_noswap": tile_config("2,2,2", swap=False, num_wg=1),
    # stage variations of the fastest layout (smaller shared memory per CTA)
    "one_wg_noswap_pds1": tile_config("2,2,1", swap=False, num_wg=1),
    "one_wg_noswap_do1": tile_config("2,1,1", swap=False, num_wg=1),
    "one_wg_noswap_s1": tile_config("1,1,1", swap=False, num_wg=1),
}


def one_wg_class():
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    class OneWarpgroupRegisters(FlashAttentionBackwardSm90):
        # Upstream sizes registers for 2 or 3 MMA warpgroups only; with one MMA warpgroup
        # its 3-warpgroup split (160 each) spills. Give the lone MMA warpgroup 240.
        def _setup_attributes(self):
            if self.num_wg_mma == 1:
                self.num_mma_regs_wg0 = self.num_mma_regs_wg1 = self.num_mma_regs = 240
                self.num_producer_regs = 24
            super()._setup_attributes()

    return OneWarpgroupRegisters


@contextmanager
def config(name):
    import flash_attn.cute.interface as itf

    saved = itf._tile_size_bwd_sm90, itf.FlashAttentionBackwardSm90
    cfg = itf.BwdConfig(**CONFIGS[name])
    itf._tile_size_bwd_sm90 = lambda *a, **k: cfg
    itf.FlashAttentionBackwardSm90 = one_wg_class()
    try:
        yield
    finally:
        itf._tile_size_bwd_sm90, itf.FlashAttentionBackwardSm90 = saved


def fa4_tensors(layout, backward):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    if backward:
        indices, counts = layout.kv_to_q.to_padded()
    else:
        indices, counts = layout.kv_indices, layout.kv_counts
    counts = counts.to(torch.int32).contiguous()
    return BlockSparseTensorsTorch(
        mask_block_cnt=torch.zeros_like(counts),
        mask_block_idx=torch.zeros((*counts.shape, 1), dtype=torch.int32, device=counts.device),
        full_block_cnt=counts,
        full_block_idx=indices.to(torch.int32).contiguous(),
        block_size=tuple(layout.block_shape),
    )


def random_layout(seq, heads, shape, keep_frac, seed, empty_kv=(3,), narrow=False):
    """Each (query, key) block kept with probability ``keep_frac``; ``narrow`` keeps the lists
    only as wide as the longest row (the paired kernel needs lists narrower than num_kv)."""
    gen = torch.Generator().manual_seed(seed)
    nq, nkv = seq // shape[0], seq // shape[1]
    mask = torch.rand(1, heads, nq, nkv, generator=gen) < keep_frac
    for col in empty_kv:
        mask[..., col] = False  # key blocks no query selects: dk/dv must come out zero
    mask[..., 0, :] = False  # a query block with nothing selected (its dq must be zero)
    valid = torch.full((nkv,), shape[1], dtype=torch.int32)
    width = int(mask.sum(-1).max()) if narrow else None
    return BlockSparseLayout.from_block_mask(mask, valid, shape, width=width).to("cuda")


def exact256_layout(seq, heads, sparsity, seed):
    n = seq // 256
    keep = max(1, round((1 - sparsity) * n))
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, heads, n, n, generator=gen)
    scores[:, :, torch.arange(n), torch.arange(n)] = 2.0
    idx = torch.topk(scores, keep, dim=-1).indices
    valid = torch.full((n,), 256, dtype=torch.int32)
    return BlockSparseLayout.from_topk(idx, valid, (256, 256))


def reference(q, k, v, dout, layout, scale):
    blocks = layout.to_block_mask()  # [B, H, NQ, NKV]
    tok = blocks.repeat_interleave(layout.q_block, 2).repeat_interleave(layout.kv_block, 3)
    qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~tok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p @ vf
    out.backward(dout.float().transpose(1, 2))
    return out.transpose(1, 2), [t.grad.transpose(1, 2) for t in (qf, kf, vf)]


def rel_l2(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def timed(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_common():
    """The repository's ``benchmarks/bench_common`` module (through ``research.harness``)."""
    return harness.bench_common()


def start_log(out_dir, name):
    """``jsonl_emitter`` for ``out_dir/name.jsonl``, after writing the run's meta record
    (device, date, command, versions)."""
    bc = bench_common()
    emit = jsonl_emitter(os.path.join(out_dir, f"{name}.jsonl"))
    emit({"case": "meta", **bc.gpu_result_header(name),
          "command": harness.command_line(),
          "versions": bc.runtime_versions(bc.distribution_versions())})  # fmt: skip
    return emit


def check_forward(emit, label, q, ref_out, run):
    """Run ``run(out, lse)`` into NaN-poisoned outputs (``out`` like ``q``, ``lse`` [B, H, S]),
    emit its relative L2 error against ``ref_out`` under ``label``; True when every output is
    finite and the error <= 1e-2. An exception is emitted, not raised (False)."""
    bc = bench_common()
    try:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
        run(out, lse)
        torch.cuda.synchronize()
        err, finite = rel_l2(out, ref_out), bool(out.isfinite().all())
        emit({"case": "correct", **label, "out_rel_l2": err, "finite": finite})
        return finite and err <= 1e-2
    except Exception as exc:
        emit({"case": "correct", **label, "error": bc.error_text(exc, 800)})
        return False


def emit_interleaved_times(emit, arms, *, rounds, reps, pairs, shape, factor=1.0, **labels):
    """Time ``arms`` (``bench_common.time_interleaved``, one of them ``"dense"``) ``rounds``
    times and emit one record per arm and round: median ms, sparse-aware TFLOP/s (``pairs``
    selected token pairs per head; ``factor`` 2.5 for a backward) and the ratio to dense.
    ``shape`` is (seq, heads, head_dim)."""
    bc = bench_common()
    seq, heads, dim = shape
    for rnd in range(rounds):
        times = bc.time_interleaved(arms, torch.device("cuda"), warmup=3, reps=reps)
        dense_ms = statistics.median(times["dense"])
        for arm, ms_list in times.items():
            ms = statistics.median(ms_list)
            work = seq * seq if arm == "dense" else pairs
            emit({"case": "time", **labels, "round": rnd, "arm": arm, "ms": ms,
                  "tflops": factor * 4 * heads * dim * work / ms / 1e9,
                  "of_dense": dense_ms / ms * work / (seq * seq)})  # fmt: skip


def time_backwards_against_dense(emit, q, k, v, dout, scale, calls, layout, reps, **labels):
    """Interleaved timing (two rounds) of the backward ``calls`` (arm -> zero-argument callable)
    against dense FA4's backward on the same tensors (experiments 9 and 13). ``layout`` is the
    `vsa_core.BlockSparseLayout` the sparse arms run, for their sparse-aware FLOPs."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    _, seq, heads, dim = q.shape
    d_out, d_lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]
    timed = {"dense": (lambda _: _flash_attn_bwd(q, k, v, d_out, dout, d_lse,
                                                 softmax_scale=scale), None)}  # fmt: skip
    timed.update({arm: (lambda _, c=call: c(), None) for arm, call in calls.items()})
    pairs = float(layout.selected_token_pairs().sum()) / heads
    emit_interleaved_times(emit, timed, rounds=2, reps=reps, pairs=pairs,
                           shape=(seq, heads, dim), factor=2.5, seq=seq, **labels)  # fmt: skip


def one_length_parser(reps: int = 20, heads: bool = True) -> argparse.ArgumentParser:
    """The options every experiment timed at one sequence length takes: ``--out``, ``--seq``,
    ``--heads`` (unless the experiment sweeps heads itself) and ``--reps``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seq", type=int, default=32768)
    if heads:
        ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--reps", type=int, default=reps)
    return ap


def one_length_args() -> argparse.Namespace:
    """Command line of the experiments timed at one sequence length (3, 5 and 8)."""
    return one_length_parser().parse_args()


def add_sass_args(ap: argparse.ArgumentParser) -> None:
    """``--sass DIR``: compile the arms for sm_90a on the CPU and keep their cubins, no timing
    (`sass_in_processes`); ``--sass-arm`` is the one-arm process it starts."""
    ap.add_argument("--sass", metavar="DIR", help="compile on the CPU, keep cubins; no timing")
    ap.add_argument("--sass-arm", help=argparse.SUPPRESS)


def sass_in_processes(module: str, dump_dir: str, arms) -> int:
    """Run ``python -m module --sass DIR --sass-arm ARM`` from the repository root once per arm,
    each in a process of its own with the compile gate's environment and ``DIR/ARM`` as the
    dump folder (CuTe DSL takes its target and dump folder from the environment of the
    process); 1 at the first failure."""
    from flash_attn_vsa import compile_gate as gate

    for name in arms:
        arm_dir = os.path.join(dump_dir, name)
        os.makedirs(arm_dir, exist_ok=True)
        env = {**os.environ, **gate.gate_environment(dump_dir=arm_dir)}
        cmd = [sys.executable, "-m", module, "--sass", dump_dir, "--sass-arm", name]
        if subprocess.run(cmd, env=env, cwd=harness.ROOT).returncode:
            return 1
        print(f"{name}: compiled into {arm_dir}", flush=True)
    return 0


def jsonl_emitter(path):
    """A function that prints a record as one JSON line and appends it to ``path``."""

    def emit(rec):
        print(json.dumps(rec), flush=True)
        with open(path, "a") as log:
            log.write(json.dumps(rec) + "\n")

    return emit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    args = ap.parse_args()
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    emit = jsonl_emitter(os.path.join(args.out, "kv64_bwd_configs.jsonl"))

    torch.manual_seed(0)
    D, scale = 128, 128**-0.5
    # ---- correctness: S=2048, H=4, Q64/KV64, random ~30% kept, empty rows/columns
    S, H = 2048, 4
    q, k, v, dout = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    lay = random_layout(S, H, (64, 64), 0.3, seed=1)
    out, lse = _flash_attn_fwd(
        q, k, v, softmax_scale=scale, block_sparse_tensors=fa4_tensors(lay, False), return_lse=True
    )[:2]
    ref_out, (rdq, rdk, rdv) = reference(q, k, v, dout, lay, scale)
    emit({"case": "fwd64", "out_rel_l2": rel_l2(out, ref_out)})
    bwd_t = fa4_tensors(lay, True)
    good = []
    for name in args.configs:
        try:
            with config(name):
                grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                dq, dk, dv = _flash_attn_bwd(
                    q,
                    k,
                    v,
                    out,
                    dout,
                    lse,
                    softmax_scale=scale,
                    block_sparse_tensors=bwd_t,
                    dq=grads[0],
                    dk=grads[1],
                    dv=grads[2],
                )[:3]
                torch.cuda.synchronize()
            errs = {
                n: rel_l2(a, b) for n, a, b in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv))
            }
            finite = all(bool(t.isfinite().all()) for t in (dq, dk, dv))
            ok = finite and max(errs.values()) <= 1e-2
            emit({"case": "correct", "config": name, "finite": finite, **errs, "ok": ok})
            if ok:
                good.append(name)
        except Exception as exc:  # a config that fails to compile or launch
            emit({"case": "correct", "config": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
    # ---- timing: S=32768, H=12, 90% exact256 expanded to 64x64 and 128x128
    S, H = args.seq, args.heads
    q, k, v, dout = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    base = exact256_layout(S, H, 0.9, seed=2)
    pairs = float(base.selected_token_pairs().sum()) / H
    l64, l128 = base.refine((64, 64)).to("cuda"), base.refine((128, 128)).to("cuda")
    out, lse = _flash_attn_fwd(
        q, k, v, softmax_scale=scale, block_sparse_tensors=fa4_tensors(l128, False), return_lse=True
    )[:2]
    b64, b128 = fa4_tensors(l64, True), fa4_tensors(l128, True)
    arms = {
        "dense": (lambda: _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale), None),
        "upstream_q128_kv128": (
            lambda: _flash_attn_bwd(
                q, k, v, out, dout, lse, softmax_scale=scale, block_sparse_tensors=b128
            ),
            None,
        ),
    }
    for name in good:
        arms[name] = (
            lambda: _flash_attn_bwd(
                q, k, v, out, dout, lse, softmax_scale=scale, block_sparse_tensors=b64
            ),
            name,
        )
    results = {}
    for rnd in range(2):
        for arm, (fn, cfg) in arms.items():
            try:
                if cfg:
                    with config(cfg):
                        ms = timed(fn)
                else:
                    ms = timed(fn)
            except Exception as exc:
                emit({"case": "time", "arm": arm, "error": f"{type(exc).__name__}: {exc}"[:400]})
                continue
            flops = 4 * H * D * (S * S if arm == "dense" else pairs) * 2.5
            results.setdefault(arm, []).append(flops / ms / 1e9)
            emit({"case": "time", "round": rnd, "arm": arm, "ms": ms, "tflops": flops / ms / 1e9})
    dense = statistics.median(results.get("dense", [float("nan")]))
    for arm, vals in results.items():
        emit({"case": "summary", "arm": arm, "tflops": vals, "ratio_to_dense": max(vals) / dense})


if __name__ == "__main__":
    sys.exit(main())

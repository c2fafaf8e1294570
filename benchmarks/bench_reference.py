"""The correctness side of the benchmark scripts: float32 references, gates and tolerances.

- `masked_attention_reference`: float32 attention (and its gradients) under a block mask, by
  query-row chunks, written independently of vsa-core: the correctness gate's ground truth.
  `ieee_fp32_matmul`: full-precision float32 matmuls (no TF32) around a reference.
- `gate_check`: finite, and max abs error under max(1e-2, 8 x the input dtype's rounding floor
  (`rounding_floor`)), optionally on selected rows (a video latent's real tokens).
- `match_check`: an op against the same op computed another way (sequence parallel vs one
  device): vsa-core's sequence-parallel tolerances (max abs in float32 / float64, relative L2
  in bf16 / fp16).
- `GateResult`, `compare_tensors`: a gate's verdict per tensor and the comparison loop both
  checks share.

Imports only torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

GATE_ABS_FLOOR = 1e-2
GATE_ROUNDING_FACTOR = 8.0
MATCH_MAX_ABS = {torch.float64: 1e-10, torch.float32: 2e-5}
MATCH_REL_L2 = {"out": 1e-2, "grad": 2e-2}


@contextlib.contextmanager
def ieee_fp32_matmul():
    """Full-precision float32 matmuls (no TF32) for the duration of the block."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def masked_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    block_mask: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    kv_valid_sizes: torch.Tensor | None = None,
    dout: torch.Tensor | None = None,
    chunk_bytes: int = 1 << 30,
) -> dict[str, torch.Tensor]:
    """Float32 attention in which query block i sees key block j iff ``block_mask[b, h, i, j]``.

    q, k, v, dout: [B, S, H, D] (BSHD). ``block_mask`` [B, H, NQ, NKV] bool over blocks of
    ``block_shape`` (None: dense); key j of block n is real iff j < ``kv_valid_sizes[n]`` (None:
    all real). Rows that see no key get out = 0 and zero gradients. Returns float32 BSHD
    tensors: ``out``, and with ``dout`` also ``dq``, ``dk``, ``dv`` (explicit backward: P is
    recomputed per chunk from the log-sum-exp, dS = P * (dP - rowsum(dO * O))).
    """
    batch, q_len, heads, _ = q.shape
    kv_len = k.shape[1]
    device = q.device
    qf = q.detach().float().transpose(1, 2).contiguous()  # [B, H, Sq, D]
    kf = k.detach().float().transpose(1, 2).contiguous()
    vf = v.detach().float().transpose(1, 2).contiguous()

    key_real: torch.Tensor | None = None
    q_block = kv_block = 1
    if block_mask is not None or kv_valid_sizes is not None:
        if block_shape is None:
            raise ValueError("block_shape is needed with block_mask or kv_valid_sizes")
        q_block, kv_block = block_shape
    if kv_valid_sizes is not None:
        slot = torch.arange(kv_block, device=device)
        key_real = (slot < kv_valid_sizes.to(device).view(-1, 1)).reshape(-1)
        if bool(key_real.all()):
            key_real = None
    if block_mask is not None:
        block_mask = block_mask.to(device)
        if block_mask.shape[-1] * kv_block != kv_len or block_mask.shape[-2] * q_block != q_len:
            raise ValueError(
                f"block_mask {tuple(block_mask.shape)} with blocks {block_shape} does not cover "
                f"q_len={q_len}, kv_len={kv_len}"
            )

    def keep_of(r0: int, r1: int) -> torch.Tensor | None:
        if block_mask is None and key_real is None:
            return None
        keep = None
        if block_mask is not None:
            rows = torch.arange(r0, r1, device=device) // q_block
            keep = block_mask.index_select(2, rows).repeat_interleave(kv_block, dim=-1)
        if key_real is not None:
            keep = key_real.view(1, 1, 1, -1) if keep is None else keep & key_real
        return keep

    per_row = batch * heads * kv_len * 4 * (5 if dout is not None else 3)
    chunk = max(1, min(q_len, chunk_bytes // max(per_row, 1)))
    out = torch.empty_like(qf)
    lse = torch.empty(batch, heads, q_len, device=device, dtype=torch.float32)
    with ieee_fp32_matmul():
        for r0 in range(0, q_len, chunk):
            r1 = min(q_len, r0 + chunk)
            s = torch.matmul(qf[:, :, r0:r1], kf.transpose(-1, -2)).mul_(scale)
            keep = keep_of(r0, r1)
            if keep is not None:
                s.masked_fill_(~keep, float("-inf"))
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = s.sub_(m).exp_()
            denom = p.sum(dim=-1, keepdim=True)
            seen = denom > 0
            safe = torch.where(seen, denom, torch.ones_like(denom))
            out[:, :, r0:r1] = torch.where(seen, torch.matmul(p, vf) / safe, 0.0)
            lse[:, :, r0:r1] = torch.where(seen, m + torch.log(safe), float("-inf")).squeeze(-1)
            del s, p, keep
        result = {"out": out.transpose(1, 2)}
        if dout is None:
            return result
        dof = dout.detach().float().transpose(1, 2).contiguous()
        delta = (dof * out).sum(dim=-1)  # [B, H, Sq]
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        dq = torch.empty_like(qf)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for r0 in range(0, q_len, chunk):
            r1 = min(q_len, r0 + chunk)
            q_rows, do_rows = qf[:, :, r0:r1], dof[:, :, r0:r1]
            s = torch.matmul(q_rows, kf.transpose(-1, -2)).mul_(scale)
            keep = keep_of(r0, r1)
            if keep is not None:
                s.masked_fill_(~keep, float("-inf"))
            p = s.sub_(lse_safe[:, :, r0:r1].unsqueeze(-1)).exp_()
            dv += torch.matmul(p.transpose(-1, -2), do_rows)
            dp = torch.matmul(do_rows, vf.transpose(-1, -2))
            ds = p.mul_(dp.sub_(delta[:, :, r0:r1].unsqueeze(-1)))
            dq[:, :, r0:r1] = torch.matmul(ds, kf) * scale
            dk += torch.matmul(ds.transpose(-1, -2), q_rows) * scale
            del s, p, dp, ds, keep
    result.update(dq=dq.transpose(1, 2), dk=dk.transpose(1, 2), dv=dv.transpose(1, 2))
    return result


@dataclass
class GateResult:
    passed: bool
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, "tensors": self.tensors}

    def summary(self) -> str:
        parts = []
        for name, t in self.tensors.items():
            err = t["max_abs_err"]
            err_s = "non-finite" if err is None else f"{err:.2e}"
            parts.append(f"{name} {err_s}/{t['tol']:.1e}")
        return ", ".join(parts)


def rounding_floor(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs error of storing ``reference`` (float32) in ``dtype``: the error no kernel that
    returns ``dtype`` can beat."""
    ref = reference.float()
    return float((ref - ref.to(dtype).float()).abs().max()) if ref.numel() else 0.0


def gate_check(
    outputs: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    rows: torch.Tensor | None = None,
) -> GateResult:
    """Compare every output with its float32 reference (same BSHD shape).

    ``rows`` (optional) selects the sequence positions (dim 1) compared. Passes when every
    tensor is finite and its max abs error is at most max(1e-2, 8 x the rounding floor of
    ``dtype`` on the reference).
    """

    def judge(name: str, got: torch.Tensor, ref: torch.Tensor) -> tuple[dict[str, Any], str | None]:
        got32 = got.detach().float()
        finite = bool(torch.isfinite(got32).all())
        err = float((got32 - ref.float()).abs().max()) if finite and got32.numel() else None
        if finite and err is None:
            err = 0.0
        tol = max(GATE_ABS_FLOOR, GATE_ROUNDING_FACTOR * rounding_floor(ref, dtype))
        ok = finite and err is not None and err <= tol
        entry = {"max_abs_err": err, "tol": tol, "finite": finite, "passed": ok}
        if ok:
            return entry, None
        if not finite:
            return entry, "non-finite values"
        return entry, f"max abs err {err:.3e} > tol {tol:.3e}"

    return compare_tensors(
        outputs, reference, rows, judge, "the arm returned no tensors", mismatch_tol=GATE_ABS_FLOOR
    )


def compare_tensors(
    outputs: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    judge: Callable[[str, torch.Tensor, torch.Tensor], tuple[dict[str, Any], str | None]],
    empty_reason: str,
    *,
    mismatch_tol: float | None = None,
) -> GateResult:
    """Every output against its reference (``rows`` selects positions of dim 1): missing
    references and shape mismatches are failures, the rest is ``judge``'s call (its entry for
    the report, and why it failed or None). The reasons of all failures are joined."""
    gate = GateResult(passed=True)
    if not outputs:
        return GateResult(False, reason=empty_reason)
    for name, got in outputs.items():
        if name not in reference:
            return GateResult(False, gate.tensors, f"no reference for output {name!r}")
        ref = reference[name]
        if rows is not None:
            got, ref = got.index_select(1, rows), ref.index_select(1, rows)
        if tuple(got.shape) != tuple(ref.shape):
            entry = {"max_abs_err": None, "tol": mismatch_tol, "finite": False}
            why: str | None = f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
        else:
            entry, why = judge(name, got, ref)
        gate.tensors[name] = entry
        if why is not None:
            gate.passed = False
            gate.reason = f"{gate.reason}; {name}: {why}" if gate.reason else f"{name}: {why}"
    return gate


def match_check(
    outputs: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    rows: torch.Tensor | None = None,
) -> GateResult:
    """Compare an op's outputs with the same op's computed another way (sequence parallel vs
    one device), both in ``dtype`` (same BSHD shapes; ``rows`` selects positions of dim 1).

    The tolerances of vsa-core's sequence-parallel tests: float32 / float64, max abs error at
    most 2e-5 / 1e-10 x max(1, max |reference|); bf16 / fp16, relative L2 error at most 1e-2
    for ``out`` and 2e-2 for gradients. Every tensor must be finite.
    """

    def judge(name: str, got: torch.Tensor, ref: torch.Tensor) -> tuple[dict[str, Any], str | None]:
        got64, ref64 = got.detach().double(), ref.detach().double()
        finite = bool(torch.isfinite(got64).all())
        entry: dict[str, Any] = {"finite": finite, "max_abs_err": None, "rel_l2_err": None}
        if finite:
            diff = got64 - ref64
            entry["max_abs_err"] = float(diff.abs().max()) if diff.numel() else 0.0
            entry["rel_l2_err"] = float(diff.norm() / ref64.norm().clamp(min=1e-30))
        if dtype in MATCH_MAX_ABS:
            scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
            entry.update(criterion="max_abs_err", tol=MATCH_MAX_ABS[dtype] * scale)
        else:
            tol = MATCH_REL_L2["out" if name == "out" else "grad"]
            entry.update(criterion="rel_l2_err", tol=tol)
        err = entry[entry["criterion"]]
        entry["passed"] = ok = finite and err is not None and err <= entry["tol"]
        if ok:
            return entry, None
        if not finite:
            return entry, "non-finite values"
        return entry, f"{entry['criterion'].replace('_', ' ')} {err:.3e} > tol {entry['tol']:.3e}"

    return compare_tensors(outputs, reference, rows, judge, "no tensors to compare")

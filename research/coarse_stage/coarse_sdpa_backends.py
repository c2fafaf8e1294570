"""The coarse attention's SDPA backend: host and device time of each (research, GPU).

The host profile of one fa4 forward at Wan 2.1 480p (session 18, `research.op_host_profile`)
put ``scaled_dot_product_attention`` first by its own time: ~150 us of the op's ~1.1 ms, for
a 13 us kernel (cuDNN's, which PyTorch 2.11 prefers on sm_90). The coarse attention is small
(N = 624-2,160 pooled tiles a head), so which backend runs it matters to the host more than to
the device. For each latent and SDPA backend (PyTorch's default choice, flash, efficient,
cuDNN, math) this times, on the pooled shapes the op makes:

- ``host_us``: wall clock of one call right after a synchronize (no sync inside), median;
- ``fwd_us`` / ``fwd_bwd_us``: device time per call, back to back between CUDA events;
- ``max_abs`` against the float32 math result.

::

    PYTHONPATH=packages/vsa-core/src python3 -m research.coarse_stage.coarse_sdpa_backends
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

LATENTS = {"wan480p": (624, 12), "wan720p": (1440, 40), "hunyuan720p": (2160, 24)}
BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
    # what an op would write to prefer flash: all four enabled, flash first
    "flash_first": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
    "aten_flash": "aten_flash",  # ATen's flash op called directly: no backend selection
}  # fmt: skip


def _call(q, k, v, backend):
    scale = q.shape[-1] ** -0.5
    if backend == "aten_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[0]
    priority = isinstance(backend, list)
    with nullcontext() if backend is None else sdpa_kernel(backend, set_priority=priority):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)


def _device_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / calls * 1e3


def _host_us(fn, calls: int = 50) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rows = []
    for latent, (tiles, heads) in LATENTS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        # the op's pooled tensors: [B, N, H, D] bf16, handed to SDPA as [B, H, N, D] views
        q, k, v = (
            torch.randn(
                1, tiles, heads, 128, device="cuda", generator=gen, dtype=torch.bfloat16
            ).transpose(1, 2)
            for _ in range(3)
        )
        want = _call(q.float(), k.float(), v.float(), SDPBackend.MATH)
        for name, backend in BACKENDS.items():
            row = {"latent": latent, "tiles": tiles, "heads": heads, "backend": name}
            try:
                got = _call(q, k, v, backend)
            except RuntimeError as exc:
                rows.append({**row, "error": str(exc).splitlines()[0][:200]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            row["max_abs"] = (got.float() - want).abs().max().item()
            inputs = (q, k, v)
            row["host_us"] = _host_us(lambda b=backend, x=inputs: _call(*x, b))
            row["fwd_us"] = _device_us(lambda b=backend, x=inputs: _call(*x, b))
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def train(b=backend, leaves=leaves):
                _call(*leaves, b).sum().backward()

            try:
                row["fwd_bwd_us"] = _device_us(train)
                row["fwd_bwd_host_us"] = _host_us(train)
            except RuntimeError as exc:
                row["bwd_error"] = str(exc).splitlines()[0][:200]
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": date, "rows": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the whole op holds at its peak in inference, modelled on this CPU: every tensor it
allocates, by the operation that made it, with the device launches stubbed.

`bench_video.py` measures the op's peak memory beyond its inputs on a GPU
(``max_memory_allocated``): at Wan 2.1 720p on an H100 (session 33), 1,033 MiB against
dense FA4's 738 on the real tokens. That is 1.40x, against the issue's target of 1.1x. This
shows what makes up the difference. It runs the real op (vsa-core, the Triton coarse stage,
fa4's adapter down to the fork's launch replay) with every launch stubbed, as
`research.op_host_cpu` does, on CPU tensors of the latent's real size. A dispatch mode counts
each new storage's bytes, rounded up to 512 like CUDA's caching allocator, until the storage
is freed. It reports the peak, and what was alive at the peak, by the ATen operation that
allocated it and the innermost line of the project's packages that asked for it.

What it misses:
- memory upstream's compiled kernels would allocate themselves (none on these paths: they
  take their outputs);
- the allocator's 2 MiB rounding of large blocks' segments (``max_memory_allocated`` counts
  blocks, not segments).
::

    uv run python -m research.op_memory_cpu --latent 21 45 80 --heads 40   # Wan 2.1 720p
"""

from __future__ import annotations

import argparse
import traceback
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from research.op_host_cpu import stub_devices

MiB = 2**20
ROUND = 512
"""Bytes CUDA's caching allocator rounds every block up to."""


class LiveStorage(TorchDispatchMode):
    """Storages made while active: bytes alive now, the peak, and what was alive at it."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.alive: dict[int, tuple[int, str]] = {}
        self.now = self.peak = 0
        self.at_peak: dict[int, tuple[int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t, f"{func.__name__} at {_caller()}")
        return out

    def _see(self, t: torch.Tensor, made_by: str) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.known or key in self.alive:
            return
        size = -(-storage.nbytes() // ROUND) * ROUND
        self.alive[key] = (size, made_by)
        self.now += size
        weakref.finalize(storage, self._free, key)
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, dict(self.alive)

    def _free(self, key: int) -> None:
        size, _ = self.alive.pop(key, (0, ""))
        self.now -= size


PACKAGES = ("vsa_core", "vsa_triton", "vsa_fa4", "flash_attn_vsa")


def _caller() -> str:
    """The innermost frame in this project's packages: path from the package, line, function."""
    for frame in reversed(traceback.extract_stack()):
        parts = frame.filename.split("/")
        starts = [i for i, part in enumerate(parts) if part in PACKAGES]
        if starts:
            return f"{'/'.join(parts[starts[0] :])}:{frame.lineno} {frame.name}"
    return "elsewhere"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latent", type=int, nargs=3, default=(21, 45, 80))
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--backend", default="fa4")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                    help="float16 for --backend triton (its interpreter refuses bf16)")  # fmt: skip
    args = ap.parse_args()
    stub_devices()
    from vsa_core import VideoTiling, video_sparse_attn

    tiling = VideoTiling(tuple(args.latent), (4, 4, 4))
    topk = max(1, round(tiling.num_tiles * (1 - args.sparsity)))
    shape = (1, tiling.padded_len, args.heads, 128)
    q, k, v, gate = (torch.zeros(shape, dtype=getattr(torch, args.dtype)) for _ in range(4))

    def call():
        return video_sparse_attn(q, k, v, tiling=tiling, topk=topk, coarse_gate=gate,
                                 backend=args.backend, coarse_backend="triton")  # fmt: skip

    with torch.no_grad():
        call()  # the first call of a description is never replayed; the second records
        call()
        mode = LiveStorage([q, k, v, gate])
        with mode:
            out = call()
        del out
    real = tiling.seq_len * args.heads * 128 * q.element_size()
    print(f"latent {tuple(args.latent)}, {args.heads} heads, k={topk}/{tiling.num_tiles}, "
          f"{args.backend}: peak {mode.peak / MiB:.1f} MiB beyond the inputs; dense's output "
          f"on the real tokens {real / MiB:.1f} MiB ({mode.peak / real:.2f}x); the op's "
          f"tile-order output {q.nbytes / MiB:.1f} MiB")  # fmt: skip
    by_op: Counter[str] = Counter()
    for size, made_by in mode.at_peak.values():
        by_op[made_by] += size
    print("alive at the peak, by the operation that allocated it and where:")
    for made_by, size in by_op.most_common():
        print(f"  {size / MiB:9.1f} MiB  {made_by}")


if __name__ == "__main__":
    main()

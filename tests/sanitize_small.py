"""Forward + backward of every block shape a backend supports, on a small case, for
compute-sanitizer (not a pytest module)::

    compute-sanitizer --tool memcheck python3 tests/sanitize_small.py triton
    compute-sanitizer --tool memcheck python3 tests/sanitize_small.py fa4
    compute-sanitizer --tool racecheck python3 tests/sanitize_small.py fa4 128x64 --forward-only
    compute-sanitizer --tool racecheck python3 tests/sanitize_small.py fa4 64x64 --forward-only \
        --fa4-variant streams,qregs

Block shapes after the backend name limit the run to them; ``--forward-only`` skips the
backward (racecheck of one forward kernel in seconds instead of minutes); ``--fa4-variant``
runs the fork's experimental forwards (``vsa_fa4.launch.ForwardVariant``: ``streams``,
``qregs``, ``persistent``) where they fit.

Partial key blocks are included; a shape the backend refuses for training (its ``supports()``
reason is printed) runs forward only, and one it refuses outright is skipped.
"""

import dataclasses
import sys

import torch

from vsa_core import AttentionCall, BlockSparseLayout, block_sparse_attn
from vsa_core.backends import get_backend

args = sys.argv[1:]
forward_only = "--forward-only" in args
args = [a for a in args if a != "--forward-only"]
if "--fa4-variant" in args:
    at = args.index("--fa4-variant")
    options = args[at + 1].split(",")
    del args[at : at + 2]
    from vsa_fa4 import launch

    variant = launch.ForwardVariant.from_names(options)
backend_name = args[0] if args else "triton"
if "--fa4-variant" in sys.argv[1:] and backend_name == "fa4":
    from vsa_fa4.backend import variant_backend

    backend_name = variant_backend(variant)  # an fa4 backend carrying the variant
backend = get_backend(backend_name)
ALL_SHAPES = ((64, 64), (128, 64), (128, 128), (64, 128), (256, 256))
chosen = [tuple(int(n) for n in a.split("x")) for a in args[1:]]
if any(shape not in ALL_SHAPES for shape in chosen):
    raise ValueError(f"block shapes must be among {ALL_SHAPES} (as QxKV), got {args[1:]}")

for shape in chosen or ALL_SHAPES:
    gen = torch.Generator().manual_seed(0)
    n_q, n_kv = 1024 // shape[0], 1024 // shape[1]
    mask = torch.rand(1, 2, n_q, n_kv, generator=gen) < 0.4
    valid = torch.randint(0, shape[1] + 1, (n_kv,), generator=gen)
    layout = BlockSparseLayout.from_block_mask(mask, valid, shape).to("cuda")
    q, k, v = (
        torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    call = AttentionCall.describe(q, k, v, layout)
    train_refusal = "--forward-only given" if forward_only else backend.supports(call)
    infer_refusal = backend.supports(dataclasses.replace(call, requires_grad=False))
    if infer_refusal:
        print(shape, "skipped:", infer_refusal, flush=True)
        continue
    with torch.set_grad_enabled(train_refusal is None):
        out, lse = block_sparse_attn(q, k, v, layout, backend=backend_name)
        if train_refusal is None:
            out.sum().backward()
    torch.cuda.synchronize()
    status = "ok" if train_refusal is None else f"ok, forward only: {train_refusal}"
    print(shape, status, flush=True)

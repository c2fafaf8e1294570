"""Forward + backward of every block shape on a small case, for compute-sanitizer.

compute-sanitizer --tool memcheck python3 packages/vsa-triton/tests/sanitize_small.py
"""

import torch

from vsa_core import BlockSparseLayout, block_sparse_attn

for shape in ((64, 64), (128, 64), (128, 128), (64, 128)):
    gen = torch.Generator().manual_seed(0)
    n_q, n_kv = 1024 // shape[0], 1024 // shape[1]
    mask = torch.rand(1, 2, n_q, n_kv, generator=gen) < 0.4
    valid = torch.randint(0, shape[1] + 1, (n_kv,), generator=gen)
    layout = BlockSparseLayout.from_block_mask(mask, valid, shape).to("cuda")
    q, k, v = (
        torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    out, lse = block_sparse_attn(q, k, v, layout, backend="triton")
    out.sum().backward()
    torch.cuda.synchronize()
    print(shape, "ok", flush=True)

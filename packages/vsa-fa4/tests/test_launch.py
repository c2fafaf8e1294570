"""Which FA4 entry point `vsa_fa4.launch.run_forward` picks (the launches themselves run in
the compile gate and the GPU tests)."""

from __future__ import annotations

import pytest
import torch

from vsa_fa4 import launch
from vsa_fa4.metadata import SparseLists

pytest.importorskip("flash_attn.cute.interface")


def lists(width: int) -> SparseLists:
    idx = torch.zeros(1, 2, 4, width, dtype=torch.int32)
    cnt = torch.zeros(1, 2, 4, dtype=torch.int32)
    return SparseLists(cnt, idx, cnt, idx)


@pytest.mark.parametrize(
    "arch,block,head_dim,width,num_kv,pairs",
    [
        (90, (128, 64), 128, 5, 16, True),
        (90, (128, 64), 128, 15, 16, True),
        (90, (128, 64), 128, 16, 16, False),  # as wide as the key blocks: pair_lists' bound
        (90, (128, 64), 64, 5, 16, False),  # the kernel is written for head dim 128
        (90, (64, 64), 128, 5, 16, False),
        (90, (128, 128), 128, 5, 16, False),
        (100, (128, 64), 128, 5, 16, False),
    ],
)
def test_paired_keys_only_for_128x64_head_dim_128_on_sm90(
    monkeypatch, arch, block, head_dim, width, num_kv, pairs
):
    import flash_attn.cute.interface as interface

    monkeypatch.setattr(interface, "_get_device_arch", lambda: arch)
    q = torch.zeros(1, 512, 2, head_dim)
    valid = torch.full((num_kv,), 64, dtype=torch.int32)
    assert launch._pairs_keys(q, lists(width), valid, block) is pairs

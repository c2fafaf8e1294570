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


@pytest.mark.parametrize("q_in_registers", [False, True])
def test_forward_passes_the_q_in_registers_switch_to_both_fork_kernels(monkeypatch, q_in_registers):
    import flash_attn.cute.interface as interface

    from flash_attn_vsa import fwd_sm90, fwd_sm90_paired

    seen = []

    def record(name):
        def kernel(*args, **kwargs):
            seen.append((name, kwargs["q_in_registers"]))

        return kernel

    monkeypatch.setattr(launch, "FORWARD_Q_IN_REGISTERS", q_in_registers)
    monkeypatch.setattr(fwd_sm90, "block_sparse_forward_q64", record("two_ctas"))
    monkeypatch.setattr(fwd_sm90_paired, "block_sparse_forward_paired", record("paired"))
    monkeypatch.setattr(interface, "_get_device_arch", lambda: 90)
    q = torch.zeros(1, 512, 2, 128)
    valid = torch.full((16,), 64, dtype=torch.int32)
    for block in ((64, 64), (128, 64)):
        launch.run_forward(q, q, q, q, q, lists(5), valid, 0.1, block, masked=False)
    assert seen == [("two_ctas", q_in_registers), ("paired", q_in_registers)]

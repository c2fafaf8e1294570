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


@pytest.mark.parametrize("q_in_registers", [None, False, True])
@pytest.mark.parametrize("two_streams", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_forward_variant_routes_to_the_fork_kernels(
    monkeypatch, q_in_registers, two_streams, persistent
):
    import flash_attn.cute.interface as interface

    from flash_attn_vsa import fwd_sm90, fwd_sm90_paired
    from flash_attn_vsa.experimental import fwd_sm90_streams

    seen = []

    def record(name):
        def kernel(*args, **kwargs):
            assert kwargs["persistent"] is persistent
            seen.append((name, kwargs["q_in_registers"]))

        return kernel

    monkeypatch.setattr(fwd_sm90, "block_sparse_forward_q64", record("two_ctas"))
    monkeypatch.setattr(fwd_sm90_paired, "block_sparse_forward_paired", record("paired"))
    monkeypatch.setattr(fwd_sm90_streams, "block_sparse_forward_streams", record("streams"))
    monkeypatch.setattr(interface, "_get_device_arch", lambda: 90)
    q = torch.zeros(1, 512, 2, 128)
    valid = torch.full((16,), 64, dtype=torch.int32)
    variant = launch.ForwardVariant(q_in_registers, two_streams, persistent)
    with launch.forward_variant(variant):
        for block in ((64, 64), (128, 64)):
            launch.run_forward(q, q, q, q, q, lists(5), valid, 0.1, block, masked=False)
        odd = torch.zeros(1, 448, 2, 128)  # 7 query blocks: no pairs of streams
        launch.run_forward(odd, odd, odd, odd, odd, lists(5), valid[:7], 0.1, (64, 64))
    first = "streams" if two_streams else "two_ctas"

    def regs(kernel):  # None: Q in registers where the H200 measured it faster
        return kernel != "paired" if q_in_registers is None else q_in_registers

    want = [(first, regs(first)), ("paired", regs("paired")), ("two_ctas", regs("two_ctas"))]
    assert seen == want
    assert launch.current_forward_variant() == launch.SHIPPED_FORWARD
    with pytest.raises(ValueError, match="ForwardVariant"), launch.forward_variant("streams"):
        pass


def test_shipped_forward_keeps_q_in_registers_where_measured_faster_only():
    shipped = launch.SHIPPED_FORWARD
    assert not shipped.two_streams and not shipped.persistent
    options = {k: shipped.kernel_options(k) for k in ("two_ctas", "paired", "streams")}
    assert options == {
        "two_ctas": {"q_in_registers": True, "persistent": False},
        "paired": {"q_in_registers": False, "persistent": False},
        "streams": {"q_in_registers": True, "persistent": False},
    }
    forced = launch.ForwardVariant(q_in_registers=False).kernel_options("two_ctas")
    assert forced == {"q_in_registers": False, "persistent": False}

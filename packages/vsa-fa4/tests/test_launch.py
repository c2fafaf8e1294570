"""Which FA4 entry point `vsa_fa4.launch.run_forward` / `run_backward` pick, and with which
kernel arguments (the launches themselves run in the compile gate and the GPU tests). Which
kernels run is an argument (`launch.ForwardVariant`, a backward `TileConfig`,
`launch.KernelChoice`), never thread or global state: tested here by source and by two threads
asking for different kernels at once."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

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
        (90, (128, 64), 128, 1, 3, False),  # an odd number of key blocks cannot be paired
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


def _replace_entry_points(monkeypatch, record, kinds):
    """The fork's entry points of ``kinds`` replaced by ``record(kind)``, on an sm_90 device."""
    import flash_attn.cute.interface as interface

    from flash_attn_vsa import bwd_sm90, fwd_sm90, fwd_sm90_paired
    from flash_attn_vsa.experimental import fwd_sm90_streams

    entry_points = {
        "two_ctas": (fwd_sm90, "block_sparse_forward_q64"),
        "paired": (fwd_sm90_paired, "block_sparse_forward_paired"),
        "streams": (fwd_sm90_streams, "block_sparse_forward_streams"),
        "kv64": (bwd_sm90, "block_sparse_backward_kv64"),
    }
    for kind in kinds:
        monkeypatch.setattr(*entry_points[kind], record(kind))
    monkeypatch.setattr(interface, "_get_device_arch", lambda: 90)


@pytest.mark.parametrize("q_in_registers", [None, False, True])
@pytest.mark.parametrize("two_streams", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_forward_variant_routes_to_the_fork_kernels(
    monkeypatch, q_in_registers, two_streams, persistent
):

    seen = []

    def record(name):
        def kernel(*args, **kwargs):
            assert kwargs["persistent"] is persistent
            seen.append((name, kwargs["q_in_registers"]))

        return kernel

    _replace_entry_points(monkeypatch, record, ("two_ctas", "paired", "streams"))
    q = torch.zeros(1, 512, 2, 128)
    valid = torch.full((16,), 64, dtype=torch.int32)
    variant = launch.ForwardVariant(q_in_registers, two_streams, persistent)
    for block in ((64, 64), (128, 64)):
        launch.run_forward(q, q, q, q, q, lists(5), valid, 0.1, block, False, variant=variant)
    odd = torch.zeros(1, 448, 2, 128)  # 7 query blocks: no pairs of streams
    launch.run_forward(odd, odd, odd, odd, odd, lists(5), valid[:7], 0.1, (64, 64), variant=variant)
    first = "streams" if two_streams else "two_ctas"

    def regs(kernel):  # None: Q in registers where the H200 measured it faster
        return kernel != "paired" if q_in_registers is None else q_in_registers

    want = [(first, regs(first)), ("paired", regs("paired")), ("two_ctas", regs("two_ctas"))]
    assert seen == want
    with pytest.raises(ValueError, match="ForwardVariant"):
        launch.run_forward(q, q, q, q, q, lists(5), valid, 0.1, (64, 64), variant="streams")


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


def test_backward_hands_its_tile_config_to_the_fork(monkeypatch):
    from flash_attn_vsa import bwd_sm90
    from flash_attn_vsa.experimental.bwd_configs import EXPERIMENTAL_CONFIGS

    seen = []
    monkeypatch.setattr(
        bwd_sm90, "block_sparse_backward_kv64", lambda *a, **k: seen.append(k["config"])
    )
    q = torch.zeros(1, 512, 2, 128)
    valid = torch.full((8,), 64, dtype=torch.int32)
    staged = EXPERIMENTAL_CONFIGS["kv64-staged"]
    for config in (None, staged):
        launch.run_backward(q, q, q, q, q, q, q, q, q, lists(5), valid, 0.1, (64, 64),
                            config=config)  # fmt: skip
    assert seen == [None, staged]  # None: the fork's shipped configuration for the block
    assert launch.backward_ctas_per_sm((64, 64)) == bwd_sm90.KV64_CONFIG.ctas_per_sm == 2
    assert launch.backward_ctas_per_sm((64, 64), staged) == 1
    assert launch.backward_ctas_per_sm((128, 128), staged) == 1  # upstream's kernel
    with pytest.raises(ValueError, match="64-token key blocks only"):
        launch.run_backward(q, q, q, q, q, q, q, q, q, lists(5), valid, 0.1, (128, 128),
                            config=staged)  # fmt: skip


def test_upstream_routes_launch_through_the_replay(monkeypatch):
    """128-token key blocks run upstream's own kernels, through `launch_replay` (recorded and
    replayed like the fork's entry points' launches), outside any fork scope."""
    from flash_attn_vsa import launch_replay

    seen = []

    def record(direction):
        def launch(kernel, building, *args, **kwargs):
            seen.append((direction, kernel, building, kwargs["replay"], kwargs["mask_mod"]))

        return launch

    monkeypatch.setattr(launch_replay, "forward", record("fwd"))
    monkeypatch.setattr(launch_replay, "backward", record("bwd"))
    q = torch.zeros(1, 512, 2, 128)
    valid = torch.full((4,), 128, dtype=torch.int32)
    for masked in (True, False):
        launch.run_forward(q, q, q, q, q, lists(4), valid, 0.1, (128, 128), masked)
        launch.run_backward(q, q, q, q, q, q, q, q, q, lists(4), valid, 0.1, (128, 128), masked)
    kernel, scope = launch_replay.UPSTREAM_KERNELS, launch_replay.no_scope
    assert [s[:4] for s in seen] == [(d, kernel, scope, True) for d in ("fwd", "bwd")] * 2
    assert [s[4] is None for s in seen] == [False, False, True, True]  # mask_mod when masked


def test_kernel_choice_round_trips_through_its_string():
    from flash_attn_vsa.experimental.bwd_configs import ABLATIONS, EXPERIMENTAL_CONFIGS

    assert launch.SHIPPED.encode() == "" and launch.KernelChoice.decode("") is launch.SHIPPED
    choices = [
        launch.KernelChoice(launch.ForwardVariant(q_in_registers=False)),
        launch.KernelChoice(launch.ForwardVariant(two_streams=True, persistent=True)),
        launch.KernelChoice(backward=EXPERIMENTAL_CONFIGS["kv64-dq-1part-2buffers"]),
        launch.KernelChoice(launch.ForwardVariant(True), ABLATIONS["kv64-no-dq"]),
        launch.KernelChoice(launch.ForwardVariant(valid_in_list=False)),
        launch.KernelChoice(backward=EXPERIMENTAL_CONFIGS["kv64-ds"]),
        launch.KernelChoice(backward=EXPERIMENTAL_CONFIGS["kv64-ds"], ds_budget_bytes=1 << 34),
        launch.KernelChoice(ds_budget_bytes=1 << 32),  # the default backward's budget
    ]
    keys = [c.encode() for c in choices]
    assert len(set(keys)) == len(keys) and "" not in keys
    assert [launch.KernelChoice.decode(k) for k in keys] == choices
    with pytest.raises(ValueError, match="ForwardVariant"):
        launch.KernelChoice("streams")
    with pytest.raises(ValueError, match="TileConfig"):
        launch.KernelChoice(backward="kv64-staged")
    for budget in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="ds_budget_bytes must be a positive int"):
            launch.KernelChoice(backward=EXPERIMENTAL_CONFIGS["kv64-ds"], ds_budget_bytes=budget)
    with pytest.raises(ValueError, match="ds_budget_bytes needs a backward that writes dS"):
        launch.KernelChoice(backward=EXPERIMENTAL_CONFIGS["kv64-dq-1part-2buffers"],
                            ds_budget_bytes=1 << 30)  # fmt: skip


def test_the_default_backward_of_64x64_blocks_writes_ds():
    from flash_attn_vsa import bwd_sm90

    assert launch.SHIPPED.backward_for((64, 64)) is bwd_sm90.KV64_DS_CONFIG
    assert launch.SHIPPED.backward_for((128, 64)) is None  # the fork's config_for decides
    assert launch.SHIPPED.backward_for((128, 128)) is None  # upstream's kernel
    chosen = launch.KernelChoice(backward=bwd_sm90.KV64_CONFIG)
    assert chosen.backward_for((64, 64)) is bwd_sm90.KV64_CONFIG


def test_forward_variant_labels_read_back_as_the_variant():
    variants = [
        launch.SHIPPED_FORWARD,
        launch.ForwardVariant(q_in_registers=False),
        launch.ForwardVariant(valid_in_list=False),
        launch.ForwardVariant(q_in_registers=False, valid_in_list=False, persistent=True),
        launch.ForwardVariant(q_in_registers=True, two_streams=True),
    ]
    labels = [v.label for v in variants]
    assert labels[:3] == ["shipped", "no-qregs", "no-valid-in-list"]
    assert len(set(labels)) == len(labels)
    assert [launch.ForwardVariant.from_names(lab.split("+")) for lab in labels[1:]] == variants[1:]
    with pytest.raises(ValueError, match="no-valid-in-list"):
        launch.ForwardVariant.from_names(["no-streams"])


def test_two_threads_run_their_own_explicit_kernels_at_once(monkeypatch):
    """Two threads, two different choices, in flight together: each call's fork entry point
    gets its own caller's arguments (a thread-local or global selector would mix them up)."""

    from flash_attn_vsa.experimental.bwd_configs import EXPERIMENTAL_CONFIGS

    barrier = threading.Barrier(2)
    seen = {}

    def record(kind):
        def kernel(*args, **kwargs):
            barrier.wait(timeout=30)
            options = {
                k: kwargs[k] for k in ("q_in_registers", "persistent", "config") if k in kwargs
            }
            seen.setdefault(threading.current_thread().name, []).append((kind, options))
            barrier.wait(timeout=30)

        return kernel

    _replace_entry_points(monkeypatch, record, ("two_ctas", "streams", "kv64"))
    q = torch.zeros(1, 512, 2, 128)
    valid = torch.full((8,), 64, dtype=torch.int32)
    staged = EXPERIMENTAL_CONFIGS["kv64-staged"]
    choices = {
        "shipped": launch.SHIPPED,
        "experimental": launch.KernelChoice(
            launch.ForwardVariant(two_streams=True, persistent=3), staged
        ),
    }

    def call(choice):
        launch.run_forward(q, q, q, q, q, lists(5), valid, 0.1, (64, 64), variant=choice.forward)
        launch.run_backward(q, q, q, q, q, q, q, q, q, lists(5), valid, 0.1, (64, 64),
                            config=choice.backward)  # fmt: skip

    threads = [threading.Thread(target=call, args=(c,), name=n) for n, c in choices.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {
        "shipped": [("two_ctas", {"q_in_registers": True, "persistent": False}),
                    ("kv64", {"config": None})],
        "experimental": [("streams", {"q_in_registers": True, "persistent": 3}),
                         ("kv64", {"config": staged})],
    }  # fmt: skip


ADAPTER = Path(launch.__file__).parent


@pytest.mark.parametrize("module", ["launch.py", "ops.py", "backend.py"])
def test_no_thread_local_or_global_kernel_selector_comes_back(module):
    """Which kernels run is passed down as arguments: vsa-fa4's launch path has no
    ``threading`` state and no scope a caller enters to pick kernels (issue 23)."""
    source = (ADAPTER / module).read_text()
    tree = ast.parse(source)
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert "threading" not in imported and "contextvars" not in imported
    assert "threading.local" not in source and "ContextVar" not in source
    for gone in ("forward_variant", "current_forward_variant", "configs_scope"):
        assert not hasattr(launch, gone)
        assert f"{gone}(" not in source


def test_valid_sizes_ride_in_the_lists_of_the_two_cta_64x64_forward_only():
    q = torch.empty(1, 128, 2, 128)
    valid = torch.full((2,), 64, dtype=torch.int32)
    takes = launch.takes_valid_in_list
    assert takes(q, valid, (64, 64))
    assert not takes(q, valid, (64, 64), launch.ForwardVariant(valid_in_list=False))
    assert not takes(q, valid, (128, 128)) and not takes(q, valid, (128, 64))
    too_many = torch.full(((1 << 16) + 1,), 64, dtype=torch.int32)  # ids past 16 bits
    assert not takes(q, too_many, (64, 64))

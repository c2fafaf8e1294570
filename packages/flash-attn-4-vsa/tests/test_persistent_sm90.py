"""Persistent tiles (`flash_attn_vsa.experimental.persistent_sm90`, delta 7) on the CPU: the
scheduler upstream's forward sees, the O tile staged in its own buffer, and the kernels' scope;
their GPU correctness runs in each forward's GPU test (``sm90_cases.PERSISTENT``: 5 CTAs walking
many tiles)."""

from __future__ import annotations

import threading

import pytest

from flash_attn_vsa import build_scope, fwd_sm90, upstream_version

needs_upstream = pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")


def persistent():
    from flash_attn_vsa.experimental import persistent_sm90

    return persistent_sm90


@needs_upstream
def test_upstream_sees_our_scheduler_only_while_building_a_persistent_kernel_on_its_thread():
    import flash_attn.cute.flash_fwd_sm90 as fwd_module
    from flash_attn.cute.tile_scheduler import SingleTileScheduler, StaticPersistentTileScheduler

    persistent().install()
    seen = {}
    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, persistent=7)):
        inside = fwd_module.SingleTileScheduler.get_grid_shape
        other = threading.Thread(
            target=lambda: seen.update(grid=fwd_module.SingleTileScheduler.get_grid_shape)
        )
        other.start()
        other.join()
    assert inside is persistent().scheduler_class(7).get_grid_shape
    assert issubclass(persistent().scheduler_class(7), StaticPersistentTileScheduler)
    assert seen["grid"] is SingleTileScheduler.get_grid_shape
    assert fwd_module.SingleTileScheduler.create is SingleTileScheduler.create
    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS)):  # not persistent
        assert fwd_module.SingleTileScheduler.get_grid_shape is SingleTileScheduler.get_grid_shape


@needs_upstream
def test_the_o_tile_comes_from_its_own_buffer_and_everything_else_passes_through():
    class Buffer:
        def __init__(self, name):
            self.name, self.base = name, f"{name}-base"

        def get_tensor(self, layout, swizzle=None, dtype=None):
            return (self.name, layout, swizzle, dtype)

    class Storage:
        sQ, sO, sK = Buffer("sQ"), Buffer("sO"), Buffer("sK")  # upstream's field names
        mbar_ptr_Q = "barriers"

    view = persistent()._StorageView(Storage())
    # upstream's kernel: Q's tile without a dtype, its O staging tile with one
    assert view.sQ.get_tensor("LQ", swizzle="SQ") == ("sQ", "LQ", "SQ", None)
    assert view.sQ.get_tensor("LO", swizzle="SO", dtype="bf16") == ("sO", "LO", "SO", "bf16")
    assert view.sK.get_tensor("LK") == ("sK", "LK", None, None)
    assert view.mbar_ptr_Q == "barriers" and view.sQ.base == "sQ-base"


def test_forward_kernels_store_their_persistent_ctas():
    two_ctas = fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, persistent=True)
    assert two_ctas.persistent == fwd_sm90.sm_count() * fwd_sm90.CTAS_PER_SM
    paired = fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS, persistent=True)
    assert paired == fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS, persistent=fwd_sm90.sm_count())
    assert fwd_sm90.ForwardKernel(fwd_sm90.TWO_STREAMS, persistent=5).persistent == 5
    assert fwd_sm90.ForwardKernel(fwd_sm90.TWO_STREAMS).persistent == 0
    for bad in (-1, 2.5, "yes"):
        with pytest.raises(ValueError, match="persistent must be"):
            fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, persistent=bad)


@needs_upstream
def test_building_a_persistent_kernel_builds_the_persistent_class():
    from flash_attn_vsa.experimental import fwd_sm90_streams

    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_STREAMS, persistent=5)):
        assert build_scope.current("fwd").persistent == 5
        cls = fwd_sm90._current_kernel_class()
    assert build_scope.current("fwd") is None
    assert cls is fwd_sm90_streams.kernel_class(persistent=5)
    assert cls.__name__ == "FlashAttentionForwardSm90TwoStreamsPersistent"
    assert issubclass(cls, fwd_sm90_streams.kernel_class())
    both = fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, q_in_registers=True, persistent=3)
    assert both.kernel_class().__name__ == "FlashAttentionForwardSm90TwoCtasQInRegistersPersistent"

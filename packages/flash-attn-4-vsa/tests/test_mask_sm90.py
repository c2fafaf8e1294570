"""The partial-key-block mask (delta 3): the mask_mod's construction, the install, and which
calls take the column-limit path (its kernel code runs only on a GPU: the sm_90 GPU tests check
partial blocks against the reference; the compile gates compile it for sm_90a)."""

from __future__ import annotations

import pytest

from flash_attn_vsa import mask_sm90, upstream_version

pytestmark = pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")


def test_one_mask_mod_per_key_tile_and_only_powers_of_two():
    assert mask_sm90.valid_size_mask_mod(64) is mask_sm90.valid_size_mask_mod(64)
    assert mask_sm90.valid_size_mask_mod(64) is not mask_sm90.valid_size_mask_mod(128)
    for bad in (0, 48, 96, -64, True, 64.0):
        with pytest.raises(ValueError, match="kv_tile must be a power of two"):
            mask_sm90.valid_size_mask_mod(bad)


def test_mask_mod_carries_its_tile_and_a_hash_naming_this_delta():
    from flash_attn.cute.utils import hash_callable

    mod = mask_sm90.valid_size_mask_mod(64)
    assert getattr(mod, mask_sm90.KV_TILE_ATTR) == 64
    assert hash_callable(mod) != hash_callable(mask_sm90.valid_size_mask_mod(128))
    assert "mask_sm90" in hash_callable(mod)


def test_install_makes_upstream_sm90_kernels_build_the_subclass():
    import flash_attn.cute.flash_bwd_sm90 as bwd_module
    import flash_attn.cute.flash_fwd_sm90 as fwd_module
    from flash_attn.cute.mask import AttentionMask

    mask_sm90.valid_size_mask_mod(64)  # installs
    # what the kernels build outside any fork scope (the forward's global may be the paired
    # delta's thread-scoped wrapper, which builds this same class there)
    for module in (fwd_module, bwd_module):
        assert issubclass(module.AttentionMask, mask_sm90.mask_class())
        assert type(module.AttentionMask(64, 64, None)) is mask_sm90.mask_class()
    assert issubclass(mask_sm90.mask_class(), AttentionMask)
    mask_sm90.install()  # idempotent
    assert type(fwd_module.AttentionMask(64, 64, None)) is mask_sm90.mask_class()


@pytest.fixture
def routed(monkeypatch):
    """apply_mask with both implementations replaced by recorders: (make_mask, calls)."""
    from flash_attn.cute.mask import AttentionMask
    from flash_attn.cute.utils import AuxData

    cls = mask_sm90.mask_class()
    calls: list[tuple] = []
    monkeypatch.setattr(
        cls, "keep_valid_columns", lambda self, *args: calls.append(("column", args[-2:]))
    )
    monkeypatch.setattr(AttentionMask, "apply_mask", lambda self, *args: calls.append(("mod",)))

    def call(tile_n=64, mask_mod=None, causal=False, local=False, packgqa=1):
        mask = cls(128, tile_n, None, qhead_per_kvhead_packgqa=packgqa)
        aux = AuxData(tensors=["valid sizes"])
        mask.apply_mask("acc", 0, 0, 0, 3, "thr", True, causal, local, mask_mod, aux)
        return calls.pop()

    return call


def test_only_our_mask_mod_on_key_tiles_within_one_block_takes_the_column_limit(routed):
    ours64, ours128 = (mask_sm90.valid_size_mask_mod(t) for t in (64, 128))
    assert routed(tile_n=64, mask_mod=ours64) == ("column", ("valid sizes", 6))
    assert routed(tile_n=64, mask_mod=ours128) == ("column", ("valid sizes", 7))
    assert routed(tile_n=128, mask_mod=ours128) == ("column", ("valid sizes", 7))
    # a 128-column tile spans two 64-token blocks: no single limit, upstream's per-element path
    assert routed(tile_n=128, mask_mod=ours64) == ("mod",)
    assert routed(mask_mod=None) == ("mod",)
    assert routed(mask_mod=lambda *args: True) == ("mod",)
    assert routed(mask_mod=ours64, causal=True) == ("mod",)
    assert routed(mask_mod=ours64, local=True) == ("mod",)
    assert routed(mask_mod=ours64, packgqa=2) == ("mod",)

"""The partial-key-block mask_mod's construction (its kernel code runs only on a GPU: the
GPU tests check it against the reference on partial blocks)."""

from __future__ import annotations

import pytest

from flash_attn_vsa import upstream_version

pytestmark = pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")


def test_one_mask_mod_per_key_tile_and_only_powers_of_two():
    from vsa_fa4._mask import valid_size_mask_mod

    assert valid_size_mask_mod(64) is valid_size_mask_mod(64)  # FA4 caches kernels by it
    assert valid_size_mask_mod(64) is not valid_size_mask_mod(128)
    for bad in (0, 48, 96):
        with pytest.raises(ValueError, match="kv_tile must be a power of two"):
            valid_size_mask_mod(bad)

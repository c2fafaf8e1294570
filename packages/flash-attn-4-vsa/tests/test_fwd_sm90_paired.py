"""The paired-key forward (`flash_attn_vsa.fwd_sm90_paired`).

CPU: `pair_lists` (every listed block exactly once, in the right list, odd tails, widths and
refusals), the mask class's dispatch, and the thread-scoped install. GPU (sm_90): 128-row
query blocks over full, partial and empty key blocks with 0..5 (odd and even) blocks per query
block against the float32 reference, NaN-poisoned outputs fully written.
"""

from __future__ import annotations

import threading

import pytest
import sm90_cases as cases
import torch

from flash_attn_vsa import build_scope, fwd_sm90, upstream_version

needs_upstream = pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")
I32 = torch.int32


def paired():
    from flash_attn_vsa import fwd_sm90_paired

    return fwd_sm90_paired


def unpack(entries, count):
    """[(a, b)] of the first ``count`` packed entries (b None for NO_BLOCK)."""
    out = []
    for value in entries[:count].tolist():
        a, b = value & 0xFFFF, value >> 16
        out.append((a, None if b == paired().NO_BLOCK else b))
    return out


def random_split_lists(seed, rows, num_kv, width):
    """Full and partial 64-token lists as forward_lists gives them: distinct blocks, each
    class at the front of its row in list order, zeros after."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.zeros(rows, width, dtype=I32)
    part = torch.zeros(rows, width, dtype=I32)
    n_full = torch.zeros(rows, dtype=I32)
    n_part = torch.zeros(rows, dtype=I32)
    for r in range(rows):
        size = int(torch.randint(0, width + 1, (1,), generator=gen))
        chosen = torch.randperm(num_kv, generator=gen)[:size]
        is_full = torch.rand(len(chosen), generator=gen) < 0.6
        f, p = chosen[is_full].sort().values, chosen[~is_full].sort().values
        full[r, : len(f)], part[r, : len(p)] = f.to(I32), p.to(I32)
        n_full[r], n_part[r] = len(f), len(p)
    return full, n_full, part, n_part


@needs_upstream
@pytest.mark.parametrize("seed,rows,num_kv,width", [(0, 40, 24, 9), (1, 30, 10, 9), (2, 5, 8, 1),
                                                    (3, 7, 200, 64), (4, 3, 6, 0)])  # fmt: skip
def test_pair_lists_list_every_block_once_in_the_right_list(seed, rows, num_kv, width):
    full, n_full, part, n_part = random_split_lists(seed, rows, num_kv, width)
    mask_cnt, mask_idx, full_cnt, full_idx = paired().pair_lists(full, n_full, part, n_part,
                                                                 num_kv)  # fmt: skip
    tiles = num_kv // 2
    assert mask_idx.shape[-1] <= tiles and full_idx.shape[-1] <= tiles
    assert all(t.dtype == I32 for t in (mask_cnt, mask_idx, full_cnt, full_idx))
    for r in range(rows):
        full_pairs = unpack(full_idx[r], int(full_cnt[r]))
        mask_pairs = unpack(mask_idx[r], int(mask_cnt[r]))
        assert all(b is not None for _, b in full_pairs)  # full list: two full blocks each
        want_full = full[r, : n_full[r]].tolist()
        want_part = part[r, : n_part[r]].tolist()
        got_full = [x for pair in full_pairs for x in pair]
        # the mask list: partial pairs (a tail last), then the full class's odd tail
        tails = [(a, b) for a, b in mask_pairs if b is None]
        assert len(tails) == n_part[r] % 2 + n_full[r] % 2
        got_part = [x for pair in mask_pairs for x in pair if x is not None]
        if n_full[r] % 2:
            got_full.append(got_part.pop())
        assert got_full == want_full and got_part == want_part
        assert int(full_cnt[r]) == n_full[r] // 2
        assert not full_idx[r, full_cnt[r] :].any() and not mask_idx[r, mask_cnt[r] :].any()


@needs_upstream
def test_pair_lists_refuse_what_cannot_pair():
    full, n_full, part, n_part = random_split_lists(0, 2, 8, 4)
    with pytest.raises(ValueError, match="num_kv must be even"):
        paired().pair_lists(full, n_full, part, n_part, 9)
    with pytest.raises(ValueError, match="num_kv must be even"):
        paired().pair_lists(full, n_full, part, n_part, paired().MAX_KEY_BLOCKS + 1)
    with pytest.raises(ValueError, match="narrower than num_kv=4"):
        paired().pair_lists(full, n_full, part, n_part, 4)


@needs_upstream
@pytest.mark.parametrize(
    "module,mask_mod,tile_n",
    [
        ("fwd_sm90_paired", "pair_mask_mod", 128),
        ("experimental.fwd_sm90_streams", "stream_mask_mod", 64),
    ],
)
def test_packed_entry_masks_apply_only_their_mask_and_skip_the_seqlen_mask(
    monkeypatch, module, mask_mod, tile_n
):
    import importlib

    from flash_attn.cute.mask import AttentionMask
    from flash_attn.cute.utils import AuxData

    kernel = importlib.import_module(f"flash_attn_vsa.{module}")
    own_mask_mod = getattr(kernel, mask_mod)()
    cls = kernel.mask_class()
    calls = []
    monkeypatch.setattr(cls, "keep_columns", lambda self, *args: calls.append(args[-1]))
    monkeypatch.setattr(AttentionMask, "apply_mask", lambda *args: calls.append("upstream"))
    mask = cls(128, tile_n, None)
    aux = AuxData(tensors=["valid sizes"])

    def apply(mask_mod, causal=False):
        return mask.apply_mask("acc", 0, 0, 0, 5, "thr", True, causal, False, mask_mod, aux)

    assert apply(None) is None and calls == []  # full entries: no sequence-length mask either
    apply(own_mask_mod)
    assert calls == ["valid sizes"]
    with pytest.raises(ValueError, match=mask_mod):
        apply(lambda *args: True)
    with pytest.raises(ValueError, match="no causal"):
        apply(own_mask_mod, causal=True)


@needs_upstream
def test_scope_swaps_mask_class_and_tma_boxes_only_inside_and_only_for_its_thread():
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    from flash_attn_vsa import mask_sm90

    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS)):
        assert build_scope.current("fwd") == fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS)
        assert fwd_sm90._current_kernel_class() is paired().kernel_class()
        assert type(fwd_module.AttentionMask(64, 128, None)) is paired().mask_class()
        seen = {}
        thread = threading.Thread(
            target=lambda: seen.update(
                mask=type(fwd_module.AttentionMask(64, 128, None)),
                cls=fwd_sm90._current_kernel_class(),
            )
        )
        thread.start()
        thread.join()
        assert seen["mask"] is mask_sm90.mask_class()
        assert seen["cls"] is not paired().kernel_class()
    assert build_scope.current("fwd") is None
    assert type(fwd_module.AttentionMask(64, 128, None)) is mask_sm90.mask_class()
    with (
        fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS)),
        fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS)),
    ):  # innermost wins
        assert fwd_sm90._current_kernel_class() is paired().kernel_class()
    with pytest.raises(ValueError, match="kernel must be"), fwd_sm90._building("paired"):
        pass
    with pytest.raises(ValueError, match="kind must be one of"):
        fwd_sm90.ForwardKernel("paired")


@needs_upstream
def test_q_in_registers_scope_is_a_paired_scope_with_its_own_class():
    import flash_attn.cute.flash_fwd_sm90 as fwd_module

    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS, True)):
        assert build_scope.current("fwd") == fwd_sm90.ForwardKernel("paired_keys", True)
        cls = fwd_sm90._current_kernel_class()
        assert type(fwd_module.AttentionMask(64, 128, None)) is paired().mask_class()
    assert cls is paired().kernel_class(q_in_registers=True)
    assert issubclass(cls, paired().kernel_class()) and cls is not paired().kernel_class()
    assert paired().kernel_class(False) is paired().kernel_class()  # one class per variant


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype,variant", cases.VARIANT_CASES)
def test_paired_forward_matches_the_reference(dtype, variant):
    def pack(split):
        num_kv = split.full_block_idx.shape[-1]
        return paired().pair_lists(
            split.full_block_idx[..., : num_kv - 1], split.full_block_cnt,
            split.mask_block_idx[..., : num_kv - 1], split.mask_block_cnt, num_kv,
        )  # fmt: skip

    c = cases.packed_forward_case(11, 128, dtype, pack, paired().BLOCK_SIZE)
    assert (c.split.mask_block_cnt % 2).any() and (c.split.full_block_cnt % 2).any()  # odd tails
    out, lse = cases.nan_outputs(c.q)
    got = paired().block_sparse_forward_paired(
        c.q, c.k, c.v, c.tensors, c.valid.cuda(), softmax_scale=c.scale, out=out, lse=lse,
        **variant,
    )  # fmt: skip
    cases.assert_forward_matches(got, (out, lse), c.ref_out, c.ref_lse)


@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
def test_paired_forward_refuses_other_block_sizes_and_head_dims():
    q, tensors, valid = cases.small_refusal_case()
    with pytest.raises(ValueError, match="block_size must be"):
        paired().block_sparse_forward_paired(q, q, q, tensors, valid, softmax_scale=0.1)
    small = q[..., :64].contiguous()
    with pytest.raises(ValueError, match="head dim must be 128"):
        paired().block_sparse_forward_paired(
            small, small, small, tensors._replace(block_size=(128, 128)), valid,
            softmax_scale=0.1,
        )  # fmt: skip

"""The fork's two-CTA Q64/KV64 forward (`flash_attn_vsa.fwd_sm90`, and with Q in registers,
`flash_attn_vsa.q_regs_sm90`): its scope on the CPU (which kernel class and which compile cache
upstream uses, per thread), correctness against a float32 reference and against upstream's own
kernel on an sm_90 GPU.

GPU cases (`sm90_cases`): 64x64 blocks, head dims 64 and 128, bf16 and fp16, key blocks full,
partial (through a mask_mod on the partial lists) and empty, query blocks selecting 0..5 key
blocks, ``out`` and ``lse`` pre-filled with NaN (every element must be written).
"""

from __future__ import annotations

import threading

import pytest
import sm90_cases as cases
import torch

from flash_attn_vsa import build_scope, fwd_sm90, mask_sm90, sm90_blocks, upstream_version

needs_upstream = pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")


def test_shares_the_sm90_argument_checks():
    assert fwd_sm90.check_call is sm90_blocks.check_call
    assert fwd_sm90.BLOCK_SIZE == (64, 64)
    assert fwd_sm90.MMA_REGISTERS + fwd_sm90.PRODUCER_REGISTERS == 256  # x 128 threads x 2 CTAs


@needs_upstream
def test_scope_picks_kernel_class_and_cache_per_thread():
    import flash_attn.cute.interface as interface
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS)):
        inside = fwd_sm90._current_kernel_class()
        interface._flash_attn_fwd.compile_cache["test-key"] = "ours"
        seen = {}

        def elsewhere():
            seen["class"] = fwd_sm90._current_kernel_class()
            seen["has_key"] = "test-key" in interface._flash_attn_fwd.compile_cache

        other = threading.Thread(target=elsewhere)
        other.start()
        other.join()
    assert inside is fwd_sm90.kernel_class()
    assert issubclass(inside, FlashAttentionForwardSm90)
    assert fwd_sm90._current_kernel_class() is FlashAttentionForwardSm90
    assert seen == {"class": FlashAttentionForwardSm90, "has_key": False}  # upstream's there
    assert "test-key" not in interface._flash_attn_fwd.compile_cache
    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS)):
        assert interface._flash_attn_fwd.compile_cache["test-key"] == "ours"
        own = interface._flash_attn_fwd.compile_cache.own
        del own[fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS)]["test-key"]
    # Upstream's interface builds its kernels through the scoped class, still a subclass.
    assert issubclass(interface.FlashAttentionForwardSm90, FlashAttentionForwardSm90)


@needs_upstream
def test_q_in_registers_scope_has_its_own_class_and_cache():
    import flash_attn.cute.interface as interface

    with fwd_sm90._building(fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, q_in_registers=True)):
        inside = fwd_sm90._current_kernel_class()
        assert build_scope.current("fwd") == fwd_sm90.ForwardKernel("two_ctas", True)
        interface._flash_attn_fwd.compile_cache["test-key"] = "q in registers"
        with fwd_sm90._building(
            fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS)
        ):  # the plain two-CTA kernels never share its entries
            assert "test-key" not in interface._flash_attn_fwd.compile_cache
        own = interface._flash_attn_fwd.compile_cache.own
        del own[fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, q_in_registers=True)]["test-key"]
    assert inside is fwd_sm90.kernel_class(q_in_registers=True)
    assert issubclass(inside, fwd_sm90.kernel_class()) and inside is not fwd_sm90.kernel_class()
    assert inside.__name__ == "FlashAttentionForwardSm90TwoCtasQInRegisters"


@needs_upstream
def test_two_threads_build_their_own_kernels_through_the_entry_points(monkeypatch):
    """Which forward runs is the entry points' arguments: two threads calling them at once with
    different ones each have upstream build their own kernel class and mask."""
    import flash_attn.cute.interface as interface

    from flash_attn_vsa import fwd_sm90_paired

    barrier = threading.Barrier(3)
    built = {}

    def fake_fwd(*args, **kwargs):
        barrier.wait(timeout=30)  # all threads inside their calls at once
        built[threading.current_thread().name] = (
            fwd_sm90._current_kernel_class(),
            build_scope.current("fwd"),
        )
        barrier.wait(timeout=30)
        return None, None

    # the entry points' once-per-process installs wrap upstream's launcher (its compile cache):
    # done before the launcher is faked, so that the test passes alone too and later tests
    # find upstream's own launcher wrapped
    from flash_attn_vsa import paired_sm90
    from flash_attn_vsa.experimental import persistent_sm90

    fwd_sm90._install()
    paired_sm90._install()
    persistent_sm90.install()
    monkeypatch.setattr(interface, "_flash_attn_fwd", fake_fwd)
    q = torch.empty(1, 256, 2, 128, device="meta")
    valid = torch.empty(4, dtype=torch.int32, device="meta")

    def tensors(block_size):
        lists = dict.fromkeys(
            ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx")
        )
        return type("Tensors", (), {"block_size": block_size, **lists})()

    calls = {
        "q-regs": lambda: fwd_sm90.block_sparse_forward_q64(
            q, q, q, tensors((64, 64)), softmax_scale=1.0, q_in_registers=True
        ),
        "plain": lambda: fwd_sm90.block_sparse_forward_q64(
            q, q, q, tensors((64, 64)), softmax_scale=1.0, q_in_registers=False
        ),
        "paired": lambda: fwd_sm90_paired.block_sparse_forward_paired(
            q, q, q, tensors((128, 128)), valid, softmax_scale=1.0, persistent=4
        ),
    }
    threads = [threading.Thread(target=call, name=name) for name, call in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == {
        "q-regs": (fwd_sm90.kernel_class(q_in_registers=True),
                   fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, True)),
        "plain": (fwd_sm90.kernel_class(), fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS)),
        "paired": (fwd_sm90_paired.kernel_class(persistent=4),
                   fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS, persistent=4)),
    }  # fmt: skip
    assert build_scope.current("fwd") is None


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize(
    "head_dim,dtype,variant",
    [(64, cases.BF16, {}), (64, cases.FP16, cases.QREGS)]
    + [(128, dtype, variant) for dtype, variant in cases.VARIANT_CASES],
)
def test_two_cta_forward_matches_the_reference_and_upstream(head_dim, dtype, variant):
    from flash_attn.cute.interface import _flash_attn_fwd

    mask_mod = mask_sm90.valid_size_mask_mod(cases.BLOCK)
    valid, selected = cases.case(seed=head_dim + 7)
    q, k, v, dout = cases.inputs(head_dim, dtype, valid)
    scale = head_dim**-0.5
    ref_out, ref_lse, _ = cases.reference(q, k, v, dout, valid, selected, scale)
    tensors = cases.sparse_tensors(valid, selected, backward=False)
    masking = {"mask_mod": mask_mod, "aux_tensors": [valid.cuda()]}
    out, lse = cases.nan_outputs(q)
    got_out, got_lse = fwd_sm90.block_sparse_forward_q64(
        q, k, v, tensors, softmax_scale=scale, out=out, lse=lse, **variant,
        **masking,
    )  # fmt: skip
    cases.assert_forward_matches((got_out, got_lse), (out, lse), ref_out, ref_lse)
    sees_keys = torch.isfinite(ref_lse)
    # Same kernel body as upstream's one-CTA launch: the same numbers.
    up_out, up_lse = _flash_attn_fwd(
        q, k, v, softmax_scale=scale, block_sparse_tensors=tensors, return_lse=True, **masking
    )[:2]
    assert (got_out.float() - up_out.float()).abs().max().item() <= 1e-6 + 2**-8 * float(
        up_out.float().abs().max()
    )
    assert torch.allclose(got_lse[sees_keys], up_lse[sees_keys], atol=1e-5, rtol=0)


@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
def test_wrong_block_size_is_refused_before_any_launch():
    q, tensors, _ = cases.small_refusal_case(num_kv=2)
    tensors = tensors._replace(block_size=(128, 64))
    with pytest.raises(ValueError, match="block_size must be"):
        fwd_sm90.block_sparse_forward_q64(q, q, q, tensors, softmax_scale=0.1)


# ---- delta 9: VSA's combine in the epilogue (argument checks: CPU, before any launch) --------
def _combine_case(seq=256, heads=2, dim=128):
    from types import SimpleNamespace

    q = torch.zeros(1, seq, heads, dim, dtype=torch.bfloat16)
    coarse = torch.zeros(1, seq // 64, heads, dim, dtype=torch.bfloat16)
    return q, coarse, SimpleNamespace(block_size=(64, 64))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"coarse": "short"}, "coarse must have shape"),
        ({"gate": "short"}, "gate must have shape"),
        ({"coarse": "fp16"}, "coarse must have q's dtype"),
        ({"coarse": None, "gate": "ok"}, "gate needs coarse"),
        ({"lse": "given"}, "lse must be None with coarse"),
    ],
)
def test_combined_forward_refuses_bad_operands_before_any_launch(change, match):
    q, coarse, sparse = _combine_case()
    args = {"coarse": coarse, "gate": None, "lse": None}
    made = {
        "short": lambda name: (coarse if name == "coarse" else q)[:, :-1],
        "fp16": lambda name: coarse.half(),
        "ok": lambda name: q.clone(),
        "given": lambda name: torch.zeros(1, 2, 256),
        None: lambda name: None,
    }
    args.update({name: made[how](name) for name, how in change.items()})
    with pytest.raises(ValueError, match=match):
        fwd_sm90.block_sparse_forward_q64(q, q, q, sparse, softmax_scale=0.1, **args)


def test_combined_epilogue_only_on_the_two_cta_kernel():
    assert fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, combine="gated").combine == "gated"
    with pytest.raises(ValueError, match="combine must be one of"):
        fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, combine="yes")
    for kind, persistent in ((fwd_sm90.PAIRED_KEYS, 0), (fwd_sm90.TWO_STREAMS, 0),
                             (fwd_sm90.TWO_CTAS, 4)):  # fmt: skip
        with pytest.raises(ValueError, match="two-CTA 64x64 kernel only"):
            fwd_sm90.ForwardKernel(kind, persistent=persistent, combine="coarse")


@needs_upstream
def test_combined_kernel_classes_are_their_own():
    gated = fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, True, combine="gated").kernel_class()
    ungated = fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, True, combine="coarse").kernel_class()
    plain = fwd_sm90.kernel_class(q_in_registers=True)
    assert issubclass(gated, plain) and issubclass(ungated, plain)
    assert len({gated, ungated, plain}) == 3
    assert gated.__name__ == "FlashAttentionForwardSm90TwoCtasQInRegistersCombinedGated"


# ---- delta 11: V's padding zeroed in shared memory ------------------------------------------
def test_zeroing_v_padding_needs_valid_sizes_in_the_lists():
    """The zeroing reads each partial step's valid size from its list entry (delta 10): a
    kernel or a call without such lists is refused before anything is built."""
    with pytest.raises(ValueError, match="zero_v_padding reads the valid sizes"):
        fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, True, zero_v_padding=True)
    with pytest.raises(ValueError, match="valid sizes in the lists: the two-CTA kernel only"):
        fwd_sm90.ForwardKernel(fwd_sm90.PAIRED_KEYS, valid_in_list=True, zero_v_padding=True)
    q, _, sparse = _combine_case()
    for mask_mod in (None, mask_sm90.valid_size_mask_mod(64)):
        with pytest.raises(ValueError, match="zero_v_padding needs lists with valid sizes"):
            fwd_sm90.block_sparse_forward_q64(
                q, q, q, sparse, softmax_scale=0.1, mask_mod=mask_mod, zero_v_padding=True
            )


@needs_upstream
def test_zeroing_kernel_class_is_its_own():
    shipped = fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, True, valid_in_list=True)
    zeroing = fwd_sm90.ForwardKernel(fwd_sm90.TWO_CTAS, True, valid_in_list=True,
                                     zero_v_padding=True)  # fmt: skip
    assert zeroing != shipped and hash(zeroing) != hash(shipped)
    cls = zeroing.kernel_class()
    assert issubclass(cls, shipped.kernel_class()) and cls is not shipped.kernel_class()
    assert cls.__name__ == "FlashAttentionForwardSm90TwoCtasQInRegistersValidInListVPaddingZeroed"

"""The fork's KV64 backward (`flash_attn_vsa.bwd_sm90`): argument checks and what upstream
builds while the entry point builds a configuration (per thread), on the CPU; correctness
against a float32 reference on an sm_90 GPU.

GPU cases: 64x64 and 128x64 blocks, head dims 64 and 128, key blocks full, partial (through a
mask_mod on the partial lists) and empty (selected by nobody: dk = dv = 0), query blocks
selecting 0..5 key blocks, outputs pre-filled with NaN (every element must be written). Relative L2
error of dq, dk, dv <= 1e-2.
"""

from __future__ import annotations

import threading

import pytest
import sm90_cases as cases
import torch

from flash_attn_vsa import bwd_sm90, mask_sm90, upstream_version
from flash_attn_vsa.experimental import bwd_configs

needs_upstream = pytest.mark.skipif(upstream_version() is None, reason="needs flash-attn-4")


class _Shape:
    def __init__(self, *shape):
        self.shape = shape


@pytest.mark.parametrize(
    ("q", "k", "block", "match"),
    [
        ((1, 128, 2, 128), (1, 128, 2, 128), (64, 128), "block_size must be"),
        ((1, 192, 2, 128), (1, 192, 2, 128), (128, 64), "multiple of 128"),
        ((1, 128, 2, 96), (1, 128, 2, 96), (64, 64), "head dim must be one of"),
        ((1, 128, 4, 128), (1, 128, 2, 128), (64, 64), "no GQA"),
        ((1, 100, 2, 128), (1, 128, 2, 128), (64, 64), "multiple of 64"),
    ],
)
def test_check_call_names_the_problem(q, k, block, match):
    with pytest.raises(ValueError, match=match):
        bwd_sm90.check_call(_Shape(*q), _Shape(*k), _Shape(*k), block, bwd_sm90.BWD_BLOCK_SIZES)


def test_configs_per_block_size():
    cfg = bwd_sm90.config_for((64, 64))
    assert cfg is bwd_sm90.KV64_CONFIG
    assert (cfg.m_block_size, cfg.n_block_size, cfg.num_wg) == (64, 64, 1)
    # two CTAs per SM (113 KB each): dQ sent in halves by the producer warp, one dO and P/dS
    # stage, two of Q
    assert (cfg.ctas_per_sm, cfg.dq_parts, cfg.dq_buffers, cfg.dq_sender) == (2, 2, 1, "producer")
    assert (cfg.num_stages_Q, cfg.num_stages_dO, cfg.num_stages_PdS) == (2, 1, 1)
    assert not cfg.SdP_swapAB  # measured: the swapped single-warpgroup layout is 0.49 vs 0.71
    cfg = bwd_sm90.config_for((128, 64))
    assert (cfg.m_block_size, cfg.n_block_size, cfg.num_wg) == (128, 64, 2)
    # each warpgroup owns 64 query rows of S/dP and dQ: full 64-row wgmmas, no query subtiles
    assert (cfg.AtomLayoutMSdP, cfg.AtomLayoutMdQ) == (2, 2)
    assert (cfg.num_stages_Q, cfg.num_stages_dO, cfg.num_stages_PdS) == (2, 1, 1)


@needs_upstream
def test_upstream_builds_the_config_only_inside_building_and_only_on_its_thread():
    import flash_attn.cute.interface as interface

    bwd_sm90._install()
    staged = bwd_sm90.KV64_STAGED_CONFIG
    upstream_class = interface.FlashAttentionBackwardSm90.__mro__[1]
    upstream_cfg = interface._tile_size_bwd_sm90(128, 128, False, False)
    seen_elsewhere = []
    with bwd_sm90._building(staged):
        assert bwd_sm90._building_class() is bwd_sm90.kernel_class()
        inside = interface._tile_size_bwd_sm90(128, 128, False, False)
        assert (inside.m_block_size, inside.n_block_size, inside.num_wg) == (64, 64, 1)

        def elsewhere():
            seen_elsewhere.append(interface._tile_size_bwd_sm90(128, 128, False, False))
            seen_elsewhere.append(bwd_sm90._building_class())

        other = threading.Thread(target=elsewhere)
        other.start()
        other.join()
    assert seen_elsewhere == [upstream_cfg, None]  # another thread still gets upstream's
    assert bwd_sm90._building_class() is None
    assert interface._tile_size_bwd_sm90(128, 128, False, False) == upstream_cfg
    assert issubclass(interface.FlashAttentionBackwardSm90, upstream_class)
    assert issubclass(bwd_sm90.kernel_class(), upstream_class)


def test_config_for_is_the_shipped_configuration_whatever_the_caller_did():
    assert bwd_sm90.config_for((64, 64)) is bwd_sm90.KV64_CONFIG
    assert bwd_sm90.config_for((128, 64)) is bwd_sm90.Q128_KV64_CONFIG
    assert not hasattr(bwd_sm90, "configs_scope")  # configurations are arguments now


@needs_upstream
def test_two_threads_build_their_own_configs_through_the_entry_point(monkeypatch):
    """``config=`` is the only way to choose: two threads calling the entry point with
    different configurations at once each have upstream build their own."""
    import flash_attn.cute.interface as interface

    two_ctas = bwd_configs.EXPERIMENTAL_CONFIGS["kv64-dq-2parts-two-ctas"]
    barrier = threading.Barrier(2)
    built = {}

    def fake_bwd(*args, **kwargs):
        barrier.wait(timeout=30)  # both threads inside their calls at once
        built[threading.current_thread().name] = bwd_sm90._building_class()
        barrier.wait(timeout=30)
        return None, None, None

    # the once-per-process install reads upstream's real backward (its compile cache): run it
    # before the stand-in replaces it, whichever test of this worker ran first
    bwd_sm90._install()
    monkeypatch.setattr(interface, "_flash_attn_bwd", fake_bwd)
    q = _Shape(1, 128, 2, 128)
    lists = dict.fromkeys(("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx"))
    tensors = type("Tensors", (), {"block_size": (64, 64), **lists})()

    def call(config):
        bwd_sm90.block_sparse_backward_kv64(q, q, q, q, q, q, tensors, softmax_scale=1.0,
                                            config=config)  # fmt: skip

    threads = [
        threading.Thread(target=call, args=(config,), name=name)
        for name, config in (("shipped", None), ("two-ctas", two_ctas))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == {
        "shipped": bwd_sm90.KV64_CONFIG.kernel_class(),
        "two-ctas": two_ctas.kernel_class(),
    }
    assert built["shipped"] is not built["two-ctas"]


def test_building_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="TileConfig"), bwd_sm90._building("kv64-staged"):
        pass


def test_our_fields_stay_out_of_upstreams_config():
    pytest.importorskip("flash_attn.cute.interface")
    config = bwd_configs.EXPERIMENTAL_CONFIGS["kv64-dq-2parts-two-ctas"]
    upstream = config.upstream()
    ours = ("dq_parts", "dq_buffers", "ctas_per_sm", "ablate_dq")
    assert not any(hasattr(upstream, f) for f in ours)
    assert (upstream.num_stages_Q, upstream.num_stages_dO, upstream.num_stages_PdS) == (2, 1, 1)


def test_two_ctas_need_dq_parts():
    with pytest.raises(ValueError, match="need dq_parts"):
        bwd_sm90.TileConfig(ctas_per_sm=2).kernel_class()
    with pytest.raises(ValueError, match="need dq_parts"):
        bwd_sm90.TileConfig(ablate_dq=True).kernel_class()


@needs_upstream
def test_each_config_runs_its_own_kernel_class():
    from flash_attn_vsa.bwd_sm90_dq_parts import DqStaging, kernel_class

    assert bwd_sm90.KV64_STAGED_CONFIG.kernel_class() is bwd_sm90.kernel_class()
    shipped = kernel_class(2, DqStaging(parts=2, buffers=1, sender="producer"))
    assert bwd_sm90.KV64_CONFIG.kernel_class() is shipped
    double = kernel_class(1, DqStaging(parts=1, buffers=2))
    halves = kernel_class(2, DqStaging(parts=2, buffers=1))
    assert bwd_configs.EXPERIMENTAL_CONFIGS["kv64-dq-1part-2buffers"].kernel_class() is double
    assert bwd_configs.EXPERIMENTAL_CONFIGS["kv64-dq-2parts-two-ctas"].kernel_class() is halves
    assert kernel_class(2, DqStaging(2, 1), True) is halves  # however the arguments come
    assert bwd_configs.ABLATIONS["kv64-two-ctas-no-dq"].kernel_class() is not halves
    assert issubclass(halves, bwd_sm90.kernel_class())
    with pytest.raises(ValueError, match="ctas_per_sm must be 1 or 2"):
        kernel_class(3)


@pytest.mark.parametrize(
    ("parts", "buffers", "q_stages", "match"),
    [
        (0, 1, 2, "parts must be a positive int"),
        (2, True, 2, "buffers must be a positive int"),
        (3, 2, 2, "must divide parts"),
        (1, 3, 2, "equal the Q stages"),
        (32, 1, 2, "512-value pieces"),
    ],
)
def test_dq_staging_refuses_what_it_cannot_run(parts, buffers, q_stages, match):
    from flash_attn_vsa.bwd_sm90_dq_parts import DqStaging

    with pytest.raises(ValueError, match=match):
        DqStaging(parts, buffers).check(q_stages, 64 * 128)


def test_dq_staging_buffer_sizes():
    from flash_attn_vsa.bwd_sm90_dq_parts import DqStaging

    assert DqStaging(1, 2).buffer_values(8192) == 16384  # two full 32 KB buffers
    assert DqStaging(4, 2).buffer_values(8192) == 4096  # two 8 KB quarters
    DqStaging(8, 4).check(2, 8192)
    DqStaging(1, 2).check(2, 8192)


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_block", [64, 128])
def test_kv64_backward_matches_the_reference(head_dim, dtype, q_block, config=None):
    mask_mod = mask_sm90.valid_size_mask_mod(cases.BLOCK)
    valid, selected = cases.case(seed=head_dim, q_block=q_block)
    q, k, v, dout = cases.inputs(head_dim, dtype, valid)
    scale = head_dim**-0.5
    ref_out, ref_lse, ref_grads = cases.reference(q, k, v, dout, valid, selected, scale)
    out = ref_out.to(dtype).contiguous()
    lse = ref_lse.float().contiguous()  # natural log, -inf for rows that see no key
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    tensors = cases.sparse_tensors(valid, selected, backward=True)
    dq, dk, dv = bwd_sm90.block_sparse_backward_kv64(
        q, k, v, out, dout, lse, tensors, softmax_scale=scale,
        mask_mod=mask_mod, aux_tensors=[valid.cuda()], dq=grads[0], dk=grads[1], dv=grads[2],
        config=config,
    )  # fmt: skip
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, strict=True):
        assert torch.isfinite(got).all(), name
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err <= 1e-2, (name, err)
    # Key block 5 is selected by nobody: its dk, dv are exactly zero.
    unselected = slice(5 * cases.BLOCK, 6 * cases.BLOCK)
    assert bool((dk[:, unselected] == 0).all()) and bool((dv[:, unselected] == 0).all())


@pytest.mark.gpu
@needs_upstream
@pytest.mark.skipif(not cases.sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize(
    "name", sorted(n for n, c in bwd_configs.EXPERIMENTAL_CONFIGS.items() if not c.dq_from_ds)
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_experimental_configs_match_the_reference(name, head_dim):
    """Every configuration under measurement (dQ sent in parts, two CTAs per SM), on the same
    cases as the shipped one, passed as ``config``. The dS-writing one needs its dQ pass:
    vsa-fa4's ``test_ds_backward_matches_the_reference_and_reruns_bitwise``."""
    config = bwd_configs.EXPERIMENTAL_CONFIGS[name]
    test_kv64_backward_matches_the_reference(head_dim, torch.bfloat16, config.m_block_size, config)


@needs_upstream
@pytest.mark.parametrize("by_name", [False, True])
def test_only_the_ds_config_skips_zeroing_the_dq_accumulator(monkeypatch, by_name):
    """Upstream's preprocess zeros the float32 dQ accumulator (B x H x S x D); the dS-writing
    backward never reads it, so its build passes the preprocess none. Every other build, and
    every call outside a build, hands the preprocess the accumulator it was given."""
    import flash_attn.cute.interface as interface

    bwd_sm90._install()
    seen = []
    monkeypatch.setattr(
        bwd_sm90._building_preprocess, "__wrapped__",
        lambda *args, **kwargs: seen.append(kwargs["dq_accum"] if by_name else args[5]),
    )  # fmt: skip
    accum = object()

    def preprocess():
        if by_name:  # the keyword form, should upstream switch to it
            interface._bwd_preprocess(*range(5), dq_accum=accum, fake_mode=False)
        else:  # upstream's call: out, dout, dpsum, lse, lse_log2, dq_accum, ...
            interface._bwd_preprocess(*range(5), accum, None, None, None, fake_mode=False)

    preprocess()
    for config in (bwd_sm90.KV64_CONFIG, bwd_sm90.KV64_DS_CONFIG):
        with bwd_sm90._building(config):
            preprocess()
    assert seen == [accum, accum, None]

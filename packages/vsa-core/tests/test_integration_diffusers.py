"""`vsa_core.integrations.diffusers` on a tiny random-weight diffusers WanTransformer3DModel (CPU,
reference backend; skipped where diffusers is not installed: it is the workspace's optional
``diffusers`` group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from vsa_core.integrations.diffusers import disable_vsa, enable_vsa  # noqa: E402

TILE = (2, 2, 2)


def tiny_wan(seed: int = 0):
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    return model.double().eval()


def inputs(seed: int = 1, frames: int = 3, height: int = 10, width: int = 6):
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(1, 4, frames, height, width, generator=gen, dtype=torch.float64)
    text = torch.randn(1, 8, 16, generator=gen, dtype=torch.float64)
    return latent, torch.tensor([500]), text


def run(model, latent, timestep, text):
    return model(latent, timestep, text, return_dict=False)[0]


def test_every_tile_selected_without_the_coarse_term_is_the_dense_model():
    model = tiny_wan()
    args = inputs()  # token grid 3 x 5 x 3: partial tiles along every axis
    dense = run(model, *args)
    enable_vsa(model, topk=10**6, tile=TILE, coarse="drop", backend="reference")
    sparse = run(model, *args)
    torch.testing.assert_close(sparse, dense, rtol=1e-9, atol=1e-9)
    disable_vsa(model)
    torch.testing.assert_close(run(model, *args), dense, rtol=0, atol=0)


def test_sparse_training_step_runs_and_trains_the_gate():
    model = tiny_wan().train()
    enable_vsa(model, sparsity=0.75, tile=TILE, backend="reference")
    keys = [k for k in model.state_dict() if "to_gate_compress" in k]
    names = [f"blocks.{i}.attn1.to_gate_compress.{p}" for i in (0, 1) for p in ("weight", "bias")]
    assert keys == names
    # zero-initialised gate: an untrained model starts from fine attention alone
    fine_only = run(model, *inputs()).detach()
    disable_vsa(model, keep_gates=True)
    enable_vsa(model, sparsity=0.75, tile=TILE, backend="reference", coarse="drop")
    torch.testing.assert_close(run(model, *inputs()).detach(), fine_only, rtol=0, atol=0)
    disable_vsa(model, keep_gates=True)
    enable_vsa(model, sparsity=0.75, tile=TILE, backend="reference")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = run(model, *inputs()).square().mean()
    loss.backward()
    gate = model.blocks[0].attn1.to_gate_compress.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    optimizer.step()
    assert gate.abs().sum() > 0


def test_the_coarse_term_changes_the_output_and_cross_attention_stays_dense():
    model = tiny_wan()
    args = inputs()
    enable_vsa(model, topk=2, tile=TILE, coarse="drop", backend="reference")
    without = run(model, *args)
    disable_vsa(model)
    enable_vsa(model, topk=2, tile=TILE, coarse="add", backend="reference")
    with_coarse = run(model, *args)
    assert not torch.allclose(without, with_coarse)
    assert type(model.blocks[0].attn2.processor).__name__ == "WanAttnProcessor"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of topk= and sparsity="),
        ({"topk": 2, "sparsity": 0.5}, "exactly one of topk= and sparsity="),
        ({"sparsity": 1.0}, "sparsity must lie in"),
        ({"topk": 0}, "topk"),
        ({"topk": 2, "coarse": "gated"}, "coarse must be"),
        ({"topk": 2, "tile": (0, 2, 2)}, "tile"),
        ({"topk": 2, "copy_to_tiles": "no"}, "copy_to_tiles"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        enable_vsa(tiny_wan(), **kwargs)


def test_enable_twice_and_disable_without_enable_are_refused():
    model = tiny_wan()
    enable_vsa(model, topk=2, tile=TILE)
    with pytest.raises(ValueError, match="already runs VSA"):
        enable_vsa(model, topk=2, tile=TILE)
    disable_vsa(model)
    with pytest.raises(ValueError, match="does not run VSA"):
        disable_vsa(model)
    with pytest.raises(ValueError, match="WanTransformer3DModel"):
        enable_vsa(torch.nn.Linear(2, 2), topk=2)


def test_compiled_model_with_vsa_matches_eager_forward_and_gradients():
    """``torch.compile`` of the whole transformer with VSA installed (what bench_dit's
    ``compile`` way runs): the same output and parameter gradients as eager, gate included.
    In float32: inductor's CPU backward of diffusers' own SDPA cross-attention fails in float64
    (torch 2.11: "expected scalar type Double but found Float"), with or without VSA."""
    model = tiny_wan().float().train()
    enable_vsa(model, sparsity=0.75, tile=TILE, backend="reference", coarse="add")
    args = tuple(a.float() if a.is_floating_point() else a for a in inputs())

    def step(runner):
        model.zero_grad(set_to_none=True)
        out = run(runner, *args)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_out, eager_grads = step(model)
    compiled_out, compiled_grads = step(torch.compile(model))
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-4, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in compiled_grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("sparsity", [0.875, 0.9, 0.75, 0.5, 1 / 3, 0.0])
def test_topk_for_a_sparsity_is_the_rounded_kept_fraction(sparsity):
    model = tiny_wan()
    settings = enable_vsa(model, sparsity=sparsity, tile=TILE)
    for tiles in (1, 7, 12, 624, 1440):
        tiling = type("Tiling", (), {"num_tiles": tiles})()
        assert settings.topk_for(tiling) == max(1, round((1 - sparsity) * tiles)), tiles
    disable_vsa(model)


def test_blocks_compiled_once_then_run_at_another_sparsity_in_training():
    """Regional compilation (each block, as diffusers' ``compile_repeated_blocks``) at one
    sparsity, then a forward and backward at another: dynamo recompiles with the kept fraction
    as integers and the gradients match eager's (a float sparsity became a symbolic float and
    failed in the backward under torch 2.11)."""
    torch._dynamo.reset()
    model = tiny_wan().float().train()
    args = tuple(a.float() if a.is_floating_point() else a for a in inputs())
    for block in model.blocks:
        block.compile()
    try:
        for sparsity in (0.75, 0.5):
            enable_vsa(model, sparsity=sparsity, tile=TILE, backend="reference", coarse="add")
            results = []
            for compiled in (True, False):
                for block in model.blocks:
                    if not compiled:
                        block._compiled_call_impl = None
                model.zero_grad(set_to_none=True)
                out = run(model, *args)
                out.square().mean().backward()
                results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
                if not compiled:
                    for block in model.blocks:
                        block.compile()
            disable_vsa(model)
            (c_out, c_grads), (e_out, e_grads) = results
            torch.testing.assert_close(c_out, e_out, rtol=1e-4, atol=1e-5)
            for c, e in zip(c_grads, e_grads, strict=True):
                torch.testing.assert_close(c, e, rtol=1e-3, atol=1e-5)
    finally:
        for block in model.blocks:
            block._compiled_call_impl = None


def test_deterministic_reaches_every_attention_call(monkeypatch):
    """``enable_vsa(deterministic=True)`` runs each block's op with the flag (and a flag that is
    not a bool is refused, naming the argument)."""
    import vsa_core.integrations.diffusers as integration

    seen = []
    original = integration.video_sparse_attn

    def recording(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return original(*args, **kwargs)

    monkeypatch.setattr(integration, "video_sparse_attn", recording)
    model = tiny_wan()
    with pytest.raises(ValueError, match="deterministic"):
        enable_vsa(model, sparsity=0.75, tile=TILE, backend="reference", deterministic="yes")
    for flag in (False, True):
        enable_vsa(model, sparsity=0.75, tile=TILE, backend="reference", deterministic=flag)
        run(model, *inputs())
        disable_vsa(model)
        assert seen == [flag, flag]
        seen.clear()


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)
def test_ulysses_context_parallelism_matches_one_process(tmp_path):
    """Two gloo processes run a tiny Wan model under diffusers' ``enable_parallelism`` (Ulysses)
    with VSA, enabled before and after it (`diffusers_cp_worker.py`): each rank's blocks see
    half the raster tokens, the processors run the sequence-parallel op, and the output equals
    one process's to 1e-10; after `disable_vsa` diffusers' own processors run context-parallel
    again (the dense model's output)."""
    from test_distributed import run_ranks

    worker = Path(__file__).resolve().parent / "diffusers_cp_worker.py"
    text = run_ranks(worker, ["--init-file", str(tmp_path / "rendezvous")], 2)
    for rank in range(2):
        assert f"rank {rank}: OK" in text, text
        for order in ("parallel first", "vsa first"):
            assert f"rank {rank}: {order}: err" in text, text
            assert f"rank {rank}: {order}, disabled: err" in text, text


def test_ring_context_parallelism_is_refused():
    """Ring attention (or uneven splits) under diffusers' context parallelism is not what VSA's
    processor runs: a ValueError names what is supported."""
    from types import SimpleNamespace

    from vsa_core.integrations.diffusers import _ulysses

    assert _ulysses(None) is None
    assert _ulysses(SimpleNamespace(context_parallel_config=None)) is None
    ring = SimpleNamespace(ring_degree=2, ulysses_degree=1, ulysses_anything=False)
    with pytest.raises(ValueError, match="Ulysses context parallelism only"):
        _ulysses(SimpleNamespace(context_parallel_config=ring))
    uneven = SimpleNamespace(ring_degree=1, ulysses_degree=2, ulysses_anything=True)
    with pytest.raises(ValueError, match="ulysses_anything=True"):
        _ulysses(SimpleNamespace(context_parallel_config=uneven))


def test_a_context_parallel_config_without_its_mesh_is_refused_clearly():
    """A config diffusers never set up (or a diffusers that moved its private mesh) raises a
    RuntimeError that says what is missing, not an AttributeError from inside the call."""
    from types import SimpleNamespace

    model = tiny_wan()
    enable_vsa(model, topk=4, tile=TILE, backend="reference")
    cp = SimpleNamespace(ring_degree=1, ulysses_degree=1, ulysses_anything=False)
    for block in model.blocks:
        block.attn1.processor._parallel_config = SimpleNamespace(context_parallel_config=cp)
    with pytest.raises(RuntimeError, match="no Ulysses mesh"):
        run(model, *inputs())


def test_gradient_checkpointing_recomputes_the_same_selection_and_gradients():
    """diffusers' gradient checkpointing (how large Wan models train within one GPU's memory)
    runs each block's forward again in the backward: VSA's top-k must pick the same tiles the
    second time, so the parameter gradients equal the run without checkpointing (float64)."""
    model = tiny_wan().train()
    enable_vsa(model, sparsity=0.75, tile=TILE, backend="reference")
    for block in model.blocks:  # a trained gate: the coarse term reaches the output
        torch.nn.init.normal_(block.attn1.to_gate_compress.weight, std=0.1)

    def grads():
        model.zero_grad(set_to_none=True)
        run(model, *inputs()).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.enable_gradient_checkpointing()
    assert model.gradient_checkpointing
    calls = []
    real = model.blocks[0].attn1.processor.attend
    model.blocks[0].attn1.processor.attend = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    checkpointed = grads()
    assert len(calls) == 2  # the forward, then its recomputation in the backward
    assert checkpointed.keys() == plain.keys()
    for name, grad in checkpointed.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-10, atol=1e-12, msg=name)

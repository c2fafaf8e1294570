"""`vsa_core.integrations.diffusers` on a CUDA device with the GPU backends (fa4, triton): a small
random-weight diffusers WanTransformer3DModel in bf16 whose token grid has partial 4x4x4 tiles
along every axis. The CPU tests (`test_integration_diffusers.py`) run the reference backend in
float64; these check that the fast backends give the same model, forward and backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from vsa_core.backends import AttentionCall  # noqa: E402
from vsa_core.backends.registry import backend_entries, refusal  # noqa: E402
from vsa_core.integrations.diffusers import disable_vsa, enable_vsa  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEAD_DIM = 64


def small_wan(num_layers: int):
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=HEAD_DIM, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=256, num_layers=num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    )  # fmt: skip
    return model.to("cuda", torch.bfloat16)


def inputs():
    # token grid 6 x 10 x 12 after patching: 4x4x4 tiles are partial along every axis
    gen = torch.Generator(device="cuda").manual_seed(1)
    latent = torch.randn(1, 4, 6, 20, 24, generator=gen, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 8, 32, generator=gen, device="cuda", dtype=torch.bfloat16)
    return latent, torch.tensor([500], device="cuda"), text


def run(model, latent, timestep, text):
    return model(latent, timestep, text, return_dict=False)[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def usable(backend: str, requires_grad: bool) -> None:
    """Skip unless ``backend`` is installed and runs this model's calls."""
    entry = backend_entries().get(backend)
    if entry is None or entry.backend is None:
        pytest.skip(f"backend {backend!r} not usable here: {entry and entry.load_error}")
    call = AttentionCall(torch.device("cuda"), torch.bfloat16, HEAD_DIM, (64, 64), requires_grad)
    reason = refusal(entry.backend, call)
    if reason is not None:
        pytest.skip(f"backend {backend!r} refuses: {reason}")


def attention_outputs(model) -> tuple[list[torch.Tensor], list]:
    """Each block's self-attention output of the next forward (hooks; remove them after)."""
    outputs: list[torch.Tensor] = []
    hooks = [
        b.attn1.register_forward_hook(lambda m, a, out: outputs.append(out)) for b in model.blocks
    ]
    return outputs, hooks


@pytest.mark.parametrize("backend", ["fa4", "triton"])
def test_every_tile_selected_without_the_coarse_term_is_the_dense_model(backend):
    """The first block's self-attention (identical inputs in both runs) and the model's output:
    the first checks the backend closely, the second that nothing else in the model changed
    (the residual stream dilutes an attention error there)."""
    usable(backend, requires_grad=False)
    model = small_wan(num_layers=2).eval()
    args = inputs()
    with torch.no_grad():
        dense_attention, hooks = attention_outputs(model)
        dense = run(model, *args)
        enable_vsa(model, topk=10**6, coarse="drop", backend=backend)
        sparse_attention, more = attention_outputs(model)
        sparse = run(model, *args)
        disable_vsa(model)
    for hook in hooks + more:
        hook.remove()
    assert torch.isfinite(sparse).all()
    assert rel(sparse_attention[0], dense_attention[0]) < 1e-2
    assert rel(sparse, dense) < 2e-2


@pytest.mark.parametrize("backend", ["fa4", "triton"])
def test_sparse_training_step_matches_the_reference_backend(backend):
    """One block (the selection then sees identical inputs in both runs, so it is the same),
    half the tiles, the gate trained: the output and every parameter's gradient through the
    fast backend's forward and backward match the reference backend's."""
    usable(backend, requires_grad=True)
    model = small_wan(num_layers=1).train()
    runs = {}
    for name in ("reference", backend):
        enable_vsa(model, sparsity=0.5, backend=name)
        gate = model.blocks[0].attn1.to_gate_compress
        with torch.no_grad():  # a non-zero gate, so that the coarse term reaches the loss
            gate.weight.normal_(0, 0.02, generator=torch.Generator("cuda").manual_seed(2))
        out = run(model, *inputs())
        out.float().square().mean().backward()
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        runs[name] = out.detach(), grads
        model.zero_grad(set_to_none=True)
        disable_vsa(model)
    (ref_out, ref_grads), (out, grads) = runs["reference"], runs[backend]
    assert rel(out, ref_out) < 2e-2
    assert grads.keys() == ref_grads.keys()
    for name in ("blocks.0.attn1.to_q.weight", "blocks.0.attn1.to_v.weight",
                 "blocks.0.attn1.to_gate_compress.weight"):  # fmt: skip
        assert name in grads
        assert torch.isfinite(grads[name]).all(), name
        assert rel(grads[name], ref_grads[name]) < 5e-2, name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_under_ulysses_context_parallelism_match_one_gpu():
    """diffusers' ``enable_parallelism`` (Ulysses over 2 GPUs, NCCL) with VSA (``auto``) in both
    orders, bf16: each rank's output against the same model on one GPU (relative L2 < 2e-2),
    and the dense model after `disable_vsa` (`diffusers_cp_worker.py --suite gpu`)."""
    from test_distributed_gpu import run_torchrun

    text = run_torchrun(
        Path(__file__).resolve().parent / "diffusers_cp_worker.py", ["--suite", "gpu"]
    )
    for rank in range(2):
        assert f"rank {rank}: nccl, world 2, cuda:{rank}, auto" in text, text
        assert f"rank {rank}: OK" in text, text

"""Backend variants that only benchmarks register, to time an op's paths side by side in one
run (the before and after of a change, at the same clock).

- ``triton_copies``: the triton backend with its raster reading and fused combine turned off
  (`Backend.reads_raster`, `Backend.fuses_combine`), so `video_sparse_attn` takes the path it
  took before they existed: tile-order copies of raster q, k, v written by the pooling kernel,
  and a separate combine pass.
- ``triton_unfused``: the triton backend with only the fused combine turned off: it still
  reads raster rows (``copy_to_tiles=False``), then combines in a separate in-place pass.
- ``fa4_unfused``: the fa4 backend without its fused combine (the 64x64 forward's combined
  epilogue, `flash_attn_vsa.combine_sm90`): the forward, then the coarse stage's combine pass.
- ``fa4_own_lists``: the fa4 backend with ``reads_forward_split`` off: its forward (combined
  in inference, with lse in training) splits the lists by key-tile fullness with its own list
  kernel instead of reading the `vsa_core.layout.ForwardSplit` the coarse stage's selection
  kernel writes (the op's path before that was turned on, in inference in session 21 and in
  training in session 24: one launch and four allocations more a call).
- ``fa4_sdpa_coarse``: the fa4 backend as shipped, with the coarse stage's attention and
  selection as two launches (SDPA, then the selection kernel: `CoarseStage.select_and_attend`'s
  default) instead of the Triton stage's one (its ``ATTEND`` phase): the op's path before
  that phase.
- ``fa4_attend_in_loop``: the fa4 backend as shipped, with the selection kernel's coarse
  attention run inside its score loop rather than as a pass of its own after it
  (``TritonCoarse.attend_after_scores`` off: the stage's choice before session 23). With
  ``fa4_sdpa_coarse`` the only variants that change the coarse stage (`coarse_backend_for`).
- ``fa4_unpacked``: the fa4 backend whose 64x64 forward lists hold plain block ids, the mask
  loading the valid sizes (``ForwardVariant(valid_in_list=False)``: what ran before delta 10,
  `flash_attn_vsa.valid_in_list_sm90`, was shipped).
- ``fa4_zero_v_padding``: the fa4 backend whose 64x64 forward zeroes partial blocks' V
  padding in shared memory (``ForwardVariant(zero_v_padding=True)``, delta 11,
  the fork's `experimental.v_padding_sm90`), so the ops make no copy of v in inference.
  Session 25's runs, made while it was briefly the default, call it ``fa4`` and the shipped
  path ``fa4_v_copy``.
- ``fa4_ds_backward``: the fa4 backend whose 64x64 backward writes dS and computes dQ from it
  in a query-owned pass (``KernelChoice(backward=KV64_DS_CONFIG)``, delta 12, the fork's
  `bwd_sm90_ds_out` and `vsa_fa4.dq_from_ds_triton`): bitwise reproducible gradients.
  Since session 27 fa4's default for 64x64 blocks (runs before then name it beside ``fa4``).
- ``fa4_ds_backward_one_chunk``: the same with a dS budget of 16 GiB
  (``KernelChoice.ds_budget_bytes``), so that its backward runs in as few head chunks as the
  dQ accumulator's budget allows (Wan 480p: one launch instead of three; 4.8 GB of dS).
- ``fa4_ds_2gib``, ``fa4_ds_4gib``, ``fa4_ds_8gib``: the dS-writing backward with that dS
  budget (the default's head chunks against fewer, larger ones).
- ``fa4_float32_dq``: the 64x64 backward whose dQ goes to L2 by float32 reduce-adds
  (``KernelChoice(backward=KV64_CONFIG)``, delta 8), fa4's default until session 27.
"""

from __future__ import annotations

COPYING_TRITON = "triton_copies"
UNFUSED_TRITON = "triton_unfused"
UNFUSED_FA4 = "fa4_unfused"
UNPACKED_FA4 = "fa4_unpacked"
ZERO_V_PADDING_FA4 = "fa4_zero_v_padding"
DS_BACKWARD_FA4 = "fa4_ds_backward"
DS_BACKWARD_ONE_CHUNK_FA4 = "fa4_ds_backward_one_chunk"
FLOAT32_DQ_FA4 = "fa4_float32_dq"
DS_BUDGET_ARMS = {f"fa4_ds_{n}gib": n << 30 for n in (2, 4, 8)}
OWN_LISTS_FA4 = "fa4_own_lists"
SDPA_COARSE_FA4 = "fa4_sdpa_coarse"
ATTEND_IN_LOOP_FA4 = "fa4_attend_in_loop"
SEPARATE_STAGE = "triton_separate_attention"
"""The coarse stage `SDPA_COARSE_FA4` runs: the Triton stage without its fused attention."""
ATTEND_IN_LOOP_STAGE = "triton_attend_in_loop"
"""The coarse stage `ATTEND_IN_LOOP_FA4` runs: the Triton stage with its attention inside the
score loop."""
_KERNEL_CHOICES = {
    UNPACKED_FA4: {"valid_in_list": False},
    ZERO_V_PADDING_FA4: {"zero_v_padding": True},
}
"""fa4 variants that are a kernel choice: `vsa_fa4.launch.ForwardVariant`'s fields."""
_BACKWARD_CHOICES = {
    DS_BACKWARD_FA4: ("KV64_DS_CONFIG", None),
    DS_BACKWARD_ONE_CHUNK_FA4: ("KV64_DS_CONFIG", 1 << 34),
    **{name: ("KV64_DS_CONFIG", budget) for name, budget in DS_BUDGET_ARMS.items()},
    FLOAT32_DQ_FA4: ("KV64_CONFIG", None),
}
"""fa4 variants whose backward is another tile configuration: its name in
`flash_attn_vsa.bwd_sm90`, and the dS buffer's budget (`KernelChoice.ds_budget_bytes`)."""
_STAGE_OF = {SDPA_COARSE_FA4: SEPARATE_STAGE, ATTEND_IN_LOOP_FA4: ATTEND_IN_LOOP_STAGE}
_SWITCHED_OFF = {
    COPYING_TRITON: ("triton", {"reads_raster": False, "fuses_combine": False}),
    UNFUSED_TRITON: ("triton", {"fuses_combine": False}),
    UNFUSED_FA4: ("fa4", {"fuses_combine": False}),
    OWN_LISTS_FA4: ("fa4", {"reads_forward_split": False}),
}


def register_variant(name: str) -> bool:
    """Register the variant called ``name`` (True), or do nothing for any other name (False)."""
    from vsa_core.backends import register_backend

    if name in _KERNEL_CHOICES or name in _BACKWARD_CHOICES:  # the backend's argument
        from vsa_fa4.backend import FA4Backend
        from vsa_fa4.launch import ForwardVariant, KernelChoice

        if name in _BACKWARD_CHOICES:
            from flash_attn_vsa import bwd_sm90

            config, budget = _BACKWARD_CHOICES[name]
            choice = KernelChoice(backward=getattr(bwd_sm90, config), ds_budget_bytes=budget)
        else:
            choice = KernelChoice(ForwardVariant(**_KERNEL_CHOICES[name]))
        variant = type(name, (FA4Backend,), {"name": name, "priority": -1})
        register_backend(variant(kernels=choice))
        return True
    if name in _STAGE_OF:  # fa4 as shipped beside a variant of the coarse stage
        _register_stage(_STAGE_OF[name])
        from vsa_fa4.backend import FA4Backend

        register_backend(type(name, (FA4Backend,), {"name": name, "priority": -1})())
        return True
    if name not in _SWITCHED_OFF:
        return False

    base_name, switched_off = _SWITCHED_OFF[name]
    if base_name == "triton":
        from vsa_triton.backend import TritonBackend as base
    else:
        from vsa_fa4.backend import FA4Backend as base
    # priority -1: auto never picks a variant
    variant = type(name, (base,), {"name": name, "priority": -1, **switched_off})
    register_backend(variant())
    return True


def coarse_backend_for(arm: str) -> str:
    """The ``coarse_backend`` an arm's op calls pass: its stage variant's name for
    `SDPA_COARSE_FA4` and `ATTEND_IN_LOOP_FA4`, ``"auto"`` for every other arm."""
    return _STAGE_OF.get(arm, "auto")


def _register_stage(name: str) -> None:
    """Add the stage variant ``name`` to vsa-core's stages of this process (a benchmark-only
    entry in the cached table `vsa_core.coarse.coarse_stages` returns; plug-ins come by entry
    point)."""
    from vsa_core.coarse import CoarseStage, coarse_stages
    from vsa_triton.coarse import TritonCoarse

    changed = {
        SEPARATE_STAGE: {"select_and_attend": CoarseStage.select_and_attend},
        ATTEND_IN_LOOP_STAGE: {"attend_after_scores": False},
    }[name]
    variant = type(f"TritonCoarse_{name}", (TritonCoarse,), {"name": name, "priority": -1,
                                                            **changed})  # fmt: skip
    coarse_stages()[name] = variant()

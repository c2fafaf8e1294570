"""The ``fa4`` backend of vsa-core: block-sparse attention on FlashAttention-4's CuTe kernels.

Registered under the ``vsa.backends`` entry-point group as ``fa4`` (priority 20, ahead of
``triton``). ``flash_attn``, ``cutlass`` and the kernels are imported on the first launch,
never with this module: ``supports()`` and ``availability()`` only look for ``flash_attn.cute``
with ``importlib`` and read the device's compute capability.

``supports()`` accepts a call only where upstream FA4 (the release flash-attn-4-vsa pins) runs
it, judged from the logical block shape with the native schedule (the pairing of 64-token
query blocks depends on the layout, which a call description does not carry); every refusal
names its reason, so ``backend="auto"`` falls back to Triton with an explanation.

Padding slots of partial key blocks must hold finite values in V for FA4's kernels, and in K
when gradients flow: they mask the scores by selection (`flash_attn_vsa.mask_sm90`'s column
limit sets them to -inf whatever they were) but multiply the zero probabilities with V, and the
zero dS with K in backward. So the backend declares ``key_padding_safe = False`` and vsa-core's
ops hand it a copy of v with zeroed padding (and of k in training). A backend whose kernel
choice turns on ``ForwardVariant.zero_v_padding`` (`variant_backend`) reads v as it is in
inference with unpaired 64x64 blocks (`FA4Backend.reads_key_padding_as_is`): its forward
zeroes partial blocks' V padding rows in shared memory (the fork's
`experimental.v_padding_sm90`), which saves the copy (peak memory 1.40x of dense instead of
2.62x at Wan 2.1 720p) but costs the op's forward 10-14% (H200, session 25), so the shipped
choice keeps the copy.

Training with 64x64 blocks (sm_90) runs the fork's dS-writing backward by default (delta 12,
`flash_attn_vsa.bwd_sm90_ds_out`, and `vsa_fa4.dq_from_ds_triton`'s dQ pass in list order;
`vsa_fa4.launch.KernelChoice.backward_for`): no float32 reductions across CTAs, so its
gradients are bitwise reproducible, and faster through the whole op than the float32-reduction
backward (``KernelChoice(backward=bwd_sm90.KV64_CONFIG)``, the default until session 27): on an
H100 (2026-12-05, forward+backward, 87.5%, once / back to back) 2.95x / 3.23x of dense against
2.57x / 2.91x at Wan 2.1 480p, 3.42x / 3.44x against 2.45x / 2.47x at 720p. It holds a dS
buffer of 8 KB a selected block pair, at most `vsa_fa4.ops.DS_BUDGET_BYTES` a launch (head
chunks beyond it): peak memory 5.9 GB beyond the inputs at Wan 480p against 1.3 GB.

``deterministic=True``: the forward is bitwise reproducible (one CTA per query tile walking its
key list in order, no reduction across CTAs, no split over keys). With gradients, 64x64 blocks
on sm_90 run the dS-writing backward on the native plan (`FA4Backend.for_call` hands such
calls this backend's kernel choice on the native plan: a paired plan's backward is 128x64).
Other calls refuse (`DETERMINISTIC_BACKWARD_REFUSAL` says why).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
from typing import TYPE_CHECKING, ClassVar

import torch

from vsa_core.backends.base import AttentionCall, Backend
from vsa_core.host_cache import resolved_once
from vsa_fa4.schedule import (
    ARCHS,
    BLOCK_SHAPES,
    HEAD_DIMS,
    SCHEDULES,
    Plan,
    make_plan,
    native_plan,
    plan_refusal,
)

if TYPE_CHECKING:
    from vsa_core.layout import BlockSparseLayout
    from vsa_fa4.launch import ForwardVariant, KernelChoice

DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def find_flash_attn_cute() -> bool:
    """Whether ``flash_attn.cute`` is installed, without importing it (cached per process).

    ``find_spec`` of a submodule imports the parent package, so look for ``flash_attn`` first
    and then resolve ``cute`` against its search path without executing ``flash_attn``.
    """
    try:
        parent = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return False
    if parent is None or parent.submodule_search_locations is None:
        return False
    search_path = list(parent.submodule_search_locations)
    return importlib.machinery.PathFinder.find_spec("flash_attn.cute", search_path) is not None


NOT_INSTALLED = "flash_attn.cute (flash-attn-4) is not installed"
ARCH_NAMES = " or ".join(ARCHS.values())


def _capable_devices() -> list[str]:
    found = []
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        if capability in ARCHS:
            found.append(f"cuda:{index} ({ARCHS[capability]})")
    return found


def _shape(block_shape: tuple[int, int]) -> str:
    return f"{block_shape[0]}x{block_shape[1]}"


TRITON_FIRST_FROM_QUERY_LEN = 115_000
TRAINING_RULE = """Where ``backend="auto"`` puts Triton ahead of fa4: training (forward+backward)
with 64-token query blocks that cannot pair onto 128-row tiles (the coarse stage's own
layouts), partial key blocks (a latent whose sides are not multiples of the tile), on sm_90,
from `TRITON_FIRST_FROM_QUERY_LEN` query tokens a (batch, head) sequence. Everywhere else fa4.

Measured on an H200 (whole op `video_sparse_attn`, 87.5%, coarse gate, every arm called once
and waited for, in alternation with dense FA4; `bench_video.py --arms auto fa4 triton
fastvideo`), speedup over dense, forward+backward, fa4 / triton. Session 20 (2026-12-02,
benchmarks/results/2026-12-02-h200-bench_video-train-delta10.json, 5 rounds, with fa4's
forward reading partial blocks' valid sizes from its lists, the fork's delta 10), and the
aligned latent from session 16 (2026-12-02-h200-bench_video-four-latents-balanced.json):

| latent, heads | tokens a head | query rows | partial tiles | fa4 | triton |
|---|---|---|---|---|---|
| Wan 480p 21x30x52, 12 | 39,936 | 0.48 M | yes | **2.94x** | 2.55x |
| Wan 720p 21x45x80, 40 | 92,160 | 3.7 M | yes | **3.52x** | 3.39x |
| HunyuanVideo 33x45x80, 24 | 138,240 | 3.3 M | yes | 3.24x | **3.51x** |
| aligned 20x44x80, 40 | 70,400 | 2.8 M | no | **5.52x** | 4.55x |

Query rows (batch x heads x tokens) no longer separate the columns: HunyuanVideo has fewer rows
than Wan 720p and is the one Triton wins; the tokens of one head do. Session 16, before delta
10, had Wan 720p at 3.38x / 3.39x (a tie) and the threshold at a million query rows. The
threshold lies between the measured 92,160 and 138,240 tokens. Inference (forward) runs faster
on fa4 in every measured cell.

Since session 27 fa4 trains 64x64 blocks on its dS-writing backward. On an H100 (2026-12-05,
benchmarks/results/2026-12-05-h100-bench_video-ds-hunyuan.json) HunyuanVideo then ran fa4
3.44x / 3.43x (once / back to back; its float32-reduction backward 2.28x) against triton
3.38x / 3.41x: a tie, at 1.9x triton's peak memory (12.1 against 6.5 GB), so triton stays
first there. Regenerate with the command in benchmarks/README.md ("Auto's
rule") and move the threshold if the crossing moves."""


DETERMINISTIC_BACKWARD_REFUSAL = (
    "deterministic=True with gradients runs on fa4 for 64x64 blocks on sm_90 only (the fork's "
    "dS-writing backward, flash_attn_vsa.bwd_sm90_ds_out, with a dQ pass in list order). "
    "Elsewhere FA4's block-sparse backward is not bitwise reproducible: one CTA per key tile "
    "computes dK and dV in registers (deterministic) and, per query tile of its list, a float32 "
    "dQ partial dS K that it adds into a float32 dQ accumulator in global memory with bulk "
    "reduce-adds, in the order the CTAs run, and float32 addition is not associative. "
    "Upstream's semaphore-ordered deterministic backward is not implemented for block sparsity "
    "on sm_90. The forward has no reduction across CTAs: inference calls (no gradient) are "
    "accepted"
)

DETERMINISTIC_BLOCK_SHAPE = (64, 64)
"""The block shape whose training calls fa4 runs deterministically (on sm_90)."""


class FA4Backend(Backend):
    """Block-sparse attention through FlashAttention-4's CuTe kernels (sm_90, sm_100).

    ``schedule`` picks the physical tiles (see `vsa_fa4.schedule`): ``"auto"`` (what the
    registry instantiates), ``"native"`` or ``"paired"``. To run the registry's ``fa4`` with
    another schedule, ``vsa_core.backends.register_backend(FA4Backend(schedule="native"))``.
    ``kernels`` picks the fork's kernels (`vsa_fa4.launch.KernelChoice`, default the shipped
    ones), passed down with every call; ``name`` registers such a backend beside ``fa4``
    (`variant_backend` does both for a forward variant).
    """

    name: ClassVar[str] = "fa4"
    priority: ClassVar[int] = 20
    key_padding_safe: ClassVar[bool] = False  # see the module doc
    handles_deterministic: ClassVar[bool] = True  # forward only: see the module doc
    fuses_combine: ClassVar[bool] = True  # in the 64x64 forward's epilogue, else a second pass
    # The 64x64 forward (combined in inference, with lse in training) reads a layout's
    # ForwardSplit, written by the coarse stage's selection pass: one list launch fewer a
    # call (in training since session 24, not yet timed on a GPU there). H200, 2026-12-02,
    # bench_video (results 2026-12-02-h200-bench_video-{presplit,attend}), inference: Wan 480p
    # forward once 2.0% and 3.4% faster, back to back equal; Wan 720p -1.6% in the first run
    # (before the selection kernel computed the coarse attention), +0.5% once and equal back
    # to back in the second. The benchmark variant fa4_own_lists (benchmarks/bench_variants.py)
    # keeps the old path.
    reads_forward_split: ClassVar[bool] = True

    def __init__(
        self, schedule: str = "auto", kernels: KernelChoice | None = None, name: str | None = None
    ) -> None:
        from vsa_fa4.launch import SHIPPED, KernelChoice

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if kernels is not None and not isinstance(kernels, KernelChoice):
            raise ValueError(f"kernels must be a vsa_fa4.launch.KernelChoice, got {kernels!r}")
        self.schedule = schedule
        self.kernels = SHIPPED if kernels is None else kernels
        if name is not None:
            self.name = name  # type: ignore[misc]  # this instance's registry name

    def availability(self) -> str | None:
        if not find_flash_attn_cute():
            return NOT_INSTALLED
        if not torch.cuda.is_available():
            return f"no CUDA device (FA4's CuTe kernels need {ARCH_NAMES})"
        if not _capable_devices():
            return f"no CUDA device of capability {ARCH_NAMES}"
        return None

    def supports(self, call: AttentionCall) -> str | None:
        reason = self._call_refusal(call)
        if reason is not None:
            return reason
        if call.deterministic and call.requires_grad and not self._backward_deterministic(call):
            return DETERMINISTIC_BACKWARD_REFUSAL
        return plan_refusal(
            call.capability, call.head_dim, native_plan(call.block_shape), call.requires_grad
        )

    def _backward_deterministic(self, call: AttentionCall) -> bool:
        """Whether this backend can run ``call``'s backward bitwise reproducibly: 64x64 blocks
        on sm_90, with the shipped backward (which `for_call` replaces) or the dS-writing one."""
        backward = self.kernels.backward
        return (
            tuple(call.block_shape) == DETERMINISTIC_BLOCK_SHAPE
            and call.capability == (9, 0)
            and (backward is None or backward.dq_from_ds)
        )

    def for_call(self, call: AttentionCall) -> FA4Backend:
        """Deterministic training (64x64 blocks, sm_90: `supports` accepts no other): this
        backend's forward with the dS-writing backward, on the native plan (its backward is
        64x64); every other call: this backend."""
        if not (call.deterministic and call.requires_grad):
            return self
        return _deterministic_twin(self)

    def reads_key_padding_as_is(self, call: AttentionCall) -> bool:
        """True for inference with unpaired 64x64 blocks on sm_90 when the kernel choice runs
        the two-CTA forward that zeroes V's padding rows in shared memory (not shipped);
        the rare such call that its kernel does not cover (2^16 key blocks or more) gets its
        zeroed copy of v here (`_v_for_kernels`)."""
        return (
            not call.requires_grad
            and call.capability == (9, 0)
            and self._forward_zeroes_v_padding(tuple(call.block_shape), call.q_group_size)
        )

    def _forward_zeroes_v_padding(self, block_shape: tuple[int, int], q_group_size: int) -> bool:
        """Whether this backend's forward of such a layout runs the kernel that zeroes partial
        blocks' V padding (before the key-block count, `vsa_fa4.launch.zeroes_v_padding`):
        the native 64x64 plan (query blocks never paired) and a kernel choice that zeroes."""
        variant = self.kernels.forward
        if not variant.zero_v_padding or q_group_size % 2 == 0 or self.schedule == "paired":
            return False  # the shipped choice stops here, on every forward, without an import
        from vsa_fa4.launch import may_zero_v_padding

        return may_zero_v_padding(block_shape, variant)

    def _v_for_kernels(
        self, q: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout, requires_grad: bool
    ) -> torch.Tensor:
        """v as the kernels read it: a zeroed copy where `reads_key_padding_as_is` let the
        ops skip theirs but this call's kernel does not zero V's padding (too many key
        blocks for the list entries); v itself everywhere else."""
        if (
            requires_grad
            or layout.kv_blocks_full
            or not self._forward_zeroes_v_padding(layout.block_shape, layout.q_group_size)
        ):
            return v
        from vsa_fa4.launch import zeroes_v_padding

        if zeroes_v_padding(q, layout.kv_valid_sizes, (64, 64), self.kernels.forward):
            return v
        from vsa_core.coarse import zero_padding

        return zero_padding(v, layout.kv_valid_sizes)

    def priority_for(self, call: AttentionCall) -> int:
        """Below Triton (10) where Triton's whole op measured faster (`TRAINING_RULE`), else
        `priority`."""
        return 5 if self.ranking_note(call) else self.priority

    def ranking_note(self, call: AttentionCall) -> str | None:
        """`TRAINING_RULE`'s verdict for ``call``: why fa4 steps behind Triton, or None."""
        unpaired_q64 = call.block_shape[0] == 64 and call.q_group_size % 2
        if (
            call.capability == (9, 0)
            and unpaired_q64
            and call.requires_grad
            and not call.kv_blocks_full
            and call.query_len >= TRITON_FIRST_FROM_QUERY_LEN
        ):
            return (
                "below triton: training with unpaired 64-row query blocks, partial key blocks "
                f"and >= {TRITON_FIRST_FROM_QUERY_LEN:,} query tokens a head on sm_90 "
                "(whole op measured faster on triton; vsa_fa4.backend.TRAINING_RULE)"
            )
        return None

    def _call_refusal(self, call: AttentionCall) -> str | None:
        """Refusals that do not depend on the schedule."""
        if not find_flash_attn_cute():
            return NOT_INSTALLED
        if tuple(call.block_shape) not in BLOCK_SHAPES:
            shapes = ", ".join(_shape(s) for s in BLOCK_SHAPES)
            return f"block shape {_shape(call.block_shape)} not in {shapes}"
        if call.head_dim not in HEAD_DIMS:
            return f"head dim {call.head_dim} not in {HEAD_DIMS}, the head dims vsa-fa4 runs"
        if call.dtype not in DTYPES:
            return f"dtype {call.dtype} not supported (float16, bfloat16)"
        if call.device.type != "cuda":
            return f"needs a CUDA device ({ARCH_NAMES}), got {call.device.type}"
        return None

    def plan(self, layout: BlockSparseLayout, schedule: str | None = None) -> Plan:
        """The physical plan this backend runs ``layout`` with (``schedule`` overrides the
        backend's own)."""
        return make_plan(
            layout.block_shape,
            layout.q_group_size,
            layout.num_q_blocks,
            self.schedule if schedule is None else schedule,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockSparseLayout,
        scale: float,
        schedule: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from vsa_fa4.ops import attention

        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        plan = _checked_plan(
            self.schedule if schedule is None else schedule, q.device, q.dtype, q.shape[-1],
            layout.block_shape, layout.q_group_size, layout.num_q_blocks, requires_grad,
        )  # fmt: skip
        v = self._v_for_kernels(q, v, layout, requires_grad)
        return attention(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, scale, plan,
            layout.q_group_size, layout.kv_blocks_full, self.kernels, layout.forward_split,
        )  # fmt: skip

    def forward_combined(self, q, k, v, layout, scale, coarse, gate, slot_rows=None):
        """VSA's ``fine + gate * coarse`` for inference: in the 64x64 forward's epilogue
        (`flash_attn_vsa.combine_sm90`), on other plans the forward and one in-place
        multiply-add (`vsa_fa4.ops.attention_combined`). Tile order only (``slot_rows`` must
        be None: fa4 does not read raster rows)."""
        from vsa_fa4.ops import attention_combined

        if slot_rows is not None:
            raise ValueError("the fa4 backend reads tile order only (slot_rows must be None)")
        plan = _checked_plan(
            self.schedule, q.device, q.dtype, q.shape[-1], layout.block_shape,
            layout.q_group_size, layout.num_q_blocks, False,
        )  # fmt: skip
        v = self._v_for_kernels(q, v, layout, False)
        return attention_combined(
            q, k, v, layout.kv_indices, layout.kv_counts, layout.kv_valid_sizes, scale, plan,
            coarse, gate, layout.q_group_size, layout.kv_blocks_full, self.kernels,
            layout.forward_split,
        )  # fmt: skip


def _deterministic_twin(backend: FA4Backend) -> FA4Backend:
    """``backend`` on the native plan (its 64x64 backward writes dS: the default, or its kernel
    choice's own dS-writing one with its budget; `FA4Backend.supports` refused every other
    choice), under its name: ``backend`` itself when it is native already."""
    if backend.schedule == "native":
        return backend
    return FA4Backend("native", backend.kernels, name=backend.name)


@resolved_once
def _checked_plan(
    schedule: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_shape: tuple[int, int],
    q_group_size: int,
    num_q_blocks: int,
    requires_grad: bool,
) -> Plan:
    """The physical plan of a call so described, or ValueError with the reason fa4 cannot run
    it (decided once per description: every forward asks)."""
    call = AttentionCall(device, dtype, head_dim, block_shape, requires_grad, q_group_size)
    backend = FA4Backend(schedule)
    reason = backend._call_refusal(call)
    plan = None
    if reason is None:
        plan = make_plan(block_shape, q_group_size, num_q_blocks, schedule)
        reason = plan_refusal(call.capability, head_dim, plan, requires_grad)
    if reason is not None:
        where = "" if plan is None else f" with physical blocks {_shape(plan.block_size)}"
        raise ValueError(f"the fa4 backend cannot run this call{where}: {reason}")
    assert plan is not None
    return plan


def variant_backend(variant: ForwardVariant) -> str:
    """The registry name of an fa4 backend that runs the fork's forward ``variant`` (registered
    on first use as ``fa4+LABEL``, `ForwardVariant.label`; the shipped variant is ``fa4``
    itself): benchmarks pass it as ``backend=`` to compare experimental kernels through the
    whole op, each call naming what it runs."""
    from vsa_core.backends import backend_entries, register_backend
    from vsa_fa4.launch import SHIPPED_FORWARD, ForwardVariant, KernelChoice

    if not isinstance(variant, ForwardVariant):
        raise ValueError(f"variant must be a vsa_fa4.launch.ForwardVariant, got {variant!r}")
    if variant == SHIPPED_FORWARD:
        return FA4Backend.name
    name = f"{FA4Backend.name}+{variant.label}"
    entry = backend_entries().get(name)
    if entry is None or getattr(entry.backend, "kernels", None) != KernelChoice(variant):
        register_backend(FA4Backend(kernels=KernelChoice(variant), name=name))
    return name

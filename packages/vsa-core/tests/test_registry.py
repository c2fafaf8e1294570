"""Backend discovery and selection rules, with fake backends registered for the test only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vsa_core import BlockSparseLayout, block_sparse_attn, video_sparse_attn
from vsa_core.backends import (
    ENTRY_POINT_GROUP,
    OVERRIDE_ENV,
    AttentionCall,
    Backend,
    backend_entries,
    explain,
    get_backend,
    register_backend,
    select_backend,
    unregister_backend,
)
from vsa_core.backends import registry as registry_module
from vsa_core.backends.reference import ReferenceBackend
from vsa_core.backends.registry import BackendEntry

pytestmark = pytest.mark.usefixtures("no_backend_override")


def _call(dtype=torch.float32, device="cpu", requires_grad=False):
    return AttentionCall(
        device=torch.device(device),
        dtype=dtype,
        head_dim=4,
        block_shape=(4, 4),
        requires_grad=requires_grad,
    )


class FakeBackend(Backend):
    """Accepts float32 calls only; records every forward call and answers a constant."""

    def __init__(self, name="fake-test", priority=1000, accept=True):
        self.name = name  # instance attributes shadow the ClassVars
        self.priority = priority
        self.accept = accept
        self.calls = []

    def supports(self, call):
        if not self.accept:
            return f"{self.name} refuses everything"
        if call.dtype != torch.float32:
            return f"{self.name} needs float32, got {call.dtype}"
        return None

    def forward(self, q, k, v, layout, scale):
        self.calls.append((q, k, v, layout, scale))
        batch, seq, heads, _ = q.shape
        lse = torch.full((batch, heads, seq), 42.0)
        return torch.full_like(q, 7.0), lse


def _inputs(dtype=torch.float32):
    q = torch.randn(1, 8, 2, 4, dtype=dtype)
    k = torch.randn(1, 8, 2, 4, dtype=dtype)
    layout = BlockSparseLayout.from_block_mask(
        torch.ones(1, 2, 2, 2, dtype=torch.bool), torch.full((2,), 4), (4, 4)
    )
    return q, k, k.clone(), layout


def test_reference_backend_is_discovered_and_accepts_everything():
    entries = backend_entries()
    assert "reference" in entries
    entry = entries["reference"]
    assert entry.load_error is None
    assert isinstance(entry.backend, ReferenceBackend)
    assert entry.origin == "vsa_core.backends.reference:ReferenceBackend"
    assert isinstance(get_backend("reference"), ReferenceBackend)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for device in ("cpu", "meta"):
            for grad in (False, True):
                assert entry.backend.supports(_call(dtype, device, grad)) is None
    assert entry.backend.availability() is None
    assert ENTRY_POINT_GROUP == "vsa.backends"


def test_auto_on_cpu_falls_back_to_reference():
    # The installed GPU backends refuse CPU calls; the reference accepts everything.
    assert isinstance(select_backend(_call()), ReferenceBackend)
    assert isinstance(select_backend(_call(), "auto"), ReferenceBackend)
    rows = dict(explain(_call()))
    assert rows["reference"] is None


def test_auto_picks_highest_priority_accepting(fresh_registry):
    high = FakeBackend("fake-high", priority=1000)
    mid = FakeBackend("fake-mid", priority=500)
    refuses = FakeBackend("fake-top", priority=2000, accept=False)
    for b in (high, mid, refuses):
        register_backend(b)
    assert select_backend(_call()) is high
    # explain lists every backend, highest priority first, with refusal reasons.
    rows = explain(_call())
    names = [n for n, _ in rows]
    assert names[:3] == ["fake-top", "fake-high", "fake-mid"]
    assert rows[0][1] == "fake-top refuses everything"
    # For a call the fakes refuse, auto goes down the list to the reference.
    assert isinstance(select_backend(_call(torch.float64)), ReferenceBackend)
    unregister_backend("fake-high")
    assert select_backend(_call()) is mid
    unregister_backend("fake-mid")
    assert isinstance(select_backend(_call()), ReferenceBackend)


def test_auto_ranks_by_priority_for_the_call(fresh_registry):
    """A backend may step back for some calls (e.g. where another is measured faster)."""

    class SteppingBack(FakeBackend):
        def priority_for(self, call):
            return 1 if call.q_group_size == 1 else self.priority

    stepping = SteppingBack("fake-stepping", priority=1000)
    other = FakeBackend("fake-other", priority=500)
    register_backend(stepping)
    register_backend(other)
    assert select_backend(_call()) is other
    names = [n for n, _ in explain(_call())]
    assert names.index("fake-other") < names.index("fake-stepping")
    paired = dataclasses.replace(_call(), q_group_size=2)
    assert select_backend(paired) is stepping
    q, k, v, layout = _inputs()
    assert AttentionCall.describe(q, k, v, layout).q_group_size == layout.q_group_size == 1
    assert AttentionCall.describe(q, k, v, layout.refine((2, 4))).q_group_size == 2


def test_env_override_applies_to_auto_only(fresh_registry, monkeypatch):
    fake = FakeBackend("fake-env", priority=-100)  # lowest priority: auto alone never picks it
    register_backend(fake)
    assert isinstance(select_backend(_call()), ReferenceBackend)
    monkeypatch.setenv(OVERRIDE_ENV, "  fake-env ")
    assert select_backend(_call()) is fake
    assert select_backend(_call(), "auto") is fake
    # An explicit name in code wins over the variable.
    assert isinstance(select_backend(_call(), "reference"), ReferenceBackend)
    # The override is not a fallback: if it refuses, the call fails and names the variable.
    with pytest.raises(
        ValueError,
        match=rf"^{OVERRIDE_ENV}='fake-env' \(environment variable\) cannot run this call",
    ):
        select_backend(_call(torch.float64))
    monkeypatch.setenv(OVERRIDE_ENV, "no-such-backend")
    with pytest.raises(ValueError, match=rf"^{OVERRIDE_ENV} \(environment variable\) must be"):
        select_backend(_call())
    monkeypatch.setenv(OVERRIDE_ENV, "   ")  # blank: no override
    assert isinstance(select_backend(_call()), ReferenceBackend)


def test_misspelt_env_override_names_the_variable(monkeypatch):
    # Issue 21, row 8: the error said "backend must be one of ...", as if the code had passed
    # the name, not the environment.
    monkeypatch.setenv(OVERRIDE_ENV, "refrence")
    with pytest.raises(ValueError) as info:
        select_backend(_call())
    message = str(info.value)
    assert message.startswith(f"{OVERRIDE_ENV} (environment variable) must be one of ")
    assert message.endswith("got 'refrence'") and "reference" in message
    q, k, v, layout = _inputs()
    with pytest.raises(ValueError, match=rf"^{OVERRIDE_ENV} \(environment variable\)"):
        block_sparse_attn(q, k, v, layout)
    # An explicit name in code still says "backend".
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        select_backend(_call(), "refrence")


def test_unusable_backend_named_by_the_env_override(fresh_registry, monkeypatch):
    broken = BackendEntry("broken-env", None, "failed to load: ImportError: no module", "x:Y")
    monkeypatch.setattr(registry_module, "backend_entries", lambda: {"broken-env": broken})
    monkeypatch.setenv(OVERRIDE_ENV, "broken-env")
    with pytest.raises(
        ValueError,
        match=rf"^{OVERRIDE_ENV} \(environment variable\) names backend 'broken-env', which is",
    ):
        select_backend(_call())
    with pytest.raises(ValueError, match=r"^backend 'broken-env' is installed but unusable"):
        get_backend("broken-env")


def test_env_override_reaches_the_ops(fresh_registry, monkeypatch):
    fake = FakeBackend("fake-env-op", priority=-100)
    register_backend(fake)
    monkeypatch.setenv(OVERRIDE_ENV, "fake-env-op")
    q, k, v, layout = _inputs()
    out, _ = block_sparse_attn(q, k, v, layout)
    assert len(fake.calls) == 1 and bool((out == 7).all())
    out, _ = block_sparse_attn(q, k, v, layout, backend="reference")
    assert len(fake.calls) == 1 and not bool((out == 7).all())


def test_named_backend_that_refuses_raises_with_reason(fresh_registry):
    register_backend(FakeBackend("fake-picky"))
    with pytest.raises(ValueError, match=r"backend='fake-picky' cannot run this call: .*float32"):
        select_backend(_call(torch.float16), "fake-picky")
    q, k, v, layout = _inputs(torch.float64)
    with pytest.raises(ValueError, match="fake-picky needs float32"):
        block_sparse_attn(q, k, v, layout, backend="fake-picky")


def test_unknown_backend_lists_known_names():
    with pytest.raises(ValueError, match="backend must be one of") as info:
        select_backend(_call(), "does-not-exist")
    message = str(info.value)
    assert "'does-not-exist'" in message
    for name in ("auto", "reference", *backend_entries()):
        assert name in message
    with pytest.raises(ValueError, match="backend must be a backend name or 'auto'"):
        select_backend(_call(), None)


def test_fake_backend_forward_is_called_by_the_ops(fresh_registry):
    fake = FakeBackend("fake-forward")
    register_backend(fake)
    q, k, v, layout = _inputs()
    out, lse = block_sparse_attn(q, k, v, layout, backend="auto", scale=0.25)
    assert len(fake.calls) == 1
    fq, fk, fv, flayout, fscale = fake.calls[0]
    assert fq is q and fk is k and fv is v and flayout is layout and fscale == 0.25
    assert bool((out == 7).all()) and bool((lse == 42).all())

    # BHSD inputs reach the backend as BSHD views of the same storage.
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, _ = block_sparse_attn(qh, kh, vh, layout, qkv_format="bhsd")
    fq = fake.calls[-1][0]
    assert fq.shape == q.shape and fq.data_ptr() == qh.data_ptr()
    assert out.shape == qh.shape

    # video_sparse_attn runs its fine stage on the chosen backend too.
    vq = torch.randn(1, 8, 2, 4)
    valid = torch.tensor([4, 4], dtype=torch.int32)
    before = len(fake.calls)
    video_sparse_attn(vq, vq, vq, topk=1, kv_valid_sizes=valid, backend="fake-forward")
    assert len(fake.calls) == before + 1
    assert fake.calls[-1][3].block_shape == (4, 4)


def test_register_replaces_and_shadows(fresh_registry):
    first, second = FakeBackend("fake-dup", priority=1), FakeBackend("fake-dup", priority=2)
    register_backend(first)
    register_backend(second)
    assert get_backend("fake-dup") is second
    shadow = FakeBackend("reference", priority=0)
    register_backend(shadow)
    assert get_backend("reference") is shadow
    assert backend_entries()["reference"].origin == "register_backend"
    unregister_backend("reference")
    assert isinstance(get_backend("reference"), ReferenceBackend)
    unregister_backend("never-registered")  # no error


def test_register_rejects_non_backends():
    with pytest.raises(ValueError, match="backend must be a Backend instance"):
        register_backend(object())
    with pytest.raises(ValueError, match="non-empty name"):
        register_backend(FakeBackend(""))


def test_attention_call_describe():
    q, k, v, layout = _inputs()
    call = AttentionCall.describe(q, k, v, layout)
    assert call.device == torch.device("cpu") and call.dtype == torch.float32
    assert call.head_dim == 4 and call.block_shape == (4, 4)
    assert not call.requires_grad and call.capability is None
    assert AttentionCall.describe(q, k.requires_grad_(), v, layout).requires_grad
    with torch.no_grad():
        assert not AttentionCall.describe(q, k, v, layout).requires_grad


def test_broken_plugin_is_reported_not_raised(fresh_registry, monkeypatch):
    from vsa_core.backends import registry

    class BrokenEntryPoint:
        name = "fake-broken"
        value = "nowhere:Nothing"

        def load(self):
            raise ImportError("no module named nowhere")

    real = registry.entry_points

    def fake_entry_points(group):
        return [*real(group=group), BrokenEntryPoint()]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    registry._discovered.cache_clear()
    try:
        entries = backend_entries()
        assert entries["fake-broken"].backend is None
        assert "ImportError" in entries["fake-broken"].load_error
        assert isinstance(select_backend(_call()), ReferenceBackend)  # auto skips it
        with pytest.raises(ValueError, match="'fake-broken' is installed but unusable"):
            get_backend("fake-broken")
    finally:
        monkeypatch.undo()
        registry._discovered.cache_clear()
    assert "fake-broken" not in backend_entries()

"""`vsa_triton.launch_cache`: which calls launch directly, with which arguments,
and which run through Triton's own launch. On a CPU a real ``triton.jit`` kernel stands in,
its ``run`` replaced by a fake that returns one fake compiled kernel per specialization key
(as Triton's cache does) and records the launches; ``test_gpu.py`` runs real kernels."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from vsa_triton import launch_cache  # noqa: E402


def _body(x_ptr, n, scale, flag, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    pass


class FakeCompiled:
    def __init__(self, key):
        self.key = key
        self.function, self.packed_metadata = f"function{key}", f"metadata{key}"
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


@pytest.fixture
def kernel(monkeypatch):
    """A JIT kernel whose launches Triton never compiles: ``kernel.slow`` lists the calls that
    went through ``kernel[grid]``, ``kernel.compiled`` the fake compiled kernels by key."""
    jit = triton.jit(_body)
    assert isinstance(jit, JITFunction)
    jit.slow, jit.compiled = [], {}
    jit.split_by = lambda args, kwargs: (args[0].data_ptr() % 16 == 0,)

    def run(*args, grid, warmup, **kwargs):
        key = jit.split_by(args, kwargs)
        jit.slow.append((grid, args, kwargs))
        return jit.compiled.setdefault(key, FakeCompiled(key))

    monkeypatch.setattr(jit, "run", run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    direct = []
    monkeypatch.setattr(
        launch_cache,
        "_run",
        lambda compiled, grid, values: direct.append((compiled, grid, values)),
    )
    jit.direct = direct
    return jit


def test_a_description_launches_directly_from_its_third_call_with_every_argument(kernel):
    x = torch.zeros(64)
    for _ in range(4):
        launch_cache.launch(kernel, (3, 2), x, 7, 0.5, True, BLOCK=64, num_warps=4)
    assert len(kernel.slow) == launch_cache.ATTEMPTS == 2
    assert len(kernel.direct) == 2
    compiled, grid, values = kernel.direct[-1]
    assert compiled is kernel.compiled[(True,)] and grid == (3, 2)
    assert values[0] is x and values[1:] == [7, 0.5, True, 64, 3]  # EXTRA's default filled in


def test_what_triton_specializes_on_starts_a_new_description(kernel):
    """Another alignment, int value, dtype, constexpr or option: Triton's own launch again."""
    x = torch.zeros(64)
    base = ((x, 7, 0.5, True), {"BLOCK": 64})
    calls = [
        base,
        ((x[1:], 7, 0.5, True), {"BLOCK": 64}),  # 4 bytes past: not 16-byte aligned
        ((x, 8, 0.5, True), {"BLOCK": 64}),
        ((x.double(), 7, 0.5, True), {"BLOCK": 64}),
        ((x, 7, 0.5, True), {"BLOCK": 128}),
        ((x, 7, 0.5, True), {"BLOCK": 64, "num_warps": 8}),
        ((x, 7, 0.25, True), {"BLOCK": 64}),  # a float's value (finer than Triton: allowed)
        ((x.clone(), 7, 0.5, True), {"BLOCK": 64}),  # another tensor alike: base's description
    ]
    for args, kwargs in calls:
        launch_cache.launch(kernel, (1,), *args, **kwargs)
    assert len(kernel.slow) == len(calls) and not kernel.direct
    launch_cache.launch(kernel, (1,), *base[0], **base[1])  # the clone's call was its second
    assert len(kernel.slow) == len(calls) and len(kernel.direct) == 1
    launch_cache.launch(kernel, (1,), *calls[1][0], **calls[1][1])  # the others' second
    assert len(kernel.slow) == len(calls) + 1 and len(kernel.direct) == 1


def test_two_compiled_kernels_for_one_description_leave_it_to_triton(kernel):
    x = torch.zeros(64)
    calls = iter(range(100))
    kernel.split_by = lambda args, kwargs: (next(calls),)  # a specialization the key misses
    for _ in range(5):
        launch_cache.launch(kernel, (1,), x, 7, 0.5, True, BLOCK=64)
    assert len(kernel.slow) == 5 and not kernel.direct


def test_launches_directly_says_when_a_description_went_direct(kernel):
    x = torch.zeros(64)
    for call in range(launch_cache.ATTEMPTS + 1):
        assert launch_cache.launches_directly(kernel) == (call == launch_cache.ATTEMPTS)
        launch_cache.launch(kernel, (1,), x, 7, 0.5, True, BLOCK=64)
    calls = iter(range(100))
    kernel.split_by = lambda args, kwargs: (next(calls),)  # left to Triton for good
    for _ in range(3):
        launch_cache.launch(kernel, (1,), x, 8, 0.5, True, BLOCK=64)
    assert launch_cache.launches_directly(kernel)  # the first description still goes direct


def test_launch_hooks_and_undescribed_arguments_run_through_triton(kernel, monkeypatch):
    """An unhashable constexpr, a tensor subclass (its description would hold it), a hook."""
    x = torch.zeros(64)
    for _ in range(3):
        launch_cache.launch(kernel, (1,), x, 7, 0.5, True, BLOCK=[64])  # unhashable constexpr
        launch_cache.launch(kernel, (1,), torch.nn.Parameter(x), 7, 0.5, True, BLOCK=64)
    assert len(kernel.slow) == 6 and not kernel.direct
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hook, "calls", [lambda *a: None])
    for _ in range(3):
        launch_cache.launch(kernel, (1,), x, 7, 0.5, True, BLOCK=64)
    assert len(kernel.slow) == 9 and not kernel.direct


def test_a_call_missing_an_argument_goes_to_triton_for_its_error(kernel):
    for _ in range(3):
        launch_cache.launch(kernel, (1,), torch.zeros(4), 7, 0.5, True)  # no BLOCK
    assert len(kernel.slow) == 3 and not kernel.direct


def test_functions_that_are_not_jit_kernels_are_called_as_they_are():
    """The interpreter's functions (and autotuners) launch as ``kernel[grid](...)``."""
    seen = []

    class NotJit:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, args, kwargs))

    for _ in range(3):
        launch_cache.launch(NotJit(), (2,), 1, BLOCK=4)
    assert seen == [((2,), (1,), {"BLOCK": 4})] * 3

"""What the fork's sm_90 deltas share (`flash_attn_vsa.sm90_blocks`): the scoped compile cache
and the launch bound, on the CPU (no upstream needed)."""

from __future__ import annotations

from flash_attn_vsa.sm90_blocks import BoundLauncher, ScopedCompileCache


class _Upstream(dict):
    """A stand-in for an upstream compile cache: a dict with one extra attribute."""

    name = "upstream-cache"


def test_scoped_cache_keeps_each_scope_apart_and_upstream_untouched():
    upstream = _Upstream(shared=1)
    current: list[object] = [None]
    cache = ScopedCompileCache(upstream, lambda: current[0])

    assert "shared" in cache and cache["shared"] == 1  # no scope: upstream's entries
    current[0] = "kernel-a"
    assert "shared" not in cache  # a scope sees only its own
    cache["k"] = "compiled-a"
    current[0] = "kernel-b"
    assert "k" not in cache
    cache["k"] = "compiled-b"
    current[0] = "kernel-a"
    assert cache["k"] == "compiled-a"
    current[0] = None
    assert "k" not in cache and dict(upstream) == {"shared": 1}
    assert cache.name == "upstream-cache"  # anything else is upstream's


class _Launcher:
    def __init__(self):
        self.kwargs = None
        self.other = "kept"

    def launch(self, *args, **kwargs):
        self.kwargs = kwargs
        return "launched"


def test_bound_launcher_asks_for_its_ctas_per_sm_and_the_whole_carveout():
    inner = _Launcher()
    bound = BoundLauncher(inner, 2)
    assert bound.launch(grid=(1, 1, 1), min_blocks_per_mp=1) == "launched"
    assert inner.kwargs == {
        "grid": (1, 1, 1),
        "min_blocks_per_mp": 2,
        "preferred_smem_carveout": 100,
    }
    assert bound.other == "kept"

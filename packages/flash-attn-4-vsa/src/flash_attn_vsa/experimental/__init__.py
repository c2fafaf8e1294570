"""The fork's kernels and configurations that ``vsa-fa4`` does not run by default.

Each is correct (its GPU tests pass on an H200) but was measured slower than what ships, or is
kept to compare against it; they run only on request:

- `flash_attn_vsa.experimental.fwd_sm90_streams` (delta 6, its body in `streams_sm90`): two
  64-row query streams per 128-row tile, when ``ForwardVariant(two_streams=True)`` is passed to
  ``vsa_fa4.launch.run_forward`` (or carried by a ``vsa_fa4.launch.KernelChoice``);
- `flash_attn_vsa.experimental.persistent_sm90` (delta 7): persistent CTAs walking the tiles of
  the fork's forwards, with ``ForwardVariant(persistent=True)`` (the entry points'
  ``persistent=`` argument);
- `flash_attn_vsa.experimental.bwd_configs`: the KV64 backward's tile configurations under
  measurement (`EXPERIMENTAL_CONFIGS`) and its timing bounds (`ABLATIONS`), passed as
  ``config=`` to ``flash_attn_vsa.bwd_sm90.block_sparse_backward_kv64`` (or to
  ``vsa_fa4.launch.run_backward``).

The shipped modules at the package's top import these only inside the branches that serve such
a request, so importing (or running) the shipped kernels loads nothing from here. A kernel moves
up to the top when vsa-fa4 routes it by default (and its row in UPSTREAM.md's deltas table, from
``flash_attn_vsa_tools.deltas``, says shipped).
"""

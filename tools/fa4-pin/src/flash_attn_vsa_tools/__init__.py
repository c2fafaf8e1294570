"""Maintainer tooling for flash-attn-4-vsa's exact upstream pin (not published, not needed at
run time): `fingerprint` (the recorded API of the upstream symbols the fork relies on,
``upstream_api.json``), `refresh` (the ``fa4-refresh`` command that moves the pin and runs the
CPU gates), `upstream_md` (the tool-kept parts of UPSTREAM.md) and `deltas` (the registry of
the fork's kernel deltas, from which UPSTREAM.md's table is generated).

The compile gate stays in the runtime package (``flash_attn_vsa.compile_gate``): vsa-fa4's
own gate (``vsa_fa4.compile_gate``) builds on it.

Importing this package imports neither ``flash_attn`` nor ``cutlass`` (nor torch).
"""

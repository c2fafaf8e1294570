"""One-off diagnostics of the fa4 adapter: its host cost (``vsa_fa4`` against raw FA4 calls:
``bench_fa4_overhead``, ``diagnose_fa4_host``) and the PTX fingerprints of every fa4 route and
fork kernel configuration (``kernel_fingerprints``: shows that a change of how kernels are
chosen changes nothing of what compiles; CPU only)."""

"""One-off diagnostics of the fa4 adapter's host cost (``vsa_fa4`` against raw FA4 calls)."""

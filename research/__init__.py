"""Research code of the workspace: kernel experiments, one-off diagnostics and their journals.

Not a package anyone installs; see ``research/README.md``. Scripts run as modules from the
repository root (``python3 -m research.fa4_fork.experiments.kv64_bwd_configs --out DIR``).
"""

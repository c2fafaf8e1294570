"""One script per experiment of ``research/fa4_fork/NOTES.md``; run each as a module from the
repository root (``python3 -m research.fa4_fork.experiments.NAME``). They import each other
relatively and reach ``benchmarks/`` and the fork's test cases through ``research.harness``."""

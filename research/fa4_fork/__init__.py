"""Experiments on the fork's kernels (``flash_attn_vsa``) and their journal, ``NOTES.md``."""

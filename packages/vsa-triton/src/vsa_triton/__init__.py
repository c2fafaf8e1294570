"""vsa-triton: portable Triton block-sparse attention kernels, the ``triton`` backend of VSA.

Importing this package imports neither triton nor the kernels; they load on the first call.
"""

__version__ = "0.1.0"

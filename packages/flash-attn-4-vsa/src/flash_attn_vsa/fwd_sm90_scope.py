"""The thread's stack of active sm_90 forward kernels (`flash_attn_vsa.fwd_sm90.forward_scope`
pushes a `ForwardKernel` on it), read by the patches of upstream's forward that pick a kernel
class or mask (`fwd_sm90._install`, `paired_sm90._install`).

A leaf: it imports nothing of the fork, so the kernel bodies below `fwd_sm90` (`paired_sm90`,
`experimental.streams_sm90`) read the scope without importing the module that defines
`ForwardKernel`.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["current_scope"]

_active = threading.local()


def current_scope() -> Any:
    """The innermost `forward_scope` kernel active on this thread (a
    ``fwd_sm90.ForwardKernel``), or None."""
    stack = getattr(_active, "stack", ())
    return stack[-1] if stack else None

"""What a process that starts llmserve-core children gives each of them."""
from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Popen's preexec_fn: the child gets SIGTERM (and drains) if the process that started it dies without
    stopping it, even by SIGKILL, so no core outlives its owner holding the GPU (Linux only; elsewhere a
    no-op). The signal follows the starting thread, so start children from a thread that outlives them."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

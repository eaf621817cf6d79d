"""How many kernels this process has JIT-compiled: Triton variants and FlashAttention-4 kernels.

A compile inside a served request costs seconds; the engine warms every variant it can reach before it
says it is ready, and `jit_compilations` in its stats shows that the count stays flat afterwards.
Triton reports each variant it builds (or loads from its disk cache) through its post-compile hook;
FlashAttention-4 keeps its compiled kernels in one dict. The interpreter (CPU) compiles nothing.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("llmserve.jit")

_triton_compiles = 0
_installed = False
_serving = False        # set once the warm-up is done: a compile after it is a gap in the warm-up


def _count(previous):
    def hook(*args, **kwargs):
        global _triton_compiles
        _triton_compiles += 1
        if _serving:
            fn = kwargs.get("fn")
            # The key ends with the constexprs and specializations, which tell the variants apart.
            log.warning("Triton compiled %s while serving (a shape the warm-up did not reach): ...%s",
                        getattr(fn, "name", "a kernel"), str(kwargs.get("key", ""))[-600:])
        return previous(*args, **kwargs) if previous is not None else None
    hook._llmserve_counter = True
    return hook


def install() -> None:
    """Chain the counter onto Triton's post-compile hook (keeping any hook already set). Idempotent."""
    global _installed
    if _installed:
        return
    try:
        from triton import knobs
    except ImportError:
        return      # no Triton, or one without knobs: nothing of ours compiles through it
    current = knobs.runtime.jit_post_compile_hook
    if not getattr(current, "_llmserve_counter", False):
        knobs.runtime.jit_post_compile_hook = _count(current)
    _installed = True


def warm_up_done() -> None:
    """From now on every Triton compile is logged as a warning, naming the kernel and its key."""
    global _serving
    _serving = True


def fa4_compilations() -> int:
    interface = sys.modules.get("flash_attn.cute.interface")
    cache = getattr(getattr(interface, "_flash_attn_fwd", None), "compile_cache", None)
    # Its cache is a dict in some FA4 releases and a JITCache object holding one in others.
    for held in (cache, getattr(cache, "cache", None), getattr(cache, "_cache", None)):
        try:
            return len(held)
        except TypeError:
            continue
    return 0


def jit_compilations() -> int:
    """Kernels compiled in this process so far (Triton variants + FA4 kernels)."""
    return _triton_compiles + fa4_compilations()

"""Programmatic dependent launch (PDL): a kernel may start while the one before it on the stream finishes.

A kernel launched with PDL runs, before `gdc_wait`, only what the kernel just before it does not write;
the wait returns once that kernel has finished and its writes are visible. Right after the wait it lets
the kernel after it launch, so a kernel starts only once the one before has passed its own wait: all work
two kernels back is complete when it starts. What it may read early is therefore its static weights and
whatever kernels further back wrote (the step's input copy, a residual, the prefix of the KV cache); each
such kernel's wrapper says what its callers must guarantee. Launched without PDL, the same kernels keep
plain stream order. Hopper and later only (layers/fast_path.py decides); CUDA graphs capture the overlap as
programmatic edges.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait_and_release(PDL: tl.constexpr):
    """In a kernel launched under PDL: wait for the kernel before (everything read after this sees its
    writes), then let the kernel after launch. Without PDL, nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_launch(pdl: bool) -> dict:
    """The launch keyword a Triton kernel takes to start under PDL (nothing without it, as the CPU
    interpreter wants)."""
    return dict(launch_pdl=True) if pdl else {}

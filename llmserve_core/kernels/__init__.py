"""Triton kernels, each with the torch reference it is tested against in the same module.

Triton compiles only for GPUs. On a machine without CUDA the kernels run in Triton's interpreter, so the
CPU test suite exercises the very code the GPU runs; this must be decided before any kernel is decorated.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_scalar_index() -> None:
    """Let interpreted kernels use loaded scalars as loop bounds.

    Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into Python ints with
    int(array), which NumPy >= 2.4 refuses for arrays with a dimension. Only the interpreter is touched.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_llmserve_fixed", False):
        return  # another Triton layout: nothing to fix, or already fixed

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._llmserve_fixed = True
    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_scalar_index()

from llmserve_core.kernels import jit_count  # noqa: E402  (after the interpreter choice above)

jit_count.install()

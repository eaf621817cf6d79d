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


def _fix_interpreter_downcasts() -> None:
    """Round float -> float8_e4m3fn and float32 -> bfloat16 in interpreted kernels to nearest even, as the
    GPU's cvt.rn does.

    Triton 3.6's interpreter drops the carry when rounding overflows the mantissa (31.8 becomes 16, not 32)
    and truncates float32 to bfloat16, which would make every FP8 or bf16 kernel disagree with its
    reference on the CPU (off by an ulp in half the elements). torch's casts round correctly.
    """
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "_llmserve_fixed", False):
        return
    sources = {"fp32": (np.float32, None), "fp16": (np.float16, None), "bf16": (np.int16, torch.bfloat16)}
    targets = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, sources),
               tl.bfloat16: (torch.bfloat16, torch.int16, {"fp32": sources["fp32"]})}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        target = targets.get(output_dtype)
        if target is not None and input_dtype.name in target[2]:
            torch_dtype, bits, allowed = target
            np_dtype, torch_view = allowed[input_dtype.name]
            src = torch.from_numpy(np.frombuffer(input.tobytes(), dtype=np_dtype).copy())
            if torch_view is not None:
                src = src.view(torch_view)
            return src.to(torch_dtype).view(bits).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert._llmserve_fixed = True
    interpreter._convert_float = convert


def _fix_interpreter_bf16_dot() -> None:
    """Multiply bfloat16 and float8_e4m3fn operands of tl.dot as the numbers they are.

    Triton 3.6's interpreter keeps both as raw bits (uint16, uint8) and hands them to np.matmul
    unconverted, so every bf16 or FP8 dot is garbage on the CPU. Widening to float32 is exact; the GPU
    accumulates the exact products in float32 too.
    """
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_llmserve_fixed", False):
        return

    def widen(handle):
        if handle.dtype.scalar == tl.float8e4nv:
            bits = torch.from_numpy(np.ascontiguousarray(handle.data).astype(np.uint8))
            return interpreter.TensorHandle(bits.view(torch.float8_e4m3fn).float().numpy(), tl.float32)
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in (tl.bfloat16, tl.float8e4nv):
            a = widen(a)
        if b.dtype.scalar in (tl.bfloat16, tl.float8e4nv):
            b = widen(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._llmserve_fixed = True
    builder.create_dot = create_dot


def _triton_present() -> bool:
    # The torch-only modules here (references, the FP8 number format) must import where Triton is absent.
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


if os.environ.get("TRITON_INTERPRET") == "1" and _triton_present():
    _fix_interpreter_scalar_index()
    _fix_interpreter_downcasts()
    _fix_interpreter_bf16_dot()

from llmserve_core.kernels import jit_count  # noqa: E402  (after the interpreter choice above)

jit_count.install()

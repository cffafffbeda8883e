"""Fixes to Triton 3.6's interpreter (the CPU path, ``TRITON_INTERPRET=1``), installed by :func:`install`.

**Rounding.** Triton 3.6's interpreter casts fp32 to bf16 by truncation; the GPU rounds to nearest even.

On the CPU path (``TRITON_INTERPRET=1``) the kernels would then carry twice the bf16 rounding error they
have on the GPU at every cast: a backward that rounds the pre-activation, g and its outputs lands near
rel-L2 1e-2 instead of 4e-3. :func:`round_bf16_to_nearest` replaces the interpreter's fp32 -> bf16
conversion with round-to-nearest-even (NaN stays a quiet NaN; values past bf16's range round to inf, as
``cvt.rn.bf16.f32`` does), so CPU results carry the GPU's rounding.

**FP8 e4m3.** Its conversions to ``tl.float8e4nv`` round half up, flush subnormals to zero and wrap values past
448 into garbage (NaN included), and its conversions from it read the NaN code (0x7f) as 480 -- the fp8 dot's
operands too. :func:`convert_fp8e4nv_exactly` makes both directions torch's ``float8_e4m3fn`` conversions, with
values past the range saturated to +-448 first: what sm_89+'s ``cvt.rn.satfinite.e4m3x2.f32`` does. Every other
conversion is untouched.

**Helper calls.** Each call of a ``@triton.jit`` helper from inside a kernel re-patches triton.language for the
interpreter (``inspect.getmembers`` over four namespaces, ~0.4 ms a call, a fifth of a small model's training
step in the interpreter), although the kernel launch around it has patched the same module already and keeps
that patch until it ends. :func:`skip_repatching_in_helpers` makes helper calls skip it while a launch runs; a
helper called outside a launch patches as before. What runs is unchanged.
"""
from __future__ import annotations

import numpy as np

_installed = False
_fp8_installed = False
_helpers_installed = False


def _fp32_to_bf16_rne(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(data)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def round_bf16_to_nearest() -> None:
    """Install the rounding fix in the interpreter (idempotent; only ever called on the interpreter path)."""
    global _installed
    if _installed:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return _fp32_to_bf16_rne(np.asarray(input)).reshape(np.shape(input))
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    _installed = True


def _torch_types(tl_dtype):
    """(torch float dtype, torch int dtype of its width, numpy uint dtype of its width) of a triton float dtype."""
    import torch
    import triton.language as tl

    floats = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
              tl.float64: torch.float64}
    width = tl_dtype.primitive_bitwidth
    ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}
    return floats[tl_dtype], ints[width], getattr(np, f"uint{width}")


def _fp8e4nv_from(data: np.ndarray, input_dtype) -> np.ndarray:
    """e4m3 codes (uint8) of the values whose ``input_dtype`` bits ``data`` holds: nearest even, and saturated
    to +-448 (NaN stays NaN), as ``cvt.rn.satfinite``."""
    import torch

    float_t, int_t, uint_np = _torch_types(input_dtype)
    bits = np.array(data, copy=True).view(uint_np)  # a writable copy: torch.from_numpy shares its memory
    values = torch.from_numpy(bits).view(int_t).view(float_t)
    return values.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _fp8e4nv_to(data: np.ndarray, output_dtype) -> np.ndarray:
    """``output_dtype``'s bits of the e4m3 codes ``data`` holds: exact, NaN kept."""
    import torch

    float_t, int_t, uint_np = _torch_types(output_dtype)
    codes = torch.from_numpy(np.array(data, copy=True).view(np.uint8))
    return codes.view(torch.float8_e4m3fn).to(float_t).view(int_t).numpy().view(uint_np)


def convert_fp8e4nv_exactly() -> None:
    """Install the e4m3 conversion fix in the interpreter (idempotent; only ever called on the interpreter
    path). It wraps whatever ``_convert_float`` is installed, so it composes with the bf16 fix."""
    global _fp8_installed
    if _fp8_installed:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    wide = (tl.float32, tl.float16, tl.bfloat16, tl.float64)

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in wide:
            return _fp8e4nv_from(np.asarray(input), input_dtype).reshape(np.shape(input))
        if input_dtype == tl.float8e4nv and output_dtype in wide:
            return _fp8e4nv_to(np.asarray(input), output_dtype).reshape(np.shape(input))
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    _fp8_installed = True


def skip_repatching_in_helpers() -> None:
    """Helper calls inside a running interpreter launch skip the re-patch when every language module their
    globals hold (``triton.language`` and/or ``triton.language.core``, the modules the interpreter patches)
    is patched already in this launch (idempotent)."""
    global _helpers_installed
    if _helpers_installed:
        return
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    state = threading.local()  # .patched: ids of the language modules patched in the running launch, or None
    langs_of: dict = {}  # jit function -> ids of the language modules in its globals
    launch_call = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__

    def langs(fn):
        found = langs_of.get(fn)
        if found is None:
            found = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        return found

    def launch(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set(langs(self.fn))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    def helper(self, *args, **kwargs):
        patched = getattr(state, "patched", None)
        needed = langs(self.fn)
        if patched is None or not needed <= patched:
            if patched is not None:
                patched |= needed
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()  # what InterpretedFunction.__call__ does after its patch
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = helper
    _helpers_installed = True


def install() -> None:
    """Every fix (only ever called on the interpreter path)."""
    round_bf16_to_nearest()
    convert_fp8e4nv_exactly()
    skip_repatching_in_helpers()

"""Triton 3.6's interpreter casts fp32 to bf16 by truncation; the GPU rounds to nearest even.

On the CPU path (``TRITON_INTERPRET=1``) the kernels would then carry twice the bf16 rounding error they
have on the GPU at every cast: a backward that rounds the pre-activation, g and its outputs lands near
rel-L2 1e-2 instead of 4e-3. :func:`round_bf16_to_nearest` replaces the interpreter's fp32 -> bf16
conversion with round-to-nearest-even (NaN stays a quiet NaN; values past bf16's range round to inf, as
``cvt.rn.bf16.f32`` does), so CPU results carry the GPU's rounding. Every other conversion is untouched.
"""
from __future__ import annotations

import numpy as np

_installed = False


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

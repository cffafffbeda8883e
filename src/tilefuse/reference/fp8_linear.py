"""Reference for FP8 (e4m3) Linear: the kernels' per-row quantization and GEMM emulated in torch, and the plain
per-tensor FP8 baseline.

e4m3 rounding is torch's ``float8_e4m3fn`` cast (round to nearest even), after saturating to +-448 as the GPU's
``cvt.rn.satfinite`` does. The float64 truth for FP8 Linear is the unquantized ``tilefuse.reference.linear``.
"""
from __future__ import annotations

import torch

from tilefuse import constants
from tilefuse.reference.linear import activation as apply_activation

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = constants.E4M3_MAX
# The smallest row amax a scale is made from: the scale amax / 448 stays a normal fp32 number and the
# reciprocal 448 / amax finite (a row of tinier values is quantized as if its amax were this).
MIN_AMAX = FP8_MAX * 2.0 ** -126


def row_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, reciprocal) fp32 from each row's amax (fp32, NaN rows given as inf): scale = amax / 448 and
    448 / amax, each rounded once; an all-zero row gets scale 1.0, a row holding NaN or inf a NaN scale."""
    safe = torch.where(amax == 0, torch.full_like(amax, FP8_MAX), amax.clamp_min(MIN_AMAX))
    # In float64, then rounded to fp32: the correctly rounded fp32 quotient (53 bits hold a division's result
    # rounded twice without error), where torch's fp32 division by a scalar on CUDA multiplies by its reciprocal
    # and ``448 / t`` is ``t.reciprocal() * 448``: two roundings each.
    wide = safe.double()
    scale = torch.where(torch.isinf(safe), torch.full_like(safe, float("nan")), (wide / FP8_MAX).float())
    return scale, (FP8_MAX / wide).float()


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): e4m3 ``q`` of ``t``'s shape and fp32 ``scale`` of ``t.shape[:-1]`` with t ~= q * scale[..., None]
    per row of the last dim, bit for bit as the row quantizer (kernels/gemm/fp8.py) makes them: each row's
    amax |t| (NaN counted as inf), then q = round_e4m3(t * (448 / amax))."""
    t32 = t.float()
    magnitude = torch.where(t32 == t32, t32.abs(), torch.full_like(t32, float("inf")))
    if t.shape[-1] == 0:
        amax = t32.new_zeros(t.shape[:-1])
    else:
        amax = magnitude.amax(-1)
    scale, inv = row_scales(amax)
    q = (t32 * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def linear_fp8_rowwise(x_q, x_scale, w_q, w_scale, bias=None, activation_name=None, out_dtype=torch.float32):
    """What the FP8 GEMM computes, emulated: ``act((x_q @ w_q^T) * x_scale[:, None] * w_scale[None, :] + bias)``
    with the product of the e4m3 values accumulated in fp32 (exact products, fp32 sums), the scales and bias
    applied in fp32, then the output dtype. x_q [..., K], x_scale [...], w_q [N, K], w_scale [N]."""
    acc = torch.matmul(x_q.float(), w_q.float().t())
    y = acc * x_scale.float()[..., None] * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return apply_activation(y, activation_name).to(out_dtype)


def linear_fp8_per_tensor(x, weight, bias=None, activation_name=None):
    """The plain per-tensor FP8 baseline: one scale for all of x and one for all of W (amax / 448 each), both
    rounded to e4m3, an fp32 GEMM of the dequantized values, then bias and activation in fp32; x's dtype out.
    Per-row and per-channel scales (:func:`quantize_rows`) keep rows of small values out of e4m3's subnormals,
    which one tensor-wide scale does not."""
    def quantize(t):
        t32 = t.float()
        amax = t32.abs().amax() if t32.numel() else t32.new_zeros(())
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale

    x_q, sx = quantize(x)
    w_q, sw = quantize(weight)
    y = torch.matmul(x_q.float(), w_q.float().t()) * (sx * sw)
    if bias is not None:
        y = y + bias.float()
    return apply_activation(y, activation_name).to(x.dtype)

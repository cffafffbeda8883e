"""Reference for the normalization family: F.layer_norm / F.rms_norm, the residual add as its own
kernel, and LayerNorm -> Linear as two calls (the normalized activations round-trip through HBM)."""

import torch
import torch.nn.functional as F

from tilefuse.reference.linear import activation as _activation


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual=None):
    """``F.layer_norm``; with ``residual``: ``h = x + residual`` first, returning ``(norm(h), h)``."""
    if residual is not None:
        h = x + residual
        return F.layer_norm(h, tuple(normalized_shape), weight, bias, eps), h
    return F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)


def rms_norm(x, normalized_shape, weight=None, eps=None, *, residual=None):
    """``F.rms_norm`` (eps None = ``torch.finfo(x.dtype).eps``); residual as in :func:`layer_norm`.

    Called on float64 copies of low-precision inputs, pass the low-precision eps explicitly: the float64
    default eps is not the one the op used.
    """
    if residual is not None:
        h = x + residual
        return F.rms_norm(h, tuple(normalized_shape), weight, eps), h
    return F.rms_norm(x, tuple(normalized_shape), weight, eps)


def layer_norm_linear(x, norm_weight, norm_bias, weight, bias=None, *, eps=None, norm="layer",
                      activation=None):
    """Normalize over the last dim of x, then ``act(F.linear(., weight, bias))``: two kernels."""
    K = x.shape[-1]
    if norm == "rms":
        xn = F.rms_norm(x, (K,), norm_weight, eps)
    else:
        xn = F.layer_norm(x, (K,), norm_weight, norm_bias, 1e-5 if eps is None else eps)
    return _activation(F.linear(xn, weight, bias), activation)

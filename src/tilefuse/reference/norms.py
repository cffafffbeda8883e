"""Reference for the normalization family: F.layer_norm / F.rms_norm, the residual add as its own
kernel, and LayerNorm -> Linear as two calls (the normalized activations round-trip through HBM)."""

import math

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


def row_statistics(h, n, eps, is_rms):
    """fp32 [2, M]: the mean (0 for RMSNorm) and 1/sqrt(var + eps) of each row of n trailing elements."""
    hf = h.reshape(-1, n).float()
    mean = torch.zeros_like(hf[:, 0]) if is_rms else hf.mean(dim=1)
    var = (hf * hf).mean(dim=1) if is_rms else hf.var(dim=1, unbiased=False)
    return torch.stack([mean, torch.rsqrt(var + eps)])


def norm_backward(dy, dh, h, weight, stats, normalized_shape, is_rms, need_dw, need_db):
    """The norms' backward given the forward's statistics (``stats`` fp32 [2, M]: mean, rstd), in closed
    form, so it also runs where autograd does not (inside tilefuse's registered op). Returns (dx in h's
    shape and dtype, plus ``dh`` when given; fp32 [n, *normalized_shape] holding dweight then dbias, those
    asked for). With
    x_hat = (h - mean) * rstd and g = dy * weight, dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
    (RMSNorm: mean = 0 and no mean(g) term), dweight = sum(dy * x_hat), dbias = sum(dy)."""
    n = math.prod(normalized_shape)
    count = int(need_dw) + int(need_db)
    if not (n and h.numel()):
        dx = torch.zeros_like(h) if dh is None else dh.clone()
        return dx.contiguous(), torch.zeros((count, *normalized_shape), dtype=torch.float32, device=h.device)
    hf = h.float().reshape(-1, n)
    dyf = dy.float().reshape(-1, n)
    rstd = stats[1].float().reshape(-1, 1)
    x_hat = hf * rstd if is_rms else (hf - stats[0].float().reshape(-1, 1)) * rstd
    g = dyf * weight.float().reshape(1, n) if weight is not None else dyf
    inner = g - x_hat * (g * x_hat).mean(dim=1, keepdim=True)
    if not is_rms:
        inner = inner - g.mean(dim=1, keepdim=True)
    dx = (rstd * inner).to(h.dtype).reshape(h.shape)
    if dh is not None:
        dx = dx + dh
    sums = []
    if need_dw:
        sums.append((dyf * x_hat).sum(0))
    if need_db:
        sums.append(dyf.sum(0))
    out = torch.stack(sums).reshape(count, *normalized_shape) if sums else \
        torch.empty((0, *normalized_shape), dtype=torch.float32, device=h.device)
    return dx.contiguous(), out

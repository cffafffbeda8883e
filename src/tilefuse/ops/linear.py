"""tilefuse.linear: act(x @ weight^T + bias) in one kernel (forward)."""
from __future__ import annotations

import math

import torch

from tilefuse import reference, runtime
from tilefuse.constants import ACTIVATIONS
from tilefuse.ops._checks import (check_no_grad_needed, check_same_device, check_same_dtype,
                                  check_tensor)

# The config of the most recent launch, for the report ("which tile ran"). Not thread-safe by design:
# it is a diagnostic, never an input to computation.
last_config = {"config": None, "path": None, "kernel": None}


def _check_linear_args(x, weight, bias, activation):
    check_tensor("x", x)
    check_tensor("weight", weight)
    if bias is not None:
        check_tensor("bias", bias)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K] (the nn.Linear layout), got shape {tuple(weight.shape)}")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension [..., K], got a 0-d tensor")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} in its last dimension but weight is [N={N}, K={K}]; "
                         "the last dimension of x must equal weight.shape[1]")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"bias must have shape [{N}] (weight.shape[0]), got {tuple(bias.shape)}")
    check_same_dtype("weight", weight, "x", x)
    if bias is not None:
        check_same_dtype("bias", bias, "x", x)
    check_same_device("weight", weight, "x", x)
    if bias is not None:
        check_same_device("bias", bias, "x", x)


def _row_addressing(x: torch.Tensor):
    """Express the rows of x[..., K] as (outer, inner) with two strides, without copying when possible.

    Returns (x_view, m_inner, stride_outer, stride_inner, stride_k). Leading dims are merged while they
    are mutually contiguous; if more than two groups remain, x is copied (rare: a >3-D tensor permuted
    in several leading dims).
    """
    K = x.shape[-1]
    lead = list(zip(x.shape[:-1], x.stride()[:-1]))
    # Drop size-1 dims (their stride is irrelevant) and merge neighbours that are contiguous.
    groups: list[list[int]] = []  # [size, stride]
    for size, stride in lead:
        if size == 1:
            continue
        if groups and groups[-1][1] == size * stride:
            groups[-1] = [groups[-1][0] * size, stride]
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        x = x.contiguous()
        groups = [[x.numel() // max(K, 1), K]]
    if not groups:
        groups = [[1, K]]
    if len(groups) == 1:
        (m, s), = groups
        return x, max(m, 1), 0, s, x.stride(-1)
    (mo, so), (mi, si) = groups
    return x, mi, so, si, x.stride(-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` computed by one fused kernel.

    x: ``[..., K]`` (1-D allowed); weight: ``[N, K]`` as in ``nn.Linear``; bias: ``[N]`` or None;
    activation: None, "gelu" (erf form, = ``F.gelu``), "gelu_tanh" (= ``F.gelu(approximate="tanh")``),
    "relu" or "silu". Returns ``[..., N]`` in ``x.dtype``. fp32 inputs use full-precision fp32 unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set. CPU tensors run the Triton kernel under
    ``TRITON_INTERPRET=1`` and the PyTorch reference otherwise.
    """
    _check_linear_args(x, weight, bias, activation)
    check_no_grad_needed("linear", x, weight, bias)
    path = runtime.execution_path(x)
    last_config.update(config=None, path=path, kernel=None)
    if path == runtime.REFERENCE:
        return reference.linear(x, weight, bias, activation)

    from tilefuse.kernels.gemm_epilogue import launch_linear  # imports triton lazily

    N, K = weight.shape
    out_shape = (*x.shape[:-1], N)
    M = math.prod(x.shape[:-1])
    y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x_rows, m_inner, s_outer, s_inner, s_k = _row_addressing(x)
    if x.dtype == torch.float32:
        precision = "tf32" if (x.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = "tf32"  # ignored by tl.dot for 16-bit operands
    y2d = y.view(M, N)
    if path == runtime.COMPILED and x.dtype != torch.float32 and s_k == 1 and (s_outer == 0 or m_inner == M):
        from tilefuse.kernels import gemm_tma

        x2d = x_rows.as_strided((M, K), (s_inner, 1))
        if gemm_tma.tma_supported(x2d, weight, y2d):
            last_config.update(config=gemm_tma.launch_linear_tma(x2d, weight, bias, y2d, activation),
                               kernel="tma")
            return y
    cfg = launch_linear(x_rows, m_inner, s_outer, s_inner, s_k, weight, bias, y2d, M, N, K,
                        activation, precision, interpret=(path == runtime.INTERPRETER))
    last_config.update(config=cfg, kernel="portable")
    return y

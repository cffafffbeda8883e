"""tilefuse.layer_norm / rms_norm (forward + backward, optional fused residual add) and
tilefuse.layer_norm_linear (normalization as the GEMM's prologue, forward only).

Layout: the normalized dims must be the trailing dims of x. x is viewed as rows [M, N]
(N = prod(normalized_shape)) without a copy whenever ``x.reshape(-1, N)`` is a view with a unit
column stride (contiguous tensors, row slices such as ``buf[:, :N]``); any other layout is copied
once with ``.contiguous()`` (documented cost: one extra read and write of x).
"""
from __future__ import annotations

import math

import torch

from tilefuse import runtime
from tilefuse.constants import ACTIVATIONS
from tilefuse.ops.linear import check_linear_args
from tilefuse.ops._checks import (check_no_grad_needed, dense, grad_needed, check_same_device, check_same_dtype,
                                  check_tensor)
from tilefuse.reference import norms as reference

# The config of the most recent launch, for the report. A diagnostic only.
last_config = {"config": None, "path": None, "kernel": None}

LAYER_NORM_EPS = 1e-5


def _normalized_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    try:
        shape = tuple(int(d) for d in normalized_shape)
    except TypeError:
        raise ValueError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}") from None
    if not shape:
        raise ValueError("normalized_shape must have at least one dimension, got ()")
    return shape


def _check_norm_args(x, normalized_shape, weight, bias, eps, residual):
    check_tensor("x", x)
    shape = _normalized_shape(normalized_shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {list(shape)} must equal the trailing dims of x, "
                         f"but x has shape {list(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        check_tensor(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (normalized_shape), got {list(t.shape)}")
        check_same_dtype(name, t, "x", x)
        check_same_device(name, t, "x", x)
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {list(x.shape)}, got {list(residual.shape)}")
        check_same_dtype("residual", residual, "x", x)
        check_same_device("residual", residual, "x", x)
    if eps is not None and (not isinstance(eps, (int, float)) or not eps >= 0):
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    return shape


def _rows(t: torch.Tensor, N: int) -> torch.Tensor:
    """[M, N] view with unit column stride; copies only when no such view exists (see module doc)."""
    t2d = t.reshape(-1, N)
    if N > 1 and t2d.stride(1) != 1:
        t2d = t2d.contiguous()
    return t2d


def _norm_forward(x, residual, weight, bias, N, eps, is_rms, interpret):
    """(y, h or None, x as rows, mean, rstd): one kernel launch."""
    x2d = _rows(x, N)
    M = x2d.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    stats = torch.empty(2, M, dtype=torch.float32, device=x.device)  # mean, rstd: one allocation
    mean, rstd = stats[0], stats[1]
    if M > 0:
        from tilefuse.kernels.norms import launch_norm_fwd  # imports triton lazily
        res2d = _rows(residual, N) if residual is not None else None
        cfg = launch_norm_fwd(x2d, res2d, weight, bias, y.view(M, N),
                              h.view(M, N) if h is not None else None, mean, rstd, eps, is_rms,
                              store_y=True, interpret=interpret)
        last_config["config"] = cfg
    return y, h, x2d, mean, rstd


class _NormFunction(torch.autograd.Function):
    """y = norm(x [+ residual]) * weight + bias; returns y, or (y, h) when a residual is given."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, norm_shape, eps, is_rms, interpret):
        N = math.prod(norm_shape)
        y, h, x2d, mean, rstd = _norm_forward(x, residual, weight, bias, N, eps, is_rms, interpret)
        ctx.save_for_backward(h if h is not None else x2d, weight, mean, rstd)
        ctx.shape, ctx.norm_shape, ctx.N = x.shape, norm_shape, N
        ctx.is_rms, ctx.interpret = is_rms, interpret
        ctx.has_residual, ctx.has_bias = residual is not None, bias is not None
        if h is not None:
            return y, h
        return y

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, mean, rstd = ctx.saved_tensors
        N = ctx.N
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        compute_dw = weight is not None and ctx.needs_input_grad[2]
        compute_db = ctx.has_bias and ctx.needs_input_grad[3]
        h2d = h.reshape(-1, N)
        M = h2d.shape[0]
        dx = torch.empty(ctx.shape, dtype=dy.dtype, device=dy.device)
        dw = db = None
        n_sums = int(compute_dw) + int(compute_db)
        sums = None  # fp32 [n_sums, N]: dweight then dbias, whichever are asked for
        if M > 0 and (need_dx or compute_dw or compute_db):
            from tilefuse.kernels.norms import launch_norm_bwd
            dh2d = _rows(dh, N) if dh is not None else None
            sums = launch_norm_bwd(_rows(dy, N), h2d, weight, None if ctx.is_rms else mean, rstd, dh2d,
                                   dx.view(M, N), ctx.is_rms, compute_dw, compute_db, ctx.interpret)
        elif M == 0 and n_sums:
            sums = torch.zeros(n_sums, N, dtype=torch.float32, device=dy.device)
        if sums is not None:
            # One cast for both: weight and bias have x's dtype (checked in the forward), and h is x's.
            grads = sums.to(h.dtype)
            if n_sums == 2:
                dw, db = grads.view(2, *ctx.norm_shape).unbind(0)
            elif compute_dw:
                dw = grads.view(ctx.norm_shape)
            else:
                db = grads.view(ctx.norm_shape)
        # h = x + residual: both receive the gradient of h (the same tensor).
        dres = dx if ctx.has_residual and ctx.needs_input_grad[1] else None
        return (dx if ctx.needs_input_grad[0] else None), dres, dw, db, None, None, None, None


def _norm(x, normalized_shape, weight, bias, eps, residual, is_rms):
    shape = _check_norm_args(x, normalized_shape, weight, bias, eps, residual)
    weight, bias = dense(weight), dense(bias)
    if eps is None:
        eps = torch.finfo(x.dtype).eps if is_rms else LAYER_NORM_EPS
    path = runtime.execution_path(x)
    last_config.update(config=None, path=path, kernel=None)
    if path == runtime.REFERENCE:
        if is_rms:
            return reference.rms_norm(x, shape, weight, eps, residual=residual)
        return reference.layer_norm(x, shape, weight, bias, eps, residual=residual)
    N = math.prod(shape)
    if N == 0:  # empty rows: nothing to normalize, the reference returns the empty result
        if is_rms:
            return reference.rms_norm(x, shape, weight, eps, residual=residual)
        return reference.layer_norm(x, shape, weight, bias, eps, residual=residual)
    interpret = path == runtime.INTERPRETER
    if grad_needed(x, residual, weight, bias):
        return _NormFunction.apply(x, residual, weight, bias, shape, float(eps), is_rms, interpret)
    y, h, _, _, _ = _norm_forward(x, residual, weight, bias, N, float(eps), is_rms, interpret)
    return (y, h) if h is not None else y


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *,
               residual: torch.Tensor | None = None):
    """``F.layer_norm`` in one Triton kernel, differentiable (dx, dweight, dbias, dresidual).

    With ``residual``: computes ``h = x + residual`` in the same pass and returns ``(y, h)``, y the
    normalized h (the pre-norm transformer pattern). Any row length, any row count (0 included),
    fp32/fp16/bf16; statistics and gradient sums in fp32, dweight/dbias reduced in a fixed order
    (deterministic). CPU tensors run the kernel under ``TRITON_INTERPRET=1``, else the PyTorch
    reference. See the module doc for which layouts are copied.
    """
    return _norm(x, normalized_shape, weight, bias, eps, residual, is_rms=False)


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None, *, residual: torch.Tensor | None = None):
    """``F.rms_norm`` in one Triton kernel (eps None = ``torch.finfo(x.dtype).eps``, as PyTorch).

    ``residual`` as in :func:`layer_norm`: returns ``(y, h)`` with ``h = x + residual``.
    """
    return _norm(x, normalized_shape, weight, None, eps, residual, is_rms=True)


# ----------------------------------------------------------------------------------------------------
# LayerNorm -> Linear, normalization in the GEMM prologue.

def _check_norm_linear_args(x, norm_weight, norm_bias, weight, bias, eps, norm, activation):
    if norm not in ("layer", "rms"):
        raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    check_linear_args(x, weight, bias, activation)  # x, weight and bias exactly as tilefuse.linear checks
    N, K = weight.shape
    named = [("norm_weight", norm_weight, (K,)), ("bias", bias, (N,))]
    if norm == "layer":
        named.insert(1, ("norm_bias", norm_bias, (K,)))
    for name, t, shape in named:
        if t is None:
            continue
        check_tensor(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    for name, t in [("weight", weight)] + [(n, t) for n, t, _ in named]:
        if t is not None:
            check_same_dtype(name, t, "x", x)
            check_same_device(name, t, "x", x)
    if eps is not None and (not isinstance(eps, (int, float)) or not eps >= 0):
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def layer_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, *, eps: float | None = None,
                      norm: str = "layer", activation: str | None = None) -> torch.Tensor:
    """``act(F.linear(norm(x), weight, bias))`` where the normalization is the GEMM's prologue.

    The normalized activations never reach HBM. On Hopper with 16-bit, TMA-aligned operands, gamma is
    folded into a copy of W once per call (W read and W' written: a temporary the size of ``weight``) and
    the TMA GEMM sums each row from the x tiles it streams, then applies
    ``rstd * (x @ W'^T - mean * colsum(W')) + (b + W @ beta)`` in its epilogue. Elsewhere a pre-pass
    writes mean/rstd per row (8 bytes) and the GEMM normalizes each x tile in registers (its prologue). ``norm`` is "layer" or "rms" (then
    ``norm_bias`` is ignored); ``eps`` None is 1e-5 for layer and ``torch.finfo(x.dtype).eps`` for
    rms. Forward only. x: ``[..., K]``; weight: ``[N, K]``; returns ``[..., N]``.
    """
    _check_norm_linear_args(x, norm_weight, norm_bias, weight, bias, eps, norm, activation)
    norm_weight, norm_bias, bias = dense(norm_weight), dense(norm_bias), dense(bias)
    is_rms = norm == "rms"
    if is_rms:
        norm_bias = None
    check_no_grad_needed("layer_norm_linear", x, norm_weight, norm_bias, weight, bias)
    if eps is None:
        eps = torch.finfo(x.dtype).eps if is_rms else LAYER_NORM_EPS
    path = runtime.execution_path(x)
    last_config.update(config=None, path=path, kernel=None)
    if path == runtime.REFERENCE:
        return reference.layer_norm_linear(x, norm_weight, norm_bias, weight, bias, eps=eps, norm=norm,
                                           activation=activation)
    from tilefuse.kernels.norm_linear import launch_norm_linear
    from tilefuse.kernels.norms import launch_norm_fwd

    N, K = weight.shape
    M = math.prod(x.shape[:-1])
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x2d = _rows(x, K) if K > 0 else x.reshape(M, 0)
    y2d = y.view(M, N)
    interpret = path == runtime.INTERPRETER
    if path == runtime.COMPILED and K > 0 and x.dtype != torch.float32:
        from tilefuse.kernels import gemm_tma
        if gemm_tma.tma_supported(x2d, weight, y2d):
            from tilefuse.kernels.norm_linear import launch_norm_linear_tma
            cfg = launch_norm_linear_tma(x2d, is_rms, eps, norm_weight, norm_bias, weight, bias, y2d, activation)
            last_config.update(config=cfg, kernel="tma, norm in epilogue")
            return y
    # The pre-pass writes every row's statistics; zeros only for K == 0, where it does not run.
    stats = (torch.empty if K > 0 else torch.zeros)(2, M, dtype=torch.float32, device=x.device)
    mean, rstd = stats[0], stats[1]
    if K > 0:
        launch_norm_fwd(x2d, None, None, None, None, None, mean, rstd, eps, is_rms, store_y=False,
                        interpret=interpret)
    if x.dtype == torch.float32:
        precision = "tf32" if (x.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = "tf32"  # ignored by tl.dot for 16-bit operands
    cfg = launch_norm_linear(x2d, mean, rstd, norm_weight, norm_bias, weight, bias, y2d,
                             is_rms, activation, precision, interpret)
    last_config.update(config=cfg, kernel="norm in prologue")
    return y

"""tilefuse.layer_norm / rms_norm (forward + backward, optional fused residual add) and
tilefuse.layer_norm_linear (the normalization fused into the GEMM; its backward recomputes the
normalized x with the norm kernel, runs the GEMM backward on it, then the norm's backward).

Registered as the custom ops ``tilefuse::layer_norm``, ``tilefuse::rms_norm`` (with autograd through
``tilefuse::norm_backward``) and ``tilefuse::layer_norm_linear``; see ``_dispatch`` for the path a call
takes. Layout: the normalized dims must be the trailing dims of x. x is viewed as rows [M, N]
(N = prod(normalized_shape)) without a copy whenever ``x.reshape(-1, N)`` is a view with a unit column
stride (contiguous tensors, row slices such as ``buf[:, :N]``); any other layout is copied once with
``.contiguous()`` (documented cost: one extra read and write of x).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from tilefuse import runtime
from tilefuse.constants import ACTIVATIONS
from tilefuse.ops import _dispatch, _dtensor
from tilefuse.ops._checks import check_same_device, check_same_dtype, check_tensor, dense, grad_needed
from tilefuse.ops.linear import check_linear_args
from tilefuse import reference as reference_gemm
from tilefuse.reference import norms as reference

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
        # Any float dtype, as torch allows (fp32 norm parameters beside bf16 activations): the kernels
        # compute in fp32 and the output keeps x's dtype.
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


def _as_compute_params(x, t):
    """A norm parameter of another float dtype than x, in fp32 for the reference path (torch's CPU
    layer_norm refuses some mixed pairs; the kernels compute in fp32 whatever the parameter's dtype)."""
    return t if t is None or t.dtype == x.dtype else t.float()


def _norms_launch():
    runtime.check_triton()
    from tilefuse.kernels.norms import launch  # imports triton: only once a kernel is to run
    return launch


def _empty_outputs(x, normalized_shape, has_residual):
    """(y, h, stats): y and h contiguous in x's shape (h empty without a residual), stats fp32 [2, M]."""
    n = math.prod(normalized_shape)
    m = x.numel() // n if n else 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape if has_residual else (0,), dtype=x.dtype, device=x.device)
    return y, h, torch.empty((2, m), dtype=torch.float32, device=x.device)


def _norm_impl(x, residual, weight, bias, normalized_shape, eps, is_rms):
    path = runtime.execution_path(x)
    n = math.prod(normalized_shape)
    if path == runtime.REFERENCE or x.numel() == 0:
        _dispatch.record_reference("rms_norm" if is_rms else "layer_norm", path)
        weight, bias = _as_compute_params(x, weight), _as_compute_params(x, bias)
        y, h, stats = _empty_outputs(x, normalized_shape, residual is not None)
        hx = x if residual is None else x + residual  # in x's dtype, as the kernel stores h
        if residual is not None:
            h.copy_(hx)
        if stats.shape[1]:
            stats.copy_(reference.row_statistics(hx, n, eps, is_rms))
        y.copy_(reference.rms_norm(hx, normalized_shape, weight, eps) if is_rms
                else reference.layer_norm(hx, normalized_shape, weight, bias, eps))
        return y, h, stats
    with _dispatch.on_device(x):
        out = _norms_launch().forward(_rows(x, n), None if residual is None else _rows(residual, n), weight, bias,
                                      eps, is_rms, path)
    if residual is None:
        y, stats = out
        h = torch.empty((0,), dtype=x.dtype, device=x.device)
    else:
        y, h, stats = out
        h = h.view(x.shape)
    return y.view(x.shape), h, stats


@torch.library.custom_op("tilefuse::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], normalized_shape: Sequence[int],
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_impl(x, residual, weight, bias, tuple(normalized_shape), eps, False)


@torch.library.custom_op("tilefuse::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                 normalized_shape: Sequence[int], eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_impl(x, residual, weight, None, tuple(normalized_shape), eps, True)


@_layer_norm_op.register_fake
def _(x, residual, weight, bias, normalized_shape, eps):
    return _empty_outputs(x, normalized_shape, residual is not None)


@_rms_norm_op.register_fake
def _(x, residual, weight, normalized_shape, eps):
    return _empty_outputs(x, normalized_shape, residual is not None)


def _norm_backward_impl(dy, dh, h, weight, stats, normalized_shape, is_rms, need_dw, need_db):
    """(dx in h's shape, sums): sums fp32 [n, *normalized_shape] holds dweight then dbias, those asked for
    (n = 0, 1 or 2; one tensor, so the op's outputs never alias); the caller casts each to its
    parameter's dtype."""
    n = math.prod(normalized_shape)
    path = runtime.execution_path(h)
    if path == runtime.REFERENCE or h.numel() == 0:
        _dispatch.record_reference("rms_norm_backward" if is_rms else "layer_norm_backward", path)
        return reference.norm_backward(dy, dh, h, weight, stats, normalized_shape, is_rms, need_dw, need_db)
    with _dispatch.on_device(h):
        dx, parts = _norms_launch().backward(_rows(dy, n), _rows(h, n), weight, stats,
                                             None if dh is None else _rows(dh, n), is_rms, need_dw, need_db, path)
    # One fixed-order reduction over the programs' partial rows (deterministic).
    count = int(need_dw) + int(need_db)
    sums = parts.sum(dim=1) if count else torch.empty((0, n), dtype=torch.float32, device=h.device)
    return dx.view(h.shape), sums.view(count, *normalized_shape)


@torch.library.custom_op("tilefuse::norm_backward", mutates_args=())
def _norm_backward_op(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor, weight: Optional[torch.Tensor],
                      stats: torch.Tensor, normalized_shape: Sequence[int], is_rms: bool, need_dw: bool,
                      need_db: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_backward_impl(dy, dh, h, weight, stats, tuple(normalized_shape), is_rms, need_dw, need_db)


@_norm_backward_op.register_fake
def _(dy, dh, h, weight, stats, normalized_shape, is_rms, need_dw, need_db):
    count = int(need_dw) + int(need_db)
    return (torch.empty(h.shape, dtype=h.dtype, device=h.device),
            torch.empty((count, *normalized_shape), dtype=torch.float32, device=h.device))


def _setup_norm(ctx, inputs, output, is_rms):
    if is_rms:
        x, residual, weight, normalized_shape, eps = inputs
        bias = None
    else:
        x, residual, weight, bias, normalized_shape, eps = inputs
    y, h, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h if residual is not None else x, weight, stats)
    ctx.normalized_shape, ctx.is_rms = tuple(normalized_shape), is_rms
    ctx.has_residual, ctx.has_weight, ctx.has_bias = residual is not None, weight is not None, bias is not None
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _norm_backward(ctx, dy, dh, dstats):
    h, weight, stats = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    grad_x = ctx.needs_input_grad[0] or (ctx.has_residual and ctx.needs_input_grad[1])
    need_dw = ctx.has_weight and ctx.needs_input_grad[2]
    need_db = ctx.has_bias and ctx.needs_input_grad[3]
    dx = dw = db = None
    if grad_x or need_dw or need_db:
        dh = dh if ctx.has_residual else None
        if _dispatch.direct(dy, dh, h, weight, stats):  # eager backward: no dispatcher round trip
            dx, sums = _norm_backward_impl(dy, dh, h, weight, stats, ctx.normalized_shape, ctx.is_rms,
                                           need_dw, need_db)
        else:
            dx, sums = _norm_backward_op(dy, dh, h, weight, stats, list(ctx.normalized_shape), ctx.is_rms,
                                         need_dw, need_db)
        w_dtype, b_dtype = ctx.param_dtypes
        if need_dw and need_db and w_dtype == b_dtype:
            sums = sums.to(w_dtype)  # one cast for both
        if need_dw:
            dw = sums[0].to(w_dtype)
        if need_db:
            db = sums[int(need_dw)].to(b_dtype)
    # h = x + residual: both receive the gradient of h (the same tensor).
    grads = [dx if ctx.needs_input_grad[0] else None, dx if ctx.has_residual and ctx.needs_input_grad[1] else None,
             dw if need_dw else None]
    if not ctx.is_rms:
        grads.append(db if need_db else None)
    return (*grads, None, None)


_layer_norm_call = _dispatch.register_autograd(
    _layer_norm_op, lambda x, residual, weight, bias, shape, eps: _norm_impl(x, residual, weight, bias, tuple(shape),
                                                                            eps, False),
    _norm_backward, lambda ctx, inputs, output: _setup_norm(ctx, inputs, output, False))
_rms_norm_call = _dispatch.register_autograd(
    _rms_norm_op, lambda x, residual, weight, shape, eps: _norm_impl(x, residual, weight, None, tuple(shape), eps, True),
    _norm_backward, lambda ctx, inputs, output: _setup_norm(ctx, inputs, output, True))


def _probe_layer_norm(t):
    return torch.nn.functional.layer_norm(t, t.shape[-1:])


def _probe_rms_norm(t):
    return torch.nn.functional.rms_norm(t, t.shape[-1:])


_dispatch.register_autocast(_layer_norm_op, (0, 1), _probe_layer_norm, "layer_norm")  # x, residual
_dispatch.register_autocast(_rms_norm_op, (0, 1), _probe_rms_norm, "rms_norm")


def _norm(x, normalized_shape, weight, bias, eps, residual, is_rms):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        cast = _dispatch.autocast_like("rms_norm" if is_rms else "layer_norm", x,
                                       _probe_rms_norm if is_rms else _probe_layer_norm)
        if cast is not None and cast != x.dtype:  # torch's autocast runs this norm in another dtype
            x, residual = _dispatch.cast_floats(cast, x, residual)
    shape = _check_norm_args(x, normalized_shape, weight, bias, eps, residual)
    weight, bias = dense(weight), dense(bias)
    if eps is None:
        eps = torch.finfo(x.dtype).eps if is_rms else LAYER_NORM_EPS
    eps = float(eps)
    if _dispatch.direct(x, residual, weight, bias):
        y, h, _ = _norm_impl(x, residual, weight, bias, shape, eps, is_rms)
    elif is_rms:
        y, h, _ = _rms_norm_call(x, residual, weight, list(shape), eps)
    else:
        y, h, _ = _layer_norm_call(x, residual, weight, bias, list(shape), eps)
    return (y, h) if residual is not None else y


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *,
               residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.layer_norm`` in one Triton kernel, differentiable (dx, dweight, dbias, dresidual).

    With ``residual``: computes ``h = x + residual`` in the same pass and returns ``(y, h)``, y the
    normalized h (the pre-norm transformer pattern). Any row length, any row count (0 included),
    fp32/fp16/bf16; statistics and gradient sums in fp32, dweight/dbias reduced in a fixed order
    (deterministic). CPU tensors run the kernel under ``TRITON_INTERPRET=1``, else the PyTorch
    reference. See the module doc for which layouts are copied.
    """
    if _dtensor.any_dtensor(x, weight, bias, residual):
        return _dtensor.rows(x, (weight, bias, residual), lambda x, w, b, r: layer_norm(
            x, normalized_shape, w, b, eps, residual=r))
    return _norm(x, normalized_shape, weight, bias, eps, residual, is_rms=False)


def rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None, *,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.rms_norm`` in one Triton kernel (eps None = ``torch.finfo(x.dtype).eps``, as PyTorch).

    ``residual`` as in :func:`layer_norm`: returns ``(y, h)`` with ``h = x + residual``.
    """
    if _dtensor.any_dtensor(x, weight, residual):
        return _dtensor.rows(x, (weight, residual), lambda x, w, r: rms_norm(x, normalized_shape, w, eps, residual=r))
    return _norm(x, normalized_shape, weight, None, eps, residual, is_rms=True)


# ----------------------------------------------------------------------------------------------------
# LayerNorm -> Linear, normalization fused into the GEMM.

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
            if name not in ("norm_weight", "norm_bias"):  # the norm's parameters may be any float dtype
                check_same_dtype(name, t, "x", x)
            check_same_device(name, t, "x", x)
    if eps is not None and (not isinstance(eps, (int, float)) or not eps >= 0):
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


@torch.library.custom_op("tilefuse::layer_norm_linear", mutates_args=())
def _layer_norm_linear_op(x: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
                          weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, norm: str,
                          activation: Optional[str], save_slope: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_norm_linear_impl(x, norm_weight, norm_bias, weight, bias, eps, norm, activation, save_slope)


@_layer_norm_linear_op.register_fake
def _(x, norm_weight, norm_bias, weight, bias, eps, norm, activation, save_slope):
    shape = (*x.shape[:-1], weight.shape[0])
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    return y, (torch.empty_like(y) if save_slope else x.new_empty((0,)))


def _layer_norm_linear_impl(x, norm_weight, norm_bias, weight, bias, eps, norm, activation, save_slope):
    """(y, slope): slope = act'(pre) in y's layout with ``save_slope``, else an empty placeholder."""
    path = runtime.execution_path(x)
    N, K = weight.shape
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("layer_norm_linear", path)
        norm_weight, norm_bias = _as_compute_params(x, norm_weight), _as_compute_params(x, norm_bias)
        pre = torch.empty_like(y).copy_(reference.layer_norm_linear(x, norm_weight, norm_bias, weight, bias, eps=eps,
                                                                    norm=norm, activation=None))
        y.copy_(reference_gemm.activation(pre, activation))
        if not save_slope:
            return y, x.new_empty((0,))
        return y, torch.empty_like(y).copy_(reference_gemm.activation_slope(pre, activation))
    from tilefuse.ops.linear import _gemm_launch
    with _dispatch.on_device(x):
        out = _gemm_launch().layer_norm_linear(_rows(x, K), norm_weight, norm_bias, weight, bias, eps, norm == "rms",
                                               activation, path, save_slope)
    y2d, slope2d = out if save_slope else (out, None)
    return y2d.view(*x.shape[:-1], N), (slope2d.view(*x.shape[:-1], N) if save_slope else x.new_empty((0,)))


def _setup_norm_linear(ctx, inputs, output):
    x, norm_weight, norm_bias, weight, bias, eps, norm, activation, save_slope = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, norm_weight, norm_bias, weight, output[1] if activation is not None else None)
    ctx.eps, ctx.norm, ctx.activation, ctx.saved_slope = eps, norm, activation, save_slope
    ctx.has = (norm_weight is not None, norm_bias is not None, bias is not None)
    ctx.param_dtypes = (None if norm_weight is None else norm_weight.dtype,
                        None if norm_bias is None else norm_bias.dtype)


def _norm_linear_backward(ctx, dy, dslope):
    """The GEMM's backward on the normalized x (recomputed here by the norm kernel with its statistics,
    rather than saved by the forward), then the norm's backward from d(normalized x)."""
    x, norm_weight, norm_bias, weight, slope = ctx.saved_tensors
    needs = ctx.needs_input_grad
    has_nw, has_nb, has_b = ctx.has
    need_dx, need_dnw, need_dnb = needs[0], has_nw and needs[1], has_nb and needs[2]
    need_dw, need_db = needs[3], has_b and needs[4]
    need_dxn = need_dx or need_dnw or need_dnb
    if dy is None or not (need_dxn or need_dw or need_db):
        return (None,) * 9
    if ctx.activation is not None and not ctx.saved_slope:
        raise RuntimeError("tilefuse.layer_norm_linear: the backward needs the activation's slope, which this "
                           "forward did not save (it ran without grad); call it with grad enabled to train")
    from tilefuse.ops.linear import linear_grads

    K = x.shape[-1]
    is_rms = ctx.norm == "rms"
    if _dispatch.direct(x, norm_weight, norm_bias):
        xn, _, stats = _norm_impl(x, None, norm_weight, None if is_rms else norm_bias, (K,), ctx.eps, is_rms)
    elif is_rms:
        xn, _, stats = _rms_norm_op(x, None, norm_weight, [K], ctx.eps)
    else:
        xn, _, stats = _layer_norm_op(x, None, norm_weight, norm_bias, [K], ctx.eps)
    dxn, dw, db = linear_grads(dy, xn, weight, slope, need_dxn, need_dw, need_db)
    dx = dnw = dnb = None
    if need_dxn:
        if _dispatch.direct(dxn, x, norm_weight, stats):
            dx, sums = _norm_backward_impl(dxn, None, x, norm_weight, stats, (K,), is_rms, need_dnw, need_dnb)
        else:
            dx, sums = _norm_backward_op(dxn, None, x, norm_weight, stats, [K], is_rms, need_dnw, need_dnb)
        if need_dnw:
            dnw = sums[0].to(ctx.param_dtypes[0])
        if need_dnb:
            dnb = sums[int(need_dnw)].to(ctx.param_dtypes[1])
    return (dx if need_dx else None, dnw, dnb, dw if need_dw else None, db if need_db else None,
            None, None, None, None)


_layer_norm_linear_call = _dispatch.register_autograd(_layer_norm_linear_op, _layer_norm_linear_impl,
                                                     _norm_linear_backward, _setup_norm_linear)
_dispatch.register_autocast(_layer_norm_linear_op, (0, 3, 4))  # x, weight, bias; norm parameters as they are


def layer_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, *, eps: float | None = None,
                      norm: str = "layer", activation: str | None = None) -> torch.Tensor:
    """``act(F.linear(norm(x), weight, bias))`` where the normalization is fused into the GEMM.

    The normalized activations never reach HBM. On Hopper with 16-bit, TMA-aligned operands, gamma is
    folded into a copy of W once per call (W read and W' written: a temporary the size of ``weight``) and
    a pre-pass writes each row's mean and rstd (8 bytes), and the TMA GEMM runs on raw x and applies
    ``rstd * (x @ W'^T - mean * colsum(W')) + (b + W @ beta)`` in its epilogue. Elsewhere the same pre-pass
    runs and the GEMM normalizes each x tile in registers (its prologue).
    ``norm`` is "layer" or "rms" (then ``norm_bias`` is ignored); ``eps`` None is 1e-5 for layer and
    ``torch.finfo(x.dtype).eps`` for rms. Differentiable in every tensor: the backward recomputes
    norm(x) (one read of x, one write and read of the normalized rows: the bytes eager spends saving it),
    runs the linear backward on it (act' fused, as :func:`tilefuse.linear`) and then the norm's backward.
    x: ``[..., K]``; weight: ``[N, K]``; returns
    ``[..., N]``.
    """
    cast = _dispatch.autocast_dtype(x) if isinstance(x, torch.Tensor) else None
    if cast is not None:  # no torch counterpart: the fused op runs in the autocast dtype, as its GEMM would
        x, weight, bias = _dispatch.cast_floats(cast, x, weight, bias)
    _check_norm_linear_args(x, norm_weight, norm_bias, weight, bias, eps, norm, activation)
    norm_weight, norm_bias, bias = dense(norm_weight), dense(norm_bias), dense(bias)
    if norm == "rms":
        norm_bias = None
    if eps is None:
        eps = torch.finfo(x.dtype).eps if norm == "rms" else LAYER_NORM_EPS
    eps = float(eps)
    if _dispatch.direct(x, norm_weight, norm_bias, weight, bias):
        return _layer_norm_linear_impl(x, norm_weight, norm_bias, weight, bias, eps, norm, activation, False)[0]
    save_slope = activation is not None and grad_needed(x, norm_weight, norm_bias, weight, bias)
    return _layer_norm_linear_call(x, norm_weight, norm_bias, weight, bias, eps, norm, activation, save_slope)[0]

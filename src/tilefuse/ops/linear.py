"""tilefuse.linear: act(x @ weight^T + bias) in one kernel, plain and gated (GLU), with autograd.

Registered as the custom ops ``tilefuse::linear`` and ``tilefuse::gated_linear`` (see ``_dispatch``),
whose autograd formulas call ``tilefuse::linear_backward`` / ``tilefuse::gated_linear_backward``. In
training the forward ops also return the activation's slope(s) ``act'(pre)`` (``save_slope``): the
backward multiplies dy by them (kernels/gemm/backward.py says why the slope, not the pre-activation).
"""
from __future__ import annotations

from typing import Optional

import torch

from tilefuse import reference, runtime
from tilefuse.constants import ACTIVATIONS, GATED_ACTIVATIONS
from tilefuse.ops import _dispatch, _dtensor, fp8_linear
from tilefuse.ops._checks import check_same_device, check_same_dtype, check_tensor, dense, grad_needed


def _split_gated(weight, bias, activation):
    """Gated activations take ``weight`` as a pair (W_gate, W_up) or one [2N, K] tensor cat([W_gate, W_up])
    (``bias`` likewise a pair or [2N]); returns (w_gate, w_up, b_gate, b_up) as views, never copies."""
    if isinstance(weight, (tuple, list)):
        if len(weight) != 2:
            raise ValueError(f"weight for activation={activation!r} must be a pair (W_gate, W_up) or one "
                             f"[2N, K] tensor, got a sequence of {len(weight)}")
        w_gate, w_up = weight
        check_tensor("weight[0] (W_gate)", w_gate)
        check_tensor("weight[1] (W_up)", w_up)
        if w_gate.shape != w_up.shape:
            raise ValueError(f"W_gate {tuple(w_gate.shape)} and W_up {tuple(w_up.shape)} must have one shape [N, K]")
    else:
        check_tensor("weight", weight)
        if weight.dim() != 2 or weight.shape[0] % 2:
            raise ValueError(f"weight for activation={activation!r} as one tensor must be [2N, K] "
                             f"(cat([W_gate, W_up])), got shape {tuple(weight.shape)}")
        half = weight.shape[0] // 2
        w_gate, w_up = weight[:half], weight[half:]
    if bias is None:
        return w_gate, w_up, None, None
    if isinstance(bias, (tuple, list)):
        if len(bias) != 2 or bias[0] is None or bias[1] is None:
            raise ValueError("bias for a gated activation must be None, a pair (b_gate, b_up) or one [2N] tensor")
        check_tensor("bias[0] (b_gate)", bias[0])
        check_tensor("bias[1] (b_up)", bias[1])
        return w_gate, w_up, bias[0], bias[1]
    check_tensor("bias", bias)
    n = w_gate.shape[0] if w_gate.dim() == 2 else -1
    if bias.dim() != 1 or bias.shape[0] != 2 * n:
        raise ValueError(f"bias for a gated activation as one tensor must have shape [{2 * n}] (2N), "
                         f"got {tuple(bias.shape)}")
    return w_gate, w_up, bias[:n], bias[n:]


def check_linear_args(x, weight, bias, activation, name="weight", bias_name="bias"):
    check_tensor("x", x)
    check_tensor(name, weight)
    if bias is not None:
        check_tensor(bias_name, bias)
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, K] (the nn.Linear layout), got shape {tuple(weight.shape)}")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension [..., K], got a 0-d tensor")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} in its last dimension but {name} is [N={N}, K={K}]; "
                         f"the last dimension of x must equal {name}.shape[1]")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"{bias_name} must have shape [{N}] ({name}.shape[0]), got {tuple(bias.shape)}")
    check_same_dtype(name, weight, "x", x)
    if bias is not None:
        check_same_dtype(bias_name, bias, "x", x)
    check_same_device(name, weight, "x", x)
    if bias is not None:
        check_same_device(bias_name, bias, "x", x)


def _gemm_launch():
    runtime.check_triton()
    from tilefuse.kernels.gemm import launch  # imports triton: only once a kernel is to run
    return launch


def _empty(x, n):
    return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)


def _nothing(x):
    """The placeholder for an output a call does not produce (a slope not asked for)."""
    return x.new_empty((0,))


# ---- forward ops: y, and in training the activation's slope(s) the backward reads --------------------
@torch.library.custom_op("tilefuse::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               activation: Optional[str], save_slope: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _linear_impl(x, weight, bias, activation, save_slope)


@_linear_op.register_fake
def _(x, weight, bias, activation, save_slope):
    return _empty(x, weight.shape[0]), (_empty(x, weight.shape[0]) if save_slope else _nothing(x))


def _linear_impl(x, weight, bias, activation, save_slope):
    """(y, slope): slope = act'(pre) in y's layout with ``save_slope``, else an empty placeholder."""
    path = runtime.execution_path(x)
    N, K = weight.shape
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("linear", path)
        pre = _empty(x, N).copy_(reference.linear(x, weight, bias))  # rounded as the kernels round it
        y = _empty(x, N).copy_(reference.activation(pre, activation))
        return y, (_empty(x, N).copy_(reference.activation_slope(pre, activation)) if save_slope else _nothing(x))
    with _dispatch.on_device(x):
        out = _gemm_launch().linear(x, weight, bias, activation, path, save_slope)
    return out if save_slope else (out, _nothing(x))


@torch.library.custom_op("tilefuse::gated_linear", mutates_args=())
def _gated_linear_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, b_gate: Optional[torch.Tensor],
                     b_up: Optional[torch.Tensor], activation: str,
                     save_slope: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gated_linear_impl(x, w_gate, w_up, b_gate, b_up, activation, save_slope)


@_gated_linear_op.register_fake
def _(x, w_gate, w_up, b_gate, b_up, activation, save_slope):
    n = w_gate.shape[0]
    saved = (_empty(x, n), _empty(x, n)) if save_slope else (_nothing(x), _nothing(x))
    return (_empty(x, n), *saved)


def _gated_linear_impl(x, w_gate, w_up, b_gate, b_up, activation, save_slope):
    """(y, s_gate, s_up) = (y, up * act'(gate), act(gate)) with ``save_slope``, else empty placeholders."""
    path = runtime.execution_path(x)
    N, K = w_gate.shape
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("linear", path)
        gate = _empty(x, N).copy_(reference.linear(x, w_gate, b_gate))
        up = _empty(x, N).copy_(reference.linear(x, w_up, b_up))
        y = _empty(x, N).copy_(reference.gate(gate, activation) * up)
        if not save_slope:
            return y, _nothing(x), _nothing(x)
        s_gate, s_up = reference.gated_slopes(gate, up, activation)
        return y, _empty(x, N).copy_(s_gate), _empty(x, N).copy_(s_up)
    with _dispatch.on_device(x):
        out = _gemm_launch().gated_linear(x, w_gate, w_up, b_gate, b_up, activation, path, save_slope)
    return out if save_slope else (out, _nothing(x), _nothing(x))


# ---- backward ops ------------------------------------------------------------------------------------
def _backward_outputs(x, weights, need_dx, need_dw, need_db):
    """Empty outputs of a backward op in its real layouts: (dx, dW..., db...); what is not asked for is
    an empty placeholder (need_db alone still returns the dW the kernel makes with it)."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else _nothing(x)
    dws = [torch.empty_like(w) if (need_dw or need_db) else _nothing(x) for w in weights]
    dbs = [x.new_empty((w.shape[0],)) if need_db else _nothing(x) for w in weights]
    return (dx, *dws, *dbs)


def _linear_backward_impl(dy, x, weight, slope, need_dx, need_dw, need_db):
    path = runtime.execution_path(x)
    N, K = weight.shape
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("linear_backward", path)
        grads = reference.linear_backward(dy, x, weight, slope)
        return tuple(out.copy_(g) if out.numel() else out
                     for out, g in zip(_backward_outputs(x, (weight,), need_dx, need_dw, need_db), grads))
    with _dispatch.on_device(x):
        return _gemm_launch().linear_backward(dy, x, weight, None, slope, None, need_dx, need_dw, need_db, path)


@torch.library.custom_op("tilefuse::linear_backward", mutates_args=())
def _linear_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, slope: Optional[torch.Tensor],
                        need_dx: bool, need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_backward_impl(dy, x, weight, slope, need_dx, need_dw, need_db)


@_linear_backward_op.register_fake
def _(dy, x, weight, slope, need_dx, need_dw, need_db):
    return _backward_outputs(x, (weight,), need_dx, need_dw, need_db)


def _gated_linear_backward_impl(dy, x, w_gate, w_up, s_gate, s_up, need_dx, need_dw, need_db):
    path = runtime.execution_path(x)
    N, K = w_gate.shape
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("linear_backward", path)
        grads = reference.gated_linear_backward(dy, x, w_gate, w_up, s_gate, s_up)
        return tuple(out.copy_(g) if out.numel() else out
                     for out, g in zip(_backward_outputs(x, (w_gate, w_up), need_dx, need_dw, need_db), grads))
    with _dispatch.on_device(x):
        return _gemm_launch().linear_backward(dy, x, w_gate, w_up, s_gate, s_up, need_dx, need_dw, need_db, path)


@torch.library.custom_op("tilefuse::gated_linear_backward", mutates_args=())
def _gated_linear_backward_op(dy: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                              s_gate: torch.Tensor, s_up: torch.Tensor, need_dx: bool, need_dw: bool,
                              need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    return _gated_linear_backward_impl(dy, x, w_gate, w_up, s_gate, s_up, need_dx, need_dw, need_db)


@_gated_linear_backward_op.register_fake
def _(dy, x, w_gate, w_up, s_gate, s_up, need_dx, need_dw, need_db):
    return _backward_outputs(x, (w_gate, w_up), need_dx, need_dw, need_db)


def linear_grads(dy, x, weight, slope, need_dx, need_dw, need_db):
    """(dx, dW, db) of ``act(x @ W^T + b)`` by the backward kernels; ``slope`` the saved act'(pre) (None
    without an activation). Also layer_norm_linear's backward, with x its normalized input."""
    if _dispatch.direct(dy, x, weight, slope):  # eager backward: no dispatcher round trip
        return _linear_backward_impl(dy, x, weight, slope, need_dx, need_dw, need_db)
    return _linear_backward_op(dy, x, weight, slope, need_dx, need_dw, need_db)


def _missing_slope(what: str):
    return RuntimeError(f"tilefuse.{what}: the backward needs the activation's slope, which this forward did not "
                        "save (it ran without grad); call it with grad enabled to train")


def _setup_linear(ctx, inputs, output):
    x, weight, bias, activation, save_slope = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, output[1] if activation is not None else None)
    ctx.activation, ctx.has_bias, ctx.saved_slope = activation, bias is not None, save_slope


def _linear_backward(ctx, dy, dslope):
    x, weight, slope = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    if dy is None or not (need_dx or need_dw or need_db):
        return None, None, None, None, None
    if ctx.activation is not None and not ctx.saved_slope:
        raise _missing_slope("linear")
    dx, dw, db = linear_grads(dy, x, weight, slope, need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None, None, None)


_linear_call = _dispatch.register_autograd(_linear_op, _linear_impl, _linear_backward, _setup_linear)
_dispatch.register_autocast(_linear_op, (0, 1, 2))  # x, weight, bias: as torch's linear


def _setup_gated(ctx, inputs, output):
    x, w_gate, w_up, b_gate, b_up, activation, save_slope = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w_gate, w_up, output[1], output[2])
    ctx.has_bias, ctx.saved_slope = (b_gate is not None, b_up is not None), save_slope


def _gated_backward(ctx, dy, ds_gate, ds_up):
    x, w_gate, w_up, s_gate, s_up = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need_dx, need_dw = needs[0], needs[1] or needs[2]
    need_db = (ctx.has_bias[0] and needs[3]) or (ctx.has_bias[1] and needs[4])
    if dy is None or not (need_dx or need_dw or need_db):
        return (None,) * 7
    if not ctx.saved_slope:
        raise _missing_slope("linear")
    args = (dy, x, w_gate, w_up, s_gate, s_up, need_dx, need_dw, need_db)
    if _dispatch.direct(dy, x, w_gate, w_up, s_gate, s_up):
        dx, dwg, dwu, dbg, dbu = _gated_linear_backward_impl(*args)
    else:
        dx, dwg, dwu, dbg, dbu = _gated_linear_backward_op(*args)
    return (dx if need_dx else None, dwg if needs[1] else None, dwu if needs[2] else None,
            dbg if ctx.has_bias[0] and needs[3] else None, dbu if ctx.has_bias[1] and needs[4] else None, None, None)


_gated_linear_call = _dispatch.register_autograd(_gated_linear_op, _gated_linear_impl, _gated_backward, _setup_gated)
_dispatch.register_autocast(_gated_linear_op, (0, 1, 2, 3, 4))


def linear(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | fp8_linear.QuantizedWeight,
           bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
           activation: str | None = None, *, fp8: bool = False,
           x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` computed by one fused kernel.

    x: ``[..., K]`` (1-D allowed); weight: ``[N, K]`` as in ``nn.Linear``; bias: ``[N]`` or None;
    activation: None, "gelu" (erf form, = ``F.gelu``), "gelu_tanh" (= ``F.gelu(approximate="tanh")``),
    "relu" or "silu". Returns ``[..., N]`` in ``x.dtype``. fp32 inputs use full-precision fp32 unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set. CPU tensors run the Triton kernel under
    ``TRITON_INTERPRET=1`` and the PyTorch reference otherwise.

    Differentiable in x, weight and bias: the backward's two GEMMs (dx = g @ W, dW = g^T @ x with
    db = sum g from the same tiles) make ``g = dy * act'(pre)`` as they load dy and the slope act'(pre),
    which the forward's epilogue computed and stored in place of the pre-activation eager keeps (the
    same bytes: x, W and one [..., N] tensor are saved; gated: two), so g never reaches HBM. dW and db
    accumulate in fp32; a weight given as a transposed view gets its gradient in that layout.

    Gated (GLU) activations "swiglu", "geglu" (erf GELU), "geglu_tanh" return
    ``act(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up)`` of shape ``[..., N]``: ``weight`` is the pair
    ``(W_gate, W_up)`` (each ``[N, K]``, read in place) or one ``[2N, K]`` tensor ``cat([W_gate, W_up])``;
    ``bias`` likewise a pair, ``[2N]`` or None.

    ``fp8=True`` (inference only; not gated): ``act((x_q * sx) @ (w_q * sw)^T + bias)`` on e4m3 operands into an
    fp32 accumulator, x scaled per row and W per output channel (scale = amax(|row|) / 448); the scales, the
    bias (float32, float16 or bfloat16, added in fp32) and the activation are applied in the epilogue.
    ``weight``: a ``tilefuse.QuantizedWeight`` from ``tilefuse.quantize_weight`` (quantized once: the fast
    path), or a 16/32-bit ``[N, K]`` tensor, quantized on every call. ``x``: 16/32-bit, quantized per row by a
    pre-pass kernel (one read of x; its e4m3 rows and scales written), or ``torch.float8_e4m3fn`` with
    ``x_scale`` (float32 of shape ``x.shape[:-1]`` or ``[..., 1]``: the unquantized x ~= x * x_scale[..., None]).
    Returns ``[..., N]``: in x's dtype for a 16/32-bit x (the autocast dtype under autocast); for an e4m3 x in
    bias's dtype, without a bias in the dtype the weight had before quantization. Needs compute capability 8.9+
    on CUDA, and refuses a call autograd would have to record (NotImplementedError both). Registered as
    ``torch.ops.tilefuse.linear_fp8`` (tilefuse/ops/fp8_linear.py).

    Registered as ``torch.ops.tilefuse.linear`` / ``torch.ops.tilefuse.gated_linear``: works under
    ``torch.compile`` (fullgraph, dynamic shapes) and CUDA-graph capture. Host cost: a repeated call
    (same shapes, strides, dtypes, alignment) replays its launch (the launch layer's fast path).
    """
    if fp8:
        return fp8_linear.linear_fp8(x, weight, bias, activation, x_scale)
    if x_scale is not None:
        raise ValueError("x_scale is the per-row scale of an fp8 x: it needs fp8=True")
    if isinstance(weight, fp8_linear.QuantizedWeight):
        raise TypeError("weight is a tilefuse.QuantizedWeight: pass fp8=True to run the FP8 GEMM")
    if isinstance(x, torch.Tensor) and x.dtype == fp8_linear.FP8_DTYPE:
        raise TypeError("x is float8_e4m3fn: pass fp8=True and its per-row scales as x_scale")
    if isinstance(weight, torch.Tensor) and weight.dtype == fp8_linear.FP8_DTYPE:
        raise TypeError("weight is float8_e4m3fn: make it with tilefuse.quantize_weight(W) and pass fp8=True")
    if activation is not None and activation not in ACTIVATIONS + GATED_ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS + GATED_ACTIVATIONS}, got {activation!r}")
    if _dtensor.any_dtensor(x, weight, bias):  # tensor parallelism: the local shards (ops/_dtensor.py)
        return _dtensor.linear(x, weight, bias, activation, linear)
    if activation in GATED_ACTIVATIONS:
        w_gate, w_up, b_gate, b_up = _split_gated(weight, bias, activation)
        cast = _dispatch.autocast_dtype(x) if isinstance(x, torch.Tensor) else None
        if cast is not None:  # as torch's linear under autocast: the GEMM in the autocast dtype
            x, w_gate, w_up, b_gate, b_up = _dispatch.cast_floats(cast, x, w_gate, w_up, b_gate, b_up)
        check_linear_args(x, w_up, b_up, activation, name="W_up", bias_name="b_up")
        check_linear_args(x, w_gate, b_gate, activation, name="W_gate", bias_name="b_gate")
        b_gate, b_up = dense(b_gate), dense(b_up)
        if _dispatch.direct(x, w_gate, w_up, b_gate, b_up):
            return _gated_linear_impl(x, w_gate, w_up, b_gate, b_up, activation, False)[0]
        save_slope = grad_needed(x, w_gate, w_up, b_gate, b_up)
        return _gated_linear_call(x, w_gate, w_up, b_gate, b_up, activation, save_slope)[0]
    if isinstance(weight, (tuple, list)):
        raise ValueError(f"a pair of weights needs a gated activation {GATED_ACTIVATIONS}, "
                         f"got activation={activation!r}")
    cast = _dispatch.autocast_dtype(x) if isinstance(x, torch.Tensor) else None
    if cast is not None:  # as torch's linear under autocast: the GEMM in the autocast dtype
        x, weight, bias = _dispatch.cast_floats(cast, x, weight, bias)
    check_linear_args(x, weight, bias, activation)
    bias = dense(bias)
    if _dispatch.direct(x, weight, bias):
        return _linear_impl(x, weight, bias, activation, False)[0]
    save_slope = activation is not None and grad_needed(x, weight, bias)
    return _linear_call(x, weight, bias, activation, save_slope)[0]

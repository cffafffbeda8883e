"""FP8 (e4m3) Linear for inference: ``tilefuse.linear(..., fp8=True)`` and the weights it takes.

Scales: x per row (token) and W per output channel, each amax(|row|) / 448, so every row uses e4m3's whole
range; the GEMM multiplies the e4m3 values into an fp32 accumulator and its epilogue applies both scales, the
bias and the activation (kernels/gemm/fp8.py). A weight is quantized once (:func:`quantize_weight`, a
:class:`QuantizedWeight`); a 16/32-bit x is quantized per call by a pre-pass kernel, or arrives as e4m3 with
its scales. Registered as the custom ops ``tilefuse::linear_fp8`` and ``tilefuse::quantize_rows`` (fake
implementations for torch.compile). Forward only: a call autograd would have to record is refused.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tilefuse import runtime
from tilefuse.constants import ACTIVATIONS, GATED_ACTIVATIONS
from tilefuse.ops import _dispatch, _dtensor
from tilefuse.ops._checks import FLOAT_DTYPES, check_fp8_device, check_same_device, check_tensor, dense, grad_needed
from tilefuse.reference import fp8_linear as fp8_reference

FP8_DTYPE = torch.float8_e4m3fn


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class QuantizedWeight:
    """An e4m3 weight with one fp32 scale per output channel, W ~= data * scale[:, None]: what
    :func:`quantize_weight` makes, once per weight, for ``tilefuse.linear(x, weight, ..., fp8=True)``.

    - ``data``: ``torch.float8_e4m3fn`` [N, K], K-contiguous;
    - ``scale``: fp32 [N], amax(|W[n, :]|) / 448 (1.0 for an all-zero row, NaN for a row holding NaN or inf);
    - ``dtype``: the weight's dtype before quantization, the output dtype of a call whose x is e4m3 and that
      has no bias;
    - ``shape``: [N, K] (``data.shape``).
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        if not isinstance(data, torch.Tensor) or data.dtype != FP8_DTYPE:
            raise TypeError(f"QuantizedWeight data must be a torch.float8_e4m3fn tensor, got "
                            f"{_dtype_text(data.dtype) if isinstance(data, torch.Tensor) else type(data).__name__}")
        if data.dim() != 2:
            raise ValueError(f"QuantizedWeight data must be 2-D [N, K], got shape {tuple(data.shape)}")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise TypeError("QuantizedWeight scale must be a float32 tensor [N], got "
                            f"{_dtype_text(scale.dtype) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
        if tuple(scale.shape) != (data.shape[0],):
            raise ValueError(f"QuantizedWeight scale must have shape [{data.shape[0]}] (one per row of data), got "
                             f"{tuple(scale.shape)}")
        check_same_device("QuantizedWeight scale", scale, "data", data)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"QuantizedWeight dtype must be one of float32, float16, bfloat16, got {dtype}")
        self.data = data.contiguous()
        self.scale = scale.contiguous()
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self) -> torch.Tensor:
        """data * scale[:, None] in ``dtype``: the weight the FP8 GEMM multiplies by."""
        return (self.data.float() * self.scale[:, None]).to(self.dtype)

    def to(self, device) -> "QuantizedWeight":
        """The same weight on ``device`` (the e4m3 values and scales unchanged)."""
        return QuantizedWeight(self.data.to(device), self.scale.to(device), self.dtype)

    def __repr__(self) -> str:
        return (f"QuantizedWeight(shape={list(self.shape)}, dtype={_dtype_text(self.dtype)}, "
                f"device={self.device})")


# ---- FP8 capability -------------------------------------------------------------------------------------
def _gemm_launch():
    runtime.check_triton()
    from tilefuse.kernels.gemm import launch  # imports triton: only once a kernel is to run
    return launch


# ---- the row quantizer --------------------------------------------------------------------------------
def _quantize_rows_impl(x):
    """(q e4m3 [M, K] contiguous, scale fp32 [M]) for the M rows of x [..., K]."""
    M, K = math.prod(x.shape[:-1]), x.shape[-1]
    path = runtime.execution_path(x)
    if path == runtime.REFERENCE or M == 0 or K == 0:
        _dispatch.record_reference("quantize_rows", path)
        q, scale = fp8_reference.quantize_rows(x.reshape(M, K))
        return q.contiguous(), scale
    check_fp8_device("x", x)
    with _dispatch.on_device(x):
        return _gemm_launch().quantize_rows(x, path)


@torch.library.custom_op("tilefuse::quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows_impl(x)


@_quantize_rows_op.register_fake
def _(x):
    M = math.prod(x.shape[:-1])
    return (x.new_empty((M, x.shape[-1]), dtype=FP8_DTYPE), x.new_empty((M,), dtype=torch.float32))


def _quantize_rows(x):
    if _dispatch.direct(x):
        return _quantize_rows_impl(x)
    return _quantize_rows_op(x)


def quantize_weight(linear_or_tensor: torch.nn.Linear | torch.Tensor) -> QuantizedWeight:
    """Quantize a weight for ``tilefuse.linear(..., fp8=True)``: each output channel (row of W [N, K]) to e4m3
    with the fp32 scale amax(|row|) / 448 (an all-zero row: 1.0). Takes a ``torch.nn.Linear`` (its ``.weight``)
    or a 2-D float32/float16/bfloat16 tensor; the result holds no reference to it. One kernel on a GPU
    (compute capability 8.9+) and in the interpreter; the PyTorch reference elsewhere on a CPU."""
    if isinstance(linear_or_tensor, torch.nn.Linear):
        name, w = "linear_or_tensor.weight", linear_or_tensor.weight
    elif isinstance(linear_or_tensor, torch.Tensor):
        name, w = "linear_or_tensor", linear_or_tensor
    else:
        raise TypeError("quantize_weight takes a torch.nn.Linear or a 2-D float tensor [N, K], got "
                        f"{type(linear_or_tensor).__name__}")
    if w.dtype == FP8_DTYPE:
        raise TypeError(f"{name} is float8_e4m3fn already; wrap it with its per-row scales as "
                        "tilefuse.QuantizedWeight(data, scale, dtype)")
    check_tensor(name, w)
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, K] (the nn.Linear layout), got shape {tuple(w.shape)}")
    w = w.detach()
    q, scale = _quantize_rows(w)
    return QuantizedWeight(q, scale, w.dtype)


# ---- the GEMM -------------------------------------------------------------------------------------------
@torch.library.custom_op("tilefuse::linear_fp8", mutates_args=())
def _linear_fp8_op(x: torch.Tensor, x_scale: Optional[torch.Tensor], w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: Optional[torch.Tensor], activation: Optional[str], out_dtype: torch.dtype) -> torch.Tensor:
    return _linear_fp8_impl(x, x_scale, w_q, w_scale, bias, activation, out_dtype)


@_linear_fp8_op.register_fake
def _(x, x_scale, w_q, w_scale, bias, activation, out_dtype):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]), dtype=out_dtype)


def _linear_fp8_impl(x, x_scale, w_q, w_scale, bias, activation, out_dtype):
    """y [..., N] in out_dtype. x e4m3 with x_scale fp32 of x.shape[:-1] (contiguous), or 16/32-bit with x_scale
    None (quantized per row first); w_q e4m3 [N, K] contiguous, w_scale fp32 [N]."""
    path = runtime.execution_path(x)
    N, K = w_q.shape
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("linear_fp8", path)
        x_q, sx = fp8_reference.quantize_rows(x) if x_scale is None else (x, x_scale)
        return fp8_reference.linear_fp8_rowwise(x_q, sx, w_q, w_scale, bias, activation, out_dtype)
    check_fp8_device("x", x)
    with _dispatch.on_device(x):
        return _gemm_launch().linear_fp8(x, x_scale, w_q, w_scale, bias, activation, out_dtype, path)


def _check_x_scale(x_scale, x: torch.Tensor) -> torch.Tensor:
    """x_scale as fp32 of x's rows' shape (x.shape[:-1]), dense; [..., 1] is taken too."""
    if not isinstance(x_scale, torch.Tensor):
        raise TypeError(f"x_scale must be a torch.Tensor (float32, one scale per row of x), got "
                        f"{type(x_scale).__name__}")
    if x_scale.dtype != torch.float32:
        raise TypeError(f"x_scale has dtype {_dtype_text(x_scale.dtype)}; expected float32")
    rows = tuple(x.shape[:-1])
    shape = tuple(x_scale.shape)
    if not (shape == rows or shape == rows + (1,)):
        raise ValueError(f"x_scale must have shape {list(rows)} or {list(rows + (1,))} (one scale per row of x "
                         f"{list(x.shape)}), got {list(shape)}")
    check_same_device("x_scale", x_scale, "x", x)
    return dense(x_scale.reshape(rows))


def linear_fp8(x, weight, bias=None, activation=None, x_scale=None):
    """``tilefuse.linear(x, weight, bias, activation, fp8=True, x_scale=x_scale)``: its docstring is the
    contract. Every check runs before any kernel launches."""
    if activation is not None and activation not in ACTIVATIONS:
        if activation in GATED_ACTIVATIONS:
            raise ValueError(f"fp8=True takes activation None or one of {ACTIVATIONS}; gated activations "
                             f"({activation!r}) run in 16-bit only (fp8=False)")
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(weight, (tuple, list)):
        raise ValueError("fp8=True takes one weight (a QuantizedWeight or an [N, K] tensor), not a pair: gated "
                         "activations run in 16-bit only (fp8=False)")
    if _dtensor.any_dtensor(x, weight if isinstance(weight, torch.Tensor) else None, bias, x_scale):
        raise NotImplementedError("fp8=True does not take DTensors; call it on the local shards")
    # The weight: quantized already, or a 16/32-bit tensor quantized on this call (after every check).
    if isinstance(weight, QuantizedWeight):
        w_q, w_scale, w_dtype, to_quantize = weight.data, weight.scale, weight.dtype, None
    elif isinstance(weight, torch.Tensor):
        if weight.dtype == FP8_DTYPE:
            raise TypeError("weight is a float8_e4m3fn tensor without its scales: make it with "
                            "tilefuse.quantize_weight(W) and pass that QuantizedWeight")
        check_tensor("weight", weight)
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [N, K] (the nn.Linear layout), got shape {tuple(weight.shape)}")
        w_q, w_scale, w_dtype, to_quantize = weight, None, weight.dtype, weight
    else:
        raise TypeError("weight must be a tilefuse.QuantizedWeight (from tilefuse.quantize_weight) or a "
                        f"torch.Tensor [N, K], got {type(weight).__name__}")
    # x: 16/32-bit (quantized per row by the pre-pass), or e4m3 with its row scales.
    check_tensor("x", x, dtypes=FLOAT_DTYPES + (FP8_DTYPE,))
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension [..., K], got a 0-d tensor")
    x_is_fp8 = x.dtype == FP8_DTYPE
    if x_is_fp8 and x_scale is None:
        raise ValueError("x is float8_e4m3fn: pass its per-row scales as x_scale (float32 [...]: the "
                         "unquantized x ~= x * x_scale[..., None])")
    if not x_is_fp8 and x_scale is not None:
        raise ValueError(f"x_scale is only for an x already in float8_e4m3fn; x is {_dtype_text(x.dtype)}, which "
                         "fp8=True quantizes per row itself (pass x_scale=None)")
    N, K = w_q.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} in its last dimension but weight is [N={N}, K={K}]; the last "
                         "dimension of x must equal weight.shape[1]")
    if bias is not None:
        check_tensor("bias", bias)
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"bias must have shape [{N}] (weight.shape[0]), got {tuple(bias.shape)}")
        check_same_device("bias", bias, "x", x)
    check_same_device("weight", w_q, "x", x)
    if x_scale is not None:
        x_scale = _check_x_scale(x_scale, x)
    if grad_needed(x, bias, x_scale, to_quantize):
        raise NotImplementedError("fp8=True is forward-only (inference): call it under torch.no_grad() or "
                                  "torch.inference_mode(), or on tensors that do not require grad")
    if x_is_fp8:
        out_dtype = bias.dtype if bias is not None else w_dtype
    else:
        out_dtype = _dispatch.autocast_dtype(x) or x.dtype  # as torch's linear under autocast
    if to_quantize is not None:
        w_q, w_scale = _quantize_rows(to_quantize.detach())
    bias = dense(bias)
    if _dispatch.direct(x, x_scale, w_q, w_scale, bias):
        return _linear_fp8_impl(x, x_scale, w_q, w_scale, bias, activation, out_dtype)
    return _linear_fp8_op(x, x_scale, w_q, w_scale, bias, activation, out_dtype)

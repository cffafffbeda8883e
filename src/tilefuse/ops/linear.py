"""tilefuse.linear: act(x @ weight^T + bias) in one kernel (forward), plain and gated (GLU).

Registered as the custom ops ``tilefuse::linear`` and ``tilefuse::gated_linear`` (see ``_dispatch``).
"""
from __future__ import annotations

from typing import Optional

import torch

from tilefuse import reference, runtime
from tilefuse.constants import ACTIVATIONS, GATED_ACTIVATIONS
from tilefuse.ops import _dispatch
from tilefuse.ops._checks import (check_no_grad_needed, check_same_device, check_same_dtype,
                                  check_tensor, dense)


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


@torch.library.custom_op("tilefuse::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               activation: Optional[str]) -> torch.Tensor:
    return _linear_impl(x, weight, bias, activation)


@_linear_op.register_fake
def _(x, weight, bias, activation):
    return _empty(x, weight.shape[0])


def _linear_impl(x, weight, bias, activation):
    path = runtime.execution_path(x)
    N, K = weight.shape
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("linear", path)
        return _empty(x, N).copy_(reference.linear(x, weight, bias, activation))
    with _dispatch.on_device(x):
        return _gemm_launch().linear(x, weight, bias, activation, path)


@torch.library.custom_op("tilefuse::gated_linear", mutates_args=())
def _gated_linear_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, b_gate: Optional[torch.Tensor],
                     b_up: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    return _gated_linear_impl(x, w_gate, w_up, b_gate, b_up, activation)


@_gated_linear_op.register_fake
def _(x, w_gate, w_up, b_gate, b_up, activation):
    return _empty(x, w_gate.shape[0])


def _gated_linear_impl(x, w_gate, w_up, b_gate, b_up, activation):
    path = runtime.execution_path(x)
    N, K = w_gate.shape
    if path == runtime.REFERENCE or N == 0 or K == 0 or x.numel() == 0:
        _dispatch.record_reference("linear", path)
        return _empty(x, N).copy_(reference.gated_linear(x, w_gate, w_up, b_gate, b_up, activation))
    with _dispatch.on_device(x):
        return _gemm_launch().gated_linear(x, w_gate, w_up, b_gate, b_up, activation, path)


def linear(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
           bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
           activation: str | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` computed by one fused kernel.

    x: ``[..., K]`` (1-D allowed); weight: ``[N, K]`` as in ``nn.Linear``; bias: ``[N]`` or None;
    activation: None, "gelu" (erf form, = ``F.gelu``), "gelu_tanh" (= ``F.gelu(approximate="tanh")``),
    "relu" or "silu". Returns ``[..., N]`` in ``x.dtype``. fp32 inputs use full-precision fp32 unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set. CPU tensors run the Triton kernel under
    ``TRITON_INTERPRET=1`` and the PyTorch reference otherwise. Forward only: with grad required it
    raises ``NotImplementedError``.

    Gated (GLU) activations "swiglu", "geglu" (erf GELU), "geglu_tanh" return
    ``act(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up)`` of shape ``[..., N]``: ``weight`` is the pair
    ``(W_gate, W_up)`` (each ``[N, K]``, read in place) or one ``[2N, K]`` tensor ``cat([W_gate, W_up])``;
    ``bias`` likewise a pair, ``[2N]`` or None.

    Registered as ``torch.ops.tilefuse.linear`` / ``torch.ops.tilefuse.gated_linear``: works under
    ``torch.compile`` (fullgraph, dynamic shapes) and CUDA-graph capture. Host cost: a repeated call
    (same shapes, strides, dtypes, alignment) replays its launch (the launch layer's fast path).
    """
    if activation is not None and activation not in ACTIVATIONS + GATED_ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS + GATED_ACTIVATIONS}, got {activation!r}")
    if activation in GATED_ACTIVATIONS:
        w_gate, w_up, b_gate, b_up = _split_gated(weight, bias, activation)
        cast = _dispatch.autocast_dtype(x) if isinstance(x, torch.Tensor) else None
        if cast is not None:  # as torch's linear under autocast: the GEMM in the autocast dtype
            x, w_gate, w_up, b_gate, b_up = _dispatch.cast_floats(cast, x, w_gate, w_up, b_gate, b_up)
        check_linear_args(x, w_up, b_up, activation, name="W_up", bias_name="b_up")
        check_linear_args(x, w_gate, b_gate, activation, name="W_gate", bias_name="b_gate")
        check_no_grad_needed("linear", x, w_gate, b_gate, w_up, b_up)
        b_gate, b_up = dense(b_gate), dense(b_up)
        if _dispatch.direct(x, w_gate, w_up, b_gate, b_up):
            return _gated_linear_impl(x, w_gate, w_up, b_gate, b_up, activation)
        return _gated_linear_op(x, w_gate, w_up, b_gate, b_up, activation)
    if isinstance(weight, (tuple, list)):
        raise ValueError(f"a pair of weights needs a gated activation {GATED_ACTIVATIONS}, "
                         f"got activation={activation!r}")
    cast = _dispatch.autocast_dtype(x) if isinstance(x, torch.Tensor) else None
    if cast is not None:  # as torch's linear under autocast: the GEMM in the autocast dtype
        x, weight, bias = _dispatch.cast_floats(cast, x, weight, bias)
    check_linear_args(x, weight, bias, activation)
    check_no_grad_needed("linear", x, weight, bias)
    bias = dense(bias)
    if _dispatch.direct(x, weight, bias):
        return _linear_impl(x, weight, bias, activation)
    return _linear_op(x, weight, bias, activation)

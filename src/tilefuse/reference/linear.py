"""Reference for the GEMM family: F.linear then the activation."""

import math

import torch
import torch.nn.functional as F


def activation(y: torch.Tensor, name: str | None) -> torch.Tensor:
    if name is None:
        return y
    if name == "gelu":
        return F.gelu(y)
    if name == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if name == "relu":
        return F.relu(y)
    if name == "silu":
        return F.silu(y)
    raise ValueError(f"unknown activation {name!r}")


def linear(x, weight, bias=None, activation_name=None):
    """``F.linear`` then the activation: two kernels, the pre-activation round-trips through HBM."""
    return activation(F.linear(x, weight, bias), activation_name)


_GATE = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def gate(t: torch.Tensor, name: str) -> torch.Tensor:
    """The gate's activation of a GLU: silu for swiglu, GELU (erf or tanh) for geglu / geglu_tanh."""
    return _GATE[name](t)


def gated_linear(x, w_gate, w_up, b_gate=None, b_up=None, activation_name="swiglu"):
    """Eager GLU: two GEMMs, then ``act(g) * u`` -- five [M, N] tensors cross HBM after the GEMMs."""
    return _GATE[activation_name](F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _vjp(fn, dy, *inputs):
    """The gradients of ``fn(*inputs)`` against ``dy``, computed in fp32 (fp64 stays fp64)."""
    leaves = [t.detach().to(_compute_dtype(t)).requires_grad_() for t in inputs]
    with torch.enable_grad():
        out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dy.to(out.dtype))


def _gemm_grads(g, x, weight):
    """(dx, dW, db) from g [..., N] in the compute dtype, cast to x's dtype."""
    K, N = x.shape[-1], g.shape[-1]
    M = math.prod(x.shape[:-1])
    g2d = g.reshape(M, N)
    x2d = x.reshape(M, K).to(g.dtype)
    dx = (g2d @ weight.to(g.dtype)).reshape(x.shape).to(x.dtype)
    return dx, (g2d.t() @ x2d).to(x.dtype), g2d.sum(0).to(x.dtype)


def linear_backward(dy, x, weight, pre, activation_name):
    """(dx, dW, db) of ``act(x @ W^T + b)`` from dy and the saved pre-activation (None without an
    activation), as eager autograd computes them: g = dy * act'(pre), then the two GEMMs and a sum."""
    if activation_name is None:
        g = dy.to(_compute_dtype(dy))
    else:
        (g,) = _vjp(lambda p: activation(p, activation_name), dy, pre)
    g = g.to(dy.dtype).to(g.dtype)  # eager's g is a tensor in dy's dtype
    return _gemm_grads(g, x, weight)


def gated_linear_backward(dy, x, w_gate, w_up, gate_pre, up_pre, activation_name):
    """(dx, dW_gate, dW_up, db_gate, db_up) of the GLU from dy and the two saved pre-activations."""
    g_gate, g_up = _vjp(lambda a, u: _GATE[activation_name](a) * u, dy, gate_pre, up_pre)
    g_gate, g_up = (t.to(dy.dtype).to(t.dtype) for t in (g_gate, g_up))
    dx_gate, dw_gate, db_gate = _gemm_grads(g_gate, x, w_gate)
    dx_up, dw_up, db_up = _gemm_grads(g_up, x, w_up)
    return (dx_gate.to(g_gate.dtype) + dx_up.to(g_up.dtype)).to(x.dtype), dw_gate, dw_up, db_gate, db_up

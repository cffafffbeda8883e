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


def _derivative(p: torch.Tensor, name: str) -> torch.Tensor:
    """act'(p) in closed form (custom ops run below autograd, so no autograd here). relu: 0 where p <= 0,
    else 1 (NaN included), as torch's threshold backward passes dy where its output is NaN."""
    if name in ("gelu", "geglu"):
        return 0.5 * (1 + torch.erf(p * 0.5 ** 0.5)) + p * torch.exp(-0.5 * p * p) * (2 * math.pi) ** -0.5
    if name in ("gelu_tanh", "geglu_tanh"):
        c = (2 / math.pi) ** 0.5
        t = torch.tanh(c * (p + 0.044715 * p ** 3))
        return 0.5 * (1 + t) + 0.5 * p * (1 - t * t) * c * (1 + 3 * 0.044715 * p * p)
    if name == "relu":
        return torch.where(p <= 0, 0.0, 1.0).to(p.dtype)
    if name in ("silu", "swiglu"):
        sig = torch.sigmoid(p)
        return sig * (1 + p * (1 - sig))
    raise ValueError(f"unknown activation {name!r}")


def activation_slope(pre: torch.Tensor, name: str) -> torch.Tensor:
    """``act'(pre)`` (in fp32, fp64 for fp64): what the training forward saves for the backward."""
    return _derivative(pre.to(_compute_dtype(pre)), name)


def gated_slopes(gate: torch.Tensor, up: torch.Tensor, name: str):
    """(up * act'(gate), act(gate)): the GLU's partial derivatives, saved for the backward."""
    a, u = gate.to(_compute_dtype(gate)), up.to(_compute_dtype(up))
    return u * _derivative(a, name), _GATE[name](a)


def _gemm_grads(g, x, weight):
    """(dx, dW, db) from g [..., N] in the compute dtype, cast to x's dtype."""
    K, N = x.shape[-1], g.shape[-1]
    M = math.prod(x.shape[:-1])
    g2d = g.reshape(M, N)
    x2d = x.reshape(M, K).to(g.dtype)
    dx = (g2d @ weight.to(g.dtype)).reshape(x.shape).to(x.dtype)
    return dx, (g2d.t() @ x2d).to(x.dtype), g2d.sum(0).to(x.dtype)


def _g(dy, slope):
    """g = dy * slope in the compute dtype, rounded to dy's dtype as eager's g tensor is."""
    g = dy.to(_compute_dtype(dy))
    if slope is not None:
        g = g * slope.to(g.dtype)
    return g.to(dy.dtype).to(g.dtype)


def linear_backward(dy, x, weight, slope):
    """(dx, dW, db) of ``act(x @ W^T + b)`` from dy and the saved slope act'(pre) (None without an
    activation): g = dy * slope, then the two GEMMs and a sum."""
    return _gemm_grads(_g(dy, slope), x, weight)


def gated_linear_backward(dy, x, w_gate, w_up, s_gate, s_up):
    """(dx, dW_gate, dW_up, db_gate, db_up) of the GLU from dy and its two saved slopes."""
    g_gate, g_up = _g(dy, s_gate), _g(dy, s_up)
    dx_gate, dw_gate, db_gate = _gemm_grads(g_gate, x, w_gate)
    dx_up, dw_up, db_up = _gemm_grads(g_up, x, w_up)
    return (dx_gate.to(g_gate.dtype) + dx_up.to(g_up.dtype)).to(x.dtype), dw_gate, dw_up, db_gate, db_up


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat([-t[..., half:], t[..., :half]], dim=-1)


def rotate_pairs(t: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotation: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack([-t[..., 1::2], t[..., ::2]], dim=-1).flatten(-2)


def qkv_projection(x, weights, biases, num_heads, num_kv_heads, rotary=None, interleaved=False, qk_norm=None):
    """Eager: three F.linear, view as heads, transpose to [B, H, N, d], per-head RMSNorm, then RoPE on the
    first r dims (HF Llama's ``apply_rotary_pos_emb``; GPT-J's pairs when ``interleaved``)."""
    B, N, _ = x.shape
    outs = []
    for i, (w, b, h) in enumerate(zip(weights, biases, (num_heads, num_kv_heads, num_kv_heads))):
        t = F.linear(x, w, b).view(B, N, h, -1).transpose(1, 2)
        if i < 2 and qk_norm is not None:
            t = F.rms_norm(t, (t.shape[-1],), qk_norm[i], qk_norm[2])
        if i < 2 and rotary is not None:
            cos, sin = rotary
            cos, sin = (c[:, None] if c.dim() == 3 else c[None, None] for c in (cos, sin))
            r = cos.shape[-1]
            rot, rest = t[..., :r], t[..., r:]
            turn = rotate_pairs(rot) if interleaved else rotate_half(rot)
            t = torch.cat([rot * cos.to(t.dtype) + turn * sin.to(t.dtype), rest], dim=-1)
        outs.append(t)
    return tuple(outs)

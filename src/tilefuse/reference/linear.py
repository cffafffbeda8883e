"""Reference for the GEMM family: F.linear then the activation."""

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


def gated_linear(x, w_gate, w_up, b_gate=None, b_up=None, activation_name="swiglu"):
    """Eager GLU: two GEMMs, then ``act(g) * u`` -- five [M, N] tensors cross HBM after the GEMMs."""
    return _GATE[activation_name](F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)

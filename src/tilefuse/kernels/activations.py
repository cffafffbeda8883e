"""Activation math as Triton helpers: one copy of each, shared by every epilogue.

All helpers take and return fp32 tiles. NaN propagates as in PyTorch (relu(NaN) = NaN: the comparison
is written so that NaN falls through to ``x``). ``tanh`` is written through ``sigmoid`` because triton
3.6 has no portable ``tl.math.tanh`` (the libdevice one does not run in the interpreter).
"""
import triton
import triton.language as tl

from tilefuse.kernels import cache_keys


# Globals read inside @triton.jit must be tl.constexpr (the compiler refuses plain floats; the
# interpreter does not check, so this is only caught on a GPU).
_SQRT1_2 = tl.constexpr(0.7071067811865476)       # 1/sqrt(2), GELU erf form
_SQRT2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2/pi), GELU tanh form
_GELU_TANH_C = tl.constexpr(0.044715)


@triton.jit
def tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def gelu_erf(x):
    return 0.5 * x * (1.0 + tl.erf(x * _SQRT1_2))


@triton.jit
def gelu_tanh(x):
    inner = _SQRT2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner))


@triton.jit
def relu(x):
    return tl.where(x < 0.0, 0.0, x)


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    """``ACTIVATION`` is a constexpr name from ACTIVATIONS or "none"; resolved at compile time."""
    if ACTIVATION == "gelu":
        x = gelu_erf(x)
    elif ACTIVATION == "gelu_tanh":
        x = gelu_tanh(x)
    elif ACTIVATION == "relu":
        x = relu(x)
    elif ACTIVATION == "silu":
        x = silu(x)
    return x


@triton.jit
def apply_gated(gate, up, ACTIVATION: tl.constexpr):
    """GLU epilogue on two fp32 tiles: swiglu = silu(gate) * up, geglu = gelu(gate) * up (erf form),
    geglu_tanh = gelu_tanh(gate) * up."""
    if ACTIVATION == "swiglu":
        gate = silu(gate)
    elif ACTIVATION == "geglu":
        gate = gelu_erf(gate)
    else:
        tl.static_assert(ACTIVATION == "geglu_tanh", "unknown gated activation")
        gate = gelu_tanh(gate)
    return gate * up


# ---- derivatives, for the training forward's epilogues ---------------------------------------------------
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi), the normal density's constant


@triton.jit
def gelu_erf_grad(x):
    """d/dx x*Phi(x) = Phi(x) + x*phi(x)."""
    cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
    return cdf + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)


@triton.jit
def gelu_tanh_grad(x):
    """d/dx 0.5*x*(1 + tanh(u)), u = sqrt(2/pi)*(x + c*x^3): 0.5*(1 + t) + 0.5*x*(1 - t^2)*u'."""
    x2 = x * x
    t = tanh(_SQRT2_OVER_PI * (x + _GELU_TANH_C * x2 * x))
    du = _SQRT2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * x2)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


@triton.jit
def silu_grad(x):
    """d/dx x*sigmoid(x) = s*(1 + x*(1 - s))."""
    s = tl.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@triton.jit
def activation_slope(pre, ACTIVATION: tl.constexpr):
    """``act'(pre)`` on an fp32 tile: what the training forward stores for the backward, which then only
    multiplies it by dy. relu's slope is 0 where pre <= 0 and 1 elsewhere, NaN included, as torch's
    threshold backward passes dy through where its output is NaN."""
    if ACTIVATION == "gelu":
        slope = gelu_erf_grad(pre)
    elif ACTIVATION == "gelu_tanh":
        slope = gelu_tanh_grad(pre)
    elif ACTIVATION == "relu":
        slope = tl.where(pre <= 0.0, 0.0, 1.0)
    else:
        tl.static_assert(ACTIVATION == "silu", "unknown activation")
        slope = silu_grad(pre)
    return slope


@triton.jit
def gated_slopes(gate, up, ACTIVATION: tl.constexpr):
    """The partial derivatives of ``act(gate) * up`` on fp32 tiles: (up * act'(gate), act(gate)); the
    backward's g for each branch is dy times one of them."""
    if ACTIVATION == "swiglu":
        act, grad = silu(gate), silu_grad(gate)
    elif ACTIVATION == "geglu":
        act, grad = gelu_erf(gate), gelu_erf_grad(gate)
    else:
        tl.static_assert(ACTIVATION == "geglu_tanh", "unknown gated activation")
        act, grad = gelu_tanh(gate), gelu_tanh_grad(gate)
    return up * grad, act


cache_keys.settle(globals())

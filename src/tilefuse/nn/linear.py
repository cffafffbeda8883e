"""nn.Module drop-ins for a Linear, a gated (GLU) MLP and a norm followed by a Linear, backed by the
fused tilefuse GEMMs.

Each keeps torch's state-dict layout: ``Linear`` is a ``torch.nn.Linear`` subclass, ``GatedMLP`` holds
``gate_proj`` / ``up_proj`` / ``down_proj`` (the Llama MLP names) and ``LayerNormLinear`` holds ``norm``
and ``linear``, all plain torch modules. The activation is a constructor argument, never a buffer. The
``from_*`` classmethods wrap existing modules and share their Parameter objects (an optimizer built on the
originals keeps training them).
"""
from __future__ import annotations

import torch

from tilefuse.constants import ACTIVATIONS
from tilefuse.ops.cross_entropy import linear_cross_entropy
from tilefuse.ops.fp8_linear import QuantizedWeight, quantize_weight
from tilefuse.ops.linear import linear
from tilefuse.ops.norms import layer_norm_linear
from tilefuse.ops.qkv import qkv_projection

# GatedMLP's activation names the gate's function; the op takes the gated epilogue's name.
_GATED = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


def _check_activation(activation):
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    return activation


def _check_is_linear(name, module):
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"{name} must be a torch.nn.Linear, got {type(module).__name__}")


class Linear(torch.nn.Linear):
    """``act(torch.nn.Linear(x))`` in one kernel (:func:`tilefuse.linear`); the state dict is torch's.

    FP8 inference: :meth:`quantize_` (or ``from_linear(..., fp8=True)``) replaces the weight by its e4m3 values
    and per-output-channel scales (:func:`tilefuse.quantize_weight`), kept as the buffers ``weight_fp8``
    (float8_e4m3fn [out, in]) and ``weight_scale`` (fp32 [out]); ``weight`` is then None and forward runs
    ``linear(..., fp8=True)``, forward-only (under ``torch.no_grad()`` / ``torch.inference_mode()`` while the bias
    requires grad). The state dict then holds ``weight_fp8``, ``weight_scale`` and ``bias``; a module quantized
    the same way loads it. ``module.to(dtype)`` leaves the e4m3 values and scales as they are (moving them to a
    device only) and makes ``dtype`` the output dtype of an e4m3 x without a bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = _check_activation(activation)
        self.weight_dtype = None  # with an FP8 weight: the dtype it had (QuantizedWeight.dtype)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, activation: str | None = None, fp8: bool = False) -> "Linear":
        """A tilefuse Linear sharing ``linear``'s weight and bias (the same Parameter objects); with ``fp8``, its
        weight quantized instead (:meth:`quantize_`; the bias still shared)."""
        _check_is_linear("linear", linear)
        # Built on the meta device: no weights allocated, then the originals put in their place.
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, activation=activation,
                     device="meta")
        module.weight, module.bias = linear.weight, linear.bias
        module.train(linear.training)
        return module.quantize_() if fp8 else module

    @property
    def quantized(self) -> bool:
        return "weight_fp8" in self._buffers

    def quantize_(self) -> "Linear":
        """Quantize the weight to e4m3 per output channel in place (see the class doc); returns the module."""
        if self.quantized:
            return self
        qw = quantize_weight(self.weight)
        del self.weight
        self.register_parameter("weight", None)
        self.register_buffer("weight_fp8", qw.data)
        self.register_buffer("weight_scale", qw.scale)
        self.weight_dtype = qw.dtype
        return self

    def quantized_weight(self) -> QuantizedWeight:
        """The FP8 weight as the op takes it (after :meth:`quantize_`)."""
        return QuantizedWeight(self.weight_fp8, self.weight_scale, self.weight_dtype)

    def _apply(self, fn, recurse=True):
        if not self.quantized:
            return super()._apply(fn, recurse)
        # A dtype conversion (module.half(), .to(torch.bfloat16)) would cast the e4m3 values and their fp32
        # scales: they only follow the device, and the dtype becomes the output dtype of an e4m3 x.
        q, scale = self._buffers.pop("weight_fp8"), self._buffers.pop("weight_scale")
        try:
            super()._apply(fn, recurse)
            probe = fn(scale.new_empty(0, dtype=self.weight_dtype))  # where fn sends a tensor of that dtype
        finally:
            self._buffers["weight_fp8"], self._buffers["weight_scale"] = q, scale
        self._buffers["weight_fp8"], self._buffers["weight_scale"] = q.to(probe.device), scale.to(probe.device)
        if probe.dtype in (torch.float32, torch.float16, torch.bfloat16):
            self.weight_dtype = probe.dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return linear(x, self.quantized_weight(), self.bias, self.activation, fp8=True)
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}" + (", fp8=True" if self.quantized else "")


class GatedMLP(torch.nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: the gate, up and product in one kernel (the pair of
    weights read in place), then down_proj. State dict as Llama's MLP (``gate_proj.weight``, ...)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        if activation not in _GATED:
            raise ValueError(f"activation must be one of {tuple(_GATED)} (gated: swiglu, geglu, geglu_tanh), "
                             f"got {activation!r}")
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    @classmethod
    def from_modules(cls, gate_proj: torch.nn.Linear, up_proj: torch.nn.Linear, down_proj: torch.nn.Linear,
                     activation: str = "silu") -> "GatedMLP":
        """A GatedMLP holding the given modules themselves (their parameters shared, not copied)."""
        for name, m in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            _check_is_linear(name, m)
        inter, hidden = gate_proj.weight.shape
        if up_proj.weight.shape != gate_proj.weight.shape:
            raise ValueError(f"up_proj.weight {list(up_proj.weight.shape)} must have gate_proj.weight's shape "
                             f"{list(gate_proj.weight.shape)} [intermediate, hidden]")
        if down_proj.weight.shape != (hidden, inter):
            raise ValueError(f"down_proj.weight must be [hidden, intermediate] = {[hidden, inter]}, "
                             f"got {list(down_proj.weight.shape)}")
        if (gate_proj.bias is None) != (up_proj.bias is None):
            raise ValueError("gate_proj and up_proj must both have a bias or neither")
        module = cls(hidden, inter, activation, bias=gate_proj.bias is not None, device="meta")
        module.gate_proj, module.up_proj, module.down_proj = gate_proj, up_proj, down_proj
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        bias = None if gate.bias is None else (gate.bias, up.bias)
        h = linear(x, (gate.weight, up.weight), bias, activation=_GATED[self.activation])
        return self.down_proj(h)  # a plain GEMM (cuBLAS), through the module so its hooks (tensor parallel) run

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def _norm_kind(norm) -> str:
    if isinstance(norm, torch.nn.RMSNorm):
        return "rms"
    if isinstance(norm, torch.nn.LayerNorm):
        return "layer"
    raise TypeError(f"norm must be a torch.nn.LayerNorm or torch.nn.RMSNorm, got {type(norm).__name__}")


class LayerNormLinear(torch.nn.Module):
    """``act(linear(norm(x)))`` with the normalization fused into the GEMM
    (:func:`tilefuse.layer_norm_linear`). Holds torch's ``norm`` (``nn.LayerNorm`` or ``nn.RMSNorm``) and
    ``linear`` (``nn.Linear``), so the state dict is ``norm.weight``, ``norm.bias``, ``linear.weight``, ...
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, eps: float | None = 1e-5,
                 norm: str = "layer", activation: str | None = None, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if norm == "layer":
            self.norm = torch.nn.LayerNorm(in_features, eps=eps, **factory)
        elif norm == "rms":
            self.norm = torch.nn.RMSNorm(in_features, eps=eps, **factory)
        else:
            raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias, **factory)
        self.activation = _check_activation(activation)

    @classmethod
    def from_modules(cls, norm: torch.nn.LayerNorm | torch.nn.RMSNorm, linear: torch.nn.Linear,
                     activation: str | None = None) -> "LayerNormLinear":
        """A LayerNormLinear holding ``norm`` and ``linear`` themselves (the norm kind from norm's type)."""
        kind = _norm_kind(norm)
        _check_is_linear("linear", linear)
        if tuple(norm.normalized_shape) != (linear.in_features,):
            raise ValueError(f"norm.normalized_shape must be ({linear.in_features},) (linear.in_features): the "
                             f"fused op normalizes the last dim only; got {tuple(norm.normalized_shape)}")
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, eps=norm.eps, norm=kind,
                     activation=activation, device="meta")
        module.norm, module.linear = norm, linear
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, lin = self.norm, self.linear
        kind = _norm_kind(norm)
        return layer_norm_linear(x, norm.weight, norm.bias if kind == "layer" else None, lin.weight, lin.bias,
                                 eps=norm.eps, norm=kind, activation=self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class LinearCrossEntropy(torch.nn.Module):
    """The LM head and its loss in one: ``cross_entropy(linear(x), target)`` by
    :func:`tilefuse.linear_cross_entropy`, the logits never materialised. It holds the given
    ``torch.nn.Linear`` (the head) or ``torch.nn.Embedding`` (a tied embedding) under ``head``, sharing its
    parameters; ``forward(x, target)`` returns the loss. ``check_targets`` as the function's."""

    def __init__(self, linear_or_embedding: torch.nn.Linear | torch.nn.Embedding, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, softcap: float | None = None,
                 check_targets: bool = True) -> None:
        super().__init__()
        if not isinstance(linear_or_embedding, (torch.nn.Linear, torch.nn.Embedding)):
            raise TypeError("linear_or_embedding must be a torch.nn.Linear or torch.nn.Embedding, got "
                            f"{type(linear_or_embedding).__name__}")
        self.head = linear_or_embedding
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.softcap = label_smoothing, softcap
        self.check_targets = bool(check_targets)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.head, "bias", None)
        return linear_cross_entropy(x, self.head.weight, target, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, label_smoothing=self.label_smoothing,
                                    softcap=self.softcap, check_targets=self.check_targets)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, softcap={self.softcap}, check_targets={self.check_targets}")


class QKVProjection(torch.nn.Module):
    """q, k, v in head layout from one call of :func:`tilefuse.qkv_projection`, holding ``q_proj``,
    ``k_proj``, ``v_proj`` (``torch.nn.Linear``) and, with ``qk_norm``, ``q_norm`` / ``k_norm``
    (``torch.nn.RMSNorm`` over the head dim): the Llama / Qwen3 state-dict names. ``forward(x, rotary=None)``
    with x ``[B, N, hidden]`` and rotary ``(cos, sin)`` returns ``(q, k, v)`` as ``[B, H, N, d]``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = True, qk_norm: bool = False, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        factory = {"device": device, "dtype": dtype}
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = torch.nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = torch.nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = torch.nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        if qk_norm:
            self.q_norm = torch.nn.RMSNorm(head_dim, eps=eps, **factory)
            self.k_norm = torch.nn.RMSNorm(head_dim, eps=eps, **factory)
        else:
            self.q_norm = self.k_norm = None

    @classmethod
    def from_linears(cls, q_proj: torch.nn.Linear, k_proj: torch.nn.Linear, v_proj: torch.nn.Linear, num_heads: int,
                     num_kv_heads: int | None = None, q_norm: torch.nn.RMSNorm | None = None,
                     k_norm: torch.nn.RMSNorm | None = None) -> "QKVProjection":
        """A QKVProjection holding the given modules themselves (parameters shared, not copied)."""
        for name, m in (("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)):
            _check_is_linear(name, m)
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm must both be given or neither")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if q_proj.out_features % num_heads:
            raise ValueError(f"q_proj.out_features ({q_proj.out_features}) must be a multiple of num_heads")
        head_dim = q_proj.out_features // num_heads
        module = cls(q_proj.in_features, num_heads, num_kv_heads, head_dim, bias=q_proj.bias is not None,
                     qk_norm=q_norm is not None, device="meta")
        module.q_proj, module.k_proj, module.v_proj = q_proj, k_proj, v_proj
        module.q_norm, module.k_norm = q_norm, k_norm
        return module

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None):
        bias = None if self.q_proj.bias is None else (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)
        qk_norm = None
        if self.q_norm is not None:
            eps = self.q_norm.eps if self.q_norm.eps is not None else torch.finfo(x.dtype).eps
            qk_norm = (self.q_norm.weight, self.k_norm.weight, eps)
        return qkv_projection(x, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight), bias,
                              num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, rotary=rotary, qk_norm=qk_norm)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"

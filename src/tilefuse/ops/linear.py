"""tilefuse.linear: act(x @ weight^T + bias) in one kernel (forward)."""
from __future__ import annotations

import math

import torch

from tilefuse import reference, runtime
from tilefuse.constants import ACTIVATIONS, GATED_ACTIVATIONS
from tilefuse.ops._checks import (check_no_grad_needed, check_same_device, check_same_dtype,
                                  check_tensor, dense)

# The config of the most recent launch, for the report ("which tile ran"). Not thread-safe by design:
# it is a diagnostic, never an input to computation.
last_config = {"config": None, "path": None, "kernel": None}


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


def _split_k(M: int, N: int, K: int, path: str, device) -> int:
    """K slices for small-M (decode) GEMMs on the compiled path; 1 otherwise. Tests on the CPU patch this."""
    if path != runtime.COMPILED:
        return 1
    from tilefuse.kernels.gemm_epilogue import split_k_for
    return split_k_for(M, N, K, runtime.device_facts(device)[1])


def _row_addressing(x: torch.Tensor):
    """Express the rows of x[..., K] as (outer, inner) with two strides, without copying when possible.

    Returns (x_view, m_inner, stride_outer, stride_inner, stride_k). Leading dims are merged while they
    are mutually contiguous; if more than two groups remain, x is copied (rare: a >3-D tensor permuted
    in several leading dims).
    """
    K = x.shape[-1]
    lead = list(zip(x.shape[:-1], x.stride()[:-1]))
    # Drop size-1 dims (their stride is irrelevant) and merge neighbours that are contiguous.
    groups: list[list[int]] = []  # [size, stride]
    for size, stride in lead:
        if size == 1:
            continue
        if groups and groups[-1][1] == size * stride:
            groups[-1] = [groups[-1][0] * size, stride]
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        x = x.contiguous()
        groups = [[x.numel() // max(K, 1), K]]
    if not groups:
        groups = [[1, K]]
    if len(groups) == 1:
        (m, s), = groups
        return x, max(m, 1), 0, s, x.stride(-1)
    (mo, so), (mi, si) = groups
    return x, mi, so, si, x.stride(-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` computed by one fused kernel.

    x: ``[..., K]`` (1-D allowed); weight: ``[N, K]`` as in ``nn.Linear``; bias: ``[N]`` or None;
    activation: None, "gelu" (erf form, = ``F.gelu``), "gelu_tanh" (= ``F.gelu(approximate="tanh")``),
    "relu" or "silu". Returns ``[..., N]`` in ``x.dtype``. fp32 inputs use full-precision fp32 unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set. CPU tensors run the Triton kernel under
    ``TRITON_INTERPRET=1`` and the PyTorch reference otherwise.

    Gated (GLU) activations "swiglu", "geglu" (erf GELU), "geglu_tanh" return
    ``act(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up)`` of shape ``[..., N]``: ``weight`` is the pair
    ``(W_gate, W_up)`` (each ``[N, K]``, read in place) or one ``[2N, K]`` tensor ``cat([W_gate, W_up])``;
    ``bias`` likewise a pair, ``[2N]`` or None.

    Host cost: a non-gated CUDA call whose inputs have the shapes, strides, dtypes, devices, grad flags
    and 16-byte alignment of an earlier call replays that call's launch (see "launch plans" below), so a
    decode-size GEMM is not bound by Python. ``clear_launch_plans()`` forgets them.
    """
    if activation is not None and activation not in ACTIVATIONS + GATED_ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS + GATED_ACTIVATIONS}, got {activation!r}")
    plan_key = _plan_key(x, weight, bias, activation)
    if plan_key is not None:
        plan = _PLANS.get(plan_key)
        if plan is not None and plan.replay.current():
            return plan(x, weight, bias)
    gated = activation in GATED_ACTIVATIONS
    if gated:
        weight, w_up, bias, b_up = _split_gated(weight, bias, activation)
        check_linear_args(x, w_up, b_up, activation, name="W_up", bias_name="b_up")
        check_linear_args(x, weight, bias, activation, name="W_gate", bias_name="b_gate")
        check_no_grad_needed("linear", x, weight, bias, w_up, b_up)
    else:
        if isinstance(weight, (tuple, list)):
            raise ValueError(f"a pair of weights needs a gated activation {GATED_ACTIVATIONS}, "
                             f"got activation={activation!r}")
        w_up = b_up = None
        check_linear_args(x, weight, bias, activation)
        check_no_grad_needed("linear", x, weight, bias)
    bias_in = bias
    bias, b_up = dense(bias), dense(b_up)
    path = runtime.execution_path(x)
    last_config.update(config=None, path=path, kernel=None)
    if path == runtime.REFERENCE:
        if gated:
            return reference.gated_linear(x, weight, w_up, bias, b_up, activation)
        return reference.linear(x, weight, bias, activation)

    from tilefuse.kernels.gemm_epilogue import launch_linear  # imports triton lazily

    N, K = weight.shape
    out_shape = (*x.shape[:-1], N)
    M = math.prod(x.shape[:-1])
    y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x_rows, m_inner, s_outer, s_inner, s_k = _row_addressing(x)
    # A launch is captured for replay when its call can be keyed and nothing was copied on the way.
    plannable = plan_key is not None and not gated and x_rows is x and bias is bias_in
    if x.dtype == torch.float32:
        precision = "tf32" if (x.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = "tf32"  # ignored by tl.dot for 16-bit operands
    y2d = y.view(M, N)
    split_k = _split_k(M, N, K, path, x.device)
    if (path == runtime.COMPILED and split_k == 1 and x.dtype != torch.float32 and s_k == 1
            and (s_outer == 0 or m_inner == M)):
        from tilefuse.kernels import gemm_tma

        x2d = x_rows.as_strided((M, K), (s_inner, 1))
        if gemm_tma.tma_supported(x2d, weight, y2d, *([w_up] if gated else [])):
            if plannable:
                cfg, replay = gemm_tma.launch_linear_tma(x2d, weight, bias, y2d, activation, capture=True)
                _remember_plan(plan_key, replay, cfg, "tma", out_shape)
            else:
                cfg = gemm_tma.launch_linear_tma(x2d, weight, bias, y2d, activation, w_up=w_up, b_up=b_up)
            last_config.update(config=cfg, kernel="tma")
            return y
    kernel = "portable" if split_k == 1 else f"split-k {split_k}"
    if plannable:  # a CUDA call (plan_key says so), non-gated
        cfg, replay = launch_linear(x_rows, m_inner, s_outer, s_inner, s_k, weight, bias, y2d, M, N, K,
                                    activation, precision, interpret=False, split_k=split_k, capture=True)
        _remember_plan(plan_key, replay, cfg, kernel, out_shape)
    else:
        cfg = launch_linear(x_rows, m_inner, s_outer, s_inner, s_k, weight, bias, y2d, M, N, K,
                            activation, precision, interpret=(path == runtime.INTERPRETER), w_up=w_up, b_up=b_up,
                            split_k=split_k)
    last_config.update(config=cfg, kernel=kernel)
    return y


# ---- launch plans: the host's fast path -----------------------------------------------------------
# A decode GEMM runs for ~20 us on the H200, less than the host needs for the checks above plus Triton's
# launch path, so such calls measured the host. A call whose every input has the shape, strides, dtype,
# device, grad flags and 16-byte alignment of an earlier call that passed the checks takes that call's
# path and config again: it replays the captured launch (kernels/relaunch.py) with the new tensors.
# Everything the checks and the dispatch read is in the key, so a hit needs neither.
_PLANS: dict = {}
_MAX_PLANS = 4096  # distinct signatures kept; beyond that new ones simply take the full path


def _tensor_key(t):
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16)


def _plan_key(x, weight, bias, activation):
    """The call's key, or None when it has no plan: not all CUDA tensors, a gated activation (its weight
    pair is split into views per call), or tensors without strides (sparse)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and isinstance(weight, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor)) and activation not in GATED_ACTIVATIONS):
        return None
    try:
        return (activation, _tensor_key(x), _tensor_key(weight), None if bias is None else _tensor_key(bias),
                torch.is_grad_enabled(), torch.cuda.current_device(),
                x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # no strides or data pointer: the full path reports what is wrong
        return None


class _Plan:
    """A replay of the call that created it. Triton pointer arguments read only the data pointer and
    dtype, so x and y go in whole: the [M, K] / [M, N] views the full path launched on start at the same
    address."""

    __slots__ = ("replay", "config", "kernel", "out_shape")

    def __init__(self, replay, config, kernel, out_shape):
        self.replay, self.config, self.kernel, self.out_shape = replay, config, kernel, out_shape

    def __call__(self, x, weight, bias):
        y = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)
        self.replay.call(x, weight, bias, y)
        last_config.update(config=self.config, path=runtime.COMPILED, kernel=self.kernel)
        return y


def _remember_plan(key, replay, config, kernel, out_shape) -> None:
    if replay is not None and len(_PLANS) < _MAX_PLANS:
        _PLANS[key] = _Plan(replay, config, kernel, out_shape)


def clear_launch_plans() -> None:
    """Forget every captured launch (tests; after changing tuned configs in this process)."""
    _PLANS.clear()

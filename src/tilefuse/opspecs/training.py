"""Registry entries for training steps: forward + backward of the GEMM-family ops.

Each row times one step -- the forward with grad on (it saves the pre-activation), then
``torch.autograd.grad`` of the outputs against a fixed random dy -- and returns (y, every gradient), so
the tests compare gradients with the float64 reference on the same grid machinery as the forward ops.
Anchors: eager autograd over the plain PyTorch ops (the reference row) and torch.compile of them
(max-autotune-no-cudagraphs: the training compile users run). The report's GPU-only column runs
``kernels_only``: the op's forward and backward implementations without the autograd engine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tilefuse import reference
from tilefuse.opspec import OpSpec
from tilefuse.opspecs import gated_linear as gated_spec
from tilefuse.opspecs import linear as linear_spec
from tilefuse.opspecs import norms as norms_spec
from tilefuse.ops import linear as linear_op
from tilefuse.ops import norms as norm_ops
from tilefuse.reference import norms as reference_norms

BF16, FP32 = torch.bfloat16, torch.float32


def _step(forward, tensors, dy, **kwargs):
    """(y, grads...) of one training step: ``forward`` on leaf copies of ``tensors`` (None stays None; a
    tuple stays a tuple of leaves), then autograd.grad of y against dy. Gradients of absent tensors are
    left out, in the order of ``tensors``."""
    def leaf(t):
        if t is None:
            return None
        if isinstance(t, tuple):
            return tuple(leaf(u) for u in t)
        return t.detach().requires_grad_()

    leaves = [leaf(t) for t in tensors]
    flat = [u for t in leaves if t is not None for u in (t if isinstance(t, tuple) else (t,))]
    with torch.enable_grad():
        y = forward(*leaves, **kwargs)
        grads = torch.autograd.grad(y, flat, dy)
    return (y.detach(), *grads)


# ---- linear + activation -----------------------------------------------------------------------------

def _on_grid(t: torch.Tensor, step: float) -> torch.Tensor:
    """``t`` rounded to multiples of ``step`` (a power of two), in place of the view's values."""
    with torch.no_grad():
        return t.copy_(torch.round(t.float() / step) * step)


def _with_dy(inputs, params, device, seed, rows_of):
    """``inputs`` plus a fresh random dy of the output's shape (the rows ``rows_of(inputs)`` by N)."""
    randn = linear_spec.random_normal(params["dtype"], device, seed + 1)
    inputs["dy"] = randn(*rows_of(inputs), params["shape"][2])
    return inputs


def _rows_of_x(inputs):
    return inputs["x"].shape[:-1]


def _linear_inputs(params, device, seed):
    inputs = linear_spec.make_inputs(params, device, seed)
    if params.get("activation") == "relu":
        # relu's derivative jumps at 0: a pre-activation within round-off of 0 may take the other side in
        # fp32 than in float64, and rel-L2 would then measure those flipped rows, not the kernel (2e-4 at
        # M1024 K768 N3072 fp32). On a coarse power-of-two grid (x in 1/4, W in 1/64, bias in 1/4) every
        # product and partial sum is exact in fp32 and bf16 keeps every input, so both sides see one sign.
        _on_grid(inputs["x"], 0.25)
        _on_grid(inputs["weight"], 1 / 64)
        if inputs["bias"] is not None:
            _on_grid(inputs["bias"], 0.25)
    return _with_dy(inputs, params, device, seed, _rows_of_x)


def _linear_fused(x, weight, bias, activation, dy):
    return _step(lambda x, w, b: linear_op.linear(x, w, b, activation), (x, weight, bias), dy)


def _linear_ref(x, weight, bias, activation, dy):
    return _step(lambda x, w, b: reference.linear(x, w, b, activation), (x, weight, bias), dy)


def _linear_kernels_only(x, weight, bias, activation, dy):
    """The step without the autograd engine: forward saving the slope, then the backward op."""
    y, slope = linear_op._linear_impl(x, weight, bias, activation, activation is not None)
    dx, dw, db = linear_op._linear_backward_impl(dy, x, weight, slope if activation else None,
                                                 True, True, bias is not None)
    return (y, dx, dw) + ((db,) if bias is not None else ())


def _linear_anchors(params):
    compiled = torch.compile(reference.linear, dynamic=False, mode="max-autotune-no-cudagraphs")

    def run(x, weight, bias, activation, dy):
        return _step(lambda x, w, b: compiled(x, w, b, activation), (x, weight, bias), dy)
    return {"torch.compile max-autotune": run}


def _linear_bytes(params):
    """fused: forward x, W read, y and the slope written; grad_input dy, slope, W read, dx written;
    grad_weight dy, slope, x read, dW (and db) written. Eager: F.linear, the activation's read and write of y, its
    backward writing g, both GEMMs and the bias sum reading g."""
    M, K, N = params["shape"]
    s = params["dtype"].itemsize
    act = params.get("activation") is not None
    bias = 2 * N * s if params.get("bias", True) else 0
    mn = M * N * s
    fused = 3 * M * K * s + 3 * N * K * s + (6 if act else 3) * mn + bias
    eager = 3 * M * K * s + 3 * N * K * s + (9 if act else 3) * mn + bias + (mn if params.get("bias", True) else 0)
    return {"fused": fused, "unfused": max(eager, fused)}


def _gemm_label(p):
    M, K, N = p["shape"]
    parts = [f"M{M} K{K} N{N} {p.get('activation') or 'none'}"]
    if not p.get("bias", True):
        parts.append("nobias")
    if p.get("layout", "contiguous") != "contiguous":
        parts.append(p["layout"])
    if p.get("weight_form", "pair") != "pair":
        parts.append(p["weight_form"])
    return " ".join(parts)


LINEAR_TRAIN = OpSpec(
    name="linear_train",
    summary=("forward + backward of act(x @ W^T + b): the forward's epilogue saves act'(pre); g = dy * act'(pre) "
             "made in both backward GEMMs' operand loads, db from the dW kernel's g tiles"),
    fused=_linear_fused,
    reference=_linear_ref,
    make_inputs=_linear_inputs,
    # The forward's grid (every activation, layout and dtype), with fewer CPU shapes: a step is three kernels.
    test_grid={**linear_spec.LINEAR.test_grid, "shape": [(33, 70, 45), (1, 1, 1), (17, 130, 9)]},
    gpu_test_grid={"shape": [(33, 70, 45), (257, 1000, 515), (1024, 768, 3072)]},
    bench_cases=[dict(shape=s, dtype=BF16, activation="gelu", bias=True) for s in linear_spec.BENCH_SHAPES],
    accuracy_cases={
        "cpu": [dict(shape=(33, 70, 45), dtype=d, activation="gelu", bias=True) for d in (FP32, BF16)],
        "gpu": [dict(shape=(1000, 2048, 1030), dtype=d, activation="gelu", bias=True) for d in (FP32, BF16)],
    },
    flops=lambda p: 6.0 * p["shape"][0] * p["shape"][1] * p["shape"][2],
    hbm_bytes=_linear_bytes,
    bound="compute",
    anchors=_linear_anchors,
    compile_group=lambda p: f"{p['dtype']}-{p.get('activation')}-{p.get('bias', True)}",
    label=_gemm_label,
    extra={"kernels_only": _linear_kernels_only},
)


# ---- gated (GLU) -------------------------------------------------------------------------------------

def _gated_inputs(params, device, seed):
    return _with_dy(gated_spec.make_inputs(params, device, seed), params, device, seed, _rows_of_x)


def _gated_reference_forward(x, weight, bias, activation):
    w_gate, w_up, b_gate, b_up = gated_spec._halves(weight, bias)
    return reference.gated_linear(x, w_gate, w_up, b_gate, b_up, activation)


def _gated_fused(x, weight, bias, activation, dy):
    return _step(lambda x, w, b: linear_op.linear(x, w, b, activation), (x, weight, bias), dy)


def _gated_ref(x, weight, bias, activation, dy):
    return _step(lambda x, w, b: _gated_reference_forward(x, w, b, activation), (x, weight, bias), dy)


def _gated_kernels_only(x, weight, bias, activation, dy):
    w_gate, w_up, b_gate, b_up = gated_spec._halves(weight, bias)
    y, s_gate, s_up = linear_op._gated_linear_impl(x, w_gate, w_up, b_gate, b_up, activation, True)
    dx, dwg, dwu, dbg, dbu = linear_op._gated_linear_backward_impl(dy, x, w_gate, w_up, s_gate, s_up,
                                                                   True, True, bias is not None)
    return (y, dx, dwg, dwu) + ((dbg, dbu) if bias is not None else ())


def _gated_anchors(params):
    compiled = torch.compile(_gated_reference_forward, dynamic=False, mode="max-autotune-no-cudagraphs")

    def run(x, weight, bias, activation, dy):
        return _step(lambda x, w, b: compiled(x, w, b, activation), (x, weight, bias), dy)
    return {"torch.compile max-autotune": run}


def _gated_bytes(params):
    """fused: forward x, W_gate, W_up read, y and the two slopes written; grad_input dy and a slope per
    branch (dy twice), both weights read, dx written; grad_weight per branch dy, its slope and x read, its
    dW written. Eager: the two GEMMs, act, the product, their backward (mul, act', two dX GEMMs summed,
    two dW GEMMs)."""
    M, K, N = params["shape"]
    s = params["dtype"].itemsize
    mk, nk, mn = M * K * s, N * K * s, M * N * s
    bias = 4 * N * s if params.get("bias", True) else 0
    fused = 4 * mk + 6 * nk + 11 * mn + bias
    eager = 7 * mk + 6 * nk + 20 * mn + bias
    return {"fused": fused, "unfused": max(eager, fused)}


GATED_LINEAR_TRAIN = OpSpec(
    name="gated_linear_train",
    summary="forward + backward of act(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up), both branches' g on chip",
    fused=_gated_fused,
    reference=_gated_ref,
    make_inputs=_gated_inputs,
    # The forward's grid plus a 3-D x that needs two row strides (the dW kernel's other addressing).
    test_grid={**gated_spec.GATED_LINEAR.test_grid, "shape": [(33, 70, 45), (1, 1, 1), (17, 130, 9)],
               "layout": ["contiguous", "x_transposed", "3d_permuted"]},
    gpu_test_grid={"shape": [(33, 70, 45), (257, 1000, 515), (1024, 768, 3072)]},
    bench_cases=[dict(shape=(8192, 4096, 14336), dtype=BF16, activation="swiglu", bias=False),
                 dict(shape=(2048, 4096, 11008), dtype=BF16, activation="swiglu", bias=False)],
    accuracy_cases={
        "cpu": [dict(shape=(33, 70, 45), dtype=d, activation="swiglu", bias=True) for d in (FP32, BF16)],
        "gpu": [dict(shape=(1000, 2048, 1030), dtype=d, activation="swiglu", bias=False) for d in (FP32, BF16)],
    },
    flops=lambda p: 12.0 * p["shape"][0] * p["shape"][1] * p["shape"][2],
    hbm_bytes=_gated_bytes,
    bound="compute",
    anchors=_gated_anchors,
    compile_group=lambda p: f"{p['dtype']}-{p['activation']}-{p.get('bias', True)}",
    label=_gemm_label,
    extra={"kernels_only": _gated_kernels_only},
)


# ---- layer_norm_linear -------------------------------------------------------------------------------

def _norm_linear_inputs(params, device, seed):
    inputs = _with_dy(norms_spec._norm_linear_inputs(params, device, seed), params, device, seed, _rows_of_x)
    if params.get("activation") == "relu":
        _zero_dy_near_kink(inputs)
    return inputs


def _zero_dy_near_kink(inputs):
    """dy set to 0 wherever the float64 pre-activation lies within round-off of relu's kink.

    There either slope is a valid answer: the kernel rounds norm(x) to the GEMM's operand dtype and sums in
    fp32, so a pre-activation within that error of 0 may take the other side than in float64, and one such
    flip moves db by several percent (7.7e-2 rel-L2 at fp16 M33 K70 N45 from a single pre-activation of
    1.4e-5). The grid trick of linear_train does not apply: normalising takes x off any grid. With dy 0 there,
    the slope at those points does not enter any gradient; everywhere else the gradients are checked as
    before. The bound: 8x (operand round-off times sqrt(sum (xn w)^2), the typical error of rounding each
    operand, plus fp32's worst-case accumulation K u32 sum |xn w|); about 3% of bf16 outputs, 0.5% of fp32."""
    x, w = inputs["x"], inputs["weight"]
    K = x.shape[-1]
    if x.numel() == 0 or w.numel() == 0:
        return
    dtype = x.dtype
    operand_u = torch.finfo(dtype).eps / 2
    if dtype == torch.float32 and x.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        operand_u = 2.0 ** -11
    as64 = lambda t: None if t is None else t.double()  # noqa: E731
    if inputs["norm"] == "rms":
        xn = F.rms_norm(x.double(), (K,), as64(inputs["norm_weight"]), inputs["eps"])
    else:
        xn = F.layer_norm(x.double(), (K,), as64(inputs["norm_weight"]), as64(inputs["norm_bias"]), inputs["eps"])
    w64 = w.double()
    pre = xn @ w64.T
    if inputs["bias"] is not None:
        pre = pre + inputs["bias"].double()
    typical = (xn * xn) @ (w64 * w64).T
    worst = xn.abs() @ w64.abs().T
    margin = 8 * (operand_u * typical.sqrt() + K * 2.0 ** -24 * worst)
    with torch.no_grad():
        inputs["dy"].masked_fill_(pre.abs() <= margin, 0)


def _norm_linear_step(forward, x, norm_weight, norm_bias, weight, bias, eps, norm, activation, dy):
    return _step(lambda x, nw, nb, w, b: forward(x, nw, nb, w, b, eps=eps, norm=norm, activation=activation),
                 (x, norm_weight, norm_bias if norm == "layer" else None, weight, bias), dy)


def _norm_linear_fused(**inputs):
    return _norm_linear_step(norm_ops.layer_norm_linear, **inputs)


def _norm_linear_ref(**inputs):
    return _norm_linear_step(reference_norms.layer_norm_linear, **inputs)


def _norm_linear_kernels_only(x, norm_weight, norm_bias, weight, bias, eps, norm, activation, dy):
    """Forward saving the slope, then the backward's own ops (norm recompute, linear backward, norm
    backward) without the autograd engine."""
    K = x.shape[-1]
    is_rms = norm == "rms"
    nb = None if is_rms else norm_bias
    y, slope = norm_ops._layer_norm_linear_impl(x, norm_weight, nb, weight, bias, eps, norm, activation,
                                                activation is not None)
    xn, _, stats = norm_ops._norm_impl(x, None, norm_weight, nb, (K,), eps, is_rms)
    dxn, dw, db = linear_op._linear_backward_impl(dy, xn, weight, slope if activation else None,
                                                  True, True, bias is not None)
    dx, sums = norm_ops._norm_backward_impl(dxn, None, x, norm_weight, stats, (K,), is_rms,
                                            norm_weight is not None, nb is not None)
    norm_grads = tuple(g.to(t.dtype) for g, t in zip(sums.unbind(0), [t for t in (norm_weight, nb) if t is not None]))
    return (y, dx, *norm_grads, dw) + ((db,) if bias is not None else ())


def _norm_linear_anchors(params):
    compiled = torch.compile(reference_norms.layer_norm_linear, dynamic=False, mode="max-autotune-no-cudagraphs")

    def run(**inputs):
        return _norm_linear_step(compiled, **inputs)
    return {"torch.compile max-autotune": run}


def _norm_linear_bytes(params):
    """fused: the forward (as layer_norm_linear's row, plus the slope written), the backward's norm
    recompute (x read, xn written), the linear backward on xn (dy, slope read twice; W, xn read; dxn, dW
    written),
    the norm backward (dxn, x read, dx written). Eager saves xn in the forward instead of recomputing it."""
    M, K, N = params["shape"]
    s = params["dtype"].itemsize
    mk, nk, mn = M * K * s, N * K * s, M * N * s
    act = params.get("activation") is not None
    fwd = norms_spec._norm_linear_bytes(params)
    fused = fwd["fused"] + (mn if act else 0) + 2 * mk + (3 * mk + 2 * nk + (4 if act else 2) * mn) + 3 * mk
    eager = fwd["unfused"] + (3 * mk + 2 * nk + (6 if act else 2) * mn) + 3 * mk + 2 * mk
    return {"fused": fused, "unfused": max(eager, fused)}


LAYER_NORM_LINEAR_TRAIN = OpSpec(
    name="layer_norm_linear_train",
    summary=("forward + backward of act(norm(x) @ W^T + b): the backward recomputes norm(x), runs the linear "
             "backward on it (act' fused) and the norm's backward"),
    fused=_norm_linear_fused,
    reference=_norm_linear_ref,
    make_inputs=_norm_linear_inputs,
    # The forward's grids, but no K = 1: LayerNorm's output is then beta whatever x is, dx is exactly 0 and
    # rel-L2 against the float64 round-off means nothing.
    test_grid={**norms_spec.LAYER_NORM_LINEAR.test_grid, "shape": [(33, 70, 45), (1, 5, 3), (17, 130, 9)]},
    gpu_test_grid=norms_spec.LAYER_NORM_LINEAR.gpu_test_grid,
    bench_cases=[dict(shape=s, dtype=BF16, norm="layer", bias=True, activation="gelu")
                 for s in norms_spec.NORM_LINEAR_SHAPES],
    accuracy_cases={
        "cpu": [dict(shape=(33, 70, 45), dtype=d, norm=n) for d in (FP32, BF16) for n in ("layer", "rms")],
        "gpu": [dict(shape=(1000, 2048, 1030), dtype=d, norm="layer") for d in (FP32, BF16)],
    },
    flops=lambda p: 6.0 * p["shape"][0] * p["shape"][1] * p["shape"][2],
    hbm_bytes=_norm_linear_bytes,
    bound="compute",
    anchors=_norm_linear_anchors,
    label=lambda p: norms_spec.LAYER_NORM_LINEAR.label(p),
    extra={"kernels_only": _norm_linear_kernels_only},
)

SPECS = [LINEAR_TRAIN, GATED_LINEAR_TRAIN, LAYER_NORM_LINEAR_TRAIN]

"""Registry entries: layer_norm / rms_norm forward and backward (optional fused residual add), and
layer_norm_linear (normalization as the GEMM prologue)."""
from __future__ import annotations

import math

import torch

from tilefuse.ops import norms as norm_ops
from tilefuse.reference import norms as reference
from tilefuse.opspec import OpSpec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (rows, cols) from the issue: LLM hidden sizes, a wide vocab-like row, many short rows, and a row
# twice Liger's 65536 limit.
BENCH_SHAPES = [(16384, 4096), (4096, 16384), (65536, 1024), (2048, 131072)]
NORM_LINEAR_SHAPES = [(8192, 4096, 4096), (16384, 768, 2304)]
# The GEMM-engine issue's second target shape (an MLP up-projection after the norm, GPT-2-small widths).
NORM_LINEAR_MLP_SHAPE = (16384, 768, 3072)

NORM_TEST_GRID = {
    # (33, 70) one tile; (1, 1) a row of one; (7, 300) and (2, 129) loop over chunks in the
    # interpreter (its chunk cap is 128 columns).
    "shape": [(33, 70), (1, 1), (7, 300), (2, 129)],
    "dtype": [FP32, FP16, BF16],
    "residual": [False, True],
    "affine": ["both", "weight", "none"],
    "layout": ["contiguous", "3d", "multi_dim", "row_strided"],
}
NORM_GPU_GRID = {
    "shape": [(1000, 4096), (37, 70001), (2, (1 << 20) + 5), (4099, 768)],
    "affine": ["both", "none"],
    "layout": ["contiguous", "multi_dim"],
}


def _norm_inputs(params: dict, device, seed: int, is_rms: bool, backward: bool) -> dict:
    """x ~ N(0.5, 2) (a non-zero mean exercises the centering), weight ~ N(1, 0.5), bias ~ N(0, 1).

    Layouts: "3d" [b, M/b, N]; "multi_dim" normalizes over the last two dims [M, n1, N/n1];
    "row_strided" is a column slice of a wider buffer (rows at stride N+7, no copy expected).
    """
    M, N = params["shape"]
    dtype = params["dtype"]
    layout = params.get("layout", "contiguous")
    affine = params.get("affine", "both")
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, mean=0.0, std=1.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(device=device, dtype=dtype)

    normalized_shape = (N,)
    if layout == "3d":
        b = next((d for d in (3, 2) if M % d == 0), 1)
        x = randn(b, M // b, N, mean=0.5, std=2.0)
    elif layout == "multi_dim":
        n1 = next((d for d in (5, 3, 2) if N % d == 0), 1)
        normalized_shape = (n1, N // n1)
        x = randn(M, n1, N // n1, mean=0.5, std=2.0)
    elif layout == "row_strided":
        x = randn(M, N + 7, mean=0.5, std=2.0)[:, :N]
    else:
        x = randn(M, N, mean=0.5, std=2.0)
    weight = randn(*normalized_shape, mean=1.0, std=0.5) if affine in ("both", "weight") else None
    eps = params.get("eps")
    if eps is None:  # resolved here so the float64 reference uses the op dtype's default
        eps = torch.finfo(dtype).eps if is_rms else norm_ops.LAYER_NORM_EPS
    inputs = {"x": x, "normalized_shape": normalized_shape, "weight": weight, "eps": eps,
              "residual": randn(*x.shape) if params.get("residual") else None}
    if not is_rms:
        inputs["bias"] = randn(*normalized_shape) if affine == "both" else None
    if backward:
        inputs["dy"] = randn(*x.shape)
        inputs["dh"] = randn(*x.shape) if params.get("residual") else None
        inputs["graph_cache"] = {}  # per inputs dict: forward graphs built once, backward timed alone
    return inputs


def _layer_norm_fused(x, normalized_shape, weight, bias, eps, residual):
    return norm_ops.layer_norm(x, normalized_shape, weight, bias, eps, residual=residual)


def _layer_norm_ref(x, normalized_shape, weight, bias, eps, residual):
    return reference.layer_norm(x, normalized_shape, weight, bias, eps, residual=residual)


def _rms_norm_fused(x, normalized_shape, weight, eps, residual):
    return norm_ops.rms_norm(x, normalized_shape, weight, eps, residual=residual)


def _rms_norm_ref(x, normalized_shape, weight, eps, residual):
    return reference.rms_norm(x, normalized_shape, weight, eps, residual=residual)


def _liger_forward(is_rms):
    """Liger-Kernel 0.8.5 ops (last-dim norms only). The residual add, which Liger does not fuse,
    runs as its own torch kernel first."""
    def run(x, normalized_shape, weight, eps, residual, bias=None):
        try:
            if is_rms:
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction as fn
            else:
                from liger_kernel.ops.layer_norm import LigerLayerNormFunction as fn
        except ImportError as exc:
            raise ImportError(f"liger_kernel is not importable ({exc}); install liger-kernel==0.8.5 "
                              "for this anchor") from None
        if len(normalized_shape) != 1 or weight is None or (not is_rms and bias is None):
            raise NotImplementedError("the Liger anchor needs a 1-D normalized_shape and affine weights")
        h = x + residual if residual is not None else x
        # positional: X, W, eps, offset, casting_mode, in_place (False: dy must survive repeated calls)
        y = fn.apply(h, weight, eps, 0.0, "llama", False) if is_rms else fn.apply(h, weight, bias, eps)
        return (y, h) if residual is not None else y
    return run


def _forward_anchors(is_rms):
    ref = _rms_norm_ref if is_rms else _layer_norm_ref

    def anchors(params):
        return {"torch.compile": torch.compile(ref, dynamic=False), "liger": _liger_forward(is_rms)}
    return anchors


# ---- backward: time only torch.autograd.grad on a forward graph built once per inputs dict ----------

def _forward_graph(key, forward, x, normalized_shape, weight, eps, residual, dy, dh, graph_cache, bias):
    """The forward graph for these inputs, built once per inputs dict (cached in its ``graph_cache``
    under ``key``, rebuilt when another x is passed): {"outs", "leaves", "grads"} for autograd.grad."""
    entry = graph_cache.get(key)
    if entry is None or entry["x"] is not x:
        graph_cache.pop(key, None)
        with torch.enable_grad():  # the report calls ops under no_grad
            leaves = [t.detach().requires_grad_() for t in (x, weight, bias, residual) if t is not None]
            it = iter(leaves)
            x_l = next(it)
            w_l = next(it) if weight is not None else None
            b_l = next(it) if bias is not None else None
            r_l = next(it) if residual is not None else None
            kwargs = {"bias": b_l} if bias is not None else {}
            out = forward(x_l, normalized_shape, w_l, eps=eps, residual=r_l, **kwargs)
        outs, grads = ((list(out), [dy, dh]) if residual is not None else ([out], [dy]))
        entry = graph_cache[key] = {"x": x, "outs": outs, "leaves": leaves, "grads": grads}
    return entry


def _backward_runner(key, forward):
    """Wrap ``forward(x, normalized_shape, weight, [bias,] eps, residual)`` into a callable that returns
    the gradients (dx, [dweight], [dbias], [dresidual]) by ``torch.autograd.grad`` on a forward graph
    built once per inputs dict, so a timed call is the backward alone (``retain_graph=True``)."""
    def run(x, normalized_shape, weight, eps, residual, dy, dh, graph_cache, bias=None):
        entry = _forward_graph(key, forward, x, normalized_shape, weight, eps, residual, dy, dh, graph_cache, bias)
        with torch.enable_grad():
            return torch.autograd.grad(entry["outs"], entry["leaves"], entry["grads"], retain_graph=True)
    return run


def _backward_kernels_only(is_rms):
    """The backward without the autograd engine, for the report's GPU-only column (autograd's replay
    cannot be captured in a CUDA graph): the backward op's implementation on a forward computed once per
    inputs dict. Same gradients in the same order as the runner above: (dx, [dweight], [dbias],
    [dresidual])."""
    def run(x, normalized_shape, weight, eps, residual, dy, dh, graph_cache, bias=None):
        entry = graph_cache.get("kernels_only")
        if entry is None or entry[0] is not x:
            _, h, stats = norm_ops._norm_impl(x, residual, weight, bias, tuple(normalized_shape), eps, is_rms)
            entry = graph_cache["kernels_only"] = (x, h if residual is not None else x, stats)
        _, h, stats = entry
        dx, sums = norm_ops._norm_backward_impl(dy, dh if residual is not None else None, h, weight, stats,
                                                tuple(normalized_shape), is_rms, weight is not None,
                                                bias is not None)
        params = [t for t in (weight, bias) if t is not None]
        grads = [dx] + [g.to(t.dtype) for g, t in zip(sums.unbind(0), params)]
        return tuple(grads + ([dx] if residual is not None else []))
    return run


def _layer_norm_keyword(fn):
    def forward(x, normalized_shape, weight, eps, residual, bias=None):
        return fn(x, normalized_shape, weight, bias, eps, residual)
    return forward


def _rms_norm_keyword(fn):
    def forward(x, normalized_shape, weight, eps, residual):
        return fn(x, normalized_shape, weight, eps, residual)
    return forward


def _backward_callables(is_rms):
    wrap = _rms_norm_keyword if is_rms else _layer_norm_keyword
    fused_forward = wrap(_rms_norm_fused if is_rms else _layer_norm_fused)
    fused = _backward_runner("tilefuse", fused_forward)
    kernels_only = _backward_kernels_only(is_rms)
    ref = _backward_runner("reference", wrap(_rms_norm_ref if is_rms else _layer_norm_ref))

    def anchors(params):
        compiled = torch.compile(_rms_norm_ref if is_rms else _layer_norm_ref, dynamic=False)
        return {"torch.compile": _backward_runner("torch.compile", wrap(compiled)),
                "liger": _backward_runner("liger", _liger_forward(is_rms))}
    return fused, ref, anchors, kernels_only


# ---- byte models --------------------------------------------------------------------------------

def _vectors(params, is_rms):
    affine = params.get("affine", "both")
    count = {"both": 1 if is_rms else 2, "weight": 1, "none": 0}[affine]
    return count


def _fwd_bytes(is_rms):
    def model(params):
        M, N = params["shape"]
        s = params["dtype"].itemsize
        vec = _vectors(params, is_rms) * N * s
        if params.get("residual"):
            # fused: read x, residual; write h, y. Unfused: the add (3 MN) then the norm (2 MN).
            return {"fused": 4 * M * N * s + vec, "unfused": 5 * M * N * s + vec}
        return {"fused": 2 * M * N * s + vec, "unfused": 2 * M * N * s + vec}
    return model


def _bwd_bytes(is_rms):
    def model(params):
        M, N = params["shape"]
        s = params["dtype"].itemsize
        vec = _vectors(params, is_rms) * N * s * 2  # read weight, write dweight (and dbias)
        stats = (4 if is_rms else 8) * M
        tensors = 4 if params.get("residual") else 3  # read dy, h, (dh); write dx
        fused = tensors * M * N * s + vec + stats
        # Eager: the dx kernel, then a column kernel for dweight/dbias re-reading dy and x; with a
        # residual, autograd adds the two gradients of h in one more kernel (read 2, write 1).
        extra = (2 * M * N * s if params.get("affine", "both") != "none" else 0)
        extra += 3 * M * N * s if params.get("residual") else 0
        return {"fused": fused, "unfused": fused + extra}
    return model


def _label(p):
    M, N = p["shape"]
    parts = [f"M{M} N{N}"]
    if p.get("layout", "contiguous") != "contiguous":
        parts.append(p["layout"])
    if p.get("affine", "both") != "both":
        parts.append(f"affine={p['affine']}")
    if p.get("residual"):
        parts.append("+residual")
    return " ".join(parts)


def _norm_specs(is_rms: bool) -> list[OpSpec]:
    name = "rms_norm" if is_rms else "layer_norm"
    grid = dict(NORM_TEST_GRID)
    if is_rms:
        grid["affine"] = ["weight", "none"]
    gpu_grid = dict(NORM_GPU_GRID)
    if is_rms:
        gpu_grid["affine"] = ["weight", "none"]
    bench = ([dict(shape=s, dtype=BF16) for s in BENCH_SHAPES]
             + [dict(shape=s, dtype=BF16, residual=True) for s in BENCH_SHAPES[:2]]
             + [dict(shape=BENCH_SHAPES[0], dtype=d) for d in (FP16, FP32)])
    accuracy = {
        "cpu": [dict(shape=(33, 70), dtype=d) for d in (FP32, FP16, BF16)]
               + [dict(shape=(7, 300), dtype=BF16, residual=True)],
        "gpu": [dict(shape=(2048, 4096), dtype=d) for d in (FP32, FP16, BF16)]
               + [dict(shape=(64, 131072), dtype=BF16, residual=True)],
    }
    bwd_fused, bwd_ref, bwd_anchors, bwd_kernels_only = _backward_callables(is_rms)
    forward = OpSpec(
        name=name,
        summary=(f"{'RMSNorm' if is_rms else 'LayerNorm'} over the trailing dims, optional residual add "
                 "fused in (returns (y, x + residual))"),
        fused=_rms_norm_fused if is_rms else _layer_norm_fused,
        reference=_rms_norm_ref if is_rms else _layer_norm_ref,
        make_inputs=lambda p, d, s: _norm_inputs(p, d, s, is_rms, backward=False),
        test_grid=grid,
        gpu_test_grid=gpu_grid,
        bench_cases=bench,
        accuracy_cases=accuracy,
        flops=lambda p: 0.0,
        hbm_bytes=_fwd_bytes(is_rms),
        bound="memory",
        anchors=_forward_anchors(is_rms),
        label=_label,
    )
    bwd_grid = {k: v for k, v in grid.items()}
    if not is_rms:
        # N = 1 or 2: LayerNorm's x_hat is 0 or +-1 whatever x is, so dx and dweight are exactly 0 and
        # rel-L2 against float64 round-off (~1e-14) means nothing; tests/test_norms.py checks N = 1.
        bwd_grid["shape"] = [(33, 70), (1, 5), (7, 300), (2, 129)]
    bwd_grid["layout"] = ["contiguous", "multi_dim", "row_strided"]
    backward = OpSpec(
        name=f"{name}_backward",
        summary=(f"{'RMSNorm' if is_rms else 'LayerNorm'} backward alone: dx, dweight"
                 f"{'' if is_rms else ', dbias'} (and dresidual), deterministic fp32 column sums"),
        fused=bwd_fused,
        reference=bwd_ref,
        make_inputs=lambda p, d, s: _norm_inputs(p, d, s, is_rms, backward=True),
        test_grid=bwd_grid,
        gpu_test_grid=gpu_grid,
        bench_cases=[dict(shape=s, dtype=BF16) for s in BENCH_SHAPES]
                    + [dict(shape=BENCH_SHAPES[0], dtype=BF16, residual=True)],
        accuracy_cases=accuracy,
        flops=lambda p: 0.0,
        hbm_bytes=_bwd_bytes(is_rms),
        bound="memory",
        anchors=bwd_anchors,
        label=_label,
        extra={"kernels_only": bwd_kernels_only},
    )
    return [forward, backward]


# ---- layer_norm_linear ---------------------------------------------------------------------------

def _norm_linear_inputs(params: dict, device, seed: int) -> dict:
    M, K, N = params["shape"]
    dtype = params["dtype"]
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, mean=0.0, std=1.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(device=device, dtype=dtype)

    norm = params.get("norm", "layer")
    x = randn(M, K, mean=0.5, std=2.0)
    affine = params.get("affine", True)
    eps = torch.finfo(dtype).eps if norm == "rms" else norm_ops.LAYER_NORM_EPS
    return {
        "x": x,
        "norm_weight": randn(K, mean=1.0, std=0.5) if affine else None,
        "norm_bias": randn(K) if affine and norm == "layer" else None,
        "weight": randn(N, K, std=1.0 / max(K, 1) ** 0.5),
        "bias": randn(N) if params.get("bias", True) else None,
        "eps": eps, "norm": norm, "activation": params.get("activation"),
    }


def _norm_linear_fused(x, norm_weight, norm_bias, weight, bias, eps, norm, activation):
    return norm_ops.layer_norm_linear(x, norm_weight, norm_bias, weight, bias, eps=eps, norm=norm,
                                      activation=activation)


def _norm_linear_ref(x, norm_weight, norm_bias, weight, bias, eps, norm, activation):
    return reference.layer_norm_linear(x, norm_weight, norm_bias, weight, bias, eps=eps, norm=norm,
                                       activation=activation)


def _norm_then_linear(x, norm_weight, norm_bias, weight, bias, eps, norm, activation):
    """Two tilefuse kernels: the norm writes the normalized x, the fused linear reads it back."""
    from tilefuse.ops.linear import linear

    K = x.shape[-1]
    if norm == "rms":
        xn = norm_ops.rms_norm(x, (K,), norm_weight, eps)
    else:
        xn = norm_ops.layer_norm(x, (K,), norm_weight, norm_bias, eps)
    return linear(xn, weight, bias, activation)


def _norm_linear_bytes(params):
    M, K, N = params["shape"]
    s = params["dtype"].itemsize
    vec = (2 * K if params.get("norm", "layer") == "layer" else K) * s + (N * s if params.get("bias", True) else 0)
    gemm = (M * K + N * K + M * N) * s
    act = 2 * M * N * s if params.get("activation") else 0
    unfused = gemm + 2 * M * K * s + vec + act
    if params["dtype"] == torch.float32:  # the prologue form: stats pre-pass (x read, mean/rstd out and in)
        return {"fused": gemm + M * K * s + 16 * M + vec, "unfused": unfused}
    # 16-bit rows are benchmarked on Hopper, in the epilogue form (kernels/gemm/launch/): the statistics
    # pre-pass reads x (8 bytes a row out and back in), gamma is folded into W once per call (W read, W'
    # written) and LayerNorm also sums W' over K (W read without gamma); RMSNorm without gamma needs no fold.
    # (Other GPUs run 16-bit in the prologue form.) Against eager's normalized x written and read back
    # (2*M*K*s), that saves M*K*s less the fold: at M = 2N with an affine LayerNorm nothing, and then the
    # 16*M + 8*N bytes of statistics and sums make the fused form move slightly more than eager (0.2% at
    # 8192x4096x4096); the unfused figure is then reported as the fused one's, as the training specs do.
    layer, affine = params.get("norm", "layer") == "layer", params.get("affine", True)
    fold = (N * K * s * (1 + int(affine)) + 8 * N) if (layer or affine) else 0
    fused = gemm + vec + fold + M * K * s + 16 * M
    return {"fused": fused, "unfused": max(unfused, fused)}


LAYER_NORM_LINEAR = OpSpec(
    name="layer_norm_linear",
    summary=("act(norm(x) @ W^T + b): on Hopper gamma folded into W, the rows' statistics from a pre-pass "
             "(8 B/row) applied in the TMA GEMM's epilogue; elsewhere the same pre-pass "
             "and normalization in the GEMM's prologue"),
    fused=_norm_linear_fused,
    reference=_norm_linear_ref,
    make_inputs=_norm_linear_inputs,
    test_grid={
        "shape": [(33, 70, 45), (1, 1, 1), (17, 130, 9)],
        "dtype": [FP32, FP16, BF16],
        "norm": ["layer", "rms"],
        "activation": [None, "gelu", "silu"],
        "bias": [True, False],
        "affine": [True, False],
    },
    # (257, 1000, 520) takes the Hopper form with tails in M, N and K; (33, 70, 45) the portable prologue.
    gpu_test_grid={"shape": [(33, 70, 45), (257, 1000, 520), (1024, 768, 2304)],
                   "activation": [None, "gelu", "gelu_tanh", "relu", "silu"]},
    bench_cases=([dict(shape=s, dtype=BF16, norm="layer", bias=True) for s in NORM_LINEAR_SHAPES]
                 + [dict(shape=s, dtype=BF16, norm="rms", bias=False) for s in NORM_LINEAR_SHAPES]
                 + [dict(shape=NORM_LINEAR_SHAPES[1], dtype=BF16, norm="layer", bias=True, activation="gelu")]
                 + [dict(shape=NORM_LINEAR_SHAPES[1], dtype=FP16, norm="layer", bias=True)]
                 + [dict(shape=NORM_LINEAR_MLP_SHAPE, dtype=BF16, norm="layer", bias=True)]),
    accuracy_cases={
        "cpu": [dict(shape=(33, 70, 45), dtype=d, norm=n) for d in (FP32, BF16) for n in ("layer", "rms")],
        "gpu": [dict(shape=(1000, 2048, 1030), dtype=d, norm="layer") for d in (FP32, FP16, BF16)]
               + [dict(shape=(2048, 4096, 4096), dtype=BF16, norm="rms")],
    },
    flops=lambda p: 2.0 * math.prod(p["shape"]),
    hbm_bytes=_norm_linear_bytes,
    bound="compute",
    anchors=lambda p: {"tilefuse layer_norm then linear": _norm_then_linear,
                       "torch.compile": torch.compile(_norm_linear_ref, dynamic=False)},
    label=lambda p: (f"M{p['shape'][0]} K{p['shape'][1]} N{p['shape'][2]} {p.get('norm', 'layer')} "
                     f"{p.get('activation') or 'none'}{'' if p.get('bias', True) else ' nobias'}"
                     f"{'' if p.get('affine', True) else ' noaffine'}"),
)

SPECS = _norm_specs(is_rms=False) + _norm_specs(is_rms=True) + [LAYER_NORM_LINEAR]

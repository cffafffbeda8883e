"""Registry entry: gated (GLU) linear, act(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up) in one kernel."""
from __future__ import annotations

import torch

from tilefuse import reference
from tilefuse.opspec import OpSpec
from tilefuse.opspecs.linear import make_x, random_normal
from tilefuse.ops import linear as linear_op

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# Llama-7B's MLP: K = 4096 hidden, N = 11008 intermediate; and Llama-3-8B's / Mistral-7B's N = 14336 (the GEMM
# engine issue's SwiGLU row).
BENCH_SHAPES = [(2048, 4096, 11008), (8192, 4096, 11008), (8192, 4096, 14336)]


def make_inputs(params: dict, device, seed: int) -> dict:
    """x ~ N(0,1); W_gate, W_up ~ N(0, 1/K); biases ~ N(0,1). ``weight_form`` "pair" passes
    (W_gate, W_up); "concat" passes one [2N, K] tensor (and a [2N] bias)."""
    M, K, N = params["shape"]
    randn = random_normal(params["dtype"], device, seed)
    w_both = randn(2 * N, K, scale=1.0 / max(K, 1) ** 0.5)
    b_both = randn(2 * N) if params.get("bias", True) else None
    x = make_x(randn, M, K, params.get("layout", "contiguous"))
    if params.get("weight_form", "pair") == "pair":
        weight = (w_both[:N], w_both[N:])
        bias = None if b_both is None else (b_both[:N], b_both[N:])
    else:
        weight, bias = w_both, b_both
    return {"x": x, "weight": weight, "bias": bias, "activation": params["activation"]}


def _fused(x, weight, bias, activation):
    return linear_op.linear(x, weight, bias, activation)


def _halves(weight, bias):
    if isinstance(weight, tuple):
        return (*weight, *(bias if bias is not None else (None, None)))
    n = weight.shape[0] // 2
    return weight[:n], weight[n:], (None if bias is None else bias[:n]), (None if bias is None else bias[n:])


def _reference(x, weight, bias, activation):
    w_gate, w_up, b_gate, b_up = _halves(weight, bias)
    return reference.gated_linear(x, w_gate, w_up, b_gate, b_up, activation)


def _flops(params):
    M, K, N = params["shape"]
    return 2.0 * M * (2 * N) * K


def _hbm_bytes(params):
    M, K, N = params["shape"]
    s = params["dtype"].itemsize
    inputs = (M * K + 2 * N * K + (2 * N if params.get("bias", True) else 0)) * s
    # Eager: two GEMMs write g and u (2MN); act reads g, writes a (2MN); a * u reads 2MN, writes MN.
    return {"fused": inputs + M * N * s, "unfused": inputs + 7 * M * N * s}


def _anchors(params):
    return {"torch.compile": torch.compile(_reference, dynamic=False)}


GATED_LINEAR = OpSpec(
    name="gated_linear",
    summary="act(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up): SwiGLU/GeGLU with both GEMMs in one kernel",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(33, 70, 45), (1, 9, 1), (17, 64, 40)],
        "dtype": [FP32, FP16, BF16],
        "activation": ["swiglu", "geglu", "geglu_tanh"],
        "bias": [True, False],
        "weight_form": ["pair", "concat"],
        "layout": ["contiguous", "x_transposed", "3d"],
    },
    gpu_test_grid={"shape": [(33, 70, 45), (257, 1000, 515), (1024, 4096, 1376)]},
    bench_cases=([dict(shape=s, dtype=BF16, activation="swiglu", bias=False) for s in BENCH_SHAPES]
                 + [dict(shape=BENCH_SHAPES[0], dtype=FP16, activation="swiglu", bias=False)]),
    accuracy_cases={
        "cpu": [dict(shape=(33, 70, 45), dtype=d, activation="swiglu", bias=True) for d in (FP32, FP16, BF16)],
        "gpu": [dict(shape=(1000, 2048, 1030), dtype=d, activation="swiglu", bias=True) for d in (FP32, FP16, BF16)],
    },
    flops=_flops,
    hbm_bytes=_hbm_bytes,
    bound="compute",
    anchors=_anchors,
    compile_group=lambda p: f"{p['dtype']}-{p['activation']}-{p.get('bias', True)}",
    label=lambda p: (f"M{p['shape'][0]} K{p['shape'][1]} N{p['shape'][2]} {p['activation']}"
                     f"{'' if p.get('bias', True) else ' nobias'}"
                     f"{' concat' if p.get('weight_form') == 'concat' else ''}"),
)

SPECS = [GATED_LINEAR]

"""Registry entry: fused Linear + bias + activation (tilefuse.linear)."""
from __future__ import annotations

import torch

from tilefuse import reference
from tilefuse.ops import linear as linear_op
from tilefuse.opspec import OpSpec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# The foundation issue's five shapes (M, K, N): LLM MLP up-projections from GPT-2 to 7B size.
BENCH_SHAPES = [(8192, 4096, 16384), (2048, 4096, 11008), (8192, 1024, 4096),
                (16384, 768, 3072), (512, 4096, 4096)]
# Decode (the Hopper issue's small-M target): M in {1, 16, 64}, K = N = 4096. Bound by the weight read.
DECODE_SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096)]


def random_normal(dtype, device, seed: int):
    """``randn(*shape, scale=1.0)``: N(0, scale^2) values drawn on the CPU from ``seed`` (the same values
    on every device), then moved to ``device`` in ``dtype``."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
    return randn


def make_x(randn, M: int, K: int, layout: str) -> torch.Tensor:
    """x with M rows of K in the named layout; every non-contiguous one is a view, never a copy."""
    if layout == "x_transposed":          # a transposed view of a [K, M] buffer
        return randn(K, M).t()
    if layout == "x_strided":             # every other row and column of a larger buffer
        return randn(2 * M, 2 * K)[::2, ::2]
    if layout in ("3d", "3d_permuted"):   # [B, S, K], M = B * S (1 x M when M is prime)
        b = next((d for d in (3, 2) if M % d == 0), 1)
        if layout == "3d":
            return randn(b, M // b, K)
        return randn(M // b, b, K).transpose(0, 1)  # a permuted view of [S, B, K]: two row strides
    if layout == "1d":
        return randn(K)
    return randn(M, K)


def make_inputs(params: dict, device, seed: int) -> dict:
    """Random x, weight, bias in the layout the params ask for (strided/transposed views included).

    Values: x ~ N(0, 1), weight ~ N(0, 1/K) so the pre-activation is O(1) and every activation is
    exercised on both sides of zero; bias ~ N(0, 1).
    """
    M, K, N = params["shape"]
    layout = params.get("layout", "contiguous")
    randn = random_normal(params["dtype"], device, seed)
    w_scale = 1.0 / max(K, 1) ** 0.5
    if layout == "w_transposed":          # weight is a transposed view of a [K, N] buffer
        weight = randn(K, N, scale=w_scale).t()
    else:
        weight = randn(N, K, scale=w_scale)
    x = make_x(randn, M, K, layout)
    bias = randn(N) if params.get("bias", True) else None
    return {"x": x, "weight": weight, "bias": bias, "activation": params.get("activation")}


def _fused(x, weight, bias, activation):
    return linear_op.linear(x, weight, bias, activation)


def _reference(x, weight, bias, activation):
    return reference.linear(x, weight, bias, activation)


def _flops(params):
    M, K, N = params["shape"]
    return 2.0 * M * N * K


def _hbm_bytes(params):
    M, K, N = params["shape"]
    s = params["dtype"].itemsize
    bias = N * s if params.get("bias", True) else 0
    gemm = (M * K + N * K + M * N) * s + bias
    # Eager: F.linear writes y (bias folded into the GEMM), the activation reads y and writes y again.
    act_trip = 2 * M * N * s if params.get("activation") else 0
    return {"fused": gemm, "unfused": gemm + act_trip}


def _anchors(params):
    """Side-by-side anchors for one shape (GPU). torch.compile is built fresh per shape, dynamic=False."""
    activation = params.get("activation")
    anchors = {}
    if params.get("bias", True) and activation in ("gelu", None):
        # cuBLASLt's own GELU epilogue (erf form), the best vendor fused path.
        def cublaslt(x, weight, bias, activation):
            return torch._addmm_activation(bias, x, weight.t(), use_gelu=activation == "gelu")
        anchors["cublaslt_epilogue"] = cublaslt
    anchors["torch.compile"] = torch.compile(_reference, dynamic=False)
    anchors["torch.compile max-autotune"] = torch.compile(
        _reference, dynamic=False, mode="max-autotune-no-cudagraphs")
    return anchors


LINEAR = OpSpec(
    name="linear",
    summary="act(x @ W^T + b): GEMM with bias and activation in the epilogue",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(33, 70, 45), (1, 1, 1), (17, 130, 9), (64, 32, 96)],
        "dtype": [FP32, FP16, BF16],
        "activation": [None, "gelu", "gelu_tanh", "relu", "silu"],
        "bias": [True, False],
        "layout": ["contiguous", "x_transposed", "w_transposed", "x_strided", "3d", "3d_permuted", "1d"],
    },
    gpu_test_grid={
        "shape": [(33, 70, 45), (1, 1, 1), (257, 1000, 515), (1024, 768, 3072), (4, 4096, 4096)],
    },
    bench_cases=(
        [dict(shape=s, dtype=BF16, activation="gelu", bias=True) for s in BENCH_SHAPES]
        + [dict(shape=s, dtype=FP16, activation="gelu", bias=True) for s in BENCH_SHAPES]
        + [dict(shape=s, dtype=FP32, activation="gelu", bias=True) for s in BENCH_SHAPES[2:4]]
        + [dict(shape=s, dtype=BF16, activation="gelu", bias=True, bound="read") for s in DECODE_SHAPES]
    ),
    accuracy_cases={
        "cpu": [dict(shape=(33, 70, 45), dtype=d, activation="gelu", bias=True) for d in (FP32, FP16, BF16)],
        "gpu": [dict(shape=(1000, 2048, 1030), dtype=d, activation="gelu", bias=True) for d in (FP32, FP16, BF16)]
               + [dict(shape=(2048, 4096, 11008), dtype=BF16, activation="gelu", bias=True)],
    },
    flops=_flops,
    hbm_bytes=_hbm_bytes,
    bound="compute",
    anchors=_anchors,
    # Layouts reuse the same compiled kernels; only dtype, activation and bias select constexprs.
    compile_group=lambda p: f"{p['dtype']}-{p.get('activation')}-{p.get('bias', True)}",
    label=lambda p: (f"M{p['shape'][0]} K{p['shape'][1]} N{p['shape'][2]} "
                     f"{p.get('activation') or 'none'}{'' if p.get('bias', True) else ' nobias'}"),
)

SPECS = [LINEAR]

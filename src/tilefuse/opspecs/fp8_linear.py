"""Registry entry: FP8 (e4m3) Linear + bias + activation (tilefuse.linear(..., fp8=True)), against the float64
unquantized Linear.

The weight is a QuantizedWeight made once in make_inputs (a user quantizes weights once). ``x_form`` "fp8": x
arrives as e4m3 rows with fp32 scales (what torch._scaled_mm takes); "bf16": x in bf16, quantized by the
pre-pass inside the timed call. ``inputs`` "outliers": 1% of x's K channels (at least one, chosen by the seed)
20x larger, as activation outlier channels are. ``dtype`` is the unquantized tensors' and the output's (bf16).
"""
from __future__ import annotations

import torch

from tilefuse import reference
from tilefuse.ops import fp8_linear as fp8_op
from tilefuse.ops import linear as linear_op
from tilefuse.opspec import OpSpec
from tilefuse.opspecs.linear import LINEAR, random_normal
from tilefuse.reference import fp8_linear as fp8_reference

BF16 = torch.bfloat16
# The three largest foundation shapes (M, K, N) by FLOPs (opspecs/linear.py's BENCH_SHAPES).
BENCH_SHAPES = [(8192, 4096, 16384), (2048, 4096, 11008), (16384, 768, 3072)]
OUTLIER_FACTOR = 20.0
TOLERANCE = 5e-2  # the FP8 Linear issue's target against float64 (ENGINEERING.md section 4: fp8 e4m3)


def make_inputs(params: dict, device, seed: int) -> dict:
    """x ~ N(0, 1), W ~ N(0, 1/K), b ~ N(0, 1) in ``dtype`` (the unquantized tensors, kept for the reference and
    the anchors), W quantized once; x quantized per row (the reference emulation) for the "fp8" form."""
    M, K, N = params["shape"]
    dtype = params["dtype"]
    randn = random_normal(dtype, device, seed)
    w = randn(N, K, scale=1.0 / max(K, 1) ** 0.5)
    x = randn(M, K)
    bias = randn(N) if params.get("bias", True) else None
    if params.get("inputs", "gaussian") == "outliers":
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        channels = torch.randperm(K, generator=g)[:max(1, K // 100)].to(device)
        x[:, channels] *= OUTLIER_FACTOR
    if params.get("x_form", "bf16") == "fp8":
        x_in, x_scale = fp8_reference.quantize_rows(x)
    else:
        x_in, x_scale = x, None
    qw = fp8_op.quantize_weight(w)
    return {"x": x_in, "x_scale": x_scale, "weight": qw, "bias": bias, "activation": params.get("activation"),
            "x_unquantized": x, "weight_unquantized": w}


def _fused(x, x_scale, weight, bias, activation, x_unquantized=None, weight_unquantized=None):
    return linear_op.linear(x, weight, bias, activation, fp8=True, x_scale=x_scale)


def _reference(x, x_scale, weight, bias, activation, x_unquantized, weight_unquantized):
    """The unquantized Linear (float64 on the report's float64 copies of the inputs)."""
    return reference.linear(x_unquantized, weight_unquantized, bias, activation)


def _hbm_bytes(params):
    M, K, N = params["shape"]
    s = params["dtype"].itemsize
    bias = N * s if params.get("bias", True) else 0
    # e4m3 x and W, y in dtype, fp32 scales, the bias.
    gemm = M * K + N * K + M * N * s + 4 * M + 4 * N + bias
    # The bf16 form's pre-pass: x read, its e4m3 rows and scales written.
    prepass = (s * M * K + M * K + 4 * M) if params.get("x_form", "bf16") == "bf16" else 0
    # torch._scaled_mm, then the bias add and the activation each read and write y.
    eager = 4 * M * N * s if params.get("activation") else 2 * M * N * s
    return {"fused": gemm + prepass, "unfused": gemm + prepass + eager}


def _scaled_mm_then_eager(x, x_scale, weight, bias, activation, **_):
    """cuBLASLt's FP8 GEMM with the same row and channel scales (bf16 out), then the bias and the activation
    eagerly."""
    y = torch._scaled_mm(x, weight.data.t(), scale_a=x_scale[:, None], scale_b=weight.scale[None, :],
                         out_dtype=torch.bfloat16)
    return reference.activation(y + bias if bias is not None else y, activation)


def _tilefuse_bf16(x, x_scale, weight, bias, activation, x_unquantized, weight_unquantized):
    return linear_op.linear(x_unquantized, weight_unquantized, bias, activation)


def _cublaslt_bf16(x, x_scale, weight, bias, activation, x_unquantized, weight_unquantized):
    return torch._addmm_activation(bias, x_unquantized, weight_unquantized.t(), use_gelu=True)


def _per_tensor(x, x_scale, weight, bias, activation, x_unquantized, weight_unquantized):
    return fp8_reference.linear_fp8_per_tensor(x_unquantized, weight_unquantized, bias, activation)


def _anchors(params):
    """GPU anchors (closures only: listing them runs nothing). The FP8 form against cuBLASLt's FP8 GEMM; the
    bf16 form against the 16-bit Linears, tilefuse's and cuBLASLt's GELU epilogue (its tanh form: a speed anchor
    only). The per-tensor FP8 baseline is a PyTorch emulation, so it is no speed anchor: the accuracy table gives
    its error (``extra["accuracy_baselines"]``)."""
    anchors = {}
    if params.get("x_form", "bf16") == "fp8":
        anchors["scaled_mm + eager bias+gelu"] = _scaled_mm_then_eager
    else:
        anchors["tilefuse bf16 linear+gelu"] = _tilefuse_bf16
        if params.get("bias", True) and params.get("activation") == "gelu":
            anchors["cublaslt epilogue bf16"] = _cublaslt_bf16
    return anchors


def _label(p):
    M, K, N = p["shape"]
    return (f"M{M} K{K} N{N} {p.get('activation') or 'none'}{'' if p.get('bias', True) else ' nobias'} "
            f"x:{p.get('x_form', 'bf16')} {p.get('inputs', 'gaussian')}")


def _case(shape, inputs="gaussian", x_form="bf16"):
    # fp8: the report takes the row's roofline against the FP8 GEMM's ceiling, not the bf16 one.
    return dict(shape=shape, dtype=BF16, activation="gelu", bias=True, inputs=inputs, x_form=x_form, fp8=True)


LINEAR_FP8 = OpSpec(
    name="linear_fp8",
    summary="act((x_q sx) @ (W_q sw)^T + b): e4m3 GEMM, per-row x and per-channel W scales, bias and activation "
            "in the epilogue",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(33, 96, 40), (17, 70, 45), (64, 32, 96)],
        "dtype": [BF16],
        "activation": [None, "gelu", "silu"],
        "bias": [True, False],
        "inputs": ["gaussian", "outliers"],
        "x_form": ["bf16", "fp8"],
    },
    gpu_test_grid={
        "shape": [(33, 96, 40), (257, 1024, 520), (1000, 2048, 1030), (1024, 768, 3072)],
        "activation": [None, "gelu", "gelu_tanh", "relu", "silu"],
    },
    bench_cases=[_case(s, x_form=f) for s in BENCH_SHAPES for f in ("fp8", "bf16")],
    accuracy_cases={
        "cpu": [_case((33, 96, 40), "gaussian"), _case((33, 96, 40), "outliers")],
        "gpu": [_case((1000, 2048, 1030), "gaussian"), _case((1000, 2048, 1030), "outliers"),
                _case((1000, 2048, 1030), "gaussian", "fp8"),
                _case((2048, 4096, 11008), "gaussian"), _case((2048, 4096, 11008), "outliers")],
    },
    flops=LINEAR.flops,  # 2MNK, as the 16-bit Linear
    hbm_bytes=_hbm_bytes,
    bound="compute",
    anchors=_anchors,
    tolerance=lambda params: TOLERANCE,
    compile_group=lambda p: f"{p.get('x_form', 'bf16')}-{p.get('activation')}-{p.get('bias', True)}",
    label=_label,
    # The report's accuracy table also gives the per-tensor baseline's rel-L2 on the same inputs.
    extra={"accuracy_baselines": {"fp8 per-tensor": _per_tensor}},
)

SPECS = [LINEAR_FP8]

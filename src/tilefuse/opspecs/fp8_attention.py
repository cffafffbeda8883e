"""Registry entry: FP8 attention forward (tilefuse.attention(..., fp8=True)).

Rows take bf16 q, k, v (``form`` "bf16": quantized by the pre-pass inside the timed call) or e4m3 ones with
their scales (``form`` "e4m3": quantized beforehand, as an FP8 pipeline hands them over); ``inputs``
"gaussian" or "outliers" (1% of the head dim's channels, at least one, x20 in Q, K and V, as LLM activations
have). Accuracy is against float64 attention of the bf16 inputs, beside the plain per-tensor FP8 baseline
(reference/fp8_attention.py) on the same inputs.
"""
from __future__ import annotations

import torch

from tilefuse.ops import attention as attention_op
from tilefuse.ops import fp8_attention
from tilefuse.opspec import OpSpec
from tilefuse.opspecs.attention import visible_pairs
from tilefuse.reference import attention as ref_attention
from tilefuse.reference import fp8_attention as ref_fp8

BF16 = torch.bfloat16
# rel-L2 against float64: Gaussian inputs within the 6e-2 (e4m3 rounding of Q, K, V and P alone costs
# ~5e-2); outlier inputs, rotated, within 1.5e-1 (the bar there is relative: 2x below the per-tensor
# baseline, shown beside it).
GAUSSIAN_BOUND = 6e-2
OUTLIER_BOUND = 1.5e-1


def _dims(params):
    return (*params["shape"], params["d"])


def make_inputs(params: dict, device, seed: int) -> dict:
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hq, Nq, d, generator=g)
    k, v = (torch.randn(B, Hkv, Nk, d, generator=g) for _ in range(2))
    if params.get("inputs", "gaussian") == "outliers":
        channels = torch.randperm(d, generator=g)[:max(1, round(0.01 * d))]
        for t in (q, k, v):
            t[..., channels] *= 20
    q, k, v = (t.to(device=device, dtype=params["dtype"]) for t in (q, k, v))
    causal = params.get("causal", False)
    rotate = params.get("rotate", True)
    inputs = dict(q=q, k=k, v=v, causal=causal, rotate=rotate, q8=None, q_scale=None, k8=None, k_scale=None, v8=None,
                  v_scale=None)
    if params.get("form", "bf16") == "e4m3":
        with torch.no_grad():
            r = fp8_attention.quantize_qkv(q, k, v, rotate=rotate)
        inputs.update(q8=r.q, q_scale=r.q_scale, k8=r.k, k_scale=r.k_scale, v8=r.v, v_scale=r.v_scale)
    return inputs


def _fused(q, k, v, causal, rotate, q8, q_scale, k8, k_scale, v8, v_scale):
    if q8 is not None:
        return attention_op.attention(q8, k8, v8, causal=causal, fp8=True, q_scale=q_scale, k_scale=k_scale,
                                      v_scale=v_scale, out_dtype=q.dtype)
    return attention_op.attention(q, k, v, causal=causal, fp8=True, rotate=rotate)


def _reference(q, k, v, causal, rotate, **quantized):
    g = q.shape[1] // k.shape[1]
    return ref_attention.attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), causal=causal)


def _per_tensor(q, k, v, causal, rotate, **quantized):
    return ref_fp8.attention_fp8_per_tensor(q, k, v, causal=causal)


def _flops(params):
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    return 4.0 * B * Hq * d * visible_pairs(Nq, Nk, params.get("causal", False), None)


def _hbm_bytes(params):
    """fused: e4m3 Q, K, V read once, O written in bf16 (+ the pre-pass for bf16 inputs: bf16 read, e4m3
    written); unfused: the bf16 forward's bytes with the scores and probabilities written and read."""
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    qkv = B * Hq * Nq * d + 2 * B * Hkv * Nk * d
    fused = qkv + 2 * B * Hq * Nq * d
    if params.get("form", "bf16") == "bf16":
        fused += 3 * qkv
    return {"fused": fused, "unfused": 2 * (qkv + B * Hq * Nq * d) + 4 * B * Hq * Nq * Nk * 2}


def _anchors(params):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bf16(q, k, v, causal, rotate, **quantized):
        return attention_op.attention(q, k, v, causal=causal)

    def cudnn(q, k, v, causal, rotate, **quantized):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    return {"tilefuse.attention bf16": bf16, "sdpa cudnn bf16": cudnn}


def _tolerance(params):
    return OUTLIER_BOUND if params.get("inputs", "gaussian") == "outliers" else GAUSSIAN_BOUND


def _label(p):
    B, Hq, Hkv, Nq, Nk, d = _dims(p)
    heads = f"H{Hq}" if Hq == Hkv else f"Hq{Hq} Hkv{Hkv}"
    n = f"N{Nq}" if Nq == Nk else f"Nq{Nq} Nk{Nk}"
    return (f"B{B} {heads} {n} d{d} {'causal' if p.get('causal') else 'full'} {p.get('form', 'bf16')} in"
            f"{' rotated' if p.get('rotate', True) else ''} {p.get('inputs', 'gaussian')}")


def _bench_cases():
    cases = []
    for B, H, N in ((4, 16, 4096), (1, 16, 16384)):
        for causal in (True, False):
            for form in ("e4m3", "bf16"):
                cases.append(dict(shape=(B, H, H, N, N), d=128, dtype=BF16, causal=causal, form=form, fp8=True))
    return cases


ATTENTION_FP8 = OpSpec(
    name="attention_fp8",
    summary="FP8 (e4m3) FlashAttention forward: per-block Q/K and per-channel V scales, P scaled before its cast",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(1, 2, 1, 70, 133), (1, 2, 2, 130, 130)],
        "d": [32, 64],
        "dtype": [BF16],
        "causal": [False, True],
        "form": ["bf16", "e4m3"],
        "rotate": [False, True],
    },
    gpu_test_grid={
        "shape": [(2, 8, 2, 257, 1000), (1, 4, 4, 1000, 1024), (1, 8, 1, 1, 1024)],
        "d": [64, 128],
    },
    bench_cases=_bench_cases(),
    accuracy_cases={
        "cpu": [dict(shape=(1, 2, 2, 256, 256), d=64, dtype=BF16, causal=c, inputs=i, rotate=True)
                for i in ("gaussian", "outliers") for c in (False, True)],
        "gpu": [dict(shape=(1, 16, 16, 4096, 4096), d=128, dtype=BF16, causal=c, inputs=i, rotate=True)
                for i in ("gaussian", "outliers") for c in (True, False)],
    },
    flops=_flops,
    hbm_bytes=_hbm_bytes,
    bound="compute",
    anchors=_anchors,
    tolerance=_tolerance,
    compile_group=lambda p: f"fp8-d{p['d']}-{p.get('causal')}-{p.get('form')}",
    label=_label,
    extra={"accuracy_baselines": {"per-tensor fp8 (reference)": _per_tensor}},
)

SPECS = [ATTENTION_FP8]

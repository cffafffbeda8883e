"""Registry entry: the QKV projection into head layout, with RoPE and QK-norm (tilefuse.qkv_projection)."""
from __future__ import annotations

import torch

from tilefuse import reference
from tilefuse.opspec import OpSpec
from tilefuse.opspecs.linear import random_normal
from tilefuse.ops import qkv as qkv_op

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _rotary(B, N, r, device, batched):
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    pos = torch.arange(N, dtype=torch.float64)[None, :, None] + (torch.arange(B)[:, None, None] * 5 if batched else 0)
    emb = torch.cat([pos * inv, pos * inv], -1)
    cos, sin = emb.cos().float().to(device), emb.sin().float().to(device)
    return (cos, sin) if batched else (cos[0], sin[0])


def make_inputs(params: dict, device, seed: int) -> dict:
    """x ~ N(0, 1) [B, N, K], the three weights ~ N(0, 1/K), biases ~ N(0, 1), HF-style rotary tables for
    ``rotary`` dims (0: none), QK-norm weights ~ N(1, 0.5) with ``qk_norm``."""
    B, N, K, H, Hkv, d = params["shape"]
    randn = random_normal(params["dtype"], device, seed)
    r = params.get("rotary", 0)
    return {
        "x": randn(B, N, K),
        "weight": tuple(randn(h * d, K, scale=K ** -0.5) for h in (H, Hkv, Hkv)),
        "bias": tuple(randn(h * d) for h in (H, Hkv, Hkv)) if params.get("bias", True) else None,
        "num_heads": H, "num_kv_heads": Hkv,
        "rotary": _rotary(B, N, r, device, params.get("batched_rotary", False)) if r else None,
        "qk_norm": (randn(d) * 0.5 + 1, randn(d) * 0.5 + 1, 1e-6) if params.get("qk_norm") else None,
        "layout": params.get("layout", "bhnd"),
    }


def _fused(x, weight, bias, num_heads, num_kv_heads, rotary, qk_norm, layout):
    return qkv_op.qkv_projection(x, weight, bias, num_heads=num_heads, num_kv_heads=num_kv_heads, rotary=rotary,
                                 qk_norm=qk_norm, layout=layout)


def _reference(x, weight, bias, num_heads, num_kv_heads, rotary, qk_norm, layout):
    """Eager: three projections, view, transpose (to contiguous head layout), QK-norm and HF's RoPE."""
    outs = reference.qkv_projection(x, weight, bias if bias is not None else (None, None, None), num_heads,
                                    num_kv_heads, rotary, False, qk_norm)
    return tuple((o if layout == "bhnd" else o.transpose(1, 2)).contiguous() for o in outs)


def _bytes(params):
    """fused: x, the weights and q, k, v once, plus the rotary tables; eager: the projections' outputs,
    then the transposing copies, then QK-norm and RoPE each reading and writing q and k."""
    B, N, K, H, Hkv, d = params["shape"]
    s = params["dtype"].itemsize
    M, qkv = B * N, (H + 2 * Hkv) * d
    qk = M * (H + Hkv) * d * s
    fused = (M * K + qkv * K + M * qkv) * s + (2 * N * params.get("rotary", 0) * 4)
    eager = fused + 2 * M * qkv * s + (2 * qk if params.get("qk_norm") else 0) + (2 * qk if params.get("rotary") else 0)
    return {"fused": fused, "unfused": eager}


def _anchors(params):
    """Three bare cuBLAS GEMMs (the projections alone: no split, transpose, norm or RoPE -- the floor a fused
    kernel at cuBLAS speed would reach) and torch.compile of the eager head-layout path."""
    def three_gemms(x, weight, bias, **_):
        bs = bias if bias is not None else (None, None, None)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weight, bs))
    return {"cublas x3 (projections only)": three_gemms,
            "torch.compile": torch.compile(_reference, dynamic=False)}


QKV_PROJECTION = OpSpec(
    name="qkv_projection",
    summary="q, k, v written by the GEMM epilogue in head layout, with RoPE and QK-norm there (forward)",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(2, 9, 40, 4, 2, 16), (1, 5, 24, 2, 1, 24), (3, 7, 33, 2, 2, 80)],
        "dtype": [FP32, FP16, BF16],
        "rotary": [0, 16],
        "qk_norm": [False, True],
        "bias": [True, False],
        "layout": ["bhnd", "bnhd"],
    },
    gpu_test_grid={"shape": [(2, 257, 1000, 8, 2, 128), (1, 300, 768, 12, 12, 64)]},
    bench_cases=[dict(shape=(4, 2048, 4096, 32, 32, 128), dtype=BF16),
                 dict(shape=(8, 2048, 768, 12, 12, 64), dtype=BF16),
                 dict(shape=(1, 2048, 4096, 32, 8, 128), dtype=BF16, rotary=128),
                 dict(shape=(1, 2048, 4096, 32, 32, 128), dtype=BF16, rotary=128),
                 dict(shape=(1, 2048, 4096, 32, 8, 128), dtype=BF16, rotary=128, qk_norm=True),
                 # head dims that are not a power of two: Phi-3-mini's d 96 (full RoPE), Phi-2's d 80 (r 32)
                 dict(shape=(1, 2048, 3072, 32, 32, 96), dtype=BF16, rotary=96),
                 dict(shape=(1, 2048, 2560, 32, 32, 80), dtype=BF16, rotary=32)],
    accuracy_cases={
        "cpu": [dict(shape=(2, 9, 40, 4, 2, 16), dtype=d, rotary=16, qk_norm=True) for d in (FP32, BF16)],
        "gpu": [dict(shape=(2, 1024, 2048, 16, 4, 128), dtype=d, rotary=128, qk_norm=True) for d in (FP32, BF16)],
    },
    flops=lambda p: 2.0 * p["shape"][0] * p["shape"][1] * p["shape"][2] * (p["shape"][3] + 2 * p["shape"][4])
    * p["shape"][5],
    hbm_bytes=_bytes,
    bound="compute",
    anchors=_anchors,
    label=lambda p: (f"B{p['shape'][0]} N{p['shape'][1]} K{p['shape'][2]} H{p['shape'][3]}/{p['shape'][4]} "
                     f"d{p['shape'][5]}" + (f" rope{p['rotary']}" if p.get("rotary") else "")
                     + (" qknorm" if p.get("qk_norm") else "") + ("" if p.get("bias", True) else " nobias")
                     + (f" {p['layout']}" if p.get("layout", "bhnd") != "bhnd" else "")),
)



# ---- forward + backward --------------------------------------------------------------------------------------

def _train_inputs(params, device, seed):
    inputs = make_inputs(params, device, seed)
    B, N, K, H, Hkv, d = params["shape"]
    randn = random_normal(params["dtype"], device, seed + 1)
    layout = inputs["layout"]
    inputs["dout"] = tuple(randn(*((B, h, N, d) if layout == "bhnd" else (B, N, h, d))) for h in (H, Hkv, Hkv))
    return inputs


def _leaves(x, weight, bias, qk_norm):
    """Leaf copies of what gets a gradient (the rotary tables do not), in the order the step returns them."""
    leaf = lambda t: t.detach().requires_grad_()  # noqa: E731
    x, weight = leaf(x), tuple(leaf(w) for w in weight)
    bias = None if bias is None else tuple(leaf(b) for b in bias)
    qk_norm = None if qk_norm is None else (leaf(qk_norm[0]), leaf(qk_norm[1]), qk_norm[2])
    flat = [x, *weight, *(bias or ()), *(qk_norm[:2] if qk_norm else ())]
    return x, weight, bias, qk_norm, flat


def _train_step(forward, x, weight, bias, num_heads, num_kv_heads, rotary, qk_norm, layout, dout):
    """(q, k, v, then the gradients of x, the weights, the biases and the QK-norm weights)."""
    x, weight, bias, qk_norm, flat = _leaves(x, weight, bias, qk_norm)
    with torch.enable_grad():
        outs = forward(x, weight, bias, num_heads, num_kv_heads, rotary, qk_norm, layout)
        grads = torch.autograd.grad(outs, flat, dout)
    return (*(o.detach() for o in outs), *grads)


def _train_fused(**inputs):
    return _train_step(_fused, **inputs)


def _train_reference(**inputs):
    return _train_step(_reference, **inputs)


def _train_kernels_only(x, weight, bias, num_heads, num_kv_heads, rotary, qk_norm, layout, dout):
    """The op's forward and its backward function on a stand-in context: no autograd engine (the report
    captures this in a CUDA graph)."""
    import types
    bias3 = bias if bias is not None else (None, None, None)
    cos, sin = rotary if rotary is not None else (None, None)
    qn, kn, eps = qk_norm if qk_norm is not None else (None, None, 1e-6)
    args = (x, *weight, *bias3, num_heads, num_kv_heads, cos, sin, False, qn, kn, eps, layout)
    outs = qkv_op._impl(*args)
    ctx = types.SimpleNamespace(saved_tensors=(x, *weight, *bias3, cos, sin, qn, kn),
                                args=(num_heads, num_kv_heads, False, eps, layout),
                                needs_input_grad=(True, True, True, True, bias is not None, bias is not None,
                                                  bias is not None) + (False,) * 5 + (qn is not None,) * 2
                                + (False, False))
    return (*outs, *[g for g in qkv_op._backward(ctx, *dout) if g is not None])


QKV_PROJECTION_TRAIN = OpSpec(
    name="qkv_projection_train",
    summary=("q, k, v in head layout with RoPE / QK-norm, forward + backward (dx, dW, db, QK-norm weights) against "
             "eager autograd over the head-layout path"),
    fused=_train_fused,
    reference=_train_reference,
    make_inputs=_train_inputs,
    test_grid={
        "shape": [(2, 9, 40, 4, 2, 16), (1, 5, 24, 2, 1, 24)],
        "dtype": [FP32, BF16],
        "rotary": [0, 16],
        "qk_norm": [False, True],
        "bias": [True, False],
        "layout": ["bhnd", "bnhd"],
    },
    gpu_test_grid={"shape": [(2, 257, 1000, 8, 2, 128)]},
    bench_cases=[dict(shape=(4, 2048, 4096, 32, 32, 128), dtype=BF16, bias=False),
                 dict(shape=(1, 2048, 4096, 32, 8, 128), dtype=BF16, rotary=128, bias=False)],
    accuracy_cases={
        "cpu": [dict(shape=(2, 9, 40, 4, 2, 16), dtype=FP32, rotary=16, qk_norm=True)],
        "gpu": [dict(shape=(2, 1024, 2048, 16, 4, 128), dtype=d, rotary=128, qk_norm=True) for d in (FP32, BF16)],
    },
    flops=lambda p: 3 * QKV_PROJECTION.flops(p),  # forward GEMMs, dx, dW
    hbm_bytes=lambda p: {k: 3 * v for k, v in _bytes(p).items()},
    bound="compute",
    label=lambda p: QKV_PROJECTION.label(p) + " fwd+bwd",
    extra={"kernels_only": _train_kernels_only},
)

SPECS = [QKV_PROJECTION, QKV_PROJECTION_TRAIN]

"""Registry entry: the attention backward alone (tilefuse.attention's autograd), against eager autograd over the
plain PyTorch math and torch's SDPA backends' backwards.

A timed call is ``torch.autograd.grad`` on a forward graph built once per inputs dict (``retain_graph``),
so it is the backward alone; the report's GPU-only column runs ``kernels_only`` (the backward op's own
implementation on a forward computed once). Returns (dq, dk, dv).
"""
from __future__ import annotations

import torch

from tilefuse.opspec import OpSpec
from tilefuse.opspecs import attention as attention_spec
from tilefuse.ops import attention as attention_op
from tilefuse.reference import attention as ref_attention

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def make_inputs(params: dict, device, seed: int) -> dict:
    """The forward row's q, k, v and mode, plus dout ~ N(0, 1) and the score modifiers ``modifier`` names:
    a softcap of 5 (scores of std ~ logits then saturate where logits are large) and/or ALiBi slopes
    ~ U(0, 1) per head."""
    inputs = attention_spec.make_inputs(params, device, seed)
    inputs.pop("return_lse")
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    inputs["dout"] = torch.randn(*inputs["q"].shape, generator=g).to(device=device, dtype=params["dtype"])
    modifier = params.get("modifier") or ""
    inputs["softcap"] = 5.0 if "softcap" in modifier else None
    inputs["alibi_slopes"] = (torch.rand(inputs["q"].shape[1], generator=g).to(device) if "alibi" in modifier
                              else None)
    inputs["graph_cache"] = {}  # per inputs dict: the forward graph is built once, the backward timed alone
    return inputs


def _runner(key, forward):
    """``forward(q, k, v, causal, window, scale, softcap, alibi_slopes)`` wrapped so a call returns
    autograd.grad of its output against dout for a forward graph built once per inputs dict (and rebuilt
    for another q)."""
    def run(q, k, v, causal, window, scale, dout, graph_cache, softcap=None, alibi_slopes=None):
        entry = graph_cache.get(key)
        if entry is None or entry[0] is not q:
            with torch.enable_grad():  # the report calls ops under no_grad
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out = forward(*leaves, causal, window, scale, softcap, alibi_slopes)
            entry = graph_cache[key] = (q, out, leaves)
        _, out, leaves = entry
        with torch.enable_grad():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return run


def _fused_forward(q, k, v, causal, window, scale, softcap, alibi_slopes):
    return attention_op.attention(q, k, v, causal=causal, window=window, scale=scale, softcap=softcap,
                                  alibi_slopes=alibi_slopes)


def _reference_forward(q, k, v, causal, window, scale, softcap, alibi_slopes):
    return ref_attention.attention(q, k, v, causal=causal, window=window, scale=scale, softcap=softcap,
                                   alibi_slopes=alibi_slopes)


def _kernels_only(q, k, v, causal, window, scale, dout, graph_cache, softcap=None, alibi_slopes=None):
    """The backward op's implementation on the forward's saved tensors, without the autograd engine."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    alibi = None if alibi_slopes is None else alibi_slopes.expand(q.shape[0], q.shape[1])
    entry = graph_cache.get("kernels_only")
    if entry is None or entry[0] is not q:
        out, lse = attention_op._attention_impl(q, k, v, None, scale, True, left, right, True, softcap, alibi)
        entry = graph_cache["kernels_only"] = (q, out, lse)
    _, out, lse = entry
    return attention_op._attention_backward_impl(dout, q, k, v, out, lse, None, None, scale, True, left, right,
                                                 softcap, alibi)


def _sdpa_backward(backend):
    def forward(q, k, v, causal, window, scale, softcap, alibi_slopes):
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    return forward


def _anchors(params):
    from torch.nn.attention import SDPBackend

    anchors = {}
    if params.get("mode", (False, None))[1] is None and not params.get("modifier"):
        anchors["sdpa flash"] = _runner("sdpa flash", _sdpa_backward(SDPBackend.FLASH_ATTENTION))
        anchors["sdpa cudnn"] = _runner("sdpa cudnn", _sdpa_backward(SDPBackend.CUDNN_ATTENTION))
    return anchors


def _flops(params):
    # Five GEMM-shaped products per visible (query, key) pair against the forward's two: 2.5x its FLOPs.
    return 2.5 * attention_spec._flops(params)


def _hbm_bytes(params):
    """fused: q, k, v, out, dout read, dq, dk, dv written, lse and D per row; eager autograd writes and reads
    the scores, probabilities and their gradients (>= 4 B*Hq*Nq*Nk elements more)."""
    B, Hq, Hkv, Nq, Nk, d = attention_spec._dims(params)
    s = params["dtype"].itemsize
    fused = (3 * B * Hq * Nq * d + 2 * B * Hkv * Nk * d) * s + (B * Hq * Nq * d + 2 * B * Hkv * Nk * d) * s \
        + 8 * B * Hq * Nq
    return {"fused": fused, "unfused": fused + 4 * B * Hq * Nq * Nk * s}


ATTENTION_BACKWARD = OpSpec(
    name="attention_backward",
    summary=("FlashAttention backward alone: scores recomputed from the saved lse, dK/dV per key block (GQA "
             "summed on chip), dQ per query block, no atomics (deterministic)"),
    fused=_runner("tilefuse", _fused_forward),
    reference=_runner("reference", _reference_forward),
    make_inputs=make_inputs,
    test_grid={
        # No row sets of a handful of keys: one key gets P = 1 whatever the scores, so dq and dk are exactly 0
        # (tests/test_attention_backward.py checks that by value); one query over 5 keys at x10 logits is
        # near one-hot, dq and dk near 0, and even eager fp32 autograd lands at rel-L2 1.7e-4 there.
        "shape": [(1, 2, 2, 17, 130), (1, 2, 1, 130, 17), (1, 4, 1, 70, 70), (1, 2, 2, 5, 40)],
        "d": [16, 40, 64, 80, 128],
        "dtype": [FP32, FP16, BF16],
        "mode": attention_spec.MODES_CPU,
        "logits": [1, 10],
        "modifier": [None, "softcap", "alibi", "softcap+alibi"],
    },
    gpu_test_grid={
        "shape": [(2, 8, 2, 257, 1000), (1, 4, 4, 1000, 257)],
        "d": [16, 64, 80, 128, 256],
        "mode": attention_spec.MODES_GPU,
        "logits": [1],
    },
    bench_cases=[c for c in attention_spec.ATTENTION.bench_cases if c["shape"][3] <= 16384 and c["dtype"] == BF16
                 and c["mode"][1] is None][:12]
    + [c for c in attention_spec.ATTENTION.bench_cases if c["d"] in (80, 96, 256)],
    accuracy_cases={
        "cpu": [dict(shape=(1, 2, 1, 70, 70), d=64, dtype=dt, mode=(True, None)) for dt in (FP32, BF16)],
        "gpu": [dict(shape=(2, 16, 4, 2048, 2048), d=128, dtype=dt, mode=(True, None)) for dt in (FP32, BF16)],
    },
    flops=_flops,
    hbm_bytes=_hbm_bytes,
    bound="compute",
    anchors=_anchors,
    compile_group=lambda p: f"{p['dtype']}-d{p['d']}-{p['mode']}",
    label=lambda p: attention_spec._label(p) + (f" {p['modifier']}" if p.get("modifier") else ""),
    extra={"kernels_only": _kernels_only},
)

SPECS = [ATTENTION_BACKWARD]

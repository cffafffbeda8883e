"""Registry entries: FlashAttention forward (tilefuse.attention) and the torch-compatible SDPA surface."""
from __future__ import annotations

import torch

from tilefuse.ops import attention as attention_op
from tilefuse.reference import attention as ref_attention
from tilefuse.opspec import OpSpec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (causal, window) pairs: full, causal, a two-sided window, causal with a left window, right-only.
MODES_CPU = [(False, None), (True, None), (False, (13, 5)), (True, (20, -1)), (False, (-1, 7))]
MODES_GPU = [(False, None), (True, None), (False, (300, 100)), (True, (255, -1))]


def _randn(g, shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


# ---- attention ----------------------------------------------------------------------------------
def _dims(params):
    """params["shape"] = (B, Hq, Hkv, Nq, Nk) and params["d"] = head dim."""
    return (*params["shape"], params["d"])


def make_inputs(params: dict, device, seed: int) -> dict:
    """q, k, v ~ N(0, 1); ``logits`` multiplies q, so the scaled scores have std ~ logits."""
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    dtype = params["dtype"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    causal, window = params.get("mode", (False, None))
    return dict(
        q=_randn(g, (B, Hq, Nq, d), dtype, device, params.get("logits", 1)),
        k=_randn(g, (B, Hkv, Nk, d), dtype, device),
        v=_randn(g, (B, Hkv, Nk, d), dtype, device),
        causal=causal, window=window, scale=None, return_lse=params.get("return_lse", False))


def _fused(q, k, v, causal, window, scale, return_lse):
    return attention_op.attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=return_lse)


def _reference(q, k, v, causal, window, scale, return_lse):
    return ref_attention.attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=return_lse)


def visible_pairs(Nq: int, Nk: int, causal: bool, window) -> float:
    """(query, key) pairs attended. Causal without a window counts Nq*Nk/2 (the usual convention,
    as in ANCHORS.md); windows count exactly."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return float(Nq * Nk)
    if causal and left < 0:
        return Nq * Nk / 2
    pos = torch.arange(Nq, dtype=torch.int64) + (Nk - Nq)
    lo = (pos - left).clamp(min=0) if left >= 0 else torch.zeros_like(pos)
    hi = (pos + right).clamp(max=Nk - 1) if right >= 0 else torch.full_like(pos, Nk - 1)
    return float((hi - lo + 1).clamp(min=0).sum())


def _flops(params):
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    causal, window = params.get("mode", (False, None))
    return 4.0 * B * Hq * d * visible_pairs(Nq, Nk, causal, window)


def _hbm_bytes(params):
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    s = params["dtype"].itemsize
    qkvo = (2 * B * Hq * Nq * d + 2 * B * Hkv * Nk * d) * s
    # Eager: K/V repeated for GQA (write + read), scores written, read by softmax, probs written, read.
    repeat = 2 * 2 * B * Hq * Nk * d * s if Hq != Hkv else 0
    return {"fused": qkvo, "unfused": qkvo + repeat + 4 * B * Hq * Nq * Nk * s}


def _sdpa_anchor(backend):
    def run(q, k, v, causal, window, scale, return_lse):
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return run


def _flex_anchor(params):
    """flex_attention compiled fresh for this shape family, with a block mask for causal / windows."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    causal, window = params.get("mode", (False, None))
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    offset = Nk - Nq
    masked = left >= 0 or right >= 0

    def mask_mod(b, h, q_idx, kv_idx):
        ok = kv_idx >= 0
        if right >= 0:
            ok = ok & (kv_idx <= q_idx + offset + right)
        if left >= 0:
            ok = ok & (kv_idx >= q_idx + offset - left)
        return ok

    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = {}  # built by the first (untimed) call, on the inputs' device: listing anchors is free

    def run(q, k, v, causal, window, scale, return_lse):
        if "mask" not in block_mask:
            block_mask["mask"] = (create_block_mask(mask_mod, B=None, H=None, Q_LEN=Nq, KV_LEN=Nk, device=q.device)
                                  if masked else None)
        return compiled(q, k, v, block_mask=block_mask["mask"], scale=scale, enable_gqa=Hq != Hkv)
    return run


def _portable(q, k, v, causal, window, scale, return_lse):
    """tilefuse's portable (non-warp-specialized) kernel, where the default is the Gluon one."""
    left, right = window if window is not None else (-1, -1)
    out, lse = attention_op._attention_impl(q, k, v, None, scale, True, left, 0 if causal else right, return_lse,
                                            kernel="portable")
    return (out, lse) if return_lse else out


def _anchors(params):
    from torch.nn.attention import SDPBackend

    anchors = {}
    if params["dtype"] in (BF16, FP16) and params["d"] in (64, 128):
        anchors["tilefuse.attention.portable"] = _portable
    if params.get("mode", (False, None))[1] is None:  # SDPA has no sliding window
        anchors["sdpa flash"] = _sdpa_anchor(SDPBackend.FLASH_ATTENTION)
        anchors["sdpa cudnn"] = _sdpa_anchor(SDPBackend.CUDNN_ATTENTION)
        anchors["sdpa efficient"] = _sdpa_anchor(SDPBackend.EFFICIENT_ATTENTION)
    anchors["flex_attention"] = _flex_anchor(params)
    return anchors


def _label(p):
    B, Hq, Hkv, Nq, Nk, d = _dims(p)
    causal, window = p.get("mode", (False, None))
    heads = f"H{Hq}" if Hq == Hkv else f"Hq{Hq} Hkv{Hkv}"
    n = f"N{Nq}" if Nq == Nk else f"Nq{Nq} Nk{Nk}"
    what = ("causal" if causal else "full") + (f" window={window[0]},{window[1]}" if window else "")
    extra = (f" logits x{p['logits']}" if p.get("logits", 1) != 1 else "") + (" lse" if p.get("return_lse") else "")
    return f"B{B} {heads} {n} d{d} {what}{extra}"


def _bench_cases():
    cases = []
    for d in (64, 128):
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                cases.append(dict(shape=(16384 // n, 2048 // d, 2048 // d, n, n), d=d, dtype=BF16,
                                  mode=(causal, None)))
    cases += [
        dict(shape=(1, 32, 32, 2048, 2048), d=128, dtype=BF16, mode=(True, None)),   # Llama-7B prefill
        dict(shape=(1, 32, 8, 2048, 2048), d=128, dtype=BF16, mode=(True, None)),    # its GQA variant
        dict(shape=(1, 16, 16, 32768, 32768), d=128, dtype=BF16, mode=(True, (1023, 0))),  # sliding 1024
        dict(shape=(4, 16, 16, 4096, 4096), d=128, dtype=FP16, mode=(True, None)),
    ]
    # the head dims that run in wider tiles (80, 96) and the widest (256), at the attention-backward issue's shape
    cases += [dict(shape=(4, 16, 16, 4096, 4096), d=d, dtype=BF16, mode=(True, None)) for d in (80, 96, 256)]
    return cases


ATTENTION = OpSpec(
    name="attention",
    summary="FlashAttention forward: softmax(q k^T * scale) v, GQA, causal/sliding window, online softmax",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(1, 2, 2, 17, 130), (1, 2, 1, 130, 17), (1, 4, 1, 130, 130), (1, 8, 1, 1, 130),
                  (1, 2, 2, 1, 1)],
        "d": [16, 40, 64, 80, 96, 128, 256],
        "dtype": [FP32, FP16, BF16],
        "mode": MODES_CPU,
        "logits": [1, 100],
        "return_lse": [False, True],
    },
    gpu_test_grid={
        "shape": [(2, 8, 2, 257, 1000), (1, 4, 4, 1000, 257), (1, 8, 1, 1, 1024)],
        "mode": MODES_GPU,
        "logits": [1],
        "return_lse": [True],
    },
    bench_cases=_bench_cases(),
    accuracy_cases={
        "cpu": [dict(shape=(1, 2, 1, 130, 130), d=64, dtype=dt, mode=(True, None)) for dt in (FP32, FP16, BF16)],
        "gpu": [dict(shape=(2, 16, 4, 2048, 2048), d=128, dtype=dt, mode=(True, None)) for dt in (FP32, FP16, BF16)]
               + [dict(shape=(1, 16, 16, 4096, 4096), d=64, dtype=BF16, mode=(False, None))],
    },
    flops=_flops,
    hbm_bytes=_hbm_bytes,
    bound="compute",
    anchors=_anchors,
    # Head dim, dtype and the causal/window mode select the compiled variant.
    compile_group=lambda p: f"{p['dtype']}-d{p['d']}-{p['mode']}",
    label=_label,
)


# ---- scaled_dot_product_attention ---------------------------------------------------------------
def make_sdpa_inputs(params: dict, device, seed: int) -> dict:
    """``layout``: "4d", "3d" (no head dim), "gqa" (enable_gqa), "bcast" (key/value batch 1).
    ``mask``: None, "bool" (random, some rows all False), "float" (additive N(0,1) with -inf holes),
    "hf_pad" (Hugging Face padding: finfo.min on padded keys, [B, 1, 1, S], one batch fully padded)."""
    B, H, Hkv, L, S, E = params["shape"]
    dtype = params["dtype"]
    layout = params.get("layout", "4d")
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv_heads = Hkv if layout == "gqa" else H
    kv_batch = 1 if layout == "bcast" else B
    q = _randn(g, (B, H, L, E), dtype, device)
    k = _randn(g, (kv_batch, kv_heads, S, E), dtype, device)
    v = _randn(g, (kv_batch, kv_heads, S, E), dtype, device)
    if layout == "3d":
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    lead = (B,) if layout == "3d" else (B, 1)
    kind = params.get("mask")
    mask = None
    if kind == "bool":
        mask = torch.rand(*lead, L, S, generator=g) > 0.3
        mask[..., L // 2, :] = False
        mask = mask.to(device)
    elif kind == "float":
        mask = torch.randn(L, S, generator=g)
        mask[torch.rand(L, S, generator=g) > 0.7] = float("-inf")
        mask = mask.to(device=device, dtype=dtype)
    elif kind == "hf_pad":
        keep = torch.ones(B, S, dtype=torch.bool)
        keep[0, S // 2:] = False
        keep[-1] = False
        mask = torch.zeros(B, S, dtype=torch.float32).masked_fill(~keep, torch.finfo(dtype).min)
        mask = mask.to(device=device, dtype=dtype).view(B, *([1] * (len(lead) - 1)), 1, S)
    return dict(query=q, key=k, value=v, attn_mask=mask, is_causal=params.get("is_causal", False),
                enable_gqa=layout == "gqa")


def _sdpa_fused(query, key, value, attn_mask, is_causal, enable_gqa):
    return attention_op.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                     is_causal=is_causal, enable_gqa=enable_gqa)


def _sdpa_reference(query, key, value, attn_mask, is_causal, enable_gqa):
    return ref_attention.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal,
                                                      None, enable_gqa)


def _sdpa_flops(params):
    B, H, Hkv, L, S, E = params["shape"]
    return 4.0 * B * H * L * S * E / (2 if params.get("is_causal") else 1)


def _sdpa_bytes(params):
    B, H, Hkv, L, S, E = params["shape"]
    s = params["dtype"].itemsize
    mask = {"bool": B * L * S, "float": L * S * s, "hf_pad": B * S * s}.get(params.get("mask"), 0)
    base = (2 * B * H * L * E + 2 * B * H * S * E) * s + mask
    return {"fused": base, "unfused": base + 4 * B * H * L * S * s}


def _sdpa_anchors(params):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def backend(b):
        def run(query, key, value, attn_mask, is_causal, enable_gqa):
            with sdpa_kernel(b):
                return torch.nn.functional.scaled_dot_product_attention(
                    query, key, value, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
        return run

    return {"sdpa default": backend([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                     SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
            "sdpa efficient": backend(SDPBackend.EFFICIENT_ATTENTION),
            "sdpa cudnn": backend(SDPBackend.CUDNN_ATTENTION)}


def _sdpa_label(p):
    B, H, Hkv, L, S, E = p["shape"]
    return (f"B{B} H{H} L{L} S{S} E{E} {p.get('layout', '4d')} mask={p.get('mask')}"
            f"{' causal' if p.get('is_causal') else ''}")


SDPA = OpSpec(
    name="sdpa",
    summary="torch.nn.functional.scaled_dot_product_attention semantics on the same kernel (mask, top-left causal)",
    fused=_sdpa_fused,
    reference=_sdpa_reference,
    make_inputs=make_sdpa_inputs,
    test_grid={
        "shape": [(2, 2, 1, 37, 70, 64), (1, 4, 2, 70, 37, 40), (2, 2, 1, 1, 17, 96)],
        "dtype": [FP32, FP16, BF16],
        "layout": ["4d", "3d", "gqa", "bcast"],
        "mask": [None, "bool", "float", "hf_pad"],
        "is_causal": [False, True],
    },
    gpu_test_grid={
        "shape": [(2, 4, 2, 300, 1000, 64), (2, 4, 1, 1000, 300, 128)],
    },
    bench_cases=[
        dict(shape=(4, 16, 16, 2048, 2048, 128), dtype=BF16, layout="4d", mask="hf_pad"),
        dict(shape=(4, 16, 16, 2048, 2048, 128), dtype=BF16, layout="4d", mask=None, is_causal=True),
    ],
    accuracy_cases={
        "cpu": [dict(shape=(2, 2, 1, 70, 70, 64), dtype=dt, layout="4d", mask="hf_pad") for dt in (FP32, BF16)],
        "gpu": [dict(shape=(4, 16, 16, 2048, 2048, 128), dtype=dt, layout="4d", mask="hf_pad")
                for dt in (FP32, FP16, BF16)],
    },
    flops=_sdpa_flops,
    hbm_bytes=_sdpa_bytes,
    bound="compute",
    anchors=_sdpa_anchors,
    label=_sdpa_label,
)

SPECS = [ATTENTION, SDPA]

"""Registry entry: decode attention over a KV cache (tilefuse.flash_attn_with_kvcache), paged or dense.

Bytes: the visible keys and values read once (2 * sum(lens) * Hkv * d * s), q read and the output written; the
unfused way a server without a paged kernel runs (gather the pages into dense keys, then attention) adds a write
and a read of those keys. The reference gathers every sequence's pages and runs masked attention in float64.
"""
from __future__ import annotations

import torch

from tilefuse.ops.paged import flash_attn_with_kvcache
from tilefuse.opspec import OpSpec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _lengths(params: dict) -> list[int]:
    """Every sequence L long, or with ``ragged`` lengths drawn from [L / 32, L] by a generator seeded from the
    shape alone (the byte model counts the same keys the inputs hold)."""
    B, L = params["batch"], params["length"]
    if params.get("ragged"):
        g = torch.Generator().manual_seed(B * 1000003 + L)
        return [int(x) for x in torch.randint(max(1, L // 32), L + 1, (B,), generator=g)]
    return [L] * B


def make_inputs(params: dict, device, seed: int) -> dict:
    """q [B, T, Hq, d] and a cache holding each sequence's keys: pages of ``page`` positions in a shuffled order
    with a block table (page 0: a dense [B, L, Hkv, d] cache), the lengths as cache_seqlens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, L, hq, hkv, d = params["batch"], params["length"], params["heads"], params["kv_heads"], params["head_dim"]
    T, page, dtype = params.get("tokens", 1), params.get("page", 0), params["dtype"]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    lens = _lengths(params)
    q = randn(B, T, hq, d)
    if not page:
        return {"q": q, "k_cache": randn(B, L, hkv, d), "v_cache": randn(B, L, hkv, d),
                "cache_seqlens": torch.tensor(lens, dtype=torch.int32, device=device), "block_table": None}
    per = -(-L // page)
    n_pages = B * per
    table = torch.randperm(n_pages, generator=g).view(B, per).to(torch.int32).to(device)
    return {"q": q, "k_cache": randn(n_pages, page, hkv, d), "v_cache": randn(n_pages, page, hkv, d),
            "cache_seqlens": torch.tensor(lens, dtype=torch.int32, device=device), "block_table": table}


def _fused(q, k_cache, v_cache, cache_seqlens, block_table):
    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                                   causal=True, validate=False)


def _dense_keys(cache, block_table):
    """[B, capacity, Hkv, d]: each sequence's cache row, its pages gathered in order."""
    if block_table is None:
        return cache
    B = block_table.shape[0]
    return cache[block_table.long()].reshape(B, -1, *cache.shape[2:])


def _reference(q, k_cache, v_cache, cache_seqlens, block_table):
    """Gather, then masked attention in q's dtype: query t of a sequence with n keys sees keys 0..n - T + t."""
    k, v = _dense_keys(k_cache, block_table), _dense_keys(v_cache, block_table)
    B, T, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bthd,bnhd->bhtn", q, k) * d ** -0.5
    n = cache_seqlens.long()[:, None, None, None]
    pos = torch.arange(k.shape[1], device=q.device)
    last = n - T + torch.arange(T, device=q.device)[None, None, :, None]
    scores = scores.masked_fill(pos[None, None, None, :] > last, float("-inf"))
    return torch.einsum("bhtn,bnhd->bthd", torch.softmax(scores, -1), v).to(q.dtype)


def _kv_bytes(p):
    keys = sum(_lengths(p))
    return 2 * keys * p["kv_heads"] * p["head_dim"] * p["dtype"].itemsize


def _bytes(p):
    qo = 2 * p["batch"] * p.get("tokens", 1) * p["heads"] * p["head_dim"] * p["dtype"].itemsize
    kv = _kv_bytes(p)
    return {"fused": kv + qo, "unfused": 3 * kv + qo}


def _flops(p):
    keys = _kv_bytes(p) / (2 * p["kv_heads"] * p["head_dim"] * p["dtype"].itemsize)
    return 4.0 * keys * p.get("tokens", 1) * p["heads"] * p["head_dim"]


def _sdpa_dense(q, k_cache, v_cache, cache_seqlens, block_table):
    """cuDNN's dense decode (SDPA) over the same keys stored dense [B, Hkv, L, d] (the layout is made once per
    inputs, outside the timed call). Every sequence at full length: rows with equal lengths only."""
    key = (k_cache.data_ptr(), v_cache.data_ptr(), tuple(k_cache.shape),
           None if block_table is None else (block_table.data_ptr(), tuple(block_table.shape)))
    if _sdpa_dense.key != key:
        _sdpa_dense.key = None
        k = _dense_keys(k_cache, block_table).transpose(1, 2).contiguous()
        v = _dense_keys(v_cache, block_table).transpose(1, 2).contiguous()
        _sdpa_dense.kv = (k, v)
        _sdpa_dense.key = key
    k, v = _sdpa_dense.kv
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v,
                                                               enable_gqa=q.shape[2] != k.shape[1])
    return out.transpose(1, 2)


_sdpa_dense.key = None


def _anchors(params):
    if params.get("ragged") or params.get("tokens", 1) != 1:
        return {}
    return {"cudnn dense": _sdpa_dense}


def _label(p):
    kind = f"page{p['page']}" if p.get("page") else "dense"
    rag = " ragged" if p.get("ragged") else ""
    return f"B{p['batch']} L{p['length']} Hq{p['heads']} Hkv{p['kv_heads']} d{p['head_dim']} {kind}{rag}"


def _case(B, L, hq, hkv, page, dtype=BF16, **extra):
    return dict(batch=B, length=L, heads=hq, kv_heads=hkv, head_dim=128, page=page, dtype=dtype, **extra)


KVCACHE_DECODE = OpSpec(
    name="kvcache_decode",
    summary="decode attention over a paged or dense KV cache (flash_attn_with_kvcache): split-KV, GQA rows "
            "packed per KV head, merged by log-sum-exp",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "batch": [3], "length": [37, 5], "heads": [4], "kv_heads": [2, 4], "head_dim": [24],
        "page": [0, 7], "tokens": [1, 3], "dtype": [FP32],
    },
    gpu_test_grid={"length": [1000, 5], "head_dim": [128, 64], "page": [0, 16, 7], "dtype": [BF16, FP16, FP32]},
    bench_cases=[_case(64, 4096, 32, 32, 16), _case(8, 32768, 32, 8, 16), _case(1, 131072, 32, 8, 16),
                 _case(64, 4096, 32, 32, 64), _case(8, 32768, 32, 8, 0), _case(16, 32768, 32, 8, 16, ragged=True)],
    accuracy_cases={
        "cpu": [dict(batch=2, length=40, heads=4, kv_heads=2, head_dim=24, page=5, dtype=FP32)],
        "gpu": [_case(4, 4096, 32, 8, 16, dtype=d) for d in (BF16, FP16, FP32)],
    },
    flops=_flops,
    hbm_bytes=_bytes,
    bound="read",
    anchors=_anchors,
    label=_label,
)

SPECS = [KVCACHE_DECODE]

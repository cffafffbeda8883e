"""Registry entry: block-sparse attention (tilefuse.attention with a tilefuse.masks.BlockMask), forward.

FLOPs and bytes count only what the mask leaves visible: 4 * d FLOPs per visible (query, key) pair, and the K/V
rows of the key tiles some query tile visits."""
from __future__ import annotations

import functools

import torch

from tilefuse import masks
from tilefuse.ops import attention as attention_op
from tilefuse.opspec import OpSpec
from tilefuse.reference import attention as ref_attention

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
WINDOW = 1024      # the bench rows' sliding window: causal & sliding_window(WINDOW, 0)
GLOBAL_TOKENS = 64
DOCUMENTS = 16


def _doc_ids(n: int, docs: int) -> torch.Tensor:
    """``docs`` packed documents of a fixed pseudo-random set of lengths (the same for every call)."""
    g = torch.Generator().manual_seed(docs)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: docs - 1] + 1).values
    ids = torch.zeros(n, dtype=torch.int32)
    ids[cuts] = 1
    return ids.cumsum(0, dtype=torch.int32)


def mask_spec(name: str, n: int) -> masks.MaskSpec:
    """The named mask for length ``n``: "causal_window" (causal, window WINDOW, or n // 4 on short rows),
    "window_global" (that | GLOBAL_TOKENS global tokens), "document" (DOCUMENTS packed, causal inside each)."""
    window = WINDOW if n >= 4 * WINDOW else max(1, n // 4)
    band = masks.causal() & masks.sliding_window(window, 0)
    if name == "causal_window":
        return band
    if name == "window_global":
        return band | masks.global_tokens(min(GLOBAL_TOKENS, max(1, n // 8)))
    if name == "document":
        return masks.document(_doc_ids(n, min(DOCUMENTS, max(1, n // 16)))) & masks.causal()
    raise ValueError(f"unknown mask {name!r}")


def _dims(params):
    return (*params["shape"], params["d"])


def make_inputs(params: dict, device, seed: int) -> dict:
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    dtype = params["dtype"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    block_q, block_k = params.get("block", (128, 128))
    spec = mask_spec(params["mask"], Nk)
    return dict(q=torch.randn(B, Hq, Nq, d, generator=g).to(device=device, dtype=dtype),
                k=torch.randn(B, Hkv, Nk, d, generator=g).to(device=device, dtype=dtype),
                v=torch.randn(B, Hkv, Nk, d, generator=g).to(device=device, dtype=dtype),
                block_mask=spec.build(B, Hq, Nq, Nk, device, block_q=block_q, block_k=block_k))


def _fused(q, k, v, block_mask):
    return attention_op.attention(q, k, v, block_mask=block_mask)


def _reference(q, k, v, block_mask):
    dense = block_mask.spec.dense(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    return ref_attention.attend(q, k, v, dense, q.shape[-1] ** -0.5, 0, -1, -1)[0]


@functools.lru_cache(maxsize=64)
def _counts(mask: str, Nq: int, Nk: int, block: tuple) -> tuple:
    """(visible pairs, key tiles some query tile visits) of one batch and head, built on the CPU once."""
    bm = mask_spec(mask, Nk).build(1, 1, Nq, Nk, block_q=block[0], block_k=block[1])
    visited = int(((bm.q_num_blocks + bm.full_q_num_blocks) > 0).sum())
    return bm.visible_count(), visited


def _flops(params):
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    return 4.0 * B * Hq * d * _counts(params["mask"], Nq, Nk, tuple(params.get("block", (128, 128))))[0]


def _hbm_bytes(params):
    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    s = params["dtype"].itemsize
    block = tuple(params.get("block", (128, 128)))
    _, visited = _counts(params["mask"], Nq, Nk, block)
    kv_rows = min(Nk, visited * block[1])
    fused = (2 * B * Hq * Nq * d + 2 * B * Hkv * kv_rows * d) * s
    # Eager: the dense scores and probabilities (written, read), the dense bool mask read.
    return {"fused": fused, "unfused": (2 * B * Hq * Nq * d + 2 * B * Hkv * Nk * d) * s
            + 4 * B * Hq * Nq * Nk * s + Nq * Nk}


def _flex_anchor(params):
    """torch's FlexAttention, compiled, with the same mask (its own block mask, built by the first call)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, Hq, Hkv, Nq, Nk, d = _dims(params)
    spec = mask_spec(params["mask"], Nk)
    compiled = torch.compile(flex_attention, dynamic=False)
    state = {}

    def run(q, k, v, block_mask):
        if "mask" not in state:
            def mask_mod(b, h, q_idx, kv_idx):
                return spec.visible(b, h, q_idx, kv_idx)
            state["mask"] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=Nq, KV_LEN=Nk, device=q.device)
        return compiled(q, k, v, block_mask=state["mask"], enable_gqa=Hq != Hkv)
    return run


def _label(p):
    B, Hq, Hkv, Nq, Nk, d = _dims(p)
    heads = f"H{Hq}" if Hq == Hkv else f"Hq{Hq} Hkv{Hkv}"
    return f"B{B} {heads} N{Nq} d{d} {p['mask']} tiles {'x'.join(map(str, p.get('block', (128, 128))))}"


BLOCK_SPARSE = OpSpec(
    name="block_sparse_attention",
    summary="attention with a tilefuse.masks BlockMask: empty tiles skipped, partial ones masked by bitmap",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(1, 2, 1, 70, 70), (2, 2, 2, 45, 45)],
        "d": [16, 64],
        "dtype": [FP32, BF16],
        "mask": ["causal_window", "window_global", "document"],
        "block": [(32, 32)],
    },
    gpu_test_grid={
        "shape": [(2, 8, 2, 1000, 1000), (1, 4, 4, 257, 257)],
        "d": [64, 128],
        "dtype": [FP32, FP16, BF16],
        "block": [(128, 128), (64, 128)],
    },
    bench_cases=[dict(shape=(1, 16, 16, 32768, 32768), d=128, dtype=BF16, mask=m)
                 for m in ("causal_window", "window_global", "document")],
    accuracy_cases={
        "cpu": [dict(shape=(1, 2, 1, 70, 70), d=32, dtype=dt, mask="window_global", block=(32, 32))
                for dt in (FP32, BF16)],
        "gpu": [dict(shape=(1, 8, 8, 4096, 4096), d=128, dtype=dt, mask="window_global")
                for dt in (FP32, FP16, BF16)],
    },
    flops=_flops,
    hbm_bytes=_hbm_bytes,
    bound="compute",
    anchors=lambda params: {"flex_attention": _flex_anchor(params)},
    compile_group=lambda p: f"{p['dtype']}-d{p['d']}-{p['mask']}-{p.get('block')}",
    label=_label,
)

SPECS = [BLOCK_SPARSE]

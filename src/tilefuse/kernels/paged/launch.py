"""The paged KV cache's launch layer: the append, and decode attention with its split count and tile sizes.
Inputs arrive checked by tilefuse.ops.paged (shapes, dtypes, devices, lengths against the cache's tables).
"""
from __future__ import annotations

import torch

from tilefuse import runtime
from tilefuse.kernels import launches
from tilefuse.kernels.paged.kernels import paged_append_kernel, paged_decode_kernel, paged_merge_kernel
from tilefuse.sizes import cdiv, next_pow2

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 128  # below this a split's fixed cost (its q load, the merge's partials) outweighs its keys
# Programs per SM the splits aim for: fewer leave too few loads in flight to reach the read ceiling; more only add
# partials and merge work (the measured split sweep: benchmarks/NOTES.md, paged decode).
PROGRAMS_PER_SM = 2
MAX_SPLITS = 64


def append(k, v, k_pages, v_pages, block_table, slots, old_lens, path: str) -> None:
    """Writes k, v ``[S, T, Hkv, d]`` into the pages at positions old_lens[s] + t of each sequence's slot."""
    S, T, hkv, d = k.shape
    paged_append_kernel[(S, T)](
        k, v, k_pages, v_pages, block_table, slots, old_lens,
        hkv, d, k_pages.shape[1], k_pages.shape[0], block_table.shape[1],
        *k.stride(), *v.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(),
        BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), num_warps=4 if hkv * d >= 2048 else 1)
    launches.record("paged_append", path, "", lambda: f"{S}x{T} tokens, {hkv} kv heads")


def choose_splits(batch: int, kv_heads: int, max_len: int, num_sms: int) -> int:
    """Splits of the key positions per (sequence, KV head): enough programs to fill the SMs, never a split
    shorter than MIN_KEYS_PER_SPLIT keys."""
    want = cdiv(PROGRAMS_PER_SM * num_sms, max(batch * kv_heads, 1))
    return max(1, min(want, cdiv(max_len, MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def decode(q, k_pages, v_pages, block_table, seq_lens, slots, max_len: int, scale: float, num_splits: int,
           path: str) -> torch.Tensor:
    """Attention of q ``[S, T, Hq, d]`` (its tokens the last T of each sequence) over each sequence's pages."""
    S, T, hq, d = q.shape
    hkv = k_pages.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    if num_splits == 0:
        sms = runtime.device_facts(q.device)[1] if path == runtime.COMPILED else 2
        num_splits = choose_splits(S, hkv, max_len, sms)
    block_n = 16 if path == runtime.INTERPRETER else 64
    num_splits = max(1, min(num_splits, cdiv(max_len, block_n)))
    block_m = max(16, next_pow2(T * group))
    block_d = max(16, next_pow2(d))
    if num_splits > 1:
        part_o = torch.empty(S * T * hq, num_splits, d, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(S * T * hq, num_splits, device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # not read
    precision = runtime.precision_for(q.dtype, q.is_cuda)
    warps = 4 if block_m * block_d <= 64 * 128 else 8
    paged_decode_kernel[(S, hkv, num_splits)](
        q, k_pages, v_pages, block_table, seq_lens, slots, out, part_o, part_lse,
        T, group, hq, d, k_pages.shape[1], k_pages.shape[0], block_table.shape[1], scale * LOG2E,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(), *out.stride(),
        NUM_SPLITS=num_splits, INPUT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps, num_stages=2)
    if num_splits > 1:
        paged_merge_kernel[(S * T * hq,)](
            part_o, part_lse, out, T, hq, d, *out.stride(),
            NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_D=block_d, num_warps=1)
    launches.record("paged_attention", path, "split-kv" if num_splits > 1 else "single",
                    lambda: f"splits={num_splits} BLOCK_M={block_m} BLOCK_N={block_n} BLOCK_D={block_d}")
    return out

"""The KV cache family's launch layer: the append, and attention over a cache with its split count and tiles.
Inputs arrive checked by tilefuse.ops.paged (shapes, dtypes, devices; lengths against the cache's tables where the
host knows them).
"""
from __future__ import annotations

import torch

from tilefuse import runtime
from tilefuse.kernels import launches
from tilefuse.kernels.paged.kernels import kv_append_kernel, kv_attention_kernel, kv_merge_kernel
from tilefuse.sizes import cdiv, next_pow2

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 128  # below this a split's fixed cost (its q load, the merge's partials) outweighs its keys
# Splits fill the programs one SM holds at once, on every SM, in a single round: every split of a fixed-length
# batch reads as many keys, so a second, partial round of programs leaves most SMs idle for a whole program's time
# (the measured sweep of tile constants and splits: benchmarks/NOTES.md, paged decode).
MAX_RESIDENT = 4  # decode programs one SM holds past what its shared memory allows (warps, registers)
SMEM_PER_PROGRAM_SLACK = 2048  # per program beyond the pipelined key and value tiles: the driver's reserve, scratch
MAX_SPLITS = 64
MAX_BLOCK_M = 64  # query rows (tokens x heads of one KV head) per program
DECODE_BLOCK_N = 64  # keys per tile (32 above head dim 128)
DECODE_STAGES = 2  # software pipeline depth of the key loop
DECODE_WARPS = 4  # warps per program up to 64 x 128 (rows x head dim) tiles; 8 past that
UNBOUNDED = 1 << 30  # a window side past every key
# Elements of k per append program (and as many of v): a decode step's few tokens spread over enough programs
# to keep loads in flight on every SM.
APPEND_TILE = 1024


def _geometry(cache: torch.Tensor, block_table):
    """(page size, rows of the table or cache, key capacity per row, table columns, pages) of a cache tensor."""
    if block_table is not None:
        page = cache.shape[1]
        return page, block_table.shape[0], page * block_table.shape[1], block_table.shape[1], cache.shape[0]
    return cache.shape[1], cache.shape[0], cache.shape[1], 1, cache.shape[0]


def append(k, v, k_cache, v_cache, block_table, slots, old_lens, rotary, path: str) -> None:
    """Writes k, v ``[S, T, Hkv, d]`` at positions old_lens[s] + t of cache row slots[s] (s without slots) of a
    paged cache (``block_table``) or a dense one; ``rotary`` None or (cos, sin, interleaved) rotates k first."""
    S, T, hkv, d = k.shape
    page, rows, capacity, cols, pages = _geometry(k_cache, block_table)
    cos, sin, interleaved = rotary if rotary is not None else (k, k, False)
    rot_len, rot_half = (cos.shape[0], cos.shape[1]) if rotary is not None else (1, 0)
    table = block_table if block_table is not None else old_lens
    block_d = next_pow2(d)
    block_h = min(next_pow2(hkv), max(1, APPEND_TILE // block_d))
    kv_append_kernel[(S, T, cdiv(hkv, block_h))](
        k, v, k_cache, v_cache, table, slots if slots is not None else old_lens, old_lens, cos, sin,
        hkv, d, page, rows, capacity, cols, pages, rot_len, rot_half,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        *(block_table.stride() if block_table is not None else (0, 0)), cos.stride(0), sin.stride(0),
        PAGED=block_table is not None, HAS_SLOTS=slots is not None, ROTARY=rotary is not None,
        INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=max(1, min(4, block_h * block_d // 256)))
    launches.record("kv_append", path, "paged" if block_table is not None else "dense",
                    lambda: f"{S}x{T} tokens, {hkv} kv heads, rotary={rotary is not None}")


def resident_programs(block_n: int, block_d: int, elem_bytes: int, smem_per_sm: int) -> int:
    """Decode programs one SM holds at once: its shared memory over the key and value tiles each program's
    DECODE_STAGES-deep pipeline buffers."""
    per_program = DECODE_STAGES * 2 * block_n * block_d * elem_bytes + SMEM_PER_PROGRAM_SLACK
    return max(1, min(MAX_RESIDENT, smem_per_sm // per_program))


def choose_splits(programs: int, max_keys: int, round_size: int) -> int:
    """Splits of the key positions per (sequence, query block, KV head): as many as keep ``programs`` x splits
    within one round of ``round_size`` programs (SMs x resident programs), never a split shorter than
    MIN_KEYS_PER_SPLIT keys."""
    want = round_size // max(programs, 1)
    return max(1, min(want, cdiv(max_keys, MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def attention(q, k_cache, v_cache, *, block_table, lens, lens_by_slot: bool, extra_keys: int, slots, leftpad, cu_q,
              max_q: int, max_keys: int, scale: float, window, softcap, alibi, rotary, num_splits: int,
              return_lse: bool, path: str):
    """Attention of q ``[B, T, Hq, d]`` (or packed ``[total_q, Hq, d]`` with ``cu_q``; ``max_q`` tokens at most
    per sequence) over each sequence's keys in a paged (``block_table``) or dense cache: ``lens`` (None: the
    whole capacity) + ``extra_keys`` of them, from ``leftpad``. ``window`` (left, right) with -1 unbounded or
    None; ``softcap`` a float or None; ``alibi`` fp32 ``[B, Hq]`` or None; ``rotary`` None or (cos, sin,
    interleaved, sequential). ``max_keys`` bounds the key count (for the split count). Returns (out, lse: fp32
    natural-log ``[B, Hq, T]`` or ``[Hq, total_q]``, an empty tensor unless ``return_lse``)."""
    varlen = cu_q is not None
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k_cache.shape[2]
    group = hq // hkv
    B = cu_q.shape[0] - 1 if varlen else q.shape[0]
    T = max_q if varlen else q.shape[1]
    out = torch.empty_like(q)
    if return_lse:
        lse = torch.empty((hq, q.shape[0]) if varlen else (B, hq, T), device=q.device, dtype=torch.float32)
        lse_strides = (0, *lse.stride()) if varlen else lse.stride()
    else:
        lse, lse_strides = torch.empty(0, device=q.device, dtype=torch.float32), (0, 0, 0)
    if B == 0 or T == 0:
        return out, lse
    page, rows, capacity, cols, pages = _geometry(k_cache, block_table)
    block_m = min(MAX_BLOCK_M, max(16, next_pow2(T * group)))
    m_blocks = cdiv(T * group, block_m)
    block_d = max(16, next_pow2(d))
    block_n = 16 if path == runtime.INTERPRETER else (DECODE_BLOCK_N // 2 if block_d > 128 else DECODE_BLOCK_N)
    if num_splits == 0:
        if path == runtime.COMPILED:
            smem = runtime.shared_memory_per_sm(q.device)
            resident = resident_programs(block_n, block_d, k_cache.element_size(), smem)
            round_size = runtime.device_facts(q.device)[1] * resident
        else:
            round_size = 4
        num_splits = choose_splits(B * m_blocks * hkv, max_keys, round_size)
    num_splits = max(1, min(num_splits, cdiv(max(max_keys, 1), block_n), MAX_SPLITS))
    if num_splits > 1:
        part_o = torch.empty(B * T * hq, num_splits, d, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(B * T * hq, num_splits, device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # not read
    left, right = window if window is not None else (-1, -1)
    banded = left >= 0 or right >= 0
    left = UNBOUNDED if left < 0 else left
    right = UNBOUNDED if right < 0 else right
    qk_scale = scale / softcap if softcap else scale * LOG2E  # soft-capping takes tanh of the natural-log score
    cos, sin, interleaved, sequential = rotary if rotary is not None else (q, q, False, False)
    rot_len, rot_half = (cos.shape[0], cos.shape[1]) if rotary is not None else (1, 0)
    q_strides = (0, *q.stride()) if varlen else q.stride()
    o_strides = (0, *out.stride()) if varlen else out.stride()
    placeholder = lens if lens is not None else q
    precision = runtime.precision_for(q.dtype, q.is_cuda)
    warps = DECODE_WARPS if block_m * block_d <= 64 * 128 else 8
    kv_attention_kernel[(B * m_blocks, hkv, num_splits)](
        q, k_cache, v_cache, block_table if block_table is not None else placeholder, placeholder,
        slots if slots is not None else placeholder, leftpad if leftpad is not None else placeholder,
        cu_q if varlen else placeholder, cos, sin, alibi if alibi is not None else q, out, lse, part_o, part_lse,
        T, group, hq, d, page, rows, capacity, cols, pages, extra_keys, m_blocks,
        qk_scale, (softcap or 0.0) * LOG2E, left, right, rot_len, rot_half, q.shape[0] if varlen else 0,
        num_splits,
        *q_strides, *k_cache.stride(), *v_cache.stride(),
        *(block_table.stride() if block_table is not None else (0, 0)), *o_strides, *lse_strides,
        *(alibi.stride() if alibi is not None else (0, 0)), cos.stride(0), sin.stride(0),
        PAGED=block_table is not None, HAS_LENS=lens is not None, LENS_BY_SLOT=lens_by_slot,
        HAS_SLOTS=slots is not None, HAS_LEFTPAD=leftpad is not None, VARLEN_Q=varlen, BANDED=banded,
        HAS_SOFTCAP=bool(softcap), HAS_ALIBI=alibi is not None, ROTARY=rotary is not None,
        INTERLEAVED=bool(interleaved), ROT_Q_SEQUENTIAL=bool(sequential), RETURN_LSE=return_lse,
        SPLIT_KV=num_splits > 1, INPUT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps, num_stages=DECODE_STAGES)
    if num_splits > 1:
        kv_merge_kernel[(B * T * hq,)](
            part_o, part_lse, out, lse, cu_q if varlen else placeholder, T, hq, d, q.shape[0] if varlen else 0,
            num_splits,
            *o_strides, *lse_strides,
            VARLEN_Q=varlen, RETURN_LSE=return_lse, BLOCK_S=max(2, next_pow2(num_splits)),
            BLOCK_D=block_d, num_warps=1)
    launches.record("kv_attention", path, "split-kv" if num_splits > 1 else "single",
                    lambda: f"{'paged' if block_table is not None else 'dense'} splits={num_splits} "
                            f"BLOCK_M={block_m} BLOCK_N={block_n} BLOCK_D={block_d}")
    return out, lse

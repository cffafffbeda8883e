"""Pieces the attention kernels share: the tl helpers that map a program to its query block and head,
find the key tiles its rows see and apply the score modifiers, and the host-side facts about TMA-able
tensors and grid limits."""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import tanh

@triton.jit
def head_tile_ptrs(ptr, b, h, stride_b, stride_h, offs_rows, stride_rows, offs_d, stride_d):
    """Pointers of a [rows, head dim] tile of head (b, h) in a [B, H, N, d] tensor (64-bit offsets)."""
    return (ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
            + offs_rows.to(tl.int64)[:, None] * stride_rows + offs_d[None, :] * stride_d)


@triton.jit
def query_block_and_head(N_Q, BLOCK_M: tl.constexpr, FLAT_GRID: tl.constexpr):
    """(query block, b * Hq + h) of this program. Query blocks run in reverse order: with causal masks the
    last blocks carry the most keys, so they start first and the light ones fill the tail of the launch.
    The q-blocks of one head are consecutive programs (axis 0 runs fastest), so programs in flight share
    a K/V head in L2. FLAT_GRID: everything on axis 0, for B * Hq past axis 1's limit of 65535 (batched
    decode). Shared by the portable kernel and the warp-specialized one (ws.py)."""
    if FLAT_GRID:
        q_blocks = tl.cdiv(N_Q, BLOCK_M)
        pid_bh = tl.program_id(0) // q_blocks
        pid_m = q_blocks - 1 - tl.program_id(0) % q_blocks
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
    return pid_m, pid_bh


@triton.jit
def key_tile_ranges(m0, ROWS: tl.constexpr, N_Q, N_K, pos_offset, window_left, window_right,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """For query rows [m0, m0 + ROWS): the first BLOCK_N tile any row sees, the end of the keys any row
    sees, and the tile-aligned range [full_start, full_end) that every row sees whole (empty: both at the
    first tile, so every tile takes the masked path). Shared by both attention kernels."""
    last_row = tl.minimum(m0 + ROWS, N_Q) - 1
    lo = 0
    hi = N_K
    full_lo = 0
    full_hi = N_K
    if HAS_LEFT:
        lo = tl.maximum(m0 + pos_offset - window_left, 0)
        full_lo = tl.maximum(last_row + pos_offset - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last_row + pos_offset + window_right + 1, 0), N_K)
        full_hi = tl.minimum(tl.maximum(m0 + pos_offset + window_right + 1, 0), N_K)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    full_start = (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_end = (full_hi // BLOCK_N) * BLOCK_N
    # tl.where, not a runtime `if`, so the scalars keep one type whichever flags are set.
    no_full = full_end <= full_start
    full_start = tl.where(no_full, lo_tile, full_start)
    full_end = tl.where(no_full, lo_tile, full_end)
    return lo_tile, hi, full_start, full_end



@triton.jit
def score_modifiers(s, pos_m, offs_n, N_K, softcap_log2, alibi_log2, HAS_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr):
    """Gemma 2's soft-capping (``s`` holds the scores divided by the cap: cap * tanh(s / cap), in the log2
    domain) and ALiBi on a [rows, keys] tile of scaled scores; the forward and the backward (backward.py)
    both call it, so they see one score.

    ALiBi is measured from each row's nearest key: ``-slope * |c - j|`` with c = clamp(p, 0, N_K - 1), which
    for every key j < N_K is ``-slope * (|p - j| - dmin(p))``, dmin(p) = max(0, -p) + max(0, p - (N_K - 1)).
    The two differ by a constant per row, which the softmax ignores; but a row far outside the keys (p < 0
    when Nq > Nk) would otherwise carry ``-slope * dmin(p)`` (hundreds) in every score and in its lse, where
    fp32 rounding of that constant (an ulp of 1.5e-5 at 200) dominates exp(s - lse). The integer distance is
    formed before the one conversion to fp32, so it is exact. The lse the kernels store is this row-shifted
    one; tilefuse.ops.attention converts it where a user asks for the lse."""
    if HAS_SOFTCAP:
        s = tanh(s) * softcap_log2
    if HAS_ALIBI:
        nearest = tl.minimum(tl.maximum(pos_m, 0), N_K - 1)
        s = s - alibi_log2 * tl.abs(nearest[:, None] - offs_n[None, :]).to(tl.float32)
    return s


@triton.jit
def varlen_sequence(cu_q_ptr, cu_k_ptr, b, TOTAL_Q, TOTAL_K):
    """(first query row (int64), query count, first key row (int64), key count, position offset) of packed
    sequence ``b`` from its offsets, clamped to [0, total] and to non-decreasing, so offsets that were not
    validated still never address a row outside q, k, v or the output; the sequence is aligned
    bottom-right. Shared by the varlen forward and backward."""
    q0 = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b).to(tl.int32), 0), TOTAL_Q)
    q1 = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1).to(tl.int32), q0), TOTAL_Q)
    k0 = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b).to(tl.int32), 0), TOTAL_K)
    k1 = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b + 1).to(tl.int32), k0), TOTAL_K)
    return q0.to(tl.int64), q1 - q0, k0.to(tl.int64), k1 - k0, (k1 - k0) - (q1 - q0)


def descriptors_usable(*tensors) -> bool:
    """TMA needs a unit last stride, 16-byte-aligned base and outer strides, and no broadcast (0) stride."""
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(s == 0 or (s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


MAX_GRID_Y = 65535  # CUDA's limit on grid axes 1 and 2

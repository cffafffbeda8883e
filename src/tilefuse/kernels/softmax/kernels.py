"""Softmax over one dim of a strided tensor, forward and backward, fp32 math, rows of any length.

Fuses: max, exp, sum and normalize (forward); the row dot sum(dy*y) and dx = y*(dy - dot) (backward).
HBM bytes (R rows of N, element size s): forward minimum 2*R*N*s (read x, write y); a row that fits one
block is read once and kept in registers. Longer rows loop over chunks and re-read x: "two_pass" 4*R*N*s
(max, sum, write passes), "online" 3*R*N*s (running (m, d), write); re-reads walk the row backwards so
they hit L2. Backward minimum 3*R*N*s (read y, dy; write dx), 5*R*N*s looped.
Tiling: BLOCK_M rows x BLOCK_N columns per program; a few long rows are split into segments over many
programs (per-segment (m, d) or partial dot to a workspace, then a combine-and-write kernel).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels import cache_keys

LOG2E = tl.constexpr(1.4426950408889634)  # exp(z) = exp2(z * log2(e)): ex2 is the hardware unit


# --------------------------------------------------------------------------------------------------
# Tile helpers. A "rows" argument is a [BLOCK_M] tensor of row base pointers; columns are
# lo <= offs_n < hi at stride_n. Everything returned is fp32.
# --------------------------------------------------------------------------------------------------
@triton.jit
def _cols(offs_n, stride_n, WIDE: tl.constexpr):
    # 64-bit column offsets only when (N - 1) * stride_n can pass 2**31 (a long strided dim).
    if WIDE:
        offs = offs_n.to(tl.int64) * stride_n
    else:
        offs = offs_n * stride_n
    return offs


@triton.jit
def _load(rows, mask_m, offs_n, hi, stride_n, OTHER: tl.constexpr, EVICT: tl.constexpr,
          WIDE: tl.constexpr):
    mask = mask_m[:, None] & (offs_n < hi)[None, :]
    ptrs = rows[:, None] + _cols(offs_n, stride_n, WIDE)[None, :]
    return tl.load(ptrs, mask=mask, other=OTHER, eviction_policy=EVICT).to(tl.float32)


@triton.jit
def _store(rows, mask_m, offs_n, hi, stride_n, value, WIDE: tl.constexpr):
    mask = mask_m[:, None] & (offs_n < hi)[None, :]
    ptrs = rows[:, None] + _cols(offs_n, stride_n, WIDE)[None, :]
    # Written once, never re-read here: leave L2 first, so a chunk-loop row stays for its second pass.
    tl.store(ptrs, value.to(rows.dtype.element_ty), mask=mask, eviction_policy="evict_first")


@triton.jit
def _chunk_start(lo, c, n_chunks, REVERSE: tl.constexpr, BLOCK_N: tl.constexpr):
    if REVERSE:
        start = lo + (n_chunks - 1 - c) * BLOCK_N
    else:
        start = lo + c * BLOCK_N
    return start


@triton.jit
def _row_stats(x_rows, mask_m, lo, hi, stride_xn, ALGORITHM: tl.constexpr, WIDE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP_STAGES: tl.constexpr = 1):
    """(m, d) per row over columns [lo, hi): the max and sum(exp(x - m)), both fp32 [BLOCK_M].

    Columns that are all -inf give (-inf, 0), so an all -inf segment adds nothing when segments
    combine (the exponent is taken against m_ref = 0 there instead of -inf - -inf = NaN); the final
    write still uses the true m, so a row that is -inf everywhere comes out NaN, as in torch.
    """
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(hi - lo, BLOCK_N)
    d_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # per-lane partial sums: one reduction at the end
    if ALGORITHM == "two_pass":
        m_acc = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
        for c in tl.range(0, n_chunks, num_stages=LOOP_STAGES):
            x = _load(x_rows, mask_m, lo + c * BLOCK_N + cols, hi, stride_xn, float("-inf"),
                      "evict_last", WIDE)
            m_acc = tl.maximum(m_acc, x)
        m = tl.max(m_acc, axis=1)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        # Backwards: the chunks read last are the ones still in L2.
        for c in tl.range(0, n_chunks, num_stages=LOOP_STAGES):
            start = _chunk_start(lo, c, n_chunks, True, BLOCK_N)
            x = _load(x_rows, mask_m, start + cols, hi, stride_xn, float("-inf"), "evict_last", WIDE)
            d_acc += tl.exp2((x - m_ref[:, None]) * LOG2E)
    else:
        # Online: the running max m and the lane sums rescaled by exp(m_old - m_new) when m grows.
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for c in tl.range(0, n_chunks, num_stages=LOOP_STAGES):
            x = _load(x_rows, mask_m, lo + c * BLOCK_N + cols, hi, stride_xn, float("-inf"),
                      "evict_last", WIDE)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2((m - m_ref) * LOG2E)
            d_acc = d_acc * alpha[:, None] + tl.exp2((x - m_ref[:, None]) * LOG2E)
            m = m_new
    return m, tl.sum(d_acc, axis=1)


@triton.jit
def _write_probs(x_rows, y_rows, mask_m, lo, hi, stride_xn, stride_yn, m, inv_d,
                 REVERSE: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
                 LOOP_STAGES: tl.constexpr = 1):
    """y = exp(x - m) * inv_d over columns [lo, hi), walking in the direction that starts in L2."""
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(hi - lo, BLOCK_N)
    for c in tl.range(0, n_chunks, num_stages=LOOP_STAGES):
        offs_n = _chunk_start(lo, c, n_chunks, REVERSE, BLOCK_N) + cols
        x = _load(x_rows, mask_m, offs_n, hi, stride_xn, float("-inf"), "evict_first", WIDE)
        _store(y_rows, mask_m, offs_n, hi, stride_yn, tl.exp2((x - m[:, None]) * LOG2E) * inv_d[:, None],
               WIDE)


@triton.jit
def _row_dot(y_rows, dy_rows, mask_m, lo, hi, stride_yn, stride_dyn, WIDE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP_STAGES: tl.constexpr = 1):
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
        y = _load(y_rows, mask_m, start + cols, hi, stride_yn, 0.0, "evict_last", WIDE)
        dy = _load(dy_rows, mask_m, start + cols, hi, stride_dyn, 0.0, "evict_last", WIDE)
        acc += y * dy
    return tl.sum(acc, axis=1)


@triton.jit
def _write_grad(y_rows, dy_rows, dx_rows, mask_m, lo, hi, stride_yn, stride_dyn, stride_dxn, dot,
                WIDE: tl.constexpr, BLOCK_N: tl.constexpr, LOOP_STAGES: tl.constexpr = 1):
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(hi - lo, BLOCK_N)
    for c in tl.range(0, n_chunks, num_stages=LOOP_STAGES):  # backwards, after the forward dot pass
        offs_n = _chunk_start(lo, c, n_chunks, True, BLOCK_N) + cols
        y = _load(y_rows, mask_m, offs_n, hi, stride_yn, 0.0, "evict_first", WIDE)
        dy = _load(dy_rows, mask_m, offs_n, hi, stride_dyn, 0.0, "evict_first", WIDE)
        _store(dx_rows, mask_m, offs_n, hi, stride_dxn, y * (dy - dot[:, None]), WIDE)


@triton.jit
def _tile_rows(tile, R_INNER, BLOCK_M: tl.constexpr):
    """Row tile -> (outer row index, BLOCK_M consecutive inner row indices, their mask).

    Rows are (outer, inner) pairs so a dim that is not last needs no copy; consecutive inner rows
    keep the compiler's contiguity facts, which is what coalesces a tile of neighbouring rows.
    """
    blocks_per_outer = tl.cdiv(R_INNER, BLOCK_M)
    outer = (tile // blocks_per_outer).to(tl.int64)
    offs_i = (tile % blocks_per_outer) * BLOCK_M + tl.arange(0, BLOCK_M)
    return outer, offs_i.to(tl.int64), offs_i < R_INNER


@triton.jit
def _segment_row(R, R_INNER, REVERSE: tl.constexpr):
    """Split kernels: program (segment, row) on grid (S, R), optionally in reverse launch order (the
    write kernel starts with what the stats kernel read last)."""
    pid_s = tl.program_id(0)
    row = tl.program_id(1)
    if REVERSE:
        pid_s = tl.num_programs(0) - 1 - pid_s
        row = R - 1 - row
    outer = (row // R_INNER).to(tl.int64)
    offs_i = (row % R_INNER + tl.arange(0, 1)).to(tl.int64)
    return pid_s, row, outer, offs_i, offs_i >= 0


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_fwd_tile(
    tile, x_ptr, y_ptr, N, R_INNER,
    stride_xo, stride_xi, stride_xn, stride_yo, stride_yi, stride_yn,
    ALGORITHM: tl.constexpr, SINGLE_BLOCK: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    outer, offs_i, mask_m = _tile_rows(tile, R_INNER, BLOCK_M)
    x_rows = x_ptr + outer * stride_xo + offs_i * stride_xi
    y_rows = y_ptr + outer * stride_yo + offs_i * stride_yi
    if SINGLE_BLOCK:
        # The whole row is one tile: one read, max / exp / sum / scale in registers, one write.
        offs_n = tl.arange(0, BLOCK_N)
        x = _load(x_rows, mask_m, offs_n, N, stride_xn, float("-inf"), "evict_first", WIDE)
        m = tl.max(x, axis=1)
        p = tl.exp2((x - m[:, None]) * LOG2E)
        inv_d = 1.0 / tl.sum(p, axis=1)
        _store(y_rows, mask_m, offs_n, N, stride_yn, p * inv_d[:, None], WIDE)
    else:
        m, d = _row_stats(x_rows, mask_m, 0, N, stride_xn, ALGORITHM, WIDE, BLOCK_M, BLOCK_N, LOOP_STAGES)
        # two_pass ended its sum pass at the row start, online its stats pass at the row end.
        _write_probs(x_rows, y_rows, mask_m, 0, N, stride_xn, stride_yn, m, 1.0 / d,
                     ALGORITHM == "online", WIDE, BLOCK_N, LOOP_STAGES)


@triton.jit
def softmax_fwd_kernel(
    x_ptr, y_ptr,
    N, R_INNER,
    stride_xo, stride_xi, stride_xn,
    stride_yo, stride_yi, stride_yn,
    KEY_N, KEY_R,  # autotune keys only: power-of-two buckets of N and of R_INNER
    N_OUTER,       # R / R_INNER: with R_INNER, the number of row tiles
    ALGORITHM: tl.constexpr, SINGLE_BLOCK: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr = 1,  # > 1: software-pipeline the chunk loops' loads (cp.async)
    PROGRAMS_PER_SM: tl.constexpr = 0,  # > 0: persistent grid of that many programs per SM (see below)
):
    if PROGRAMS_PER_SM > 0:
        # Few rows in flight at a time (one per program), so a chunk-loop row read in the first pass
        # is still in L2 for the second: a 128K-column bf16 row is 256 KB, and one program per SM
        # keeps 34 MB of rows live against a 50 MB L2.
        num_tiles = N_OUTER * tl.cdiv(R_INNER, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=1):
            _softmax_fwd_tile(tile, x_ptr, y_ptr, N, R_INNER, stride_xo, stride_xi, stride_xn,
                              stride_yo, stride_yi, stride_yn, ALGORITHM, SINGLE_BLOCK, WIDE,
                              BLOCK_M, BLOCK_N, LOOP_STAGES)
    else:
        _softmax_fwd_tile(tl.program_id(0), x_ptr, y_ptr, N, R_INNER, stride_xo, stride_xi, stride_xn,
                          stride_yo, stride_yi, stride_yn, ALGORITHM, SINGLE_BLOCK, WIDE,
                          BLOCK_M, BLOCK_N, LOOP_STAGES)


@triton.jit
def softmax_split_stats_kernel(
    x_ptr, m_ptr, d_ptr,
    N, R, R_INNER, SEG_LEN, S,
    stride_xo, stride_xi, stride_xn,
    KEY_N, KEY_R,  # autotune keys only: power-of-two buckets of N and of R
    ALGORITHM: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_s, row, outer, offs_i, mask_m = _segment_row(R, R_INNER, False)
    x_rows = x_ptr + outer * stride_xo + offs_i * stride_xi
    lo = pid_s * SEG_LEN
    m, d = _row_stats(x_rows, mask_m, lo, tl.minimum(lo + SEG_LEN, N), stride_xn, ALGORITHM, WIDE,
                      1, BLOCK_N)
    ws = row * S + pid_s + tl.arange(0, 1)
    tl.store(m_ptr + ws, m)
    tl.store(d_ptr + ws, d)


@triton.jit
def softmax_split_write_kernel(
    x_ptr, y_ptr, m_ptr, d_ptr,
    N, R, R_INNER, SEG_LEN, S,
    stride_xo, stride_xi, stride_xn,
    stride_yo, stride_yi, stride_yn,
    ALGORITHM: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_s, row, outer, offs_i, mask_m = _segment_row(R, R_INNER, True)
    # Combine the row's S segment states (tiny, redone by each of its programs):
    # m = max m_s, d = sum d_s * exp(m_s - m).
    offs_s = tl.arange(0, BLOCK_S)[None, :]
    ws = row * S + offs_s
    m_s = tl.load(m_ptr + ws, mask=offs_s < S, other=float("-inf"))
    d_s = tl.load(d_ptr + ws, mask=offs_s < S, other=0.0)
    m = tl.max(m_s, axis=1)
    d = tl.sum(d_s * tl.exp2((m_s - m[:, None]) * LOG2E), axis=1)
    x_rows = x_ptr + outer * stride_xo + offs_i * stride_xi
    y_rows = y_ptr + outer * stride_yo + offs_i * stride_yi
    lo = pid_s * SEG_LEN
    _write_probs(x_rows, y_rows, mask_m, lo, tl.minimum(lo + SEG_LEN, N), stride_xn, stride_yn, m,
                 1.0 / d, ALGORITHM == "online", WIDE, BLOCK_N)


# --------------------------------------------------------------------------------------------------
# Backward: dx = y * (dy - sum(dy * y)) over the row
# --------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_bwd_tile(
    tile, y_ptr, dy_ptr, dx_ptr, N, R_INNER,
    stride_yo, stride_yi, stride_yn, stride_dyo, stride_dyi, stride_dyn, stride_dxo, stride_dxi, stride_dxn,
    SINGLE_BLOCK: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    outer, offs_i, mask_m = _tile_rows(tile, R_INNER, BLOCK_M)
    y_rows = y_ptr + outer * stride_yo + offs_i * stride_yi
    dy_rows = dy_ptr + outer * stride_dyo + offs_i * stride_dyi
    dx_rows = dx_ptr + outer * stride_dxo + offs_i * stride_dxi
    if SINGLE_BLOCK:
        offs_n = tl.arange(0, BLOCK_N)
        y = _load(y_rows, mask_m, offs_n, N, stride_yn, 0.0, "evict_first", WIDE)
        dy = _load(dy_rows, mask_m, offs_n, N, stride_dyn, 0.0, "evict_first", WIDE)
        dot = tl.sum(y * dy, axis=1)
        _store(dx_rows, mask_m, offs_n, N, stride_dxn, y * (dy - dot[:, None]), WIDE)
    else:
        dot = _row_dot(y_rows, dy_rows, mask_m, 0, N, stride_yn, stride_dyn, WIDE, BLOCK_M, BLOCK_N,
                       LOOP_STAGES)
        _write_grad(y_rows, dy_rows, dx_rows, mask_m, 0, N, stride_yn, stride_dyn, stride_dxn, dot,
                    WIDE, BLOCK_N, LOOP_STAGES)


@triton.jit
def softmax_bwd_kernel(
    y_ptr, dy_ptr, dx_ptr,
    N, R_INNER,
    stride_yo, stride_yi, stride_yn,
    stride_dyo, stride_dyi, stride_dyn,
    stride_dxo, stride_dxi, stride_dxn,
    KEY_N, KEY_R,
    N_OUTER,
    SINGLE_BLOCK: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr = 1,  # > 1: software-pipeline the chunk loops' loads (cp.async)
    PROGRAMS_PER_SM: tl.constexpr = 0,  # > 0: persistent grid, as in the forward
):
    if PROGRAMS_PER_SM > 0:
        num_tiles = N_OUTER * tl.cdiv(R_INNER, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=1):
            _softmax_bwd_tile(tile, y_ptr, dy_ptr, dx_ptr, N, R_INNER, stride_yo, stride_yi, stride_yn,
                              stride_dyo, stride_dyi, stride_dyn, stride_dxo, stride_dxi, stride_dxn,
                              SINGLE_BLOCK, WIDE, BLOCK_M, BLOCK_N, LOOP_STAGES)
    else:
        _softmax_bwd_tile(tl.program_id(0), y_ptr, dy_ptr, dx_ptr, N, R_INNER, stride_yo, stride_yi,
                          stride_yn, stride_dyo, stride_dyi, stride_dyn, stride_dxo, stride_dxi, stride_dxn,
                          SINGLE_BLOCK, WIDE, BLOCK_M, BLOCK_N, LOOP_STAGES)


@triton.jit
def softmax_bwd_split_dot_kernel(
    y_ptr, dy_ptr, part_ptr,
    N, R, R_INNER, SEG_LEN, S,
    stride_yo, stride_yi, stride_yn,
    stride_dyo, stride_dyi, stride_dyn,
    WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_s, row, outer, offs_i, mask_m = _segment_row(R, R_INNER, False)
    y_rows = y_ptr + outer * stride_yo + offs_i * stride_yi
    dy_rows = dy_ptr + outer * stride_dyo + offs_i * stride_dyi
    lo = pid_s * SEG_LEN
    dot = _row_dot(y_rows, dy_rows, mask_m, lo, tl.minimum(lo + SEG_LEN, N), stride_yn, stride_dyn,
                   WIDE, 1, BLOCK_N)
    tl.store(part_ptr + row * S + pid_s + tl.arange(0, 1), dot)


@triton.jit
def softmax_bwd_split_write_kernel(
    y_ptr, dy_ptr, dx_ptr, part_ptr,
    N, R, R_INNER, SEG_LEN, S,
    stride_yo, stride_yi, stride_yn,
    stride_dyo, stride_dyi, stride_dyn,
    stride_dxo, stride_dxi, stride_dxn,
    WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_s, row, outer, offs_i, mask_m = _segment_row(R, R_INNER, True)
    offs_s = tl.arange(0, BLOCK_S)[None, :]
    dot = tl.sum(tl.load(part_ptr + row * S + offs_s, mask=offs_s < S, other=0.0), axis=1)
    y_rows = y_ptr + outer * stride_yo + offs_i * stride_yi
    dy_rows = dy_ptr + outer * stride_dyo + offs_i * stride_dyi
    dx_rows = dx_ptr + outer * stride_dxo + offs_i * stride_dxi
    lo = pid_s * SEG_LEN
    _write_grad(y_rows, dy_rows, dx_rows, mask_m, lo, tl.minimum(lo + SEG_LEN, N), stride_yn,
                stride_dyn, stride_dxn, dot, WIDE, BLOCK_N)


cache_keys.settle(globals())

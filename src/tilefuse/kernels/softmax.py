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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tilefuse import runtime, tuning
from tilefuse.kernels.tiling import cdiv, next_pow2

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


# --------------------------------------------------------------------------------------------------
# Plans and launchers
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Caps:
    """Block-size limits. The interpreter's are tiny so rows of ~300 already take the chunk loop
    and the split-row path (its cost is per program and per op, not per element)."""
    max_block_n: int    # rows up to this many columns are one tile kept in registers
    tile: int           # target elements per program for short rows (several rows per program)
    max_tile: int       # never more elements than this in one tile (register budget)
    loop_rows: int      # rows per program in the chunk loop
    loop_block_n: int   # chunk width in the loop (GPU: autotuned around it)
    split_block_n: int  # chunk width in the split-row kernels
    min_seg: int        # shortest segment worth a program of its own
    num_sms: int


GPU_CAPS = Caps(max_block_n=16384, tile=8192, max_tile=16384, loop_rows=1, loop_block_n=4096,
                split_block_n=4096, min_seg=4096, num_sms=132)
INTERPRETER_CAPS = Caps(max_block_n=128, tile=2048, max_tile=2048, loop_rows=8, loop_block_n=64,
                        split_block_n=64, min_seg=64, num_sms=2)


@dataclass(frozen=True)
class Plan:
    mode: str           # "block" (row in registers), "loop" (chunk loop), "split" (row over programs)
    block_m: int
    block_n: int
    num_warps: int
    segments: int = 1
    seg_len: int = 0
    tuned: bool = False  # GPU: triton.autotune picks among this config and its neighbours (split: the
    #                      tiling is fixed and only algorithm="auto" is tuned)

    def describe(self) -> str:
        s = f"{self.mode} {self.block_m}x{self.block_n} w{self.num_warps}"
        return s + (f" {self.segments}x{self.seg_len}" if self.mode == "split" else "")


def _warps(tile: int) -> int:
    # ~16 fp32 values per thread: enough loads in flight per SM without spilling.
    return max(1, min(16, tile // 512))


def plan(rows: int, r_inner: int, n: int, rows_adjacent: bool, elem_size: int, caps: Caps) -> Plan:
    """Choose the tiling for R rows of N (rows_adjacent: the columns are strided but neighbouring
    rows are contiguous in memory, i.e. softmax over a dim that is not last)."""
    if rows_adjacent:
        # Tile tall in rows so each column slice is >= one 32-byte sector; as wide as fits.
        # One tile per row block when it fits max_tile, else a chunk loop at the smaller target tile
        # (the loop also holds the lane sums: twice the registers).
        bm = min(next_pow2(r_inner), 64, max(32 // elem_size, caps.tile // next_pow2(n)))
        if bm * next_pow2(n) <= caps.max_tile and n <= caps.max_block_n:
            return Plan("block", bm, next_pow2(n), _warps(bm * next_pow2(n)))
        bn = min(max(1, caps.tile // bm), caps.max_block_n // 2)
        return Plan("loop", bm, bn, _warps(bm * bn))
    if n > caps.max_block_n and rows < 2 * caps.num_sms:
        # Too few rows to fill the GPU with one program per row: split each row into segments.
        bn = caps.split_block_n
        segs = min(cdiv(4 * caps.num_sms, rows), cdiv(n, caps.min_seg))
        seg_len = cdiv(cdiv(n, segs), bn) * bn  # whole chunks: aligned 16-byte loads
        segs = cdiv(n, seg_len)
        if segs > 1:
            # Fixed tiling; on the GPU "auto" still tunes the algorithm of the stats kernel.
            return Plan("split", 1, bn, _warps(bn), segs, seg_len, tuned=caps is GPU_CAPS)
    tuned = caps is GPU_CAPS
    if n <= caps.max_block_n:
        bn = next_pow2(n)
        bm = block_rows(bn, r_inner, caps)
        return Plan("block", bm, bn, _warps(bm * bn), tuned=tuned)
    return Plan("loop", caps.loop_rows, caps.loop_block_n, _warps(caps.loop_rows * caps.loop_block_n),
                tuned=tuned)


def block_rows(block_n: int, r_inner: int, caps: Caps) -> int:
    return max(1, min(caps.tile // block_n, next_pow2(r_inner), 1024))


# Autotune (GPU only): the heuristic plan and two neighbours, keyed on power-of-two buckets.
def _block_config_space():
    return [triton.Config({"BLOCK_M": bm}, num_warps=w) for bm in (2 ** i for i in range(11))
            for w in (1, 2, 4, 8, 16)]


def _prune_block(configs, named_args, **kwargs):
    """Keep (rows, warps) of the heuristic, half its warps, and twice its rows (if the tile allows)."""
    args = {**named_args, **kwargs}
    bn, r_inner = args["BLOCK_N"], args["R_INNER"]
    bm = block_rows(bn, r_inner, GPU_CAPS)
    w = _warps(bm * bn)
    keep = {(bm, w), (bm, max(1, w // 2))}
    if 2 * bm <= next_pow2(r_inner) and 2 * bm * bn <= GPU_CAPS.max_tile:
        keep.add((2 * bm, _warps(2 * bm * bn)))
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.num_warps) in keep]


# Chunk loops: the first three are the original space; LOOP_STAGES = 3 pipelines the loads, so an SM
# keeps more than one chunk in flight per row (one chunk per program at a time is ~55% of copy on the
# H200 for the norms' loop, which has the same shape).
_LOOP_CONFIGS = ([triton.Config({"BLOCK_M": 1, "BLOCK_N": bn, "LOOP_STAGES": st, "PROGRAMS_PER_SM": 0},
                                 num_warps=_warps(bn)) for st in (1, 3) for bn in (2048, 4096, 8192)]
                 # Persistent: 1-2 rows in flight per SM, so pass 2 re-reads the row from L2 (rows of
                 # 128K columns ran at 68% of copy on the H200 with a row per program: 3 trips, not 2).
                 + [triton.Config({"BLOCK_M": 1, "BLOCK_N": bn, "LOOP_STAGES": 3, "PROGRAMS_PER_SM": p},
                                  num_warps=_warps(bn)) for bn, p in ((8192, 1), (4096, 1), (4096, 2))])
LOOP_SMEM_BUDGET = 220 * 1024


def loop_smem_bytes(cfg: triton.Config, elem_bytes: int, backward: bool) -> int:
    """Upper bound on the pipelining buffers: LOOP_STAGES - 1 copies of each chunk loaded in each loop
    (forward: up to three loops of x, for two_pass; backward: two loops of y and dy)."""
    loads = 4 if backward else 3
    return (cfg.kwargs["LOOP_STAGES"] - 1) * cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] * elem_bytes * loads


def _prune_loop(configs, named_args, **kwargs):
    backward = "dy_ptr" in named_args
    t = named_args["y_ptr"] if backward else named_args["x_ptr"]
    elem = t.element_size() if hasattr(t, "element_size") else 4
    return [c for c in configs if loop_smem_bytes(c, elem, backward) <= LOOP_SMEM_BUDGET] or configs[:1]

softmax_fwd_block_tuned = tuning.autotune(
    name="softmax_fwd_block",
    configs=_block_config_space(), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_block})(softmax_fwd_kernel)
softmax_fwd_loop_tuned = tuning.autotune(
    name="softmax_fwd_loop",
    configs=_LOOP_CONFIGS, key=["KEY_N", "KEY_R", "ALGORITHM", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_loop})(softmax_fwd_kernel)
softmax_bwd_block_tuned = tuning.autotune(
    name="softmax_bwd_block",
    configs=_block_config_space(), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_block})(softmax_bwd_kernel)
softmax_bwd_loop_tuned = tuning.autotune(
    name="softmax_bwd_loop",
    configs=_LOOP_CONFIGS, key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_loop})(softmax_bwd_kernel)


# algorithm="auto": the algorithm is one more tuned parameter. Each chunked config is offered with
# "online" and with "two_pass" (online first: the pinned choice), so the tuner picks the faster pair
# for the key by measurement; a row held in one block reads x once either way and is offered once.
def with_both_algorithms(configs):
    return [triton.Config({**c.kwargs, "ALGORITHM": a}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs for a in (("online",) if c.kwargs.get("SINGLE_BLOCK") else ("online", "two_pass"))]


softmax_fwd_loop_auto = tuning.autotune(
    name="softmax_fwd_loop_auto",
    configs=with_both_algorithms(_LOOP_CONFIGS), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_loop})(softmax_fwd_kernel)

# Rows of 8K-16K elements (forward): one row per program held in registers (~100 registers per thread
# at 16 warps, so one block per SM with no loads in flight while it reduces -- the norms' single pass
# ran at 56% of copy so) or the pipelined chunk loop, which re-reads the row from L2. The autotuner
# measures both. The single-block configs come first, in the block tuner's order (the pinned choice).
LONG_ROW_MIN_N = 8192


def _long_row_configs():
    single = [triton.Config({"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_N": bn, "SINGLE_BLOCK": True,
                             "LOOP_STAGES": 1}, num_warps=c.num_warps)
              for bn in (8192, 16384) for c in _block_config_space() if c.kwargs["BLOCK_M"] <= 2]
    loop = [triton.Config({"BLOCK_M": 1, "BLOCK_N": bn, "SINGLE_BLOCK": False, "LOOP_STAGES": st},
                          num_warps=_warps(bn)) for bn in (2048, 4096) for st in (1, 3)]
    return single + loop


def _prune_long(configs, named_args, **kwargs):
    full = next_pow2(named_args["N"])
    single_kept = {(c.kwargs["BLOCK_M"], c.num_warps)
                   for c in _prune_block(_block_config_space(), {**named_args, "BLOCK_N": full})}
    elem = named_args["x_ptr"].element_size()
    keep = []
    for c in configs:
        if c.kwargs["SINGLE_BLOCK"]:
            if c.kwargs["BLOCK_N"] == full and (c.kwargs["BLOCK_M"], c.num_warps) in single_kept:
                keep.append(c)
        elif c.kwargs["BLOCK_N"] < full and loop_smem_bytes(c, elem, False) <= LOOP_SMEM_BUDGET:
            keep.append(c)
    return keep


softmax_fwd_long_tuned = tuning.autotune(
    name="softmax_fwd_long",
    configs=_long_row_configs(), key=["KEY_N", "KEY_R", "ALGORITHM", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_long})(softmax_fwd_kernel)
softmax_fwd_long_auto = tuning.autotune(
    name="softmax_fwd_long_auto",
    configs=with_both_algorithms(_long_row_configs()), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_long})(softmax_fwd_kernel)
# Few long rows split into segments: the stats kernel is where the algorithms differ (one read of each
# segment or two); the write kernel then follows the algorithm the stats kernel measured faster.
softmax_split_stats_auto = tuning.autotune(
    name="softmax_split_stats_auto",
    configs=[triton.Config({"ALGORITHM": a}, num_warps=_warps(GPU_CAPS.split_block_n)) for a in ("online", "two_pass")],
    key=["N", "R", "WIDE"])(softmax_split_stats_kernel)

# When False, the GPU runs the heuristic plan as is (no autotune): a switch for quick GPU checks.
AUTOTUNE = True


@dataclass(frozen=True)
class RowLayout:
    """R rows of N columns, row r = (outer, inner) with R = R_OUTER * R_INNER; per tensor the strides
    (outer, inner, column). Every tensor of one launch enumerates the rows in the same order."""
    rows: int
    r_inner: int
    n: int
    strides: tuple  # one (stride_outer, stride_inner, stride_n) per tensor, in argument order

    @property
    def wide(self) -> bool:
        return any((self.n - 1) * abs(sn) >= 2 ** 31 for _, _, sn in self.strides)


def _caps(interpret: bool, device: torch.device) -> Caps:
    if interpret:
        return INTERPRETER_CAPS
    sms = runtime.device_facts(device)[1]
    return GPU_CAPS if sms == GPU_CAPS.num_sms else Caps(**{**GPU_CAPS.__dict__, "num_sms": sms})


def _plan_for(layout: RowLayout, t: torch.Tensor, interpret: bool) -> Plan:
    _, s_inner, s_n = layout.strides[0]
    rows_adjacent = s_n != 1 and s_inner == 1 and layout.r_inner > 1
    return plan(layout.rows, layout.r_inner, layout.n, rows_adjacent, t.element_size(),
                _caps(interpret, t.device))


def _flat_strides(layout: RowLayout):
    return [s for triple in layout.strides for s in triple]


def launch_softmax_forward(x, y, layout: RowLayout, algorithm: str, interpret: bool) -> str:
    """y = softmax(x) over the layout's rows; returns a description of the config that ran.
    ``algorithm`` "auto": where the algorithms differ (rows longer than one block) and the GPU tunes,
    the faster one for the key is measured (the *_auto tuners); otherwise "online", which reads a long
    row twice instead of three times."""
    p = _plan_for(layout, x, interpret)
    R, r_inner, N = layout.rows, layout.r_inner, layout.n
    wide = layout.wide
    measured = algorithm == "auto" and p.tuned and AUTOTUNE
    if algorithm == "auto" and not measured:
        algorithm = "online"
    if p.mode == "split":
        ws = torch.empty((2, R, p.segments), dtype=torch.float32, device=x.device)
        (sxo, sxi, sxn), (syo, syi, syn) = layout.strides
        grid = (p.segments, R)
        stats_args = (x, ws[0], ws[1], N, R, r_inner, p.seg_len, p.segments, sxo, sxi, sxn)
        if measured:
            softmax_split_stats_auto[grid](*stats_args, WIDE=wide, BLOCK_N=p.block_n)
            algorithm = softmax_split_stats_auto.best_config.kwargs["ALGORITHM"]
        else:
            softmax_split_stats_kernel[grid](*stats_args, ALGORITHM=algorithm, WIDE=wide, BLOCK_N=p.block_n,
                                             num_warps=p.num_warps)
        softmax_split_write_kernel[grid](x, y, ws[0], ws[1], N, R, r_inner, p.seg_len, p.segments,
                                         sxo, sxi, sxn, syo, syi, syn, ALGORITHM=algorithm, WIDE=wide,
                                         BLOCK_N=p.block_n, BLOCK_S=next_pow2(p.segments),
                                         num_warps=p.num_warps)
        return f"{'auto ' if measured else ''}{algorithm} {p.describe()}"
    n_outer = R // r_inner
    args = (x, y, N, r_inner, *_flat_strides(layout), tuning.m_bucket(N), tuning.m_bucket(r_inner), n_outer)
    if p.mode == "block" and p.tuned and AUTOTUNE and p.block_n >= LONG_ROW_MIN_N:
        def grid(meta):
            return (n_outer * cdiv(r_inner, meta["BLOCK_M"]),)

        if measured:
            tuner = softmax_fwd_long_auto
            tuner[grid](*args, WIDE=wide)
        else:
            tuner = softmax_fwd_long_tuned
            tuner[grid](*args, ALGORITHM=algorithm, WIDE=wide)
        cfg = tuner.best_config
        k = cfg.kwargs
        how = "block" if k["SINGLE_BLOCK"] else f"loop stages {k['LOOP_STAGES']}"
        chosen = f"auto {k['ALGORITHM']}" if measured else algorithm
        return f"{chosen} {how} {k['BLOCK_M']}x{k['BLOCK_N']} w{cfg.num_warps} (tuned)"
    loop_tuned = softmax_fwd_loop_tuned
    if p.mode == "block":
        # One tile per row: both algorithms are the same single read, so compile one variant.
        algorithm = "online" if algorithm == "auto" else algorithm
        common = dict(ALGORITHM="online", SINGLE_BLOCK=True, WIDE=wide)
    elif measured:
        loop_tuned = softmax_fwd_loop_auto  # its configs carry ALGORITHM
        common = dict(SINGLE_BLOCK=False, WIDE=wide)
    else:
        common = dict(ALGORITHM=algorithm, SINGLE_BLOCK=False, WIDE=wide)
    return _launch_rows(softmax_fwd_kernel, softmax_fwd_block_tuned, loop_tuned,
                        p, args, common, n_outer, r_inner, algorithm)


def launch_softmax_backward(y, dy, dx, layout: RowLayout, interpret: bool) -> str:
    """dx = y * (dy - sum(dy * y)) over the layout's rows."""
    p = _plan_for(layout, y, interpret)
    R, r_inner, N = layout.rows, layout.r_inner, layout.n
    wide = layout.wide
    if p.mode == "split":
        part = torch.empty((R, p.segments), dtype=torch.float32, device=y.device)
        (syo, syi, syn), (sdo, sdi, sdn), (sxo, sxi, sxn) = layout.strides
        grid = (p.segments, R)
        softmax_bwd_split_dot_kernel[grid](y, dy, part, N, R, r_inner, p.seg_len, p.segments,
                                           syo, syi, syn, sdo, sdi, sdn, WIDE=wide, BLOCK_N=p.block_n,
                                           num_warps=p.num_warps)
        softmax_bwd_split_write_kernel[grid](y, dy, dx, part, N, R, r_inner, p.seg_len, p.segments,
                                             syo, syi, syn, sdo, sdi, sdn, sxo, sxi, sxn, WIDE=wide,
                                             BLOCK_N=p.block_n, BLOCK_S=next_pow2(p.segments),
                                             num_warps=p.num_warps)
        return f"backward {p.describe()}"
    n_outer = R // r_inner
    args = (y, dy, dx, N, r_inner, *_flat_strides(layout), tuning.m_bucket(N), tuning.m_bucket(r_inner),
            n_outer)
    common = dict(SINGLE_BLOCK=p.mode == "block", WIDE=wide)
    return _launch_rows(softmax_bwd_kernel, softmax_bwd_block_tuned, softmax_bwd_loop_tuned,
                        p, args, common, n_outer, r_inner, "backward")


def _launch_rows(kernel, block_tuned, loop_tuned, p: Plan, args, common, n_outer, r_inner, name):
    def grid(meta):
        tiles = n_outer * cdiv(r_inner, meta["BLOCK_M"])
        per_sm = meta.get("PROGRAMS_PER_SM", 0)
        return (min(tiles, per_sm * runtime.device_facts(args[0].device)[1]) if per_sm else tiles,)

    if p.tuned and AUTOTUNE:
        if p.mode == "block":
            block_tuned[grid](*args, **common, BLOCK_N=p.block_n)
            cfg = block_tuned.best_config
            return f"{name} block {cfg.kwargs['BLOCK_M']}x{p.block_n} w{cfg.num_warps} (tuned)"
        loop_tuned[grid](*args, **common)
        cfg = loop_tuned.best_config
        per_sm = cfg.kwargs.get("PROGRAMS_PER_SM", 0)
        if "ALGORITHM" in cfg.kwargs:  # a tuned algorithm ("auto") is named with the tiles
            name = f"{name} {cfg.kwargs['ALGORITHM']}"
        return (f"{name} loop 1x{cfg.kwargs['BLOCK_N']} w{cfg.num_warps} stages {cfg.kwargs['LOOP_STAGES']}"
                + (f" persistent {per_sm}/SM" if per_sm else "") + " (tuned)")
    kernel[grid](*args, **common, BLOCK_M=p.block_m, BLOCK_N=p.block_n, num_warps=p.num_warps)
    return f"{name} {p.describe()}"

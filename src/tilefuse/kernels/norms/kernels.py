"""LayerNorm / RMSNorm forward and backward over rows x[M, N], with an optional fused residual add.

Fuses: (h = x + residual) + row statistics + normalize + affine into one kernel and one store of y (and h).
HBM bytes, element size s: unfused pre-norm = add (3*M*N*s) + norm (2*M*N*s) = 5*M*N*s; fused
4*M*N*s with a residual, 2*M*N*s without (+ 8 bytes/row of mean/rstd kept for the backward).
Backward: dx and the dweight/dbias partials in one pass: reads dy, h (+ the extra grad of h), writes dx.
Tiling: BLOCK_M rows x BLOCK_N columns per tile; a row longer than BLOCK_N is walked in chunks (two
passes, stats then normalize; Chan's merge keeps the variance stable), so any N >= 1 works.
Limits: the last dim must be contiguous (stride 1); rows may sit at any stride.
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr,
    M, N,
    stride_xm, stride_rm, stride_ym, stride_hm,
    eps,
    M_BUCKET,  # autotune key only
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_Y: tl.constexpr,  # False: statistics only (the prologue pre-pass of layer_norm_linear)
    SINGLE_PASS: tl.constexpr,  # N <= BLOCK_N: the row stays in registers, one read and one write
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # grid size only (see the launcher); unused here
    LOOP_STAGES: tl.constexpr,  # > 1: software-pipeline the loads of the innermost loop (cp.async)
):
    # Persistent loop over row tiles: a small grid keeps few long rows in flight at a time, so the
    # second pass of a chunked row re-reads it from L2 instead of HBM.
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    # LOOP_STAGES > 1 on a persistent single-pass grid prefetches the next row tile while this one
    # is reduced; on chunked rows (the tile loop is then not innermost) it prefetches the next chunk.
    for tile in tl.range(pid, num_tiles, tl.num_programs(0), num_stages=LOOP_STAGES if SINGLE_PASS else 1):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        rows = offs_m.to(tl.int64)  # M * stride can pass 2**31
        if SINGLE_PASS:
            mask_n = offs_n0 < N
            mask = mask_m[:, None] & mask_n[None, :]
            h = tl.load(x_ptr + rows[:, None] * stride_xm + offs_n0[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_n0[None, :], mask=mask, other=0.0)
                h_low = (h + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
                tl.store(h_ptr + rows[:, None] * stride_hm + offs_n0[None, :], h_low, mask=mask)
                h = h_low.to(tl.float32)  # statistics of the stored (rounded) h, as the unfused pair
            if IS_RMS:
                mean = tl.zeros((BLOCK_M,), tl.float32)
                centered = h
            else:
                mean = tl.sum(h, axis=1) / N
                centered = tl.where(mask, h - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
            if STORE_Y:
                y = centered * rstd[:, None]
                if HAS_WEIGHT:
                    y = y * tl.load(w_ptr + offs_n0, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                if HAS_BIAS:
                    y = y + tl.load(b_ptr + offs_n0, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + rows[:, None] * stride_ym + offs_n0[None, :],
                         y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            # Pass 1: statistics chunk by chunk. Layer norm merges (count, mean, M2) per chunk (Chan et
            # al.), which stays accurate when |mean| >> std, unlike sum and sum of squares.
            mean = tl.zeros((BLOCK_M,), tl.float32)
            m2 = tl.zeros((BLOCK_M,), tl.float32)
            # L2 hints: what pass 2 re-reads (x, or h with a residual) is marked to stay; what is read
            # once (the residual) or written for good (y) to leave first. Only then do the rows in
            # flight (one per program of a persistent grid) fit the 50 MB L2 with y streaming past.
            for n0 in tl.range(0, N, BLOCK_N, num_stages=LOOP_STAGES):
                offs_n = n0 + offs_n0
                mask_n = offs_n < N
                mask = mask_m[:, None] & mask_n[None, :]
                h = tl.load(x_ptr + rows[:, None] * stride_xm + offs_n[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first" if HAS_RESIDUAL else "evict_last").to(tl.float32)
                if HAS_RESIDUAL:
                    r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0,
                                eviction_policy="evict_first")
                    h_low = (h + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
                    tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h_low, mask=mask,
                             eviction_policy="evict_last")
                    h = h_low.to(tl.float32)
                if IS_RMS:
                    m2 += tl.sum(h * h, axis=1)
                else:
                    count_before = n0 * 1.0
                    count_chunk = tl.sum(mask_n.to(tl.float32), axis=0)
                    chunk_mean = tl.sum(h, axis=1) / count_chunk
                    d = tl.where(mask, h - chunk_mean[:, None], 0.0)
                    count_after = count_before + count_chunk
                    delta = chunk_mean - mean
                    mean += delta * (count_chunk / count_after)
                    m2 += tl.sum(d * d, axis=1) + delta * delta * (count_before * count_chunk / count_after)
            rstd = 1.0 / tl.sqrt(m2 / N + eps)
            if STORE_Y:
                # Pass 2: normalize. With a residual, read the h just written (one tensor, not two).
                for n0 in tl.range(0, N, BLOCK_N, num_stages=LOOP_STAGES):
                    offs_n = n0 + offs_n0
                    mask_n = offs_n < N
                    mask = mask_m[:, None] & mask_n[None, :]
                    if HAS_RESIDUAL:
                        h = tl.load(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], mask=mask, other=0.0,
                                    eviction_policy="evict_first")
                    else:
                        h = tl.load(x_ptr + rows[:, None] * stride_xm + offs_n[None, :], mask=mask, other=0.0,
                                    eviction_policy="evict_first")
                    y = (h.to(tl.float32) - mean[:, None]) * rstd[:, None]
                    if HAS_WEIGHT:
                        y = y * tl.load(w_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                    if HAS_BIAS:
                        y = y + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :],
                             y.to(y_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first")
        tl.store(mean_ptr + offs_m, mean, mask=mask_m)
        tl.store(rstd_ptr + offs_m, rstd, mask=mask_m)


@triton.jit
def _grad_terms(dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, offs_m, mask_m, rows, offs_n, mask_n, mask,
                stride_dym, stride_hm, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """rstd, dy, x_hat and w*dy for one [BLOCK_M, BLOCK_N] tile, in fp32 (masked lanes are 0)."""
    rstd = tl.load(rstd_ptr + offs_m, mask=mask_m, other=0.0)
    mean = rstd
    if not IS_RMS:
        mean = tl.load(mean_ptr + offs_m, mask=mask_m, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        x_hat = h * rstd[:, None]
    else:
        x_hat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_WEIGHT:
        wdy = dy * tl.load(w_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    else:
        wdy = dy
    return rstd, dy, x_hat, wdy


@triton.jit
def _add_column_sums(dw_acc, db_acc, dy, x_hat, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr):
    """One row tile's contribution to the dweight / dbias partial rows (kept in registers)."""
    if COMPUTE_DW:
        dw_acc += tl.sum(dy * x_hat, axis=0)
    if COMPUTE_DB:
        db_acc += tl.sum(dy, axis=0)
    return dw_acc, db_acc


@triton.jit
def _store_column_sums(dw_part_ptr, db_part_ptr, part_row, N, offs_n, mask_n, dw_acc, db_acc,
                       COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr):
    """This program's fp32 partial rows; their sum over programs is taken afterwards in a fixed order."""
    if COMPUTE_DW:
        tl.store(dw_part_ptr + part_row * N + offs_n, dw_acc, mask=mask_n)
    if COMPUTE_DB:
        tl.store(db_part_ptr + part_row * N + offs_n, db_acc, mask=mask_n)


@triton.jit
def _dx(wdy, x_hat, c1, c2, rstd, IS_RMS: tl.constexpr):
    """dx = rstd * (w*dy - x_hat*c1 - c2), c1 = mean(x_hat*w*dy), c2 = mean(w*dy) (absent for RMS)."""
    if IS_RMS:
        return (wdy - x_hat * c1[:, None]) * rstd[:, None]
    return (wdy - (x_hat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def norm_bwd_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dh_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    M, N,
    stride_dym, stride_hm, stride_dhm, stride_dxm,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Rows that fit one tile (N <= BLOCK_N). dx = rstd * (w*dy - x_hat*c1 - c2) with
    c1 = mean(x_hat*w*dy), c2 = mean(w*dy) (0 for RMS). Each program walks row tiles pid, pid+G, ...
    summing dy*x_hat and dy column-wise in registers, then writes its own fp32 partial row: the
    dweight/dbias sum over programs is done afterwards in a fixed order (deterministic, no atomics)."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    db_acc = tl.zeros((BLOCK_N,), tl.float32)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        rows = offs_m.to(tl.int64)
        mask = mask_m[:, None] & mask_n[None, :]
        rstd, dy, x_hat, wdy = _grad_terms(dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, offs_m, mask_m, rows,
                                           offs_n, mask_n, mask, stride_dym, stride_hm, IS_RMS, HAS_WEIGHT)
        dx = _dx(wdy, x_hat, tl.sum(x_hat * wdy, axis=1) / N, tl.sum(wdy, axis=1) / N, rstd, IS_RMS)
        if HAS_DH:  # h was also an output (residual stream): its own gradient joins here
            dx += tl.load(dh_ptr + rows[:, None] * stride_dhm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * stride_dxm + offs_n[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc, db_acc = _add_column_sums(dw_acc, db_acc, dy, x_hat, COMPUTE_DW, COMPUTE_DB)
    _store_column_sums(dw_part_ptr, db_part_ptr, pid, N, offs_n, mask_n, dw_acc, db_acc, COMPUTE_DW, COMPUTE_DB)


@triton.jit
def norm_bwd_chunk_sums_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dots_ptr, dw_part_ptr, db_part_ptr,
    M, N, NUM_CHUNKS,
    stride_dym, stride_hm,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Long rows, pass 1. Program (g, c) owns column chunk c of row tiles g, g+G, ...: it writes the
    per-(row, chunk) partial sums of x_hat*w*dy and w*dy to dots[row, c, 0:2] and its dweight/dbias
    partial row for chunk c (column sums stay in registers)."""
    pid_g = tl.program_id(0)
    pid_c = tl.program_id(1)
    num_tiles = tl.cdiv(M, BLOCK_M)
    offs_n = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    db_acc = tl.zeros((BLOCK_N,), tl.float32)
    for tile in range(pid_g, num_tiles, tl.num_programs(0)):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        rows = offs_m.to(tl.int64)
        mask = mask_m[:, None] & mask_n[None, :]
        rstd, dy, x_hat, wdy = _grad_terms(dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, offs_m, mask_m, rows,
                                           offs_n, mask_n, mask, stride_dym, stride_hm, IS_RMS, HAS_WEIGHT)
        dots = dots_ptr + (rows * NUM_CHUNKS + pid_c) * 2
        tl.store(dots, tl.sum(x_hat * wdy, axis=1), mask=mask_m)
        tl.store(dots + 1, tl.sum(wdy, axis=1), mask=mask_m)
        dw_acc, db_acc = _add_column_sums(dw_acc, db_acc, dy, x_hat, COMPUTE_DW, COMPUTE_DB)
    _store_column_sums(dw_part_ptr, db_part_ptr, pid_g, N, offs_n, mask_n, dw_acc, db_acc, COMPUTE_DW, COMPUTE_DB)


@triton.jit
def norm_bwd_dx_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dots_ptr, dh_ptr, dx_ptr,
    M, N, NUM_CHUNKS,
    stride_dym, stride_hm, stride_dhm, stride_dxm,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Long rows, pass 2: program (row tile, chunk) sums its rows' chunk partials in a fixed order and
    writes dx for its chunk."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    dots = dots_ptr + (rows[:, None] * NUM_CHUNKS + offs_c[None, :]) * 2
    mask_c = mask_m[:, None] & (offs_c < NUM_CHUNKS)[None, :]
    c1 = tl.sum(tl.load(dots, mask=mask_c, other=0.0), axis=1) / N
    c2 = tl.sum(tl.load(dots + 1, mask=mask_c, other=0.0), axis=1) / N
    rstd, dy, x_hat, wdy = _grad_terms(dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, offs_m, mask_m, rows, offs_n,
                                       mask_n, mask, stride_dym, stride_hm, IS_RMS, HAS_WEIGHT)
    dx = _dx(wdy, x_hat, c1, c2, rstd, IS_RMS)
    if HAS_DH:
        dx += tl.load(dh_ptr + rows[:, None] * stride_dhm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + rows[:, None] * stride_dxm + offs_n[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)

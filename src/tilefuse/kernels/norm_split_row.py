"""LayerNorm / RMSNorm forward for rows too long for one program's registers, split over SPLITS programs.

Fuses what norm_fwd_kernel does (residual add, statistics, normalize, affine), for long rows. HBM bytes,
element size s: one read of x (and the residual) and one write of y (and h), as a short row, i.e.
2*M*N*s without a residual; the chunked path of norm_fwd_kernel reads x twice (3*M*N*s) once the rows in
flight outgrow the L2 (2048x131072 bf16: 59-62% of copy on the H200). Here each program keeps one
CHUNK of a row in registers; the SPLITS programs of a row exchange (mean, M2) partials through a small
global buffer (Chan's merge, exact) and wait for each other at a per-row arrival counter.
The exchange and its safeguards (cooperative grid, bounded wait) are in row_exchange.py.
Experimental: not dispatched by tilefuse.layer_norm / rms_norm until it measures faster
(benchmarks/split_rows.py compares it with the chunked path).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.row_exchange import (MAX_POLLS, exchange_partials, leave_row, load_row_chunk, program_chunk,
                                           split_row_launch)
from tilefuse.kernels.tiling import cdiv, next_pow2


@triton.jit
def norm_fwd_split_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr,
    part_ptr,   # fp32 [M, SPLITS, 2]: each program's (chunk mean, chunk M2), or (sum of squares, 0) for rms
    count_ptr,  # int32 [>= M], zero before and after every launch: arrivals, then departures
    M, N, CHUNK,
    stride_xm, stride_rm, stride_ym, stride_hm,
    eps,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MAX_POLLS: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the program's next row before this row's wait (two chunks in registers)
):
    split, groups, first, offs, mask = program_chunk(N, CHUNK, SPLITS, BLOCK_N)
    count = tl.sum(mask.to(tl.float32), axis=0)
    splits = tl.arange(0, SPLITS)
    split_counts = tl.minimum(tl.maximum(N - splits * CHUNK, 0), CHUNK).to(tl.float32)
    if PREFETCH:
        x_next = load_row_chunk(x_ptr, first, M, stride_xm, offs, mask, 0.0)
        if HAS_RESIDUAL:
            r_next = load_row_chunk(res_ptr, first, M, stride_rm, offs, mask, 0.0)
    for row in range(first, M, groups):
        row64 = (row + tl.arange(0, 1)).to(tl.int64)
        if PREFETCH:
            # The next row's loads are issued now and land while this row waits for its partners.
            x_row = x_next
            x_next = load_row_chunk(x_ptr, row + groups, M, stride_xm, offs, mask, 0.0)
            if HAS_RESIDUAL:
                r = r_next
                r_next = load_row_chunk(res_ptr, row + groups, M, stride_rm, offs, mask, 0.0)
        else:
            x_row = load_row_chunk(x_ptr, row, M, stride_xm, offs, mask, 0.0)
            if HAS_RESIDUAL:
                r = load_row_chunk(res_ptr, row, M, stride_rm, offs, mask, 0.0)
        h = x_row.to(tl.float32)
        if HAS_RESIDUAL:
            h_low = (h + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row64 * stride_hm + offs, h_low, mask=mask)
            h = h_low.to(tl.float32)  # statistics of the stored (rounded) h, as the unfused pair
        if IS_RMS:
            part_a = tl.sum(h * h, axis=0)
            part_b = part_a * 0.0
        else:
            part_a = tl.sum(h, axis=0) / tl.maximum(count, 1.0)
            centred = tl.where(mask, h - part_a, 0.0)
            part_b = tl.sum(centred * centred, axis=0)
        parts_a, parts_b, arrived = exchange_partials(part_ptr, count_ptr, row, row64, split, part_a, part_b,
                                                      SPLITS, MAX_POLLS)
        if IS_RMS:
            mean = 0.0
            rstd = 1.0 / tl.sqrt(tl.sum(parts_a, axis=0) / N + eps)
        else:
            # Chan et al.: M2 = sum_s M2_s + n_s (mean_s - mean)^2, exact for any split of the row.
            mean = tl.sum(parts_a * split_counts, axis=0) / N
            gap = parts_a - mean
            rstd = 1.0 / tl.sqrt(tl.sum(parts_b + split_counts * gap * gap, axis=0) / N + eps)
        rstd = tl.where(arrived, rstd, float("nan"))  # a wait that gave up poisons its row, visibly
        leave_row(count_ptr, row, SPLITS)
        y = (h - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row64 * stride_ym + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        if split == 0:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)


def launch_norm_fwd_split(x2d, res2d, weight, bias, y2d, h2d, mean, rstd, eps, is_rms, splits: int,
                          num_warps: int = 8, programs_per_sm: int = 1, prefetch: bool = False):
    """Forward of [M, N] rows (unit column stride) with each row split over ``splits`` programs (on the
    interpreter ``splits`` must be 1). ``programs_per_sm`` sizes the cooperative grid; ``prefetch`` loads
    each program's next row before the current row's wait. Returns the grid."""
    M, N = x2d.shape
    chunk = cdiv(N, splits)
    grid, parts, counters, options = split_row_launch(x2d, M, splits, programs_per_sm)
    dummy = mean
    norm_fwd_split_kernel[grid](
        x2d, res2d if res2d is not None else dummy, weight if weight is not None else dummy,
        bias if bias is not None else dummy, y2d, h2d if h2d is not None else dummy, mean, rstd, parts, counters,
        M, N, chunk, x2d.stride(0), res2d.stride(0) if res2d is not None else 0, y2d.stride(0),
        h2d.stride(0) if h2d is not None else 0, eps,
        IS_RMS=is_rms, HAS_RESIDUAL=res2d is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        SPLITS=splits, BLOCK_N=next_pow2(chunk), MAX_POLLS=MAX_POLLS, PREFETCH=prefetch, num_warps=num_warps,
        **options)
    return grid

"""Softmax forward over the last dim for rows too long for one program's registers, split over SPLITS
programs.

Fuses max, exp, sum and normalize, as softmax.py does, for long rows. HBM bytes, element size s: one
read of x and one write of y, 2*R*N*s, where softmax.py's chunk loops read x two or three times (online
3*R*N*s, two_pass 4*R*N*s) and its second read reaches HBM once the rows in flight outgrow the L2
(2048x131072 bf16 online: 68% of copy on the H200). Each program keeps one CHUNK of a row in registers and
exchanges its (chunk max, sum of exp(x - chunk max)) with the row's other programs (row_exchange.py);
the merge is the online softmax's rescaling, d = sum_s d_s * exp(m_s - m).
Extremes as torch.softmax: a row with NaN or +inf, or with no finite entry, is NaN throughout (a chunk
that is all -inf contributes nothing to a row that is not).
Experimental: last dim, rows at any stride with unit column stride; not dispatched by tilefuse.softmax
until it measures faster (benchmarks/split_rows.py times it beside the dispatched kernels).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilefuse.kernels.row_exchange import (MAX_POLLS, exchange_partials, leave_row, load_row_chunk, program_chunk,
                                           split_row_launch)
from tilefuse.kernels.tiling import cdiv, next_pow2

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def softmax_fwd_split_kernel(
    x_ptr, y_ptr,
    part_ptr,   # fp32 [R, SPLITS, 2]: each program's (chunk max, chunk sum of exp(x - chunk max))
    count_ptr,  # int32 [>= R], zero before and after every launch
    R, N, CHUNK, stride_xr, stride_yr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MAX_POLLS: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the program's next row before this row's wait (two chunks in registers)
):
    split, groups, first, offs, mask = program_chunk(N, CHUNK, SPLITS, BLOCK_N)
    if PREFETCH:
        x_next = load_row_chunk(x_ptr, first, R, stride_xr, offs, mask, float("-inf"))
    for row in range(first, R, groups):
        row64 = (row + tl.arange(0, 1)).to(tl.int64)
        if PREFETCH:
            # The next row's load is issued now and lands while this row waits for its partners.
            x_row = x_next
            x_next = load_row_chunk(x_ptr, row + groups, R, stride_xr, offs, mask, float("-inf"))
        else:
            x_row = load_row_chunk(x_ptr, row, R, stride_xr, offs, mask, float("-inf"))
        x = x_row.to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        # An all -inf chunk (or the padding of a short last chunk) sums to 0 from a max of -inf; a NaN or
        # +inf in the chunk makes its sum NaN, which spreads to the whole row in the merge, as in torch.
        shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
        chunk_sum = tl.sum(tl.exp2((x - shift) * LOG2E), axis=0)
        every_max, every_sum, arrived = exchange_partials(part_ptr, count_ptr, row, row64, split, chunk_max,
                                                          chunk_sum, SPLITS, MAX_POLLS)
        row_max = tl.max(every_max, axis=0)
        # A row with no finite entry has row_max = -inf: exp2(-inf - -inf) is NaN, and so is the row.
        row_sum = tl.sum(every_sum * tl.exp2((every_max - row_max) * LOG2E), axis=0)
        inv_sum = tl.where(arrived, 1.0 / row_sum, float("nan"))  # a wait that gave up poisons its row
        leave_row(count_ptr, row, SPLITS)
        y = tl.exp2((x - row_max) * LOG2E) * inv_sum
        tl.store(y_ptr + row64 * stride_yr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def launch_softmax_fwd_split(x2d: torch.Tensor, y2d: torch.Tensor, splits: int, num_warps: int = 8,
                             programs_per_sm: int = 1, prefetch: bool = False):
    """Softmax over the last dim of [R, N] rows (unit column stride) with each row split over ``splits``
    programs (1 under the interpreter). Returns the grid."""
    R, N = x2d.shape
    chunk = cdiv(N, splits)
    grid, parts, counters, options = split_row_launch(x2d, R, splits, programs_per_sm)
    softmax_fwd_split_kernel[grid](
        x2d, y2d, parts, counters, R, N, chunk, x2d.stride(0), y2d.stride(0),
        SPLITS=splits, BLOCK_N=next_pow2(chunk), MAX_POLLS=MAX_POLLS, PREFETCH=prefetch, num_warps=num_warps,
        **options)
    return grid

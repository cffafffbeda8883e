"""LayerNorm / RMSNorm forward for rows too long for one program's registers, split over SPLITS programs.

Fuses what norm_fwd_kernel does (residual add, statistics, normalize, affine), for long rows. HBM bytes,
element size s: one read of x (and the residual) and one write of y (and h), as a short row, i.e.
2*M*N*s without a residual; the chunked path of norm_fwd_kernel reads x twice (3*M*N*s) once the rows in
flight outgrow the L2 (2048x131072 bf16: 59-62% of copy on the H200). Here each program keeps one
CHUNK of a row in registers; the SPLITS programs of a row exchange (mean, M2) partials through a small
global buffer (Chan's merge, exact) and wait for each other at a per-row arrival counter.
Waiting needs every program of a row resident at once: on the GPU the grid is launched cooperatively
(``launch_cooperative_grid``: a grid that cannot be co-resident fails to launch instead of hanging),
and the wait is bounded (MAX_POLLS): a row whose wait gives up comes out NaN, which the tests see, never a hang.
The interpreter runs programs one at a time, so there it only runs SPLITS = 1.
Experimental: not dispatched by tilefuse.layer_norm / rms_norm until it measures faster
(benchmarks/norm_split_row.py compares it with the chunked path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilefuse import runtime
from tilefuse.kernels.gemm_epilogue import tile_counters
from tilefuse.kernels.tiling import cdiv, next_pow2

MAX_POLLS = 1 << 20  # ~1 s of polling at worst: long past any real wait, short of a hung GPU call


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
    pid = tl.program_id(0)
    split = pid % SPLITS
    groups = tl.num_programs(0) // SPLITS
    lanes = tl.arange(0, BLOCK_N)
    offs = split * CHUNK + lanes
    mask = (lanes < CHUNK) & (offs < N)
    count = tl.sum(mask.to(tl.float32), axis=0)
    splits = tl.arange(0, SPLITS)
    split_counts = tl.minimum(tl.maximum(N - splits * CHUNK, 0), CHUNK).to(tl.float32)
    first = pid // SPLITS
    if PREFETCH:
        first64 = (first + tl.arange(0, 1)).to(tl.int64)
        x_next = tl.load(x_ptr + first64 * stride_xm + offs, mask=mask & (first < M), other=0.0)
        if HAS_RESIDUAL:
            r_next = tl.load(res_ptr + first64 * stride_rm + offs, mask=mask & (first < M), other=0.0)
    for row in range(first, M, groups):
        row64 = (row + tl.arange(0, 1)).to(tl.int64)  # [1]: M * stride can pass 2**31
        if PREFETCH:
            # The next row's loads are issued now and land while this row waits for its partners.
            x_row = x_next
            following = row + groups
            following64 = (following + tl.arange(0, 1)).to(tl.int64)
            x_next = tl.load(x_ptr + following64 * stride_xm + offs, mask=mask & (following < M), other=0.0)
            if HAS_RESIDUAL:
                r = r_next
                r_next = tl.load(res_ptr + following64 * stride_rm + offs, mask=mask & (following < M), other=0.0)
        else:
            x_row = tl.load(x_ptr + row64 * stride_xm + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row64 * stride_rm + offs, mask=mask, other=0.0)
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
        part = part_ptr + (row64 * SPLITS + split) * 2
        tl.store(part, part_a)
        tl.store(part + 1, part_b)
        # Arrive: the barrier and the release make this program's partial visible before its count is.
        tl.debug_barrier()
        seen = tl.atomic_add(count_ptr + row, 1, sem="acq_rel") + 1
        polls = 0
        while (seen < SPLITS) & (polls < MAX_POLLS):
            # A compare-and-swap that never matches (counts are >= 0) reads the count as a read-modify-
            # write: sm_90a PTX for an atomic add of 0 came out without the loop at all.
            seen = tl.atomic_cas(count_ptr + row, -1, -1, sem="acquire")
            polls += 1
        parts = part_ptr + (row64 * SPLITS + splits) * 2
        parts_a = tl.load(parts, cache_modifier=".cg")
        parts_b = tl.load(parts + 1, cache_modifier=".cg")
        if IS_RMS:
            mean = 0.0
            rstd = 1.0 / tl.sqrt(tl.sum(parts_a, axis=0) / N + eps)
        else:
            # Chan et al.: M2 = sum_s M2_s + n_s (mean_s - mean)^2, exact for any split of the row.
            mean = tl.sum(parts_a * split_counts, axis=0) / N
            gap = parts_a - mean
            rstd = 1.0 / tl.sqrt(tl.sum(parts_b + split_counts * gap * gap, axis=0) / N + eps)
        rstd = tl.where(seen >= SPLITS, rstd, float("nan"))  # a wait that gave up poisons its row, visibly
        # Depart: the last of the row's 2 * SPLITS counts puts the counter back to zero for the next launch.
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == 2 * SPLITS - 1:
            tl.atomic_xchg(count_ptr + row, 0)
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
    interpret = runtime.execution_path(x2d) == runtime.INTERPRETER
    if interpret and splits != 1:
        raise ValueError("the interpreter runs one program at a time: split rows need splits=1 there")
    chunk = cdiv(N, splits)
    sms = 1 if interpret else runtime.device_facts(x2d.device)[1]
    groups = max(1, min(M, sms * programs_per_sm // splits))
    if groups * splits > sms * programs_per_sm and not interpret:
        raise ValueError(f"{splits} programs per row do not fit a cooperative grid of {sms * programs_per_sm}")
    parts = torch.empty((M, splits, 2), dtype=torch.float32, device=x2d.device)
    counters = tile_counters(x2d.device, M)
    dummy = mean
    extra = {} if interpret else {"launch_cooperative_grid": True}
    norm_fwd_split_kernel[(groups * splits,)](
        x2d, res2d if res2d is not None else dummy, weight if weight is not None else dummy,
        bias if bias is not None else dummy, y2d, h2d if h2d is not None else dummy, mean, rstd, parts, counters,
        M, N, chunk, x2d.stride(0), res2d.stride(0) if res2d is not None else 0, y2d.stride(0),
        h2d.stride(0) if h2d is not None else 0, eps,
        IS_RMS=is_rms, HAS_RESIDUAL=res2d is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        SPLITS=splits, BLOCK_N=next_pow2(chunk), MAX_POLLS=MAX_POLLS, PREFETCH=prefetch, num_warps=num_warps,
        **extra)
    return (groups * splits,)

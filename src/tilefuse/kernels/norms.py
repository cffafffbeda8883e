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

import torch
import triton
import triton.language as tl

from tilefuse import runtime, tuning
from tilefuse.kernels.tiling import cdiv, next_pow2

# Chunk caps. On the GPU a 16K-element chunk keeps <= 32 fp32 values per thread at 16 warps; under the
# interpreter the cap is tiny so that a 300-long test row already takes the chunked path.
GPU_MAX_BLOCK_N = 16384
INTERPRETER_MAX_BLOCK_N = 128
INTERPRETER_TILE_ELEMS = 2048  # rows per interpreter program: big tiles, the interpreter pays per program


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


# ----------------------------------------------------------------------------------------------------
# Launchers: grid and config only.

def _num_sms(device) -> int:
    return runtime.device_facts(device)[1]


def _warps_for(tile_elems: int) -> int:
    # ~16 fp32 values per thread per live tensor, between 4 and 16 warps.
    return max(4, min(16, tile_elems // 512))


# Chunked-row variants (BLOCK_N, warps, PROGRAMS_PER_SM, LOOP_STAGES): the old fixed choice first, then
# pipelined ones; few enough that tuning one shape stays under ~20 s of compiles.
FWD_CHUNKED = [(16384, 8, 1, 1), (16384, 16, 1, 2), (16384, 16, 2, 2), (16384, 8, 2, 2),
               (8192, 8, 2, 3), (8192, 16, 2, 3), (8192, 8, 4, 3), (4096, 8, 4, 3), (4096, 4, 4, 3)]


def _fwd_configs():
    """Single pass (BLOCK_N = next_pow2(N) <= 16384, whole rows in registers) and chunked (two passes,
    the second re-reading the row from L2). Rows of >= 8K elements may take either: the autotuner
    measures. Persistent pipelined variants (PROGRAMS_PER_SM 1-2, LOOP_STAGES > 1) keep more bytes in
    flight per SM: a 16K-element row tile needs ~107 registers at 16 warps, so one block fits per SM
    and its loads stall while it reduces (4096x16384 bf16 ran at 56% of copy in the first H200 run).
    Within each family the first entry is the config used before these variants existed."""
    single = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=1 << i, SINGLE_PASS=True, PROGRAMS_PER_SM=p,
                                 LOOP_STAGES=st), num_warps=w)
              for i in range(15) for bm in (1, 2, 4, 8, 16) for w in (4, 8, 16)
              for p, st in ((64, 1), (1, 3), (2, 2))]
    chunked = [triton.Config(dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, PROGRAMS_PER_SM=p,
                                  LOOP_STAGES=st), num_warps=w)
               for bn, w, p, st in FWD_CHUNKED]
    return single + chunked


def fwd_smem_bytes(cfg: triton.Config, elem_bytes: int, residual: bool, weight: bool, bias: bool) -> int:
    """Upper bound on the pipelining buffers: LOOP_STAGES - 1 copies of every tile loaded inside the
    pipelined loop -- x, the residual, and the weight and bias rows too (loop-invariant in the single
    pass, yet the pipeliner buffers them: 4096x16384 bf16 with a residual and 3 stages compiled to 256 KB
    for sm_90a). The chunked path counts both of its loops."""
    k = cfg.kwargs
    rows = k["BLOCK_M"] * (2 if residual else 1)
    loads = rows + int(weight) + int(bias)
    if not k["SINGLE_PASS"]:
        loads += 1  # pass 2 re-reads x (or h)
    return (k["LOOP_STAGES"] - 1) * k["BLOCK_N"] * elem_bytes * loads


FWD_SMEM_BUDGET = 220 * 1024  # of the 227 KB a block may use; the rest for the reductions' scratch


def _prune_fwd(configs, named_args, **kwargs):
    """Keep a handful per shape: single-pass tiles of 2K-16K elements, warps near the tile's need, the
    persistent pipelined grid only for rows of >= 4K elements; chunked rows (BLOCK_M = 1, persistent
    so that the second pass finds the row in L2) when the row is longer than one chunk."""
    n, m = named_args["N"], named_args["M"]
    x = named_args.get("x_ptr")
    elem = x.element_size() if hasattr(x, "element_size") else 2
    residual, weight, bias = (bool(kwargs.get(f)) for f in ("HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS"))
    full = next_pow2(max(n, 1))
    keep = []
    for c in configs:
        bm, bn, w, p = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["PROGRAMS_PER_SM"]
        tile = bm * bn
        if c.kwargs["SINGLE_PASS"]:
            if bn != full or full > GPU_MAX_BLOCK_N:
                continue
            if tile > 16384 or (tile < 2048 and bm < 16) or bm > max(1, m):
                continue
            if p != 64 and (tile < 8192 or bm != 1):  # pipelined persistent grid: long rows only
                continue
            if w not in (_warps_for(tile), max(4, _warps_for(tile) // 2)):
                continue
        elif bn >= full or full < 8192:
            continue
        if fwd_smem_bytes(c, elem, residual, weight, bias) > FWD_SMEM_BUDGET:
            continue
        keep.append(c)
    if keep:
        return keep
    bn = min(full, GPU_MAX_BLOCK_N)
    return [triton.Config(dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=full <= GPU_MAX_BLOCK_N, PROGRAMS_PER_SM=64
                               if full <= GPU_MAX_BLOCK_N else 2, LOOP_STAGES=1), num_warps=_warps_for(bn))]


norm_fwd_autotuned = tuning.autotune(
    name="norm_fwd",
    configs=_fwd_configs(),
    key=["N", "M_BUCKET", "IS_RMS", "HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS", "STORE_Y"],
    prune_configs_by={"early_config_prune": _prune_fwd},
)(norm_fwd_kernel)


def block_n_for(N: int, interpret: bool) -> int:
    cap = INTERPRETER_MAX_BLOCK_N if interpret else GPU_MAX_BLOCK_N
    return min(next_pow2(max(N, 1)), cap)


def launch_norm_fwd(x2d, res2d, weight, bias, y2d, h2d, mean, rstd, eps, is_rms, store_y, interpret):
    """x2d etc. are [M, N] views with unit column stride. Returns the config used (for the report)."""
    M, N = x2d.shape
    block_n = block_n_for(N, interpret)
    dummy = mean  # never dereferenced when the matching HAS_* flag is False
    args = (x2d, res2d if res2d is not None else dummy, weight if weight is not None else dummy,
            bias if bias is not None else dummy, y2d if y2d is not None else dummy,
            h2d if h2d is not None else dummy, mean, rstd, M, N,
            x2d.stride(0), res2d.stride(0) if res2d is not None else 0,
            y2d.stride(0) if y2d is not None else 0, h2d.stride(0) if h2d is not None else 0,
            float(eps), tuning.m_bucket(M))
    flags = dict(IS_RMS=is_rms, HAS_RESIDUAL=res2d is not None, HAS_WEIGHT=weight is not None,
                 HAS_BIAS=bias is not None, STORE_Y=store_y)
    if interpret:
        block_m = max(1, min(16, INTERPRETER_TILE_ELEMS // block_n))
        grid = (cdiv(M, block_m),)
        norm_fwd_kernel[grid](*args, **flags, SINGLE_PASS=N <= block_n, BLOCK_N=block_n, BLOCK_M=block_m,
                              PROGRAMS_PER_SM=64, LOOP_STAGES=1)
        return dict(BLOCK_M=block_m, BLOCK_N=block_n)
    sms = _num_sms(x2d.device)

    def grid(meta):
        return (min(cdiv(M, meta["BLOCK_M"]), sms * meta["PROGRAMS_PER_SM"]),)

    norm_fwd_autotuned[grid](*args, **flags)
    cfg = norm_fwd_autotuned.best_config
    return dict(BLOCK_M=cfg.kwargs["BLOCK_M"], BLOCK_N=cfg.kwargs["BLOCK_N"], warps=cfg.num_warps,
                progs_per_sm=cfg.kwargs["PROGRAMS_PER_SM"], single_pass=cfg.kwargs["SINGLE_PASS"],
                loop_stages=cfg.kwargs["LOOP_STAGES"])


def launch_norm_bwd(dy2d, h2d, weight, mean, rstd, dh2d, dx2d, is_rms, compute_dw, compute_db, interpret):
    """dx is written into dx2d. Returns the fp32 column sums, [2, N] (dweight, dbias), [1, N] (the one
    asked for) or None: one allocation and one reduction for both, since on a GPU host each torch op
    costs microseconds and a backward row of this size is near its host time."""
    M, N = h2d.shape
    block_n = block_n_for(N, interpret)
    dummy = rstd
    flags = dict(IS_RMS=is_rms, HAS_WEIGHT=weight is not None)
    w_arg = weight if weight is not None else dummy
    mean_arg = mean if mean is not None else dummy
    dev = h2d.device
    if N <= block_n:
        if interpret:
            block_m = max(1, min(16, INTERPRETER_TILE_ELEMS // block_n))
            warps, programs = 4, cdiv(M, block_m)
        else:
            block_m = max(1, min(16, 4096 // block_n))
            warps = _warps_for(block_m * block_n)
            # Enough programs to fill the machine, few enough that the fp32 partial rows (G x N) stay
            # small next to the M x N tensors.
            programs = min(cdiv(M, block_m), _num_sms(dev) * max(1, 32 // warps))
        programs = max(programs, 1)
        parts, dw_part, db_part = _partial_rows(programs, N, compute_dw, compute_db, dev, dummy)
        norm_bwd_kernel[(programs,)](
            dy2d, h2d, w_arg, mean_arg, rstd, dh2d if dh2d is not None else dummy, dx2d, dw_part, db_part,
            M, N, dy2d.stride(0), h2d.stride(0), dh2d.stride(0) if dh2d is not None else 0, dx2d.stride(0),
            **flags, HAS_DH=dh2d is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    else:
        num_chunks = cdiv(N, block_n)
        # GPU: one row per tile, a chunk is already 16K elements. Interpreter: many rows per program.
        block_m = max(1, INTERPRETER_TILE_ELEMS // block_n) if interpret else 1
        warps = 4 if interpret else _warps_for(block_n)
        row_tiles = cdiv(M, block_m)
        if interpret:
            groups = min(row_tiles, 2)
        else:
            groups = min(row_tiles, max(1, cdiv(4 * _num_sms(dev), num_chunks)))
        dots = torch.empty((M, num_chunks, 2), dtype=torch.float32, device=dev)
        parts, dw_part, db_part = _partial_rows(groups, N, compute_dw, compute_db, dev, dummy)
        norm_bwd_chunk_sums_kernel[(groups, num_chunks)](
            dy2d, h2d, w_arg, mean_arg, rstd, dots, dw_part, db_part, M, N, num_chunks,
            dy2d.stride(0), h2d.stride(0), **flags, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        norm_bwd_dx_kernel[(row_tiles, num_chunks)](
            dy2d, h2d, w_arg, mean_arg, rstd, dots, dh2d if dh2d is not None else dummy, dx2d,
            M, N, num_chunks, dy2d.stride(0), h2d.stride(0),
            dh2d.stride(0) if dh2d is not None else 0, dx2d.stride(0),
            **flags, HAS_DH=dh2d is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_C=next_pow2(num_chunks), num_warps=warps)
    # Fixed-order reduction of the per-program partial rows: deterministic run to run.
    return parts.sum(dim=1) if parts is not None else None


def _partial_rows(rows, N, compute_dw, compute_db, dev, dummy):
    """(parts [n, rows, N] fp32 or None, dweight partial rows, dbias partial rows): one allocation; a
    partial not asked for is ``dummy`` (never written)."""
    n = int(compute_dw) + int(compute_db)
    if n == 0:
        return None, dummy, dummy
    parts = torch.empty((n, rows, N), dtype=torch.float32, device=dev)
    if n == 2:
        dw_part, db_part = parts.unbind(0)
        return parts, dw_part, db_part
    one = parts.view(rows, N)
    return parts, (one if compute_dw else dummy), (one if compute_db else dummy)

"""FP8 (e4m3) GEMM ``y = act((x_q @ w_q^T) * sx[:, None] * sw[None, :] + b)`` and the row quantizer that makes x_q.

Fuses: the per-row (x) and per-output-channel (W) dequantization, bias and activation into the GEMM's epilogue on
the fp32 accumulator; for a 16/32-bit x, its quantization into one pre-pass.
HBM bytes (x in s-byte elements, y in t-byte ones): the GEMM reads M*K + N*K + 4*M + 4*N (+ the bias) and writes
t*M*N; the pre-pass reads s*M*K and writes M*K + 4*M (its second sweep of a row re-reads it from L2). A scaled
GEMM followed by eager bias and activation moves 4*t*M*N more (each reads and writes y).
Tiling (TMA kernel, Hopper): persistent programs walk output tiles in grouped order, as tma.py; x [M, K] and
w [N, K], both K-major (FP8 wgmma takes no other layout), arrive through descriptors in BLOCK_K = 128 steps (one
128-byte swizzle row of e4m3); the epilogue applies the scales, bias and activation, optionally on one N-half at
a time (EPILOGUE_SUBTILE), and stores through a descriptor. Accumulation: fp32 promotion every BLOCK_K step, or
Hopper's fast FP8 accumulation over the whole K loop (FAST_ACCUM; kernels/gemm/launch/ decides). The pointer
kernel: masked tiles, any M, N, K and strides. The quantizer: BLOCK_M rows per program, K in BLOCK_K chunks, an
amax sweep then a scale-and-cast sweep (one sweep when a chunk holds the row).
Limits: the TMA kernel needs K % 16 == 0, y's rows a multiple of 16 bytes and 16-byte-aligned bases (the launch
layer takes the pointer kernel otherwise); FP8 tensor cores need sm_89+.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse import constants
from tilefuse.kernels import cache_keys
from tilefuse.kernels.activations import apply_activation
from tilefuse.kernels.tiling import column_halves, grouped_tile

# Globals read inside @triton.jit must be tl.constexpr. The values are reference/fp8_linear.py's, whose
# emulation the tests compare bit for bit.
FP8_MAX = tl.constexpr(constants.E4M3_MAX)
MIN_AMAX = tl.constexpr(constants.E4M3_MAX * 2.0 ** -126)
_INF = tl.constexpr(float("inf"))  # (no NaN constant: NaN != NaN fails triton's check of a global's value)


@triton.jit
def _magnitude(x):
    """|x| with NaN as inf: a row holding NaN gets a NaN scale whichever way the max treats NaN."""
    return tl.where(x == x, tl.abs(x), _INF)


@triton.jit
def _row_scales(amax):
    """(scale, reciprocal) of each row's amax: amax / 448 and 448 / amax, each rounded once (div_rn, as the torch
    emulation divides); 1.0 for an all-zero row, NaN for a row with NaN or inf."""
    safe = tl.where(amax == 0.0, FP8_MAX, tl.maximum(amax, MIN_AMAX))
    scale = tl.where(safe == _INF, safe - safe, tl.div_rn(safe, FP8_MAX))  # inf - inf: NaN
    return scale, tl.div_rn(FP8_MAX, safe)


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K,
    M_INNER,  # x row m lives at (m // M_INNER) * stride_xo + (m % M_INNER) * stride_xm
    stride_xo, stride_xm, stride_xk,
    stride_qm,
    ONE_CHUNK: tl.constexpr,  # K <= BLOCK_K: the row stays in registers between the amax and the cast
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """q[m, :] = e4m3(x[m, :] * 448 / amax_m), s[m] = amax_m / 448 for BLOCK_M rows of x (any strides); q
    contiguous rows of stride_qm, s fp32 [M]."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_m64 = offs_m.to(tl.int64)
    x_rows = x_ptr + (offs_m64 // M_INNER) * stride_xo + (offs_m64 % M_INNER) * stride_xm
    q_rows = q_ptr + offs_m64 * stride_qm
    offs_k = tl.arange(0, BLOCK_K)
    if ONE_CHUNK:
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_rows[:, None] + offs_k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        scale, inv = _row_scales(tl.max(_magnitude(x), 1))
        tl.store(q_rows[:, None] + offs_k[None, :], (x * inv[:, None]).to(tl.float8e4nv), mask=mask)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = mask_m[:, None] & ((k0 + offs_k) < K)[None, :]
            x = tl.load(x_rows[:, None] + (k0 + offs_k)[None, :] * stride_xk, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(_magnitude(x.to(tl.float32)), 1))
        scale, inv = _row_scales(amax)
        # The second sweep reads the rows again: BLOCK_M rows of K were just read, so they come from L2.
        for k0 in range(0, K, BLOCK_K):
            mask = mask_m[:, None] & ((k0 + offs_k) < K)[None, :]
            x = tl.load(x_rows[:, None] + (k0 + offs_k)[None, :] * stride_xk, mask=mask, other=0.0)
            q = (x.to(tl.float32) * inv[:, None]).to(tl.float8e4nv)
            tl.store(q_rows[:, None] + (k0 + offs_k)[None, :], q, mask=mask)
    tl.store(s_ptr + offs_m, scale, mask=mask_m)


@triton.jit
def _accumulate(a, b, acc, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a @ b for e4m3 tiles. Hopper's FP8 tensor cores add products at reduced precision (fewer mantissa
    bits than fp32); tl.dot's default there keeps the whole K loop in that accumulator (FAST_ACCUM). Otherwise each
    BLOCK_K step accumulates in a zeroed partial accumulator that is then added to acc in fp32 (CUTLASS's
    promotion; cuBLASLt without fast accumulation): one more accumulator of registers. Other GPUs and the
    interpreter accumulate in fp32 either way."""
    if FAST_ACCUM:
        return tl.dot(a, b, acc)
    return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def _dequantize_epilogue(acc, sx, sw_ptr, b_ptr, off_n, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                         WIDTH: tl.constexpr):
    """act(acc * sx[:, None] * sw[None, :] + b) on a [rows, WIDTH] slice of the accumulator whose first column is
    output column off_n; sx: the rows' scales."""
    offs_n = off_n + tl.arange(0, WIDTH)
    mask_n = offs_n < N
    sw = tl.load(sw_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return apply_activation(y, ACTIVATION)


@triton.jit
def linear_fp8_tma_kernel(
    x_ptr, w_ptr,    # e4m3 x [M, K] and w [N, K], unit inner strides
    sx_ptr, sw_ptr,  # fp32 scales: x's rows [M], w's rows (the output channels) [N]
    b_ptr, y_ptr,    # bias [N] (any float dtype; any valid pointer without HAS_BIAS), y [M, N]
    M, N, K,
    M_BUCKET,  # autotune key only
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FAST_ACCUM: tl.constexpr,  # see _accumulate
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
):
    out_dtype = y_ptr.dtype.element_ty
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    Y_WIDTH: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1], block_shape=[BLOCK_M, Y_WIDTH])

    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            # Both tiles K-major, w's as the transposed view: the layout FP8 wgmma reads from shared memory.
            # TMA zero-fills past K, so a ragged last step adds nothing.
            acc = _accumulate(x_desc.load([off_m, off_k]), w_desc.load([off_n, off_k]).T, acc, FAST_ACCUM, BLOCK_K)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        sx = tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)
        if EPILOGUE_SUBTILE:
            acc_lo, acc_hi = column_halves(acc, BLOCK_M, BLOCK_N // 2)
            y_lo = _dequantize_epilogue(acc_lo, sx, sw_ptr, b_ptr, off_n, N, HAS_BIAS, ACTIVATION, BLOCK_N // 2)
            y_desc.store([off_m, off_n], y_lo.to(out_dtype))
            y_hi = _dequantize_epilogue(acc_hi, sx, sw_ptr, b_ptr, off_n + BLOCK_N // 2, N, HAS_BIAS, ACTIVATION,
                                        BLOCK_N // 2)
            y_desc.store([off_m, off_n + BLOCK_N // 2], y_hi.to(out_dtype))
        else:
            y = _dequantize_epilogue(acc, sx, sw_ptr, b_ptr, off_n, N, HAS_BIAS, ACTIVATION, BLOCK_N)
            y_desc.store([off_m, off_n], y.to(out_dtype))


@triton.jit
def linear_fp8_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, b_ptr, y_ptr,  # as linear_fp8_tma_kernel's, with any strides
    M, N, K,
    M_BUCKET,  # autotune key only
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_m64 = offs_m.to(tl.int64)  # M * stride can pass 2**31 elements
    x_ptrs = x_ptr + offs_m64[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        # w's rows as loaded, transposed in the dot: K-major operands.
        acc = _accumulate(x_tile, w_tile.T, acc, FAST_ACCUM, BLOCK_K)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    sx = tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)
    y = _dequantize_epilogue(acc, sx, sw_ptr, b_ptr, pid_n * BLOCK_N, N, HAS_BIAS, ACTIVATION, BLOCK_N)
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


cache_keys.settle(globals())

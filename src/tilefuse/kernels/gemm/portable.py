"""Tiled GEMM ``y = act(x @ w^T + b)`` with bias and activation applied to the fp32 accumulator.

Gated form (GATED): ``y = act(x @ w^T + b) * (x @ wu^T + bu)`` -- the gate and up GEMMs share every x
tile and keep two accumulators, so neither [M, N] product reaches HBM: (M*K + 2*N*K + M*N)*s instead of
eager's (M*K + 2*N*K + 7*M*N)*s (two GEMM outputs, act reads/writes, the product reads two, writes one).

Fuses: GEMM + bias add + activation into one kernel and one store.
HBM bytes (element size s): unfused eager = GEMM (M*K + N*K + M*N)*s, then bias+act reads and writes
M*N twice more (``F.linear`` folds the bias, ``F.gelu`` reads y, writes y): (M*K + N*K + 3*M*N)*s.
Fused: (M*K + N*K + M*N)*s (+ N*s for the bias) -- the pre-activation never leaves registers.
Tiling: BLOCK_M x BLOCK_N output tile per program, K walked in BLOCK_K steps, grouped tile order so
GROUP_M row-tiles share the same weight columns while they sit in L2. Every edge is masked: any M, N,
K >= 0 and any strides (x's rows may sit at two strides, for a 3-D input that does not flatten).
This is the portable path (Ampere, Hopper, the interpreter); kernels/gemm/launch/ decides when it runs.
Split-K (small M): K slices run as separate programs that store fp32 partials; the last program of a
tile to arrive sums them and runs the epilogue, so decode shapes take one launch, not a GEMM and a
reduction kernel (extra traffic 2 * SPLIT_K * M * N * 4 bytes, small for small M).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import activation_slope, apply_activation, apply_gated, gated_slopes
from tilefuse.kernels.tiling import grouped_tile


@triton.jit
def linear_epilogue_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    wu_ptr, bu_ptr,  # gated only: the "up" weight [N, K] and bias (any valid pointer otherwise)
    ws_ptr,  # split-K only: fp32 partial sums [SPLIT_K, M, N] (then the up partials, if GATED)
    counter_ptr,  # split-K only: int32 per output tile, 0 between launches (see the end of the kernel)
    s_ptr, su_ptr,  # SAVE_SLOPE only: act'(pre) [M, N] (gated: the two branches' slopes), y's strides
    M, N, K,
    M_BUCKET,  # autotune key only: next power of two of M
    K_SPLIT_LEN,  # K elements per split (a multiple of BLOCK_K); K when SPLIT_K == 1
    M_INNER,  # x row m lives at (m // M_INNER) * stride_xo + (m % M_INNER) * stride_xm
    stride_xo, stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_wun, stride_wuk,
    stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    SAVE_SLOPE: tl.constexpr,       # training: also store the activation's slope(s) for the backward
    SPLIT_K: tl.constexpr,          # > 1: program_id(1) sums one K slice and stores fp32 partials
    INPUT_PRECISION: tl.constexpr,  # "ieee" | "tf32" (fp32 only; ignored for 16-bit operands)
    UPCAST_DOT: tl.constexpr,       # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Split-K (small M): this program covers K in [k_begin, k_end); the partials meet in a second kernel.
    k_begin = tl.program_id(1) * K_SPLIT_LEN
    k_end = tl.minimum(K, k_begin + K_SPLIT_LEN)
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # 64-bit row offsets: M * stride can pass 2**31 elements on large activations.
    offs_m64 = offs_m.to(tl.int64)
    row_off = (offs_m64 // M_INNER) * stride_xo + (offs_m64 % M_INNER) * stride_xm
    x_ptrs = x_ptr + row_off[:, None] + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wu_ptr + offs_n.to(tl.int64)[None, :] * stride_wun + offs_k[:, None] * stride_wuk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # unused (and removed) unless GATED
    for k0 in range(0, k_end - k_begin, BLOCK_K):
        mask_k = (k0 + offs_k) < k_end
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST_DOT:
            x_tile = x_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        acc = tl.dot(x_tile, w_tile, acc, input_precision=INPUT_PRECISION)
        if GATED:
            wu_tile = tl.load(wu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST_DOT:
                wu_tile = wu_tile.to(tl.float32)
            acc_up = tl.dot(x_tile, wu_tile, acc_up, input_precision=INPUT_PRECISION)
            wu_ptrs += BLOCK_K * stride_wuk
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if SPLIT_K > 1:
        # Each K slice stores its fp32 partial; the last of the tile's SPLIT_K programs to arrive sums
        # them in slice order (deterministic) and runs the epilogue. One launch instead of a GEMM and a
        # reduction kernel. The barrier and the acq_rel counter make every thread's partial visible
        # before the count is seen (a semaphore as CUTLASS's serial split-K); the reads bypass L1.
        tile_mask = mask_m[:, None] & mask_n[None, :]
        ws_offs = offs_m64[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + tl.program_id(1) * M * N + ws_offs, acc, mask=tile_mask)
        if GATED:
            tl.store(ws_ptr + (SPLIT_K + tl.program_id(1)) * M * N + ws_offs, acc_up, mask=tile_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tl.program_id(0), 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(ws_ptr + s * M * N + ws_offs, mask=tile_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(ws_ptr + (SPLIT_K + s) * M * N + ws_offs, mask=tile_mask, other=0.0,
                                      cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + tl.program_id(0), 0)  # ready for the next launch
            _bias_activation_store(acc, acc_up, b_ptr, bu_ptr, y_ptr, s_ptr, su_ptr, offs_m64, offs_n, mask_m,
                                   mask_n, stride_ym, stride_yn, HAS_BIAS, ACTIVATION, GATED, SAVE_SLOPE)
    else:
        _bias_activation_store(acc, acc_up, b_ptr, bu_ptr, y_ptr, s_ptr, su_ptr, offs_m64, offs_n, mask_m,
                               mask_n, stride_ym, stride_yn, HAS_BIAS, ACTIVATION, GATED, SAVE_SLOPE)


@triton.jit
def _bias_activation_store(acc, acc_up, b_ptr, bu_ptr, y_ptr, s_ptr, su_ptr, offs_m64, offs_n, mask_m, mask_n,
                           stride_ym, stride_yn, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                           GATED: tl.constexpr, SAVE_SLOPE: tl.constexpr):
    """The epilogue on the fp32 accumulator(s): nothing touches HBM but the bias vectors and the store
    (and, training, the activation's slope the backward multiplies dy by: as many elements as the
    pre-activation eager saves; kernels/gemm/backward.py says why the slope)."""
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
        if GATED:
            acc_up = acc_up + tl.load(bu_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_offs = offs_m64[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    if SAVE_SLOPE:
        # The pre-activation rounded to y's dtype, as eager's saved tensor is: y and the slope both
        # come from the same rounded value.
        acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        if GATED:
            acc_up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            s_gate, s_up = gated_slopes(acc, acc_up, ACTIVATION)
            tl.store(s_ptr + y_offs, s_gate.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(su_ptr + y_offs, s_up.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(s_ptr + y_offs, activation_slope(acc, ACTIVATION).to(y_ptr.dtype.element_ty), mask=mask)
    if GATED:
        acc = apply_gated(acc, acc_up, ACTIVATION)
    else:
        acc = apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

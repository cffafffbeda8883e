"""``y = act(norm(x) @ W^T + b)``: LayerNorm/RMSNorm as the prologue of a tiled GEMM.

Fuses: normalization + GEMM + bias + activation. HBM bytes, element size s: unfused = norm (2*M*K*s)
+ GEMM (M*K + N*K + M*N)*s; fused = stats pre-pass (M*K*s read + 8*M written) + GEMM
(M*K + N*K + M*N)*s + 8*M: the normalized activations never reach HBM.
Tiling: BLOCK_M x BLOCK_N output tile per program, K walked in BLOCK_K steps; each x tile is normalized
in registers ((x - mean) * rstd * gamma + beta, gamma/beta loaded for the K slice), cast back to the
operand dtype, then fed to tl.dot. Grouped tile order as in portable.py. Any M, N, K; x rows at
any stride with a unit column stride.

On Hopper with 16-bit operands (TMA-able layouts) the normalization moves past the GEMM instead
(tma.py, NORM): ``weight_fold_kernel`` below makes W' = W * gamma, s = sum_k W' and c = b + W @ beta
once per call (2*N*K*s + 8*N bytes: W read, W' written; N*K*s when gamma is None), the same statistics
pre-pass writes mean and rstd, and the TMA GEMM runs its plain main loop on raw x, with
``rstd * (acc - mean * s) + c`` in its epilogue. Fused bytes there: (2*M*K + N*K + M*N)*s + the fold +
16*M, against unfused's (3*M*K + N*K + M*N)*s. The statistics come from a pre-pass rather than from the GEMM's
own x tiles so that its main loop stays linear's (any math on the x tile there stalls the wgmma issue); the
register prologue above runs at about half the linear kernel's rate on the H200 (benchmarks/NOTES.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import activation_slope, apply_activation
from tilefuse.kernels.tiling import grouped_tile


@triton.jit
def norm_linear_kernel(
    x_ptr, mean_ptr, rstd_ptr, g_ptr, beta_ptr, w_ptr, b_ptr, y_ptr,
    s_ptr,  # SAVE_SLOPE only: act'(pre) [M, N], y's layout
    M, N, K,
    M_BUCKET,  # autotune key only
    stride_xm, stride_wn, stride_wk, stride_ym,
    IS_RMS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SAVE_SLOPE: tl.constexpr,  # training: also store the activation's slope for the backward
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_m64 = offs_m.to(tl.int64)

    # Row statistics from the pre-pass: 8 bytes per row, loaded once per tile.
    rstd = tl.load(rstd_ptr + offs_m, mask=mask_m, other=0.0)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    if not IS_RMS:
        mean = tl.load(mean_ptr + offs_m, mask=mask_m, other=0.0)

    x_ptrs = x_ptr + offs_m64[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        # Prologue: normalize in fp32, then back to the operand dtype (what the unfused GEMM would read).
        xn = (x_tile.to(tl.float32) - mean[:, None]) * rstd[:, None]
        if HAS_GAMMA:
            xn = xn * tl.load(g_ptr + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        if HAS_BETA:
            xn = xn + tl.load(beta_ptr + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        xn = tl.where(mask_k[None, :], xn, 0.0)  # padded K lanes must add nothing (beta would)
        if UPCAST_DOT:
            acc = tl.dot(xn.to(x_ptr.dtype.element_ty).to(tl.float32), w_tile.to(tl.float32), acc,
                         input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(xn.to(x_ptr.dtype.element_ty), w_tile, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_offs = offs_m64[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SAVE_SLOPE:  # of the pre-activation rounded as eager saves it; y from the same rounded value
        acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(s_ptr + y_offs, activation_slope(acc, ACTIVATION).to(y_ptr.dtype.element_ty), mask=mask)
    acc = apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def weight_fold_kernel(
    w_ptr, g_ptr, beta_ptr, b_ptr, wf_ptr, colsum_ptr, shift_ptr,
    N, K, stride_wn, stride_wfn,
    HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_COLSUM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """BLOCK_N rows of W per program: W' = W * gamma (written only with gamma), colsum = sum_k W' in fp32
    (of the rounded W' the GEMM reads, so mean * colsum cancels exactly what x @ W'^T holds), and
    shift = b + sum_k W * beta in fp32."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    rows_wf = wf_ptr + offs_n.to(tl.int64)[:, None] * stride_wfn
    colsum = tl.zeros((BLOCK_N,), tl.float32)
    shift = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        mask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(rows_w + ks[None, :], mask=mask, other=0.0)
        wf = w
        if HAS_GAMMA:
            g = tl.load(g_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
            wf = (w.to(tl.float32) * g[None, :]).to(wf_ptr.dtype.element_ty)
            tl.store(rows_wf + ks[None, :], wf, mask=mask)
        if NEED_COLSUM:
            colsum += tl.sum(wf.to(tl.float32), axis=1)
        if HAS_BETA:
            beta = tl.load(beta_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
            shift += tl.sum(w.to(tl.float32) * beta[None, :], axis=1)
    if HAS_BIAS:
        shift += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if NEED_COLSUM:
        tl.store(colsum_ptr + offs_n, colsum, mask=mask_n)
    if HAS_BETA or HAS_BIAS:
        tl.store(shift_ptr + offs_n, shift, mask=mask_n)

"""Tiled GEMM ``y = act(x @ w^T + b)`` with bias and activation applied to the fp32 accumulator.

Fuses: GEMM + bias add + activation into one kernel and one store.
HBM bytes (element size s): unfused eager = GEMM (M*K + N*K + M*N)*s, then bias+act reads and writes
M*N twice more (``F.linear`` folds the bias, ``F.gelu`` reads y, writes y): (M*K + N*K + 3*M*N)*s.
Fused: (M*K + N*K + M*N)*s (+ N*s for the bias) -- the pre-activation never leaves registers.
Tiling: BLOCK_M x BLOCK_N output tile per program, K walked in BLOCK_K steps, grouped tile order so
GROUP_M row-tiles share the same weight columns while they sit in L2. Every edge is masked: any M, N,
K >= 0 and any strides (x's rows may sit at two strides, for a 3-D input that does not flatten).
This is the portable path (Ampere, Hopper, the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilefuse import tuning
from tilefuse.kernels.activations import apply_activation


@triton.jit
def linear_epilogue_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    M_BUCKET,  # autotune key only: next power of two of M
    M_INNER,  # x row m lives at (m // M_INNER) * stride_xo + (m % M_INNER) * stride_xm
    stride_xo, stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" | "tf32" (fp32 only; ignored for 16-bit operands)
    UPCAST_DOT: tl.constexpr,       # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: walk GROUP_M tiles down a column of tiles before moving right, so a weight tile
    # fetched from HBM is reused from L2 by GROUP_M programs.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    group_id = pid // pids_per_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % pids_per_group) % group_size_m)
    pid_n = (pid % pids_per_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # 64-bit row offsets: M * stride can pass 2**31 elements on large activations.
    offs_m64 = offs_m.to(tl.int64)
    row_off = (offs_m64 // M_INNER) * stride_xo + (offs_m64 % M_INNER) * stride_xm
    x_ptrs = x_ptr + row_off[:, None] + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST_DOT:
            x_tile = x_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        acc = tl.dot(x_tile, w_tile, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # Epilogue on the fp32 accumulator: nothing below touches HBM except the bias vector and the store.
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    acc = apply_activation(acc, ACTIVATION)

    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# GPU path: the same kernel behind a small autotune space, keyed on the row-count bucket rather than M
# itself so that a new batch size reuses the tuned tile.
linear_epilogue_autotuned = tuning.autotune(
    configs=tuning.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "INPUT_PRECISION"],
)(linear_epilogue_kernel)


def launch_linear(x, m_inner, stride_xo, stride_xm, stride_xk, w, b, y, M, N, K,
                  activation, input_precision, interpret):
    """Launch on 2-D-addressable operands; returns the config used (a dict or triton.Config)."""
    common = dict(
        HAS_BIAS=b is not None,
        ACTIVATION=activation or "none",
        INPUT_PRECISION=input_precision,
    )
    args = (x, w, b if b is not None else y, y, M, N, K, tuning.m_bucket(M), m_inner,
            stride_xo, stride_xm, stride_xk, w.stride(0), w.stride(1), y.stride(0), y.stride(1))
    if interpret:
        cfg = tuning.INTERPRETER_GEMM
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        upcast = x.dtype == torch.bfloat16
        linear_epilogue_kernel[grid](*args, **common, UPCAST_DOT=upcast, **cfg)
        return cfg

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    linear_epilogue_autotuned[grid](*args, **common, UPCAST_DOT=False)
    return linear_epilogue_autotuned.best_config

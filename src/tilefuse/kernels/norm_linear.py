"""``y = act(norm(x) @ W^T + b)``: LayerNorm/RMSNorm as the prologue of a tiled GEMM.

Fuses: normalization + GEMM + bias + activation. HBM bytes, element size s: unfused = norm (2*M*K*s)
+ GEMM (M*K + N*K + M*N)*s; fused = stats pre-pass (M*K*s read + 8*M written) + GEMM
(M*K + N*K + M*N)*s + 8*M: the normalized activations never reach HBM.
Tiling: BLOCK_M x BLOCK_N output tile per program, K walked in BLOCK_K steps; each x tile is normalized
in registers ((x - mean) * rstd * gamma + beta, gamma/beta loaded for the K slice), cast back to the
operand dtype, then fed to tl.dot. Grouped tile order as in gemm_epilogue.py. Any M, N, K; x rows at
any stride with a unit column stride.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilefuse import tuning
from tilefuse.kernels.tiling import cdiv, grouped_tile
from tilefuse.kernels.activations import apply_activation
from tilefuse.kernels.gemm_epilogue import prune_portable_configs


@triton.jit
def norm_linear_kernel(
    x_ptr, mean_ptr, rstd_ptr, g_ptr, beta_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    M_BUCKET,  # autotune key only
    stride_xm, stride_wn, stride_wk, stride_ym,
    IS_RMS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
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
    acc = apply_activation(acc, ACTIVATION)
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _prune(configs, named_args, **kwargs):
    """The portable GEMM's rules plus one x tile: the normalized x tile goes through shared memory on its
    way to tl.dot (fp32 128x128x64, 4 stages: 230,912 B compiled for sm_90a against 196,608 modeled)."""
    return prune_portable_configs(configs, named_args,
                                  extra_smem=lambda c, elem: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_K"] * elem,
                                  **kwargs)


norm_linear_autotuned = tuning.autotune(
    name="norm_linear",
    configs=tuning.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "IS_RMS", "HAS_GAMMA", "HAS_BETA", "HAS_BIAS", "ACTIVATION",
         "INPUT_PRECISION"],
    # The portable GEMM's shared-memory and fp32-FMA rules apply to this main loop as well.
    prune_configs_by={"early_config_prune": _prune},
)(norm_linear_kernel)


def launch_norm_linear(x2d, mean, rstd, gamma, beta, w, b, y2d, is_rms, activation, input_precision,
                       interpret):
    """x2d [M, K] (unit column stride), y2d [M, N] contiguous. Returns the config used."""
    M, K = x2d.shape
    N = w.shape[0]
    args = (x2d, mean, rstd, gamma if gamma is not None else mean, beta if beta is not None else mean,
            w, b if b is not None else mean, y2d, M, N, K, tuning.m_bucket(M),
            x2d.stride(0), w.stride(0), w.stride(1), y2d.stride(0))
    flags = dict(IS_RMS=is_rms, HAS_GAMMA=gamma is not None,
                 HAS_BETA=beta is not None, HAS_BIAS=b is not None, ACTIVATION=activation or "none",
                 INPUT_PRECISION=input_precision)
    if interpret:
        cfg = tuning.INTERPRETER_GEMM
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
        norm_linear_kernel[grid](*args, **flags, UPCAST_DOT=x2d.dtype == torch.bfloat16, **cfg)
        return cfg

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    norm_linear_autotuned[grid](*args, **flags, UPCAST_DOT=False)
    return norm_linear_autotuned.best_config

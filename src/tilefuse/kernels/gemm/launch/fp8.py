"""FP8 (e4m3) Linear: a 16/32-bit x quantized per row first (the row quantizer, also what quantizes a weight per
output channel); then on Hopper with TMA-able operands the persistent FP8 TMA kernel, else the masked pointer
kernel (Ada, odd shapes, the interpreter). Scales, bias and activation in the epilogue; inference only."""
from __future__ import annotations

import math

import torch

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches, switches
from tilefuse.kernels.gemm import configs
from tilefuse.kernels.gemm.fp8 import linear_fp8_kernel, linear_fp8_tma_kernel, quantize_rows_kernel
from tilefuse.kernels.gemm.launch.rules import (fp8_tma_operands, launch_persistent_tma, persistent_grid,
                                                row_addressing)
from tilefuse.kernels.tiling import ensure_descriptor_allocator
from tilefuse.sizes import cdiv

# FP8: the TMA kernel keyed as linear_tma (y's dtype joins the key with every argument's); the pointer kernel
# likewise, for the shapes and GPUs TMA does not take. FAST_ACCUM changes which tiles fit (configs.py).
linear_fp8_tma_tuned = tuning.autotune(
    name="linear_fp8_tma",
    configs=[configs.fp8_tma_config(**c) for c in configs.FP8_TMA_GEMM_CONFIGS],
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "FAST_ACCUM"],
    prune_configs_by={"early_config_prune": configs.prune_fp8_tma_configs},
)(linear_fp8_tma_kernel)


linear_fp8_portable_tuned = tuning.autotune(
    name="linear_fp8_portable",
    configs=configs.FP8_PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "FAST_ACCUM"],
    prune_configs_by={"early_config_prune": configs.prune_fp8_portable_configs},
)(linear_fp8_kernel)


_LINEAR_FP8 = fastpath.Plans("linear_fp8")
_QUANTIZE_ROWS = fastpath.Plans("quantize_rows")


def quantize_rows(x: torch.Tensor, path: str):
    """(q, scale) of x [..., K] (16/32-bit, any strides, non-empty): q e4m3 [M, K] contiguous and scale fp32 [M]
    for the M rows of x, each row q = e4m3(x * 448 / amax), scale = amax / 448 (fp8.py's row quantizer)."""
    return _QUANTIZE_ROWS.run((x,), (), lambda: _quantize_rows(x, path))


def _quantize_rows(x, path):
    K = x.shape[-1]
    M = math.prod(x.shape[:-1])
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    x_rows, m_inner, s_outer, s_inner, s_k = row_addressing(x)
    tile = configs.quantize_rows_tile(K, interpret=path == runtime.INTERPRETER)
    fastpath.launch(quantize_rows_kernel, (cdiv(M, tile["BLOCK_M"]),), (
        x_rows, q, scale, M, K, m_inner, s_outer, s_inner, s_k, q.stride(0)), dict(tile))
    launches.record("quantize_rows", path, "rows", lambda: f"{tile['BLOCK_M']} rows x {tile['BLOCK_K']}"
                    + ("" if tile["ONE_CHUNK"] else " chunks, two sweeps"))
    return q, scale


def linear_fp8(x, x_scale, w_q, w_scale, bias, activation, out_dtype, path):
    """``act((x_q @ w_q^T) * sx[:, None] * w_scale[None, :] + bias)`` as y [..., N] contiguous in ``out_dtype``. x:
    e4m3 [..., K] with ``x_scale`` fp32 [...] contiguous, or 16/32-bit [..., K] (any strides) with ``x_scale`` None,
    then quantized here per row (its e4m3 rows and scales are returned beside y inside the fast path's plan, which
    thus allocates them too). w_q e4m3 [N, K], w_scale fp32 [N], bias [N] dense or None. Inputs checked and
    non-empty (tilefuse.ops.fp8_linear)."""
    fast_accum = switches.gemm.FP8_FAST_ACCUM
    out = _LINEAR_FP8.run((x, x_scale, w_q, w_scale, bias), (activation, out_dtype, fast_accum),
                          lambda: _linear_fp8(x, x_scale, w_q, w_scale, bias, activation, out_dtype, fast_accum, path))
    return out[0]


def _linear_fp8(x, x_scale, w_q, w_scale, bias, activation, out_dtype, fast_accum, path):
    N, K = w_q.shape
    M = math.prod(x.shape[:-1])
    temporaries = ()
    if x_scale is None:
        x2d, sx = _quantize_rows(x, path)
        temporaries = (x2d, sx)
    else:
        x2d, sx = x.reshape(M, K), x_scale.reshape(M)
    y = torch.empty((*x.shape[:-1], N), dtype=out_dtype, device=x.device)
    y2d = y.view(M, N)
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=activation or "none", FAST_ACCUM=fast_accum)
    b = bias if bias is not None else sx  # any valid pointer: never read without HAS_BIAS
    if fp8_tma_operands(x2d, w_q, y2d):
        cfg = launch_fp8_tma(x2d, w_q, sx, w_scale, b, y2d, flags, path)
        kernel = "tma"
    else:
        cfg = _launch_fp8_portable(x2d, w_q, sx, w_scale, b, y2d, flags, path)
        kernel = "portable"
    launches.record("linear_fp8", path, kernel, lambda: tuning.describe(cfg))
    return (y, *temporaries)


def launch_fp8_tma(x2d, w, sx, sw, b, y2d, flags: dict, path: str, config: dict | None = None):
    """The persistent FP8 TMA kernel into y2d; returns the config used. ``config`` (an FP8_TMA_GEMM_CONFIGS
    entry) pins one; None autotunes on the GPU and takes FP8_INTERPRETER_TMA in the interpreter."""
    ensure_descriptor_allocator()
    M, K = x2d.shape
    N = w.shape[0]
    num_sms = runtime.device_facts(x2d.device)[1]
    args = (x2d, w, sx, sw, b, y2d, M, N, K, sizes.m_bucket(M), x2d.stride(0), w.stride(0), y2d.stride(0))
    common = dict(flags, NUM_SMS=num_sms)

    if config is None and path == runtime.INTERPRETER:
        config = configs.FP8_INTERPRETER_TMA
    cfg = configs.fp8_tma_config(**config) if config is not None else None
    return launch_persistent_tma(linear_fp8_tma_kernel, linear_fp8_tma_tuned, cfg, persistent_grid(M, N, num_sms),
                                 args, common)


def _launch_fp8_portable(x2d, w, sx, sw, b, y2d, flags: dict, path: str):
    """The masked FP8 pointer kernel (any strides) into y2d; returns the config used."""
    M, K = x2d.shape
    N = w.shape[0]
    args = (x2d, w, sx, sw, b, y2d, M, N, K, sizes.m_bucket(M), x2d.stride(0), x2d.stride(1), w.stride(0),
            w.stride(1), y2d.stride(0), y2d.stride(1))

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    if path == runtime.INTERPRETER:
        cfg = configs.FP8_INTERPRETER_GEMM
        fastpath.launch(linear_fp8_kernel, grid(cfg), args, dict(flags, **cfg))
        return cfg
    fastpath.launch(linear_fp8_portable_tuned, grid, args, flags)
    return linear_fp8_portable_tuned.launched_config()

"""layer_norm_linear, ``act(norm(x) @ W^T + b)``: on Hopper the TMA GEMM on raw x with gamma folded into a copy
of W and the rows' statistics (the norms family's pre-pass) applied in its epilogue; elsewhere the statistics
pre-pass and the normalization in the GEMM's prologue (norm_prologue.py); or its vendor candidate (the norm, then
linear's cuBLAS composition)."""
from __future__ import annotations

import torch

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches
from tilefuse.kernels.gemm import configs
from tilefuse.kernels.gemm.launch.forward import launch_tma, linear_vendor
from tilefuse.kernels.gemm.launch.rules import CUBLAS, tma_supported, training_field
from tilefuse.kernels.gemm.norm_prologue import norm_linear_kernel, weight_fold_kernel
from tilefuse.kernels.norms.launch import forward as norm_forward
from tilefuse.kernels.norms.launch import norm_statistics
from tilefuse.runtime import precision_for
from tilefuse.sizes import cdiv

norm_linear_tuned = tuning.autotune(
    name="norm_linear",
    configs=configs.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "IS_RMS", "HAS_GAMMA", "HAS_BETA", "HAS_BIAS", "ACTIVATION",
         "INPUT_PRECISION", "SAVE_SLOPE"],
    # The portable GEMM's shared-memory and fp32-FMA rules apply to this main loop as well.
    prune_configs_by={"early_config_prune": configs.prune_norm_linear_configs},
)(norm_linear_kernel)


_NORM_LINEAR = fastpath.Plans("layer_norm_linear")


def layer_norm_linear(x2d, norm_weight, norm_bias, weight, bias, eps, is_rms, activation, path, save_slope=False):
    """``act(norm(x) @ weight^T + bias)`` for rows x2d [M, K] (unit column stride, M, K > 0); norm
    parameters [K] dense or None. Returns y [M, N] contiguous, and with ``save_slope`` (y, act'(pre))."""
    precision = precision_for(x2d.dtype, x2d.is_cuda)
    mode = runtime.backend()
    out = _NORM_LINEAR.run((x2d, norm_weight, norm_bias, weight, bias),
                           (eps, is_rms, activation, precision, save_slope, mode),
                           lambda: _layer_norm_linear_chosen(x2d, norm_weight, norm_bias, weight, bias, eps, is_rms,
                                                             activation, precision, path, save_slope, mode))
    return out[:2] if save_slope else out[0]


def _layer_norm_linear_chosen(x2d, norm_weight, norm_bias, weight, bias, eps, is_rms, activation, precision, path,
                              save_slope, mode):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return _layer_norm_linear(x2d, norm_weight, norm_bias, weight, bias, eps, is_rms, activation, precision,
                                      path, save_slope)
        return fastpath.vendor(_norm_then_cublas, x2d, norm_weight, norm_bias, weight, bias, eps, is_rms, activation,
                               path, save_slope)

    def key():
        (M, K), N = x2d.shape, weight.shape[0]
        return tuning.ChoiceKey(M_BUCKET=sizes.m_bucket(M), N=N, K=K, IS_RMS=is_rms, HAS_GAMMA=norm_weight is not None,
                                HAS_BETA=norm_bias is not None, HAS_BIAS=bias is not None, ACTIVATION=activation,
                                INPUT_PRECISION=precision, **training_field(save_slope), dtype=x2d.dtype)
    return fastpath.run_chosen(NORM_LINEAR_CHOICE, mode, (tuning.TILEFUSE, NORM_THEN_CUBLAS), key, x2d.device, run)


# layer_norm_linear's vendor candidate: the norm (the norms family's entry, which makes its own choice between
# tilefuse's kernel and torch's), then linear's cuBLAS composition on its output (in training with the slope: the
# backward recomputes the normalized rows itself, so nothing else of the forward is kept).
NORM_THEN_CUBLAS = "norm_then_cublas"
NORM_LINEAR_CHOICE = tuning.BackendChoice("layer_norm_linear_forward_backend", (tuning.TILEFUSE, NORM_THEN_CUBLAS))


def _norm_then_cublas(x2d, norm_weight, norm_bias, weight, bias, eps, is_rms, activation, path, save_slope=False):
    y, _ = norm_forward(x2d, None, norm_weight, norm_bias, eps, is_rms, path)
    out = linear_vendor(CUBLAS, y, weight, bias, activation, path, save_slope)
    return out if save_slope else (out,)


def _layer_norm_linear(x2d, norm_weight, norm_bias, weight, bias, eps, is_rms, activation, precision, path,
                       save_slope):
    """(y, [slope,] the temporaries): the row statistics and the fold's tensors are returned beside the outputs,
    so that the fast path's plan allocates them too and a later call replays every launch (a launch argument
    made here and not returned would send every call down the full path)."""
    M = x2d.shape[0]
    N = weight.shape[0]
    y2d = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    slopes = (torch.empty_like(y2d),) if save_slope else ()
    if path == runtime.COMPILED and x2d.dtype != torch.float32 and tma_supported(x2d, weight, y2d):
        cfg, temporaries = _norm_linear_tma(x2d, is_rms, eps, norm_weight, norm_bias, weight, bias, y2d, activation,
                                            slopes=slopes)
        launches.record("layer_norm_linear", path, "tma, norm in epilogue", lambda: tuning.describe(cfg))
        return (y2d, *slopes, *temporaries)
    stats = norm_statistics(x2d, eps, is_rms, interpret=path == runtime.INTERPRETER)
    mean, rstd = stats
    cfg = _launch_norm_prologue(x2d, mean, rstd, norm_weight, norm_bias, weight, bias, y2d, is_rms, activation,
                                precision, interpret=path == runtime.INTERPRETER, slopes=slopes)
    launches.record("layer_norm_linear", path, "norm in prologue", lambda: tuning.describe(cfg))
    return (y2d, *slopes, stats)


def fold_weight(w, gamma, beta, b, is_rms: bool):
    """(W', shift, colsum) for the epilogue form of layer_norm_linear (norm_prologue.py's module doc): W' is
    ``w`` itself without gamma; shift (fp32 [N]) is None when there is neither beta nor b; colsum (fp32
    [N]) is None for rms. No kernel runs when none of them needs computing."""
    N, K = w.shape
    need_colsum = not is_rms
    has_beta = beta is not None and not is_rms
    if gamma is None and not need_colsum and not has_beta:
        return w, (None if b is None else b), None
    wf = torch.empty_like(w, memory_format=torch.contiguous_format) if gamma is not None else w
    colsum = torch.empty(N, dtype=torch.float32, device=w.device) if need_colsum else None
    has_shift = has_beta or b is not None
    shift = torch.empty(N, dtype=torch.float32, device=w.device) if has_shift else None
    unused = w  # any valid pointer for the outputs a flag switches off
    fastpath.launch(weight_fold_kernel, (cdiv(N, configs.FOLD_BLOCK_N),), (
        w, gamma if gamma is not None else w, beta if has_beta else w, b if b is not None else w, wf,
        colsum if colsum is not None else unused, shift if shift is not None else unused,
        N, K, w.stride(0), wf.stride(0)),
        dict(HAS_GAMMA=gamma is not None, HAS_BETA=has_beta, HAS_BIAS=b is not None, NEED_COLSUM=need_colsum,
             BLOCK_N=configs.FOLD_BLOCK_N, BLOCK_K=configs.FOLD_BLOCK_K, num_warps=configs.FOLD_WARPS))
    return wf, shift, colsum


def _norm_linear_tma(x2d, is_rms, eps, gamma, beta, w, b, y2d, activation, config: dict | None = None, slopes=()):
    """layer_norm_linear on Hopper: the fold and the rows' statistics (the norms family's pre-pass), then the
    TMA GEMM on raw x, which applies them in its epilogue. ``config`` pins the GEMM's config. Returns (the GEMM's
    config, the temporaries made here: the statistics and whichever of the fold's outputs are not w or b)."""
    wf, shift, colsum = fold_weight(w, gamma, beta, b, is_rms)
    stats = norm_statistics(x2d, eps, is_rms, interpret=runtime.execution_path(x2d) == runtime.INTERPRETER)
    cfg = launch_tma(x2d, wf, shift, y2d, activation, config=config, norm=(2 if is_rms else 1, colsum, stats),
                      slopes=slopes)
    temporaries = tuple(t for t in (wf, shift, colsum) if t is not None and t is not w and t is not b)
    return cfg, (stats, *temporaries)


def _launch_norm_prologue(x2d, mean, rstd, gamma, beta, w, b, y2d, is_rms, activation, input_precision, interpret,
                          slopes=()):
    """x2d [M, K] (unit column stride), y2d [M, N] contiguous, ``slopes`` () or (slope [M, N] like y2d,).
    Returns the config used."""
    M, K = x2d.shape
    N = w.shape[0]
    args = (x2d, mean, rstd, gamma if gamma is not None else mean, beta if beta is not None else mean,
            w, b if b is not None else mean, y2d, slopes[0] if slopes else y2d, M, N, K, sizes.m_bucket(M),
            x2d.stride(0), w.stride(0), w.stride(1), y2d.stride(0))
    flags = dict(IS_RMS=is_rms, HAS_GAMMA=gamma is not None, HAS_BETA=beta is not None, HAS_BIAS=b is not None,
                 ACTIVATION=activation or "none", INPUT_PRECISION=input_precision, SAVE_SLOPE=bool(slopes))
    if interpret:
        cfg = configs.INTERPRETER_GEMM
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
        fastpath.launch(norm_linear_kernel, grid, args, dict(flags, UPCAST_DOT=x2d.dtype == torch.bfloat16, **cfg))
        return cfg

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    fastpath.launch(norm_linear_tuned, grid, args, dict(flags, UPCAST_DOT=False))
    return norm_linear_tuned.launched_config()

"""Linear's forward, ``act(x @ W^T + b)``, and the forward kernels it shares with the gated form and
layer_norm_linear: the decode kernel at small M, the cooperative gated kernel, the persistent TMA kernel on
Hopper and the portable kernel (split over K at small M) everywhere else; and linear's vendor candidates
(cuBLASLt's epilogue, cuBLAS then torch's activation). The package's docstring has the map."""
from __future__ import annotations

import math

import torch

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches, switches
from tilefuse.kernels.gemm import configs, coop
from tilefuse.kernels.gemm.decode import block_m as decode_block_m
from tilefuse.kernels.gemm.decode import decode_linear_kernel
from tilefuse.kernels.gemm.gate import activation_slope_kernel
from tilefuse.kernels.gemm.launch.rules import (CUBLAS, MIN_TILE, coop_gated, launch_persistent_tma, pass_grid,
                                                persistent_grid, row_addressing, split_k_slices, split_k_workspace,
                                                stream_handle, tile_counters, training_field, tma_supported)
from tilefuse.kernels.gemm.portable import linear_epilogue_kernel
from tilefuse.kernels.gemm.tma import linear_tma_kernel
from tilefuse.kernels.tiling import ensure_descriptor_allocator
from tilefuse.runtime import precision_for
from tilefuse.sizes import cdiv

# Keyed on the row-count bucket rather than M itself, so a new batch size reuses the tuned tile.
linear_portable_tuned = tuning.autotune(
    name="linear_portable",
    configs=configs.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "INPUT_PRECISION", "SPLIT_K", "SAVE_SLOPE"],
    prune_configs_by={"early_config_prune": configs.prune_portable_configs},
)(linear_epilogue_kernel)


# Small M (decode): few output tiles for 132 SMs, so K is split too. Skinny row tiles (tl.dot needs 16
# rows), narrow column tiles for more programs, long K steps to keep loads in flight.
linear_splitk_tuned = tuning.autotune(
    name="linear_splitk",
    configs=configs.SPLIT_K_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "ACTIVATION", "INPUT_PRECISION", "SPLIT_K", "SAVE_SLOPE"],
    prune_configs_by={"early_config_prune": configs.prune_portable_configs},
)(linear_epilogue_kernel)


linear_tma_tuned = tuning.autotune(
    name="linear_tma",
    configs=[configs.tma_config(**c) for c in configs.TMA_GEMM_CONFIGS],
    # NORM: layer_norm_linear's epilogue reads the row statistics (and the pre-pass shares the GPU's time with
    # it); RMSNorm without bias has linear's dtypes, so only NORM tells the two keys apart.
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "NORM", "SAVE_SLOPE"],
    prune_configs_by={"early_config_prune": configs.prune_gated_configs},
)(linear_tma_kernel)


_LINEAR = fastpath.Plans("linear")


# The decode kernel (decode.py, under switches.gemm.DECODE_KERNEL) measured faster than split-K (H200, K = N = 4096:
# 1.09-1.39x, weights cold); its programs are N / 32 column slabs, so N must give the SMs about a wave of them (4096:
# 128 programs for 132 SMs); with fewer, split-K keeps the SMs busy.
DECODE_MIN_WAVE = 0.95


def decode_usable(M: int, N: int, K: int, w: torch.Tensor, gated: bool, save_slope: bool, device) -> bool:
    """Whether a small-M Linear whose x the compiled path reads as 16-bit rows runs the decode kernel: M <= 64
    and K >= 1024 (split-K's domain), W 16-bit with a unit inner stride, no gate and no slopes to store, and at
    least DECODE_MIN_WAVE of a wave of 32-column programs."""
    if not (switches.gemm.DECODE_KERNEL and M <= 64 and K >= 1024 and not gated and not save_slope
            and w.dtype in (torch.float16, torch.bfloat16) and w.stride(1) == 1):
        return False
    bn = configs.DECODE_GEMM_CONFIGS[16]["BLOCK_N"]
    return cdiv(N, bn) >= DECODE_MIN_WAVE * runtime.device_facts(device)[1]


def _launch_decode(x2d, w, b, y2d, activation, interpret: bool) -> dict:
    """The decode kernel into y2d; returns the config used."""
    M, K = x2d.shape
    N = w.shape[0]
    bm = decode_block_m(M)
    cfg = configs.DECODE_INTERPRETER if interpret else configs.DECODE_GEMM_CONFIGS[16 if bm <= 16 else 64]
    fastpath.launch(decode_linear_kernel, (cdiv(N, cfg["BLOCK_N"]),), (
        x2d, w, b if b is not None else y2d, y2d, M, N, K, x2d.stride(0), w.stride(0), y2d.stride(0)),
        dict(HAS_BIAS=b is not None, ACTIVATION=activation or "none", BLOCK_M=bm, **cfg))
    return cfg


def linear(x, weight, bias, activation, path, save_slope=False):
    """``act(x @ weight^T + bias)`` for x [..., K] (any strides), weight [N, K], bias [N] dense or None.
    ``save_slope`` (training, with an activation): returns (y, slope), slope = act'(pre) in y's layout.
    Runs tilefuse's kernels or a cuBLAS composition (see :data:`LINEAR_CHOICE`)."""
    precision = precision_for(x.dtype, x.is_cuda)
    mode = runtime.backend()
    return _LINEAR.run((x, weight, bias), (activation, precision, save_slope, mode),
                       lambda: _linear_chosen(x, weight, bias, activation, precision, path, save_slope, mode))


def _linear_chosen(x, weight, bias, activation, precision, path, save_slope, mode):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return forward_kernels(x, weight, bias, None, None, activation, precision, path, save_slope)
        return fastpath.vendor(linear_vendor, candidate, x, weight, bias, activation, path, save_slope)

    def key():
        N, K = weight.shape
        return tuning.ChoiceKey(M_BUCKET=sizes.m_bucket(math.prod(x.shape[:-1])), N=N, K=K, HAS_BIAS=bias is not None,
                                ACTIVATION=activation, INPUT_PRECISION=precision, **training_field(save_slope),
                                dtype=x.dtype)
    return fastpath.run_chosen(LINEAR_CHOICE, mode, _linear_candidates(x, bias, activation, save_slope), key,
                               x.device, run)


def forward_kernels(x, w, b, w_up, b_up, activation, precision, path, save_slope):
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    x_rows, m_inner, s_outer, s_inner, s_k = row_addressing(x)
    y2d = y.view(M, N)
    gated = w_up is not None
    saved = tuple(torch.empty_like(y) for _ in range((2 if gated else 1) if save_slope else 0))
    slopes = tuple(t.view(M, N) for t in saved)
    out = (y, *saved) if save_slope else y
    compiled = path == runtime.COMPILED
    # x as 2-D rows with a unit inner stride, for the decode, cooperative and TMA kernels (16-bit only)
    x2d = None
    if compiled and s_k == 1 and (s_outer == 0 or m_inner == M) and x.dtype != torch.float32:
        x2d = x_rows.as_strided((M, K), (s_inner, 1))
    if x2d is not None and decode_usable(M, N, K, w, gated, save_slope, x.device):
        cfg = _launch_decode(x2d, w, b, y2d, activation, interpret=False)
        launches.record("linear", path, "decode", lambda: tuning.describe(cfg))
        return out
    split_k = split_k_slices(M, N, K, path, x.device)
    if x2d is not None and split_k == 1:
        if gated and coop_gated(x2d, w, w_up, y2d, save_slope, path):
            coop.launch(x2d, None, w, y2d, b_kmajor=True, bias=b, activation=activation, b_up=w_up, bias_up=b_up,
                        config=switches.gemm.COOP_GATED_CONFIG)
            launches.record("linear", path, "cooperative warp-specialized", switches.gemm.COOP_GATED_CONFIG)
            return out
        if tma_supported(x2d, w, y2d, *([w_up] if gated else []), *slopes):
            cfg = launch_tma(x2d, w, b, y2d, activation, w_up=w_up, b_up=b_up, slopes=slopes)
            launches.record("linear", path, "tma", lambda: tuning.describe(cfg))
            return out
    cfg = _launch_portable(x_rows, m_inner, s_outer, s_inner, s_k, w, b, y2d, M, N, K, activation, precision,
                           interpret=path == runtime.INTERPRETER, w_up=w_up, b_up=b_up, split_k=split_k, slopes=slopes)
    launches.record("linear", path, "portable" if split_k == 1 else f"split-k {split_k}",
                    lambda: tuning.describe(cfg))
    return out


# Same outputs as tilefuse's: y [..., N] contiguous in x's dtype (in training, with the slope(s) in y's layout);
# fp32 follows the same TF32 flag (torch's matmul reads it as the kernels' precision_for does). The training
# forward's slope comes from a pass of its own after cuBLAS (gate.py: the activation and its slope in one pass);
# cuBLASLt's epilogue stores no slope, so it is no training candidate.
CUBLASLT_EPILOGUE = "cublaslt_epilogue"  # torch._addmm_activation: cuBLASLt's bias + ReLU / tanh-GELU epilogue


LINEAR_CHOICE = tuning.BackendChoice("linear_forward_backend", (tuning.TILEFUSE, CUBLASLT_EPILOGUE, CUBLAS))
# cuBLASLt's GELU epilogue is the tanh form, so it stands in for gelu_tanh only, never for the erf gelu. CUDA only:
# the same op on the CPU applies the erf form.
_EPILOGUE_ACTIVATIONS = {"relu": False, "gelu_tanh": True}  # activation -> use_gelu
_IN_PLACE = {"gelu": lambda y: torch.ops.aten.gelu_(y),
             "gelu_tanh": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"),
             "relu": torch.relu_, "silu": lambda y: torch.nn.functional.silu(y, inplace=True)}


def _linear_candidates(x, bias, activation, save_slope) -> tuple[str, ...]:
    if save_slope:
        return (tuning.TILEFUSE, CUBLAS)
    if x.is_cuda and bias is not None and activation in _EPILOGUE_ACTIVATIONS:
        return (tuning.TILEFUSE, CUBLASLT_EPILOGUE, CUBLAS)
    return (tuning.TILEFUSE, CUBLAS)


def _relu_pre_in_fp32(x, bias, activation) -> bool:
    """Whether the training forward's cuBLAS pre-activation is kept in fp32: relu's slope is a step at 0, and a 16-bit
    x @ W^T rounded before the bias is added (cuBLAS on the H200 does so for bf16) puts pre within that rounding of 0
    on the other side from float64: dx, dW and db then carry whole flipped terms (rel-L2 2e-2 at M257 K1000 N515,
    from about 50 flips). One fp32 pre (bias added in fp32, rounded once) keeps the sign tilefuse's epilogue sees.
    The smooth activations take the 16-bit pre, eager's rounding."""
    return activation == "relu" and bias is not None and x.dtype in (torch.float16, torch.bfloat16)


def _fp32_linear(x, weight, bias):
    """x @ W^T + b as an fp32 [M, N] tensor from 16-bit operands, accumulated and biased in fp32 (cuBLAS's fp32
    output on CUDA; fp32 copies elsewhere)."""
    x2d = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        return torch.addmm(bias, x2d, weight.t(), out_dtype=torch.float32)
    return torch.addmm(bias.float(), x2d.float(), weight.float().t())


def linear_vendor(candidate, x, weight, bias, activation, path, save_slope=False):
    if save_slope:  # pre by cuBLAS, then y = act(pre) (over pre itself where it is 16-bit) and its slope, one pass
        N = weight.shape[0]
        M = math.prod(x.shape[:-1])
        if _relu_pre_in_fp32(x, bias, activation):
            pre = _fp32_linear(x, weight, bias)
            y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
            how = "F.linear in fp32"
        else:
            y = pre = torch.nn.functional.linear(x, weight, bias).contiguous()
            how = "F.linear"
        slope = torch.empty_like(y)
        grid, tile = pass_grid(M, N, path)
        fastpath.launch(activation_slope_kernel, grid, (pre, y, slope, M, N, N, N),
                        dict(ACTIVATION=activation, **tile))
        launches.record("linear", path, CUBLAS, f"{how}, then {activation} and its slope in one pass")
        return y, slope
    if candidate == CUBLASLT_EPILOGUE:
        x2d = x.reshape(-1, x.shape[-1])
        y = torch._addmm_activation(bias, x2d, weight.t(), use_gelu=_EPILOGUE_ACTIVATIONS[activation])
        y = y.view(*x.shape[:-1], weight.shape[0])
        launches.record("linear", path, CUBLASLT_EPILOGUE, "torch._addmm_activation")
        return y
    y = torch.nn.functional.linear(x, weight, bias).contiguous()
    if activation is not None:
        _IN_PLACE[activation](y)
    launches.record("linear", path, CUBLAS, "F.linear" + (f" then {activation} in place" if activation else ""))
    return y


def _launch_portable(x, m_inner, stride_xo, stride_xm, stride_xk, w, b, y, M, N, K, activation, input_precision,
                     interpret, w_up=None, b_up=None, split_k=1, slopes=()):
    """The portable kernel on 2-D-addressable operands; returns the config used. ``slopes``: () or the
    [M, N] slope output(s) to store (y's strides)."""
    gated = w_up is not None
    w_up = w_up if gated else w
    common = dict(HAS_BIAS=b is not None, ACTIVATION=activation or "none", GATED=gated,
                  INPUT_PRECISION=input_precision, SAVE_SLOPE=bool(slopes))
    s_ptr = slopes[0] if slopes else y
    su_ptr = slopes[1] if len(slopes) > 1 else y
    ws = counters = y
    k_split_len = K
    if split_k > 1:
        # Slices are whole multiples of the largest BLOCK_K in use, so no K step straddles two slices.
        k_split_len = cdiv(cdiv(K, split_k), configs.SPLIT_K_ALIGN) * configs.SPLIT_K_ALIGN
        split_k = cdiv(K, k_split_len)
        stream = stream_handle(y.device)
        ws = split_k_workspace(y.device, ((2 if gated else 1) * split_k, M, N), stream)
        counters = tile_counters(y.device, cdiv(M, MIN_TILE) * cdiv(N, MIN_TILE), stream)
    common["SPLIT_K"] = split_k
    args = (x, w, b if b is not None else y, y, w_up, b_up if b_up is not None else y, ws, counters,
            s_ptr, su_ptr, M, N, K, sizes.m_bucket(M), k_split_len, m_inner,
            stride_xo, stride_xm, stride_xk, w.stride(0), w.stride(1), w_up.stride(0), w_up.stride(1),
            y.stride(0), y.stride(1))
    if interpret:
        cfg = configs.INTERPRETER_GEMM
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), split_k)
        fastpath.launch(linear_epilogue_kernel, grid, args,
                        dict(common, UPCAST_DOT=x.dtype == torch.bfloat16, **cfg))
        return cfg

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), split_k)

    kernel = linear_splitk_tuned if split_k > 1 else linear_portable_tuned
    fastpath.launch(kernel, grid, args, dict(common, UPCAST_DOT=False))
    return kernel.launched_config()


def launch_tma(x2d, w, b, y, activation, config: dict | None = None, w_up=None, b_up=None,
                norm: tuple | None = None, slopes=()):
    """Persistent TMA launch; returns the config used. ``config`` pins one (benchmarks of variants);
    None autotunes. ``norm``: (1 for LayerNorm or 2 for RMSNorm, colsum fp32 [N] or None, the rows'
    statistics fp32 [2, M] contiguous: mean, rstd) for layer_norm_linear, where ``w`` is the gamma-folded
    weight and ``b`` the folded bias. ``slopes``: () or the slope output(s) to store, laid out as y."""
    ensure_descriptor_allocator()
    M, K = x2d.shape
    N = w.shape[0]
    num_sms = runtime.device_facts(x2d.device)[1]
    gated = w_up is not None
    norm_kind, stats = 0, None
    if norm is not None:
        norm_kind, b_up, stats = norm
    if not gated:
        w_up = w
    second_slot = slopes[1] if len(slopes) > 1 else (stats if stats is not None else y)
    args = (x2d, w, b if b is not None else y, y, w_up, b_up if b_up is not None else y,
            slopes[0] if slopes else y, second_slot,
            M, N, K, sizes.m_bucket(M), x2d.stride(0), w.stride(0), w_up.stride(0), y.stride(0))
    common = dict(HAS_BIAS=b is not None, ACTIVATION=activation or "none", GATED=gated, NORM=norm_kind,
                  NUM_SMS=num_sms, SAVE_SLOPE=bool(slopes))

    cfg = configs.tma_config(**config) if config is not None else None
    return launch_persistent_tma(linear_tma_kernel, linear_tma_tuned, cfg, persistent_grid(M, N, num_sms), args,
                                 common)

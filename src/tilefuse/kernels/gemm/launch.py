"""The GEMM family's launch layer: the one place that decides which GEMM kernel runs, with which
config, grid and K split, for tilefuse.linear (plain and gated) and tilefuse.layer_norm_linear.

- Hopper (sm_90+), 16-bit operands, TMA-able layouts (unit inner strides, 16-byte-aligned rows and
  bases): the persistent TMA kernel (tma.py); layer_norm_linear there folds gamma into a copy of the
  weight, takes the rows' statistics from the norms family's pre-pass and lets the TMA GEMM normalize in its
  epilogue. The gated forward without slopes (inference) on
  sm_90 with at least one output tile per SM: the cooperative warp-specialized Gluon kernel (coop.py,
  ``coop_gated``).
- Small M (decode, M <= 64 with K >= 1024): with 16-bit operands, N wide enough for a wave of its 32-column
  programs and no slopes or gate, the decode kernel (decode.py: the weight read once, no K split); otherwise
  the portable kernel with K split over programs, reduced in the same launch (portable.py, SPLIT_K).
- Everything else, and the interpreter: the portable kernel; layer_norm_linear with a statistics
  pre-pass (the norms family's kernel) and normalization in the GEMM's prologue (norm_prologue.py).
- FP8 (e4m3) linear (``linear_fp8``): a 16/32-bit x is first quantized per row by the row quantizer
  (fp8.py, ``quantize_rows``, also what quantizes a weight per output channel); then on Hopper with TMA-able
  operands (K % 16 == 0, 16-byte output rows) the persistent FP8 TMA kernel, else the masked pointer kernel
  (Ada, odd shapes, the interpreter). Inference only: no slopes, no vendor candidate.
- Training: every forward entry takes ``save_slope`` and then also returns the activation's slope(s)
  ``act'(pre)`` its kernel stored (backward.py says why the slope, not the pre-activation); the backward
  entry runs the two backward GEMMs (backward.py), which make ``g = dy * slope`` in their operand loads: dW
  as a persistent TMA kernel on Hopper (16-bit, TMA-able operands), the tuned pointer kernels otherwise. With a
  slope, not gated, on sm_90, dx and dW (+ db) each take the cooperative warp-specialized Gluon kernel
  (coop.py) where it measured faster (``coop_backward``: enough output tiles for the SMs and a reduction of
  2048 or more; dW in the weight's row-major layout).

Each entry allocates its output, records what ran (kernels/launches.py) and goes through the family's
fast path (kernels/fastpath.py). Inputs arrive checked and non-empty (tilefuse.ops).
"""
from __future__ import annotations

import math

import torch

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches
from tilefuse.kernels.gemm import configs, coop
from tilefuse.kernels.gemm.decode import block_m as decode_block_m
from tilefuse.kernels.gemm.decode import decode_linear_kernel
from tilefuse.kernels.gemm.fp8 import linear_fp8_kernel, linear_fp8_tma_kernel, quantize_rows_kernel
from tilefuse.kernels.gemm.gate import activation_slope_kernel, gated_grad_kernel, glu_gate_kernel
from tilefuse.kernels.gemm.backward import grad_input_kernel, grad_weight_kernel, grad_weight_tma_kernel
from tilefuse.kernels.gemm.norm_prologue import norm_linear_kernel, weight_fold_kernel
from tilefuse.kernels.gemm.portable import linear_epilogue_kernel
from tilefuse.kernels.gemm.tma import linear_tma_kernel
from tilefuse.kernels.norms.launch import forward as norm_forward
from tilefuse.kernels.norms.launch import norm_statistics
from tilefuse.kernels.tiling import ensure_descriptor_allocator
from tilefuse.runtime import precision_for
from tilefuse.sizes import cdiv

# ---- tuners ----------------------------------------------------------------------------------------
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

norm_linear_tuned = tuning.autotune(
    name="norm_linear",
    configs=configs.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "IS_RMS", "HAS_GAMMA", "HAS_BETA", "HAS_BIAS", "ACTIVATION",
         "INPUT_PRECISION", "SAVE_SLOPE"],
    # The portable GEMM's shared-memory and fp32-FMA rules apply to this main loop as well.
    prune_configs_by={"early_config_prune": configs.prune_norm_linear_configs},
)(norm_linear_kernel)

# The backward GEMMs: keyed like the forward (the reduction of grad_weight runs over M, hence M_BUCKET).
grad_input_tuned = tuning.autotune(
    name="linear_grad_input",
    configs=configs.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_SLOPE", "GATED", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": configs.prune_backward_configs},
)(grad_input_kernel)

grad_weight_tuned = tuning.autotune(
    name="linear_grad_weight",
    configs=configs.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "HAS_SLOPE", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": configs.prune_backward_configs},
)(grad_weight_kernel)

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

_LINEAR = fastpath.Plans("linear")
_GATED = fastpath.Plans("gated_linear")
_NORM_LINEAR = fastpath.Plans("layer_norm_linear")
_LINEAR_BACKWARD = fastpath.Plans("linear_backward")
_LINEAR_FP8 = fastpath.Plans("linear_fp8")
_QUANTIZE_ROWS = fastpath.Plans("quantize_rows")


# ---- decisions -------------------------------------------------------------------------------------
def split_k_for(M: int, N: int, K: int, num_sms: int) -> int:
    """How many K slices for a small-M GEMM: enough programs for ~2 waves (with 64-wide column tiles),
    each slice still >= 512 deep. 1 (no split) above 64 rows, where the M x N tiles fill the GPU."""
    if M > 64 or K < 1024:
        return 1
    tiles = cdiv(M, 64) * cdiv(N, 64)
    return max(1, min(16, cdiv(2 * num_sms, tiles), K // 512))


# The decode kernel (decode.py) where it measured faster than split-K (H200, K = N = 4096: 1.09-1.39x, weights
# cold): its programs are N / 32 column slabs, so N must give the SMs about a wave of them (4096: 128 programs
# for 132 SMs); with fewer, split-K keeps the SMs busy. False leaves decode shapes to split-K.
DECODE_KERNEL = True
DECODE_MIN_WAVE = 0.95


def decode_usable(M: int, N: int, K: int, w: torch.Tensor, gated: bool, save_slope: bool, device) -> bool:
    """Whether a small-M Linear whose x the compiled path reads as 16-bit rows runs the decode kernel: M <= 64
    and K >= 1024 (split-K's domain), W 16-bit with a unit inner stride, no gate and no slopes to store, and at
    least DECODE_MIN_WAVE of a wave of 32-column programs."""
    if not (DECODE_KERNEL and M <= 64 and K >= 1024 and not gated and not save_slope
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


def split_k_slices(M: int, N: int, K: int, path: str, device) -> int:
    """K slices on the compiled path (:func:`split_k_for`); 1 elsewhere. Tests force a split here."""
    if path != runtime.COMPILED:
        return 1
    return split_k_for(M, N, K, runtime.device_facts(device)[1])


def tma_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a GPU with TMA (sm_90+)."""
    return t.is_cuda and runtime.device_facts(t.device)[0] >= 9


def tma_supported(x2d: torch.Tensor, *others: torch.Tensor) -> bool:
    """TMA needs unit inner strides, 16-byte-aligned row strides and base addresses, on sm_90+."""
    if not tma_device(x2d):
        return False
    s = x2d.element_size()
    for t in (x2d, *others):
        if t.stride(-1) != 1 or (t.stride(0) * s) % 16 or t.data_ptr() % 16:
            return False
    return True


def hopper_tma(x2d: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the Hopper TMA kernels (tiles sized for sm_90's 227 KB of shared memory) take these operands:
    16-bit, TMA-able (``tma_supported``), on an sm_90 GPU."""
    return x2d.dtype != torch.float32 and tma_supported(x2d, *others) and runtime.device_facts(x2d.device)[0] == 9


# The cooperative warp-specialized Gluon GEMM (coop.py) where it measured faster than the kernels the launch
# runs otherwise (benchmarks/NOTES.md has the numbers): the linear backward's dx and dW (+ db) with a slope, and
# the gated forward without slopes. False leaves each to those kernels (benchmarks compare them so; after
# switching, fastpath.clear_all(): captured plans keep their kernels).
COOP_BACKWARD = True
COOP_GATED = True
# The gated dx, (dy * s_gate) @ W_gate + (dy * s_up) @ W_up, as one cooperative launch (coop.py's GATED_DX) under
# the plain dx's rule: 1.19-1.23x the tuned pointer kernel on the H200 (benchmarks/NOTES.md). False leaves it to
# that kernel.
COOP_GATED_DX = True
COOP_BACKWARD_CONFIG = "128x256x32_s4"
COOP_GATED_CONFIG = "128x128x64_s4"  # the gated form's two accumulators per consumer fit at BLOCK_N 128 only
# The backward's cooperative GEMM has one CTA per SM walking whole output tiles, each over the whole reduction
# (no split): with fewer tiles than SMs some SMs idle, and over a short reduction a tile's ring fill, drain and
# epilogue weigh more than its few K steps. Measured: dx slower with half the SMs' worth of tiles, dW slower over
# short reductions but faster with half an SM's worth of tiles over long ones (dW's own reduction runs 8-16k
# rows deep there); with these minimums it measured faster on every shape.
COOP_MIN_REDUCTION = 2048
COOP_MIN_TILES_PER_SM = {"dx": 1.0, "dW": 0.5}


def coop_operands(path: str, *tensors: torch.Tensor) -> bool:
    """Whether the cooperative kernel can take these 2-D operands and output: the compiled path, one 16-bit
    dtype, ``hopper_tma`` (sm_90, unit inner strides, 16-byte-aligned rows and bases) and dense rows (a row
    stride at least the row's length: no broadcast or overlapping rows under its TMA boxes)."""
    t0 = tensors[0]
    return (path == runtime.COMPILED and t0.dtype in (torch.float16, torch.bfloat16)
            and all(t.dtype == t0.dtype and t.stride(0) >= t.shape[1] for t in tensors) and hopper_tma(*tensors))


def coop_backward(c: torch.Tensor, a: torch.Tensor, s, b: torch.Tensor, path: str, gemm: str) -> bool:
    """Whether one backward GEMM runs the cooperative kernel: dx [M, K] = g @ W (``b`` = W [N, K]) or
    dW [N, K] = g^T @ x (``b`` = x [M, K]), g = a * s (``a`` = dy [M, N], ``s`` the slope or None), into ``c``.
    Taken with COOP_BACKWARD, a slope (without one, today's kernels: not measured), ``coop_operands`` of all
    four as laid out -- so W row-major for dx, and dW only in the weight's row-major [N, K] layout (a Conv1D
    weight's dW^T stays on the TMA kernel) -- and where it measured faster: output tiles (``coop.output_tiles``
    at COOP_BACKWARD_CONFIG) at least COOP_MIN_TILES_PER_SM[gemm] ("dx" or "dW") times the SM count and a
    reduction (``b``'s rows) of at least COOP_MIN_REDUCTION."""
    if not COOP_BACKWARD or s is None or not coop_operands(path, c, a, s, b):
        return False
    tiles = coop.output_tiles(c.shape[0], c.shape[1], COOP_BACKWARD_CONFIG)
    return (tiles >= COOP_MIN_TILES_PER_SM[gemm] * runtime.device_facts(c.device)[1]
            and b.shape[0] >= COOP_MIN_REDUCTION)


def coop_gated_dx(dx2d, dy2d, s_gate, s_up, w_gate, w_up, path: str) -> bool:
    """Whether the gated dx runs the cooperative kernel's GATED_DX form: COOP_GATED_DX, the plain dx's rule
    (``coop_backward``) for the gate's product, and the up branch's slope and weight TMA-able alike."""
    return (COOP_GATED_DX and coop_backward(dx2d, dy2d, s_gate, w_gate, path, "dx")
            and coop_operands(path, dx2d, s_up, w_up))


def coop_gated(x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, y2d: torch.Tensor, save_slope: bool,
               path: str) -> bool:
    """Whether the gated forward y2d = glu(x2d @ w_gate^T + b_gate, x2d @ w_up^T + b_up) runs the cooperative
    kernel: COOP_GATED, no slopes to store (the kernel has no slope outputs, so a training forward keeps the
    TMA kernel), ``coop_operands`` of x2d, both weights ([N, K] as nn.Linear keeps them) and y2d, and at least
    one output tile per SM at COOP_GATED_CONFIG (it measured faster than the TMA gated kernel at prefill-sized
    M; with fewer tiles than SMs the TMA kernel keeps it)."""
    if not COOP_GATED or save_slope or not coop_operands(path, y2d, x2d, w_gate, w_up):
        return False
    return coop.output_tiles(*y2d.shape, COOP_GATED_CONFIG) >= runtime.device_facts(y2d.device)[1]


def row_addressing(x: torch.Tensor):
    """The rows of x[..., K] as (outer, inner) with two strides, without copying when possible.

    Returns (x_view, m_inner, stride_outer, stride_inner, stride_k). Leading dims are merged while they
    are mutually contiguous; if more than two groups remain, x is copied (rare: a >3-D tensor permuted
    in several leading dims).
    """
    K = x.shape[-1]
    groups: list[list[int]] = []  # [size, stride]; size-1 dims dropped, contiguous neighbours merged
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if groups and groups[-1][1] == size * stride:
            groups[-1] = [groups[-1][0] * size, stride]
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        x = x.contiguous()
        groups = [[x.numel() // max(K, 1), K]]
    if not groups:
        groups = [[1, K]]
    if len(groups) == 1:
        (m, s), = groups
        return x, max(m, 1), 0, s, x.stride(-1)
    (mo, so), (mi, si) = groups
    return x, mi, so, si, x.stride(-1)


# ---- split-K buffers -------------------------------------------------------------------------------
MIN_TILE = 16  # no config tiles M or N finer (tl.dot needs 16): bounds the number of output tiles
_COUNTERS: dict = {}
_WORKSPACES: dict = {}


def split_k_workspace(device: torch.device, shape: tuple, stream: int) -> torch.Tensor:
    """The fp32 partial sums of a split-K launch, ``shape`` (slices, M, N): one buffer per (device, stream,
    shape), kept for the process (the fast path replays its address). Launches on one stream run in
    order and each writes every partial it reads, so they can share it; two streams must not."""
    key = (device.index, stream, shape)
    buf = _WORKSPACES.get(key)
    if buf is None:
        buf = _WORKSPACES[key] = fastpath.persistent(torch.empty(shape, dtype=torch.float32, device=device))
    return buf


def tile_counters(device: torch.device, tiles: int, stream: int) -> torch.Tensor:
    """Zeroed int32 split-K arrival counters, one per output tile, kept per (device, stream) for the
    process: every launch leaves them at zero again, so one zeroing serves all later launches; two
    streams running split-K at once must not share them."""
    key = (device.index, stream, max(1024, sizes.next_pow2(tiles)))
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = fastpath.persistent(torch.zeros(key[2], dtype=torch.int32, device=device))
    return buf


def _stream(device: torch.device) -> int:
    """The current stream's handle on ``device`` (0 off the GPU): Triton's own getter, a fraction of
    ``torch.cuda.current_stream``'s host cost."""
    if device.type != "cuda":
        return 0
    from triton.runtime.driver import driver
    return driver.active.get_current_stream(device.index if device.index is not None else torch.cuda.current_device())


# ---- entries ---------------------------------------------------------------------------------------
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
            return _linear(x, weight, bias, None, None, activation, precision, path, save_slope)
        return fastpath.vendor(_linear_vendor, candidate, x, weight, bias, activation, path, save_slope)

    def key():
        N, K = weight.shape
        return tuning.ChoiceKey(M_BUCKET=sizes.m_bucket(math.prod(x.shape[:-1])), N=N, K=K, HAS_BIAS=bias is not None,
                                ACTIVATION=activation, INPUT_PRECISION=precision, **_training_field(save_slope),
                                dtype=x.dtype)
    return fastpath.run_chosen(LINEAR_CHOICE, mode, _linear_candidates(x, bias, activation, save_slope), key,
                               x.device, run)


def gated_linear(x, w_gate, w_up, b_gate, b_up, activation, path, save_slope=False):
    """``act(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)``, both GEMMs in one kernel. ``save_slope``:
    returns (y, s_gate, s_up) = (y, up * act'(gate), act(gate)) in y's layout. Runs tilefuse's kernels or
    cuBLAS's GEMMs and the gate kernel (see :data:`GATED_CHOICE`)."""
    precision = precision_for(x.dtype, x.is_cuda)
    mode = runtime.backend()
    return _GATED.run((x, w_gate, w_up, b_gate, b_up), (activation, precision, save_slope, mode),
                      lambda: _gated_chosen(x, w_gate, w_up, b_gate, b_up, activation, precision, path, save_slope,
                                            mode))


def _gated_chosen(x, w_gate, w_up, b_gate, b_up, activation, precision, path, save_slope, mode):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return _linear(x, w_gate, b_gate, w_up, b_up, activation, precision, path, save_slope)
        return fastpath.vendor(_gated_vendor, x, w_gate, w_up, b_gate, b_up, activation, path, save_slope)

    def key():
        N, K = w_gate.shape
        return tuning.ChoiceKey(M_BUCKET=sizes.m_bucket(math.prod(x.shape[:-1])), N=N, K=K,
                                HAS_BIAS=b_gate is not None, ACTIVATION=activation, INPUT_PRECISION=precision,
                                STACKED=_stacked(w_gate, w_up), **_training_field(save_slope), dtype=x.dtype)
    return fastpath.run_chosen(GATED_CHOICE, mode, (tuning.TILEFUSE, CUBLAS), key, x.device, run)


def _training_field(save_slope: bool) -> dict:
    """The choice key's field for a training forward (the slopes stored too: its candidates' times differ from
    inference's); none for inference, whose keys the shipped tables hold as they are."""
    return {"TRAINING": True} if save_slope else {}


def _linear(x, w, b, w_up, b_up, activation, precision, path, save_slope):
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
                        config=COOP_GATED_CONFIG)
            launches.record("linear", path, "cooperative warp-specialized", COOP_GATED_CONFIG)
            return out
        if tma_supported(x2d, w, y2d, *([w_up] if gated else []), *slopes):
            cfg = _launch_tma(x2d, w, b, y2d, activation, w_up=w_up, b_up=b_up, slopes=slopes)
            launches.record("linear", path, "tma", lambda: tuning.describe(cfg))
            return out
    cfg = _launch_portable(x_rows, m_inner, s_outer, s_inner, s_k, w, b, y2d, M, N, K, activation, precision,
                           interpret=path == runtime.INTERPRETER, w_up=w_up, b_up=b_up, split_k=split_k, slopes=slopes)
    launches.record("linear", path, "portable" if split_k == 1 else f"split-k {split_k}",
                    lambda: tuning.describe(cfg))
    return out


# ---- FP8 (e4m3) linear -------------------------------------------------------------------------------
# Hopper's fast FP8 accumulation over the whole K loop (fp8.py's _accumulate) instead of promoting each BLOCK_K
# step's partial sum to the fp32 accumulator. Off (as cuBLASLt's default, the scaled_mm anchor's): tiles up to
# 128x128, the second accumulator's registers; on: tiles up to 128x256, the whole K in the tensor cores' fewer
# bits. Read per call (the fast path's plans are keyed on it).
FP8_FAST_ACCUM = False


def fp8_tma_operands(x2d: torch.Tensor, w: torch.Tensor, y2d: torch.Tensor) -> bool:
    """Whether the FP8 TMA kernel takes x2d [M, K] and w [N, K] (e4m3) and y2d [M, N]: a TMA device of sm_90
    (the configs are sized for its shared memory) and each tensor with a unit inner stride, dense rows (a row
    stride at least the row's length: no overlapping rows under a TMA box), a row stride of a multiple of 16
    bytes (e4m3 rows: K % 16 == 0) and a 16-byte-aligned base."""
    if not tma_device(x2d) or runtime.device_facts(x2d.device)[0] != 9:
        return False
    return all(t.stride(-1) == 1 and t.stride(0) >= t.shape[1] and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (x2d, w, y2d))


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
    fast_accum = FP8_FAST_ACCUM
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

    def grid(meta):
        return (min(num_sms, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)

    if config is None and path == runtime.INTERPRETER:
        config = configs.FP8_INTERPRETER_TMA
    if config is not None:
        cfg = configs.fp8_tma_config(**config)
        fastpath.launch(linear_fp8_tma_kernel, grid(cfg.kwargs), args,
                        dict(common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        return cfg
    fastpath.launch(linear_fp8_tma_tuned, grid, args, common)
    return linear_fp8_tma_tuned.launched_config()


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


# ---- the vendor candidates of linear's forward ------------------------------------------------------
# Same outputs as tilefuse's: y [..., N] contiguous in x's dtype (in training, with the slope(s) in y's layout);
# fp32 follows the same TF32 flag (torch's matmul reads it as the kernels' precision_for does). The training
# forward's slope comes from a pass of its own after cuBLAS (gate.py: the activation and its slope in one pass);
# cuBLASLt's epilogue stores no slope, so it is no training candidate.
CUBLASLT_EPILOGUE = "cublaslt_epilogue"  # torch._addmm_activation: cuBLASLt's bias + ReLU / tanh-GELU epilogue
CUBLAS = "cublas"  # F.linear (bias in cuBLAS's epilogue), then torch's activation kernel in place on y
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


def _linear_vendor(candidate, x, weight, bias, activation, path, save_slope=False):
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
        grid, tile = _pass_grid(M, N, path)
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


# The gated forward's vendor candidate: one cuBLAS GEMM per half, then the gate kernel (gate.py) with the biases.
GATED_CHOICE = tuning.BackendChoice("gated_linear_forward_backend", (tuning.TILEFUSE, CUBLAS))
GATE_TILE = dict(BLOCK_M=8, BLOCK_N=256, num_warps=4)
GATE_INTERPRETER_TILE = dict(BLOCK_M=32, BLOCK_N=128)


def _pass_grid(M: int, N: int, path) -> tuple[tuple, dict]:
    """(grid, tile) of an elementwise pass of gate.py over [M, N] rows."""
    tile = GATE_INTERPRETER_TILE if path == runtime.INTERPRETER else GATE_TILE
    return (cdiv(M, tile["BLOCK_M"]), cdiv(N, tile["BLOCK_N"])), tile


def _stacked(first, second) -> bool:
    """Whether ``second`` continues ``first`` in memory, both dense: the halves of one tensor."""
    return (first.is_contiguous() and second.is_contiguous() and first.dtype == second.dtype
            and second.data_ptr() == first.data_ptr() + first.numel() * first.element_size())


def _gated_vendor(x, w_gate, w_up, b_gate, b_up, activation, path, save_slope=False):
    """One cuBLAS GEMM per half, each without its bias, then the gate kernel adds both biases in fp32. The same calls
    whether the halves are two tensors or one stacked [2N, K] tensor, so both weight forms get the same bits, as
    tilefuse's kernel gives them: one GEMM over a stacked weight would take other cuBLAS kernels than two over its
    halves, and a bias view at an odd offset another epilogue. (Equal bits also need cuBLAS to see the same
    alignment: it does where N * K is a multiple of 8.)"""
    N, K = w_gate.shape
    M = math.prod(x.shape[:-1])
    x2d = x.reshape(M, K)
    gate = torch.mm(x2d, w_gate.t())
    up = torch.mm(x2d, w_up.t())
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    slopes = (torch.empty_like(y), torch.empty_like(y)) if save_slope else (y, y)  # (y, y): pointers never stored
    has_bias = b_gate is not None
    biases = (b_gate, b_up) if has_bias else (y, y)  # (y, y): never read
    grid, tile = _pass_grid(M, N, path)
    fastpath.launch(glu_gate_kernel, grid, (gate, up, *biases, y, *slopes, M, N, gate.stride(0), up.stride(0), N),
                    dict(ACTIVATION=activation, HAS_BIAS=has_bias, SAVE_SLOPES=save_slope, **tile))
    launches.record("linear", path, CUBLAS, "a cuBLAS GEMM per half, then the "
                    + f"{activation} gate kernel" + (" with the biases" if has_bias else "")
                    + (" and its slopes" if save_slope else ""))
    return (y, *slopes) if save_slope else y


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
        stream = _stream(y.device)
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


def _launch_tma(x2d, w, b, y, activation, config: dict | None = None, w_up=None, b_up=None,
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

    def grid(meta):
        return (min(num_sms, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)

    if config is not None:
        cfg = configs.tma_config(**config)
        fastpath.launch(linear_tma_kernel, grid(cfg.kwargs), args,
                        dict(common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        return cfg
    fastpath.launch(linear_tma_tuned, grid, args, common)
    return linear_tma_tuned.launched_config()


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
                                INPUT_PRECISION=precision, **_training_field(save_slope), dtype=x2d.dtype)
    return fastpath.run_chosen(NORM_LINEAR_CHOICE, mode, (tuning.TILEFUSE, NORM_THEN_CUBLAS), key, x2d.device, run)


# layer_norm_linear's vendor candidate: the norm (the norms family's entry, which makes its own choice between
# tilefuse's kernel and torch's), then linear's cuBLAS composition on its output (in training with the slope: the
# backward recomputes the normalized rows itself, so nothing else of the forward is kept).
NORM_THEN_CUBLAS = "norm_then_cublas"
NORM_LINEAR_CHOICE = tuning.BackendChoice("layer_norm_linear_forward_backend", (tuning.TILEFUSE, NORM_THEN_CUBLAS))


def _norm_then_cublas(x2d, norm_weight, norm_bias, weight, bias, eps, is_rms, activation, path, save_slope=False):
    y, _ = norm_forward(x2d, None, norm_weight, norm_bias, eps, is_rms, path)
    out = _linear_vendor(CUBLAS, y, weight, bias, activation, path, save_slope)
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
    cfg = _launch_tma(x2d, wf, shift, y2d, activation, config=config, norm=(2 if is_rms else 1, colsum, stats),
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


# ---- backward ----------------------------------------------------------------------------------------
def linear_backward(dy, x, w, w_up, slope, slope_up, need_dx, need_dw, need_db, path):
    """Gradients of ``act(x @ w^T + b)`` (gated: of ``act(x @ w^T + b) * (x @ w_up^T + b_up)``) from dy
    [..., N] (any strides) and the slope(s) the training forward saved, [..., N] in y's layout (None
    without an activation; gated: s_gate and s_up). Returns (dx, dw, db) -- gated (dx, dw, dw_up, db,
    db_up) -- each in x's dtype: dx contiguous in x's shape, each dW in its weight's own layout when that
    is dense, db [N]; an output not asked for is an empty tensor (db needs the dW kernel, so need_db also
    returns dW)."""
    precision = precision_for(x.dtype, x.is_cuda)
    # Without an activation (never gated: a gate always saves its slopes) g is dy itself, already in HBM, and db
    # its column sum: one read of dy, eager's own db, made here as a torch reduction outside the fast path's plan
    # (whose outputs must all come from its kernels). The dW kernel does not sum db from a loaded dy tile: one
    # tile feeding both the dot and the elementwise sum compiles wrong on sm_90 with triton 3.6 (NOTES.md).
    db_by_sum = need_db and slope is None
    in_plan_db = need_db and not db_by_sum
    mode = runtime.backend()
    grads = _LINEAR_BACKWARD.run(
        (dy, x, w, w_up, slope, slope_up), (precision, need_dx, need_dw, in_plan_db, mode),
        lambda: _linear_backward_chosen(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, in_plan_db,
                                        path, mode))
    if db_by_sum:
        db = dy.reshape(-1, w.shape[0]).sum(0, dtype=torch.float32).to(x.dtype)  # any leading dims, 1-D too
        grads = (grads[0], grads[1], db)
    return grads


def _linear_backward_chosen(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, need_db, path, mode):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return _linear_backward(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, need_db, path)
        return fastpath.vendor(_linear_backward_vendor, dy, x, w, w_up, slope, slope_up, need_dx, need_dw, need_db,
                               path)

    def key():
        N, K = w.shape
        return tuning.ChoiceKey(M_BUCKET=sizes.m_bucket(math.prod(x.shape[:-1])), N=N, K=K, GATED=w_up is not None,
                                HAS_SLOPE=slope is not None, NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db,
                                INPUT_PRECISION=precision, dtype=x.dtype)
    return fastpath.run_chosen(LINEAR_BACKWARD_CHOICE, mode, (tuning.TILEFUSE, CUBLAS), key, x.device, run)


# The backward's vendor candidate: g = dy * slope (each gated branch's own) as one elementwise pass, then cuBLAS's
# dx = g W (gated: + g_up W_up) and dW = g^T x, db = the column sums of g. Same outputs as tilefuse's (see
# linear_backward).
LINEAR_BACKWARD_CHOICE = tuning.BackendChoice("linear_backward_backend", (tuning.TILEFUSE, CUBLAS))


def _linear_backward_vendor(dy, x, w, w_up, slope, slope_up, need_dx, need_dw, need_db, path):
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    dy2d = dy.reshape(M, N)
    if w_up is not None:
        return _gated_backward_vendor(dy2d, x, w, w_up, slope.reshape(M, N), slope_up.reshape(M, N), need_dx,
                                      need_dw, need_db, path)
    g = dy2d if slope is None else dy2d * slope.reshape(M, N)
    dx = dw = db = dy.new_empty((0,))
    if need_dx:
        dx = (g @ w).view(x.shape)
    if need_dw or need_db:
        dw = g.t() @ x.reshape(M, K)
        dw = dw if w.is_contiguous() else torch.empty_like(w).copy_(dw)  # the weight's own layout
        if need_db:
            db = g.sum(0, dtype=torch.float32).to(x.dtype)
    launches.record("linear_backward", path, CUBLAS, ("dy * slope, then " if slope is not None else "")
                    + "cuBLAS's dx and dW GEMMs")
    return dx, dw, db


def _gated_backward_vendor(dy2d, x, w, w_up, s_gate, s_up, need_dx, need_dw, need_db, path):
    """The gated backward's cuBLAS form: g = [dy * s_gate, dy * s_up] side by side in one [M, 2N] tensor (one pass,
    dy read once: gate.py), then dx = g_gate W_gate + g_up W_up as one GEMM per half, the second accumulated (the
    same calls for both weight forms, as in the forward), and both dW as one GEMM g^T x, each half a view in its
    weight's layout (a copy where the weight is not dense), db the column sums of g."""
    N, K = w.shape
    M = dy2d.shape[0]
    if dy2d.stride(1) != 1:  # autograd's dy may be expanded or strided: the pass reads rows of unit stride
        dy2d = dy2d.contiguous()
    g = torch.empty((M, 2 * N), dtype=dy2d.dtype, device=dy2d.device)
    grid, tile = _pass_grid(M, N, path)
    fastpath.launch(gated_grad_kernel, grid, (dy2d, s_gate, s_up, g, M, N, dy2d.stride(0), s_gate.stride(0), 2 * N),
                    dict(tile))
    g_gate, g_up = g[:, :N], g[:, N:]

    def none():
        return dy2d.new_empty((0,))
    dx = none()
    if need_dx:
        dx2d = g_gate @ w
        dx2d.addmm_(g_up, w_up)
        dx = dx2d.view(x.shape)
    dws, dbs = [none(), none()], [none(), none()]
    if need_dw or need_db:
        dw = g.t() @ x.reshape(M, K)  # [2N, K]: both halves in one GEMM
        for i, (half, wb) in enumerate(((dw[:N], w), (dw[N:], w_up))):
            dws[i] = half if wb.is_contiguous() else torch.empty_like(wb).copy_(half)  # the weight's own layout
        if need_db:
            db = g.sum(0, dtype=torch.float32).to(x.dtype)
            dbs = [db[:N], db[N:]]
    launches.record("linear_backward", path, CUBLAS, "dy * both slopes in one pass, then cuBLAS's dx GEMM per half "
                    "and one dW GEMM")
    return dx, dws[0], dws[1], dbs[0], dbs[1]


# Hopper's dW kernel (backward.py: grad_weight_tma_kernel), taken where its operands allow (measured faster than
# the tuned pointer dW: NOTES.md), at one tile. False leaves dW to the pointer kernel too.
BACKWARD_TMA = True
BACKWARD_TMA_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def _dense_2d(t: torch.Tensor):
    """``t`` [rows, cols] as TMA reads it: itself with a unit column stride, its transpose (a view) with a unit
    row stride, or None."""
    if t.stride(1) == 1:
        return t
    if t.stride(0) == 1:
        return t.t()
    return None


def _backward_tma(rows: tuple, either_way: tuple = ()) -> bool:
    """Whether dW takes the Hopper TMA kernel (BACKWARD_TMA): ``hopper_tma`` of the ``rows`` operands (dy, the
    slope, x) as laid out and of the ``either_way`` ones (dW) with a unit stride on either dim."""
    views = [_dense_2d(t) for t in either_way]
    return BACKWARD_TMA and all(v is not None for v in views) and hopper_tma(*rows, *views)


def _linear_backward(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, need_db, path):
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    gated = w_up is not None
    interpret = path == runtime.INTERPRETER
    dy2d = dy.reshape(M, N)
    s2d = slope.view(M, N) if slope is not None else dy2d
    su2d = slope_up.view(M, N) if slope_up is not None else s2d

    def none():  # an output not asked for: empty, and never the same tensor twice
        return dy.new_empty((0,))
    flags = dict(HAS_SLOPE=slope is not None, INPUT_PRECISION=precision,
                 UPCAST_DOT=interpret and x.dtype == torch.bfloat16)
    # The cooperative kernel's slope for dx: plain dx takes the kernel's plain form; gated dx sums two products,
    # g_gate @ W_gate + g_up @ W_up, which its GATED_DX form walks as one reduction (``coop_gated_dx``). Each gated
    # branch's dW is one product, g_branch^T x, and takes the kernel as plain dW does.
    s_coop = s2d if slope is not None and not gated else None
    dx = none()
    if need_dx:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx2d = dx.view(M, K)
        if gated and coop_gated_dx(dx2d, dy2d, s2d, su2d, w, w_up, path):
            coop.launch(dy2d, s2d, w, dx2d, b_up=w_up, s_up=su2d, config=COOP_BACKWARD_CONFIG)
            launches.record("linear_backward", path, "grad input gated (cooperative warp-specialized), g = dy * "
                            "slope for each branch in its loads", COOP_BACKWARD_CONFIG)
        elif coop_backward(dx2d, dy2d, s_coop, w, path, "dx"):
            coop.launch(dy2d, s2d, w, dx2d, config=COOP_BACKWARD_CONFIG)
            launches.record("linear_backward", path, "grad input (cooperative warp-specialized), g = dy * slope "
                            "in its loads", COOP_BACKWARD_CONFIG)
        else:
            wu = w_up if gated else w
            args = (dy2d, s2d, su2d, w, wu, dx2d, M, N, K, sizes.m_bucket(M),
                    dy2d.stride(0), dy2d.stride(1), s2d.stride(0), s2d.stride(1),
                    w.stride(0), w.stride(1), wu.stride(0), wu.stride(1), dx2d.stride(0), dx2d.stride(1))
            cfg = _launch_backward(grad_input_kernel, grad_input_tuned, args, dict(flags, GATED=gated), interpret,
                                   lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(K, meta["BLOCK_N"]),))
            launches.record("linear_backward", path, "grad input, g = dy * slope in its loads",
                            lambda: tuning.describe(cfg))
    dws, dbs = [none(), none()], [none(), none()]
    # db comes from the dW kernel only with a slope, summed from the g it makes (dy * slope); without one the
    # caller (linear_backward) sums dy itself.
    fused_db = need_db and slope is not None
    if need_dw or fused_db:
        x_rows, m_inner, s_outer, s_inner, s_k = row_addressing(x)
        two_strides = s_outer != 0 and m_inner != M
        x2d = None if two_strides or s_k != 1 else x_rows.as_strided((M, K), (s_inner, 1))
        branches = ((w, s2d), (w_up, su2d)) if gated else ((w, s2d),)
        for i, (wb, sb) in enumerate(branches):
            dw = dws[i] = torch.empty_like(wb)  # the weight's own layout when it is dense
            db = dw
            if fused_db:
                db = dbs[i] = torch.empty(N, dtype=x.dtype, device=x.device)
            if x2d is not None and coop_backward(dw, dy2d, sb if slope is not None else None, x2d, path, "dW"):
                coop.launch(dy2d, sb, x2d, dw, trans_a=True, db=db if fused_db else None,
                            config=COOP_BACKWARD_CONFIG)
                launches.record("linear_backward", path, "grad weight (cooperative warp-specialized)"
                                + (" + bias" if fused_db else "") + ", g = dy * slope in its loads",
                                COOP_BACKWARD_CONFIG)
                continue
            if x2d is not None and _backward_tma((dy2d, sb, x2d), (dw,)):
                dw_kn = dw.stride(1) != 1  # dW in its weight's Conv1D layout: dW^T [K, N], unit row stride
                cfg = BACKWARD_TMA_TILE
                fastpath.launch_persistent(grad_weight_tma_kernel, cdiv(K, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), (
                    dy2d, sb, x2d, dw, db, M, N, K, dy2d.stride(0), sb.stride(0), x2d.stride(0),
                    dw.stride(1) if dw_kn else dw.stride(0)),
                    dict(HAS_BIAS=fused_db, HAS_SLOPE=slope is not None, DW_KN=dw_kn, **cfg), x.device)
                launches.record("linear_backward", path, "grad weight (TMA, dW^T = x^T g)"
                                + (" + bias" if fused_db else "") + ", g = dy * slope in its loads",
                                lambda: tuning.describe(cfg))
                continue
            args = (dy2d, sb, x_rows, dw, db, M, N, K, sizes.m_bucket(M), m_inner, s_outer, s_inner, s_k,
                    dy2d.stride(0), dy2d.stride(1), sb.stride(0), sb.stride(1), dw.stride(0), dw.stride(1))
            cfg = _launch_backward(grad_weight_kernel, grad_weight_tuned, args,
                                   dict(flags, HAS_BIAS=fused_db, TWO_ROW_STRIDES=two_strides), interpret,
                                   lambda meta: (cdiv(N, meta["BLOCK_M"]) * cdiv(K, meta["BLOCK_N"]),))
            launches.record("linear_backward", path, "grad weight" + (" + bias" if fused_db else "")
                            + ", g = dy * slope in its loads", lambda: tuning.describe(cfg))
    if gated:
        return dx, dws[0], dws[1], dbs[0], dbs[1]
    return dx, dws[0], dbs[0]


def _launch_backward(kernel, tuned, args, flags, interpret, grid):
    """One backward GEMM: the interpreter's fixed tile, else the tuner. Returns the config used."""
    if interpret:
        cfg = configs.INTERPRETER_GEMM
        fastpath.launch(kernel, grid(cfg), args, dict(flags, **cfg))
        return cfg
    fastpath.launch(tuned, grid, args, dict(flags, UPCAST_DOT=False))
    return tuned.launched_config()


# ---- linear + cross-entropy ------------------------------------------------------------------------
# One tile shape (not tuned yet): 64 tokens x 128 vocabulary columns, K in 64-wide steps; the interpreter
# takes 64 x 64 x 32 (its cost is per program).
LCE_TILE = dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)
LCE_INTERPRETER_TILE = dict(BLOCK_M=64, BLOCK_V=64, BLOCK_K=32)


def _lce_tile(path):
    return LCE_INTERPRETER_TILE if path == runtime.INTERPRETER else LCE_TILE


def linear_cross_entropy(x2d, w, b, target, ignore_index: int, smoothing: float, softcap, path):
    """(loss per row fp32 [M], lse fp32 [M]) of ``cross_entropy(x2d @ w^T + b, target)`` for x2d [M, K] and
    w [V, K] with unit inner strides, target int [M]: 0 on rows whose target is ``ignore_index``, NaN where
    the target is outside [0, V). The vocabulary is cut into slices (enough programs for the GPU); their
    partial (max, sum of exp, target logit, logit sum) merge here."""
    from tilefuse.kernels.gemm.cross_entropy import lce_chunk_stats_kernel, lce_forward_kernel

    M, K = x2d.shape
    V = w.shape[0]
    if LCE_FORWARD == "chunked":  # cuBLAS makes each vocabulary chunk's logits; a row pass folds them
        vc = lce_vocab_chunk(M, V, x2d.element_size())
        splits = cdiv(V, vc)
        part = torch.empty((4, splits, M), dtype=torch.float32, device=x2d.device)
        tile = LCE_STATS_TILE
        buf = _logits_buffer(M, vc, x2d)
        for i, v0 in enumerate(range(0, V, vc)):
            z = _chunk_logits(x2d, w, b, v0, vc, buf)
            fastpath.launch(lce_chunk_stats_kernel, (cdiv(M, tile["BLOCK_M"]),), (
                z, target, part, M, z.shape[1], v0, i, splits, z.stride(0), float(softcap or 0.0)),
                dict(HAS_SOFTCAP=softcap is not None, **tile))
        launches.record("linear_cross_entropy", path, f"{splits} vocabulary chunks of {vc}: logits by a GEMM, "
                        "folded by a row pass", lambda: f"{tile['BLOCK_M']}x{tile['BLOCK_V']}")
    else:
        tile = _lce_tile(path)
        blocks = cdiv(M, tile["BLOCK_M"])
        vtiles = cdiv(V, tile["BLOCK_V"])
        if path == runtime.INTERPRETER:
            splits = min(4, vtiles)
        else:
            splits = max(1, min(vtiles, cdiv(2 * runtime.device_facts(x2d.device)[1], blocks)))
        v_slice = cdiv(vtiles, splits) * tile["BLOCK_V"]
        splits = cdiv(V, v_slice)
        part = torch.empty((4, splits, M), dtype=torch.float32, device=x2d.device)
        fastpath.launch(lce_forward_kernel, (blocks, splits), (
            x2d, w, b if b is not None else w, target, part, M, V, K, v_slice, x2d.stride(0), w.stride(0),
            float(softcap or 0.0)),
            dict(HAS_BIAS=b is not None, HAS_SOFTCAP=softcap is not None,
                 INPUT_PRECISION=precision_for(x2d.dtype, x2d.is_cuda),
                 UPCAST_DOT=path == runtime.INTERPRETER and x2d.dtype == torch.bfloat16, **tile))
        launches.record("linear_cross_entropy", path, f"online lse over {splits} vocabulary slices",
                        lambda: f"{tile['BLOCK_M']}x{tile['BLOCK_V']}x{tile['BLOCK_K']}")
    return _rows_from_partials(part, target, V, ignore_index, smoothing)


def _rows_from_partials(part, target, V: int, ignore_index: int, smoothing: float):
    """(loss per row, lse per row) from the slices' partials fp32 [4, splits, M] (max, sum of exp, target logit,
    logit sum): 0 on rows whose target is ``ignore_index``, NaN where it is outside [0, V)."""
    m = part[0].amax(0)
    lse = m + torch.log((part[1] * torch.exp(part[0] - m)).sum(0))
    z_t, z_sum = part[2].sum(0), part[3].sum(0)
    loss = (1.0 - smoothing) * (lse - z_t) + smoothing * (lse - z_sum / V)
    ignored = target == ignore_index
    valid = (target >= 0) & (target < V)
    loss = torch.where(ignored, 0.0, torch.where(valid, loss, float("nan")))
    return loss, lse


# Eager training over a "mean" or "sum" loss in bf16 / fp32 takes linear_cross_entropy_with_grads (the training
# form, tilefuse.ops.cross_entropy._TrainingForm); False: the forward above and the recomputing backward below.
LCE_TRAINING_FORM = True


# The training form's token chunk [rows, V]: every chunk after the first reads and rewrites dW, so fewer, larger
# chunks move fewer bytes; at the Llama-3 head (V 128256, K 4096, bf16) 256 MiB is 1040 rows, 8 chunks per 8192
# tokens, and the chunk, dW and dx together about 1.4 GB beyond the inputs.
LCE_TRAINING_CHUNK_BYTES = 256 * 2**20


def lce_token_chunk(M: int, V: int, element_size: int) -> int:
    """Tokens per chunk of the training form: the chunk's logits [rows, V] within LCE_TRAINING_CHUNK_BYTES, the
    M tokens shared evenly among as few chunks as that allows (no short last chunk: each chunk's GEMMs are one
    wave of tiles or more, and each reads and rewrites dW), a multiple of 16 rows (at least 16, at most M)."""
    most = max(16, LCE_TRAINING_CHUNK_BYTES // max(1, V * element_size) // 16 * 16)
    chunks = cdiv(M, most)
    return max(1, min(M, cdiv(cdiv(M, chunks), 16) * 16))


def linear_cross_entropy_with_grads(x2d, w, b, target, ignore_index: int, smoothing: float, softcap, need_dx, need_dw,
                                    need_db, path):
    """The training form, for losses whose rows all take one gradient (``mean`` and ``sum``): (loss per row fp32 [M],
    lse fp32 [M], dx [M, K] in x's dtype, dW [V, K] in w's, db fp32 [V]; empty where not asked), the gradients
    those of the sum of the rows' losses (every row whose target is in [0, V) and not ``ignore_index`` with
    gradient 1; the backward scales them). One token chunk at a time: its logits over the whole vocabulary by one
    cuBLAS GEMM, folded into the rows' lse (the forward's row pass) and turned into dz in place (the backward's
    gradient kernel), then dx's rows and dW (accumulated over the chunks) by two GEMMs: three GEMMs where the
    forward and the backward apart take four (the backward recomputes the logits). bf16 and fp32: fp16's range
    cannot hold dW summed over the tokens before the loss's scale is applied."""
    from tilefuse.kernels.gemm.cross_entropy import lce_chunk_stats_kernel, lce_logit_grad_kernel

    M, K = x2d.shape
    V = w.shape[0]
    dev = x2d.device
    rows = lce_token_chunk(M, V, x2d.element_size())
    loss = torch.empty((M,), dtype=torch.float32, device=dev)
    lse = torch.empty((M,), dtype=torch.float32, device=dev)
    dx = torch.empty((M, K) if need_dx else (0,), dtype=x2d.dtype, device=dev)
    dw = torch.empty((V, K) if need_dw else (0,), dtype=w.dtype, device=dev)
    db = torch.zeros((V,) if need_db else (0,), dtype=torch.float32, device=dev)
    unit = ((target != ignore_index) & (target >= 0) & (target < V)).float()  # each kept row's gradient: 1
    stats, grad = LCE_STATS_TILE, LCE_GRAD_TILE
    buf = _logits_buffer(rows, V, x2d)
    for m0 in range(0, M, rows):
        x_c, t_c, u_c = x2d[m0:m0 + rows], target[m0:m0 + rows], unit[m0:m0 + rows]
        m = x_c.shape[0]
        p_c = torch.empty((4, 1, m), dtype=torch.float32, device=dev)  # dense: the kernel's planes are m apart
        z = _chunk_logits(x_c, w, b, 0, V, buf)
        fastpath.launch(lce_chunk_stats_kernel, (cdiv(m, stats["BLOCK_M"]),), (
            z, t_c, p_c, m, V, 0, 0, 1, z.stride(0), float(softcap or 0.0)),
            dict(HAS_SOFTCAP=softcap is not None, **stats))
        loss[m0:m0 + m], lse[m0:m0 + m] = _rows_from_partials(p_c, t_c, V, ignore_index, smoothing)
        fastpath.launch(lce_logit_grad_kernel, (cdiv(m, grad["BLOCK_M"]), cdiv(V, grad["BLOCK_V"])), (
            z, t_c, lse[m0:m0 + m], u_c, m, V, V, 0, z.stride(0), float(softcap or 0.0), float(smoothing), 1.0),
            dict(HAS_SOFTCAP=softcap is not None, **grad))
        if need_dx:
            torch.mm(z, w, out=dx[m0:m0 + m])
        if need_dw:  # beta 0 on the first chunk: dW's uninitialised memory is not read
            dw.addmm_(z.t(), x_c, beta=0.0 if m0 == 0 else 1.0)
        if need_db:
            db += z.sum(0, dtype=torch.float32)
    launches.record("linear_cross_entropy", path, f"training form: {cdiv(M, rows)} token chunks of {rows}: logits by "
                    "a GEMM, folded, dz in place, dx and dW GEMMs", lambda: f"{stats['BLOCK_M']}x{stats['BLOCK_V']}, "
                    f"{grad['BLOCK_M']}x{grad['BLOCK_V']}")
    return loss, lse, dx, dw, db


LCE_CHUNK_BYTES = 128 * 2**20  # the one [T, VC] logits chunk of the backward (and of the chunked forward)
LCE_GRAD_TILE = dict(BLOCK_M=32, BLOCK_V=128)
LCE_FP16_SCALE = 2.0 ** 12  # fp16 dz chunk: |dz'| <= 4096, and softmax values down to 1.5e-8 stay normal
LCE_STATS_TILE = dict(BLOCK_M=8, BLOCK_V=256)  # the chunked forward's row pass: 80 registers on sm_90a, no spills
# The forward: "chunked" (cuBLAS GEMMs over vocabulary chunks, one [T, VC] chunk at a time, folded by a row pass)
# or "online" (lce_forward_kernel: logit tiles only on chip, tl.dot with pointer loads). Chunked by default: it
# measured faster at both heads of benchmarks/cross_entropy_head.py at the same peak memory (the online kernel's
# GEMM runs below cuBLAS; numbers in NOTES.md).
LCE_FORWARD = "chunked"


# Row pitch of a logits chunk on CUDA, in elements: 128 bytes in bf16. cuBLAS's tensor-core GEMMs need every row of
# an operand to start 16-byte aligned; a dense [rows, V] chunk at GPT-2's V of 50257 has rows 100514 bytes apart,
# and the three GEMMs that write and read it then run kernels several times slower. On a CPU each chunk is a dense
# tensor of its own: torch's CPU bf16 matmul reads a padded operand's padding (NaN there comes out in the product).
LOGITS_PITCH = 64


def _logits_buffer(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor | None:
    """On CUDA, storage for [<= rows, <= cols] logits chunks in ``like``'s dtype with rows LOGITS_PITCH-padded
    apart, made once per call and rewritten by every chunk (stream order keeps each chunk's readers before the
    next GEMM); None on a CPU."""
    if not like.is_cuda:
        return None
    return torch.empty((rows, cdiv(cols, LOGITS_PITCH) * LOGITS_PITCH), dtype=like.dtype, device=like.device)


def _chunk_logits(x2d, w, b, v0: int, vc: int, buf: torch.Tensor | None) -> torch.Tensor:
    """x2d @ W[v0:v0 + vc]^T (+ b's chunk) by cuBLAS: one vocabulary chunk's logits [M, <= vc] in x's dtype, in
    ``buf`` (:func:`_logits_buffer`, a view whose rows are its pitch apart) when there is one."""
    w_c = w[v0:v0 + vc].t()
    if buf is None:
        return torch.mm(x2d, w_c) if b is None else torch.addmm(b[v0:v0 + vc], x2d, w_c)
    z = buf[:x2d.shape[0], :w_c.shape[1]]
    return torch.mm(x2d, w_c, out=z) if b is None else torch.addmm(b[v0:v0 + vc], x2d, w_c, out=z)


def lce_vocab_chunk(M: int, V: int, element_size: int) -> int:
    """Vocabulary entries per backward chunk: the chunk [M, VC] within LCE_CHUNK_BYTES, a multiple of 128."""
    vc = LCE_CHUNK_BYTES // max(1, M * element_size)
    return max(128, min(V, vc // 128 * 128 or 128))


def linear_cross_entropy_backward(dloss, x2d, w, b, target, lse, smoothing: float, softcap, need_dx, need_dw,
                                  need_db, path):
    """(dx [M, K] in x's dtype, dW [V, K] in w's, db [V] in b's; empty where not asked) from dloss fp32 [M]
    (0 on rows that get no gradient), one vocabulary chunk at a time: the chunk's logits recomputed by a GEMM,
    made into dz in place (cross_entropy.py), then dW's rows of the chunk (one GEMM over all tokens) and dx
    (accumulated in fp32 over the chunks). No atomics: deterministic."""
    from tilefuse.kernels.gemm.cross_entropy import lce_logit_grad_kernel

    M, K = x2d.shape
    V = w.shape[0]
    vc = lce_vocab_chunk(M, V, x2d.element_size())
    tile = LCE_GRAD_TILE
    # fp16's exponent range: dloss * (softmax - onehot) is ~ 1 / (tokens * V) under "mean" and would be stored
    # as a subnormal (a bit or two of precision). In fp16 the chunk holds dz / c * LCE_FP16_SCALE instead, c the
    # largest |dloss| (a device scalar: no host synchronisation), and the GEMMs undo the scale in fp32.
    scaled = x2d.dtype == torch.float16
    if scaled:
        c = dloss.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
        dloss = dloss / c
    dx = torch.zeros((M, K) if need_dx else (0,), dtype=torch.float32, device=x2d.device)
    dw = torch.empty((V, K) if need_dw else (0,), dtype=w.dtype, device=x2d.device)
    db = torch.empty((V,) if need_db else (0,), dtype=torch.float32, device=x2d.device)
    alpha = 1.0 / LCE_FP16_SCALE if scaled else 1.0  # a power of two: exact
    buf = _logits_buffer(M, vc, x2d)
    for v0 in range(0, V, vc):
        w_c = w[v0:v0 + vc]
        z = _chunk_logits(x2d, w, b, v0, vc, buf)
        n = z.shape[1]
        fastpath.launch(lce_logit_grad_kernel, (cdiv(M, tile["BLOCK_M"]), cdiv(n, tile["BLOCK_V"])), (
            z, target, lse, dloss, M, n, V, v0, z.stride(0), float(softcap or 0.0), float(smoothing),
            LCE_FP16_SCALE if scaled else 1.0),
            dict(HAS_SOFTCAP=softcap is not None, **tile))
        if need_dw:  # fp16: dW rows = c * (dz'^T x) / scale (dz'^T x / scale, i.e. dW / c, must fit fp16)
            dw_c = dw[v0:v0 + n]
            torch.addmm(dw_c, z.t(), x2d, beta=0, alpha=alpha, out=dw_c)
            if scaled:
                dw_c.mul_(c)
        if need_dx:
            if scaled:
                dx.addcmul_(torch.addmm(z.new_zeros(()), z, w_c, beta=0, alpha=alpha), c)
            else:
                dx += torch.mm(z, w_c)
        if need_db:
            db[v0:v0 + n] = z.sum(0, dtype=torch.float32) * (c * alpha if scaled else 1.0)
    launches.record("linear_cross_entropy_backward", path, f"{cdiv(V, vc)} vocabulary chunks of {vc}: logits "
                    "recomputed (GEMM), dz in place, dW and dx GEMMs", lambda: f"{tile['BLOCK_M']}x{tile['BLOCK_V']}")
    return (dx.to(x2d.dtype) if need_dx else dx, dw,
            db.to(b.dtype) if need_db and b is not None else db)


# ---- QKV projection into head layout ---------------------------------------------------------------
_QKV = fastpath.Plans("qkv_projection")
# The Hopper QKV kernel's tile per (head dim, RoPE or QK-norm in the epilogue): (BLOCK_M, heads per tile,
# num_warps, num_stages). Plain d 128 takes two heads (128x256, as the linear TMA table's fastest tiles); with
# RoPE or QK-norm two heads spill on sm_90a and one head does not. d 256 takes 64 rows. The compile test
# (tests/test_sm90_compile.py) holds these tiles spill-free. Emptying it (before the first call, or followed by
# fastpath.clear_all(): captured plans keep their kernels) leaves every call to the pointer kernels.
QKV_TMA_TILES = {(64, False): (128, 2, 8, 4), (64, True): (128, 2, 8, 4), (128, False): (128, 2, 8, 3),
                 (128, True): (128, 1, 8, 4), (256, False): (64, 1, 8, 3), (256, True): (64, 1, 8, 3)}
QKV_TMA_BLOCK_K, QKV_TMA_GROUP_M = 64, 8
# The parts form (qkv.qkv_projection_tma_parts_kernel) for every other rotate-half case -- d 80, 96, 160, 192,
# partial rotary: (BLOCK_M, num_warps, num_stages) by the width its accumulators take (padded parts): up to 128
# columns 128 rows, wider 64 rows (as d 256 above). False leaves those cases to the pointer kernels.
QKV_TMA_PARTS = True


def qkv_tma_parts_tile(head_dim: int, rot: int, rope: bool) -> dict:
    """The parts kernel's padded part widths and tile for one projection: BLOCK_R per rotary half (16 without
    RoPE: unused), BLOCK_P for the pass-through columns (16 when RoPE covers all of d: unused)."""
    block_r = max(16, sizes.next_pow2(rot // 2)) if rope else 16
    has_pass = rot < head_dim
    block_p = max(16, sizes.next_pow2(head_dim - rot)) if has_pass else 16
    width = (2 * block_r if rope else 0) + (block_p if has_pass else 0)
    block_m, stages = (128, 4) if width <= 128 else (64, 3)
    return dict(BLOCK_R=block_r, BLOCK_P=block_p, HAS_PASS=has_pass, BLOCK_M=block_m, num_warps=8,
                num_stages=stages)


def qkv_projection(x2d, seq_len, weights, biases, heads, head_dim, rotary, interleaved, qk_norm, layout,
                   make_outputs, path):
    """(q, k, v) from ``make_outputs()`` -- each [B, h, N, d], or with ``layout`` "bnhd" the [B, h, N, d] view
    of a [B, N, h, d] tensor -- written from x2d [M = B * N, K] (unit column stride) by qkv.py: one launch per
    projection, RoPE (``rotary`` (cos, sin) [N, r] or [B, N, r], or None) and QK-norm (``qk_norm`` (q weight,
    k weight, eps) or None) on q and k. Each weight [h * d, K] has a unit stride on one of its two dims (nn.Linear's layout, or the transposed view of
    GPT-2's Conv1D weight) and is read in place. Repeated calls replay (kernels/fastpath.py)."""
    cos, sin = rotary if rotary is not None else (None, None)
    q_w, k_w, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    inputs = (x2d, *weights, *biases, cos, sin, q_w, k_w)
    scalars = (seq_len, tuple(heads), head_dim, bool(interleaved), float(eps), layout,
               precision_for(x2d.dtype, x2d.is_cuda))
    return _QKV.run(inputs, scalars, lambda: _qkv_projection(x2d, seq_len, weights, biases, heads, head_dim,
                                                               rotary, interleaved, qk_norm, make_outputs(), path))


def _qkv_projection(x2d, seq_len, weights, biases, heads, head_dim, rotary, interleaved, qk_norm, outs, path):
    from tilefuse.kernels.gemm.qkv import (qkv_projection_head_kernel, qkv_projection_kernel,
                                           qkv_projection_tma_kernel, qkv_projection_tma_parts_kernel)

    M, K = x2d.shape
    interpret = path == runtime.INTERPRETER
    tile = dict(BLOCK_M=64, BLOCK_K=32 if interpret else 64)
    forms = []
    for i, (w, b, h, out) in enumerate(zip(weights, biases, heads, outs)):
        qk = i < 2
        use_rope = qk and rotary is not None
        rot = rotary[0].shape[-1] if use_rope else 0  # v is never rotated: all its columns pass through
        use_norm = qk and qk_norm is not None
        cos, sin = rotary if use_rope else (x2d, x2d)
        stride_cb, stride_cn = ((cos.stride(0), cos.stride(1)) if cos.dim() == 3 else (0, cos.stride(0))) \
            if use_rope else (0, 0)
        norm_w = qk_norm[i] if use_norm else x2d
        flags = dict(HAS_BIAS=b is not None, HAS_ROPE=use_rope, INTERLEAVED=bool(interleaved), HAS_NORM=use_norm)
        out_strides = (out.stride(0), out.stride(1), out.stride(2), stride_cb, stride_cn,
                       float(qk_norm[2]) if use_norm else 0.0)
        w_kn = w.stride(1) != 1  # the transposed view of a Conv1D weight: unit stride down the rows
        tma_tile = QKV_TMA_TILES.get((head_dim, use_rope or use_norm))
        # Hopper's shared memory (the tiles are sized for its 227 KB), 16-bit operands, at least one full row
        # tile (decode-sized M keeps the pointer kernel's 64-row tiles, one program per head).
        on_hopper = hopper_tma(x2d, w.t() if w_kn else w)
        if tma_tile is not None and (not use_rope or rot == head_dim) and on_hopper and M >= tma_tile[0]:
            block_m, per_tile, warps, stages = tma_tile
            per_tile = min(per_tile, h)
            fastpath.launch_persistent(qkv_projection_tma_kernel, cdiv(M, block_m) * cdiv(h, per_tile), (
                x2d, w, b if b is not None else w, out, cos, sin, norm_w, M, seq_len, K, h, x2d.stride(0),
                w.stride(1) if w_kn else w.stride(0), *out_strides),
                dict(flags, W_KN=w_kn, BLOCK_M=block_m, HEAD_DIM=head_dim, HEADS_PER_TILE=per_tile,
                     BLOCK_K=QKV_TMA_BLOCK_K, GROUP_M=QKV_TMA_GROUP_M, num_warps=warps, num_stages=stages),
                x2d.device)
            forms.append(f"tma {block_m}x{per_tile * head_dim}x{QKV_TMA_BLOCK_K} w{warps} s{stages}")
            continue
        parts = qkv_tma_parts_tile(head_dim, rot, use_rope)
        if QKV_TMA_PARTS and on_hopper and not (use_rope and interleaved) and M >= parts["BLOCK_M"]:
            fastpath.launch_persistent(qkv_projection_tma_parts_kernel, cdiv(M, parts["BLOCK_M"]) * h, (
                x2d, w, b if b is not None else w, out, cos, sin, norm_w, M, seq_len, K, h,
                x2d.stride(0), w.stride(1) if w_kn else w.stride(0), *out_strides),
                dict(HEAD_DIM=head_dim, ROT=rot, HAS_BIAS=b is not None, HAS_ROPE=use_rope, HAS_NORM=use_norm,
                     W_KN=w_kn, BLOCK_K=QKV_TMA_BLOCK_K, GROUP_M=QKV_TMA_GROUP_M, **parts), x2d.device)
            widths = ([f"{parts['BLOCK_R']}+{parts['BLOCK_R']}"] if use_rope else []) + \
                ([str(parts["BLOCK_P"])] if parts["HAS_PASS"] else [])
            forms.append(f"tma parts {parts['BLOCK_M']}x({'+'.join(widths)})x{QKV_TMA_BLOCK_K} "
                         f"w{parts['num_warps']} s{parts['num_stages']}")
            continue
        if w_kn and (K - 1) * w.stride(1) >= 2**31:  # the pointer kernels' K offsets are 32-bit
            w = w.contiguous()
        flags.update(INPUT_PRECISION=precision_for(x2d.dtype, x2d.is_cuda),
                     UPCAST_DOT=interpret and x2d.dtype == torch.bfloat16, **tile)
        block_d = max(16, sizes.next_pow2(head_dim))
        common = (M, seq_len, K, head_dim)
        strides = (x2d.stride(0), w.stride(0), w.stride(1), *out_strides)
        if not use_rope or rot == head_dim == block_d:
            # One K loop over the head's columns (RoPE, if any, over all of them: the pairs split in registers).
            # 4 warps hold a 64-row head tile up to d 128 without spilling on sm_90a; d 256 takes 8.
            launch_opts = {} if interpret else dict(num_warps=8 if block_d >= 256 else 4, num_stages=3)
            fastpath.launch(qkv_projection_head_kernel, (cdiv(M, tile["BLOCK_M"]), h), (
                x2d, w, b if b is not None else w, out, cos, sin, norm_w, *common, *strides),
                dict(flags, BLOCK_D=block_d, **launch_opts))
            forms.append(f"one loop {tile['BLOCK_M']}x{block_d}x{tile['BLOCK_K']}")
            continue
        # Partial rotary (r < d) or a d that is not a power of two with RoPE: the two rotary halves and the
        # pass-through columns as three accumulators (a K loop each).
        block_r = max(16, sizes.next_pow2(max(rot // 2, 1)))
        block_p = max(16, sizes.next_pow2(max(head_dim - rot, 1)))
        fastpath.launch(qkv_projection_kernel, (cdiv(M, tile["BLOCK_M"]), h), (
            x2d, w, b if b is not None else w, out, cos, sin, norm_w, *common, rot, *strides),
            dict(flags, BLOCK_R=block_r, BLOCK_P=block_p))
        forms.append(f"three parts {tile['BLOCK_M']} rows, K by {tile['BLOCK_K']}")
    launches.record("qkv_projection", path, "head layout, RoPE and QK-norm in the epilogue",
                    lambda: f"q/k/v: {', '.join(forms)}")
    return tuple(outs)

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
This is the portable path (Ampere, Hopper, the interpreter).
Split-K (small M): K slices run as separate programs that store fp32 partials; the last program of a
tile to arrive sums them and runs the epilogue, so decode shapes take one launch, not a GEMM and a
reduction kernel (extra traffic 2 * SPLIT_K * M * N * 4 bytes, small for small M).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver

from tilefuse import tuning
from tilefuse.kernels import relaunch
from tilefuse.kernels.tiling import cdiv, grouped_tile
from tilefuse.kernels.activations import GATED_ACTIVATIONS, apply_activation, apply_gated


@triton.jit
def linear_epilogue_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    wu_ptr, bu_ptr,  # gated only: the "up" weight [N, K] and bias (any valid pointer otherwise)
    ws_ptr,  # split-K only: fp32 partial sums [SPLIT_K, M, N] (then the up partials, if GATED)
    counter_ptr,  # split-K only: int32 per output tile, 0 between launches (see the end of the kernel)
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
            _bias_activation_store(acc, acc_up, b_ptr, bu_ptr, y_ptr, offs_m64, offs_n, mask_m, mask_n,
                                   stride_ym, stride_yn, HAS_BIAS, ACTIVATION, GATED)
    else:
        _bias_activation_store(acc, acc_up, b_ptr, bu_ptr, y_ptr, offs_m64, offs_n, mask_m, mask_n,
                               stride_ym, stride_yn, HAS_BIAS, ACTIVATION, GATED)


@triton.jit
def _bias_activation_store(acc, acc_up, b_ptr, bu_ptr, y_ptr, offs_m64, offs_n, mask_m, mask_n,
                           stride_ym, stride_yn, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                           GATED: tl.constexpr):
    """The epilogue on the fp32 accumulator(s): nothing touches HBM but the bias vectors and the store."""
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
        if GATED:
            acc_up = acc_up + tl.load(bu_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = apply_gated(acc, acc_up, ACTIVATION)
    else:
        acc = apply_activation(acc, ACTIVATION)
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


SMEM_LIMIT = 232448  # Hopper: the most shared memory one block may opt in to (227 KB)


def portable_smem_bytes(bm: int, bn: int, bk: int, stages: int, elem_bytes: int, gated: bool,
                        tensor_cores: bool = True) -> int:
    """Shared memory of the portable kernel's pipeline, as the compiler allocates it: ``stages`` buffers
    (``stages - 1`` for fp32 "ieee", which runs on the FMA units) of one x tile and one (gated: two)
    weight tiles. Checked against ptxas for sm_90a: exact for fp32 ieee and tf32; 16-bit operands
    allocate less (benchmarks/NOTES.md, "portable shared memory")."""
    buffers = stages if tensor_cores else stages - 1
    return buffers * (bm * bk + (2 if gated else 1) * bn * bk) * elem_bytes


def prune_gated_configs(configs, named_args, **kwargs):
    """Gated epilogues keep two fp32 accumulators: keep tiles with at most 64 accumulator elements per
    thread each. Offline sm_90a compiles (benchmarks/compile_check.py) showed 128x128 with 4 warps and
    64x256 spilling (255 registers), and 64x256 needing 311 KB of shared memory; 128x128 with 8 warps
    and 64x128 with 4 fit (235 registers, no spills)."""
    if kwargs.get("GATED"):
        fits = [c for c in configs
                if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32 * c.num_warps and c.kwargs["BLOCK_N"] <= 128]
        return fits or configs[-1:]
    return configs


def prune_portable_configs(configs, named_args, extra_smem=None, **kwargs):
    """The gated register rule, then shared memory: on the H200, fp32 gated 128x128x64 with 4 stages
    (ieee, 288 KB) and fp32 128x256x64 with 3 stages under tf32 (288 KB) failed to launch (the first
    config, pinned in the GPU tests). ``extra_smem(config, elem_bytes)``: bytes a kernel built on this
    main loop adds (layer_norm_linear re-lays out its normalized x tile through shared memory)."""
    x = named_args.get("x_ptr")
    elem = x.element_size() if hasattr(x, "element_size") else 4
    gated = bool(kwargs.get("GATED"))
    tensor_cores = not (elem == 4 and kwargs.get("INPUT_PRECISION", "ieee") == "ieee")
    kept = prune_gated_configs(configs, named_args, **kwargs)
    if not tensor_cores:
        # fp32 "ieee" runs tl.dot on the FMA units: 128x256 / 256x128 tiles spill ~4 KB per thread and take
        # 3x longer to compile than 128x128 (sm_90a, offline); the H200 picked 128x128x32 anyway.
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128] or kept
    fits = [c for c in kept
            if portable_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
                                   c.num_stages, elem, gated, tensor_cores)
            + (extra_smem(c, elem) if extra_smem else 0) <= SMEM_LIMIT]
    return fits or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]


# GPU path: the same kernel behind a small autotune space, keyed on the row-count bucket rather than M
# itself so that a new batch size reuses the tuned tile.
linear_epilogue_autotuned = tuning.autotune(
    name="linear_portable",
    configs=tuning.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "INPUT_PRECISION", "SPLIT_K"],
    prune_configs_by={"early_config_prune": prune_portable_configs},
)(linear_epilogue_kernel)

# Small M (decode): few output tiles for 132 SMs, so K is split too. Skinny row tiles (tl.dot needs 16
# rows), narrow column tiles for more programs, long K steps to keep loads in flight.
linear_splitk_autotuned = tuning.autotune(
    name="linear_splitk",
    configs=tuning.SPLIT_K_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "ACTIVATION", "INPUT_PRECISION", "SPLIT_K"],
    prune_configs_by={"early_config_prune": prune_portable_configs},
)(linear_epilogue_kernel)


def split_k_for(M: int, N: int, K: int, num_sms: int) -> int:
    """How many K slices for a small-M GEMM: enough programs for ~2 waves (with 64-wide column tiles),
    each slice still >= 512 deep. 1 (no split) above 64 rows, where the M x N tiles fill the GPU."""
    if M > 64 or K < 1024:
        return 1
    tiles = cdiv(M, 64) * cdiv(N, 64)
    return max(1, min(16, cdiv(2 * num_sms, tiles), K // 512))


def launch_linear(x, m_inner, stride_xo, stride_xm, stride_xk, w, b, y, M, N, K,
                  activation, input_precision, interpret, w_up=None, b_up=None, split_k=1, capture=False):
    """Launch on 2-D-addressable operands; returns the config used (a dict or triton.Config).

    ``w_up``/``b_up`` are the up-projection of a gated activation (``activation`` in GATED_ACTIVATIONS).
    ``capture`` (compiled, non-gated): returns (config, replay), where ``replay.call(x, w, b, y)`` issues this
    launch again on tensors of the same shapes, strides, dtypes and 16-byte alignment
    (kernels/relaunch.py), or None when it cannot.
    """
    gated = activation in GATED_ACTIVATIONS
    w_up = w_up if gated else w
    common = dict(
        HAS_BIAS=b is not None,
        ACTIVATION=activation or "none",
        GATED=gated,
        INPUT_PRECISION=input_precision,
    )
    ws = counters = y
    k_split_len = K
    if split_k > 1:
        # Slices are whole multiples of the largest BLOCK_K in use, so no K step straddles two slices.
        k_split_len = cdiv(cdiv(K, split_k), tuning.SPLIT_K_ALIGN) * tuning.SPLIT_K_ALIGN
        split_k = cdiv(K, k_split_len)
        stream = stream_id(y.device)
        ws = split_k_workspace(y.device, ((2 if gated else 1) * split_k, M, N), stream)
        counters = tile_counters(y.device, cdiv(M, MIN_TILE) * cdiv(N, MIN_TILE), stream)
    common["SPLIT_K"] = split_k
    args = (x, w, b if b is not None else y, y, w_up, b_up if b_up is not None else y, ws, counters,
            M, N, K, tuning.m_bucket(M), k_split_len, m_inner,
            stride_xo, stride_xm, stride_xk, w.stride(0), w.stride(1), w_up.stride(0), w_up.stride(1),
            y.stride(0), y.stride(1))
    if interpret:
        cfg = tuning.INTERPRETER_GEMM
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), split_k)
        upcast = x.dtype == torch.bfloat16
        linear_epilogue_kernel[grid](*args, **common, UPCAST_DOT=upcast, **cfg)
        chosen = cfg
    else:
        def grid(meta):
            return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), split_k)

        kernel = linear_splitk_autotuned if split_k > 1 else linear_epilogue_autotuned
        common["UPCAST_DOT"] = False
        if capture and not gated:
            # Tensor arguments: x, w, bias (y when absent), y, w_up (= w), b_up (= y), workspace, counters.
            r = relaunch.launch_and_capture(kernel, grid, args, common, positions=tuple(range(8)))
            return kernel.best_config, None if r is None else _launch_linear_replay(r, split_k, tuple(ws.shape))
        kernel[grid](*args, **common)
        chosen = kernel.best_config
    if capture:
        return chosen, None
    return chosen


def _launch_linear_replay(r, split_k, ws_shape):
    """The Replay of a captured launch_linear: this stream's workspace and counters per call when K is
    split (the captured ones belong to the capture's stream)."""
    if split_k == 1:
        def replay(x, w, b, y):
            r(x, w, y if b is None else b, y, w, y, y, y)
        return relaunch.Replay(r, replay)
    M, N = ws_shape[1], ws_shape[2]
    tiles = cdiv(M, MIN_TILE) * cdiv(N, MIN_TILE)

    def replay_split(x, w, b, y):
        stream = stream_id(y.device)
        r(x, w, y if b is None else b, y, w, y, split_k_workspace(y.device, ws_shape, stream),
          tile_counters(y.device, tiles, stream))
    return relaunch.Replay(r, replay_split)


MIN_TILE = 16  # no config tiles M or N finer (tl.dot needs 16): bounds the number of output tiles
_COUNTERS: dict = {}
_WORKSPACES: dict = {}


def stream_id(device: torch.device) -> int:
    """The current stream's handle on ``device`` (0 off the GPU): Triton's own getter, a fraction of
    ``torch.cuda.current_stream(device)``'s host cost on the decode GEMM's launch path."""
    if device.type != "cuda":
        return 0
    return driver.active.get_current_stream(device.index if device.index is not None else torch.cuda.current_device())


def split_k_workspace(device: torch.device, shape: tuple, stream: int) -> torch.Tensor:
    """The fp32 partial sums of a split-K launch, ``shape`` (slices, M, N): a view of one buffer per (device,
    stream), grown as needed. Launches on one stream run in order and each writes every partial it reads,
    so they can share it; two streams must not. Saves an allocation per decode call."""
    key = (device.type, device.index, stream)
    entry = _WORKSPACES.get(key)  # (buffer, {shape: view of it})
    view = None if entry is None else entry[1].get(shape)
    if view is not None:
        return view
    numel = shape[0] * shape[1] * shape[2]
    if entry is None or entry[0].numel() < numel:
        entry = (torch.empty(numel, dtype=torch.float32, device=device), {})
        _WORKSPACES[key] = entry
    view = entry[0][:numel].view(shape)
    entry[1][shape] = view
    return view


def tile_counters(device: torch.device, tiles: int, stream: int | None = None) -> torch.Tensor:
    """Zeroed int32 split-K arrival counters, one per output tile, kept per (device, stream): every
    launch leaves them at zero again, so one zeroing serves all later launches; two streams running
    split-K at once must not share them."""
    if stream is None:
        stream = stream_id(device)
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf

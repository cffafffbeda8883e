"""GEMM config spaces, their pruning rules and the shared-memory models behind them (Hopper).

Used by the tuners in kernels/gemm/launch/; the rules were checked against sm_90a compiles
(tests/test_sm90_compile.py) and H200 launch failures.
"""
from __future__ import annotations

import triton

from tilefuse.sizes import next_pow2

INTERPRETER_GEMM = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)


def _gemm_config(bm, bn, bk, warps, stages, group=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group),
                         num_warps=warps, num_stages=stages)


# Portable GEMM space: a few shapes that cover large square-ish problems (128x256), mid-size (128x128)
# and skinny M (64xN). Configs that do not fit in shared memory for fp32 are dropped by the autotuner
# (OutOfResources) rather than listed per dtype.
PORTABLE_GEMM_CONFIGS = [
    _gemm_config(128, 256, 64, 8, 3),
    _gemm_config(256, 128, 64, 8, 3),
    _gemm_config(128, 128, 64, 8, 4),
    _gemm_config(128, 128, 32, 4, 4),
    _gemm_config(64, 128, 64, 4, 4),
    _gemm_config(64, 64, 64, 4, 4),
    _gemm_config(32, 64, 32, 4, 4),
]


# Hopper TMA persistent GEMM space (tma.py), as dicts so benchmarks can pin one.
# 128x256x64 with 3 stages is the classic Hopper bf16 shape (two consumer warpgroups of 64 rows);
# 128x128 serves mid-size N; 64-row tiles serve small M (wgmma's minimum M is 64).
# Small-M split-K GEMM (decode shapes): 16/32/64-row tiles, narrow columns for more programs, long K
# steps to keep loads in flight. SPLIT_K_ALIGN: K slices are multiples of it (the largest BLOCK_K here
# and in INTERPRETER_GEMM), so no K step straddles two slices.
SPLIT_K_GEMM_CONFIGS = [
    _gemm_config(bm, bn, bk, 4, stages, group=1)
    for bm, bn, bk, stages in ((16, 64, 128, 4), (16, 32, 128, 5), (32, 64, 128, 4), (64, 64, 128, 3),
                               (16, 128, 64, 4))
]
SPLIT_K_ALIGN = 128

# Decode kernel (decode.py) by its row tile: 32 columns per program (4096 / 32 = 128 programs for 132 SMs) and the
# K tile and depth that measured fastest on the H200 at K = N = 4096 (benchmarks/decode_gemv.py): 512-deep tiles
# at 4 stages up to 16 rows; with 32 or 64 rows the x tile grows, and 128-deep tiles at 6 stages fit (144 KB).
DECODE_GEMM_CONFIGS = {16: dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=4),
                       64: dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=6)}
DECODE_INTERPRETER = dict(BLOCK_N=16, BLOCK_K=32)

TMA_GEMM_CONFIGS = [
    dict(bm=128, bn=256, bk=64, stages=3, warps=8),
    dict(bm=128, bn=128, bk=64, stages=4, warps=8),
    dict(bm=128, bn=128, bk=64, stages=4, warps=4),
    dict(bm=64, bn=128, bk=64, stages=4, warps=4),
    dict(bm=64, bn=256, bk=64, stages=4, warps=4),
    # One 128x128 store instead of two halves. The compiler gives the subtiled epilogue one staging buffer,
    # so the second half waits for the first half's TMA store to finish (sm_90a TTGIR: a
    # tma_store_wait{0} between them); with short K loops (K <= 1024) that stall is a visible share of a
    # tile. Unsplit, the only wait is at the next tile's epilogue. sm_90a: 133 registers, no spills.
    dict(bm=128, bn=128, bk=64, stages=4, warps=8, subtile=False),
    # Four stages on the largest tile: 229 KB shared (the H200 allows 227 KiB = 232 KB), with and without
    # NORM; no spills with NORM and a GELU epilogue (tests/test_sm90_compile.py).
    dict(bm=128, bn=256, bk=64, stages=4, warps=8),
]


def tma_config(bm, bn, bk, stages, warps, subtile=True, ws=False, group=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, EPILOGUE_SUBTILE=subtile,
                              WARP_SPECIALIZE=ws), num_stages=stages, num_warps=warps)


SMEM_LIMIT = 232448  # Hopper: the most shared memory one block may opt in to (227 KB)


def portable_smem_bytes(bm: int, bn: int, bk: int, stages: int, elem_bytes: int, gated: bool,
                        tensor_cores: bool = True) -> int:
    """Shared memory of the portable kernel's pipeline, as the compiler allocates it: ``stages`` buffers
    (``stages - 1`` for fp32 "ieee", which runs on the FMA units) of one x tile and one (gated: two)
    weight tiles. Checked against ptxas for sm_90a: exact for fp32 ieee and tf32; 16-bit operands
    allocate less."""
    buffers = stages if tensor_cores else stages - 1
    return buffers * (bm * bk + (2 if gated else 1) * bn * bk) * elem_bytes


def prune_gated_configs(configs, named_args, **kwargs):
    """Gated epilogues keep two fp32 accumulators: keep tiles with at most 64 accumulator elements per
    thread each. sm_90a compiles (benchmarks/compile_check.py) show 128x128 with 4 warps and
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
        # 3x longer to compile than 128x128 (sm_90a), and 128x128x32 is faster on the H200 anyway.
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128] or kept
    fits = [c for c in kept
            if portable_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
                                   c.num_stages, elem, gated, tensor_cores)
            + (extra_smem(c, elem) if extra_smem else 0) <= SMEM_LIMIT]
    return fits or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]


def prune_norm_linear_configs(configs, named_args, **kwargs):
    """The portable GEMM's rules plus one x tile: the normalized x tile goes through shared memory on its
    way to tl.dot (fp32 128x128x64, 4 stages: 230,912 B compiled for sm_90a against 196,608 modeled)."""
    return prune_portable_configs(configs, named_args,
                                  extra_smem=lambda c, elem: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_K"] * elem,
                                  **kwargs)


# One fixed tile: the fold moves N*K elements once per call (2-4% of the GEMM at the shapes), so
# it is not worth a tuner; 8 rows x 512 columns with 4 warps gives 16-byte loads and N/8 programs.
FOLD_BLOCK_N, FOLD_BLOCK_K, FOLD_WARPS = 8, 512, 4


def backward_smem_bytes(bm: int, bn: int, bk: int, stages: int, elem_bytes: int, a_tiles: int,
                        tensor_cores: bool = True) -> int:
    """Shared memory of a backward GEMM's pipeline (backward.py): every loaded tile is staged, ``a_tiles``
    of bm x bk (dy, and the slope the A operand is made from) and one of bk x bn (the weight or x);
    ``stages - 1`` buffers on the FMA path, as the forward's model."""
    buffers = stages if tensor_cores else stages - 1
    return buffers * (a_tiles * bm * bk + bn * bk) * elem_bytes


def prune_backward_configs(configs, named_args, **kwargs):
    """The forward's tile rules for the backward GEMMs, with their own shared-memory model: two A-side
    tiles staged per step when there is a slope to multiply. The operand size is dy's."""
    dy = named_args.get("dy_ptr")
    elem = dy.element_size() if hasattr(dy, "element_size") else 4
    a_tiles = 2 if kwargs.get("HAS_SLOPE") else 1
    tensor_cores = not (elem == 4 and kwargs.get("INPUT_PRECISION", "ieee") == "ieee")
    kept = configs
    if not tensor_cores:  # as the forward: fp32 "ieee" on the FMA units spills on the largest tiles
        kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128] or configs
    fits = [c for c in kept
            if backward_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages,
                                   elem, a_tiles, tensor_cores) <= SMEM_LIMIT]
    return fits or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]


# ---- FP8 (e4m3) GEMM (fp8.py) ----------------------------------------------------------------------
# BLOCK_K 128: one 128-byte swizzle row of e4m3 per tile row, and half as many K steps (barrier waits, wgmma
# issues) as 64 would take. 128x256 is the bf16 kernel's fastest shape at twice the K depth for the same bytes;
# 256x128 the same with the tile's long side on M; 128x128 for mid-size N, 64-row tiles for small M.
# tests/test_fp8_linear.py compiles them for sm_90a (registers, spills, shared memory).
FP8_TMA_GEMM_CONFIGS = [
    dict(bm=128, bn=256, bk=128, stages=3, warps=8),
    dict(bm=128, bn=256, bk=128, stages=4, warps=8),
    dict(bm=256, bn=128, bk=128, stages=3, warps=8),
    dict(bm=128, bn=128, bk=128, stages=4, warps=8),
    dict(bm=128, bn=128, bk=128, stages=4, warps=8, subtile=False),
    dict(bm=64, bn=256, bk=128, stages=4, warps=4),
    dict(bm=64, bn=128, bk=128, stages=4, warps=4),
]
# The pointer kernel (any strides and sizes; Ada, or operands TMA cannot take).
FP8_PORTABLE_GEMM_CONFIGS = [
    _gemm_config(128, 128, 128, 8, 3),
    _gemm_config(128, 64, 128, 4, 4),
    _gemm_config(64, 128, 128, 4, 4),
    _gemm_config(64, 64, 128, 4, 4),
]
# The interpreter's fixed tiles (its cost is per program): the pointer kernel's and the TMA kernel's.
FP8_INTERPRETER_GEMM = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)
FP8_INTERPRETER_TMA = dict(bm=64, bn=64, bk=128, stages=1, warps=4)


def fp8_tma_config(bm, bn, bk, stages, warps, subtile=True, group=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, EPILOGUE_SUBTILE=subtile),
                         num_stages=stages, num_warps=warps)


FP8_TMA_SMEM_SLACK = 2048  # barriers and the like: sm_90a compiles of the space allocate 24-1048 B past the tiles


def fp8_tma_smem_bytes(bm: int, bn: int, bk: int, stages: int, subtile: bool, out_bytes: int) -> int:
    """Shared memory of the FP8 TMA kernel as modeled: ``stages`` buffers of one x and one w tile (1 byte an
    element), one epilogue staging buffer of the stored tile (half of it with subtiling) and FP8_TMA_SMEM_SLACK.
    (sm_90a, bf16 out: 128x256x128 s4 compiles to 229,408 B, modeled 231,424.)"""
    return stages * (bm + bn) * bk + bm * (bn // 2 if subtile else bn) * out_bytes + FP8_TMA_SMEM_SLACK


def _fp8_register_fit(configs, kwargs):
    """Without FAST_ACCUM each K step adds a partial accumulator to the main one: two fp32 tiles, so (as the gated
    GEMM's two) at most 64 accumulator elements per thread each. sm_90a: 128x256 (8 warps) and 64x256 (4) spill
    132-164 B then, and 256x128 serializes its wgmma; 128x128 takes 168 registers, 64x128 161, no spills."""
    if kwargs.get("FAST_ACCUM", True):
        return configs
    fits = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32 * c.num_warps]
    return fits or configs[-1:]


def prune_fp8_tma_configs(configs, named_args, **kwargs):
    """The register rule (:func:`_fp8_register_fit`), then the configs whose modeled shared memory
    (:func:`fp8_tma_smem_bytes`, at y's element size) fits sm_90's 227 KB; the smallest if none does."""
    y = named_args.get("y_ptr")
    out_bytes = y.element_size() if hasattr(y, "element_size") else 2

    def smem(c):
        k = c.kwargs
        return fp8_tma_smem_bytes(k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], c.num_stages, k["EPILOGUE_SUBTILE"],
                                  out_bytes)
    kept = _fp8_register_fit(configs, kwargs)
    fits = [c for c in kept if smem(c) <= SMEM_LIMIT]
    return fits or [min(kept, key=smem)]


def prune_fp8_portable_configs(configs, named_args, **kwargs):
    """The register rule, then the pipeline's shared memory: ``stages`` buffers of one x and one w tile, 1 byte an
    element."""
    kept = _fp8_register_fit(configs, kwargs)
    fits = [c for c in kept
            if c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] <= SMEM_LIMIT]
    return fits or kept[-1:]


def quantize_rows_tile(K: int, interpret: bool) -> dict:
    """The row quantizer's tile: a whole row per chunk up to 4096 (the interpreter: 512) columns, else chunks of
    that; rows per program so a program holds about 8192 elements (4 warps, 16-byte loads)."""
    block_k = min(max(16, next_pow2(K)), 512 if interpret else 4096)
    block_m = max(1, min(64, 8192 // block_k))
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, ONE_CHUNK=K <= block_k)

"""FlashAttention forward: softmax(q k^T * scale + mask) v with an online softmax, one pass over K/V.

Fuses: QK^T, scale, causal/window/attn_mask masking, softmax and PV into one kernel; the [Nq, Nk]
scores never leave the chip. HBM bytes (element size s, G = Hq / Hkv): unfused eager writes and reads
the scores and probabilities, >= (Q + K + V + O)*s + 4 * B*Hq*Nq*Nk*s; fused: (Q + K + V + O)*s
(+ 4*B*Hq*Nq for the fp32 log-sum-exp, + the mask tile reads when a mask is given). K/V are read
per query head group from the same KV head (GQA), never repeated in memory.
Tiling: one BLOCK_M x head_dim query tile per program, loaded once; K/V walked in BLOCK_N tiles in
three stages (masked lead-in, unmasked middle, masked tail) so most tiles skip all masking.
Limits: head_dim <= 256 (padded to a power of two >= 16 and masked), any Nq, Nk >= 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilefuse import runtime, tuning
from tilefuse.kernels.tiling import cdiv, ensure_descriptor_allocator, next_pow2

LOG2E = 1.4426950408889634
# A finite additive mask below this would overflow to -inf once multiplied by log2(e); clamping keeps
# Hugging Face's finfo.min padding finite (a fully masked row then averages uniformly, as torch does).
MASK_FLOOR = tl.constexpr(-2.3e38)


@triton.jit
def _attend_stage(
    acc, l_i, m_i, q,
    k_src, v_src, mask_ptrs,
    b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
    start_n, end_n, N_K, window_left, window_right, qk_scale,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
    APPLY_BOUNDS: tl.constexpr,   # this stage holds tiles cut by the window or by N_K
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    EVEN_D: tl.constexpr, USE_DESC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Folds the K/V tiles [start_n, end_n) into the online-softmax state (acc, l_i, m_i).

    Scores live in the log2 domain (scale * log2(e) folded into qk_scale) so exp is one exp2.
    """
    offs_n_base = tl.arange(0, BLOCK_N)
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + offs_n_base
        # ---- load K and V tiles [BLOCK_N, BLOCK_D] --------------------------------------------
        if USE_DESC:
            # TMA: rows past N_K and columns past head_dim come back as zeros.
            k = k_src.load([b, h_kv, start, 0]).reshape(BLOCK_N, BLOCK_D)
            v = v_src.load([b, h_kv, start, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            kv_mask = mask_d[None, :]
            if APPLY_BOUNDS:
                kv_mask = kv_mask & (offs_n < N_K)[:, None]
            k_ptrs = k_src + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
            v_ptrs = v_src + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
            if EVEN_D and not APPLY_BOUNDS:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
                v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # ---- scores in the log2 domain ------------------------------------------------------
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if APPLY_BOUNDS:
            key_pos = offs_n[None, :]
            visible = key_pos < N_K
            if HAS_LEFT:
                visible = visible & (key_pos >= pos_m[:, None] - window_left)
            if HAS_RIGHT:
                visible = visible & (key_pos <= pos_m[:, None] + window_right)
            s = tl.where(visible, s, float("-inf"))
        if HAS_MASK:
            tile_mask = mask_m[:, None] & (offs_n < N_K)[None, :]
            mvals = tl.load(mask_ptrs + offs_n[None, :] * stride_maskn, mask=tile_mask, other=0)
            if MASK_IS_BOOL:
                s = tl.where(mvals != 0, s, float("-inf"))
            else:
                mvals = mvals.to(tl.float32)
                bias = tl.maximum(mvals, MASK_FLOOR) * 1.4426950408889634
                s = s + tl.where(mvals == float("-inf"), float("-inf"), bias)

        # ---- online softmax: the one place m_i, l_i, acc change -----------------------------
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if APPLY_BOUNDS or HAS_MASK:
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(s - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST_DOT:
            p_dot = p
        else:
            p_dot = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def query_block_and_head(N_Q, BLOCK_M: tl.constexpr, FLAT_GRID: tl.constexpr):
    """(query block, b * Hq + h) of this program. Query blocks run in reverse order: with causal masks the
    last blocks carry the most keys, so they start first and the light ones fill the tail of the launch.
    The q-blocks of one head are consecutive programs (axis 0 runs fastest), so programs in flight share
    a K/V head in L2. FLAT_GRID: everything on axis 0, for B * Hq past axis 1's limit of 65535 (batched
    decode). Shared by the portable kernel and the warp-specialized one (attention_ws.py)."""
    if FLAT_GRID:
        q_blocks = tl.cdiv(N_Q, BLOCK_M)
        pid_bh = tl.program_id(0) // q_blocks
        pid_m = q_blocks - 1 - tl.program_id(0) % q_blocks
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
    return pid_m, pid_bh


@triton.jit
def key_tile_ranges(m0, ROWS: tl.constexpr, N_Q, N_K, pos_offset, window_left, window_right,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """For query rows [m0, m0 + ROWS): the first BLOCK_N tile any row sees, the end of the keys any row
    sees, and the tile-aligned range [full_start, full_end) that every row sees whole (empty: both at the
    first tile, so every tile takes the masked path). Shared by both attention kernels."""
    last_row = tl.minimum(m0 + ROWS, N_Q) - 1
    lo = 0
    hi = N_K
    full_lo = 0
    full_hi = N_K
    if HAS_LEFT:
        lo = tl.maximum(m0 + pos_offset - window_left, 0)
        full_lo = tl.maximum(last_row + pos_offset - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last_row + pos_offset + window_right + 1, 0), N_K)
        full_hi = tl.minimum(tl.maximum(m0 + pos_offset + window_right + 1, 0), N_K)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    full_start = (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_end = (full_hi // BLOCK_N) * BLOCK_N
    # tl.where, not a runtime `if`, so the scalars keep one type whichever flags are set.
    no_full = full_end <= full_start
    full_start = tl.where(no_full, lo_tile, full_start)
    full_end = tl.where(no_full, lo_tile, full_end)
    return lo_tile, hi, full_start, full_end


# Sizes and positions are never specialised to the constant 1, so the scalar arithmetic below keeps
# one type (a tensor) whatever the shapes are.
@triton.jit(do_not_specialize=["B", "H_Q", "N_Q", "N_K", "HEAD_DIM", "H_KV", "pos_offset",
                               "window_left", "window_right"])
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, mask_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_maskb, stride_maskh, stride_maskm, stride_maskn,
    B, H_Q, N_Q, N_K, HEAD_DIM,
    GROUP,          # query heads per KV head (Hq // Hkv)
    H_KV,
    qk_scale,       # scale * log2(e)
    pos_offset,     # query row i sits at key position i + pos_offset (Nk - Nq: bottom-right; 0: top-left)
    window_left, window_right,
    Q_BUCKET, K_BUCKET,  # autotune keys only (next power of two of N_Q, N_K)
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    STORE_LSE: tl.constexpr, EVEN_D: tl.constexpr, USE_DESC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr = False,
):
    pid_m, pid_bh = query_block_and_head(N_Q, BLOCK_M, FLAT_GRID)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // GROUP

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM
    pos_m = offs_m + pos_offset

    # ---- key range: every key some row of this block may see, and the part all rows see --------
    lo_tile, hi, full_start, full_end = key_tile_ranges(m0, BLOCK_M, N_Q, N_K, pos_offset, window_left,
                                                        window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N)

    # ---- base addresses (64-bit: B*H*N*d can pass 2**31) ----------------------------------------
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    mask_ptrs = mask_ptr
    if HAS_MASK:
        mask_ptrs = (mask_ptr + b.to(tl.int64) * stride_maskb + h.to(tl.int64) * stride_maskh
                     + offs_m.to(tl.int64)[:, None] * stride_maskm)

    if USE_DESC:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[B, H_Q, N_Q, HEAD_DIM],
                                           strides=[stride_qb, stride_qh, stride_qm, 1],
                                           block_shape=[1, 1, BLOCK_M, BLOCK_D])
        k_src = tl.make_tensor_descriptor(k_ptr, shape=[B, H_KV, N_K, HEAD_DIM],
                                          strides=[stride_kb, stride_kh, stride_kn, 1],
                                          block_shape=[1, 1, BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_ptr, shape=[B, H_KV, N_K, HEAD_DIM],
                                          strides=[stride_vb, stride_vh, stride_vn, 1],
                                          block_shape=[1, 1, BLOCK_N, BLOCK_D])
        q = q_desc.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        k_src = k_base
        v_src = v_base
        q_ptrs = q_base + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # ---- online-softmax state -----------------------------------------------------------------
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running row max (log2 domain)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)                # running sum of exp2(s - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)        # running sum of p @ v

    # Stage 1: tiles the window's left edge cuts (masked).
    acc, l_i, m_i = _attend_stage(
        acc, l_i, m_i, q, k_src, v_src, mask_ptrs, b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
        lo_tile, full_start, N_K, window_left, window_right, qk_scale,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
        True, HAS_LEFT, HAS_RIGHT, HAS_MASK, MASK_IS_BOOL, EVEN_D, USE_DESC,
        INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_D)
    # Stage 2: tiles every row of the block sees whole (no window or bounds masking).
    acc, l_i, m_i = _attend_stage(
        acc, l_i, m_i, q, k_src, v_src, mask_ptrs, b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
        full_start, full_end, N_K, window_left, window_right, qk_scale,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
        False, HAS_LEFT, HAS_RIGHT, HAS_MASK, MASK_IS_BOOL, EVEN_D, USE_DESC,
        INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_D)
    # Stage 3: the causal diagonal / right window edge and the ragged last tile (masked).
    acc, l_i, m_i = _attend_stage(
        acc, l_i, m_i, q, k_src, v_src, mask_ptrs, b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
        full_end, hi, N_K, window_left, window_right, qk_scale,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
        True, HAS_LEFT, HAS_RIGHT, HAS_MASK, MASK_IS_BOOL, EVEN_D, USE_DESC,
        INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_D)

    # ---- epilogue: rows that saw no key give 0 (l_i = 0) and lse = -inf --------------------------
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if STORE_LSE:
        # Natural-log LSE of the scaled scores: (m + log2 l) * ln 2.
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        lse_ptrs = lse_ptr + pid_bh.to(tl.int64) * N_Q + offs_m
        tl.store(lse_ptrs, lse, mask=mask_m)
    out = out.to(o_ptr.dtype.element_ty)
    if USE_DESC:
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[B, H_Q, N_Q, HEAD_DIM],
                                           strides=[stride_ob, stride_oh, stride_om, 1],
                                           block_shape=[1, 1, BLOCK_M, BLOCK_D])
        o_desc.store([b, h, m0, 0], out.reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o_ptrs = (o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, out, mask=mask_m[:, None] & mask_d[None, :])


# ---- configs ----------------------------------------------------------------------------------
# Interpreter: one large fixed tile (its cost is per program, not per element). 64 x 64.
INTERPRETER_CONFIG = dict(BLOCK_M=64, BLOCK_N=64)


def _cfg(bm, bn, warps, stages, maxnreg=None):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=warps, num_stages=stages, maxnreg=maxnreg)


# Hopper space (pruned per head dim / dtype below). 128-row query tiles with 8 warps feed wgmma at
# d = 128; d <= 64 prefers 4 warps; d = 256 needs 64-row tiles or shallow pipelines to fit.
GPU_CONFIGS = [
    _cfg(128, 64, 4, 3), _cfg(128, 64, 4, 4), _cfg(128, 128, 8, 3),
    _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(128, 128, 8, 2),
    _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(128, 32, 8, 2),
    # d = 256: found by the offline sm_90a compile study (no spills with or without descriptors).
    _cfg(64, 32, 8, 3), _cfg(64, 64, 8, 2),
    # Two or three CTAs per SM, so one CTA's softmax runs while another's wgmma does (what FA3 gets
    # from ping-pong warpgroups, which triton 3.6 cannot express on sm_90). Every tile above takes one
    # CTA per SM at d = 128 (128x64 w8 s2: 140 registers). Capped at 128 registers it compiles
    # without spills in 98 KB of shared memory (sm_90a, d = 128, full and causal). At d = 64, 128x64 w4
    # s3 takes 187 registers (2 CTAs); capped at 168, 3 CTAs with 4 bytes of spill.
    _cfg(128, 64, 8, 2, maxnreg=128), _cfg(128, 64, 4, 3, maxnreg=168),
]
# fp32 with input_precision="ieee" runs tl.dot on the FMA units, whose operand layouts hold far more per
# thread: the 16-bit tiles above spill 40-105 KB per thread there and take 26-95 s to compile (sm_90a,
# offline). These small tiles compile in 4-8 s with no spills but 148 bytes at d = 256
# (benchmarks/NOTES.md): 32x16 up to d = 64, 16x16 above.
FP32_IEEE_CONFIGS = [_cfg(32, 16, 4, 2), _cfg(16, 16, 4, 2)]
SMEM_LIMIT = 227 * 1024  # H200: shared memory per block


def config_fits(bm, bn, warps, stages, block_d, elem_bytes, use_desc=True, has_mask=False):
    """Shared memory and registers stay within Hopper's limits.

    Shared memory, as the compiler allocates it (checked by compiling every config for sm_90a,
    benchmarks/results/h200/2026-11-29/compile_study_offline.json): Q once plus K and V in every one of
    ``stages`` buffers, plus 1 KB of descriptors. Registers: without descriptors Q also sits in
    registers, so the fp32 accumulator gets half the budget (d = 256 spilled otherwise). A mask adds
    up to one fp32 score-sized tile (a layout conversion): 64 KB at 128x128 when the mask's row stride is
    not a multiple of 16, which made the first d = 128 config fail to launch on the H200."""
    smem = ((bm * block_d + 2 * stages * bn * block_d) * elem_bytes + (1024 if use_desc else 0)
            + (bm * bn * 4 if has_mask else 0))
    acc_regs = bm * block_d // (32 * warps)     # fp32 accumulator per thread
    score_regs = bm * bn // (32 * warps)        # fp32 score tile per thread
    acc_cap = 128 if use_desc else 64
    return smem <= SMEM_LIMIT and acc_regs <= acc_cap and score_regs <= 64 and acc_regs + score_regs <= 160


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    block_d = args["BLOCK_D"]
    elem = args["q_ptr"].element_size()
    ieee = elem == 4 and args.get("INPUT_PRECISION") == "ieee"
    if ieee:
        return [fp32_ieee_config(block_d)]
    configs = [c for c in configs if c not in FP32_IEEE_CONFIGS]
    if elem != 2 or block_d > 128:  # register caps were sized for 16-bit tiles up to d = 128
        configs = [c for c in configs if c.maxnreg is None]
    kept = [c for c in configs
            if config_fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, block_d, elem,
                           args.get("USE_DESC", True), args.get("HAS_MASK", False))]
    if block_d <= 64:  # small head dims: 8 warps leave each warp too little wgmma work
        kept = [c for c in kept if c.num_warps == 4] or kept
    elif block_d == 128:
        kept = [c for c in kept if c.num_warps == 8 and c.kwargs["BLOCK_M"] == 128] or kept
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


attention_fwd_autotuned = tuning.autotune(
    name="attention_fwd",
    configs=GPU_CONFIGS + FP32_IEEE_CONFIGS,
    key=["Q_BUCKET", "K_BUCKET", "BLOCK_D", "HAS_LEFT", "HAS_RIGHT", "HAS_MASK", "MASK_IS_BOOL",
         "USE_DESC", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": _prune},
)(attention_fwd_kernel)

# Below this much work (Nq * Nk) one launch costs less than tuning it: use the heuristic config. This
# also keeps the GPU test grid (hundreds of small variants) from autotuning every variant.
AUTOTUNE_MIN_WORK = 512 * 512


def fp32_ieee_config(block_d: int) -> triton.Config:
    """The FMA-path tile: 32x16 up to d = 64 (no spills), 16x16 above (no spills at d = 128, 148 bytes
    at d = 256 -- the larger ones spill kilobytes)."""
    return FP32_IEEE_CONFIGS[0] if block_d <= 64 else FP32_IEEE_CONFIGS[1]


def heuristic_config(block_d: int, elem_bytes: int, input_precision: str = "tf32") -> triton.Config:
    if elem_bytes == 4 and input_precision == "ieee":
        return fp32_ieee_config(block_d)
    if block_d <= 64:
        return _cfg(128, 64, 4, 3)
    if block_d <= 128:
        return _cfg(128, 64, 8, 3) if elem_bytes == 2 else _cfg(64, 32, 4, 3)
    # d = 256: 64x32 with 8 warps compiled without spills on both load paths (offline sm_90a study).
    return _cfg(64, 32, 8, 3) if elem_bytes == 2 else _cfg(64, 32, 4, 2)


def descriptors_usable(*tensors) -> bool:
    """TMA needs a unit last stride, 16-byte-aligned base and outer strides, and no broadcast (0) stride."""
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(s == 0 or (s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


MAX_GRID_Y = 65535  # CUDA's limit on grid axes 1 and 2


def _grid(Nq: int, block_m: int, heads: int) -> tuple:
    """(query blocks, B * Hq), or everything on axis 0 (FLAT_GRID) when B * Hq passes axis 1's limit."""
    return (cdiv(Nq, block_m), heads) if heads <= MAX_GRID_Y else (cdiv(Nq, block_m) * heads,)


def launch_attention(q, k, v, out, lse, mask, *, scale, pos_offset, window_left, window_right,
                     input_precision, interpret, use_desc=None, kernel="auto"):
    """q/out [B, Hq, Nq, d], k/v [B, Hkv, Nk, d] (any strides); mask None or broadcastable strides
    [B, Hq, Nq, Nk] (0 where broadcast); lse None or contiguous fp32 [B, Hq, Nq].

    window_left / window_right < 0 mean unbounded. ``kernel``: "auto" runs the warp-specialized Hopper
    kernel (kernels/attention_ws.py) where it applies and ``use_desc`` is not forced, else this file's
    kernel; "ws" or "portable" force one ("ws" raises where it cannot run). Returns the config used
    (``WARP_SPECIALIZE`` set when the warp-specialized kernel ran).
    """
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if kernel not in ("auto", "ws", "portable"):
        raise ValueError(f"kernel must be 'auto', 'ws' or 'portable', got {kernel!r}")
    if kernel != "portable" and not interpret and use_desc is None:
        from tilefuse.kernels import attention_ws  # imports Gluon: GPU path only

        if attention_ws.usable(q, k, v, out, mask):
            return attention_ws.launch(q, k, v, out, lse, qk_scale=scale * LOG2E, pos_offset=pos_offset,
                                       window_left=window_left, window_right=window_right)
    if kernel == "ws":
        raise ValueError("the warp-specialized kernel needs sm_90, fp16/bf16, head dim 64 or 128, no mask and "
                         "TMA-able tensors (16-byte aligned, unit last stride)")
    block_d = max(16, next_pow2(d))
    if use_desc is None:
        # Descriptors on the GPU only (portable pointer path in the interpreter); both paths are tested.
        use_desc = (not interpret and q.is_cuda and runtime.device_facts(q.device)[0] >= 9
                    and descriptors_usable(q, k, v, out))
    if use_desc:
        ensure_descriptor_allocator()
    has_mask = mask is not None
    mask_is_bool = has_mask and mask.dtype == torch.bool
    if mask_is_bool:
        mask = mask.view(torch.uint8)
    mask_strides = mask.stride() if has_mask else (0, 0, 0, 0)
    args = (q, k, v, out, lse if lse is not None else out, mask if has_mask else out,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mask_strides,
            B, Hq, Nq, Nk, d, Hq // Hkv, Hkv,
            scale * LOG2E, pos_offset, max(window_left, 0), max(window_right, 0),
            tuning.m_bucket(Nq), tuning.m_bucket(Nk))
    flags = dict(HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_MASK=has_mask,
                 MASK_IS_BOOL=mask_is_bool, STORE_LSE=lse is not None, EVEN_D=d == block_d,
                 USE_DESC=use_desc, INPUT_PRECISION=input_precision, BLOCK_D=block_d,
                 FLAT_GRID=B * Hq > MAX_GRID_Y)
    if interpret:
        cfg = INTERPRETER_CONFIG
        grid = _grid(Nq, cfg["BLOCK_M"], B * Hq)
        attention_fwd_kernel[grid](*args, **flags, UPCAST_DOT=q.dtype == torch.bfloat16, **cfg)
        return cfg

    if Nq * Nk < AUTOTUNE_MIN_WORK:
        cfg = heuristic_config(block_d, q.element_size(), input_precision)
        grid = _grid(Nq, cfg.kwargs["BLOCK_M"], B * Hq)
        attention_fwd_kernel[grid](*args, **flags, UPCAST_DOT=False, **cfg.kwargs,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return cfg

    def grid(meta):
        return _grid(Nq, meta["BLOCK_M"], B * Hq)

    attention_fwd_autotuned[grid](*args, **flags, UPCAST_DOT=False)
    return attention_fwd_autotuned.best_config

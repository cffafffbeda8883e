"""FP8 (e4m3) attention forward: the quantize pre-pass and the portable kernel.

Quantization (``quantize_blocks_kernel``; ``channel_amax_kernel``, ``channel_scale_kernel`` and
``quantize_transposed_kernel`` for V):
- Q and K per block: one fp32 scale per head and per QUANT_BLOCK rows (amax / 448), optionally after an
  orthogonal rotation along d (``ROTATE``: a ±1 Hadamard matrix with random signs, times 1/sqrt(d)). Rotating
  Q and K by the same orthogonal matrix leaves QK^T unchanged and spreads an outlier channel over all d,
  so the rounding errors of the d products average instead of one product's error dominating (FA3's
  incoherent processing).
- V per channel: one scale per head and per d column over all keys. out[:, c] = sum_j p_j V[j, c] takes the
  column's scale out of the sum exactly, so the kernel applies it once to the output.
  V is written transposed ([d, N] per head, keys contiguous): Hopper's FP8 wgmma reads its B operand
  K-major only, and for P @ V the reduction runs over keys.
Q and K: one read of the 16-bit tensor and a write of half its bytes (+ the scales), a program per
[QUANT_BLOCK, d] block. V: a column's scale needs all N rows, so two passes over [rows, d] blocks, a program
each: the blocks' column amaxes into a small fp32 buffer, reduced to the scales once per head, then the cast,
transposed on chip; V is read twice, at as many programs as Q's pass has.

Forward (``attention_fp8_fwd_kernel``): FlashAttention's online softmax over e4m3 Q, K, V^T. The scores'
scale is sm_scale * log2(e) * q_scale(block) * k_scale(tile), one multiply per score as in the 16-bit
kernels. P (in [0, 1]) is multiplied by P_SCALE before its e4m3 cast: e4m3's normal range ends at 2^-6, and
a long row's small probabilities would otherwise land in the subnormals (absolute step 2^-9), losing most
of their bits; the factor comes out with the row sum at the end, with V's channel scales.
HBM bytes: (Q + K + V) at 1 byte an element + O at 2 (+ the scales), against (Q + K + V + O) * 2 for the
16-bit forward. Tiling, masks and the key-range split as in portable.py (causal, windows, GQA); any Nq,
Nk, head dims up to 256 masked to a power of two. On sm_90 the warp-specialized FP8 kernel (ws_fp8.py)
runs instead where it applies (launch.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse import constants
from tilefuse.kernels import cache_keys
from tilefuse.kernels.attention.common import head_tile_ptrs, key_tile_ranges, query_block_and_head

E4M3_MAX = tl.constexpr(constants.E4M3_MAX)
QUANT_BLOCK = constants.FP8_ATTENTION_BLOCK  # Q and K rows per scale
P_SCALE = tl.constexpr(constants.FP8_P_SCALE)


@triton.jit
def _scale_of(amax):
    """amax / 448, or 1 for an all-zero block (its values stay 0)."""
    return tl.where(amax > 0.0, amax / E4M3_MAX, 1.0)


@triton.jit
def _magnitude(x):
    """|x| with NaN as 0: a NaN element stays NaN itself (its row's output is NaN, as in PyTorch) without
    making its block's scale, and so every value of the block, NaN."""
    return tl.where(x == x, tl.abs(x), 0.0)


@triton.jit(do_not_specialize=["H", "N"])
def quantize_blocks_kernel(src_ptr, dst_ptr, scale_ptr, rot_ptr, H, N, D,
                           stride_sb, stride_sh, stride_sn, stride_sd,
                           stride_db, stride_dh, stride_dn, stride_dd,
                           ROTATE: tl.constexpr, INTERPRETER: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """src [B, H, N, D] (any strides) -> dst e4m3 (same shape, its strides) and scale fp32 [B, H, cdiv(N,
    BLOCK_R)] contiguous; program (row block, b * H + h). ROTATE: rows times rot [D, D] (±1 entries, D a power
    of two = BLOCK_D), then times 1/sqrt(D). INTERPRETER: the interpreter's 16-bit tl.dot is wrong, so the
    rotation's dot runs in fp32 there."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_n < N)[:, None] & (offs_d < D)[None, :]
    src = head_tile_ptrs(src_ptr, b, h, stride_sb, stride_sh, offs_n, stride_sn, offs_d, stride_sd)
    x = tl.load(src, mask=mask, other=0.0)
    if INTERPRETER:
        x = x.to(tl.float32)
    if ROTATE:
        # The ±1 matrix is exact in x's dtype, so 16-bit products are exact and sum in fp32.
        rot = tl.load(rot_ptr + offs_d[:, None] * BLOCK_D + offs_d[None, :]).to(x.dtype)
        x = tl.dot(x, rot) * (1.0 / tl.sqrt(BLOCK_D * 1.0))
    else:
        x = x.to(tl.float32)
    scale = _scale_of(tl.max(tl.max(_magnitude(x), 1), 0))
    dst = head_tile_ptrs(dst_ptr, b, h, stride_db, stride_dh, offs_n, stride_dn, offs_d, stride_dd)
    tl.store(dst, (x / scale).to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + bh.to(tl.int64) * tl.num_programs(0) + blk, scale)


@triton.jit(do_not_specialize=["H", "N"])
def channel_amax_kernel(src_ptr, part_ptr, H, N, D, stride_sb, stride_sh, stride_sn, stride_sd,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The V pass's first half: src [B, H, N, D] -> part fp32 [B * H, cdiv(N, BLOCK_R), D], each column's amax
    over one block of BLOCK_R rows; program (row block, b * H + h)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    src = head_tile_ptrs(src_ptr, b, h, stride_sb, stride_sh, offs_n, stride_sn, offs_d, stride_sd)
    x = tl.load(src, mask=(offs_n < N)[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    part = part_ptr + (bh.to(tl.int64) * tl.num_programs(0) + blk) * D
    tl.store(part + offs_d, tl.max(_magnitude(x), 0), mask=mask_d)


@triton.jit(do_not_specialize=["BLOCKS"])
def channel_scale_kernel(part_ptr, scale_ptr, D, BLOCKS, BLOCK_D: tl.constexpr, PART_ROWS: tl.constexpr):
    """The V pass's middle step: each column's scale from its BLOCKS partial amaxes (channel_amax_kernel's part),
    once per head (the cast's programs then read D scales, not BLOCKS x D partials each); scale fp32 [B * H, D]
    contiguous. Program b * H + h."""
    bh = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    part = part_ptr + bh.to(tl.int64) * BLOCKS * D
    amax = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for p0 in range(0, BLOCKS, PART_ROWS):
        offs_p = p0 + tl.arange(0, PART_ROWS)
        chunk = tl.load(part + offs_p[:, None] * D + offs_d[None, :],
                        mask=(offs_p < BLOCKS)[:, None] & mask_d[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(chunk, 0))
    tl.store(scale_ptr + bh.to(tl.int64) * D + offs_d, _scale_of(amax), mask=mask_d)


@triton.jit(do_not_specialize=["H"])
def quantize_transposed_kernel(src_ptr, scale_ptr, dst_ptr, H, N, D,
                               stride_sb, stride_sh, stride_sn, stride_sd,
                               stride_db, stride_dh, stride_dn, stride_dd,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The V pass's last step: one [BLOCK_R, D] block of src divided by its columns' scales (channel_scale_kernel's,
    fp32 [B * H, D]), cast to e4m3 and stored transposed (dst [B, H, N, D] with its strides; V^T: stride_dn 1, so
    a [D, BLOCK_R] tile of keys-contiguous rows). Program (row block, b * H + h)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    scale = tl.load(scale_ptr + bh.to(tl.int64) * D + offs_d, mask=mask_d, other=1.0)
    offs_n = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (offs_n < N)[:, None] & mask_d[None, :]
    src = head_tile_ptrs(src_ptr, b, h, stride_sb, stride_sh, offs_n, stride_sn, offs_d, stride_sd)
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    y = tl.trans((x / scale[None, :]).to(tl.float8e4nv))  # [BLOCK_D, BLOCK_R]
    dst = (dst_ptr + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
           + offs_d[:, None] * stride_dd + offs_n.to(tl.int64)[None, :] * stride_dn)
    tl.store(dst, y, mask=tl.trans(mask))


@triton.jit
def _attend_fp8_stage(acc, l_i, m_i, q, k_src, vt_src, ks_base, b, h_kv, offs_m, pos_m, offs_d, mask_d,
                      start_n, end_n, N_K, window_left, window_right, qk_scale,
                      stride_kn, stride_kd, stride_vd, stride_vn,
                      APPLY_BOUNDS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      USE_DESC: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """Folds the key tiles [start_n, end_n) into (acc, l_i, m_i); ``qk_scale`` already holds the query
    block's scale, each tile multiplies its own key scale in. K and V^T come through descriptors (USE_DESC:
    zero-filled past Nk and d) or masked pointer loads from their head's base pointers."""
    offs_n_base = tl.arange(0, BLOCK_N)
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + offs_n_base
        if USE_DESC:
            k = k_src.load([b, h_kv, start, 0]).reshape(BLOCK_N, BLOCK_D)
            vt = vt_src.load([b, h_kv, 0, start]).reshape(BLOCK_D, BLOCK_N)
        else:
            in_keys = offs_n < N_K
            k = tl.load(k_src + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=in_keys[:, None] & mask_d[None, :], other=0.0)
            vt = tl.load(vt_src + offs_d.to(tl.int64)[:, None] * stride_vd + offs_n[None, :] * stride_vn,
                         mask=mask_d[:, None] & in_keys[None, :], other=0.0)
        k_scale = tl.load(ks_base + start // QBLOCK)
        s = tl.dot(q, tl.trans(k)) * (qk_scale * k_scale)
        if APPLY_BOUNDS:
            key_pos = offs_n[None, :]
            visible = key_pos < N_K
            if HAS_LEFT:
                visible = visible & (key_pos >= pos_m[:, None] - window_left)
            if HAS_RIGHT:
                visible = visible & (key_pos <= pos_m[:, None] + window_right)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
        if APPLY_BOUNDS:  # a row with no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p8 = (p * P_SCALE).to(tl.float8e4nv)
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["H_Q", "N_Q", "N_K", "HEAD_DIM", "pos_offset", "window_left", "window_right", "B",
                               "H_KV"])
def attention_fp8_fwd_kernel(
    q_ptr, k_ptr, vt_ptr, o_ptr, qs_ptr, ks_ptr, vs_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vn,   # V^T: [B, Hkv, d, Nk]
    stride_ob, stride_oh, stride_om, stride_od,
    H_Q, N_Q, N_K, HEAD_DIM, GROUP,
    qk_scale,  # sm_scale * log2(e)
    pos_offset, window_left, window_right,
    Q_BUCKET, K_BUCKET,  # autotune keys only
    B, H_KV,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, QBLOCK: tl.constexpr, USE_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr = False,
):
    """Scales: qs fp32 [B, Hq, cdiv(Nq, QBLOCK)], ks fp32 [B, Hkv, cdiv(Nk, QBLOCK)], vs fp32 [B, Hkv, d], all
    contiguous. BLOCK_M and BLOCK_N divide QBLOCK, so a tile lies in one scale block."""
    pid_m, pid_bh = query_block_and_head(N_Q, BLOCK_M, FLAT_GRID)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // GROUP
    bh_kv = b * (H_Q // GROUP) + h_kv
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM
    pos_m = offs_m + pos_offset
    lo_tile, hi, full_start, full_end = key_tile_ranges(m0, BLOCK_M, N_Q, N_K, pos_offset, window_left,
                                                        window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N)

    ks_base = ks_ptr + bh_kv.to(tl.int64) * tl.cdiv(N_K, QBLOCK)
    if USE_DESC:  # the GPU path: no per-element addresses in registers
        k_src = tl.make_tensor_descriptor(k_ptr, shape=[B, H_KV, N_K, HEAD_DIM],
                                          strides=[stride_kb, stride_kh, stride_kn, 1],
                                          block_shape=[1, 1, BLOCK_N, BLOCK_D])
        vt_src = tl.make_tensor_descriptor(vt_ptr, shape=[B, H_KV, HEAD_DIM, N_K],
                                           strides=[stride_vb, stride_vh, stride_vd, 1],
                                           block_shape=[1, 1, BLOCK_D, BLOCK_N])
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[B, H_Q, N_Q, HEAD_DIM],
                                           strides=[stride_qb, stride_qh, stride_qm, 1],
                                           block_shape=[1, 1, BLOCK_M, BLOCK_D])
        q = q_desc.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        k_src = k_ptr + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
        vt_src = vt_ptr + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
        q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    qk_scale = qk_scale * tl.load(qs_ptr + pid_bh.to(tl.int64) * tl.cdiv(N_Q, QBLOCK) + m0 // QBLOCK)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # Masked lead-in (left window edge), unmasked middle, masked tail (diagonal, right edge, ragged end).
    acc, l_i, m_i = _attend_fp8_stage(acc, l_i, m_i, q, k_src, vt_src, ks_base, b, h_kv, offs_m, pos_m, offs_d, mask_d,
                                      lo_tile, full_start, N_K, window_left, window_right, qk_scale,
                                      stride_kn, stride_kd, stride_vd, stride_vn, True, HAS_LEFT, HAS_RIGHT,
                                      USE_DESC, QBLOCK, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _attend_fp8_stage(acc, l_i, m_i, q, k_src, vt_src, ks_base, b, h_kv, offs_m, pos_m, offs_d, mask_d,
                                      full_start, full_end, N_K, window_left, window_right, qk_scale,
                                      stride_kn, stride_kd, stride_vd, stride_vn, False, HAS_LEFT, HAS_RIGHT,
                                      USE_DESC, QBLOCK, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _attend_fp8_stage(acc, l_i, m_i, q, k_src, vt_src, ks_base, b, h_kv, offs_m, pos_m, offs_d, mask_d,
                                      full_end, hi, N_K, window_left, window_right, qk_scale,
                                      stride_kn, stride_kd, stride_vd, stride_vn, True, HAS_LEFT, HAS_RIGHT,
                                      USE_DESC, QBLOCK, BLOCK_N, BLOCK_D)

    # Rows that saw no key give 0. P_SCALE and V's channel scales come out here, once per output.
    v_scale = tl.load(vs_ptr + bh_kv.to(tl.int64) * HEAD_DIM + offs_d, mask=mask_d, other=0.0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i) * P_SCALE
    out = acc * (v_scale[None, :] / l_safe[:, None])
    o_ptrs = (o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


cache_keys.settle(globals())

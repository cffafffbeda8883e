"""FlashAttention forward: softmax(q k^T * scale + mask) v with an online softmax, one pass over K/V.

Fuses: QK^T, scale, causal/window/attn_mask masking, softmax and PV into one kernel; the [Nq, Nk]
scores never leave the chip. HBM bytes (element size s, G = Hq / Hkv): unfused eager writes and reads
the scores and probabilities, >= (Q + K + V + O)*s + 4 * B*Hq*Nq*Nk*s; fused: (Q + K + V + O)*s
(+ 4*B*Hq*Nq for the fp32 log-sum-exp, + the mask tile reads when a mask is given). K/V are read
per query head group from the same KV head (GQA), never repeated in memory.
Tiling: one BLOCK_M x head_dim query tile per program, loaded once; K/V walked in BLOCK_N tiles in
three stages (masked lead-in, unmasked middle, masked tail) so most tiles skip all masking.
Score modifiers: Gemma 2's soft-capping and ALiBi slopes (``score_modifiers``), shared with the backward.
Limits: head_dim <= 256 (padded to a power of two >= 16 and masked), any Nq, Nk >= 1. The launch layer
(launch.py) runs it wherever the warp-specialized kernel (ws.py) does not apply.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels import cache_keys
from tilefuse.kernels.attention.common import key_tile_ranges, query_block_and_head, score_modifiers, varlen_sequence
# A finite additive mask below this would overflow to -inf once multiplied by log2(e); clamping keeps
# Hugging Face's finfo.min padding finite (a fully masked row then averages uniformly, as torch does).
MASK_FLOOR = tl.constexpr(-2.3e38)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_stage(
    acc, l_i, m_i, q,
    k_src, v_src, mask_ptrs,
    b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
    start_n, end_n, N_K, window_left, window_right, qk_scale, softcap_log2, alibi_log2,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
    APPLY_BOUNDS: tl.constexpr,   # this stage holds tiles cut by the window or by N_K
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    EVEN_D: tl.constexpr, USE_DESC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Folds the K/V tiles [start_n, end_n) into the online-softmax state (acc, l_i, m_i).

    Scores live in the log2 domain (scale * log2(e) folded into qk_scale) so exp is one exp2. With
    HAS_SOFTCAP, qk_scale is scale / softcap and the score is tanh of it times softcap * log2(e)
    (``softcap_log2``); HAS_ALIBI subtracts ``alibi_log2`` (this head's slope * log2(e)) times the distance
    from the row's nearest key (``score_modifiers``).
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
        s = score_modifiers(s, pos_m, offs_n, N_K, softcap_log2, alibi_log2, HAS_SOFTCAP, HAS_ALIBI)
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
    softcap_log2,   # HAS_SOFTCAP: softcap * log2(e) (and qk_scale is scale / softcap)
    alibi_ptr, stride_alibi_b, stride_alibi_h,  # HAS_ALIBI: fp32 slopes [B, Hq] (stride 0 where broadcast)
    # VARLEN: B packed sequences in tensors viewed [1, H, total, d]; N_Q / N_K are the totals and each
    # sequence's rows come from its offsets cu_q[b]..cu_q[b + 1] (keys likewise), aligned bottom-right;
    # the lse is [Hq, total_q].
    cu_q_ptr, cu_k_ptr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr,
    STORE_LSE: tl.constexpr, EVEN_D: tl.constexpr, USE_DESC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr = False,
):
    pid_m, pid_bh = query_block_and_head(N_Q, BLOCK_M, FLAT_GRID)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // GROUP
    lse_row0 = pid_bh.to(tl.int64) * N_Q
    row0_q = 0
    row0_k = 0
    if VARLEN:  # b is the sequence (the launch layer passes batch strides of 0): rows come from the offsets
        total_q = N_Q
        row0_q, N_Q, row0_k, N_K, pos_offset = varlen_sequence(cu_q_ptr, cu_k_ptr, b, N_Q, N_K)
        lse_row0 = h.to(tl.int64) * total_q + row0_q

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM
    pos_m = offs_m + pos_offset

    # ---- key range: every key some row of this block may see, and the part all rows see --------
    lo_tile, hi, full_start, full_end = key_tile_ranges(m0, BLOCK_M, N_Q, N_K, pos_offset, window_left,
                                                        window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    if VARLEN:  # a block past its sequence's end (the grid covers the longest) walks no key
        hi = tl.where(m0 < N_Q, hi, lo_tile)
        full_start = tl.where(m0 < N_Q, full_start, lo_tile)
        full_end = tl.where(m0 < N_Q, full_end, lo_tile)

    # ---- base addresses (64-bit: B*H*N*d can pass 2**31) ----------------------------------------
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + row0_q * stride_qm
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh + row0_k * stride_kn
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh + row0_k * stride_vn
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

    alibi_log2 = 0.0
    if HAS_ALIBI:
        alibi_log2 = tl.load(alibi_ptr + b.to(tl.int64) * stride_alibi_b + h.to(tl.int64) * stride_alibi_h) * LOG2E

    # ---- online-softmax state -----------------------------------------------------------------
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running row max (log2 domain)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)                # running sum of exp2(s - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)        # running sum of p @ v

    # Stage 1: tiles the window's left edge cuts (masked).
    acc, l_i, m_i = _attend_stage(
        acc, l_i, m_i, q, k_src, v_src, mask_ptrs, b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
        lo_tile, full_start, N_K, window_left, window_right, qk_scale, softcap_log2, alibi_log2,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
        True, HAS_LEFT, HAS_RIGHT, HAS_MASK, MASK_IS_BOOL, HAS_SOFTCAP, HAS_ALIBI, EVEN_D, USE_DESC,
        INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_D)
    # Stage 2: tiles every row of the block sees whole (no window or bounds masking).
    acc, l_i, m_i = _attend_stage(
        acc, l_i, m_i, q, k_src, v_src, mask_ptrs, b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
        full_start, full_end, N_K, window_left, window_right, qk_scale, softcap_log2, alibi_log2,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
        False, HAS_LEFT, HAS_RIGHT, HAS_MASK, MASK_IS_BOOL, HAS_SOFTCAP, HAS_ALIBI, EVEN_D, USE_DESC,
        INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_D)
    # Stage 3: the causal diagonal / right window edge and the ragged last tile (masked).
    acc, l_i, m_i = _attend_stage(
        acc, l_i, m_i, q, k_src, v_src, mask_ptrs, b, h_kv, offs_m, pos_m, offs_d, mask_m, mask_d,
        full_end, hi, N_K, window_left, window_right, qk_scale, softcap_log2, alibi_log2,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_maskn,
        True, HAS_LEFT, HAS_RIGHT, HAS_MASK, MASK_IS_BOOL, HAS_SOFTCAP, HAS_ALIBI, EVEN_D, USE_DESC,
        INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_D)

    # ---- epilogue: rows that saw no key give 0 (l_i = 0) and lse = -inf --------------------------
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if STORE_LSE:
        # Natural-log LSE of the scaled scores: (m + log2 l) * ln 2.
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        lse_ptrs = lse_ptr + lse_row0 + offs_m
        tl.store(lse_ptrs, lse, mask=mask_m)
    out = out.to(o_ptr.dtype.element_ty)
    if USE_DESC:
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[B, H_Q, N_Q, HEAD_DIM],
                                           strides=[stride_ob, stride_oh, stride_om, 1],
                                           block_shape=[1, 1, BLOCK_M, BLOCK_D])
        o_desc.store([b, h, m0, 0], out.reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o_ptrs = (o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + (row0_q + offs_m).to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, out, mask=mask_m[:, None] & mask_d[None, :])


cache_keys.settle(globals())

"""Block-sparse attention: FlashAttention forward and backward that visit only the tiles a BlockMask lists.

Fuses what the portable kernels fuse (QK^T, scale, mask, online softmax, PV; the backward's recomputation),
reading K/V only for listed tiles: HBM bytes (element size s) Q + O + (K + V over the visited tiles) per query
head, + 4 bytes per listed tile (its index; partial: and its slot), + block_q * block_k / 8 bytes of bitmap per
partial tile, + the fp32 lse. Empty tiles cost nothing; full tiles run no mask at all; partial tiles apply their
packed element mask (tilefuse.masks: bit c % 32 of word c // 32 of each tile row).
Tiling: kernel tiles BLOCK_M x BLOCK_N divide the mask's MASK_BQ x MASK_BK tiles (powers of two), so a program
of BLOCK_M query rows lies in one mask query tile and walks each listed key tile in MASK_BK / BLOCK_N steps,
one loop over (list entry, step). The mask's tensors are [Bm, Hm, ...] with Bm in {1, B}, Hm in {1, Hq}:
broadcast through row strides of 0 (``mask_stride_b``, ``mask_stride_h``).
Limits: head dim <= 256 (padded to a power of two, masked), any Nq, Nk; positions top-left aligned.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels import cache_keys
from tilefuse.kernels.attention.common import query_block_and_head

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _list_head(num_ptr, mrow, tile, N_TILES, LIST_LEN):
    """(entries, first entry's offset) of the list of tile ``tile`` in mask row ``mrow`` (b * stride_b +
    h * stride_h): counts [rows, N_TILES], lists [rows, N_TILES, LIST_LEN]. The count is clamped to the list
    length, so a damaged mask never reads past its lists."""
    row = mrow.to(tl.int64) * N_TILES + tile
    count = tl.minimum(tl.maximum(tl.load(num_ptr + row), 0), LIST_LEN)
    return count, row * LIST_LEN


@triton.jit
def _entry(idx_ptr, offset, LIST_LEN):
    """A list entry (a tile index or a bitmap slot), clamped to [0, LIST_LEN)."""
    return tl.minimum(tl.maximum(tl.load(idx_ptr + offset), 0), LIST_LEN - 1)


@triton.jit
def _tile_bits(bits_ptr, slot, rows, cols, MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr):
    """Visibility of (row, col) of partial tile ``slot`` (rows in [0, MASK_BQ), cols in [0, MASK_BK), index
    tensors that broadcast to the score tile's shape): bit col % 32 of word col // 32 of its row."""
    WORDS: tl.constexpr = (MASK_BK + 31) // 32
    words = tl.load(bits_ptr + slot.to(tl.int64) * (MASK_BQ * WORDS) + rows * WORDS + cols // 32)
    return ((words >> (cols % 32)) & 1) != 0


@triton.jit
def _head_ptrs(ptr, b, h, stride_b, stride_h, offs_rows, stride_rows, offs_d, stride_d):
    """Pointers of a [rows, head dim] tile of head (b, h) of a [B, H, N, d] tensor (64-bit offsets)."""
    return (ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
            + offs_rows.to(tl.int64)[:, None] * stride_rows + offs_d[None, :] * stride_d)


@triton.jit
def _attend_listed(acc, l_i, m_i, q, k_src, v_src, b, h_kv, offs_d, mask_d, rows_in_tile,
                   idx_ptr, slot_ptr, bits_ptr, count, list0, N_K, K_TILES, NUM_SLOTS, qk_scale,
                   stride_kn, stride_kd, stride_vn, stride_vd,
                   PARTIAL: tl.constexpr, USE_DESC: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   UPCAST_DOT: tl.constexpr, MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Folds the ``count`` listed key tiles into the online-softmax state (acc, l_i, m_i), scores in the log2
    domain. PARTIAL: each tile's bitmap masks its scores; full tiles (never cut by N_K, tilefuse.masks) take
    no mask."""
    SUBS: tl.constexpr = MASK_BK // BLOCK_N
    offs_sub = tl.arange(0, BLOCK_N)
    for t in range(0, count * SUBS):
        entry = list0 + t // SUBS
        sub = (t % SUBS) * BLOCK_N
        start = _entry(idx_ptr, entry, K_TILES) * MASK_BK + sub
        offs_n = start + offs_sub
        if USE_DESC:  # TMA: rows past N_K come back as zeros
            k = k_src.load([b, h_kv, start, 0]).reshape(BLOCK_N, BLOCK_D)
            v = v_src.load([b, h_kv, start, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            kv_mask = (offs_n < N_K)[:, None] & mask_d[None, :]
            k = tl.load(k_src + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)
            v = tl.load(v_src + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if PARTIAL:
            slot = _entry(slot_ptr, entry, NUM_SLOTS)
            visible = _tile_bits(bits_ptr, slot, rows_in_tile[:, None], (sub + offs_sub)[None, :], MASK_BQ, MASK_BK)
            s = tl.where(visible, s, float("-inf"))
        # ---- online softmax: the one place m_i, l_i, acc change --------------------------------------
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if PARTIAL:  # a row that has seen no key keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(s - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p_dot = p if UPCAST_DOT else p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["B", "H_Q", "H_KV", "N_Q", "N_K", "GROUP", "mask_stride_b", "mask_stride_h",
                               "Q_TILES", "K_TILES", "NUM_SLOTS"])
def block_sparse_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    kv_num_ptr, kv_idx_ptr, kv_slot_ptr, full_num_ptr, full_idx_ptr, bits_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    B, H_Q, H_KV, N_Q, N_K, HEAD_DIM: tl.constexpr, GROUP,  # head dim a constexpr: its mask keeps loads wide
    mask_stride_b, mask_stride_h,  # mask row of (b, h): b * stride_b + h * stride_h (0 where it broadcasts)
    Q_TILES, K_TILES, NUM_SLOTS,    # the mask's tile counts and its bitmaps' count
    qk_scale,                       # scale * log2(e)
    STORE_LSE: tl.constexpr, USE_DESC: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr = False,
):
    pid_m, pid_bh = query_block_and_head(N_Q, BLOCK_M, FLAT_GRID)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // GROUP
    m0 = pid_m * BLOCK_M
    q_tile = m0 // MASK_BQ
    rows_in_tile = m0 - q_tile * MASK_BQ + tl.arange(0, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM

    mrow = b * mask_stride_b + h * mask_stride_h
    n_full, full0 = _list_head(full_num_ptr, mrow, q_tile, Q_TILES, K_TILES)
    n_part, part0 = _list_head(kv_num_ptr, mrow, q_tile, Q_TILES, K_TILES)

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
        k_src = k_ptr + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
        v_src = v_ptr + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
        q = tl.load(_head_ptrs(q_ptr, b, h, stride_qb, stride_qh, offs_m, stride_qm, offs_d, stride_qd),
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running row max (log2 domain)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)                # running sum of exp2(s - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)        # running sum of p @ v
    # Full tiles first (no mask), then the partial ones (their bitmaps).
    acc, l_i, m_i = _attend_listed(
        acc, l_i, m_i, q, k_src, v_src, b, h_kv, offs_d, mask_d, rows_in_tile, full_idx_ptr, kv_slot_ptr,
        bits_ptr, n_full, full0, N_K, K_TILES, NUM_SLOTS, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
        False, USE_DESC, INPUT_PRECISION, UPCAST_DOT, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _attend_listed(
        acc, l_i, m_i, q, k_src, v_src, b, h_kv, offs_d, mask_d, rows_in_tile, kv_idx_ptr, kv_slot_ptr,
        bits_ptr, n_part, part0, N_K, K_TILES, NUM_SLOTS, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
        True, USE_DESC, INPUT_PRECISION, UPCAST_DOT, MASK_BQ, MASK_BK, BLOCK_M, BLOCK_N, BLOCK_D)

    # ---- epilogue: rows that saw no key give 0 (l_i = 0) and lse = -inf ------------------------------
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(lse_ptr + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=mask_m)
    tl.store(_head_ptrs(o_ptr, b, h, stride_ob, stride_oh, offs_m, stride_om, offs_d, stride_od),
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# ---- backward ---------------------------------------------------------------------------------------
# The portable backward's recomputation (backward.py's doc has the formulas), over the listed tiles: the dQ pass
# walks each query tile's key lists, the dK/dV pass each key tile's query lists (the transposed lists).

@triton.jit
def _row_terms(lse_ptr, delta_ptr, rows, mask):
    """(lse in the log2 domain, +inf where the row saw no key so that its P is 0; delta) of flat rows."""
    lse = tl.load(lse_ptr + rows, mask=mask, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), tl.load(delta_ptr + rows, mask=mask, other=0.0)


@triton.jit
def _dq_listed(dq, q, do, lse2, delta, k_src, v_src, offs_d, mask_d, rows_in_tile,
               idx_ptr, slot_ptr, bits_ptr, count, list0, N_K, K_TILES, NUM_SLOTS, qk_scale,
               stride_kn, stride_kd, stride_vn, stride_vd,
               PARTIAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
               MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq += dS K over the ``count`` listed key tiles (unscaled: the caller multiplies by scale)."""
    SUBS: tl.constexpr = MASK_BK // BLOCK_N
    offs_sub = tl.arange(0, BLOCK_N)
    for t in range(0, count * SUBS):
        entry = list0 + t // SUBS
        sub = (t % SUBS) * BLOCK_N
        offs_n = _entry(idx_ptr, entry, K_TILES) * MASK_BK + sub + offs_sub
        kv_mask = (offs_n < N_K)[:, None] & mask_d[None, :]
        k = tl.load(k_src + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_src + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        op_dtype = k.dtype
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if PARTIAL:
            slot = _entry(slot_ptr, entry, NUM_SLOTS)
            visible = _tile_bits(bits_ptr, slot, rows_in_tile[:, None], (sub + offs_sub)[None, :], MASK_BQ, MASK_BK)
            s = tl.where(visible, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds_op = (p * (dp - delta[:, None])).to(op_dtype)
        if UPCAST_DOT:
            ds_op = ds_op.to(tl.float32)
        dq = tl.dot(ds_op, k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["H_Q", "N_Q", "N_K", "GROUP", "mask_stride_b", "mask_stride_h", "Q_TILES",
                               "K_TILES", "NUM_SLOTS"])
def block_sparse_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    kv_num_ptr, kv_idx_ptr, kv_slot_ptr, full_num_ptr, full_idx_ptr, bits_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H_Q, N_Q, N_K, HEAD_DIM: tl.constexpr, GROUP,
    mask_stride_b, mask_stride_h, Q_TILES, K_TILES, NUM_SLOTS,
    qk_scale, scale,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * H_Q + h
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // GROUP
    m0 = pid_m * BLOCK_M
    q_tile = m0 // MASK_BQ
    rows_in_tile = m0 - q_tile * MASK_BQ + tl.arange(0, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM
    qm = mask_m[:, None] & mask_d[None, :]
    q = tl.load(_head_ptrs(q_ptr, b, h, stride_qb, stride_qh, offs_m, stride_qm, offs_d, stride_qd), mask=qm,
                other=0.0)
    do = tl.load(_head_ptrs(do_ptr, b, h, stride_dob, stride_doh, offs_m, stride_dom, offs_d, stride_dod), mask=qm,
                 other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2, delta = _row_terms(lse_ptr, delta_ptr, pid_bh.to(tl.int64) * N_Q + offs_m, mask_m)
    k_src = k_ptr + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_src = v_ptr + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    mrow = b * mask_stride_b + h * mask_stride_h
    n_full, full0 = _list_head(full_num_ptr, mrow, q_tile, Q_TILES, K_TILES)
    n_part, part0 = _list_head(kv_num_ptr, mrow, q_tile, Q_TILES, K_TILES)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dq = _dq_listed(dq, q, do, lse2, delta, k_src, v_src, offs_d, mask_d, rows_in_tile, full_idx_ptr, kv_slot_ptr,
                    bits_ptr, n_full, full0, N_K, K_TILES, NUM_SLOTS, qk_scale, stride_kn, stride_kd, stride_vn,
                    stride_vd, False, INPUT_PRECISION, UPCAST_DOT, MASK_BQ, MASK_BK, BLOCK_N)
    dq = _dq_listed(dq, q, do, lse2, delta, k_src, v_src, offs_d, mask_d, rows_in_tile, kv_idx_ptr, kv_slot_ptr,
                    bits_ptr, n_part, part0, N_K, K_TILES, NUM_SLOTS, qk_scale, stride_kn, stride_kd, stride_vn,
                    stride_vd, True, INPUT_PRECISION, UPCAST_DOT, MASK_BQ, MASK_BK, BLOCK_N)
    tl.store(_head_ptrs(dq_ptr, b, h, stride_dqb, stride_dqh, offs_m, stride_dqm, offs_d, stride_dqd),
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=qm)


@triton.jit
def _dkdv_listed(dk, dv, k, v, q_src, do_src, rows0, lse_ptr, delta_ptr, offs_d, mask_d, cols_in_tile,
                 idx_ptr, slot_ptr, bits_ptr, count, list0, N_Q, Q_TILES, NUM_SLOTS, qk_scale,
                 stride_qm, stride_qd, stride_dom, stride_dod,
                 PARTIAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr, BLOCK_M: tl.constexpr):
    """dv += P^T dO and dk += dS^T Q (unscaled) over the ``count`` listed query tiles of one query head. Keys
    as rows: S^T = K Q^T, so P^T and dS^T come out of their dots in the layout the next dots take."""
    SUBS: tl.constexpr = MASK_BQ // BLOCK_M
    offs_sub = tl.arange(0, BLOCK_M)
    for t in range(0, count * SUBS):
        entry = list0 + t // SUBS
        sub = (t % SUBS) * BLOCK_M
        offs_m = _entry(idx_ptr, entry, Q_TILES) * MASK_BQ + sub + offs_sub
        mask_m = offs_m < N_Q
        qm = mask_m[:, None] & mask_d[None, :]
        q = tl.load(q_src + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=qm,
                    other=0.0)
        do = tl.load(do_src + offs_m.to(tl.int64)[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=qm,
                     other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2, delta = _row_terms(lse_ptr, delta_ptr, rows0 + offs_m, mask_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale   # [BLOCK_N, BLOCK_M]
        if PARTIAL:
            slot = _entry(slot_ptr, entry, NUM_SLOTS)
            visible = _tile_bits(bits_ptr, slot, (sub + offs_sub)[None, :], cols_in_tile[:, None], MASK_BQ, MASK_BK)
            s_t = tl.where(visible, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - lse2[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        p_op = p_t.to(q_src.dtype.element_ty)
        ds_op = ds_t.to(q_src.dtype.element_ty)
        if UPCAST_DOT:
            p_op = p_op.to(tl.float32)
            ds_op = ds_op.to(tl.float32)
        dv = tl.dot(p_op, do, dv, input_precision=INPUT_PRECISION)
        dk = tl.dot(ds_op, q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["H_Q", "H_KV", "N_Q", "N_K", "GROUP", "mask_stride_b", "mask_stride_h", "Q_TILES",
                               "K_TILES", "NUM_SLOTS"])
def block_sparse_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    q_num_ptr, q_idx_ptr, q_slot_ptr, full_num_ptr, full_idx_ptr, bits_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H_Q, H_KV, N_Q, N_K, HEAD_DIM: tl.constexpr, GROUP,
    mask_stride_b, mask_stride_h, Q_TILES, K_TILES, NUM_SLOTS,
    qk_scale, scale,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    MASK_BQ: tl.constexpr, MASK_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (key block, batch, KV head): dK and dV of its keys summed on chip over the query heads
    of its GQA group, each walking its own mask's query lists for this key tile."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * H_KV + h_kv
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    n0 = pid_n * BLOCK_N
    k_tile = n0 // MASK_BK
    cols_in_tile = n0 - k_tile * MASK_BK + tl.arange(0, BLOCK_N)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    kv_mask = (offs_n < N_K)[:, None] & mask_d[None, :]
    k = tl.load(_head_ptrs(k_ptr, b, h_kv, stride_kb, stride_kh, offs_n, stride_kn, offs_d, stride_kd), mask=kv_mask,
                other=0.0)
    v = tl.load(_head_ptrs(v_ptr, b, h_kv, stride_vb, stride_vh, offs_n, stride_vn, offs_d, stride_vd), mask=kv_mask,
                other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for g in range(0, GROUP):
        h = h_kv * GROUP + g
        q_src = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_src = do_ptr + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        rows0 = (b * H_Q + h).to(tl.int64) * N_Q
        mrow = b * mask_stride_b + h * mask_stride_h
        n_full, full0 = _list_head(full_num_ptr, mrow, k_tile, K_TILES, Q_TILES)
        n_part, part0 = _list_head(q_num_ptr, mrow, k_tile, K_TILES, Q_TILES)
        dk, dv = _dkdv_listed(dk, dv, k, v, q_src, do_src, rows0, lse_ptr, delta_ptr, offs_d, mask_d, cols_in_tile,
                              full_idx_ptr, q_slot_ptr, bits_ptr, n_full, full0, N_Q, Q_TILES, NUM_SLOTS, qk_scale,
                              stride_qm, stride_qd, stride_dom, stride_dod, False, INPUT_PRECISION, UPCAST_DOT,
                              MASK_BQ, MASK_BK, BLOCK_M)
        dk, dv = _dkdv_listed(dk, dv, k, v, q_src, do_src, rows0, lse_ptr, delta_ptr, offs_d, mask_d, cols_in_tile,
                              q_idx_ptr, q_slot_ptr, bits_ptr, n_part, part0, N_Q, Q_TILES, NUM_SLOTS, qk_scale,
                              stride_qm, stride_qd, stride_dom, stride_dod, True, INPUT_PRECISION, UPCAST_DOT,
                              MASK_BQ, MASK_BK, BLOCK_M)
    tl.store(_head_ptrs(dk_ptr, b, h_kv, stride_dkb, stride_dkh, offs_n, stride_dkn, offs_d, stride_dkd),
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(_head_ptrs(dv_ptr, b, h_kv, stride_dvb, stride_dvh, offs_n, stride_dvn, offs_d, stride_dvd),
             dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


cache_keys.settle(globals())

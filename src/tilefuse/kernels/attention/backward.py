"""FlashAttention backward with recomputation: no [Nq, Nk] matrix is stored or written.

The forward keeps only its output O and the log-sum-exp per query row; here S and P are recomputed tile
by tile (more FLOPs, far fewer bytes: FlashAttention's trade). With D = rowsum(dO * O) (minus dlse when
the lse output carries a gradient):
    P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ = scale * dS K,  dK = scale * dS^T Q,
with dS times 1 - tanh^2 under Gemma 2's soft-capping (S = cap * tanh(scale * q.k / cap)); ALiBi's bias is
a constant of q and k.
Three kernels, none with atomics, so the gradients are bit-identical run to run (a fourth form, DQ_ATOMIC,
folds the dQ pass into the dK/dV kernel with fp32 atomic adds, for measuring the two against each other):
- ``attention_bwd_rowdot_kernel``: D per query row (reads dO and O once).
- ``attention_bwd_dkdv_kernel``: one program per (key block, batch, KV head) walks the query blocks that
  see its keys, for every query head of its GQA group, accumulating dK and dV in registers (the group's
  sum happens on chip). It recomputes S^T = K Q^T (keys as rows), so P^T and dS^T leave their dots in the
  layout wgmma takes as a register operand for dV += P^T dO and dK += dS^T Q.
- ``attention_bwd_dq_kernel``: one program per (query block, batch, query head) walks its key tiles
  (the forward's ranges) accumulating dQ.
HBM bytes (element size s): Q, K, V, O, dO read (dkdv: Q, dO once per KV head group member; dq: K, V
once per query block row band from L2), dQ, dK, dV written, lse and D (8 bytes per row): against eager
autograd's >= 4 * B*Hq*Nq*Nk*s for S, P, dP, dS. Masks (bool or additive), causal and windows as the
forward; any Nq, Nk and head dim <= 256 (padded to a power of two and masked). The head dim is a constexpr:
with a runtime bound the head-dim mask kept every tile load to one 16-bit element (a compile per head dim
instead). Scores live in the log2 domain (scale * log2(e) folded into qk_scale), as in the forward.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels import cache_keys
from tilefuse.kernels.activations import tanh
from tilefuse.kernels.attention.common import head_tile_ptrs, key_tile_ranges, score_modifiers, varlen_sequence

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)
MASK_FLOOR = tl.constexpr(-2.3e38)  # as the forward: a finite additive mask stays finite in the log2 domain


@triton.jit
def _row_terms(lse_ptr, delta_ptr, rows, mask):
    """(lse in the log2 domain, +inf where the row saw no key, so its P is 0; delta) for flat row indices."""
    lse = tl.load(lse_ptr + rows, mask=mask, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), tl.load(delta_ptr + rows, mask=mask, other=0.0)


@triton.jit
def attention_bwd_rowdot_kernel(
    o_ptr, do_ptr, dlse_ptr, delta_ptr,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H_Q, N_Q, HEAD_DIM: tl.constexpr,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta[b, h, m] = sum_d dO * O - dlse (fp32): the row term of dS = P * (dP - delta)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < N_Q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(head_tile_ptrs(o_ptr, b, h, stride_ob, stride_oh, offs_m, stride_om, offs_d, stride_od), mask=mask,
                other=0.0)
    do = tl.load(head_tile_ptrs(do_ptr, b, h, stride_dob, stride_doh, offs_m, stride_dom, offs_d, stride_dod), mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    rows = pid_bh.to(tl.int64) * N_Q + offs_m
    if HAS_DLSE:
        delta = delta - tl.load(dlse_ptr + rows, mask=offs_m < N_Q, other=0.0)
    tl.store(delta_ptr + rows, delta, mask=offs_m < N_Q)


@triton.jit
def _probabilities(s, lse2, offs_m, offs_n, pos_m, N_Q, N_K, window_left, window_right, mask_tile,
                   softcap_log2, alibi_log2,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr,
                   MASK_IS_BOOL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """(P, the softcap's chain factor 1 - tanh^2) for a [rows, keys] tile of scaled scores ``s`` (divided by
    the cap with HAS_SOFTCAP): the forward's score modifiers, bounds, window and mask, then
    exp2(s - lse2). ``lse2`` is +inf on rows that saw no key, so P = 0. The factor is 1 without a cap."""
    chain = 1.0
    if HAS_SOFTCAP:
        t = tanh(s)
        chain = 1.0 - t * t
    s = score_modifiers(s, pos_m, offs_n, N_K, softcap_log2, alibi_log2, HAS_SOFTCAP, HAS_ALIBI)
    visible = (offs_m < N_Q)[:, None] & (offs_n < N_K)[None, :]
    if HAS_LEFT:
        visible = visible & (offs_n[None, :] >= pos_m[:, None] - window_left)
    if HAS_RIGHT:
        visible = visible & (offs_n[None, :] <= pos_m[:, None] + window_right)
    if HAS_MASK:
        if MASK_IS_BOOL:
            visible = visible & (mask_tile != 0)
        else:
            mvals = mask_tile.to(tl.float32)
            s = s + tl.where(mvals == float("-inf"), float("-inf"), tl.maximum(mvals, MASK_FLOOR) * LOG2E)
    s = tl.where(visible, s, float("-inf"))
    return tl.math.exp2(s - lse2[:, None]), chain


@triton.jit(do_not_specialize=["N_Q", "N_K", "pos_offset", "window_left", "window_right"])
def attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, mask_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_maskb, stride_maskh, stride_maskm, stride_maskn,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H_Q, H_KV, N_Q, N_K, HEAD_DIM: tl.constexpr, GROUP,
    qk_scale, scale, pos_offset, window_left, window_right,
    softcap_log2, alibi_ptr, stride_alibi_b, stride_alibi_h,
    cu_q_ptr, cu_k_ptr,  # VARLEN: as the forward (tensors viewed [1, H, total, d], lse and delta [Hq, total_q])
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    # DQ_ATOMIC: also add each tile's dQ share, scale * dS K, into fp32 dq_acc (zeroed, q's [B, H, N, d] view) with
    # atomics, in place of the dQ pass: no second recompute of S and dP, but the order of the adds varies.
    DQ_ATOMIC: tl.constexpr = False, dq_acc_ptr=None, stride_dqab=0, stride_dqah=0, stride_dqam=0, stride_dqad=0,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * H_KV + h_kv
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    total_q = N_Q
    row0_q = 0
    row0_k = 0
    if VARLEN:  # b is the sequence (batch strides are 0): its rows come from the offsets
        row0_q, N_Q, row0_k, N_K, pos_offset = varlen_sequence(cu_q_ptr, cu_k_ptr, b, N_Q, N_K)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N_K
    mask_d = offs_d < HEAD_DIM
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(head_tile_ptrs(k_ptr, b, h_kv, stride_kb, stride_kh, row0_k + offs_n, stride_kn, offs_d, stride_kd),
                mask=kv_mask, other=0.0)
    v = tl.load(head_tile_ptrs(v_ptr, b, h_kv, stride_vb, stride_vh, row0_k + offs_n, stride_vn, offs_d, stride_vd),
                mask=kv_mask, other=0.0)
    op_dtype = k.dtype
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    # Query rows whose window reaches this key block: row i sees key j when
    # i + pos_offset - left <= j <= i + pos_offset + right.
    m_lo = 0
    m_hi = N_Q
    if HAS_RIGHT:
        m_lo = tl.maximum(n0 - pos_offset - window_right, 0)
    if HAS_LEFT:
        m_hi = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 + window_left - pos_offset + 1, 0), N_Q)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    if VARLEN:  # a key block past its sequence's end (the grid covers the longest) walks no query
        m_hi = tl.where(n0 < N_K, m_hi, m_lo)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    offs_m_base = tl.arange(0, BLOCK_M)
    for g in range(0, GROUP):
        h = h_kv * GROUP + g
        rows_base = (b * H_Q + h).to(tl.int64) * N_Q
        if VARLEN:
            rows_base = h.to(tl.int64) * total_q + row0_q
        mask_base = mask_ptr + b.to(tl.int64) * stride_maskb + h.to(tl.int64) * stride_maskh
        alibi_log2 = 0.0
        if HAS_ALIBI:
            alibi_log2 = tl.load(alibi_ptr + b.to(tl.int64) * stride_alibi_b + h.to(tl.int64) * stride_alibi_h) * LOG2E
        for m0 in range(m_lo, m_hi, BLOCK_M):
            offs_m = m0 + offs_m_base
            mask_m = offs_m < N_Q
            qm = mask_m[:, None] & mask_d[None, :]
            q = tl.load(head_tile_ptrs(q_ptr, b, h, stride_qb, stride_qh, row0_q + offs_m, stride_qm, offs_d, stride_qd),
                        mask=qm, other=0.0)
            do = tl.load(head_tile_ptrs(do_ptr, b, h, stride_dob, stride_doh, row0_q + offs_m, stride_dom, offs_d,
                                    stride_dod), mask=qm, other=0.0)
            lse2, delta = _row_terms(lse_ptr, delta_ptr, rows_base + offs_m, mask_m)
            if UPCAST_DOT:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            mask_tile = 0
            if HAS_MASK:
                mask_tile = tl.load(mask_base + offs_m.to(tl.int64)[:, None] * stride_maskm
                                    + offs_n[None, :] * stride_maskn,
                                    mask=mask_m[:, None] & mask_n[None, :], other=0)
            # Keys as rows: S^T = K Q^T, so P^T and dS^T come out of their dots in the layout wgmma takes
            # as its register A operand for dV += P^T dO and dK += dS^T Q (no trip through shared memory).
            s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale   # [BLOCK_N, BLOCK_M]
            p, chain = _probabilities(tl.trans(s_t), lse2, offs_m, offs_n, offs_m + pos_offset, N_Q, N_K,
                                      window_left, window_right, mask_tile, softcap_log2, alibi_log2, HAS_LEFT,
                                      HAS_RIGHT, HAS_MASK, MASK_IS_BOOL, HAS_SOFTCAP, HAS_ALIBI)
            p_t = tl.trans(p)
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)             # [BLOCK_N, BLOCK_M]
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_SOFTCAP:
                ds_t = ds_t * tl.trans(chain)
            p_op = p_t.to(op_dtype)
            ds_op = ds_t.to(op_dtype)
            if UPCAST_DOT:
                p_op = p_op.to(tl.float32)
                ds_op = ds_op.to(tl.float32)
            dv = tl.dot(p_op, do, dv, input_precision=INPUT_PRECISION)
            dk = tl.dot(ds_op, q, dk, input_precision=INPUT_PRECISION)
            if DQ_ATOMIC:
                dq_part = tl.dot(tl.trans(ds_op), k, input_precision=INPUT_PRECISION) * scale  # [BLOCK_M, BLOCK_D]
                tl.atomic_add(head_tile_ptrs(dq_acc_ptr, b, h, stride_dqab, stride_dqah, row0_q + offs_m, stride_dqam,
                                         offs_d, stride_dqad), dq_part, mask=qm)

    dk = dk * scale
    tl.store(head_tile_ptrs(dk_ptr, b, h_kv, stride_dkb, stride_dkh, row0_k + offs_n, stride_dkn, offs_d, stride_dkd),
             dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(head_tile_ptrs(dv_ptr, b, h_kv, stride_dvb, stride_dvh, row0_k + offs_n, stride_dvn, offs_d, stride_dvd),
             dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["N_Q", "N_K", "pos_offset", "window_left", "window_right"])
def attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, mask_ptr, dq_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_maskb, stride_maskh, stride_maskm, stride_maskn,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H_Q, N_Q, N_K, HEAD_DIM: tl.constexpr, GROUP,
    qk_scale, scale, pos_offset, window_left, window_right,
    softcap_log2, alibi_ptr, stride_alibi_b, stride_alibi_h,
    cu_q_ptr, cu_k_ptr,  # VARLEN: as the forward (tensors viewed [1, H, total, d], lse and delta [Hq, total_q])
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * H_Q + h
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // GROUP
    rows0 = pid_bh.to(tl.int64) * N_Q  # this head's first lse / delta row
    row0_q = 0
    row0_k = 0
    if VARLEN:  # b is the sequence (batch strides are 0): its rows come from the offsets
        total_q = N_Q
        row0_q, N_Q, row0_k, N_K, pos_offset = varlen_sequence(cu_q_ptr, cu_k_ptr, b, N_Q, N_K)
        rows0 = h.to(tl.int64) * total_q + row0_q
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM
    qm = mask_m[:, None] & mask_d[None, :]
    q = tl.load(head_tile_ptrs(q_ptr, b, h, stride_qb, stride_qh, row0_q + offs_m, stride_qm, offs_d, stride_qd), mask=qm,
                other=0.0)
    do = tl.load(head_tile_ptrs(do_ptr, b, h, stride_dob, stride_doh, row0_q + offs_m, stride_dom, offs_d, stride_dod),
                 mask=qm, other=0.0)
    op_dtype = q.dtype
    if UPCAST_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2, delta = _row_terms(lse_ptr, delta_ptr, rows0 + offs_m, mask_m)
    mask_base = (mask_ptr + b.to(tl.int64) * stride_maskb + h.to(tl.int64) * stride_maskh
                 + offs_m.to(tl.int64)[:, None] * stride_maskm)
    lo_tile, hi, _, _ = key_tile_ranges(m0, BLOCK_M, N_Q, N_K, pos_offset, window_left, window_right,
                                        HAS_LEFT, HAS_RIGHT, BLOCK_N)
    if VARLEN:  # a block past its sequence's end walks no key
        hi = tl.where(m0 < N_Q, hi, lo_tile)
    alibi_log2 = 0.0
    if HAS_ALIBI:
        alibi_log2 = tl.load(alibi_ptr + b.to(tl.int64) * stride_alibi_b + h.to(tl.int64) * stride_alibi_h) * LOG2E
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    offs_n_base = tl.arange(0, BLOCK_N)
    for n0 in range(lo_tile, hi, BLOCK_N):
        offs_n = n0 + offs_n_base
        mask_n = offs_n < N_K
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(head_tile_ptrs(k_ptr, b, h_kv, stride_kb, stride_kh, row0_k + offs_n, stride_kn, offs_d, stride_kd),
                    mask=kv_mask, other=0.0)
        v = tl.load(head_tile_ptrs(v_ptr, b, h_kv, stride_vb, stride_vh, row0_k + offs_n, stride_vn, offs_d, stride_vd),
                    mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        mask_tile = 0
        if HAS_MASK:
            mask_tile = tl.load(mask_base + offs_n[None, :] * stride_maskn, mask=mask_m[:, None] & mask_n[None, :],
                                other=0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        p, chain = _probabilities(s, lse2, offs_m, offs_n, offs_m + pos_offset, N_Q, N_K, window_left,
                                  window_right, mask_tile, softcap_log2, alibi_log2, HAS_LEFT, HAS_RIGHT, HAS_MASK,
                                  MASK_IS_BOOL, HAS_SOFTCAP, HAS_ALIBI)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds_op = (p * (dp - delta[:, None]) * chain).to(op_dtype)
        if UPCAST_DOT:
            ds_op = ds_op.to(tl.float32)
        dq = tl.dot(ds_op, k, dq, input_precision=INPUT_PRECISION)
    dq = dq * scale
    tl.store(head_tile_ptrs(dq_ptr, b, h, stride_dqb, stride_dqh, row0_q + offs_m, stride_dqm, offs_d, stride_dqd),
             dq.to(dq_ptr.dtype.element_ty), mask=qm)


cache_keys.settle(globals())

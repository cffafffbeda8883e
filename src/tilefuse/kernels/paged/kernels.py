"""KV cache kernels: the append of new tokens and decode / chunked-prefill attention over a cache.

A cache is paged (FlashAttention's layout: pages ``[num_pages, page_size, Hkv, d]`` and a block table of int32
page ids, key position n of table row r in page ``block_table[r, n // page_size]`` at row ``n % page_size``) or
dense (``[cache_batch, capacity, Hkv, d]``, position n of cache row r at ``[r, n]``): ``PAGED`` picks one, and
everything else is shared. Any page size works (positions are gathered per element, not per page).

- ``kv_append_kernel``: one program per (sequence, new token, block of KV heads) writes that token's keys
  (rotated, if a rotary table is given) and values of those heads into the cache. Bytes: 2 * S*T*Hkv*d*s read and written.
- ``kv_attention_kernel``: flash-decoding. One program per (sequence, block of query rows, KV head, split)
  holds the query rows of all G = Hq / Hkv query heads of that KV head as the rows of one tile (rows ordered
  token-major: row r is token r // G, head r % G), so each key and value tile is read once per KV head, not
  once per query head, and walks its split of the visible key positions with an online softmax. Query token
  t of a sequence with n keys and Tq query tokens sits at position n - Tq + t (bottom-right alignment); the
  window (causal: right = 0), soft-capping, ALiBi and a left padding bound the keys it sees, and only the key
  tiles that some row of the block sees are read. With one split the program writes the output (and lse);
  with several it writes a normalised partial output and its log2-domain lse, which ``kv_merge_kernel``
  combines. Bytes: the visible KV once per KV head (2 * L*Hkv*d*s per sequence), q and the output, plus
  2 * S*Tq*Hq*splits*(d + 1)*4 of fp32 partials.

Page ids, rows, lengths and rotary positions come from tables the host may not have validated: the kernels
clamp each of them into its tensor, so that no value addresses memory outside the tensors.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import tanh

LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: compiled kernels read no plain globals


@triton.jit
def rotary_rows(x_ptr, rows_addr, offs_d, row_ok, d_ok, stride_xd, cos_ptr, sin_ptr, pos, stride_cos,
                stride_sin, ROT_HALF, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A [rows, BLOCK_D] tile loaded from ``x_ptr + rows_addr[:, None] + offs_d * stride_xd`` in fp32, and with
    ``ROTARY`` its first 2 * ROT_HALF dims rotated by the cos / sin tables' rows ``pos`` (one per row):
    GPT-NeoX halves (d and d + ROT_HALF paired) or, ``INTERLEAVED``, GPT-J pairs (2i and 2i + 1)."""
    mask = row_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + rows_addr[:, None] + offs_d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if ROTARY:
        rot = offs_d < 2 * ROT_HALF
        if INTERLEAVED:
            partner = offs_d ^ 1
            sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
            freq = offs_d // 2
        else:
            first = offs_d < ROT_HALF
            partner = tl.where(first, offs_d + ROT_HALF, offs_d - ROT_HALF)
            sign = tl.where(first, -1.0, 1.0)
            freq = tl.where(first, offs_d, offs_d - ROT_HALF)
        rmask = row_ok[:, None] & (rot & d_ok)[None, :]
        xp = tl.load(x_ptr + rows_addr[:, None] + partner[None, :] * stride_xd, mask=rmask, other=0.0)
        pos64 = pos.to(tl.int64)
        c = tl.load(cos_ptr + pos64[:, None] * stride_cos + freq[None, :], mask=rmask, other=1.0)
        s = tl.load(sin_ptr + pos64[:, None] * stride_sin + freq[None, :], mask=rmask, other=0.0)
        x = tl.where(rot[None, :], x * c.to(tl.float32) + sign[None, :] * xp.to(tl.float32) * s.to(tl.float32), x)
    return x


@triton.jit
def kv_append_kernel(
    k_ptr, v_ptr, k_cache, v_cache, block_table, slots_ptr, old_lens_ptr, cos_ptr, sin_ptr,
    HKV, HEAD_DIM, PAGE_SIZE, NUM_ROWS, CAPACITY, PAGES_PER_SEQ, NUM_PAGES, ROT_LEN, ROT_HALF,
    stride_ks, stride_kt, stride_kh, stride_kd,
    stride_vs, stride_vt, stride_vh, stride_vd,
    stride_cp, stride_ct, stride_ch, stride_cd,
    stride_dp, stride_dt, stride_dh, stride_dd,
    stride_bts, stride_btp, stride_cos, stride_sin,
    PAGED: tl.constexpr, HAS_SLOTS: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Token t of sequence s goes to position old_lens[s] + t of cache row slots[s] (s without slots); a
    position past the row's capacity is not written. Axis 2 splits the KV heads in blocks of BLOCK_H."""
    s = tl.program_id(0)
    t = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + s)
    else:
        slot = s
    slot = tl.minimum(tl.maximum(slot, 0), NUM_ROWS - 1).to(tl.int64)
    pos = tl.load(old_lens_ptr + s) + t
    in_cache = (pos >= 0) & (pos < CAPACITY)
    pos_c = tl.minimum(tl.maximum(pos, 0), CAPACITY - 1)
    if PAGED:
        page = tl.load(block_table + slot * stride_bts + (pos_c // PAGE_SIZE) * stride_btp)
        base = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
        row = (pos_c % PAGE_SIZE).to(tl.int64)
    else:
        base = slot
        row = pos_c.to(tl.int64)
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < HKV
    d_ok = offs_d < HEAD_DIM
    mask = h_ok[:, None] & d_ok[None, :]
    rot_pos = tl.zeros([BLOCK_H], tl.int32) + tl.minimum(tl.maximum(pos, 0), ROT_LEN - 1)
    src_k = s.to(tl.int64) * stride_ks + t.to(tl.int64) * stride_kt + offs_h.to(tl.int64) * stride_kh
    k = rotary_rows(k_ptr, src_k, offs_d, h_ok, d_ok, stride_kd, cos_ptr, sin_ptr, rot_pos, stride_cos,
                    stride_sin, ROT_HALF, ROTARY, INTERLEAVED)
    src_v = s.to(tl.int64) * stride_vs + t.to(tl.int64) * stride_vt
    v = tl.load(v_ptr + src_v + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst_k = k_cache + base * stride_cp + row * stride_ct
    tl.store(dst_k + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd, k.to(k_cache.dtype.element_ty),
             mask=mask & in_cache)
    dst_v = v_cache + base * stride_dp + row * stride_dt
    tl.store(dst_v + offs_h[:, None] * stride_dh + offs_d[None, :] * stride_dd, v, mask=mask & in_cache)


@triton.jit
def kv_attention_kernel(
    q_ptr, k_cache, v_cache, block_table, lens_ptr, slots_ptr, leftpad_ptr, cu_q_ptr, cos_ptr, sin_ptr,
    alibi_ptr, out_ptr, lse_ptr, part_o, part_lse,
    T, G, H_Q, HEAD_DIM, PAGE_SIZE, NUM_ROWS, CAPACITY, PAGES_PER_SEQ, NUM_PAGES, EXTRA_KEYS, M_BLOCKS,
    qk_scale, softcap_log2, window_left, window_right, ROT_LEN, ROT_HALF, TOTAL_Q, num_splits,
    stride_qs, stride_qt, stride_qh, stride_qd,
    stride_kp, stride_kt, stride_kh, stride_kd,
    stride_vp, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btp,
    stride_os, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lh, stride_lt,
    stride_ab, stride_ah, stride_cos, stride_sin,
    PAGED: tl.constexpr, HAS_LENS: tl.constexpr, LENS_BY_SLOT: tl.constexpr, HAS_SLOTS: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, VARLEN_Q: tl.constexpr, BANDED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, ROT_Q_SEQUENTIAL: tl.constexpr,
    RETURN_LSE: tl.constexpr, SPLIT_KV: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Arguments: ``lens`` (HAS_LENS; else every row holds CAPACITY keys) plus EXTRA_KEYS is each sequence's
    key count, indexed by its slot (LENS_BY_SLOT) or by the sequence; ``slots`` (HAS_SLOTS; else the sequence
    itself) its cache row; ``leftpad`` its first visible key; ``cu_q`` (VARLEN_Q) packed query offsets, else
    T tokens each. BANDED: keys p - window_left <= j <= p + window_right (both >= 0 here; the host passes a
    bound past every key for an unbounded side). ``qk_scale`` is scale * log2(e), or with HAS_SOFTCAP scale / cap
    (the score is cap * tanh(s / cap) in natural log; ``softcap_log2`` = cap * log2(e)); ``alibi`` holds fp32 slopes per (sequence, query head).
    ROTARY rotates q at positions lens + t (ROT_Q_SEQUENTIAL) or lens. The lse is stored in natural log."""
    pid = tl.program_id(0)
    b = pid // M_BLOCKS
    m_block = pid % M_BLOCKS
    h_kv = tl.program_id(1)
    split = tl.program_id(2)

    if VARLEN_Q:
        q0 = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b), 0), TOTAL_Q)
        n_q = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1), q0), TOTAL_Q) - q0
    else:
        q0 = 0
        n_q = T
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + b)
    else:
        slot = b
    slot = tl.minimum(tl.maximum(slot, 0), NUM_ROWS - 1).to(tl.int64)
    if HAS_LENS:
        if LENS_BY_SLOT:
            base_len = tl.load(lens_ptr + slot)
        else:
            base_len = tl.load(lens_ptr + b)
    else:
        base_len = CAPACITY
    n_keys = tl.minimum(tl.maximum(base_len + EXTRA_KEYS, 0), CAPACITY)
    if HAS_LEFTPAD:
        key_lo = tl.minimum(tl.maximum(tl.load(leftpad_ptr + b), 0), n_keys)
    else:
        key_lo = 0

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // G
    row_ok = (tok < n_q) & (tok < T)  # T bounds the partials' rows even where cu_q was not validated
    head = h_kv * G + rows % G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = b.to(tl.int64) * stride_qs + (q0 + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    if ROT_Q_SEQUENTIAL:
        rot_pos = base_len + tok
    else:
        rot_pos = base_len + tok * 0
    rot_pos = tl.minimum(tl.maximum(rot_pos, 0), ROT_LEN - 1)
    q = rotary_rows(q_ptr, q_rows, offs_d, row_ok, d_ok, stride_qd, cos_ptr, sin_ptr, rot_pos, stride_cos,
                    stride_sin, ROT_HALF, ROTARY, INTERLEAVED).to(k_cache.dtype.element_ty)
    q_pos = n_keys - n_q + tok
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + b.to(tl.int64) * stride_ab + head * stride_ah, mask=row_ok, other=0.0)
        alibi_log2 = slope * 1.4426950408889634

    # The keys some row of this block sees, in whole BLOCK_N tiles from a tile boundary, split evenly.
    lo = key_lo
    hi = n_keys
    if BANDED:
        first_pos = n_keys - n_q + m_block * BLOCK_M // G
        last_pos = n_keys - n_q + tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // G, n_q - 1)
        lo = tl.maximum(lo, first_pos - window_left)
        hi = tl.minimum(hi, last_pos + window_right + 1)
    lo = tl.minimum(lo, hi)
    lo = (lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(hi, start + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_table + slot * stride_bts
    kv_head_k = h_kv.to(tl.int64) * stride_kh
    kv_head_v = h_kv.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < end) & (offs_n >= key_lo)
        if PAGED:
            page = tl.load(table_row + (offs_n // PAGE_SIZE) * stride_btp, mask=n_ok, other=0)
            base = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
            key_row = (offs_n % PAGE_SIZE).to(tl.int64)
        else:
            base = slot + offs_n * 0
            key_row = offs_n.to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + (base * stride_kp + key_row * stride_kt + kv_head_k)[:, None]
                    + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache + (base * stride_vp + key_row * stride_vt + kv_head_v)[:, None]
                    + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            scores = tanh(scores) * softcap_log2
        if HAS_ALIBI:
            scores = scores - alibi_log2[:, None] * tl.abs(q_pos[:, None] - offs_n[None, :]).to(tl.float32)
        visible = n_ok[None, :]
        if BANDED:
            visible = visible & (offs_n[None, :] >= q_pos[:, None] - window_left) \
                & (offs_n[None, :] <= q_pos[:, None] + window_right)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse2 = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT_KV:
        o_rows = b.to(tl.int64) * stride_os + (q0 + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
        if RETURN_LSE:
            l_rows = b.to(tl.int64) * stride_ls + head.to(tl.int64) * stride_lh + (q0 + tok).to(tl.int64) * stride_lt
            tl.store(lse_ptr + l_rows, lse2 * LN2, mask=row_ok)
    else:
        part = ((b.to(tl.int64) * T + tok) * H_Q + head) * num_splits + split
        tl.store(part_lse + part, lse2, mask=row_ok)
        tl.store(part_o + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)


@triton.jit
def kv_merge_kernel(
    part_o, part_lse, out_ptr, lse_ptr, cu_q_ptr, T, H_Q, HEAD_DIM, TOTAL_Q, num_splits,
    stride_os, stride_ot, stride_oh, stride_od, stride_ls, stride_lh, stride_lt,
    VARLEN_Q: tl.constexpr, RETURN_LSE: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combines the splits of one (sequence, token, query head) row by their log-sum-exps."""
    r = tl.program_id(0).to(tl.int64)
    b = r // (T * H_Q)
    tok = (r // H_Q) % T
    head = r % H_Q
    if VARLEN_Q:
        q0 = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b), 0), TOTAL_Q)
        n_q = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1), q0), TOTAL_Q) - q0
    else:
        q0 = 0
        n_q = T
    if tok < n_q:
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < num_splits
        lse = tl.load(part_lse + r * num_splits + offs_s, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_safe)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        o = tl.load(part_o + (r * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        w_sum = tl.sum(w, 0)
        o = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)
        row = q0 + tok
        dst = out_ptr + b * stride_os + row * stride_ot + head * stride_oh
        tl.store(dst + offs_d * stride_od, o.to(out_ptr.dtype.element_ty), mask=d_ok)
        if RETURN_LSE:
            lse_row = tl.where(w_sum > 0, m_safe + tl.log2(tl.where(w_sum > 0, w_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + b * stride_ls + head * stride_lh + row * stride_lt, lse_row * LN2)

"""Paged KV cache kernels.

Layout (FlashAttention's paged layout, one layer): pages ``[num_pages, page_size, Hkv, d]``, a block table
``[max_seqs, pages_per_seq]`` of int32 page ids and ``seq_lens[max_seqs]`` int32. Key position n of sequence slot
``s`` lives in page ``block_table[s, n // page_size]`` at row ``n % page_size``; any page size works (positions
are gathered per element, not per page).

- ``paged_append_kernel``: one program per (sequence, new token) writes that token's keys and values for every
  KV head into its page. Bytes: 2 * S*T*Hkv*d*s read and written, nothing else.
- ``paged_decode_kernel``: flash-decoding. One program per (sequence, KV head, split) holds the T new query
  tokens of all G = Hq / Hkv query heads of that KV head as the rows of one tile (T*G rows), so each key and
  value tile is read once per KV head, not once per query head, and walks its split of the key positions with
  an online softmax. Causal among the new tokens: query token t sits at position L - T + t and sees keys
  0..L - T + t. With one split the program writes the output; with several it writes a normalised partial
  output and its log2-domain log-sum-exp, which ``paged_merge_kernel`` combines. Bytes: the KV pages read once
  per KV head (2 * L*Hkv*d*s per sequence), q and the output, plus 2 * S*T*Hq*splits*(d + 1)*4 of fp32 partials.

Page ids and lengths come from the cache's own tables; the kernels still clamp both (a page id to
[0, num_pages), a length to the table's reach) so that no value of them addresses memory outside the tensors.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_append_kernel(
    k_ptr, v_ptr, k_pages, v_pages, block_table, slots_ptr, old_lens_ptr,
    HKV, HEAD_DIM, PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ,
    stride_ks, stride_kt, stride_kh, stride_kd,
    stride_vs, stride_vt, stride_vh, stride_vd,
    stride_kpp, stride_kpt, stride_kph, stride_kpd,
    stride_vpp, stride_vpt, stride_vph, stride_vpd,
    stride_bts, stride_btp,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    t = tl.program_id(1)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    pos = tl.load(old_lens_ptr + s) + t
    page_col = tl.minimum(tl.maximum(pos // PAGE_SIZE, 0), PAGES_PER_SEQ - 1)
    page = tl.load(block_table + slot * stride_bts + page_col * stride_btp)
    page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
    row = (pos % PAGE_SIZE).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < HKV)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = s.to(tl.int64) * stride_ks + t.to(tl.int64) * stride_kt
    k = tl.load(k_ptr + src + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    src_v = s.to(tl.int64) * stride_vs + t.to(tl.int64) * stride_vt
    v = tl.load(v_ptr + src_v + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst_k = k_pages + page * stride_kpp + row * stride_kpt
    tl.store(dst_k + offs_h[:, None] * stride_kph + offs_d[None, :] * stride_kpd, k, mask=mask)
    dst_v = v_pages + page * stride_vpp + row * stride_vpt
    tl.store(dst_v + offs_h[:, None] * stride_vph + offs_d[None, :] * stride_vpd, v, mask=mask)


@triton.jit
def paged_decode_kernel(
    q_ptr, k_pages, v_pages, block_table, seq_lens, slots_ptr, out_ptr, part_o, part_lse,
    T, G, H_Q, HEAD_DIM, PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ, qk_scale,
    stride_qs, stride_qt, stride_qh, stride_qd,
    stride_kpp, stride_kpt, stride_kph, stride_kpd,
    stride_vpp, stride_vpt, stride_vph, stride_vpd,
    stride_bts, stride_btp,
    stride_os, stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h_kv = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    n_keys = tl.minimum(tl.load(seq_lens + slot), PAGES_PER_SEQ * PAGE_SIZE)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < T * G
    tok = rows // G
    head = h_kv * G + rows % G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = s.to(tl.int64) * stride_qs + tok.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    q_pos = n_keys - T + tok

    # This split's key positions, whole BLOCK_N tiles except at the sequence's end.
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(n_keys, start + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_table + slot * stride_bts
    kv_head_k = h_kv.to(tl.int64) * stride_kph
    kv_head_v = h_kv.to(tl.int64) * stride_vph
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        page = tl.load(table_row + (offs_n // PAGE_SIZE) * stride_btp, mask=n_ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
        key_row = (offs_n % PAGE_SIZE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_pages + (page * stride_kpp + key_row * stride_kpt + kv_head_k)[:, None]
                    + offs_d[None, :] * stride_kpd, mask=kv_mask, other=0.0)
        v = tl.load(v_pages + (page * stride_vpp + key_row * stride_vpt + kv_head_v)[:, None]
                    + offs_d[None, :] * stride_vpd, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_rows = s.to(tl.int64) * stride_os + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part = ((s.to(tl.int64) * T + tok) * H_Q + head) * NUM_SPLITS + split
        tl.store(part_lse + part, lse, mask=row_ok)
        tl.store(part_o + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)


@triton.jit
def paged_merge_kernel(
    part_o, part_lse, out_ptr, T, H_Q, HEAD_DIM,
    stride_os, stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combines the splits of one (sequence, token, query head) row by their log-sum-exps."""
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(part_lse + r * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    o = tl.load(part_o + (r * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    b = r // (T * H_Q)
    tok = (r // H_Q) % T
    head = r % H_Q
    dst = out_ptr + b * stride_os + tok * stride_ot + head * stride_oh
    tl.store(dst + offs_d * stride_od, o.to(out_ptr.dtype.element_ty), mask=d_ok)

"""Reference for KV caches: the cache rows gathered into dense keys and values, then plain attention.

Dense math in the dtype asked for (float64 in the tests); one sequence at a time, since their lengths differ.
The functions take the launch layer's arguments (tilefuse.kernels.paged.launch), so the op's reference path and
its kernels see one contract: a paged cache (``block_table``) or a dense one, lengths ``lens`` (+ ``extra_keys``)
by slot or by sequence, optional slots, left padding, packed queries (``cu_q``), window, soft-cap, ALiBi and a
rotary table.
"""
from __future__ import annotations

import torch

from tilefuse.reference.linear import rotate_half, rotate_pairs


def gather(pages: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, ``[length, Hkv, d]``, from pages ``[P, page_size, Hkv, d]``."""
    page_size = pages.shape[1]
    n_pages = -(-length // page_size)
    return pages[block_table_row[:n_pages].long()].reshape(-1, *pages.shape[2:])[:length]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x ``[n, H, d]`` with its first 2 * cos.shape[1] dims rotated at positions ``pos`` ``[n]`` (GPT-NeoX halves,
    or GPT-J pairs when ``interleaved``), in x's dtype."""
    r = 2 * cos.shape[1]
    c, s = cos[pos].to(x.dtype), sin[pos].to(x.dtype)  # [n, r/2]
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        turn = rotate_pairs(x[..., :r])
    else:
        c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
        turn = rotate_half(x[..., :r])
    return torch.cat([x[..., :r] * c[:, None] + turn * s[:, None], x[..., r:]], -1)


def _row(cache, block_table, slot, capacity):
    if block_table is None:
        return cache[slot]
    return gather(cache, block_table[slot], capacity)


def _geometry(cache, block_table):
    rows = block_table.shape[0] if block_table is not None else cache.shape[0]
    capacity = cache.shape[1] * block_table.shape[1] if block_table is not None else cache.shape[1]
    return rows, capacity


def append(k, v, k_cache, v_cache, block_table, slots, old_lens, rotary=None) -> None:
    """Writes k, v ``[S, T, Hkv, d]`` at positions old_lens[s] + t of cache row slots[s] (s without slots), in
    place; rotary None or (cos, sin, interleaved) rotates k first. Positions past the capacity are dropped."""
    T = k.shape[1]
    rows, capacity = _geometry(k_cache, block_table)
    slot_list = slots.tolist() if slots is not None else list(range(k.shape[0]))
    for s, (slot, start) in enumerate(zip(slot_list, old_lens.tolist())):
        pos = torch.arange(start, start + T, device=k.device)
        keep = (pos >= 0) & (pos < capacity)
        ks = k[s]
        if rotary is not None:
            cos, sin, interleaved = rotary
            ks = rotate(ks, cos, sin, pos.clamp(0, cos.shape[0] - 1), interleaved)
        pos, ks, vs = pos[keep], ks[keep], v[s][keep]
        if block_table is None:
            k_cache[slot, pos] = ks.to(k_cache.dtype)
            v_cache[slot, pos] = vs.to(v_cache.dtype)
        else:
            page_size = k_cache.shape[1]
            pages = block_table[slot][pos // page_size].long()
            k_cache[pages, pos % page_size] = ks.to(k_cache.dtype)
            v_cache[pages, pos % page_size] = vs.to(v_cache.dtype)


def attend(q, k, v, scale, q_pos, key_lo=0, window=None, softcap=None, slopes=None):
    """One sequence: q ``[Tq, Hq, d]`` at key positions ``q_pos`` ``[Tq]``, keys and values ``[n, Hkv, d]`` at
    positions 0..n-1 (GQA: each KV head repeated for its query heads); keys before ``key_lo`` and outside the
    ``window`` (left, right; -1 unbounded) around each query's position are hidden; ``softcap`` caps the scaled
    scores (cap * tanh(s / cap)) and ``slopes`` ``[Hq]`` add ALiBi's -slope * |p - j|. Returns (out ``[Tq, Hq,
    d]``, lse ``[Hq, Tq]``); a row that sees no key gives 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n = k.shape[0]
    scores = torch.einsum("thd,nhd->htn", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    j = torch.arange(n, device=q.device)
    if slopes is not None:
        scores = scores - slopes.to(scores.dtype)[:, None, None] * (q_pos[:, None] - j[None, :]).abs().to(scores.dtype)
    visible = (j[None, :] >= key_lo).expand(q.shape[0], n)
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j[None, :] >= q_pos[:, None] - left)
        if right >= 0:
            visible = visible & (j[None, :] <= q_pos[:, None] + right)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("htn,nhd->thd", torch.softmax(scores, -1), v)
    return out.masked_fill(~visible.any(-1)[:, None, None], 0.0), lse


def attention(q, k_cache, v_cache, *, block_table, lens, lens_by_slot, extra_keys, slots, leftpad, cu_q, max_q,
              scale, window, softcap, alibi, rotary, dtype=None):
    """The launch layer's ``attention`` (same arguments but ``max_keys``, ``num_splits``, ``return_lse``), in
    ``dtype`` (default q's): returns (out in q's dtype or ``dtype``, lse fp32 or ``dtype``, natural log)."""
    dtype = dtype or q.dtype
    varlen = cu_q is not None
    B = cu_q.shape[0] - 1 if varlen else q.shape[0]
    hq = q.shape[-2]
    rows, capacity = _geometry(k_cache, block_table)
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((hq, q.shape[0]) if varlen else (B, hq, q.shape[1]), float("-inf"),
                     dtype=dtype if dtype == torch.float64 else torch.float32, device=q.device)
    offsets = cu_q.tolist() if varlen else None
    slot_list = slots.tolist() if slots is not None else list(range(B))
    for b in range(B):
        slot = min(max(slot_list[b], 0), rows - 1)
        base = capacity if lens is None else int(lens[slot if lens_by_slot else b])
        n = min(max(base + extra_keys, 0), capacity)
        qb = q[offsets[b]:offsets[b + 1]] if varlen else q[b]
        t = qb.shape[0]
        qb = qb.to(dtype)
        if rotary is not None:
            cos, sin, interleaved, sequential = rotary
            pos = base + (torch.arange(t, device=q.device) if sequential else torch.zeros(t, dtype=torch.long,
                                                                                         device=q.device))
            qb = rotate(qb.to(q.dtype), cos, sin, pos.clamp(0, cos.shape[0] - 1), interleaved).to(dtype)
        k = _row(k_cache, block_table, slot, capacity)[:n].to(dtype)
        v = _row(v_cache, block_table, slot, capacity)[:n].to(dtype)
        key_lo = min(max(int(leftpad[b]), 0), n) if leftpad is not None else 0
        q_pos = torch.arange(t, device=q.device) + n - t
        o, l = attend(qb, k, v, scale, q_pos, key_lo, window, softcap, None if alibi is None else alibi[b])
        if varlen:
            out[offsets[b]:offsets[b + 1]] = o
            lse[:, offsets[b]:offsets[b + 1]] = l
        else:
            out[b] = o
            lse[b] = l
    return out, lse


def paged_attention(q, k_pages, v_pages, block_table, seq_lens, slots, scale: float,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence, q ``[S, T, Hq, d]`` being its last T positions (causal among
    them), over its first seq_lens[slot] keys of a PagedKVCache layer. The result has q's dtype, or ``dtype``
    (the math runs in it too)."""
    out, _ = attention(q, k_pages, v_pages, block_table=block_table, lens=seq_lens, lens_by_slot=True, extra_keys=0,
                       slots=slots, leftpad=None, cu_q=None, max_q=q.shape[1], scale=scale, window=(-1, 0),
                       softcap=None, alibi=None, rotary=None, dtype=dtype)
    return out

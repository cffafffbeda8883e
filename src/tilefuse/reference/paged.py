"""Reference for paged KV caches: the pages gathered into dense keys and values, then plain attention.

Dense math in the dtype asked for (float64 in the tests); one sequence at a time, since their lengths differ.
"""
from __future__ import annotations

import torch


def gather(pages: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, ``[length, Hkv, d]``, from pages ``[P, page_size, Hkv, d]``."""
    page_size = pages.shape[1]
    n_pages = -(-length // page_size)
    return pages[block_table_row[:n_pages].long()].reshape(-1, *pages.shape[2:])[:length]


def append(k, v, k_pages, v_pages, block_table, slots, old_lens) -> None:
    """Writes k, v ``[S, T, Hkv, d]`` at positions old_lens[s] + t of slot slots[s] (in place)."""
    page_size = k_pages.shape[1]
    T = k.shape[1]
    for s, (slot, start) in enumerate(zip(slots.tolist(), old_lens.tolist())):
        pos = torch.arange(start, start + T, device=k.device)
        pages = block_table[slot][pos // page_size].long()
        k_pages[pages, pos % page_size] = k[s]
        v_pages[pages, pos % page_size] = v[s]


def paged_attention(q, k_pages, v_pages, block_table, seq_lens, slots, scale: float,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence, q ``[S, T, Hq, d]`` being its last T positions (causal among
    them), over its first seq_lens[slot] keys; GQA by repeating each KV head for its query heads. The result has
    q's dtype, or ``dtype`` (the math runs in it too)."""
    dtype = dtype or q.dtype
    S, T, hq, d = q.shape
    group = hq // k_pages.shape[2]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for s, slot in enumerate(slots.tolist()):
        length = int(seq_lens[slot])
        k = gather(k_pages, block_table[slot], length).to(dtype).repeat_interleave(group, dim=1)
        v = gather(v_pages, block_table[slot], length).to(dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[s].to(dtype), k) * scale
        q_pos = torch.arange(length - T, length, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s] = torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), v)
    return out

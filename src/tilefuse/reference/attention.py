"""Reference for attention: explicit softmax(q k^T * scale + mask) v in plain PyTorch.

This is the unfused math (the scores are materialised). When the score matrix would pass
``CHUNK_BYTES`` it is computed one block of query rows at a time -- still the same unfused ops,
but a 16k-token reference does not need B*H*N*N*8 bytes at once.
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 4 << 30


def _rows_per_chunk(n_rows_total: int, n_q: int, n_k: int, elem_bytes: int) -> int:
    """Query rows per chunk so that one chunk's scores (all batches and heads) stay under CHUNK_BYTES."""
    per_row = max(1, n_rows_total // max(n_q, 1)) * n_k * elem_bytes * 3  # scores, probs, a temporary
    return max(1, min(n_q, CHUNK_BYTES // per_row))


def _safe_softmax(s: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; a row that is all -inf gives 0 (torch's SDPA math does the same)."""
    p = torch.softmax(s, dim=-1)
    fully_masked = (s == float("-inf")).all(dim=-1, keepdim=True)
    return p.masked_fill(fully_masked, 0.0)


def visibility(n_q: int, n_k: int, pos_offset: int, left: int, right: int, device) -> torch.Tensor | None:
    """[n_q, n_k] bool: query row i (position i + pos_offset) sees key j when
    p - left <= j <= p + right; a negative bound is unbounded. None when everything is visible."""
    if left < 0 and right < 0:
        return None
    pos = torch.arange(n_q, device=device)[:, None] + pos_offset
    j = torch.arange(n_k, device=device)[None, :]
    vis = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        vis &= j >= pos - left
    if right >= 0:
        vis &= j <= pos + right
    return vis


def alibi_row_shift(pos, n_k):
    """dmin(p) = max(0, -p) + max(0, p - (n_k - 1)): the distance from key position ``pos`` (a tensor) to the
    nearest of the keys 0..n_k - 1 (``n_k`` an int or a tensor broadcasting with ``pos``). tilefuse's op
    measures ALiBi from there (``modify_scores(..., alibi_from_nearest=True)``), so its lse is the true one
    plus ``slope * dmin(p)``."""
    return (-pos).clamp(min=0) + (pos - (n_k - 1)).clamp(min=0)


def modify_scores(s, softcap=None, alibi=None, pos_offset=0, alibi_from_nearest=False):
    """Gemma 2's soft-capping ``softcap * tanh(s / softcap)``, then ALiBi's ``-slope * |p - j|`` (alibi
    [B, Hq] slopes, p = i + pos_offset) on scaled scores s [B, Hq, rows, Nk] whose rows start at row 0 and
    hold every key. ``alibi_from_nearest``: ``-slope * (|p - j| - dmin(p))`` instead (:func:`alibi_row_shift`),
    the convention of tilefuse's op and kernels: a constant per row, so the probabilities are the same,
    while the scores and the lse of rows far outside the keys stay O(1) (in fp32 the constant's rounding
    would dominate exp(s - lse))."""
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        n_k = s.shape[-1]
        pos = torch.arange(s.shape[-2], device=s.device)[:, None] + pos_offset
        dist = (pos - torch.arange(n_k, device=s.device)[None, :]).abs()
        if alibi_from_nearest:
            dist = dist - alibi_row_shift(pos, n_k)  # integers: exact before the conversion below
        s = s - alibi.to(s.dtype)[..., None, None] * dist.to(s.dtype)
    return s


def _attend(q, k, v, scale, vis, mask, softcap=None, alibi=None, pos_offset=0, alibi_from_nearest=False):
    """q [..., Nq, d], k/v [..., Nk, d] (broadcastable batch dims); vis [Nq, Nk] or None; mask
    (bool or additive) broadcastable to [..., Nq, Nk] or None; the score modifiers as
    :func:`modify_scores`. Returns (out, lse)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    rows_total = q.numel() // max(q.shape[-1], 1)
    step = _rows_per_chunk(rows_total, n_q, n_k, q.element_size())
    outs, lses = [], []
    for r0 in range(0, n_q, step):
        r1 = min(n_q, r0 + step)
        s = (q[..., r0:r1, :] @ k.transpose(-2, -1)) * scale
        if softcap is not None or alibi is not None:
            s = modify_scores(s, softcap, alibi, pos_offset + r0, alibi_from_nearest)
        if vis is not None:
            s = s.masked_fill(~vis[r0:r1], float("-inf"))
        if mask is not None:
            m = mask[..., r0:r1, :] if mask.dim() >= 2 and mask.shape[-2] == n_q else mask
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(_safe_softmax(s).to(v.dtype) @ v)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def attention(q, k, v, causal=False, window=None, scale=None, return_lse=False, deterministic=False, softcap=None,
              alibi_slopes=None):
    """tilefuse.attention's semantics: GQA by repeat_interleave, bottom-right aligned causal/window,
    softcap and ALiBi slopes ([Hq] or [B, Hq])."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    alibi = None if alibi_slopes is None else alibi_slopes.expand(q.shape[0], q.shape[1])
    out, lse = attend(q, k, v, None, scale, k.shape[-2] - q.shape[-2], left, right, softcap, alibi)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's math: top-left causal, bool or additive
    mask, broadcast batch dims, GQA by repeat_interleave over dim -3. (torch's math backend refuses
    is_causal with a mask; here, as in torch's CPU flash kernel, both apply.)"""
    if dropout_p > 0:
        raise NotImplementedError("the reference has no dropout")
    n_q, n_k = query.shape[-2], key.shape[-2]
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    vis = visibility(n_q, n_k, 0, -1, 0, query.device) if is_causal else None
    return _attend(query, key, value, scale, vis, attn_mask)[0]


def attend(q, k, v, mask, scale, pos_offset, left, right, softcap=None, alibi=None, alibi_from_nearest=False):
    """The math behind tilefuse's attention op on 4-D inputs: q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d]
    (GQA by repeat_interleave), query row i at key position i + pos_offset seeing keys
    p - left <= j <= p + right (negative: unbounded), mask None or broadcastable to [B, Hq, Nq, Nk].
    Returns (out, lse); a row that sees no key gives 0 and lse -inf. ``alibi_from_nearest``: ALiBi as the
    op's kernels apply it (:func:`modify_scores`), so lse is the op's row-shifted one; out is the same."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    vis = visibility(q.shape[-2], k.shape[-2], pos_offset, left, right, q.device)
    out, lse = _attend(q, k, v, scale, vis, mask, softcap, alibi, pos_offset, alibi_from_nearest)
    # lse in fp32 as the kernel returns it (kept fp64 when the reference runs in fp64)
    return out, (lse if lse.dtype == torch.float64 else lse.float())


def attend_backward(dout, q, k, v, out, lse, dlse, mask, scale, pos_offset, left, right, softcap=None, alibi=None,
                    alibi_from_nearest=False):
    """(dq, dk, dv) of :func:`attend` in closed form (custom ops run below autograd): P recomputed from
    the forward's lse (rows that saw no key: P = 0), dS = P * (dP - (rowsum(dO * O) - dlse)), GQA
    gradients summed over each group's query heads. In fp32 (fp64 stays fp64), cast to the inputs'
    dtype. ``alibi_from_nearest`` must be what the forward that made ``lse`` used."""
    ct = torch.promote_types(q.dtype, torch.float32)
    B, Hq, Nq, d = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    qf, kf, vf, of, dof = (t.to(ct) for t in (q, k, v, out, dout))
    kr, vr = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    raw = (qf @ kr.transpose(-2, -1)) * scale
    s = modify_scores(raw, softcap, alibi, pos_offset, alibi_from_nearest)
    vis = visibility(Nq, k.shape[-2], pos_offset, left, right, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(ct)
    lse_c = lse.to(ct)[..., None]
    p = torch.where(torch.isneginf(lse_c), torch.zeros_like(s), torch.exp(s - lse_c))
    delta = (dof * of).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(ct)[..., None]
    dp = dof @ vr.transpose(-2, -1)
    ds = p * (dp - delta)
    if softcap is not None:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = (ds @ kr) * scale
    dk = ((ds.transpose(-2, -1) @ qf) * scale).reshape(B, Hkv, group, *k.shape[2:]).sum(2)
    dv = (p.transpose(-2, -1) @ dof).reshape(B, Hkv, group, *v.shape[2:]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

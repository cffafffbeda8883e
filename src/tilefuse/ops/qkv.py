"""tilefuse.qkv_projection: q, k, v from x in one pass per projection, written in head layout with RoPE and
QK-norm applied in the GEMM's epilogue.

Registered as ``tilefuse::qkv_projection``, with autograd: the backward undoes RoPE (the transposed
rotation) and QK-norm (recomputing the projection's heads) in PyTorch, then runs tilefuse's linear backward
once over the three projections stacked. GPT-2's ``Conv1D`` ``c_attn`` keeps its weight as [K, 3K]
(transposed): pass ``c_attn.weight.t()``, a view with a unit row stride, which the kernels read in place
(on Hopper the TMA kernel loads its [K, rows] tiles as they lie; no copy, the same HBM bytes as nn.Linear's
layout). A weight with no unit stride on either dim is copied once per call.
"""
from __future__ import annotations

from typing import Optional

import torch

from tilefuse import reference, runtime
from tilefuse.ops import _dispatch
from tilefuse.ops._checks import check_same_device, check_same_dtype, check_tensor, grad_needed
from tilefuse.ops.linear import _gemm_launch, linear, linear_grads

LAYOUTS = ("bhnd", "bnhd")


def _outputs(x, heads, d, layout):
    """q, k, v allocated in ``layout``, each returned with its [B, H, N, d] view (for the kernels)."""
    B, N = x.shape[0], x.shape[1]
    outs = []
    for h in heads:
        if layout == "bhnd":
            outs.append(torch.empty((B, h, N, d), dtype=x.dtype, device=x.device))
        else:
            outs.append(torch.empty((B, N, h, d), dtype=x.dtype, device=x.device).transpose(1, 2))
    return outs


def _impl(x, wq, wk, wv, bq, bk, bv, num_heads, num_kv_heads, cos, sin, interleaved, q_norm, k_norm, eps, layout):
    d = wq.shape[0] // num_heads
    heads = (num_heads, num_kv_heads, num_kv_heads)
    rotary = None if cos is None else (cos, sin)
    qk_norm = None if q_norm is None else (q_norm, k_norm, eps)
    path = runtime.execution_path(x)
    if path == runtime.REFERENCE or x.numel() == 0:
        _dispatch.record_reference("qkv_projection", path)
        outs = _outputs(x, heads, d, layout)
        ref = reference.qkv_projection(x, (wq, wk, wv), (bq, bk, bv), num_heads, num_kv_heads, rotary, interleaved,
                                       qk_norm)
        for out, r in zip(outs, ref):
            out.copy_(r)
    else:
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.shape[1] > 1 and x2d.stride(1) != 1:
            x2d = x2d.contiguous()
        with _dispatch.on_device(x):
            outs = _gemm_launch().qkv_projection(x2d, x.shape[1], (wq, wk, wv), (bq, bk, bv), heads, d, rotary,
                                                 interleaved, qk_norm, layout,
                                                 lambda: _outputs(x, heads, d, layout), path)
    return tuple(o if layout == "bhnd" else o.transpose(1, 2) for o in outs)


@torch.library.custom_op("tilefuse::qkv_projection", mutates_args=())
def _qkv_op(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: Optional[torch.Tensor],
            bk: Optional[torch.Tensor], bv: Optional[torch.Tensor], num_heads: int, num_kv_heads: int,
            cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], interleaved: bool, q_norm: Optional[torch.Tensor],
            k_norm: Optional[torch.Tensor], eps: float, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl(x, wq, wk, wv, bq, bk, bv, num_heads, num_kv_heads, cos, sin, interleaved, q_norm, k_norm, eps,
                 layout)


@_qkv_op.register_fake
def _(x, wq, wk, wv, bq, bk, bv, num_heads, num_kv_heads, cos, sin, interleaved, q_norm, k_norm, eps, layout):
    outs = _outputs(x, (num_heads, num_kv_heads, num_kv_heads), wq.shape[0] // num_heads, layout)
    return tuple(o if layout == "bhnd" else o.transpose(1, 2) for o in outs)



def _rotate(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return reference.rotate_pairs(t) if interleaved else reference.rotate_half(t)


def _setup(ctx, inputs, output):
    x, wq, wk, wv, bq, bk, bv, num_heads, num_kv_heads, cos, sin, interleaved, q_norm, k_norm, eps, layout = inputs
    ctx.save_for_backward(x, wq, wk, wv, bq, bk, bv, cos, sin, q_norm, k_norm)
    ctx.args = (num_heads, num_kv_heads, interleaved, eps, layout)


def _backward(ctx, dq, dk, dv):
    """The three projections' gradients in head layout become one [B, N, (H + 2*Hkv), d] tensor in x's dtype
    -- q's and k's first through the transposed RoPE (cos * do - R(sin * do) on the rotated dims, R the
    rotation, R^T = -R) and QK-norm's backward (RMSNorm's on the recomputed heads; its weight's gradient
    summed here), in fp32 -- so one linear backward (tilefuse.ops.linear.linear_grads) over the stacked
    weights makes dx, dW and db of all three: one dx GEMM reducing over every projection, no sum of three."""
    x, wq, wk, wv, bq, bk, bv, cos, sin, q_norm, k_norm = ctx.saved_tensors
    num_heads, num_kv_heads, interleaved, eps, layout = ctx.args
    needs = ctx.needs_input_grad
    B, N, K = x.shape
    d = wq.shape[0] // num_heads
    heads = (num_heads, num_kv_heads, num_kv_heads)
    weights, biases = (wq, wk, wv), (bq, bk, bv)
    need_dx, need_dw = needs[0], any(needs[1:4])
    need_db = any(b is not None and needs[4 + i] for i, b in enumerate(biases))
    grads_n = [None, None]
    dy = x.new_empty((B, N, sum(heads), d))
    first = 0
    for i, (g, w, b, h) in enumerate(zip((dq, dk, dv), weights, biases, heads)):
        part = dy[:, :, first:first + h]  # [B, N, h, d]
        first += h
        if g is None:
            part.zero_()
            continue
        g = g if layout == "bhnd" else g.transpose(1, 2)  # [B, h, N, d]
        norm_w = (q_norm, k_norm)[i] if i < 2 else None
        if i < 2 and (cos is not None or norm_w is not None):
            g = g.float()
            if cos is not None:
                r = cos.shape[-1]
                c, s_ = (t[:, None] if t.dim() == 3 else t[None, None] for t in (cos.float(), sin.float()))
                rot = g[..., :r]
                g = torch.cat([rot * c - _rotate(rot * s_, interleaved), g[..., r:]], dim=-1)
            if norm_w is not None:
                pre = linear(x, w, b).view(B, N, h, d).transpose(1, 2).float()
                rstd = torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + eps)
                normed = pre * rstd
                if needs[12 + i]:
                    grads_n[i] = (g * normed).sum((0, 1, 2)).to(norm_w.dtype)
                gn = g * norm_w.float()
                g = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        part.copy_(g.transpose(1, 2))
    dx, grads_w, grads_b = None, [None] * 3, [None] * 3
    if need_dx or need_dw or need_db:
        rows = [h * d for h in heads]
        # The weights stacked: a copy of W per backward (2 * rows * K * s bytes, ~1% of the two GEMMs'
        # time at Llama-7B's shape), and dW comes back as one tensor split into the three projections'.
        gx, gw, gb = linear_grads(dy.view(B * N, -1), x.reshape(B * N, K), torch.cat(weights), None, need_dx,
                                  need_dw, need_db)
        if need_dx:
            dx = gx.view(B, N, K)
        if need_dw:
            grads_w = [g if needs[1 + i] else None for i, g in enumerate(gw.split(rows))]
        if need_db:
            grads_b = [g if b is not None and needs[4 + i] else None
                       for i, (g, b) in enumerate(zip(gb.split(rows), biases))]
    return (dx, *grads_w, *grads_b, None, None, None, None, None, grads_n[0], grads_n[1], None, None)


_qkv_call = _dispatch.register_autograd(_qkv_op, _impl, _backward, _setup)
_dispatch.register_autocast(_qkv_op, (0, 1, 2, 3, 4, 5, 6))  # x, the weights and biases: as torch's linear


def _three(name, value, sizes):
    """A triple (or None) from a triple or one tensor cat'ed along dim 0 in q, k, v order."""
    if value is None:
        return None, None, None
    if isinstance(value, (tuple, list)):
        if len(value) != 3:
            raise ValueError(f"{name} as a sequence must be (q, k, v), got {len(value)} items")
        return tuple(value)
    check_tensor(name, value)
    if value.shape[0] != sum(sizes):
        raise ValueError(f"{name} as one tensor must have {sum(sizes)} rows (q, k, v stacked), got {value.shape[0]}")
    return tuple(value.split(list(sizes)))


def qkv_projection(x: torch.Tensor, weight, bias=None, *, num_heads: int, num_kv_heads: int | None = None,
                   rotary: tuple[torch.Tensor, torch.Tensor] | None = None, rotary_interleaved: bool = False,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, layout: str = "bhnd"):
    """``(q, k, v)`` of x ``[B, N, K]``: the three projections (``weight`` the triple (W_q, W_k, W_v) in
    nn.Linear layout, read in place, or one tensor cat([W_q, W_k, W_v]); ``bias`` likewise or None), q
    ``[B, H, N, d]``, k and v ``[B, Hkv, N, d]`` (``layout="bnhd"``: ``[B, N, H, d]``), contiguous, each
    written by its GEMM's epilogue: no split, transpose or copy kernels. ``rotary=(cos, sin)``, each ``[N, r]``
    or ``[B, N, r]`` with even r <= d, applies RoPE to q and k in HF Llama's rotate-half convention
    (``rotary_interleaved=True``: GPT-J's pairs), r < d rotating the first r dims only. ``qk_norm=(q_weight,
    k_weight, eps)`` applies a per-head RMSNorm over d to q and k before RoPE (Qwen3). Differentiable in x,
    the weights, the biases and the QK-norm weights (not the rotary tables). Under ``torch.autocast`` the GEMMs
    run in the autocast dtype (torch's linear rule) and q, k, v come out in it."""
    check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, N, K], got shape {tuple(x.shape)}")
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide num_heads ({num_heads}), got {num_kv_heads!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    K = x.shape[-1]
    if isinstance(weight, (tuple, list)):
        wq, wk, wv = _three("weight", weight, ())
        for name, w in (("weight[0] (W_q)", wq), ("weight[1] (W_k)", wk), ("weight[2] (W_v)", wv)):
            check_tensor(name, w)
        d = wq.shape[0] // num_heads
    else:
        check_tensor("weight", weight)
        d = weight.shape[0] // (num_heads + 2 * num_kv_heads)
        wq, wk, wv = _three("weight", weight, (num_heads * d, num_kv_heads * d, num_kv_heads * d))
    if not 1 <= d <= 256:
        raise ValueError(f"head dim d = {d} from the weights must be in [1, 256]")
    cast = _dispatch.autocast_dtype(x)
    if cast is not None:  # as torch's linear under autocast: the GEMMs in the autocast dtype
        x, wq, wk, wv = _dispatch.cast_floats(cast, x, wq, wk, wv)
    for name, w, rows in (("W_q", wq, num_heads * d), ("W_k", wk, num_kv_heads * d), ("W_v", wv, num_kv_heads * d)):
        if w.dim() != 2 or tuple(w.shape) != (rows, K):
            raise ValueError(f"{name} must be [{rows}, {K}] (heads * d, K), got {tuple(w.shape)}")
        check_same_dtype(name, w, "x", x)
        check_same_device(name, w, "x", x)
    bq, bk, bv = _three("bias", bias, (num_heads * d, num_kv_heads * d, num_kv_heads * d))
    if cast is not None:
        bq, bk, bv = _dispatch.cast_floats(cast, bq, bk, bv)
    for name, b, rows in (("b_q", bq, num_heads * d), ("b_k", bk, num_kv_heads * d), ("b_v", bv, num_kv_heads * d)):
        if b is not None and tuple(b.shape) != (rows,):
            raise ValueError(f"{name} must be [{rows}], got {tuple(b.shape)}")
    cos = sin = None
    if rotary is not None:
        if not isinstance(rotary, (tuple, list)) or len(rotary) != 2:
            raise ValueError("rotary must be None or (cos, sin)")
        cos, sin = rotary
        for name, t in (("cos", cos), ("sin", sin)):
            check_tensor(name, t)
            if t.shape != cos.shape or t.dim() not in (2, 3) or t.shape[-2] != x.shape[1] or \
                    (t.dim() == 3 and t.shape[0] != x.shape[0]):
                raise ValueError(f"rotary {name} must be [N, r] or [B, N, r] with N = {x.shape[1]}, got "
                                 f"{tuple(t.shape)}")
        r = cos.shape[-1]
        if r % 2 or r > d:
            raise ValueError(f"rotary dims r = {r} must be even and <= d = {d}")
        cos, sin = cos.contiguous(), sin.contiguous()
    q_norm = k_norm = None
    eps = 0.0
    if qk_norm is not None:
        if not isinstance(qk_norm, (tuple, list)) or len(qk_norm) != 3:
            raise ValueError("qk_norm must be None or (q_weight, k_weight, eps)")
        q_norm, k_norm, eps = qk_norm
        for name, t in (("qk_norm q_weight", q_norm), ("qk_norm k_weight", k_norm)):
            check_tensor(name, t)
            if tuple(t.shape) != (d,):
                raise ValueError(f"{name} must be [{d}] (the head dim), got {tuple(t.shape)}")
        eps = float(eps)
        q_norm, k_norm = q_norm.contiguous(), k_norm.contiguous()  # the kernels read them at unit stride
    # Read in place with a unit stride on either dim (nn.Linear's layout, or GPT-2's Conv1D weight transposed).
    wq, wk, wv = (w if K <= 1 or 1 in w.stride() else w.contiguous() for w in (wq, wk, wv))
    if cos is not None and grad_needed(cos, sin):
        raise NotImplementedError("tilefuse.qkv_projection: the rotary cos/sin tables get no gradient; pass them "
                                  "detached")
    bq, bk, bv = (None if t is None else t.contiguous() for t in (bq, bk, bv))
    args = (x, wq, wk, wv, bq, bk, bv, num_heads, num_kv_heads, cos, sin, bool(rotary_interleaved), q_norm, k_norm,
            eps, layout)
    if _dispatch.direct(x, wq, wk, wv, bq, bk, bv, cos, sin, q_norm, k_norm):
        return _impl(*args)
    return _qkv_call(*args)

"""tilefuse.attention and tilefuse.scaled_dot_product_attention: FlashAttention forward (one kernel) and
backward (recomputation from the saved log-sum-exp).

Both surfaces share one registered op (``tilefuse::attention``) and the attention family's launch
layer. attention() aligns positions bottom-right (query row i sits at key position i + Nk - Nq, as
FlashAttention does); scaled_dot_product_attention() follows torch's SDPA: top-left causal (position
offset 0), optional bool/additive mask read with its broadcast strides, broadcast batch dims,
enable_gqa.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tilefuse import runtime
from tilefuse.ops import _dispatch, _dtensor
from tilefuse.ops import fp8_attention
from tilefuse.ops import paged as paged_ops
from tilefuse.ops._checks import (check_kv_heads, check_offsets, check_qkv, check_same_device,
                                  check_tensor, flash_attn_window, grad_needed, score_modifiers)
from tilefuse.masks import BlockMask
from tilefuse.reference import attention as ref_attention

MAX_GRID_Y_BACKWARD = 65535  # the backward kernels put batch * heads on the grid's second axis


def _check_scale(scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")


def _empty_outputs(q, return_lse, out_bnhd=False):
    """(out, lse): out [B, Hq, Nq, d] contiguous, or with ``out_bnhd`` laid out [B, Nq, Hq, d] (FlashAttention's
    layout; packed sequences, q viewed [1, Hq, total, d], so get [total, Hq, d] as the packed input is) and
    returned as its [B, Hq, Nq, d] view; lse [B, Hq, Nq] fp32 (varlen: [1, Hq, total]) or empty. The launch
    layer (launch._forward) allocates the same layouts, which the fake implementation states."""
    B, Hq, Nq, d = q.shape
    if out_bnhd:
        out = torch.empty((B, Nq, Hq, d), dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)
    else:
        out = torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    return out, lse


def _per_sequence(cu_q, cu_k):
    """[(q rows, k rows)] slices of each packed sequence (host values: the plain-PyTorch path only)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _attention_impl(q, k, v, mask, scale, bottom_right, window_left, window_right, return_lse, softcap=None,
                    alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                    out_bnhd=False, deterministic=False, kernel="auto"):
    """(out, lse) for 4-D q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d], mask None or a view of
    [B, Hq, Nq, Nk], alibi None or fp32 slopes viewed as [B, Hq]; lse is an empty tensor without
    ``return_lse``. Packed sequences (``cu_seqlens_q`` given): q/k/v viewed [1, H, total, d], each sequence
    bottom-right aligned on its own, alibi [sequences, Hq]. ``out_bnhd``: out laid out [B, Nq, Hq, d] (as
    packed sequences always are; see ``_empty_outputs``). ``deterministic`` leaves the forward as it
    is (deterministic either way) and travels to the backward (see ``launch.backward``). ``kernel`` forces a
    kernel of the launch layer (its ``KERNELS``); the registered op always takes "auto".

    With ALiBi the lse is the op's own: ALiBi measured from each row's nearest key (the kernels'
    ``score_modifiers``), i.e. the true lse plus ``slope * dmin(p)``; the backward reads it as it is, and
    the public functions hand users the true one (``_user_lse``)."""
    path = runtime.execution_path(q)
    Nq, Nk = q.shape[2], k.shape[2]
    varlen = cu_seqlens_q is not None
    out_bnhd = out_bnhd or varlen
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pos_offset = Nk - Nq if bottom_right else 0
    if q.numel() == 0 or Nk == 0:  # no key at all: every row sees nothing -> 0, lse -inf
        _dispatch.record_reference("attention", path)
        out, lse = _empty_outputs(q, return_lse, out_bnhd)
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if path == runtime.REFERENCE:
        _dispatch.record_reference("attention", path)
        out, lse = _empty_outputs(q, return_lse, out_bnhd)
        pieces = _per_sequence(cu_seqlens_q, cu_seqlens_k) if varlen else [(slice(None), slice(None))]
        for i, (rq, rk) in enumerate(pieces):
            qi, ki, vi = q[:, :, rq], k[:, :, rk], v[:, :, rk]
            if qi.shape[2] == 0:
                continue
            if ki.shape[2] == 0:
                out[:, :, rq] = 0
                if return_lse:
                    lse[:, :, rq] = float("-inf")
                continue
            offset = ki.shape[2] - qi.shape[2] if (bottom_right or varlen) else 0
            ai = alibi[i:i + 1] if varlen and alibi is not None else alibi
            ref, ref_lse = ref_attention.attend(qi, ki, vi, mask, scale, offset, window_left, window_right, softcap,
                                                ai, alibi_from_nearest=True)
            out[:, :, rq] = ref
            if return_lse:
                lse[:, :, rq] = ref_lse
        return out, lse
    runtime.check_triton()
    from tilefuse.kernels.attention import launch  # imports triton: only once a kernel is to run
    with _dispatch.on_device(q):
        return launch.forward(q, k, v, mask, scale, pos_offset, window_left, window_right, return_lse, path,
                              kernel=kernel, softcap=softcap, alibi=alibi,
                              varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) if varlen else None,
                              out_bnhd=out_bnhd)


@torch.library.custom_op("tilefuse::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  scale: Optional[float], bottom_right: bool, window_left: int, window_right: int,
                  return_lse: bool, softcap: Optional[float] = None, alibi: Optional[torch.Tensor] = None,
                  cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                  out_bnhd: bool = False, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward behind tilefuse.attention, attention_varlen and the flash_attn functions (arguments as
    ``_attention_impl``). Its lse, with ALiBi, is the row-shifted one the backward needs: the public
    functions convert it (``_user_lse``)."""
    return _attention_impl(q, k, v, mask, scale, bottom_right, window_left, window_right, return_lse, softcap, alibi,
                           cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out_bnhd, deterministic)


@_attention_op.register_fake
def _(q, k, v, mask, scale, bottom_right, window_left, window_right, return_lse, softcap=None, alibi=None,
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, out_bnhd=False, deterministic=False):
    return _empty_outputs(q, return_lse, out_bnhd or cu_seqlens_q is not None)


def _attention_backward_impl(dout, q, k, v, out, lse, dlse, mask, scale, bottom_right, window_left, window_right,
                             softcap=None, alibi=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                             max_seqlen_k=0, deterministic=False):
    path = runtime.execution_path(q)
    Nq, Nk = q.shape[2], k.shape[2]
    varlen = cu_seqlens_q is not None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pos_offset = Nk - Nq if bottom_right else 0
    if path == runtime.REFERENCE or q.numel() == 0 or k.numel() == 0:
        _dispatch.record_reference("attention_backward", path)
        if not varlen:
            grads = ref_attention.attend_backward(dout, q, k, v, out, lse, dlse, mask, scale, pos_offset, window_left,
                                                  window_right, softcap, alibi, alibi_from_nearest=True)
            # in the inputs' layouts, as the kernels write them and the fake implementation says
            return tuple(torch.empty_like(t).copy_(g) for t, g in zip((q, k, v), grads))
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        for i, (rq, rk) in enumerate(_per_sequence(cu_seqlens_q, cu_seqlens_k)):
            if q[:, :, rq].shape[2] == 0 or k[:, :, rk].shape[2] == 0:
                continue
            parts = ref_attention.attend_backward(
                dout[:, :, rq], q[:, :, rq], k[:, :, rk], v[:, :, rk], out[:, :, rq], lse[:, :, rq],
                None if dlse is None else dlse[:, :, rq], None, scale, k[:, :, rk].shape[2] - q[:, :, rq].shape[2],
                window_left, window_right, softcap, None if alibi is None else alibi[i:i + 1],
                alibi_from_nearest=True)
            dq[:, :, rq], dk[:, :, rk], dv[:, :, rk] = parts
        return dq, dk, dv
    runtime.check_triton()
    from tilefuse.kernels.attention import launch
    with _dispatch.on_device(q):
        return launch.backward(dout, q, k, v, out, lse, dlse, mask, scale, pos_offset, window_left, window_right,
                               path, softcap, alibi,
                               (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) if varlen else None,
                               deterministic)


@torch.library.custom_op("tilefuse::attention_backward", mutates_args=())
def _attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, dlse: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                           scale: Optional[float], bottom_right: bool, window_left: int,
                           window_right: int, softcap: Optional[float] = None, alibi: Optional[torch.Tensor] = None,
                           cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                           max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                           deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attention_backward_impl(dout, q, k, v, out, lse, dlse, mask, scale, bottom_right, window_left,
                                    window_right, softcap, alibi, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, deterministic)


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, mask, scale, bottom_right, window_left, window_right, softcap=None, alibi=None,
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, deterministic=False):
    return tuple(torch.empty_like(t) for t in (q, k, v))  # the inputs' layouts, as the kernels write them


def _setup_attention(ctx, inputs, output):
    (q, k, v, mask, scale, bottom_right, window_left, window_right, return_lse, softcap, alibi, cu_q, cu_k, max_q,
     max_k, _, deterministic) = (*inputs, *(None, None, None, None, 0, 0, False, False)[len(inputs) - 9:])
    out, lse = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, mask, out, lse, alibi, cu_q, cu_k)
    ctx.args = (scale, bottom_right, window_left, window_right, softcap)
    ctx.lengths = (max_q, max_k)
    ctx.has_lse = return_lse
    ctx.deterministic = deterministic
    ctx.n_inputs = len(inputs)


def _attention_backward(ctx, dout, dlse):
    q, k, v, mask, out, lse, alibi, cu_q, cu_k = ctx.saved_tensors
    if not ctx.has_lse:
        raise RuntimeError("tilefuse.attention: the backward needs the forward's log-sum-exp, which this call "
                           "did not keep (it ran without grad)")
    if dout is None and dlse is None:
        return (None,) * ctx.n_inputs
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is not None:  # the kernels read it in the lse's layout; autograd's may be expanded (loss = lse.sum())
        dlse = dlse.contiguous()
    args = (dout, q, k, v, out, lse, dlse, mask, *ctx.args, alibi, cu_q, cu_k, *ctx.lengths, ctx.deterministic)
    if _dispatch.direct(dout, q, k, v, out, lse, dlse, mask, alibi):
        dq, dk, dv = _attention_backward_impl(*args)
    else:
        dq, dk, dv = _attention_backward_op(*args)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * (ctx.n_inputs - 3)


_attention_call = _dispatch.register_autograd(_attention_op, _attention_impl, _attention_backward,
                                             _setup_attention)


def _check_trainable(name, q, heads, mask=None):
    """What the backward cannot do, refused before the forward runs (no silent missing gradient)."""
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"tilefuse.{name}: a float attn_mask that requires grad has no gradient here; "
                                  "detach it or pass a bool mask")
    if heads > MAX_GRID_Y_BACKWARD:
        raise NotImplementedError(f"tilefuse.{name} backward: batch * heads = {heads} is above "
                                  f"{MAX_GRID_Y_BACKWARD} (the grid's second axis)")


def _run(q, k, v, mask, scale, bottom_right, left, right, return_lse, name, softcap=None, alibi=None,
         out_bnhd=False, deterministic=False):
    """The forward, through the op with its autograd when a gradient is needed (keeping the lse the
    backward reads), else directly when the call is plain eager. The lse is the op's (see ``_user_lse``)."""
    args = (q, k, v, mask, scale, bottom_right, left, right)
    modifiers = (softcap, alibi, None, None, 0, 0, out_bnhd, deterministic)
    if grad_needed(q, k, v):
        _check_trainable(name, q, q.shape[0] * q.shape[1], mask)
        return _attention_call(*args, True, *modifiers)
    _check_trainable(name, q, 0, mask)
    if _dispatch.direct(q, k, v, mask, alibi):
        return _attention_impl(*args, return_lse, *modifiers)
    return _attention_call(*args, return_lse, *modifiers)


def _user_lse(lse, alibi, n_k, pos_offset, cu_seqlens_q=None, cu_seqlens_k=None):
    """The true lse, from the op's ``lse`` ([B, Hq, Nq] over ``n_k`` keys; packed sequences: [1, Hq, total_q],
    ``n_k`` and ``pos_offset`` unused) for ALiBi slopes ``alibi`` ([B, Hq]; packed: [sequences, Hq]) or None
    (then ``lse`` as it is).

    The op measures ALiBi from each row's nearest key, so its lse is the true one plus ``slope * dmin(p)``,
    dmin(p) = max(0, -p) + max(0, p - (Nk - 1)) for the row's key position p (``pos_offset`` + its row;
    packed: within its own sequence, bottom-right aligned). A few device ops (no host synchronisation),
    differentiable (a constant shift: the lse's gradient reaches the op's lse unchanged); -inf rows stay
    -inf. Only this conversion rounds the large constant, once, in the value handed out."""
    if alibi is None:
        return lse
    n_q = lse.shape[-1]
    if cu_seqlens_q is None:
        pos = torch.arange(n_q, device=lse.device) + pos_offset
        shift = alibi[..., None] * ref_attention.alibi_row_shift(pos, n_k).to(lse.dtype)
        return lse - shift
    seqs = cu_seqlens_q.shape[0] - 1
    if seqs < 1 or n_q == 0:
        return lse
    rows = torch.arange(n_q, device=lse.device, dtype=cu_seqlens_q.dtype)
    # each packed row's sequence: the last offset at or before it (clamped, as the kernels clamp offsets)
    seq = (torch.searchsorted(cu_seqlens_q, rows, right=True) - 1).clamp(0, seqs - 1)
    q0, n_q_seq = cu_seqlens_q[seq], cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]
    n_k_seq = cu_seqlens_k[seq + 1] - cu_seqlens_k[seq]
    pos = rows - q0 + n_k_seq - n_q_seq
    shift = alibi[seq].transpose(0, 1) * ref_attention.alibi_row_shift(pos, n_k_seq).to(lse.dtype)  # [Hq, total]
    return lse - shift[None]


_dispatch.register_autocast(_attention_op, (0, 1, 2, 3))  # q, k, v and a float mask: as torch's SDPA


# ---- block-sparse attention (a tilefuse.masks.BlockMask) -------------------------------------------
# Its own op pair, the BlockMask's tensors passed as op arguments (so torch.compile traces them as inputs; one
# argument each in the forward, whose autograd wants a None per argument), its tile sizes as ints. Positions are
# top-left aligned; no score modifiers.
N_MASK_TENSORS = len(BlockMask.TENSORS)


def _block_sparse_impl(q, k, v, *args):
    """(out, lse) for q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d], then the BlockMask's 11 tensors (``BlockMask.TENSORS``,
    checked against q and k), block_q, block_k, scale and return_lse; lse is an empty tensor without
    ``return_lse``."""
    mask_tensors, (block_q, block_k, scale, return_lse) = args[:N_MASK_TENSORS], args[N_MASK_TENSORS:]
    path = runtime.execution_path(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.numel() == 0:
        _dispatch.record_reference("block_sparse_attention", path)
        return _empty_outputs(q, return_lse)
    if path == runtime.REFERENCE:
        _dispatch.record_reference("block_sparse_attention", path)
        mask = _dense_block_mask(mask_tensors, q.shape[2], k.shape[2], block_q, block_k)
        out, lse = ref_attention.attend(q, k, v, mask, scale, 0, -1, -1)
        return out.to(q.dtype).contiguous(), (lse.float() if return_lse else _empty_outputs(q, False)[1])
    runtime.check_triton()
    from tilefuse.kernels.attention import launch
    with _dispatch.on_device(q):
        return launch.block_sparse_forward(q, k, v, list(mask_tensors), block_q, block_k, scale, return_lse, path)


def _dense_block_mask(mask_tensors, n_q, n_k, block_q, block_k):
    """The [Bm, Hm, Nq, Nk] bool mask of a BlockMask's tensors (the plain-PyTorch path)."""
    tensors = dict(zip(BlockMask.TENSORS, mask_tensors))
    return BlockMask(tensors, n_q, n_k, block_q, block_k, mask_tensors[10].shape[0]).to_dense()


@torch.library.custom_op("tilefuse::block_sparse_attention", mutates_args=())
def _block_sparse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_num_blocks: torch.Tensor,
                     kv_indices: torch.Tensor, kv_slots: torch.Tensor, full_kv_num_blocks: torch.Tensor,
                     full_kv_indices: torch.Tensor, q_num_blocks: torch.Tensor, q_indices: torch.Tensor,
                     q_slots: torch.Tensor, full_q_num_blocks: torch.Tensor, full_q_indices: torch.Tensor,
                     partial_bits: torch.Tensor, block_q: int, block_k: int, scale: Optional[float],
                     return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward behind tilefuse.attention(block_mask=...) (arguments as ``_block_sparse_impl``)."""
    return _block_sparse_impl(q, k, v, kv_num_blocks, kv_indices, kv_slots, full_kv_num_blocks, full_kv_indices,
                              q_num_blocks, q_indices, q_slots, full_q_num_blocks, full_q_indices, partial_bits,
                              block_q, block_k, scale, return_lse)


@_block_sparse_op.register_fake
def _(q, k, v, *args):
    return _empty_outputs(q, args[-1])


def _block_sparse_backward_impl(dout, q, k, v, out, lse, dlse, mask_tensors, block_q, block_k, scale):
    path = runtime.execution_path(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if path == runtime.REFERENCE or q.numel() == 0:
        _dispatch.record_reference("block_sparse_attention_backward", path)
        mask = _dense_block_mask(mask_tensors, q.shape[2], k.shape[2], block_q, block_k) if q.numel() else None
        grads = ref_attention.attend_backward(dout, q, k, v, out, lse, dlse, mask, scale, 0, -1, -1)
        return tuple(g.contiguous() for g in grads)
    runtime.check_triton()
    from tilefuse.kernels.attention import launch
    with _dispatch.on_device(q):
        return launch.block_sparse_backward(dout, q, k, v, out, lse, dlse, list(mask_tensors), block_q, block_k,
                                            scale, path)


@torch.library.custom_op("tilefuse::block_sparse_attention_backward", mutates_args=())
def _block_sparse_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                              mask_tensors: list[torch.Tensor], block_q: int, block_k: int,
                              scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _block_sparse_backward_impl(dout, q, k, v, out, lse, dlse, mask_tensors, block_q, block_k, scale)


@_block_sparse_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, mask_tensors, block_q, block_k, scale):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))  # contiguous


def _setup_block_sparse(ctx, inputs, output):
    q, k, v = inputs[:3]
    mask_tensors = inputs[3:3 + N_MASK_TENSORS]
    block_q, block_k, scale, return_lse = inputs[3 + N_MASK_TENSORS:]
    out, lse = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, *mask_tensors)
    ctx.args = (block_q, block_k, scale)
    ctx.has_lse = return_lse


def _block_sparse_backward(ctx, dout, dlse):
    q, k, v, out, lse, *mask_tensors = ctx.saved_tensors
    if not ctx.has_lse:
        raise RuntimeError("tilefuse.attention: the backward needs the forward's log-sum-exp, which this call "
                           "did not keep (it ran without grad)")
    if dout is None and dlse is None:
        return (None,) * (3 + N_MASK_TENSORS + 4)
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is not None:  # the kernels read it in the lse's layout; autograd's may be expanded
        dlse = dlse.contiguous()
    args = (dout, q, k, v, out, lse, dlse, list(mask_tensors), *ctx.args)
    if _dispatch.direct(dout, q, k, v, out, lse, dlse, *mask_tensors):
        dq, dk, dv = _block_sparse_backward_impl(*args)
    else:
        dq, dk, dv = _block_sparse_backward_op(*args)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * (
        N_MASK_TENSORS + 4)


_block_sparse_call = _dispatch.register_autograd(_block_sparse_op, _block_sparse_impl, _block_sparse_backward,
                                                 _setup_block_sparse)
_dispatch.register_autocast(_block_sparse_op, (0, 1, 2))


def _check_block_mask(block_mask, q, k):
    """A BlockMask built for q [B, Hq, Nq, d] and k [B, Hkv, Nk, d], on their device, or a clear error."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a tilefuse.masks.BlockMask (spec.build(...)), got "
                        f"{type(block_mask).__name__}")
    B, Hq, Nq = q.shape[0], q.shape[1], q.shape[2]
    Nk = k.shape[2]
    if (block_mask.seq_q, block_mask.seq_k) != (Nq, Nk):
        raise ValueError(f"block_mask was built for Nq={block_mask.seq_q}, Nk={block_mask.seq_k} but q has Nq={Nq} "
                         f"and k has Nk={Nk}; build it for these lengths")
    if block_mask.batch not in (1, B) or block_mask.heads not in (1, Hq):
        raise ValueError(f"block_mask was built for batch {block_mask.batch} and {block_mask.heads} heads; q has "
                         f"batch {B} and {Hq} query heads (a mask's batch and heads must be 1 or q's)")
    if block_mask.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.device} but q is on {q.device}; build it on q's device")
    tensors = block_mask.tensors()
    Tq, Tk = -(-Nq // block_mask.block_q), -(-Nk // block_mask.block_k)
    lead = (block_mask.batch, block_mask.heads)
    want = [lead + (Tq,), lead + (Tq, Tk), lead + (Tq, Tk), lead + (Tq,), lead + (Tq, Tk),
            lead + (Tk,), lead + (Tk, Tq), lead + (Tk, Tq), lead + (Tk,), lead + (Tk, Tq)]
    for name, t, shape in zip(BlockMask.TENSORS, tensors, want):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"block_mask.{name} must be a contiguous int32 {list(shape)} tensor on {q.device} "
                             f"(block tiles {block_mask.block_q}x{block_mask.block_k}); got {t.dtype} "
                             f"{list(t.shape)} on {t.device}: rebuild the mask for these shapes")
    bits = tensors[10]
    words = -(-block_mask.block_k // 32)
    if (bits.dtype != torch.int32 or bits.dim() != 3 or bits.shape[0] < 1
            or tuple(bits.shape[1:]) != (block_mask.block_q, words) or not bits.is_contiguous()
            or bits.device != q.device):
        raise ValueError(f"block_mask.partial_bits must be a contiguous int32 [P >= 1, {block_mask.block_q}, {words}] "
                         f"tensor on {q.device}, got {bits.dtype} {list(bits.shape)}")
    return tensors


# A block mask whose spec is a band (causal, sliding windows: MaskSpec.band) at Nq == Nk runs the windowed kernels
# (attention(window=)): the same mask computed from positions, no tile lists or bitmaps read, and on Hopper the
# warp-specialized passes. False: every block mask on the block-sparse kernels (the tests of those kernels).
BAND_MASKS_AS_WINDOWS = True


def _block_sparse_attention(q, k, v, block_mask, causal, window, scale, return_lse, deterministic, softcap,
                            alibi_slopes):
    """:func:`attention` with a ``block_mask``."""
    if causal or window is not None:
        raise ValueError("block_mask carries the whole mask: pass causal=False and window=None, and combine "
                         "tilefuse.masks.causal() / sliding_window() into the mask's spec instead (block masks are "
                         "top-left aligned: query row i is position i)")
    if softcap is not None or alibi_slopes is not None:
        raise NotImplementedError("tilefuse.attention: softcap and alibi_slopes are not supported with block_mask")
    if _dtensor.any_dtensor(q, k, v):
        raise NotImplementedError("tilefuse.attention: block_mask with DTensor inputs is not supported")
    cast = _dispatch.autocast_dtype(q) if isinstance(q, torch.Tensor) else None
    if cast is not None:  # as torch's SDPA under autocast
        q, k, v = _dispatch.cast_floats(cast, q, k, v)
    check_qkv(q, k, v, ndim=4)
    check_kv_heads(q, k, v)
    if k.shape[2] == 0:
        raise ValueError("k must hold at least one key position with block_mask")
    _check_scale(scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    tensors = _check_block_mask(block_mask, q, k)
    band = block_mask.spec.band() if BAND_MASKS_AS_WINDOWS and block_mask.spec is not None else None
    if band is not None and q.shape[2] == k.shape[2]:  # top-left and bottom-right alignment agree
        left, right = (-1 if w is None else w for w in band)
        window = None if (left, right) == (-1, -1) else (left, right)
        return _attention(q, k, v, False, window, scale, return_lse, deterministic, None, None)
    scale = None if scale is None else float(scale)
    args = (q, k, v, *tensors, block_mask.block_q, block_mask.block_k, scale)
    if grad_needed(q, k, v):
        _check_trainable("attention", q, q.shape[0] * q.shape[1])
        out, lse = _block_sparse_call(*args, True)
    elif _dispatch.direct(q, k, v, *tensors):
        out, lse = _block_sparse_impl(*args, return_lse)
    else:
        out, lse = _block_sparse_call(*args, return_lse)
    return (out, lse) if return_lse else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: tuple[int, int] | None = None, scale: float | None = None,
              return_lse: bool = False, deterministic: bool = False, softcap: float | None = None,
              alibi_slopes: torch.Tensor | None = None,
              block_mask: BlockMask | None = None, fp8: bool = False, q_scale=None, k_scale=None, v_scale=None,
              rotate: bool | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward: ``softmax(q k^T * scale) v`` without materialising the scores.

    q: ``[B, Hq, Nq, d]``; k, v: ``[B, Hkv, Nk, d]`` with ``Hq % Hkv == 0`` (query head h reads KV
    head ``h // (Hq // Hkv)``, as ``repeat_interleave`` would, without copying K/V). Positions are
    aligned bottom-right: query row i sits at ``p = i + Nk - Nq``. ``causal=True`` lets it see keys
    ``j <= p``; ``window=(left, right)`` keys ``p - left <= j <= p + right`` (-1: unbounded side;
    with causal, right = 0). A row that sees no key returns 0 (lse -inf). ``scale`` defaults to
    ``d ** -0.5``. ``return_lse=True`` returns ``(out, lse)``, lse fp32 ``[B, Hq, Nq]`` natural log.
    d <= 256; fp16, bf16, fp32 (full fp32 dots unless ``allow_tf32``). Differentiable in q, k and v
    (and through lse): FlashAttention's backward, recomputing the scores tile by tile from the saved
    lse, GQA gradients summed over each group on chip. tilefuse's kernels use no atomics: bit-identical run to
    run. Where the backward may take SDPA's kernels instead (the backends ``auto`` and ``vendor``), which may not
    be, ``deterministic=True`` or ``torch.use_deterministic_algorithms(True)`` keeps it on tilefuse's.
    ``softcap``: Gemma 2's soft-capping, ``softcap * tanh(s / softcap)`` on the scaled scores s.
    ``alibi_slopes``: fp32 ``[Hq]`` or ``[B, Hq]``, adds ``-slope * |p - j|`` (p the query's bottom-right
    aligned position, FlashAttention's convention) after the cap; both compose with causal, windows and
    GQA, forward and backward (the slopes get no gradient). Registered as ``torch.ops.tilefuse.attention``.
    ``block_mask``: a :class:`tilefuse.masks.BlockMask` built for these shapes (``spec.build(B, Hq, Nq, Nk,
    device)``): block-sparse attention, forward and backward, skipping the tiles it leaves empty. Its positions
    are top-left aligned (query row i is position i); it carries the whole mask, so ``causal`` and ``window``
    must stay unset (combine ``masks.causal()`` / ``masks.sliding_window()`` into the spec instead), and
    ``softcap`` / ``alibi_slopes`` are not supported with it. Registered as
    ``torch.ops.tilefuse.block_sparse_attention``. A mask that is only a band (``causal() & sliding_window(w, 0)``
    and the like, :meth:`tilefuse.masks.MaskSpec.band`) with Nq == Nk runs the windowed kernels instead, which
    compute the same mask from positions and read no tile lists.

    ``fp8=True``: both matrix products in FP8 (e4m3) on FP8 tensor cores (compute capability 8.9+; CPU runs the
    same math), forward only, with ``causal``, ``window``, ``scale`` and GQA as above. 16/32-bit q, k, v are
    quantized first (:func:`tilefuse.quantize_qkv`: Q and K one scale per head and 128 rows, V one per head
    and channel; ``rotate`` -- by default where d is a power of two -- rotates Q and K by one orthogonal
    matrix first, which keeps outlier channels from dominating the rounding) and the output is in their dtype. Or pass float8_e4m3fn q, k, v with ``q_scale``, ``k_scale``,
    ``v_scale`` (each a number, one per head [B, H], or per block: q [B, Hq, cdiv(Nq, 128)], k [B, Hkv,
    cdiv(Nk, 128)], v per channel [B, Hkv, d]; a v laid out keys-contiguous, as quantize_qkv returns it, is
    read in place) and get ``out_dtype`` (default bfloat16). The probabilities are scaled by 256 before their
    e4m3 cast so that small ones keep their bits. Registered as ``torch.ops.tilefuse.attention_fp8``.
    """
    if fp8 is not False:
        if fp8 is not True:
            raise TypeError(f"fp8 must be a bool, got {fp8!r}")
        unsupported = [name for name, value in (("block_mask", block_mask), ("softcap", softcap),
                                                ("alibi_slopes", alibi_slopes)) if value is not None]
        if return_lse:
            unsupported.append("return_lse")
        if unsupported:
            raise NotImplementedError(f"fp8=True does not support {', '.join(unsupported)}")
        if window is not None and (not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
                isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
            raise ValueError(f"window must be None or (left, right) with ints >= -1, got {window!r}")
        _check_scale(scale)
        return fp8_attention.attention_fp8(q, k, v, causal=causal, window=window, scale=scale, q_scale=q_scale,
                                           k_scale=k_scale, v_scale=v_scale, rotate=rotate, out_dtype=out_dtype)
    for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale), ("out_dtype", out_dtype)):
        if value is not None:
            raise ValueError(f"{name} is only for fp8=True")
    if rotate is not None:
        raise ValueError("rotate is only for fp8=True")
    if block_mask is not None:
        return _block_sparse_attention(q, k, v, block_mask, causal, window, scale, return_lse, deterministic,
                                       softcap, alibi_slopes)
    if _dtensor.any_dtensor(q, k, v, alibi_slopes):  # heads sharded by tensor parallelism: the local heads
        return _dtensor.heads(q, k, v, (alibi_slopes,), lambda q, k, v, a: _attention(
            q, k, v, causal, window, scale, return_lse, deterministic, softcap, a))
    return _attention(q, k, v, causal, window, scale, return_lse, deterministic, softcap, alibi_slopes)


def _attention(q, k, v, causal, window, scale, return_lse, deterministic, softcap, alibi_slopes, out_bnhd=False):
    """:func:`attention`; ``out_bnhd``: out laid out [B, Nq, Hq, d] (FlashAttention's layout, written there by
    the kernel) and returned as its [B, Hq, Nq, d] view."""
    cast = _dispatch.autocast_dtype(q) if isinstance(q, torch.Tensor) else None
    if cast is not None:  # as torch's SDPA under autocast
        q, k, v = _dispatch.cast_floats(cast, q, k, v)
    check_qkv(q, k, v, ndim=4)
    check_kv_heads(q, k, v)
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
            raise ValueError(f"window must be None or (left, right) with ints >= -1, got {window!r}")
    _check_scale(scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    softcap, alibi = score_modifiers(q, softcap, alibi_slopes)
    left, right = tuple(window) if window is not None else (-1, -1)
    if causal:
        right = 0
    scale = None if scale is None else float(scale)
    out, lse = _run(q, k, v, None, scale, True, left, right, return_lse, "attention", softcap, alibi, out_bnhd,
                    deterministic)
    return (out, _user_lse(lse, alibi, k.shape[2], k.shape[2] - q.shape[2])) if return_lse else out


def _broadcast_shape(*shapes) -> tuple | None:
    """The broadcast of ``shapes`` (torch's rules), or None if they do not broadcast. Plain Python:
    torch.broadcast_shapes goes through symbolic-shape machinery that costs ~30 us per call."""
    out = [1] * max([len(s) for s in shapes] + [0])
    for shape in shapes:
        for i, d in enumerate(shape, len(out) - len(shape)):
            if d == out[i] or d == 1:
                continue
            if out[i] != 1:
                return None
            out[i] = d
    return tuple(out)


def _broadcast(name, *shapes):
    out = _broadcast_shape(*shapes)
    if out is None:
        raise ValueError(f"{name}: shapes {', '.join(str(tuple(s)) for s in shapes)} do not broadcast")
    return out


def _to_4d(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Expand t to ``shape`` (a view: broadcast dims get stride 0) and present it as 4-D."""
    t = t.expand(shape)
    if len(shape) == 4:
        return t
    if len(shape) == 2:
        return t[None, None]
    if len(shape) == 3:
        return t[:, None]
    return t.reshape(-1, *shape[-3:])  # 5-D and up: leading dims merge (copies only if they must)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (forward, no dropout).

    Same semantics: top-left causal, ``attn_mask`` bool (True = attend) or additive float
    broadcastable to ``[..., Hq, L, S]`` (read with its broadcast strides, never materialised),
    broadcast batch dims, 2-D/3-D inputs, ``enable_gqa``. A row every key of which is masked
    (all False / -inf) gives 0, as torch's math backend does; a finite large negative mask gives
    the uniform average. With both ``is_causal`` and ``attn_mask`` both apply (torch's math
    backend refuses that). value's head dim must equal query's (torch allows Ev != E).
    """
    return sdpa_heads_last(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, heads_last=False)


def sdpa_heads_last(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    *, heads_last: bool = True) -> torch.Tensor:
    """:func:`scaled_dot_product_attention`, its output written by the kernel with the heads dim innermost
    but one (``heads_last``: the result [..., H, L, E] is a view of a [..., L, H, E] tensor), so that
    ``out.transpose(-3, -2)`` -- the layout an output projection reads, as Hugging Face's attention
    functions return it -- is contiguous without a copy."""
    if dropout_p != 0.0:
        raise NotImplementedError("tilefuse.scaled_dot_product_attention has no dropout; use dropout_p=0.0")
    if _dtensor.any_dtensor(query, key, value, attn_mask):
        return _dtensor.heads(query, key, value, (attn_mask,), lambda q, k, v, m: sdpa_heads_last(
            q, k, v, m, 0.0, is_causal, scale, enable_gqa, heads_last=heads_last))
    cast = _dispatch.autocast_dtype(query) if isinstance(query, torch.Tensor) else None
    if cast is not None:  # as torch's SDPA under autocast (a float mask follows the inputs)
        query, key, value = _dispatch.cast_floats(cast, query, key, value)
        if isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(cast)
    check_qkv(query, key, value, "query", "key", "value")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"value head dim {value.shape[-1]} != query head dim "
                                  f"{query.shape[-1]}: not supported")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key has {key.shape[-2]} positions but value has {value.shape[-2]}")
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    qb, kb, vb = query.shape[:-2], key.shape[:-2], value.shape[:-2]
    gqa = enable_gqa and len(qb) >= 1 and len(kb) >= 1 and kb[-1] != qb[-1]
    if gqa:
        if kb[-1] == 0 or qb[-1] % kb[-1] or vb[-1] != kb[-1]:
            raise ValueError(f"enable_gqa: query heads ({qb[-1]}) must be a multiple of key/value heads "
                             f"({kb[-1]}, {vb[-1]})")
        batch = _broadcast("query/key/value batch dims", qb[:-1], kb[:-1], vb[:-1])
        hq, hkv = qb[-1], kb[-1]
        q_shape, kv_shape = batch + (hq, L, E), batch + (hkv, S, E)
    else:
        batch = _broadcast("query/key/value batch dims", qb, kb, vb)
        q_shape, kv_shape = batch + (L, E), batch + (S, E)
    out_shape = q_shape
    score_shape = q_shape[:-1] + (S,)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; expected bool or query's dtype {query.dtype}")
        check_same_device("attn_mask", attn_mask, "query", query)
        if _broadcast_shape(attn_mask.shape, score_shape) != score_shape:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                             f"attention weights' shape {score_shape}")
    _check_scale(scale)
    q4, k4, v4 = _to_4d(query, q_shape), _to_4d(key, kv_shape), _to_4d(value, kv_shape)
    mask4 = _to_4d(attn_mask, score_shape) if attn_mask is not None else None
    scale = None if scale is None else float(scale)
    right = 0 if is_causal else -1
    out, _ = _run(q4, k4, v4, mask4, scale, False, -1, right, False, "scaled_dot_product_attention",
                  out_bnhd=heads_last)
    return out.reshape(out_shape)


# ---- FlashAttention 2's API ------------------------------------------------------------------------
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """``flash_attn.flash_attn_func`` on tilefuse's kernels: q ``[B, Nq, Hq, d]``, k/v ``[B, Nk, Hkv, d]``
    (FlashAttention 2's layout, read in place through strides: no copies), bottom-right aligned causal,
    ``window_size=(left, right)`` with -1 unbounded, ``softcap`` 0 for none, ``alibi_slopes`` fp32 ``[Hq]`` or
    ``[B, Hq]``. Returns out ``[B, Nq, Hq, d]``, contiguous as FlashAttention's (the kernel writes that layout
    directly), or with ``return_attn_probs`` ``(out, softmax_lse [B, Hq, Nq], None)``. Forward and backward
    (dq, dk, dv in the inputs' layouts where those are dense, so contiguous inputs get contiguous
    gradients); dropout raises ``NotImplementedError``."""
    window = flash_attn_window(dropout_p, window_size, softcap)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, N, H, d] (FlashAttention's layout), got shape {tuple(t.shape)}")
    res = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, window, softmax_scale,
                     return_attn_probs, deterministic, softcap or None, alibi_slopes, out_bnhd=True)
    if not return_attn_probs:
        return res.transpose(1, 2)  # contiguous [B, Nq, Hq, d]
    out, lse = res
    return out.transpose(1, 2), lse, None


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False):
    """``flash_attn.flash_attn_qkvpacked_func``: qkv ``[B, N, 3, H, d]``, q, k and v read in place."""
    check_tensor("qkv", qkv)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [B, N, 3, H, d], got shape {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: float | None = None, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False):
    """``flash_attn.flash_attn_kvpacked_func``: q ``[B, Nq, Hq, d]``, kv ``[B, Nk, 2, Hkv, d]`` read in place."""
    check_tensor("kv", kv)
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be [B, N, 2, H, d], got shape {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


# ---- packed variable-length sequences --------------------------------------------------------------
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     window: tuple[int, int] | None = None, scale: float | None = None, softcap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None, deterministic: bool = False, return_lse: bool = False,
                     validate: bool = True):
    """Attention over packed variable-length sequences: q ``[total_q, Hq, d]``, k/v ``[total_k, Hkv, d]``,
    sequence i's rows at ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` (keys likewise; int32 or int64 offsets from
    0). Each sequence attends only to its own keys, aligned bottom-right as :func:`attention`, with the same
    options; ``alibi_slopes`` ``[Hq]`` or ``[B, Hq]``. Returns ``[total_q, Hq, d]`` (and lse fp32
    ``[Hq, total_q]`` with ``return_lse``). Forward and backward, in one launch each however many sequences.
    ``validate=True`` checks the offsets' values (one host synchronisation); ``validate=False`` skips that
    (CUDA graphs, torch.compile), and the kernels then clamp offsets to the totals so that they never read or
    write outside q, k, v and the output."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [total, H, d], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    q4, k4, v4 = (t.permute(1, 0, 2)[None] for t in (q, k, v))  # [1, H, total, d] views, no copy
    check_qkv(q4, k4, v4, ndim=4)
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv})")
    check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, validate)
    check_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, validate)
    check_same_device("cu_seqlens_q", cu_seqlens_q, "q", q)
    check_same_device("cu_seqlens_k", cu_seqlens_k, "q", q)
    seqs = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != seqs + 1:
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.shape[0] - 1} sequences, cu_seqlens_q {seqs}")
    if seqs * Hq > MAX_GRID_Y_BACKWARD:
        raise NotImplementedError(f"tilefuse.attention_varlen: sequences * heads = {seqs * Hq} is above "
                                  f"{MAX_GRID_Y_BACKWARD} (the grid's second axis)")
    if window is not None and (not isinstance(window, (tuple, list)) or len(window) != 2
                               or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"window must be None or (left, right) with ints >= -1, got {window!r}")
    _check_scale(scale)
    softcap, alibi = score_modifiers(q.new_empty((seqs, Hq, 0, 0)), softcap, alibi_slopes)
    left, right = tuple(window) if window is not None else (-1, -1)
    if causal:
        right = 0
    scale = None if scale is None else float(scale)
    args = (q4, k4, v4, None, scale, True, left, right)
    varlen = (softcap, alibi, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), False, deterministic)
    if grad_needed(q, k, v):
        out, lse = _attention_call(*args, True, *varlen)
    elif _dispatch.direct(q4, k4, v4, alibi, cu_seqlens_q, cu_seqlens_k):
        out, lse = _attention_impl(*args, return_lse, *varlen)
    else:
        out, lse = _attention_call(*args, return_lse, *varlen)
    out = out[0].permute(1, 0, 2)  # [total_q, Hq, d], contiguous: the kernel wrote the packed layout
    return (out, _user_lse(lse, alibi, 0, 0, cu_seqlens_q, cu_seqlens_k)[0]) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn.flash_attn_varlen_func`` on :func:`attention_varlen` (offsets validated: one host
    synchronisation). With ``return_attn_probs``: ``(out, softmax_lse [Hq, total_q], None)``. With
    ``block_table`` (int32 ``[B, max_blocks]``), k and v are a paged cache ``[num_blocks, page_size, Hkv, d]``
    and sequence b's cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys sit in the pages of block_table[b]
    (forward only: :func:`tilefuse.ops.paged.flash_attn_varlen_paged`)."""
    window = flash_attn_window(dropout_p, window_size, softcap)
    if block_table is not None:
        out, lse = paged_ops.flash_attn_varlen_paged(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale, causal,
            window, softcap or None, alibi_slopes, return_lse=True)
        return (out, lse, None) if return_attn_probs else out
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                window=window, scale=softmax_scale, softcap=softcap or None,
                                alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True)
    return (out, lse, None) if return_attn_probs else out

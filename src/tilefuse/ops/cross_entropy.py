"""tilefuse.linear_cross_entropy: ``F.cross_entropy(F.linear(x, weight, bias), target)`` without the logits.

Registered as ``tilefuse::linear_cross_entropy`` (per-row losses and lse) with autograd through
``tilefuse::linear_cross_entropy_backward``; the reduction ("mean" / "sum" / "none") is plain torch on the
per-row losses, so autograd carries the incoming gradient to each row.

Training with "mean" or "sum" in bf16 or fp32 takes the training form instead: the forward also makes the
gradients, every kept row's gradient being one and the same number, which the backward applies; so the logits are
made once, not again in the backward. Eagerly through :class:`_TrainingForm`, in graphs torch.compile traces through
``tilefuse::linear_cross_entropy_train``.
"""
from __future__ import annotations

from typing import Optional

import torch

from tilefuse import runtime
from tilefuse.kernels import switches
from tilefuse.ops import _dispatch
from tilefuse.ops._checks import check_same_device, check_same_dtype, check_softcap, check_tensor, grad_needed
from tilefuse.ops.linear import _gemm_launch

REDUCTIONS = ("mean", "sum", "none")


def _no_autocast(fn):
    """``fn`` with autocast off on its tensors' device: the reference computes in fp32 as the kernels do (under
    CPU autocast, F.linear would otherwise run in bf16 and the loss come back bf16)."""
    def run(*args):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        with torch.autocast(device, enabled=False):
            return fn(*args)
    return run


@_no_autocast
def _reference_rows(x2d, weight, bias, target, ignore_index, smoothing, softcap):
    """(loss per row, lse) in fp32 by the plain PyTorch ops (the logits materialised)."""
    z = torch.nn.functional.linear(x2d.float(), weight.float(), None if bias is None else bias.float())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    V = weight.shape[0]
    valid = (target >= 0) & (target < V)
    lse = torch.logsumexp(z, -1)
    z_t = z.gather(1, torch.where(valid, target, 0).long()[:, None])[:, 0]
    # torch's label smoothing: (1 - eps) * -log p_target + eps * mean over classes of -log p
    loss = (1 - smoothing) * (lse - z_t) + smoothing * (lse - z.mean(-1))
    loss = torch.where(target == ignore_index, 0.0, torch.where(valid, loss, float("nan")))
    return loss, lse


@_no_autocast
def _reference_backward(dloss, x2d, weight, bias, target, lse, smoothing, softcap):
    z = torch.nn.functional.linear(x2d.float(), weight.float(), None if bias is None else bias.float())
    t = None
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    V = weight.shape[0]
    p = torch.exp(z - lse[:, None])
    onehot = torch.zeros_like(p)
    valid = (target >= 0) & (target < V)
    onehot[valid.nonzero()[:, 0], target[valid].long()] = 1.0
    dz = ((1 - smoothing) * (p - onehot) + smoothing * (p - 1.0 / V)) * dloss[:, None]
    if t is not None:
        dz = dz * (1 - t * t)
    return dz @ weight.float(), dz.t() @ x2d.float(), dz.sum(0)


def _rows_impl(x2d, weight, bias, target, ignore_index, smoothing, softcap):
    path = runtime.execution_path(x2d)
    if path == runtime.REFERENCE or x2d.shape[0] == 0 or x2d.shape[1] == 0:
        _dispatch.record_reference("linear_cross_entropy", path)
        return _reference_rows(x2d, weight, bias, target, ignore_index, smoothing, softcap)
    with _dispatch.on_device(x2d):
        return _gemm_launch().linear_cross_entropy(x2d, weight, bias, target, ignore_index, smoothing, softcap, path)


@torch.library.custom_op("tilefuse::linear_cross_entropy", mutates_args=())
def _lce_op(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
            ignore_index: int, label_smoothing: float, softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows_impl(x2d, weight, bias, target, ignore_index, label_smoothing, softcap)


@_lce_op.register_fake
def _(x2d, weight, bias, target, ignore_index, label_smoothing, softcap):
    rows = x2d.shape[0]
    return x2d.new_empty((rows,), dtype=torch.float32), x2d.new_empty((rows,), dtype=torch.float32)


def _backward_impl(dloss, x2d, weight, bias, target, lse, smoothing, softcap, need_dx, need_dw, need_db):
    path = runtime.execution_path(x2d)
    if path == runtime.REFERENCE or x2d.shape[0] == 0 or x2d.shape[1] == 0:
        _dispatch.record_reference("linear_cross_entropy_backward", path)
        dx, dw, db = _reference_backward(dloss, x2d, weight, bias, target, lse, smoothing, softcap)
        return (dx.to(x2d.dtype) if need_dx else x2d.new_empty((0,)), dw.to(weight.dtype) if need_dw else
                x2d.new_empty((0,)), db.to(bias.dtype) if need_db else x2d.new_empty((0,)))
    with _dispatch.on_device(x2d):
        return _gemm_launch().linear_cross_entropy_backward(dloss, x2d, weight, bias, target, lse, smoothing, softcap,
                                                            need_dx, need_dw, need_db, path)


@torch.library.custom_op("tilefuse::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(dloss: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     target: torch.Tensor, lse: torch.Tensor, label_smoothing: float, softcap: Optional[float],
                     need_dx: bool, need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(dloss, x2d, weight, bias, target, lse, label_smoothing, softcap, need_dx, need_dw, need_db)


@_lce_backward_op.register_fake
def _(dloss, x2d, weight, bias, target, lse, label_smoothing, softcap, need_dx, need_dw, need_db):
    return (torch.empty(x2d.shape if need_dx else (0,), dtype=x2d.dtype, device=x2d.device),
            torch.empty(weight.shape if need_dw else (0,), dtype=weight.dtype, device=x2d.device),
            torch.empty(bias.shape if need_db else (0,), dtype=x2d.dtype if bias is None else bias.dtype,
                        device=x2d.device))


def _setup(ctx, inputs, output):
    x2d, weight, bias, target, ignore_index, label_smoothing, softcap = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x2d, weight, bias, target, output[1])
    ctx.args = (ignore_index, label_smoothing, softcap)


def _kept_row_gradients(drows, target, ignore_index, V):
    """(dloss fp32 [M], keep): the rows' incoming gradients, 0 on rows that get none -- ignored targets, and
    targets outside [0, V) (their loss is NaN)."""
    keep = (target != ignore_index) & (target >= 0) & (target < V)
    return torch.where(keep, drows.float(), 0.0).contiguous(), keep


def _backward(ctx, dloss, dlse):
    x2d, weight, bias, target, lse = ctx.saved_tensors
    ignore_index, smoothing, softcap = ctx.args
    needs = ctx.needs_input_grad
    need_dx, need_dw, need_db = needs[0], needs[1], bias is not None and needs[2]
    if dloss is None or not (need_dx or need_dw or need_db):
        return (None,) * 7
    dloss, _ = _kept_row_gradients(dloss, target, ignore_index, weight.shape[0])
    args = (dloss, x2d, weight, bias, target, lse, smoothing, softcap, need_dx, need_dw, need_db)
    if _dispatch.direct(dloss, x2d, weight, bias, target, lse):
        dx, dw, db = _backward_impl(*args)
    else:
        dx, dw, db = _lce_backward_op(*args)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None, None, None, None, None)


_lce_call = _dispatch.register_autograd(_lce_op, _rows_impl, _backward, _setup)

TRAINING_DTYPES = (torch.bfloat16, torch.float32)  # fp16's range cannot hold dW summed before the loss's scale


def _training_form_applies(reduction, x2d, weight, bias) -> bool:
    """A "mean" or "sum" loss in bf16 / fp32 that autograd records, on the launch layer's paths, with rows to take:
    eagerly through :class:`_TrainingForm`, in a graph torch.compile traces through its op, so a compiled step
    makes the logits once, as an eager one does."""
    return (reduction != "none" and x2d.dtype in TRAINING_DTYPES and x2d.shape[0] > 0 and x2d.shape[1] > 0
            and grad_needed(x2d, weight, bias) and runtime.execution_path(x2d) != runtime.REFERENCE
            and switches.gemm.LCE_TRAINING_FORM)


def _training_impl(x2d, weight, bias, target, ignore_index, smoothing, softcap, need_dx, need_dw, need_db):
    with _dispatch.on_device(x2d):
        return _gemm_launch().linear_cross_entropy_with_grads(x2d, weight, bias, target, ignore_index, smoothing,
                                                              softcap, need_dx, need_dw, need_db,
                                                              runtime.execution_path(x2d))


@torch.library.custom_op("tilefuse::linear_cross_entropy_train", mutates_args=())
def _lce_train_op(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
                  ignore_index: int, label_smoothing: float, softcap: Optional[float], need_dx: bool, need_dw: bool,
                  need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training form as an op, for graphs torch.compile traces: (loss per row, lse, dx, dW, db) of the sum of
    the kept rows' losses, the gradients made with the logits (the launch's ``linear_cross_entropy_with_grads``)."""
    return _training_impl(x2d, weight, bias, target, ignore_index, label_smoothing, softcap, need_dx, need_dw,
                          need_db)


@_lce_train_op.register_fake
def _(x2d, weight, bias, target, ignore_index, label_smoothing, softcap, need_dx, need_dw, need_db):
    M, K = x2d.shape
    V = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=x2d.device)
    return (torch.empty((M,), **f32), torch.empty((M,), **f32),
            torch.empty((M, K) if need_dx else (0,), dtype=x2d.dtype, device=x2d.device),
            torch.empty((V, K) if need_dw else (0,), dtype=weight.dtype, device=x2d.device),
            torch.empty((V,) if need_db else (0,), **f32))


def _setup_train(ctx, inputs, output):
    x2d, weight, bias, target, ignore_index, label_smoothing, softcap, need_dx, need_dw, need_db = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(target, *output[2:])
    ctx.ignore_index, ctx.V = ignore_index, weight.shape[0]
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.need = (need_dx, need_dw, need_db)


def _train_backward(ctx, drows, dlse, ddx, ddw, ddb):
    """As :class:`_TrainingForm`'s backward, out of place (a compiled graph's saved tensors are never written):
    the kept rows' common gradient c scales dW and db, dx is scaled row by row."""
    target, dx, dw, db = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.need
    if drows is None:
        return (None,) * 10
    dloss, keep = _kept_row_gradients(drows, target, ctx.ignore_index, ctx.V)
    c = dloss.sum() / keep.sum().clamp_min(1)
    return ((dx * dloss[:, None]).to(dx.dtype) if need_dx else None, (dw * c).to(dw.dtype) if need_dw else None,
            (db * c).to(ctx.bias_dtype) if need_db else None) + (None,) * 7


_lce_train_op.register_autograd(_train_backward, setup_context=_setup_train)


class _TrainingForm(torch.autograd.Function):
    """The per-row losses and lse, as ``_lce_op``, with the gradients made in the forward
    (``linear_cross_entropy_with_grads``: those of the sum of the kept rows' losses). Only for "mean" and "sum",
    whose kept rows all get one gradient c (mean: g / n, sum: g): the backward takes c as the mean of the
    incoming row gradients over the kept rows (no host synchronisation) and scales dW and db by it, dx row by
    row. A second backward over the same graph (``retain_graph``) takes the recomputing backward."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, target, ignore_index, smoothing, softcap):
        needs = ctx.needs_input_grad
        need = (needs[0], needs[1], bias is not None and needs[2])
        rows, lse, *grads = _training_impl(x2d, weight, bias, target, ignore_index, smoothing, softcap, *need)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x2d, weight, bias, target, lse)
        ctx.args = (ignore_index, smoothing, softcap)
        ctx.need = need
        ctx.grads = grads  # handed over once (their only reference: autograd then keeps them without a copy)
        return rows, lse

    @staticmethod
    def backward(ctx, drows, dlse):
        x2d, weight, bias, target, lse = ctx.saved_tensors
        ignore_index, smoothing, softcap = ctx.args
        need_dx, need_dw, need_db = ctx.need
        grads, ctx.grads = ctx.grads, None
        if drows is None:
            return (None,) * 7
        dloss, keep = _kept_row_gradients(drows, target, ignore_index, weight.shape[0])
        if grads is None:  # the gradients went to an earlier backward: recompute them
            with _dispatch.on_device(x2d):
                dx, dw, db = _backward_impl(dloss, x2d, weight, bias, target, lse, smoothing, softcap, need_dx,
                                            need_dw, need_db)
        else:
            dx, dw, db = grads
            c = dloss.sum() / keep.sum().clamp_min(1)
            if need_dx:
                dx.mul_(dloss[:, None])
            if need_dw:
                dw.mul_(c)
            if need_db:
                db = (db * c).to(bias.dtype)
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None, None, None, None, None)


def _check_targets(target, V, ignore_index) -> None:
    """Every target in [0, V) or ignore_index. Eagerly a ValueError (one host synchronisation); under
    torch.compile, where a host read would break the graph, an asynchronous assertion in the graph instead,
    the outcome F.cross_entropy has on CUDA for such a target (on a CPU it raises at once, on CUDA the device
    assertion fails the stream)."""
    bad = ((target < 0) | (target >= V)) & (target != ignore_index)
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"linear_cross_entropy: target holds a value outside [0, {V}) that is "
                                        f"not ignore_index ({ignore_index})")
        return
    if bool(bad.any()):
        raise ValueError(f"target holds {int(bad.sum())} value(s) outside [0, {V}) that are not ignore_index "
                         f"({ignore_index}), e.g. {int(target[bad].flatten()[0])}")


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                         *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         softcap: float | None = None, return_lse: bool = False, check_targets: bool = True):
    """``F.cross_entropy(F.linear(x, weight, bias), target, ignore_index=..., reduction=...,
    label_smoothing=...)`` without materialising the logits: vocabulary chunks stream through the GEMM into the
    rows' log-sum-exp, and the backward recomputes each chunk's logits; eager training over "mean" or "sum" in
    bf16 / fp32 makes the gradients in the forward instead, a chunk of tokens at a time, so the logits are made
    once (the backward scales them by the loss's gradient). x ``[..., K]``; weight ``[V, K]`` (the LM
    head or a tied embedding, read in place); target int64 or int32 ``[...]``. Returns fp32: a scalar for
    "mean" / "sum", ``[...]`` for "none"; ``softcap`` is Gemma 2's ``softcap * tanh(z / softcap)`` on the
    logits; ``return_lse`` also returns the per-token lse (fp32, not differentiable). ``check_targets``
    checks that every target is in [0, V) or ``ignore_index``: a ValueError naming the first bad value (one host
    synchronisation), or under ``torch.compile`` an asynchronous assertion in the graph (no graph break; on CUDA a
    device-side assertion, as F.cross_entropy's); without it such a row's loss is NaN and the kernels never use
    it as an address."""
    cast = _dispatch.autocast_dtype(x) if isinstance(x, torch.Tensor) else None
    if cast is not None:  # no torch counterpart: runs in the autocast dtype, the loss in fp32
        x, weight, bias = _dispatch.cast_floats(cast, x, weight, bias)
    check_tensor("x", x)
    check_tensor("weight", weight)
    if bias is not None:
        check_tensor("bias", bias)
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int32, torch.int64):
        what = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        raise TypeError(f"target must be an int64 or int32 tensor, got {what}")
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, K] with V >= 1, got shape {tuple(weight.shape)}")
    V, K = weight.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., K] with K = weight.shape[1] = {K}, got shape {tuple(x.shape)}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must have x's leading shape {tuple(x.shape[:-1])}, got {tuple(target.shape)}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must have shape [{V}], got {tuple(bias.shape)}")
    check_same_dtype("weight", weight, "x", x)
    if bias is not None:
        check_same_dtype("bias", bias, "x", x)
    for name, t in (("weight", weight), ("bias", bias), ("target", target)):
        if t is not None:
            check_same_device(name, t, "x", x)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or \
            not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    softcap = check_softcap(softcap)
    if check_targets and target.numel():
        _check_targets(target, V, ignore_index)
    x2d = x.reshape(-1, K)
    if K > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    if K > 1 and weight.stride(1) != 1:
        weight = weight.contiguous()  # the kernels read W rows with a unit column stride
    t1d = target.reshape(-1).contiguous()
    bias = None if bias is None else bias.contiguous()
    args = (x2d, weight, bias, t1d, int(ignore_index), float(label_smoothing), softcap)
    if _dispatch.direct(x2d, weight, bias, t1d):
        rows, lse = _rows_impl(*args)
    elif _training_form_applies(reduction, x2d, weight, bias):
        if _dispatch.eager_autograd(x2d, weight, bias, t1d):
            rows, lse = _TrainingForm.apply(*args)
        else:
            need = (x2d.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
            rows, lse = _lce_train_op(*args, *need)[:2]
    else:
        rows, lse = _lce_call(*args)
    if reduction == "none":
        loss = rows.view(target.shape)
    elif reduction == "sum":
        loss = rows.sum()
    else:
        loss = rows.sum() / (t1d != ignore_index).sum()
    return (loss, lse.view(target.shape)) if return_lse else loss

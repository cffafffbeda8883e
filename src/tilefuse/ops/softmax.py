"""tilefuse.softmax: softmax over any dim, forward and backward, two-pass or online.

Registered as the custom ops ``tilefuse::softmax`` (autograd through ``tilefuse::softmax_backward``);
see ``_dispatch`` for the path a call takes.
"""
from __future__ import annotations

import operator

import torch

from tilefuse import runtime
from tilefuse.ops import _dispatch
from tilefuse.ops._checks import check_tensor
from tilefuse.reference.softmax import softmax as reference_softmax
from tilefuse.reference.softmax import softmax_backward as reference_softmax_backward

ALGORITHMS = ("auto", "online", "two_pass")


def _check_softmax_args(x, dim, algorithm) -> int:
    """Returns dim as a non-negative int (0-d x counts as 1-d, as in torch)."""
    check_tensor("x", x)
    if isinstance(dim, bool):
        raise TypeError("dim must be an int, got a bool")
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"dim must be an int, got {type(dim).__name__}") from None
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-d x: expected "
                         f"{-ndim} <= dim < {ndim}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return dim % ndim


def _softmax_launch():
    runtime.check_triton()
    from tilefuse.kernels.softmax import launch  # imports triton: only once a kernel is to run
    return launch


def _softmax_impl(x, dim, algorithm):
    path = runtime.execution_path(x)
    if path == runtime.REFERENCE or x.numel() == 0:
        _dispatch.record_reference("softmax", path)
        return torch.empty_like(x).copy_(reference_softmax(x, dim))
    with _dispatch.on_device(x):
        return _softmax_launch().forward(x, dim, algorithm, path)


def _softmax_backward_impl(y, dy, dim):
    path = runtime.execution_path(y)
    if path == runtime.REFERENCE or y.numel() == 0:
        _dispatch.record_reference("softmax_backward", path)
        return torch.empty_like(y).copy_(reference_softmax_backward(y.float(), dy.float(), dim))
    with _dispatch.on_device(y):
        return _softmax_launch().backward(y, dy, dim, path)


@torch.library.custom_op("tilefuse::softmax", mutates_args=())
def _softmax_op(x: torch.Tensor, dim: int, algorithm: str) -> torch.Tensor:
    return _softmax_impl(x, dim, algorithm)


@_softmax_op.register_fake
def _(x, dim, algorithm):
    return torch.empty_like(x)


@torch.library.custom_op("tilefuse::softmax_backward", mutates_args=())
def _softmax_backward_op(y: torch.Tensor, dy: torch.Tensor, dim: int) -> torch.Tensor:
    return _softmax_backward_impl(y, dy, dim)


@_softmax_backward_op.register_fake
def _(y, dy, dim):
    return torch.empty_like(y)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.dim = inputs[1]


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    if _dispatch.direct(y, dy):  # eager backward: no dispatcher round trip
        return _softmax_backward_impl(y, dy, ctx.dim), None, None
    return _softmax_backward_op(y, dy, ctx.dim), None, None


_softmax_call = _dispatch.register_autograd(_softmax_op, _softmax_impl, _backward, _setup)


def _probe_softmax(t):
    return torch.softmax(t, -1)


_dispatch.register_autocast(_softmax_op, (0,), _probe_softmax, "softmax")


def softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto") -> torch.Tensor:
    """``torch.softmax(x, dim)`` by Triton kernels, differentiable (backward in one kernel too).

    x: fp32, fp16 or bf16, any shape and strides; ``dim`` may be negative and need not be last (the
    kernels take a row stride and a column stride, no copy). The result has x's dtype (fp32 math
    inside) and the layout of ``torch.empty_like(x)`` (x's when x is dense). ``algorithm``: "two_pass"
    (a max pass, then a sum pass, then the write), "online" (running max and rescaled sum in one pass,
    then the write), or "auto"; they differ only for rows longer than one block. "auto" on a GPU
    measures both for the shape (the autotuner: the faster is kept in the tuning cache) and runs the
    faster; where nothing is tuned (the interpreter) it runs "online", which reads a long row twice,
    not three times. Extremes as in torch: an all -inf row, a row with +inf or NaN gives NaN; large
    logits are safe. CPU tensors run the kernels under ``TRITON_INTERPRET=1`` and ``torch.softmax``
    otherwise.
    """
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        cast = _dispatch.autocast_like("softmax", x, _probe_softmax)
        if cast is not None and cast != x.dtype:  # torch's autocast runs softmax in another dtype
            x = x.to(cast)
    dim = _check_softmax_args(x, dim, algorithm)
    x1 = x.reshape(1) if x.dim() == 0 else x
    dim = 0 if x.dim() == 0 else dim
    if _dispatch.direct(x1):
        y = _softmax_impl(x1, dim, algorithm)
    else:
        y = _softmax_call(x1, dim, algorithm)
    return y.reshape(()) if x.dim() == 0 else y

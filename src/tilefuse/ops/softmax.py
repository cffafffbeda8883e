"""tilefuse.softmax: softmax over any dim, forward and backward, two-pass or online."""
from __future__ import annotations

import math
import operator

import torch
from torch.autograd.function import once_differentiable

from tilefuse import runtime
from tilefuse.ops._checks import check_tensor, grad_needed
from tilefuse.reference.softmax import softmax as reference_softmax

ALGORITHMS = ("auto", "online", "two_pass")

# The config of the most recent launch, for the report ("which tiling ran"). A diagnostic only.
last_config = {"config": None, "path": None}
last_backward_config = {"config": None, "path": None}


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


def _row_split(views: list[torch.Tensor]):
    """Rows of tensors shaped [..., N] (softmax dim moved last, a view) as (outer, inner) pairs.

    Finds the first split of the leading dims into an outer and an inner group such that, in every
    tensor, each group collapses to one stride. Returns (r_inner, ((s_outer, s_inner, s_n), ...)), or
    None when no split works for all of them (the caller then copies; rare: >3-d permuted layouts).
    """
    shape = views[0].shape
    lead = [j for j in range(len(shape) - 1) if shape[j] != 1]

    def collapses(t, dims):
        return all(t.stride(a) == shape[b] * t.stride(b) for a, b in zip(dims, dims[1:]))

    for k in range(len(lead) + 1):
        outer, inner = lead[:k], lead[k:]
        if all(collapses(t, outer) and collapses(t, inner) for t in views):
            strides = tuple((t.stride(outer[-1]) if outer else 0, t.stride(inner[-1]) if inner else 0,
                             t.stride(-1)) for t in views)
            return math.prod(shape[j] for j in inner), strides
    return None


def _layout(views):
    from tilefuse.kernels.softmax import RowLayout

    found = _row_split(views)
    if found is None:
        return None
    r_inner, strides = found
    n = views[0].shape[-1]
    return RowLayout(rows=views[0].numel() // n, r_inner=r_inner, n=n, strides=strides)


def _forward(x: torch.Tensor, dim: int, algorithm: str, interpret: bool) -> torch.Tensor:
    from tilefuse.kernels.softmax import launch_softmax_forward  # imports triton lazily

    # y keeps x's memory layout when x is dense, so reads and writes walk memory the same way.
    y = torch.empty_like(x)
    if x.numel() == 0:
        last_config["config"] = "empty"
        return y
    layout = _layout([x.movedim(dim, -1), y.movedim(dim, -1)])
    if layout is None:
        # No two row strides address x: copy it (documented; e.g. a 4-d tensor permuted twice).
        x = x.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        layout = _layout([x.movedim(dim, -1), y.movedim(dim, -1)])
    last_config["config"] = launch_softmax_forward(x, y, layout, algorithm, interpret)
    return y


def _backward(y: torch.Tensor, dy: torch.Tensor, dim: int, interpret: bool) -> torch.Tensor:
    from tilefuse.kernels.softmax import launch_softmax_backward

    dx = torch.empty_like(y)  # y is dense (we allocated it): dx gets its exact strides
    if y.numel() == 0:
        last_backward_config["config"] = "empty"
        return dx
    layout = _layout([y.movedim(dim, -1), dy.movedim(dim, -1), dx.movedim(dim, -1)])
    if layout is None:
        dy = torch.empty_like(y).copy_(dy)  # dy in y's layout, which always addresses
        layout = _layout([y.movedim(dim, -1), dy.movedim(dim, -1), dx.movedim(dim, -1)])
    last_backward_config["config"] = launch_softmax_backward(y, dy, dx, layout, interpret)
    return dx


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, algorithm, interpret):
        y = _forward(x, dim, algorithm, interpret)
        ctx.save_for_backward(y)
        ctx.dim, ctx.interpret = dim, interpret
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        last_backward_config["path"] = runtime.INTERPRETER if ctx.interpret else runtime.COMPILED
        return _backward(y, dy, ctx.dim, ctx.interpret), None, None, None


def softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto") -> torch.Tensor:
    """``torch.softmax(x, dim)`` by Triton kernels, differentiable (backward in one kernel too).

    x: fp32, fp16 or bf16, any shape and strides; ``dim`` may be negative and need not be last (the
    kernels take a row stride and a column stride, no copy). The result has x's dtype (fp32 math
    inside) and x's memory layout when x is dense. ``algorithm``: "two_pass" (a max pass, then a
    sum pass, then the write), "online" (running max and rescaled sum in one pass, then the write),
    or "auto"; they differ only for rows longer than one block. "auto" on a GPU measures both for the
    shape (the autotuner: the faster is kept in the tuning cache) and runs the faster; where nothing is
    tuned (the interpreter) it runs "online", which reads a long row twice, not three times.
    Extremes as in torch: an all -inf row, a row with +inf or NaN gives NaN; large logits are safe.
    CPU tensors run the kernels under ``TRITON_INTERPRET=1`` and ``torch.softmax`` otherwise.
    """
    dim = _check_softmax_args(x, dim, algorithm)
    path = runtime.execution_path(x)
    last_config.update(config=None, path=path)
    if path == runtime.REFERENCE:
        return reference_softmax(x, dim)
    interpret = path == runtime.INTERPRETER
    x1 = x.reshape(1) if x.dim() == 0 else x
    dim = 0 if x.dim() == 0 else dim
    if grad_needed(x):
        y = _SoftmaxFunction.apply(x1, dim, algorithm, interpret)
    else:
        y = _forward(x1, dim, algorithm, interpret)
    return y.reshape(()) if x.dim() == 0 else y

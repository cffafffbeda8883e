"""Registry entries: softmax forward (tilefuse.softmax, online vs two_pass) and its backward."""
from __future__ import annotations

import torch

from tilefuse.ops import softmax as softmax_op
from tilefuse.reference.softmax import softmax as reference_softmax
from tilefuse.opspec import OpSpec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# The shapes (rows, cols): attention-score and vocabulary-sized rows, then one and 32 rows of
# 2**20 columns (the split-row path; 32 rows so the figure is not only launch latency).
BENCH_SHAPES = [(16384, 4096), (4096, 16384), (65536, 1024), (2048, 131072), (1, 1048576),
                (32, 1048576)]

# Layouts: where the softmax dim sits and how the tensor is strided. R rows of N columns each.
#   rows:        x [R, N], dim=-1
#   dim0:        x [N, R], dim=0 (columns strided by R, neighbouring rows adjacent in memory)
#   middle:      x [a, N, R/a], dim=1 (two row strides)
#   transposed:  x [R, N] as the transpose of an [N, R] buffer, dim=-1
#   sliced:      x [R, N] = every other row and column of a [2R, 2N] buffer (not dense), dim=-1
#   3d_permuted: x [a, R/a, N] as a permuted view of [R/a, N, a], dim=-1 (two row strides, column stride a)
LAYOUTS = ["rows", "dim0", "middle", "transposed", "sliced", "3d_permuted"]


def _split_rows(R: int) -> int:
    return next((d for d in (3, 2) if R % d == 0), 1)


def make_x(params: dict, device, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """x ~ N(0, scale^2) in the params' layout, and the dim to take softmax over."""
    R, N = params["shape"]
    dtype, layout = params["dtype"], params.get("layout", "rows")
    scale = params.get("scale", 1.0)

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    a = _split_rows(R)
    if layout == "rows":
        return randn(R, N), -1
    if layout == "dim0":
        return randn(N, R), 0
    if layout == "middle":
        return randn(a, N, R // a), 1
    if layout == "transposed":
        return randn(N, R).t(), -1
    if layout == "sliced":
        return randn(2 * R, 2 * N)[::2, ::2], -1
    if layout == "3d_permuted":
        return randn(R // a, N, a).permute(2, 0, 1), -1
    raise ValueError(f"unknown layout {layout!r}")


def make_inputs(params: dict, device, seed: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x, dim = make_x(params, device, g)
    return {"x": x, "dim": dim, "algorithm": params.get("algorithm", "auto")}


def make_backward_inputs(params: dict, device, seed: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x, dim = make_x(params, device, g)
    dy = torch.randn(x.shape, generator=g).to(device=device, dtype=x.dtype)
    return {"x": x, "dy": dy, "dim": dim, "algorithm": params.get("algorithm", "auto")}


def _fused(x, dim, algorithm):
    return softmax_op.softmax(x, dim, algorithm=algorithm)


def _reference(x, dim, algorithm):
    return reference_softmax(x, dim)


class BackwardOnly:
    """dx = autograd.grad(forward(x), x, dy): builds the forward graph once per inputs and reuses it,
    so repeated calls (the timing loop) run only the backward. The harness calls ops under
    torch.no_grad(), hence enable_grad. Holds the last inputs' graph only."""

    def __init__(self, forward):
        self.forward = forward
        self._key = None
        self._graph = None

    def graph(self, x, dy, dim, algorithm):
        """(x leaf, y) of the forward for these inputs, built on first use."""
        key = self._key
        if key is None or key[0] is not x or key[1] is not dy or key[2:] != (dim, algorithm):
            self._key = self._graph = None  # free the previous graph first
            with torch.enable_grad():
                xg = x.detach().requires_grad_()
                self._graph = (xg, self.forward(xg, dim, algorithm))
            self._key = (x, dy, dim, algorithm)
        return self._graph

    def __call__(self, x, dy, dim, algorithm):
        xg, y = self.graph(x, dy, dim, algorithm)
        with torch.enable_grad():
            (dx,) = torch.autograd.grad(y, xg, dy, retain_graph=True)
        return dx


_FUSED_BACKWARD = BackwardOnly(_fused)


def _backward_kernels_only(x, dy, dim, algorithm):
    """The fused backward without the autograd engine, for the report's GPU-only column (autograd's
    replay cannot be captured in a CUDA graph): the backward op's implementation on the forward output
    of the graph the timed call uses."""
    _, y = _FUSED_BACKWARD.graph(x, dy, dim, algorithm)
    return softmax_op._softmax_backward_impl(y.detach(), dy, dim % max(x.dim(), 1))


def _bytes(params, tensors: int):
    R, N = params["shape"]
    b = tensors * R * N * params["dtype"].itemsize
    # torch.softmax and its backward are single kernels too: the eager minimum is the same traffic.
    return {"fused": b, "unfused": b}


def _liger_forward(x, dim, algorithm=None):
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError as exc:
        raise ImportError("liger anchor: liger_kernel.ops.softmax.LigerSoftmaxFunction is not "
                          f"importable ({exc}); install liger-kernel==0.8.5") from None
    if dim not in (-1, x.dim() - 1):
        raise ValueError("liger anchor: LigerSoftmaxFunction takes the last dim only")
    return LigerSoftmaxFunction.apply(x)


def _anchors(params):
    """GPU anchors per shape: torch.compile fresh per shape (dynamic=False) and Liger's softmax.
    Eager torch.softmax is the reference, timed by the harness as "eager unfused"."""
    return {"torch.compile": torch.compile(_reference, dynamic=False), "liger": _liger_forward}


def _backward_anchors(params):
    return {"torch.compile": BackwardOnly(torch.compile(_reference, dynamic=False)),
            "liger": BackwardOnly(_liger_forward)}


def _label(p):
    R, N = p["shape"]
    extra = "" if p.get("layout", "rows") == "rows" else f" {p['layout']}"
    return f"{R}x{N} {p.get('algorithm', 'auto')}{extra}"


CPU_SHAPES = [(33, 70), (5, 300), (2, 333), (1, 1), (37, 129)]  # block, loop, split, trivial, loop
GPU_SHAPES = [(1, 1), (257, 1000), (64, 16384), (300, 20000), (3, 70000)]

SOFTMAX = OpSpec(
    name="softmax",
    summary="softmax(x, dim): max, exp, sum and normalize in one kernel (two_pass vs online for long rows)",
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": CPU_SHAPES,
        "dtype": [FP32, FP16, BF16],
        "algorithm": ["online", "two_pass", "auto"],
        "layout": LAYOUTS,
    },
    gpu_test_grid={"shape": GPU_SHAPES, "layout": ["rows", "dim0", "sliced", "3d_permuted"]},
    bench_cases=(
        [dict(shape=s, dtype=BF16, algorithm=a) for s in BENCH_SHAPES for a in ("online", "two_pass")]
        + [dict(shape=s, dtype=FP32, algorithm="online") for s in BENCH_SHAPES[:1] + BENCH_SHAPES[3:4]]
    ),
    accuracy_cases={
        "cpu": [dict(shape=(33, 70), dtype=d, algorithm="online") for d in (FP32, FP16, BF16)]
               + [dict(shape=(2, 333), dtype=FP32, algorithm="two_pass")],
        "gpu": [dict(shape=(1000, 4096), dtype=d, algorithm="online") for d in (FP32, FP16, BF16)]
               + [dict(shape=(64, 131072), dtype=BF16, algorithm=a) for a in ("online", "two_pass")]
               + [dict(shape=(2, 1048576), dtype=FP32, algorithm="online")],
    },
    flops=lambda p: 5.0 * p["shape"][0] * p["shape"][1],  # max, sub, exp, sum, scale per element
    hbm_bytes=lambda p: _bytes(p, 2),  # read x, write y
    bound="memory",
    anchors=_anchors,
    label=_label,
)

SOFTMAX_BACKWARD = OpSpec(
    name="softmax_backward",
    summary="softmax backward dx = y * (dy - sum(dy * y)) in one kernel (timed alone: graph built once)",
    fused=_FUSED_BACKWARD,
    reference=BackwardOnly(_reference),
    make_inputs=make_backward_inputs,
    test_grid={
        "shape": CPU_SHAPES[:4],
        "dtype": [FP32, FP16, BF16],
        "layout": ["rows", "dim0", "middle", "sliced"],
    },
    gpu_test_grid={"shape": GPU_SHAPES, "layout": ["rows", "dim0", "sliced", "3d_permuted"]},
    bench_cases=[dict(shape=s, dtype=BF16) for s in BENCH_SHAPES],
    accuracy_cases={
        "cpu": [dict(shape=(33, 70), dtype=d) for d in (FP32, FP16, BF16)]
               + [dict(shape=(2, 333), dtype=FP32)],
        "gpu": [dict(shape=(1000, 4096), dtype=d) for d in (FP32, FP16, BF16)]
               + [dict(shape=(64, 131072), dtype=BF16), dict(shape=(2, 1048576), dtype=FP32)],
    },
    flops=lambda p: 4.0 * p["shape"][0] * p["shape"][1],  # mul, sum, sub, mul per element
    hbm_bytes=lambda p: _bytes(p, 3),  # read y, read dy, write dx
    bound="memory",
    anchors=_backward_anchors,
    label=lambda p: _label({**p, "algorithm": p.get("algorithm", "auto")}).replace(" auto", ""),
    extra={"kernels_only": _backward_kernels_only},
)

SPECS = [SOFTMAX, SOFTMAX_BACKWARD]

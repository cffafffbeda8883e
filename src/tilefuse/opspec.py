"""The OpSpec record: everything tests, benchmarks and the report need to know about one op.

Kept apart from ``tilefuse.registry`` (which collects the specs) so that a spec module can be imported
on its own without a circular import.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# ENGINEERING.md section 4: rel-L2 bound against a float64 reference, by compute dtype.
REL_L2_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
REL_L2_BOUND_TF32 = 1e-3

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
               torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def default_tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32 and torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32:
        return REL_L2_BOUND_TF32
    return REL_L2_BOUND[dtype]


@dataclass
class OpSpec:
    """Everything the tests, the benchmarks and the report need to know about one op.

    Callables take a ``params`` dict (shape and options, always with a "dtype" key) or the ``inputs``
    dict built by ``make_inputs(params, device, seed)``; ``fused(**inputs)`` and
    ``reference(**inputs)`` return a tensor or a tuple of tensors of the same structure.
    """

    name: str
    summary: str
    fused: Callable[..., Any]
    reference: Callable[..., Any]
    make_inputs: Callable[[dict, torch.device, int], dict]
    # Test grid: option name -> values. CPU tests take a pairwise cover of it (interpreter, tiny odd
    # shapes); GPU tests take the full product, with ``gpu_test_grid`` replacing axes (larger shapes).
    test_grid: dict[str, list]
    gpu_test_grid: dict[str, list]
    # Benchmark rows (GPU): params dicts with real shapes, each with a "dtype".
    bench_cases: list[dict]
    # Accuracy distribution over seeds (report): a few params dicts per dtype.
    accuracy_cases: dict[str, list[dict]]  # "cpu" / "gpu" -> params list
    flops: Callable[[dict], float]
    hbm_bytes: Callable[[dict], dict[str, float]]  # {"fused": bytes, "unfused": bytes}
    bound: str  # "compute", "memory" or "read": which ceiling the roofline % is taken against
    anchors: Callable[[dict], dict[str, Callable[..., Any]]] = lambda params: {}
    tolerance: Callable[[dict], float] = lambda params: default_tolerance(params["dtype"])
    label: Callable[[dict], str] = lambda params: " ".join(
        f"{k}={dtype_name(v) if isinstance(v, torch.dtype) else v}" for k, v in params.items())
    # Test runs on a GPU spread tests over processes; cases with the same compile group go to the same
    # process (pytest-xdist loadgroup) so each kernel variant compiles once, not once per process.
    # Default: the dtype plus every option that is a str, bool or None (these usually select constexprs).
    compile_group: Callable[[dict], str] = lambda params: "-".join(
        dtype_name(v) if isinstance(v, torch.dtype) else f"{k}={v}" for k, v in params.items()
        if isinstance(v, (torch.dtype, str, bool)) or v is None)
    extra: dict = field(default_factory=dict)
    # A bench row may name its own ceiling with a "bound" key (decode GEMMs are bound by the weight read).

    def bound_for(self, params: dict) -> str:
        return params.get("bound", self.bound)

    def test_params(self, on_gpu: bool) -> list[dict]:
        if on_gpu:
            grid = {**self.test_grid, **self.gpu_test_grid}
            return product(grid)
        return pairwise(self.test_grid)


def product(grid: dict[str, list]) -> list[dict]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def pairwise(grid: dict[str, list]) -> list[dict]:
    """A small set of rows covering every pair of values of every two axes (greedy all-pairs).

    Deterministic, so CPU test ids are stable between runs.
    """
    keys = list(grid)
    if len(keys) <= 1:
        return product(grid)
    uncovered = set()
    for (i, a), (j, b) in itertools.combinations(enumerate(keys), 2):
        for va in range(len(grid[a])):
            for vb in range(len(grid[b])):
                uncovered.add((i, va, j, vb))
    rows = []
    all_rows = list(itertools.product(*(range(len(grid[k])) for k in keys)))
    while uncovered:
        best, best_gain = None, -1
        for row in all_rows:
            gain = sum((i, row[i], j, row[j]) in uncovered
                       for i, j in itertools.combinations(range(len(keys)), 2))
            if gain > best_gain:
                best, best_gain = row, gain
        rows.append(best)
        for i, j in itertools.combinations(range(len(keys)), 2):
            uncovered.discard((i, best[i], j, best[j]))
    return [{k: grid[k][v] for k, v in zip(keys, row)} for row in rows]



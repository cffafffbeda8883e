"""Where a host-bound training step's host time goes: one registry training row (default linear_train M512 K4096
N4096 gelu, the row at 0.44x eager in the 2026-12-04c report), timed in pieces side by side in one process.

Each variant prints host us per call (benchmarks' host_us: best of rounds of calls, no synchronization inside a
round) and do_bench's median ms:

- eager: the reference step (F.linear + gelu, autograd.grad);
- eager as a Python autograd.Function: the same torch ops, forward and backward written in Python (what a
  Python-level op costs in the engine before any of tilefuse's layers);
- tilefuse under auto, tilefuse and vendor: the registry's fused step;
- tilefuse kernels only: the forward and backward implementations called directly, no autograd engine;
- tilefuse forward only: the forward with grad on (the slope saved), no backward.

Run on the GPU:  PYTHONPATH=src python3 benchmarks/train_step_host.py [--op linear_train] [--case "M512 "]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

import tilefuse
from tilefuse import registry
from tilefuse.harness.timing import host_us
from tilefuse.ops import linear as linear_op


class _EagerAsFunction(torch.autograd.Function):
    """act(x W^T + b) with gelu, forward and backward as torch ops called from Python."""

    @staticmethod
    def forward(ctx, x, w, b):
        pre = F.linear(x, w, b)
        ctx.save_for_backward(x, w, pre)
        return F.gelu(pre)

    @staticmethod
    def backward(ctx, dy):
        x, w, pre = ctx.saved_tensors
        g = torch.ops.aten.gelu_backward(dy, pre)
        return g @ w, g.t() @ x, g.sum(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="linear_train")
    ap.add_argument("--case", default="M512 ")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (interpreter)")
    args = ap.parse_args()
    spec = registry.get(args.op)
    params = next(p for p in spec.bench_cases if args.case in spec.label(p) + " ")
    inputs = spec.make_inputs(params, torch.device(args.device), 0)
    x, w, b, dy, act = inputs["x"], inputs["weight"], inputs["bias"], inputs["dy"], inputs["activation"]

    def leaves():
        return [t.detach().requires_grad_() for t in (x, w, b)]

    def python_function():
        lx, lw, lb = leaves()
        y = _EagerAsFunction.apply(lx, lw, lb)
        return torch.autograd.grad(y, (lx, lw, lb), dy)

    def with_backend(name):
        def run():
            with tilefuse.use_backend(name):
                return spec.fused(**inputs)
        return run

    def forward_only():
        lx, lw, lb = leaves()
        with torch.enable_grad():
            return linear_op.linear(lx, lw, lb, act)

    variants = {
        "eager": lambda: spec.reference(**inputs),
        "eager as a Python autograd.Function": python_function,
        "tilefuse (auto)": lambda: spec.fused(**inputs),
        "tilefuse (backend tilefuse)": with_backend("tilefuse"),
        "tilefuse (backend vendor)": with_backend("vendor"),
        "tilefuse kernels only (auto)": lambda: spec.extra["kernels_only"](**inputs),
        "tilefuse forward only, grad on (auto)": forward_only,
    }
    print(f"{spec.name} {spec.label(params)}")
    print(f"{'variant':42s} {'host us':>9s} {'ms':>9s}")
    for name, fn in variants.items():
        us = host_us(fn, 100, 10, 30)
        ms = triton.testing.do_bench(fn, return_mode="median")
        print(f"{name:42s} {us:9.1f} {ms:9.4f}")


if __name__ == "__main__":
    main()

"""Where the host time of a settled tilefuse call goes, on the GPU host: cProfile over many calls of one
registry bench case, functions sorted by their own time. The default is linear's decode row M = 1; any op
and case can be named (the first bench case whose label contains CASE). ``*_backward`` ops run only their
backward, as in host_per_op.py.

Run on the GPU:  PYTHONPATH=src python benchmarks/host_profile.py [--op linear] [--case "M1 "] [--calls 5000]
                     [--torch-profiler]
  e.g.           PYTHONPATH=src python benchmarks/host_profile.py --op attention_backward \
                     --case "B16 H16 N1024 d128 causal" --calls 500
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from tilefuse import registry
from tilefuse.harness.timing import host_us


def pick_case(spec, case: str):
    for params in spec.bench_cases:
        if case in spec.label(params) + " ":
            return params
    labels = ", ".join(spec.label(p) for p in spec.bench_cases)
    raise SystemExit(f"no bench case of {spec.name} has {case!r} in its label: {labels}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="linear")
    ap.add_argument("--case", default="M1 ", help="a substring of the case's label (a trailing space is added "
                    "to the label, so 'M1 ' matches '... M1' but not 'M16')")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--torch-profiler", action="store_true",
                    help="also torch.profiler's CPU table over the same number of calls (time inside C++)")
    args = ap.parse_args()
    spec = registry.get(args.op)
    params = pick_case(spec, args.case)
    inputs = spec.make_inputs(params, torch.device("cuda"), 0)
    fn = lambda: spec.fused(**inputs)  # noqa: E731
    grad = torch.enable_grad if spec.name.endswith("_train") else torch.no_grad
    with grad():
        print(f"{spec.name} {spec.label(params)}: host us per call (best of 10 x 100): "
              f"{host_us(fn, 100, 10, 100):.1f}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.rows)
    if args.torch_profiler:
        # What cProfile cannot see: the time inside C++ (the autograd engine's nodes, aten's dispatch, the CUDA
        # launches), per aten op and runtime call, over the same calls.
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with grad(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

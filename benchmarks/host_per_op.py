"""Host cost and do_bench time of one call per registry op: the first bench case of every op, and for
linear also its decode rows (M1, M16, M64, M512). Uses only ``tilefuse.registry.REGISTRY`` and the
OpSpec fields bench_cases, make_inputs, fused and label, so the same script compares two versions of the
package (run it once per tree). ``*_backward`` ops are measured too: their fused callable runs only the
backward.

- host_us: wall microseconds per call with no synchronization inside a round (checks, dispatch, launch):
  the best of 10 rounds of 200 calls after 20 warm-up calls, synchronizing before each round;
- ms: ``triton.testing.do_bench(fn, return_mode="median")``.

Run on the GPU:  PYTHONPATH=<tree>/src python3 benchmarks/host_per_op.py --out FILE.json
``--no-fastpath`` (trees with kernels/fastpath.py): every call takes the launch layer's full path, which
measures what the fast path saves.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from tilefuse.registry import REGISTRY

DECODE = ("M1 ", "M16 ", "M64 ", "M512 ")


def cases(spec):
    """The first bench case, and for linear every later decode row (a trailing space is added to the
    label, so "M16 " matches "... M16" but never "M16384")."""
    picked = spec.bench_cases[:1]
    if spec.name == "linear":
        picked += [p for p in spec.bench_cases[1:] if any(d in spec.label(p) + " " for d in DECODE)]
    return picked


def case_name(spec, params):
    """The label, with the dtype appended when the label does not show it (linear's rows repeat per dtype)."""
    label, dtype = spec.label(params), str(params.get("dtype", "")).replace("torch.", "")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
    return label if not dtype or dtype in label or short in label else f"{label} {short}"


def host_us(fn, calls=200, rounds=10, warmup=20):
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def measure(spec, params):
    inputs = spec.make_inputs(params, torch.device("cuda"), 0)
    fn = lambda: spec.fused(**inputs)  # noqa: E731
    with torch.no_grad():
        return host_us(fn), triton.testing.do_bench(fn, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file: a list of {op, case, host_us, ms}")
    ap.add_argument("--no-fastpath", action="store_true", help="disable the launch layer's replays")
    args = ap.parse_args()
    if args.no_fastpath:
        from tilefuse.kernels import fastpath
        fastpath.signature = lambda tensors, scalars: None  # no key: the full path every call
    rows = []
    for name, spec in REGISTRY.items():
        for params in cases(spec):
            label = case_name(spec, params)
            row = {"op": name, "case": label}
            try:
                row["host_us"], row["ms"] = measure(spec, params)
                print(f"{name:22s} {label:44s} host {row['host_us']:8.1f} us  ms {row['ms']:.4f}", flush=True)
            except Exception as e:  # noqa: BLE001 -- one failing case must not lose the others
                row["host_us"] = row["ms"] = None
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"{name:22s} {label:44s} ERROR {row['error']}", flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:  # rewritten after each case: a run cut short keeps what it had
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

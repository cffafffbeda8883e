"""Forward + backward of the training registry rows, fused against eager autograd, side by side.

A quick stand-in for the report's rows when device time is short: for each bench case of the named
training specs (default linear_train and gated_linear_train) it times ``spec.fused`` (tilefuse forward
with grad, then autograd.grad), ``spec.reference`` (eager PyTorch) and the kernels-only step with
triton.testing.do_bench medians on the same fresh random inputs, checks the fused gradients against
eager within the dtype's bound, and records peak memory of one step of each. Writes JSON.

    python3 benchmarks/train_step.py --out train_step.json [--specs linear_train ...]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--specs", nargs="+", default=["linear_train", "gated_linear_train"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import triton.testing

    from tilefuse import registry
    from tilefuse.harness.stats import error_stats
    from tilefuse.opspec import REL_L2_BOUND

    rows = []
    for name in args.specs:
        spec = registry.get(name)
        for params in spec.bench_cases:
            inputs = spec.make_inputs(params, torch.device("cuda"), seed=0)
            fused = spec.fused(**inputs)  # tunes, compiles
            eager = spec.reference(**inputs)
            err = max(error_stats(f, e).rel_l2 for f, e in zip(fused, eager))
            row = {"op": name, "label": spec.label(params), "rel_l2_vs_eager": err,
                   "within_bound": err <= 2 * REL_L2_BOUND[params["dtype"]]}
            for key, fn in (("fused_ms", spec.fused), ("eager_ms", spec.reference),
                            ("kernels_only_ms", spec.extra["kernels_only"])):
                row[key] = triton.testing.do_bench(lambda: fn(**inputs), warmup=25, rep=200)
            for key, fn in (("fused_peak_bytes", spec.fused), ("eager_peak_bytes", spec.reference)):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn(**inputs)
                torch.cuda.synchronize()
                row[key] = torch.cuda.max_memory_allocated() - base
            row["speedup_vs_eager"] = row["eager_ms"] / row["fused_ms"]
            row["tflops_fused"] = spec.flops(params) / row["fused_ms"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
            del inputs, fused, eager
            torch.cuda.empty_cache()
    for name in args.specs:
        ratios = [r["speedup_vs_eager"] for r in rows if r["op"] == name]
        if ratios:
            print(f"{name}: geomean fused/eager speedup {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

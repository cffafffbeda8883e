"""rel-L2 of each output of a linear_train step (y, dx, dW, db) against float64, twice per case, at
M1024 K768 N3072 for fp16/bf16, three layouts, no activation / GELU, with / without bias: which gradient is
wrong, and whether it changes run to run. ``python3 benchmarks/linear_train_per_output.py [first N cases]``"""
import itertools
import sys

import torch
from tilefuse import registry
from tilefuse.harness.stats import error_stats, to_float64

spec = registry.REGISTRY["linear_train"]
dev = "cuda" if torch.cuda.is_available() else "cpu"
names = ["y", "dx", "dW", "db"]
cases = []
for dtype, layout, act, bias in itertools.product([torch.float16, torch.bfloat16], ["plain", "w_transposed", "3d"],
                                                  [None, "gelu"], [True, False]):
    cases.append(dict(shape=(1024, 768, 3072), dtype=dtype, activation=act, bias=bias, layout=layout))
if len(sys.argv) > 1:
    cases = cases[:int(sys.argv[1])]
for p in cases:
    inputs = spec.make_inputs(p, dev, seed=len(spec.label(p)))
    with torch.no_grad():
        ref = spec.reference(**to_float64(inputs))
        errs = []
        for rep in range(2):
            out = spec.fused(**inputs)
            errs.append(" ".join(f"{n}={error_stats(o, r).rel_l2:.1e}" for n, o, r in zip(names, out, ref)))
    print(p["dtype"], p["layout"], p["activation"], p["bias"], "|", " || ".join(errs), flush=True)

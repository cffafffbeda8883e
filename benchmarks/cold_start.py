"""Cold start of tilefuse.linear (the Hopper issue's target: <= 5 s for a shipped shape).

Each measurement is a fresh Python process with an empty Triton cache and an empty tilefuse user cache,
so the first call must compile, and it finds its config only in the table shipped in the package
(src/tilefuse/configs/<gpu>.json) -- or autotunes if the shape is not there. Times are wall clock from
process start (interpreter start-up included) to the first result on the device.

Run on the GPU:  PYTHONPATH=src python benchmarks/cold_start.py [OUT.json]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from rows import collect

CASES = [  # (registry op, params): the Hopper issue's bf16 rows
    ("linear", dict(shape=(8192, 4096, 16384), activation="gelu")),
    ("linear", dict(shape=(512, 4096, 4096), activation="gelu")),
    ("linear", dict(shape=(16, 4096, 4096), activation="gelu")),
    ("gated_linear", dict(shape=(2048, 4096, 11008), activation="swiglu", weight_form="concat")),
]

CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
import torch
from tilefuse import registry, tuning
op, params = json.loads(sys.argv[2])
params = dict(params, shape=tuple(params["shape"]), dtype=torch.bfloat16, bias=True)
spec = registry.get(op)
inputs = spec.make_inputs(params, torch.device("cuda"), 0)
t_ready = time.time()
spec.fused(**inputs)
torch.cuda.synchronize()
t_first = time.time()
spec.fused(**inputs)
torch.cuda.synchronize()
t_second = time.time()
sources = sorted({r.get("source", "?") for r in tuning.tuning_records()})
print(json.dumps(dict(process_to_first_result_s=t_first - t0, first_call_s=t_first - t_ready,
                      second_call_s=t_second - t_first, config_sources=sources)))
"""


def measure(case) -> dict:
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as user_cache:
        env = dict(os.environ, TRITON_CACHE_DIR=triton_cache, TILEFUSE_CACHE_DIR=user_cache)
        env.pop("TILEFUSE_AUTOTUNE", None)
        t0 = time.time()
        out = subprocess.run([sys.executable, "-c", CHILD, repr(t0), json.dumps(case)], env=env,
                             capture_output=True, text=True)
    if out.returncode:
        return {"case": case, "error": out.stderr[-2000:]}
    return {"case": case, **json.loads(out.stdout.strip().splitlines()[-1])}


def main(out=None):
    collect((measure(case) for case in CASES), out)


if __name__ == "__main__":
    main(*sys.argv[1:])

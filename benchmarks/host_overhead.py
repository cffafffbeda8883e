"""Where the time of a small tilefuse.linear call goes: host (Python + launch) or device.

do_bench times back-to-back calls with CUDA events, so a call whose host work takes longer than its
kernels measures the host, not the GPU. For each shape this prints:
- host_us: wall time per call with no synchronization (the CPU cost of one call: checks, dispatch,
  autotuner lookup, Triton's launcher), the best of 10 rounds of 200 calls after warm-up;
- device_us: the same call captured in a CUDA graph and replayed after the L2 flush do_bench does
  (launch cost gone: the kernels alone; the report's GPU-only column);
- do_bench_us: what the report measures;
- the same three numbers for eager F.linear + F.gelu (the registry's reference), the anchor.
If host_us > device_us, the report's number for that shape is the host's.

Run on the GPU:  PYTHONPATH=src python benchmarks/host_overhead.py [OUT.json]
"""
from __future__ import annotations

import sys

import torch

from tilefuse import registry
from tilefuse.harness.timing import bench_ms, graph_ms, host_us
from tilefuse.kernels import launches
from rows import collect

SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096), (512, 4096, 4096)]


def measure(M, K, N) -> dict:
    spec = registry.get("linear")  # the report's inputs, fused call and eager reference
    inputs = spec.make_inputs(dict(shape=(M, K, N), dtype=torch.bfloat16, activation="gelu", bias=True),
                              torch.device("cuda"), 0)
    fused = lambda: spec.fused(**inputs)  # noqa: E731
    eager = lambda: spec.reference(**inputs)  # noqa: E731
    row = {"shape": [M, K, N]}
    for name, fn in (("tilefuse", fused), ("eager", eager)):
        fn()
        device_ms = graph_ms(fn)
        row[name] = {"host_us": host_us(fn, calls=200, rounds=10, warmup=50),
                     "device_us": device_ms * 1e3 if isinstance(device_ms, float) else device_ms,
                     "do_bench_us": bench_ms(fn) * 1e3}
    with launches.recording() as records:  # what the settled call ran (the launch layer's own record)
        fused()
    rec = records[-1] if records else None
    row["tilefuse_path"] = (dict(config=rec.config, path=rec.path, kernel=rec.kernel, replayed=rec.replayed)
                            if rec else None)
    return row


def main(out=None):
    collect((measure(*shape) for shape in SHAPES), out)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Where the time of a small tilefuse.linear call goes: host (Python + launch) or device.

do_bench times back-to-back calls with CUDA events, so a call whose host work takes longer than its
kernels measures the host, not the GPU. For each shape this prints:
- host_us: wall time per call with no synchronization (the CPU cost of one call: checks, dispatch,
  autotuner lookup, Triton's launcher), averaged over many calls after warm-up;
- device_us: the same call captured in a CUDA graph and replayed (launch cost gone: the kernels alone);
- do_bench_us: what the report measures;
- the same three numbers for eager F.linear + F.gelu (the registry's reference), the anchor.
If host_us > device_us, the report's number for that shape is the host's.

Run on the GPU:  PYTHONPATH=src python benchmarks/host_overhead.py [OUT.json]
"""
from __future__ import annotations

import sys
import time

import torch
import triton.testing

import tilefuse.ops.linear as linear_op
from tilefuse import registry
from rows import collect

SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096), (512, 4096, 4096)]


def host_us(fn, calls=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def graph_us(fn, replays=200) -> float | str:
    try:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (replays * 10)
    except Exception as exc:  # noqa: BLE001 - reported, e.g. a launch that allocates during capture
        return f"failed: {type(exc).__name__}: {str(exc)[:120]}"


def measure(M, K, N) -> dict:
    spec = registry.get("linear")  # the report's inputs, fused call and eager reference
    inputs = spec.make_inputs(dict(shape=(M, K, N), dtype=torch.bfloat16, activation="gelu", bias=True),
                              torch.device("cuda"), 0)
    fused = lambda: spec.fused(**inputs)  # noqa: E731
    eager = lambda: spec.reference(**inputs)  # noqa: E731
    row = {"shape": [M, K, N]}
    for name, fn in (("tilefuse", fused), ("eager", eager)):
        fn()
        row[name] = {"host_us": host_us(fn), "device_us": graph_us(fn),
                     "do_bench_us": triton.testing.do_bench(fn, return_mode="median") * 1e3}
    row["tilefuse_path"] = dict(linear_op.last_config)
    row["tilefuse_path"]["config"] = str(row["tilefuse_path"]["config"])
    return row


def main(out=None):
    collect((measure(*shape) for shape in SHAPES), out)


if __name__ == "__main__":
    main(*sys.argv[1:])

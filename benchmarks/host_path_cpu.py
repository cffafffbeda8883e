"""Host cost of each op's compiled-path dispatch, measured on a CPU with the kernel launches stubbed
(tests/tools/host_path.py): microseconds per call (best of 30 rounds of 100 calls) and Python function calls per
call (deterministic, so a change shows even on a noisy shared CPU). Triton's own launcher is not in
these numbers; benchmarks/host_overhead.py measures the whole call on the GPU.

Run anywhere:  TILEFUSE_AUTOTUNE=0 PYTHONPATH=src python benchmarks/host_path_cpu.py [OUT.json] [OP ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tools: the stubbed launch path

from rows import collect  # noqa: E402
from tilefuse import registry  # noqa: E402
from tilefuse.harness.timing import host_us  # noqa: E402
from tools.host_path import stubbed_launches  # noqa: E402

# One small case per op: the host path does not depend on the size (CPU allocations of bench-size
# tensors would add malloc time the GPU's caching allocator does not have).
SMALL_SHAPES = {
    "linear": [(512, 1024, 1024), (16, 4096, 4096)],  # the TMA path; the decode kernel
    "gated_linear": [(512, 1024, 1024)],
    "layer_norm": [(64, 4096)], "rms_norm": [(64, 4096)],
    "layer_norm_backward": [(64, 4096)], "rms_norm_backward": [(64, 4096)],
    "softmax": [(64, 4096)], "softmax_backward": [(64, 4096)],
    "layer_norm_linear": [(256, 1024, 1024)],
    "attention": [(1, 4, 4, 128, 128)],
    "sdpa": [(1, 2, 2, 128, 128, 64)],
    "linear_train": [(512, 1024, 1024)],  # forward + backward through autograd
    # GPT-2-medium's attention input (plain), Llama's (RoPE over d, GQA): a case's other params as a dict
    "qkv_projection": [(1, 128, 1024, 16, 16, 64), dict(shape=(1, 128, 1024, 8, 2, 128), rotary=128)],
}


def python_calls(fn) -> int:
    """Python-level function calls made by one call of ``fn`` (builtins not counted)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # fn itself


def measure(op: str, case) -> dict:
    spec = registry.get(op)
    params = dict(spec.bench_cases[0], **(case if isinstance(case, dict) else dict(shape=case)))
    shape = params["shape"]
    inputs = spec.make_inputs(params, torch.device("cpu"), 0)
    with stubbed_launches() as launches:
        fn = lambda: spec.fused(**inputs)  # noqa: E731
        fn()
        kernels = [launch.kernel for launch in launches]
        return {"op": op, "shape": list(shape), **({"rotary": params["rotary"]} if params.get("rotary") else {}),
                "kernels": kernels, "host_us": round(host_us(fn, calls=100, rounds=30, warmup=20), 1),
                "python_calls": python_calls(fn)}


def main(argv):
    out = argv[0] if argv and argv[0].endswith(".json") else None
    ops = [a for a in argv if not a.endswith(".json")] or list(SMALL_SHAPES)
    collect((measure(op, shape) for op in ops for shape in SMALL_SHAPES[op]), out)


if __name__ == "__main__":
    main(sys.argv[1:])

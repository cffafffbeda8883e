"""Where the host time of a settled tilefuse.linear call goes, on the GPU host: cProfile over many calls of
one registry input (the decode row M = 1 by default), functions sorted by their own time.

Run on the GPU:  PYTHONPATH=src python benchmarks/host_profile.py [M] [calls]
"""
from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from tilefuse import registry
from tilefuse.harness.timing import host_us


def main(M: int = 1, calls: int = 5000) -> None:
    spec = registry.get("linear")
    inputs = spec.make_inputs(dict(shape=(M, 4096, 4096), dtype=torch.bfloat16, activation="gelu", bias=True),
                              torch.device("cuda"), 0)
    with torch.no_grad():
        print(f"host us per call (best of 10 x 200): {host_us(lambda: spec.fused(**inputs), 200, 10, 200):.1f}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            spec.fused(**inputs)
        profile.disable()
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])

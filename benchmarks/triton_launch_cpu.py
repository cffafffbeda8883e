"""Python cost of Triton's own launch path (JITFunction.run) for a kernel already compiled, on any machine.

The host time of a tilefuse call is our dispatch (benchmarks/host_path_cpu.py) plus Triton's: binding the
arguments, specializing them (alignment, ints equal to 1 or divisible by 16), the kernel-cache key, launch
metadata, then the C launcher. Without a GPU the driver is replaced by a stand-in for an sm_90 device, and
the kernel cache is filled with a stub whose launcher does nothing; so this is everything but the C
launcher and the driver call. Microseconds per call, best of 5 rounds of 2000 calls.

Run anywhere:  PYTHONPATH=src python benchmarks/triton_launch_cpu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.runtime.driver import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tools: the stand-in driver

from tilefuse.harness.timing import host_us  # noqa: E402
from tools.host_path import StandInDriver  # noqa: E402


class _CompiledStub:
    function = None
    packed_metadata = None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        pass


def launch_cost_us(jit_fn, args: tuple, kwargs: dict, grid: tuple, calls: int = 2000, rounds: int = 5) -> float:
    """Microseconds per ``jit_fn[grid](*args, **kwargs)`` once its kernel is in the cache."""
    def compile_stub(key, *unused, **unused_kw):
        stub = _CompiledStub()
        jit_fn.device_caches[0][0][key] = stub  # as _do_compile caches a real kernel
        return stub

    jit_fn._do_compile = compile_stub

    def launch():
        jit_fn.run(*args, grid=grid, warmup=False, **kwargs)

    launch()
    return host_us(launch, calls=calls, rounds=rounds)

def main() -> None:
    driver.set_active(StandInDriver())
    from tilefuse.kernels.gemm.portable import linear_epilogue_kernel

    # The decode GEMM of the report (M = 16, K = N = 4096, bf16, GELU, split-K 4): 23 runtime arguments.
    M, N, K = 16, 4096, 4096
    x = torch.empty(M, K, dtype=torch.bfloat16)
    w = torch.empty(N, K, dtype=torch.bfloat16)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    ws, counters = torch.empty(4, M, N), torch.zeros(1024, dtype=torch.int32)
    args = (x, w, y, y, w, y, ws, counters, M, N, K, 16, 1024, M, 0, K, 1, K, 1, K, 1, N, 1)
    kwargs = dict(HAS_BIAS=True, ACTIVATION="gelu", GATED=False, INPUT_PRECISION="tf32", SPLIT_K=4,
                  UPCAST_DOT=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    us = launch_cost_us(linear_epilogue_kernel, args, kwargs, (256, 4))
    print(f"linear_epilogue_kernel (split-K decode, {len(args)} runtime args): JITFunction.run {us:.1f} us per call")


if __name__ == "__main__":
    main()

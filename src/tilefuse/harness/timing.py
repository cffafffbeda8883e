"""GPU timing: triton.testing.do_bench medians after warm-up. On a CPU nothing is timed."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


def bench_ms(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> float | None:
    """Median milliseconds of ``fn()`` on the GPU, or None on a CPU (interpreter times mean nothing)."""
    if not torch.cuda.is_available():
        return None
    import triton.testing

    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(fn, reps: int = 50) -> float | str | None:
    """Median milliseconds of the GPU work of one ``fn()`` with the host taken out: the call is captured
    once in a CUDA graph and replayed, the L2 cache cleared before each replay as do_bench does. Beside
    do_bench's number it tells a kernel's time from its launch path's. A call that cannot be captured
    gives the reason as text."""
    if not torch.cuda.is_available():
        return None
    import triton

    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        driver = triton.runtime.driver.active
        cache = driver.get_empty_cache_for_benchmark()
        times = []
        for _ in range(reps):
            driver.clear_cache(cache)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in times)
        del graph
        return ms[len(ms) // 2]
    except Exception as exc:  # noqa: BLE001 - reported in the row, never hidden
        torch.cuda.synchronize()
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def host_us(fn, calls: int = 20, rounds: int = 3, warmup: int = 0) -> float:
    """Microseconds of CPU time one call of ``fn`` takes to issue its work (checks, dispatch, launch):
    the best of ``rounds`` rounds of ``calls`` calls (a shared CPU's noise only ever adds time), with no
    synchronization inside a round. When this exceeds the kernel time, do_bench measures the host, not
    the GPU: the report shows both so that such rows are visible. Also times the stubbed launch path
    on a CPU (tests/tools/host_path.py)."""
    on_gpu = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    if on_gpu:
        torch.cuda.synchronize()
    return best


def measure_ceilings() -> dict:
    """The run's own ceilings: device-to-device copy, read-only sum, bf16/fp16/fp32 GEMM throughput and, on GPUs
    with FP8 tensor cores, the e4m3 GEMM's (``torch._scaled_mm``).

    Measured at the start of every GPU report so every % is against this machine, this run.
    """
    if not torch.cuda.is_available():
        return {}
    n = 1 << 29  # 1 GiB of bf16: far larger than the 60 MB L2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    read_ms = bench_ms(lambda: src.sum(dtype=torch.float32))
    del dst
    ceilings = {
        "copy_TBps": 2 * src.numel() * 2 / (copy_ms * 1e-3) / 1e12,
        "read_TBps": src.numel() * 2 / (read_ms * 1e-3) / 1e12,
    }
    del src
    for dtype, key in ((torch.bfloat16, "gemm_bf16_TFLOPs"), (torch.float16, "gemm_fp16_TFLOPs"),
                       (torch.float32, "gemm_fp32_TFLOPs")):
        a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        ms = bench_ms(lambda: a @ b)
        ceilings[key] = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    if torch.cuda.get_device_capability() >= (8, 9):  # FP8 tensor cores: cuBLASLt's e4m3 GEMM, per-tensor scales
        a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        ms = bench_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        ceilings["gemm_fp8_TFLOPs"] = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return ceilings


@contextmanager
def compile_clock():
    """Yields ``{"kernels": n, "seconds": s, "slowest": [[kernel, seconds], ...]}``, filled while inside with
    every kernel specialization triton builds in this process (through its JIT hooks, the ones set before
    chained): a load from triton's disk cache takes milliseconds, a compile seconds, so a row whose first call
    is slow tells which it met. Launches of the Triton interpreter build nothing and count nothing."""
    from triton import knobs

    clock = {"kernels": 0, "seconds": 0.0, "slowest": []}
    started: dict = {}
    before_miss, before_done = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

    def on_miss(**kwargs):
        started[kwargs["repr"]] = time.perf_counter()
        return before_miss(**kwargs) if before_miss else None

    def on_done(**kwargs):
        t0 = started.pop(kwargs["repr"], None)
        if t0 is not None:
            seconds = time.perf_counter() - t0
            clock["kernels"] += 1
            clock["seconds"] = round(clock["seconds"] + seconds, 2)
            name = kwargs["repr"].split("[", 1)[0]
            clock["slowest"] = sorted(clock["slowest"] + [[name, round(seconds, 2)]], key=lambda r: -r[1])[:3]
        return before_done(**kwargs) if before_done else None

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = on_miss, on_done
    try:
        yield clock
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before_miss, before_done

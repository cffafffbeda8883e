"""Long-row norms: the split-row kernel (kernels/norm_split_row.py) against what tilefuse dispatches now.

For each shape and norm: tilefuse.layer_norm / rms_norm as dispatched (the chunked kernel, tuned), then
every split-row variant (programs per row x warps x programs per SM). Each row gives do_bench's median
ms, the CUDA-graph (GPU-only) ms, the fraction of the copy ceiling measured in this run (a 1 GiB
device-to-device copy, as the report's), and rel-L2 against a float64 reference, so a fast variant that
is wrong shows as wrong. A variant that fails to launch (a cooperative grid too large) is reported, not
skipped. The bytes are one read and one write of the rows (+ the residual read and h write).

Run on the GPU:  PYTHONPATH=src:benchmarks python benchmarks/norm_split_row.py [OUT.json]
"""
from __future__ import annotations

import itertools
import sys

import torch

import tilefuse
from tilefuse.harness.stats import error_stats
from tilefuse.harness.timing import bench_ms, graph_ms
from tilefuse.kernels.norm_split_row import launch_norm_fwd_split
from tilefuse.reference import norms as reference
from rows import collect

SHAPES = [(2048, 131072), (64, 1048576)]  # the row-wise issue's long shape; its one-million row (x64)
VARIANTS = [dict(splits=s, num_warps=w, programs_per_sm=p, prefetch=f)
            for s, w, p, f in itertools.product((8, 16, 64), (8, 16), (1, 2), (False, True))]


def copy_ceiling_tbps() -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12


def rows(copy_tbps: float):
    for (M, N), is_rms in itertools.product(SHAPES, (False, True)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(M, N, device="cuda", generator=g) * 2 + 3).to(torch.bfloat16)
        w = (torch.randn(N, device="cuda", generator=g) * 0.5 + 1).to(torch.bfloat16)
        b = None if is_rms else torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
        eps = 1e-6 if is_rms else 1e-5
        if is_rms:
            ref = reference.rms_norm(x.double(), (N,), w.double(), eps)
            dispatched = lambda: tilefuse.rms_norm(x, (N,), w, eps)  # noqa: E731
        else:
            ref = reference.layer_norm(x.double(), (N,), w.double(), b.double(), eps)
            dispatched = lambda: tilefuse.layer_norm(x, (N,), w, b, eps)  # noqa: E731
        gbytes = 2 * M * N * 2 / 1e9
        base = {"shape": [M, N], "norm": "rms" if is_rms else "layer", "GB": gbytes}

        def measure(name, fn, out):
            ms = bench_ms(fn)
            gpu = graph_ms(fn)
            return {**base, "variant": name, "ms": ms, "gpu_only_ms": gpu,
                    "pct_copy": 100 * gbytes / (ms * 1e-3) / 1e3 / copy_tbps,
                    "rel_l2": error_stats(out(), ref).rel_l2}

        yield measure("dispatched (chunked, tuned)", dispatched, dispatched)
        y = torch.empty_like(x)
        mean = torch.empty(M, device="cuda")
        rstd = torch.empty(M, device="cuda")
        for v in VARIANTS:
            if (N + v["splits"] - 1) // v["splits"] * (2 if v["prefetch"] else 1) > 64 * 32 * v["num_warps"]:
                continue  # over 64 elements a thread (two chunks with prefetch): past the registers

            def split_row(v=v):
                launch_norm_fwd_split(x, None, w, b, y, None, mean, rstd, eps, is_rms, **v)
                return y

            try:
                name = (f"split {v['splits']} w{v['num_warps']} {v['programs_per_sm']}/SM"
                        f"{' prefetch' if v['prefetch'] else ''}")
                yield measure(name, split_row, split_row)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot launch is a result too
                yield {**base, "variant": str(v), "failed": f"{type(exc).__name__}: {str(exc)[:200]}"}


def main(out=None):
    copy_tbps = copy_ceiling_tbps()
    print(f"copy ceiling {copy_tbps:.2f} TB/s", flush=True)
    collect(rows(copy_tbps), out)


if __name__ == "__main__":
    main(*sys.argv[1:])

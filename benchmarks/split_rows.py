"""Long rows: the split-row kernels (kernels/norm_split_row.py, softmax_split_row.py) against what
tilefuse dispatches now.

For each shape and op (layer_norm, rms_norm, softmax): the op as dispatched (the chunked / looped
kernels, tuned), then every split-row variant (programs per row x warps x programs per SM x prefetch).
Each row gives do_bench's median ms, the CUDA-graph (GPU-only) ms, the fraction of the copy ceiling
measured in this run (a 1 GiB device-to-device copy, as the report's), and rel-L2 against a float64
reference, so a fast variant that is wrong shows as wrong. A variant that fails to launch (a cooperative
grid too large) is reported, not skipped. The bytes are one read and one write of the rows.

Run on the GPU:  PYTHONPATH=src:benchmarks python benchmarks/split_rows.py [OUT.json]
"""
from __future__ import annotations

import itertools
import sys

import torch

import tilefuse
from tilefuse.harness.stats import error_stats
from tilefuse.harness.timing import bench_ms, graph_ms
from tilefuse.kernels.norm_split_row import launch_norm_fwd_split
from tilefuse.kernels.softmax_split_row import launch_softmax_fwd_split
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


def _cases():
    """(shape, op name, the dispatched call, the split-row call given a variant, float64 reference)."""
    for (M, N), op in itertools.product(SHAPES, ("layer", "rms", "softmax")):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(M, N, device="cuda", generator=g) * 2 + 3).to(torch.bfloat16)
        y = torch.empty_like(x)
        if op == "softmax":
            yield ((M, N), op, lambda: tilefuse.softmax(x, -1),
                   lambda v: (launch_softmax_fwd_split(x, y, **v), y)[1], torch.softmax(x.double(), -1))
            continue
        is_rms = op == "rms"
        w = (torch.randn(N, device="cuda", generator=g) * 0.5 + 1).to(torch.bfloat16)
        b = None if is_rms else torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
        eps = 1e-6 if is_rms else 1e-5
        mean, rstd = torch.empty(M, device="cuda"), torch.empty(M, device="cuda")
        if is_rms:
            dispatched = lambda x=x, w=w, eps=eps: tilefuse.rms_norm(x, (x.shape[1],), w, eps)  # noqa: E731
            ref = reference.rms_norm(x.double(), (N,), w.double(), eps)
        else:
            dispatched = lambda x=x, w=w, b=b: tilefuse.layer_norm(x, (x.shape[1],), w, b, 1e-5)  # noqa: E731
            ref = reference.layer_norm(x.double(), (N,), w.double(), b.double(), eps)

        def split_row(v, x=x, w=w, b=b, y=y, mean=mean, rstd=rstd, eps=eps, is_rms=is_rms):
            launch_norm_fwd_split(x, None, w, b, y, None, mean, rstd, eps, is_rms, **v)
            return y

        yield (M, N), op, dispatched, split_row, ref


def rows(copy_tbps: float):
    for (M, N), op, dispatched, split_row, ref in _cases():
        gbytes = 2 * M * N * 2 / 1e9
        base = {"shape": [M, N], "op": op, "GB": gbytes}

        def measure(name, fn):
            ms = bench_ms(fn)
            gpu = graph_ms(fn)
            return {**base, "variant": name, "ms": ms, "gpu_only_ms": gpu,
                    "pct_copy": 100 * gbytes / (ms * 1e-3) / 1e3 / copy_tbps,
                    "rel_l2": error_stats(fn(), ref).rel_l2}

        yield measure("dispatched (tuned)", dispatched)
        for v in VARIANTS:
            if (N + v["splits"] - 1) // v["splits"] * (2 if v["prefetch"] else 1) > 64 * 32 * v["num_warps"]:
                continue  # over 64 elements a thread (two chunks with prefetch): past the registers
            if (N + v["splits"] - 1) // v["splits"] < 8192:
                continue  # chunks under 8K elements: a handshake per 16 KB, not worth the minutes
            name = (f"split {v['splits']} w{v['num_warps']} {v['programs_per_sm']}/SM"
                    f"{' prefetch' if v['prefetch'] else ''}")
            try:
                yield measure(name, lambda v=v: split_row(v))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot launch is a result too
                yield {**base, "variant": name, "failed": f"{type(exc).__name__}: {str(exc)[:200]}"}


def main(out=None):
    copy_tbps = copy_ceiling_tbps()
    print(f"copy ceiling {copy_tbps:.2f} TB/s", flush=True)
    collect(rows(copy_tbps), out)


if __name__ == "__main__":
    main(*sys.argv[1:])

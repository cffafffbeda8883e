"""Study of the GEMM-engine issue's decode shapes (M <= 64): the decode kernel (src/tilefuse/kernels/gemm/decode.py,
which the launch takes where it measured faster than split-K) at every config of a sweep, beside the shipped path.

The shipped small-M path before it (the portable kernel with K split over programs, reduced through an fp32
workspace in the same launch) read the weight at 1.3-1.9 TB/s (NOTES); decode.py says how this one differs.

    PYTHONPATH=src python benchmarks/decode_gemv.py bench   # H200: every config beside tilefuse.linear (and its
                                                            # split-K path), eager and cuBLASLt, weights cold,
                                                            # as CUDA-graph replays
"""
from __future__ import annotations

import itertools
import json
import sys

import torch

from tilefuse.kernels import switches
from tilefuse.kernels.gemm.decode import block_m, decode_linear_kernel
from tilefuse.sizes import cdiv


# (BLOCK_N, BLOCK_K, num_warps, num_stages): narrow column slabs for enough programs, long K tiles for bytes in
# flight (BLOCK_N * BLOCK_K * 2 bytes per stage: 16 KB at 32 x 256).
CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4, 6))
           if bn * bk * 2 * s <= 160 * 1024]


def linear(x, w, b, activation, config):
    """act(x @ w^T + b) at one ``config`` of the sweep, for x [M, K] (M <= 64, unit inner stride), w [N, K]."""
    M, K = x.shape
    N = w.shape[0]
    if M > 64 or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"decode_gemv.linear takes M <= 64 and unit inner strides, got x {tuple(x.shape)} "
                         f"{x.stride()}, w {w.stride()}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    decode_linear_kernel[(cdiv(N, config["BLOCK_N"]),)](
        x, w, b if b is not None else y, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=b is not None, ACTIVATION=activation or "none", BLOCK_M=block_m(M), **config)
    return y


def _split_k_ms(fn):
    """``fn``'s GPU time with the launch's decode kernel switched off (the split-K path it replaced)."""
    from tilefuse.harness.timing import graph_ms

    with switches.overridden(switches.gemm, DECODE_KERNEL=False):
        return graph_ms(fn)


def bench():
    """Decode Linear + bias + GELU at M 1 / 16 / 64, K = N = 4096, bf16: each config's GPU time as a CUDA-graph
    replay after an L2 flush (weights cold: tilefuse.harness.timing.graph_ms), beside tilefuse.linear (the
    shipped split-K path), eager (F.linear + GELU) and cuBLASLt's GELU epilogue, and the fraction of the run's
    read ceiling (a read-only pass over 1 GiB) the weight's bytes reach."""
    import torch.nn.functional as F

    import tilefuse
    from tilefuse.harness.timing import graph_ms, measure_ceilings

    read_tbps = measure_ceilings().get("read_TBps")
    # The same replay timing of a bare read of one weight's bytes (a sum over a 4096 x 4096 bf16 buffer): the
    # floor at this size, where one wave's ramp and drain weigh against the 1 GiB ceiling's steady rate.
    weight_sized = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    bare_read_ms = graph_ms(lambda: weight_sized.sum(dtype=torch.float32))
    for M in (1, 16, 64):
        g = torch.Generator(device="cuda").manual_seed(M)
        K = N = 4096
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
        want = F.gelu(x.double() @ w.double().t() + b.double())
        weight_bytes = w.numel() * 2 + x.numel() * 2 + M * N * 2
        row = {"M": M, "K": K, "N": N, "read_ceiling_TBps": read_tbps, "bytes": weight_bytes,
               "bare_read_of_weight_ms": bare_read_ms,
               "tilefuse_ms": graph_ms(lambda: tilefuse.linear(x, w, b, activation="gelu")),
               "tilefuse_split_k_ms": _split_k_ms(lambda: tilefuse.linear(x, w, b, activation="gelu")),
               "eager_ms": graph_ms(lambda: F.gelu(F.linear(x, w, b))),
               "cublaslt_gelu_ms": graph_ms(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))}
        best = None
        for cfg in CONFIGS:
            name = "n{BLOCK_N}_k{BLOCK_K}_w{num_warps}_s{num_stages}".format(**cfg)
            try:
                y = linear(x, w, b, "gelu", cfg)
                rel = ((y.double() - want).norm() / want.norm()).item()
                ms = graph_ms(lambda: linear(x, w, b, "gelu", cfg))
            except Exception as e:  # a config that fails to compile or launch is reported, the rest still run
                row[name] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            row[name] = {"ms": ms, "rel_l2": rel}
            if isinstance(ms, float) and (best is None or ms < row[best]["ms"]):
                best = name
        if best is not None:
            ms = row[best]["ms"]
            row["best"] = best
            row["best_TBps"] = weight_bytes / (ms * 1e-3) / 1e12
            row["best_fraction_of_read_ceiling"] = row["best_TBps"] / read_tbps if read_tbps else None
            row["best_vs_eager"] = row["eager_ms"] / ms if isinstance(row["eager_ms"], float) else None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"bench": bench}[sys.argv[1] if len(sys.argv) > 1 else "bench"]()

"""Side-by-side timing of GEMM+GELU kernel variants on the GPU (issue: Hopper GEMM epilogues).

For each shape: cuBLAS linear alone, eager linear+gelu, cuBLASLt's GELU epilogue, the portable
autotuned kernel, every pinned TMA config (with and without tl's warp_specialize, a no-op on sm_90), and
the cooperative warp-specialized Gluon kernel (kernels/gemm/coop.py, which the launch takes for the gated forward
and the backward, not this plain forward) at each of its forward configs. For each compiled
TMA variant it records registers, spills and whether the PTX uses wgmma. Prints a table and writes
JSON to the path given (default gemm_variants.json).
Run on the GPU:  PYTHONPATH=src python3 benchmarks/gemm_variants.py OUT.json [bf16|fp16]
"""
import json
import sys

import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.harness.timing import bench_ms
from tilefuse.kernels import launches
from tilefuse.kernels.gemm import coop
from tilefuse.kernels.gemm.configs import TMA_GEMM_CONFIGS
from tilefuse.kernels.gemm.launch.forward import launch_tma
from tilefuse.kernels.gemm.tma import linear_tma_kernel
from tilefuse.opspecs.linear import BENCH_SHAPES

SMALL_M = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096)]


def _time_variant(row, name, ref, out_shape, dtype, launch):
    """Runs ``launch(y)`` into a NaN-filled output, records its rel-L2 against ``ref`` and its time; a variant
    that fails to compile or launch is recorded as failed, not fatal."""
    try:
        y = torch.full(out_shape, float("nan"), device="cuda", dtype=dtype)
        launch(y)
        torch.cuda.synchronize()
        row["rel_l2"][name] = ((y.float() - ref).norm() / ref.norm()).item()
        row["ms"][name] = bench_ms(lambda: launch(y))
    except Exception as exc:  # noqa: BLE001 - recorded per variant
        row["ms"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"


def main(out_path="gemm_variants.json", dtype_name="bf16"):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    rows = []
    variants = [dict(c, ws=ws) for c in TMA_GEMM_CONFIGS for ws in (False, True)]
    variants += [dict(TMA_GEMM_CONFIGS[0], subtile=False)]
    for M, K, N in BENCH_SHAPES + SMALL_M:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=dtype, generator=g) / K ** 0.5
        b = torch.randn(N, device="cuda", dtype=dtype, generator=g)
        ref = F.gelu(F.linear(x.float(), w.float(), b.float()))
        flops = 2 * M * N * K
        row = {"shape": [M, K, N], "dtype": dtype_name, "ms": {}, "rel_l2": {}, "compile": {}}
        row["ms"]["cublas linear only"] = bench_ms(lambda: F.linear(x, w, b))
        row["ms"]["eager linear+gelu"] = bench_ms(lambda: F.gelu(F.linear(x, w, b)))
        row["ms"]["cublaslt epilogue"] = bench_ms(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
        with launches.recording() as records:
            y = tilefuse.linear(x, w, b, "gelu")
        row["ms"]["tilefuse.linear (dispatch)"] = bench_ms(lambda: tilefuse.linear(x, w, b, "gelu"))
        row["rel_l2"]["tilefuse.linear (dispatch)"] = ((y.float() - ref).norm() / ref.norm()).item()
        row["dispatch_config"] = f"{records[-1].config} {records[-1].kernel}" if records else "not recorded"
        for v in variants:
            _time_variant(row, "tma " + "_".join(f"{k}{val}" for k, val in v.items()), ref, (M, N), dtype,
                          lambda y, v=v: launch_tma(x, w, b, y, "gelu", config=v))
        # The cooperative Gluon kernel: a TMA producer warp, two consumer warpgroups per 128-row tile.
        for c in coop.CONFIGS:
            _time_variant(row, "gluon coop " + c, ref, (M, N), dtype,
                          lambda y, c=c: coop.launch(x, None, w, y, b_kmajor=True, bias=b, activation="gelu",
                                                     config=c))
        rows.append(row)
        ws_rows = {k: v for k, v in row["ms"].items() if k.startswith("gluon")}
        print("   gluon coop: " + ", ".join(f"{k} {v:.4f} ms" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in ws_rows.items()), flush=True)
        best = min((v, k) for k, v in row["ms"].items() if isinstance(v, float) and k.startswith("tma"))
        print(f"M{M} K{K} N{N} {dtype_name}: cublas {row['ms']['cublas linear only']:.4f} "
              f"lt-epi {row['ms']['cublaslt epilogue']:.4f} eager {row['ms']['eager linear+gelu']:.4f} "
              f"dispatch {row['ms']['tilefuse.linear (dispatch)']:.4f} best-tma {best[0]:.4f} ({best[1]}) "
              f"= {flops / best[0] / 1e9:.0f} TFLOP/s", flush=True)
    # Compiler facts per compiled TMA variant: registers, spills, wgmma in the PTX.
    facts = []
    try:
        for cache in linear_tma_kernel.device_caches.values():
            for key, compiled in cache[0].items():
                ptx = compiled.asm.get("ptx", "")
                facts.append({"key": str(key)[:300], "n_regs": compiled.n_regs, "n_spills": compiled.n_spills,
                              "wgmma": "wgmma" in ptx, "shared": compiled.metadata.shared})
    except Exception as exc:  # noqa: BLE001 - triton internals differ between versions; say so
        facts.append({"error": f"could not read compiled kernels: {exc!r}"})
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "compiled": facts}, f, indent=1)
    for fct in facts:
        print("compiled:", fct["n_regs"], "regs", fct["n_spills"], "spills wgmma", fct["wgmma"], "smem", fct["shared"])


if __name__ == "__main__":
    main(*sys.argv[1:])

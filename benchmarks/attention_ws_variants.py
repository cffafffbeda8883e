"""Side-by-side timing of the warp-specialized attention kernel's variants (issue: FlashAttention forward).

For each bench shape of the attention registry entry (bf16, d = 64 / 128, full and causal, plus the
Llama-7B prefill rows): cuDNN SDPA, the FA2 backend, tilefuse's portable Triton kernel (autotuned) and the
Gluon kernel in each variant of VARIANTS, with the CPU time to issue one call. Every variant's output is checked
against cuDNN's (rel-L2, fp32) before it is timed, so a race shows up as an error, not as a speed.
Prints one line per measurement and writes JSON.
Run on the GPU:  PYTHONPATH=src python3 benchmarks/attention_ws_variants.py OUT.json [--quick]
"""
import json
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tilefuse.harness.stats import error_stats
from tilefuse.harness.timing import bench_ms, host_us
from tilefuse.kernels.attention.launch import LOG2E, _launch, _launch_ws
from tilefuse.registry import REGISTRY

# Session 6, call 3 compared PINGPONG, STAGES and BLOCK_N (ws_variants_s6.log), call 6 host against device
# descriptors (ws_variants_s6c6.log). Each head dim's default (DEVICE_DESC then chosen per launch) against its
# other schedule and both descriptor placements forced:
VARIANTS = {
    64: [dict(), dict(PINGPONG=True), dict(DEVICE_DESC=True), dict(DEVICE_DESC=False)],
    128: [dict(), dict(PINGPONG=False), dict(DEVICE_DESC=True), dict(DEVICE_DESC=False)],
}


def main(out_path, quick=False):
    spec = REGISTRY["attention"]
    cases = [c for c in spec.bench_cases if c["mode"][1] is None and c["dtype"] == torch.bfloat16]
    if quick:
        cases = [c for c in cases if c["shape"][3] == 4096 or c["shape"][0] == 1 and c["shape"][3] == 2048]
    rows = []
    t_start = time.time()
    for case in cases:
        B, Hq, Hkv, Nq, Nk = case["shape"]
        d = case["d"]
        causal = case["mode"][0]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, Nq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, Hkv, Nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, Hkv, Nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        flops = spec.flops(case)
        gqa = Hq != Hkv
        row = {"case": dict(shape=case["shape"], d=d, causal=causal), "ms": {}, "rel_l2_vs_cudnn": {}}

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                            enable_gqa=gqa)
            return run
        ref = sdpa(SDPBackend.CUDNN_ATTENTION)()
        row["ms"]["sdpa cudnn"] = bench_ms(sdpa(SDPBackend.CUDNN_ATTENTION))
        if not gqa:
            row["ms"]["sdpa flash"] = bench_ms(sdpa(SDPBackend.FLASH_ATTENTION))
        out = torch.empty_like(q)
        right = 0 if causal else -1

        def portable():
            _launch(q, k, v, out, None, None, scale=d ** -0.5, pos_offset=Nk - Nq, window_left=-1,
                    window_right=right, input_precision="tf32", interpret=False, kernel="portable")
        portable()
        row["rel_l2_vs_cudnn"]["portable"] = error_stats(out, ref).rel_l2
        row["ms"]["portable"] = bench_ms(portable)
        row.setdefault("issue_us", {})["portable"] = host_us(portable, calls=200)
        for variant in VARIANTS[d]:
            name = "ws " + (" ".join(f"{k}={v}" for k, v in variant.items()) or "default")
            out = torch.full_like(q, float("nan"))

            def ws():
                _launch_ws(q, k, v, out, None, qk_scale=d ** -0.5 * LOG2E, pos_offset=Nk - Nq,
                           window_left=-1, window_right=right, config=variant)
            try:
                ws()
                torch.cuda.synchronize()
                row["rel_l2_vs_cudnn"][name] = error_stats(out, ref).rel_l2
                row["ms"][name] = bench_ms(ws)
                row.setdefault("issue_us", {})[name] = host_us(ws, calls=200)
            except Exception as exc:  # a variant that fails to compile or launch is recorded, not fatal
                row["ms"][name] = None
                row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["tflops"] = {n: (flops / (ms * 1e-3) / 1e12 if ms else None) for n, ms in row["ms"].items()}
        rows.append(row)
        cudnn = row["ms"]["sdpa cudnn"]
        print(f"B{B} Hq{Hq} Hkv{Hkv} N{Nq} d{d} {'causal' if causal else 'full'}  ({time.time() - t_start:.0f} s)")
        for n, ms in row["ms"].items():
            err = row["rel_l2_vs_cudnn"].get(n)
            print(f"   {n:40s} " + (f"{ms:.4f} ms {row['tflops'][n]:6.1f} TFLOP/s x cudnn {cudnn / ms:.3f}"
                                    if ms else "failed: " + row["errors"][n])
                  + (f"  rel-L2 vs cudnn {err:.2e}" if err is not None else "")
                  + (f"  issue {row['issue_us'][n]:.0f} us" if n in row.get("issue_us", {}) else ""), flush=True)
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "attention_ws_variants.json",
         quick="--quick" in sys.argv)

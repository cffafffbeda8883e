"""FP8 Linear + bias + GELU beside torch._scaled_mm and the 16-bit Linears (GPU), JSON lines to stdout.

    python benchmarks/fp8_linear.py [--fast-accum]

At the three largest foundation shapes (M, K, N), bf16 output, W quantized once (per output channel):
- e4m3 x given with its row scales: tilefuse's FP8 Linear+GELU against torch._scaled_mm (row-wise scales, the
  same e4m3 operands) followed by eager bias add and GELU;
- bf16 x (the row quantizer inside the timed call): against tilefuse's bf16 Linear+GELU and cuBLASLt's bf16
  bias+GELU epilogue;
and rel-L2 of both FP8 paths and of the per-tensor FP8 baseline against the float64 unquantized Linear+GELU.
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import tilefuse
from tilefuse.kernels import switches
from tilefuse.kernels.gemm import launch
from tilefuse.reference import fp8_linear as fp8_reference

SHAPES = [(8192, 4096, 16384), (2048, 4096, 11008), (16384, 768, 3072)]


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def main(fast_accum: bool):
    switches.gemm.FP8_FAST_ACCUM = fast_accum
    for M, K, N in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(M + K + N)
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        b = torch.randn(N, device="cuda", generator=g).bfloat16()
        qw = tilefuse.quantize_weight(w)
        x8, sx = fp8_reference.quantize_rows(x)
        w_t = qw.data.t()
        sx2, sw2 = sx.reshape(M, 1).float(), qw.scale.reshape(1, N).float()

        def scaled_mm():
            y = torch._scaled_mm(x8, w_t, scale_a=sx2, scale_b=sw2, out_dtype=torch.bfloat16)
            return torch.nn.functional.gelu(y + b)

        rows = {
            "fp8 (e4m3 x)": lambda: tilefuse.linear(x8, qw, b, "gelu", fp8=True, x_scale=sx),
            "scaled_mm + eager bias+gelu": scaled_mm,
            "fp8 (bf16 x)": lambda: tilefuse.linear(x, qw, b, "gelu", fp8=True),
            "tilefuse bf16": lambda: tilefuse.linear(x, w, b, "gelu"),
            "cublaslt bf16 epilogue": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
        }
        ms = {name: do_bench(fn, warmup=30, rep=200) for name, fn in rows.items()}
        truth = torch.nn.functional.gelu(x.double() @ w.double().t() + b.double())
        flops = 2.0 * M * N * K
        print(json.dumps(dict(
            shape=f"M{M} K{K} N{N}", fast_accum=fast_accum, ms={n: round(t, 4) for n, t in ms.items()},
            tflops={n: round(flops / t / 1e9, 1) for n, t in ms.items()},
            vs_scaled_mm=round(ms["scaled_mm + eager bias+gelu"] / ms["fp8 (e4m3 x)"], 3),
            bf16_x_vs_tilefuse_bf16=round(ms["tilefuse bf16"] / ms["fp8 (bf16 x)"], 3),
            e4m3_x_vs_tilefuse_bf16=round(ms["tilefuse bf16"] / ms["fp8 (e4m3 x)"], 3),
            rel_l2=dict(fp8=round(_rel(rows["fp8 (bf16 x)"](), truth), 5),
                        scaled_mm=round(_rel(scaled_mm(), truth), 5),
                        per_tensor=round(_rel(fp8_reference.linear_fp8_per_tensor(x, w, b, "gelu"), truth), 5),
                        bf16=round(_rel(rows["tilefuse bf16"](), truth), 5)),
            config=launch.fp8.linear_fp8_tma_tuned.launched_config().__str__()
            if hasattr(launch, "linear_fp8_tma_tuned") else None)), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fast-accum", action="store_true")
    main(parser.parse_args().fast_accum)

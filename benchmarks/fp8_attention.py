"""FP8 attention forward beside the 16-bit forward and cuDNN's bf16 SDPA (GPU).

    python benchmarks/fp8_attention.py bench [--kernel portable|ws|auto]   # speed, JSON lines to stdout
    python benchmarks/fp8_attention.py accuracy                              # rel-L2 vs float64
    python benchmarks/fp8_attention.py prepass                               # the bf16-input pre-pass, GB/s

bench: d 128, (B, H, N) = (4, 16, 4096) and (1, 16, 16384), causal and full: tilefuse bf16 (its default
launch), FP8 from e4m3 inputs (quantized beforehand, as an FP8 pipeline hands them over), FP8 from bf16
inputs (the quantize pre-pass inside the timed call), cuDNN SDPA bf16, and the e4m3 row again with
switches.attention.FP8_FMA_SOFTMAX on. accuracy: one 4k slice per case on
Gaussian and outlier inputs (1% of d channels x20 in Q, K and V), FP8 with and without the rotation and the
per-tensor baseline (reference/fp8_attention.py), all against float64.
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import tilefuse

from tilefuse.kernels import switches
from tilefuse.reference import attention as ref_attention
from tilefuse.reference import fp8_attention as ref_fp8

SHAPES = [(4, 16, 4096), (1, 16, 16384)]
D = 128


def _flops(B, H, N, causal):
    return 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)


def _inputs(B, H, N, kind="gaussian", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g) for _ in range(3))
    if kind == "outliers":
        channels = torch.randperm(D, generator=torch.Generator().manual_seed(seed))[:max(1, round(0.01 * D))]
        for t in (q, k, v):
            t[..., channels.cuda()] *= 20
    return tuple(t.bfloat16() for t in (q, k, v))


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def bench(kernel: str):
    for B, H, N in SHAPES:
        for causal in (True, False):
            q, k, v = _inputs(B, H, N)
            r = tilefuse.quantize_qkv(q, k, v, rotate=True)
            rows = {
                "tilefuse bf16": lambda: tilefuse.attention(q, k, v, causal=causal),
                "fp8 (e4m3 inputs)": lambda: tilefuse.attention(r.q, r.k, r.v, causal=causal, fp8=True,
                                                                q_scale=r.q_scale, k_scale=r.k_scale,
                                                                v_scale=r.v_scale),
                "fp8 (bf16 inputs, rotated)": lambda: tilefuse.attention(q, k, v, causal=causal, fp8=True, rotate=True),
                "cudnn bf16": lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal),
            }
            old = switches.attention.FP8_KERNEL
            switches.attention.FP8_KERNEL = kernel
            try:
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    ms = {name: do_bench(fn, warmup=50, rep=300) for name, fn in rows.items()}
                with switches.overridden(switches.attention, FP8_FMA_SOFTMAX=True):  # the fused softmax step
                    ms["fp8 (e4m3 inputs, fma softmax)"] = do_bench(rows["fp8 (e4m3 inputs)"], warmup=50, rep=300)
            finally:
                switches.attention.FP8_KERNEL = old
            fl = _flops(B, H, N, causal)
            row = dict(shape=f"B{B} H{H} N{N} d{D} {'causal' if causal else 'full'}", kernel=kernel,
                       ms={n: round(t, 4) for n, t in ms.items()},
                       tflops={n: round(fl / t / 1e9, 1) for n, t in ms.items()},
                       fp8_vs_bf16=round(ms["tilefuse bf16"] / ms["fp8 (e4m3 inputs)"], 3),
                       fp8_vs_cudnn=round(ms["cudnn bf16"] / ms["fp8 (e4m3 inputs)"], 3),
                       fma_softmax_vs_bf16=round(ms["tilefuse bf16"] / ms["fp8 (e4m3 inputs, fma softmax)"], 3),
                       fma_softmax_vs_cudnn=round(ms["cudnn bf16"] / ms["fp8 (e4m3 inputs, fma softmax)"], 3),
                       fp8_bf16_in_vs_bf16=round(ms["tilefuse bf16"] / ms["fp8 (bf16 inputs, rotated)"], 3),
                       fp8_bf16_in_vs_cudnn=round(ms["cudnn bf16"] / ms["fp8 (bf16 inputs, rotated)"], 3))
            print(json.dumps(row), flush=True)


def sweep():
    """The portable FP8 kernel's tile configs at each bench shape (e4m3 inputs)."""
    from tilefuse.kernels.attention import launch
    configs = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8,
               num_stages=3), dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
               dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4,
               num_stages=3)]
    old = (switches.attention.FP8_KERNEL, launch.FP8_CONFIG)
    switches.attention.FP8_KERNEL = "portable"
    try:
        for B, H, N in SHAPES:
            for causal in (True, False):
                q, k, v = _inputs(B, H, N)
                r = tilefuse.quantize_qkv(q, k, v)
                for cfg in configs:
                    launch.FP8_CONFIG = cfg
                    ms = do_bench(lambda: tilefuse.attention(r.q, r.k, r.v, causal=causal, fp8=True, q_scale=r.q_scale,
                                                             k_scale=r.k_scale, v_scale=r.v_scale), warmup=30, rep=200)
                    print(json.dumps(dict(shape=f"B{B} H{H} N{N} {'causal' if causal else 'full'}", config=cfg,
                                          ms=round(ms, 4), tflops=round(_flops(B, H, N, causal) / ms / 1e9, 1))),
                          flush=True)
    finally:
        switches.attention.FP8_KERNEL, launch.FP8_CONFIG = old


def prepass():
    """The bf16-input pre-pass piece by piece at the bench shapes: quantize_qkv whole, Q's block pass (rotated and
    not) and V's two-kernel channel pass, each against its minimum bytes (2 read + 1 written per element) and a
    copy of the same tensor (torch's clone: 2 + 2) as the run's bandwidth ceiling."""
    from tilefuse import runtime
    from tilefuse.kernels.attention import launch
    from tilefuse.reference import fp8_attention as ref
    path = runtime.execution_path(torch.empty(1, device="cuda"))
    for B, H, N in SHAPES:
        q, k, v = _inputs(B, H, N)
        rot = ref.hadamard_signs(D, q.device, q.dtype)
        rows = {"quantize_qkv (rotated)": (lambda: tilefuse.quantize_qkv(q, k, v, rotate=True), 3),
                "q blocks, rotated": (lambda: launch.quantize_blocks(q, rot, path), 1),
                "q blocks": (lambda: launch.quantize_blocks(q, None, path), 1),
                "v channels, transposed": (lambda: launch.quantize_channels_transposed(v, path), 1),
                "copy (clone)": (lambda: q.clone(), None)}
        elems = q.numel()
        out = {}
        for name, (fn, tensors) in rows.items():
            ms = do_bench(fn, warmup=30, rep=200)
            nbytes = elems * (4 if tensors is None else 3 * tensors)
            out[name] = dict(ms=round(ms, 4), gbps=round(nbytes / ms / 1e6, 1))
        print(json.dumps(dict(shape=f"B{B} H{H} N{N} d{D}", rows=out)), flush=True)


def check():
    """Both FP8 kernels against the tile-by-tile emulation (reference/fp8_attention.py) on the GPU: ragged
    sizes, GQA, causal, windows, d 64 and 128."""
    from tilefuse.kernels import launches
    cases = [(2, 4, 2, 1000, 1000, 128, True, None), (1, 8, 8, 4096, 4096, 128, False, None),
             (1, 4, 1, 300, 1024, 64, True, None), (2, 2, 2, 777, 2048, 128, False, (256, 0)),
             (1, 2, 2, 1, 4096, 128, False, None), (1, 2, 1, 512, 1000, 128, False, None)]
    for B, Hq, Hkv, Nq, Nk, d, causal, window in cases:
        g = torch.Generator(device="cuda").manual_seed(Nq + Nk)
        q = torch.randn(B, Hq, Nq, d, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(B, Hkv, Nk, d, device="cuda", generator=g).bfloat16() for _ in range(2))
        r = tilefuse.quantize_qkv(q, k, v)
        left, right = window if window else (-1, -1)
        right = 0 if causal else right
        emu = ref_fp8.attention_fp8_tiled(r.q, r.q_scale, r.k, r.k_scale, r.v, r.v_scale, d ** -0.5, Nk - Nq, left,
                                          right, block_n=128)
        for kernel in ("auto", "portable"):
            switches.attention.FP8_KERNEL = kernel
            with launches.recording() as rec:
                out = tilefuse.attention(r.q, r.k, r.v, causal=causal, window=window, fp8=True, q_scale=r.q_scale,
                                         k_scale=r.k_scale, v_scale=r.v_scale)
            print(json.dumps(dict(case=f"B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} Nk{Nk} d{d} causal={causal} window={window}",
                                  ran=rec[-1].kernel, rel_vs_emulation=round(_rel(out, emu.double()), 6),
                                  nan=bool(out.isnan().any()))), flush=True)
        switches.attention.FP8_KERNEL = "auto"


def accuracy():
    for kind in ("gaussian", "outliers"):
        for causal in (True, False):
            q, k, v = _inputs(1, 2, 4096, kind, seed=1)
            truth = ref_attention.attention(q.double(), k.double(), v.double(), causal=causal)
            row = dict(inputs=kind, causal=causal, shape="B1 H2 N4096 d128")
            row["fp8"] = _rel(tilefuse.attention(q, k, v, causal=causal, fp8=True), truth)
            row["fp8 rotated"] = _rel(tilefuse.attention(q, k, v, causal=causal, fp8=True, rotate=True), truth)
            row["per-tensor fp8 baseline"] = _rel(ref_fp8.attention_fp8_per_tensor(q, k, v, causal=causal), truth)
            row["bf16"] = _rel(tilefuse.attention(q, k, v, causal=causal), truth)
            row["baseline / fp8 rotated"] = row["per-tensor fp8 baseline"] / row["fp8 rotated"]
            print(json.dumps({n: (round(x, 5) if isinstance(x, float) else x) for n, x in row.items()}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["bench", "accuracy", "sweep", "check", "prepass"])
    parser.add_argument("--kernel", default="auto", choices=["auto", "portable", "ws"])
    args = parser.parse_args()
    {"accuracy": accuracy, "sweep": sweep, "check": check, "prepass": prepass, "bench": lambda: bench(args.kernel)}[args.command]()

"""Lab: the dW GEMM of the linear backward computed transposed, dW^T = x^T @ g, against the shipped
grad_weight_kernel (dW = g^T @ x).

Why: in the shipped form g^T is the A operand, made in registers and carried to wgmma's register-A layout
through a transpose and four layout conversions per K step (sm_90a TTGIR, NOTES 2026-12-01 training). In
the transposed form x^T is the A operand straight from the cp.async buffer (a transposed shared-memory
view, no register round trip) and g the B operand, stored to shared memory once per step.

    PYTHONPATH=src python benchmarks/grad_weight_variants.py compile   # sm_90a facts of both, any machine
    PYTHONPATH=src python benchmarks/grad_weight_variants.py bench     # H200: time both on the bench shapes
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from tilefuse.kernels.tiling import grouped_tile


@triton.jit
def grad_weight_t_kernel(
    dy_ptr, s_ptr, x_ptr, dw_ptr, db_ptr,
    M, N, K,
    stride_dym, stride_sm, stride_xm, stride_dwn, stride_dwk,
    HAS_BIAS: tl.constexpr, HAS_SLOPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dW^T[K, N] tile (BLOCK_M rows of K, BLOCK_N columns of N) = sum over m of x[m, k] g[m, n]."""
    pid_k, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(K, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_k = pid_k * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_k = offs_k < K
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_r[:, None] * stride_xm + offs_k[None, :]
    dy_ptrs = dy_ptr + offs_r[:, None] * stride_dym + offs_n[None, :]
    s_ptrs = s_ptr + offs_r[:, None] * stride_sm + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_K):
        mask_r = (m0 + offs_r) < M
        x = tl.load(x_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)   # [BLOCK_K (m), BLOCK_M (k)]
        g = tl.load(dy_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K (m), BLOCK_N (n)]
        if HAS_SLOPE:
            g = (g.to(tl.float32) * tl.load(s_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(
                tl.float32)).to(x.dtype)
        if HAS_BIAS:
            db_acc += g.to(tl.float32)
        acc = tl.dot(tl.trans(x), g, acc)
        x_ptrs += BLOCK_K * stride_xm
        dy_ptrs += BLOCK_K * stride_dym
        s_ptrs += BLOCK_K * stride_sm
    dw_ptrs = dw_ptr + offs_n.to(tl.int64)[None, :] * stride_dwn + offs_k[:, None] * stride_dwk
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])
    if HAS_BIAS:
        tl.store(db_ptr + offs_n, tl.sum(db_acc, axis=0).to(db_ptr.dtype.element_ty), mask=mask_n & (pid_k == 0))


CONFIGS = [dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)]


def compile_facts():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tools import compiler

    out = []
    for cfg in CONFIGS:
        consts = {k: v for k, v in cfg.items() if not k.startswith("num_")}
        consts.update(HAS_BIAS=True, HAS_SLOPE=True)
        aligned = ("dy_ptr", "s_ptr", "x_ptr", "dw_ptr", "N", "K", "stride_dym", "stride_sm", "stride_xm",
                   "stride_dwn")
        facts = compiler.compile_sm90("grad_weight_variants", "grad_weight_t_kernel", "*bf16", dict(consts, stride_dwk=1),
                                      cfg["num_warps"], cfg["num_stages"], aligned=aligned)
        out.append({"config": cfg, **{k: facts[k] for k in ("regs", "spill_store_bytes", "shared", "wgmma",
                                                           "wgmma_a_in_registers")}})
    print(json.dumps(out, indent=1))


def bench():
    from triton.testing import do_bench

    from tilefuse.kernels.gemm import launch
    from tilefuse.opspecs.linear import BENCH_SHAPES

    rows = []
    for M, K, N in BENCH_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        s = torch.rand(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
        shipped = lambda: launch.linear_backward(dy, x, w, None, s, None, False, True, True, "compiled")  # noqa: E731
        dw_ref, db_ref = shipped()[1:]
        row = {"shape": [M, K, N], "shipped_ms": do_bench(shipped)}
        for cfg in CONFIGS:
            dw, db = torch.empty_like(w), torch.empty(N, device="cuda", dtype=torch.bfloat16)
            meta = {k: v for k, v in cfg.items()}
            grid = (triton.cdiv(K, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)

            def run():
                grad_weight_t_kernel[grid](dy, s, x, dw, db, M, N, K, dy.stride(0), s.stride(0), x.stride(0),
                                           dw.stride(0), dw.stride(1), HAS_BIAS=True, HAS_SLOPE=True, **meta)
            run()
            err = ((dw.double() - dw_ref.double()).norm() / dw_ref.double().norm()).item()
            row[f"t_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_ms"] = do_bench(run)
            row[f"t_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_rel_l2_vs_shipped"] = err
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"compile": compile_facts, "bench": bench}[sys.argv[1] if len(sys.argv) > 1 else "compile"]()

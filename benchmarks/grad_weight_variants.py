"""Lab: the linear backward's two GEMMs in other forms, against the shipped kernels and cuBLAS.

- ``grad_weight_t_kernel``: dW computed transposed, dW^T = x^T @ g, pointer loads (against the shipped
  grad_weight_kernel's dW = g^T @ x).
- ``grad_weight_tma_t_kernel``: the same product as a persistent TMA GEMM (x, dy and the slope arrive as TMA
  tiles; dW stored through a TMA descriptor from the transposed accumulator).
- ``grad_input_tma_kernel``: dx = g @ W as a persistent TMA GEMM, g = dy * slope made from TMA tiles in
  registers (wgmma's A from registers, W's tiles from shared memory as they lie).
- cuBLAS: torch.mm on a precomputed g (g^T @ x and g @ W): the two GEMMs alone, the ceiling.

Why: in the shipped form g^T is the A operand, made in registers and carried to wgmma's register-A layout
through a transpose and four layout conversions per K step (sm_90a TTGIR, NOTES 2026-12-01 training). In
the transposed form x^T is the A operand straight from the cp.async buffer (a transposed shared-memory
view, no register round trip) and g the B operand, stored to shared memory once per step.

    PYTHONPATH=src python benchmarks/grad_weight_variants.py compile   # sm_90a facts of each, any machine
    PYTHONPATH=src python benchmarks/grad_weight_variants.py check     # each against float64, interpreter or GPU
    PYTHONPATH=src python benchmarks/grad_weight_variants.py bench     # H200: time each on the bench shapes
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


@triton.jit
def grad_weight_tma_t_kernel(
    dy_ptr, s_ptr, x_ptr, dw_ptr, db_ptr,
    M, N, K,
    stride_dym, stride_sm, stride_xm, stride_dwn,
    HAS_BIAS: tl.constexpr, HAS_SLOPE: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Persistent: dW^T tiles [BLOCK_M (k), BLOCK_N (n)] = sum over m of x[m, k] g[m, n], the forward's M walked
    in BLOCK_K steps; x^T is wgmma's A straight from the TMA buffer, g = dy * s the B operand."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_K, BLOCK_M])
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[stride_dym, 1],
                                        block_shape=[BLOCK_K, BLOCK_N])
    s_desc = tl.make_tensor_descriptor(s_ptr, shape=[M, N], strides=[stride_sm, 1], block_shape=[BLOCK_K, BLOCK_N])
    dw_desc = tl.make_tensor_descriptor(dw_ptr, shape=[N, K], strides=[stride_dwn, 1],
                                        block_shape=[BLOCK_N, BLOCK_M])
    num_pid_k = tl.cdiv(K, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_pid_k * num_pid_n, NUM_SMS, flatten=True):
        pid_k, pid_n = grouped_tile(tile_id, num_pid_k, num_pid_n, GROUP_M)
        off_k = pid_k * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for mi in range(tl.cdiv(M, BLOCK_K)):
            m0 = mi * BLOCK_K
            xt = x_desc.load([m0, off_k])
            g = dy_desc.load([m0, off_n])
            if HAS_SLOPE:
                g = (g.to(tl.float32) * s_desc.load([m0, off_n]).to(tl.float32)).to(xt.dtype)
            if HAS_BIAS:
                db_acc += g.to(tl.float32)
            acc = tl.dot(xt.T, g, acc)
        dw_desc.store([off_n, off_k], tl.trans(acc).to(dw_ptr.dtype.element_ty))
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            tl.store(db_ptr + offs_n, tl.sum(db_acc, axis=0).to(db_ptr.dtype.element_ty),
                     mask=(offs_n < N) & (pid_k == 0))


@triton.jit
def grad_input_tma_kernel(
    dy_ptr, s_ptr, w_ptr, dx_ptr,
    M, N, K,
    stride_dym, stride_sm, stride_wn, stride_dxm,
    HAS_SLOPE: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Persistent: dx tiles [BLOCK_M (m), BLOCK_N (k)] = g[m, :] @ W[:, k], the forward's N walked in BLOCK_K
    steps; W's [BLOCK_K, BLOCK_N] tiles as they lie (K contiguous) are wgmma's B."""
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[stride_dym, 1],
                                        block_shape=[BLOCK_M, BLOCK_K])
    s_desc = tl.make_tensor_descriptor(s_ptr, shape=[M, N], strides=[stride_sm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_K, BLOCK_N])
    dx_desc = tl.make_tensor_descriptor(dx_ptr, shape=[M, K], strides=[stride_dxm, 1],
                                        block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(K, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ri in range(tl.cdiv(N, BLOCK_K)):
            r0 = ri * BLOCK_K
            g = dy_desc.load([off_m, r0])
            if HAS_SLOPE:
                g = (g.to(tl.float32) * s_desc.load([off_m, r0]).to(tl.float32)).to(g.dtype)
            acc = tl.dot(g, w_desc.load([r0, off_n]), acc)
        dx_desc.store([off_m, off_n], acc.to(dx_ptr.dtype.element_ty))


# Pairs (dW config, dx config), each within the H200's 227 KB of shared memory on sm_90a (`compile`): the dW
# kernel's 128x256 tile needs 272 KB at 3 stages, so it keeps 128x128 (its TMA store's staging tile counts too).
TMA_CONFIGS = [(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
                dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)),
               (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3))]


def _tma_grid(kernel, M, N, K, cfg, num_sms):
    out_rows, out_cols = (K, N) if kernel is grad_weight_tma_t_kernel else (M, K)
    return (min(num_sms, triton.cdiv(out_rows, cfg["BLOCK_M"]) * triton.cdiv(out_cols, cfg["BLOCK_N"])),)


def run_tma_dw(dy, s, x, dw, db, cfg, num_sms):
    M, K = x.shape
    N = dy.shape[1]
    grad_weight_tma_t_kernel[_tma_grid(grad_weight_tma_t_kernel, M, N, K, cfg, num_sms)](
        dy, s, x, dw, db, M, N, K, dy.stride(0), s.stride(0), x.stride(0), dw.stride(0), HAS_BIAS=True,
        HAS_SLOPE=True, NUM_SMS=num_sms, **cfg)


def run_tma_dx(dy, s, w, dx, cfg, num_sms):
    M, N = dy.shape
    K = w.shape[1]
    grad_input_tma_kernel[_tma_grid(grad_input_tma_kernel, M, N, K, cfg, num_sms)](
        dy, s, w, dx, M, N, K, dy.stride(0), s.stride(0), w.stride(0), dx.stride(0), HAS_SLOPE=True,
        NUM_SMS=num_sms, **cfg)


CONFIGS = [dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)]


def compile_facts():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tools import compiler

    keep = ("regs", "spill_store_bytes", "shared", "wgmma", "wgmma_a_in_registers")
    out = []
    for cfg in CONFIGS:
        consts = {k: v for k, v in cfg.items() if not k.startswith("num_")}
        consts.update(HAS_BIAS=True, HAS_SLOPE=True)
        aligned = ("dy_ptr", "s_ptr", "x_ptr", "dw_ptr", "N", "K", "stride_dym", "stride_sm", "stride_xm",
                   "stride_dwn")
        facts = compiler.compile_sm90("grad_weight_variants", "grad_weight_t_kernel", "*bf16", dict(consts, stride_dwk=1),
                                      cfg["num_warps"], cfg["num_stages"], aligned=aligned)
        out.append({"kernel": "grad_weight_t_kernel", "config": cfg, **{k: facts[k] for k in keep}})
    for name, extra, aligned in (
            ("grad_weight_tma_t_kernel", dict(HAS_BIAS=True, HAS_SLOPE=True),
             ("dy_ptr", "s_ptr", "x_ptr", "dw_ptr", "db_ptr", "N", "K", "stride_dym", "stride_sm", "stride_xm",
              "stride_dwn")),
            ("grad_input_tma_kernel", dict(HAS_SLOPE=True),
             ("dy_ptr", "s_ptr", "w_ptr", "dx_ptr", "N", "K", "stride_dym", "stride_sm", "stride_wn", "stride_dxm"))):
        for cfg in (pair[name == "grad_input_tma_kernel"] for pair in TMA_CONFIGS):
            consts = dict({k: v for k, v in cfg.items() if not k.startswith("num_")}, NUM_SMS=132, **extra)
            facts = compiler.compile_sm90("grad_weight_variants", name, "*bf16", consts, cfg["num_warps"],
                                          cfg["num_stages"], aligned=aligned)
            out.append({"kernel": name, "config": cfg, **{k: facts[k] for k in keep}})
    print(json.dumps(out, indent=1))


def check():
    """Each lab kernel against float64 on a tail-heavy shape (the interpreter on a CPU, fp16 there)."""
    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float16
    if not on_gpu:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    M, K, N = (1000, 264, 392) if on_gpu else (136, 72, 200)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dev, dtype)
    dy = torch.randn(M, N, generator=g).to(dev, dtype)
    s = torch.rand(M, N, generator=g).to(dev, dtype)
    w = (torch.randn(N, K, generator=g) * N ** -0.5).to(dev, dtype)
    gd = (dy.double() * s.double()).to(dtype).double()  # g rounded to the operand dtype, as the kernels make it
    want_dw, want_db, want_dx = gd.t() @ x.double(), gd.sum(0), gd @ w.double()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 3
    for cfg_dw, cfg_dx in TMA_CONFIGS:
        dw, db, dx = torch.empty_like(w), torch.empty(N, device=dev, dtype=dtype), torch.empty_like(x)
        run_tma_dw(dy, s, x, dw, db, cfg_dw, num_sms)
        run_tma_dx(dy, s, w, dx, cfg_dx, num_sms)
        print(json.dumps({"dW config": cfg_dw, "dx config": cfg_dx, "dW_rel_l2": rel(dw, want_dw),
                          "db_rel_l2": rel(db, want_db), "dx_rel_l2": rel(dx, want_dx)}))


def bench():
    from triton.testing import do_bench

    from tilefuse.kernels.gemm import launch
    from tilefuse.opspecs.linear import BENCH_SHAPES
    from tilefuse.kernels.tiling import ensure_descriptor_allocator

    ensure_descriptor_allocator()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for M, K, N in BENCH_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        s = torch.rand(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * N ** -0.5
        shipped = lambda: launch.linear_backward(dy, x, w, None, s, None, False, True, True, "compiled")  # noqa: E731
        shipped_dx = lambda: launch.linear_backward(dy, x, w, None, s, None, True, False, False, "compiled")  # noqa: E731
        dw_ref, db_ref = shipped()[1:]
        dx_ref = shipped_dx()[0]
        gg = dy * s
        row = {"shape": [M, K, N], "gemm_tflop": 2 * M * N * K / 1e12, "shipped_dw_db_ms": do_bench(shipped),
               "shipped_dx_ms": do_bench(shipped_dx), "cublas_dw_ms": do_bench(lambda: torch.mm(gg.t(), x)),
               "cublas_dx_ms": do_bench(lambda: torch.mm(gg, w))}
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
        for cfg_dw, cfg_dx in TMA_CONFIGS:
            tag_dw = f"{cfg_dw['BLOCK_M']}x{cfg_dw['BLOCK_N']}s{cfg_dw['num_stages']}"
            tag_dx = f"{cfg_dx['BLOCK_M']}x{cfg_dx['BLOCK_N']}s{cfg_dx['num_stages']}"
            dw, db, dx = torch.empty_like(w), torch.empty(N, device="cuda", dtype=torch.bfloat16), torch.empty_like(x)
            try:
                run_tma_dw(dy, s, x, dw, db, cfg_dw, num_sms)
                run_tma_dx(dy, s, w, dx, cfg_dx, num_sms)
            except Exception as exc:  # a lab variant that does not compile is a result too
                row[f"tma_{tag_dw}_{tag_dx}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
            row[f"tma_t_dw_{tag_dw}_ms"] = do_bench(lambda: run_tma_dw(dy, s, x, dw, db, cfg_dw, num_sms))
            row[f"tma_dx_{tag_dx}_ms"] = do_bench(lambda: run_tma_dx(dy, s, w, dx, cfg_dx, num_sms))
            row[f"tma_{tag_dw}_{tag_dx}_rel_l2_vs_shipped_dw_db_dx"] = [rel(dw, dw_ref), rel(db, db_ref),
                                                                       rel(dx, dx_ref)]
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"compile": compile_facts, "check": check, "bench": bench}[sys.argv[1] if len(sys.argv) > 1 else "compile"]()

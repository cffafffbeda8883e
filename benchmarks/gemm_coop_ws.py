"""Study script for the cooperative warp-specialized Gluon GEMM (src/tilefuse/kernels/gemm/coop.py: the kernel,
its configs and host entries live there; this file only compiles and times them). The launch layer
(kernels/gemm/launch/: ``coop_backward``, ``coop_gated``) takes it for the linear backward's dx and dW and the
gated forward where it measured faster; these commands compare every config of ``coop.CONFIGS`` with what the
launch runs otherwise.

    PYTHONPATH=src python benchmarks/gemm_coop_ws.py compile   # sm_90a facts (any machine)
    PYTHONPATH=src python benchmarks/gemm_coop_ws.py bench     # H200: the backward GEMMs beside the launch's
                                                               # other kernels and cuBLAS
    PYTHONPATH=src python benchmarks/gemm_coop_ws.py forward   # H200: Linear+GELU beside tilefuse.linear and cuBLASLt,
                                                               # then SwiGLU beside tilefuse's gated kernel and eager
    PYTHONPATH=src python benchmarks/gemm_coop_ws.py gated_dx  # H200: SwiGLU's dx, the GATED_DX form beside the
                                                               # tuned pointer kernel the launch runs and cuBLAS
"""
from __future__ import annotations

import contextlib
import json
import sys

import torch

from tilefuse.kernels import switches
from tilefuse.kernels.gemm.coop import (CONFIGS, gated_configs, gated_linear, grad_input, grad_input_gated,
                                        grad_weight, linear)


def coop_off():
    """The launch's own choice without the cooperative kernel (its COOP_* switches off)."""

    return switches.overridden(switches.gemm, COOP_BACKWARD=False, COOP_GATED=False)


# ---- commands ----------------------------------------------------------------------------------------
BENCH_SHAPES = [(8192, 4096, 16384), (2048, 4096, 11008), (8192, 1024, 4096), (16384, 768, 3072), (512, 4096, 4096),
                (1000, 520, 1288)]  # the five linear_train shapes (M, K, N), then one with tails on every tile


def compile_facts():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
    from tools.compiler import compile_gluon_sm90

    for name in CONFIGS:
        for gemm in ("forward", "gated", "dx", "gated_dx", "dW"):
            if gemm in ("dx", "gated_dx", "dW") and CONFIGS[name].get("FORWARD_ONLY"):
                continue
            if gemm == "gated" and name not in gated_configs():
                continue
            facts = compile_gluon_sm90("tools.compiler", "gemm_coop_ws_compile_job",
                                       dict(gemm=gemm, config=name, activation="swiglu" if gemm == "gated" else "gelu"))
            print(json.dumps(dict(config=name, gemm=gemm, **facts)), flush=True)


def bench_forward():
    """Linear + bias + GELU (erf) on the five foundation shapes: the cooperative kernel at each config beside
    tilefuse.linear (its TMA kernel), cuBLASLt's GELU epilogue (torch._addmm_activation) and the bare cuBLAS GEMM;
    then SwiGLU at the gated_linear bench shapes beside tilefuse's gated TMA kernel (``tilefuse_ms``, the
    cooperative kernel switched off), what the launch picks (``tilefuse_dispatch_ms``) and eager."""
    from triton.testing import do_bench

    import tilefuse

    from tilefuse.opspecs.linear import BENCH_SHAPES as FOUNDATION_SHAPES

    for M, K, N in FOUNDATION_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.gelu(x.double() @ w.double().t() + b.double())
        row = {"shape": [M, K, N], "tilefuse_ms": do_bench(lambda: tilefuse.linear(x, w, b, "gelu")),
               "cublaslt_gelu_ms": do_bench(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)),
               "cublas_gemm_ms": do_bench(lambda: torch.mm(x, w.t()))}
        for name in CONFIGS:
            try:
                y = linear(x, w, b, "gelu", name)
                row[f"ws_{name}_rel_l2"] = ((y.double() - ref).norm() / ref.norm()).item()
                row[f"ws_{name}_ms"] = do_bench(lambda: linear(x, w, b, "gelu", name))
            except Exception as e:  # a config that fails is reported, the rest still run
                row[f"ws_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
    from tilefuse.opspecs.gated_linear import BENCH_SHAPES as GATED_SHAPES

    for M, K, N in GATED_SHAPES:  # SwiGLU, no bias: beside tilefuse's gated kernel and eager's two GEMMs
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        wg, wu = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5 for _ in range(2))
        ref = torch.nn.functional.silu(x.double() @ wg.double().t()) * (x.double() @ wu.double().t())
        with coop_off():
            tma_ms = do_bench(lambda: tilefuse.linear(x, (wg, wu), None, "swiglu"))
        row = {"shape": [M, K, N], "activation": "swiglu", "tilefuse_ms": tma_ms,
               "tilefuse_dispatch_ms": do_bench(lambda: tilefuse.linear(x, (wg, wu), None, "swiglu")),
               "eager_ms": do_bench(lambda: torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())),
               "cublas_two_gemms_ms": do_bench(lambda: (torch.mm(x, wg.t()), torch.mm(x, wu.t())))}
        for name in gated_configs():
            try:
                y = gated_linear(x, wg, wu, None, None, "swiglu", name)
                row[f"ws_{name}_rel_l2"] = ((y.double() - ref).norm() / ref.norm()).item()
                row[f"ws_{name}_ms"] = do_bench(lambda: gated_linear(x, wg, wu, None, None, "swiglu", name))
            except Exception as e:  # a config that fails is reported, the rest still run
                row[f"ws_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


def bench():
    """The backward GEMMs on BENCH_SHAPES: dx and dW + db of the cooperative kernel at each config beside the
    launch's other kernels (``launch_*``: the cooperative kernel switched off), what the launch picks
    (``dispatch_*``) and cuBLAS on a precomputed g; each with its rel-L2 against float64."""
    from triton.testing import do_bench

    from tilefuse.kernels import fastpath
    from tilefuse.kernels.gemm import launch

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from grad_weight_variants import bench_inputs

    for M, K, N in BENCH_SHAPES:
        x, dy, s, w = bench_inputs(M, K, N)
        gg = (dy.float() * s.float()).to(torch.bfloat16)  # g as eager rounds it
        ref_dx, ref_dw, ref_db = gg.double() @ w.double(), gg.double().t() @ x.double(), gg.double().sum(0)
        row = {"shape": [M, K, N]}
        def dx_call():
            return launch.linear_backward(dy, x, w, None, s, None, True, False, False, "compiled")

        def dw_db_call():
            return launch.linear_backward(dy, x, w, None, s, None, False, True, True, "compiled")

        fastpath.clear_all()
        for prefix, switch in (("launch", coop_off), ("dispatch", contextlib.nullcontext)):
            with switch():
                dx_l = dx_call()[0]
                _, dw_l, db_l = dw_db_call()
                row[f"{prefix}_rel_l2_dx_dw_db"] = [rel(dx_l, ref_dx), rel(dw_l, ref_dw), rel(db_l, ref_db)]
                row[f"{prefix}_dx_ms"] = do_bench(dx_call)
                row[f"{prefix}_dw_db_ms"] = do_bench(dw_db_call)
        row["cublas_dx_ms"] = do_bench(lambda: torch.mm(gg, w))
        row["cublas_dw_ms"] = do_bench(lambda: torch.mm(gg.t(), x))
        for name in (n for n, c in CONFIGS.items() if not c.get("FORWARD_ONLY")):
            try:
                dx = grad_input(dy, s, w, name)
                dw, db = grad_weight(dy, s, x, name)
                torch.cuda.synchronize()
                row[f"ws_{name}_rel_l2_dx_dw_db"] = [rel(dx, ref_dx), rel(dw, ref_dw), rel(db, ref_db)]
                row[f"ws_{name}_dx_ms"] = do_bench(lambda: grad_input(dy, s, w, name))
                row[f"ws_{name}_dw_db_ms"] = do_bench(lambda: grad_weight(dy, s, x, name))
            except Exception as e:  # a config that fails to compile or launch is reported, the rest still run
                row[f"ws_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


GATED_DX_SHAPES = [(8192, 4096, 14336), (2048, 4096, 11008), (2100, 2056, 4360)]  # (M, K, N): gated_linear_train's
# two rows, then tails on every tile dim


def bench_gated_dx():
    """SwiGLU's dx = (dy * s_gate) @ W_gate + (dy * s_up) @ W_up on GATED_DX_SHAPES: the GATED_DX form at each
    backward config beside what the launch runs with it off (the tuned pointer kernel) and cuBLAS's two GEMMs and
    add on precomputed g's; each with its rel-L2 against float64."""
    from triton.testing import do_bench

    from tilefuse.kernels import fastpath
    from tilefuse.kernels.gemm import launch

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for M, K, N in GATED_DX_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        dy, s_gate, s_up = (torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        w_gate, w_up = ((torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
                        for _ in range(2))
        x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        g_gate, g_up = ((dy.float() * s).to(torch.bfloat16) for s in (s_gate, s_up))
        ref = g_gate.double() @ w_gate.double() + g_up.double() @ w_up.double()
        row = {"shape": [M, K, N]}

        def launch_call():
            return launch.linear_backward(dy, x, w_gate, w_up, s_gate, s_up, True, False, False, "compiled")[0]

        fastpath.clear_all()
        with switches.overridden(switches.gemm, COOP_GATED_DX=False):
            row["launch_rel_l2"] = rel(launch_call(), ref)
            row["launch_ms"] = do_bench(launch_call)
        fastpath.clear_all()
        row["cublas_ms"] = do_bench(lambda: torch.addmm(torch.mm(g_gate, w_gate), g_up, w_up))
        for name in (n for n, c in CONFIGS.items() if not c.get("FORWARD_ONLY")):
            try:
                dx = grad_input_gated(dy, s_gate, w_gate, s_up, w_up, name)
                torch.cuda.synchronize()
                row[f"ws_{name}_rel_l2"] = rel(dx, ref)
                row[f"ws_{name}_ms"] = do_bench(lambda: grad_input_gated(dy, s_gate, w_gate, s_up, w_up, name))
            except Exception as e:  # a config that fails to compile or launch is reported, the rest still run
                row[f"ws_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"compile": compile_facts, "bench": bench, "forward": bench_forward, "gated_dx": bench_gated_dx}[sys.argv[1] if len(sys.argv) > 1 else "compile"]()

"""Study script for the attention backward's warp-specialized passes at head dims past 128 (160, 192, 256 in
256-wide tiles): the dK/dV pass of src/tilefuse/kernels/attention/ws_backward_wide.py (one consumer warpgroup per
output; its module doc says why) and ws_backward's dQ pass in 256-wide tiles with ws_backward_wide.DQ_KEYS-key
K/V steps. The launch layer (kernels/attention/launch.py: ``ws_backward_usable``, ``_backward_ws``) takes them
for 16-bit, no mask, no soft-cap, ALiBi, left window or packed sequences; ``switches.attention.BACKWARD_WS_WIDE`` switches
them off (the portable passes then run there). This file only compiles and times them, through the launch's own
``_backward_ws``.

    PYTHONPATH=src python benchmarks/attention_bwd_wide.py compile   # sm_90a facts (any machine)
    PYTHONPATH=src python benchmarks/attention_bwd_wide.py bench     # H200: check and time beside the portable pass
"""
from __future__ import annotations

import json
import math
import sys

import torch
from tilefuse.kernels import switches


BENCH_CASES = [(4, 16, 16, 4096, 256, True), (4, 16, 16, 4096, 192, True), (4, 16, 16, 4096, 160, True),
               (4, 16, 16, 4096, 256, False), (1, 32, 8, 2048, 256, True)]  # (B, Hq, Hkv, N, d, causal)


def compile_facts():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
    from tools.compiler import compile_gluon_sm90

    for which in ("dkdv", "dq"):
        for causal in (False, True):
            for stages in (1, 2):
                facts = compile_gluon_sm90("tools.compiler", "attention_bwd_wide_compile_job",
                                           dict(causal=causal, stages=stages, which=which))
                print(json.dumps(dict(which=which, causal=causal, stages=stages, **facts)), flush=True)


def bench():
    """Each case: the portable backward as the launch runs it with the wide passes switched off (row-dot, dK/dV,
    dQ), then the wide dK/dV and dQ passes as ``launch._backward_ws`` launches them, each on its own, against it
    (rel-L2), each pass's time and TFLOP/s (its GEMMs counted: four of 2 * N * N * d for dK/dV, three for dQ)."""
    from triton.testing import do_bench

    import tilefuse
    from tilefuse.kernels.attention import launch

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for B, Hq, Hkv, N, d, causal in BENCH_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(B, Hq, N, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(B, Hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        scale = 1.0 / math.sqrt(d)
        out, lse = tilefuse.attention(q, k, v, causal=causal, return_lse=True)
        lse = lse.float().contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()

        def portable():
            return launch.backward(dout, q, k, v, out, lse, None, None, scale, 0, -1, 0 if causal else -1,
                                   "compiled")

        with switches.overridden(switches.attention, BACKWARD_WS_WIDE=False):
            dq_ref, dk_ref, dv_ref = portable()
            row = {"case": [B, Hq, Hkv, N, d, causal], "portable_backward_ms": do_bench(portable)}
        flops = 8 * B * Hq * N * N * d * (0.5 if causal else 1.0)  # four GEMMs of 2 * N * N * d
        got = tuple(torch.empty_like(t) for t in (q, k, v))  # dq, dk, dv

        def run(which):
            return launch._backward_ws(dout, q, k, v, lse, delta, *got, scale=scale, pos_offset=0,
                                       window_right=0 if causal else -1, passes=(which,))

        for name, share, outs, want in (("dkdv", 1.0, got[1:], (dk_ref, dv_ref)), ("dq", 0.75, got[:1], (dq_ref,))):
            try:
                cfg = run(name)
                torch.cuda.synchronize()
                row[f"rel_l2_vs_portable_{name}"] = [rel(a, b) for a, b in zip(outs, want)]
                ms = do_bench(lambda: run(name))
                row[f"wide_{name}_ms"] = ms
                row[f"wide_{name}_tflops"] = flops * share / ms / 1e9
                row["config"] = cfg
            except Exception as e:  # reported, the other cases still run
                row[f"wide_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"compile": compile_facts, "bench": bench}[sys.argv[1] if len(sys.argv) > 1 else "compile"]()

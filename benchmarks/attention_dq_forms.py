"""The attention backward's two dQ forms on the portable passes, side by side: dQ by its own pass (the default:
S and dP recomputed a second time, no atomics, bit-identical run to run) and dQ by fp32 atomics inside the dK/dV
kernel (``switches.attention.BACKWARD_DQ_ATOMIC``: one recompute, an fp32 buffer zeroed and cast, adds in varying order),
with the warp-specialized passes (Hopper, no mask) beside them where they apply. One JSON row per case: each
form's median backward ms (do_bench over the backward alone, on one forward's graph), its rel-L2 against the
default form, and whether two runs of it gave the same bits.

Run on the GPU:  PYTHONPATH=src python3 benchmarks/attention_dq_forms.py bench [OUT.json]
(scripts/gpu_check.sh: LABS="attention_dq_forms:bench")
"""
from __future__ import annotations

import sys

import torch
import triton

import tilefuse
from rows import collect
from tilefuse.kernels import switches

# (B, Hq, Hkv, N, d, causal, masked): the forward grid's d 64 / 128 rows at 16k tokens, GQA, and a masked row
# (a padding mask through scaled_dot_product_attention: the portable passes' own case)
CASES = [(16, 32, 32, 1024, 64, True, False), (4, 16, 16, 4096, 128, True, False),
         (1, 32, 8, 2048, 128, True, False), (4, 16, 16, 2048, 128, False, True)]
FORMS = {"dq pass": dict(BACKWARD_WS=False, BACKWARD_DQ_ATOMIC=False),
         "dq atomics": dict(BACKWARD_WS=False, BACKWARD_DQ_ATOMIC=True),
         "warp-specialized passes": dict(BACKWARD_WS=True, BACKWARD_DQ_ATOMIC=False)}


def _inputs(B, Hq, Hkv, N, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    return q, k, v, torch.randn(B, Hq, N, d, device="cuda", generator=g).to(torch.bfloat16)


def measure(case) -> dict:
    B, Hq, Hkv, N, d, causal, masked = case
    q, k, v, do = _inputs(B, Hq, Hkv, N, d)
    mask = None
    if masked:
        mask = torch.ones(B, 1, N, N, dtype=torch.bool, device="cuda")
        mask[:, :, :, N - N // 8:] = False  # the last eighth of the keys padded
    row = dict(case=list(case))
    default = None
    for name, values in FORMS.items():
        if name == "warp-specialized passes" and masked:
            continue
        with switches.overridden(switches.attention, **values):
            if mask is None:
                out = tilefuse.attention(q, k, v, causal=causal)
            else:
                out = tilefuse.scaled_dot_product_attention(q, k, v, mask, enable_gqa=Hq != Hkv)
            grads = [torch.autograd.grad(out, (q, k, v), do, retain_graph=True) for _ in range(2)]
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         return_mode="median")
        same = all(torch.equal(a, b) for a, b in zip(*grads))
        if default is None:
            default = grads[0]
        err = max(float((g.double() - r.double()).norm() / r.double().norm()) for g, r in zip(grads[0], default))
        row[name] = dict(ms=ms, rel_l2_vs_dq_pass=err, bit_identical_run_to_run=same)
    return row


def main(argv) -> None:
    if not argv or argv[0] != "bench":
        raise SystemExit(__doc__)
    collect((measure(case) for case in CASES), argv[1] if len(argv) > 1 else None)


if __name__ == "__main__":
    main(sys.argv[1:])

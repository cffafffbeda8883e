"""Compiler facts (registers, spills, shared memory, wgmma) of the GEMM kernel variants for sm_90a,
without a GPU. Run: PYTHONPATH=src python benchmarks/compile_check.py [OUT.json]"""
import json
import sys

from tilefuse import tuning
from tilefuse.harness.compiler import compile_sm90

TMA_SIGNATURE = {name: ("*bf16" if name.endswith("_ptr") else "i32") for name in
                 ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "wu_ptr", "bu_ptr", "M", "N", "K", "M_BUCKET",
                  "stride_xm", "stride_wn", "stride_wun", "stride_ym")}


def tma_variants():
    for activation, gated in (("gelu", False), ("swiglu", True)):
        for c in tuning.TMA_GEMM_CONFIGS:
            if gated and (c["bm"] * c["bn"] > 64 * 32 * c["warps"] or c["bn"] > 128):
                continue
            for ws in (False, True):
                yield activation, gated, c, ws


def main(out=None):
    rows = []
    for activation, gated, c, ws in tma_variants():
        consts = dict(HAS_BIAS=True, ACTIVATION=activation, GATED=gated, NUM_SMS=132, BLOCK_M=c["bm"],
                      BLOCK_N=c["bn"], BLOCK_K=c["bk"], GROUP_M=8, EPILOGUE_SUBTILE=True, WARP_SPECIALIZE=ws)
        facts = compile_sm90("tilefuse.kernels.gemm_tma", "linear_tma_kernel", TMA_SIGNATURE, consts, c["warps"], c["stages"])
        row = {"kernel": "linear_tma", "activation": activation, **c, "ws": ws, **facts}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])

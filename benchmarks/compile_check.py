"""Compiler facts (registers, spills, shared memory, wgmma) of the GEMM kernel variants for sm_90a,
without a GPU. Run: PYTHONPATH=src:benchmarks python benchmarks/compile_check.py [OUT.json [gemm|norm ...]]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tools: the sm_90a compiler

from rows import collect  # noqa: E402
from tilefuse.kernels.gemm.configs import TMA_GEMM_CONFIGS, prune_gated_configs, tma_config  # noqa: E402
from tools.compiler import compile_sm90  # noqa: E402

def tma_variants():
    """Every config of the space, gated ones too: rows record whether the launcher's prune keeps it,
    so the facts show why the pruned ones are pruned."""
    space = [tma_config(**c) for c in TMA_GEMM_CONFIGS]
    for activation, gated in (("gelu", False), ("swiglu", True)):
        kept_space = [(k.kwargs, k.num_warps, k.num_stages) for k in prune_gated_configs(space, {}, GATED=gated)]
        for c, cfg in zip(TMA_GEMM_CONFIGS, space):
            kept = (cfg.kwargs, cfg.num_warps, cfg.num_stages) in kept_space
            for ws in (False, True):
                yield activation, gated, c, ws, kept


def facts_rows():
    for activation, gated, c, ws, kept in tma_variants():
        consts = dict(HAS_BIAS=True, ACTIVATION=activation, GATED=gated, NORM=0, NUM_SMS=132, BLOCK_M=c["bm"],
                      BLOCK_N=c["bn"], BLOCK_K=c["bk"], GROUP_M=8, EPILOGUE_SUBTILE=c.get("subtile", True),
                      WARP_SPECIALIZE=ws)
        facts = compile_sm90("tilefuse.kernels.gemm.tma", "linear_tma_kernel", "*bf16", consts, c["warps"], c["stages"])
        yield {"kernel": "linear_tma", "activation": activation, **c, "ws": ws, "launcher_keeps": kept, **facts}


# layer_norm_linear's form, compiled as a launch at the bench shapes specializes it (N, K and the row
# strides multiples of 16): its row sums and register operand are what NORM adds to the main loop.
NORM_ALIGNED = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "wu_ptr", "bu_ptr", "N", "K", "stride_xm", "stride_wn",
                "stride_wun", "stride_ym")


def norm_rows():
    for norm in (1, 2):
        for c in TMA_GEMM_CONFIGS:
            consts = dict(HAS_BIAS=True, ACTIVATION="none", GATED=False, NORM=norm, NUM_SMS=132, BLOCK_M=c["bm"],
                          BLOCK_N=c["bn"], BLOCK_K=c["bk"], GROUP_M=8, EPILOGUE_SUBTILE=c.get("subtile", True),
                          WARP_SPECIALIZE=False)
            sig = {"*": "*bf16", "b_ptr": "*fp32", "bu_ptr": "*fp32", "eps": "fp32"}
            facts = compile_sm90("tilefuse.kernels.gemm.tma", "linear_tma_kernel", sig, consts, c["warps"],
                                 c["stages"], aligned=NORM_ALIGNED)
            yield {"kernel": "linear_tma", "norm": {1: "layer", 2: "rms"}[norm], **c, "ws": False, **facts}


def main(out=None, *which):
    """``which``: "gemm" (every linear/gated config), "norm" (layer_norm_linear's form); both by default."""
    which = which or ("gemm", "norm")
    rows = []
    if "gemm" in which:
        rows.append(facts_rows())
    if "norm" in which:
        rows.append(norm_rows())
    collect((r for gen in rows for r in gen), out)


if __name__ == "__main__":
    main(*sys.argv[1:])

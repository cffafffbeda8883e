"""Compiler facts (registers, spills, shared memory, wgmma) of the GEMM kernel variants for sm_90a,
without a GPU. Run: PYTHONPATH=src python benchmarks/compile_check.py [OUT.json]"""
import sys

from rows import collect
from tilefuse import tuning
from tilefuse.harness.compiler import compile_sm90
from tilefuse.kernels.gemm_epilogue import prune_gated_configs
from tilefuse.kernels.gemm_tma import _tma_config

def tma_variants():
    """Every config of the space, gated ones too: rows record whether the launcher's prune keeps it,
    so the facts show why the pruned ones are pruned."""
    space = [_tma_config(**c) for c in tuning.TMA_GEMM_CONFIGS]
    for activation, gated in (("gelu", False), ("swiglu", True)):
        kept_space = [(k.kwargs, k.num_warps, k.num_stages) for k in prune_gated_configs(space, {}, GATED=gated)]
        for c, cfg in zip(tuning.TMA_GEMM_CONFIGS, space):
            kept = (cfg.kwargs, cfg.num_warps, cfg.num_stages) in kept_space
            for ws in (False, True):
                yield activation, gated, c, ws, kept


def facts_rows():
    for activation, gated, c, ws, kept in tma_variants():
        consts = dict(HAS_BIAS=True, ACTIVATION=activation, GATED=gated, NORM=0, NUM_SMS=132, BLOCK_M=c["bm"],
                      BLOCK_N=c["bn"], BLOCK_K=c["bk"], GROUP_M=8, EPILOGUE_SUBTILE=c.get("subtile", True),
                      WARP_SPECIALIZE=ws)
        facts = compile_sm90("tilefuse.kernels.gemm_tma", "linear_tma_kernel", "*bf16", consts, c["warps"], c["stages"])
        yield {"kernel": "linear_tma", "activation": activation, **c, "ws": ws, "launcher_keeps": kept, **facts}


def main(out=None):
    collect(facts_rows(), out)


if __name__ == "__main__":
    main(*sys.argv[1:])

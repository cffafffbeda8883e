"""The Hopper kernels compile for sm_90a on any machine, and the GEMMs use wgmma.

The interpreter never compiles, so errors such as a plain-float global inside @triton.jit only showed
up on the GPU; compiling for sm_90a here (Triton ships LLVM and ptxas) catches them in CI.
"""
import pytest

from tilefuse.harness.compiler import compile_sm90


@pytest.mark.parametrize("activation,gated", [("gelu", False), ("swiglu", True)])
def test_tma_gemm_compiles_to_wgmma(activation, gated):
    consts = dict(HAS_BIAS=True, ACTIVATION=activation, GATED=gated, NUM_SMS=132, BLOCK_M=128, BLOCK_N=128,
                  BLOCK_K=64, GROUP_M=8, EPILOGUE_SUBTILE=True, WARP_SPECIALIZE=False)
    facts = compile_sm90("tilefuse.kernels.gemm_tma", "linear_tma_kernel", "*bf16", consts, num_warps=8, num_stages=4)
    assert facts["wgmma"], facts
    assert facts["shared"] <= 227 * 1024, facts  # the H200's shared memory per block


@pytest.mark.parametrize("split_k,gated", [(1, False), (4, True)])
def test_portable_gemm_compiles_for_sm90(split_k, gated):
    sig = {"*": "*fp16", "ws_ptr": "*fp32"}
    consts = dict(HAS_BIAS=True, ACTIVATION="geglu_tanh" if gated else "gelu_tanh", GATED=gated, SPLIT_K=split_k,
                  INPUT_PRECISION="tf32", UPCAST_DOT=False, BLOCK_M=128 if split_k == 1 else 16, BLOCK_N=64,
                  BLOCK_K=64 if split_k == 1 else 128, GROUP_M=8)
    facts = compile_sm90("tilefuse.kernels.gemm_epilogue", "linear_epilogue_kernel", sig, consts, num_warps=8, num_stages=4)
    assert facts["regs"] is not None, facts
    # wgmma needs 64-row warpgroup tiles: the 128-row tile must use it; 16-row split-K tiles use mma.
    assert facts["wgmma"] == (consts["BLOCK_M"] >= 64), facts


def test_split_k_epilogue_compiles_for_sm90():
    sig = {"*": "*bf16", "ws_ptr": "*fp32"}
    consts = dict(SPLIT_K=4, HAS_BIAS=True, ACTIVATION="swiglu", GATED=True, BLOCK=1024)
    facts = compile_sm90("tilefuse.kernels.gemm_epilogue", "splitk_epilogue_kernel", sig, consts, num_warps=4)
    assert facts["regs"] is not None and facts["spill_store_bytes"] == 0, facts


@pytest.mark.parametrize("dtype,gated,split_k", [("fp32", True, 1), ("fp32", False, 1), ("fp32", True, 4),
                                                 ("bf16", True, 1)])
def test_first_kept_portable_config_fits_shared_memory(dtype, gated, split_k):
    """The GPU tests pin each kernel's first kept config: it must launch. (fp32 gated 128x128x64 with 4
    stages asked for 288 KB on the H200.) The model the prune uses must not under-count the compiler."""
    import torch

    from tilefuse import tuning
    from tilefuse.kernels.gemm_epilogue import SMEM_LIMIT, portable_smem_bytes, prune_portable_configs

    space = tuning.PORTABLE_GEMM_CONFIGS if split_k == 1 else tuning.SPLIT_K_GEMM_CONFIGS
    x = torch.empty(1, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    cfg = prune_portable_configs(space, {"x_ptr": x}, GATED=gated)[0]
    consts = dict(HAS_BIAS=True, ACTIVATION="swiglu" if gated else "gelu", GATED=gated, SPLIT_K=split_k,
                  INPUT_PRECISION="ieee", UPCAST_DOT=False, **cfg.kwargs)
    facts = compile_sm90("tilefuse.kernels.gemm_epilogue", "linear_epilogue_kernel",
                         {"*": f"*{dtype}", "ws_ptr": "*fp32"}, consts, cfg.num_warps, cfg.num_stages)
    model = portable_smem_bytes(cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"],
                                cfg.num_stages, x.element_size(), gated)
    assert facts["shared"] <= model <= SMEM_LIMIT, (cfg, facts, model)

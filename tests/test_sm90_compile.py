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

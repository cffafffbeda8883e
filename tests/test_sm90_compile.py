"""The Hopper kernels compile for sm_90a on any machine, and the GEMMs use wgmma.

The interpreter never compiles, so errors such as a plain-float global inside @triton.jit only showed
up on the GPU; compiling for sm_90a here (Triton ships LLVM and ptxas) catches them in CI.
"""

import pytest

from helpers import representative
from tools.compiler import compile_gluon_sm90, compile_sm90


@pytest.mark.parametrize("activation,gated,norm,save_slope", representative([
    ("gelu", False, 1, True), ("swiglu", True, 0, True), ("none", False, 2, False),
    ("gelu", False, 0, False), ("swiglu", True, 0, False), ("gelu", False, 1, False), ("gelu", False, 0, True)],
    keep=3))
def test_tma_gemm_compiles_to_wgmma(activation, gated, norm, save_slope):
    """norm=1, 2: layer_norm_linear's form, whose main loop is plain linear's (x and W both wgmma's shared
    operands) and whose epilogue applies the pre-pass's row statistics: no spills on the largest tile
    (128x256, 8 warps) the tuner offers it."""
    consts = dict(HAS_BIAS=True, ACTIVATION=activation, GATED=gated, NORM=norm, NUM_SMS=132, BLOCK_M=128,
                  BLOCK_N=256 if norm else 128, BLOCK_K=64, GROUP_M=8, EPILOGUE_SUBTILE=True, WARP_SPECIALIZE=False,
                  SAVE_SLOPE=save_slope)
    sig = {"*": "*bf16", "b_ptr": "*fp32", "bu_ptr": "*fp32", "su_ptr": "*fp32"} if norm else "*bf16"
    # Aligned as at the bench shapes (N, K and row strides multiples of 16), which the spill check is about.
    aligned = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "wu_ptr", "bu_ptr", "s_ptr", "su_ptr", "N", "K", "stride_xm",
               "stride_wn", "stride_wun", "stride_ym")
    facts = compile_sm90("tilefuse.kernels.gemm.tma", "linear_tma_kernel", sig, consts, num_warps=8,
                         num_stages=3 if norm else 4, aligned=aligned)
    assert facts["wgmma"], facts
    assert not facts["wgmma_a_in_registers"], facts
    assert facts["shared"] <= 227 * 1024, facts  # the H200's shared memory per block
    if norm:
        assert facts["spill_store_bytes"] == 0, facts


@pytest.mark.parametrize("split_k,gated", [(1, False), (4, True)])
def test_portable_gemm_compiles_for_sm90(split_k, gated):
    sig = {"*": "*fp16", "ws_ptr": "*fp32", "counter_ptr": "*i32"}
    consts = dict(HAS_BIAS=True, ACTIVATION="geglu_tanh" if gated else "gelu_tanh", GATED=gated, SPLIT_K=split_k, SAVE_SLOPE=False,
                  INPUT_PRECISION="tf32", UPCAST_DOT=False, BLOCK_M=128 if split_k == 1 else 16, BLOCK_N=64,
                  BLOCK_K=64 if split_k == 1 else 128, GROUP_M=8)
    facts = compile_sm90("tilefuse.kernels.gemm.portable", "linear_epilogue_kernel", sig, consts, num_warps=8, num_stages=4)
    assert facts["regs"] is not None, facts
    # wgmma needs 64-row warpgroup tiles: the 128-row tile must use it; 16-row split-K tiles use mma.
    assert facts["wgmma"] == (consts["BLOCK_M"] >= 64), facts


def test_split_k_reduces_in_one_launch_with_an_ordered_counter():
    """Single-launch split-K: the last program of a tile to arrive reduces the partials. The arrival
    count must be an acquire-release atomic at GPU scope (a relaxed one would let the reducer read
    partials not yet visible), and the reducing code must not spill."""
    sig = {"*": "*bf16", "ws_ptr": "*fp32", "counter_ptr": "*i32"}
    consts = dict(HAS_BIAS=True, ACTIVATION="swiglu", GATED=True, SPLIT_K=5, SAVE_SLOPE=False, INPUT_PRECISION="tf32",
                  UPCAST_DOT=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1)
    aligned = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "wu_ptr", "bu_ptr", "ws_ptr", "N", "K", "K_SPLIT_LEN",
               "stride_xm", "stride_wn", "stride_wun", "stride_ym")  # as a launch on aligned tensors is
    facts = compile_sm90("tilefuse.kernels.gemm.portable", "linear_epilogue_kernel", sig, consts, num_warps=4,
                         num_stages=4, aligned=aligned)
    assert facts["spill_store_bytes"] == 0, facts
    assert any(".gpu" in a and ".acq_rel" in a and ".add" in a for a in facts["atomics"]), facts
    assert any(".exch" in a for a in facts["atomics"]), facts  # the reducer's reset to 0


@pytest.mark.parametrize("dtype,gated,split_k,precision", representative([
    ("fp32", True, 1, "ieee"), ("bf16", True, 1, "ieee"), ("fp32", False, 1, "ieee"), ("fp32", True, 4, "ieee"),
    ("fp32", False, 1, "tf32"), ("fp32", True, 1, "tf32")], keep=2))
def test_first_kept_portable_config_fits_shared_memory(dtype, gated, split_k, precision):
    """The GPU tests pin each kernel's first kept config: it must launch. (fp32 gated 128x128x64 with 4
    stages asked for 288 KB on the H200.) The model the prune uses must not under-count the compiler."""
    import torch

    from tilefuse.kernels.gemm.configs import (PORTABLE_GEMM_CONFIGS, SMEM_LIMIT, SPLIT_K_GEMM_CONFIGS,
                                               portable_smem_bytes, prune_portable_configs)

    space = PORTABLE_GEMM_CONFIGS if split_k == 1 else SPLIT_K_GEMM_CONFIGS
    x = torch.empty(1, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    cfg = prune_portable_configs(space, {"x_ptr": x}, GATED=gated, INPUT_PRECISION=precision)[0]
    consts = dict(HAS_BIAS=True, ACTIVATION="swiglu" if gated else "gelu", GATED=gated, SPLIT_K=split_k, SAVE_SLOPE=False,
                  INPUT_PRECISION=precision, UPCAST_DOT=False, **cfg.kwargs)
    facts = compile_sm90("tilefuse.kernels.gemm.portable", "linear_epilogue_kernel",
                         {"*": f"*{dtype}", "ws_ptr": "*fp32"}, consts, cfg.num_warps, cfg.num_stages)
    model = portable_smem_bytes(cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"],
                                cfg.num_stages, x.element_size(), gated,
                                tensor_cores=not (dtype == "fp32" and precision == "ieee"))
    assert facts["shared"] <= model <= SMEM_LIMIT, (cfg, facts, model)


@pytest.mark.parametrize("mask_type,use_desc", [("*u8", True), ("*fp16", False)])
def test_first_kept_attention_config_with_a_mask_fits_shared_memory(mask_type, use_desc):
    """sdpa with a mask at d = 128 (fp16) failed to launch on the H200: the mask's layout conversion
    takes an fp32 score tile of shared memory on top of Q, K and V. The first kept config (pinned in the
    GPU tests) and the small-work heuristic config must fit; compiled without divisibility hints, the
    worst case (a mask row stride such as 300)."""
    import torch

    from tilefuse.kernels.attention import launch as att

    q = torch.empty(1, dtype=torch.float16)
    first = att._prune(att.GPU_CONFIGS, {"q_ptr": q}, BLOCK_D=128, USE_DESC=use_desc, HAS_MASK=True)[0]
    for cfg in (first, att.heuristic_config(128, 2)):
        consts = dict(HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_LEFT=False, HAS_RIGHT=True, HAS_MASK=True, MASK_IS_BOOL=mask_type == "*u8",
                      STORE_LSE=False, EVEN_D=True, USE_DESC=use_desc, INPUT_PRECISION="tf32",
                      UPCAST_DOT=False, BLOCK_M=cfg.kwargs["BLOCK_M"], BLOCK_N=cfg.kwargs["BLOCK_N"], BLOCK_D=128)
        facts = compile_sm90("tilefuse.kernels.attention.portable", "attention_fwd_kernel",
                             {"*": "*fp16", "lse_ptr": "*fp32", "mask_ptr": mask_type}, consts,
                             cfg.num_warps, cfg.num_stages)
        assert facts["shared"] <= 227 * 1024, (cfg, facts)


@pytest.mark.parametrize("shape,residual", [((4096, 16384), True), ((2048, 131072), False)])
def test_pipelined_norm_configs_fit_shared_memory(shape, residual):
    """Pipelined norm-forward loops (LOOP_STAGES > 1) buffer every tile they load in shared memory.
    The kept config with the largest modeled buffers, compiled as a launch on aligned rows would be
    (the pipeliner only buffers vectorizable loads), must fit, and the model must not under-count."""
    import torch

    from tilefuse.kernels.norms import launch as nm

    M, N = shape
    x = torch.empty(1, dtype=torch.bfloat16)
    kept = nm._prune_fwd(nm.norm_fwd_tuned.configs, {"N": N, "M": M, "x_ptr": x},
                         HAS_RESIDUAL=residual, HAS_WEIGHT=True, HAS_BIAS=True)
    first = kept[0].kwargs
    assert first["LOOP_STAGES"] == 1 and first["BLOCK_N"] == min(N, nm.GPU_MAX_BLOCK_N)  # the old choice first
    cfg = max(kept, key=lambda c: nm.fwd_smem_bytes(c, 2, residual, True, True))
    model = nm.fwd_smem_bytes(cfg, 2, residual, True, True)
    assert cfg.kwargs["LOOP_STAGES"] > 1 and 0 < model <= nm.FWD_SMEM_BUDGET
    consts = dict(IS_RMS=False, HAS_RESIDUAL=residual, HAS_WEIGHT=True, HAS_BIAS=True, STORE_Y=True, **cfg.kwargs)
    sig = {"*": "*bf16", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "eps": "fp32"}
    aligned = ("x_ptr", "res_ptr", "w_ptr", "b_ptr", "y_ptr", "h_ptr", "N",
               "stride_xm", "stride_rm", "stride_ym", "stride_hm")
    facts = compile_sm90("tilefuse.kernels.norms.kernels", "norm_fwd_kernel", sig, consts, cfg.num_warps, 3,
                         aligned=aligned)
    assert facts["shared"] <= 227 * 1024, (cfg, facts, model)
    assert facts["shared"] >= model // 2, ("the loop was not pipelined", cfg, facts, model)
    assert facts["shared"] <= model + 2048, ("the model under-counts", cfg, facts, model)


def test_fp32_ieee_attention_tile_does_not_spill():
    """fp32 "ieee" attention runs tl.dot on FMA units: the 16-bit tiles spilled 40-105 KB per thread
    there (and took a minute to compile). The FMA-path tile chosen at d = 128 must not spill."""
    import torch

    from tilefuse.kernels.attention import launch as att

    q = torch.empty(1, dtype=torch.float32)
    cfg = att._prune(att.attention_fwd_tuned.configs, {"q_ptr": q}, BLOCK_D=128, USE_DESC=False,
                     HAS_MASK=False, INPUT_PRECISION="ieee")[0]
    assert cfg is att.heuristic_config(128, 4, "ieee")
    consts = dict(HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_LEFT=True, HAS_RIGHT=True, HAS_MASK=False, MASK_IS_BOOL=False, STORE_LSE=True, EVEN_D=True,
                  USE_DESC=False, INPUT_PRECISION="ieee", UPCAST_DOT=False, BLOCK_D=128, **cfg.kwargs)
    facts = compile_sm90("tilefuse.kernels.attention.portable", "attention_fwd_kernel", {"*": "*fp32"}, consts,
                         cfg.num_warps, cfg.num_stages)
    assert facts["spill_store_bytes"] == 0, (cfg, facts)


@pytest.mark.parametrize("backward,dtype,algorithm,persistent", [
    (False, "bf16", "two_pass", False), (False, "fp32", "online", False), (True, "fp32", None, False),
    (False, "bf16", "online", True), (True, "bf16", None, True)])
def test_pipelined_softmax_loop_configs_fit_shared_memory(backward, dtype, algorithm, persistent):
    """The softmax chunk loops with LOOP_STAGES > 1: the kept config with the largest modeled buffers
    compiles (aligned rows, so the loads pipeline) within shared memory, and the model bounds it; the
    persistent variants too (their chunk loops sit inside the loop over rows and must still pipeline)."""
    import torch

    from tilefuse.kernels.softmax import launch as sm

    t = torch.empty(1, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    named = {"y_ptr": t, "dy_ptr": t} if backward else {"x_ptr": t}
    kept = [c for c in sm._prune_loop(sm._LOOP_CONFIGS, named) if (c.kwargs["PROGRAMS_PER_SM"] > 0) == persistent]
    cfg = max(kept, key=lambda c: sm.loop_smem_bytes(c, t.element_size(), backward))
    model = sm.loop_smem_bytes(cfg, t.element_size(), backward)
    assert cfg.kwargs["LOOP_STAGES"] > 1 and model <= sm.LOOP_SMEM_BUDGET
    consts = dict(SINGLE_BLOCK=False, WIDE=False, **cfg.kwargs)
    if backward:
        kernel, aligned = "softmax_bwd_kernel", ("y_ptr", "dy_ptr", "dx_ptr", "N", "stride_yo", "stride_yi",
                                                 "stride_dyo", "stride_dyi", "stride_dxo", "stride_dxi")
    else:
        kernel, aligned = "softmax_fwd_kernel", ("x_ptr", "y_ptr", "N", "stride_xo", "stride_xi", "stride_yo",
                                                 "stride_yi")
        consts["ALGORITHM"] = algorithm
    # Unit column strides, as a launch on contiguous rows specializes them.
    consts.update({k: 1 for k in ("stride_xn", "stride_yn", "stride_dyn", "stride_dxn")
                   if k in (("stride_yn", "stride_dyn", "stride_dxn") if backward else ("stride_xn", "stride_yn"))})
    facts = compile_sm90("tilefuse.kernels.softmax.kernels", kernel, f"*{dtype}", consts, cfg.num_warps, 3, aligned=aligned)
    assert 0 < facts["shared"] <= model + 2048 <= 227 * 1024, (cfg, facts, model)
    assert facts["shared"] >= model // 3, ("the loops were not pipelined", cfg, facts, model)


@pytest.mark.parametrize("block_d,causal", [(128, False), (128, True), (64, False)])
def test_register_capped_attention_tiles_fit_more_ctas_per_sm(block_d, causal):
    """The maxnreg attention configs exist to put 2 (d = 128) or 3 (d = 64) CTAs on an SM. Compiled as
    the GPU compiles them (aligned strides, descriptors) they must meet their cap, not spill beyond a
    few bytes, and fit that many CTAs in registers and shared memory."""
    import torch

    from tilefuse.kernels.attention import launch as att

    q = torch.empty(1, dtype=torch.bfloat16)
    kept = att._prune(att.GPU_CONFIGS, {"q_ptr": q}, BLOCK_D=block_d, USE_DESC=True, HAS_MASK=False)
    capped = [c for c in kept if c.maxnreg is not None]
    assert len(capped) == 1, kept
    cfg = capped[0]
    consts = dict(HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_LEFT=False, HAS_RIGHT=causal, HAS_MASK=False, MASK_IS_BOOL=False, STORE_LSE=False,
                  EVEN_D=True, USE_DESC=True, INPUT_PRECISION="tf32", UPCAST_DOT=False,
                  BLOCK_M=cfg.kwargs["BLOCK_M"], BLOCK_N=cfg.kwargs["BLOCK_N"], BLOCK_D=block_d)
    aligned = tuple(f"stride_{t}{a}" for t in "qkvo" for a in ("b", "h", "m" if t in "qo" else "n"))
    facts = compile_sm90("tilefuse.kernels.attention.portable", "attention_fwd_kernel",
                         {"*": "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32"}, consts, cfg.num_warps,
                         cfg.num_stages, aligned=aligned, maxnreg=cfg.maxnreg)
    ctas = min(65536 // (facts["regs"] * 32 * cfg.num_warps), (228 * 1024) // (facts["shared"] + 1024))
    assert facts["regs"] <= cfg.maxnreg and facts["spill_store_bytes"] <= 8, facts
    assert ctas >= (2 if block_d == 128 else 3), (facts, ctas)
    # and the fp32 / d = 256 launches never get a cap sized for 16-bit d <= 128 tiles
    for elem_dtype, d in ((torch.float32, 128), (torch.bfloat16, 256)):
        kept = att._prune(att.GPU_CONFIGS, {"q_ptr": torch.empty(1, dtype=elem_dtype)}, BLOCK_D=d,
                          USE_DESC=True, HAS_MASK=False, INPUT_PRECISION="tf32")
        assert all(c.maxnreg is None for c in kept)


@pytest.mark.parametrize("gamma,beta", [(True, True), (False, False)])
def test_weight_fold_compiles_for_sm90(gamma, beta):
    """layer_norm_linear's per-call weight fold (W * gamma, column sums, folded bias)."""
    from tilefuse.kernels.gemm import configs as nl
    sig = {"*": "*bf16", "colsum_ptr": "*fp32", "shift_ptr": "*fp32"}
    consts = dict(HAS_GAMMA=gamma, HAS_BETA=beta, HAS_BIAS=True, NEED_COLSUM=True, BLOCK_N=nl.FOLD_BLOCK_N,
                  BLOCK_K=nl.FOLD_BLOCK_K)
    facts = compile_sm90("tilefuse.kernels.gemm.norm_prologue", "weight_fold_kernel", sig, consts,
                         num_warps=nl.FOLD_WARPS, aligned=("w_ptr", "wf_ptr", "K", "stride_wn", "stride_wfn"))
    assert facts["regs"] is not None and facts["spill_store_bytes"] == 0, facts


@pytest.mark.parametrize("head_dim,has_left,has_right,device_desc", representative([
    (128, False, True, True), (256, False, False, False), (64, False, False, True), (128, True, True, False),
    (96, False, False, True), (80, True, True, False), (192, False, True, True)], keep=2))
def test_warp_specialized_attention_compiles_to_partitions(head_dim, has_left, has_right, device_desc):
    """The Gluon attention kernel is warp-specialized on sm_90a (Triton 3.6's tl code is not): the TTGIR
    holds the partitions, the producer's warpgroup gives its registers away (setmaxnreg 24) and the
    consumers take 240, 12 warps run, wgmma takes P from registers, and nothing spills; also at the head dims
    that run in wider tiles (80 and 96 in 128, 160 and 192 in 256) and at 256 (64-key tiles)."""
    facts = compile_gluon_sm90("tools.compiler", "attention_ws_compile_job",
                               dict(head_dim=head_dim, has_left=has_left, has_right=has_right,
                                    config=dict(DEVICE_DESC=device_desc)))
    assert facts["warp_specialized"] and facts["wgmma"] and facts["wgmma_a_in_registers"], facts
    assert {24, 240} <= set(facts["setmaxnreg"]) and facts["threads"] == 384, facts
    assert facts["spill_store_bytes"] == 0 and facts["shared"] <= 227 * 1024, facts


@pytest.mark.parametrize("gemm,activation,db", representative([
    ("gated", "swiglu", False), ("gated_dx", None, False), ("dW", None, True), ("forward", "gelu", False),
    ("gated", "geglu", False), ("dx", None, False), ("dW", None, False)], keep=3))
def test_cooperative_gemm_compiles(gemm, activation, db):
    """The cooperative Gluon GEMM (tilefuse.kernels.gemm.coop) at the configs the launch takes for each form --
    the gated forward (SwiGLU / GeGLU: two accumulators per consumer) and the backward's two GEMMs (dW with and
    without db; dx plain and gated, the gated one walking both branches' slopes and weights) -- and the plain forward Linear+GELU at coop.DEFAULT: partitions, setmaxnreg 24/240, the
    backward's g made in registers as wgmma's A operand (for dW through a transposed load), the wgmmas not
    serialised by ptxas (it serialises them when a register operand stays in flight across the loop), no
    spills, and the ring within the shared memory."""
    facts = compile_gluon_sm90("tools.compiler", "gemm_coop_ws_compile_job",
                               dict(gemm=gemm, activation=activation, db=db))
    assert facts["warp_specialized"] and facts["wgmma"], facts
    assert facts["wgmma_a_in_registers"] == (gemm in ("dx", "gated_dx", "dW")), facts
    assert not facts["wgmma_serialized"], facts
    assert {24, 240} <= set(facts["setmaxnreg"]) and facts["threads"] == 384, facts
    assert facts["spill_store_bytes"] == 0 and facts["shared"] <= 227 * 1024, facts


@pytest.mark.parametrize("which,head_dim,causal,sliding", [
    ("dkdv", 64, False, False), ("dkdv", 128, True, False), ("dq", 128, True, False), ("dkdv", 128, True, True),
    ("dq", 128, True, True)])
def test_warp_specialized_attention_backward_compiles(which, head_dim, causal, sliding):
    """The Gluon backward passes (tilefuse.kernels.attention.ws_backward) as the launch runs them: partitions,
    setmaxnreg 24/240, P^T and dS^T (dS in the dQ pass) as wgmma's register operand, no spills at d 128 (dK/dV:
    two [64, 128] fp32 accumulators beside the score tiles; the row terms enter as the score accumulators'
    initial values to fit), with the sliding window's second edge mask too, wgmmas not serialised."""
    facts = compile_gluon_sm90("tools.compiler", "attention_bwd_ws_compile_job",
                               dict(head_dim=head_dim, causal=causal, which=which, sliding=sliding))
    assert facts["warp_specialized"] and facts["wgmma"] and facts["wgmma_a_in_registers"], facts
    assert not facts["wgmma_serialized"], facts
    assert {24, 240} <= set(facts["setmaxnreg"]) and facts["threads"] == 384, facts
    assert facts["spill_store_bytes"] == 0 and facts["shared"] <= 227 * 1024, facts


@pytest.mark.parametrize("kernel,slope,gated", representative([
    ("grad_input_kernel", True, True), ("grad_weight_kernel", True, False), ("grad_input_kernel", True, False),
    ("grad_input_kernel", False, False), ("grad_weight_kernel", False, False)], keep=2))
def test_backward_gemms_compile_to_wgmma_and_fit(kernel, slope, gated):
    """The backward GEMMs (g = dy * slope made in the operand loads) on the first config the prune keeps for
    bf16: they must compile for sm_90a, feed wgmma, fit the shared memory the model allows and not spill
    (a spilling A-operand prologue would cost more than the fusion saves)."""
    import importlib

    import torch

    from tilefuse.kernels.gemm.configs import PORTABLE_GEMM_CONFIGS, SMEM_LIMIT, prune_backward_configs

    dy = torch.empty(1, dtype=torch.bfloat16)
    cfg = prune_backward_configs(PORTABLE_GEMM_CONFIGS, {"dy_ptr": dy}, HAS_SLOPE=slope, INPUT_PRECISION="tf32")[0]
    # grad_weight sums db only from a g it makes (a slope): without one the launcher sums dy itself
    consts = dict(HAS_SLOPE=slope, GATED=gated, HAS_BIAS=slope, TWO_ROW_STRIDES=False, INPUT_PRECISION="tf32",
                  UPCAST_DOT=False, **cfg.kwargs)
    # Unit inner strides, which Triton specializes at launch (an int argument equal to 1 is a constant).
    for unit in ("stride_dyn", "stride_sn", "stride_wk", "stride_wuk", "stride_dxk", "stride_xk", "stride_dwk"):
        consts[unit] = 1
    params = importlib.import_module("tilefuse.kernels.gemm.backward").__dict__[kernel].arg_names
    consts = {k: v for k, v in consts.items() if k in params}
    aligned = tuple(a for a in ("dy_ptr", "s_ptr", "su_ptr", "w_ptr", "wu_ptr", "dx_ptr", "x_ptr", "dw_ptr", "N", "K",
                                "stride_dym", "stride_sm", "stride_wn", "stride_wun", "stride_dxm", "stride_xm",
                                "stride_dwn") if a in params)
    facts = compile_sm90("tilefuse.kernels.gemm.backward", kernel, "*bf16", consts, cfg.num_warps, cfg.num_stages,
                         aligned=aligned)
    assert facts["wgmma"], facts
    assert facts["shared"] <= SMEM_LIMIT, facts
    assert facts["spill_store_bytes"] == 0, facts


@pytest.mark.parametrize("kernel,d", representative([
    ("attention_bwd_dkdv_kernel", 128), ("attention_bwd_dq_kernel", 256), ("attention_bwd_dkdv_kernel", 80),
    ("attention_bwd_dkdv_kernel", 64), ("attention_bwd_dkdv_kernel", 256), ("attention_bwd_dq_kernel", 64),
    ("attention_bwd_dq_kernel", 80), ("attention_bwd_dq_kernel", 128)], keep=3))
def test_attention_backward_compiles_for_sm90(kernel, d):
    """The attention backward kernels on the tiles the launch layer gives them (launch.backward_config):
    they compile for sm_90a, fit shared memory, and feed wgmma where the tiles have 64 rows (d <= 128)."""
    import importlib

    from tilefuse.kernels.attention.launch import SMEM_LIMIT, backward_config

    from tilefuse.kernels.attention.launch import BACKWARD_DKDV_STAGES

    block_d = max(16, 1 << (d - 1).bit_length())
    cfg = backward_config(block_d, 2, interpret=False)
    stages = BACKWARD_DKDV_STAGES if kernel == "attention_bwd_dkdv_kernel" and cfg["BLOCK_M"] == 64 \
        else cfg["num_stages"]
    consts = dict(HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_LEFT=False, HAS_RIGHT=True, HAS_MASK=False, MASK_IS_BOOL=False, INPUT_PRECISION="tf32",
                  UPCAST_DOT=False, HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d)
    params = importlib.import_module("tilefuse.kernels.attention.backward").__dict__[kernel].arg_names
    for unit in ("stride_qd", "stride_kd", "stride_vd", "stride_dod", "stride_dkd", "stride_dvd", "stride_dqd"):
        if unit in params:
            consts[unit] = 1  # Triton specializes a unit stride at launch
    sig = {"*": "*bf16", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "mask_ptr": "*fp32", "qk_scale": "fp32",
           "scale": "fp32"}
    # As a launch on [B, H, N, d] tensors specializes them: 16-byte pointers, row, head and batch strides
    # multiples of 16.
    aligned = tuple(a for a in params if a in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr", "dq_ptr")
                    or (a.startswith("stride_") and a[-1] in "bhmn" and "mask" not in a and "alibi" not in a))
    facts = compile_sm90("tilefuse.kernels.attention.backward", kernel, sig, consts, cfg["num_warps"],
                         stages, aligned=aligned)
    assert facts["shared"] <= SMEM_LIMIT, facts
    assert facts["wgmma"] == (cfg["BLOCK_M"] >= 64), facts
    # The head dim is a constexpr, so the head-dim mask's constancy is known and the tiles load 16 bytes at a
    # time (a runtime bound on the contiguous dimension made every load one 16-bit element).
    assert facts["scalar_16bit_loads"] == 0, facts
    if d in (64, 128):
        # dK/dV with keys as rows (S^T = K Q^T): P^T and dS^T feed dV and dK from registers (S = Q K^T with
        # P and dS transposed through shared memory spilled 76 bytes at d 128), at one stage.
        assert facts["spill_store_bytes"] == 0, facts


@pytest.mark.parametrize("kernel", ["attention_fwd_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"])
def test_attention_varlen_and_modifiers_compile_for_sm90(kernel):
    """Packed sequences with softcap and ALiBi (the variant with every new constexpr on) compile for sm_90a
    with the portable pointer loads and feed wgmma (d = 128, 64-row tiles)."""
    import importlib

    module = "tilefuse.kernels.attention." + ("portable" if kernel == "attention_fwd_kernel" else "backward")
    params = importlib.import_module(module).__dict__[kernel].arg_names
    consts = dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_MASK=False, MASK_IS_BOOL=False, HAS_SOFTCAP=True,
                  HAS_ALIBI=True, VARLEN=True, STORE_LSE=True, EVEN_D=True, HEAD_DIM=128, USE_DESC=False, INPUT_PRECISION="tf32",
                  UPCAST_DOT=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, FLAT_GRID=False)
    sig = {"*": "*bf16", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "mask_ptr": "*fp32", "qk_scale": "fp32",
           "scale": "fp32", "softcap_log2": "fp32", "alibi_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}
    facts = compile_sm90(module, kernel, {k: v for k, v in sig.items() if k == "*" or k in params},
                         {k: v for k, v in consts.items() if k in params}, 8, 2)
    assert facts["wgmma"], facts


@pytest.mark.parametrize("rope,norm", [(False, False), (True, True)])
def test_qkv_projection_compiles_to_wgmma(rope, norm):
    """The head-layout QKV kernel at d = 128 (rotary halves of 64) compiles for sm_90a and feeds wgmma."""
    consts = dict(HAS_BIAS=True, HAS_ROPE=rope, INTERLEAVED=False, HAS_NORM=norm, INPUT_PRECISION="tf32",
                  UPCAST_DOT=False, BLOCK_M=64,
                  BLOCK_R=64, BLOCK_P=16 if rope else 128, BLOCK_K=64)
    sig = {"*": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32"}
    facts = compile_sm90("tilefuse.kernels.gemm.qkv", "qkv_projection_kernel", sig, consts, 4, 3,
                         aligned=("x_ptr", "w_ptr", "out_ptr", "K", "stride_xm", "stride_wn"), ones=("stride_wk",))
    assert facts["wgmma"], facts


@pytest.mark.parametrize("d,rope,norm,interleaved", representative([
    (128, True, True, False), (256, True, True, False), (64, True, False, False), (128, False, False, False),
    (128, True, False, False), (128, True, False, True)], keep=2))
def test_qkv_projection_head_kernel_compiles_without_spills(d, rope, norm, interleaved):
    """The one-loop QKV kernel (the head's d columns in one accumulator, the RoPE pairs split in registers), as
    launch.qkv_projection launches it (4 warps, 8 at d 256; 3 stages; 64 rows): wgmma, no spill, 16-byte tile
    loads."""
    consts = dict(HAS_BIAS=True, HAS_ROPE=rope, INTERLEAVED=interleaved, HAS_NORM=norm, INPUT_PRECISION="tf32",
                  UPCAST_DOT=False, BLOCK_M=64, BLOCK_D=d, BLOCK_K=64)
    sig = {"*": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32"}
    aligned = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "cos_ptr", "sin_ptr", "norm_w_ptr", "K", "HEAD_DIM", "stride_xm",
               "stride_wn", "stride_ob", "stride_oh", "stride_on", "stride_cb", "stride_cn")
    facts = compile_sm90("tilefuse.kernels.gemm.qkv", "qkv_projection_head_kernel", sig, consts, 8 if d >= 256 else 4,
                         3, aligned=aligned, ones=("stride_wk",))
    assert facts["wgmma"], facts
    assert facts["spill_store_bytes"] == 0, facts
    assert facts["scalar_16bit_loads"] <= 2, facts  # the 1-D bias and norm-weight vectors at most (tiles: 16 B)


@pytest.mark.parametrize("d,rope,norm,w_kn", representative([
    (128, True, True, False), (64, True, False, True), (128, False, False, False), (128, True, False, True),
    (256, True, True, False)], keep=2))
def test_qkv_projection_tma_kernel_compiles_to_wgmma_without_spills(d, rope, norm, w_kn):
    """The Hopper QKV kernel at the tiles launch.QKV_TMA_TILES gives each head dim and epilogue, in nn.Linear's
    weight layout and Conv1D's transposed one: wgmma fed from shared memory (TMA tiles), no spill with the
    RoPE and QK-norm epilogue, within the H200's shared memory. The tiles arrive by TMA, so the only 16-bit
    scalar loads are of the bias vector, in the layout RoPE's pair split gives it (16-32 per tile)."""
    from tilefuse.kernels.gemm.launch.qkv import QKV_TMA_BLOCK_K, QKV_TMA_GROUP_M, QKV_TMA_TILES
    block_m, per_tile, warps, stages = QKV_TMA_TILES[d, rope or norm]
    consts = dict(HAS_BIAS=True, HAS_ROPE=rope, INTERLEAVED=False, HAS_NORM=norm, W_KN=w_kn, NUM_SMS=132,
                  BLOCK_M=block_m, HEAD_DIM=d, HEADS_PER_TILE=per_tile, BLOCK_K=QKV_TMA_BLOCK_K,
                  GROUP_M=QKV_TMA_GROUP_M)
    facts = _qkv_tma_compiles_spill_free("qkv_projection_tma_kernel", consts, warps, stages)
    assert facts["scalar_16bit_loads"] <= 32, facts


def _qkv_tma_compiles_spill_free(kernel: str, consts: dict, warps: int, stages: int) -> dict:
    """One Hopper QKV kernel compiled for sm_90a at aligned bench-like strides: wgmma fed from shared memory,
    no spill, within the H200's shared memory. Returns the compiler's facts."""
    sig = {"*": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32"}
    aligned = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "cos_ptr", "sin_ptr", "norm_w_ptr", "K", "stride_xm",
               "stride_w", "stride_ob", "stride_oh", "stride_on", "stride_cb", "stride_cn")
    facts = compile_sm90("tilefuse.kernels.gemm.qkv", kernel, sig, consts, warps, stages, aligned=aligned)
    assert facts["wgmma"] and not facts["wgmma_a_in_registers"], facts
    assert facts["spill_store_bytes"] == 0, facts
    assert facts["shared"] <= 227 * 1024, facts
    return facts


@pytest.mark.parametrize("d,r,norm,w_kn", representative([
    (96, 96, True, False), (80, 32, False, True), (192, 0, False, False), (160, 160, True, False),
    (128, 32, True, False)], keep=2))
def test_qkv_projection_tma_parts_kernel_compiles_to_wgmma_without_spills(d, r, norm, w_kn):
    """The Hopper QKV kernel's parts form (launch.qkv_tma_parts_tile) for the head dims the whole-head form does
    not take and for partial rotary: wgmma from shared memory, no spill, within the H200's shared memory (d and
    r are constexprs so the parts' column masks fold; NOTES.md has the runtime-argument form's spills)."""
    from tilefuse.kernels.gemm.launch.qkv import QKV_TMA_BLOCK_K, QKV_TMA_GROUP_M, qkv_tma_parts_tile
    tile = qkv_tma_parts_tile(d, r, r > 0)
    warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    consts = dict(HEAD_DIM=d, ROT=r, HAS_BIAS=True, HAS_ROPE=r > 0, HAS_NORM=norm, W_KN=w_kn, NUM_SMS=132,
                  BLOCK_K=QKV_TMA_BLOCK_K, GROUP_M=QKV_TMA_GROUP_M, **tile)
    _qkv_tma_compiles_spill_free("qkv_projection_tma_parts_kernel", consts, warps, stages)


@pytest.mark.parametrize("flags", [dict(HAS_BIAS=True, HAS_SLOPE=True, DW_KN=False),
                                   dict(HAS_BIAS=False, HAS_SLOPE=False, DW_KN=True)])
def test_hopper_grad_weight_compiles_to_wgmma_without_spills(flags):
    """The Hopper dW kernel at launch.BACKWARD_TMA_TILE: wgmma with x^T straight from the TMA buffer (no
    register A operand), no spill, within the H200's shared memory."""
    from tilefuse.kernels.gemm.launch.backward import BACKWARD_TMA_TILE
    cfg = dict(BACKWARD_TMA_TILE)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    aligned = ("dy_ptr", "s_ptr", "x_ptr", "dw_ptr", "db_ptr", "N", "K", "stride_dym", "stride_sm", "stride_xm",
               "stride_dw")
    facts = compile_sm90("tilefuse.kernels.gemm.backward", "grad_weight_tma_kernel", "*bf16",
                         dict(cfg, NUM_SMS=132, **flags), warps, stages, aligned=aligned)
    assert facts["wgmma"], facts
    assert not facts["wgmma_a_in_registers"], facts
    assert facts["spill_store_bytes"] == 0, facts
    assert facts["shared"] <= 227 * 1024, facts


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_fp32_gemm_kernels_honour_the_input_precision(precision):
    """fp32 operands run full-precision FMA dots unless torch allows TF32 (launch.precision_for): a tl.dot
    left at its default precision rounds fp32 operands to TF32, which on the H200 put the fp32 QKV rows at
    rel-L2 5e-4 to 8e-4 against the 1e-5 bound. TF32 dots are wgmma; IEEE ones are not."""
    module, name = "tilefuse.kernels.gemm.qkv", "qkv_projection_kernel"
    consts = dict(HAS_BIAS=True, HAS_ROPE=True, INTERLEAVED=False, HAS_NORM=True, BLOCK_M=64, BLOCK_R=32,
                  BLOCK_P=16, BLOCK_K=32)
    sig = {"*": "*fp32", "eps": "fp32"}
    consts.update(INPUT_PRECISION=precision, UPCAST_DOT=False)
    facts = compile_sm90(module, name, sig, consts, 4, 2)
    assert facts["wgmma"] == (precision == "tf32"), facts


@pytest.mark.parametrize("kernel,form", [("lce_logit_grad_kernel", False), ("lce_logit_grad_kernel", True),
                                         ("lce_chunk_stats_kernel", False), ("lce_chunk_stats_kernel", True)])
def test_cross_entropy_chunk_kernels_compile_for_sm90(kernel, form):
    """The row passes over a bf16 logits chunk -- the backward's in-place dz (the training form's with its rows'
    unit gradients from the targets), the chunked forward's partials, the training form's finished rows (no dot in
    any): they compile, without spills."""
    from tilefuse.kernels.gemm.launch.loss import LCE_GRAD_TILE, LCE_STATS_TILE
    sig = {"z_ptr": "*bf16", "target_ptr": "*i64", "softcap": "fp32", "smoothing": "fp32", "*": "*fp32"}
    tile = dict(LCE_STATS_TILE, FINISH=form)
    if kernel == "lce_logit_grad_kernel":
        sig["scale"] = "fp32"
        tile = dict(LCE_GRAD_TILE, UNIT_DLOSS=form)
    facts = compile_sm90("tilefuse.kernels.gemm.cross_entropy", kernel, sig, dict(HAS_SOFTCAP=True, **tile), 4, 1)
    assert facts["spill_store_bytes"] == 0, facts
    # At an odd vocabulary (VC 50257) in a padded chunk the loads' bound VC_MEM is a multiple of 16: the tiles
    # load 16 bytes at a time (a bound of unknown divisibility, VC itself, would give one-element loads); so does a
    # column slice's start, the launches passing its width rounded to BLOCK_V.
    facts = compile_sm90("tilefuse.kernels.gemm.cross_entropy", kernel, sig, dict(HAS_SOFTCAP=True, **tile), 4, 1,
                         aligned=("z_ptr", "stride_zm", "VC_MEM", *(("cols",) if kernel == "lce_chunk_stats_kernel"
                                                                      else ())))
    assert facts["scalar_16bit_loads"] == 0 and facts["spill_store_bytes"] == 0, facts
    # One token, one chunk, the second chunk (split 1): integers a launch passes as 1 become constexprs
    # unless the kernel pins them, and the kernel must still compile (split == 1 once did not).
    compile_sm90("tilefuse.kernels.gemm.cross_entropy", kernel, sig, dict(HAS_SOFTCAP=True, **tile), 4, 1,
                 ones=("M", "v0", "split", "splits") if kernel == "lce_chunk_stats_kernel" else ("M", "v0"))


@pytest.mark.parametrize("rows", [16, 32, 64])
def test_decode_kernel_configs_fit_and_do_not_spill(rows):
    """The decode kernel (kernels/gemm/decode.py) at each shipped config, by its row tile (16: 512-deep K tiles
    at 4 stages; 32 and 64: 128-deep at 6): the stages fit the H200's shared memory, and nothing spills."""
    from tilefuse.kernels.gemm import configs

    cfg = dict(configs.DECODE_GEMM_CONFIGS[16 if rows <= 16 else 64])
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    aligned = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_ym")  # K = N = 4096
    facts = compile_sm90("tilefuse.kernels.gemm.decode", "decode_linear_kernel", {"*": "*bf16"},
                         dict(HAS_BIAS=True, ACTIVATION="gelu", BLOCK_M=rows, **cfg), warps, stages, aligned)
    assert facts["shared"] <= configs.SMEM_LIMIT and facts["spill_store_bytes"] == 0, facts


@pytest.mark.parametrize("which,causal", [("dkdv", False), ("dkdv", True), ("dq", True)])
def test_wide_head_attention_backward_compiles(which, causal):
    """The backward passes for head dims past 128 as the launch runs them (tilefuse.kernels.attention.
    ws_backward_wide's dK/dV pass with one consumer per output (dV, dK), each a [64, 256] fp32 accumulator beside
    its score tiles, and ws_backward's dQ pass in 256-wide tiles with 32-key K/V steps): partitions, setmaxnreg
    24/240, P^T and dS^T (dS) as wgmma's register operand, no spills, wgmmas not serialised, two ring stages
    within shared memory."""
    facts = compile_gluon_sm90("tools.compiler", "attention_bwd_wide_compile_job", dict(causal=causal, which=which))
    assert facts["warp_specialized"] and facts["wgmma"] and facts["wgmma_a_in_registers"], facts
    assert not facts["wgmma_serialized"], facts
    assert {24, 240} <= set(facts["setmaxnreg"]) and facts["threads"] == 384, facts
    assert facts["spill_store_bytes"] == 0 and facts["shared"] <= 227 * 1024, facts


@pytest.mark.parametrize("fma_softmax", [False, True], ids=["scaled", "fma"])
@pytest.mark.parametrize("has_right", [False, True])
def test_fp8_attention_ws_compiles(has_right, fma_softmax):
    """The warp-specialized FP8 attention (ws_fp8.py) at the launch's ring (128-key tiles, 3 stages), either softmax
    form: partitions, setmaxnreg 24/240, both products on wgmma with P (e4m3) from registers, no spills, the ring in
    shared memory."""
    from tilefuse.kernels.attention.launch import FP8_WS_CONFIG
    facts = compile_gluon_sm90("tools.compiler", "attention_fp8_ws_compile_job",
                               dict(head_dim=128, has_right=has_right, block_n=FP8_WS_CONFIG["BLOCK_N"],
                                    stages=FP8_WS_CONFIG["STAGES"], fma_softmax=fma_softmax))
    assert facts["warp_specialized"] and facts["wgmma"] and facts["wgmma_a_in_registers"], facts
    assert {24, 240} <= set(facts["setmaxnreg"]) and facts["threads"] == 384, facts
    assert facts["spill_store_bytes"] == 0 and facts["shared"] <= 227 * 1024, facts


def test_fp8_attention_portable_compiles_to_wgmma():
    """The portable FP8 attention at its GPU config, loading through descriptors as it does on sm_90: e4m3 wgmma
    for QK^T and for P @ V (V^T tiles keys-contiguous), no spills."""
    from tilefuse.kernels.attention.launch import FP8_CONFIG
    cfg = {k: v for k, v in FP8_CONFIG.items() if k not in ("num_warps", "num_stages")}
    sig = {"*": "*fp8e4nv", "o_ptr": "*bf16", "qs_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
           "qk_scale": "fp32"}
    facts = compile_sm90("tilefuse.kernels.attention.fp8", "attention_fp8_fwd_kernel", sig,
                         dict(HAS_LEFT=False, HAS_RIGHT=True, QBLOCK=128, USE_DESC=True, BLOCK_D=128,
                              FLAT_GRID=False, **cfg), num_warps=FP8_CONFIG["num_warps"],
                         num_stages=FP8_CONFIG["num_stages"],
                         aligned=("q_ptr", "k_ptr", "vt_ptr", "o_ptr", "stride_qb", "stride_qh", "stride_qm",
                                  "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vd",
                                  "stride_ob", "stride_oh", "stride_om"),
                         ones=("stride_qd", "stride_kd", "stride_vn", "stride_od"))
    assert facts["wgmma"] and facts["spill_store_bytes"] == 0, facts


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_block_pass_loads_and_stores_16_bytes_at_a_time(rotate, d):
    """The FP8 pre-pass's Q and K kernel at a launch's specialization (the head dim a multiple of 16, unit
    inner strides): its bf16 tile loads and its e4m3 stores vectorized, no spills. The head dim must stay
    specializable: a masked access vectorizes only where its bound's 16-divisibility is known."""
    sig = {"*": "*bf16", "dst_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "rot_ptr": "*bf16"}
    aligned = ("src_ptr", "dst_ptr", "scale_ptr", "rot_ptr", "D", "stride_sb", "stride_sh", "stride_sn",
               "stride_db", "stride_dh", "stride_dn")
    facts = compile_sm90("tilefuse.kernels.attention.fp8", "quantize_blocks_kernel", sig,
                         dict(ROTATE=rotate, INTERPRETER=False, BLOCK_R=128, BLOCK_D=d), num_warps=8,
                         aligned=aligned, ones=("stride_sd", "stride_dd"))
    assert facts["spill_store_bytes"] == 0, facts
    assert facts["scalar_16bit_loads"] == 0 and facts["byte_stores"] == 0, facts


@pytest.mark.parametrize("kernel", ["channel_amax_kernel", "channel_scale_kernel", "quantize_transposed_kernel"])
@pytest.mark.parametrize("d", [128, 256])
def test_fp8_value_pass_compiles_without_spills(kernel, d):
    """The FP8 pre-pass's three V kernels at the launch's [rows, d] block: no spills, the block in registers (the
    cast's transpose through shared memory within the H200's 227 KB), no 16-bit element loads, no byte stores."""
    from tilefuse.kernels.attention.launch import QUANT_PART_ROWS, QUANT_TILE_ELEMENTS
    rows = max(16, min(128, QUANT_TILE_ELEMENTS // d))
    consts = {"channel_amax_kernel": dict(BLOCK_R=rows, BLOCK_D=d),
              "channel_scale_kernel": dict(BLOCK_D=d, PART_ROWS=QUANT_PART_ROWS),
              "quantize_transposed_kernel": dict(BLOCK_R=rows, BLOCK_D=d)}[kernel]
    cast = kernel == "quantize_transposed_kernel"
    from tilefuse.kernels.attention import fp8
    params = getattr(fp8, kernel).arg_names
    sig = {k: v for k, v in {"part_ptr": "*fp32", "scale_ptr": "*fp32", "dst_ptr": "*fp8e4nv"}.items() if k in params}
    sig["*"] = "*bf16"
    # The transposed e4m3 store runs along the keys: 16 bytes at a time where N is a multiple of 16 (N stays
    # specializable for that).
    aligned = tuple(a for a in ("src_ptr", "part_ptr", "scale_ptr", "stride_sb", "stride_sh", "stride_sn", "D")
                    if a in params) + (("dst_ptr", "stride_db", "stride_dh", "stride_dd", "N") if cast else ())
    facts = compile_sm90("tilefuse.kernels.attention.fp8", kernel, sig, consts, num_warps=8, aligned=aligned,
                         ones=tuple(a for a in ("stride_sd", "stride_dn") if a in params))
    assert facts["spill_store_bytes"] == 0 and facts["scalar_16bit_loads"] == 0, facts
    assert facts["shared"] <= 227 * 1024, facts
    assert facts["byte_stores"] == 0, facts

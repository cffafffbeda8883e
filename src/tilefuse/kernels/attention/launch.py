"""The attention family's launch layer: the one place that picks the kernels, their configs and grids.
- Forward: the warp-specialized Hopper kernel (ws.py) for sm_90, fp16/bf16, the head dims it supports, no
  mask and TMA-able tensors; the portable kernel (portable.py) everything else, and the interpreter.
- Backward: D = rowsum(dO * O) by the portable row-dot kernel, then the warp-specialized dK/dV and dQ passes
  for sm_90, fp16/bf16, the forward kernel's head dims, no mask, soft-cap, ALiBi, left window or packed
  sequences, TMA-able tensors: ws_backward.py's at d <= 128, ws_backward_wide.py's dK/dV pass and ws_backward's
  dQ pass in 256-wide tiles at d 160/192/256; the portable passes (backward.py) everything else.
- Block-sparse attention (block_sparse.py, a tilefuse.masks.BlockMask): its forward, and its dQ and dK/dV passes
  after the portable row-dot, in the portable kernels' tiles cut to the mask's (``block_sparse_forward``,
  ``block_sparse_backward``).
- FP8 forward (``forward_fp8``, after the pre-pass's ``quantize_blocks`` / ``quantize_channels_transposed``): the
  warp-specialized FP8 kernel (ws_fp8.py) on sm_90 at head dims 64 and 128 with a 16-bit output and TMA-able
  tensors (switches.attention.FP8_KERNEL "auto"), the portable FP8 kernel (fp8.py) elsewhere, through
  descriptors on sm_90 (switches.attention.FP8_DESCRIPTORS None) and pointer loads otherwise. No vendor candidate (SDPA has no FP8 forward in torch).
- The vendor candidates, forward and backward: SDPA's cuDNN and flash kernels (torch's CPU flash kernel off CUDA)
  where their semantics are the call's (``sdpa_candidates``), chosen against tilefuse's by measurement per shape
  bucket (FORWARD_CHOICE, BACKWARD_CHOICE; ``tuning.choices``).
Inputs arrive checked and non-empty (tilefuse.ops).
"""
from __future__ import annotations

import torch
import triton

from tilefuse import constants, runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches, switches
from tilefuse.kernels.attention import fp8, ws, ws_backward, ws_backward_wide, ws_fp8
from tilefuse.kernels.attention.common import MAX_GRID_Y, descriptors_usable
from tilefuse.kernels.attention.portable import attention_fwd_kernel
from tilefuse.kernels.gluon_host import host_descriptor
from tilefuse.kernels.tiling import ensure_descriptor_allocator
from tilefuse.runtime import precision_for
from tilefuse.sizes import cdiv, next_pow2

LOG2E = 1.4426950408889634

# ---- configs ----------------------------------------------------------------------------------
# Interpreter: one large fixed tile (its cost is per program, not per element). 64 x 64.
INTERPRETER_CONFIG = dict(BLOCK_M=64, BLOCK_N=64)


def _cfg(bm, bn, warps, stages, maxnreg=None):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=warps, num_stages=stages, maxnreg=maxnreg)


# Hopper space (pruned per head dim / dtype below). 128-row query tiles with 8 warps feed wgmma at
# d = 128; d <= 64 prefers 4 warps; d = 256 needs 64-row tiles or shallow pipelines to fit.
GPU_CONFIGS = [
    _cfg(128, 64, 4, 3), _cfg(128, 64, 4, 4), _cfg(128, 128, 8, 3),
    _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(128, 128, 8, 2),
    _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(128, 32, 8, 2),
    # d = 256: no spills with or without descriptors (sm_90a compiles).
    _cfg(64, 32, 8, 3), _cfg(64, 64, 8, 2),
    # Two or three CTAs per SM, so one CTA's softmax runs while another's wgmma does (what FA3 gets
    # from ping-pong warpgroups, which triton 3.6 cannot express on sm_90). Every tile above takes one
    # CTA per SM at d = 128 (128x64 w8 s2: 140 registers). Capped at 128 registers it compiles
    # without spills in 98 KB of shared memory (sm_90a, d = 128, full and causal). At d = 64, 128x64 w4
    # s3 takes 187 registers (2 CTAs); capped at 168, 3 CTAs with 4 bytes of spill.
    _cfg(128, 64, 8, 2, maxnreg=128), _cfg(128, 64, 4, 3, maxnreg=168),
]
# fp32 with input_precision="ieee" runs tl.dot on the FMA units, whose operand layouts hold far more per
# thread: the 16-bit tiles above spill 40-105 KB per thread there and take 26-95 s to compile (sm_90a,
# sm_90a). These small tiles compile in 4-8 s with no spills but 148 bytes at d = 256: 32x16 up to
# d = 64, 16x16 above.
FP32_IEEE_CONFIGS = [_cfg(32, 16, 4, 2), _cfg(16, 16, 4, 2)]
SMEM_LIMIT = 227 * 1024  # H200: shared memory per block


def config_fits(bm, bn, warps, stages, block_d, elem_bytes, use_desc=True, has_mask=False):
    """Shared memory and registers stay within Hopper's limits.

    Shared memory, as the compiler allocates it (checked by compiling every config for sm_90a,
    benchmarks/compile_study.py): Q once plus K and V in every one of
    ``stages`` buffers, plus 1 KB of descriptors. Registers: without descriptors Q also sits in
    registers, so the fp32 accumulator gets half the budget (d = 256 spilled otherwise). A mask adds
    up to one fp32 score-sized tile (a layout conversion): 64 KB at 128x128 when the mask's row stride is
    not a multiple of 16, enough to make a d = 128 config fail to launch on the H200."""
    smem = ((bm * block_d + 2 * stages * bn * block_d) * elem_bytes + (1024 if use_desc else 0)
            + (bm * bn * 4 if has_mask else 0))
    acc_regs = bm * block_d // (32 * warps)     # fp32 accumulator per thread
    score_regs = bm * bn // (32 * warps)        # fp32 score tile per thread
    acc_cap = 128 if use_desc else 64
    return smem <= SMEM_LIMIT and acc_regs <= acc_cap and score_regs <= 64 and acc_regs + score_regs <= 160


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    block_d = args["BLOCK_D"]
    elem = args["q_ptr"].element_size()
    ieee = elem == 4 and args.get("INPUT_PRECISION") == "ieee"
    if ieee:
        return [fp32_ieee_config(block_d)]
    configs = [c for c in configs if c not in FP32_IEEE_CONFIGS]
    if elem != 2 or block_d > 128:  # register caps were sized for 16-bit tiles up to d = 128
        configs = [c for c in configs if c.maxnreg is None]
    kept = [c for c in configs
            if config_fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, block_d, elem,
                           args.get("USE_DESC", True), args.get("HAS_MASK", False))]
    if block_d <= 64:  # small head dims: 8 warps leave each warp too little wgmma work
        kept = [c for c in kept if c.num_warps == 4] or kept
    elif block_d == 128:
        kept = [c for c in kept if c.num_warps == 8 and c.kwargs["BLOCK_M"] == 128] or kept
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


attention_fwd_tuned = tuning.autotune(
    name="attention_fwd",
    configs=GPU_CONFIGS + FP32_IEEE_CONFIGS,
    key=["Q_BUCKET", "K_BUCKET", "BLOCK_D", "HAS_LEFT", "HAS_RIGHT", "HAS_MASK", "MASK_IS_BOOL",
         "USE_DESC", "INPUT_PRECISION"],
    # HAS_SOFTCAP / HAS_ALIBI are left out of the key: they add elementwise work to the same tiles, and the
    # shipped table's keys stay valid.
    prune_configs_by={"early_config_prune": _prune},
)(attention_fwd_kernel)

# Below this much work (Nq * Nk) one launch costs less than tuning it: use the heuristic config. This
# also keeps the GPU test grid (hundreds of small variants) from autotuning every variant.
AUTOTUNE_MIN_WORK = 512 * 512


def fp32_ieee_config(block_d: int) -> triton.Config:
    """The FMA-path tile: 32x16 up to d = 64 (no spills), 16x16 above (no spills at d = 128, 148 bytes
    at d = 256 -- the larger ones spill kilobytes)."""
    return FP32_IEEE_CONFIGS[0] if block_d <= 64 else FP32_IEEE_CONFIGS[1]


def heuristic_config(block_d: int, elem_bytes: int, input_precision: str = "tf32") -> triton.Config:
    if elem_bytes == 4 and input_precision == "ieee":
        return fp32_ieee_config(block_d)
    if block_d <= 64:
        return _cfg(128, 64, 4, 3)
    if block_d <= 128:
        return _cfg(128, 64, 8, 3) if elem_bytes == 2 else _cfg(64, 32, 4, 3)
    # d = 256: 64x32 with 8 warps compiles without spills on both load paths (sm_90a).
    return _cfg(64, 32, 8, 3) if elem_bytes == 2 else _cfg(64, 32, 4, 2)


def ws_config_for(head_dim: int) -> dict:
    """The warp-specialized kernel's config by its tile width (ws.tile_head_dim): 128-key tiles; 64 keeps 3
    K/V stages in 115 KB, 128 two in 164 KB; 256 takes 64-key tiles, two stages in 197 KB (sm_90a, no spill).
    PINGPONG: the consumers' FA3 schedule (ws._consume_pingpong) from 128 up, where it is 5-8% faster on the
    H200's d 128 bench rows, and the plain order at 64, where it is 1-7% slower. DEVICE_DESC (descriptors made
    in the kernel) is chosen per launch by ``_launch_ws``."""
    tile = ws.tile_head_dim(head_dim)
    if tile == 256:
        return dict(BLOCK_N=64, STAGES=2, PINGPONG=True)
    return dict(BLOCK_N=128, STAGES=3 if tile <= 64 else 2, PINGPONG=tile > 64)


# Descriptors made on the device save ~60 us of host time per call (four host descriptors and their
# CUtensorMap encodes) but cost every CTA their creation before its first load: on the H200 kernels of
# 2048-4096 CTAs run 6-47% slower with them, while a 512-CTA Llama prefill (0.1 ms, host-bound) runs
# 11-28% faster. So launches of at most this many waves of CTAs (132 SMs: 528 CTAs) make them on the
# device (benchmarks/NOTES.md has the measurements).
DEVICE_DESC_MAX_WAVES = 4


def ws_usable(mask, q, *others) -> bool:
    """The cases the warp-specialized kernels take (no mask, sm_90, fp16/bf16, the forward's head dims, q and
    ``others`` TMA-able); everything else runs the portable kernels."""
    return (mask is None and q.is_cuda and runtime.device_facts(q.device)[0] == 9
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in ws.SUPPORTED_HEAD_DIMS
            and descriptors_usable(q, *others))


def _descriptor(t: torch.Tensor, rows: int):
    """``t`` [B, H, N, d] in tiles of ``rows`` x the kernel's tile width for d (zero-filled past d)."""
    return host_descriptor(t, (1, 1, int(rows), ws.tile_head_dim(t.shape[-1])))


def _launch_ws(q, k, v, out, lse, *, qk_scale, pos_offset, window_left, window_right, config=None) -> dict:
    """q/out [B, Hq, Nq, d] and k/v [B, Hkv, Nk, d], TMA-able (``usable``); lse None or fp32 [B, Hq, Nq].
    ``config`` overrides entries of ``ws_config_for(d)`` (benchmarks compare variants with it)."""
    B, Hq, Nq, d = q.shape
    q_blocks = cdiv(Nq, ws.BLOCK_M.value)
    flat = B * Hq > MAX_GRID_Y
    grid = (q_blocks * B * Hq,) if flat else (q_blocks, B * Hq)
    few_ctas = q_blocks * B * Hq <= DEVICE_DESC_MAX_WAVES * runtime.device_facts(q.device)[1]
    cfg = {**ws_config_for(d), "DEVICE_DESC": few_ctas, **(config or {})}
    if cfg["DEVICE_DESC"]:
        ensure_descriptor_allocator()
        srcs = (q, k, v, out)
    else:
        srcs = (_descriptor(q, ws.HALF_M), _descriptor(k, cfg["BLOCK_N"]), _descriptor(v, cfg["BLOCK_N"]),
                _descriptor(out, ws.HALF_M))
    fastpath.launch(ws.attention_fwd_ws_kernel, grid, (
        *srcs, lse if lse is not None else out, B, Hq, k.shape[1], Nq, k.shape[2], d,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        qk_scale, pos_offset, max(window_left, 0), max(window_right, 0)),
        dict(HEAD_D=ws.tile_head_dim(d), HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0,
             STORE_LSE=lse is not None, FLAT_GRID=flat, num_warps=4, maxnreg=ws.LAUNCH_MAXNREG, **cfg))
    return dict(BLOCK_M=ws.BLOCK_M.value, **cfg, WARP_SPECIALIZE=True)


def _strides(t: torch.Tensor, varlen) -> tuple:
    """t's strides for the kernels; packed sequences (``varlen``) get a batch stride of 0, since the
    kernels' batch index is then the sequence, whose rows come from the offsets."""
    return (0, *t.stride()[1:]) if varlen is not None else t.stride()


def modifier_args(scale: float, softcap) -> tuple:
    """(qk_scale, softcap_log2) for the kernels: the score multiplier before the modifiers and the cap in the
    log2 domain. With a softcap the scores go to tanh divided by the cap, and the cap times log2(e) comes
    back after it; without, scale * log2(e) puts them straight in the log2 domain."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return scale / softcap, softcap * LOG2E


def _grid(Nq: int, block_m: int, heads: int) -> tuple:
    """(query blocks, B * Hq), or everything on axis 0 (FLAT_GRID) when B * Hq passes axis 1's limit."""
    return (cdiv(Nq, block_m), heads) if heads <= MAX_GRID_Y else (cdiv(Nq, block_m) * heads,)


def _launch(q, k, v, out, lse, mask, *, scale, pos_offset, window_left, window_right,
                     input_precision, interpret, use_desc=None, kernel="auto", softcap=None, alibi=None, varlen=None):
    """q/out [B, Hq, Nq, d], k/v [B, Hkv, Nk, d] (any strides); mask None or broadcastable strides
    [B, Hq, Nq, Nk] (0 where broadcast); lse None or contiguous fp32 [B, Hq, Nq].

    window_left / window_right < 0 mean unbounded; ``softcap`` a float or None, ``alibi`` None or fp32
    slopes viewed as [B, Hq] (stride 0 where broadcast). ``kernel``: "auto" runs the warp-specialized Hopper
    kernel (ws.py) where it applies and ``use_desc`` is not forced, else the portable
    kernel; "ws" or "portable" force one ("ws" raises where it cannot run). Returns the config used
    (``WARP_SPECIALIZE`` set when the warp-specialized kernel ran). ``varlen``: (cu_q, cu_k, max_q, max_k)
    for packed sequences, q/k/v/out viewed [1, H, total, d] and lse [Hq, total_q] (portable kernel).
    """
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    grid_rows, grid_heads = Nq, B * Hq
    if varlen is not None:
        B = varlen[0].shape[0] - 1  # sequences: the kernel's b indexes the offsets
        grid_rows, grid_heads = varlen[2], B * Hq
        use_desc = False
    if kernel not in ("auto", "ws", "portable"):
        raise ValueError(f"kernel must be 'auto', 'ws' or 'portable', got {kernel!r}")
    modified = softcap is not None or alibi is not None or varlen is not None
    if (kernel != "portable" and not interpret and use_desc is None and not modified
            and ws_usable(mask, q, k, v, out)):
        return _launch_ws(q, k, v, out, lse, qk_scale=scale * LOG2E, pos_offset=pos_offset,
                          window_left=window_left, window_right=window_right)
    if kernel == "ws":
        raise ValueError("the warp-specialized kernel needs sm_90, fp16/bf16, head dim 64 or 128, no mask, no "
                         "softcap or ALiBi and TMA-able tensors (16-byte aligned, unit last stride)")
    block_d = max(16, next_pow2(d))
    if use_desc is None:
        # Descriptors on the GPU only (portable pointer path in the interpreter); both paths are tested.
        use_desc = (not interpret and q.is_cuda and runtime.device_facts(q.device)[0] >= 9
                    and descriptors_usable(q, k, v, out))
    if use_desc:
        ensure_descriptor_allocator()
    has_mask = mask is not None
    mask_is_bool = has_mask and mask.dtype == torch.bool
    if mask_is_bool:
        mask = mask.view(torch.uint8)
    mask_strides = mask.stride() if has_mask else (0, 0, 0, 0)
    qk_scale, softcap_log2 = modifier_args(scale, softcap)
    args = (q, k, v, out, lse if lse is not None else out, mask if has_mask else out,
            *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(out, varlen), *mask_strides,
            B, Hq, Nq, Nk, d, Hq // Hkv, Hkv,
            qk_scale, pos_offset, max(window_left, 0), max(window_right, 0),
            sizes.m_bucket(grid_rows), sizes.m_bucket(varlen[3] if varlen is not None else Nk), softcap_log2,
            alibi if alibi is not None else out, *(alibi.stride() if alibi is not None else (0, 0)),
            *(varlen[:2] if varlen is not None else (out, out)))
    flags = dict(HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_MASK=has_mask,
                 MASK_IS_BOOL=mask_is_bool, HAS_SOFTCAP=softcap is not None, HAS_ALIBI=alibi is not None,
                 VARLEN=varlen is not None, STORE_LSE=lse is not None, EVEN_D=d == block_d,
                 USE_DESC=use_desc, INPUT_PRECISION=input_precision, BLOCK_D=block_d,
                 FLAT_GRID=grid_heads > MAX_GRID_Y)
    if interpret:
        cfg = INTERPRETER_CONFIG
        grid = _grid(grid_rows, cfg["BLOCK_M"], grid_heads)
        fastpath.launch(attention_fwd_kernel, grid, args, dict(flags, UPCAST_DOT=q.dtype == torch.bfloat16, **cfg))
        return cfg

    if Nq * Nk < AUTOTUNE_MIN_WORK:
        cfg = heuristic_config(block_d, q.element_size(), input_precision)
        grid = _grid(grid_rows, cfg.kwargs["BLOCK_M"], grid_heads)
        fastpath.launch(attention_fwd_kernel, grid, args, dict(flags, UPCAST_DOT=False, **cfg.kwargs,
                                                               num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        return cfg

    def grid(meta):
        return _grid(grid_rows, meta["BLOCK_M"], grid_heads)

    fastpath.launch(attention_fwd_tuned, grid, args, dict(flags, UPCAST_DOT=False))
    return attention_fwd_tuned.launched_config()


# ---- entries ---------------------------------------------------------------------------------------
_FORWARD = fastpath.Plans("attention")
KERNELS = ("auto", "ws", "portable")


def forward(q, k, v, mask, scale: float, pos_offset: int, window_left: int, window_right: int,
            return_lse: bool, path, kernel: str = "auto", softcap=None, alibi=None, varlen=None, out_bnhd=False):
    """out [B, Hq, Nq, d] (contiguous, or see ``out_bnhd``) and lse fp32 [B, Hq, Nq] (or an empty tensor without
    ``return_lse``) for q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d] with Nq, Nk >= 1, mask None or a view of
    [B, Hq, Nq, Nk] (broadcast dims at stride 0). ``kernel``: "auto" (the rule in the module doc) or
    "ws" / "portable" to force one (benchmarks measure both side by side). ``softcap`` / ``alibi``: the
    score modifiers (see ``_launch``; with ``alibi`` the lse is measured from each row's nearest key, see
    common.score_modifiers). ``out_bnhd``: out laid out [B, Nq, Hq, d] (FlashAttention's layout, written in
    place by the kernel through its strides) and returned as its [B, Hq, Nq, d] view. ``varlen``: (cu_q,
    cu_k, max_q, max_k) for packed sequences with q/k/v viewed [1, H, total, d]; out is then always laid out
    so, i.e. [total_q, Hq, d] (returned as its [1, Hq, total_q, d] view), and lse is [1, Hq, total_q]."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    cu = varlen[:2] if varlen is not None else (None, None)
    precision = precision_for(q.dtype, q.is_cuda)
    mode = runtime.backend()
    return _FORWARD.run((q, k, v, mask, alibi, *cu),
                        (scale, pos_offset, window_left, window_right, return_lse, kernel, softcap,
                         None if varlen is None else varlen[2:], out_bnhd, precision, mode),
                        lambda: _forward_chosen(q, k, v, mask, scale, pos_offset, window_left, window_right,
                                                return_lse, path, kernel, softcap, alibi, varlen, out_bnhd, precision,
                                                mode))


def _forward_chosen(q, k, v, mask, scale, pos_offset, window_left, window_right, return_lse, path, kernel, softcap,
                    alibi, varlen, out_bnhd, precision, mode):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return _forward(q, k, v, mask, scale, pos_offset, window_left, window_right, return_lse, path, kernel,
                            softcap, alibi, varlen, out_bnhd, precision)
        return fastpath.vendor(_forward_sdpa, candidate, q, k, v, scale, window_right == 0, return_lse, out_bnhd,
                               path)

    available = (tuning.TILEFUSE,)
    if kernel == "auto":  # a kernel named by the caller is tilefuse's
        available += sdpa_candidates(q, k, v, mask, pos_offset, window_left, window_right, softcap, alibi, varlen)
    return fastpath.run_chosen(FORWARD_CHOICE, mode, available,
                               lambda: _choice_key(q, k, window_right == 0, return_lse), q.device, run)


def _empty_out(q, bnhd: bool):
    """The forward's output for q [B, Hq, Nq, d]: contiguous, or with ``bnhd`` laid out [B, Nq, Hq, d] (packed:
    [total_q, Hq, d]) and seen as [B, Hq, Nq, d], the layout tilefuse.ops.attention._empty_outputs (the fake
    implementation) gives."""
    B, Hq, Nq, d = q.shape
    if bnhd:
        return torch.empty((B, Nq, Hq, d), dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)
    return torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)


def _forward(q, k, v, mask, scale, pos_offset, window_left, window_right, return_lse, path, kernel, softcap, alibi,
             varlen, out_bnhd, precision):
    B, Hq, Nq, d = q.shape
    out = _empty_out(q, varlen is not None or out_bnhd)
    lse = torch.empty((B, Hq, Nq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    cfg = _launch(q, k, v, out, lse if return_lse else None, mask, scale=scale, pos_offset=pos_offset,
                  window_left=window_left, window_right=window_right, input_precision=precision,
                  interpret=path == runtime.INTERPRETER, kernel=kernel, softcap=softcap, alibi=alibi, varlen=varlen)
    is_ws = isinstance(cfg, dict) and cfg.get("WARP_SPECIALIZE")
    launches.record("attention", path, "ws" if is_ws else "portable", lambda: tuning.describe(cfg))
    return out, lse


# ---- backward --------------------------------------------------------------------------------------
_BACKWARD = fastpath.Plans("attention_backward")


def backward_config(block_d: int, elem_bytes: int, interpret: bool) -> dict:
    """Tiles of the backward kernels (backward.py): dK and dV (or dQ) accumulate [BLOCK, BLOCK_D] in fp32
    beside the recomputed score tile, so wide heads take smaller tiles. The interpreter takes 64 x 64
    (its cost is per program)."""
    if interpret:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)
    if elem_bytes == 4:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    # 16-bit, d 64 / 128: dQ pipelines its K, V tiles over 2 stages; dK/dV, which holds two [64, d] fp32
    # accumulators beside the score tiles, spills on sm_90a at 2 stages and not at 1: BACKWARD_DKDV_STAGES.
    if block_d <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if block_d <= 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)


BACKWARD_DKDV_STAGES = 1  # the dK/dV kernel's pipeline depth on 16-bit 64-row tiles (backward_config)
# The backward's switches (switches.attention): BACKWARD_DQ_ATOMIC (dQ by fp32 atomics inside the portable dK/dV
# pass: off, since the adds' order varies run to run and ``deterministic=True``, as every default call, gives
# bit-identical gradients), BACKWARD_WS / BACKWARD_WS_WIDE (the warp-specialized passes up to d 128 / past it) and
# BACKWARD_REPLAY (the backward through the fast path's plans: D among the plan's outputs, so the launches replay;
# the Gluon passes also need fastpath.REPLAY_HOST_DESCRIPTORS). Up to d 128 the Q/dO (dK/dV pass) and K/V (dQ
# pass) rings are BACKWARD_WS_STAGES deep: 2 stages measured best or within 2% of 3 and 4 on the H200's backward
# grid (NOTES.md). Past 128 they are ws_backward_wide.STAGES deep (2: a third does not fit).
BACKWARD_WS_STAGES = 2

def ws_backward_usable(q, k, v, mask, window_left, softcap, alibi, varlen) -> bool:
    """The cases the warp-specialized backward passes take: the forward kernel's (``ws_usable``) at
    ws_backward.HEAD_DIMS (d <= 128) and, with switches.attention.BACKWARD_WS_WIDE, ws_backward_wide.HEAD_DIMS (160, 192, 256),
    without soft-cap, ALiBi or packed sequences (left windows up to d 128: the wide dK/dV pass has none), and a
    grid within axis 1's limit (B * Hq: the dQ pass's, at least the dK/dV pass's B * Hkv); everything else runs
    the portable passes. dout need not be TMA-able: the launch copies it when it is not (autograd's expanded or
    strided gradients)."""
    d = q.shape[-1]
    narrow = d in ws_backward.HEAD_DIMS
    head_dim_taken = narrow or (switches.attention.BACKWARD_WS_WIDE and d in ws_backward_wide.HEAD_DIMS and window_left < 0)
    return (switches.attention.BACKWARD_WS and head_dim_taken and softcap is None and alibi is None and varlen is None
            and q.shape[0] * q.shape[1] <= MAX_GRID_Y and ws_usable(mask, q, k, v))


def _backward_ws(dout, q, k, v, lse, delta, dq, dk, dv, *, scale, pos_offset, window_right, window_left=-1,
                 passes=("dkdv", "dq")) -> dict:
    """The two warp-specialized passes into dq, dk, dv (the layouts of q, k, v: TMA-able as they are), or only
    those in ``passes`` (benchmarks time each on its own). Returns the config: STAGES, HEAD_D (the tile width),
    WIDE (the dK/dV pass of ws_backward_wide.py) and DQ_KEYS (the dQ pass's keys per ring step)."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    tile = ws.tile_head_dim(d)
    wide = tile > 128
    stages = ws_backward_wide.STAGES if wide else BACKWARD_WS_STAGES
    # Query tiles of 64 rows in both passes (and the wide dK/dV pass's 64-key blocks); the dQ pass's ring steps
    # over keys in its K descriptor's box rows: 64 as its query tiles up to d 128, DQ_KEYS in 256-wide tiles.
    rows = (1, 1, ws_backward.BLOCK_M.value, tile)
    dq_keys = ws_backward_wide.DQ_KEYS if wide else ws_backward.BLOCK_M.value
    q_d, do_d = host_descriptor(q, rows), host_descriptor(dout, rows)
    if wide and window_left >= 0:
        raise ValueError("the wide warp-specialized dK/dV pass takes no left window (ws_backward_usable)")
    flags = dict(HAS_RIGHT=window_right >= 0, STAGES=stages, num_warps=4, maxnreg=ws_backward.LAUNCH_MAXNREG)
    positions = (Hq, Hkv, Nq, Nk, scale * LOG2E, scale, pos_offset, max(window_right, 0))
    # The narrow passes (both of them up to d 128, the dQ pass at every width) also take the window's left side.
    band = dict(flags, HAS_LEFT=window_left >= 0)
    band_positions = (*positions, max(window_left, 0))
    if "dkdv" in passes:
        # Per CTA: the wide pass's KEYS keys (both consumers on them), the narrow pass's KEYS per consumer.
        if wide:
            kernel, keys_per_cta = ws_backward_wide.attention_bwd_dkdv_wide_kernel, ws_backward_wide.KEYS
        else:
            kernel, keys_per_cta = ws_backward.attention_bwd_dkdv_ws_kernel, 2 * ws_backward.KEYS
        keys = (1, 1, ws_backward_wide.KEYS if wide else ws_backward.KEYS, tile)
        fastpath.launch(kernel, (cdiv(Nk, keys_per_cta), B * Hkv), (
            q_d, host_descriptor(k, keys), host_descriptor(v, keys), do_d, host_descriptor(dk, keys),
            host_descriptor(dv, keys), lse, delta, *(positions if wide else band_positions)),
            flags if wide else band)
    if "dq" in passes:
        kv = (1, 1, dq_keys, tile)
        fastpath.launch(ws_backward.attention_bwd_dq_ws_kernel, (cdiv(Nq, ws_backward.QUERY_ROWS), B * Hq), (
            q_d, host_descriptor(k, kv), host_descriptor(v, kv), do_d, host_descriptor(dq, rows), lse, delta,
            *band_positions), band)
    return dict(STAGES=stages, HEAD_D=tile, WIDE=wide, DQ_KEYS=dq_keys)


# What the launch records for the warp-specialized backward (the report's config column): up to d 128, and past it.
WS_BACKWARD_KERNEL = "ws: rowdot, dk/dv, dq (no atomics)"
WS_BACKWARD_WIDE_KERNEL = "ws: rowdot, dk/dv wide, dq (no atomics)"


def backward(dout, q, k, v, out, lse, dlse, mask, scale: float, pos_offset: int, window_left: int,
             window_right: int, path, softcap=None, alibi=None, varlen=None, deterministic=False):
    """(dq, dk, dv) of the attention op from dout [B, Hq, Nq, d] (any strides), the forward's q, k, v, out and
    lse (fp32 [B, Hq, Nq], contiguous), dlse (the lse output's gradient, same layout) or None, and the
    forward's mask and positions. dq/dk/dv contiguous in q's / k's / v's shapes, q's dtype. ``deterministic`` (or
    torch's deterministic algorithms) leaves out SDPA's backwards, whose dQ accumulation may vary run to run."""
    precision = precision_for(q.dtype, q.is_cuda)
    mode = runtime.backend()
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()

    def full():
        return _backward_chosen(dout, q, k, v, out, lse, dlse, mask, scale, pos_offset, window_left, window_right,
                                path, softcap, alibi, varlen, precision, mode, deterministic)

    if not switches.attention.BACKWARD_REPLAY:
        return full()[:3]
    cu = varlen[:2] if varlen is not None else (None, None)
    return _BACKWARD.run((dout, q, k, v, out, lse, dlse, mask, alibi, *cu),
                         (scale, pos_offset, window_left, window_right, softcap, None if varlen is None else varlen[2:],
                          precision, mode, deterministic), full)[:3]


def _backward_chosen(dout, q, k, v, out, lse, dlse, mask, scale, pos_offset, window_left, window_right, path, softcap,
                     alibi, varlen, precision, mode, deterministic):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return _backward(dout, q, k, v, out, lse, dlse, mask, scale, pos_offset, window_left, window_right, path,
                             softcap, alibi, varlen, precision)
        return fastpath.vendor(_backward_sdpa, candidate, dout, q, k, v, out, lse, scale, window_right == 0, path)

    available = (tuning.TILEFUSE,)
    if not deterministic:
        available += sdpa_candidates(q, k, v, mask, pos_offset, window_left, window_right, softcap, alibi, varlen,
                                     dlse)
    return fastpath.run_chosen(BACKWARD_CHOICE, mode, available, lambda: _choice_key(q, k, window_right == 0, False),
                               q.device, run)


def _backward(dout, q, k, v, out, lse, dlse, mask, scale, pos_offset, window_left, window_right, path, softcap,
              alibi, varlen, precision):
    """(dq, dk, dv, delta): D = rowsum(dO * O), which every pass reads, is returned beside the gradients so that
    the fast path's plan allocates it and later calls replay the launches (a temporary would send each call
    down the full path)."""
    from tilefuse.kernels.attention.backward import (attention_bwd_dkdv_kernel, attention_bwd_dq_kernel,
                                                     attention_bwd_rowdot_kernel)

    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    interpret = path == runtime.INTERPRETER
    block_d = max(16, next_pow2(d))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))  # the inputs' layouts (packed ones included)
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    upcast = interpret and q.dtype == torch.bfloat16
    rows = 64
    fastpath.launch(attention_bwd_rowdot_kernel, (cdiv(Nq, rows), B * Hq), (
        out, dout, dlse if dlse is not None else delta, delta, *out.stride(), *dout.stride(), Hq, Nq, d),
        dict(HAS_DLSE=dlse is not None, BLOCK_M=rows, BLOCK_D=block_d))
    if ws_backward_usable(q, k, v, mask, window_left, softcap, alibi, varlen):
        if not descriptors_usable(dout):
            dout = dout.contiguous()
        cfg = _backward_ws(dout, q, k, v, lse, delta, dq, dk, dv, scale=scale, pos_offset=pos_offset,
                           window_left=window_left, window_right=window_right)
        launches.record("attention_backward", path, WS_BACKWARD_WIDE_KERNEL if cfg["WIDE"] else WS_BACKWARD_KERNEL,
                        lambda: f"s{cfg['STAGES']} d{cfg['HEAD_D']}"
                        + (f" dq keys {cfg['DQ_KEYS']}" if cfg["WIDE"] else ""))
        return dq, dk, dv, delta
    has_mask = mask is not None
    mask_is_bool = has_mask and mask.dtype == torch.bool
    if mask_is_bool:
        mask = mask.view(torch.uint8)
    mask_strides = mask.stride() if has_mask else (0, 0, 0, 0)
    mask_arg = mask if has_mask else delta
    cfg = backward_config(block_d, q.element_size(), interpret)
    flags = dict(HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_MASK=has_mask,
                 MASK_IS_BOOL=mask_is_bool, HAS_SOFTCAP=softcap is not None, HAS_ALIBI=alibi is not None,
                 INPUT_PRECISION=precision, UPCAST_DOT=upcast, BLOCK_D=block_d, **cfg)
    qk_scale, softcap_log2 = modifier_args(scale, softcap)
    positions = (qk_scale, scale, pos_offset, max(window_left, 0), max(window_right, 0), softcap_log2,
                 alibi if alibi is not None else delta, *(alibi.stride() if alibi is not None else (0, 0)),
                 *(varlen[:2] if varlen is not None else (delta, delta)))
    flags["VARLEN"] = varlen is not None
    seqs, rows_q, rows_k = B, Nq, Nk
    if varlen is not None:
        seqs, rows_q, rows_k = varlen[0].shape[0] - 1, varlen[2], varlen[3]
    dkdv_flags = flags
    if not interpret and q.element_size() == 2 and cfg["BLOCK_M"] == 64:
        dkdv_flags = dict(flags, num_stages=BACKWARD_DKDV_STAGES)
    if switches.attention.BACKWARD_DQ_ATOMIC:
        dq_acc = torch.zeros(dq.shape, dtype=torch.float32, device=q.device)  # [B, Hq, Nq, d] (packed: [1, ...])
        dkdv_flags = dict(dkdv_flags, DQ_ATOMIC=True, dq_acc_ptr=dq_acc,
                          **dict(zip(("stride_dqab", "stride_dqah", "stride_dqam", "stride_dqad"),
                                     _strides(dq_acc, varlen))))
    fastpath.launch(attention_bwd_dkdv_kernel, (cdiv(rows_k, cfg["BLOCK_N"]), seqs * Hkv), (
        q, k, v, dout, lse, delta, mask_arg, dk, dv,
        *[s for t in (q, k, v, dout) for s in _strides(t, varlen)], *mask_strides,
        *_strides(dk, varlen), *_strides(dv, varlen),
        Hq, Hkv, Nq, Nk, d, Hq // Hkv, *positions), dkdv_flags)
    if switches.attention.BACKWARD_DQ_ATOMIC:
        dq.copy_(dq_acc)
        launches.record("attention_backward", path, "portable: rowdot, dk/dv with dq by fp32 atomics",
                        lambda: f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']}")
        return dq, dk, dv, delta
    fastpath.launch(attention_bwd_dq_kernel, (cdiv(rows_q, cfg["BLOCK_M"]), seqs * Hq), (
        q, k, v, dout, lse, delta, mask_arg, dq,
        *[s for t in (q, k, v, dout) for s in _strides(t, varlen)], *mask_strides, *_strides(dq, varlen),
        Hq, Nq, Nk, d, Hq // Hkv, *positions), flags)
    launches.record("attention_backward", path, "portable: rowdot, dk/dv, dq (no atomics)",
                    lambda: f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']}")
    return dq, dk, dv, delta


# ---- SDPA's kernels, the vendor candidates -----------------------------------------------------------
# torch's private SDPA entry points, which return (and take back) the log-sum-exp the public function hides:
# cuDNN's and the flash kernel on CUDA, torch's flash kernel on the CPU (so the CPU suite runs the candidates'
# plumbing too). Same outputs and layouts as tilefuse's: out as ``_empty_out`` lays it, lse fp32 [B, Hq, Nq]
# natural log (or empty), dq/dk/dv in q's / k's / v's layouts.
SDPA_CUDNN = "sdpa_cudnn"
SDPA_FLASH = "sdpa_flash"
# The flash kernel first: a call with no stored or measured choice (autotuning off, CUDA-graph capture) takes the
# first vendor candidate under ``vendor``, and the flash kernel takes every layout with a unit last stride.
FORWARD_CHOICE = tuning.BackendChoice("attention_forward_backend", (tuning.TILEFUSE, SDPA_FLASH, SDPA_CUDNN))
BACKWARD_CHOICE = tuning.BackendChoice("attention_backward_backend", (tuning.TILEFUSE, SDPA_FLASH, SDPA_CUDNN))
# Head dims each takes on CUDA (multiples of 8): PyTorch's flash kernel up to 256, its cuDNN path up to 128, and up
# to 256 on Hopper (sm_90: measured there, forward and backward, in the report's d 256 rows).
SDPA_MAX_HEAD_DIM = {SDPA_FLASH: 256, SDPA_CUDNN: 128}
SDPA_CUDNN_MAX_HEAD_DIM_SM90 = 256


def _cudnn_max_head_dim(device: torch.device) -> int:
    major = runtime.device_facts(device)[0]
    return SDPA_CUDNN_MAX_HEAD_DIM_SM90 if major == 9 else SDPA_MAX_HEAD_DIM[SDPA_CUDNN]


def _bhnd_or_bnhd(t: torch.Tensor) -> bool:
    """t [B, H, N, d] dense as [B, H, N, d] or as [B, N, H, d] (FlashAttention's layout), the layouts PyTorch's
    cuDNN path takes."""
    return t.is_contiguous() or t.transpose(1, 2).is_contiguous()


def sdpa_candidates(q, k, v, mask, pos_offset, window_left, window_right, softcap, alibi, varlen, dlse=None) -> tuple:
    """The SDPA kernels whose semantics are this call's: no mask, score modifier, packed sequences or lse
    gradient (``dlse``), and full attention or causal with as many queries as keys (the kernels' causal masks
    start at different corners when the counts differ: SDPA's semantics top-left, the flash kernel bottom-right);
    on CUDA fp16/bf16 with unit last strides and a head dim of at most ``SDPA_MAX_HEAD_DIM`` (cuDNN's on Hopper:
    256), a multiple of 8, and for cuDNN dense [B, H, N, d] or [B, N, H, d] layouts. Grouped key heads (GQA) on
    CUDA, where both kernels take them as they are (a key head per group of query heads; their backwards sum each
    group's dK and dV); on the CPU one key head per query head, torch's CPU flash kernel's semantics."""
    if mask is not None or softcap is not None or alibi is not None or varlen is not None or dlse is not None:
        return ()
    causal = window_left < 0 and window_right == 0 and pos_offset == 0 and q.shape[2] == k.shape[2]
    if not (causal or (window_left < 0 and window_right < 0)):
        return ()
    if not q.is_cuda:
        return (SDPA_FLASH,) if q.shape[1] == k.shape[1] else ()
    d = q.shape[-1]
    if (q.dtype not in (torch.float16, torch.bfloat16) or d % 8
            or any(t.stride(-1) != 1 for t in (q, k, v))):
        return ()
    cudnn = d <= _cudnn_max_head_dim(q.device) and all(_bhnd_or_bnhd(t) for t in (q, k, v))
    return (SDPA_FLASH, SDPA_CUDNN) if cudnn else (SDPA_FLASH,)


def _choice_key(q, k, causal: bool, return_lse: bool):
    """What the choice between tilefuse's attention and SDPA's depends on, as a ``tuning.ChoiceKey``: GROUP is
    the query heads per key head (1 without GQA)."""
    B, Hq, Nq, d = q.shape
    return tuning.ChoiceKey(Q_BUCKET=sizes.m_bucket(Nq), K_BUCKET=sizes.m_bucket(k.shape[2]),
                            HEADS_BUCKET=sizes.m_bucket(B * Hq), GROUP=Hq // k.shape[1], D=d, CAUSAL=causal,
                            LSE=return_lse, dtype=q.dtype)


def _like(t: torch.Tensor, strides: tuple, make) -> torch.Tensor:
    """``t`` with ``strides``: t itself when it has them, else a copy into ``make()`` (an empty tensor of t's shape
    laid out so)."""
    return t if t.stride() == tuple(strides) else make().copy_(t)


SDPA_FORWARD_OPS = {SDPA_CUDNN: "aten._scaled_dot_product_cudnn_attention",
                    SDPA_FLASH: "aten._scaled_dot_product_flash_attention"}
SDPA_BACKWARD_OPS = {name: op + "_backward" for name, op in SDPA_FORWARD_OPS.items()}
SDPA_CPU_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu"


def _forward_sdpa(backend, q, k, v, scale, causal, return_lse, out_bnhd, path):
    B, Hq, Nq, d = q.shape
    aten = torch.ops.aten
    if not q.is_cuda:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        what = SDPA_CPU_FORWARD
    elif backend == SDPA_CUDNN:
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, return_lse, 0.0, causal, False,
                                                            scale=scale)[:2]
        what = SDPA_FORWARD_OPS[backend]
    else:
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        what = SDPA_FORWARD_OPS[backend]
    out = _like(out, (Nq * Hq * d, d, Hq * d, 1) if out_bnhd else (Hq * Nq * d, Nq * d, d, 1),
                lambda: _empty_out(q, out_bnhd))
    if return_lse:  # cuDNN's is [B, H, Nq, 1], the CPU kernel's laid out [B, Nq, H]
        lse = lse.reshape(B, Hq, Nq).contiguous()
    else:
        lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    launches.record("attention", path, backend, what)
    return out, lse


# The random-number state the SDPA backwards take, per (backend, device): zeros, never read without dropout, made
# once rather than by two fill kernels in every backward (outside CUDA-graph capture: a tensor allocated inside
# one belongs to the graph's memory pool).
_RNG_STATE: dict = {}


def _unused_rng_state(backend: str, device: torch.device) -> tuple:
    """(seed, offset) of the types ``backend``'s forward returns: cuDNN's two int64 scalars, the flash kernel's
    uint64 pair and uint64 offset."""
    state = _RNG_STATE.get((backend, device))
    if state is None:
        if backend == SDPA_CUDNN:
            zero = torch.zeros((), dtype=torch.int64, device=device)
            state = (zero, zero)
        else:
            state = (torch.zeros((2,), dtype=torch.uint64, device=device),
                     torch.zeros((), dtype=torch.uint64, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _RNG_STATE[(backend, device)] = state
    return state


def _backward_sdpa(backend, dout, q, k, v, out, lse, scale, causal, path):
    """(dq, dk, dv, delta) as ``_backward`` returns them (delta empty: no kernel of tilefuse's reads it)."""
    Nq, Nk = q.shape[2], k.shape[2]
    aten = torch.ops.aten
    if not q.is_cuda:
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                          scale=scale)
        what = SDPA_CPU_FORWARD + "_backward"
    else:
        # Both take dout laid out as out (autograd's may be expanded or strided), and a random-number state they
        # never read without dropout.
        dout = _like(dout, out.stride(), lambda: torch.empty_like(out))
        seed, offset = _unused_rng_state(backend, q.device)
        if backend == SDPA_CUDNN:
            grads = aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None, Nq, Nk, 0.0, causal,
                scale=scale)
        else:
            grads = aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, Nq, Nk, 0.0, causal, seed, offset, scale=scale)
        what = SDPA_BACKWARD_OPS[backend]
    dq, dk, dv = (_like(g, t.stride(), lambda t=t: torch.empty_like(t)) for g, t in zip(grads, (q, k, v)))
    launches.record("attention_backward", path, backend, what)
    return dq, dk, dv, torch.empty((0,), dtype=torch.float32, device=q.device)


# ---- block-sparse attention (block_sparse.py) ---------------------------------------------------------
# The forward, then the backward's three passes (the portable row-dot, then dQ and dK/dV over the mask's lists),
# for the BlockMask's tensors in tilefuse.masks.BlockMask.TENSORS order. Kernel tiles are the portable kernels'
# (heuristic_config, backward_config) cut to the mask's tiles: both powers of two, so they divide them.
_BLOCK_SPARSE_FORWARD = fastpath.Plans("block_sparse_attention")
_BLOCK_SPARSE_BACKWARD = fastpath.Plans("block_sparse_attention_backward")


def _mask_args(mask_tensors) -> tuple:
    """(row strides of batch and head into the mask's [Bm, Hm, ...] lists (0 where they broadcast), query tiles,
    key tiles, bitmap slots)."""
    kv_num, q_num, bits = mask_tensors[0], mask_tensors[5], mask_tensors[10]
    Bm, Hm = kv_num.shape[0], kv_num.shape[1]
    return (Hm if Bm > 1 else 0, 1 if Hm > 1 else 0, kv_num.shape[2], q_num.shape[2], bits.shape[0])


def block_sparse_forward_config(block_d: int, elem_bytes: int, precision: str, interpret: bool, block_q: int,
                                block_k: int) -> dict:
    """The forward's tile: the portable kernel's heuristic (or the interpreter's 64 x 64), cut to the mask's."""
    if interpret:
        cfg = dict(BLOCK_M=INTERPRETER_CONFIG["BLOCK_M"], BLOCK_N=INTERPRETER_CONFIG["BLOCK_N"], num_warps=4,
                   num_stages=1)
    else:
        c = heuristic_config(block_d, elem_bytes, precision)
        cfg = dict(**c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    return dict(cfg, BLOCK_M=min(cfg["BLOCK_M"], block_q), BLOCK_N=min(cfg["BLOCK_N"], block_k))


def block_sparse_forward(q, k, v, mask_tensors, block_q: int, block_k: int, scale: float, return_lse: bool, path,
                         use_desc=None):
    """(out [B, Hq, Nq, d] contiguous, lse fp32 [B, Hq, Nq] or empty) for q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d]
    (any strides, Nq, Nk >= 1) and a BlockMask's tensors (checked against these shapes by tilefuse.ops).
    ``use_desc``: force the TMA-descriptor loads on or off (default: on for sm_90 where the tensors allow)."""
    precision = precision_for(q.dtype, q.is_cuda)
    return _BLOCK_SPARSE_FORWARD.run(
        (q, k, v, *mask_tensors), (block_q, block_k, scale, return_lse, use_desc, precision),
        lambda: _block_sparse_forward(q, k, v, mask_tensors, block_q, block_k, scale, return_lse, path, use_desc,
                                      precision))


def _block_sparse_forward(q, k, v, mask_tensors, block_q, block_k, scale, return_lse, path, use_desc, precision):
    from tilefuse.kernels.attention.block_sparse import block_sparse_fwd_kernel

    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    interpret = path == runtime.INTERPRETER
    block_d = max(16, next_pow2(d))
    out = torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if use_desc is None:
        use_desc = (not interpret and q.is_cuda and runtime.device_facts(q.device)[0] >= 9
                    and descriptors_usable(q, k, v))
    if use_desc:
        ensure_descriptor_allocator()
    cfg = block_sparse_forward_config(block_d, q.element_size(), precision, interpret, block_q, block_k)
    heads = B * Hq
    grid = _grid(Nq, cfg["BLOCK_M"], heads)
    fastpath.launch(block_sparse_fwd_kernel, grid, (
        q, k, v, out, lse if return_lse else out, *mask_tensors[:5], mask_tensors[10],
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        B, Hq, Hkv, Nq, Nk, d, Hq // Hkv, *_mask_args(mask_tensors), scale * LOG2E),
        dict(STORE_LSE=return_lse, USE_DESC=use_desc, INPUT_PRECISION=precision,
             UPCAST_DOT=interpret and q.dtype == torch.bfloat16, MASK_BQ=block_q, MASK_BK=block_k,
             BLOCK_D=block_d, FLAT_GRID=heads > MAX_GRID_Y, **cfg))
    launches.record("block_sparse_attention", path, "block_sparse",
                    lambda: f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} "
                            f"mask {block_q}x{block_k}" + (" desc" if use_desc else ""))
    return out, lse


def block_sparse_backward(dout, q, k, v, out, lse, dlse, mask_tensors, block_q: int, block_k: int, scale: float,
                          path):
    """(dq, dk, dv), contiguous in q's / k's / v's shapes, from dout (any strides), the forward's q, k, v, out and
    lse (fp32 [B, Hq, Nq]), dlse (the lse output's gradient, lse's layout) or None, and the BlockMask's tensors.
    No atomics: bit-identical run to run."""
    precision = precision_for(q.dtype, q.is_cuda)
    return _BLOCK_SPARSE_BACKWARD.run(
        (dout, q, k, v, out, lse, dlse, *mask_tensors), (block_q, block_k, scale, precision),
        lambda: _block_sparse_backward(dout, q, k, v, out, lse, dlse, mask_tensors, block_q, block_k, scale, path,
                                       precision))[:3]


def _block_sparse_backward(dout, q, k, v, out, lse, dlse, mask_tensors, block_q, block_k, scale, path, precision):
    """(dq, dk, dv, delta): delta (D = rowsum(dO * O) - dlse), which both passes read, returned beside the
    gradients so that the fast path's plan allocates it."""
    from tilefuse.kernels.attention.backward import attention_bwd_rowdot_kernel
    from tilefuse.kernels.attention.block_sparse import block_sparse_bwd_dkdv_kernel, block_sparse_bwd_dq_kernel

    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    interpret = path == runtime.INTERPRETER
    block_d = max(16, next_pow2(d))
    dq = torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hkv, Nk, d), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hkv, Nk, d), dtype=v.dtype, device=q.device)
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    rows = 64
    fastpath.launch(attention_bwd_rowdot_kernel, (cdiv(Nq, rows), B * Hq), (
        out, dout, dlse if dlse is not None else delta, delta, *out.stride(), *dout.stride(), Hq, Nq, d),
        dict(HAS_DLSE=dlse is not None, BLOCK_M=rows, BLOCK_D=block_d))
    cfg = backward_config(block_d, q.element_size(), interpret)
    cfg = dict(cfg, BLOCK_M=min(cfg["BLOCK_M"], block_q), BLOCK_N=min(cfg["BLOCK_N"], block_k))
    flags = dict(INPUT_PRECISION=precision, UPCAST_DOT=interpret and q.dtype == torch.bfloat16, MASK_BQ=block_q,
                 MASK_BK=block_k, BLOCK_D=block_d, **cfg)
    masks = _mask_args(mask_tensors)
    dkdv_flags = flags
    if not interpret and q.element_size() == 2 and cfg["BLOCK_M"] == 64:
        dkdv_flags = dict(flags, num_stages=BACKWARD_DKDV_STAGES)
    fastpath.launch(block_sparse_bwd_dkdv_kernel, (cdiv(Nk, cfg["BLOCK_N"]), B * Hkv), (
        q, k, v, dout, lse, delta, dk, dv, *mask_tensors[5:10], mask_tensors[10],
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        Hq, Hkv, Nq, Nk, d, Hq // Hkv, *masks, scale * LOG2E, scale), dkdv_flags)
    fastpath.launch(block_sparse_bwd_dq_kernel, (cdiv(Nq, cfg["BLOCK_M"]), B * Hq), (
        q, k, v, dout, lse, delta, dq, *mask_tensors[:5], mask_tensors[10],
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        Hq, Nq, Nk, d, Hq // Hkv, *masks, scale * LOG2E, scale), flags)
    launches.record("block_sparse_attention_backward", path, "block_sparse: rowdot, dk/dv, dq (no atomics)",
                    lambda: f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} mask {block_q}x{block_k}")
    return dq, dk, dv, delta


# ---- FP8 forward (fp8.py; ws_fp8.py on sm_90) -------------------------------------------------------
# switches.attention.FP8_KERNEL picks the kernel ("auto": the warp-specialized one where it applies), and
# FP8_DESCRIPTORS the portable kernel's loads. The portable FP8 kernel's tiles: BLOCK_M and BLOCK_N divide fp8.QUANT_BLOCK (one scale per tile).
FP8_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
FP8_INTERPRETER_CONFIG = dict(BLOCK_M=64, BLOCK_N=64)
QUANT_INTERPRETER_ROWS = 64  # the V pass's rows per program in the interpreter (its cost is per program)
QUANT_TILE_ELEMENTS = 16384  # the V pass's [rows, d] block on a GPU: 128 rows up to d 128, fewer past it
QUANT_PART_ROWS = 32  # partial amaxes reduced per step by the V pass's scale programs


def quantize_blocks(t: torch.Tensor, rotation, path) -> tuple[torch.Tensor, torch.Tensor]:
    """t [B, H, N, d] (any strides, 16/32-bit) -> (e4m3 [B, H, N, d] contiguous, fp32 scales [B, H, cdiv(N,
    QUANT_BLOCK)]); ``rotation``: None or the ±1 [d, d] matrix (d a power of two; t's dtype: half the bytes
    each program reads at 16 bits), applied first."""
    B, H, N, d = t.shape
    dst = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device)
    blocks = cdiv(N, fp8.QUANT_BLOCK)
    scales = torch.empty((B, H, blocks), dtype=torch.float32, device=t.device)
    fastpath.launch(fp8.quantize_blocks_kernel, (blocks, B * H), (
        t, dst, scales, rotation if rotation is not None else scales, H, N, d, *t.stride(), *dst.stride()),
        dict(ROTATE=rotation is not None, INTERPRETER=path == runtime.INTERPRETER, BLOCK_R=fp8.QUANT_BLOCK, BLOCK_D=max(16, next_pow2(d)),
             **({} if path == runtime.INTERPRETER else dict(num_warps=8))))
    return dst, scales


_QUANTIZE = fastpath.Plans("quantize_qkv")


def quantize_qkv(q, k, v, rotation, path):
    """The whole pre-pass, one plan of the fast path (its five launches replayed through the C launcher on a call
    like an earlier one): (q8, q_scale, k8, k_scale, v8, v_scale) as ``quantize_blocks`` for q and k and
    ``quantize_channels_transposed`` for v give them."""
    out = _QUANTIZE.run((q, k, v, rotation), (path,), lambda: (
        *quantize_blocks(q, rotation, path), *quantize_blocks(k, rotation, path),
        *_channels_transposed(v, path)))
    return out[:6]  # the seventh: the V pass's partial amaxes, a temporary each replay allocates


def quantize_channels_transposed(t: torch.Tensor, path) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 V^T view, per-channel scales): :func:`_channels_transposed` without its temporary."""
    return _channels_transposed(t, path)[:2]


def _channels_transposed(t: torch.Tensor, path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t [B, H, N, d] -> (e4m3 [B, H, N, d] view of a [B, H, d, N] buffer (keys contiguous, the layout FP8
    wgmma reads for P @ V; rows padded to a multiple of 16 keys, so V^T is TMA-able at any N and the
    warp-specialized kernel takes it), fp32 per-channel scales [B, H, d]): the column amaxes per row block,
    the scales once per head, then the cast per row block (fp8.channel_amax_kernel, fp8.channel_scale_kernel,
    fp8.quantize_transposed_kernel); third, the partial amaxes [B * H, blocks, d] fp32 (a temporary)."""
    B, H, N, d = t.shape
    dst = torch.empty_strided((B, H, d, N), constants.fp8_v_t_strides(B, H, d, N), dtype=torch.float8_e4m3fn,
                              device=t.device).transpose(2, 3)
    scales = torch.empty((B, H, d), dtype=torch.float32, device=t.device)
    block_d = max(16, next_pow2(d))
    interpret = path == runtime.INTERPRETER
    rows = QUANT_INTERPRETER_ROWS if interpret else max(16, min(128, QUANT_TILE_ELEMENTS // block_d))
    blocks = cdiv(N, rows)
    partial = torch.empty((B * H, blocks, d), dtype=torch.float32, device=t.device)
    warps = {} if interpret else dict(num_warps=8)
    fastpath.launch(fp8.channel_amax_kernel, (blocks, B * H), (t, partial, H, N, d, *t.stride()),
                    dict(BLOCK_R=rows, BLOCK_D=block_d, **warps))
    fastpath.launch(fp8.channel_scale_kernel, (B * H,), (partial, scales, d, blocks),
                    dict(BLOCK_D=block_d, PART_ROWS=QUANT_PART_ROWS, **warps))
    fastpath.launch(fp8.quantize_transposed_kernel, (blocks, B * H), (
        t, scales, dst, H, N, d, *t.stride(), *dst.stride()), dict(BLOCK_R=rows, BLOCK_D=block_d, **warps))
    return dst, scales, partial


# The warp-specialized FP8 kernel's ring: 128-key tiles (one K scale each), three stages in 148 KB at d 128
# (sm_90a, no spills; two take 115 KB).
FP8_WS_CONFIG = dict(BLOCK_N=128, STAGES=3)


def fp8_ws_usable(q, k, v_t, out) -> bool:
    """The cases the warp-specialized FP8 kernel takes: sm_90, head dim 64 or 128, a 16-bit output, and q, k,
    v^T [B, Hkv, d, Nk] and out TMA-able (so Nk a multiple of 16)."""
    return (q.is_cuda and runtime.device_facts(q.device)[0] == 9 and q.shape[-1] in ws_fp8.SUPPORTED_HEAD_DIMS
            and out.dtype in (torch.float16, torch.bfloat16) and descriptors_usable(q, k, v_t, out))


_FP8_FORWARD = fastpath.Plans("attention_fp8")


def forward_fp8(q, k, v, q_scale, k_scale, v_scale, scale: float, pos_offset: int, window_left: int,
                window_right: int, out_dtype, path):
    """out [B, Hq, Nq, d] in ``out_dtype`` for e4m3 q [B, Hq, Nq, d], k [B, Hkv, Nk, d] and v [B, Hkv, Nk, d]
    with keys contiguous (v.stride(2) == 1), fp32 scales q [B, Hq, cdiv(Nq, 128)], k [B, Hkv, cdiv(Nk,
    128)], v [B, Hkv, d] contiguous; Nq, Nk >= 1. Runs the warp-specialized kernel (ws_fp8.py) where
    ``fp8_ws_usable`` and switches.attention.FP8_KERNEL allow, the portable one (fp8.py) elsewhere; a call
    like an earlier one replays that launch (one fast-path plan)."""
    return _FP8_FORWARD.run((q, k, v, q_scale, k_scale, v_scale),
                            (scale, pos_offset, window_left, window_right, out_dtype, path),
                            lambda: _forward_fp8(q, k, v, q_scale, k_scale, v_scale, scale, pos_offset,
                                                 window_left, window_right, out_dtype, path))


def _forward_fp8(q, k, v, q_scale, k_scale, v_scale, scale: float, pos_offset: int, window_left: int,
                 window_right: int, out_dtype, path):
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    out = torch.empty((B, Hq, Nq, d), dtype=out_dtype, device=q.device)
    interpret = path == runtime.INTERPRETER
    vt = v.transpose(2, 3)  # [B, Hkv, d, Nk], keys contiguous
    flat = B * Hq > MAX_GRID_Y
    windows = (scale * LOG2E, pos_offset, max(window_left, 0), max(window_right, 0))
    flags = dict(HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, FLAT_GRID=flat)
    if switches.attention.FP8_KERNEL == "auto" and not interpret and fp8_ws_usable(q, k, vt, out):
        ensure_descriptor_allocator()
        fastpath.launch(ws_fp8.attention_fp8_ws_kernel, _grid(Nq, ws.BLOCK_M.value, B * Hq), (
            q, k, vt, out, q_scale, k_scale, v_scale, B, Hq, Hkv, Nq, Nk, d, *q.stride()[:3], *k.stride()[:3],
            *vt.stride()[:3], *out.stride()[:3], *windows),
            dict(HEAD_D=d, **flags, **FP8_WS_CONFIG, FMA_SOFTMAX=switches.attention.FP8_FMA_SOFTMAX and scale > 0,
                 num_warps=4, maxnreg=ws.LAUNCH_MAXNREG))
        launches.record("attention_fp8", path, "ws", lambda: tuning.describe(dict(BLOCK_M=ws.BLOCK_M.value,
                                                                                   **FP8_WS_CONFIG)))
        return out
    cfg = FP8_INTERPRETER_CONFIG if interpret else FP8_CONFIG
    # Descriptors on sm_90 (TMA-able tensors), pointer loads elsewhere and in the interpreter; tests run both.
    use_desc = switches.attention.FP8_DESCRIPTORS if switches.attention.FP8_DESCRIPTORS is not None else (
        not interpret and runtime.device_facts(q.device)[0] >= 9 and descriptors_usable(q, k, vt))
    if use_desc:
        ensure_descriptor_allocator()
    fastpath.launch(fp8.attention_fp8_fwd_kernel, _grid(Nq, cfg["BLOCK_M"], B * Hq), (
        q, k, vt, out, q_scale, k_scale, v_scale, *q.stride(), *k.stride(), *vt.stride(), *out.stride(),
        Hq, Nq, Nk, d, Hq // Hkv, *windows, sizes.m_bucket(Nq), sizes.m_bucket(Nk), B, Hkv),
        dict(QBLOCK=fp8.QUANT_BLOCK, USE_DESC=use_desc, BLOCK_D=max(16, next_pow2(d)), **flags, **cfg))
    launches.record("attention_fp8", path, "portable", lambda: tuning.describe(cfg))
    return out

"""The QKV projection into head layout: one launch per projection writing [B, h, N, d] (or a bnhd view), RoPE and
QK-norm on q and k in the epilogue: Hopper's TMA kernels (whole heads, or the parts form for the other rotate-half
cases), the pointer kernels elsewhere."""
from __future__ import annotations

import torch

from tilefuse import runtime, sizes
from tilefuse.kernels import fastpath, launches, switches
from tilefuse.kernels.gemm.launch.rules import hopper_tma
from tilefuse.runtime import precision_for
from tilefuse.sizes import cdiv

_QKV = fastpath.Plans("qkv_projection")
# The Hopper QKV kernel's tile per (head dim, RoPE or QK-norm in the epilogue): (BLOCK_M, heads per tile,
# num_warps, num_stages). Plain d 128 takes two heads (128x256, as the linear TMA table's fastest tiles); with
# RoPE or QK-norm two heads spill on sm_90a and one head does not. d 256 takes 64 rows. The compile test
# (tests/test_sm90_compile.py) holds these tiles spill-free. switches.gemm.QKV_TMA False leaves every call to the
# pointer kernels.
QKV_TMA_TILES = {(64, False): (128, 2, 8, 4), (64, True): (128, 2, 8, 4), (128, False): (128, 2, 8, 3),
                 (128, True): (128, 1, 8, 4), (256, False): (64, 1, 8, 3), (256, True): (64, 1, 8, 3)}
QKV_TMA_BLOCK_K, QKV_TMA_GROUP_M = 64, 8


# The parts form (qkv.qkv_projection_tma_parts_kernel) for every other rotate-half case -- d 80, 96, 160, 192,
# partial rotary -- under switches.gemm.QKV_TMA_PARTS: (BLOCK_M, num_warps, num_stages) by the width its
# accumulators take (padded parts): up to 128 columns 128 rows, wider 64 rows (as d 256 above).
def qkv_tma_parts_tile(head_dim: int, rot: int, rope: bool) -> dict:
    """The parts kernel's padded part widths and tile for one projection: BLOCK_R per rotary half (16 without
    RoPE: unused), BLOCK_P for the pass-through columns (16 when RoPE covers all of d: unused)."""
    block_r = max(16, sizes.next_pow2(rot // 2)) if rope else 16
    has_pass = rot < head_dim
    block_p = max(16, sizes.next_pow2(head_dim - rot)) if has_pass else 16
    width = (2 * block_r if rope else 0) + (block_p if has_pass else 0)
    block_m, stages = (128, 4) if width <= 128 else (64, 3)
    return dict(BLOCK_R=block_r, BLOCK_P=block_p, HAS_PASS=has_pass, BLOCK_M=block_m, num_warps=8,
                num_stages=stages)


def qkv_projection(x2d, seq_len, weights, biases, heads, head_dim, rotary, interleaved, qk_norm, layout,
                   make_outputs, path):
    """(q, k, v) from ``make_outputs()`` -- each [B, h, N, d], or with ``layout`` "bnhd" the [B, h, N, d] view
    of a [B, N, h, d] tensor -- written from x2d [M = B * N, K] (unit column stride) by qkv.py: one launch per
    projection, RoPE (``rotary`` (cos, sin) [N, r] or [B, N, r], or None) and QK-norm (``qk_norm`` (q weight,
    k weight, eps) or None) on q and k. Each weight [h * d, K] has a unit stride on one of its two dims (nn.Linear's layout, or the transposed view of
    GPT-2's Conv1D weight) and is read in place. Repeated calls replay (kernels/fastpath.py)."""
    cos, sin = rotary if rotary is not None else (None, None)
    q_w, k_w, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    inputs = (x2d, *weights, *biases, cos, sin, q_w, k_w)
    scalars = (seq_len, tuple(heads), head_dim, bool(interleaved), float(eps), layout,
               precision_for(x2d.dtype, x2d.is_cuda))
    return _QKV.run(inputs, scalars, lambda: _qkv_projection(x2d, seq_len, weights, biases, heads, head_dim,
                                                               rotary, interleaved, qk_norm, make_outputs(), path))


def _qkv_projection(x2d, seq_len, weights, biases, heads, head_dim, rotary, interleaved, qk_norm, outs, path):
    from tilefuse.kernels.gemm.qkv import (qkv_projection_head_kernel, qkv_projection_kernel,
                                           qkv_projection_tma_kernel, qkv_projection_tma_parts_kernel)

    M, K = x2d.shape
    interpret = path == runtime.INTERPRETER
    tile = dict(BLOCK_M=64, BLOCK_K=32 if interpret else 64)
    forms = []
    for i, (w, b, h, out) in enumerate(zip(weights, biases, heads, outs)):
        qk = i < 2
        use_rope = qk and rotary is not None
        rot = rotary[0].shape[-1] if use_rope else 0  # v is never rotated: all its columns pass through
        use_norm = qk and qk_norm is not None
        cos, sin = rotary if use_rope else (x2d, x2d)
        stride_cb, stride_cn = ((cos.stride(0), cos.stride(1)) if cos.dim() == 3 else (0, cos.stride(0))) \
            if use_rope else (0, 0)
        norm_w = qk_norm[i] if use_norm else x2d
        flags = dict(HAS_BIAS=b is not None, HAS_ROPE=use_rope, INTERLEAVED=bool(interleaved), HAS_NORM=use_norm)
        out_strides = (out.stride(0), out.stride(1), out.stride(2), stride_cb, stride_cn,
                       float(qk_norm[2]) if use_norm else 0.0)
        w_kn = w.stride(1) != 1  # the transposed view of a Conv1D weight: unit stride down the rows
        tma_tile = QKV_TMA_TILES.get((head_dim, use_rope or use_norm)) if switches.gemm.QKV_TMA else None
        # Hopper's shared memory (the tiles are sized for its 227 KB), 16-bit operands, at least one full row
        # tile (decode-sized M keeps the pointer kernel's 64-row tiles, one program per head).
        on_hopper = hopper_tma(x2d, w.t() if w_kn else w)
        if tma_tile is not None and (not use_rope or rot == head_dim) and on_hopper and M >= tma_tile[0]:
            block_m, per_tile, warps, stages = tma_tile
            per_tile = min(per_tile, h)
            fastpath.launch_persistent(qkv_projection_tma_kernel, cdiv(M, block_m) * cdiv(h, per_tile), (
                x2d, w, b if b is not None else w, out, cos, sin, norm_w, M, seq_len, K, h, x2d.stride(0),
                w.stride(1) if w_kn else w.stride(0), *out_strides),
                dict(flags, W_KN=w_kn, BLOCK_M=block_m, HEAD_DIM=head_dim, HEADS_PER_TILE=per_tile,
                     BLOCK_K=QKV_TMA_BLOCK_K, GROUP_M=QKV_TMA_GROUP_M, num_warps=warps, num_stages=stages),
                x2d.device)
            forms.append(f"tma {block_m}x{per_tile * head_dim}x{QKV_TMA_BLOCK_K} w{warps} s{stages}")
            continue
        parts = qkv_tma_parts_tile(head_dim, rot, use_rope)
        if switches.gemm.QKV_TMA_PARTS and on_hopper and not (use_rope and interleaved) and M >= parts["BLOCK_M"]:
            fastpath.launch_persistent(qkv_projection_tma_parts_kernel, cdiv(M, parts["BLOCK_M"]) * h, (
                x2d, w, b if b is not None else w, out, cos, sin, norm_w, M, seq_len, K, h,
                x2d.stride(0), w.stride(1) if w_kn else w.stride(0), *out_strides),
                dict(HEAD_DIM=head_dim, ROT=rot, HAS_BIAS=b is not None, HAS_ROPE=use_rope, HAS_NORM=use_norm,
                     W_KN=w_kn, BLOCK_K=QKV_TMA_BLOCK_K, GROUP_M=QKV_TMA_GROUP_M, **parts), x2d.device)
            widths = ([f"{parts['BLOCK_R']}+{parts['BLOCK_R']}"] if use_rope else []) + \
                ([str(parts["BLOCK_P"])] if parts["HAS_PASS"] else [])
            forms.append(f"tma parts {parts['BLOCK_M']}x({'+'.join(widths)})x{QKV_TMA_BLOCK_K} "
                         f"w{parts['num_warps']} s{parts['num_stages']}")
            continue
        if w_kn and (K - 1) * w.stride(1) >= 2**31:  # the pointer kernels' K offsets are 32-bit
            w = w.contiguous()
        flags.update(INPUT_PRECISION=precision_for(x2d.dtype, x2d.is_cuda),
                     UPCAST_DOT=interpret and x2d.dtype == torch.bfloat16, **tile)
        block_d = max(16, sizes.next_pow2(head_dim))
        common = (M, seq_len, K, head_dim)
        strides = (x2d.stride(0), w.stride(0), w.stride(1), *out_strides)
        if not use_rope or rot == head_dim == block_d:
            # One K loop over the head's columns (RoPE, if any, over all of them: the pairs split in registers).
            # 4 warps hold a 64-row head tile up to d 128 without spilling on sm_90a; d 256 takes 8.
            launch_opts = {} if interpret else dict(num_warps=8 if block_d >= 256 else 4, num_stages=3)
            fastpath.launch(qkv_projection_head_kernel, (cdiv(M, tile["BLOCK_M"]), h), (
                x2d, w, b if b is not None else w, out, cos, sin, norm_w, *common, *strides),
                dict(flags, BLOCK_D=block_d, **launch_opts))
            forms.append(f"one loop {tile['BLOCK_M']}x{block_d}x{tile['BLOCK_K']}")
            continue
        # Partial rotary (r < d) or a d that is not a power of two with RoPE: the two rotary halves and the
        # pass-through columns as three accumulators (a K loop each).
        block_r = max(16, sizes.next_pow2(max(rot // 2, 1)))
        block_p = max(16, sizes.next_pow2(max(head_dim - rot, 1)))
        fastpath.launch(qkv_projection_kernel, (cdiv(M, tile["BLOCK_M"]), h), (
            x2d, w, b if b is not None else w, out, cos, sin, norm_w, *common, rot, *strides),
            dict(flags, BLOCK_R=block_r, BLOCK_P=block_p))
        forms.append(f"three parts {tile['BLOCK_M']} rows, K by {tile['BLOCK_K']}")
    launches.record("qkv_projection", path, "head layout, RoPE and QK-norm in the epilogue",
                    lambda: f"q/k/v: {', '.join(forms)}")
    return tuple(outs)

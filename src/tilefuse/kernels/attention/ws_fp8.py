"""FP8 (e4m3) FlashAttention forward for Hopper with warp specialization (Gluon): ws.py's kernel -- a TMA
producer warp, two consumer warpgroups of 64 query rows in FA3's ping-pong order -- with both products in
FP8 on the tensor cores (twice the 16-bit rate).

What changes from the 16-bit kernel (fp8.py has the scheme and its reasons):
- Q, K and V arrive e4m3 with fp32 scales: Q one per CTA (its 128 rows are one scale block), K one per
  128-key tile, multiplied into the score scale as the tile's QK^T is issued; V per channel, applied with the
  row sum on the output.
- V is read transposed, [d, Nk] tiles with keys contiguous: FP8 wgmma takes its B operand K-major only, and
  the reduction of P @ V runs over keys. P goes to registers as e4m3 (times P_SCALE) for the A operand.
- The output (16-bit) gets its own shared staging buffer, since Q's buffers are e4m3.
Shared memory at d 128, 128-key tiles: Q 16 KB, K and V^T 32 KB a stage, O staging 32 KB.
HBM bytes: Q, K, V one byte an element, O two (+ the scales).
Limits: sm_90, head dims 64 and 128 (d 64 in 64-wide tiles), Nk a multiple of 16 (V^T's row stride is
16-byte aligned), TMA-able q, k and v^T; the portable FP8 kernel (fp8.py) runs elsewhere.
"""
from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tilefuse import constants
from tilefuse.kernels import cache_keys
from tilefuse.kernels.attention.common import key_tile_ranges, query_block_and_head
from tilefuse.kernels.attention.ws import (BLOCK_M, CONSUMER_REGS, HALF_M, LAUNCH_MAXNREG, PRODUCER_REGS,
                                           _online_softmax_step, hide_keys, ring_barriers)

SUPPORTED_HEAD_DIMS = (64, 128)
QBLOCK = gl.constexpr(constants.FP8_ATTENTION_BLOCK)  # rows per Q/K scale
P_SCALE = gl.constexpr(constants.FP8_P_SCALE)
LOG2_P_SCALE = gl.constexpr(math.log2(constants.FP8_P_SCALE))


@gluon.constexpr_function
def fp8_accumulator_layout(cols):
    """The register layout of a [64, cols] fp32 wgmma result from 8-bit operands (instruction K = 32)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 32])


@gluon.constexpr_function
def fp8_operand_layout(acc_layout):
    """The layout of an 8-bit A operand in registers for a wgmma into ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)


@gluon.jit
def _p_operand(p, p_layout: gl.constexpr, FMA_SOFTMAX: gl.constexpr):
    if not FMA_SOFTMAX:  # the fused step's exp2 made P times P_SCALE already
        p = p * P_SCALE
    return gl.convert_layout(p.to(gl.float8e4nv), p_layout)


@gluon.jit
def _softmax_step(s, m_i, l_i, start, pos_m, N_K, window_left, window_right, qk_scale, masked,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                  FMA_SOFTMAX: gl.constexpr):
    """One key tile's online-softmax step. FMA_SOFTMAX (the launch sets it for qk_scale > 0): the row max taken
    over the raw scores and scaled once per row, then P_SCALE * exp2(s * qk_scale - m) as one FMA and one exp2 per
    element (log2(P_SCALE) joins the subtracted max, so l sums P_SCALE * p and the two cancel in O = acc / l).
    Otherwise ws.py's step (scale every score, then max and exp2), P scaled in _p_operand."""
    if not FMA_SOFTMAX:
        return _online_softmax_step(s, m_i, l_i, start, pos_m, N_K, window_left, window_right, qk_scale, masked,
                                    HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout)
    if masked:
        s = hide_keys(s, start, pos_m, N_K, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout)
    m_raw = gl.max(s, 1)
    # qk_scale > 0 keeps the max where it is; a zero-scale block (a tensor of zeros) must not make 0 * -inf
    m_new = gl.maximum(m_i, gl.where(m_raw == float("-inf"), float("-inf"), m_raw * qk_scale))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2 of -inf gives 0
    t = s * qk_scale - (m_safe - LOG2_P_SCALE)[:, None]
    if masked:  # hidden keys hold -inf (raw scores are finite): -inf again, whatever 0 * -inf gave
        t = gl.where(s == float("-inf"), float("-inf"), t)
    p = gl.exp2(t)
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _consume(acc, m_i, l_i, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, other_turn,
             ks_base, lo_tile, hi, full_start, full_end, pos_m, N_K, window_left, window_right, qk_scale,
             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
             STAGES: gl.constexpr, WHICH: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
             p_layout: gl.constexpr, FMA_SOFTMAX: gl.constexpr):
    """ws._consume_pingpong's schedule over e4m3 tiles: tile j's QK^T and tile j-1's PV issued together, tile
    j's softmax while that PV runs; the consumers take turns issuing. Each tile's key scale joins qk_scale."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.wait(my_turn, 1 - WHICH)
    mbarrier.wait(k_ready.index(0), 0)
    k_t = k_bufs.index(0).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
    s = warpgroup_mma(q_buf, k_t, gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    mbarrier.arrive(other_turn, count=1)
    k_scale = gl.load(ks_base + lo_tile // QBLOCK)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    masked = (lo_tile < full_start) | (lo_tile >= full_end)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, lo_tile, pos_m, N_K, window_left, window_right,
                                       qk_scale * k_scale, masked, HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout, FMA_SOFTMAX)
    p_op = _p_operand(p, p_layout, FMA_SOFTMAX)
    it = lo_tile * 0
    for start in range(lo_tile + BLOCK_N, hi, BLOCK_N):
        prev = it % STAGES
        prev_phase = (it // STAGES) & 1
        it += 1
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(my_turn, (it & 1) ^ (1 - WHICH))
        mbarrier.wait(k_ready.index(slot), phase)
        k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
        s = warpgroup_mma(q_buf, k_t, gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        v_t = v_bufs.index(prev).reshape([HEAD_D, BLOCK_N]).permute((1, 0))
        acc = warpgroup_mma(p_op, v_t, acc, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        k_scale = gl.load(ks_base + start // QBLOCK)
        s = warpgroup_mma_wait(1, deps=(s, ))  # groups retire in order: QK^T done, PV may still run
        mbarrier.arrive(k_empty.index(slot), count=1)
        masked = (start < full_start) | (start >= full_end)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, start, pos_m, N_K, window_left, window_right,
                                           qk_scale * k_scale, masked, HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout,
                                           FMA_SOFTMAX)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = _p_operand(p, p_layout, FMA_SOFTMAX)
    last = it % STAGES
    mbarrier.wait(v_ready.index(last), (it // STAGES) & 1)
    v_t = v_bufs.index(last).reshape([HEAD_D, BLOCK_N]).permute((1, 0))
    acc = warpgroup_mma(p_op, v_t, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, WHICH: gl.constexpr, FMA_SOFTMAX: gl.constexpr):
    """Consumer WHICH (0 or 1): query rows m0 + WHICH*HALF_M .. +HALF_M of the CTA's block."""
    q_desc, k_desc, v_desc, o_desc, qs_ptr, ks_ptr, vs_ptr = descs
    q_bufs, k_bufs, v_bufs, o_bufs = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    (b, h, m0, lo_tile, hi, N_Q, N_K, qk_scale, pos_offset, window_left, window_right, group, pid_bh, D,
     H_KV) = params
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    s_layout: gl.constexpr = fp8_accumulator_layout(BLOCK_N)
    o_layout: gl.constexpr = fp8_accumulator_layout(HEAD_D)
    p_layout: gl.constexpr = fp8_operand_layout(o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    rows0 = m0 + WHICH * HALF_M
    _, _, full_start, full_end = key_tile_ranges(rows0, HALF_M, N_Q, N_K, pos_offset, window_left, window_right,
                                                 HAS_LEFT, HAS_RIGHT, BLOCK_N)
    pos_m = rows0 + gl.arange(0, HALF_M, layout=row_s) + pos_offset
    bh_kv = (b * H_KV + h // group).to(gl.int64)
    ks_base = ks_ptr + bh_kv * gl.cdiv(N_K, QBLOCK)
    qk_scale = qk_scale * gl.load(qs_ptr + pid_bh.to(gl.int64) * gl.cdiv(N_Q, QBLOCK) + m0 // QBLOCK)

    q_buf = q_bufs.index(WHICH).reshape([HALF_M, HEAD_D])
    mbarrier.wait(q_ready.index(WHICH), 0)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF_M], gl.float32, row_s)
    acc = gl.zeros([HALF_M, HEAD_D], gl.float32, o_layout)
    acc, m_i, l_i = _consume(acc, m_i, l_i, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                             turns.index(WHICH), turns.index(1 - WHICH), ks_base, lo_tile, hi, full_start, full_end,
                             pos_m, N_K, window_left, window_right, qk_scale, HAS_LEFT, HAS_RIGHT, BLOCK_N, HEAD_D,
                             STAGES, WHICH, s_layout, o_layout, p_layout, FMA_SOFTMAX)
    # Rows that saw no key give 0; V's channel scales and P_SCALE come out with the row sum (in it already when
    # the fused step scaled P).
    offs_d = gl.arange(0, HEAD_D, layout=col_o)
    v_scale = gl.load(vs_ptr + bh_kv * D + offs_d, mask=offs_d < D, other=0.0)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    if not FMA_SOFTMAX:
        l_safe = l_safe * P_SCALE
    out = acc * v_scale[None, :] / gl.convert_layout(l_safe, row_o)[:, None]
    o_buf = o_bufs.index(WHICH)
    o_buf.reshape([HALF_M, HEAD_D]).store(out.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, rows0, 0], o_buf)
    tma.store_wait(0)


@gluon.jit
def _producer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, WHICH: gl.constexpr):
    """One warp: Q for both consumers, then every K and V^T tile of the CTA's key range through the ring."""
    q_desc, k_desc, v_desc, o_desc, qs_ptr, ks_ptr, vs_ptr = descs
    q_bufs, k_bufs, v_bufs, o_bufs = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    (b, h, m0, lo_tile, hi, N_Q, N_K, qk_scale, pos_offset, window_left, window_right, group, pid_bh, D,
     H_KV) = params
    h_kv = h // group
    for c in gl.static_range(2):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + c * HALF_M, 0], q_ready.index(c), q_bufs.index(c))
    it = lo_tile * 0
    for start in range(lo_tile, hi, BLOCK_N):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h_kv, start, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, h_kv, 0, start], v_ready.index(slot), v_bufs.index(slot))
        it += 1


@gluon.jit(do_not_specialize=["B", "H_Q", "H_KV", "N_Q", "N_K", "pos_offset", "window_left", "window_right"])
def attention_fp8_ws_kernel(q_ptr, k_ptr, vt_ptr, o_ptr, qs_ptr, ks_ptr, vs_ptr, B, H_Q, H_KV, N_Q, N_K, D,
                            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                            stride_vb, stride_vh, stride_vd, stride_ob, stride_oh, stride_om,
                            qk_scale, pos_offset, window_left, window_right, HEAD_D: gl.constexpr,
                            HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, FLAT_GRID: gl.constexpr, FMA_SOFTMAX: gl.constexpr = False):
    """q [B, Hq, Nq, D], k [B, Hkv, Nk, D] e4m3, vt [B, Hkv, D, Nk] e4m3 (keys contiguous), o [B, Hq, Nq, D]
    16-bit; scales fp32 contiguous: qs [B, Hq, cdiv(Nq, 128)], ks [B, Hkv, cdiv(Nk, 128)], vs [B, Hkv, D].
    Descriptors are made here from the sizes and strides (zero-filled past D and Nk, stores clipped)."""
    elem: gl.constexpr = q_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, HALF_M, HEAD_D], elem)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, HEAD_D], elem)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, HEAD_D, BLOCK_N], elem)
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, HALF_M, HEAD_D], o_ptr.dtype.element_ty)
    q_desc = tma.make_tensor_descriptor(q_ptr, [B, H_Q, N_Q, D], [stride_qb, stride_qh, stride_qm, 1],
                                        [1, 1, HALF_M, HEAD_D], q_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, [B, H_KV, N_K, D], [stride_kb, stride_kh, stride_kn, 1],
                                        [1, 1, BLOCK_N, HEAD_D], k_layout)
    v_desc = tma.make_tensor_descriptor(vt_ptr, [B, H_KV, D, N_K], [stride_vb, stride_vh, stride_vd, 1],
                                        [1, 1, HEAD_D, BLOCK_N], v_layout)
    o_desc = tma.make_tensor_descriptor(o_ptr, [B, H_Q, N_Q, D], [stride_ob, stride_oh, stride_om, 1],
                                        [1, 1, HALF_M, HEAD_D], o_layout)
    pid_m, pid_bh = query_block_and_head(N_Q, BLOCK_M, FLAT_GRID)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    m0 = pid_m * BLOCK_M
    lo_tile, hi, _, _ = key_tile_ranges(m0, BLOCK_M, N_Q, N_K, pos_offset, window_left, window_right,
                                        HAS_LEFT, HAS_RIGHT, BLOCK_N)
    hi = gl.maximum(hi, lo_tile + 1)  # at least one tile (masked out whole where no row sees a key)

    q_bufs = gl.allocate_shared_memory(elem, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(elem, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(elem, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)

    descs = (q_desc, k_desc, v_desc, o_desc, qs_ptr, ks_ptr, vs_ptr)
    bufs = (q_bufs, k_bufs, v_bufs, o_bufs)
    bars = ring_barriers(STAGES)
    params = (b, h, m0, lo_tile, hi, N_Q, N_K, qk_scale, pos_offset, window_left, window_right, H_Q // H_KV, pid_bh,
              D, H_KV)
    gl.warp_specialize([
        (_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, BLOCK_N, STAGES, 0, FMA_SOFTMAX)),
        (_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, BLOCK_N, STAGES, 1, FMA_SOFTMAX)),
        (_producer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, BLOCK_N, STAGES, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


cache_keys.settle(globals())  # _softmax_step reads LOG2_P_SCALE (kernels/cache_keys.py says why)

"""Lab: warp-specialized Gluon forms of the attention backward's two passes, dK/dV (four of the backward's seven
GEMMs per tile) and dQ (the other three), for issue 18's fast Hopper backward. Not dispatched: nothing in
src/ imports this file. tests/tools/compiler.py's attention_bwd_ws_compile_job compiles it for sm_90a.

The portable dK/dV kernel (src/tilefuse/kernels/attention/backward.py) holds two [64, d] fp32 accumulators
beside its score tiles in one instruction stream: at d 128 it sits at 255 registers with one pipeline stage
(NOTES: the compile table), 0.40-0.61x FA2 for the whole backward. Here, per CTA, one key block of 128 keys
of one KV head:
- a producer warp loads the block's K and V once, then Q and dO of every query block that sees the keys (for
  every query head of the GQA group) through a ring of TMA buffers;
- two consumer warpgroups each own 64 of the keys, with their dK and dV accumulators in registers. Per query
  block: S^T = K Q^T and dP^T = V dO^T from shared memory (issued together), P^T = exp2(S^T - lse) while dP^T
  runs, dV += P^T dO issued, dS^T = P^T (dP^T - D) while it runs, then dK += dS^T Q; P^T and dS^T are wgmma's
  register operand (keys as rows: no transpose). The ring slot goes back when both consumers are done with it.
- the epilogue scales dK, stages dK and dV in the consumer's own K and V buffers and stores them by TMA
  (4-D descriptors clip rows past the head's N).
Scope of this form: 16-bit, head dim up to 128 (80 and 96 in 128-wide tiles), no mask, no soft-cap or ALiBi, no left window; causal and
right windows (HAS_RIGHT), GQA, any N (rows past N_Q get P = 0 through lse = +inf; keys past N_K only reach
dK/dV rows that are never stored).
D = rowsum(dO * O) comes from the portable row-dot kernel. The dQ pass (``attention_bwd_dq_ws_kernel``) has the
forward's structure: per CTA 128 query rows (two consumers of 64), K and V tiles through the ring, dQ += dS K.

    PYTHONPATH=src python benchmarks/attention_bwd_ws.py compile   # sm_90a facts (any machine)
    PYTHONPATH=src python benchmarks/attention_bwd_ws.py bench     # H200: check and time beside the portable pass
"""
from __future__ import annotations

import json
import math
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tilefuse.kernels.attention.ws import tile_head_dim
from tilefuse.kernels.gluon_host import host_descriptor
from tilefuse.sizes import cdiv

KEYS = 64  # keys per consumer warpgroup: a CTA's key block is 2 * KEYS
HALF_N = gl.constexpr(KEYS)
BLOCK_M = gl.constexpr(64)  # query rows per ring step
LOG2E = gl.constexpr(1.4426950408889634)
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
LAUNCH_MAXNREG = 168
CONFIGS = {"s2": dict(STAGES=2), "s3": dict(STAGES=3), "s4": dict(STAGES=4)}  # ring depth (Q and dO per slot: 2 x 64 x d x 2 bytes)
DEFAULT = "s2"


@gluon.jit
def _query_range(n0, N_Q, pos_offset, window_right, HAS_RIGHT: gl.constexpr):
    """[m_lo, m_hi): the query blocks whose rows see any key of the block starting at n0 (query i sees key
    j when j <= i + pos_offset + window_right), m_lo aligned down to BLOCK_M."""
    m_lo = 0
    if HAS_RIGHT:
        m_lo = gl.maximum(n0 - pos_offset - window_right, 0)
    return (m_lo // BLOCK_M) * BLOCK_M, N_Q


@gluon.jit
def _fill_slot(empty, ready, it, desc0, desc1, coord0, coord1, bufs0, bufs1):
    """Ring step ``it`` of a producer: wait for its slot to be free, then one box of each descriptor into it.
    Empty barriers start out complete for phase 1: nothing to wait for on the first lap."""
    STAGES: gl.constexpr = bufs0.type.shape[0]
    slot = it % STAGES
    mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), desc0.block_type.nbytes + desc1.block_type.nbytes)
    tma.async_copy_global_to_shared(desc0, coord0, ready.index(slot), bufs0.index(slot))
    tma.async_copy_global_to_shared(desc1, coord1, ready.index(slot), bufs1.index(slot))


@gluon.jit
def _producer(descs, bufs, bars, params, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr, WHICH: gl.constexpr):
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    kv_ready, ready, empty = bars
    b, h_kv, n0, N_Q, N_K, group, qk_scale, scale, pos_offset, window_right, H_Q = params
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, h_kv, n0 + c * HALF_N, 0], kv_ready, k_bufs.index(c))
        tma.async_copy_global_to_shared(v_desc, [b, h_kv, n0 + c * HALF_N, 0], kv_ready, v_bufs.index(c))
    m_lo, m_hi = _query_range(n0, N_Q, pos_offset, window_right, HAS_RIGHT)
    it = 0
    for g in range(group):
        h = h_kv * group + g
        for m0 in range(m_lo, m_hi, BLOCK_M):
            _fill_slot(empty, ready, it, q_desc, do_desc, [b, h, m0, 0], [b, h, m0, 0], q_bufs, do_bufs)
            it += 1


@gluon.jit
def _consumer(descs, bufs, bars, params, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr, WHICH: gl.constexpr):
    """Keys n0 + WHICH * 64 ... + 64 of the block: their dK and dV over every query block of the ring."""
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    kv_ready, ready, empty = bars
    b, h_kv, n0, N_Q, N_K, group, qk_scale, scale, pos_offset, window_right, H_Q = params
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # along S^T's rows (keys)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # along its columns (queries)

    keys0 = n0 + WHICH * HALF_N
    offs_n = keys0 + gl.arange(0, HALF_N, layout=key_layout)
    k_buf = k_bufs.index(WHICH).reshape([HALF_N, HEAD_D])
    v_buf = v_bufs.index(WHICH).reshape([HALF_N, HEAD_D])
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)
    m_lo, m_hi = _query_range(n0, N_Q, pos_offset, window_right, HAS_RIGHT)
    it = 0
    for g in range(group):
        h = h_kv * group + g
        rows_base = (b * H_Q + h).to(gl.int64) * N_Q
        for m0 in range(m_lo, m_hi, BLOCK_M):
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=query_layout)
            in_q = offs_m < N_Q
            # The row terms are issued before the wait: their latency hides under the ring and the first wgmma.
            lse = gl.load(lse_ptr + rows_base + offs_m, mask=in_q, other=float("-inf"))
            delta = gl.load(delta_ptr + rows_base + offs_m, mask=in_q, other=0.0)
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            q_buf = q_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            do_buf = do_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            # The row terms enter as the accumulators' initial values: S^T starts at -lse / qk_scale (lse in the
            # log2 domain, +inf on rows that saw no key and rows past N_Q: their P is 0) and dP^T at -D, so the
            # wgmmas return qk_scale^-1 (S^T - lse) and dP^T - D, and the two row vectors die here.
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
            zeros = gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout)
            s_t = warpgroup_mma(k_buf, q_buf.permute((1, 0)), zeros - (lse2 / qk_scale)[None, :], is_async=True)
            dp_t = warpgroup_mma(v_buf, do_buf.permute((1, 0)), zeros - delta[None, :], is_async=True)
            s_t = warpgroup_mma_wait(1, deps=(s_t, ))
            # No bounds mask: rows past N_Q get P = 0 from their lse, and keys past N_K (zeros from TMA) only
            # feed dK/dV rows the TMA store clips. The causal / right-window mask only where the block crosses it.
            s_t = s_t * qk_scale
            if HAS_RIGHT:
                if m0 + pos_offset + window_right < keys0 + HALF_N - 1:
                    s_t = gl.where(offs_n[:, None] <= offs_m[None, :] + (pos_offset + window_right), s_t,
                                   float("-inf"))
            p_t = gl.exp2(s_t)
            # dV's wgmma goes out before dS^T is made; waiting for all but it means dP^T is done (wgmma groups
            # complete in order), and P^T's fp32 tile dies with dS^T (d 128 fits 240 registers that way).
            p_op = gl.convert_layout(p_t.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_buf, dv, is_async=True)
            dp_t, dv = warpgroup_mma_wait(1, deps=(dp_t, dv))
            ds_op = gl.convert_layout((p_t * dp_t).to(dtype), op_layout)
            dk = warpgroup_mma(ds_op, q_buf, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(empty.index(slot), count=1)
            it += 1
    # Every wgmma on this consumer's K and V buffers has been waited for: they stage its dK and dV.
    k_buf.store((dk * scale).to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, h_kv, keys0, 0], k_bufs.index(WHICH))
    tma.async_copy_shared_to_global(dv_desc, [b, h_kv, keys0, 0], v_bufs.index(WHICH))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["N_Q", "N_K", "H_Q", "H_KV", "pos_offset", "window_right"])
def attention_bwd_dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr,
                                 H_Q, H_KV, N_Q, N_K, qk_scale, scale, pos_offset, window_right,
                                 HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release each slot
    n0 = gl.program_id(0) * (2 * HALF_N)
    pid_bh = gl.program_id(1)  # b * H_KV + h_kv
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    descs = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr)
    bufs = (q_bufs, do_bufs, k_bufs, v_bufs)
    bars = (kv_ready, ready, empty)
    params = (b, h_kv, n0, N_Q, N_K, H_Q // H_KV, qk_scale, scale, pos_offset, window_right, H_Q)
    # Constexprs go as separate arguments (inside a tuple they would become runtime values).
    gl.warp_specialize([
        (_consumer, (descs, bufs, bars, params, HAS_RIGHT, HEAD_D, 0)),
        (_consumer, (descs, bufs, bars, params, HAS_RIGHT, HEAD_D, 1)),
        (_producer, (descs, bufs, bars, params, HAS_RIGHT, HEAD_D, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- the dQ pass ------------------------------------------------------------------------------------
# Per CTA 128 query rows of one query head (two consumers of 64), the key tiles they see through a ring of K and
# V: S = Q K^T and dP = dO V^T together, P, dS = P (dP - D), dQ += dS K (dS the register operand). The forward's
# structure (ws.py) with dS in place of P.
BLOCK_KEYS = gl.constexpr(64)  # keys per ring step of the dQ pass


@gluon.jit
def _dq_key_end(m0, N_K, pos_offset, window_right, HAS_RIGHT: gl.constexpr):
    """The end of the keys rows [m0, m0 + 128) see (row i sees j <= i + pos_offset + window_right)."""
    hi = N_K
    if HAS_RIGHT:
        hi = gl.minimum(gl.maximum(m0 + 2 * BLOCK_M - 1 + pos_offset + window_right + 1, 0), N_K)
    return hi


@gluon.jit
def _dq_producer(descs, bufs, bars, params, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr, WHICH: gl.constexpr):
    q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    q_ready, ready, empty = bars
    b, h, h_kv, m0, N_Q, N_K, qk_scale, scale, pos_offset, window_right, pid_bh = params
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + c * BLOCK_M, 0], q_ready, q_bufs.index(c))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0 + c * BLOCK_M, 0], q_ready, do_bufs.index(c))
    hi = _dq_key_end(m0, N_K, pos_offset, window_right, HAS_RIGHT)
    it = 0
    for n0 in range(0, hi, BLOCK_KEYS):
        _fill_slot(empty, ready, it, k_desc, v_desc, [b, h_kv, n0, 0], [b, h_kv, n0, 0], k_bufs, v_bufs)
        it += 1


@gluon.jit
def _dq_consumer(descs, bufs, bars, params, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr, WHICH: gl.constexpr):
    """Rows m0 + WHICH * 64 ... + 64: their dQ over every key tile the CTA's rows see."""
    q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    q_ready, ready, empty = bars
    b, h, h_kv, m0, N_Q, N_K, qk_scale, scale, pos_offset, window_right, pid_bh = params
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_KEYS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows0 = m0 + WHICH * BLOCK_M
    offs_m = rows0 + gl.arange(0, BLOCK_M, layout=row_layout)
    in_q = offs_m < N_Q
    lse = gl.load(lse_ptr + pid_bh.to(gl.int64) * N_Q + offs_m, mask=in_q, other=float("-inf"))
    delta = gl.load(delta_ptr + pid_bh.to(gl.int64) * N_Q + offs_m, mask=in_q, other=0.0)
    # As in the dK/dV pass, the row terms are the score accumulators' initial values (broadcast along keys).
    s_init = gl.zeros([BLOCK_M, BLOCK_KEYS], gl.float32, s_layout) - \
        (gl.where(lse == float("-inf"), float("inf"), lse * LOG2E) / qk_scale)[:, None]
    dp_init = gl.zeros([BLOCK_M, BLOCK_KEYS], gl.float32, s_layout) - delta[:, None]
    q_buf = q_bufs.index(WHICH).reshape([BLOCK_M, HEAD_D])
    do_buf = do_bufs.index(WHICH).reshape([BLOCK_M, HEAD_D])
    dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(q_ready, 0)
    hi = _dq_key_end(m0, N_K, pos_offset, window_right, HAS_RIGHT)
    it = 0
    for n0 in range(0, hi, BLOCK_KEYS):
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        k_buf = k_bufs.index(slot).reshape([BLOCK_KEYS, HEAD_D])
        v_buf = v_bufs.index(slot).reshape([BLOCK_KEYS, HEAD_D])
        s = warpgroup_mma(q_buf, k_buf.permute((1, 0)), s_init, is_async=True)
        dp = warpgroup_mma(do_buf, v_buf.permute((1, 0)), dp_init, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        s = s * qk_scale
        # Keys past N_K (zeros from TMA) are masked here: unlike the dK/dV pass, they would reach dQ's rows.
        offs_n = n0 + gl.arange(0, BLOCK_KEYS, layout=key_layout)
        if HAS_RIGHT:
            if n0 + BLOCK_KEYS - 1 > rows0 + pos_offset + window_right:  # the tile crosses this consumer's edge
                s = gl.where(offs_n[None, :] <= offs_m[:, None] + (pos_offset + window_right), s, float("-inf"))
        if n0 + BLOCK_KEYS > N_K:
            s = gl.where((offs_n < N_K)[None, :], s, float("-inf"))
        p = gl.exp2(s)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds_op = gl.convert_layout((p * dp).to(dtype), op_layout)
        dq = warpgroup_mma(ds_op, k_buf, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        mbarrier.arrive(empty.index(slot), count=1)
        it += 1
    # Every wgmma on this consumer's Q buffer has been waited for: it stages dQ.
    q_buf.store((dq * scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, rows0, 0], q_bufs.index(WHICH))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["N_Q", "N_K", "H_Q", "H_KV", "pos_offset", "window_right"])
def attention_bwd_dq_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr,
                               H_Q, H_KV, N_Q, N_K, qk_scale, scale, pos_offset, window_right,
                               HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release each slot
    # Query blocks in reverse: under a causal mask the last ones see the most keys, so they start first.
    m0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * (2 * BLOCK_M)
    pid_bh = gl.program_id(1)  # b * H_Q + h
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // (H_Q // H_KV)
    descs = (q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr)
    bufs = (q_bufs, do_bufs, k_bufs, v_bufs)
    bars = (q_ready, ready, empty)
    params = (b, h, h_kv, m0, N_Q, N_K, qk_scale, scale, pos_offset, window_right, pid_bh)
    gl.warp_specialize([
        (_dq_consumer, (descs, bufs, bars, params, HAS_RIGHT, HEAD_D, 0)),
        (_dq_consumer, (descs, bufs, bars, params, HAS_RIGHT, HEAD_D, 1)),
        (_dq_producer, (descs, bufs, bars, params, HAS_RIGHT, HEAD_D, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ------------------------------------------------------------------------------------
def _tile(d: int) -> int:
    """The tiles' head-dim width, the forward's (ws.tile_head_dim): the descriptors keep the tensors' real d, so
    TMA fills the columns past it with zeros on load and clips them on store (d 80 and 96 run in 128-wide tiles).
    Past 128 the two [64, d] fp32 accumulators of the dK/dV pass do not fit a consumer's 240 registers."""
    if d > 128:
        raise ValueError(f"head dim {d}: the lab passes take d <= 128")
    return tile_head_dim(d)


def dkdv(q, k, v, dout, lse, delta, *, scale: float, causal: bool, config: str = DEFAULT):
    """(dk, dv) for q, dout [B, Hq, Nq, d], k, v [B, Hkv, Nk, d] (16-bit, d <= 128, unit last stride,
    16-byte-aligned rows), lse and delta fp32 [B, Hq, Nq] contiguous (delta = rowsum(dO * O)); causal
    aligned bottom-right as the forward (pos_offset = Nk - Nq)."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    q_box, kv_box = (1, 1, 64, _tile(d)), (1, 1, KEYS, _tile(d))
    attention_bwd_dkdv_ws_kernel[(cdiv(Nk, 2 * KEYS), B * Hkv)](
        host_descriptor(q, q_box), host_descriptor(k, kv_box), host_descriptor(v, kv_box),
        host_descriptor(dout, q_box), host_descriptor(dk, kv_box), host_descriptor(dv, kv_box), lse, delta,
        Hq, Hkv, Nq, Nk, scale * 1.4426950408889634, scale, Nk - Nq, 0, HAS_RIGHT=causal,
        STAGES=CONFIGS[config]["STAGES"], num_warps=4, maxnreg=LAUNCH_MAXNREG)
    return dk, dv


def dq(q, k, v, dout, lse, delta, *, scale: float, causal: bool, config: str = DEFAULT):
    """dq for the same arguments as ``dkdv``."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    q_box, kv_box = (1, 1, 64, _tile(d)), (1, 1, 64, _tile(d))
    attention_bwd_dq_ws_kernel[(cdiv(Nq, 128), B * Hq)](
        host_descriptor(q, q_box), host_descriptor(k, kv_box), host_descriptor(v, kv_box),
        host_descriptor(dout, q_box), host_descriptor(out, q_box), lse, delta,
        Hq, Hkv, Nq, Nk, scale * 1.4426950408889634, scale, Nk - Nq, 0, HAS_RIGHT=causal,
        STAGES=CONFIGS[config]["STAGES"], num_warps=4, maxnreg=LAUNCH_MAXNREG)
    return out


def compile_job(head_dim: int = 128, causal: bool = True, config: str = DEFAULT, dtype: str = "bfloat16",
                which: str = "dkdv"):
    """(kernel, signature, constexprs, options) as ``dkdv`` (``which`` "dkdv") or ``dq`` ("dq") launch it, for
    tests/tools/compiler.py."""
    from triton.runtime.jit import mangle_type

    t = torch.empty(1, 2, 256, head_dim, dtype=getattr(torch, dtype))
    q_sig = mangle_type(host_descriptor(t, (1, 1, 64, _tile(head_dim))))
    kv_sig = mangle_type(host_descriptor(t, (1, 1, KEYS, _tile(head_dim))))
    rest = dict(lse_ptr="*fp32", delta_ptr="*fp32", H_Q="i32", H_KV="i32", N_Q="i32", N_K="i32", qk_scale="fp32",
                scale="fp32", pos_offset="i32", window_right="i32")
    constexprs = dict(HAS_RIGHT=causal, STAGES=CONFIGS[config]["STAGES"])
    if which == "dq":
        signature = dict(q_desc=q_sig, k_desc=q_sig, v_desc=q_sig, do_desc=q_sig, dq_desc=q_sig, **rest)
        return attention_bwd_dq_ws_kernel, signature, constexprs, dict(num_warps=4, maxnreg=LAUNCH_MAXNREG)
    signature = dict(q_desc=q_sig, k_desc=kv_sig, v_desc=kv_sig, do_desc=q_sig, dk_desc=kv_sig, dv_desc=kv_sig,
                     **rest)
    return attention_bwd_dkdv_ws_kernel, signature, constexprs, dict(num_warps=4, maxnreg=LAUNCH_MAXNREG)


# ---- lab commands ------------------------------------------------------------------------------------
# (B, Hq, Hkv, N, d, causal): the backward grid of the report (B*N = 16k, H = 2048 / d) and a GQA row.
BENCH_CASES = [(16, 32, 32, 1024, 64, False), (16, 32, 32, 1024, 64, True), (4, 32, 32, 4096, 64, True),
               (16, 16, 16, 1024, 128, False), (16, 16, 16, 1024, 128, True), (4, 16, 16, 4096, 128, False),
               (4, 16, 16, 4096, 128, True), (1, 16, 16, 16384, 128, True), (1, 32, 8, 2048, 128, True),
               (4, 16, 16, 4096, 80, True), (4, 16, 16, 4096, 96, True)]  # issue 18's head-dim rows


def compile_facts():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
    from tools.compiler import compile_gluon_sm90

    for which in ("dkdv", "dq"):
        for d in (64, 128):
            for name in CONFIGS:
                for causal in (False, True):
                    facts = compile_gluon_sm90("tools.compiler", "attention_bwd_ws_compile_job",
                                               dict(head_dim=d, causal=causal, config=name, which=which))
                    print(json.dumps(dict(which=which, head_dim=d, config=name, causal=causal, **facts)), flush=True)


def _portable_dkdv(q, k, v, dout, out, lse, scale, causal):
    """The launch's whole backward (row-dot, portable dK/dV, dQ): (dq, dk, dv), for the reference and the timing."""
    from tilefuse.kernels.attention import launch
    Nq, Nk = q.shape[2], k.shape[2]
    return launch.backward(dout, q, k, v, out, lse, None, None, scale, Nk - Nq, -1, 0 if causal else -1, "compiled")


def bench():
    from triton.testing import do_bench

    import tilefuse

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for B, Hq, Hkv, N, d, causal in BENCH_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, Hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, Hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
        dout = torch.randn(B, Hq, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
        scale = 1.0 / math.sqrt(d)
        out, lse = tilefuse.attention(q, k, v, causal=causal, return_lse=True)
        lse = lse.float().contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        _, dk_ref, dv_ref = _portable_dkdv(q, k, v, dout, out, lse, scale, causal)
        flops = 8 * B * Hq * N * N * d * (0.5 if causal else 1.0)  # dK/dV pass: 4 GEMMs of 2*N*N*d
        # The whole backward as the launch runs it (row-dot, portable dK/dV, portable dQ): the report's
        # attention_backward time at these shapes, where FA2 and cuDNN sit beside it.
        row = {"case": [B, Hq, Hkv, N, d, causal], "portable_backward_ms": do_bench(
            lambda: _portable_dkdv(q, k, v, dout, out, lse, scale, causal)),
            "delta_torch_ms": do_bench(lambda: (dout.float() * out.float()).sum(-1))}
        dq_ref = _portable_dkdv(q, k, v, dout, out, lse, scale, causal)[0]
        for name in CONFIGS:
            try:
                dk, dv = dkdv(q, k, v, dout, lse, delta, scale=scale, causal=causal, config=name)
                dq_ws = dq(q, k, v, dout, lse, delta, scale=scale, causal=causal, config=name)
                torch.cuda.synchronize()
                row[f"ws_{name}_rel_l2_vs_portable_dq_dk_dv"] = [rel(dq_ws, dq_ref), rel(dk, dk_ref), rel(dv, dv_ref)]
                ms = do_bench(lambda: dkdv(q, k, v, dout, lse, delta, scale=scale, causal=causal, config=name))
                row[f"ws_{name}_dkdv_ms"] = ms
                row[f"ws_{name}_dkdv_tflops"] = flops / ms / 1e9
                ms = do_bench(lambda: dq(q, k, v, dout, lse, delta, scale=scale, causal=causal, config=name))
                row[f"ws_{name}_dq_ms"] = ms
                row[f"ws_{name}_dq_tflops"] = flops * 3 / 4 / ms / 1e9  # three GEMMs of 2*N*N*d
            except Exception as e:  # a config that fails is reported, the rest still run
                row[f"ws_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"compile": compile_facts, "bench": bench}[sys.argv[1] if len(sys.argv) > 1 else "compile"]()

"""FlashAttention backward for Hopper with warp specialization (Gluon): the dK/dV pass and the dQ pass.

The portable passes (backward.py) hold two [64, d] fp32 accumulators beside their score tiles in one instruction
stream: at d 128 the dK/dV kernel sits at 255 registers with one pipeline stage. Here a producer warp only
issues TMA loads and two consumer warpgroups run the GEMMs, with setmaxnreg giving them 240 registers each.
- dK/dV (``attention_bwd_dkdv_ws_kernel``), per CTA one block of 128 keys of one KV head: the producer loads
  the block's K and V once, then Q and dO of every query block that sees the keys (every query head of the GQA
  group) through a ring of TMA buffers. Each consumer owns 64 of the keys, dK and dV in registers. Per query
  block: S^T = K Q^T and dP^T = V dO^T issued together from shared memory, P^T = exp2(S^T - lse) while dP^T
  runs, dV += P^T dO issued, dS^T = P^T (dP^T - D) while it runs, then dK += dS^T Q; P^T and dS^T are wgmma's
  register operand (keys as rows: no transpose). The epilogue scales dK, stages dK and dV in the consumer's own
  K and V buffers and stores them by TMA (4-D descriptors clip rows past the head's N).
- dQ (``attention_bwd_dq_ws_kernel``), per CTA 128 query rows of one query head (two consumers of 64): the
  forward's structure (ws.py) with dS in place of P, dQ += dS K. No atomics: the gradients are deterministic.
The row terms lse and D enter as the score accumulators' initial values, so the two vectors die at once and
d 128 fits without spills.
Scope: sm_90, 16-bit, head dim up to 128 for the dK/dV pass (80 and 96 in 128-wide tiles, ws.tile_head_dim),
no mask, no soft-cap or ALiBi; causal and right windows (HAS_RIGHT), left windows (HAS_LEFT: the sliding window;
up to d 128, the dQ pass at every width), GQA, any N (rows past N_Q get
P = 0 through lse = +inf; keys past N_K only reach dK/dV rows that are never stored). Past 128 (160, 192, 256)
the dK/dV pass is ws_backward_wide.py's, and the dQ pass here runs in 256-wide tiles with fewer keys per ring
step. D = rowsum(dO * O) comes from the portable row-dot kernel; the launch (launch.py) runs the portable
passes for everything else.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tilefuse.kernels import cache_keys
from tilefuse.kernels.wgmma import accumulator_layout, register_operand_layout

KEYS = 64  # keys per consumer warpgroup: a CTA's key block is 2 * KEYS
HALF_N = gl.constexpr(KEYS)
BLOCK_M = gl.constexpr(64)  # query rows per ring step
LOG2E = gl.constexpr(1.4426950408889634)
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
LAUNCH_MAXNREG = 168  # 3 warpgroups at 168 = 2 * 240 + 24
QUERY_ROWS = 128  # query rows per CTA of the dQ pass (two consumers of BLOCK_M)
# The forward's head dims up to 128 (ws.tile_head_dim's 64- and 128-wide tiles); past 128 this dK/dV pass's two
# [64, d] fp32 accumulators do not fit a consumer's registers (ws_backward_wide.py takes those head dims).
HEAD_DIMS = (64, 80, 96, 128)


@gluon.jit
def _query_range(n0, keys, N_Q, pos_offset, window_left, window_right, HAS_LEFT: gl.constexpr,
                 HAS_RIGHT: gl.constexpr):
    """[m_lo, m_hi): the query blocks whose rows see any key of the ``keys`` keys from n0 (query i sees key j
    when i + pos_offset - window_left <= j <= i + pos_offset + window_right), m_lo aligned down to BLOCK_M."""
    m_lo = 0
    m_hi = N_Q
    if HAS_RIGHT:
        m_lo = gl.maximum(n0 - pos_offset - window_right, 0)
    if HAS_LEFT:
        m_hi = gl.minimum(gl.maximum(n0 + keys + window_left - pos_offset, 0), N_Q)
    return (m_lo // BLOCK_M) * BLOCK_M, m_hi


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
def _producer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr,
              WHICH: gl.constexpr):
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    kv_ready, ready, empty = bars
    b, h_kv, n0, N_Q, N_K, group, qk_scale, scale, pos_offset, window_left, window_right, H_Q = params
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, h_kv, n0 + c * HALF_N, 0], kv_ready, k_bufs.index(c))
        tma.async_copy_global_to_shared(v_desc, [b, h_kv, n0 + c * HALF_N, 0], kv_ready, v_bufs.index(c))
    m_lo, m_hi = _query_range(n0, 2 * HALF_N, N_Q, pos_offset, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    it = 0
    for g in range(group):
        h = h_kv * group + g
        for m0 in range(m_lo, m_hi, BLOCK_M):
            _fill_slot(empty, ready, it, q_desc, do_desc, [b, h, m0, 0], [b, h, m0, 0], q_bufs, do_bufs)
            it += 1


@gluon.jit
def _consumer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr,
              WHICH: gl.constexpr):
    """Keys n0 + WHICH * 64 ... + 64 of the block: their dK and dV over every query block of the ring."""
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    kv_ready, ready, empty = bars
    b, h_kv, n0, N_Q, N_K, group, qk_scale, scale, pos_offset, window_left, window_right, H_Q = params
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_M)
    acc_layout: gl.constexpr = accumulator_layout(HEAD_D)
    op_layout: gl.constexpr = register_operand_layout(acc_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # along S^T's rows (keys)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # along its columns (queries)

    keys0 = n0 + WHICH * HALF_N
    offs_n = keys0 + gl.arange(0, HALF_N, layout=key_layout)
    k_buf = k_bufs.index(WHICH).reshape([HALF_N, HEAD_D])
    v_buf = v_bufs.index(WHICH).reshape([HALF_N, HEAD_D])
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)
    m_lo, m_hi = _query_range(n0, 2 * HALF_N, N_Q, pos_offset, window_left, window_right, HAS_LEFT, HAS_RIGHT)
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
            s_init = zeros - (lse2 / qk_scale)[None, :]
            if HAS_LEFT:  # the sliding window's far edge: -inf in S^T's initial value where the block crosses it
                if m0 + BLOCK_M - 1 + pos_offset - window_left > keys0:
                    s_init = gl.where(offs_n[:, None] >= offs_m[None, :] + (pos_offset - window_left), s_init,
                                      float("-inf"))
            s_t = warpgroup_mma(k_buf, q_buf.permute((1, 0)), s_init, is_async=True)
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


@gluon.jit(do_not_specialize=["N_Q", "N_K", "H_Q", "H_KV", "pos_offset", "window_right", "window_left"])
def attention_bwd_dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr,
                                 H_Q, H_KV, N_Q, N_K, qk_scale, scale, pos_offset, window_right, window_left,
                                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
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
    params = (b, h_kv, n0, N_Q, N_K, H_Q // H_KV, qk_scale, scale, pos_offset, window_left, window_right, H_Q)
    # Constexprs go as separate arguments (inside a tuple they would become runtime values).
    gl.warp_specialize([
        (_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, HEAD_D, 0)),
        (_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, HEAD_D, 1)),
        (_producer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, HEAD_D, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- the dQ pass ------------------------------------------------------------------------------------
# Per CTA 128 query rows of one query head (two consumers of 64), the key tiles they see through a ring of K and
# V: S = Q K^T and dP = dO V^T together, P, dS = P (dP - D), dQ += dS K (dS the register operand). The forward's
# structure (ws.py) with dS in place of P. Keys per ring step: the K descriptor's box rows (the launch's 64 up to
# d 128; 256-wide tiles take ws_backward_wide.DQ_KEYS for the ring to fit).


@gluon.jit
def _dq_key_range(m0, N_K, pos_offset, window_left, window_right, BLOCK_KEYS: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr):
    """[lo, hi): the keys rows [m0, m0 + 128) see (row i sees j when i + pos_offset - window_left <= j <= i +
    pos_offset + window_right), lo aligned down to BLOCK_KEYS."""
    lo = 0
    hi = N_K
    if HAS_RIGHT:
        hi = gl.minimum(gl.maximum(m0 + 2 * BLOCK_M - 1 + pos_offset + window_right + 1, 0), N_K)
    if HAS_LEFT:
        lo = gl.minimum(gl.maximum(m0 + pos_offset - window_left, 0), hi)
    return (lo // BLOCK_KEYS) * BLOCK_KEYS, hi


@gluon.jit
def _dq_producer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr,
                 WHICH: gl.constexpr):
    q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    q_ready, ready, empty = bars
    b, h, h_kv, m0, N_Q, N_K, qk_scale, scale, pos_offset, window_left, window_right, pid_bh = params
    BLOCK_KEYS: gl.constexpr = k_desc.block_type.shape[2]
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + c * BLOCK_M, 0], q_ready, q_bufs.index(c))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0 + c * BLOCK_M, 0], q_ready, do_bufs.index(c))
    lo, hi = _dq_key_range(m0, N_K, pos_offset, window_left, window_right, BLOCK_KEYS, HAS_LEFT, HAS_RIGHT)
    it = 0
    for n0 in range(lo, hi, BLOCK_KEYS):
        _fill_slot(empty, ready, it, k_desc, v_desc, [b, h_kv, n0, 0], [b, h_kv, n0, 0], k_bufs, v_bufs)
        it += 1


@gluon.jit
def _dq_consumer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HEAD_D: gl.constexpr,
                 WHICH: gl.constexpr):
    """Rows m0 + WHICH * 64 ... + 64: their dQ over every key tile the CTA's rows see."""
    q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    q_ready, ready, empty = bars
    b, h, h_kv, m0, N_Q, N_K, qk_scale, scale, pos_offset, window_left, window_right, pid_bh = params
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_KEYS: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_KEYS)
    acc_layout: gl.constexpr = accumulator_layout(HEAD_D)
    op_layout: gl.constexpr = register_operand_layout(acc_layout)
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
    lo, hi = _dq_key_range(m0, N_K, pos_offset, window_left, window_right, BLOCK_KEYS, HAS_LEFT, HAS_RIGHT)
    it = 0
    for n0 in range(lo, hi, BLOCK_KEYS):
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
        if HAS_LEFT:
            if n0 < rows0 + BLOCK_M - 1 + pos_offset - window_left:  # the tile crosses the window's far edge
                s = gl.where(offs_n[None, :] >= offs_m[:, None] + (pos_offset - window_left), s, float("-inf"))
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


@gluon.jit(do_not_specialize=["N_Q", "N_K", "H_Q", "H_KV", "pos_offset", "window_right", "window_left"])
def attention_bwd_dq_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr,
                               H_Q, H_KV, N_Q, N_K, qk_scale, scale, pos_offset, window_right, window_left,
                               HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
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
    params = (b, h, h_kv, m0, N_Q, N_K, qk_scale, scale, pos_offset, window_left, window_right, pid_bh)
    gl.warp_specialize([
        (_dq_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, HEAD_D, 0)),
        (_dq_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, HEAD_D, 1)),
        (_dq_producer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, HEAD_D, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


cache_keys.settle(globals())

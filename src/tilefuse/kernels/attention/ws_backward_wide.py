"""FlashAttention backward for Hopper with warp specialization (Gluon): the dK/dV pass for head dims past 128
(160, 192 and 256, in 256-wide tiles as the forward runs them: ws.tile_head_dim).

The dK/dV pass of ws_backward.py gives each consumer warpgroup 64 keys with both its dK and its dV accumulators:
two [64, d] fp32 tiles are 2 * d / 2 registers a thread, 256 at d 256, past a consumer's 240. Here the two
consumers split the work by output instead of by key (``attention_bwd_dkdv_wide_kernel``): per CTA one block of
64 keys of one KV head, consumer 0 accumulates dV (S^T = K Q^T, P^T, dV += P^T dO: two GEMMs a query block) and
consumer 1 dK (S^T and dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q: three). Each holds one [64, 256]
accumulator (128 registers) beside its score tiles; S^T is computed by both, one GEMM in five more than the
narrow pass's four. The producer warp loads the block's K and V once and Q and dO of every query block (every
query head of the GQA group) through the ring; a slot goes back when both consumers are done with it. K and V
stay in use by both consumers until the last query block, so an mbarrier joins the two before dV and dK are
staged in the V and K buffers for their TMA stores. The row terms (and the causal mask) enter as the score
accumulators' initial values, as in ws_backward.py.
dQ needs no pass of its own: ws_backward.attention_bwd_dq_ws_kernel holds one [64, d] accumulator per consumer,
and runs here in 256-wide tiles with its K/V ring stepping DQ_KEYS keys (64-key K and V tiles beside 128 rows of
Q and dO would not fit shared memory at d 256).
Scope: sm_90, 16-bit, HEAD_DIMS, no mask, no soft-cap, ALiBi or left window; causal and right windows
(HAS_RIGHT), GQA, any N (rows past N_Q get P = 0 through lse = +inf; keys past N_K only reach dK/dV rows the TMA
store clips; columns past d are zeros from the TMA loads, and the stores clip them). D = rowsum(dO * O) comes
from the portable row-dot kernel; the launch (launch.py) picks this pass and runs the portable passes elsewhere.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tilefuse.kernels import cache_keys
from tilefuse.kernels.attention.ws_backward import (BLOCK_M, CONSUMER_REGS, LOG2E, PRODUCER_REGS, _fill_slot,
                                                    _query_range)
from tilefuse.kernels.wgmma import accumulator_layout, register_operand_layout

KEYS = 64  # keys per CTA: both consumers work on the same 64
BLOCK_N = gl.constexpr(KEYS)
TILE = 256  # the tile width of every head dim here
HEAD_DIMS = (160, 192, 256)  # the forward's head dims past 128 (ws.SUPPORTED_HEAD_DIMS), all in 256-wide tiles
# The ring depth of both passes at 256-wide tiles: dK/dV holds Q and dO per slot (2 x 64 x 256 x 2 bytes = 64 KB)
# beside K and V (64 KB), dQ 32-key K and V per slot (32 KB) beside 128 rows of Q and dO (128 KB): 192 KB each
# at 2 stages, a third does not fit the 227 KB.
STAGES = 2
DQ_KEYS = 32  # keys per ring step of the dQ pass (its K and V descriptors' box rows)


@gluon.jit
def _producer(descs, bufs, bars, params, HAS_RIGHT: gl.constexpr, WHICH: gl.constexpr):
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    kv_ready, ready, empty, done = bars
    b, h_kv, n0, N_Q, N_K, group, qk_scale, scale, pos_offset, window_right, H_Q = params
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, h_kv, n0, 0], kv_ready, k_bufs.index(0))
    tma.async_copy_global_to_shared(v_desc, [b, h_kv, n0, 0], kv_ready, v_bufs.index(0))
    m_lo, m_hi = _query_range(n0, BLOCK_N, N_Q, pos_offset, 0, window_right, False, HAS_RIGHT)
    it = 0
    for g in range(group):
        h = h_kv * group + g
        for m0 in range(m_lo, m_hi, BLOCK_M):
            _fill_slot(empty, ready, it, q_desc, do_desc, [b, h, m0, 0], [b, h, m0, 0], q_bufs, do_bufs)
            it += 1


@gluon.jit
def _consumer(descs, bufs, bars, params, HAS_RIGHT: gl.constexpr, WHICH: gl.constexpr):
    """WHICH 0: dV of the CTA's 64 keys; WHICH 1: their dK."""
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    kv_ready, ready, empty, done = bars
    b, h_kv, n0, N_Q, N_K, group, qk_scale, scale, pos_offset, window_right, H_Q = params
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    NUM_STAGES: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_M)
    acc_layout: gl.constexpr = accumulator_layout(HEAD_D)
    op_layout: gl.constexpr = register_operand_layout(acc_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # along S^T's rows (keys)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # along its columns (queries)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=key_layout)
    k_buf = k_bufs.index(0).reshape([BLOCK_N, HEAD_D])
    v_buf = v_bufs.index(0).reshape([BLOCK_N, HEAD_D])
    acc = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)
    m_lo, m_hi = _query_range(n0, BLOCK_N, N_Q, pos_offset, 0, window_right, False, HAS_RIGHT)
    it = 0
    for g in range(group):
        h = h_kv * group + g
        rows_base = (b * H_Q + h).to(gl.int64) * N_Q
        for m0 in range(m_lo, m_hi, BLOCK_M):
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=query_layout)
            in_q = offs_m < N_Q
            lse = gl.load(lse_ptr + rows_base + offs_m, mask=in_q, other=float("-inf"))
            slot = it % NUM_STAGES
            mbarrier.wait(ready.index(slot), (it // NUM_STAGES) & 1)
            q_buf = q_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            do_buf = do_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
            zeros = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
            # The causal / right-window mask goes into S^T's initial value (-inf stays -inf through the wgmma):
            # made before any wgmma of the step is in flight, it needs no registers beside their results (at
            # d 256, applied to the result, the dK consumer spilled).
            s_init = zeros - (lse2 / qk_scale)[None, :]
            if HAS_RIGHT:
                if m0 + pos_offset + window_right < n0 + BLOCK_N - 1:
                    s_init = gl.where(offs_n[:, None] <= offs_m[None, :] + (pos_offset + window_right), s_init,
                                      float("-inf"))
            s_t = warpgroup_mma(k_buf, q_buf.permute((1, 0)), s_init, is_async=True)
            if WHICH == 1:
                delta = gl.load(delta_ptr + rows_base + offs_m, mask=in_q, other=0.0)
                dp_t = warpgroup_mma(v_buf, do_buf.permute((1, 0)), zeros - delta[None, :], is_async=True)
                s_t = warpgroup_mma_wait(1, deps=(s_t, ))
            else:
                s_t = warpgroup_mma_wait(0, deps=(s_t, ))
            p_t = gl.exp2(s_t * qk_scale)
            if WHICH == 0:
                acc = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do_buf, acc, is_async=True)
            else:
                dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
                acc = warpgroup_mma(gl.convert_layout((p_t * dp_t).to(dtype), op_layout), q_buf, acc,
                                    is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index(slot), count=1)
            it += 1
    # Both consumers read K and V to their last query block: join before either buffer stages a result.
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    if WHICH == 0:
        v_buf.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dv_desc, [b, h_kv, n0, 0], v_bufs.index(0))
    else:
        k_buf.store((acc * scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, h_kv, n0, 0], k_bufs.index(0))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["N_Q", "N_K", "H_Q", "H_KV", "pos_offset", "window_right"])
def attention_bwd_dkdv_wide_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr,
                                   H_Q, H_KV, N_Q, N_K, qk_scale, scale, pos_offset, window_right,
                                   HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
    """Grid (cdiv(N_K, KEYS), B * H_KV); every descriptor's box [1, 1, KEYS, TILE] (query blocks and key blocks
    are both 64 rows)."""
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(done, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release each slot
    n0 = gl.program_id(0) * BLOCK_N
    pid_bh = gl.program_id(1)  # b * H_KV + h_kv
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    descs = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr)
    bufs = (q_bufs, do_bufs, k_bufs, v_bufs)
    bars = (kv_ready, ready, empty, done)
    params = (b, h_kv, n0, N_Q, N_K, H_Q // H_KV, qk_scale, scale, pos_offset, window_right, H_Q)
    # Constexprs go as separate arguments (inside a tuple they would become runtime values).
    gl.warp_specialize([
        (_consumer, (descs, bufs, bars, params, HAS_RIGHT, 0)),
        (_consumer, (descs, bufs, bars, params, HAS_RIGHT, 1)),
        (_producer, (descs, bufs, bars, params, HAS_RIGHT, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


cache_keys.settle(globals())

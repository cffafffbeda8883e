"""FlashAttention forward for Hopper with warp specialization (Gluon): a TMA producer warp and two
consumer warpgroups.

Fuses the same work as portable.py (QK^T, scale, causal/window masking, online softmax, PV;
the [Nq, Nk] scores never reach HBM: (Q + K + V + O) bytes instead of + 4*B*Hq*Nq*Nk*s), and adds
what triton 3.6 cannot produce from tl code on sm_90: one warp only issues the TMA loads of Q, K and V
into rings of shared buffers (mbarrier-synchronised), while two 4-warp consumer partitions each own
64 query rows of the CTA's 128. At d = 128 the consumers follow FA3's ping-pong schedule: they take turns
issuing their GEMMs, and each runs a tile's softmax while its previous PV is still on the tensor cores.
At d = 64 they run the plain order and the warp scheduler interleaves them. Registers move with
setmaxnreg: 24 for the producer's warpgroup, 240 for each consumer.
Head dims 64, 128 and 256 run as they are; 80 and 96 in 128-wide tiles, 160 and 192 in 256-wide ones
(``tile_head_dim``): the TMA loads of Q, K and V fill the columns past d with zeros, which add nothing to QK^T,
and give PV zero columns there, which the TMA store of O clips.
Limits: sm_90, fp16/bf16, the head dims above, no attn_mask tensor, TMA-able strides; the launch layer
(launch.py) uses the portable kernel elsewhere and the report's config column says which ran ("ws" for this one).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tilefuse.kernels.attention.common import key_tile_ranges, query_block_and_head
from tilefuse.kernels.wgmma import accumulator_layout, register_operand_layout

HALF_M = gl.constexpr(64)           # query rows per consumer warpgroup (wgmma's M is 64 per warpgroup)
BLOCK_M = gl.constexpr(2 * HALF_M)  # query rows per CTA
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
# 12 warps (3 warpgroups) share the SM's 64K registers: 168 per thread at launch, then the
# producer's warpgroup gives its surplus to the two consumers (2 * 240 + 24 = 3 * 168).
LAUNCH_MAXNREG = 168
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)


def tile_head_dim(d: int) -> int:
    """The width of the kernel's Q/K/V/O tiles for head dim ``d``: the power of two at or above it."""
    return 64 if d <= 64 else 128 if d <= 128 else 256


@gluon.jit
def hide_keys(s, start, pos_m, N_K, window_left, window_right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """A score tile of keys start.. with -inf where a key is past N_K or outside a row's window."""
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    key_pos = start + gl.arange(0, BLOCK_N, layout=col_s)
    visible = (key_pos < N_K)[None, :]
    if HAS_LEFT:
        visible = visible & (key_pos[None, :] >= pos_m[:, None] - window_left)
    if HAS_RIGHT:
        visible = visible & (key_pos[None, :] <= pos_m[:, None] + window_right)
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _online_softmax_step(s, m_i, l_i, start, pos_m, N_K, window_left, window_right, qk_scale, masked,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
                         s_layout: gl.constexpr):
    """Scores of one K tile -> (p, alpha, m_new, l_new): the one place the running max and sum change.
    ``masked`` (constexpr or runtime) applies N_K and the window to this tile's keys."""
    s = s * qk_scale  # log2 domain: scale * log2(e) folded in, so exp is one exp2
    if masked:
        s = hide_keys(s, start, pos_m, N_K, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout)
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # A row that has seen no key keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _consume_tiles(acc, m_i, l_i, it, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                   start_n, end_n, pos_m, N_K, window_left, window_right, qk_scale,
                   MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                   s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Plain order: QK^T, wait, softmax, PV, wait, for K/V tiles [start_n, end_n); ``it`` counts ring
    slots used so far. Overlap comes only from the other consumer."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    for start in range(start_n, end_n, BLOCK_N):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
        s = warpgroup_mma(q_buf, k_t, gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot), count=1)  # the K buffer may be refilled
        p, alpha, m_i, l_i = _online_softmax_step(s, m_i, l_i, start, pos_m, N_K, window_left, window_right,
                                                  qk_scale, MASKED, HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(q_buf.dtype), p_layout)
        mbarrier.wait(v_ready.index(slot), phase)
        acc = warpgroup_mma(p_op, v_bufs.index(slot).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(slot), count=1)
        it += 1
    return acc, m_i, l_i, it


@gluon.jit
def _consume_pingpong(acc, m_i, l_i, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                      my_turn, other_turn, lo_tile, hi, full_start, full_end, pos_m, N_K, window_left,
                      window_right, qk_scale, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                      BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, WHICH: gl.constexpr,
                      s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """FA3's schedule for K/V tiles [lo_tile, hi) (at least one): tile j's QK^T and tile j-1's PV are
    issued together, then tile j's softmax runs while that PV is still on the tensor cores. The two
    consumers take turns issuing (my_turn / other_turn mbarriers), so one's softmax meets the other's
    GEMMs instead of both computing exp2 at once."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # Tile 0 (peeled: no PV before it). Consumer 0's first turn is free (a fresh mbarrier's phase 1
    # counts as complete), consumer 1's waits for consumer 0's first issue.
    mbarrier.wait(my_turn, 1 - WHICH)
    mbarrier.wait(k_ready.index(0), 0)
    k_t = k_bufs.index(0).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
    s = warpgroup_mma(q_buf, k_t, gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    mbarrier.arrive(other_turn, count=1)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    masked = (lo_tile < full_start) | (lo_tile >= full_end)
    p, alpha, m_i, l_i = _online_softmax_step(s, m_i, l_i, lo_tile, pos_m, N_K, window_left, window_right,
                                              qk_scale, masked, HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(q_buf.dtype), p_layout)
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
        acc = warpgroup_mma(p_op, v_bufs.index(prev).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        s = warpgroup_mma_wait(1, deps=(s, ))  # groups retire in order: QK^T done, PV may still run
        mbarrier.arrive(k_empty.index(slot), count=1)
        masked = (start < full_start) | (start >= full_end)
        p, alpha, m_i, l_i = _online_softmax_step(s, m_i, l_i, start, pos_m, N_K, window_left, window_right,
                                                  qk_scale, masked, HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(q_buf.dtype), p_layout)
    # The last tile's PV.
    last = it % STAGES
    mbarrier.wait(v_ready.index(last), (it // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_bufs.index(last).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              STORE_LSE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
              WHICH: gl.constexpr):
    """Consumer WHICH (0 or 1): query rows m0 + WHICH*HALF_M .. +HALF_M of the CTA's block."""
    q_desc, k_desc, v_desc, o_desc, lse_ptr = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    b, h, m0, lo_tile, hi, N_Q, N_K, qk_scale, pos_offset, window_left, window_right, group, pid_bh = params
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    s_layout: gl.constexpr = accumulator_layout(BLOCK_N)
    o_layout: gl.constexpr = accumulator_layout(HEAD_D)
    p_layout: gl.constexpr = register_operand_layout(o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    rows0 = m0 + WHICH * HALF_M
    _, _, full_start, full_end = key_tile_ranges(rows0, HALF_M, N_Q, N_K, pos_offset, window_left, window_right,
                                                 HAS_LEFT, HAS_RIGHT, BLOCK_N)
    pos_m = rows0 + gl.arange(0, HALF_M, layout=row_s) + pos_offset

    q_buf = q_bufs.index(WHICH).reshape([HALF_M, HEAD_D])
    mbarrier.wait(q_ready.index(WHICH), 0)

    m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF_M], gl.float32, row_s)
    acc = gl.zeros([HALF_M, HEAD_D], gl.float32, o_layout)
    # The CTA walks the union of both consumers' key ranges; this consumer masks the tiles its rows
    # see only in part (window edges, the causal diagonal, the ragged end) and none of the others.
    if PINGPONG:
        acc, m_i, l_i = _consume_pingpong(acc, m_i, l_i, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                                          turns.index(WHICH), turns.index(1 - WHICH), lo_tile, hi, full_start,
                                          full_end, pos_m, N_K, window_left, window_right, qk_scale, HAS_LEFT,
                                          HAS_RIGHT, BLOCK_N, HEAD_D, STAGES, WHICH, s_layout, o_layout, p_layout)
    else:
        acc, m_i, l_i = _consume_in_stages(acc, m_i, l_i, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                                           v_empty, lo_tile, hi, full_start, full_end, pos_m, N_K, window_left,
                                           window_right, qk_scale, HAS_LEFT, HAS_RIGHT, BLOCK_N, HEAD_D, STAGES,
                                           s_layout, o_layout, p_layout)
    _epilogue(acc, m_i, l_i, q_bufs, o_desc, lse_ptr, b, h, pid_bh, rows0, N_Q, WHICH, HEAD_D, STORE_LSE, s_layout,
              o_layout)


@gluon.jit
def _consume_in_stages(acc, m_i, l_i, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, lo_tile, hi,
                       full_start, full_end, pos_m, N_K, window_left, window_right, qk_scale,
                       HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
                       HEAD_D: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                       o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Masked lead-in, unmasked middle, masked tail: only tiles cut by an edge pay for the mask."""
    it = lo_tile * 0
    acc, m_i, l_i, it = _consume_tiles(acc, m_i, l_i, it, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                                       v_empty, lo_tile, full_start, pos_m, N_K, window_left, window_right,
                                       qk_scale, True, HAS_LEFT, HAS_RIGHT, BLOCK_N, HEAD_D, STAGES,
                                       s_layout, o_layout, p_layout)
    acc, m_i, l_i, it = _consume_tiles(acc, m_i, l_i, it, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                                       v_empty, full_start, full_end, pos_m, N_K, window_left, window_right,
                                       qk_scale, False, HAS_LEFT, HAS_RIGHT, BLOCK_N, HEAD_D, STAGES,
                                       s_layout, o_layout, p_layout)
    acc, m_i, l_i, it = _consume_tiles(acc, m_i, l_i, it, q_buf, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                                       v_empty, full_end, hi, pos_m, N_K, window_left, window_right,
                                       qk_scale, True, HAS_LEFT, HAS_RIGHT, BLOCK_N, HEAD_D, STAGES,
                                       s_layout, o_layout, p_layout)
    return acc, m_i, l_i


@gluon.jit
def _epilogue(acc, m_i, l_i, q_bufs, o_desc, lse_ptr, b, h, pid_bh, rows0, N_Q, WHICH: gl.constexpr,
              HEAD_D: gl.constexpr,
              STORE_LSE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Rows that saw no key give 0 and lse = -inf. The consumer's Q buffer (no longer read: every wgmma
    on it has been waited for) stages the output for one TMA store, which clips rows past N_Q."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_buf = q_bufs.index(WHICH).reshape([HALF_M, HEAD_D])
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    if STORE_LSE:
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        offs = rows0 + gl.arange(0, HALF_M, layout=row_s)
        gl.store(lse_ptr + pid_bh.to(gl.int64) * N_Q + offs, lse, mask=offs < N_Q)
    q_buf.store(out.to(q_buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, rows0, 0], q_bufs.index(WHICH))
    tma.store_wait(0)


@gluon.jit
def _producer(descs, bufs, bars, params, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              STORE_LSE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
              WHICH: gl.constexpr):
    """One warp: Q for both consumers, then every K/V tile of the CTA's key range through the ring."""
    q_desc, k_desc, v_desc, o_desc, lse_ptr = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    b, h, m0, lo_tile, hi, N_Q, N_K, qk_scale, pos_offset, window_left, window_right, group, pid_bh = params
    h_kv = h // group  # GQA: query head h reads KV head h // (Hq / Hkv), in place
    for c in gl.static_range(2):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + c * HALF_M, 0], q_ready.index(c), q_bufs.index(c))
    it = lo_tile * 0
    for start in range(lo_tile, hi, BLOCK_N):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        # Empty barriers start out complete for phase 1 (nothing to wait for on the first lap).
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h_kv, start, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, h_kv, start, 0], v_ready.index(slot), v_bufs.index(slot))
        it += 1


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """The mbarriers of a producer and two consumers, initialised: (q_ready [2], k_ready, v_ready, k_empty,
    v_empty [STAGES], turns [2]); each K/V buffer is released by both consumers. Shared by this kernel and
    the FP8 one (ws_fp8.py)."""
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    return q_ready, k_ready, v_ready, k_empty, v_empty, turns


# Sizes and positions are never specialised to the constant 1 (one compiled kernel per flag set).
@gluon.jit(do_not_specialize=["B", "H_Q", "H_KV", "N_Q", "N_K", "pos_offset", "window_left", "window_right"])
def attention_fwd_ws_kernel(q_src, k_src, v_src, o_src, lse_ptr, B, H_Q, H_KV, N_Q, N_K, D,
                            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                            stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                            qk_scale, pos_offset, window_left, window_right, HEAD_D: gl.constexpr,
                            HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STORE_LSE: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                            DEVICE_DESC: gl.constexpr, FLAT_GRID: gl.constexpr):
    # *_src: TMA descriptors made on the host, or (DEVICE_DESC) plain pointers whose descriptors are made
    # here from the sizes and strides: a host descriptor costs Python and a driver call to encode on
    # every launch, four per call. D: the tensors' head dim (HEAD_D, the tiles' width, is at least D).
    if DEVICE_DESC:
        elem: gl.constexpr = q_src.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, HALF_M, HEAD_D], elem)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, HEAD_D], elem)
        q_desc = tma.make_tensor_descriptor(q_src, [B, H_Q, N_Q, D], [stride_qb, stride_qh, stride_qm, 1],
                                            [1, 1, HALF_M, HEAD_D], q_layout)
        o_desc = tma.make_tensor_descriptor(o_src, [B, H_Q, N_Q, D], [stride_ob, stride_oh, stride_om, 1],
                                            [1, 1, HALF_M, HEAD_D], q_layout)
        k_desc = tma.make_tensor_descriptor(k_src, [B, H_KV, N_K, D], [stride_kb, stride_kh, stride_kn, 1],
                                            [1, 1, BLOCK_N, HEAD_D], kv_layout)
        v_desc = tma.make_tensor_descriptor(v_src, [B, H_KV, N_K, D], [stride_vb, stride_vh, stride_vn, 1],
                                            [1, 1, BLOCK_N, HEAD_D], kv_layout)
    else:
        q_desc = q_src
        k_desc = k_src
        v_desc = v_src
        o_desc = o_src
    pid_m, pid_bh = query_block_and_head(N_Q, BLOCK_M, FLAT_GRID)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    m0 = pid_m * BLOCK_M
    lo_tile, hi, _, _ = key_tile_ranges(m0, BLOCK_M, N_Q, N_K, pos_offset, window_left, window_right,
                                        HAS_LEFT, HAS_RIGHT, BLOCK_N)
    # At least one tile, also where no row sees a key: it is masked out whole (its keys lie past what
    # any row sees), and the pipelines never run empty.
    hi = gl.maximum(hi, lo_tile + 1)

    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)

    descs = (q_desc, k_desc, v_desc, o_desc, lse_ptr)
    bufs = (q_bufs, k_bufs, v_bufs)
    bars = ring_barriers(STAGES)
    params = (b, h, m0, lo_tile, hi, N_Q, N_K, qk_scale, pos_offset, window_left, window_right, H_Q // H_KV, pid_bh)
    # Constexprs go as separate arguments (inside a tuple they would become runtime values).
    gl.warp_specialize([
        (_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, STORE_LSE, BLOCK_N, STAGES, PINGPONG, 0)),
        (_consumer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, STORE_LSE, BLOCK_N, STAGES, PINGPONG, 1)),
        (_producer, (descs, bufs, bars, params, HAS_LEFT, HAS_RIGHT, STORE_LSE, BLOCK_N, STAGES, PINGPONG, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

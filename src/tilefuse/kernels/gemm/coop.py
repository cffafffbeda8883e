"""Cooperative warp-specialized GEMM for Hopper (Gluon): one kernel for the linear backward's two GEMMs and
the gated (GLU) forward, with the operand prologue and the epilogue chosen by constexprs.

C[Mc, Nc] = act(op(A) @ B + bias): op(A) = A [Mc, R], A^T (TRANS_A: A stored [R, Mc]), or either times a slope S
of A's shape made on chip (HAS_SLOPE); B [R, Nc], or B^T stored [Nc, R] (B_KMAJOR); db = row sums of op(A)
(HAS_DB). The forms the launch layer (launch.py) runs:
- dx[M, K] = g[M, N] @ W[N, K], g = dy * s               (HAS_SLOPE; s the activation's slope the forward saved)
- dW[N, K] = g^T[N, M] @ x[M, K], db[N] = sum_m g        (HAS_SLOPE, TRANS_A, HAS_DB)
- gated:    y = glu(x @ W_gate^T + b_gate, x @ W_up^T + b_up)   (GATED, B_KMAJOR: both weights as nn.Linear
            keeps them; each K step loads both weight tiles beside x's, each consumer keeps two accumulators and
            applies the SwiGLU/GeGLU epilogue: the gate and up products never reach HBM)
- gated dx: dx[M, K] = (dy * s_gate) @ W_gate + (dy * s_up) @ W_up   (GATED_DX, HAS_SLOPE: one reduction twice
            as long; the producer walks N for the gate's slope and weight, then again for the up's, into the
            same ring, so the consumers run the plain dx's loop over 2 * cdiv(N, BLOCK_K) steps into one
            accumulator)
and the plain forward y = act(x @ W^T + b) (B_KMAJOR), which the launch does not take (the TMA kernel, tma.py,
is faster there; benchmarks/NOTES.md).

Why warp specialization: in the tl backward kernels (backward.py) the multiply g = dy * s sits in the same
instruction stream as the loads and the MMAs, so the three serialise. Here one producer warp keeps a ring of TMA
boxes (A, S and B per K step) full across the CTA's persistent tile loop, and two consumer warpgroups share each
128-row output tile, 64 rows each (cooperative: the ping-pong schedule is slower in the forward). Without a slope
A goes from shared memory to the wgmma with one in flight. With one, each consumer loads its halves of A and S
into wgmma's register operand layout (transposed by the load for dW), multiplies, and runs the wgmma while the
other consumer's loads and multiply run.
The bias is the accumulator's initial value; each consumer's epilogue (the activation) stores its 64 x BLOCK_N
half through its own staging buffer, and that TMA store drains under the next tile's main loop. TMA zero-fills
out-of-bounds loads and clips stores, so tails need no masks.

Limits: sm_90, fp16/bf16, every operand TMA-able (unit inner stride, 16-byte-aligned rows and base); the launch
layer checks them and the shapes where this kernel is the faster one (``launch.coop_backward``,
``launch.coop_gated``). No slope output: a training forward keeps the TMA kernel, which stores the slopes.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tilefuse.kernels import fastpath
from tilefuse.kernels.activations import apply_activation, apply_gated
from tilefuse.kernels.tiling import grouped_tile
from tilefuse.kernels.wgmma import accumulator_layout, register_operand_layout
from tilefuse.sizes import cdiv

HALF_ROWS = 64  # rows per consumer warpgroup (wgmma's M per warpgroup): an output tile is 2 * HALF_ROWS rows
HALF_M = gl.constexpr(HALF_ROWS)  # the same, for the kernels
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
# 12 warps (3 warpgroups) share the SM's 64K registers: 168 per thread at launch, then the producer's warpgroup
# gives its surplus to the two consumers (2 * 240 + 24 = 3 * 168).
LAUNCH_MAXNREG = 168
# Tile configs by name, "<rows>x<BLOCK_N>x<BLOCK_K>_s<STAGES>". Ring per K step: 2 x (A, S) boxes [64, BLOCK_K]
# (no S without a slope) and one B box [BLOCK_K, BLOCK_N] (two when gated), plus 2 staging buffers [64, BLOCK_N].
CONFIGS = {
    "128x128x64_s4": dict(BLOCK_N=128, BLOCK_K=64, STAGES=4, GROUP_M=8),   # 4 x 48 KB + 2 x 16 KB staging
    "128x256x64_s2": dict(BLOCK_N=256, BLOCK_K=64, STAGES=2, GROUP_M=8),   # 2 x 64 KB + 2 x 32 KB staging
    "128x128x64_s3": dict(BLOCK_N=128, BLOCK_K=64, STAGES=3, GROUP_M=8),
    "128x256x32_s4": dict(BLOCK_N=256, BLOCK_K=32, STAGES=4, GROUP_M=8),   # 4 x 32 KB + 2 x 32 KB staging
    # Without a slope (the forward) the ring holds no S boxes: 3 x 48 KB + 2 x 32 KB staging
    "fwd_128x256x64_s3": dict(BLOCK_N=256, BLOCK_K=64, STAGES=3, GROUP_M=8, FORWARD_ONLY=True),
}
DEFAULT = "128x128x64_s4"


def gated_configs() -> list:
    """The configs the gated forward takes: two [64, BLOCK_N] fp32 accumulators fit a consumer's registers at
    BLOCK_N 128 only."""
    return [n for n, c in CONFIGS.items() if c["BLOCK_N"] == 128]


@gluon.jit
def _counts(a_desc, c_desc, sizes, TRANS_A: gl.constexpr, GATED_DX: gl.constexpr):
    """Output tiles along Mc and Nc, and K steps over R (the tile from the A and C boxes), twice over with
    GATED_DX (the gate's product, then the up's)."""
    Mc, Nc, R = sizes
    return (gl.cdiv(Mc, 2 * c_desc.block_type.shape[0]), gl.cdiv(Nc, c_desc.block_type.shape[1]),
            gl.cdiv(R, a_desc.block_type.shape[0 if TRANS_A else 1]) * (2 if GATED_DX else 1))


@gluon.jit
def _producer(descs, bufs, bars, sizes, TRANS_A: gl.constexpr, HAS_SLOPE: gl.constexpr, B_KMAJOR: gl.constexpr,
              HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, GATED: gl.constexpr, HAS_DB: gl.constexpr,
              GATED_DX: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, WHICH: gl.constexpr):
    """One warp: every K step of every output tile of this CTA, in order, through the ring."""
    a_desc, s_desc, su_desc, b_desc, bu_desc, c_desc, bias_ptr, bias_up_ptr, db_ptr = descs
    a_bufs, s_bufs, b_bufs, bu_bufs, c_bufs = bufs
    ready, empty = bars
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0 if TRANS_A else 1]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    step_bytes: gl.constexpr = ((4 if HAS_SLOPE else 2) * a_desc.block_type.nbytes
                                + (2 if GATED else 1) * b_desc.block_type.nbytes)
    num_pid_m, num_pid_n, k_steps = _counts(a_desc, c_desc, sizes, TRANS_A, GATED_DX)
    k_half = k_steps // 2  # GATED_DX: the steps of the gate's product; the up's follow
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        for k_step in range(k_steps):
            kk = k_step
            if GATED_DX:
                if k_step >= k_half:
                    kk = k_step - k_half
            slot = step % STAGES
            # Empty barriers start out complete for phase 1: nothing to wait for on the first lap.
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), step_bytes)
            for half in gl.static_range(2):
                row = pid_m * (2 * HALF_M) + half * HALF_M
                if TRANS_A:  # A^T's rows are A's columns: boxes [BLOCK_K (r), HALF_M (rows of C)]
                    coord = [kk * BLOCK_K, row]
                else:
                    coord = [row, kk * BLOCK_K]
                tma.async_copy_global_to_shared(a_desc, coord, ready.index(slot), a_bufs.index(2 * slot + half))
                if GATED_DX:
                    if k_step >= k_half:
                        tma.async_copy_global_to_shared(su_desc, coord, ready.index(slot),
                                                        s_bufs.index(2 * slot + half))
                    else:
                        tma.async_copy_global_to_shared(s_desc, coord, ready.index(slot),
                                                        s_bufs.index(2 * slot + half))
                elif HAS_SLOPE:
                    tma.async_copy_global_to_shared(s_desc, coord, ready.index(slot), s_bufs.index(2 * slot + half))
            if B_KMAJOR:  # B^T stored [Nc, R] (nn.Linear's weight for the forward)
                b_coord = [pid_n * BLOCK_N, kk * BLOCK_K]
            else:
                b_coord = [kk * BLOCK_K, pid_n * BLOCK_N]
            if GATED_DX:  # the up projection's weight in the second half, into the same ring slots
                if k_step >= k_half:
                    tma.async_copy_global_to_shared(bu_desc, b_coord, ready.index(slot), b_bufs.index(slot))
                else:
                    tma.async_copy_global_to_shared(b_desc, b_coord, ready.index(slot), b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, b_coord, ready.index(slot), b_bufs.index(slot))
            if GATED:  # the up projection's weight tile beside the gate's
                tma.async_copy_global_to_shared(bu_desc, b_coord, ready.index(slot), bu_bufs.index(slot))
            step += 1


@gluon.jit
def _consumer(descs, bufs, bars, sizes, TRANS_A: gl.constexpr, HAS_SLOPE: gl.constexpr, B_KMAJOR: gl.constexpr,
              HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, GATED: gl.constexpr, HAS_DB: gl.constexpr,
              GATED_DX: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, WHICH: gl.constexpr):
    """Consumer WHICH: rows [WHICH * 64, WHICH * 64 + 64) of every output tile of this CTA."""
    a_desc, s_desc, su_desc, b_desc, bu_desc, c_desc, bias_ptr, bias_up_ptr, db_ptr = descs
    a_bufs, s_bufs, b_bufs, bu_bufs, c_bufs = bufs
    ready, empty = bars
    Mc, Nc, R = sizes
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    acc_layout: gl.constexpr = accumulator_layout(BLOCK_N)
    a_layout: gl.constexpr = register_operand_layout(acc_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, a_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    num_pid_m, num_pid_n, k_steps = _counts(a_desc, c_desc, sizes, TRANS_A, GATED_DX)
    c_buf = c_bufs.index(WHICH)
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        if GATED:
            acc_up = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        else:
            acc_up = acc  # unused
        if HAS_BIAS:
            # The bias is the accumulator's initial value: its row vector (BLOCK_N / 4 registers a thread) is
            # dead before the main loop (added in the epilogue it spills beside the activation at BLOCK_N 256).
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            acc = acc + gl.load(bias_ptr + offs_n, mask=offs_n < Nc, other=0.0).to(gl.float32)[None, :]
            if GATED:
                acc_up = acc_up + gl.load(bias_up_ptr + offs_n, mask=offs_n < Nc, other=0.0).to(gl.float32)[None, :]
        db_acc = gl.zeros([HALF_M], gl.float32, row_layout)
        for kk in range(k_steps):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a_view = a_bufs.index(2 * slot + WHICH)
            if TRANS_A:
                a_view = a_view.permute((1, 0))
            b_view = b_bufs.index(slot)
            if B_KMAJOR:
                b_view = b_view.permute((1, 0))
            if HAS_SLOPE:
                s_view = s_bufs.index(2 * slot + WHICH)
                if TRANS_A:
                    s_view = s_view.permute((1, 0))
                # In the operand dtype: the product of two 16-bit floats is exact in fp32, so one rounding
                # either way, the same bits as eager's g tensor.
                g = a_view.load(a_layout) * s_view.load(a_layout)
                if HAS_DB:
                    db_acc += gl.sum(g.to(gl.float32), axis=1)
                # Waited at once: with a register operand in flight across the loop ptxas serialises the wgmmas
                # ("insufficient register resources", sm_90a). The other consumer's MMA runs under this one's
                # loads and multiply instead.
                acc = warpgroup_mma(g, b_view, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(empty.index(slot), count=1)
            elif GATED:  # gate and up from the same A tile: this step's two wgmmas in flight
                bu_view = bu_bufs.index(slot)
                if B_KMAJOR:
                    bu_view = bu_view.permute((1, 0))
                acc = warpgroup_mma(a_view, b_view, acc, is_async=True)
                acc_up = warpgroup_mma(a_view, bu_view, acc_up, is_async=True)
                acc, acc_up = warpgroup_mma_wait(2, deps=(acc, acc_up))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            else:  # A as TMA delivered it: one wgmma in flight, step k-1's slot released
                acc = warpgroup_mma(a_view, b_view, acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            step += 1
        if not HAS_SLOPE:  # the tile's last step
            if GATED:
                acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
        row0 = pid_m * (2 * HALF_M) + WHICH * HALF_M
        if HAS_DB:
            if pid_n == 0:  # the first column band of tiles stores db
                offs = row0 + gl.arange(0, HALF_M, layout=row_layout)
                gl.store(db_ptr + offs, db_acc.to(dtype), mask=offs < Mc)
        if GATED:
            out = apply_gated(acc, acc_up, ACTIVATION).to(dtype)
        else:
            out = apply_activation(acc, ACTIVATION).to(dtype)
        # The previous tile's store has had this tile's whole main loop to leave the staging buffer.
        tma.store_wait(0)
        c_buf.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row0, pid_n * BLOCK_N], c_buf)
    tma.store_wait(0)


@gluon.jit
def gemm_coop_ws_kernel(a_ptr, s_ptr, su_ptr, b_ptr, bu_ptr, c_ptr, bias_ptr, bias_up_ptr, db_ptr, Mc, Nc, R,
                        stride_a, stride_s, stride_su, stride_b, stride_bu, stride_c,
                        TRANS_A: gl.constexpr, HAS_SLOPE: gl.constexpr, B_KMAJOR: gl.constexpr, HAS_BIAS: gl.constexpr,
                        ACTIVATION: gl.constexpr, GATED: gl.constexpr, HAS_DB: gl.constexpr, GATED_DX: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                        NUM_SMS: gl.constexpr):
    """C[Mc, Nc] = act(op(A) @ B + bias): op(A) = A, A^T (TRANS_A), or either times a slope S (HAS_SLOPE);
    B [R, Nc], or B^T stored [Nc, R] (B_KMAJOR); db = row sums of op(A) (HAS_DB). GATED (without a slope):
    C = glu(op(A) @ B + bias, op(A) @ B_up + bias_up), the gated activation of the two products. GATED_DX (with
    a slope, A and B row-major): C = (A * S) @ B + (A * S_up) @ B_up. Every operand has a unit inner stride;
    ``stride_*`` are the row strides."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    # The TMA descriptors are made here, once per CTA of the persistent grid: made on the host they cost an
    # encode per descriptor per call, and the launch layer's fast path cannot replay a call holding them.
    if TRANS_A:  # A stored [R, Mc]: boxes [BLOCK_K (r), HALF_M (rows of C)]
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], dtype)
        a_desc = tma.make_tensor_descriptor(a_ptr, [R, Mc], [stride_a, 1], [BLOCK_K, HALF_M], a_layout)
        s_desc = tma.make_tensor_descriptor(s_ptr, [R, Mc], [stride_s, 1], [BLOCK_K, HALF_M], a_layout)
    else:
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], dtype)
        a_desc = tma.make_tensor_descriptor(a_ptr, [Mc, R], [stride_a, 1], [HALF_M, BLOCK_K], a_layout)
        s_desc = tma.make_tensor_descriptor(s_ptr, [Mc, R], [stride_s, 1], [HALF_M, BLOCK_K], a_layout)
    if GATED_DX:  # the up branch's slope, in A's boxes
        su_desc = tma.make_tensor_descriptor(su_ptr, [Mc, R], [stride_su, 1], [HALF_M, BLOCK_K], a_layout)
    else:
        su_desc = s_desc
    if B_KMAJOR:  # B^T stored [Nc, R] (nn.Linear's weight for the forward)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
        b_desc = tma.make_tensor_descriptor(b_ptr, [Nc, R], [stride_b, 1], [BLOCK_N, BLOCK_K], b_layout)
        bu_desc = tma.make_tensor_descriptor(bu_ptr, [Nc, R], [stride_bu, 1], [BLOCK_N, BLOCK_K], b_layout)
    else:
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
        b_desc = tma.make_tensor_descriptor(b_ptr, [R, Nc], [stride_b, 1], [BLOCK_K, BLOCK_N], b_layout)
        bu_desc = tma.make_tensor_descriptor(bu_ptr, [R, Nc], [stride_bu, 1], [BLOCK_K, BLOCK_N], b_layout)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_N], dtype)
    c_desc = tma.make_tensor_descriptor(c_ptr, [Mc, Nc], [stride_c, 1], [HALF_M, BLOCK_N], c_layout)
    a_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + a_desc.block_type.shape, a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_layout)
    # Buffers a form does not use alias ones it does (never indexed there): no shared memory for them.
    if HAS_SLOPE:
        s_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + s_desc.block_type.shape, a_layout)
    else:
        s_bufs = a_bufs
    if GATED:
        bu_bufs = gl.allocate_shared_memory(dtype, [STAGES] + bu_desc.block_type.shape, b_layout)
    else:
        bu_bufs = b_bufs
    c_bufs = gl.allocate_shared_memory(dtype, [2] + c_desc.block_type.shape, c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release each K step
    descs = (a_desc, s_desc, su_desc, b_desc, bu_desc, c_desc, bias_ptr, bias_up_ptr, db_ptr)
    bufs = (a_bufs, s_bufs, b_bufs, bu_bufs, c_bufs)
    bars = (ready, empty)
    sizes = (Mc, Nc, R)
    # Constexprs go as separate arguments (inside a tuple they would become runtime values).
    gl.warp_specialize([
        (_consumer, (descs, bufs, bars, sizes, TRANS_A, HAS_SLOPE, B_KMAJOR, HAS_BIAS, ACTIVATION, GATED, HAS_DB,
                     GATED_DX, GROUP_M, NUM_SMS, 0)),
        (_consumer, (descs, bufs, bars, sizes, TRANS_A, HAS_SLOPE, B_KMAJOR, HAS_BIAS, ACTIVATION, GATED, HAS_DB,
                     GATED_DX, GROUP_M, NUM_SMS, 1)),
        (_producer, (descs, bufs, bars, sizes, TRANS_A, HAS_SLOPE, B_KMAJOR, HAS_BIAS, ACTIVATION, GATED, HAS_DB,
                     GATED_DX, GROUP_M, NUM_SMS, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ------------------------------------------------------------------------------------
def output_tiles(rows: int, cols: int, config: str) -> int:
    """Output tiles of C [rows, cols] at ``config``: the persistent grid's work items."""
    return cdiv(rows, 2 * HALF_ROWS) * cdiv(cols, CONFIGS[config]["BLOCK_N"])


def constexprs(trans_a, slope, b_kmajor, bias, activation, db, cfg, gated=False, gated_dx=False) -> dict:
    """The kernel's constexprs for one form at ``cfg`` (a CONFIGS entry), but NUM_SMS (the launch's)."""
    return dict(TRANS_A=trans_a, HAS_SLOPE=slope, B_KMAJOR=b_kmajor, HAS_BIAS=bias, ACTIVATION=activation or "none",
                GATED=gated, HAS_DB=db, GATED_DX=gated_dx, BLOCK_N=cfg["BLOCK_N"],
                BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"])


def launch(a, s, b, c, *, trans_a=False, b_kmajor=False, bias=None, activation=None, db=None, b_up=None,
           bias_up=None, s_up=None, config=DEFAULT) -> None:
    """C = act(op(A) @ B + bias) into ``c`` for 16-bit TMA-able operands of one dtype (checked by the caller);
    ``s`` None or the slope (A's shape), ``db`` None or the [Mc] row sums of op(A) to store (with a slope),
    ``b_up`` (with ``bias_up``) the up projection of a gated activation (``activation`` its GLU), or with ``s_up``
    (and ``s``, A and B row-major) the gated dx's second product, C += (A * s_up) @ b_up. One CTA per SM at
    most; its descriptors are made in the kernel, so the launch layer's fast path can replay the call."""
    cfg = CONFIGS[config]
    Mc, Nc = c.shape
    R = a.shape[0] if trans_a else a.shape[1]
    s_ = s if s is not None else a
    su = s_up if s_up is not None else s_
    bu = b_up if b_up is not None else b
    fastpath.launch_persistent(gemm_coop_ws_kernel, output_tiles(Mc, Nc, config), (
        a, s_, su, b, bu, c, bias if bias is not None else c, bias_up if bias_up is not None else c,
        db if db is not None else c, Mc, Nc, R, a.stride(0), s_.stride(0), su.stride(0), b.stride(0), bu.stride(0),
        c.stride(0)),
        dict(constexprs(trans_a, s is not None, b_kmajor, bias is not None, activation, db is not None, cfg,
                        gated=b_up is not None and s_up is None, gated_dx=s_up is not None),
             num_warps=4, maxnreg=LAUNCH_MAXNREG), c.device)


# Direct entries (benchmarks/gemm_coop_ws.py, the GPU tests): each allocates its output and launches one config.
def linear(x, w, b=None, activation=None, config: str = DEFAULT):
    """The forward: act(x @ w^T + b), x [M, K], w [N, K] (nn.Linear's layout, read as K-major B tiles)."""
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    launch(x, None, w, y, b_kmajor=True, bias=b, activation=activation, config=config)
    return y


def gated_linear(x, w_gate, w_up, b_gate=None, b_up=None, activation="swiglu", config: str = DEFAULT):
    """The gated forward: glu(x @ w_gate^T + b_gate, x @ w_up^T + b_up), "swiglu" | "geglu" | "geglu_tanh"."""
    y = torch.empty(x.shape[0], w_gate.shape[0], dtype=x.dtype, device=x.device)
    launch(x, None, w_gate, y, b_kmajor=True, bias=b_gate, activation=activation, b_up=w_up, bias_up=b_up,
           config=config)
    return y


def grad_input(dy, s, w, config: str = DEFAULT):
    """dx = (dy * s) @ w: dy, s [M, N], w [N, K]."""
    dx = torch.empty(dy.shape[0], w.shape[1], dtype=dy.dtype, device=dy.device)
    launch(dy, s, w, dx, config=config)
    return dx


def grad_input_gated(dy, s_gate, w_gate, s_up, w_up, config: str = DEFAULT):
    """The gated dx = (dy * s_gate) @ w_gate + (dy * s_up) @ w_up: dy and both slopes [M, N], weights [N, K]."""
    dx = torch.empty(dy.shape[0], w_gate.shape[1], dtype=dy.dtype, device=dy.device)
    launch(dy, s_gate, w_gate, dx, b_up=w_up, s_up=s_up, config=config)
    return dx


def grad_weight(dy, s, x, config: str = DEFAULT):
    """(dW, db): dW = (dy * s)^T @ x [N, K], db = column sums of dy * s [N]."""
    dw = torch.empty(dy.shape[1], x.shape[1], dtype=dy.dtype, device=dy.device)
    db = torch.empty(dy.shape[1], dtype=dy.dtype, device=dy.device)
    launch(dy, s, x, dw, trans_a=True, db=db, config=config)
    return dw, db

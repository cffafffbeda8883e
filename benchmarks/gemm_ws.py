"""Lab code, kept for the GEMM-engine work and not dispatched: tilefuse.linear runs tilefuse.kernels.gemm,
and nothing in src/ imports this file. Tests and benchmarks import it with benchmarks/ on sys.path
(``import gemm_ws``; tests/tools/compiler.py's gemm_ws_compile_job compiles it for sm_90a).

Hopper GEMM ``y = act(x @ w^T + b)`` with warp specialization (Gluon): a TMA producer warp and two
consumer warpgroups in ping-pong over a persistent tile loop.

Fuses the same work as tilefuse/kernels/gemm/tma.py, with the same HBM bytes: (M*K + N*K + M*N)*s against
(M*K + N*K + 3*M*N)*s for GEMM-then-activation. What it adds is what Triton 3.6's tl code cannot produce
on sm_90 (sessions 3 and 5, benchmarks/NOTES.md): one warp only issues the TMA loads of the K steps of
every output tile the CTA owns, into a ring of shared buffers; two consumer warpgroups take the CTA's
tiles in turn (even, odd), each computing a whole BLOCK_M x BLOCK_N tile on wgmma. While one consumer runs
its epilogue (bias, activation, the TMA store), the other's main loop keeps the tensor cores busy. The
main loops take turns through a pair of mbarriers (CUTLASS's "order barrier"): a consumer starts waiting
on the ring only after the other has taken its last K step, so no consumer waits on a ring slot more
than one lap ahead of the producer, where an mbarrier's parity cannot tell the two laps apart.
Status: correct on the H200 (tests/test_linear.py) and compiled for sm_90a in CI, but slower than
linear_tma_kernel's best config at every bench shape (benchmarks/gemm_variants.py, session 7: 1.03-1.08x
the time at the two large K = 4096 shapes, 1.36-1.48x at K <= 1024, 1.6x at M = 512), so tilefuse.linear
does not dispatch to it. Ping-pong
serializes the main loops: one warpgroup's m64 wgmmas alone keep the tensor cores less busy than the tl
kernel's two warpgroups issuing together, and with one tile per CTA (M = 512) one consumer sits idle.
Limits: as tilefuse/kernels/gemm/tma.py (row-contiguous x and y, K-contiguous w, 16-byte-aligned rows),
fp16/bf16, no gated activations.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tilefuse import runtime
from tilefuse.kernels.activations import apply_activation
from tilefuse.kernels.gluon_host import host_descriptor
from tilefuse.kernels.tiling import grouped_tile
from tilefuse.sizes import cdiv

CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
# 12 warps (3 warpgroups) launch with 168 registers a thread; the producer's warpgroup drops to 24 and the
# consumers rise to 240 (2 * 240 + 24 = 3 * 168). At 232/40 the GELU epilogue spilled 20 bytes (sm_90a).
LAUNCH_MAXNREG = 168
# 128x128 tiles per consumer (acc: 128 fp32 registers a thread), 64-wide K steps, a 4-deep ring:
# 4 * (128 + 128) * 64 * 2 B = 128 KB, plus one 32 KB output staging buffer per consumer.
DEFAULT_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, GROUP_M=8)


@gluon.jit
def _tile_counts(x_desc, w_desc, sizes):
    """Output tiles along M and N, and K steps per tile (the descriptors' blocks set the tile)."""
    M, N, K = sizes
    return (gl.cdiv(M, x_desc.block_type.shape[0]), gl.cdiv(N, w_desc.block_type.shape[0]),
            gl.cdiv(K, x_desc.block_type.shape[1]))


@gluon.jit
def _producer(x_desc, w_desc, y_desc, b_ptr, bufs, bars, sizes, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, WHICH: gl.constexpr):
    """One warp: the K steps of every tile of this CTA, in tile order, through the ring."""
    x_bufs, w_bufs, y_bufs = bufs
    ready, empty, turns = bars
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    num_pid_m, num_pid_n, k_steps = _tile_counts(x_desc, w_desc, sizes)
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        for kk in range(k_steps):
            slot = step % STAGES
            # Empty barriers start out complete for phase 1: nothing to wait for on the first lap.
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [pid_m * BLOCK_M, kk * BLOCK_K], ready.index(slot),
                                            x_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [pid_n * BLOCK_N, kk * BLOCK_K], ready.index(slot),
                                            w_bufs.index(slot))
            step += 1


@gluon.jit
def _consumer(x_desc, w_desc, y_desc, b_ptr, bufs, bars, sizes, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, WHICH: gl.constexpr):
    """Consumer WHICH (0 or 1): the CTA's tiles WHICH, WHICH + 2, ...; main loop, then the epilogue."""
    x_bufs, w_bufs, y_bufs = bufs
    ready, empty, turns = bars
    N = sizes[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    num_pid_m, num_pid_n, k_steps = _tile_counts(x_desc, w_desc, sizes)
    y_buf = y_bufs.index(WHICH)
    my_turn = turns.index(WHICH)
    other_turn = turns.index(1 - WHICH)
    i = 0  # this CTA's tile count: tile i's K steps are ring steps i * k_steps ... (i + 1) * k_steps - 1
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        if i % 2 == WHICH:
            pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            # Main loops in tile order: tile i's waits on the ring start after tile i - 1's have passed.
            # The i-th turn of consumer 1 follows consumer 0's (i // 2)-th main loop; consumer 0's first
            # turn is free (a fresh mbarrier's phase "-1", parity 1, counts as complete).
            mbarrier.wait(my_turn, ((i // 2) & 1) ^ (1 - WHICH))
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kk in range(k_steps):
                step = i * k_steps + kk
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                # One wgmma in flight: the previous step's is done, so its buffers go back to the producer.
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            mbarrier.arrive(other_turn, count=1)  # every K step of this tile is taken: the other's turn
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index((i * k_steps + k_steps - 1) % STAGES), count=1)

            if HAS_BIAS:
                offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                bias = gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
                acc = acc + bias[None, :]
            out = apply_activation(acc, ACTIVATION).to(y_desc.dtype)
            tma.store_wait(0)  # this consumer's previous tile has left its staging buffer
            y_buf.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(y_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], y_buf)
        i += 1
    tma.store_wait(0)


@gluon.jit
def linear_ws_kernel(x_desc, w_desc, y_desc, b_ptr, M, N, K, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr):
    dtype: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    y_bufs = gl.allocate_shared_memory(dtype, [2] + y_desc.block_type.shape, y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)  # each K step belongs to exactly one consumer
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(turns.index(c), count=1)
    bufs = (x_bufs, w_bufs, y_bufs)
    bars = (ready, empty, turns)
    sizes = (M, N, K)
    # Constexprs go as separate arguments (inside a tuple they would become runtime values).
    gl.warp_specialize([
        (_consumer, (x_desc, w_desc, y_desc, b_ptr, bufs, bars, sizes, HAS_BIAS, ACTIVATION, GROUP_M, NUM_SMS, 0)),
        (_consumer, (x_desc, w_desc, y_desc, b_ptr, bufs, bars, sizes, HAS_BIAS, ACTIVATION, GROUP_M, NUM_SMS, 1)),
        (_producer, (x_desc, w_desc, y_desc, b_ptr, bufs, bars, sizes, HAS_BIAS, ACTIVATION, GROUP_M, NUM_SMS, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ------------------------------------------------------------------------------------
def launch(x2d, w, b, y, activation=None, config: dict | None = None) -> dict:
    """x2d [M, K], w [N, K], b [N] or None, y [M, N]: fp16/bf16, TMA-able
    (tilefuse.kernels.gemm.launch.tma_supported)."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    M, K = x2d.shape
    N = w.shape[0]
    num_sms = runtime.device_facts(x2d.device)[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (min(num_sms, cdiv(M, bm) * cdiv(N, bn)),)
    linear_ws_kernel[grid](host_descriptor(x2d, (bm, bk)), host_descriptor(w, (bn, bk)),
                           host_descriptor(y, (bm, bn)),
                           b if b is not None else y, M, N, K, HAS_BIAS=b is not None,
                           ACTIVATION=activation or "none", STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"],
                           NUM_SMS=num_sms, num_warps=4, maxnreg=LAUNCH_MAXNREG)
    return cfg


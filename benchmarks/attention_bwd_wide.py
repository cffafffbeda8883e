"""Lab: the attention backward's passes for head dims past 128 (160, 192, 256 in 256-wide tiles), issue 18's fast
Hopper path for wide heads: a dK/dV pass of its own, and the shipped dQ pass in 256-wide tiles with 32-key K/V
steps (``dq``). Not dispatched: nothing in src/ imports it.

The shipped Gluon pass (src/tilefuse/kernels/attention/ws_backward.py) gives each consumer warpgroup 64 keys with
both its dK and its dV accumulators: two [64, d] fp32 tiles are 2 * d / 2 registers a thread, 256 at d 256, past
a consumer's 240. Here the two consumers split the work by output instead of by key: per CTA one block of 64
keys, consumer 0 accumulates dV (S^T = K Q^T, P^T, dV += P^T dO: two GEMMs a query block) and consumer 1 dK (S^T
and dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q: three). Each holds one [64, 256] accumulator (128
registers) beside its score tiles. S^T is computed by both, one GEMM in five more than the shipped pass's four.
The producer warp loads the block's K and V once and Q and dO of every query block (every query head of the GQA
group) through the ring; a slot goes back when both consumers are done with it. K and V stay in use by both
consumers until the last query block, so an mbarrier joins the two before dV and dK are staged in the V and K
buffers for their TMA stores. Row terms (and the causal mask) as the score accumulators' initial values.
Scope: 16-bit, d 129-256, no mask, causal / right windows, GQA; D from the portable row-dot kernel.

    PYTHONPATH=src python benchmarks/attention_bwd_wide.py compile   # sm_90a facts (any machine)
    PYTHONPATH=src python benchmarks/attention_bwd_wide.py bench     # H200: check and time beside the portable pass
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

from tilefuse.kernels.attention import ws_backward
from tilefuse.kernels.attention.ws_backward import _fill_slot, _query_range
from tilefuse.kernels.gluon_host import host_descriptor
from tilefuse.kernels.wgmma import accumulator_layout, register_operand_layout
from tilefuse.sizes import cdiv

KEYS = 64  # keys per CTA: both consumers work on the same 64
BLOCK_N = gl.constexpr(KEYS)
BLOCK_M = gl.constexpr(64)  # query rows per ring step (the shipped pass's, which _query_range aligns to)
LOG2E = gl.constexpr(1.4426950408889634)
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
LAUNCH_MAXNREG = 168
TILE = 256
STAGES = 2  # Q and dO per slot: 2 x 64 x 256 x 2 bytes = 64 KB; K and V 64 KB


@gluon.jit
def _producer(descs, bufs, bars, params, HAS_RIGHT: gl.constexpr, WHICH: gl.constexpr):
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    kv_ready, ready, empty, done = bars
    b, h_kv, n0, N_Q, N_K, group, qk_scale, scale, pos_offset, window_right, H_Q = params
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, h_kv, n0, 0], kv_ready, k_bufs.index(0))
    tma.async_copy_global_to_shared(v_desc, [b, h_kv, n0, 0], kv_ready, v_bufs.index(0))
    m_lo, m_hi = _query_range(n0, N_Q, pos_offset, window_right, HAS_RIGHT)
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
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=key_layout)
    k_buf = k_bufs.index(0).reshape([BLOCK_N, HEAD_D])
    v_buf = v_bufs.index(0).reshape([BLOCK_N, HEAD_D])
    acc = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)
    m_lo, m_hi = _query_range(n0, N_Q, pos_offset, window_right, HAS_RIGHT)
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
    gl.warp_specialize([
        (_consumer, (descs, bufs, bars, params, HAS_RIGHT, 0)),
        (_consumer, (descs, bufs, bars, params, HAS_RIGHT, 1)),
        (_producer, (descs, bufs, bars, params, HAS_RIGHT, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ------------------------------------------------------------------------------------
def dkdv(q, k, v, dout, lse, delta, *, scale: float, causal: bool, stages: int = STAGES):
    """(dk, dv) for q, dout [B, Hq, Nq, d], k, v [B, Hkv, Nk, d] (16-bit, 128 < d <= 256, unit last stride,
    16-byte-aligned rows), lse and delta fp32 [B, Hq, Nq] contiguous (delta = rowsum(dO * O)); causal aligned
    bottom-right as the forward (pos_offset = Nk - Nq)."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if not 128 < d <= TILE:
        raise ValueError(f"head dim {d}: this pass takes 128 < d <= 256")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    box = (1, 1, KEYS, TILE)  # query blocks and key blocks are both 64 rows
    attention_bwd_dkdv_wide_kernel[(cdiv(Nk, KEYS), B * Hkv)](
        host_descriptor(q, box), host_descriptor(k, box), host_descriptor(v, box), host_descriptor(dout, box),
        host_descriptor(dk, box), host_descriptor(dv, box), lse, delta,
        Hq, Hkv, Nq, Nk, scale * 1.4426950408889634, scale, Nk - Nq, 0, HAS_RIGHT=causal, STAGES=stages,
        num_warps=4, maxnreg=LAUNCH_MAXNREG)
    return dk, dv


DQ_KEYS = 32  # the shipped dQ pass's ring step at d 256: 2 stages of 32-key K and V tiles beside 128 rows of Q, dO


def dq(q, k, v, dout, lse, delta, *, scale: float, causal: bool, stages: int = STAGES):
    """dq for the arguments of ``dkdv``: the shipped Gluon dQ pass (ws_backward.attention_bwd_dq_ws_kernel) in
    256-wide tiles, its K/V ring stepping DQ_KEYS keys (64-key tiles would not fit shared memory at d 256)."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if not 128 < d <= TILE:
        raise ValueError(f"head dim {d}: this pass takes 128 < d <= 256")
    out = torch.empty_like(q)
    rows, keys = (1, 1, 64, TILE), (1, 1, DQ_KEYS, TILE)
    ws_backward.attention_bwd_dq_ws_kernel[(cdiv(Nq, ws_backward.QUERY_ROWS), B * Hq)](
        host_descriptor(q, rows), host_descriptor(k, keys), host_descriptor(v, keys), host_descriptor(dout, rows),
        host_descriptor(out, rows), lse, delta, Hq, Hkv, Nq, Nk, scale * 1.4426950408889634, scale, Nk - Nq, 0,
        HAS_RIGHT=causal, STAGES=stages, num_warps=4, maxnreg=LAUNCH_MAXNREG)
    return out


def compile_job(causal: bool = True, dtype: str = "bfloat16", head_dim: int = 256, stages: int = STAGES,
                which: str = "dkdv"):
    """(kernel, signature, constexprs, options) as ``dkdv`` (``which`` "dkdv") or ``dq`` ("dq") launches it, for
    tests/tools/compiler.py."""
    from triton.runtime.jit import mangle_type

    t = torch.empty(1, 2, 256, head_dim, dtype=getattr(torch, dtype))
    sig = mangle_type(host_descriptor(t, (1, 1, KEYS, TILE)))
    rest = dict(lse_ptr="*fp32", delta_ptr="*fp32", H_Q="i32", H_KV="i32", N_Q="i32", N_K="i32", qk_scale="fp32",
                scale="fp32", pos_offset="i32", window_right="i32")
    options = dict(num_warps=4, maxnreg=LAUNCH_MAXNREG)
    if which == "dq":
        kv_sig = mangle_type(host_descriptor(t, (1, 1, DQ_KEYS, TILE)))
        signature = dict(q_desc=sig, k_desc=kv_sig, v_desc=kv_sig, do_desc=sig, dq_desc=sig, **rest)
        return ws_backward.attention_bwd_dq_ws_kernel, signature, dict(HAS_RIGHT=causal, STAGES=stages), options
    signature = dict(q_desc=sig, k_desc=sig, v_desc=sig, do_desc=sig, dk_desc=sig, dv_desc=sig, **rest)
    return attention_bwd_dkdv_wide_kernel, signature, dict(HAS_RIGHT=causal, STAGES=stages), options


# ---- lab commands ------------------------------------------------------------------------------------
BENCH_CASES = [(4, 16, 16, 4096, 256, True), (4, 16, 16, 4096, 192, True), (4, 16, 16, 4096, 160, True),
               (4, 16, 16, 4096, 256, False), (1, 32, 8, 2048, 256, True)]  # issue 18's d 256 row, wide dims, GQA


def compile_facts():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
    from tools.compiler import compile_gluon_sm90

    for which in ("dkdv", "dq"):
        for causal in (False, True):
            for stages in (1, 2):
                facts = compile_gluon_sm90("tools.compiler", "attention_bwd_wide_compile_job",
                                           dict(causal=causal, stages=stages, which=which))
                print(json.dumps(dict(which=which, causal=causal, stages=stages, **facts)), flush=True)


def bench():
    """Each case: the portable backward as the launch runs it at d > 128 (row-dot, dK/dV, dQ), then this lab's
    dK/dV and dQ passes against it (rel-L2), each pass's time and TFLOP/s (its GEMMs counted: four of
    2 * N * N * d for dK/dV, three for dQ)."""
    from triton.testing import do_bench

    import tilefuse
    from tilefuse.kernels.attention import launch

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for B, Hq, Hkv, N, d, causal in BENCH_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(B, Hq, N, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(B, Hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        scale = 1.0 / math.sqrt(d)
        out, lse = tilefuse.attention(q, k, v, causal=causal, return_lse=True)
        lse = lse.float().contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()

        def portable():
            return launch.backward(dout, q, k, v, out, lse, None, None, scale, 0, -1, 0 if causal else -1,
                                   "compiled")

        dq_ref, dk_ref, dv_ref = portable()
        row = {"case": [B, Hq, Hkv, N, d, causal], "portable_backward_ms": do_bench(portable)}
        flops = 8 * B * Hq * N * N * d * (0.5 if causal else 1.0)  # four GEMMs of 2 * N * N * d
        for name, run, share in (("dkdv", lambda: dkdv(q, k, v, dout, lse, delta, scale=scale, causal=causal), 1.0),
                                 ("dq", lambda: dq(q, k, v, dout, lse, delta, scale=scale, causal=causal), 0.75)):
            try:
                got = run()
                torch.cuda.synchronize()
                want = (dk_ref, dv_ref) if name == "dkdv" else (dq_ref,)
                row[f"rel_l2_vs_portable_{name}"] = [rel(a, b) for a, b in zip(got if name == "dkdv" else (got,),
                                                                               want)]
                ms = do_bench(run)
                row[f"wide_{name}_ms"] = ms
                row[f"wide_{name}_tflops"] = flops * share / ms / 1e9
            except Exception as e:  # reported, the other cases still run
                row[f"wide_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"compile": compile_facts, "bench": bench}[sys.argv[1] if len(sys.argv) > 1 else "compile"]()

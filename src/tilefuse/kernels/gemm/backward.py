"""Backward of ``y = act(x @ W^T + b)`` (and of the gated form) with ``g = dy * act'(pre)`` made in the
GEMMs' operand loads: g never reaches HBM.

The training forward's epilogue stores the activation's slope ``s = act'(pre)`` instead of the
pre-activation (the same M*N elements eager saves; gated: ``s_gate = up * act'(gate)`` and
``s_up = act(gate)`` instead of gate and up), computed once per element where the accumulator already
is. Both backward GEMMs then make g with one multiply per element as they load it. Computing act' here
instead would repeat its erf/exp for every output column tile (K / BLOCK_N times per element), which
on the H200 cost more than the GEMMs' tensor-core time.

Two kernels, each a tiled GEMM whose A operand is ``dy * s`` (``dy`` alone without an activation):
- ``grad_input_kernel``: dx[M, K] = g[M, N] @ W[N, K] (gated: g_gate @ W_gate + g_up @ W_up into one
  accumulator, in two passes over N). Program tile BLOCK_M x BLOCK_N over (M, K), the forward's N
  walked in BLOCK_K steps.
- ``grad_weight_kernel``: dW[N, K] = g^T[N, M] @ x[M, K], and db[N] = sum_m g from the same g tiles (the
  programs of the first K column band store it). Program tile BLOCK_M x BLOCK_N over (N, K), M walked in
  BLOCK_K steps. Gated: launched once per branch.
On Hopper (16-bit, TMA-able operands) dW takes ``grad_weight_tma_kernel``, a persistent TMA GEMM computing
dW^T = x^T @ g so that x^T is wgmma's shared-memory A operand as TMA delivered it; dx stays on the tuned
``grad_input_kernel`` (a TMA form of it measured slower: NOTES.md).
BLOCK_M/BLOCK_N/BLOCK_K name the output rows, output columns and the reduction, as in the forward's
config space. Accumulation in fp32 (dW and db too), one cast on store.
HBM bytes (element size s, plain form): fused = dy and the slope read by each kernel (4*M*N*s) + W, x
read and dx, dW, db written ((2*N*K + 2*M*K + N)*s). Eager: the activation's backward reads dy and pre
and writes g (3*M*N*s), both GEMMs read g (2*M*N*s), the bias gradient reads it again (M*N*s).
Every edge is masked; any strides (x's rows at two strides, as the forward takes them).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.tiling import grouped_tile


@triton.jit
def _grad_input_pass(acc, dy_ptr, s_ptr, w_ptr, offs_m64, offs_k, mask_m, mask_k, N,
                     stride_dym, stride_dyn, stride_sm, stride_sn, stride_wn, stride_wk,
                     HAS_SLOPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """acc += (dy * s)[rows, :] @ W[:, cols], the forward's N walked in BLOCK_K steps."""
    offs_r = tl.arange(0, BLOCK_K)
    dy_ptrs = dy_ptr + offs_m64[:, None] * stride_dym + offs_r[None, :] * stride_dyn
    s_ptrs = s_ptr + offs_m64[:, None] * stride_sm + offs_r[None, :] * stride_sn
    w_ptrs = w_ptr + offs_r.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
    op_dtype = w_ptr.dtype.element_ty
    for r0 in range(0, N, BLOCK_K):
        mask_r = (r0 + offs_r) < N
        mask_a = mask_m[:, None] & mask_r[None, :]
        g = tl.load(dy_ptrs, mask=mask_a, other=0.0)
        if HAS_SLOPE:  # rounded to the operand dtype as eager's g tensor is
            g = (g.to(tl.float32) * tl.load(s_ptrs, mask=mask_a, other=0.0).to(tl.float32)).to(op_dtype)
        w = tl.load(w_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        if UPCAST_DOT:
            g = g.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(g, w, acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_K * stride_dyn
        s_ptrs += BLOCK_K * stride_sn
        w_ptrs += BLOCK_K * stride_wn
    return acc


@triton.jit
def grad_input_kernel(
    dy_ptr,                   # dy [M, N]
    s_ptr, su_ptr,            # HAS_SLOPE: the saved slope [M, N]; gated: the up branch's slope too
    w_ptr, wu_ptr,            # W [N, K]; gated: W_up [N, K] (any valid pointer otherwise)
    dx_ptr,                   # dx [M, K]
    M, N, K,                  # the forward's sizes: dx is M x K, the reduction runs over N
    M_BUCKET,                 # autotune key only
    stride_dym, stride_dyn, stride_sm, stride_sn,
    stride_wn, stride_wk, stride_wun, stride_wuk,
    stride_dxm, stride_dxk,
    HAS_SLOPE: tl.constexpr,
    GATED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)   # output columns: the forward's K
    mask_m = offs_m < M
    mask_k = offs_k < K
    offs_m64 = offs_m.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _grad_input_pass(acc, dy_ptr, s_ptr, w_ptr, offs_m64, offs_k, mask_m, mask_k, N, stride_dym, stride_dyn,
                           stride_sm, stride_sn, stride_wn, stride_wk, HAS_SLOPE, INPUT_PRECISION, UPCAST_DOT,
                           BLOCK_K)
    if GATED:  # the up branch: one operand pipeline live at a time
        acc = _grad_input_pass(acc, dy_ptr, su_ptr, wu_ptr, offs_m64, offs_k, mask_m, mask_k, N, stride_dym,
                               stride_dyn, stride_sm, stride_sn, stride_wun, stride_wuk, HAS_SLOPE, INPUT_PRECISION,
                               UPCAST_DOT, BLOCK_K)
    dx_ptrs = dx_ptr + offs_m64[:, None] * stride_dxm + offs_k[None, :] * stride_dxk
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_k[None, :])


@triton.jit
def grad_weight_kernel(
    dy_ptr, s_ptr,            # dy [M, N]; HAS_SLOPE: the slope of this branch [M, N]
    x_ptr,                    # x rows [M, K]; TWO_ROW_STRIDES: at two strides (M_INNER, as the forward)
    dw_ptr, db_ptr,           # dW [N, K], db [N] (HAS_BIAS; any valid pointer otherwise)
    M, N, K,
    M_BUCKET,                 # autotune key only: next power of two of M, the reduction length here
    M_INNER, stride_xo, stride_xm, stride_xk,
    stride_dym, stride_dyn, stride_sm, stride_sn,
    stride_dwn, stride_dwk,
    HAS_BIAS: tl.constexpr,
    HAS_SLOPE: tl.constexpr,
    TWO_ROW_STRIDES: tl.constexpr,  # False: x row m at m * stride_xm (no division in the loop)
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # db only from a g made here (dy * slope): a loaded dy tile feeding both the dot and the sum compiles
    # wrong on sm_90 with triton 3.6 (the launch layer sums dy itself when there is no slope).
    tl.static_assert(HAS_SLOPE or not HAS_BIAS, "db is summed here only with a slope")
    pid_n, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    offs_n = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)  # output rows: the forward's N
    offs_k = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns: the forward's K
    offs_r = tl.arange(0, BLOCK_K)                     # reduction: the forward's M
    mask_n = offs_n < N
    mask_k = offs_k < K
    offs_r64 = offs_r.to(tl.int64)
    # g^T tiles [BLOCK_K (m), BLOCK_M (n)] loaded as they lie, transposed on chip for the dot.
    dy_ptrs = dy_ptr + offs_r64[:, None] * stride_dym + offs_n[None, :] * stride_dyn
    s_ptrs = s_ptr + offs_r64[:, None] * stride_sm + offs_n[None, :] * stride_sn
    x_ptrs = x_ptr + offs_r64[:, None] * stride_xm + offs_k[None, :] * stride_xk
    op_dtype = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # db: g summed elementwise into a tile in the loop and across its rows once after it (a cross-thread
    # reduction per step would stall every K step of the main loop).
    db_acc = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_K):
        rows = m0 + offs_r64
        mask_r = rows < M
        mask_g = mask_r[:, None] & mask_n[None, :]
        g = tl.load(dy_ptrs, mask=mask_g, other=0.0)
        if HAS_SLOPE:  # rounded to the operand dtype as eager's g tensor is
            g = (g.to(tl.float32) * tl.load(s_ptrs, mask=mask_g, other=0.0).to(tl.float32)).to(op_dtype)
        if HAS_BIAS:
            db_acc += g.to(tl.float32)
        if TWO_ROW_STRIDES:
            x_off = (rows // M_INNER) * stride_xo + (rows % M_INNER) * stride_xm
            x = tl.load(x_ptr + x_off[:, None] + offs_k[None, :] * stride_xk, mask=mask_r[:, None] & mask_k[None, :],
                        other=0.0)
        else:
            x = tl.load(x_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        if UPCAST_DOT:
            g = g.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_K * stride_dym
        s_ptrs += BLOCK_K * stride_sm
        x_ptrs += BLOCK_K * stride_xm

    offs_n64 = offs_n.to(tl.int64)
    tl.store(dw_ptr + offs_n64[:, None] * stride_dwn + offs_k[None, :] * stride_dwk, acc.to(dw_ptr.dtype.element_ty),
             mask=mask_n[:, None] & mask_k[None, :])
    if HAS_BIAS:
        db = tl.sum(db_acc, axis=0)
        tl.store(db_ptr + offs_n, db.to(db_ptr.dtype.element_ty), mask=mask_n & (pid_k == 0))


# ---- Hopper: dW as a persistent TMA GEMM ---------------------------------------------------------------
@triton.jit
def grad_weight_tma_kernel(
    dy_ptr, s_ptr, x_ptr, dw_ptr, db_ptr,
    M, N, K,
    stride_dym, stride_sm, stride_xm, stride_dw,
    HAS_BIAS: tl.constexpr, HAS_SLOPE: tl.constexpr,
    DW_KN: tl.constexpr,  # dW laid out as its weight's transposed view (GPT-2's Conv1D): dW^T [K, N] dense
    NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Hopper: dW computed transposed, dW^T = x^T @ g, as a persistent TMA GEMM: tiles [BLOCK_M (k), BLOCK_N (n)],
    the forward's M walked in BLOCK_K steps. x^T is wgmma's A straight from the TMA buffer (a transposed view:
    no register round trip, which the A = g^T form of ``grad_weight_kernel`` pays each step), g = dy * s the B
    operand. db from the same g tiles (HAS_BIAS, with a slope), stored by the first K column band."""
    tl.static_assert(HAS_SLOPE or not HAS_BIAS, "db is summed here only with a slope")
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_K, BLOCK_M])
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[stride_dym, 1], block_shape=[BLOCK_K, BLOCK_N])
    s_desc = tl.make_tensor_descriptor(s_ptr, shape=[M, N], strides=[stride_sm, 1], block_shape=[BLOCK_K, BLOCK_N])
    if DW_KN:
        dw_desc = tl.make_tensor_descriptor(dw_ptr, shape=[K, N], strides=[stride_dw, 1],
                                            block_shape=[BLOCK_M, BLOCK_N])
    else:
        dw_desc = tl.make_tensor_descriptor(dw_ptr, shape=[N, K], strides=[stride_dw, 1],
                                            block_shape=[BLOCK_N, BLOCK_M])
    num_pid_k = tl.cdiv(K, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_pid_k * num_pid_n, NUM_SMS, flatten=True):
        pid_k, pid_n = grouped_tile(tile_id, num_pid_k, num_pid_n, GROUP_M)
        off_k = pid_k * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for mi in range(tl.cdiv(M, BLOCK_K)):
            m0 = mi * BLOCK_K
            xt = x_desc.load([m0, off_k])
            g = dy_desc.load([m0, off_n])
            if HAS_SLOPE:  # rounded to the operand dtype as eager's g tensor is
                g = (g.to(tl.float32) * s_desc.load([m0, off_n]).to(tl.float32)).to(xt.dtype)
            if HAS_BIAS:
                db_acc += g.to(tl.float32)
            acc = tl.dot(xt.T, g, acc)
        if DW_KN:
            dw_desc.store([off_k, off_n], acc.to(dw_ptr.dtype.element_ty))
        else:
            dw_desc.store([off_n, off_k], tl.trans(acc).to(dw_ptr.dtype.element_ty))
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            tl.store(db_ptr + offs_n, tl.sum(db_acc, axis=0).to(db_ptr.dtype.element_ty),
                     mask=(offs_n < N) & (pid_k == 0))

"""Backward of ``y = act(x @ W^T + b)`` (and of the gated form) with ``g = dy * act'(pre)`` computed in the
GEMMs' operand loads: g never reaches HBM.

Two kernels, each a tiled GEMM whose A operand is made on chip from dy and the saved pre-activation:
- ``grad_input_kernel``: dx[M, K] = g[M, N] @ W[N, K] (gated: g_gate @ W_gate + g_up @ W_up, one
  accumulator, the two products in two passes over N). Program tile BLOCK_M x BLOCK_N over (M, K), the
  forward's N walked in BLOCK_K steps.
- ``grad_weight_kernel``: dW[N, K] = g^T[N, M] @ x[M, K], and db[N] = sum_m g from the same g tiles (the
  programs of the first K column band store it). Program tile BLOCK_M x BLOCK_N over (N, K), M walked in
  BLOCK_K steps; gated: a second grid axis picks the branch (0: W_gate, b_gate; 1: W_up, b_up).
In both, BLOCK_M/BLOCK_N/BLOCK_K name the output rows, output columns and the reduction, as in the
forward's config space. Accumulation in fp32 (dW and db too), one cast on store.
HBM bytes (element size s, plain form): fused = dy and pre read by each kernel (4*M*N*s) + W, x read and
dx, dW, db written ((2*N*K + 2*M*K + N)*s). Eager: the activation's backward reads dy and pre and writes g
(3*M*N*s), both GEMMs read g (2*M*N*s) and the bias gradient reads it again (M*N*s): 2*M*N*s more.
Gated: fused reads dy, gate, up in each kernel and dy, gate again in grad_input's second pass (mostly
from L2), against eager's ~13*M*N*s.
Every edge is masked; any strides (x's rows at two strides, as the forward takes them).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import activation_grad, gated_grads
from tilefuse.kernels.tiling import grouped_tile


@triton.jit
def grad_input_kernel(
    dy_ptr, pre_ptr, up_ptr,  # dy [M, N]; pre-activation [M, N] ("none": unused); gated: the up product
    w_ptr, wu_ptr,            # W [N, K]; gated: W_up [N, K] (any valid pointer otherwise)
    dx_ptr,                   # dx [M, K]
    M, N, K,                  # the forward's sizes: dx is M x K, the reduction runs over N
    M_BUCKET,                 # autotune key only
    stride_dym, stride_dyn, stride_pm, stride_pn,
    stride_wn, stride_wk, stride_wun, stride_wuk,
    stride_dxm, stride_dxk,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)   # output columns: the forward's K
    offs_r = tl.arange(0, BLOCK_K)                      # reduction: the forward's N
    mask_m = offs_m < M
    mask_k = offs_k < K
    offs_m64 = offs_m.to(tl.int64)
    dy_ptrs = dy_ptr + offs_m64[:, None] * stride_dym + offs_r[None, :] * stride_dyn
    pre_ptrs = pre_ptr + offs_m64[:, None] * stride_pm + offs_r[None, :] * stride_pn
    up_ptrs = up_ptr + offs_m64[:, None] * stride_pm + offs_r[None, :] * stride_pn
    w_ptrs = w_ptr + offs_r.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
    wu_ptrs = wu_ptr + offs_r.to(tl.int64)[:, None] * stride_wun + offs_k[None, :] * stride_wuk
    op_dtype = w_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, N, BLOCK_K):
        mask_r = (r0 + offs_r) < N
        mask_a = mask_m[:, None] & mask_r[None, :]
        dy = tl.load(dy_ptrs, mask=mask_a, other=0.0).to(tl.float32)
        if GATED:
            pre = tl.load(pre_ptrs, mask=mask_a, other=0.0).to(tl.float32)
            up = tl.load(up_ptrs, mask=mask_a, other=0.0).to(tl.float32)
            g, _ = gated_grads(dy, pre, up, ACTIVATION)
            up_ptrs += BLOCK_K * stride_pn
        elif ACTIVATION != "none":
            pre = tl.load(pre_ptrs, mask=mask_a, other=0.0).to(tl.float32)
            g = activation_grad(dy, pre, ACTIVATION)
        else:
            g = dy
        w = tl.load(w_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        if UPCAST_DOT:
            w = w.to(tl.float32)
        # g rounds to the operand dtype before the dot, as eager's g tensor does.
        acc = tl.dot(g.to(op_dtype).to(w.dtype), w, acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_K * stride_dyn
        pre_ptrs += BLOCK_K * stride_pn
        w_ptrs += BLOCK_K * stride_wn
    if GATED:
        # The up branch in a second pass over N (dy and the gate re-read, from L2 mostly): one operand
        # pipeline live at a time, where both in one loop spill on sm_90a.
        dy_ptrs = dy_ptr + offs_m64[:, None] * stride_dym + offs_r[None, :] * stride_dyn
        pre_ptrs = pre_ptr + offs_m64[:, None] * stride_pm + offs_r[None, :] * stride_pn
        for r0 in range(0, N, BLOCK_K):
            mask_r = (r0 + offs_r) < N
            mask_a = mask_m[:, None] & mask_r[None, :]
            dy = tl.load(dy_ptrs, mask=mask_a, other=0.0).to(tl.float32)
            pre = tl.load(pre_ptrs, mask=mask_a, other=0.0).to(tl.float32)
            _, g_up = gated_grads(dy, pre, pre, ACTIVATION)  # d up = dy * act(gate): up unused
            wu = tl.load(wu_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            if UPCAST_DOT:
                wu = wu.to(tl.float32)
            acc = tl.dot(g_up.to(op_dtype).to(wu.dtype), wu, acc, input_precision=INPUT_PRECISION)
            dy_ptrs += BLOCK_K * stride_dyn
            pre_ptrs += BLOCK_K * stride_pn
            wu_ptrs += BLOCK_K * stride_wun

    dx_ptrs = dx_ptr + offs_m64[:, None] * stride_dxm + offs_k[None, :] * stride_dxk
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_k[None, :])


@triton.jit
def grad_weight_kernel(
    dy_ptr, pre_ptr, up_ptr,  # as grad_input_kernel
    x_ptr,                    # x rows [M, K] at two strides (M_INNER, as the forward)
    dw_ptr, db_ptr,           # dW [N, K], db [N] (HAS_BIAS; any valid pointer otherwise)
    dwu_ptr, dbu_ptr,         # gated: dW_up, db_up
    M, N, K,
    M_BUCKET,                 # autotune key only: next power of two of M, the reduction length here
    M_INNER, stride_xo, stride_xm, stride_xk,
    stride_dym, stride_dyn, stride_pm, stride_pn,
    stride_dwn, stride_dwk, stride_dwun, stride_dwuk,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_n, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    up_branch = tl.program_id(1) == 1  # gated only: this program makes dW_up (and db_up)
    offs_n = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)  # output rows: the forward's N
    offs_k = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns: the forward's K
    offs_r = tl.arange(0, BLOCK_K)                     # reduction: the forward's M
    mask_n = offs_n < N
    mask_k = offs_k < K
    offs_r64 = offs_r.to(tl.int64)
    # g^T tiles [BLOCK_K (m), BLOCK_M (n)] loaded as they lie, transposed on chip for the dot.
    dy_ptrs = dy_ptr + offs_r64[:, None] * stride_dym + offs_n[None, :] * stride_dyn
    pre_ptrs = pre_ptr + offs_r64[:, None] * stride_pm + offs_n[None, :] * stride_pn
    up_ptrs = up_ptr + offs_r64[:, None] * stride_pm + offs_n[None, :] * stride_pn
    op_dtype = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_K):
        rows = m0 + offs_r64
        mask_r = rows < M
        mask_g = mask_r[:, None] & mask_n[None, :]
        dy = tl.load(dy_ptrs, mask=mask_g, other=0.0).to(tl.float32)
        if ACTIVATION != "none":
            pre = tl.load(pre_ptrs, mask=mask_g, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(up_ptrs, mask=mask_g, other=0.0).to(tl.float32)
            g_gate, g_up = gated_grads(dy, pre, up, ACTIVATION)
            g = tl.where(up_branch, g_up, g_gate)
            up_ptrs += BLOCK_K * stride_pm
        elif ACTIVATION != "none":
            g = activation_grad(dy, pre, ACTIVATION)
        else:
            g = dy
        g = g.to(op_dtype)  # rounded as eager's g tensor is
        if HAS_BIAS:
            db += tl.sum(g.to(tl.float32), axis=0)
        x_off = (rows // M_INNER) * stride_xo + (rows % M_INNER) * stride_xm
        x = tl.load(x_ptr + x_off[:, None] + offs_k[None, :] * stride_xk, mask=mask_r[:, None] & mask_k[None, :],
                    other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(g.to(x.dtype)), x, acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_K * stride_dym
        pre_ptrs += BLOCK_K * stride_pm

    offs_n64 = offs_n.to(tl.int64)
    mask_out = mask_n[:, None] & mask_k[None, :]
    if up_branch:
        tl.store(dwu_ptr + offs_n64[:, None] * stride_dwun + offs_k[None, :] * stride_dwuk,
                 acc.to(dwu_ptr.dtype.element_ty), mask=mask_out)
        if HAS_BIAS:
            tl.store(dbu_ptr + offs_n, db.to(dbu_ptr.dtype.element_ty), mask=mask_n & (pid_k == 0))
    else:
        tl.store(dw_ptr + offs_n64[:, None] * stride_dwn + offs_k[None, :] * stride_dwk,
                 acc.to(dw_ptr.dtype.element_ty), mask=mask_out)
        if HAS_BIAS:
            tl.store(db_ptr + offs_n, db.to(db_ptr.dtype.element_ty), mask=mask_n & (pid_k == 0))

"""The elementwise passes of the GEMM family's cuBLAS candidates, run after cuBLAS's GEMM(s) on [M, N] rows (any
row strides, unit column stride), fp32 math, outputs in their own dtype:

- the gate of a GLU: y = act(gate + b_gate) * (up + b_up), one read of each half and one write of y, where eager
  runs the activation and the product as two passes; with SAVE_SLOPES (the training forward) also the two slopes the backward reads,
  (up * act'(gate), act(gate)) (activations.gated_slopes), as tilefuse's fused epilogue stores them;
- the training forward's activation: y = act(pre) (over pre itself where y is pre) and its slope act'(pre)
  (activations.activation_slope), the pair tilefuse's fused epilogue stores;
- the gated backward's g: [dy * s_gate, dy * s_up] side by side in one [M, 2N] tensor (dy read once), so that both
  dW are one GEMM."""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import activation_slope, apply_activation, apply_gated, gated_slopes


@triton.jit
def _row_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile of the [M, N] rows: (rows as int64, columns, in-bounds mask), over a
    (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) grid."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, (rows[:, None] < M) & (cols[None, :] < N)


@triton.jit
def glu_gate_kernel(g_ptr, u_ptr, bg_ptr, bu_ptr, y_ptr, sg_ptr, su_ptr, M, N, stride_g, stride_u, stride_y,
                    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_SLOPES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _row_tile(M, N, BLOCK_M, BLOCK_N)
    gate = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # the biases added here in fp32, not by cuBLAS (see the launch module's gated candidate)
        gate += tl.load(bg_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bu_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = apply_gated(gate, up, ACTIVATION)
    out = rows[:, None] * stride_y + cols[None, :]
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)
    if SAVE_SLOPES:  # the slopes share y's layout
        s_gate, s_up = gated_slopes(gate, up, ACTIVATION)
        tl.store(sg_ptr + out, s_gate.to(sg_ptr.dtype.element_ty), mask=mask)
        tl.store(su_ptr + out, s_up.to(su_ptr.dtype.element_ty), mask=mask)


@triton.jit
def activation_slope_kernel(h_ptr, y_ptr, s_ptr, M, N, stride_h, stride_y,
                            ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _row_tile(M, N, BLOCK_M, BLOCK_N)
    pre = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = rows[:, None] * stride_y + cols[None, :]
    tl.store(y_ptr + out, apply_activation(pre, ACTIVATION).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + out, activation_slope(pre, ACTIVATION).to(s_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_grad_kernel(dy_ptr, sg_ptr, su_ptr, g_ptr, M, N, stride_dy, stride_s, stride_g,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _row_tile(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = rows[:, None] * stride_s + cols[None, :]
    s_gate = tl.load(sg_ptr + s, mask=mask, other=0.0).to(tl.float32)
    s_up = tl.load(su_ptr + s, mask=mask, other=0.0).to(tl.float32)
    g = g_ptr + rows[:, None] * stride_g + cols[None, :]
    tl.store(g, (dy * s_gate).to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(g + N, (dy * s_up).to(g_ptr.dtype.element_ty), mask=mask)

"""The gate of a GLU as a pass of its own: y = act(gate) * up over [M, N] rows (any row strides, unit column
stride), fp32 math, y in its own dtype. The gated linear's cuBLAS candidate runs it after cuBLAS's GEMM(s): one
read of each half and one write of y, where eager runs the activation and the product as two passes."""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import apply_gated


@triton.jit
def glu_gate_kernel(g_ptr, u_ptr, y_ptr, M, N, stride_g, stride_u, stride_y,
                    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    gate = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = apply_gated(gate, up, ACTIVATION)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

"""Decode-shaped Linear (+ bias + activation) for M <= 64: the weight read once, no K split, no workspace.

At decode size the work is the weight read (4096 x 4096 bf16 is 33.5 MB), while the FLOPs (2 * M * N * K) are
nothing for the tensor cores. Each program owns BLOCK_N output columns for every row of x: it streams its
[BLOCK_N, K] slab of W through ``num_stages`` [BLOCK_N, BLOCK_K] tiles in flight (the bytes per SM the read rate
needs), multiplies by the matching x tile (at most 64 rows, from L2 for every program) and runs the epilogue on
its own [BLOCK_M, BLOCK_N] accumulator: one launch, no partial sums in HBM. N / BLOCK_N programs, so it needs N
wide enough for a wave of them (the launch's rule, launch.decode_usable); narrower N keeps the split-K path.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import apply_activation
from tilefuse.sizes import next_pow2


@triton.jit
def decode_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[M, N] = act(x[M, K] @ w[N, K]^T + b) for M <= BLOCK_M (unit inner strides): one program per BLOCK_N
    columns, over the whole K."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    in_n = offs_n < N
    in_m = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=in_n[:, None] & in_k[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=in_m[:, None] & in_k[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])


def block_m(M: int) -> int:
    """The row tile: every row of x in one (tl.dot takes 16 rows at least)."""
    return max(16, next_pow2(M))

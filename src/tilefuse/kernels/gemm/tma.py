"""Hopper GEMM ``y = act(x @ w^T + b)``: tensor descriptors (TMA), persistent grid, fused epilogue.

Fuses: GEMM + bias + activation, as portable.py, with the same HBM bytes: (M*K + N*K + M*N)*s fused
against (M*K + N*K + 3*M*N)*s for GEMM-then-activation; and the gated (GLU) form with two accumulators
fed by one x tile: (M*K + 2*N*K + M*N)*s against eager's (M*K + 2*N*K + 7*M*N)*s.
Tiling: one program per SM walks output tiles tile_id = pid, pid + NUM_SMS, ... in grouped order (GROUP_M
row-tiles per weight column band stay in L2). Operands arrive through TMA into swizzled shared memory and
feed wgmma; the K loop is software-pipelined NUM_STAGES deep. The epilogue adds the bias, applies the
activation on the fp32 accumulator and stores through TMA, optionally in two N-halves (EPILOGUE_SUBTILE)
to halve the registers and shared memory it needs. TMA zero-fills out-of-bounds loads and clips stores,
so the edges need no masks.
NORM (layer_norm_linear): ``act(norm(x) @ W^T + b)`` with the normalization moved past the GEMM. With
W' = W * gamma (gamma along K), s = W' summed over K and c = b + W @ beta (kernels/gemm/launch/ makes
them with norm_prologue.weight_fold_kernel), norm(x) @ W^T + b = rstd * (x @ W'^T - mean * s) + c: the main
loop is exactly the plain GEMM's, on raw x, and the epilogue applies the rows' mean and rstd, which a
statistics pre-pass (the norms family's kernel: one read of x, 8 bytes a row written) leaves in su_ptr.
No normalized x is written.
Limits: x and y row-contiguous, w [N, K] K-contiguous, row strides multiples of 16 bytes, base pointers
16-byte aligned; otherwise the launch layer (kernels/gemm/launch/) runs the portable kernel (portable.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import activation_slope, apply_activation, apply_gated, gated_slopes
from tilefuse.kernels.tiling import column_halves, grouped_tile


@triton.jit
def linear_tma_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    # Gated: the "up" weight [N, K] and its bias. NORM: bu_ptr holds the folded weight's column sums
    # (fp32 [N], LayerNorm only). Otherwise any valid pointer.
    wu_ptr, bu_ptr,
    # SAVE_SLOPE: act'(pre) [M, N] (gated: the two branches' slopes), y's row stride. NORM (never gated):
    # su_ptr holds the row statistics, fp32 [2, M] contiguous: mean (LayerNorm only), then rstd.
    s_ptr, su_ptr,
    M, N, K,
    M_BUCKET,  # autotune key only
    stride_xm, stride_wn, stride_wun, stride_ym,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,  # 0: none; 1: LayerNorm (mean and rstd); 2: RMSNorm (rstd)
    SAVE_SLOPE: tl.constexpr,  # training: also store the activation's slope(s) for the backward
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    out_dtype = y_ptr.dtype.element_ty
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    if GATED:
        wu_desc = tl.make_tensor_descriptor(wu_ptr, shape=[N, K], strides=[stride_wun, 1],
                                            block_shape=[BLOCK_N, BLOCK_K])
    # Stores go in tiles of BLOCK_N columns, or two halves of BLOCK_N / 2 with EPILOGUE_SUBTILE.
    Y_WIDTH: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1], block_shape=[BLOCK_M, Y_WIDTH])
    if SAVE_SLOPE:  # y's layout: slopes are allocated like y
        s_desc = tl.make_tensor_descriptor(s_ptr, shape=[M, N], strides=[stride_ym, 1],
                                           block_shape=[BLOCK_M, Y_WIDTH])
        if GATED:
            su_desc = tl.make_tensor_descriptor(su_ptr, shape=[M, N], strides=[stride_ym, 1],
                                                block_shape=[BLOCK_M, Y_WIDTH])

    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dead (removed) unless GATED
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            x_tile = x_desc.load([off_m, off_k])
            acc = tl.dot(x_tile, w_desc.load([off_n, off_k]).T, acc)
            if GATED:
                acc_up = tl.dot(x_tile, wu_desc.load([off_n, off_k]).T, acc_up)
        # NORM: the rows' statistics from the pre-pass (unused, and removed, otherwise).
        offs_m = off_m + tl.arange(0, BLOCK_M)
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NORM != 0:
            rstd = tl.load(su_ptr + M + offs_m, mask=offs_m < M, other=0.0)
            if NORM == 1:
                mean = tl.load(su_ptr + offs_m, mask=offs_m < M, other=0.0)

        # Epilogue on the fp32 accumulator; the pre-activation never leaves the SM. With subtiling the
        # bias and activation run on one N-half at a time, which halves the live temporaries of the
        # activation (the 128x256 tile otherwise spills).
        if EPILOGUE_SUBTILE:
            acc_lo, acc_hi = column_halves(acc, BLOCK_M, BLOCK_N // 2)
            up_lo, up_hi = column_halves(acc_up, BLOCK_M, BLOCK_N // 2)
            pre, pre_up = _pre_activation(acc_lo, up_lo, b_ptr, bu_ptr, mean, rstd, off_n, N, HAS_BIAS, GATED,
                                          NORM, BLOCK_N // 2)
            if SAVE_SLOPE:
                pre, pre_up = _store_slopes(s_desc, su_desc if GATED else s_desc, [off_m, off_n], pre, pre_up,
                                            out_dtype, ACTIVATION, GATED)
            y_desc.store([off_m, off_n], _activate(pre, pre_up, ACTIVATION, GATED).to(out_dtype))
            pre, pre_up = _pre_activation(acc_hi, up_hi, b_ptr, bu_ptr, mean, rstd, off_n + BLOCK_N // 2, N,
                                          HAS_BIAS, GATED, NORM, BLOCK_N // 2)
            if SAVE_SLOPE:
                pre, pre_up = _store_slopes(s_desc, su_desc if GATED else s_desc, [off_m, off_n + BLOCK_N // 2], pre, pre_up,
                                            out_dtype, ACTIVATION, GATED)
            y_desc.store([off_m, off_n + BLOCK_N // 2], _activate(pre, pre_up, ACTIVATION, GATED).to(out_dtype))
        else:
            pre, pre_up = _pre_activation(acc, acc_up, b_ptr, bu_ptr, mean, rstd, off_n, N, HAS_BIAS, GATED, NORM,
                                          BLOCK_N)
            if SAVE_SLOPE:
                pre, pre_up = _store_slopes(s_desc, su_desc if GATED else s_desc, [off_m, off_n], pre, pre_up,
                                            out_dtype, ACTIVATION, GATED)
            y_desc.store([off_m, off_n], _activate(pre, pre_up, ACTIVATION, GATED).to(out_dtype))

@triton.jit
def _pre_activation(acc, acc_up, b_ptr, bu_ptr, mean, rstd, off_n, N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                    NORM: tl.constexpr, WIDTH: tl.constexpr):
    """(Row statistics,) bias on a [BLOCK_M, WIDTH] slice of the accumulator(s): the pre-activation(s).
    ``mean``/``rstd``: the rows' statistics under NORM (unused otherwise)."""
    offs_n = off_n + tl.arange(0, WIDTH)
    if NORM != 0:
        if NORM == 1:
            # rstd * (x @ W'^T - mean * colsum(W')): the centring a prologue would have done.
            colsum = tl.load(bu_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc - mean[:, None] * colsum[None, :]
        acc = acc * rstd[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up = acc_up + tl.load(bu_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return acc, acc_up


@triton.jit
def _store_slopes(s_desc, su_desc, offsets, pre, pre_up, out_dtype: tl.constexpr, ACTIVATION: tl.constexpr,
                  GATED: tl.constexpr):
    """Training: round the pre-activation(s) to the output dtype, as eager's saved tensors are, store the
    activation's slope(s) of the rounded values and return them, so y comes from the same values."""
    pre = pre.to(out_dtype).to(tl.float32)
    if GATED:
        pre_up = pre_up.to(out_dtype).to(tl.float32)
        s_gate, s_up = gated_slopes(pre, pre_up, ACTIVATION)
        s_desc.store(offsets, s_gate.to(out_dtype))
        su_desc.store(offsets, s_up.to(out_dtype))
    else:
        s_desc.store(offsets, activation_slope(pre, ACTIVATION).to(out_dtype))
    return pre, pre_up


@triton.jit
def _activate(pre, pre_up, ACTIVATION: tl.constexpr, GATED: tl.constexpr):
    if GATED:
        return apply_gated(pre, pre_up, ACTIVATION)
    return apply_activation(pre, ACTIVATION)

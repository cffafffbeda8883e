"""Q, K, V projections written straight into head layout, with the rotary embedding and the per-head RMSNorm
(QK-norm) in the GEMM's epilogue.

One program per (BLOCK_M token rows, head) of one projection. ``qkv_projection_head_kernel`` (no RoPE, or
RoPE over all of a power-of-two d: the Llama / Qwen / Mistral case) makes the head's d columns in one K loop
and splits the rotation pairs apart in registers. ``qkv_projection_kernel`` (partial rotary, r < d, or RoPE
on another d) makes them as three accumulators, a K loop each -- the two rotary halves (rotate-half: columns
[0, r/2) and [r/2, r); GPT-J: the even and odd columns of the first r) and the pass-through rest [r, d) --
so the rotation pairs meet in registers. ``qkv_projection_tma_kernel`` (Hopper, 16-bit operands, a
power-of-two d with RoPE over all of it or none) is the one-loop form as a persistent TMA GEMM, one or two
whole heads per output tile; ``qkv_projection_tma_parts_kernel`` (Hopper, 16-bit, every other rotate-half
case: d 80, 96, 160, 192, partial rotary) is the three-part form as one, with one K loop feeding the parts.
Then, in all four:
bias, QK-norm over the head's d columns (rstd from the three accumulators), RoPE with cos/sin of each row's
position, and a store into q/k/v laid out [B, H, N, d] (or [B, N, H, d]) at the row's (b, n).
HBM bytes (element size s): fused (M*K + (H + 2*Hkv)*d*K + M*(H + 2*Hkv)*d)*s + the cos/sin reads; eager
writes the [M, (H + 2*Hkv)*d] product, reads it to split and transpose (a copy each), and RoPE and QK-norm
read and write q and k again: >= 4 more passes over q and k.
Any M, K, d <= 256 (each part padded to a power of two >= 16 and masked), even r <= d. W is read in place
in nn.Linear's [rows, K] layout or as the transposed view of GPT-2's Conv1D weight (unit row stride).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.tiling import column_halves, grouped_tile


@triton.jit
def _head_part(x_ptr, w_ptr, offs_m64, mask_m, rows, mask_c, K, stride_xm, stride_wn, stride_wk,
               INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """x[rows m] @ W[rows]^T for the weight rows ``rows`` ([BLOCK_C], masked by ``mask_c``): fp32. W's element
    (row, k) is at row * stride_wn + k * stride_wk: nn.Linear's [rows, K] (stride_wk 1) or GPT-2 Conv1D's
    transposed view (stride_wn 1), read in place."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptr + offs_m64[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + rows.to(tl.int64)[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
                    mask=mask_k[:, None] & mask_c[None, :], other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _program_rows(M, N_SEQ, BLOCK_M: tl.constexpr):
    """(head, token rows (int64), their mask, batch index, position) of this (row block, head) program."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m64 = offs_m.to(tl.int64)
    return tl.program_id(1), offs_m64, offs_m < M, offs_m64 // N_SEQ, offs_m64 % N_SEQ


@triton.jit
def _rotate_pairs(a, b, cos_ptr, sin_ptr, c_rows, col_a, col_b, mask):
    """RoPE on the pairs (a, b) of head columns col_a / col_b: a' = a cos - b sin, b' = b cos + a sin, with
    cos/sin read at each row's ``c_rows`` offset (fp32 math)."""
    cos_a = tl.load(cos_ptr + c_rows + col_a[None, :], mask=mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + c_rows + col_a[None, :], mask=mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + c_rows + col_b[None, :], mask=mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + c_rows + col_b[None, :], mask=mask, other=0.0).to(tl.float32)
    return a * cos_a - b * sin_a, b * cos_b + a * sin_b


@triton.jit
def qkv_projection_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr,
    M, N_SEQ, K, HEAD_DIM, ROT,            # rows M = B * N_SEQ; ROT: rotary dims (even, <= HEAD_DIM; 0: none)
    stride_xm, stride_wn, stride_wk,       # W element (row, k) at row * stride_wn + k * stride_wk
    stride_ob, stride_oh, stride_on,       # the output [B, H, N, d] (or [B, N, H, d]) strides; unit d stride
    stride_cb, stride_cn,                  # cos/sin [B, N, r] (stride_cb 0 for [N, r]), unit last stride
    eps,
    HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # fp32: "ieee" unless torch allows TF32 matmuls (launch.precision_for)
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    head, offs_m64, mask_m, b, n = _program_rows(M, N_SEQ, BLOCK_M)
    col_a, col_b, mask_r, col_p, mask_p = _part_columns(HEAD_DIM, ROT, INTERLEAVED, BLOCK_R, BLOCK_P)
    row0 = head * HEAD_DIM
    acc_a = _head_part(x_ptr, w_ptr, offs_m64, mask_m, row0 + col_a, mask_r, K, stride_xm, stride_wn, stride_wk,
                       INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_R, BLOCK_K)
    acc_b = _head_part(x_ptr, w_ptr, offs_m64, mask_m, row0 + col_b, mask_r, K, stride_xm, stride_wn, stride_wk,
                       INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_R, BLOCK_K)
    acc_p = _head_part(x_ptr, w_ptr, offs_m64, mask_m, row0 + col_p, mask_p, K, stride_xm, stride_wn, stride_wk,
                       INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_P, BLOCK_K)
    _parts_epilogue(acc_a, acc_b, acc_p, head, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64, mask_m, b, n,
                    HEAD_DIM, ROT, stride_ob, stride_oh, stride_on, stride_cb, stride_cn, eps, HAS_BIAS, HAS_ROPE,
                    INTERLEAVED, HAS_NORM, BLOCK_R, BLOCK_P)


@triton.jit
def _part_columns(HEAD_DIM, ROT, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """A head's columns as three parts: the rotary pairs' first and second members (rotate-half: [0, r/2) and
    [r/2, r); GPT-J: the even and odd columns of the first r), each [BLOCK_R] masked past r/2, and the
    pass-through rest [r, d) as [BLOCK_P] masked past d. Returns (col_a, col_b, mask_r, col_p, mask_p)."""
    half = ROT // 2
    i = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        col_a = 2 * i
        col_b = 2 * i + 1
    else:
        col_a = i
        col_b = i + half
    col_p = ROT + tl.arange(0, BLOCK_P)
    return col_a, col_b, i < half, col_p, col_p < HEAD_DIM


@triton.jit
def _parts_epilogue(acc_a, acc_b, acc_p, head, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64, mask_m, b, n,
                    HEAD_DIM, ROT, stride_ob, stride_oh, stride_on, stride_cb, stride_cn, eps,
                    HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Bias, QK-norm, RoPE and the head-layout store of one head made as three parts (``_part_columns``),
    fp32 [BLOCK_M, BLOCK_R] x 2 and [BLOCK_M, BLOCK_P]. Columns past a part's end are zeroed first (a TMA
    tile holds the next columns' products there), so the QK-norm sums see the head's d columns only."""
    col_a, col_b, mask_r, col_p, mask_p = _part_columns(HEAD_DIM, ROT, INTERLEAVED, BLOCK_R, BLOCK_P)
    acc_a = tl.where(mask_r[None, :], acc_a, 0.0)
    acc_b = tl.where(mask_r[None, :], acc_b, 0.0)
    acc_p = tl.where(mask_p[None, :], acc_p, 0.0)
    row0 = head * HEAD_DIM
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + row0 + col_a, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(b_ptr + row0 + col_b, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        acc_p += tl.load(b_ptr + row0 + col_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    out_dtype = out_ptr.dtype.element_ty
    if HAS_NORM:  # per-head RMSNorm over d, in fp32, on the product rounded as eager's would be
        acc_a = acc_a.to(out_dtype).to(tl.float32)
        acc_b = acc_b.to(out_dtype).to(tl.float32)
        acc_p = acc_p.to(out_dtype).to(tl.float32)
        sq = tl.sum(acc_a * acc_a, 1) + tl.sum(acc_b * acc_b, 1) + tl.sum(acc_p * acc_p, 1)
        rstd = 1.0 / tl.sqrt(sq / HEAD_DIM + eps)
        acc_a = acc_a * rstd[:, None] * tl.load(norm_w_ptr + col_a, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        acc_b = acc_b * rstd[:, None] * tl.load(norm_w_ptr + col_b, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        acc_p = acc_p * rstd[:, None] * tl.load(norm_w_ptr + col_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    if HAS_ROPE:  # HF Llama's rotate-half (or GPT-J's pairs): a' = a cos - b sin, b' = b cos + a sin
        acc_a = acc_a.to(out_dtype).to(tl.float32)
        acc_b = acc_b.to(out_dtype).to(tl.float32)
        acc_a, acc_b = _rotate_pairs(acc_a, acc_b, cos_ptr, sin_ptr, (b * stride_cb + n * stride_cn)[:, None],
                                     col_a, col_b, mask_m[:, None] & mask_r[None, :])
    base = out_ptr + b * stride_ob + head.to(tl.int64) * stride_oh + n * stride_on
    tl.store(base[:, None] + col_a[None, :], acc_a.to(out_dtype), mask=mask_m[:, None] & mask_r[None, :])
    tl.store(base[:, None] + col_b[None, :], acc_b.to(out_dtype), mask=mask_m[:, None] & mask_r[None, :])
    tl.store(base[:, None] + col_p[None, :], acc_p.to(out_dtype), mask=mask_m[:, None] & mask_p[None, :])


@triton.jit
def qkv_projection_head_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr,
    M, N_SEQ, K, HEAD_DIM,
    stride_xm, stride_wn, stride_wk,
    stride_ob, stride_oh, stride_on,
    stride_cb, stride_cn,
    eps,
    HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The same projection with the head's columns made by one K loop into one [BLOCK_M, BLOCK_D]
    accumulator (``qkv_projection_kernel`` runs a loop per part, reading x's tile once per part). RoPE, when
    given, rotates every column (r == d == BLOCK_D): the pairs are taken apart in registers (rotate-half:
    columns j and j + d/2; GPT-J: 2j and 2j + 1) and put back before the store. Without RoPE any d <= BLOCK_D.
    Rounding as ``qkv_projection_kernel``: the product to the output dtype before QK-norm and before RoPE."""
    head, offs_m64, mask_m, b, n = _program_rows(M, N_SEQ, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    acc = _head_part(x_ptr, w_ptr, offs_m64, mask_m, head * HEAD_DIM + cols, cols < HEAD_DIM, K, stride_xm, stride_wn,
                     stride_wk, INPUT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_D, BLOCK_K)
    _head_epilogue(acc, head, tl.num_programs(1), b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64, mask_m, b, n,
                   HEAD_DIM, stride_ob, stride_oh, stride_on, stride_cb, stride_cn, eps, HAS_BIAS, HAS_ROPE, INTERLEAVED,
                   HAS_NORM, BLOCK_M, BLOCK_D)


@triton.jit
def _head_epilogue(acc, head, HEADS, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64, mask_m, b, n, HEAD_DIM,
                   stride_ob, stride_oh, stride_on, stride_cb, stride_cn, eps, HAS_BIAS: tl.constexpr,
                   HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Bias, QK-norm, RoPE and the head-layout store of one head's fp32 product ``acc`` [BLOCK_M, BLOCK_D]
    (columns >= HEAD_DIM masked; with RoPE HEAD_DIM == BLOCK_D), rows at (b, n); nothing is read or written
    for a head >= HEADS. Rounding as ``qkv_projection_kernel``: the product to the output dtype before QK-norm
    and before RoPE."""
    cols = tl.arange(0, BLOCK_D)
    mask_d = cols < HEAD_DIM
    mask_m = mask_m & (head < HEADS)  # stores (and cos/sin reads) only for real heads
    if HAS_BIAS:  # a head past the end reads the last head's bias (in bounds, unmasked: 16-byte loads)
        acc += tl.load(b_ptr + tl.minimum(head, HEADS - 1) * HEAD_DIM + cols, mask=mask_d,
                       other=0.0).to(tl.float32)[None, :]
    out_dtype = out_ptr.dtype.element_ty
    if HAS_NORM:  # per-head RMSNorm over d, in fp32, on the product rounded as eager's would be
        acc = acc.to(out_dtype).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(acc * acc, 1) / HEAD_DIM + eps)
        acc = acc * rstd[:, None] * tl.load(norm_w_ptr + cols, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if HAS_ROPE:  # a' = a cos - b sin, b' = b cos + a sin over the pairs (a, b)
        acc = acc.to(out_dtype).to(tl.float32)
        HALF: tl.constexpr = BLOCK_D // 2
        if INTERLEAVED:
            pairs = tl.reshape(acc, (BLOCK_M, HALF, 2))                                   # [m, j, (2j, 2j+1)]
        else:
            pairs = tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1))            # [m, j, (j, j+d/2)]
        a, bb = tl.split(pairs)
        i = tl.arange(0, HALF)
        col_a = 2 * i if INTERLEAVED else i
        col_b = col_a + 1 if INTERLEAVED else i + HALF
        a, bb = _rotate_pairs(a, bb, cos_ptr, sin_ptr, (b * stride_cb + n * stride_cn)[:, None], col_a, col_b,
                              mask_m[:, None])
        pairs = tl.join(a, bb)
        if INTERLEAVED:
            acc = tl.reshape(pairs, (BLOCK_M, BLOCK_D))
        else:
            acc = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BLOCK_M, BLOCK_D))
    base = out_ptr + b * stride_ob + head.to(tl.int64) * stride_oh + n * stride_on
    tl.store(base[:, None] + cols[None, :], acc.to(out_dtype), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _weight_descriptor(w_ptr, rows, K, stride_w, W_KN: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """W's TMA descriptor for tiles of BLOCK_ROWS weight rows by BLOCK_K: W [rows, K] as nn.Linear keeps it, or
    with W_KN its transpose [K, rows] as GPT-2's Conv1D does (tiles then [BLOCK_K, BLOCK_ROWS])."""
    if W_KN:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[K, rows], strides=[stride_w, 1],
                                         block_shape=[BLOCK_K, BLOCK_ROWS])
    else:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[rows, K], strides=[stride_w, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_K])
    return desc


@triton.jit
def qkv_projection_tma_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr,
    M, N_SEQ, K, HEADS,
    stride_xm, stride_w,   # x's row stride; W's row stride ([rows, K], or [K, rows] with W_KN)
    stride_ob, stride_oh, stride_on,
    stride_cb, stride_cn,
    eps,
    HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
    W_KN: tl.constexpr,  # W given as W^T [K, rows] with unit row stride (GPT-2's Conv1D), read in place
    NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Hopper: the same projection as a persistent TMA GEMM (the main loop of tma.py) whose output tiles are
    HEADS_PER_TILE whole heads (HEAD_DIM a power of two, RoPE over all of it or none), walked in grouped order
    so a weight band stays in L2. The epilogue takes the tile apart head by head (``_head_epilogue``: bias,
    QK-norm, RoPE, the store at each row's (b, n)). x and W arrive through TMA (zero-filled past their
    edges, so a last head beyond HEADS reads zeros and its store is skipped); the stores are pointer stores,
    since a tile's rows may cross a sequence boundary."""
    BLOCK_N: tl.constexpr = HEADS_PER_TILE * HEAD_DIM
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = _weight_descriptor(w_ptr, HEADS * HEAD_DIM, K, stride_w, W_KN, BLOCK_N, BLOCK_K)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(HEADS, HEADS_PER_TILE)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x_tile = x_desc.load([off_m, ki * BLOCK_K])
            if W_KN:
                acc = tl.dot(x_tile, w_desc.load([ki * BLOCK_K, off_n]), acc)
            else:
                acc = tl.dot(x_tile, w_desc.load([off_n, ki * BLOCK_K]).T, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_m64 = offs_m.to(tl.int64)
        mask_m = offs_m < M
        b = offs_m64 // N_SEQ
        n = offs_m64 % N_SEQ
        head = pid_n * HEADS_PER_TILE
        if HEADS_PER_TILE == 2:
            acc0, acc1 = column_halves(acc, BLOCK_M, HEAD_DIM)
            _head_epilogue(acc0, head, HEADS, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64, mask_m, b, n,
                           HEAD_DIM, stride_ob, stride_oh, stride_on, stride_cb, stride_cn, eps, HAS_BIAS, HAS_ROPE,
                           INTERLEAVED, HAS_NORM, BLOCK_M, HEAD_DIM)
            _head_epilogue(acc1, head + 1, HEADS, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64, mask_m, b,
                           n, HEAD_DIM, stride_ob, stride_oh, stride_on, stride_cb, stride_cn, eps, HAS_BIAS, HAS_ROPE,
                           INTERLEAVED, HAS_NORM, BLOCK_M, HEAD_DIM)
        else:
            _head_epilogue(acc, head, HEADS, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64, mask_m, b, n,
                           HEAD_DIM, stride_ob, stride_oh, stride_on, stride_cb, stride_cn, eps, HAS_BIAS, HAS_ROPE,
                           INTERLEAVED, HAS_NORM, BLOCK_M, HEAD_DIM)


@triton.jit
def qkv_projection_tma_parts_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr,
    M, N_SEQ, K, HEADS,
    stride_xm, stride_w,   # x's row stride; W's row stride ([rows, K], or [K, rows] with W_KN)
    stride_ob, stride_oh, stride_on,
    stride_cb, stride_cn,
    eps,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_PASS: tl.constexpr, HAS_NORM: tl.constexpr,
    W_KN: tl.constexpr, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Hopper: ``qkv_projection_kernel``'s three parts (rotate-half only) as a persistent TMA GEMM, one head per
    output tile, for the head dims and rotary widths the whole-head kernel cannot split in registers (d 80,
    96, 160, 192; partial rotary). Each K step loads x's tile once and W's rows of each part as a TMA tile
    starting at the part's first row (the rotary halves at +0 and +r/2, the rest at +r, HAS_PASS when r < d):
    a tile's rows past the part are the next part's (zeroed in the epilogue), and past the weight zeros."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    wr_desc = _weight_descriptor(w_ptr, HEADS * HEAD_DIM, K, stride_w, W_KN, BLOCK_R, BLOCK_K)
    wp_desc = _weight_descriptor(w_ptr, HEADS * HEAD_DIM, K, stride_w, W_KN, BLOCK_P, BLOCK_K)
    half = ROT // 2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_tiles = num_pid_m * HEADS
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, head = grouped_tile(tile_id, num_pid_m, HEADS, GROUP_M)
        off_m = pid_m * BLOCK_M
        row0 = head * HEAD_DIM
        acc_a = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc_p = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            x_tile = x_desc.load([off_m, k0])
            if W_KN:
                if HAS_ROPE:
                    acc_a = tl.dot(x_tile, wr_desc.load([k0, row0]), acc_a)
                    acc_b = tl.dot(x_tile, wr_desc.load([k0, row0 + half]), acc_b)
                if HAS_PASS:
                    acc_p = tl.dot(x_tile, wp_desc.load([k0, row0 + ROT]), acc_p)
            else:
                if HAS_ROPE:
                    acc_a = tl.dot(x_tile, wr_desc.load([row0, k0]).T, acc_a)
                    acc_b = tl.dot(x_tile, wr_desc.load([row0 + half, k0]).T, acc_b)
                if HAS_PASS:
                    acc_p = tl.dot(x_tile, wp_desc.load([row0 + ROT, k0]).T, acc_p)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_m64 = offs_m.to(tl.int64)
        _parts_epilogue(acc_a, acc_b, acc_p, head, b_ptr, out_ptr, cos_ptr, sin_ptr, norm_w_ptr, offs_m64,
                        offs_m < M, offs_m64 // N_SEQ, offs_m64 % N_SEQ, HEAD_DIM, ROT, stride_ob, stride_oh,
                        stride_on, stride_cb, stride_cn, eps, HAS_BIAS, HAS_ROPE, False, HAS_NORM, BLOCK_R, BLOCK_P)

"""The LM head without logits: ``cross_entropy(x @ W^T + b, target)`` with the [tokens, V] logits never
materialised, forward and backward.

Forward (``lce_chunk_stats_kernel``): a cuBLAS GEMM makes one vocabulary chunk's logits [T, VC] at a time; a
row pass folds each chunk into per-row partials -- the running max / sum of exponentials (the online
softmax), the target's logit and the logits' sum (for label smoothing) -- which the launch layer merges
(4 floats per token and chunk).
Backward (launch.py), over vocabulary chunks of a few thousand entries: the chunk's logits [T, VC] are
recomputed by one GEMM, turned into ``dz = dloss * ((1 - eps) * (softmax - onehot) + eps * (softmax - 1/V))``
(times 1 - tanh^2 under the softcap) in place by ``lce_logit_grad_kernel``, then ``dW[chunk] = dz^T @ x``
(complete: the whole token reduction in one GEMM) and ``dx += dz @ W[chunk]`` (fp32). The chunk is the only
[T, *] buffer: no [T, V] tensor exists in any dtype, and there are no atomics, so the gradients are
deterministic.
HBM bytes (element size s, T tokens): eager writes the logits and reads them back at least twice (softmax,
its gradient) and writes their gradient: >= 4 * T * V * s beyond the GEMMs' operands; fused: the GEMM
operands, in the forward each chunk written and read once (2 * T * V * s) and 16 bytes per token and chunk, in
the backward each chunk written and read
three times (T * V * s * 3 in all) plus the fp32 dx accumulator.
Rows whose target is ``ignore_index`` contribute nothing; a target outside [0, V) gets a NaN loss (the
launch layer) and no gradient, and is never used as an address.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.kernels.activations import tanh


@triton.jit
def _soft_capped(z, softcap):
    """(Gemma 2's soft-capped logits softcap * tanh(z / softcap), the tanh: its derivative is 1 - tanh^2)."""
    t = tanh(z / softcap)
    return softcap * t, t


@triton.jit
def _rows_start(target_ptr, offs_m64, mask_m, BLOCK_M: tl.constexpr):
    """The rows' targets and their empty partials (max -inf, sums 0)."""
    target = tl.load(target_ptr + offs_m64, mask=mask_m, other=-1).to(tl.int64)
    zero = tl.zeros((BLOCK_M,), dtype=tl.float32)
    return target, tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32), zero, zero, zero


@triton.jit
def _fold_tile(z, offs_v, mask_v, target, m_i, l_i, z_t, z_sum):
    """One [rows, BLOCK_V] logit tile (-inf past the slice) folded into the rows' running max, sum of exp
    (online softmax), target logit and logit sum."""
    m_new = tl.maximum(m_i, tl.max(z, 1))
    l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
    hit = (offs_v.to(tl.int64)[None, :] == target[:, None]) & mask_v[None, :]  # past the slice: another's id
    z_t += tl.sum(tl.where(hit, z, 0.0), 1)
    z_sum += tl.sum(tl.where(mask_v[None, :], z, 0.0), 1)
    return m_new, l_i, z_t, z_sum


@triton.jit
def _store_partials(part_ptr, split, splits, M, offs_m64, mask_m, m_i, l_i, z_t, z_sum):
    base = part_ptr + split.to(tl.int64) * M + offs_m64
    plane = splits.to(tl.int64) * M
    tl.store(base, m_i, mask=mask_m)
    tl.store(base + plane, l_i, mask=mask_m)
    tl.store(base + 2 * plane, z_t, mask=mask_m)
    tl.store(base + 3 * plane, z_sum, mask=mask_m)


@triton.jit
def _store_rows(loss_ptr, lse_ptr, offs_m64, mask_m, lse, z_t, z_sum, target, V, ignore_index, smoothing):
    """The rows' lse and (label-smoothed) loss stored: 0 where the target is ignore_index, NaN where it is outside
    [0, V)."""
    loss = (1.0 - smoothing) * (lse - z_t) + smoothing * (lse - z_sum / V)
    loss = tl.where((target >= 0) & (target < V), loss, float("nan"))
    loss = tl.where(target == ignore_index, 0.0, loss)
    tl.store(loss_ptr + offs_m64, loss, mask=mask_m)
    tl.store(lse_ptr + offs_m64, lse, mask=mask_m)


@triton.jit(do_not_specialize=["v0", "split", "splits"])  # split == 1 would become a constexpr (no .to)
def lce_chunk_stats_kernel(
    z_ptr,                       # [M, VC] logits of vocabulary chunk ``split`` (bias added), from a GEMM
    target_ptr, part_ptr,        # part: fp32 [4, SPLITS, M], the chunks' partials
    loss_ptr, lse_ptr,           # FINISH: fp32 [M] each, the rows' loss and lse
    M, VC, VC_MEM, V, v0, split, splits, cols, stride_zm, softcap, ignore_index, smoothing,
    HAS_SOFTCAP: tl.constexpr, FINISH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The forward's partials of one materialised vocabulary chunk (the chunked forward: cuBLAS makes the
    chunk's logits, this folds them), columns v0 + j. VC_MEM >= VC: the columns each row has in memory (a padded
    chunk's, rounded to 16), the loads' bound, so an odd VC (GPT-2's vocabulary) still loads 16 bytes at a time;
    the columns past VC are read and never used. FINISH (the chunk is the whole vocabulary, v0 = 0): the rows'
    loss and lse instead of partials, as the launch layer's merge of one split makes them (0 where the target is
    ignore_index, NaN where it is outside [0, V)), so a token chunk of the training form takes one launch here
    instead of a dozen small torch ops. The second grid axis cuts the chunk's columns into slices of ``cols`` (a
    multiple of BLOCK_V), slice i storing partial ``split + i``: a chunk of few rows and many columns (the training
    form's 1024 tokens by 128256) keeps enough programs in flight to cover HBM's latency."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_m64 = offs_m.to(tl.int64)
    target, m_i, l_i, z_t, z_sum = _rows_start(target_ptr, offs_m64, mask_m, BLOCK_M)
    lo = tl.program_id(1) * cols
    for j0 in range(lo, tl.minimum(lo + cols, VC), BLOCK_V):
        offs_j = j0 + tl.arange(0, BLOCK_V)
        mask_v = offs_j < VC
        z = tl.load(z_ptr + offs_m64[:, None] * stride_zm + offs_j[None, :],
                    mask=mask_m[:, None] & (offs_j < VC_MEM)[None, :], other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z, _ = _soft_capped(z, softcap)
        z = tl.where(mask_v[None, :], z, float("-inf"))
        m_i, l_i, z_t, z_sum = _fold_tile(z, v0 + offs_j, mask_v, target, m_i, l_i, z_t, z_sum)
    if FINISH:  # exp(0) = 1; NaN where the max is infinite, as the merge's
        _store_rows(loss_ptr, lse_ptr, offs_m64, mask_m, m_i + tl.log(l_i * tl.exp(m_i - m_i)), z_t, z_sum, target,
                    V, ignore_index, smoothing)
    else:
        _store_partials(part_ptr, split + tl.program_id(1), splits, M, offs_m64, mask_m, m_i, l_i, z_t, z_sum)


@triton.jit(do_not_specialize=["splits"])
def lce_rows_finish_kernel(part_ptr, target_ptr, loss_ptr, lse_ptr, M, V, splits, ignore_index, smoothing,
                           BLOCK_M: tl.constexpr):
    """The rows' loss and lse (fp32 [M] each) from the partials fp32 [4, splits, M] (max, sum of exp, target logit,
    logit sum) lce_chunk_stats_kernel stored, for the chunked forward's vocabulary chunks and the training form's
    column slices alike: 0 where the target is ignore_index, NaN where it is outside [0, V) or the max is infinite."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_m64 = offs_m.to(tl.int64)
    plane = splits.to(tl.int64) * M
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(part_ptr + s * M + offs_m64, mask=mask_m, other=0.0))
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    z_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    z_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for s in range(0, splits):
        base = part_ptr + s * M + offs_m64
        m_s = tl.load(base, mask=mask_m, other=0.0)
        l += tl.load(base + plane, mask=mask_m, other=0.0) * tl.exp(m_s - m)
        z_t += tl.load(base + 2 * plane, mask=mask_m, other=0.0)
        z_sum += tl.load(base + 3 * plane, mask=mask_m, other=0.0)
    target = tl.load(target_ptr + offs_m64, mask=mask_m, other=-1).to(tl.int64)
    _store_rows(loss_ptr, lse_ptr, offs_m64, mask_m, m + tl.log(l), z_t, z_sum, target, V, ignore_index, smoothing)


@triton.jit
def lce_logit_grad_kernel(
    z_ptr,                       # [M, VC] logits of one vocabulary chunk (bias added), overwritten with dz
    target_ptr, lse_ptr, dloss_ptr,  # per row: target (int), lse fp32, dloss fp32 (0 on rows with no gradient)
    M, VC, VC_MEM, V, v0, stride_zm, softcap, smoothing, scale, ignore_index,
    HAS_SOFTCAP: tl.constexpr, UNIT_DLOSS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """scale * dz, dz = dloss * ((1 - eps) * (softmax - onehot) + eps * (softmax - 1/V)) (times 1 - tanh^2 under the
    softcap) for a [BLOCK_M, BLOCK_V] tile of a chunk whose columns are vocabulary entries v0 + j, in place.
    VC_MEM >= VC bounds the loads and stores (lce_chunk_stats_kernel's): the columns past VC get 0. UNIT_DLOSS (the
    training form): dloss is not read, but 1 on every row whose target is in [0, V) and not ignore_index, else 0."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_v < VC_MEM)[None, :]
    offs_m64 = offs_m.to(tl.int64)
    ptrs = z_ptr + offs_m64[:, None] * stride_zm + offs_v[None, :]
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + offs_m64, mask=mask_m, other=0.0)
    target = tl.load(target_ptr + offs_m64, mask=mask_m, other=-1).to(tl.int64)
    if UNIT_DLOSS:
        dloss = tl.where(mask_m & (target != ignore_index) & (target >= 0) & (target < V), 1.0, 0.0)
    else:
        dloss = tl.load(dloss_ptr + offs_m64, mask=mask_m, other=0.0)
    t = z
    if HAS_SOFTCAP:
        z, t = _soft_capped(z, softcap)
    p = tl.exp(z - lse[:, None])
    onehot = tl.where((v0 + offs_v).to(tl.int64)[None, :] == target[:, None], 1.0, 0.0)
    dz = ((1.0 - smoothing) * (p - onehot) + smoothing * (p - 1.0 / V)) * dloss[:, None]
    # Rows with no gradient stay 0 even where p is NaN; so do the columns past VC.
    dz = tl.where((dloss[:, None] != 0.0) & (offs_v < VC)[None, :], dz, 0.0)
    if HAS_SOFTCAP:
        dz = dz * (1.0 - t * t)
    tl.store(ptrs, (dz * scale).to(z_ptr.dtype.element_ty), mask=mask)

"""The LM-head loss, ``cross_entropy(x @ W^T + b, target)`` without the [tokens, vocabulary] logits in HBM at
once: the forward over vocabulary chunks (cuBLAS logits folded by a row pass), the recomputing backward, and the
training form (loss and both gradients over token chunks in one pass)."""
from __future__ import annotations

import torch

from tilefuse.kernels import fastpath, launches
from tilefuse.sizes import cdiv


def linear_cross_entropy(x2d, w, b, target, ignore_index: int, smoothing: float, softcap, path):
    """(loss per row fp32 [M], lse fp32 [M]) of ``cross_entropy(x2d @ w^T + b, target)`` for x2d [M, K] and
    w [V, K] with unit inner strides, target int [M]: 0 on rows whose target is ``ignore_index``, NaN where
    the target is outside [0, V). The vocabulary is cut into chunks (lce_vocab_chunk); their partials (max, sum
    of exp, target logit, logit sum) merge in one kernel (lce_rows_finish_kernel)."""
    from tilefuse.kernels.gemm.cross_entropy import lce_chunk_stats_kernel, lce_rows_finish_kernel

    M = x2d.shape[0]
    V = w.shape[0]
    vc = lce_vocab_chunk(M, V, x2d.element_size())  # cuBLAS makes each chunk's logits; a row pass folds them
    splits = cdiv(V, vc)
    part = torch.empty((4, splits, M), dtype=torch.float32, device=x2d.device)
    tile = LCE_STATS_TILE
    buf = _logits_buffer(M, vc, x2d)
    for i, v0 in enumerate(range(0, V, vc)):
        z = _chunk_logits(x2d, w, b, v0, vc, buf)
        fastpath.launch(lce_chunk_stats_kernel, (cdiv(M, tile["BLOCK_M"]),), (  # loss/lse pointers unread: FINISH off
            z, target, part, part, part, M, z.shape[1], _columns_in_memory(z, buf), V, v0, i, splits,
            cdiv(z.shape[1], tile["BLOCK_V"]) * tile["BLOCK_V"], z.stride(0),  # one slice, 16-divisible as launched
            float(softcap or 0.0), ignore_index, float(smoothing)),
            dict(HAS_SOFTCAP=softcap is not None, FINISH=False, **tile))
    launches.record("linear_cross_entropy", path, f"{splits} vocabulary chunks of {vc}: logits by a GEMM, "
                    "folded by a row pass", lambda: f"{tile['BLOCK_M']}x{tile['BLOCK_V']}")
    loss = torch.empty((M,), dtype=torch.float32, device=x2d.device)
    lse = torch.empty((M,), dtype=torch.float32, device=x2d.device)
    fastpath.launch(lce_rows_finish_kernel, (cdiv(M, LCE_FINISH_ROWS),), (
        part, target, loss, lse, M, V, splits, ignore_index, float(smoothing)), dict(BLOCK_M=LCE_FINISH_ROWS))
    return loss, lse


# The training form's token chunk [rows, V]: every chunk after the first reads and rewrites dW, so fewer, larger
# chunks move fewer bytes; at the Llama-3 head (V 128256, K 4096, bf16) 256 MiB is 1040 rows, 8 chunks per 8192
# tokens, and the chunk, dW and dx together about 1.4 GB beyond the inputs.
LCE_TRAINING_CHUNK_BYTES = 256 * 2**20


def lce_token_chunk(M: int, V: int, element_size: int) -> int:
    """Tokens per chunk of the training form: the chunk's logits [rows, V] within LCE_TRAINING_CHUNK_BYTES, the
    M tokens shared evenly among as few chunks as that allows (no short last chunk: each chunk's GEMMs are one
    wave of tiles or more, and each reads and rewrites dW), a multiple of 16 rows (at least 16, at most M)."""
    most = max(16, LCE_TRAINING_CHUNK_BYTES // max(1, V * element_size) // 16 * 16)
    chunks = cdiv(M, most)
    return max(1, min(M, cdiv(cdiv(M, chunks), 16) * 16))


def linear_cross_entropy_with_grads(x2d, w, b, target, ignore_index: int, smoothing: float, softcap, need_dx, need_dw,
                                    need_db, path):
    """The training form, for losses whose rows all take one gradient (``mean`` and ``sum``): (loss per row fp32 [M],
    lse fp32 [M], dx [M, K] in x's dtype, dW [V, K] in w's, db fp32 [V]; empty where not asked), the gradients
    those of the sum of the rows' losses (every row whose target is in [0, V) and not ``ignore_index`` with
    gradient 1; the backward scales them). One token chunk at a time: its logits over the whole vocabulary by one
    cuBLAS GEMM, folded into the rows' lse (the forward's row pass) and turned into dz in place (the backward's
    gradient kernel), then dx's rows and dW (accumulated over the chunks) by two GEMMs: three GEMMs where the
    forward and the backward apart take four (the backward recomputes the logits). bf16 and fp32: fp16's range
    cannot hold dW summed over the tokens before the loss's scale is applied."""
    from tilefuse.kernels.gemm.cross_entropy import lce_chunk_stats_kernel, lce_logit_grad_kernel, lce_rows_finish_kernel

    M, K = x2d.shape
    V = w.shape[0]
    dev = x2d.device
    rows = lce_token_chunk(M, V, x2d.element_size())
    loss = torch.empty((M,), dtype=torch.float32, device=dev)
    lse = torch.empty((M,), dtype=torch.float32, device=dev)
    dx = torch.empty((M, K) if need_dx else (0,), dtype=x2d.dtype, device=dev)
    dw = torch.empty((V, K) if need_dw else (0,), dtype=w.dtype, device=dev)
    db = torch.zeros((V,) if need_db else (0,), dtype=torch.float32, device=dev)
    stats, grad = LCE_STATS_TILE, LCE_GRAD_TILE
    buf = _logits_buffer(rows, V, x2d)
    cols, slices = lce_stats_slices(rows, V, stats)
    part = torch.empty((4 * slices * rows,) if slices > 1 else (0,), dtype=torch.float32, device=dev)
    for m0 in range(0, M, rows):
        x_c, t_c = x2d[m0:m0 + rows], target[m0:m0 + rows]
        m = x_c.shape[0]
        z = _chunk_logits(x_c, w, b, 0, V, buf)
        in_memory = _columns_in_memory(z, buf)
        fastpath.launch(lce_chunk_stats_kernel, (cdiv(m, stats["BLOCK_M"]), slices), (  # one slice: FINISH, part unread
            z, t_c, part if slices > 1 else lse, loss[m0:], lse[m0:], m, V, in_memory, V, 0, 0, slices, cols,
            z.stride(0), float(softcap or 0.0), ignore_index, float(smoothing)),
            dict(HAS_SOFTCAP=softcap is not None, FINISH=slices == 1, **stats))
        if slices > 1:
            fastpath.launch(lce_rows_finish_kernel, (cdiv(m, LCE_FINISH_ROWS),), (
                part, t_c, loss[m0:], lse[m0:], m, V, slices, ignore_index, float(smoothing)),
                dict(BLOCK_M=LCE_FINISH_ROWS))
        fastpath.launch(lce_logit_grad_kernel, (cdiv(m, grad["BLOCK_M"]), cdiv(V, grad["BLOCK_V"])), (
            z, t_c, lse[m0:m0 + m], lse, m, V, in_memory, V, 0, z.stride(0), float(softcap or 0.0), float(smoothing),
            1.0, ignore_index),  # each kept row's gradient 1, from its target (UNIT_DLOSS: the dloss pointer unread)
            dict(HAS_SOFTCAP=softcap is not None, UNIT_DLOSS=True, **grad))
        if need_dx:
            _logit_rows_product(z, w, dx[m0:m0 + m], buf is not None)
        if need_dw:  # beta 0 on the first chunk: dW's uninitialised memory is not read
            dw.addmm_(z.t(), x_c, beta=0.0 if m0 == 0 else 1.0)
        if need_db:
            db += z.sum(0, dtype=torch.float32)
    launches.record("linear_cross_entropy", path, f"training form: {cdiv(M, rows)} token chunks of {rows}: logits by "
                    f"a GEMM, folded in {slices} column slices of {cols}, dz in place, dx and dW GEMMs", lambda: f"{stats['BLOCK_M']}x{stats['BLOCK_V']}, "
                    f"{grad['BLOCK_M']}x{grad['BLOCK_V']}")
    return loss, lse, dx, dw, db


LCE_CHUNK_BYTES = 128 * 2**20  # the one [T, VC] logits chunk of the backward (and of the chunked forward)
LCE_GRAD_TILE = dict(BLOCK_M=32, BLOCK_V=128)
LCE_FP16_SCALE = 2.0 ** 12  # fp16 dz chunk: |dz'| <= 4096, and softmax values down to 1.5e-8 stay normal
LCE_STATS_PROGRAMS = 1024  # the training form's stats pass: row blocks x column slices at least this many programs
LCE_FINISH_ROWS = 128      # rows per program of the partials' merge
LCE_STATS_SLICE_TILES = 16  # the fewest BLOCK_V tiles a column slice walks


def lce_stats_slices(rows: int, V: int, tile: dict) -> tuple[int, int]:
    """(columns per slice, slices) for the stats pass over a [rows, V] chunk: enough slices that row blocks times
    slices reach LCE_STATS_PROGRAMS (a 1024-token chunk has 128 row blocks of 8), each slice a multiple of BLOCK_V
    and at least LCE_STATS_SLICE_TILES tiles long; one slice where the rows alone are enough."""
    blocks = cdiv(rows, tile["BLOCK_M"])
    want = max(1, min(cdiv(LCE_STATS_PROGRAMS, blocks), cdiv(V, LCE_STATS_SLICE_TILES * tile["BLOCK_V"])))
    cols = cdiv(cdiv(V, want), tile["BLOCK_V"]) * tile["BLOCK_V"]
    return cols, cdiv(V, cols)


LCE_STATS_TILE = dict(BLOCK_M=8, BLOCK_V=256)  # the chunked forward's row pass: 80 registers on sm_90a, no spills


# Row pitch of a logits chunk on CUDA, in elements: 128 bytes in bf16. cuBLAS's tensor-core GEMMs need every row of
# an operand to start 16-byte aligned; a dense [rows, V] chunk at GPT-2's V of 50257 has rows 100514 bytes apart,
# and the three GEMMs that write and read it then run kernels several times slower. On a CPU each chunk is a dense
# tensor of its own: torch's CPU bf16 matmul reads a padded operand's padding (NaN there comes out in the product).
LOGITS_PITCH = 64


def _logits_buffer(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor | None:
    """On CUDA, storage for [<= rows, <= cols] logits chunks in ``like``'s dtype with rows LOGITS_PITCH-padded
    apart, made once per call and rewritten by every chunk (stream order keeps each chunk's readers before the
    next GEMM); None on a CPU."""
    if not like.is_cuda:
        return None
    return torch.empty((rows, cdiv(cols, LOGITS_PITCH) * LOGITS_PITCH), dtype=like.dtype, device=like.device)


def _chunk_logits(x2d, w, b, v0: int, vc: int, buf: torch.Tensor | None) -> torch.Tensor:
    """x2d @ W[v0:v0 + vc]^T (+ b's chunk) by cuBLAS: one vocabulary chunk's logits [M, <= vc] in x's dtype, in
    ``buf`` (:func:`_logits_buffer`, a view whose rows are its pitch apart) when there is one. There the columns
    come from two GEMMs, a multiple of 8 of them and the up to 7 left (:func:`_aligned_part`)."""
    w_c = w[v0:v0 + vc]
    if buf is None:
        return torch.mm(x2d, w_c.t()) if b is None else torch.addmm(b[v0:v0 + vc], x2d, w_c.t())
    n = w_c.shape[0]
    z = buf[:x2d.shape[0], :n]
    for c0, c1 in _aligned_part(n):
        out = z[:, c0:c1]
        if b is None:
            torch.mm(x2d, w_c[c0:c1].t(), out=out)
        else:
            torch.addmm(b[v0 + c0:v0 + c1], x2d, w_c[c0:c1].t(), out=out)
    return z


def _columns_in_memory(z: torch.Tensor, buf: torch.Tensor | None) -> int:
    """The columns the row kernels may read and write in each row of a logits chunk: its own where it is dense;
    in a padded buffer (every row of it ``stride(0)`` elements long) its columns rounded up to 16 within the
    pitch, so the loads' bound is a multiple of 16 and an odd vocabulary (GPT-2's 50257) still loads 16 bytes at a
    time (Triton vectorizes a masked access only where the bound's 16-divisibility is known)."""
    n = z.shape[1]
    return n if buf is None else min(z.stride(0), cdiv(n, 16) * 16)


def _aligned_part(n: int) -> tuple[tuple[int, int], ...]:
    """The column ranges a padded chunk of ``n`` logits is made and read in: [0, n8) and [n8, n), n8 the largest
    multiple of 8 (one range where n is one already, or below 8). cuBLAS picks its tensor-core kernels by the
    problem's dimensions as well as the rows' alignment: an odd V (GPT-2's 50257) as the logits' columns, or as
    the inner dimension of dz @ W, sends the whole GEMM to a kernel with one-element accesses, several times
    slower (the Hopper profile in benchmarks/NOTES.md); the up to 7 columns left cost a skinny GEMM."""
    n8 = n - n % 8
    return ((0, n),) if n8 in (0, n) else ((0, n8), (n8, n))


def _logit_rows_product(z: torch.Tensor, w_c: torch.Tensor, out: torch.Tensor | None, padded: bool,
                        alpha: float = 1.0) -> torch.Tensor:
    """alpha * z @ w_c for a logits chunk z [M, n] and its rows of W [n, K] (alpha inside the GEMMs, before
    their fp32 sums are rounded to z's dtype): a new tensor, or into ``out`` (alpha 1 there). A padded chunk's
    inner dimension is cut as its columns were made (:func:`_aligned_part`), the second product accumulated onto
    the first."""
    parts = _aligned_part(z.shape[1]) if padded else ((0, z.shape[1]),)
    (c0, c1), rest = parts[0], parts[1:]
    if out is None:
        y = torch.addmm(z.new_zeros(()), z[:, c0:c1], w_c[c0:c1], beta=0, alpha=alpha)
    else:
        assert alpha == 1.0, "alpha is applied only to a new tensor"
        y = torch.mm(z[:, c0:c1], w_c[c0:c1], out=out)
    for c0, c1 in rest:
        y.addmm_(z[:, c0:c1], w_c[c0:c1], alpha=alpha)
    return y


def lce_vocab_chunk(M: int, V: int, element_size: int) -> int:
    """Vocabulary entries per backward chunk: the chunk [M, VC] within LCE_CHUNK_BYTES, a multiple of 128."""
    vc = LCE_CHUNK_BYTES // max(1, M * element_size)
    return max(128, min(V, vc // 128 * 128 or 128))


def linear_cross_entropy_backward(dloss, x2d, w, b, target, lse, smoothing: float, softcap, need_dx, need_dw,
                                  need_db, path):
    """(dx [M, K] in x's dtype, dW [V, K] in w's, db [V] in b's; empty where not asked) from dloss fp32 [M]
    (0 on rows that get no gradient), one vocabulary chunk at a time: the chunk's logits recomputed by a GEMM,
    made into dz in place (cross_entropy.py), then dW's rows of the chunk (one GEMM over all tokens) and dx
    (accumulated in fp32 over the chunks). No atomics: deterministic."""
    from tilefuse.kernels.gemm.cross_entropy import lce_logit_grad_kernel

    M, K = x2d.shape
    V = w.shape[0]
    vc = lce_vocab_chunk(M, V, x2d.element_size())
    tile = LCE_GRAD_TILE
    # fp16's exponent range: dloss * (softmax - onehot) is ~ 1 / (tokens * V) under "mean" and would be stored
    # as a subnormal (a bit or two of precision). In fp16 the chunk holds dz / c * LCE_FP16_SCALE instead, c the
    # largest |dloss| (a device scalar: no host synchronisation), and the GEMMs undo the scale in fp32.
    scaled = x2d.dtype == torch.float16
    if scaled:
        c = dloss.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
        dloss = dloss / c
    dx = torch.zeros((M, K) if need_dx else (0,), dtype=torch.float32, device=x2d.device)
    dw = torch.empty((V, K) if need_dw else (0,), dtype=w.dtype, device=x2d.device)
    db = torch.empty((V,) if need_db else (0,), dtype=torch.float32, device=x2d.device)
    alpha = 1.0 / LCE_FP16_SCALE if scaled else 1.0  # a power of two: exact
    buf = _logits_buffer(M, vc, x2d)
    for v0 in range(0, V, vc):
        w_c = w[v0:v0 + vc]
        z = _chunk_logits(x2d, w, b, v0, vc, buf)
        n = z.shape[1]
        fastpath.launch(lce_logit_grad_kernel, (cdiv(M, tile["BLOCK_M"]), cdiv(n, tile["BLOCK_V"])), (
            z, target, lse, dloss, M, n, _columns_in_memory(z, buf), V, v0, z.stride(0), float(softcap or 0.0),
            float(smoothing), LCE_FP16_SCALE if scaled else 1.0, -1),
            dict(HAS_SOFTCAP=softcap is not None, UNIT_DLOSS=False, **tile))
        if need_dw:  # fp16: dW rows = c * (dz'^T x) / scale (dz'^T x / scale, i.e. dW / c, must fit fp16)
            dw_c = dw[v0:v0 + n]
            torch.addmm(dw_c, z.t(), x2d, beta=0, alpha=alpha, out=dw_c)
            if scaled:
                dw_c.mul_(c)
        if need_dx:
            if scaled:
                dx.addcmul_(_logit_rows_product(z, w_c, None, buf is not None, alpha), c)
            else:
                dx += _logit_rows_product(z, w_c, None, buf is not None)
        if need_db:
            db[v0:v0 + n] = z.sum(0, dtype=torch.float32) * (c * alpha if scaled else 1.0)
    launches.record("linear_cross_entropy_backward", path, f"{cdiv(V, vc)} vocabulary chunks of {vc}: logits "
                    "recomputed (GEMM), dz in place, dW and dx GEMMs", lambda: f"{tile['BLOCK_M']}x{tile['BLOCK_V']}")
    return (dx.to(x2d.dtype) if need_dx else dx, dw,
            db.to(b.dtype) if need_db and b is not None else db)

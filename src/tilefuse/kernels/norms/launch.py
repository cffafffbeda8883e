"""The norms family's launch layer: config spaces, the tuner, and the launches (grid, config, single
pass or chunked rows) for LayerNorm / RMSNorm forward and backward, and the statistics pre-pass that
layer_norm_linear's portable form uses. Inputs arrive as [M, N] row views with unit column stride,
checked and non-empty (tilefuse.ops)."""
from __future__ import annotations

import torch
import triton

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches
from tilefuse.kernels.norms.kernels import (norm_bwd_chunk_sums_kernel, norm_bwd_dx_kernel, norm_bwd_kernel,
                                            norm_fwd_kernel)
from tilefuse.sizes import cdiv, next_pow2

# Chunk caps. On the GPU a 16K-element chunk keeps <= 32 fp32 values per thread at 16 warps; under the
# interpreter the cap is tiny so that a 300-long test row already takes the chunked path.
GPU_MAX_BLOCK_N = 16384
INTERPRETER_MAX_BLOCK_N = 128
INTERPRETER_TILE_ELEMS = 2048  # rows per interpreter program: big tiles, the interpreter pays per program

def _num_sms(device) -> int:
    return runtime.device_facts(device)[1]


def _warps_for(tile_elems: int) -> int:
    # ~16 fp32 values per thread per live tensor, between 4 and 16 warps.
    return max(4, min(16, tile_elems // 512))


# Chunked-row variants (BLOCK_N, warps, PROGRAMS_PER_SM, LOOP_STAGES): one row per program without
# pipelining first, then pipelined ones; few enough that tuning one shape stays under ~20 s of compiles.
FWD_CHUNKED = [(16384, 8, 1, 1), (16384, 16, 1, 2), (16384, 16, 2, 2), (16384, 8, 2, 2),
               (8192, 8, 2, 3), (8192, 16, 2, 3), (8192, 8, 4, 3), (4096, 8, 4, 3), (4096, 4, 4, 3)]


def _fwd_configs():
    """Single pass (BLOCK_N = next_pow2(N) <= 16384, whole rows in registers) and chunked (two passes,
    the second re-reading the row from L2). Rows of >= 8K elements may take either: the autotuner
    measures. Persistent pipelined variants (PROGRAMS_PER_SM 1-2, LOOP_STAGES > 1) keep more bytes in
    flight per SM: a 16K-element row tile needs ~107 registers at 16 warps, so one block fits per SM
    and its loads stall while it reduces (4096x16384 bf16 reaches only ~56% of copy that way on the
    H200). Within each family the first entry is the unpipelined one, the pinned choice."""
    single = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=1 << i, SINGLE_PASS=True, PROGRAMS_PER_SM=p,
                                 LOOP_STAGES=st), num_warps=w)
              for i in range(15) for bm in (1, 2, 4, 8, 16) for w in (4, 8, 16)
              for p, st in ((64, 1), (1, 3), (2, 2))]
    chunked = [triton.Config(dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, PROGRAMS_PER_SM=p,
                                  LOOP_STAGES=st), num_warps=w)
               for bn, w, p, st in FWD_CHUNKED]
    return single + chunked


def fwd_smem_bytes(cfg: triton.Config, elem_bytes: int, residual: bool, weight: bool, bias: bool) -> int:
    """Upper bound on the pipelining buffers: LOOP_STAGES - 1 copies of every tile loaded inside the
    pipelined loop -- x, the residual, and the weight and bias rows too (loop-invariant in the single
    pass, yet the pipeliner buffers them: 4096x16384 bf16 with a residual and 3 stages compiled to 256 KB
    for sm_90a). The chunked path counts both of its loops."""
    k = cfg.kwargs
    rows = k["BLOCK_M"] * (2 if residual else 1)
    loads = rows + int(weight) + int(bias)
    if not k["SINGLE_PASS"]:
        loads += 1  # pass 2 re-reads x (or h)
    return (k["LOOP_STAGES"] - 1) * k["BLOCK_N"] * elem_bytes * loads


FWD_SMEM_BUDGET = 220 * 1024  # of the 227 KB a block may use; the rest for the reductions' scratch


def _prune_fwd(configs, named_args, **kwargs):
    """Keep a handful per shape: single-pass tiles of 2K-16K elements, warps near the tile's need, the
    persistent pipelined grid only for rows of >= 4K elements; chunked rows (BLOCK_M = 1, persistent
    so that the second pass finds the row in L2) when the row is longer than one chunk."""
    n, m = named_args["N"], named_args["M"]
    x = named_args.get("x_ptr")
    elem = x.element_size() if hasattr(x, "element_size") else 2
    residual, weight, bias = (bool(kwargs.get(f)) for f in ("HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS"))
    full = next_pow2(max(n, 1))
    keep = []
    for c in configs:
        bm, bn, w, p = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["PROGRAMS_PER_SM"]
        tile = bm * bn
        if c.kwargs["SINGLE_PASS"]:
            if bn != full or full > GPU_MAX_BLOCK_N:
                continue
            if tile > 16384 or (tile < 2048 and bm < 16) or bm > max(1, m):
                continue
            if p != 64 and (tile < 8192 or bm != 1):  # pipelined persistent grid: long rows only
                continue
            if w not in (_warps_for(tile), max(4, _warps_for(tile) // 2)):
                continue
        elif bn >= full or full < 8192:
            continue
        if fwd_smem_bytes(c, elem, residual, weight, bias) > FWD_SMEM_BUDGET:
            continue
        keep.append(c)
    if keep:
        return keep
    bn = min(full, GPU_MAX_BLOCK_N)
    return [triton.Config(dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=full <= GPU_MAX_BLOCK_N, PROGRAMS_PER_SM=64
                               if full <= GPU_MAX_BLOCK_N else 2, LOOP_STAGES=1), num_warps=_warps_for(bn))]


norm_fwd_tuned = tuning.autotune(
    name="norm_fwd",
    configs=_fwd_configs(),
    key=["N", "M_BUCKET", "IS_RMS", "HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS", "STORE_Y"],
    prune_configs_by={"early_config_prune": _prune_fwd},
)(norm_fwd_kernel)


def block_n_for(N: int, interpret: bool) -> int:
    cap = INTERPRETER_MAX_BLOCK_N if interpret else GPU_MAX_BLOCK_N
    return min(next_pow2(max(N, 1)), cap)


def _launch_forward(x2d, res2d, weight, bias, y2d, h2d, mean, rstd, eps, is_rms, store_y, interpret):
    """x2d etc. are [M, N] views with unit column stride. Returns the config used (for the report)."""
    M, N = x2d.shape
    block_n = block_n_for(N, interpret)
    dummy = mean  # never dereferenced when the matching HAS_* flag is False
    args = (x2d, res2d if res2d is not None else dummy, weight if weight is not None else dummy,
            bias if bias is not None else dummy, y2d if y2d is not None else dummy,
            h2d if h2d is not None else dummy, mean, rstd, M, N,
            x2d.stride(0), res2d.stride(0) if res2d is not None else 0,
            y2d.stride(0) if y2d is not None else 0, h2d.stride(0) if h2d is not None else 0,
            float(eps), sizes.m_bucket(M))
    flags = dict(IS_RMS=is_rms, HAS_RESIDUAL=res2d is not None, HAS_WEIGHT=weight is not None,
                 HAS_BIAS=bias is not None, STORE_Y=store_y)
    if interpret:
        block_m = max(1, min(16, INTERPRETER_TILE_ELEMS // block_n))
        grid = (cdiv(M, block_m),)
        fastpath.launch(norm_fwd_kernel, grid, args, dict(flags, SINGLE_PASS=N <= block_n, BLOCK_N=block_n,
                                                          BLOCK_M=block_m, PROGRAMS_PER_SM=64, LOOP_STAGES=1))
        return dict(BLOCK_M=block_m, BLOCK_N=block_n)
    sms = _num_sms(x2d.device)

    def grid(meta):
        return (min(cdiv(M, meta["BLOCK_M"]), sms * meta["PROGRAMS_PER_SM"]),)

    fastpath.launch(norm_fwd_tuned, grid, args, flags)
    cfg = norm_fwd_tuned.launched_config()
    return dict(BLOCK_M=cfg.kwargs["BLOCK_M"], BLOCK_N=cfg.kwargs["BLOCK_N"], warps=cfg.num_warps,
                progs_per_sm=cfg.kwargs["PROGRAMS_PER_SM"], single_pass=cfg.kwargs["SINGLE_PASS"],
                loop_stages=cfg.kwargs["LOOP_STAGES"])


def _launch_backward(dy2d, h2d, weight, mean, rstd, dh2d, dx2d, is_rms, compute_dw, compute_db, interpret):
    """dx is written into dx2d. Returns the fp32 per-program partial column sums, [2 | 1, programs, N]
    (dweight then dbias, those asked for; one allocation for both) or None; summing them over programs
    in a fixed order gives deterministic dweight / dbias."""
    M, N = h2d.shape
    block_n = block_n_for(N, interpret)
    dummy = rstd
    flags = dict(IS_RMS=is_rms, HAS_WEIGHT=weight is not None)
    w_arg = weight if weight is not None else dummy
    mean_arg = mean if mean is not None else dummy
    dev = h2d.device
    if N <= block_n:
        if interpret:
            block_m = max(1, min(16, INTERPRETER_TILE_ELEMS // block_n))
            warps, programs = 4, cdiv(M, block_m)
        else:
            block_m = max(1, min(16, 4096 // block_n))
            warps = _warps_for(block_m * block_n)
            # Enough programs to fill the machine, few enough that the fp32 partial rows (G x N) stay
            # small next to the M x N tensors.
            programs = min(cdiv(M, block_m), _num_sms(dev) * max(1, 32 // warps))
        programs = max(programs, 1)
        parts, dw_part, db_part = _partial_rows(programs, N, compute_dw, compute_db, dev, dummy)
        fastpath.launch(norm_bwd_kernel, (programs,), (
            dy2d, h2d, w_arg, mean_arg, rstd, dh2d if dh2d is not None else dummy, dx2d, dw_part, db_part,
            M, N, dy2d.stride(0), h2d.stride(0), dh2d.stride(0) if dh2d is not None else 0, dx2d.stride(0)),
            dict(flags, HAS_DH=dh2d is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
                 BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
    else:
        num_chunks = cdiv(N, block_n)
        # GPU: one row per tile, a chunk is already 16K elements. Interpreter: many rows per program.
        block_m = max(1, INTERPRETER_TILE_ELEMS // block_n) if interpret else 1
        warps = 4 if interpret else _warps_for(block_n)
        row_tiles = cdiv(M, block_m)
        if interpret:
            groups = min(row_tiles, 2)
        else:
            groups = min(row_tiles, max(1, cdiv(4 * _num_sms(dev), num_chunks)))
        dots = torch.empty((M, num_chunks, 2), dtype=torch.float32, device=dev)
        parts, dw_part, db_part = _partial_rows(groups, N, compute_dw, compute_db, dev, dummy)
        fastpath.launch(norm_bwd_chunk_sums_kernel, (groups, num_chunks), (
            dy2d, h2d, w_arg, mean_arg, rstd, dots, dw_part, db_part, M, N, num_chunks,
            dy2d.stride(0), h2d.stride(0)),
            dict(flags, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, BLOCK_M=block_m, BLOCK_N=block_n,
                 num_warps=warps))
        fastpath.launch(norm_bwd_dx_kernel, (row_tiles, num_chunks), (
            dy2d, h2d, w_arg, mean_arg, rstd, dots, dh2d if dh2d is not None else dummy, dx2d,
            M, N, num_chunks, dy2d.stride(0), h2d.stride(0),
            dh2d.stride(0) if dh2d is not None else 0, dx2d.stride(0)),
            dict(flags, HAS_DH=dh2d is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_C=next_pow2(num_chunks), num_warps=warps))
    return parts


def _partial_rows(rows, N, compute_dw, compute_db, dev, dummy):
    """(parts [n, rows, N] fp32 or None, dweight partial rows, dbias partial rows): one allocation; a
    partial not asked for is ``dummy`` (never written)."""
    n = int(compute_dw) + int(compute_db)
    if n == 0:
        return None, dummy, dummy
    parts = torch.empty((n, rows, N), dtype=torch.float32, device=dev)
    if n == 2:
        dw_part, db_part = parts.unbind(0)
        return parts, dw_part, db_part
    one = parts.view(rows, N)
    return parts, (one if compute_dw else dummy), (one if compute_db else dummy)


# ---- entries ---------------------------------------------------------------------------------------
_FORWARD = fastpath.Plans("norm_forward")
_BACKWARD = fastpath.Plans("norm_backward")


def _describe(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def forward(x2d, res2d, weight, bias, eps: float, is_rms: bool, path):
    """y = norm(x [+ residual]) * weight + bias over rows [M, N] (M, N > 0). Returns (y, stats) or, with a
    residual, (y, h, stats): y and h contiguous [M, N], stats fp32 [2, M] (mean, rstd). Runs tilefuse's
    kernel or torch's (see :data:`FORWARD_CHOICE`)."""
    mode = runtime.backend()
    return _FORWARD.run((x2d, res2d, weight, bias), (eps, is_rms, mode),
                        lambda: _forward_chosen(x2d, res2d, weight, bias, eps, is_rms, path, mode))


def _forward_chosen(x2d, res2d, weight, bias, eps, is_rms, path, mode):
    def run(candidate):
        if candidate == TORCH:
            return fastpath.vendor(_forward_torch, x2d, res2d, weight, bias, eps, is_rms, path)
        return _forward(x2d, res2d, weight, bias, eps, is_rms, path)

    available = (tuning.TILEFUSE, TORCH) if _torch_takes(x2d, weight, bias, is_rms=is_rms) else (tuning.TILEFUSE,)
    return fastpath.run_chosen(FORWARD_CHOICE, mode, available, lambda: _choice_key(x2d, res2d, weight, bias, is_rms),
                               x2d.device, run)


def _forward(x2d, res2d, weight, bias, eps, is_rms, path):
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    h = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device) if res2d is not None else None
    stats = torch.empty((2, M), dtype=torch.float32, device=x2d.device)
    cfg = _launch_forward(x2d, res2d, weight, bias, y, h, stats[0], stats[1], eps, is_rms, store_y=True,
                          interpret=path == runtime.INTERPRETER)
    launches.record("rms_norm" if is_rms else "layer_norm", path, "", lambda: _describe(cfg))
    return (y, stats) if h is None else (y, h, stats)


def norm_statistics(x2d, eps: float, is_rms: bool, interpret: bool):
    """The rows' statistics of x2d as one fp32 [2, M] tensor, mean then rstd (``mean, rstd = stats``; the
    mean row is left unwritten for rms): the pre-pass of layer_norm_linear's forms."""
    M = x2d.shape[0]
    stats = torch.empty((2, M), dtype=torch.float32, device=x2d.device)
    _launch_forward(x2d, None, None, None, None, None, stats[0], stats[1], eps, is_rms, store_y=False,
                    interpret=interpret)
    return stats


def backward(dy2d, h2d, weight, stats, dh2d, is_rms: bool, compute_dw: bool, compute_db: bool, path):
    """dx [M, N] (h2d's dtype) and the fp32 partial column sums [2 | 1, programs, N] (dweight then dbias,
    those asked for; an empty tensor when neither is): their sum over dim 1 gives the gradients. h2d: the
    normalized rows (x, or h = x + residual); stats from :func:`forward`."""
    mode = runtime.backend()
    return _BACKWARD.run((dy2d, h2d, weight, stats, dh2d), (is_rms, compute_dw, compute_db, mode),
                         lambda: _backward_chosen(dy2d, h2d, weight, stats, dh2d, is_rms, compute_dw, compute_db,
                                                  path, mode))


def _backward_chosen(dy2d, h2d, weight, stats, dh2d, is_rms, compute_dw, compute_db, path, mode):
    def run(candidate):
        if candidate == TORCH:
            return fastpath.vendor(_backward_torch, dy2d, h2d, weight, stats, dh2d, is_rms, compute_dw, compute_db,
                                   path)
        return _backward(dy2d, h2d, weight, stats, dh2d, is_rms, compute_dw, compute_db, path)

    # aten's fused RMSNorm backward has CUDA kernels only.
    vendor = _torch_takes(h2d, weight, dy2d, is_rms=is_rms) and (h2d.is_cuda or not is_rms)
    available = (tuning.TILEFUSE, TORCH) if vendor else (tuning.TILEFUSE,)
    return fastpath.run_chosen(BACKWARD_CHOICE, mode, available,
                               lambda: _choice_key(h2d, dh2d, weight, None, is_rms, COMPUTE_DW=compute_dw,
                                                   COMPUTE_DB=compute_db), h2d.device, run)


def _backward(dy2d, h2d, weight, stats, dh2d, is_rms, compute_dw, compute_db, path):
    M, N = h2d.shape
    dx = torch.empty((M, N), dtype=h2d.dtype, device=h2d.device)
    parts = _launch_backward(dy2d, h2d, weight, None if is_rms else stats[0], stats[1], dh2d, dx, is_rms,
                             compute_dw, compute_db, path == runtime.INTERPRETER)
    launches.record("rms_norm_backward" if is_rms else "layer_norm_backward", path, "", "fixed tiles")
    if parts is None:
        parts = torch.empty((0,), dtype=torch.float32, device=h2d.device)
    return dx, parts


# ---- torch's kernels, the vendor candidate -----------------------------------------------------------
# Same outputs and layouts as tilefuse's: y (and h) contiguous [M, N], stats fp32 [2, M]; the backward's
# dweight / dbias as fp32 [n, 1, N] "partial rows" (one program's). Taken only when the norm parameters have
# x's dtype: torch's kernels differ from each other in how they treat mixed ones.
TORCH = "torch"
FORWARD_CHOICE = tuning.BackendChoice("norm_forward_backend", (tuning.TILEFUSE, TORCH))
BACKWARD_CHOICE = tuning.BackendChoice("norm_backward_backend", (tuning.TILEFUSE, TORCH))


def _torch_takes(x2d, *others, is_rms: bool) -> bool:
    """Whether torch's kernel is a candidate: the parameters in x's dtype, and for LayerNorm off CUDA only fp32
    rows (torch's CPU LayerNorm keeps its mean and rstd in x's dtype, 16-bit ones too: too coarse for the
    statistics the backward reads)."""
    if not (is_rms or x2d.is_cuda or x2d.dtype == torch.float32):
        return False
    return all(t is None or t.dtype == x2d.dtype for t in others)


def _choice_key(x2d, res2d, weight, bias, is_rms, **extra) -> tuple:
    """What the choice between tilefuse's and torch's norm depends on, as a ``tuning.ChoiceKey``."""
    M, N = x2d.shape
    return tuning.ChoiceKey(N=N, M_BUCKET=sizes.m_bucket(M), IS_RMS=is_rms, HAS_RESIDUAL=res2d is not None,
                            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **extra, dtype=x2d.dtype)


def _flat(t, N):
    """A norm parameter as the [N] vector torch's kernels take over [M, N] rows (it may be shaped like a
    multi-dimensional normalized_shape)."""
    return None if t is None else t.reshape(N)


def _forward_torch(x2d, res2d, weight, bias, eps, is_rms, path):
    M, N = x2d.shape
    weight, bias = _flat(weight, N), _flat(bias, N)
    h = x2d if res2d is None else x2d + res2d
    stats = torch.empty((2, M), dtype=torch.float32, device=x2d.device)
    if is_rms:
        y, rstd = torch.ops.aten._fused_rms_norm(h, [N], weight, eps)
    else:
        y, mean, rstd = torch.native_layer_norm(h, [N], weight, bias, eps)
        stats[0].copy_(mean.view(M))
    stats[1].copy_(rstd.view(M))
    launches.record("rms_norm" if is_rms else "layer_norm", path, TORCH,
                    "aten._fused_rms_norm" if is_rms else "aten.native_layer_norm")
    y = y.contiguous()
    return (y, stats) if res2d is None else (y, h, stats)


def _backward_torch(dy2d, h2d, weight, stats, dh2d, is_rms, compute_dw, compute_db, path):
    M, N = h2d.shape
    weight = _flat(weight, N)
    rstd = stats[1].view(M, 1)
    if is_rms:
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy2d, h2d, [N], rstd, weight, [True, compute_dw])
        grads = [dw] if compute_dw else []
    else:
        # aten sizes dbias by the bias it is given and never reads it: weight (same shape and dtype) stands in,
        # so dbias comes out of the same kernel instead of a second pass over dy.
        fused_db = compute_db and weight is not None
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy2d, h2d, [N], stats[0].view(M, 1), rstd, weight,
                                                               weight if fused_db else None,
                                                               [True, compute_dw, fused_db])
        if compute_db and not fused_db:
            db = dy2d.sum(dim=0, dtype=torch.float32)
        grads = ([dw] if compute_dw else []) + ([db] if compute_db else [])
    if dh2d is not None:
        dx = dx + dh2d
    launches.record("rms_norm_backward" if is_rms else "layer_norm_backward", path, TORCH,
                    "aten._fused_rms_norm_backward" if is_rms else "aten.native_layer_norm_backward")
    parts = (torch.stack([g.float() for g in grads]).view(len(grads), 1, N) if grads
             else torch.empty((0,), dtype=torch.float32, device=h2d.device))
    return dx.contiguous(), parts


"""The linear backward (plain and gated): dx and dW (+ db) from dy and the slope(s) the training forward saved,
g = dy * slope made in the GEMMs' operand loads (backward.py's kernels): the cooperative Gluon GEMM on sm_90 where
it measured faster, Hopper's TMA dW kernel, the tuned pointer kernels otherwise; or its vendor candidate (one
elementwise pass for g, then cuBLAS)."""
from __future__ import annotations

import math

import torch

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches, switches
from tilefuse.kernels.gemm import configs, coop
from tilefuse.kernels.gemm.backward import grad_input_kernel, grad_weight_kernel, grad_weight_tma_kernel
from tilefuse.kernels.gemm.gate import gated_grad_kernel
from tilefuse.kernels.gemm.launch.rules import (CUBLAS, coop_backward, coop_gated_dx, hopper_tma, pass_grid,
                                                row_addressing)
from tilefuse.runtime import precision_for
from tilefuse.sizes import cdiv

# The backward GEMMs: keyed like the forward (the reduction of grad_weight runs over M, hence M_BUCKET).
grad_input_tuned = tuning.autotune(
    name="linear_grad_input",
    configs=configs.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_SLOPE", "GATED", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": configs.prune_backward_configs},
)(grad_input_kernel)


grad_weight_tuned = tuning.autotune(
    name="linear_grad_weight",
    configs=configs.PORTABLE_GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "HAS_SLOPE", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": configs.prune_backward_configs},
)(grad_weight_kernel)


_LINEAR_BACKWARD = fastpath.Plans("linear_backward")


def linear_backward(dy, x, w, w_up, slope, slope_up, need_dx, need_dw, need_db, path):
    """Gradients of ``act(x @ w^T + b)`` (gated: of ``act(x @ w^T + b) * (x @ w_up^T + b_up)``) from dy
    [..., N] (any strides) and the slope(s) the training forward saved, [..., N] in y's layout (None
    without an activation; gated: s_gate and s_up). Returns (dx, dw, db) -- gated (dx, dw, dw_up, db,
    db_up) -- each in x's dtype: dx contiguous in x's shape, each dW in its weight's own layout when that
    is dense, db [N]; an output not asked for is an empty tensor (db needs the dW kernel, so need_db also
    returns dW)."""
    precision = precision_for(x.dtype, x.is_cuda)
    # Without an activation (never gated: a gate always saves its slopes) g is dy itself, already in HBM, and db
    # its column sum: one read of dy, eager's own db, made here as a torch reduction outside the fast path's plan
    # (whose outputs must all come from its kernels). The dW kernel does not sum db from a loaded dy tile: one
    # tile feeding both the dot and the elementwise sum compiles wrong on sm_90 with triton 3.6 (NOTES.md).
    db_by_sum = need_db and slope is None
    in_plan_db = need_db and not db_by_sum
    mode = runtime.backend()
    grads = _LINEAR_BACKWARD.run(
        (dy, x, w, w_up, slope, slope_up), (precision, need_dx, need_dw, in_plan_db, mode),
        lambda: _linear_backward_chosen(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, in_plan_db,
                                        path, mode))
    if db_by_sum:
        db = dy.reshape(-1, w.shape[0]).sum(0, dtype=torch.float32).to(x.dtype)  # any leading dims, 1-D too
        grads = (grads[0], grads[1], db)
    return grads


def _linear_backward_chosen(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, need_db, path, mode):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return _linear_backward(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, need_db, path)
        return fastpath.vendor(_linear_backward_vendor, dy, x, w, w_up, slope, slope_up, need_dx, need_dw, need_db,
                               path)

    def key():
        N, K = w.shape
        return tuning.ChoiceKey(M_BUCKET=sizes.m_bucket(math.prod(x.shape[:-1])), N=N, K=K, GATED=w_up is not None,
                                HAS_SLOPE=slope is not None, NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db,
                                INPUT_PRECISION=precision, dtype=x.dtype)
    return fastpath.run_chosen(LINEAR_BACKWARD_CHOICE, mode, (tuning.TILEFUSE, CUBLAS), key, x.device, run)


# The backward's vendor candidate: g = dy * slope (each gated branch's own) as one elementwise pass, then cuBLAS's
# dx = g W (gated: + g_up W_up) and dW = g^T x, db = the column sums of g. Same outputs as tilefuse's (see
# linear_backward).
LINEAR_BACKWARD_CHOICE = tuning.BackendChoice("linear_backward_backend", (tuning.TILEFUSE, CUBLAS))


def _linear_backward_vendor(dy, x, w, w_up, slope, slope_up, need_dx, need_dw, need_db, path):
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    dy2d = dy.reshape(M, N)
    if w_up is not None:
        return _gated_backward_vendor(dy2d, x, w, w_up, slope.reshape(M, N), slope_up.reshape(M, N), need_dx,
                                      need_dw, need_db, path)
    g = dy2d if slope is None else dy2d * slope.reshape(M, N)
    # each output its own tensor, never a view of another: the backward op's outputs may not alias (torch.library)
    dx, dw, db = (dy.new_empty((0,)) for _ in range(3))
    if need_dx:
        dx = (g @ w).view(x.shape)
    if need_dw or need_db:
        dw = g.t() @ x.reshape(M, K)
        dw = dw if w.is_contiguous() else torch.empty_like(w).copy_(dw)  # the weight's own layout
        if need_db:
            db = g.sum(0, dtype=torch.float32).to(x.dtype)
    launches.record("linear_backward", path, CUBLAS, ("dy * slope, then " if slope is not None else "")
                    + "cuBLAS's dx and dW GEMMs")
    return dx, dw, db


def _gated_backward_vendor(dy2d, x, w, w_up, s_gate, s_up, need_dx, need_dw, need_db, path):
    """The gated backward's cuBLAS form: g = [dy * s_gate, dy * s_up] side by side in one [M, 2N] tensor (one pass,
    dy read once: gate.py), then dx = g_gate W_gate + g_up W_up as one GEMM per half, the second accumulated (the
    same calls for both weight forms, as in the forward), each dW one GEMM g_half^T x in its weight's layout (a
    copy where the weight is not dense) and each db the column sums of its half. The two dW and db are separate
    tensors, not views of one [2N, ...] result: the backward op's outputs may not alias each other."""
    N, K = w.shape
    M = dy2d.shape[0]
    if dy2d.stride(1) != 1:  # autograd's dy may be expanded or strided: the pass reads rows of unit stride
        dy2d = dy2d.contiguous()
    g = torch.empty((M, 2 * N), dtype=dy2d.dtype, device=dy2d.device)
    grid, tile = pass_grid(M, N, path)
    fastpath.launch(gated_grad_kernel, grid, (dy2d, s_gate, s_up, g, M, N, dy2d.stride(0), s_gate.stride(0), 2 * N),
                    dict(tile))
    g_gate, g_up = g[:, :N], g[:, N:]

    def none():
        return dy2d.new_empty((0,))
    dx = none()
    if need_dx:
        dx2d = g_gate @ w
        dx2d.addmm_(g_up, w_up)
        dx = dx2d.view(x.shape)
    dws, dbs = [none(), none()], [none(), none()]
    if need_dw or need_db:
        x2d = x.reshape(M, K)
        for i, (half, wb) in enumerate(((g_gate, w), (g_up, w_up))):
            dw = half.t() @ x2d
            dws[i] = dw if wb.is_contiguous() else torch.empty_like(wb).copy_(dw)  # the weight's own layout
            if need_db:
                dbs[i] = half.sum(0, dtype=torch.float32).to(x.dtype)
    launches.record("linear_backward", path, CUBLAS, "dy * both slopes in one pass, then cuBLAS's dx and dW GEMMs "
                    "per half")
    return dx, dws[0], dws[1], dbs[0], dbs[1]


# Hopper's dW kernel (backward.py: grad_weight_tma_kernel, under switches.gemm.BACKWARD_TMA) at one tile: measured
# faster than the tuned pointer dW (NOTES.md).
BACKWARD_TMA_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def _dense_2d(t: torch.Tensor):
    """``t`` [rows, cols] as TMA reads it: itself with a unit column stride, its transpose (a view) with a unit
    row stride, or None."""
    if t.stride(1) == 1:
        return t
    if t.stride(0) == 1:
        return t.t()
    return None


def _backward_tma(rows: tuple, either_way: tuple = ()) -> bool:
    """Whether dW takes the Hopper TMA kernel (switches.gemm.BACKWARD_TMA): ``hopper_tma`` of the ``rows`` operands (dy, the
    slope, x) as laid out and of the ``either_way`` ones (dW) with a unit stride on either dim."""
    views = [_dense_2d(t) for t in either_way]
    return switches.gemm.BACKWARD_TMA and all(v is not None for v in views) and hopper_tma(*rows, *views)


def _linear_backward(dy, x, w, w_up, slope, slope_up, precision, need_dx, need_dw, need_db, path):
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    gated = w_up is not None
    interpret = path == runtime.INTERPRETER
    dy2d = dy.reshape(M, N)
    s2d = slope.view(M, N) if slope is not None else dy2d
    su2d = slope_up.view(M, N) if slope_up is not None else s2d

    def none():  # an output not asked for: empty, and never the same tensor twice
        return dy.new_empty((0,))
    flags = dict(HAS_SLOPE=slope is not None, INPUT_PRECISION=precision,
                 UPCAST_DOT=interpret and x.dtype == torch.bfloat16)
    # The cooperative kernel's slope for dx: plain dx takes the kernel's plain form; gated dx sums two products,
    # g_gate @ W_gate + g_up @ W_up, which its GATED_DX form walks as one reduction (``coop_gated_dx``). Each gated
    # branch's dW is one product, g_branch^T x, and takes the kernel as plain dW does.
    s_coop = s2d if slope is not None and not gated else None
    dx = none()
    if need_dx:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx2d = dx.view(M, K)
        if gated and coop_gated_dx(dx2d, dy2d, s2d, su2d, w, w_up, path):
            coop.launch(dy2d, s2d, w, dx2d, b_up=w_up, s_up=su2d, config=switches.gemm.COOP_BACKWARD_CONFIG)
            launches.record("linear_backward", path, "grad input gated (cooperative warp-specialized), g = dy * "
                            "slope for each branch in its loads", switches.gemm.COOP_BACKWARD_CONFIG)
        elif coop_backward(dx2d, dy2d, s_coop, w, path, "dx"):
            coop.launch(dy2d, s2d, w, dx2d, config=switches.gemm.COOP_BACKWARD_CONFIG)
            launches.record("linear_backward", path, "grad input (cooperative warp-specialized), g = dy * slope "
                            "in its loads", switches.gemm.COOP_BACKWARD_CONFIG)
        else:
            wu = w_up if gated else w
            args = (dy2d, s2d, su2d, w, wu, dx2d, M, N, K, sizes.m_bucket(M),
                    dy2d.stride(0), dy2d.stride(1), s2d.stride(0), s2d.stride(1),
                    w.stride(0), w.stride(1), wu.stride(0), wu.stride(1), dx2d.stride(0), dx2d.stride(1))
            cfg = _launch_backward(grad_input_kernel, grad_input_tuned, args, dict(flags, GATED=gated), interpret,
                                   lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(K, meta["BLOCK_N"]),))
            launches.record("linear_backward", path, "grad input, g = dy * slope in its loads",
                            lambda: tuning.describe(cfg))
    dws, dbs = [none(), none()], [none(), none()]
    # db comes from the dW kernel only with a slope, summed from the g it makes (dy * slope); without one the
    # caller (linear_backward) sums dy itself.
    fused_db = need_db and slope is not None
    if need_dw or fused_db:
        x_rows, m_inner, s_outer, s_inner, s_k = row_addressing(x)
        two_strides = s_outer != 0 and m_inner != M
        x2d = None if two_strides or s_k != 1 else x_rows.as_strided((M, K), (s_inner, 1))
        branches = ((w, s2d), (w_up, su2d)) if gated else ((w, s2d),)
        for i, (wb, sb) in enumerate(branches):
            dw = dws[i] = torch.empty_like(wb)  # the weight's own layout when it is dense
            db = dw
            if fused_db:
                db = dbs[i] = torch.empty(N, dtype=x.dtype, device=x.device)
            if x2d is not None and coop_backward(dw, dy2d, sb if slope is not None else None, x2d, path, "dW"):
                coop.launch(dy2d, sb, x2d, dw, trans_a=True, db=db if fused_db else None,
                            config=switches.gemm.COOP_BACKWARD_CONFIG)
                launches.record("linear_backward", path, "grad weight (cooperative warp-specialized)"
                                + (" + bias" if fused_db else "") + ", g = dy * slope in its loads",
                                switches.gemm.COOP_BACKWARD_CONFIG)
                continue
            if x2d is not None and _backward_tma((dy2d, sb, x2d), (dw,)):
                dw_kn = dw.stride(1) != 1  # dW in its weight's Conv1D layout: dW^T [K, N], unit row stride
                cfg = BACKWARD_TMA_TILE
                fastpath.launch_persistent(grad_weight_tma_kernel, cdiv(K, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), (
                    dy2d, sb, x2d, dw, db, M, N, K, dy2d.stride(0), sb.stride(0), x2d.stride(0),
                    dw.stride(1) if dw_kn else dw.stride(0)),
                    dict(HAS_BIAS=fused_db, HAS_SLOPE=slope is not None, DW_KN=dw_kn, **cfg), x.device)
                launches.record("linear_backward", path, "grad weight (TMA, dW^T = x^T g)"
                                + (" + bias" if fused_db else "") + ", g = dy * slope in its loads",
                                lambda: tuning.describe(cfg))
                continue
            args = (dy2d, sb, x_rows, dw, db, M, N, K, sizes.m_bucket(M), m_inner, s_outer, s_inner, s_k,
                    dy2d.stride(0), dy2d.stride(1), sb.stride(0), sb.stride(1), dw.stride(0), dw.stride(1))
            cfg = _launch_backward(grad_weight_kernel, grad_weight_tuned, args,
                                   dict(flags, HAS_BIAS=fused_db, TWO_ROW_STRIDES=two_strides), interpret,
                                   lambda meta: (cdiv(N, meta["BLOCK_M"]) * cdiv(K, meta["BLOCK_N"]),))
            launches.record("linear_backward", path, "grad weight" + (" + bias" if fused_db else "")
                            + ", g = dy * slope in its loads", lambda: tuning.describe(cfg))
    if gated:
        return dx, dws[0], dws[1], dbs[0], dbs[1]
    return dx, dws[0], dbs[0]


def _launch_backward(kernel, tuned, args, flags, interpret, grid):
    """One backward GEMM: the interpreter's fixed tile, else the tuner. Returns the config used."""
    if interpret:
        cfg = configs.INTERPRETER_GEMM
        fastpath.launch(kernel, grid(cfg), args, dict(flags, **cfg))
        return cfg
    fastpath.launch(tuned, grid, args, dict(flags, UPCAST_DOT=False))
    return tuned.launched_config()

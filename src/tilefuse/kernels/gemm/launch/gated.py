"""The gated forward, ``act(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up)``: both GEMMs in one of the forward
kernels (forward.py), or its vendor candidate (a cuBLAS GEMM per half, then the gate kernel)."""
from __future__ import annotations

import math

import torch

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches
from tilefuse.kernels.gemm.gate import glu_gate_kernel
from tilefuse.kernels.gemm.launch.forward import forward_kernels
from tilefuse.kernels.gemm.launch.rules import CUBLAS, pass_grid, training_field
from tilefuse.runtime import precision_for

_GATED = fastpath.Plans("gated_linear")


def gated_linear(x, w_gate, w_up, b_gate, b_up, activation, path, save_slope=False):
    """``act(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)``, both GEMMs in one kernel. ``save_slope``:
    returns (y, s_gate, s_up) = (y, up * act'(gate), act(gate)) in y's layout. Runs tilefuse's kernels or
    cuBLAS's GEMMs and the gate kernel (see :data:`GATED_CHOICE`)."""
    precision = precision_for(x.dtype, x.is_cuda)
    mode = runtime.backend()
    return _GATED.run((x, w_gate, w_up, b_gate, b_up), (activation, precision, save_slope, mode),
                      lambda: _gated_chosen(x, w_gate, w_up, b_gate, b_up, activation, precision, path, save_slope,
                                            mode))


def _gated_chosen(x, w_gate, w_up, b_gate, b_up, activation, precision, path, save_slope, mode):
    def run(candidate):
        if candidate == tuning.TILEFUSE:
            return forward_kernels(x, w_gate, b_gate, w_up, b_up, activation, precision, path, save_slope)
        return fastpath.vendor(_gated_vendor, x, w_gate, w_up, b_gate, b_up, activation, path, save_slope)

    def key():
        N, K = w_gate.shape
        return tuning.ChoiceKey(M_BUCKET=sizes.m_bucket(math.prod(x.shape[:-1])), N=N, K=K,
                                HAS_BIAS=b_gate is not None, ACTIVATION=activation, INPUT_PRECISION=precision,
                                STACKED=_stacked(w_gate, w_up), **training_field(save_slope), dtype=x.dtype)
    return fastpath.run_chosen(GATED_CHOICE, mode, (tuning.TILEFUSE, CUBLAS), key, x.device, run)


# The gated forward's vendor candidate: one cuBLAS GEMM per half, then the gate kernel (gate.py) with the biases.
GATED_CHOICE = tuning.BackendChoice("gated_linear_forward_backend", (tuning.TILEFUSE, CUBLAS))


def _stacked(first, second) -> bool:
    """Whether ``second`` continues ``first`` in memory, both dense: the halves of one tensor."""
    return (first.is_contiguous() and second.is_contiguous() and first.dtype == second.dtype
            and second.data_ptr() == first.data_ptr() + first.numel() * first.element_size())


def _gated_vendor(x, w_gate, w_up, b_gate, b_up, activation, path, save_slope=False):
    """One cuBLAS GEMM per half, each without its bias, then the gate kernel adds both biases in fp32. The same calls
    whether the halves are two tensors or one stacked [2N, K] tensor, so both weight forms get the same bits, as
    tilefuse's kernel gives them: one GEMM over a stacked weight would take other cuBLAS kernels than two over its
    halves, and a bias view at an odd offset another epilogue. (Equal bits also need cuBLAS to see the same
    alignment: it does where N * K is a multiple of 8.)"""
    N, K = w_gate.shape
    M = math.prod(x.shape[:-1])
    x2d = x.reshape(M, K)
    gate = torch.mm(x2d, w_gate.t())
    up = torch.mm(x2d, w_up.t())
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    slopes = (torch.empty_like(y), torch.empty_like(y)) if save_slope else (y, y)  # (y, y): pointers never stored
    has_bias = b_gate is not None
    biases = (b_gate, b_up) if has_bias else (y, y)  # (y, y): never read
    grid, tile = pass_grid(M, N, path)
    fastpath.launch(glu_gate_kernel, grid, (gate, up, *biases, y, *slopes, M, N, gate.stride(0), up.stride(0), N),
                    dict(ACTIVATION=activation, HAS_BIAS=has_bias, SAVE_SLOPES=save_slope, **tile))
    launches.record("linear", path, CUBLAS, "a cuBLAS GEMM per half, then the "
                    + f"{activation} gate kernel" + (" with the biases" if has_bias else "")
                    + (" and its slopes" if save_slope else ""))
    return (y, *slopes) if save_slope else y

"""FP8 attention: tilefuse.attention(..., fp8=True) and tilefuse.quantize_qkv.

Two registered ops: ``tilefuse::quantize_qkv_fp8`` (the pre-pass: Q and K e4m3 per head and per 128 rows,
optionally rotated; V e4m3 per channel, written keys-contiguous) and ``tilefuse::attention_fp8`` (the
forward over e4m3 inputs and their scales). Forward only: FP8 attention serves inference.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from tilefuse import constants, runtime
from tilefuse.ops import _dispatch
from tilefuse.ops._checks import (FLOAT_DTYPES, check_fp8_device, check_kv_heads, check_no_grad_needed, check_qkv,
                                  check_tensor)
from tilefuse.reference import fp8_attention as ref_fp8

FP8 = torch.float8_e4m3fn
QUANT_BLOCK = ref_fp8.QUANT_BLOCK
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QuantizedQKV(NamedTuple):
    """e4m3 q [B, Hq, Nq, d], k and v [B, Hkv, Nk, d] with their fp32 scales: q_scale [B, Hq, cdiv(Nq, 128)],
    k_scale [B, Hkv, cdiv(Nk, 128)] (one per head and 128 rows), v_scale [B, Hkv, d] (one per channel). v is a
    view of a [B, Hkv, d, Nk] buffer (keys contiguous: the layout Hopper's FP8 MMA reads for P @ V). With
    ``rotated``, q and k are q·R and k·R for one orthogonal R (QK^T unchanged)."""
    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    rotated: bool


def _launch():
    runtime.check_triton()
    from tilefuse.kernels.attention import launch  # imports triton: only once a kernel is to run
    return launch


def _blocks(n: int) -> int:
    return -(-n // QUANT_BLOCK)


def _new_v_t(like: torch.Tensor, B: int, H: int, d: int, N: int) -> torch.Tensor:
    """An empty e4m3 V^T [B, H, d, N] on ``like``'s device in the layout the kernels read
    (``constants.fp8_v_t_strides``: keys contiguous, rows padded to 16 keys)."""
    return like.new_empty_strided((B, H, d, N), constants.fp8_v_t_strides(B, H, d, N), dtype=FP8)


def _quant_outputs(q, k):
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    new = q.new_empty
    return (new((B, Hq, Nq, d), dtype=FP8), new((B, Hq, _blocks(Nq)), dtype=torch.float32),
            new((B, Hkv, Nk, d), dtype=FP8), new((B, Hkv, _blocks(Nk)), dtype=torch.float32),
            _new_v_t(q, B, Hkv, d, Nk), new((B, Hkv, d), dtype=torch.float32))


@torch.library.custom_op("tilefuse::quantize_qkv_fp8", mutates_args=())
def _quantize_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rotate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor]:
    """(q8, q_scale, k8, k_scale, v8 as [B, Hkv, d, Nk], v_scale)."""
    path = runtime.execution_path(q)
    reference = path == runtime.REFERENCE or q.numel() == 0 or k.numel() == 0
    # The ±1 matrix: fp32 for the reference's products, the inputs' dtype for the kernels' (exact either way).
    rotation = ref_fp8.hadamard_signs(q.shape[-1], q.device, torch.float32 if reference else q.dtype) \
        if rotate else None
    if reference:
        _dispatch.record_reference("quantize_qkv", path)
        q8, qs = ref_fp8.quantize_blocks(q, rotation)
        k8, ks = ref_fp8.quantize_blocks(k, rotation)
        v8, vs = ref_fp8.quantize_channels(v)
        B, Hkv, Nk, d = v8.shape
        return q8, qs, k8, ks, _new_v_t(v8, B, Hkv, d, Nk).copy_(v8.transpose(2, 3)), vs
    launch = _launch()
    with _dispatch.on_device(q):
        q8, qs, k8, ks, v8, vs = launch.quantize_qkv(q, k, v, rotation, path)
    return q8, qs, k8, ks, v8.transpose(2, 3), vs


@_quantize_op.register_fake
def _(q, k, v, rotate):
    return _quant_outputs(q, k)


@torch.library.custom_op("tilefuse::attention_fp8", mutates_args=())
def _attention_op(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                  v_t: torch.Tensor, v_scale: torch.Tensor, scale: float, pos_offset: int, window_left: int,
                  window_right: int, out_dtype: torch.dtype) -> torch.Tensor:
    """out [B, Hq, Nq, d] for e4m3 inputs; v_t [B, Hkv, d, Nk] keys contiguous (:func:`_v_t_for_kernels`)."""
    path = runtime.execution_path(q)
    v = v_t.transpose(2, 3)
    if path == runtime.REFERENCE or q.numel() == 0 or k.shape[2] == 0:
        _dispatch.record_reference("attention_fp8", path)
        if k.shape[2] == 0:
            return q.new_zeros(q.shape, dtype=out_dtype)
        return ref_fp8.attention_fp8_tiled(q, q_scale, k, k_scale, v, v_scale, scale, pos_offset, window_left,
                                           window_right).to(out_dtype)
    with _dispatch.on_device(q):
        return _launch().forward_fp8(q, k, v, q_scale, k_scale, v_scale, scale, pos_offset, window_left,
                                     window_right, out_dtype, path)


@_attention_op.register_fake
def _(q, q_scale, k, k_scale, v_t, v_scale, scale, pos_offset, window_left, window_right, out_dtype):
    return q.new_empty(q.shape, dtype=out_dtype)


def _check_inputs(q, k, v, dtypes=FLOAT_DTYPES):
    """tilefuse.ops._checks' attention checks (dtypes, devices, [B, H, N, d] shapes, head dims, GQA)."""
    check_qkv(q, k, v, ndim=4, dtypes=dtypes)
    check_kv_heads(q, k, v)


def _v_t_for_kernels(v_t: torch.Tensor) -> torch.Tensor:
    """V^T [B, Hkv, d, Nk] as the kernels read it: keys contiguous, every other stride 16-byte aligned (TMA-able,
    so the warp-specialized kernel takes it); quantize_qkv writes it so, other layouts are copied into that one
    (``constants.fp8_v_t_strides``)."""
    # Strides only (a compiled graph knows them; the base address the launch's descriptor check sees).
    if v_t.stride(-1) == 1 and all(st % 16 == 0 for st in v_t.stride()[:-1]):
        return v_t
    return _new_v_t(v_t, *v_t.shape).copy_(v_t)


def _power_of_two(d: int) -> bool:
    return d > 0 and not d & (d - 1)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotate: bool | None = None) -> QuantizedQKV:
    """Quantizes 16/32-bit q [B, Hq, Nq, d], k, v [B, Hkv, Nk, d] for ``tilefuse.attention(..., fp8=True)``
    in one pre-pass per tensor (one read, e4m3 and the scales written): Q and K per head and per 128 rows (scale
    = amax / 448), V per head and channel. ``rotate=True`` multiplies Q and K by one orthogonal matrix first (a
    randomized Hadamard, d a power of two): QK^T is unchanged, and an outlier channel is spread over all d, so
    its rounding error no longer dominates the scores (on inputs with 1% of channels x20 it measured 2-4x closer
    to float64 than without; on Gaussian inputs the same). ``None`` (default): rotate where d is a power of two.
    Pass the result's fields to attention:
    ``attention(r.q, r.k, r.v, fp8=True, q_scale=r.q_scale, k_scale=r.k_scale, v_scale=r.v_scale)``."""
    _check_inputs(q, k, v)
    if rotate is not None and not isinstance(rotate, bool):
        raise TypeError(f"rotate must be None or a bool, got {type(rotate).__name__}")
    d = q.shape[-1]
    if rotate is None:
        rotate = _power_of_two(d)
    if rotate and not _power_of_two(d):
        raise ValueError(f"rotate=True needs a power-of-two head dim (a Hadamard rotation), got d={d}")
    check_fp8_device("q", q)
    check_no_grad_needed("quantize_qkv", q, k, v)
    q8, qs, k8, ks, v8t, vs = _quantize_op(q, k, v, rotate)
    return QuantizedQKV(q8, qs, k8, ks, v8t.transpose(2, 3), vs, rotate)


def _scales(name: str, s, lead: tuple, full: int, what: str, device) -> torch.Tensor:
    """A scale argument as a contiguous fp32 [*lead, full] tensor: a number or 0-d tensor (one scale),
    [*lead] (one per head) or [*lead, full] (``what``)."""
    if s is None:
        raise ValueError(f"{name} is required when the inputs are already FP8 (the scale each value was divided by)")
    if isinstance(s, bool) or not isinstance(s, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number or an fp32 tensor, got {type(s).__name__}")
    if not isinstance(s, torch.Tensor):
        s = torch.tensor(float(s), device=device)
    if not s.is_floating_point() or s.dtype == FP8:
        raise TypeError(f"{name} must be a float tensor (fp32), got dtype {s.dtype}")
    if s.device != device:
        raise ValueError(f"{name} is on {s.device} but q is on {device}; they must be on one device")
    shapes = ((), lead, (*lead, full))
    if tuple(s.shape) not in shapes:
        raise ValueError(f"{name} must have shape () (one scale), {list(lead)} (one per head) or "
                         f"{[*lead, full]} ({what}), got {tuple(s.shape)}")
    s = s.float()
    if s.dim() < 3:
        s = s.reshape(*s.shape, *([1] * (3 - s.dim()))).expand(*lead, full)
    return s.contiguous()


def attention_fp8(q, k, v, *, causal=False, window=None, scale=None, q_scale=None, k_scale=None, v_scale=None,
                  rotate=None, out_dtype=None):
    """FP8 attention forward (tilefuse.attention with ``fp8=True``; its docstring has the arguments)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES + (FP8,))
    given = (q.dtype == FP8, k.dtype == FP8, v.dtype == FP8)
    if any(given) and not all(given):
        raise TypeError(f"q, k and v must be all float8_e4m3fn (with their scales) or all 16/32-bit, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    _check_inputs(q, k, v, FLOAT_DTYPES + (FP8,))
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be None or one of bfloat16, float16, float32, got {out_dtype}")
    left, right = tuple(window) if window is not None else (-1, -1)
    if causal:
        right = 0
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else float(scale)
    if all(given):
        if rotate:
            raise ValueError("rotate=True applies while quantizing: pass 16/32-bit q, k, v (or rotate them "
                             "yourself before quantizing)")
        check_fp8_device("q", q)
        qs = _scales("q_scale", q_scale, (B, Hq), _blocks(Nq), "one per head and 128 query rows", q.device)
        ks = _scales("k_scale", k_scale, (B, Hkv), _blocks(Nk), "one per head and 128 keys", q.device)
        vs = _scales("v_scale", v_scale, (B, Hkv), d, "one per head and channel", q.device)
        v_t = _v_t_for_kernels(v.transpose(2, 3))
        q, k = q.contiguous(), k.contiguous()
        out_dtype = out_dtype or torch.bfloat16
    else:
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{name} is only for float8_e4m3fn inputs; 16/32-bit q, k, v are quantized "
                                 "here (tilefuse.quantize_qkv)")
        out_dtype = out_dtype or q.dtype
        r = quantize_qkv(q, k, v, rotate=rotate)
        q, qs, k, ks, vs = r.q, r.q_scale, r.k, r.k_scale, r.v_scale
        v_t = r.v.transpose(2, 3)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return _attention_op(q, qs, k, ks, v_t, vs, scale, Nk - Nq, left, right, out_dtype)

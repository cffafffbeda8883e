"""FP8 (e4m3) attention in plain PyTorch: tilefuse's scheme emulated tile by tile, the plain per-tensor FP8
baseline the report compares it with, and the rotation both sides of QK^T share.

- ``quantize_blocks`` / ``quantize_channels``: the pre-pass's math (per QUANT_BLOCK rows of a head for Q and
  K, optionally rotated; per channel for V), e4m3 rounding by torch's float8_e4m3fn cast.
- ``attention_fp8_tiled``: the FP8 kernels' online softmax over BLOCK_N key tiles, with P times P_SCALE cast
  to e4m3 against the running maximum of its tile, as the kernels do; on CPU without the interpreter this is
  what tilefuse.attention(..., fp8=True) runs.
- ``attention_fp8_per_tensor``: plain FP8 attention: one scale for each of Q, K and V (amax / 448), the
  exact softmax in fp32, P cast to e4m3 as it is (no scale) for P @ V.
"""
from __future__ import annotations

import math

import torch

from tilefuse import constants
from tilefuse.reference.attention import visibility

E4M3_MAX = constants.E4M3_MAX
QUANT_BLOCK = constants.FP8_ATTENTION_BLOCK
P_SCALE = constants.FP8_P_SCALE
LOG2E = 1.4426950408889634
_ROTATIONS: dict = {}


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN as 0, as the kernels take it for a block's scale (a NaN stays in its own element)."""
    return torch.where(x.isnan(), torch.zeros_like(x), x.abs())


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn)


def hadamard_signs(d: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rotation's ±1 matrix [d, d] (d a power of two; exact in any float dtype, so the kernels take it in their
    inputs' 16-bit dtype, half the bytes each program reads): a Sylvester Hadamard matrix with its rows' signs
    flipped by a fixed pseudo-random pattern (so no input is aligned with it by construction). Times 1/sqrt(d) it is
    orthogonal, so rotating Q and K alike leaves QK^T unchanged. Made once per (d, device, dtype)."""
    if d & (d - 1) or d < 1:
        raise ValueError(f"the rotation needs a power-of-two head dim, got {d}")
    key = (d, str(device), dtype)
    m = _ROTATIONS.get(key)
    if m is None:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        g = torch.Generator().manual_seed(0x5EED)
        signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1
        m = _ROTATIONS[key] = (signs[:, None] * h).to(device=device, dtype=dtype)
    return m


def quantize_blocks(t: torch.Tensor, rotation: torch.Tensor | None = None, block: int = QUANT_BLOCK):
    """t [B, H, N, d] -> (e4m3 [B, H, N, d], fp32 scales [B, H, cdiv(N, block)]): one scale per ``block`` rows
    of a head; ``rotation`` (the ±1 matrix) first multiplies the rows, then 1/sqrt(d)."""
    x = t.float()
    if rotation is not None:
        x = (x @ rotation.float()) * (1.0 / math.sqrt(rotation.shape[0]))
    B, H, N, d = x.shape
    blocks = -(-N // block)
    padded = torch.nn.functional.pad(x, (0, 0, 0, blocks * block - N))
    amax = _magnitude(padded).view(B, H, blocks, block * d).amax(-1)
    scales = _scale_of(amax)
    per_row = scales.repeat_interleave(block, dim=2)[:, :, :N, None]
    return _e4m3(x / per_row), scales


def quantize_channels(t: torch.Tensor):
    """t [B, H, N, d] -> (e4m3 [B, H, N, d], fp32 scales [B, H, d]): one scale per channel of a head."""
    x = t.float()
    if x.shape[2] == 0:  # no rows: nothing to scale
        return _e4m3(x), x.new_ones((*x.shape[:2], x.shape[3]))
    scales = _scale_of(_magnitude(x).amax(dim=2))
    return _e4m3(x / scales[:, :, None, :]), scales


def _per_row(scales: torch.Tensor, n: int, block: int = QUANT_BLOCK) -> torch.Tensor:
    return scales.repeat_interleave(block, dim=2)[:, :, :n]


def attention_fp8_tiled(q8, q_scale, k8, k_scale, v8, v_scale, scale: float, pos_offset: int, left: int,
                        right: int, block_n: int = 64) -> torch.Tensor:
    """The FP8 kernels' math in fp32: e4m3 q [B, Hq, Nq, d], k, v [B, Hkv, Nk, d] with the scales of
    ``quantize_blocks`` (q, k) and ``quantize_channels`` (v); returns fp32 [B, Hq, Nq, d]. Key tiles of
    ``block_n`` (dividing QUANT_BLOCK) walk the online softmax in order; rows that see no key give 0."""
    B, Hq, Nq, d = q8.shape
    Hkv, Nk = k8.shape[1], k8.shape[2]
    group = Hq // Hkv
    k8, v8 = (t.repeat_interleave(group, dim=1) for t in (k8, v8))
    k_scale, v_scale = (t.repeat_interleave(group, dim=1) for t in (k_scale, v_scale))
    qk = (scale * LOG2E) * _per_row(q_scale, Nq)[..., None]  # [B, Hq, Nq, 1]
    vis = visibility(Nq, Nk, pos_offset, left, right, q8.device)
    qf, kf, vf = q8.float(), k8.float(), v8.float()
    m = torch.full((B, Hq, Nq), float("-inf"), device=q8.device)
    l_sum = torch.zeros((B, Hq, Nq), device=q8.device)
    acc = torch.zeros((B, Hq, Nq, d), device=q8.device)
    for start in range(0, Nk, block_n):
        stop = min(start + block_n, Nk)
        s = (qf @ kf[:, :, start:stop].transpose(-1, -2)) * (qk * k_scale[:, :, start // QUANT_BLOCK, None, None])
        if vis is not None:
            s = s.masked_fill(~vis[:, start:stop], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        p = torch.exp2(s - m_safe[..., None])
        alpha = torch.exp2(m - m_safe)
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + _e4m3(p * P_SCALE).float() @ vf[:, :, start:stop]
        m = m_new
    l_safe = torch.where(l_sum == 0, torch.ones_like(l_sum), l_sum) * P_SCALE
    return acc * (v_scale[:, :, None, :] / l_safe[..., None])


def attention_fp8_per_tensor(q, k, v, scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """Plain per-tensor FP8 attention (the baseline): Q, K and V each e4m3 with one scale (amax / 448), exact
    softmax of the fp32 scores, P cast to e4m3 unscaled, fp32 P @ V, divided by the fp32 row sum. q [B, Hq,
    Nq, d], k, v [B, Hkv, Nk, d] (16/32-bit); returns fp32, bottom-right causal as tilefuse.attention."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    quant = []
    for t in (q, k, v):
        s = _scale_of(_magnitude(t.float()).amax())
        quant.append((_e4m3(t.float() / s).float(), s))
    (qf, qs), (kf, ks), (vf, vs) = quant
    kf, vf = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (kf, vf))
    s = (qf @ kf.transpose(-1, -2)) * (qs * ks * scale)
    if causal:
        s = s.masked_fill(~visibility(Nq, Nk, Nk - Nq, -1, 0, q.device), float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l_sum = p.sum(-1, keepdim=True)
    out = (_e4m3(p).float() @ vf) * vs
    return out / torch.where(l_sum == 0, torch.ones_like(l_sum), l_sum)

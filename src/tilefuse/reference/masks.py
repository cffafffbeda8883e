"""Reference for block masks: the dense [B, H, Nq, Nk] bool mask a BlockMask's tile lists describe.

Plain PyTorch over the tile grid (the plain-PyTorch attention path and the tests read it); materialises the
whole mask, so small shapes only.
"""
from __future__ import annotations

import torch


def unpack_bits(words: torch.Tensor, cols: int) -> torch.Tensor:
    """[..., W] int32 words -> [..., cols] bool (bit c % 32 of word c // 32)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    bits = (words.long()[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :cols].bool()


def dense_from_blocks(classes: torch.Tensor, slots: torch.Tensor, partial_bits: torch.Tensor, n_q: int, n_k: int,
                      block_q: int, block_k: int) -> torch.Tensor:
    """classes int8 [B, H, Tq, Tk] (0 empty, 1 partial, 2 full), slots [B, H, Tq, Tk] (each partial tile's row
    of ``partial_bits`` [P, block_q, W]) -> [B, H, n_q, n_k] bool."""
    B, H, Tq, Tk = classes.shape
    tiles = unpack_bits(partial_bits, block_k)[slots.clamp(0, partial_bits.shape[0] - 1)]  # [B, H, Tq, Tk, bq, bk]
    tiles = torch.where((classes == 2)[..., None, None], True, tiles & (classes == 1)[..., None, None])
    dense = tiles.permute(0, 1, 2, 4, 3, 5).reshape(B, H, Tq * block_q, Tk * block_k)
    return dense[:, :, :n_q, :n_k].contiguous()

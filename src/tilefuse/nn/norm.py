"""nn.Module drop-ins for torch.nn.LayerNorm / torch.nn.RMSNorm backed by the tilefuse kernels.

They subclass the torch modules, so parameters, buffers, constructor arguments, ``extra_repr`` and
state dicts are exactly torch's: a torch state dict loads unchanged and vice versa. Only ``forward``
differs, and it takes an optional ``residual`` (returns ``(y, x + residual)``, the pre-norm pattern).
"""
from __future__ import annotations

import torch

from tilefuse.ops.norms import layer_norm, rms_norm


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by :func:`tilefuse.layer_norm`."""

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, residual=residual)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by :func:`tilefuse.rms_norm` (eps None = finfo(x.dtype).eps)."""

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, residual=residual)

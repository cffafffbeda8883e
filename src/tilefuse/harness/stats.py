"""Error statistics against a float64 reference: rel-L2 = ||out - ref|| / ||ref|| and max-abs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ErrorStats:
    rel_l2: float
    max_abs: float
    nan_mismatch: int  # elements NaN in exactly one of out / ref (an unwritten or wrongly NaN output)

    def ok(self, bound: float) -> bool:
        return self.nan_mismatch == 0 and self.rel_l2 <= bound


def flatten_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flatten_outputs(o)]
    raise TypeError(f"op returned {type(out).__name__}; expected a tensor or a tuple of tensors")


def error_stats(out, ref) -> ErrorStats:
    """Compares every tensor of ``out`` with ``ref`` (same structure); the worst figure of each wins.

    Positions where the reference is +-inf or NaN must match exactly and are excluded from the norms.
    """
    outs, refs = flatten_outputs(out), flatten_outputs(ref)
    if len(outs) != len(refs):
        raise ValueError(f"op returned {len(outs)} tensors, the reference {len(refs)}")
    worst = ErrorStats(0.0, 0.0, 0)
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            raise ValueError(f"output shape {tuple(o.shape)} != reference shape {tuple(r.shape)}")
        # On the reference's device: over a large output (an LCE row's dW, 525M elements) the GPU takes
        # milliseconds where a CPU pass takes seconds.
        o64, r64 = o.detach().to(device=r.device, dtype=torch.float64), r.detach().to(torch.float64)
        finite = torch.isfinite(r64)
        special_mismatch = int((~finite & ~((o64 == r64) | (o64.isnan() & r64.isnan()))).sum())
        nan_mismatch = int((o64.isnan() & finite).sum()) + special_mismatch
        diff = (o64 - r64)[finite]
        ref_norm = r64[finite].norm().item()
        err_norm = diff.norm().item() if diff.numel() else 0.0
        rel = err_norm / ref_norm if ref_norm > 0 else err_norm
        max_abs = diff.abs().max().item() if diff.numel() else 0.0
        worst = ErrorStats(max(worst.rel_l2, rel), max(worst.max_abs, max_abs),
                           worst.nan_mismatch + nan_mismatch)
    return worst


def to_float64(inputs: dict) -> dict:
    """Float tensors (also inside tuples/lists) to float64 on the same device; everything else as is.
    For the accuracy reference."""
    def convert(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(torch.float64)
        if isinstance(v, (tuple, list)):
            return type(v)(convert(t) for t in v)
        return v
    return {k: convert(v) for k, v in inputs.items()}


def poison_outputs_like(ref, dtype: torch.dtype) -> None:
    """Fill the memory the CUDA caching allocator will hand out next -- as many bytes as ``ref``'s
    tensors take in ``dtype`` -- with NaN, so an output element a kernel never writes fails the
    comparison instead of holding stale but plausible data. No-op without CUDA."""
    nbytes = sum(t.numel() for t in flatten_outputs(ref)) * dtype.itemsize
    if torch.cuda.is_available() and nbytes > 0:
        torch.full((nbytes // 2 + 64,), float("nan"), dtype=torch.float16, device="cuda")

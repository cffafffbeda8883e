"""Assertion helpers shared by every test file."""
from __future__ import annotations

import pytest
import torch

from tilefuse.harness.stats import error_stats, poison_outputs_like, to_float64

ON_GPU = torch.cuda.is_available()


def assert_close(out, ref, bound: float, what: str = "") -> None:
    """rel-L2 of out against ref (compared in float64) must be <= bound; NaN/inf positions must match.

    The failure message reports rel-L2, max-abs and the bound.
    """
    st = error_stats(out, ref)
    assert st.nan_mismatch == 0, f"{what}: {st.nan_mismatch} NaN/inf mismatches (rel-L2 {st.rel_l2:.3e})"
    assert st.rel_l2 <= bound, (f"{what}: rel-L2 {st.rel_l2:.3e} > bound {bound:.0e} "
                                f"(max-abs {st.max_abs:.3e})")


def check_against_reference(spec, params, device, seed=0):
    """Run the registry op and its float64 reference on the same fresh random inputs and compare."""
    inputs = spec.make_inputs(params, device, seed)
    with torch.no_grad():
        ref = spec.reference(**to_float64(inputs))
        poison_outputs_like(ref, params["dtype"])
        out = spec.fused(**inputs)
    assert_close(out, ref, spec.tolerance(params), f"{spec.name} {spec.label(params)}")
    return out


def train_losses(loss_fn, optimizer, steps: int) -> list[float]:
    """``steps`` optimizer steps on ``loss_fn()``; the loss of each step (before its update)."""
    losses = []
    for _ in range(steps):
        loss = loss_fn()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def representative(cases, keep=1):
    """A parametrize list whose first ``keep`` cases run everywhere and the rest are marked exhaustive (the
    GPU suite runs them; the CPU suite leaves them out): put the cases that differ most first."""
    out = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        out.append(pytest.param(*values) if i < keep else pytest.param(*values, marks=pytest.mark.exhaustive))
    return out

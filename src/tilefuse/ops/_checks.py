"""Argument checks shared by the ops. Messages name the argument and what was expected.

Policy (ENGINEERING.md): shape, value and device problems -> ValueError; dtype problems -> TypeError;
unsupported features -> NotImplementedError. Every check runs before any kernel launch.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {names}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; they must match")


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must be on one device")


def dense(t):
    """``t`` itself when its elements are contiguous, else a contiguous copy (None stays None). Kernels
    index parameter vectors (biases, norm weights) as dense arrays; they are small, so a strided view
    of one is copied rather than given strides of its own."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def grad_needed(*tensors) -> bool:
    """Whether autograd must record this call. When it need not, ops skip torch.autograd.Function:
    its bookkeeping costs tens of microseconds of host time per call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_no_grad_needed(op: str, *tensors) -> None:
    """Forward-only ops: refuse rather than return a result autograd cannot differentiate."""
    if grad_needed(*tensors):
        raise NotImplementedError(
            f"tilefuse.{op} has no backward yet; call it under torch.no_grad() or on tensors that do "
            "not require grad")


def check_softcap(softcap):
    """Gemma 2's logit soft-capping value: None or a positive finite number (returned as a float or None)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    return float(softcap)

"""Argument checks shared by the ops. Messages name the argument and what was expected.

Policy (ENGINEERING.md): shape, value and device problems -> ValueError; dtype problems -> TypeError;
unsupported features -> NotImplementedError. Every check runs before any kernel launch.
"""
from __future__ import annotations

import torch

from tilefuse import runtime

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {names}")


MAX_HEAD_DIM = 256  # the attention kernels' widest head


def check_qkv(q, k, v, q_name="q", k_name="k", v_name="v", *, ndim=None, min_dim=2, dtypes=FLOAT_DTYPES) -> None:
    """Attention's q, k, v: tensors of ``dtypes`` with one dtype, on one device, ``ndim`` (or at least
    ``min_dim``) dimensions, k's head dim q's, in [1, MAX_HEAD_DIM]."""
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        check_tensor(name, t, dtypes=dtypes)
        if (ndim is not None and t.dim() != ndim) or t.dim() < min_dim:
            want = f"{ndim}-D [B, H, N, d]" if ndim is not None else f"at least {min_dim}-D [..., L, E]"
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    check_same_dtype(k_name, k, q_name, q)
    check_same_dtype(v_name, v, q_name, q)
    check_same_device(k_name, k, q_name, q)
    check_same_device(v_name, v, q_name, q)
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"{k_name} has head dim {k.shape[-1]} but {q_name} has {d}; they must match")
    if d > MAX_HEAD_DIM or d < 1:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {d}")


def check_kv_heads(q, k, v) -> None:
    """[B, H, N, d] attention inputs: v shaped as k, one batch, q's heads a multiple of k's (GQA)."""
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}; they must match")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")


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


def flash_attn_window(dropout_p, window_size, softcap):
    """FlashAttention's shared arguments checked; returns the window as tilefuse takes it (None: unbounded)."""
    if dropout_p != 0.0:
        raise NotImplementedError("tilefuse's flash_attn functions have no dropout; use dropout_p=0.0")
    if isinstance(window_size, torch.Tensor):  # FlashAttention's own tests pass a tensor of two ints
        if window_size.shape != (2,) or window_size.is_floating_point() or window_size.is_complex() \
                or window_size.dtype == torch.bool:
            raise ValueError(f"window_size as a tensor must hold two ints (left, right), got {window_size!r}")
        window_size = tuple(int(w) for w in window_size.tolist())
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be (left, right) ints, -1 for unbounded, got {window_size!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0: none), got {softcap!r}")
    return None if tuple(window_size) == (-1, -1) else tuple(window_size)


def score_modifiers(q, softcap, alibi_slopes):
    """(softcap as a float or None, the slopes viewed as [B, Hq] or None), checked."""
    softcap = check_softcap(softcap)
    if alibi_slopes is None:
        return softcap, None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes has dtype {alibi_slopes.dtype}; expected float32")
    check_same_device("alibi_slopes", alibi_slopes, "q", q)
    B, Hq = q.shape[0], q.shape[1]
    shape = tuple(alibi_slopes.shape)
    # ==, not `in`: under torch.compile(dynamic=True) Dynamo evaluated `shape in (...)` as False when the
    # tuples held symbolic sizes
    if not (shape == (Hq,) or shape == (B, Hq)):
        raise ValueError(f"alibi_slopes must have shape [{Hq}] or [{B}, {Hq}] (q's [Hq] or [B, Hq]), got "
                         f"{list(alibi_slopes.shape)}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("tilefuse.attention: alibi_slopes get no gradient; pass them detached")
    return softcap, alibi_slopes.expand(B, Hq)


def check_offsets(name, cu, total, max_seqlen, validate):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} has dtype {cu.dtype}; expected int32 or int64")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(cu.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"the max_seqlen for {name} must be an int >= 0, got {max_seqlen!r}")
    if validate:  # one host synchronisation; validate=False skips it (CUDA graphs, torch.compile)
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        if values[-1] != total:
            raise ValueError(f"{name} must end at the total length {total}, got {values[-1]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if any(n < 0 for n in lengths):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if lengths and max(lengths) > max_seqlen:
            raise ValueError(f"{name} has a sequence of length {max(lengths)} above its max_seqlen {max_seqlen}")


FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores


def fp8_device_problem(device: torch.device) -> str | None:
    """Why FP8 kernels cannot run on CUDA device ``device`` (no FP8 tensor cores: compute capability below
    8.9), as a sentence, or None."""
    major = runtime.device_facts(device)[0]
    if major >= 9:
        return None
    capability = f"{major}.x"
    if major == 8:
        minor = torch.cuda.get_device_capability(device)[1]
        if (major, minor) >= FP8_MIN_CAPABILITY:
            return None
        capability = f"{major}.{minor}"
    return (f"fp8=True needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); {device} "
            f"has compute capability {capability}. Run the 16-bit op (fp8=False) there")


def check_fp8_device(name: str, t: torch.Tensor) -> None:
    """Refuses an FP8 call whose tensor ``name`` is on a GPU without FP8 tensor cores, before any launch; CPU
    tensors run the interpreter or the reference."""
    if t.is_cuda:
        problem = fp8_device_problem(t.device)
        if problem is not None:
            raise NotImplementedError(f"{name}: {problem}")

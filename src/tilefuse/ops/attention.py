"""tilefuse.attention and tilefuse.scaled_dot_product_attention: FlashAttention forward (one kernel).

Both surfaces share one kernel (tilefuse.kernels.attention). attention() aligns positions
bottom-right (query row i sits at key position i + Nk - Nq, as FlashAttention does);
scaled_dot_product_attention() follows torch's SDPA: top-left causal (position offset 0), optional
bool/additive mask read with its broadcast strides, broadcast batch dims, enable_gqa.
"""
from __future__ import annotations

import contextlib
import math

import torch

from tilefuse import runtime
from tilefuse.ops._checks import (check_no_grad_needed, check_same_device, check_same_dtype,
                                  check_tensor)
from tilefuse.reference import attention as ref_attention

MAX_HEAD_DIM = 256

# The config of the most recent launch, for the report; ``deterministic`` is recorded for the
# backward pass (forward is always deterministic: one program owns each output tile).
last_config = {"config": None, "path": None, "deterministic": False}

# Which forward kernel launch_attention may pick: "auto" (the warp-specialized Hopper kernel where it
# applies, else the portable one) or "portable". Benchmarks set it through ``forward_kernel`` to measure
# the portable kernel side by side with the default.
_kernel_choice = {"kernel": "auto"}


@contextlib.contextmanager
def forward_kernel(kernel: str):
    """``with forward_kernel("portable"): ...`` runs attention / SDPA calls on that kernel."""
    if kernel not in ("auto", "portable"):
        raise ValueError(f"kernel must be 'auto' or 'portable', got {kernel!r}")
    before = _kernel_choice["kernel"]
    _kernel_choice["kernel"] = kernel
    try:
        yield
    finally:
        _kernel_choice["kernel"] = before


def _check_qkv_common(q, k, v, q_name="q", k_name="k", v_name="v", *, ndim=None, min_dim=2):
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        check_tensor(name, t)
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


def _check_scale(scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")


def _precision(q: torch.Tensor) -> str:
    if q.dtype == torch.float32 and not (q.is_cuda and torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"  # fp32 with allow_tf32; ignored by tl.dot for 16-bit operands


def _run(q, k, v, mask, scale, pos_offset, left, right, return_lse, path):
    """q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d], mask None or expanded to [B, Hq, Nq, Nk] (views)."""
    B, Hq, Nq, d = q.shape
    Nk = k.shape[2]
    out = torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device) if return_lse else None
    if out.numel() == 0 or Nk == 0:  # no key at all: every row sees nothing -> 0, lse -inf
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse
    from tilefuse.kernels.attention import launch_attention  # imports triton lazily

    cfg = launch_attention(q, k, v, out, lse, mask, scale=scale, pos_offset=pos_offset,
                           window_left=left, window_right=right, input_precision=_precision(q),
                           interpret=(path == runtime.INTERPRETER), kernel=_kernel_choice["kernel"])
    last_config["config"] = cfg
    return out, lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: tuple[int, int] | None = None, scale: float | None = None,
              return_lse: bool = False, deterministic: bool = False):
    """FlashAttention forward: ``softmax(q k^T * scale) v`` without materialising the scores.

    q: ``[B, Hq, Nq, d]``; k, v: ``[B, Hkv, Nk, d]`` with ``Hq % Hkv == 0`` (query head h reads KV
    head ``h // (Hq // Hkv)``, as ``repeat_interleave`` would, without copying K/V). Positions are
    aligned bottom-right: query row i sits at ``p = i + Nk - Nq``. ``causal=True`` lets it see keys
    ``j <= p``; ``window=(left, right)`` keys ``p - left <= j <= p + right`` (-1: unbounded side;
    with causal, right = 0). A row that sees no key returns 0 (lse -inf). ``scale`` defaults to
    ``d ** -0.5``. ``return_lse=True`` returns ``(out, lse)``, lse fp32 ``[B, Hq, Nq]`` natural log.
    d <= 256; fp16, bf16, fp32 (full fp32 dots unless ``allow_tf32``). Forward only.
    """
    _check_qkv_common(q, k, v, ndim=4)
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}; they must match")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
            raise ValueError(f"window must be None or (left, right) with ints >= -1, got {window!r}")
    _check_scale(scale)
    check_no_grad_needed("attention", q, k, v)
    last_config.update(config=None, path=runtime.execution_path(q), deterministic=bool(deterministic))
    path = last_config["path"]
    if path == runtime.REFERENCE:
        return ref_attention.attention(q, k, v, causal=causal, window=window, scale=scale,
                                       return_lse=return_lse)
    left, right = tuple(window) if window is not None else (-1, -1)
    if causal:
        right = 0
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = _run(q, k, v, None, scale, k.shape[2] - q.shape[2], left, right, return_lse, path)
    return (out, lse) if return_lse else out


def _broadcast_shape(*shapes) -> tuple | None:
    """The broadcast of ``shapes`` (torch's rules), or None if they do not broadcast. Plain Python:
    torch.broadcast_shapes goes through symbolic-shape machinery that costs ~30 us per call."""
    out = [1] * max((len(s) for s in shapes), default=0)
    for shape in shapes:
        for i, d in enumerate(shape, len(out) - len(shape)):
            if d == out[i] or d == 1:
                continue
            if out[i] != 1:
                return None
            out[i] = d
    return tuple(out)


def _broadcast(name, *shapes):
    out = _broadcast_shape(*shapes)
    if out is None:
        raise ValueError(f"{name}: shapes {', '.join(str(tuple(s)) for s in shapes)} do not broadcast")
    return out


def _to_4d(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Expand t to ``shape`` (a view: broadcast dims get stride 0) and present it as 4-D."""
    t = t.expand(shape)
    if len(shape) == 4:
        return t
    if len(shape) == 2:
        return t[None, None]
    if len(shape) == 3:
        return t[:, None]
    return t.reshape(-1, *shape[-3:])  # 5-D and up: leading dims merge (copies only if they must)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (forward, no dropout).

    Same semantics: top-left causal, ``attn_mask`` bool (True = attend) or additive float
    broadcastable to ``[..., Hq, L, S]`` (read with its broadcast strides, never materialised),
    broadcast batch dims, 2-D/3-D inputs, ``enable_gqa``. A row every key of which is masked
    (all False / -inf) gives 0, as torch's math backend does; a finite large negative mask gives
    the uniform average. With both ``is_causal`` and ``attn_mask`` both apply (torch's math
    backend refuses that). value's head dim must equal query's (torch allows Ev != E).
    """
    if dropout_p != 0.0:
        raise NotImplementedError("tilefuse.scaled_dot_product_attention has no dropout; use dropout_p=0.0")
    _check_qkv_common(query, key, value, "query", "key", "value")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"value head dim {value.shape[-1]} != query head dim "
                                  f"{query.shape[-1]}: not supported")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key has {key.shape[-2]} positions but value has {value.shape[-2]}")
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    qb, kb, vb = query.shape[:-2], key.shape[:-2], value.shape[:-2]
    gqa = enable_gqa and len(qb) >= 1 and len(kb) >= 1 and kb[-1] != qb[-1]
    if gqa:
        if kb[-1] == 0 or qb[-1] % kb[-1] or vb[-1] != kb[-1]:
            raise ValueError(f"enable_gqa: query heads ({qb[-1]}) must be a multiple of key/value heads "
                             f"({kb[-1]}, {vb[-1]})")
        batch = _broadcast("query/key/value batch dims", qb[:-1], kb[:-1], vb[:-1])
        hq, hkv = qb[-1], kb[-1]
        q_shape, kv_shape = batch + (hq, L, E), batch + (hkv, S, E)
    else:
        batch = _broadcast("query/key/value batch dims", qb, kb, vb)
        q_shape, kv_shape = batch + (L, E), batch + (S, E)
    out_shape = q_shape
    score_shape = q_shape[:-1] + (S,)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; expected bool or query's dtype {query.dtype}")
        check_same_device("attn_mask", attn_mask, "query", query)
        if _broadcast_shape(attn_mask.shape, score_shape) != score_shape:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                             f"attention weights' shape {score_shape}")
    _check_scale(scale)
    check_no_grad_needed("scaled_dot_product_attention", query, key, value, attn_mask)
    path = runtime.execution_path(query)
    last_config.update(config=None, path=path)
    if path == runtime.REFERENCE:
        return ref_attention.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal,
                                                          scale, enable_gqa)
    q4, k4, v4 = _to_4d(query, q_shape), _to_4d(key, kv_shape), _to_4d(value, kv_shape)
    mask4 = _to_4d(attn_mask, score_shape) if attn_mask is not None else None
    scale = E ** -0.5 if scale is None else float(scale)
    right = 0 if is_causal else -1
    out, _ = _run(q4, k4, v4, mask4, scale, 0, -1, right, False, path)
    return out.reshape(out_shape)

"""tilefuse ops under torch.compile (fullgraph, static and dynamic shapes) and inside CUDA graphs.

On a CPU the kernels run in the Triton interpreter and the backend is "aot_eager" (inductor would need
a C++ toolchain for its own CPU code); on a GPU it is "inductor". A compiled call must give what the
eager call gives (on a CPU: the call on the plain-PyTorch reference path, see ``_eager``), run tilefuse's
kernels (not a fallback), carry gradients for the differentiable ops, and compile with fullgraph=True (which
raises on a graph break). With dynamic=True the compiled function is called on two shapes and must not
recompile. GPU only: every op's forward captured in a CUDA graph
and replayed on new inputs, and a compiled function calling tilefuse ops captured the same way.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse import reference
from tilefuse.opspec import REL_L2_BOUND
from tilefuse.reference import attention as ref_attention
from tilefuse.reference import norms
from tilefuse.reference import softmax as ref_softmax

BACKEND = "inductor" if ON_GPU else "aot_eager"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BOUND = REL_L2_BOUND[DTYPE]
# Rows (or query length) of the first and second call; K and N of the GEMMs and rows; head dim.
SIZES = (257, 300) if ON_GPU else (33, 41)
ATT_SIZES = (257, 300) if ON_GPU else (37, 45)
K, N = (1000, 515) if ON_GPU else (70, 45)
D = 64 if ON_GPU else 16


def _randn(gen, *shape, device, dtype=DTYPE, mean=0.0, std=1.0):
    return (torch.randn(*shape, generator=gen) * std + mean).to(device=device, dtype=dtype)


# Each case: (inputs(n, device, gen) -> tuple of tensors, fn(*inputs) calling the op, op-family words).
# n is the size that changes between the two calls of a dynamic=True compile (rows or query length).
def _x(n, device, gen):
    return _randn(gen, n, K, device=device)


def _w(device, gen, rows=N):
    return _randn(gen, rows, K, device=device, std=K ** -0.5)


def _gamma(device, gen):
    return _randn(gen, K, device=device, mean=1.0, std=0.5)


def _qkv(n, device, gen, hq, hkv):
    return (_randn(gen, 1, hq, n, D, device=device), _randn(gen, 1, hkv, n + 33, D, device=device),
            _randn(gen, 1, hkv, n + 33, D, device=device))


def _rope_tables(n, like, r=16):
    """HF-style (cos, sin) [n, r] built from torch ops, so a compiled function makes them for any n."""
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, device=like.device, dtype=torch.float32) / r))
    freqs = torch.arange(n, device=like.device, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def _masked_qkv(n, device, gen):
    q, k, v = _qkv(n, device, gen, 2, 2)
    mask = torch.rand(1, 1, n, n + 33, generator=gen) > 0.3
    mask[..., 0] = True  # every row sees a key
    return q, k, v, mask.to(device)


CASES = {
    "linear_gelu_bias": (lambda n, d, g: (_x(n, d, g), _w(d, g), _randn(g, N, device=d)),
                         lambda x, w, b: tilefuse.linear(x, w, b, "gelu"), ("linear",)),
    "swiglu_pair": (lambda n, d, g: (_x(n, d, g), _w(d, g), _w(d, g)),
                    lambda x, wg, wu: tilefuse.linear(x, (wg, wu), None, "swiglu"), ("linear",)),
    "layer_norm": (lambda n, d, g: (_x(n, d, g), _gamma(d, g), _randn(g, K, device=d)),
                   lambda x, w, b: tilefuse.layer_norm(x, (K,), w, b), ("norm",)),
    "layer_norm_residual": (lambda n, d, g: (_x(n, d, g), _x(n, d, g), _gamma(d, g), _randn(g, K, device=d)),
                            lambda x, r, w, b: tilefuse.layer_norm(x, (K,), w, b, residual=r), ("norm",)),
    "rms_norm": (lambda n, d, g: (_x(n, d, g), _gamma(d, g)),
                 lambda x, w: tilefuse.rms_norm(x, (K,), w), ("norm",)),
    "rms_norm_residual": (lambda n, d, g: (_x(n, d, g), _x(n, d, g), _gamma(d, g)),
                          lambda x, r, w: tilefuse.rms_norm(x, (K,), w, residual=r), ("norm",)),
    "layer_norm_linear_layer": (
        lambda n, d, g: (_x(n, d, g), _gamma(d, g), _randn(g, K, device=d), _w(d, g), _randn(g, N, device=d)),
        lambda x, nw, nb, w, b: tilefuse.layer_norm_linear(x, nw, nb, w, b, norm="layer", activation="gelu"),
        ("norm", "linear")),
    "layer_norm_linear_rms": (
        lambda n, d, g: (_x(n, d, g), _gamma(d, g), _w(d, g)),
        lambda x, nw, w: tilefuse.layer_norm_linear(x, nw, None, w, norm="rms"), ("norm", "linear")),
    "qkv_rope_norm": (lambda n, d, g: (_x(n, d, g)[None], _w(d, g, rows=2 * 16), _w(d, g, rows=16), _w(d, g, rows=16),
                                       _gamma(d, g)[:16], _gamma(d, g)[:16]),
                      lambda x, wq, wk, wv, nq, nk: tilefuse.qkv_projection(
                          x, (wq, wk, wv), num_heads=2, num_kv_heads=1, rotary=_rope_tables(x.shape[1], x),
                          qk_norm=(nq, nk, 1e-6)), ("qkv",)),
    "attention_varlen": (lambda n, d, g: (_randn(g, n, 4, D, device=d), _randn(g, n + 5, 2, D, device=d),
                                          _randn(g, n + 5, 2, D, device=d),
                                          torch.tensor([0, n // 2, n], dtype=torch.int32, device=d),
                                          torch.tensor([0, n // 2 + 5, n + 5], dtype=torch.int32, device=d)),
                         lambda q, k, v, cq, ck: tilefuse.attention_varlen(q, k, v, cq, ck, q.shape[0], k.shape[0],
                                                                           causal=True, validate=False),
                         ("attention",)),
    # ALiBi with the lse returned, more queries than keys (rows before the keys: the lse handed out is
    # converted from the op's, measured from the nearest key), and flash_attn_func's [B, N, H, d] output.
    "attention_flash_api_alibi_lse": (
        lambda n, d, g: (_randn(g, 2, n, 4, D, device=d), _randn(g, 2, n // 2 + 3, 2, D, device=d),
                         _randn(g, 2, n // 2 + 3, 2, D, device=d)),
        lambda q, k, v: tilefuse.flash_attn_func(q, k, v, alibi_slopes=torch.linspace(0.5, 2.0, 4, device=q.device),
                                                 return_attn_probs=True)[:2], ("attention",)),
    "attention_varlen_alibi_lse": (
        lambda n, d, g: (_randn(g, n, 4, D, device=d), _randn(g, n // 2 + 5, 2, D, device=d),
                         _randn(g, n // 2 + 5, 2, D, device=d),
                         torch.tensor([0, n // 2, n], dtype=torch.int32, device=d),
                         torch.tensor([0, 5, n // 2 + 5], dtype=torch.int32, device=d)),
        lambda q, k, v, cq, ck: tilefuse.attention_varlen(
            q, k, v, cq, ck, q.shape[0], k.shape[0], alibi_slopes=torch.linspace(0.5, 2.0, 4, device=q.device),
            return_lse=True, validate=False), ("attention",)),
    "softmax_last": (lambda n, d, g: (_x(n, d, g),), lambda x: tilefuse.softmax(x, dim=-1), ("softmax",)),
    "softmax_dim0": (lambda n, d, g: (_x(n, d, g),), lambda x: tilefuse.softmax(x, dim=0), ("softmax",)),
    "attention_causal_gqa": (lambda n, d, g: _qkv(n, d, g, 4, 2),
                             lambda q, k, v: tilefuse.attention(q, k, v, causal=True), ("attention",)),
    "sdpa_bool_mask": (_masked_qkv,
                       lambda q, k, v, m: tilefuse.scaled_dot_product_attention(q, k, v, attn_mask=m),
                       ("attention", "sdpa")),
}
FORWARD_CASES = [c for c in CASES if c != "rms_norm_residual"]
GRAD_CASES = ["linear_gelu_bias", "swiglu_pair", "layer_norm", "layer_norm_residual", "rms_norm", "rms_norm_residual",
              "layer_norm_linear_layer", "layer_norm_linear_rms", "softmax_last", "softmax_dim0", "attention_causal_gqa",
              "sdpa_bool_mask", "qkv_rope_norm", "attention_varlen", "attention_flash_api_alibi_lse",
              "attention_varlen_alibi_lse"]


def _sizes(case):
    return ATT_SIZES if "attention" in case or "sdpa" in case else SIZES


def _compile(fn, dynamic, backend=BACKEND):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, fullgraph=True, backend=counter, dynamic=dynamic), counter


def _graphs(counter, i, first):
    """The number of graphs compiled by the first call (i == 0); a later call, on a new shape under
    dynamic=True, must reuse them: a compile that recompiles for each shape is not dynamic."""
    if i == 0:
        assert counter.frame_count >= 1, "torch.compile never compiled the function"
        return counter.frame_count
    assert counter.frame_count == first, f"recompiled for a new shape: {first} graph(s), then {counter.frame_count}"
    return first


def _eager(fn, args, monkeypatch, grads_seed=None):
    """What the eager call gives: on a GPU the eager call itself; on a CPU the same call on the plain-PyTorch
    reference path (TRITON_INTERPRET unset for it), which the rest of the suite holds the interpreted kernels
    to, so the compiled kernels are compared without running the interpreter a second time."""
    with monkeypatch.context() as m:
        if not ON_GPU:
            m.delenv("TRITON_INTERPRET", raising=False)
        if grads_seed is None:
            with torch.no_grad():
                return fn(*args)
        return _grads(fn, args, grads_seed)


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_compiled_forward_matches_eager_and_runs_tilefuse_kernels(device, case, monkeypatch):
    """Static shapes, no autograd: the compiled call's launches are tilefuse's kernels (never the reference),
    and its output is the eager call's."""
    from tilefuse.kernels.launches import recording

    make, fn, family = CASES[case]
    cfn, counter = _compile(fn, dynamic=False)
    args = make(_sizes(case)[0], device, torch.Generator().manual_seed(10))
    with torch.no_grad():
        cfn(*args)  # compiles outside the recording: only the compiled call's launches are recorded
        with recording() as recs:
            got = cfn(*args)
    _graphs(counter, 0, None)
    assert len(recs) >= 1, f"{case}: the compiled call launched no tilefuse kernel"
    for rec in recs:
        assert rec.path != "reference", f"{case}: compiled call fell back to the reference ({rec})"
        if not ON_GPU:
            assert rec.path == "interpreter", f"{case}: path {rec.path!r} on a CPU"
        assert any(word in str(rec.op) for word in family), f"{case}: record of op {rec.op!r}"
    assert_close(got, _eager(fn, args, monkeypatch), BOUND, f"{case} compiled vs eager")


def _grads(fn, args, seed):
    """Outputs and d/d(every input) of sum(out * g) for random g, with fresh leaves."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * _randn(gen, *o.shape, device=o.device, dtype=o.dtype)).sum() for o in outs)
    grads = iter(torch.autograd.grad(loss, [t for t in leaves if t.requires_grad]))
    return outs, [next(grads) if t.requires_grad else None for t in leaves]  # None: a bool mask


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", GRAD_CASES)
def test_compiled_gradients_match_eager(device, case, dynamic, monkeypatch):
    """Forward and gradients of the compiled call against the eager call's; with dynamic=True on two
    shapes, the second compiled without a recompile."""
    make, fn, _ = CASES[case]
    cfn, counter = _compile(fn, dynamic)
    sizes, first = (SIZES if dynamic else SIZES[:1]), None
    for i, n in enumerate(sizes):
        args = make(n, device, torch.Generator().manual_seed(20 + i))
        got_out, got = _grads(cfn, args, seed=30 + i)
        first = _graphs(counter, i, first)
        want_out, want = _eager(fn, args, monkeypatch, grads_seed=30 + i)
        assert_close(got_out, want_out, BOUND, f"{case} n={n} forward")
        for j, (g, w) in enumerate(zip(got, want)):
            if not args[j].is_floating_point():
                continue
            assert g is not None and g.shape == args[j].shape, f"{case}: gradient of input {j}"
            assert_close(g, w, BOUND, f"{case} n={n} d(input {j}) compiled vs eager")


def test_the_first_compiled_call_of_a_process_is_not_recompiled_for_a_new_shape(device, monkeypatch):
    """The ops look up torch's DTensor class lazily and cache it in a module global: a compiled function must not
    depend on that global (dynamo guarded on it, so a dynamic compile made before the first lookup recompiled
    once the eager call between set it)."""
    from tilefuse.ops import _dtensor

    monkeypatch.setattr(_dtensor, "_DTENSOR", None)  # as in a fresh process
    make, fn, _ = CASES["rms_norm"]
    cfn, counter = _compile(fn, dynamic=True)
    for i, n in enumerate(SIZES):
        args = make(n, device, torch.Generator().manual_seed(40 + i))
        with torch.no_grad():
            got = cfn(*args)
            assert_close(got, fn(*args), BOUND, f"rms_norm n={n} compiled vs eager")
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two shapes under dynamic=True"


# ---- GPU only: CUDA graphs -------------------------------------------------------------------------
BF16 = torch.bfloat16


def _big(*shape, seed, std=1.0, mean=0.0):
    return _randn(torch.Generator().manual_seed(seed), *shape, device="cuda", dtype=BF16, mean=mean, std=std)


def _linear_inputs(M, K_, N_, seed, gated=False):
    x, w = _big(M, K_, seed=seed), _big(N_, K_, seed=seed + 1, std=K_ ** -0.5)
    return (x, w, _big(N_, K_, seed=seed + 2, std=K_ ** -0.5)) if gated else (x, w, _big(N_, seed=seed + 2))


def _norm_inputs(M, K_, seed, residual=False, bias=True):
    x = [_big(M, K_, seed=seed)] + ([_big(M, K_, seed=seed + 1)] if residual else [])
    return (*x, _big(K_, seed=seed + 2, mean=1.0, std=0.5), *([_big(K_, seed=seed + 3)] if bias else []))


def _att_inputs(B, Hq, Hkv, Nq, Nk, d, seed, mask=False):
    q, k, v = _big(B, Hq, Nq, d, seed=seed), _big(B, Hkv, Nk, d, seed=seed + 1), _big(B, Hkv, Nk, d, seed=seed + 2)
    if not mask:
        return q, k, v
    m = torch.rand(B, 1, Nq, Nk, generator=torch.Generator().manual_seed(seed + 3)) > 0.3
    m[..., 0] = True
    return q, k, v, m.cuda()


RMS_EPS = 1e-6
# name: (inputs(seed) -> tuple, fn(*inputs) the op, ref(*float64 inputs) its float64 reference)
GRAPH_CASES = {
    "linear_257x1000x515": (lambda s: _linear_inputs(257, 1000, 515, s),
                            lambda x, w, b: tilefuse.linear(x, w, b, "gelu"),
                            lambda x, w, b: reference.linear(x, w, b, "gelu")),
    "linear_decode_m1_4096": (lambda s: _linear_inputs(1, 4096, 4096, s),  # split-K
                              lambda x, w, b: tilefuse.linear(x, w, b, "gelu"),
                              lambda x, w, b: reference.linear(x, w, b, "gelu")),
    "swiglu_257x1000x515": (lambda s: _linear_inputs(257, 1000, 515, s, gated=True),
                            lambda x, wg, wu: tilefuse.linear(x, (wg, wu), None, "swiglu"),
                            lambda x, wg, wu: reference.gated_linear(x, wg, wu, None, None, "swiglu")),
    "swiglu_decode_m1_4096": (lambda s: _linear_inputs(1, 4096, 4096, s, gated=True),
                              lambda x, wg, wu: tilefuse.linear(x, (wg, wu), None, "swiglu"),
                              lambda x, wg, wu: reference.gated_linear(x, wg, wu, None, None, "swiglu")),
    "layer_norm_1000x4096": (lambda s: _norm_inputs(1000, 4096, s),
                             lambda x, w, b: tilefuse.layer_norm(x, (4096,), w, b),
                             lambda x, w, b: norms.layer_norm(x, (4096,), w, b, 1e-5)),
    "layer_norm_residual_1000x4096": (
        lambda s: _norm_inputs(1000, 4096, s, residual=True),
        lambda x, r, w, b: tilefuse.layer_norm(x, (4096,), w, b, residual=r),
        lambda x, r, w, b: norms.layer_norm(x, (4096,), w, b, 1e-5, residual=r)),
    "rms_norm_1000x4096": (lambda s: _norm_inputs(1000, 4096, s, bias=False),
                           lambda x, w: tilefuse.rms_norm(x, (4096,), w, RMS_EPS),
                           lambda x, w: norms.rms_norm(x, (4096,), w, RMS_EPS)),
    "rms_norm_residual_1000x4096": (
        lambda s: _norm_inputs(1000, 4096, s, residual=True, bias=False),
        lambda x, r, w: tilefuse.rms_norm(x, (4096,), w, RMS_EPS, residual=r),
        lambda x, r, w: norms.rms_norm(x, (4096,), w, RMS_EPS, residual=r)),
    "layer_norm_linear_layer_257x1000x515": (
        lambda s: (*_norm_inputs(257, 1000, s), *_linear_inputs(1, 1000, 515, s + 10)[1:]),
        lambda x, nw, nb, w, b: tilefuse.layer_norm_linear(x, nw, nb, w, b, eps=1e-5, norm="layer", activation="gelu"),
        lambda x, nw, nb, w, b: norms.layer_norm_linear(x, nw, nb, w, b, eps=1e-5, norm="layer", activation="gelu")),
    "layer_norm_linear_rms_257x1000x515": (
        lambda s: (*_norm_inputs(257, 1000, s, bias=False), _linear_inputs(1, 1000, 515, s + 10)[1]),
        lambda x, nw, w: tilefuse.layer_norm_linear(x, nw, None, w, eps=RMS_EPS, norm="rms"),
        lambda x, nw, w: norms.layer_norm_linear(x, nw, None, w, eps=RMS_EPS, norm="rms")),
    "softmax_257x1000": (lambda s: (_big(257, 1000, seed=s),), lambda x: tilefuse.softmax(x, dim=-1),
                         lambda x: ref_softmax.softmax(x, -1)),
    "softmax_dim0_257x1000": (lambda s: (_big(257, 1000, seed=s),), lambda x: tilefuse.softmax(x, dim=0),
                              lambda x: ref_softmax.softmax(x, 0)),
    "attention_B2_H8_N1000_d128_causal": (
        lambda s: _att_inputs(2, 8, 8, 1000, 1000, 128, s), lambda q, k, v: tilefuse.attention(q, k, v, causal=True),
        lambda q, k, v: ref_attention.attention(q, k, v, causal=True, window=None, scale=None, return_lse=False)),
    "attention_gqa_B2_H8kv2_N1000_d128_causal": (
        lambda s: _att_inputs(2, 8, 2, 1000, 1000, 128, s), lambda q, k, v: tilefuse.attention(q, k, v, causal=True),
        lambda q, k, v: ref_attention.attention(q, k, v, causal=True, window=None, scale=None, return_lse=False)),
    "sdpa_mask_B2_H8_N1000_d128": (
        lambda s: _att_inputs(2, 8, 8, 1000, 1000, 128, s, mask=True),
        lambda q, k, v, m: tilefuse.scaled_dot_product_attention(q, k, v, attn_mask=m),
        lambda q, k, v, m: ref_attention.scaled_dot_product_attention(q, k, v, m, 0.0, False, None, False)),
}


def _capture_and_replay(fn, static, fresh):
    """Warm fn up on a side stream, capture one call, copy fresh data into the static inputs, replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for t, new in zip(static, fresh):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    return out


def _double(t):
    return t.double() if t.is_floating_point() else t


@pytest.mark.gpu_only
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_cuda_graph_replay_on_new_inputs(case):
    make, fn, ref = GRAPH_CASES[case]
    static, fresh = make(0), make(100)
    with torch.no_grad():
        out = _capture_and_replay(fn, static, fresh)
        want = ref(*(_double(t) for t in fresh))
    assert_close(out, want, REL_L2_BOUND[BF16], f"{case} replayed on new inputs")


def _block(x, nw, nb, w, b):
    """A small layer: LayerNorm -> Linear(gelu) -> softmax, each a tilefuse op."""
    return tilefuse.softmax(tilefuse.linear(tilefuse.layer_norm(x, (x.shape[-1],), nw, nb), w, b, "gelu"), dim=-1)


def _block_reference(x, nw, nb, w, b):
    return ref_softmax.softmax(reference.linear(norms.layer_norm(x, (x.shape[-1],), nw, nb, 1e-5), w, b, "gelu"), -1)


@pytest.mark.gpu_only
def test_cuda_graph_of_a_compiled_function():
    def make(s):
        return (*_norm_inputs(257, 1000, s), *_linear_inputs(1, 1000, 515, s + 10)[1:])

    cfn, counter = _compile(_block, dynamic=False, backend="inductor")
    static, fresh = make(0), make(100)
    with torch.no_grad():
        out = _capture_and_replay(cfn, static, fresh)
        want = _block_reference(*(t.double() for t in fresh))
    assert counter.frame_count == 1
    assert_close(out, want, REL_L2_BOUND[BF16], "compiled block replayed on new inputs")


# ---- the backward ops' contract with torch.library, under each backend ---------------------------------------
@pytest.mark.parametrize("backend", ["tilefuse", "vendor"])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False), (True, False, False)],
                         ids=["all", "dw", "dx"])
def test_linear_backward_ops_pass_opcheck(device, backend, needs):
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) of the plain and gated
    backward ops: no output may alias an input or another output (a compiled graph's functionalization relies on
    it), whichever backend's form runs -- the vendor's gated form once returned both dW as views of one GEMM."""
    g = torch.Generator().manual_seed(3)
    M, K, N = 16, 24, 8
    x, dy, s_gate, s_up = (_randn(g, *shape, device=device) for shape in ((M, K), (M, N), (M, N), (M, N)))
    w_gate, w_up = _randn(g, N, K, device=device), _randn(g, N, K, device=device)
    with tilefuse.use_backend(backend):
        torch.library.opcheck(torch.ops.tilefuse.gated_linear_backward, (dy, x, w_gate, w_up, s_gate, s_up, *needs))
        torch.library.opcheck(torch.ops.tilefuse.linear_backward, (dy, x, w_gate, s_gate, *needs))

"""The backend an op takes (TILEFUSE_BACKEND, tilefuse.use_backend) and the measured choice between tilefuse's
kernels and the vendor's composition (tuning.choices), for the families that have a vendor candidate: norms,
softmax, the GEMMs and attention."""
import threading

import pytest
import torch
import triton

import tilefuse
from helpers import assert_close, check_against_reference
from tilefuse import registry, runtime, tuning
from tilefuse.opspec import default_tolerance
from tilefuse.kernels import launches
from tilefuse.tuning import choices

VENDOR_OPS = ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward", "softmax", "softmax_backward",
              "layer_norm_linear"]


def test_backend_comes_from_the_block_then_the_environment(monkeypatch):
    monkeypatch.delenv("TILEFUSE_BACKEND", raising=False)
    assert runtime.backend() == "auto"
    monkeypatch.setenv("TILEFUSE_BACKEND", "Vendor")
    assert runtime.backend() == "vendor"
    with tilefuse.use_backend("tilefuse"):
        assert runtime.backend() == "tilefuse"
        with tilefuse.use_backend("auto"):
            assert runtime.backend() == "auto"
        assert runtime.backend() == "tilefuse"
    assert runtime.backend() == "vendor"


def test_a_block_holds_in_the_threads_autograd_runs_a_backward_on():
    """On CUDA, autograd runs a backward on its own device thread: a block set per thread (a context variable)
    would leave that backward on the environment's backend."""
    seen, before = [], runtime.backend()
    with tilefuse.use_backend("vendor" if before != "vendor" else "tilefuse"):
        worker = threading.Thread(target=lambda: seen.append(runtime.backend()))
        worker.start()
        worker.join()
    assert seen == ["vendor" if before != "vendor" else "tilefuse"]
    assert runtime.backend() == before


def test_bad_backend_names_are_refused_naming_where_they_came_from(monkeypatch, device):
    with pytest.raises(ValueError, match="use_backend"):
        with tilefuse.use_backend("cudnn"):
            pass
    assert runtime.backend() in runtime.BACKENDS  # the refused block left nothing behind
    monkeypatch.setenv("TILEFUSE_BACKEND", "fastest")
    x = torch.randn(3, 8, device=device)
    if runtime.execution_path(x) == runtime.REFERENCE:
        pytest.skip("no launch layer on this path: nothing reads the backend")
    with pytest.raises(ValueError, match="TILEFUSE_BACKEND"):
        tilefuse.layer_norm(x, 8)


# the launch records' names of vendor compositions
VENDOR_KERNELS = {"torch", "cublas", "cublaslt_epilogue", "sdpa_cudnn", "sdpa_flash"}
SMALL_LINEAR = dict(shape=(33, 70, 45), dtype=torch.bfloat16, bias=True)
VENDOR_CASES = [(name, None) for name in VENDOR_OPS] + [
    # linear: cuBLASLt's epilogue takes relu and tanh-GELU with a bias (CUDA: on the CPU torch's op applies the erf
    # GELU); every other activation, or no bias, F.linear then torch's activation in place
    ("linear", dict(SMALL_LINEAR, activation=a)) for a in ("relu", "gelu_tanh", "gelu", "silu", None)] + [
    ("linear", dict(SMALL_LINEAR, activation="relu", bias=False)),
    ("linear", dict(SMALL_LINEAR, dtype=torch.float32, activation="gelu_tanh"))] + [
    # gated: a cuBLAS GEMM per half (whichever weight form), then the gate kernel adding the biases
    ("gated_linear", dict(SMALL_LINEAR, activation="swiglu")),
    ("gated_linear", dict(SMALL_LINEAR, activation="geglu", weight_form="concat", dtype=torch.float16)),
    ("gated_linear", dict(SMALL_LINEAR, activation="geglu_tanh", bias=False, dtype=torch.float32))] + [
    # layer_norm_linear: the norm's entry (its own choice: torch's kernel under vendor), then F.linear and the
    # activation
    ("layer_norm_linear", dict(shape=(33, 70, 45), dtype=torch.bfloat16, norm="rms", activation="gelu"))] + [
    # attention: SDPA's kernels where their semantics are the call's (one key head per query head, full or causal
    # from the top-left corner), forward with and without the lse, and the backward after a vendor forward
    ("attention", dict(shape=(1, 2, 2, 70, 70), d=32, dtype=torch.bfloat16, mode=(True, None), return_lse=True)),
    ("attention", dict(shape=(2, 2, 2, 17, 130), d=64, dtype=torch.float16, mode=(False, None))),
    ("attention_backward", dict(shape=(1, 2, 2, 70, 70), d=32, dtype=torch.bfloat16, mode=(True, None))),
    ("attention_backward", dict(shape=(1, 2, 2, 40, 90), d=64, dtype=torch.float16, mode=(False, None)))]


# linear's cases under auto and tilefuse run tilefuse's kernels, as the registry's grid does already
BACKEND_CASES = [(name, case, mode) for name, case in VENDOR_CASES for mode in ("auto", "tilefuse", "vendor")
                 if case is None or mode == "vendor"]


@pytest.mark.parametrize("name,case,mode", BACKEND_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_ops_match_float64_under_each_backend_and_say_which_ran(name, case, mode, device):
    spec = registry.get(name)
    params = case or spec.accuracy_cases["gpu" if device.type == "cuda" else "cpu"][0]
    with tilefuse.use_backend(mode), launches.recording() as recs:
        check_against_reference(spec, params, device, seed=3)
    kernels = {r.kernel for r in recs if r.path != runtime.REFERENCE}
    if runtime.execution_path(torch.empty(0, device=device)) == runtime.REFERENCE:
        return  # no launch layer on this path
    if mode == "vendor":
        # aten's fused RMSNorm backward has CUDA kernels only: elsewhere that backward stays tilefuse's.
        tilefuse_only = {"rms_norm_backward"} if device.type != "cuda" else set()
        assert {r.kernel for r in recs if r.op not in tilefuse_only} <= VENDOR_KERNELS, recs
        if name == "gated_linear":
            biased = " with the biases" if case["bias"] else ""
            assert [r.config for r in recs] == [f"a cuBLAS GEMM per half, then the {case['activation']} gate kernel"
                                                + biased], recs
        if name == "linear":
            epilogue = device.type == "cuda" and case["bias"] and case["activation"] in ("relu", "gelu_tanh")
            assert {r.kernel for r in recs} <= ({"cublaslt_epilogue", "cublas"} if epilogue else {"cublas"}), recs
        assert all(r.kernel == "" for r in recs if r.op in tilefuse_only), recs
    elif mode == "tilefuse" or device.type == "cpu" or not tuning.autotune_enabled():
        assert not kernels & VENDOR_KERNELS, recs  # auto measures only on a GPU with tuning on


def test_vendor_gated_linear_over_separate_weights_runs_two_gemms(device):
    x = torch.randn(2, 9, 40, device=device, dtype=torch.bfloat16)
    w_gate, w_up = (torch.randn(24, 40, device=device, dtype=torch.bfloat16) / 6 for _ in range(2))
    b_gate, b_up = (torch.randn(24, device=device, dtype=torch.bfloat16) for _ in range(2))
    with tilefuse.use_backend("vendor"), launches.recording() as recs:
        y = tilefuse.linear(x, (w_gate, w_up), (b_gate, b_up), activation="swiglu")
    d = [t.double() for t in (x, w_gate, w_up, b_gate, b_up)]
    ref = torch.nn.functional.silu(d[0] @ d[1].T + d[3]) * (d[0] @ d[2].T + d[4])
    assert y.shape == (2, 9, 24) and y.dtype == x.dtype
    assert_close(y, ref, default_tolerance(x.dtype), "swiglu over separate weights, vendor")
    if runtime.execution_path(x) != runtime.REFERENCE:
        assert [(r.kernel, r.config) for r in recs] == [
            ("cublas", "a cuBLAS GEMM per half, then the swiglu gate kernel with the biases")]


@pytest.mark.parametrize("name,params", [
    ("linear_train", dict(SMALL_LINEAR, activation="gelu")),
    ("linear_train", dict(SMALL_LINEAR, activation=None, dtype=torch.float32)),
    ("linear_train", dict(SMALL_LINEAR, activation="relu", layout="x_transposed")),
    ("gated_linear_train", dict(SMALL_LINEAR, activation="swiglu")),
    ("gated_linear_train", dict(SMALL_LINEAR, activation="geglu", bias=False, weight_form="concat")),
    ("layer_norm_linear_train", dict(shape=(33, 70, 45), dtype=torch.bfloat16, norm="layer", bias=True,
                                     activation="gelu"))])
def test_vendor_training_step_takes_cublas_for_both_passes(name, params, device):
    """Under vendor a training step is cuBLAS's both ways: the forward's GEMM(s), then one pass storing y and the
    slope(s) the backward reads (as tilefuse's fused epilogue stores them); the backward g = dy * slope, then
    cuBLAS's dx and dW GEMMs and db from g. Gradients against float64."""
    spec = registry.get(name)
    with tilefuse.use_backend("vendor"), launches.recording() as recs:
        check_against_reference(spec, params, device, seed=5)
    if runtime.execution_path(torch.empty(0, device=device)) == runtime.REFERENCE:
        return
    backward = [r for r in recs if r.op == "linear_backward"]
    assert backward and {r.kernel for r in backward} == {"cublas"}, recs
    forward = [r for r in recs if r.op == "linear"]
    assert forward and {r.kernel for r in forward} == {"cublas"}, recs
    if params["activation"] is not None:  # the slope(s) made by the pass after cuBLAS
        assert all("slope" in r.config for r in forward), recs
    if params["activation"] == "relu":  # relu's step taken from an fp32 pre-activation (launch.py says why)
        assert all(r.config.startswith("F.linear in fp32") for r in forward), recs
    if name == "gated_linear_train":  # dx one GEMM per half, whichever weight form
        assert all("dx and dW GEMMs per half" in r.config for r in backward), recs


def test_vendor_gated_training_over_separate_weights_and_an_expanded_dy(device):
    """The gated backward's cuBLAS form with W_gate and W_up two tensors (dx as two GEMMs, the second accumulated;
    each dW its own GEMM, in its weight's layout) and the expanded dy of ``y.sum()`` (stride 0, which the
    one pass making g reads as a dense copy): every gradient matches float64."""
    x = torch.randn(2, 9, 40, device=device, dtype=torch.bfloat16, requires_grad=True)
    w_gate, w_up = ((torch.randn(24, 40, device=device, dtype=torch.bfloat16) / 6).requires_grad_() for _ in range(2))
    b_gate, b_up = (torch.randn(24, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    leaves = (x, w_gate, w_up, b_gate, b_up)
    with tilefuse.use_backend("vendor"), launches.recording() as recs:
        y = tilefuse.linear(x, (w_gate, w_up), (b_gate, b_up), activation="swiglu")
        grads = torch.autograd.grad(y.sum(), leaves)
    d = [t.detach().double().requires_grad_() for t in leaves]
    ref = torch.nn.functional.silu(d[0] @ d[1].T + d[3]) * (d[0] @ d[2].T + d[4])
    want = torch.autograd.grad(ref.sum(), d)
    for got, w_, name in zip(grads, want, ("dx", "dW_gate", "dW_up", "db_gate", "db_up")):
        assert got.shape == w_.shape and got.dtype == x.dtype
        assert_close(got, w_, default_tolerance(x.dtype), f"vendor gated backward: {name}")
    if runtime.execution_path(x) != runtime.REFERENCE:
        [bwd] = [r for r in recs if r.op == "linear_backward"]
        assert bwd.kernel == "cublas" and "stacked" not in bwd.config, recs


def test_vendor_norm_with_mixed_parameter_dtypes_takes_tilefuses_kernel(device):
    x = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, device=device)  # fp32 beside bf16 x: torch's kernels differ in how they treat it
    with tilefuse.use_backend("vendor"), launches.recording() as recs:
        y = tilefuse.rms_norm(x, 64, w)
    ref = torch.nn.functional.rms_norm(x.double(), (64,), w.double())
    assert y.dtype == x.dtype
    assert_close(y, ref, default_tolerance(x.dtype), "rms_norm, fp32 weight, bf16 x")
    if runtime.execution_path(x) != runtime.REFERENCE:
        assert [r.kernel for r in recs] == [""], recs


def _attention_inputs(device, dtype, B=1, Hq=2, Hkv=2, Nq=40, Nk=40, d=32, grad=True):
    g = torch.Generator(device="cpu").manual_seed(11)
    return [torch.randn(B, h, n, d, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
            for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk))]


def _attention_grads(q, k, v, dout, attention=tilefuse.attention, **kwargs):
    """(out, dq, dk, dv) of ``attention(q, k, v, **kwargs)`` with the incoming gradient dout."""
    out = attention(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _attention_float64(q, k, v, dout, **kwargs):
    from tilefuse.reference import attention as ref_attention

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    return _attention_grads(*leaves, dout.double(), attention=ref_attention.attention, **kwargs)


@pytest.mark.parametrize("what,kwargs,shape", [
    ("causal from the bottom-right corner", dict(causal=True), dict(Nq=17, Nk=40)),
    ("a window", dict(window=(8, 3)), {}),
    ("a softcap", dict(causal=True, softcap=5.0), {}),
    ("ALiBi", dict(alibi_slopes="per head"), {})])
def test_vendor_attention_without_sdpas_semantics_takes_tilefuses_kernels(what, kwargs, shape, device):
    """SDPA has top-left causal only, no window, softcap or ALiBi: such calls stay tilefuse's under vendor, forward
    and backward, and still match float64."""
    q, k, v = _attention_inputs(device, torch.bfloat16, **shape)
    if kwargs.get("alibi_slopes"):
        kwargs = dict(kwargs, alibi_slopes=torch.rand(q.shape[1], device=device))
    dout = torch.randn_like(q)
    with tilefuse.use_backend("vendor"), launches.recording() as recs:
        got = _attention_grads(q, k, v, dout, **kwargs)
    for g, r, name in zip(got, _attention_float64(q, k, v, dout, **kwargs), ("out", "dq", "dk", "dv")):
        assert_close(g, r, default_tolerance(q.dtype), f"{what}: {name}")
    if runtime.execution_path(q) != runtime.REFERENCE:
        assert {r.op for r in recs} == {"attention", "attention_backward"}, recs
        assert not {r.kernel for r in recs} & VENDOR_KERNELS, recs


def test_vendor_gqa_takes_sdpa_on_cuda_and_tilefuses_on_the_cpu(device):
    """Grouped key heads (4 query heads over 2 key heads): on CUDA both SDPA kernels take them as they are, so
    under vendor the forward and the backward are SDPA's; torch's CPU flash kernel has one key head per query
    head, so on the CPU the call stays tilefuse's. Either way out, dq, dk, dv match float64."""
    q, k, v = _attention_inputs(device, torch.bfloat16, Hq=4, Hkv=2)
    dout = torch.randn_like(q)
    with tilefuse.use_backend("vendor"), launches.recording() as recs:
        got = _attention_grads(q, k, v, dout, causal=True)
    for g, r, name in zip(got, _attention_float64(q, k, v, dout, causal=True), ("out", "dq", "dk", "dv")):
        assert_close(g, r, default_tolerance(q.dtype), f"GQA: {name}")
    if runtime.execution_path(q) != runtime.REFERENCE:
        kinds = {r.op: r.kernel for r in recs}
        assert set(kinds) == {"attention", "attention_backward"}, recs
        for op, kernel in kinds.items():
            assert (kernel in VENDOR_KERNELS) == (device.type == "cuda"), (op, recs)


def test_vendor_sdpa_causal_with_fewer_queries_than_keys_takes_tilefuses(device):
    """SDPA's causal mask from the top-left corner, 17 queries over 40 keys: the flash kernel would put the corner
    bottom-right, so the call stays tilefuse's, and matches float64."""
    q, k, v = _attention_inputs(device, torch.bfloat16, Nq=17, Nk=40, grad=False)
    with tilefuse.use_backend("vendor"), launches.recording() as recs:
        out = tilefuse.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert_close(out, ref, default_tolerance(q.dtype), "top-left causal, 17 queries over 40 keys")
    if runtime.execution_path(q) != runtime.REFERENCE:
        assert recs and not {r.kernel for r in recs} & VENDOR_KERNELS, recs


@pytest.mark.parametrize("how", ["argument", "torch flag"])
def test_a_deterministic_backward_stays_tilefuses_under_vendor(how, device):
    """SDPA's backwards may accumulate dQ in an order that varies run to run: ``deterministic=True``, or torch's
    deterministic algorithms, keep the backward on tilefuse's kernels (the forward may still be SDPA's)."""
    q, k, v = _attention_inputs(device, torch.bfloat16)
    dout = torch.randn_like(q)
    saved = torch.are_deterministic_algorithms_enabled()
    try:
        with tilefuse.use_backend("vendor"), launches.recording() as recs:
            if how == "torch flag":
                torch.use_deterministic_algorithms(True)
            got = _attention_grads(q, k, v, dout, causal=True, deterministic=how == "argument")
    finally:
        torch.use_deterministic_algorithms(saved)
    for g, r, name in zip(got, _attention_float64(q, k, v, dout, causal=True), ("out", "dq", "dk", "dv")):
        assert_close(g, r, default_tolerance(q.dtype), f"deterministic ({how}): {name}")
    if runtime.execution_path(q) != runtime.REFERENCE:
        kinds = {r.op: r.kernel for r in recs}
        assert kinds["attention"] in VENDOR_KERNELS and kinds["attention_backward"] not in VENDOR_KERNELS, recs


@pytest.mark.parametrize("mode", ["tilefuse", "vendor"])
def test_attention_backward_with_an_lse_gradient_takes_tilefuses(mode, device):
    """SDPA's backward has no gradient through the lse: a loss that reads it keeps tilefuse's backward, under
    vendor after SDPA's forward. lse.sum() hands the backward an expanded dlse (one element, stride 0), which the
    kernels must not read as a full [B, H, N] tensor."""
    q, k, v = _attention_inputs(device, torch.float16)
    with tilefuse.use_backend(mode), launches.recording() as recs:
        out, lse = tilefuse.attention(q, k, v, causal=True, return_lse=True)
        grads = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    scores = (leaves[0] @ leaves[1].transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool, device=device).triu(1), float("-inf"))
    ref = torch.autograd.grad((scores.softmax(-1) @ leaves[2]).sum() + scores.logsumexp(-1).sum(), leaves)
    for g, r, name in zip(grads, ref, ("dq", "dk", "dv")):
        assert_close(g, r, default_tolerance(q.dtype), f"lse gradient: {name}")
    if runtime.execution_path(q) != runtime.REFERENCE:
        kinds = {r.op: r.kernel for r in recs}
        assert (kinds["attention"] in VENDOR_KERNELS) == (mode == "vendor"), recs
        assert kinds["attention_backward"] not in VENDOR_KERNELS, recs


SDPA_BACKENDS = ["sdpa_cudnn", "sdpa_flash"]


@pytest.mark.parametrize("forward_backend", ["tilefuse", "vendor"])
@pytest.mark.parametrize("candidate", SDPA_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,Hq,Hkv", [(64, 2, 2), (256, 2, 2), (64, 4, 2)])
def test_each_sdpa_candidate_matches_float64_after_either_forward(candidate, forward_backend, causal, d, Hq, Hkv,
                                                                  device):
    """Each SDPA candidate on its own (on the CPU both are torch's CPU flash kernel), its backward reading the lse
    of tilefuse's forward as well as of its own: the two forwards' lse must mean the same thing (fp32 natural
    log, [B, H, Nq]). A noncontiguous dout takes out's layout first. d 256: cuDNN's on Hopper too; 4 query heads
    over 2 key heads (GQA, query head h reading key head h // 2): on CUDA, dK and dV summed over each group."""
    from tilefuse.kernels.attention import launch

    if device.type == "cpu" and candidate != "sdpa_flash":
        pytest.skip("off CUDA both candidates are torch's CPU flash kernel: sdpa_flash's case runs it")
    if device.type == "cpu" and Hq != Hkv:
        pytest.skip("torch's CPU flash kernel takes one key head per query head")
    if device.type == "cuda" and candidate == "sdpa_cudnn" and d > launch._cudnn_max_head_dim(device):
        pytest.skip(f"cuDNN's SDPA takes d {d} on Hopper only")
    q, k, v = _attention_inputs(device, torch.bfloat16, B=2, Hq=Hq, Hkv=Hkv, Nq=70, Nk=70 if causal else 90, d=d,
                                grad=False)
    if device.type == "cuda":
        assert candidate in launch.sdpa_candidates(q, k, v, None, 0, -1, 0 if causal else -1, None, None, None)
    path = runtime.execution_path(q)
    if path == runtime.REFERENCE:
        pytest.skip("the candidates are the launch layer's; this path has none")
    dout = torch.randn(2, 70, Hq, d, device=device, dtype=q.dtype).transpose(1, 2)  # [B, H, N, d] strided
    right = 0 if causal else -1
    if forward_backend == "tilefuse":
        out, lse = launch._forward(q, k, v, None, 0.125, 0, -1, right, True, path, "auto", None, None, None, False,
                                   runtime.precision_for(q.dtype, q.is_cuda))
    else:
        out, lse = launch._forward_sdpa(candidate, q, k, v, 0.125, causal, True, False, path)
    assert lse.shape == (2, Hq, 70) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.is_contiguous()
    dq, dk, dv, _ = launch._backward_sdpa(candidate, dout, q, k, v, out, lse, 0.125, causal, path)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(70, k.shape[2], dtype=torch.bool, device=device).triu(1) if causal else None
    k_ref, v_ref = (t.repeat_interleave(Hq // Hkv, dim=1) for t in leaves[1:])
    scores = (leaves[0] @ k_ref.transpose(-1, -2)) * 0.125
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    ref = scores.softmax(-1) @ v_ref
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    bound = default_tolerance(q.dtype)
    assert_close(out, ref, bound, f"{forward_backend} forward: out")
    assert_close(lse, scores.logsumexp(-1), 1e-5, f"{forward_backend} forward: lse")
    for g, r, t, name in zip((dq, dk, dv), ref_grads, (q, k, v), ("dq", "dk", "dv")):
        assert g.stride() == t.stride() and g.dtype == t.dtype
        assert_close(g, r, bound, f"{candidate} backward after the {forward_backend} forward: {name}")


# ---- the choice itself -------------------------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A CUDA device as the choice sees it (name, no capture, tuning on), with do_bench answering from
    ``times`` (candidate -> ms) and counting its calls; an empty user cache."""
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 9000")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning.autotuner, "_tune_missing_keys", True)
    monkeypatch.setattr(tuning.autotuner, "autotune_enabled", lambda: True)
    state = {"times": {}, "benched": []}

    def do_bench(fn, **kwargs):
        name = fn()
        state["benched"].append(name)
        return state["times"][name]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    return state


def _choice(name):
    choices._CHOICES.pop(name, None)
    return tuning.BackendChoice(name, ("tilefuse", "torch", "cudnn"))


def test_allowed_candidates_follow_the_backend():
    c = _choice("test_allowed")
    assert c.allowed("tilefuse", ("tilefuse", "torch")) == ("tilefuse",)
    assert c.allowed("vendor", ("tilefuse", "torch", "cudnn")) == ("torch", "cudnn")
    assert c.allowed("vendor", ("tilefuse",)) == ("tilefuse",)  # no vendor composition for this call
    assert c.allowed("auto", ("tilefuse", "cudnn")) == ("tilefuse", "cudnn")
    with pytest.raises(ValueError, match="unknown candidates"):
        c.allowed("auto", ("tilefuse", "flashinfer"))
    with pytest.raises(ValueError, match="first candidate"):
        tuning.BackendChoice("test_bad_first", ("torch", "tilefuse"))


def test_auto_measures_once_keeps_the_fastest_and_the_next_process_reads_it(fake_gpu):
    c = _choice("test_measured")
    key = tuning.ChoiceKey(N=4096, M_BUCKET=8192, dtype=torch.bfloat16)
    fake_gpu["times"] = {"tilefuse": 0.30, "torch": 0.25, "cudnn": 0.40}
    device = torch.device("cuda")
    run = lambda name: name  # noqa: E731 - do_bench above times by the name a run returns
    assert c.choose("auto", c.candidates, key, device, run) == "torch"
    assert sorted(fake_gpu["benched"]) == ["cudnn", "tilefuse", "torch"]
    assert c.choose("auto", c.candidates, key, device, run) == "torch"
    assert len(fake_gpu["benched"]) == 3  # settled in this process
    [record] = [r for r in tuning.tuning_records() if r["kernel"] == "test_measured"]
    assert record["source"] == "measured" and record["key"] == "N=4096 M_BUCKET=8192 dtypes=bfloat16"
    assert [t["config"]["kwargs"]["BACKEND"] for t in record["timings"]] == ["torch", "tilefuse", "cudnn"]
    c.clear()  # a new process: the user cache answers, nothing is timed
    fake_gpu["times"] = {"tilefuse": 0.1, "torch": 9.0, "cudnn": 9.0}
    assert c.choose("auto", c.candidates, key, device, run) == "torch"
    assert len(fake_gpu["benched"]) == 3
    assert c.records[record["key"]]["source"] == "user cache"
    # vendor keeps to the vendor candidates: measured among them, under a key of their own
    assert c.choose("vendor", c.candidates, key, device, run) == "torch"
    assert "N=4096 M_BUCKET=8192 dtypes=bfloat16 among=torch,cudnn" in c.records


def test_auto_without_a_gpu_to_measure_on_takes_tilefuse(fake_gpu, monkeypatch):
    c = _choice("test_unmeasured")
    key = tuning.ChoiceKey(N=8, dtype=torch.float32)
    assert c.choose("auto", c.candidates, key, torch.device("cpu"), lambda n: n) == "tilefuse"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # a CUDA graph being captured
    assert c.choose("auto", c.candidates, tuning.ChoiceKey(N=16), torch.device("cuda"), lambda n: n) == "tilefuse"
    assert fake_gpu["benched"] == []
    assert {r["source"] for r in c.records.values()} == {choices.NOT_MEASURED}


def test_a_call_with_one_allowed_candidate_builds_no_key_and_times_nothing(fake_gpu):
    from tilefuse.kernels import fastpath

    c = _choice("test_one_allowed")

    def no_key():
        raise AssertionError("a key was built for a call with one candidate")
    assert fastpath.run_chosen(c, "tilefuse", c.candidates, no_key, torch.device("cuda"), lambda n: n) == "tilefuse"
    assert fastpath.run_chosen(c, "vendor", ("tilefuse", "torch"), no_key, torch.device("cuda"), lambda n: n) == "torch"
    fake_gpu["times"] = {"tilefuse": 0.2, "torch": 0.1, "cudnn": 0.3}
    key = lambda: tuning.ChoiceKey(N=3)  # noqa: E731
    assert fastpath.run_chosen(c, "auto", c.candidates, key, torch.device("cuda"), lambda n: n) == "torch"
    assert sorted(fake_gpu["benched"]) == ["cudnn", "tilefuse", "torch"]


def test_a_switch_away_from_its_default_keys_a_choice_of_its_own(fake_gpu):
    """A choice measured with the switches at their defaults is not the answer once a switch changes which of
    tilefuse's kernels runs: the fast path keys the choice by the switches away from their defaults too, and
    back at the defaults the first answer stands without timing anything."""
    from tilefuse.kernels import fastpath, switches

    c = _choice("test_switch_keyed")
    key = lambda: tuning.ChoiceKey(N=5, dtype=torch.bfloat16)  # noqa: E731
    fake_gpu["times"] = {"tilefuse": 0.2, "torch": 0.1, "cudnn": 0.3}
    assert fastpath.run_chosen(c, "auto", c.candidates, key, torch.device("cuda"), lambda n: n) == "torch"
    assert len(fake_gpu["benched"]) == 3
    fake_gpu["times"] = {"tilefuse": 0.05, "torch": 0.1, "cudnn": 0.3}
    with switches.overridden(switches.gemm, COOP_BACKWARD=False):
        assert switches.non_default() == "gemm.COOP_BACKWARD=False"
        assert fastpath.run_chosen(c, "auto", c.candidates, key, torch.device("cuda"), lambda n: n) == "tilefuse"
    assert len(fake_gpu["benched"]) == 6
    assert sorted(c.records) == ["N=5 dtypes=bfloat16", "N=5 switches='gemm.COOP_BACKWARD=False' dtypes=bfloat16"]
    assert switches.non_default() == ""
    assert fastpath.run_chosen(c, "auto", c.candidates, key, torch.device("cuda"), lambda n: n) == "torch"
    assert len(fake_gpu["benched"]) == 6


def test_a_close_call_is_timed_again_in_the_reverse_order(fake_gpu):
    """Candidates within CLOSE_CALL of the fastest are timed a second time, the last first, each keeping its
    faster median: a first round that drifted (tilefuse's 0.30 against torch's 0.29, then 0.26 and 0.31) is
    decided by the second; a candidate far off (cudnn) is not timed again."""
    c = _choice("test_close_call")
    rounds = {"tilefuse": [0.30, 0.26], "torch": [0.29, 0.31], "cudnn": [0.60]}
    fake_gpu["times"] = {}

    def run(name):
        fake_gpu["times"][name] = rounds[name].pop(0)
        return name
    assert c.choose("auto", c.candidates, tuning.ChoiceKey(N=2), torch.device("cuda"), run) == "tilefuse"
    assert fake_gpu["benched"] == ["tilefuse", "torch", "cudnn", "torch", "tilefuse"]
    [record] = [r for r in tuning.tuning_records() if r["kernel"] == "test_close_call"]
    assert [(t["config"]["kwargs"]["BACKEND"], t["ms"]) for t in record["timings"]] == [
        ("tilefuse", 0.26), ("torch", 0.29), ("cudnn", 0.60)]


def test_a_failing_candidate_is_never_chosen(fake_gpu):
    c = _choice("test_failing")

    def run(name):
        if name == "torch":
            raise RuntimeError("no kernel for this shape")
        return name
    fake_gpu["times"] = {"tilefuse": 0.5, "cudnn": 0.7}
    assert c.choose("auto", c.candidates, tuning.ChoiceKey(N=1), torch.device("cuda"), run) == "tilefuse"


@pytest.mark.gpu_only
def test_a_backend_switch_between_two_calls_is_not_replayed_over():
    """The host fast path replays a key's launches: the backend is part of the key, or a switch between two
    calls of one shape would replay tilefuse's kernels under ``vendor`` (and the reverse)."""
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    for mode, kernel in [("tilefuse", ""), ("tilefuse", ""), ("vendor", "torch"), ("tilefuse", ""), ("vendor", "torch")]:
        with tilefuse.use_backend(mode), launches.recording() as recs:
            tilefuse.rms_norm(x, 1024, w)
        assert [r.kernel for r in recs] == [kernel], (mode, recs)

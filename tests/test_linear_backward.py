"""tilefuse.linear / layer_norm_linear backward: behaviour beyond the registry grid (what is saved, layouts
of gradients, weight forms, retain_graph, partial requires_grad, NaN, CUDA graphs)."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.kernels import switches
from tilefuse import reference
from tilefuse.opspec import REL_L2_BOUND

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BOUND = REL_L2_BOUND[DTYPE]
M, K, N = (257, 1000, 515) if ON_GPU else (33, 70, 45)


def _r(*shape, seed=0, scale=1.0, device, dtype=DTYPE):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _ref_grads(fn, tensors, dy):
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    fn(*leaves).backward(dy.double())
    return [t.grad for t in leaves]


@pytest.mark.parametrize("activation", [None, "gelu", "silu"])
def test_saves_what_eager_saves(device, activation):
    """x, W and (with an activation) the pre-activation, nothing more: the bytes saved for the backward
    equal eager's F.linear + activation."""
    def saved_bytes(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t
        x, w, b = _leaves(_r(M, K, device=device), _r(N, K, seed=1, scale=K ** -0.5, device=device),
                          _r(N, seed=2, device=device))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, w, b)
        return sum(sizes)
    ours = saved_bytes(lambda x, w, b: tilefuse.linear(x, w, b, activation))
    eager = saved_bytes(lambda x, w, b: reference.linear(x, w, b, activation))
    assert ours <= eager, (ours, eager)
    s = DTYPE.itemsize
    assert ours == (M * K + N * K + (M * N if activation else 0)) * s


def test_backward_runs_twice_with_retain_graph(device):
    x, w, b = _leaves(_r(M, K, device=device), _r(N, K, seed=1, scale=K ** -0.5, device=device),
                      _r(N, seed=2, device=device))
    y = tilefuse.linear(x, w, b, "gelu")
    dy = _r(M, N, seed=3, device=device)
    first = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
    second = torch.autograd.grad(y, (x, w, b), dy)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_transposed_weight_gets_its_gradient_in_its_own_layout(device):
    base = _r(K, N, seed=1, scale=K ** -0.5, device=device).requires_grad_()  # weight is base.t()
    x = _r(M, K, device=device).requires_grad_()
    dy = _r(M, N, seed=3, device=device)
    y = tilefuse.linear(x, base.t(), None, "gelu_tanh")
    seen = []
    handle = y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.extend(grad_inputs))
    y.backward(dy)
    handle.remove()
    dw = seen[1]  # the op's gradient for its weight input, the transposed view
    assert dw.shape == (N, K) and dw.stride() == (1, N), dw.stride()
    want = _ref_grads(lambda x, wt: reference.linear(x, wt.t(), None, "gelu_tanh"), (x, base), dy)
    assert_close(x.grad, want[0], BOUND, "dx")
    assert_close(base.grad, want[1], BOUND, "d(base)")


@pytest.mark.parametrize("backend", ["auto", "vendor"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
def test_gated_weight_as_pair_or_one_tensor_gets_the_same_gradients(device, activation, backend):
    """The same bits from both weight forms, under tilefuse's kernels and under cuBLAS's composition."""
    wg, wu = _r(N, K, seed=1, scale=K ** -0.5, device=device), _r(N, K, seed=2, scale=K ** -0.5, device=device)
    bg, bu = _r(N, seed=3, device=device), _r(N, seed=4, device=device)
    x = _r(M, K, device=device)
    dy = _r(M, N, seed=5, device=device)
    pair = _leaves(x, wg, wu, bg, bu)
    cat = _leaves(x, torch.cat([wg, wu]), torch.cat([bg, bu]))
    with tilefuse.use_backend(backend):
        tilefuse.linear(pair[0], (pair[1], pair[2]), (pair[3], pair[4]), activation).backward(dy)
        tilefuse.linear(cat[0], cat[1], cat[2], activation).backward(dy)
    assert torch.equal(pair[0].grad, cat[0].grad)
    assert torch.equal(torch.cat([pair[1].grad, pair[2].grad]), cat[1].grad)
    assert torch.equal(torch.cat([pair[3].grad, pair[4].grad]), cat[2].grad)
    want = _ref_grads(lambda x, w, b: reference.gated_linear(x, w[:N], w[N:], b[:N], b[N:], activation),
                      (x, torch.cat([wg, wu]), torch.cat([bg, bu])), dy)
    for got, exp, name in zip(cat, want, ("dx", "dW", "db")):
        assert_close(got.grad, exp, BOUND, f"{activation} {name}")


@pytest.mark.parametrize("backend", ["auto", "vendor"])
@pytest.mark.parametrize("which", ["x", "weight", "bias"])
def test_only_the_inputs_that_require_grad_get_one(device, which, backend):
    """relu's slope against float64 on random inputs: under vendor too, whose 16-bit cuBLAS pre-activation would
    put values within its rounding of 0 on the other side of relu's step."""
    x, w, b = _r(M, K, device=device), _r(N, K, seed=1, scale=K ** -0.5, device=device), _r(N, seed=2, device=device)
    args = {"x": x, "weight": w, "bias": b}
    args[which] = args[which].clone().requires_grad_()
    dy = _r(M, N, seed=3, device=device)
    with tilefuse.use_backend(backend):
        y = tilefuse.linear(args["x"], args["weight"], args["bias"], "relu")
        (got,) = torch.autograd.grad(y, args[which], dy)
    pos = ["x", "weight", "bias"].index(which)
    want = _ref_grads(lambda x, w, b: reference.linear(x, w, b, "relu"), (x, w, b), dy)[pos]
    assert_close(got, want, BOUND, f"d{which}")


def test_nan_in_gives_nan_gradients_where_torch_does(device):
    x, w = _r(M, K, device=device), _r(N, K, seed=1, scale=K ** -0.5, device=device)
    x[3, 5] = float("nan")
    ours, theirs = _leaves(x, w), _leaves(x, w)
    dy = _r(M, N, seed=3, device=device)
    tilefuse.linear(ours[0], ours[1], None, "gelu").backward(dy)
    F.gelu(F.linear(theirs[0], theirs[1])).backward(dy)
    for a, c in zip(ours, theirs):
        assert torch.equal(a.grad.isnan(), c.grad.isnan())


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_layer_norm_linear_gradients_against_float64(device, norm):
    x = _r(M, K, device=device, scale=2.0) + 0.5
    nw, nb = _r(K, seed=1, device=device) * 0.5 + 1, _r(K, seed=2, device=device)
    w, b = _r(N, K, seed=3, scale=K ** -0.5, device=device), _r(N, seed=4, device=device)
    dy = _r(M, N, seed=5, device=device)
    tensors = (x, nw, nb, w, b) if norm == "layer" else (x, nw, w, b)
    leaves = _leaves(*tensors)
    if norm == "layer":
        tilefuse.layer_norm_linear(*leaves, eps=1e-5, norm=norm, activation="gelu").backward(dy)
        fn = lambda x, nw, nb, w, b: F.gelu(F.linear(F.layer_norm(x, (K,), nw, nb, 1e-5), w, b))  # noqa: E731
    else:
        x_l, nw_l, w_l, b_l = leaves
        tilefuse.layer_norm_linear(x_l, nw_l, None, w_l, b_l, eps=1e-5, norm=norm, activation="gelu").backward(dy)
        fn = lambda x, nw, w, b: F.gelu(F.linear(F.rms_norm(x, (K,), nw, 1e-5), w, b))  # noqa: E731
    for got, want, i in zip(leaves, _ref_grads(fn, tensors, dy), range(5)):
        assert_close(got.grad, want, BOUND, f"{norm} grad {i}")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_training_step_of_a_module_in_a_cuda_graph():
    """Forward + backward of tilefuse modules captured once and replayed on new inputs: the gradients of
    each replay match an eager step on the same inputs (the parameters' .grad buffers are the graph's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(tilefuse.nn.Linear(K, N, activation="gelu", device="cuda", dtype=DTYPE),
                                tilefuse.nn.Linear(N, K, device="cuda", dtype=DTYPE))
    static_x = _r(M, K, device="cuda")
    static_dy = _r(M, K, seed=1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compile and tune outside the capture
            model.zero_grad(set_to_none=False)
            model(static_x).backward(static_dy)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        model(static_x).backward(static_dy)
    for seed in (7, 8):
        static_x.copy_(_r(M, K, seed=seed, device="cuda"))
        static_dy.copy_(_r(M, K, seed=seed + 10, device="cuda"))
        for p in model.parameters():
            p.grad.zero_()
        graph.replay()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=False)
        model(static_x).backward(static_dy)
        for g, p in zip(got, model.parameters()):
            assert torch.equal(g, p.grad), "replayed step differs from the eager step"


def _pinned_backward(monkeypatch, config):
    """Both backward GEMMs launched with ``config`` (a triton.Config of the portable space) instead of the
    tuner's choice: GPU tests pin every kernel to its first config, and the tuner may pick any other. The
    pointer kernels on Hopper too (the launch would take its TMA kernels there)."""
    from tilefuse.kernels import fastpath
    from tilefuse.kernels.gemm import launch

    monkeypatch.setattr(switches.gemm, "BACKWARD_TMA", False)
    calls = []

    def pinned(kernel, tuned, args, flags, interpret, grid):
        calls.append(kernel)
        meta = dict(config.kwargs)
        launch_flags = dict(flags, UPCAST_DOT=flags.get("UPCAST_DOT", False) and interpret, **meta)
        if not interpret:
            launch_flags.update(num_warps=config.num_warps, num_stages=config.num_stages)
        fastpath.launch(kernel, grid(meta), args, launch_flags)
        return config
    monkeypatch.setattr(launch.backward, "_launch_backward", pinned)
    fastpath.clear_all()  # no replay of a plan captured with another config
    return calls


def _backward_cases():
    from tilefuse.kernels.gemm import configs
    acts = ("gelu_tanh", None, "swiglu") if ON_GPU else ("gelu_tanh",)
    return [(i, a) for i in range(len(configs.PORTABLE_GEMM_CONFIGS)) for a in acts]


@pytest.mark.parametrize("index,activation", _backward_cases())
@pytest.mark.usefixtures("tilefuse_backend")  # tilefuse's backward kernels and configs
def test_every_backward_config_matches_float64(device, monkeypatch, index, activation):
    """dx, dW and db through each config of the backward GEMMs' space, pinned, on tails against every tile
    size in it (M 130, N 264, K 96, bias): the first config is the only one the pinned GPU tests run
    otherwise, and the tuner (and the shipped table) may choose any. Configs the launch would prune for a
    case are skipped for it."""
    from tilefuse.kernels.gemm import configs
    config = configs.PORTABLE_GEMM_CONFIGS[index]
    gated = activation == "swiglu"
    dy_probe = torch.empty(1, dtype=DTYPE)
    precision = "ieee" if DTYPE == torch.float32 else "tf32"
    if config not in configs.prune_backward_configs([config], {"dy_ptr": dy_probe}, HAS_SLOPE=activation is not None,
                                                    INPUT_PRECISION=precision):
        pytest.skip("pruned for this dtype")  # the prune keeps the smallest config when none fits: never here
    calls = _pinned_backward(monkeypatch, config)
    m, k, n = 130, 96, 264
    x = _r(m, k, device=device)
    w = _r(n, k, seed=1, scale=k ** -0.5, device=device)
    b = _r(n, seed=2, device=device)
    dy = _r(m, n, seed=3, device=device)
    weights, biases = ((w, _r(n, k, seed=4, scale=k ** -0.5, device=device)), (b, _r(n, seed=5, device=device))) \
        if gated else ((w,), (b,))
    leaves = _leaves(x, *weights, *biases)
    nw = len(weights)

    def run(x, *rest, fn):
        ws, bs = rest[:nw], rest[nw:]
        return fn(x, ws if gated else ws[0], bs if gated else bs[0], activation)
    run(*leaves, fn=tilefuse.linear).backward(dy)
    assert len(calls) == 1 + nw, calls  # dx, and dW per weight, all through the pinned config
    want = _ref_grads(lambda *t: run(*t, fn=_reference_linear), [x, *weights, *biases], dy)
    for got, ref, name in zip(leaves, want, ["dx"] + [f"dW{i}" for i in range(nw)] + [f"db{i}" for i in range(nw)]):
        assert_close(got.grad, ref, BOUND, f"{config} {activation} {name}")


def _reference_linear(x, w, b, activation):
    if isinstance(w, tuple):
        return reference.gated_linear(x, w[0], w[1], b[0], b[1], activation)
    return reference.linear(x, w, b, activation)


class _PinnedTuner:
    """Stands in for the portable GEMM's tuner: launches its kernel with one config."""

    def __init__(self, fn, config):
        self.fn, self.config, self.launches = fn, config, 0

    def __getitem__(self, grid):
        meta = dict(self.config.kwargs)

        def run(*args, **kwargs):
            self.launches += 1
            return self.fn[grid(meta) if callable(grid) else grid](
                *args, **kwargs, **meta, num_warps=self.config.num_warps, num_stages=self.config.num_stages)
        return run

    def launched_config(self):
        return self.config


def _portable_cases():
    from tilefuse.kernels.gemm import configs
    acts = ("gelu_tanh", None) if ON_GPU else ("gelu_tanh",)
    return [(i, a) for i in range(len(configs.PORTABLE_GEMM_CONFIGS)) for a in acts]


@pytest.mark.parametrize("index,activation", _portable_cases())
@pytest.mark.usefixtures("tilefuse_backend")  # tilefuse's backward kernels and configs
def test_every_portable_config_trains_a_conv1d_layout_weight(device, monkeypatch, index, activation):
    """GPT-2's Conv1D keeps W as [K, N], so tilefuse.linear reads its transposed view and takes the portable
    GEMM (TMA needs unit inner strides), whose tuner picks a config per row-count bucket. Each config of
    its space, pinned in the training forward (slope saved) and in both backward GEMMs: y, dx, dW (in the
    [K, N] layout) and db within the bound on tails, against float64."""
    from tilefuse.kernels import fastpath
    from tilefuse.kernels.gemm import configs, launch
    config = configs.PORTABLE_GEMM_CONFIGS[index]
    m, k, n = 130, 96, 264
    probe = {"x_ptr": torch.empty(1, dtype=DTYPE)}
    precision = "ieee" if DTYPE == torch.float32 else "tf32"
    if config not in configs.prune_portable_configs([config], probe, INPUT_PRECISION=precision):
        pytest.skip("pruned for this dtype")
    monkeypatch.setattr(fastpath, "signature", lambda *a, **k: None)  # every call takes the full path
    monkeypatch.setattr(launch.forward, "split_k_slices", lambda *a, **k: 1)  # the portable kernel itself, not split-K
    if ON_GPU:
        pinned = _PinnedTuner(launch.forward.linear_portable_tuned.fn, config)
        monkeypatch.setattr(launch.forward, "linear_portable_tuned", pinned)
    else:
        monkeypatch.setattr(configs, "INTERPRETER_GEMM", dict(config.kwargs))
    calls = _pinned_backward(monkeypatch, config)
    x = _r(m, k, device=device)
    w_kn = _r(k, n, seed=1, scale=k ** -0.5, device=device)  # Conv1D's storage
    b = _r(n, seed=2, device=device)
    dy = _r(m, n, seed=3, device=device)
    xl, wl, bl = _leaves(x, w_kn, b)
    y = tilefuse.linear(xl, wl.t(), bl, activation)
    y.backward(dy)
    if ON_GPU:
        assert pinned.launches == 1
    assert len(calls) == 2  # dx and dW through the pinned config
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w_kn, b)]
    want_y = reference.linear(ref_leaves[0], ref_leaves[1].t(), ref_leaves[2], activation)
    want_y.backward(dy.double())
    assert_close(y, want_y, BOUND, f"{config} {activation} y")
    assert wl.grad.stride() == w_kn.stride()
    for got, ref, name in zip((xl, wl, bl), ref_leaves, ("dx", "dW", "db")):
        assert_close(got.grad, ref.grad, BOUND, f"{config} {activation} {name}")


@pytest.mark.parametrize("activation,bias,conv1d", [("gelu", True, False), (None, True, True), ("silu", False, False),
                                                    ("swiglu", True, False), ("geglu", False, True)])
@pytest.mark.usefixtures("tilefuse_backend")  # tilefuse's backward kernels and configs
def test_hopper_tma_backward_gemms_match_float64(tma_launch_device, activation, bias, conv1d):
    """The Hopper backward as the launch picks it for 16-bit operands (on a CPU in the interpreter, an sm_90 of
    3 SMs): dW^T = x^T g from TMA tiles, dx on the pointer kernel; tails in M, N and K, bias or none, plain and
    gated activations, and a weight given as GPT-2 Conv1D's transposed view (its gradient in that layout); x, W
    and b gradients against float64, and the kernels the launch recorded."""
    from tilefuse.kernels import launches

    dev, dtype = tma_launch_device, torch.float16
    m, k, n = (257, 1000, 520) if dev.type == "cuda" else (136, 72, 200)  # 16-byte rows, tails on every tile
    gated = activation in ("swiglu", "geglu")
    x = _r(2, m // 2, k, device=dev, dtype=dtype)
    stored = [_r(n, k, seed=1 + i, scale=k ** -0.5, device=dev, dtype=dtype) for i in range(2 if gated else 1)]
    if conv1d:  # [K, N] storage, passed transposed: a unit row stride
        stored = [w.t().contiguous() for w in stored]
    bs = [_r(n, seed=5 + i, device=dev, dtype=dtype) for i in range(2 if gated else 1)] if bias else []
    leaves = _leaves(x, *stored, *bs)
    lx, lws, lbs = leaves[0], leaves[1:1 + len(stored)], leaves[1 + len(stored):]
    ws = [w.t() for w in lws] if conv1d else lws

    def fn(x_, ws_, bs_):
        weight = tuple(ws_) if gated else ws_[0]
        b_ = (tuple(bs_) if gated else bs_[0]) if bs_ else None
        return tilefuse.linear(x_, weight, b_, activation)

    dy = _r(2, m // 2, n, seed=9, device=dev, dtype=dtype)
    with launches.recording() as records:
        fn(lx, ws, lbs).backward(dy)
    kinds = [r.kernel for r in records if r.op == "linear_backward"]
    assert sum(kind.startswith("grad input,") for kind in kinds) == 1, kinds
    assert sum("grad weight (TMA" in kind for kind in kinds) == len(stored), kinds
    ref = [t.detach().double().requires_grad_() for t in (x, *stored, *bs)]
    rws = [w.t() for w in ref[1:1 + len(stored)]] if conv1d else ref[1:1 + len(stored)]
    rbs = ref[1 + len(stored):]
    if gated:
        want = reference.gated_linear(ref[0], rws[0], rws[1], *(rbs if bias else (None, None)), activation)
    else:
        want = reference.linear(ref[0], rws[0], rbs[0] if bias else None, activation)
    want.backward(dy.double())
    for i, (got, exp) in enumerate(zip(leaves, ref)):
        assert got.grad.shape == exp.grad.shape and got.grad.stride() == got.stride(), i
        assert_close(got.grad, exp.grad, REL_L2_BOUND[dtype], f"grad {i}")


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(130, 96, 264), (1000, 520, 1288), (4096, 1024, 2048)])
@pytest.mark.usefixtures("tilefuse_backend")  # tilefuse's backward kernels and configs
def test_warp_specialized_backward_gemms_match_float64(M, K, N, dtype):
    """The Gluon cooperative GEMM (tilefuse.kernels.gemm.coop, through its direct entries) as the backward's two
    GEMMs at every config of its table: dx = (dy * s) W and dW = (dy * s)^T x, db = column sums, on tails in
    every dim of the tile and more output tiles than SMs (each CTA's producer runs ahead across tiles), against
    float64 on the same g."""
    from tilefuse.kernels.gemm import coop

    x = _r(M, K, device="cuda", dtype=dtype)
    w = _r(N, K, seed=1, scale=K ** -0.5, device="cuda", dtype=dtype)
    dy = _r(M, N, seed=2, device="cuda", dtype=dtype)
    s = torch.rand(M, N, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(dtype)
    g = (dy.double() * s.double()).to(dtype).double()  # eager's g, rounded to the operand dtype
    for name in (n for n, c in coop.CONFIGS.items() if not c.get("FORWARD_ONLY")):
        dx = coop.grad_input(dy, s, w, name)
        dw, db = coop.grad_weight(dy, s, x, name)
        assert_close(dx, g @ w.double(), REL_L2_BOUND[dtype], f"{name} dx")
        assert_close(dw, g.t() @ x.double(), REL_L2_BOUND[dtype], f"{name} dW")
        assert_close(db, g.sum(0), REL_L2_BOUND[dtype], f"{name} db")


@pytest.mark.gpu_only
@pytest.mark.parametrize("M,K,N", [(2048, 2304, 4352), (2100, 2056, 4360)])
@pytest.mark.usefixtures("tilefuse_backend")  # tilefuse's backward kernels and configs
def test_linear_training_runs_the_cooperative_backward(M, K, N):
    """tilefuse.linear's training path (bf16, bias, GELU; forward and backward through autograd) at sizes where
    the launch takes the cooperative kernel for both backward GEMMs (launch.rules.coop_backward: an output tile per SM
    and a reduction of >= 2048; dx [M, K] over N, dW [N, K] over M), the second with tails on every tile dim and
    K step (rows still 16-byte multiples): the records say which kernels ran, and the x, W and b gradients match
    float64."""
    from tilefuse import runtime
    from tilefuse.kernels import fastpath, launches
    from tilefuse.kernels.gemm import coop, launch

    dev, dtype = torch.device("cuda"), torch.bfloat16
    sms = runtime.device_facts(dev)[1]
    for rows, cols, reduction in ((M, K, N), (N, K, M)):  # the shapes take it on this GPU: else the test is void
        assert coop.output_tiles(rows, cols, switches.gemm.COOP_BACKWARD_CONFIG) >= sms
        assert reduction >= launch.rules.COOP_MIN_REDUCTION
    fastpath.clear_all()
    x = _r(2, M // 2, K, device=dev, dtype=dtype)
    w = _r(N, K, seed=1, scale=K ** -0.5, device=dev, dtype=dtype)
    b = _r(N, seed=2, device=dev, dtype=dtype)
    dy = _r(2, M // 2, N, seed=3, device=dev, dtype=dtype)
    leaves = _leaves(x, w, b)
    for call in range(2):  # the second call as the first: host descriptors, never a replay
        for t in leaves:
            t.grad = None
        with launches.recording() as records:
            y = tilefuse.linear(*leaves, "gelu")
            y.backward(dy)
        assert [r.kernel for r in records if r.op == "linear"] == ["tma"]
        assert [r.kernel for r in records if r.op == "linear_backward"] == [
            "grad input (cooperative warp-specialized), g = dy * slope in its loads",
            "grad weight (cooperative warp-specialized) + bias, g = dy * slope in its loads"], call
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = reference.linear(*ref, "gelu")
    want.backward(dy.double())
    assert_close(y, want, BOUND, "y")
    for got, exp, name in zip(leaves, ref, ("dx", "dW", "db")):
        assert got.grad.shape == exp.grad.shape and got.grad.stride() == got.stride(), name
        assert_close(got.grad, exp.grad, REL_L2_BOUND[dtype], f"coop {M}x{K}x{N} {name}")


def _gated_training_step_against_float64(M, K, N, label):
    """SwiGLU through tilefuse.linear (x [2, M / 2, K], one [2N, K] weight, bias) forward and backward in bf16 on
    the GPU, its output and the x, W and b gradients checked against float64; returns the backward's records."""
    from tilefuse.kernels import fastpath, launches

    dev, dtype = torch.device("cuda"), torch.bfloat16
    fastpath.clear_all()
    x = _r(2, M // 2, K, device=dev, dtype=dtype)
    w = _r(2 * N, K, seed=1, scale=K ** -0.5, device=dev, dtype=dtype)
    b = _r(2 * N, seed=2, device=dev, dtype=dtype)
    dy = _r(2, M // 2, N, seed=3, device=dev, dtype=dtype)
    leaves = _leaves(x, w, b)
    with launches.recording() as records:
        y = tilefuse.linear(*leaves, "swiglu")
        y.backward(dy)
    fastpath.clear_all()
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = reference.gated_linear(ref[0], ref[1][:N], ref[1][N:], ref[2][:N], ref[2][N:], "swiglu")  # cat([gate, up])
    want.backward(dy.double())
    assert_close(y, want, BOUND, "y")
    for got, exp, name in zip(leaves, ref, ("dx", "dW", "db")):
        assert got.grad.shape == exp.grad.shape, name
        assert_close(got.grad, exp.grad, REL_L2_BOUND[dtype], f"{label} {M}x{K}x{N} {name}")
    return [r.kernel for r in records if r.op == "linear_backward"]


@pytest.mark.gpu_only
@pytest.mark.parametrize("M,K,N", [(2100, 2056, 4360)])
@pytest.mark.usefixtures("tilefuse_backend")  # tilefuse's backward kernels and configs
def test_gated_training_runs_dx_and_each_branchs_dw_on_the_cooperative_kernel(M, K, N):
    """tilefuse.linear with SwiGLU (one [2N, K] weight, bias) in training at a size where each branch's dW (g_branch^T
    x with its own slope, + db) and dx (two products summed, the GATED_DX form) take the cooperative kernel, tails
    on every tile dim: the records say so, and the x, W and b gradients match float64."""
    assert _gated_training_step_against_float64(M, K, N, "gated coop") == [
        "grad input gated (cooperative warp-specialized), g = dy * slope for each branch in its loads"] + [
        "grad weight (cooperative warp-specialized) + bias, g = dy * slope in its loads"] * 2


@pytest.mark.gpu_only
@pytest.mark.parametrize("M,K,N", [(2100, 2056, 4360)])
@pytest.mark.usefixtures("tilefuse_backend")  # tilefuse's backward kernels and configs
def test_gated_dx_on_the_pointer_kernel_matches_float64(M, K, N, monkeypatch):
    """With switches.gemm.COOP_GATED_DX switched off, SwiGLU's dx (two products summed) runs the tuned pointer kernel,
    tails on every tile dim, against float64; the gate and up branches' dW as before."""
    from tilefuse.kernels.gemm import launch

    monkeypatch.setattr(switches.gemm, "COOP_GATED_DX", False)
    assert _gated_training_step_against_float64(M, K, N, "gated dx pointer") == [
        "grad input, g = dy * slope in its loads"] + [
        "grad weight (cooperative warp-specialized) + bias, g = dy * slope in its loads"] * 2

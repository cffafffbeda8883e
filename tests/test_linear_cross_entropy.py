"""tilefuse.linear_cross_entropy beyond the registry grid: targets checked or not, all-ignored batches,
return_lse, torch.compile with ignore_index, the module, bad input."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.kernels import switches
from tilefuse.opspec import REL_L2_BOUND

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BOUND = REL_L2_BOUND[DTYPE]
M, K, V = (1000, 512, 5003) if ON_GPU else (30, 40, 130)


def _inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, DTYPE)
    w = (torch.randn(V, K, generator=g) / K ** 0.5).to(device, DTYPE)
    t = torch.randint(0, V, (M,), generator=g).to(device)
    t[::4] = -100
    return x, w, t


def _eager(x, w, t, **kw):
    return F.cross_entropy(F.linear(x.double(), w.double()), t, **kw)


def test_out_of_range_targets(device):
    x, w, t = _inputs(device)
    bad = t.clone()
    bad[1] = V
    with pytest.raises(ValueError, match=r"outside \[0"):
        tilefuse.linear_cross_entropy(x, w, bad)
    rows = tilefuse.linear_cross_entropy(x, w, bad, reduction="none", check_targets=False)
    assert rows[1].isnan() and torch.isfinite(rows[2:]).all()  # that row only, never an out-of-bounds read
    leaves = [u.clone().requires_grad_() for u in (x, w)]
    tilefuse.linear_cross_entropy(*leaves, bad, reduction="none", check_targets=False)[2:].sum().backward()
    assert all(torch.isfinite(u.grad).all() for u in leaves)


@pytest.mark.parametrize("slice_tiles", [16, 1], ids=["one slice", "column slices"])
def test_training_form_rows_give_nan_for_a_bad_target_and_0_for_an_ignored_one(device, monkeypatch, slice_tiles):
    """The training form's token chunks finish their rows' loss in the row kernel (FINISH), or, with the stats pass
    cut into column slices, in the partials' merge kernel: an ignored row adds 0 and its gradient none, a target
    outside [0, V) (unchecked) makes the summed loss NaN, as the rows' merge of the chunked forward does; ignored
    rows only, the loss and gradients match float64."""
    from tilefuse.kernels.gemm.launch import loss as loss_launch
    monkeypatch.setattr(switches.gemm, "LCE_TRAINING_FORM", True)
    monkeypatch.setattr(loss_launch, "LCE_STATS_SLICE_TILES", slice_tiles)
    if slice_tiles == 1:  # 64-column tiles: slices of a CPU-sized vocabulary too (the last one 2 columns wide)
        monkeypatch.setattr(loss_launch, "LCE_STATS_TILE", dict(loss_launch.LCE_STATS_TILE, BLOCK_V=64))
    rows = loss_launch.lce_token_chunk(M, V, DTYPE.itemsize)
    cols, slices = loss_launch.lce_stats_slices(rows, V, loss_launch.LCE_STATS_TILE)
    assert (slices > 1) == (slice_tiles == 1)
    x, w, t = _inputs(device, seed=9)
    t[3] = -100
    from tilefuse.kernels import launches
    leaves = [u.clone().requires_grad_() for u in (x, w)]
    with launches.recording() as recs:
        loss = tilefuse.linear_cross_entropy(*leaves, t, reduction="sum", label_smoothing=0.1)
    assert [r.kernel.startswith("training form") and f"folded in {slices} column slices of {cols}," in r.kernel
            for r in recs] == [True], recs
    loss.backward()
    ref = [u.double().requires_grad_() for u in (x, w)]
    want = F.cross_entropy(F.linear(*ref), t, reduction="sum", label_smoothing=0.1)
    want.backward()
    assert_close(loss, want, BOUND, "loss")
    for got, r, name in zip(leaves, ref, ("dx", "dW")):
        assert_close(got.grad, r.grad, BOUND, name)
    assert torch.count_nonzero(leaves[0].grad[3]) == 0  # the ignored row
    bad = t.clone()
    bad[1] = V
    leaves = [u.clone().requires_grad_() for u in (x, w)]
    assert tilefuse.linear_cross_entropy(*leaves, bad, reduction="sum", check_targets=False).isnan()


def test_all_ignored_gives_what_torch_gives(device):
    x, w, t = _inputs(device)
    t.fill_(-100)
    got = tilefuse.linear_cross_entropy(x, w, t)
    assert got.isnan() and _eager(x, w, t).isnan()  # mean over zero tokens
    assert tilefuse.linear_cross_entropy(x, w, t, reduction="sum") == 0


def test_return_lse(device):
    x, w, t = _inputs(device)
    loss, lse = tilefuse.linear_cross_entropy(x, w, t, return_lse=True)
    assert lse.shape == t.shape and lse.dtype == torch.float32 and not lse.requires_grad
    assert_close(lse, torch.logsumexp(F.linear(x.double(), w.double()), -1), 1e-5 if DTYPE == torch.float32
                 else 1e-3, "lse")


def test_under_torch_compile_fullgraph_with_ignore_index(device):
    x, w, t = _inputs(device)
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: tilefuse.linear_cross_entropy(x, w, t, check_targets=False), fullgraph=True,
                       backend="inductor" if ON_GPU else "aot_eager")
    leaves = [u.clone().requires_grad_() for u in (x, w)]
    loss = fn(*leaves)
    loss.backward()
    ref = [u.detach().double().requires_grad_() for u in (x, w)]
    want = F.cross_entropy(F.linear(*ref), t)
    want.backward()
    assert_close(loss, want, 1e-5 if DTYPE == torch.float32 else 1e-3, "compiled loss")
    for got, exp, name in zip(leaves, ref, ("dx", "dW")):
        assert_close(got.grad, exp.grad, BOUND, f"compiled {name}")


@pytest.mark.parametrize("reduction, bias", [("mean", False), ("sum", True)])
def test_a_compiled_training_step_takes_the_training_form(device, reduction, bias):
    """Under torch.compile a mean or sum loss that autograd records runs the training form's op (the logits made
    once, the gradients with them; no recomputing backward op in the graph), and its loss and gradients are
    float64's."""
    from torch._dynamo.backends.registry import lookup_backend
    x, w, t = _inputs(device, seed=8)
    b = (torch.randn(V, generator=torch.Generator().manual_seed(9)) / 4).to(device, DTYPE) if bias else None
    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("inductor" if ON_GPU else "aot_eager")(gm, inputs)
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: tilefuse.linear_cross_entropy(x, w, t, b, reduction=reduction,
                                                                      label_smoothing=0.1), fullgraph=True,
                       backend=backend)
    leaves = [u.clone().requires_grad_() for u in (x, w, b) if u is not None]
    loss = fn(*leaves, *([] if bias else [None]))
    (2.0 * loss).backward()
    assert any("linear_cross_entropy_train" in o for o in ops), ops
    assert not any("linear_cross_entropy_backward" in o or o.endswith("tilefuse.linear_cross_entropy.default")
                   for o in ops), ops
    ref = [u.detach().double().requires_grad_() for u in leaves]
    want = F.cross_entropy(F.linear(ref[0], ref[1], ref[2] if bias else None), t, reduction=reduction,
                           label_smoothing=0.1)
    (2.0 * want).backward()
    assert_close(loss, want, 1e-5 if DTYPE == torch.float32 else 1e-3, "compiled loss")
    for got, exp, name in zip(leaves, ref, ("dx", "dW", "db")):
        assert_close(got.grad, exp.grad, BOUND, f"compiled training form {name}")


@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False), (True, False, False)],
                         ids=["all", "dw", "dx"])
def test_the_training_op_passes_opcheck(device, needs):
    """torch.library.opcheck of ``tilefuse::linear_cross_entropy_train`` (schema, fake tensors against the real
    outputs, the autograd formula, AOT dispatch): what a compiled training step relies on."""
    x, w, t = _inputs(device, seed=10)
    b = (torch.randn(V, generator=torch.Generator().manual_seed(11)) / 4).to(device, DTYPE)
    leaves = [u.clone().requires_grad_(need) for u, need in zip((x, w, b), needs)]
    torch.library.opcheck(torch.ops.tilefuse.linear_cross_entropy_train, (*leaves, t, -100, 0.1, None, *needs))


def test_the_default_target_check_keeps_a_compiled_graph_whole(device):
    """check_targets=True (the default) under torch.compile(fullgraph=True): no graph break, the loss as
    eager's, and a bad target still refused (an assertion in the graph; on a CPU it raises at once)."""
    x, w, t = _inputs(device)
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, t: tilefuse.linear_cross_entropy(x, w, t), fullgraph=True,
                       backend="inductor" if ON_GPU else "aot_eager")
    assert_close(fn(x, w, t), _eager(x, w, t), 1e-5 if DTYPE == torch.float32 else 1e-3, "compiled loss")
    if not ON_GPU:  # on CUDA the failed device assertion would end the process's CUDA context
        bad = t.clone()
        bad[3] = V + 7
        with pytest.raises(RuntimeError, match=r"outside \[0"):
            fn(x, w, bad)


def test_the_module_passes_check_targets_on(device):
    x, w, t = _inputs(device)
    head = torch.nn.Linear(K, V, bias=False, device=device, dtype=DTYPE)
    bad = t.clone()
    bad[1] = V
    with pytest.raises(ValueError, match=r"outside \[0"):
        tilefuse.nn.LinearCrossEntropy(head)(x, bad)
    unchecked = tilefuse.nn.LinearCrossEntropy(head, reduction="none", check_targets=False)
    rows = unchecked(x, bad)
    assert rows[1].isnan() and torch.isfinite(rows[2:]).all()
    assert "check_targets=False" in repr(unchecked)


@pytest.mark.parametrize("tied", [False, True])
def test_module_shares_the_head(device, tied):
    x, w, t = _inputs(device)
    head = torch.nn.Embedding(V, K, device=device, dtype=DTYPE) if tied else \
        torch.nn.Linear(K, V, device=device, dtype=DTYPE)
    with torch.no_grad():
        head.weight.copy_(w)
    module = tilefuse.nn.LinearCrossEntropy(head, label_smoothing=0.1)
    assert module.head is head and module.head.weight is head.weight
    loss = module(x, t)
    loss.backward()
    bias = None if tied else head.bias.detach().double()
    want = F.cross_entropy(F.linear(x.double(), w.double(), bias), t, label_smoothing=0.1)
    assert_close(loss, want, 1e-5 if DTYPE == torch.float32 else 1e-3, "module loss")
    assert head.weight.grad is not None and head.weight.grad.dtype == DTYPE


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(target=torch.zeros(30, dtype=torch.float32)), TypeError, "int64 or int32"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(reduction="avg"), ValueError, "reduction"),
])
def test_bad_input(device, kwargs, exc, match):
    x, w, t = _inputs(device)
    target = kwargs.pop("target", t)
    if isinstance(target, torch.Tensor):
        target = target.to(device)[: x.shape[0]] if target.dim() else target
    with pytest.raises(exc, match=match):
        tilefuse.linear_cross_entropy(x, w, target, **kwargs)


@pytest.mark.parametrize("form,reduction", [("recompute", "mean"), ("training", "mean"), ("training", "sum")])
@pytest.mark.parametrize("smoothing,softcap", [(0.0, None), (0.1, 5.0)])
def test_backward_over_several_chunks(device, monkeypatch, smoothing, softcap, form, reduction):
    """Both training paths walk the problem in chunks. The recomputing backward: the vocabulary (a full GEMM per
    chunk for dW's rows, dx summed over the chunks): with a chunk budget of 128 columns, V = 301 takes three
    chunks, the last one partial. The training form: the tokens (16 rows a chunk at that budget: 37 tokens in
    three, dW summed over them), its gradients made in the forward and scaled by the loss's gradient (x 2.5 here)
    in the backward. Gradients against float64, bias included; bit-identical when run twice (no atomics)."""
    from tilefuse.kernels import launches
    monkeypatch.setattr(switches.gemm, "LCE_TRAINING_FORM", form == "training")
    x, w, b, target = _three_chunk_problem(device, monkeypatch, seed=4)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with launches.recording() as recs:
            loss = tilefuse.linear_cross_entropy(*leaves[:2], target, leaves[2], label_smoothing=smoothing,
                                                 softcap=softcap, reduction=reduction)
            (2.5 * loss).backward()
        grads.append([t.grad for t in leaves])
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    z = F.linear(*ref[:2], ref[2])
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    want_loss = F.cross_entropy(z, target, label_smoothing=smoothing, reduction=reduction)
    (2.5 * want_loss).backward()
    assert_close(loss, want_loss, BOUND, "loss")
    for got, again, want, name in zip(grads[0], grads[1], ref, ("dx", "dW", "db")):
        assert_close(got, want.grad, BOUND, name)
        assert torch.equal(got, again), f"{name} differs run to run"
    if any(r.path != "reference" for r in recs):
        assert [r.kernel.startswith("training form: 3 token chunks of 16") for r in recs] == (
            [True] if form == "training" else [False, False]), recs


@pytest.mark.parametrize("form", ["recompute", "training"])
def test_logits_chunks_rows_apart_by_a_pitch(device, monkeypatch, form):
    """On CUDA every logits chunk lives in one buffer whose rows are padded apart (16-byte aligned rows for cuBLAS's
    tensor-core GEMMs at an odd V): the GEMMs write and read the chunk as a strided view, every chunk after the
    first rewrites the buffer, and no kernel reads the padding. Here every call takes such a buffer, its padding
    NaN (fp32 on a CPU, whose matmul reads strided operands as such): loss and gradients match float64."""
    from tilefuse.kernels.gemm import launch

    made = []

    def padded(rows, cols, like):
        made.append((rows, cols))
        return torch.full((rows, cols + 13), float("nan"), dtype=like.dtype, device=like.device)
    monkeypatch.setattr(launch.loss, "_logits_buffer", padded)
    monkeypatch.setattr(switches.gemm, "LCE_TRAINING_FORM", form == "training")
    x, w, b, target = _three_chunk_problem(device, monkeypatch, seed=8)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss = tilefuse.linear_cross_entropy(*leaves[:2], target, leaves[2], label_smoothing=0.1)
    loss.backward()
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    want = F.cross_entropy(F.linear(*ref[:2], ref[2]), target, label_smoothing=0.1)
    want.backward()
    assert_close(loss, want, BOUND, "loss")
    for got, r, name in zip(leaves, ref, ("dx", "dW", "db")):
        assert_close(got.grad, r.grad, BOUND, name)
    # the training form's one token-chunk buffer; the recomputing form's forward and backward one each
    assert made == ([(16, 301)] if form == "training" else [(37, 128), (37, 128)]), made


def test_padded_logits_are_made_in_a_multiple_of_8_columns_and_the_rest():
    """cuBLAS runs one-element-access kernels for an odd V as the logits' columns (or dz @ W's inner dimension):
    a padded chunk is made, and read by the dx GEMM, as its largest multiple of 8 columns and the up to 7 left
    (the pitch test above runs both parts at V 301 and at the recomputing form's last chunk of 45)."""
    from tilefuse.kernels.gemm import launch

    assert launch.loss._aligned_part(50257) == ((0, 50256), (50256, 50257))
    assert launch.loss._aligned_part(45) == ((0, 40), (40, 45))
    assert launch.loss._aligned_part(128256) == ((0, 128256),)
    assert launch.loss._aligned_part(5) == ((0, 5),)


def test_the_training_form_shares_the_tokens_evenly_among_its_chunks():
    """As few token chunks as LCE_TRAINING_CHUNK_BYTES allows, the tokens shared evenly (multiples of 16 rows): at
    the Llama-3 head 8 chunks of 1024 (the budget's 1040 rows would leave a last chunk of 912), at GPT-2's 4 of
    2048 (2656 would leave 224); never more rows than tokens, never fewer than 16."""
    from tilefuse.kernels.gemm import launch

    assert launch.loss.LCE_TRAINING_CHUNK_BYTES == 256 * 2**20
    assert launch.loss.lce_token_chunk(8192, 128256, 2) == 1024
    assert launch.loss.lce_token_chunk(8192, 50257, 2) == 2048
    assert launch.loss.lce_token_chunk(5, 50257, 2) == 5
    assert launch.loss.lce_token_chunk(100000, 10**9, 2) == 16


def test_training_form_gives_a_second_backward_the_same_gradients(device):
    """The training form hands its gradients to the first backward; a second over the same graph
    (``retain_graph``) recomputes them, and both match float64."""
    x, w, t = _inputs(device, seed=6)
    leaves = [u.clone().requires_grad_() for u in (x, w)]
    loss = tilefuse.linear_cross_entropy(*leaves, t, label_smoothing=0.1)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(3.0 * loss, leaves)
    ref = [u.double().requires_grad_() for u in (x, w)]
    want = torch.autograd.grad(F.cross_entropy(F.linear(*ref), t, label_smoothing=0.1), ref)
    for a, b, r, name in zip(first, second, want, ("dx", "dW")):
        assert_close(a, r, BOUND, f"first backward: {name}")
        assert_close(b, 3.0 * r, BOUND, f"second backward: {name}")


@pytest.mark.parametrize("case", ["none", "fp16", "no grad"])
def test_training_form_only_where_every_row_takes_one_gradient(device, case):
    """reduction="none" gives each row its own gradient, fp16 cannot hold dW summed over the tokens, and without a
    gradient there is nothing to make: those keep the forward alone."""
    from tilefuse.kernels import launches
    x, w, t = _inputs(device, seed=7)
    if case == "fp16":
        x, w = x.half(), w.half()
    leaves = [u.clone().requires_grad_(case != "no grad") for u in (x, w)]
    with launches.recording() as recs:
        tilefuse.linear_cross_entropy(*leaves, t, reduction="none" if case == "none" else "mean")
    assert recs and not any(r.kernel.startswith("training form") for r in recs), recs


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_chunked_forward_matches_float64(device, monkeypatch, softcap):
    """The forward folds the partials of cuBLAS-made vocabulary chunks: losses and lse agree with float64 over
    three chunks (the last partial), label smoothing and bias included."""
    x, w, b, target = _three_chunk_problem(device, monkeypatch, seed=5)
    got, lse = tilefuse.linear_cross_entropy(x, w, target, b, reduction="none", label_smoothing=0.1,
                                             softcap=softcap, return_lse=True)
    z = F.linear(x.double(), w.double(), b.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    assert_close(got, F.cross_entropy(z, target, reduction="none", label_smoothing=0.1), BOUND, "loss")
    assert_close(lse, torch.logsumexp(z, -1), BOUND, "lse")


def _three_chunk_problem(device, monkeypatch, seed):
    """(x, w, b, target) at M 37, K 24, V 301 with the chunk budget cut to 128 vocabulary entries: three
    chunks, the last one partial; every 5th target ignored."""
    from tilefuse.kernels.gemm import launch
    M, K, V = 37, 24, 301
    monkeypatch.setattr(launch.loss, "LCE_CHUNK_BYTES", 128 * M * (2 if DTYPE == torch.bfloat16 else 4))
    monkeypatch.setattr(launch.loss, "LCE_TRAINING_CHUNK_BYTES", launch.loss.LCE_CHUNK_BYTES)
    assert launch.loss.lce_vocab_chunk(M, V, 2 if DTYPE == torch.bfloat16 else 4) == 128
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, DTYPE)
    w = (torch.randn(V, K, generator=g) * K ** -0.5).to(device, DTYPE)
    b = torch.randn(V, generator=g).to(device, DTYPE)
    target = torch.randint(0, V, (M,), generator=g).to(device)
    target[::5] = -100
    return x, w, b, target


def test_fp16_gradients_keep_their_precision(device):
    """Under "mean" each logit's gradient dloss * (softmax - onehot) is ~ 1 / (tokens * V): below fp16's
    normal range (6.1e-5), so a chunk holding it in fp16 would keep a bit or two of it (db, dW and dx at
    rel-L2 3e-3 to 7e-3 here). Gradients of fp16 inputs meet the fp16 bound against float64, bias included."""
    m, k, v = (1024, 768, 5003) if ON_GPU else (384, 8, 700)  # CPU: gradients ~4e-6, fp16-subnormal too
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=g).to(device, torch.float16)
    w = (torch.randn(v, k, generator=g) / k ** 0.5).to(device, torch.float16)
    b = torch.randn(v, generator=g).to(device, torch.float16)  # N(0, 1): softmax mass spread unevenly
    target = torch.randint(0, v, (m,), generator=g).to(device)
    target[::5] = -100
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    tilefuse.linear_cross_entropy(*leaves[:2], target, leaves[2]).backward()
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    F.cross_entropy(F.linear(*ref[:2], ref[2]), target).backward()
    for got, want, name in zip(leaves, ref, ("dx", "dW", "db")):
        assert torch.isfinite(got.grad).all(), name
        assert_close(got.grad, want.grad, REL_L2_BOUND[torch.float16], name)

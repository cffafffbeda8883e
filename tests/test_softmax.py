"""tilefuse.softmax: behaviour beyond the registry grid (extremes, dims, backward layouts, plans, errors).

Under the interpreter the chunk cap is 128 columns, so rows of ~300 already take the chunk loop, and
fewer than 4 rows of them take the split-row path; `modes` below pins which path each case runs.
"""
import dataclasses

import pytest
import torch

import tilefuse.kernels.softmax.launch as K
from tilefuse.kernels import launches
from helpers import ON_GPU, assert_close
from tilefuse.ops import softmax as S


@pytest.fixture(autouse=True)
def _records():
    """Every test records its launches; ``_last(op)`` is the last record of that op (what ran)."""
    with launches.recording() as recs:
        _RECORDS.append(recs)
        yield
    _RECORDS.pop()


_RECORDS: list = []


def _last(op: str):
    found = [r for r in _RECORDS[-1] if r.op == op]
    assert found, f"no {op} launch recorded"
    return found[-1]

# Every test here checks tilefuse's own kernel modes (block, loop, split) and their launch records.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                         "ignore:divide by zero encountered:RuntimeWarning"),
              pytest.mark.usefixtures("tilefuse_backend")]

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (rows, cols) that take each path: on the GPU the caps are larger, so the shapes are too.
MODE_SHAPES = ({"block": (6, 50), "loop": (300, 20000), "split": (6, 70000)} if ON_GPU
               else {"block": (6, 50), "loop": (6, 300), "split": (6, 333)})


def _pin_split_rows(mode, monkeypatch):
    """Under the interpreter, let the split-row path take up to 15 rows (instead of 3) when the case
    is about that path; other cases keep the default caps."""
    if mode == "split" and not ON_GPU:
        caps = dataclasses.replace(K.INTERPRETER_CAPS, num_sms=8, min_seg=128)
        monkeypatch.setattr(K, "INTERPRETER_CAPS", caps)


def _rand(*shape, device, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _extreme_rows(R, N, device, dtype):
    """Row 0 plain; 1: +inf late in the row; 2: -inf over the first chunks and scattered;
    3: all -inf; 4: logits x1e4; 5: one NaN. torch gives NaN rows for 1, 3 and 5."""
    x = _rand(R, N, device=device)
    x[1, N - 3] = float("inf")
    x[2, : (2 * N) // 3] = float("-inf")
    x[2, N - 1] = float("-inf")
    x[3] = float("-inf")
    x[4] = _rand(N, device=device, seed=1, scale=1e4)
    x[5, N // 2] = float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("mode", ["block", "loop", "split"])
@pytest.mark.parametrize("algorithm", ["online", "two_pass"])
def test_extremes_match_torch(device, mode, algorithm, monkeypatch):
    _pin_split_rows(mode, monkeypatch)
    R, N = MODE_SHAPES[mode]
    for dtype in (torch.float32, torch.bfloat16) if mode == "loop" else (torch.float32,):
        x = _extreme_rows(R, N, device, dtype)
        y = S.softmax(x, -1, algorithm=algorithm)
        assert _last("softmax").config.startswith(f"{algorithm} {mode}"), _last("softmax")
        ref = torch.softmax(x.double(), -1)
        assert torch.equal(y.isnan(), ref.isnan()), f"NaN rows differ: {y.isnan().any(-1)}"
        assert y.dtype == dtype
        assert_close(y, ref, BOUND[dtype], f"extremes {mode} {algorithm} {dtype}")
        assert (y[2, : (2 * N) // 3] == 0).all()  # exp(-inf) is exactly 0


@pytest.mark.parametrize("mode", ["loop", "split"])
@pytest.mark.parametrize("algorithm", ["online", "two_pass"])
def test_max_in_the_last_chunk(device, mode, algorithm, monkeypatch):
    _pin_split_rows(mode, monkeypatch)
    # The running max keeps growing chunk after chunk (online rescales every step), or sits first.
    R, N = MODE_SHAPES[mode]
    ramp = torch.linspace(-30, 30, N, device=device)
    x = torch.stack([ramp, ramp.flip(0), ramp * 100, -ramp * 100]).repeat(R, 1)[:R]
    y = S.softmax(x, -1, algorithm=algorithm)
    assert _last("softmax").config.startswith(f"{algorithm} {mode}")
    assert_close(y, torch.softmax(x.double(), -1), 1e-5, f"ramp {mode} {algorithm}")


@pytest.mark.parametrize("mode", ["block", "loop", "split"])
def test_backward_matches_autograd(device, mode, monkeypatch):
    _pin_split_rows(mode, monkeypatch)
    R, N = MODE_SHAPES[mode]
    x = _rand(R, N, device=device, seed=2, scale=3.0)
    w = _rand(N, device=device, seed=3)
    xg = x.clone().requires_grad_()
    (S.softmax(xg, -1) * w).sum().backward()  # dy = w broadcast over rows: row stride 0
    assert _last("softmax_backward").config.startswith(f"backward {mode}"), _last("softmax_backward")
    x64 = x.double().requires_grad_()
    (torch.softmax(x64, -1) * w.double()).sum().backward()
    assert_close(xg.grad, x64.grad, 1e-5, f"grad {mode}")


def test_every_dim_of_a_4d_tensor(device):
    x = _rand(2, 3, 5, 7, device=device, seed=4)
    for dim in range(-4, 4):
        xg = x.clone().requires_grad_()
        y = S.softmax(xg, dim)
        dy = _rand(*x.shape, device=device, seed=5 + dim)
        y.backward(dy)
        x64 = x.double().requires_grad_()
        torch.softmax(x64, dim).backward(dy.double())
        assert_close(y, torch.softmax(x.double(), dim), 1e-5, f"dim={dim}")
        assert_close(xg.grad, x64.grad, 1e-5, f"grad dim={dim}")


def test_layout_no_two_strides_can_address_is_copied(device):
    # A 4-d tensor permuted so its row dims form three stride groups: documented copy, same result.
    x = _rand(3, 4, 5, 6, device=device, seed=6).permute(3, 1, 0, 2)  # [6, 4, 3, 5], strides (1, 30, 120, 6)
    assert K._row_split([x]) is None
    xg = x.detach().clone().requires_grad_()  # clone keeps the strides
    y = S.softmax(xg, -1)
    dy = _rand(*x.shape, device=device, seed=7).permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    y.backward(dy)
    x64 = x.double().requires_grad_()
    torch.softmax(x64, -1).backward(dy.double())
    assert_close(y, torch.softmax(x.double(), -1), 1e-5, "permuted fwd")
    assert_close(xg.grad, x64.grad, 1e-5, "permuted grad")


def test_dim_not_last_needs_no_copy(device, monkeypatch):
    calls = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    cases = [(_rand(70, 9, device=device), 0), (_rand(3, 40, 5, device=device), 1),
             (_rand(9, 70, device=device).t(), -1), (_rand(5, 40, 6, device=device).permute(2, 0, 1), -1)]
    for x, dim in cases:
        y = S.softmax(x, dim)
        monkeypatch.setattr(torch.Tensor, "contiguous", real)
        assert_close(y, torch.softmax(x.double(), dim), 1e-5, f"dim {dim} of {tuple(x.shape)}")
        monkeypatch.setattr(torch.Tensor, "contiguous",
                            lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert not calls
    # y keeps a dense x's layout (reads and writes walk memory alike)
    xt = _rand(9, 70, device=device).t()
    assert S.softmax(xt, -1).stride() == xt.stride()


def test_small_and_empty_shapes(device):
    assert S.softmax(torch.tensor(3.0, device=device), 0).item() == 1.0  # 0-d, as torch
    assert S.softmax(torch.tensor(3.0, device=device), -1).shape == ()
    assert torch.equal(S.softmax(torch.zeros(1, 1, device=device)), torch.ones(1, 1, device=device))
    v = _rand(11, device=device)
    assert_close(S.softmax(v, 0), torch.softmax(v.double(), 0), 1e-5, "1-d")
    assert S.softmax(torch.empty(0, 5, device=device)).shape == (0, 5)
    assert S.softmax(torch.empty(3, 0, device=device), 1).shape == (3, 0)
    xg = torch.empty(0, 5, device=device, requires_grad=True)
    S.softmax(xg).sum().backward()
    assert xg.grad.shape == (0, 5)


def test_fp16_output_dtype_and_grad_dtype(device):
    x = _rand(7, 90, device=device, dtype=torch.float16, seed=8).requires_grad_()
    y = S.softmax(x, -1, algorithm="two_pass")
    assert y.dtype == torch.float16
    dy = _rand(7, 90, device=device, dtype=torch.float16, seed=9)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == torch.float16
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
    assert_close(dx, ref, 2e-3, "fp16 grad")


def test_auto_without_tuning_runs_online(device):
    """Where nothing is tuned (the interpreter's plans), "auto" runs "online": two reads of a long row,
    not three. On the GPU the choice is measured (the tests below force that path)."""
    x = _rand(5, 300, device=device)
    y = S.softmax(x, -1)
    assert_close(y, torch.softmax(x.double(), -1), 1e-5, "auto")
    if not ON_GPU:
        assert _last("softmax").config.startswith("online loop"), _last("softmax")


@pytest.mark.skipif(ON_GPU, reason="drives the GPU launch path through the interpreter")
@pytest.mark.parametrize("algorithm", ["online", "two_pass"])
@pytest.mark.parametrize("plan", ["loop", "long", "split"])
def test_auto_runs_the_algorithm_its_tuner_measured(plan, algorithm, monkeypatch):
    """"auto" on the GPU plans: the algorithm is a tuned parameter (chunk loops and long rows: with the
    tiles; few long rows split into segments: of the stats kernel, which the write kernel then follows).
    The tuner is pinned here to a config of each algorithm, and the softmax must come out right with
    either. The loop plan is forced with small caps so that rows of 300 take it."""
    monkeypatch.setattr(K, "_caps", lambda interpret, device: K.GPU_CAPS)
    if plan == "loop":
        from tilefuse import runtime

        caps = dataclasses.replace(K.INTERPRETER_CAPS, num_sms=2)
        monkeypatch.setattr(K, "GPU_CAPS", caps)
        monkeypatch.setattr(K, "_caps", lambda interpret, device: caps)
        monkeypatch.setattr(runtime, "device_facts", lambda device: (9, 2))
        tuner = K.softmax_fwd_loop_auto
        chosen = next(c for c in tuner.configs if c.kwargs["PROGRAMS_PER_SM"] == 0 and c.kwargs["LOOP_STAGES"] == 1
                      and c.kwargs["ALGORITHM"] == algorithm)
        x = _rand(9, 300, device="cpu", seed=3, scale=4.0)
    elif plan == "long":
        tuner = K.softmax_fwd_long_auto
        chosen = next(c for c in tuner.configs if not c.kwargs["SINGLE_BLOCK"] and c.kwargs["BLOCK_N"] == 4096
                      and c.kwargs["LOOP_STAGES"] == 3 and c.kwargs["ALGORITHM"] == algorithm)
        x = _rand(3, 10000, device="cpu", seed=1, scale=4.0)
    else:
        tuner = K.softmax_split_stats_auto
        chosen = next(c for c in tuner.configs if c.kwargs["ALGORITHM"] == algorithm)
        x = _rand(2, 20000, device="cpu", seed=2, scale=4.0)
    monkeypatch.setattr(tuner, "pinned", True)
    monkeypatch.setattr(tuner, "configs", [chosen])
    monkeypatch.setattr(tuner, "cache", {})
    y = S.softmax(x, -1, algorithm="auto")
    assert_close(y, torch.softmax(x.double(), -1), 1e-5, f"auto {plan} {algorithm}")
    assert tuner.best_config is chosen
    assert _last("softmax").config.startswith(f"auto {algorithm} {'split' if plan == 'split' else 'loop'}"), \
        _last("softmax")


@pytest.mark.skipif(ON_GPU, reason="drives the GPU launch path through the interpreter")
def test_split_rows_of_one_bucket_share_the_split_tuners_key(monkeypatch):
    """The split plan's tuner keys on the power-of-two buckets of N and of the row count, as every other
    softmax tuner does: 3 rows and 4 rows reuse one measured choice (and one shipped entry) instead of
    measuring each row count again."""
    monkeypatch.setattr(K, "_caps", lambda interpret, device: K.GPU_CAPS)
    tuner = K.softmax_split_stats_auto
    monkeypatch.setattr(tuner, "pinned", True)
    monkeypatch.setattr(tuner, "configs", [tuner.configs[0]])
    monkeypatch.setattr(tuner, "cache", {})
    keys = []
    launch = K.fastpath.launch

    def recording_launch(kernel, grid, args, kwargs):
        if kernel is tuner:
            keys.append(tuner.tuning_key(args, kwargs)[1])
        return launch(kernel, grid, args, kwargs)

    monkeypatch.setattr(K.fastpath, "launch", recording_launch)
    for rows in (3, 4):
        x = _rand(rows, 20000, device="cpu", seed=rows, scale=4.0)
        assert_close(S.softmax(x, -1, algorithm="auto"), torch.softmax(x.double(), -1), 1e-5, f"split {rows} rows")
    assert len(keys) == 2 and keys[0] == keys[1], keys
    assert keys[0].startswith("KEY_N=32768 KEY_R=4 "), keys


def test_h200_plans():
    """The GPU tiling for the issue's shapes (pure Python: no GPU needed to check the plan)."""
    caps = K.GPU_CAPS
    p = K.plan(16384, 16384, 4096, False, 2, caps)
    assert (p.mode, p.block_n, p.tuned) == ("block", 4096, True)
    p = K.plan(4096, 4096, 16384, False, 2, caps)
    assert (p.mode, p.block_m, p.block_n) == ("block", 1, 16384)
    p = K.plan(65536, 65536, 1024, False, 2, caps)
    assert p.mode == "block" and p.block_m >= 4  # several short rows per program
    assert K.plan(2048, 2048, 131072, False, 2, caps).mode == "loop"
    for rows in (1, 32):
        p = K.plan(rows, rows, 1 << 20, False, 2, caps)
        assert p.mode == "split" and rows * p.segments >= caps.num_sms, p
        assert p.seg_len % p.block_n == 0 and (p.segments - 1) * p.seg_len < 1 << 20
    p = K.plan(4096, 64, 1000, True, 2, caps)  # softmax over a dim that is not last
    assert p.block_m * 2 >= 32 and p.block_m * p.block_n <= caps.max_tile


def test_autotune_space_is_small_and_never_empty():
    space = K._block_config_space()
    for block_n in (2 ** i for i in range(15)):
        for rows in (1, 3, 100, 65536):
            kept = K._prune_block(space, {"R_INNER": rows}, BLOCK_N=block_n)
            assert 1 <= len(kept) <= 3, (block_n, rows)
            assert all(c.kwargs["BLOCK_M"] * block_n <= K.GPU_CAPS.max_tile or c.kwargs["BLOCK_M"] == 1
                       for c in kept)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(x=torch.randn(3, 4), dim=2), ValueError, "dim=2 is out of range"),
    (dict(x=torch.randn(3, 4), dim=-3), ValueError, "dim=-3"),
    (dict(x=torch.tensor(1.0), dim=1), ValueError, "dim=1"),
    (dict(x=torch.randn(3, 4), dim=1.0), TypeError, "dim must be an int"),
    (dict(x=torch.randn(3, 4), dim=True), TypeError, "dim must be an int"),
    (dict(x=torch.randn(3, 4), algorithm="three_pass"), ValueError, "algorithm must be one of"),
    (dict(x=torch.ones(3, 4, dtype=torch.int64)), TypeError, "x has dtype int64"),
    (dict(x=torch.ones(3, 4, dtype=torch.float64)), TypeError, "x has dtype float64"),
    (dict(x=[[1.0, 2.0]]), TypeError, "x must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(kwargs, exc, match):
    x = kwargs.pop("x")
    with pytest.raises(exc, match=match):
        S.softmax(x, **kwargs)


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is the CPU path")
def test_interpreter_path_is_used_on_cpu():
    S.softmax(torch.randn(3, 4))
    assert _last("softmax").path == "interpreter"


@pytest.mark.gpu_only
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("algorithm", ["online", "two_pass"])
def test_million_column_rows(rows, algorithm):
    x = _rand(rows, 1 << 20, device="cuda", seed=10, scale=4.0).requires_grad_()
    y = S.softmax(x, -1, algorithm=algorithm)
    assert "split" in _last("softmax").config
    _check_fwd_bwd(x, y, _rand(rows, 1 << 20, device="cuda", seed=11), f"1M {rows} {algorithm}")


def _check_fwd_bwd(x, y, dy, what):
    """y = softmax(x, -1) and its gradient for dy, both against float64 torch."""
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = torch.softmax(x64, -1)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert_close(y, y64, 1e-5, f"{what} fwd")
    assert_close(dx, dx64, 1e-5, f"{what} bwd")


@pytest.mark.skipif(ON_GPU, reason="drives the GPU launch path through the interpreter")
@pytest.mark.parametrize("single", [True, False])
def test_long_row_tuner_runs_either_choice(single, monkeypatch):
    """Rows of 8K-16K go to a tuner that may pick one block per row or the pipelined chunk loop; both
    must give the softmax. The GPU plan is forced here and the tuner pinned to one of its choices."""
    tuner = K.softmax_fwd_long_tuned
    chosen = next(c for c in tuner.configs if c.kwargs["SINGLE_BLOCK"] == single and c.kwargs["BLOCK_N"] in (16384, 4096)
                  and c.kwargs["LOOP_STAGES"] == (1 if single else 3))
    monkeypatch.setattr(K, "_caps", lambda interpret, device: K.GPU_CAPS)
    monkeypatch.setattr(tuner, "pinned", True)
    monkeypatch.setattr(tuner, "configs", [chosen])
    monkeypatch.setattr(tuner, "cache", {})
    x = torch.randn(3, 10000, generator=torch.Generator().manual_seed(1)) * 4
    y = S.softmax(x, dim=-1, algorithm="online")  # "auto" takes the tuner that also picks the algorithm
    assert_close(y, torch.softmax(x.double(), -1), 1e-5, f"long row single={single}")
    assert tuner.best_config is chosen


@pytest.mark.skipif(ON_GPU, reason="drives the GPU launch path through the interpreter")
@pytest.mark.parametrize("algorithm", ["online", "two_pass"])
def test_persistent_chunk_loop_covers_every_row(algorithm, monkeypatch):
    """The persistent loop configs launch fewer programs than row tiles (2 SMs x 1 here for 9 rows), so
    each program walks several rows; every row, forward and backward, must come out right. The GPU's
    tuned loop plan is forced with small caps so rows of 300 take it."""
    from tilefuse import runtime

    caps = dataclasses.replace(K.INTERPRETER_CAPS, num_sms=2)
    monkeypatch.setattr(K, "GPU_CAPS", caps)
    monkeypatch.setattr(K, "_caps", lambda interpret, device: caps)
    monkeypatch.setattr(runtime, "device_facts", lambda device: (9, 2))
    for tuner in (K.softmax_fwd_loop_tuned, K.softmax_bwd_loop_tuned):
        persistent = [c for c in tuner.configs if c.kwargs["PROGRAMS_PER_SM"] == 1 and c.kwargs["BLOCK_N"] == 4096]
        monkeypatch.setattr(tuner, "pinned", True)
        monkeypatch.setattr(tuner, "configs", persistent[:1])
        monkeypatch.setattr(tuner, "cache", {})
    x = (torch.randn(9, 300, generator=torch.Generator().manual_seed(3)) * 4).requires_grad_()
    y = S.softmax(x, dim=-1, algorithm=algorithm)
    assert "persistent 1/SM" in _last("softmax").config, _last("softmax")
    _check_fwd_bwd(x, y, torch.randn(9, 300, generator=torch.Generator().manual_seed(4)), f"persistent {algorithm}")


@pytest.mark.gpu_only
@pytest.mark.parametrize("per_sm,block_n", [(1, 8192), (2, 4096)])
def test_persistent_chunk_loop_on_gpu(per_sm, block_n, monkeypatch):
    """The persistent loop configs are tuner candidates the pinned GPU tests never reach: force each on
    rows that take the chunk loop (more than 16K columns, more rows than programs)."""
    for tuner in (K.softmax_fwd_loop_tuned, K.softmax_bwd_loop_tuned):
        chosen = [c for c in tuner.configs
                  if c.kwargs["PROGRAMS_PER_SM"] == per_sm and c.kwargs["BLOCK_N"] == block_n]
        monkeypatch.setattr(tuner, "pinned", True)
        monkeypatch.setattr(tuner, "configs", chosen)
        monkeypatch.setattr(tuner, "cache", {})
    x = _rand(600, 20000, device="cuda", seed=12, scale=4.0).requires_grad_()
    y = S.softmax(x, -1, algorithm="online")
    assert f"persistent {per_sm}/SM" in _last("softmax").config, _last("softmax")
    _check_fwd_bwd(x, y, _rand(600, 20000, device="cuda", seed=13), f"persistent {per_sm}/SM")


@pytest.mark.parametrize("shape,layout", [((5, 300), "rows"), ((33, 70), "dim0")])
def test_backward_kernels_only_gives_autograds_gradient(device, shape, layout):
    """The report's GPU-only column times softmax_backward through the spec's "kernels_only" callable
    (``_SoftmaxFunction.backward`` on the forward's node, no autograd engine): the same dx as the timed
    autograd call, bit for bit, call after call."""
    from tilefuse import registry

    spec = registry.REGISTRY["softmax_backward"]
    inputs = spec.make_inputs(dict(shape=shape, dtype=torch.bfloat16, layout=layout), device, 0)
    expected = spec.fused(**inputs)
    for _ in range(2):
        got = spec.extra["kernels_only"](**inputs)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert torch.equal(got, expected)

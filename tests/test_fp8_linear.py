"""tilefuse.linear(..., fp8=True), tilefuse.quantize_weight and tilefuse.nn.Linear's FP8 form.

The kernels take the same e4m3 values as the PyTorch emulation of the per-row / per-channel math
(tilefuse.reference.fp8_linear), so they are held to it tightly (fp32 sums in another order: ~1e-6); against
the float64 unquantized Linear they are held to the FP8 bound. Both GEMM kernels (TMA descriptors and masked
pointers), every activation, the x forms and layouts, the edges and every input error.
"""
import pytest
import torch
import triton
import triton.language as tl

import tilefuse
from tilefuse.kernels import switches
from tilefuse.ops import _checks
from helpers import ON_GPU, assert_close, representative
from tilefuse import reference, runtime
from tilefuse.kernels import launches
from tilefuse.ops import fp8_linear as fp8_op
from tilefuse.reference import fp8_linear as emulation
from tools.compiler import compile_sm90

ACTS = [None, "gelu", "gelu_tanh", "relu", "silu"]
FP8 = torch.float8_e4m3fn
FP8_BOUND = 5e-2  # against float64 (ENGINEERING.md section 4)
# Against the emulation (fp32 sums of the same e4m3 products). In the interpreter the sums differ in order only:
# 1e-5 for fp32 outputs; 16-bit outputs also by a rounding flip where the order moves a value across a rounding
# boundary. FP8 tensor cores add products in fewer fraction bits than fp32 (about 13 on Hopper) before the fp32
# promotion every 128-deep K step: 1e-3 on a GPU; with fast accumulation over the whole K loop
# (switches.gemm.FP8_FAST_ACCUM), 5e-3.
SAME_VALUES = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}


def _same_values(dtype):
    from tilefuse.kernels.gemm import launch

    if not ON_GPU:
        return SAME_VALUES[dtype]
    return max(SAME_VALUES[dtype], 5e-3 if switches.gemm.FP8_FAST_ACCUM else 1e-3)


def _rand(*shape, device, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _operands(M, K, N, device, dtype=torch.float32, seed=0, bias=True):
    x = _rand(M, K, device=device, dtype=dtype, seed=seed)
    w = _rand(N, K, device=device, dtype=dtype, seed=seed + 1, scale=K ** -0.5)
    b = _rand(N, device=device, dtype=dtype, seed=seed + 2) if bias else None
    return x, w, b


def _emulated(x, qw, b, activation, out_dtype):
    x_q, sx = emulation.quantize_rows(x)
    return emulation.linear_fp8_rowwise(x_q, sx, qw.data, qw.scale, b, activation, out_dtype)


def _f64(x, w, b, activation):
    return reference.linear(x.double(), w.double(), None if b is None else b.double(), activation)


# ---- the e4m3 casts -------------------------------------------------------------------------------------------
@triton.jit
def _e4m3_casts_kernel(x_ptr, q_ptr, codes_ptr, back_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(q_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float8e4nv), mask=mask)
    tl.store(back_ptr + offs, tl.load(codes_ptr + offs, mask=offs < 256).to(tl.float32), mask=offs < 256)


def test_e4m3_casts_round_to_nearest_even_saturate_and_keep_nan(device):
    """What the kernels' casts do (the GPU's cvt.rn.satfinite; the interpreter's, fixed in
    kernels/interpreter.py) is what the emulation assumes: torch's float8_e4m3fn cast after clamping to +-448;
    and every e4m3 code reads back as torch reads it, NaN included."""
    from tilefuse.kernels import fastpath  # noqa: F401  (importing the launch path installs the interpreter's fixes)

    ties = [1.0625, 1.1875, 2 ** -9 * 1.5, 2 ** -10, 240.0, 464.0]  # halfway cases; 464: halfway past 448
    x = torch.cat([torch.linspace(-500, 500, 301), torch.randn(200) * 2.0 ** -7,
                   torch.tensor(ties + [-t for t in ties] + [float("inf"), -float("inf"), float("nan"), 0.0])])
    x = x.to(device)
    codes = torch.arange(256, dtype=torch.uint8, device=device).view(FP8)
    q = torch.empty(x.shape, dtype=FP8, device=device)
    back = torch.empty(256, device=device)
    _e4m3_casts_kernel[(1,)](x, q, codes, back, x.numel(), BLOCK=1024)
    want = x.clamp(-448.0, 448.0).to(FP8)
    nan = want.float().isnan()
    assert torch.equal(q.float().isnan(), nan)
    assert torch.equal(q.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
    read = codes.float()
    assert torch.equal(back.isnan(), read.isnan()) and torch.equal(back[~read.isnan()], read[~read.isnan()])


# ---- quantize_weight ------------------------------------------------------------------------------------------
def test_quantize_weight_is_the_emulation_bit_for_bit(device):
    w = _rand(40, 70, device=device, scale=0.1)
    w[3] = 0.0          # an all-zero row: scale 1, zeros
    w[5] *= 1e-30       # a row of tiny values keeps its own range
    w[7, 11] = 300.0    # a row with one large value
    qw = tilefuse.quantize_weight(w)
    q, s = emulation.quantize_rows(w)
    assert torch.equal(qw.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qw.scale, s)
    assert qw.data.dtype == FP8 and qw.data.is_contiguous() and qw.scale.dtype == torch.float32
    assert qw.shape == (40, 70) and qw.dtype == torch.float32 and qw.device == w.device
    assert bool((qw.scale > 0).all()) and qw.scale[3] == 1.0 and qw.data[3].float().abs().sum() == 0
    assert_close(qw.dequantize(), w.double(), FP8_BOUND, "dequantized weight")
    assert_close(qw.dequantize()[5], w[5].double(), FP8_BOUND, "tiny row")


def test_quantize_weight_of_a_linear_and_of_rows_longer_than_a_chunk(device):
    lin = torch.nn.Linear(1100, 6, device=device, dtype=torch.bfloat16)  # 1100 > the interpreter's 512 chunk
    qw = tilefuse.quantize_weight(lin)
    q, s = emulation.quantize_rows(lin.weight.detach())
    assert torch.equal(qw.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qw.scale, s)
    assert qw.dtype == torch.bfloat16 and not qw.data.requires_grad


@pytest.mark.parametrize("arg,exc,match", [
    ([[1.0]], TypeError, "torch.nn.Linear or a 2-D float tensor"),
    (torch.randn(4), ValueError, "must be 2-D"),
    (torch.ones(3, 4, dtype=torch.int32), TypeError, "dtype int32"),
    (torch.randn(3, 4).to(torch.float8_e4m3fn), TypeError, "QuantizedWeight"),
])
def test_quantize_weight_rejects(arg, exc, match):
    with pytest.raises(exc, match=match):
        tilefuse.quantize_weight(arg)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: tilefuse.QuantizedWeight(torch.randn(3, 4), torch.ones(3), torch.float32), TypeError, "data"),
    (lambda: tilefuse.QuantizedWeight(torch.randn(3, 4).to(FP8), torch.ones(4), torch.float32), ValueError,
     "scale must have shape \\[3\\]"),
    (lambda: tilefuse.QuantizedWeight(torch.randn(3, 4).to(FP8), torch.ones(3, dtype=torch.float16),
                                      torch.float32), TypeError, "scale"),
    (lambda: tilefuse.QuantizedWeight(torch.randn(3, 4).to(FP8), torch.ones(3), torch.int8), TypeError, "dtype"),
])
def test_quantized_weight_checks_its_parts(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---- the GEMM kernels ------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("tilefuse_backend")
@pytest.mark.parametrize("activation,dtype,bias", [
    (None, torch.float32, True), ("gelu", torch.bfloat16, True), ("gelu_tanh", torch.float16, False),
    ("relu", torch.float32, False), ("silu", torch.bfloat16, True)])
def test_pointer_kernel_matches_the_emulation_and_float64(device, activation, dtype, bias):
    """K = 70 (e4m3 rows not 16-byte multiples): the masked pointer kernel on every device."""
    x, w, b = _operands(33, 70, 45, device, dtype, bias=bias)
    qw = tilefuse.quantize_weight(w)
    with launches.recording() as recs:
        y = tilefuse.linear(x, qw, b, activation, fp8=True)
    assert [r.kernel for r in recs if r.op == "linear_fp8"] == ["portable"], recs
    assert y.dtype == dtype and y.shape == (33, 45)
    assert_close(y, _emulated(x, qw, b, activation, torch.float64), _same_values(dtype), f"emulation {activation}")
    assert_close(y, _f64(x, w, b, activation), FP8_BOUND, f"float64 {activation}")


@pytest.mark.parametrize("index,activation", representative(
    [(1, "gelu"), (2, "silu"), (4, None), (0, "gelu_tanh"), (3, "relu"), (5, "gelu"), (6, None)], keep=3))
def test_every_tma_config_matches_the_emulation(tma_launch_device, index, activation):
    """Each config of the FP8 TMA kernel's space, pinned, on tails in M, N and K (130 x 160 x 264: ragged against
    every tile, K against BLOCK_K 128), fp32 out where it fits (the tight bound), else bf16. On a CPU the largest tiles (M and N
    long sides) and the unsplit epilogue; the GPU suite runs all."""
    from tilefuse.kernels.gemm import configs, launch

    config = configs.FP8_TMA_GEMM_CONFIGS[index]
    k = configs.fp8_tma_config(**config)
    # fp32 out where its epilogue staging fits sm_90's shared memory with the config's ring, else bf16 (the tuner
    # keeps such a config for 16-bit outputs only: prune_fp8_tma_configs)
    fp32_fits = configs.fp8_tma_smem_bytes(k.kwargs["BLOCK_M"], k.kwargs["BLOCK_N"], k.kwargs["BLOCK_K"], k.num_stages,
                                           k.kwargs["EPILOGUE_SUBTILE"], 4) <= configs.SMEM_LIMIT
    out_dtype = torch.float32 if fp32_fits else torch.bfloat16
    x, w, b = _operands(130, 160, 264, tma_launch_device, seed=index)
    qw = tilefuse.quantize_weight(w)
    x_q, sx = emulation.quantize_rows(x)
    y = torch.full((130, 264), float("nan"), device=x.device, dtype=out_dtype)
    flags = dict(HAS_BIAS=True, ACTIVATION=activation or "none", FAST_ACCUM=switches.gemm.FP8_FAST_ACCUM)
    launch.fp8.launch_fp8_tma(x_q, qw.data, sx, qw.scale, b, y, flags, runtime.execution_path(x), config=config)
    assert_close(y, _emulated(x, qw, b, activation, torch.float64), _same_values(out_dtype), f"{config}")


@pytest.mark.usefixtures("tilefuse_backend")
def test_launch_takes_tma_where_the_rows_are_16_byte_multiples(tma_launch_device):
    """The launch layer's choice: TMA where x's e4m3 rows (K) and y's rows are multiples of 16 bytes, the pointer
    kernel otherwise; both right."""
    dev = tma_launch_device
    cases = [((40, 96, 48), torch.bfloat16, "tma"), ((40, 96, 44), torch.float32, "tma"),
             ((40, 90, 48), torch.bfloat16, "portable"), ((40, 96, 45), torch.bfloat16, "portable")]
    for (M, K, N), dtype, kernel in cases:
        x, w, b = _operands(M, K, N, dev, dtype)
        qw = tilefuse.quantize_weight(w)
        with launches.recording() as recs:
            y = tilefuse.linear(x, qw, b, "gelu", fp8=True)
        assert [r.kernel for r in recs if r.op == "linear_fp8"] == [kernel], (M, K, N, dtype, recs)
        assert_close(y, _emulated(x, qw, b, "gelu", torch.float64), _same_values(dtype), f"{kernel} {K} {N}")


def test_fp8_x_with_its_scales_gives_the_16_bit_x_result(device):
    x, w, b = _operands(21, 64, 30, device)
    qw = tilefuse.quantize_weight(w.bfloat16())
    x_q, sx = emulation.quantize_rows(x)
    y = tilefuse.linear(x, qw, b, "silu", fp8=True)
    for scale in (sx, sx[:, None]):
        assert torch.equal(tilefuse.linear(x_q, qw, b, "silu", fp8=True, x_scale=scale), y)
    # Output dtype of an e4m3 x: the bias's, else the weight's before quantization.
    assert tilefuse.linear(x_q, qw, b.half(), "silu", fp8=True, x_scale=sx).dtype == torch.float16
    assert tilefuse.linear(x_q, qw, None, None, fp8=True, x_scale=sx).dtype == torch.bfloat16
    # A 16/32-bit weight is quantized on the call: the same values as quantize_weight's.
    assert torch.equal(tilefuse.linear(x, w.bfloat16(), b, "silu", fp8=True), y)


def test_autocast_sets_the_output_dtype_of_a_16_or_32_bit_x(device):
    x, w, b = _operands(9, 32, 16, device)
    qw = tilefuse.quantize_weight(w)
    y = tilefuse.linear(x, qw, b, "gelu", fp8=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        z = tilefuse.linear(x, qw, b, "gelu", fp8=True)
    assert z.dtype == torch.bfloat16 and torch.equal(z, y.bfloat16())  # the fp32 result rounded once


def test_any_x_layout_gives_the_contiguous_result(device):
    K, N = 48, 20
    w = _rand(N, K, device=device, seed=1, scale=K ** -0.5)
    qw = tilefuse.quantize_weight(w)
    b = _rand(N, device=device, seed=2)
    base = _rand(14, 2 * K, device=device, seed=3)
    views = [base[::2, ::2],                                       # strided rows and columns
             base[:, :K].reshape(2, 7, K),                         # 3-D
             base[:, :K].reshape(7, 2, K).transpose(0, 1),         # 3-D, two row strides
             base[0, :K]]                                          # 1-D
    for x in views:
        y = tilefuse.linear(x, qw, b, "relu", fp8=True)
        assert y.shape == (*x.shape[:-1], N)
        assert torch.equal(y, tilefuse.linear(x.contiguous(), qw, b, "relu", fp8=True)), tuple(x.shape)
        x_q, sx = emulation.quantize_rows(x)  # an e4m3 x with a column stride of 2 too
        spaced = torch.zeros((*x_q.shape[:-1], 2 * K), dtype=FP8, device=device)
        spaced[..., ::2] = x_q
        assert torch.equal(tilefuse.linear(spaced[..., ::2], qw, b, "relu", fp8=True, x_scale=sx), y)


def test_empty_inputs(device):
    w = _rand(5, 16, device=device)
    qw = tilefuse.quantize_weight(w)
    b = _rand(5, device=device, seed=2)
    assert tilefuse.linear(torch.empty(0, 16, device=device), qw, b, "gelu", fp8=True).shape == (0, 5)
    assert tilefuse.linear(torch.empty(2, 0, 16, device=device), qw, None, fp8=True).shape == (2, 0, 5)
    x_q = torch.empty(0, 16, device=device, dtype=FP8)
    assert tilefuse.linear(x_q, qw, b, None, fp8=True, x_scale=torch.empty(0, device=device)).shape == (0, 5)
    w0 = tilefuse.quantize_weight(torch.empty(5, 0, device=device))  # K = 0: the bias, as F.linear gives
    out = tilefuse.linear(torch.empty(3, 0, device=device), w0, b, "gelu", fp8=True)
    assert_close(out, torch.nn.functional.gelu(b.double()).expand(3, 5), 1e-6, "K=0")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_nan_in_x_gives_nan_in_its_row_and_nan_in_w_in_its_column(device):
    x, w, b = _operands(9, 32, 12, device)
    x[2, 3] = float("nan")
    w[4, 7] = float("nan")
    y = tilefuse.linear(x, tilefuse.quantize_weight(w), b, "relu", fp8=True)
    nan = y.isnan()
    assert nan[2].all() and nan[:, 4].all()
    nan[2], nan[:, 4] = False, False
    assert not nan.any()


@pytest.mark.skipif(ON_GPU, reason="the plain-PyTorch path is a CPU path")
def test_cpu_without_the_interpreter_runs_the_emulation(monkeypatch):
    x, w, b = _operands(17, 40, 24, "cpu")
    y = tilefuse.linear(x, tilefuse.quantize_weight(w), b, "gelu", fp8=True)
    monkeypatch.setattr(runtime, "interpreter_enabled", lambda: False)
    with launches.recording() as recs:
        ref_path = tilefuse.linear(x, tilefuse.quantize_weight(w), b, "gelu", fp8=True)
    assert {r.path for r in recs} == {"reference"}, recs
    assert_close(ref_path, y.double(), _same_values(torch.float32), "reference path")


def test_rows_of_small_values_keep_their_precision_where_per_tensor_scaling_loses_it(device):
    """The per-tensor baseline puts rows 1e-5 the size of the largest below e4m3's subnormals; per-row scales
    keep every row at the FP8 bound."""
    from tilefuse.harness.stats import error_stats

    x, w, b = _operands(32, 64, 24, device, bias=False)
    x[16:] *= 1e-5
    y = tilefuse.linear(x, tilefuse.quantize_weight(w), None, None, fp8=True)
    per_tensor = emulation.linear_fp8_per_tensor(x, w, None, None)
    truth = _f64(x, w, None, None)
    assert_close(y[16:], truth[16:], FP8_BOUND, "per-row, small rows")
    assert error_stats(per_tensor[16:], truth[16:]).rel_l2 > 0.2
    assert_close(per_tensor[:16], truth[:16], FP8_BOUND, "per-tensor, large rows")


# ---- errors -------------------------------------------------------------------------------------------------------
def _qw():
    return tilefuse.quantize_weight(torch.randn(5, 4))


@pytest.mark.parametrize("call,exc,match", [
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, None, x_scale=torch.ones(3)), ValueError, "x_scale"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw), TypeError, "fp8=True"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4).to(FP8), torch.randn(5, 4)), TypeError, "fp8=True"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, None, "swiglu", fp8=True), ValueError, "gated"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, None, "gelu_erf", fp8=True), ValueError, "activation"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), (qw, qw), fp8=True), ValueError, "pair"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), torch.randn(5, 4).to(FP8), fp8=True), TypeError,
     "quantize_weight"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), 2.0, fp8=True), TypeError, "weight must be"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), torch.randn(5, 4, 1), fp8=True), ValueError, "weight must be 2-D"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), torch.ones(5, 4, dtype=torch.int32), fp8=True), TypeError,
     "weight has dtype"),
    (lambda qw: tilefuse.linear(torch.ones(3, 4, dtype=torch.int32), qw, fp8=True), TypeError, "x has dtype"),
    (lambda qw: tilefuse.linear([[1.0] * 4], qw, fp8=True), TypeError, "x must be a torch.Tensor"),
    (lambda qw: tilefuse.linear(torch.tensor(1.0), qw, fp8=True), ValueError, "0-d"),
    (lambda qw: tilefuse.linear(torch.randn(3, 6), qw, fp8=True), ValueError, "weight.shape\\[1\\]"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, torch.randn(4), fp8=True), ValueError,
     "bias must have shape \\[5\\]"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, torch.ones(5, dtype=torch.int64), fp8=True), TypeError,
     "bias has dtype"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, torch.randn(5, device="meta"), fp8=True), ValueError,
     "bias is on meta"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4).to(FP8), qw, fp8=True), ValueError, "x_scale"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4).to(FP8), qw, fp8=True, x_scale=torch.ones(3).half()), TypeError,
     "x_scale has dtype"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4).to(FP8), qw, fp8=True, x_scale=torch.ones(4)), ValueError,
     "x_scale must have shape"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4).to(FP8), qw, fp8=True, x_scale=1.0), TypeError,
     "x_scale must be a torch.Tensor"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, fp8=True, x_scale=torch.ones(3)), ValueError,
     "x_scale is only"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4, requires_grad=True), qw, fp8=True), NotImplementedError,
     "forward-only"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), qw, torch.randn(5, requires_grad=True), fp8=True),
     NotImplementedError, "forward-only"),
    (lambda qw: tilefuse.linear(torch.randn(3, 4), torch.randn(5, 4, requires_grad=True), fp8=True),
     NotImplementedError, "forward-only"),
])
def test_bad_input_raises_before_any_launch(call, exc, match):
    qw = _qw()
    with launches.recording() as recs, pytest.raises(exc, match=match):
        call(qw)
    assert not recs, recs


def test_fp8_needs_compute_capability_8_9(monkeypatch):
    cuda = torch.device("cuda", 0)
    for facts, capability, ok in [((9, 132), (9, 0), True), ((8, 128), (8, 9), True), ((8, 108), (8, 0), False),
                                  ((8, 84), (8, 6), False), ((7, 80), (7, 0), False), ((10, 148), (10, 0), True)]:
        monkeypatch.setattr(runtime, "device_facts", lambda device, f=facts: f)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        problem = _checks.fp8_device_problem(cuda)
        assert (problem is None) == ok, (facts, capability, problem)
        if not ok:
            assert "compute capability 8.9" in problem and str(facts[0]) in problem

            class OnCuda:  # a CUDA tensor as the check sees one, on a machine without a GPU
                is_cuda, device = True, cuda
            with pytest.raises(NotImplementedError, match="FP8 tensor cores"):
                _checks.check_fp8_device("x", OnCuda())


# ---- torch.compile ---------------------------------------------------------------------------------------------
def test_compiles_fullgraph_with_dynamic_shapes(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    x, w, b = _operands(33, 48, 24, device)
    qw = tilefuse.quantize_weight(w)
    x_q, sx = emulation.quantize_rows(x)

    def fn(x, x_q, sx):
        return tilefuse.linear(x, qw, b, "gelu", fp8=True), tilefuse.linear(x_q, qw, b, "gelu", fp8=True, x_scale=sx)

    counter = CompileCounterWithBackend("inductor" if ON_GPU else "aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for rows in (33, 41):
        xr = _rand(rows, 48, device=device, seed=rows)
        xr_q, sxr = emulation.quantize_rows(xr)
        got = compiled(xr, xr_q, sxr)
        want = fn(xr, xr_q, sxr)
        for g, e in zip(got, want):
            assert torch.equal(g, e)
    assert counter.frame_count == 1


# ---- nn.Linear ---------------------------------------------------------------------------------------------------
def test_nn_linear_holds_an_fp8_weight(device):
    lin = torch.nn.Linear(48, 20, device=device)
    assert set(tilefuse.nn.Linear.from_linear(lin).state_dict()) == {"weight", "bias"}  # unquantized: torch's
    m = tilefuse.nn.Linear.from_linear(lin, "gelu", fp8=True)
    assert m.weight is None and m.bias is lin.bias and m.quantized and "fp8=True" in repr(m)
    assert set(m.state_dict()) == {"bias", "weight_fp8", "weight_scale"}
    x = _rand(7, 48, device=device)
    with torch.no_grad():
        y = m(x)
        assert torch.equal(y, tilefuse.linear(x, tilefuse.quantize_weight(lin), lin.bias, "gelu", fp8=True))
        m2 = tilefuse.nn.Linear(48, 20, activation="gelu", device=device).quantize_()
        m2.load_state_dict(m.state_dict())
        assert torch.equal(m2(x), y)
    with pytest.raises(NotImplementedError, match="forward-only"):  # the bias requires grad
        m(x)
    # A dtype conversion keeps the e4m3 values and scales, and sets the output dtype of an e4m3 x.
    m2.half()
    assert m2.weight_fp8.dtype == FP8 and m2.weight_scale.dtype == torch.float32 and m2.bias.dtype == torch.float16
    assert m2.weight_dtype == torch.float16
    with torch.inference_mode():
        assert_close(m2(x.half()), y.double(), _same_values(torch.float16), "module.half()")


def test_registry_outlier_inputs_scale_one_percent_of_the_channels():
    from tilefuse import registry

    spec = registry.get("linear_fp8")
    params = dict(spec.accuracy_cases["cpu"][1], shape=(8, 250, 16))
    assert params["inputs"] == "outliers"
    x = spec.make_inputs(params, torch.device("cpu"), seed=3)["x_unquantized"]
    plain = spec.make_inputs(dict(params, inputs="gaussian"), torch.device("cpu"), seed=3)["x_unquantized"]
    ratio = (x.float() / plain.float()).mean(0)
    assert int((ratio > 10).sum()) == 2  # 1% of 250 channels, at least one
    assert torch.allclose(ratio[ratio > 10], torch.tensor(20.0), rtol=1e-2)  # bf16 rounding


# ---- sm_90a compile ---------------------------------------------------------------------------------------------
_ALIGNED = ("x_ptr", "w_ptr", "sx_ptr", "sw_ptr", "b_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_ym")


def _kept_tma_configs(fast_accum: bool):
    """The FP8 TMA space's configs the prune keeps for a bf16 output, as (index, config dict)."""
    from tilefuse.kernels.gemm import configs

    space = [configs.fp8_tma_config(**c) for c in configs.FP8_TMA_GEMM_CONFIGS]
    kept = configs.prune_fp8_tma_configs(space, {"y_ptr": torch.empty(0, dtype=torch.bfloat16)},
                                         FAST_ACCUM=fast_accum)
    return [(i, fast_accum) for i, c in enumerate(space) if c in kept]


@pytest.mark.parametrize("index,fast_accum", representative(
    [(1, True), (3, False)] + [c for c in _kept_tma_configs(True) + _kept_tma_configs(False)
                               if c not in ((1, True), (3, False))], keep=2))
def test_tma_kernel_compiles_to_wgmma_without_spills(index, fast_accum):
    """Each config the prune keeps, for each accumulation (FAST_ACCUM), as launched at the bench shapes (aligned),
    bf16 out with bias and GELU: FP8 wgmma from shared memory, not serialized, no spills, and shared memory within
    the prune's model and sm_90's 227 KB. The first cases are each mode's largest tile at its deepest pipeline
    (128x256x128 4 stages; with fp32 promotion 128x128x128 4 stages)."""
    from tilefuse.kernels.gemm import configs

    c = configs.FP8_TMA_GEMM_CONFIGS[index]
    cfg = configs.fp8_tma_config(**c)
    sig = {"*": "*fp8e4nv", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    facts = compile_sm90("tilefuse.kernels.gemm.fp8", "linear_fp8_tma_kernel", sig,
                         dict(HAS_BIAS=True, ACTIVATION="gelu", FAST_ACCUM=fast_accum, NUM_SMS=132, **cfg.kwargs),
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=_ALIGNED)
    model = configs.fp8_tma_smem_bytes(c["bm"], c["bn"], c["bk"], c["stages"], c.get("subtile", True), 2)
    assert facts["wgmma"] and not facts["wgmma_a_in_registers"] and not facts["wgmma_serialized"], facts
    assert facts["spill_store_bytes"] == 0, facts
    assert facts["shared"] <= model <= configs.SMEM_LIMIT, (c, facts, model)


@pytest.mark.exhaustive
def test_pointer_kernel_and_quantizer_compile_for_sm90():
    from tilefuse.kernels.gemm import configs

    cfg = configs.FP8_PORTABLE_GEMM_CONFIGS[0]
    sig = {"*": "*fp8e4nv", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    facts = compile_sm90("tilefuse.kernels.gemm.fp8", "linear_fp8_kernel", sig,
                         dict(HAS_BIAS=True, ACTIVATION="gelu", FAST_ACCUM=False, **cfg.kwargs),
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=("x_ptr", "w_ptr", "y_ptr", "N", "K", "stride_xm",
                                                             "stride_wn", "stride_ym"),
                         ones=("stride_xk", "stride_wk", "stride_yn"))
    assert facts["wgmma"] and facts["spill_store_bytes"] == 0, facts
    for K in (4096, 11008):  # one chunk; two sweeps
        tile = configs.quantize_rows_tile(K, interpret=False)
        facts = compile_sm90("tilefuse.kernels.gemm.fp8", "quantize_rows_kernel",
                             {"*": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, tile, num_warps=4, num_stages=1,
                             aligned=("x_ptr", "q_ptr", "stride_xm", "stride_qm", "K"), ones=("stride_xk",))
        assert facts["spill_store_bytes"] == 0, facts

"""The CPU path rounds fp32 -> bf16 to nearest even, as the GPU does (Triton 3.6's interpreter truncates)."""
import pytest
import torch

from helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="about the interpreter, the CPU path")


def test_bf16_casts_in_kernels_round_like_torch():
    import triton
    import triton.language as tl

    from tilefuse.kernels import fastpath  # noqa: F401  (installs the rounding on the interpreter path)

    @triton.jit
    def cast(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-40,
                            3.3961e38, 1.00390625, 1.01171875])  # the last two are bf16 ties
    x = torch.cat([torch.randn(1024 - special.numel(), generator=g) * 10, special])
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    cast[(1,)](x, y, N=x.numel())
    expected = x.to(torch.bfloat16)
    same = (y == expected) | (y.isnan() & expected.isnan())
    assert same.all(), (x[~same][:5], y[~same][:5], expected[~same][:5])

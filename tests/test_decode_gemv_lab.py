"""The decode GEMV lab kernel (benchmarks/decode_gemv.py, not dispatched): correct at every M it takes, with tails
on N and K, bias and activations, so its bench's timings on the H200 are of a right answer."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_gemv  # noqa: E402

DTYPE = torch.bfloat16 if ON_GPU else torch.float32


@pytest.mark.parametrize("M", [1, 5, 16, 64])
@pytest.mark.parametrize("activation,bias", [("gelu", True), (None, False), ("silu", True)])
def test_decode_kernel_matches_float64(M, activation, bias, device):
    g = torch.Generator().manual_seed(M)
    K, N = 300, 70  # tails on both: neither is a multiple of a tile
    x = torch.randn(M, K, generator=g).to(device, DTYPE)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device, DTYPE)
    b = torch.randn(N, generator=g).to(device, DTYPE) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    want = {"gelu": F.gelu, "silu": F.silu, None: lambda t: t}[activation](want)
    assert_close(decode_gemv.linear(x, w, b, activation), want, REL_L2_BOUND[DTYPE], f"M{M}")


def test_decode_kernel_rejects_what_it_does_not_take(device):
    x, w = torch.randn(65, 32, device=device), torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="M <= 64"):
        decode_gemv.linear(x, w)
    with pytest.raises(ValueError, match="unit inner strides"):
        decode_gemv.linear(x[:8].t().contiguous().t(), w)

"""Forward + backward of the training ops captured in one CUDA graph and replayed on new data: Linear+GELU at a
size whose backward runs the cooperative GEMM, attention
(causal, GQA), packed varlen attention (offsets unvalidated, as graphs need), the fused LM-head loss (targets
unchecked) and the QKV projection with RoPE. Each replay's outputs and gradients match an eager call on the
same data (within the bf16 bound: the loss's backward adds with atomics)."""
import pytest
import torch

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
BF16 = torch.bfloat16


def _r(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to("cuda", BF16)


def _attention(seed):
    q, k, v = _r(2, 8, 300, 64, seed=seed), _r(2, 2, 300, 64, seed=seed + 1), _r(2, 2, 300, 64, seed=seed + 2)
    return (q, k, v), _r(2, 8, 300, 64, seed=seed + 3), lambda q, k, v: tilefuse.attention(q, k, v, causal=True)


CU = None


def _varlen(seed):
    global CU
    lens = [100, 0, 257, 1, 150]
    CU = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    t = sum(lens)
    q, k, v = _r(t, 4, 64, seed=seed), _r(t, 2, 64, seed=seed + 1), _r(t, 2, 64, seed=seed + 2)
    return (q, k, v), _r(t, 4, 64, seed=seed + 3), lambda q, k, v: tilefuse.attention_varlen(
        q, k, v, CU, CU, 257, 257, causal=True, validate=False)


def _loss(seed):
    x, w = _r(300, 256, seed=seed), _r(1003, 256, seed=seed + 1, scale=256 ** -0.5)
    g = torch.Generator().manual_seed(2)  # one target for every replay: the graph holds it
    target = torch.randint(0, 1003, (300,), generator=g).cuda()
    target[::7] = -100

    def fn(x, w):
        return tilefuse.linear_cross_entropy(x, w, target, check_targets=False)
    return (x, w), torch.ones((), device="cuda"), fn


def _qkv(seed):
    x = _r(2, 128, 256, seed=seed)
    wq, wk, wv = (_r(rows, 256, seed=seed + i, scale=256 ** -0.5) for i, rows in enumerate((256, 128, 128), 1))
    pos = torch.arange(128, device="cuda", dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float32) / 64))
    freqs = torch.cat([pos[:, None] * inv[None]] * 2, -1)
    rotary = (freqs.cos(), freqs.sin())

    def fn(x, wq, wk, wv):
        q, k, v = tilefuse.qkv_projection(x, (wq, wk, wv), num_heads=4, num_kv_heads=2, rotary=rotary)
        return torch.cat([q.flatten(), k.flatten(), v.flatten()])
    dy = _r(2 * 4 * 128 * 64 + 2 * 2 * 2 * 128 * 64, seed=seed + 9)
    return (x, wq, wk, wv), dy, fn


def _linear_coop(seed):
    # Sizes where both backward GEMMs take the cooperative Gluon kernel (descriptors made in the kernel, scratch
    # from the allocator inside the capture): dx 16 x 9 and dW 34 x 9 output tiles, reductions 4352 and 2048.
    x, w, b = _r(2048, 2304, seed=seed), _r(4352, 2304, seed=seed + 1, scale=2304 ** -0.5), _r(4352, seed=seed + 2)
    return (x, w, b), _r(2048, 4352, seed=seed + 3), lambda x, w, b: tilefuse.linear(x, w, b, "gelu")


CASES = {"linear_cooperative_backward": _linear_coop, "attention": _attention, "attention_varlen": _varlen, "linear_cross_entropy": _loss, "qkv_projection": _qkv}


def _step(fn, leaves, dy):
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dy))


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_replays_in_a_cuda_graph(case):
    tensors, dy, fn = CASES[case](0)
    leaves = [t.clone().requires_grad_() for t in tensors]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile and tune outside the capture
            _step(fn, leaves, dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(fn, leaves, dy)
    for seed in (11, 12):
        fresh, fresh_dy, _ = CASES[case](seed)
        with torch.no_grad():
            for leaf, t in zip(leaves, fresh):
                leaf.copy_(t)
            dy.copy_(fresh_dy)
        graph.replay()
        torch.cuda.synchronize()
        want = _step(fn, [t.clone().requires_grad_() for t in fresh], fresh_dy)
        for i, (got, ref) in enumerate(zip(captured, want)):
            assert_close(got, ref, REL_L2_BOUND[BF16], f"{case} replay {seed}, output {i}")

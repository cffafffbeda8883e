"""Registry entry: the LM head's linear + cross-entropy, forward and backward, without logits
(tilefuse.linear_cross_entropy)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tilefuse.opspec import OpSpec
from tilefuse.opspecs.linear import random_normal
from tilefuse.ops import cross_entropy as ce_op

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (tokens, K, V): Llama-3's head and GPT-2's.
BENCH_SHAPES = [(8192, 4096, 128256), (8192, 768, 50257)]


def make_inputs(params: dict, device, seed: int) -> dict:
    """x ~ N(0, 1) (3-D when asked), W ~ N(0, 1/K), bias ~ N(0, 1), targets uniform over the vocabulary with
    every 7th (or, "all_ignored", every) token set to ignore_index -100."""
    M, K, V = params["shape"]
    randn = random_normal(params["dtype"], device, seed)
    x = randn(M, K)
    if params.get("layout") == "3d" and M % 3 == 0:
        x = x.view(3, M // 3, K)
    g = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, V, x.shape[:-1], generator=g)
    target.view(-1)[::7] = -100
    if params.get("all_ignored"):
        target.fill_(-100)
    return {"x": x, "weight": randn(V, K, scale=max(K, 1) ** -0.5), "target": target.to(device),
            "bias": randn(V) if params.get("bias") else None, "reduction": params.get("reduction", "mean"),
            "label_smoothing": params.get("label_smoothing", 0.0), "softcap": params.get("softcap")}


def _step(loss_fn, x, weight, target, bias, reduction, label_smoothing, softcap):
    """(loss, dx, dW[, db]) of a forward + backward with a fixed upstream gradient of ones."""
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    with torch.enable_grad():
        loss = loss_fn(leaves[0], leaves[1], target, leaves[2] if bias is not None else None, reduction,
                       label_smoothing, softcap)
        grads = torch.autograd.grad(loss, leaves, torch.ones_like(loss))
    return (loss.detach(), *grads)


def _fused_loss(x, weight, target, bias, reduction, label_smoothing, softcap):
    return ce_op.linear_cross_entropy(x, weight, target, bias, reduction=reduction, label_smoothing=label_smoothing,
                                      softcap=softcap)


def reference_loss(x, weight, target, bias, reduction, label_smoothing, softcap):
    """Eager: the logits materialised (in fp32 when x is 16-bit, as training code upcasts them)."""
    z = F.linear(x, weight, bias)
    z = z.float() if z.dtype in (BF16, FP16) else z
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.flatten(0, -2), target.flatten().long(), reduction=reduction,
                           label_smoothing=label_smoothing).view(target.shape if reduction == "none" else ())


def _fused(**inputs):
    return _step(_fused_loss, **inputs)


def _reference(**inputs):
    return _step(reference_loss, **inputs)


def _kernels_only(x, weight, target, bias, reduction, label_smoothing, softcap):
    """Forward rows and the backward op on all-ones row gradients, without the autograd engine."""
    K = x.shape[-1]
    x2d, t1d = x.reshape(-1, K), target.reshape(-1)
    rows, lse = ce_op._rows_impl(x2d, weight, bias, t1d, -100, label_smoothing, softcap)
    dloss = torch.where(t1d != -100, 1.0, 0.0)
    return (rows, *ce_op._backward_impl(dloss, x2d, weight, bias, t1d, lse, label_smoothing, softcap, True, True,
                                        bias is not None))


def _anchors(params):
    compiled = torch.compile(reference_loss, dynamic=False)
    anchors = {"torch.compile": lambda **inputs: _step(compiled, **inputs)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return anchors

    def liger(x, weight, target, bias, reduction, label_smoothing, softcap):
        fn = LigerFusedLinearCrossEntropyLoss(reduction=reduction, label_smoothing=label_smoothing,
                                              softcap=softcap)
        return fn(weight, x.flatten(0, -2), target.flatten(), bias)
    anchors["liger"] = lambda **inputs: _step(liger, **inputs)
    return anchors


def _bytes(params):
    """The minimum HBM bytes of the step, whichever form the launch layer takes: x and W (and b) read, dx and dW
    (and db) written, the logits kept on chip (fused). Eager (unfused) also writes the fp32 logits, reads them for
    the softmax and its gradient, and writes and reads that gradient."""
    M, K, V = params["shape"]
    s = params["dtype"].itemsize
    fused = (2 * M * K + 2 * V * K) * s
    logits = 4 * M * V * 4
    return {"fused": fused, "unfused": fused + logits}


LINEAR_CROSS_ENTROPY = OpSpec(
    name="linear_cross_entropy",
    summary=("cross_entropy(x @ W^T + b, target), forward + backward, no [tokens, V] tensor: in training over mean "
             "/ sum (bf16, fp32) token chunks with the gradients made in the forward; else lse over vocabulary "
             "chunks and the backward over the same chunks (logits recomputed, dz in place, dW and dx GEMMs)"),
    fused=_fused,
    reference=_reference,
    make_inputs=make_inputs,
    test_grid={
        "shape": [(33, 70, 301), (12, 9, 65), (30, 48, 130)],
        "dtype": [FP32, FP16, BF16],
        "reduction": ["mean", "sum", "none"],
        "label_smoothing": [0.0, 0.1],
        "softcap": [None, 5.0],
        "bias": [False, True],
        "layout": ["2d", "3d"],
    },
    gpu_test_grid={"shape": [(257, 1000, 50257), (1024, 768, 5003)]},
    bench_cases=[dict(shape=s, dtype=BF16) for s in BENCH_SHAPES],
    accuracy_cases={
        "cpu": [dict(shape=(33, 70, 301), dtype=d) for d in (FP32, BF16)],
        "gpu": [dict(shape=(1024, 2048, 32003), dtype=d) for d in (FP32, BF16)],
    },
    # the useful FLOPs: the logits' GEMM, dx and dW (a form that recomputes the logits does more work, not more of
    # the step)
    flops=lambda p: 6.0 * p["shape"][0] * p["shape"][1] * p["shape"][2],
    hbm_bytes=_bytes,
    bound="compute",
    anchors=_anchors,
    label=lambda p: (f"T{p['shape'][0]} K{p['shape'][1]} V{p['shape'][2]} {p.get('reduction', 'mean')}"
                     + (f" smoothing={p['label_smoothing']}" if p.get("label_smoothing") else "")
                     + (f" softcap={p['softcap']}" if p.get("softcap") else "") + (" bias" if p.get("bias") else "")),
    extra={"kernels_only": _kernels_only},
)

SPECS = [LINEAR_CROSS_ENTROPY]

"""Issue targets for the fused LM-head loss: forward + backward time and peak memory of tilefuse's
linear_cross_entropy (its two training forms: the gradients made in the forward over token chunks, and the chunked
forward with a backward that recomputes the logits) beside eager (F.linear + F.cross_entropy on fp32 logits),
torch.compile of the eager pair and Liger-Kernel's LigerFusedLinearCrossEntropyLoss (when its wheel is installed), side by side in one run.

Shapes: the Llama-3 head (8192 tokens, K 4096, V 128256), the Llama-1B training workload's (8192, 2048, 128256)
and GPT-2's (8192, 768, 50257), bf16, every 7th
target ignore_index. Time: triton.testing.do_bench median of one forward + backward (loss.backward(); the
leaves' .grad reset between calls). Memory: peak of one step above what is allocated before it (x, W, their
gradients' buffers from a previous step, the targets) -- the issue's "peak above the inputs, weight and its
gradient". Loss rel error against float64 on the same inputs. Writes JSON.

    python3 benchmarks/cross_entropy_head.py --out cross_entropy_head.json
"""
from __future__ import annotations

import argparse
import json

import torch
from tilefuse.kernels import switches
import torch.nn.functional as F

SHAPES = {"llama3": (8192, 4096, 128256), "llama1b": (8192, 2048, 128256), "gpt2": (8192, 768, 50257)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--chunk-mib", nargs="*", type=int, default=[128, 64],
                   help="more training-form variants at these logits-chunk sizes (MiB)")
    p.add_argument("--profile", nargs="*", default=[], metavar="SHAPE",
                   help="at these shapes, also print each variant's kernels (torch.profiler, CUDA time of 3 steps)")
    args = p.parse_args()
    import triton.testing

    import tilefuse

    def eager(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)
    compiled = torch.compile(eager, dynamic=False)

    from tilefuse.kernels.gemm.launch import loss as loss_launch
    shipped_chunk = loss_launch.LCE_TRAINING_CHUNK_BYTES

    def fused(training, chunk_bytes=shipped_chunk):
        def run(x, w, t):
            # the launch layer's forms (its LCE_TRAINING_FORM): gradients made in the forward, or the chunked
            # forward and the backward that recomputes the logits; the training form's logits chunk in bytes
            switches.gemm.LCE_TRAINING_FORM = training
            loss_launch.LCE_TRAINING_CHUNK_BYTES = chunk_bytes
            try:
                return tilefuse.linear_cross_entropy(x, w, t, check_targets=False)
            finally:
                loss_launch.LCE_TRAINING_CHUNK_BYTES = shipped_chunk
        return run
    variants = {"tilefuse (training form)": fused(True), "tilefuse (recomputing form)": fused(False),
                "eager": eager, "torch.compile": compiled}
    # the chunk trade: a smaller logits chunk holds less memory and reads and rewrites dW more often
    for mib in args.chunk_mib:
        variants[f"tilefuse (training form, {mib} MiB chunk)"] = fused(True, mib * 2**20)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        variants["liger"] = lambda x, w, t: liger(w, x, t)
    except ImportError as exc:
        print("liger-kernel not installed:", exc)
    rows = []
    for name in args.shapes:
        M, K, V = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(V, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5).requires_grad_()
        t = torch.randint(0, V, (M,), device="cuda", generator=g)
        t[::7] = -100
        with torch.no_grad():
            want = F.cross_entropy(F.linear(x.double(), w.double()), t).item()
        for vname, fn in variants.items():
            def step():
                x.grad = w.grad = None
                fn(x, w, t).backward()
            try:
                step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - before
                with torch.no_grad():
                    loss = fn(x, w, t).item()
                ms = triton.testing.do_bench(step)
                row = dict(shape=name, variant=vname, ms=ms, peak_above_inputs_bytes=peak,
                           loss_rel_err_vs_fp64=abs(loss - want) / abs(want))
                if name in args.profile and "MiB chunk" not in vname:
                    print(f"kernels of {vname} at {name}, 3 steps:\n{kernel_table(step)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - recorded
                row = dict(shape=name, variant=vname, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name()), f, indent=1)
    return 0


def kernel_table(step, steps: int = 3) -> str:
    """The CUDA kernels of ``steps`` calls of ``step``, by total GPU time (the launches' own names)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=90)


if __name__ == "__main__":
    raise SystemExit(main())

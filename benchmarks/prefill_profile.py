"""Where a patched model's prefill (or, with --train, training step) spends its time: torch.profiler over a
few forwards of a `tilefuse bench prefill` model (its own builder: config, seed, bf16 on the GPU), or a few
AdamW steps (forward with labels, backward, optimizer step) at `tilefuse bench train`'s batch and sequence,
eager and patched, printing for each the host (CPU) and device (CUDA) time per op and per kernel, sorted by
self host time and by device time, and the wall time per forward or step. One whose summed kernel time is
far below its wall time is host-bound; the rows say where the host goes.

    PYTHONPATH=$PWD/src python3 benchmarks/prefill_profile.py --model gpt2-medium [--forwards 3] [--rows 25]
    PYTHONPATH=$PWD/src python3 benchmarks/prefill_profile.py --model gpt2-small --train [--forwards 3]
        [--python: also cProfile the Python of the steps] [--only tilefuse]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import tilefuse
from tilefuse.harness import model_bench


def profile_forwards(model, ids, forwards: int, rows: int, label: str, train: bool = False,
                     python: bool = False) -> None:
    on_gpu = ids.is_cuda
    if train:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=model_bench.LR)

        def run():
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        context = torch.enable_grad
    else:
        def run():
            model(input_ids=ids)
        context = torch.no_grad
    what = "step" if train else "forward"
    with context():
        run()  # warm-up: compiles, tunes, captures the fast path's plans
        run()
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(forwards):
            run()
        if on_gpu:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / forwards
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            for _ in range(forwards):
                run()
            if on_gpu:
                torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / forwards if on_gpu else float("nan")
    print(f"== {label}: {1e3 * wall:.2f} ms per {what} (wall), kernels {device_us / 1e3:.2f} ms per {what}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    if on_gpu:
        print(events.table(sort_by="self_device_time_total", row_limit=rows))
    if python:  # where the host's Python goes (torch.profiler shows an autograd.Function's Python as self time)
        with context():
            py = cProfile.Profile()
            py.enable()
            for _ in range(forwards):
                run()
            py.disable()
            if on_gpu:
                torch.cuda.synchronize()
        print(f"== {label}: Python functions over {forwards} {what}s, by own time")
        pstats.Stats(py).sort_stats("tottime").print_stats(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-medium", choices=sorted(model_bench.MODELS))
    p.add_argument("--forwards", type=int, default=3)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--train", action="store_true", help="AdamW training steps at the train bench's shape")
    p.add_argument("--python", action="store_true", help="also cProfile the steps (Python functions by own time)")
    p.add_argument("--only", choices=("eager", "tilefuse"), default=None, help="profile one variant")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if args.train:
        batch, n = (model_bench.MODELS[args.model][3] if on_gpu else model_bench.TINY_TRAIN)[:2]
    else:
        batch, n = model_bench.MODELS[args.model][2] if on_gpu else model_bench.TINY_PREFILL
    for label in (args.only,) if args.only else ("eager", "tilefuse"):
        model = model_bench.build_model(args.model, on_gpu, seed=0)
        if label == "tilefuse":
            print(tilefuse.patch(model))
        device = next(model.parameters()).device
        ids = model_bench._tokens(model.config.vocab_size, batch, n, 1, device)
        profile_forwards(model, ids, args.forwards, args.rows,
                         f"{args.model} {label}" + (" train" if args.train else ""), train=args.train,
                         python=args.python)
        del model
        if on_gpu:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the end-to-end workloads spend their steps, per variant: GPU time per op family, GPU busy time per step,
and the host's share (step wall time minus GPU busy time, and the largest idle gaps between kernels).

Workloads, at the sizes of the benchmarks they come from (tilefuse.harness.mlp_train and model_bench, whose
builders, data and variants are used as they are):
- ``mlp-train-d1024``: ``tilefuse bench mlp-train``'s step (4 residual Linear+GELU blocks, d 1024, 8192 tokens,
  MSE, AdamW);
- ``gpt2-small-train``, ``llama-1b-train``: ``tilefuse bench train``'s step (forward with labels, backward,
  AdamW) at its batch and sequence;
- ``gpt2-medium-prefill``, ``llama-7b-prefill``: ``tilefuse bench prefill``'s forward (eval, no grad).
Variants: eager, tilefuse, torch.compile, torch.compile over tilefuse, and liger-kernel on the Llama workloads
(GPT-2 and the MLP have no Liger patch; such a variant is listed under ``not_applicable``; where liger-kernel is
not installed its entry is the failure saying so).

Each variant: ``--warmup`` steps (compilation, autotuning), ``--steps`` timed steps without the profiler (the
wall time per step), then ``--steps`` steps under torch.profiler, each inside a ``record_function`` marker that
ends after a device sync, so every kernel of a step lies in its marker's window. On a GPU (CPU and CUDA
activities), from the kernel, memcpy and memset events:
- GPU time per op family: each kernel's time, summed per family (``FAMILIES``: the first pattern that matches
  the kernel's name, lower-cased), per step; the ten longest kernels with their family;
- GPU busy per step: the union of the step's kernel intervals (kernels on several streams are not counted
  twice); host gap per step = the unprofiled wall time minus that; the idle time inside the profiled steps
  (window minus busy, the profiler's own host overhead included), the wait from the step's start to its first
  kernel, and the largest gaps between consecutive kernels with the kernels on either side.
Without a GPU there are no device events: families are formed from the CPU ops' self time (aten and tilefuse
op names), GPU busy and gaps are null, and model_bench's tiny configurations run (the Triton kernels in the
interpreter: a smoke check of the script, not a measurement).

Writes ``<out>/<workload>.json`` and ``<out>/<workload>.md`` (the tables) and prints the tables.

    PYTHONPATH=$PWD/src python3 benchmarks/model_profile.py --workload llama-1b-train [--variants eager tilefuse]
        [--warmup 3] [--steps 3] [--compile-mode max-autotune-no-cudagraphs] [--out model-profile]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is first imported: without a GPU the kernels are interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from tilefuse.harness import mlp_train, model_bench  # noqa: E402

# name -> (model_bench model or None for the MLP, "train" | "prefill")
WORKLOADS = {
    "mlp-train-d1024": (None, "train"),
    "gpt2-small-train": ("gpt2-small", "train"),
    "llama-1b-train": ("llama-1b", "train"),
    "gpt2-medium-prefill": ("gpt2-medium", "prefill"),
    "llama-7b-prefill": ("llama-7b", "prefill"),
}
MLP_D, MLP_TOKENS = 1024, 8192  # the GPU size of the MLP workload (mlp_train.CPU_SIZES without a GPU)
MLP_NO_LIGER = "Liger-Kernel has no patch for this MLP (Linear + GELU blocks)"
STEP_MARK = "model_profile::step"

# (family, pattern on the lower-cased kernel or op name): the first match wins, so the order matters. Names
# that say more than one thing go to the more specific family: a fused log-softmax to cross-entropy, a
# norm-prologue GEMM (norm_linear) to GEMM, an Inductor kernel to what it is named after (triton_tem_fused_mm:
# GEMM, triton_red_fused_native_layer_norm: norm), else to "elementwise/triton fused".
FAMILIES = (
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("copy/memcpy", r"memcpy|memset|direct_copy|copy_kernel|aten::copy_|aten::_to_copy|aten::to$|aten::clone"
                    r"|aten::contiguous"),
    ("cross-entropy", r"cross_entropy|lce|nll_loss|log_softmax|logsoftmax"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product"),
    ("gemm/matmul", r"cutlass|xmma|gemm|linear|nvjet|cublas|matmul|grad_input_kernel|grad_weight|qkv_projection"
                    r"|(^|[^a-z])(mm|addmm|bmm|baddbmm)([^a-z]|$)"),
    ("softmax", r"softmax"),
    ("norm", r"norm"),
    ("elementwise/triton fused", r"triton_|elementwise|gelu|silu|swiglu|glu_gate|gated_grad|activation_slope"
                                 r"|rope|rotary|aten::(add|sub|mul|div|neg|pow|rsqrt|exp|tanh|sigmoid|where|cat"
                                 r"|fill|zero)_?$"),
)
OTHER = "other"
FAMILY_NAMES = tuple(f for f, _ in FAMILIES) + (OTHER,)
_COMPILED = [(f, re.compile(p)) for f, p in FAMILIES]
TOP_KERNELS, TOP_GAPS, NAME_CHARS = 10, 5, 120


def family(name: str) -> str:
    """The op family of a kernel or op name (``FAMILIES``), ``other`` where no pattern matches."""
    low = name.lower()
    return next((f for f, pattern in _COMPILED if pattern.search(low)), OTHER)


# ----------------------------------------------------------------------------------------------- workloads

def variants_of(workload: str) -> tuple[tuple[str, ...], dict]:
    """(the variants that apply, {variant: why not} for the one that does not)."""
    model, _ = WORKLOADS[workload]
    if model is None:
        return mlp_train.VARIANTS, {model_bench.LIGER: MLP_NO_LIGER}
    return model_bench.default_variants(model), model_bench.not_applicable(model)


def resolve_variants(workload: str, names) -> list[str]:
    """The named variants (model_bench's names, '-' for spaces) in canonical order, or all that apply;
    ValueError for one that does not apply to the workload."""
    applicable, excluded = variants_of(workload)
    if not names:
        return list(applicable)
    chosen = {model_bench.variant_name(n) for n in names}
    for variant in chosen:
        if variant in excluded:
            raise ValueError(f"{variant} does not apply to {workload}: {excluded[variant]}")
    return [v for v in applicable if v in chosen]


def build_step(workload: str, variant: str, on_gpu: bool, compile_mode, seed: int = 0):
    """(step function, description of the sizes) of one variant, built afresh; the step syncs nothing."""
    model_name, kind = WORKLOADS[workload]
    device = torch.device("cuda" if on_gpu else "cpu")
    if model_name is None:
        dtype = torch.bfloat16 if on_gpu else torch.float32
        d, tokens = (MLP_D, MLP_TOKENS) if on_gpu else (mlp_train.CPU_SIZES["d"], mlp_train.CPU_SIZES["tokens"])
        state = mlp_train._initial_state(d, seed, dtype)
        x, target = mlp_train._data(d, tokens, seed, device, dtype)
        fwd, module = mlp_train._build(variant, d, state, device, dtype, compile_mode)
        opt = torch.optim.AdamW(module.parameters(), lr=mlp_train.LR)

        def step():
            opt.zero_grad(set_to_none=True)
            F.mse_loss(fwd(x).float(), target).backward()
            opt.step()
        return step, {"d": d, "tokens": tokens, "blocks": mlp_train.BLOCKS}
    fwd, module, _ = model_bench._variant_model(variant, model_name, on_gpu, seed, compile_mode)
    vocab = module.config.vocab_size
    if kind == "train":
        batch, seq = (model_bench.MODELS[model_name][3] if on_gpu else model_bench.TINY_TRAIN)[:2]
        module.train()
        opt = torch.optim.AdamW(module.parameters(), lr=model_bench.LR)
        ids = model_bench._tokens(vocab, batch, seq, seed + 10, device)

        def step():
            opt.zero_grad(set_to_none=True)
            fwd(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    else:
        batch, seq = model_bench.MODELS[model_name][2] if on_gpu else model_bench.TINY_PREFILL
        ids = model_bench._tokens(vocab, batch, seq, seed + 1, device)

        def step():
            with torch.no_grad():
                fwd(input_ids=ids)
    return step, {"model": model_name, "batch": batch, "seq": seq}


# ------------------------------------------------------------------------------------------------ profiling

def measure(step, warmup: int, steps: int, on_gpu: bool):
    """(unprofiled wall seconds per step, the profiler holding ``steps`` marked steps)."""
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = (time.perf_counter() - t0) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
                sync()
    return wall, prof


def _merge(intervals):
    """Sorted (start, end, name) intervals merged where they overlap: [(start, end, first name, last name)]."""
    merged = []
    for start, end, name in intervals:
        if merged and start <= merged[-1][1]:
            last = merged[-1]
            if end > last[1]:
                merged[-1] = (last[0], end, last[2], name)
        else:
            merged.append((start, end, name, name))
    return merged


def analyse_gpu(events, steps: int, wall_s: float) -> dict:
    """Family times, busy time, host gap and idle gaps from the profiled steps' device events (µs clock)."""
    windows = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.name == STEP_MARK and e.device_type == DeviceType.CPU)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                     and e.name != STEP_MARK)
    fam_us = dict.fromkeys(FAMILY_NAMES, 0.0)
    per_name = {}
    for start, end, name in kernels:
        fam_us[family(name)] += end - start
        total, calls = per_name.get(name, (0.0, 0))
        per_name[name] = (total + end - start, calls + 1)
    busy, idle, lead_in, gaps, outside = [], [], [], [], len(kernels)
    for i, (w0, w1) in enumerate(windows):
        inside = [k for k in kernels if w0 <= k[0] <= w1]
        outside -= len(inside)
        merged = _merge(inside)
        b = sum(e - s for s, e, *_ in merged)
        busy.append(b)
        idle.append((w1 - w0) - b)
        lead_in.append(merged[0][0] - w0 if merged else None)
        for prev, nxt in zip(merged, merged[1:]):
            gaps.append({"us": nxt[0] - prev[1], "step": i, "after": prev[3][:NAME_CHARS],
                         "before": nxt[2][:NAME_CHARS]})
    n = max(len(windows), 1)
    busy_ms = sum(busy) / n / 1e3
    gaps.sort(key=lambda g: -g["us"])
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {
        "wall_ms_per_step": 1e3 * wall_s,
        "profiled_wall_ms_per_step": sum(w1 - w0 for w0, w1 in windows) / n / 1e3,
        "gpu_busy_ms_per_step": busy_ms,
        "host_gap_ms_per_step": 1e3 * wall_s - busy_ms,
        "host_gap_fraction": (1e3 * wall_s - busy_ms) / (1e3 * wall_s) if wall_s else None,
        "profiled_idle_ms_per_step": sum(idle) / n / 1e3,
        "lead_in_us_per_step": lead_in,
        "kernels_per_step": (len(kernels) - outside) / n,
        "kernels_outside_steps": outside,
        "largest_gaps": gaps[:TOP_GAPS],
        "family_ms_per_step": {f: us / n / 1e3 for f, us in fam_us.items()},
        "top_kernels": [{"name": name[:NAME_CHARS], "family": family(name), "ms_per_step": us / n / 1e3,
                         "calls_per_step": calls / n} for name, (us, calls) in top],
        "steps_profiled": len(windows),
    }


def analyse_cpu(prof, steps: int, wall_s: float) -> dict:
    """Without device events: the CPU ops' self time per family (the step marker left out), per step."""
    windows = [e.time_range.elapsed_us() for e in prof.events()
               if e.name == STEP_MARK and e.device_type == DeviceType.CPU]
    n = max(len(windows), 1)
    fam_us = dict.fromkeys(FAMILY_NAMES, 0.0)
    ops = []
    for avg in prof.key_averages():
        if avg.key == STEP_MARK:
            continue
        fam_us[family(avg.key)] += avg.self_cpu_time_total
        ops.append((avg.key, avg.self_cpu_time_total, avg.count))
    ops.sort(key=lambda o: -o[1])
    in_ops = sum(fam_us.values()) / n / 1e3
    profiled = sum(windows) / n / 1e3
    return {
        "wall_ms_per_step": 1e3 * wall_s,
        "profiled_wall_ms_per_step": profiled,
        "gpu_busy_ms_per_step": None, "host_gap_ms_per_step": None, "host_gap_fraction": None,
        "profiled_idle_ms_per_step": None, "lead_in_us_per_step": None, "kernels_per_step": None,
        "kernels_outside_steps": None, "largest_gaps": [],
        "cpu_op_self_ms_per_step": in_ops,
        "cpu_outside_ops_ms_per_step": profiled - in_ops,  # Python (the interpreter's kernels among it)
        "family_ms_per_step": {f: us / n / 1e3 for f, us in fam_us.items()},
        "top_kernels": [{"name": name[:NAME_CHARS], "family": family(name), "ms_per_step": us / n / 1e3,
                         "calls_per_step": calls / n} for name, us, calls in ops[:TOP_KERNELS]],
        "steps_profiled": len(windows),
    }


def profile_variant(workload, variant, warmup, steps, on_gpu, compile_mode) -> dict:
    """One variant's entry: its sizes and analysis, or its failure (error and traceback's tail)."""
    scope = model_bench.liger_scope() if variant == model_bench.LIGER else contextlib.nullcontext()
    try:
        with scope:
            step, sizes = build_step(workload, variant, on_gpu, compile_mode)
            wall, prof = measure(step, warmup, steps, on_gpu)
            entry = (analyse_gpu(prof.events(), steps, wall) if on_gpu else analyse_cpu(prof, steps, wall))
            entry.update(sizes=sizes, error=None)
    except Exception as exc:  # noqa: BLE001 - recorded, the other variants still run
        failure = mlp_train._failure(exc)
        entry = {"error": failure["error"], "traceback": failure["traceback"]}
    finally:
        if variant.startswith("torch.compile"):
            torch._dynamo.reset()
        mlp_train._release(torch.device("cuda" if on_gpu else "cpu"))
    return entry


# ------------------------------------------------------------------------------------------------- output

def _cell(v, spec=".3f"):
    return "–" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    """The run as Markdown: the per-step table, the family table, the largest gaps, what did not apply."""
    on_gpu = result["on_gpu"]
    ran = {n: v for n, v in result["variants"].items() if v["error"] is None}
    lines = [f"# {result['workload']} on {result['device']} ({result['path']})", "",
             f"{result['warmup']} warm-up steps, {result['steps']} timed and {result['steps']} profiled per variant; "
             f"torch.compile mode {result['compile_mode']}."
             + ("" if on_gpu else " No GPU: CPU ops' self time per family, no device timeline (a smoke check).")]
    sizes = next((v["sizes"] for v in ran.values()), None)
    if sizes:
        lines[-1] += " Sizes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()) + "."
    lines.append("")
    if on_gpu:
        lines += ["| variant | wall ms/step | GPU busy ms/step | host gap ms/step | host gap | largest gap µs "
                  "| kernels/step |", "|---|---:|---:|---:|---:|---:|---:|"]
        for n, v in ran.items():
            gap = v["largest_gaps"][0]["us"] if v["largest_gaps"] else None
            lines.append(f"| {n} | {_cell(v['wall_ms_per_step'])} | {_cell(v['gpu_busy_ms_per_step'])} | "
                         f"{_cell(v['host_gap_ms_per_step'])} | {_cell(100 * v['host_gap_fraction'], '.1f')}% | "
                         f"{_cell(gap, '.1f')} | {_cell(v['kernels_per_step'], '.0f')} |")
    else:
        lines += ["| variant | wall ms/step | profiled ms/step | in CPU ops ms/step | outside ops ms/step |",
                  "|---|---:|---:|---:|---:|"]
        for n, v in ran.items():
            lines.append(f"| {n} | {_cell(v['wall_ms_per_step'])} | {_cell(v['profiled_wall_ms_per_step'])} | "
                         f"{_cell(v['cpu_op_self_ms_per_step'])} | {_cell(v['cpu_outside_ops_ms_per_step'])} |")
    for n, v in result["variants"].items():
        if v["error"] is not None:
            lines.append(f"| {n} | failed: {v['error']} |")
    for n, why in result["not_applicable"].items():
        lines.append(f"| {n} | not applicable: {why} |")
    used = [f for f in FAMILY_NAMES if any(v["family_ms_per_step"][f] for v in ran.values())]
    if ran:
        what = "GPU time" if on_gpu else "CPU self time"
        lines += ["", f"## {what} per op family, ms per step", "",
                  "| variant | " + " | ".join(used) + " |", "|---|" + "---:|" * len(used)]
        for n, v in ran.items():
            lines.append(f"| {n} | " + " | ".join(_cell(v["family_ms_per_step"][f]) for f in used) + " |")
    if on_gpu and ran:
        lines += ["", "## Largest idle gaps between consecutive kernels", ""]
        for n, v in ran.items():
            for g in v["largest_gaps"][:3]:
                lines.append(f"- {n}, step {g['step']}: {g['us']:.1f} µs after `{g['after'][:60]}`, before "
                             f"`{g['before'][:60]}`")
    return "\n".join(lines) + "\n"


def run(workload: str, variants=None, warmup: int = 3, steps: int = 3, compile_mode: str | None = None,
        out: str = "model-profile") -> dict:
    """Profile every chosen variant of the workload; write ``<out>/<workload>.json`` and ``.md``; return it."""
    from tilefuse.harness.report import _quiet_interpreter_math, environment

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    if warmup < 1 or steps < 1:
        raise ValueError("--warmup and --steps must be >= 1")
    chosen = resolve_variants(workload, variants)
    on_gpu = torch.cuda.is_available()
    if compile_mode is None:
        compile_mode = model_bench.GPU_COMPILE_MODE if on_gpu else None
    env = environment()
    _, excluded = variants_of(workload)
    result = {"benchmark": "model-profile", "workload": workload, "device": env["device"], "path": env["path"],
              "environment": env, "on_gpu": on_gpu, "warmup": warmup, "steps": steps,
              "compile_mode": compile_mode or "default", "families": dict(FAMILIES),
              "not_applicable": {v: why for v, why in excluded.items() if v not in chosen}, "variants": {}}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    with _quiet_interpreter_math():
        for variant in chosen:
            print(f"{workload}: {variant}", file=sys.stderr, flush=True)
            result["variants"][variant] = profile_variant(workload, variant, warmup, steps, on_gpu, compile_mode)
            (folder / f"{workload}.json").write_text(json.dumps(result, indent=1, default=str))
    (folder / f"{workload}.md").write_text(markdown(result))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, choices=list(WORKLOADS))
    p.add_argument("--variants", nargs="+", metavar="NAME",
                   help=f"a subset of: {', '.join(model_bench.VARIANTS)} (default: all that apply)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--steps", type=int, default=3, help="timed steps, then as many profiled (default 3)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile's mode (default: max-autotune-no-cudagraphs on a GPU, default on a CPU)")
    p.add_argument("--out", default="model-profile", help="output folder (default ./model-profile)")
    args = p.parse_args(argv)
    try:
        result = run(args.workload, args.variants, args.warmup, args.steps, args.compile_mode, args.out)
    except (ValueError, mlp_train.BenchArgumentError) as exc:
        p.error(str(exc))
    print(markdown(result))
    print(f"wrote {Path(args.out) / (args.workload + '.json')} and .md")
    return 1 if any(v["error"] for v in result["variants"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""``tilefuse bench mlp-train``: training throughput of a residual MLP stack, four ways, in one run.

The model: ``BLOCKS`` residual blocks ``x = x + fc2(gelu(fc1(x)))`` with fc1 = Linear(d, 4d), fc2 =
Linear(4d, d), biases on; MSE to a fixed random target; AdamW (lr 1e-4) straight on the parameters in
the model dtype, as torch does (bf16 on a GPU, so the optimizer state is bf16 too; fp32 on a CPU). The
loss is taken in fp32. One fixed batch of ``tokens`` rows and one target serve every step.

Variants, all from the same initial weights (the eager model is built once from the seed; its state is
copied into each variant) and the same data:
- ``eager``: torch.nn.Linear + F.gelu;
- ``tilefuse``: tilefuse.nn.Linear(d, 4d, activation="gelu") (GEMM + bias + GELU in one kernel) and
  tilefuse.nn.Linear(4d, d);
- ``torch.compile``: the eager model compiled; ``torch.compile over tilefuse``: the tilefuse model
  compiled (the tilefuse GEMMs stay custom ops, Inductor fuses what is around them). GPU:
  ``mode="max-autotune-no-cudagraphs"``, CPU: the default mode; ``dynamic=False`` either way.

Only the model is compiled; the loss, backward call and optimizer step are the same eager code for
every variant. Timing: the first ``warmup_steps`` steps (compilation, autotuning, allocator warm-up)
are left out; the rest are timed between two CUDA events (CPU: ``time.perf_counter``), with no host
sync inside (the loss of each step is copied into a device buffer, read once at the end). Peak memory:
``torch.cuda.max_memory_allocated`` over the timed steps (the peak stats are reset after the warm-up,
so max-autotune's benchmark buffers do not count); it includes the shared input and target, whose
size is in ``memory_baseline_bytes``. A variant that fails is recorded with its error and the run goes
on. On a CPU the kernels run in the Triton interpreter: losses are real, times are not.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from tilefuse.kernels import launches

VARIANTS = ("eager", "tilefuse", "torch.compile", "torch.compile over tilefuse")
BLOCKS = 4
LR = 1e-4
WARMUP_STEPS = 10        # at most; never more than half the steps (a 2-step CPU run times its 2nd step)
LOSS_RTOL = 0.01         # "final loss within 1% of eager"
GPU_COMPILE_MODE = "max-autotune-no-cudagraphs"
GPU_SIZES = {"d": 1024, "tokens": 8192, "steps": 2000}
CPU_SIZES = {"d": 16, "tokens": 32, "steps": 3}   # the interpreter: a tiny configuration
JSON_NAME = "mlp_train.json"
PNG_NAME = "loss_curves.png"


class BenchArgumentError(ValueError):
    """An argument of the benchmark that cannot run (raised before any work)."""


def default_sizes(on_gpu: bool | None = None) -> dict:
    """d, tokens and steps when the user gives none: the issue's sizes on a GPU, tiny ones otherwise."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    return dict(GPU_SIZES if on_gpu else CPU_SIZES)


def variant_name(text: str) -> str:
    """A variant from its name, case-insensitive, with '-' or '_' standing for spaces on a command
    line ("torch.compile-over-tilefuse")."""
    key = " ".join(text.replace("-", " ").replace("_", " ").lower().split())
    for name in VARIANTS:
        if name == key:
            return name
    raise BenchArgumentError(f"--variants: unknown variant {text!r}; known: {', '.join(VARIANTS)} "
                             "(on a command line '-' may stand for a space)")


# --------------------------------------------------------------------------------------------- models

class EagerBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class TilefuseBlock(torch.nn.Module):
    """The same parameters under the same names as EagerBlock (tilefuse.nn.Linear is a torch.nn.Linear),
    so the eager state dict loads unchanged; the GELU runs in fc1's epilogue."""

    def __init__(self, d: int):
        super().__init__()
        from tilefuse import nn as tnn

        self.fc1 = tnn.Linear(d, 4 * d, activation="gelu")
        self.fc2 = tnn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.fc1(x))


class ResidualMLP(torch.nn.Module):
    def __init__(self, d: int, block=EagerBlock, blocks: int = BLOCKS):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block(d) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _initial_state(d: int, seed: int, dtype: torch.dtype) -> dict:
    """The eager model's weights from the seed: built on the CPU in fp32 (the same numbers on any device),
    then cast to the model dtype, as ``model.to(dtype)`` would."""
    with torch.random.fork_rng(devices=[]):  # the caller's CPU generator is left as it was
        torch.manual_seed(seed)
        model = ResidualMLP(d, EagerBlock)
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items()}


def _data(d: int, tokens: int, seed: int, device, dtype):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, d, generator=g).to(device=device, dtype=dtype)
    target = torch.randn(tokens, d, generator=g).to(device=device, dtype=torch.float32)
    return x, target


def _build(variant: str, d: int, state: dict, device, dtype, compile_mode):
    """(module to call, module whose parameters train) of one variant, holding its own copy of ``state``."""
    block = TilefuseBlock if "tilefuse" in variant else EagerBlock
    model = ResidualMLP(d, block).to(device=device, dtype=dtype)
    model.load_state_dict(copy.deepcopy(state))
    if variant.startswith("torch.compile"):
        kwargs = {"dynamic": False}
        if compile_mode is not None:
            kwargs["mode"] = compile_mode
        return torch.compile(model, **kwargs), model
    return model, model


# ------------------------------------------------------------------------------------------- training

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(variant, d, state, x, target, steps, warmup, device, dtype, compile_mode, advance) -> dict:
    fwd, model = _build(variant, d, state, device, dtype, compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = torch.empty(steps, device=device, dtype=torch.float32)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(fwd(x).float(), target)
        loss.backward()
        opt.step()
        losses[i] = loss.detach()
        advance()

    graphs_before = _dynamo_counts()
    t0 = time.perf_counter()
    with launches.recording() as records:  # what ran, read from the warm-up steps only
        for i in range(warmup):
            step(i)
        _sync(device)
    warmup_s = time.perf_counter() - t0
    graphs_after = _dynamo_counts()
    seconds, peak = timed_steps(step, warmup, steps, device)
    timed = steps - warmup
    curve = losses.tolist()
    return {
        "tokens_per_s": x.shape[0] * timed / seconds,
        "step_ms": 1e3 * seconds / timed,
        "peak_memory_bytes": peak,
        "final_loss": curve[-1],
        "loss_curve": curve,
        "warmup_s": warmup_s,
        "kernels": _describe(records),
        # what torch.compile made of the model: one graph and no breaks means all of it was compiled
        "compiled_graphs": graphs_after[0] - graphs_before[0] if fwd is not model else None,
        "graph_breaks": graphs_after[1] - graphs_before[1] if fwd is not model else None,
        "error": None,
    }


def timed_steps(step, first: int, last: int, device) -> tuple[float, int | None]:
    """(seconds, peak bytes) of ``step(i)`` for i in [first, last): between two CUDA events with the peak
    memory stats reset before (GPU), or by time.perf_counter with no peak (CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(first, last):
            step(i)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(device)
    t0 = time.perf_counter()
    for i in range(first, last):
        step(i)
    return time.perf_counter() - t0, None


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from torch._dynamo's counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _describe(records) -> list[str]:
    """The distinct launches of the warm-up steps, e.g. "linear compiled tma: 128x256x64 w8 s3"."""
    texts = []
    for r in records:
        text = f"{r.op} " + r.describe().replace(" (replayed)", "")
        if text not in texts:
            texts.append(text)
    return texts


def _failure(exc: BaseException) -> dict:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"tokens_per_s": None, "step_ms": None, "peak_memory_bytes": None, "final_loss": None,
            "loss_curve": [], "warmup_s": None, "kernels": [], "compiled_graphs": None, "graph_breaks": None,
            "error": f"{type(exc).__name__}: {first[:300]}",
            "traceback": "".join(tb).splitlines()[-25:]}


def _release(device):
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a failed variant's CUDA error is already recorded
            pass
        torch.cuda.empty_cache()


def _ratios(variants: dict) -> None:
    """tokens/s over eager's and over torch.compile's; loss check against eager's final loss."""
    def tps(name):
        v = variants.get(name)
        return v["tokens_per_s"] if v and v["error"] is None else None

    eager_tps, compile_tps = tps("eager"), tps("torch.compile")
    eager = variants.get("eager")
    eager_loss = eager["final_loss"] if eager and eager["error"] is None else None
    eager_ok = eager_loss is not None and math.isfinite(eager_loss) and eager_loss != 0
    for v in variants.values():
        ok = v["error"] is None
        v["vs_eager"] = v["tokens_per_s"] / eager_tps if ok and eager_tps else None
        v["vs_torch_compile"] = v["tokens_per_s"] / compile_tps if ok and compile_tps else None
        rel = within = None
        if ok and not math.isfinite(v["final_loss"]):
            within = False
        elif ok and eager_ok:
            rel = abs(v["final_loss"] - eager_loss) / abs(eager_loss)
            within = rel <= LOSS_RTOL
        v["final_loss_rel_diff_vs_eager"] = rel
        v["final_loss_within_1pct_of_eager"] = within
        # the whole curve against eager's: where the trajectories part, not only where they end
        curve_rel = [abs(a - b) / abs(b) if b else math.inf
                     for a, b in zip(v["loss_curve"], eager["loss_curve"])] if ok and eager_ok else []
        v["curve_max_rel_diff_vs_eager"] = (None if not curve_rel else max(curve_rel)
                                            if all(map(math.isfinite, curve_rel)) else math.nan)
        v["curve_first_step_over_1pct_vs_eager"] = next(
            (i for i, r in enumerate(curve_rel) if not r <= LOSS_RTOL), None)


def resolve_args(d, steps, tokens, variants, on_gpu: bool):
    """(d, steps, tokens, variants) with the defaults filled in and each checked; the variants in the
    canonical order, each once. Raises :class:`BenchArgumentError` before any work."""
    sizes = default_sizes(on_gpu)
    d = sizes["d"] if d is None else d
    steps = sizes["steps"] if steps is None else steps
    tokens = sizes["tokens"] if tokens is None else tokens
    for name, value, least in (("d", d, 1), ("tokens", tokens, 1), ("steps", steps, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            why = " (one warm-up step, then timed ones)" if name == "steps" else ""
            raise BenchArgumentError(f"--{name} must be an integer >= {least}{why}, got {value!r}")
    if variants is not None and not variants:
        raise BenchArgumentError(f"--variants: name at least one of {', '.join(VARIANTS)}")
    chosen = {variant_name(v) for v in (variants or VARIANTS)}
    return d, steps, tokens, [v for v in VARIANTS if v in chosen]


def run_mlp_train(d: int | None = None, steps: int | None = None, tokens: int | None = None,
                  variants=None, out_dir="bench-mlp-train", seed: int = 0, progress: bool = True,
                  compile_mode: str | None = None) -> dict:
    """Train every variant ``steps`` steps from the same weights and data; write ``mlp_train.json`` and
    ``loss_curves.png`` into ``out_dir`` and return the JSON's content. Sizes left None take
    :func:`default_sizes` (tiny without a GPU). ``compile_mode``: torch.compile's mode for the compiled variants
    (None: GPU_COMPILE_MODE on a GPU, torch's default on a CPU)."""
    from rich.progress import Progress

    from tilefuse.harness.report import _quiet_interpreter_math, environment

    on_gpu = torch.cuda.is_available()
    d, steps, tokens, chosen = resolve_args(d, steps, tokens, variants, on_gpu)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if compile_mode is None:
        compile_mode = GPU_COMPILE_MODE if on_gpu else None
    warmup = min(WARMUP_STEPS, steps // 2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    env = environment()
    result = {
        "benchmark": "mlp-train",
        "device": env["device"], "path": env["path"],
        "torch": env["torch"], "triton": env["triton"], "environment": env,
        "dtypes": {"params": _dtype_name(dtype), "optimizer_state": _dtype_name(dtype), "loss": "fp32"},
        "d": d, "hidden": 4 * d, "blocks": BLOCKS, "steps": steps, "tokens": tokens, "seed": seed,
        "lr": LR, "optimizer": "torch.optim.AdamW (defaults besides lr)",
        "warmup_steps": warmup, "timed_steps": steps - warmup,
        "compile": {"mode": compile_mode or "default", "dynamic": False},
        "timing": "CUDA events around the timed steps" if on_gpu else
                  f"time.perf_counter on the CPU (tilefuse path: {env['path']}): not a speed measurement",
        "memory_baseline_bytes": None,
        "loss_rtol_vs_eager": LOSS_RTOL,
        "variants": {},
    }
    state = _initial_state(d, seed, dtype)
    x, target = _data(d, tokens, seed, device, dtype)
    if on_gpu:
        result["memory_baseline_bytes"] = torch.cuda.memory_allocated(device)
    with Progress(disable=not progress, transient=True) as bar, _quiet_interpreter_math():
        task = bar.add_task("mlp-train", total=steps * len(chosen))
        for name in chosen:
            bar.update(task, description=f"mlp-train: {name}")
            try:
                entry = _train(name, d, state, x, target, steps, warmup, device, dtype, compile_mode,
                               lambda: bar.advance(task))
            except Exception as exc:  # noqa: BLE001 - recorded in the JSON and the summary, never hidden
                entry = _failure(exc)
            result["variants"][name] = entry
            if name.startswith("torch.compile"):
                torch._dynamo.reset()  # frees the compiled graphs; the next variant compiles on its own
            _release(device)
            _ratios(result["variants"])
            _write(result, out)  # after every variant, so a run cut short keeps what finished
    result["plot"] = write_plot(result, out / PNG_NAME)
    _write(result, out)
    return result


def _dtype_name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def _write(result: dict, out: Path) -> None:
    (out / JSON_NAME).write_text(json.dumps(result, indent=1, default=str))


# ---------------------------------------------------------------------------------------- plot, text

LINESTYLES = {"eager": ("#7f7f7f", "-"), "tilefuse": ("#d62728", "--"), "torch.compile": ("#1f77b4", ":"),
              "torch.compile over tilefuse": ("#9467bd", "-.")}


def write_plot(result: dict, path: Path) -> str:
    """Loss against step for every variant that ran (top) and, with eager there, each one's relative
    difference from eager's curve (bottom: the curves overlap on the top panel when all is right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {n: v for n, v in result["variants"].items() if v["error"] is None and v["loss_curve"]}
    eager = ran.get("eager")
    others = [n for n in ran if n != "eager"] if eager else []
    fig, axes = plt.subplots(2 if others else 1, 1, figsize=(7, 5.5 if others else 3.5), sharex=True,
                             layout="constrained", squeeze=False)
    ax = axes[0][0]
    for name, v in ran.items():
        color, style = LINESTYLES[name]
        ax.plot(range(len(v["loss_curve"])), v["loss_curve"], style, color=color, label=name, linewidth=1.4)
    if result["warmup_steps"]:
        ax.axvspan(-0.5, result["warmup_steps"] - 0.5, color="#cccccc", alpha=0.4, lw=0,
                   label=f"warm-up (untimed, {result['warmup_steps']} steps)")
    ax.set_ylabel("MSE loss (fp32)")
    ax.set_title(f"mlp-train: {result['blocks']} blocks d={result['d']}, {result['tokens']} tokens/step, "
                 f"{result['dtypes']['params']} · {result['device']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(linewidth=0.4, alpha=0.5)
    if others:
        ax2 = axes[1][0]
        base = eager["loss_curve"]
        for name in others:
            color, style = LINESTYLES[name]
            rel = [max(abs(a - b) / abs(b), 1e-12) if b else float("nan")
                   for a, b in zip(ran[name]["loss_curve"], base)]
            ax2.plot(range(len(rel)), rel, style, color=color, label=name, linewidth=1.2)
        ax2.axhline(result["loss_rtol_vs_eager"], color="black", linewidth=0.8, linestyle="--",
                    label=f"{result['loss_rtol_vs_eager']:.0%} (the final-loss check)")
        ax2.set_yscale("log")
        ax2.set_ylabel("|loss − eager| / eager\n(0 drawn at 1e-12)")
        ax2.legend(fontsize=7)
        ax2.grid(linewidth=0.4, alpha=0.5)
    axes[-1][0].set_xlabel("step")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def summary_text(result: dict) -> str:
    """The run as a small table (one row per variant) and the final-loss check, as plain text."""
    head = ["variant", "tokens/s", "× eager", "× compile", "peak MiB", "final loss", "within 1% of eager"]
    rows = []
    for name, v in result["variants"].items():
        if v["error"] is not None:
            rows.append([name, "failed", "", "", "", "", v["error"][:80]])
            continue
        check = v["final_loss_within_1pct_of_eager"]
        rel = v["final_loss_rel_diff_vs_eager"]
        if check is None:
            check_text = "–"
        elif rel is None:
            check_text = "NO (loss not finite)"
        else:
            check_text = f"{'yes' if check else 'NO'} (rel diff {rel:.1e})"
        peak = v["peak_memory_bytes"]
        rows.append([name, _fmt(v["tokens_per_s"], ",.0f"), _fmt(v["vs_eager"], ".3f"),
                     _fmt(v["vs_torch_compile"], ".3f"), _fmt(None if peak is None else peak / 2**20, ",.0f"),
                     _fmt(v["final_loss"], ".6g"), check_text])
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = [f"mlp-train on {result['device']} ({result['path']}): {result['blocks']} blocks, d={result['d']}, "
             f"{result['tokens']} tokens/step, {result['steps']} steps ({result['warmup_steps']} warm-up), "
             f"{result['dtypes']['params']} params, torch.compile mode {result['compile']['mode']}"]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    curves = [f"{n} {_fmt(v['curve_max_rel_diff_vs_eager'], '.1e')}"
              + (f" (first > 1% at step {v['curve_first_step_over_1pct_vs_eager']})"
                 if v["curve_first_step_over_1pct_vs_eager"] is not None else "")
              for n, v in result["variants"].items()
              if n != "eager" and v["error"] is None and v.get("curve_max_rel_diff_vs_eager") is not None]
    if curves:
        lines.append("loss curve vs eager, largest |loss - eager| / eager over the steps: " + "; ".join(curves))
    compiled = [f"{n}: {v['compiled_graphs']} graph(s), {v['graph_breaks']} graph break(s)"
                for n, v in result["variants"].items() if v["error"] is None and v.get("compiled_graphs") is not None]
    if compiled:
        lines.append("torch.compile captured " + "; ".join(compiled))
    if result["path"] == "interpreter":
        lines.append("(no GPU: tilefuse ran in the Triton interpreter, so tokens/s mean nothing; losses are real)")
    elif result["path"] == "reference":
        lines.append("(no GPU and TRITON_INTERPRET unset: tilefuse ran its PyTorch reference, not Triton; "
                     "tokens/s mean nothing)")
    checked = [(n, v) for n, v in result["variants"].items() if n != "eager" and v["error"] is None]
    if "eager" in result["variants"] and checked:
        verdict = {True: "PASS", False: "FAIL", None: "not checked (eager did not finish)"}
        lines.append("final loss within 1% of eager: " + "; ".join(
            f"{n} {verdict[v['final_loss_within_1pct_of_eager']]}" for n, v in checked))
    return "\n".join(lines)


def problems(result: dict) -> list[str]:
    """What makes the run a failure: variants that failed, final losses off eager's by more than 1%."""
    out = []
    for name, v in result["variants"].items():
        if v["error"] is not None:
            out.append(f"{name}: {v['error']}")
        elif v["final_loss_within_1pct_of_eager"] is False:
            rel = v["final_loss_rel_diff_vs_eager"]
            out.append(f"{name}: final loss {v['final_loss']:.6g} is "
                       + (f"{rel:.2%} off eager's" if rel is not None else "not finite"))
    return out

"""Command line: ``tilefuse report | tune | info | bench mlp-train`` (also ``python -m tilefuse``).

On a machine without a GPU, ``report`` and ``bench`` run the kernels in the Triton interpreter; the
variable must be set before triton is imported, which is why this module imports the rest of tilefuse
lazily. Each command that runs kernels first checks what it needs (numpy for the interpreter, the
``report`` extra, the triton version) and stops with one line saying why and how to fix it, exit
status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from tilefuse import __version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tilefuse", description="Fused Triton kernels for transformer layers.")
    p.add_argument("--version", action="version", version=f"tilefuse {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="accuracy, speed, HBM bytes and roofline for every op on this device")
    r.add_argument("--ops", nargs="+", metavar="NAME", help="registry op names (default: all)")
    r.add_argument("--quick", action="store_true",
                   help="the first benchmark row and the first two accuracy cases per op, 3 seeds each, and no "
                   "anchor that compiles (torch.compile, FlexAttention) unless --anchors names it")
    r.add_argument("--seeds", type=int, default=None, help="seeds per accuracy case (default 20 on GPU, 3 on CPU)")
    r.add_argument("--out", default="report", help="output folder (default: ./report)")
    r.add_argument("--anchors", nargs="+", metavar="REGEX",
                   help="run only anchors whose whole name matches one of these regexes (eager unfused always runs)")
    r.add_argument("--dtype", nargs="+", metavar="NAME", choices=["fp32", "fp16", "bf16"],
                   help="only bench rows of these dtypes (accuracy cases all run)")
    r.add_argument("--cases", nargs="+", metavar="REGEX",
                   help="only bench rows whose label contains a match of one of these regexes")
    r.add_argument("--retune", action="store_true",
                   help="ignore configs in the user cache and the shipped table: tune every key in this run, "
                   "so each row's config is measured against the whole current space")
    r.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes that run the accuracy cases and each row's first (compiling) call "
                   "before the timing, which runs alone (default on a GPU: one per task -- an op's accuracy, a row's "
                   "first call -- up to the cores plus two, "
                   "at most 20; on a CPU 1; 1 runs everything in this process)")
    r.add_argument("--backend", choices=["auto", "tilefuse", "vendor"], default=None,
                   help="the backend every op takes in this run, workers included (sets TILEFUSE_BACKEND; default: "
                   "the environment's, else auto); the report records it")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    t = sub.add_parser("tune", help="autotune the kernels behind ops on this GPU and store the winners")
    t.add_argument("--ops", nargs="+", metavar="NAME", help="registry op names (default: all)")
    t.add_argument("--dtype", nargs="+", metavar="NAME", choices=["fp32", "fp16", "bf16"],
                   help="only bench cases of these dtypes (default: all)")
    t.add_argument("--out", metavar="FILE", help="also merge the chosen configs into FILE, a table in the "
                   "shipped format (src/tilefuse/configs/<gpu-slug>.json)")
    t.add_argument("--retune", action="store_true",
                   help="ignore configs already in the user cache or the shipped table; benchmark every key")
    sub.add_parser("info", help="versions, device, and which execution path runs")
    from tilefuse.harness import mlp_train, model_bench  # import torch only: triton stays unimported here

    b = sub.add_parser("bench", help="end-to-end benchmarks (timed on a GPU)")
    bsub = b.add_subparsers(dest="bench", required=True)
    m = bsub.add_parser(
        "mlp-train", help="training throughput of a residual MLP stack: eager, tilefuse, torch.compile",
        description="Trains 4 residual blocks x = x + fc2(gelu(fc1(x))) (Linear(d, 4d) + GELU, Linear(4d, d), "
        "biases) on a fixed random MSE target with AdamW (lr 1e-4), bf16 parameters on a GPU (fp32 on a CPU), "
        "from the same seeded weights and data in each variant: eager (torch.nn.Linear + F.gelu), tilefuse "
        "(tilefuse.nn.Linear with the GELU fused), torch.compile of the eager model and torch.compile over "
        "the tilefuse modules (mode=\"max-autotune-no-cudagraphs\" on a GPU, the default mode on a CPU). "
        "Writes mlp_train.json (tokens/s, peak memory, loss curves, ratios) and loss_curves.png. Without a "
        "GPU it runs the kernels in the Triton interpreter at d=16, tokens=32, steps=3 unless sizes are "
        "given: the losses are real there, the times are not.")
    m.add_argument("--d", type=int, default=None, help="model width (default 1024; 16 without a GPU)")
    m.add_argument("--steps", type=int, default=None,
                   help="training steps per variant, the first few untimed (default 2000; 3 without a GPU)")
    m.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192; 32 without a GPU)")
    m.add_argument("--variants", nargs="+", metavar="NAME",
                   help=f"a subset of: {', '.join(mlp_train.VARIANTS)} (default: all; '-' may stand for a "
                   "space, e.g. torch.compile-over-tilefuse)")
    m.add_argument("--out", default="bench-mlp-train", help="output folder (default: ./bench-mlp-train)")
    m.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data (default 0)")
    _compile_mode_argument(m)
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    for kind, what, default in (
            ("prefill", "one forward of B x N tokens (eval, no grad): median ms of each variant and the logits' "
             "rel-L2 against eager", "llama-7b"),
            ("train", "AdamW training steps (labels = inputs): tokens/s, peak memory, the loss against eager's "
             "every 20 steps", "gpt2-small")):
        k = bsub.add_parser(
            kind, help=f"Hugging Face models from their configs: {what}",
            description=f"{what.capitalize()}, for a Hugging Face model built from its config (random weights, "
            "no downloads, dropout 0): HF eager, tilefuse.patch-ed, torch.compile of the eager model, "
            "torch.compile over the patched one (mode=\"max-autotune-no-cudagraphs\" on a GPU unless "
            "--compile-mode says) and, for the Llama models, Liger-Kernel (apply_liger_kernel_to_llama; needs "
            f"pip install {model_bench.LIGER_PIN}, else its entry records that it is not installed; GPT-2 has no "
            "Liger patch). bf16 on a GPU; without one, a tiny configuration of the same family in the "
            f"Triton interpreter (times mean nothing there). Writes {kind}.json and a PNG.")
        k.add_argument("--model", default=None, help=f"one of: llama-7b, llama-1b, gpt2-medium, gpt2-small "
                       f"(default {default})")
        k.add_argument("--variants", nargs="+", metavar="NAME",
                       help=f"a subset of: {', '.join(model_bench.VARIANTS)} (default: all that apply to the model; "
                       f"{model_bench.LIGER} runs on the Llama models only; '-' may stand for a space)")
        if kind == "train":
            k.add_argument("--steps", type=int, default=None, help="steps per variant (default: the model's: "
                           "200 for GPT-2, 100 for Llama; 3 without a GPU)")
        else:
            k.add_argument("--repeats", type=int, default=10, help="timed forwards per variant (default 10)")
        k.add_argument("--out", default=f"bench-{kind}", help=f"output folder (default: ./bench-{kind})")
        k.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
        _compile_mode_argument(k)
        k.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compile_mode_argument(parser) -> None:
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                        help="torch.compile's mode for the compiled variants (default: max-autotune-no-cudagraphs "
                        "on a GPU, default on a CPU; max-autotune of a whole training step can take many minutes, "
                        "the JSON records the mode used)")


def _prepare_interpreter() -> None:
    import torch

    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _missing_report_extras() -> list[str]:
    """The packages of the ``report`` extra that cannot be imported."""
    missing = []
    try:
        import rich  # noqa: F401
    except ImportError:
        missing.append("rich")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing.append("matplotlib")
    return missing


def _triton_problem() -> str | None:
    """runtime.check_triton's complaint as text, or None (and the check is then done for this process)."""
    from tilefuse import runtime

    try:
        runtime.check_triton()
    except runtime.UnsupportedTritonError as exc:
        return str(exc)
    return None


def _preflight_report(what: str = "the report") -> str | None:
    """Why ``tilefuse report`` (or ``bench``: ``what`` names it) cannot run here, as one line (without the
    command's prefix), or None. Runs before anything is imported that imports triton."""
    import torch

    from tilefuse import runtime

    if not torch.cuda.is_available():
        problem = runtime.interpreter_numpy_problem()
        if problem:
            return problem
    missing = _missing_report_extras()
    if missing:
        return (f"{what} needs rich and matplotlib (the \"report\" extra), and {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed: pip install \"tilefuse[report]\"")
    return _triton_problem()


def cmd_info() -> int:
    import platform

    import torch

    from tilefuse import runtime

    triton_version = runtime.triton_version() or "not installed"

    path = runtime.default_path()
    explain = {
        runtime.COMPILED: "CUDA tensors run compiled Triton kernels",
        runtime.INTERPRETER: "TRITON_INTERPRET=1: CPU tensors run the Triton kernels in the interpreter (slow; for tests)",
        runtime.REFERENCE: "no GPU and TRITON_INTERPRET unset: CPU tensors run the PyTorch reference "
                           "implementations (tilefuse.reference), not Triton",
    }[path]
    print(f"tilefuse {__version__}")
    print(f"python {platform.python_version()} · torch {torch.__version__} · triton {triton_version}")
    problems = [runtime.triton_problem(), runtime.interpreter_numpy_problem() if path == runtime.INTERPRETER else None]
    for problem in filter(None, problems):
        print(f"warning: {problem}")
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        print(f"device: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}, "
              f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
    else:
        print("device: CPU only (no CUDA device visible)")
    print(f"path: {path} — {explain}")
    from tilefuse import registry
    print("ops: " + ", ".join(registry.REGISTRY))
    from tilefuse.kernels import switches
    print(f"switches (tilefuse.kernels.switches; {switches.ENV}=\"family.NAME=value,...\" sets them):")
    for row in switches.describe():
        changed = "" if row["value"] == row["default"] else f"  (default {row['default']!r})"
        print(f"  {row['family']}.{row['name']} = {row['value']!r}{changed}: {row['doc']}")
    from tilefuse import compile_rules
    print(f"patched patterns under torch.compile (tilefuse.compile_rules; {compile_rules.ENV}=\"pattern=rule,...\" "
          "sets them):")
    for pattern, rule in compile_rules.rules().items():
        default, why = compile_rules.DEFAULT_RULES[pattern]
        changed = "" if rule == default else f"  (default {default})"
        print(f"  {pattern} = {rule}{changed}: {why if rule == default else ''}".rstrip(": "))
    return 0


def cmd_report(args) -> int:
    _prepare_interpreter()
    problem = _preflight_report()
    if problem:
        print(f"tilefuse report: {problem}", file=sys.stderr)
        return 2
    from tilefuse import registry
    from tilefuse.harness import report

    for name in args.ops or []:
        if name not in registry.REGISTRY:
            print(f"tilefuse report: unknown op {name!r}; known ops: {', '.join(registry.REGISTRY)}",
                  file=sys.stderr)
            return 2

    if args.retune:
        from tilefuse import tuning
        tuning.use_stored_configs(False)
    if args.backend:
        os.environ["TILEFUSE_BACKEND"] = args.backend  # the spawned workers read it too
    try:
        result = report.run_report(ops=args.ops, quick=args.quick, seeds=args.seeds, out_dir=args.out,
                                   anchor_filter=args.anchors, show_progress=not args.no_progress,
                                   dtypes=args.dtype, case_filter=args.cases, jobs=args.jobs)
    except report.ReportArgumentError as exc:
        print(f"tilefuse report: {exc}", file=sys.stderr)
        return 2
    failed = [f"{name}: {a['case']} {a['dtype']}" for name, op in result["ops"].items()
              for a in op["accuracy"] if not a["pass"]]
    summary_text = getattr(report, "summary_text", None)  # the pass/fail summary, where the harness has it
    if summary_text is not None:
        text = summary_text(result)
        if text:
            print(text.rstrip("\n"))
    print(f"wrote {os.path.join(args.out, 'REPORT.md')}, report.json and plots")
    if failed:
        print("accuracy bound exceeded:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


def cmd_tune(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("tilefuse tune: tuning needs a CUDA device; interpreter timings mean nothing", file=sys.stderr)
        return 2
    if os.environ.get("TILEFUSE_AUTOTUNE", "1") == "0":
        print("tilefuse tune: TILEFUSE_AUTOTUNE=0 pins every kernel to its first config; unset it to tune",
              file=sys.stderr)
        return 2
    problem = _triton_problem()
    if problem:
        print(f"tilefuse tune: {problem}", file=sys.stderr)
        return 2
    from tilefuse import registry, tuning
    from tilefuse.harness.tune import tune_ops

    unknown = [name for name in args.ops or [] if name not in registry.REGISTRY]
    if unknown:
        print(f"tilefuse tune: unknown op {unknown[0]!r}; known ops: {', '.join(registry.REGISTRY)}",
              file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    print(f"tuning on {gpu}; user cache: {tuning.cache_dir() / tuning.gpu_slug(gpu)}")
    tuning.use_stored_configs(not args.retune)
    failures = tune_ops(args.ops or list(registry.REGISTRY), dtypes=args.dtype)
    records = tuning.tuning_records()
    for r in records:
        print(f"{r['kernel']} [{r['key']}]\n    {tuning.describe_record(r)}")
    if args.out:
        n = tuning.write_table(args.out, records, gpu)
        print(f"merged {n} configs into {args.out} (ship it as src/tilefuse/configs/{tuning.gpu_slug(gpu)}.json)")
    if failures:
        print("cases that failed:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def cmd_bench_mlp_train(args) -> int:
    import torch

    _prepare_interpreter()
    prog = "tilefuse bench mlp-train"
    problem = _preflight_report("the benchmark")
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    from tilefuse.harness import mlp_train

    try:
        mlp_train.resolve_args(args.d, args.steps, args.tokens, args.variants, torch.cuda.is_available())
    except mlp_train.BenchArgumentError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        tiny = mlp_train.default_sizes(on_gpu=False)
        defaulted = [f"{k}={v}" for k, v in tiny.items() if getattr(args, k) is None]
        if defaulted:
            print(f"no GPU: the kernels run in the Triton interpreter, so the sizes not given are tiny: "
                  f"{', '.join(defaulted)} (times mean nothing here; losses are real)")
    try:
        result = mlp_train.run_mlp_train(d=args.d, steps=args.steps, tokens=args.tokens, variants=args.variants,
                                         out_dir=args.out, seed=args.seed, progress=not args.no_progress,
                                         compile_mode=args.compile_mode)
    except mlp_train.BenchArgumentError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(mlp_train.summary_text(result))
    print(f"wrote {os.path.join(args.out, mlp_train.JSON_NAME)} and {os.path.join(args.out, mlp_train.PNG_NAME)}")
    problems = mlp_train.problems(result)
    if problems:
        print("variants that failed or whose final loss is off eager's by more than 1%:\n  "
              + "\n  ".join(problems), file=sys.stderr)
        return 1
    return 0


def cmd_bench_model(args) -> int:
    import torch

    _prepare_interpreter()
    prog = f"tilefuse bench {args.bench}"
    problem = _preflight_report("the benchmark")
    if problem is None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            problem = "the model benchmarks build Hugging Face models: pip install transformers"
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    from tilefuse.harness import mlp_train, model_bench

    try:
        model_bench.resolve(args.bench, args.model, args.variants, torch.cuda.is_available())
        result = model_bench.run(args.bench, args.model, args.variants, args.out, args.seed,
                                 steps=getattr(args, "steps", None), repeats=getattr(args, "repeats", 10),
                                 progress=not args.no_progress, compile_mode=args.compile_mode)
    except mlp_train.BenchArgumentError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(model_bench.summary_text(result))
    print(f"wrote {os.path.join(args.out, model_bench.JSON_NAMES[args.bench])}")
    failed = [f"{n}: {v['error']}" for n, v in result["variants"].items() if v.get("error")]
    if failed:
        print("variants that failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        return cmd_info()
    if args.command == "report":
        return cmd_report(args)
    if args.command == "tune":
        return cmd_tune(args)
    if args.command == "bench" and args.bench == "mlp-train":
        return cmd_bench_mlp_train(args)
    if args.command == "bench" and args.bench in ("prefill", "train"):
        return cmd_bench_model(args)
    raise AssertionError(args.command)

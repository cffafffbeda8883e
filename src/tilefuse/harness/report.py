"""``tilefuse report``: accuracy, speed, modeled HBM bytes and roofline for every registry op.

Writes REPORT.md, report.json and PNG plots into one folder. On a GPU every anchor runs in the same
process on the same inputs; on a CPU only accuracy (Triton interpreter) and the byte model are
meaningful, and the report says so.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import platform
import re
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

import torch

from tilefuse import registry, runtime, tuning
from tilefuse.kernels import launches
from tilefuse.opspec import OpSpec, dtype_name
from tilefuse.harness import plots
from tilefuse.harness.stats import error_stats, poison_outputs_like, to_float64
from tilefuse.harness.timing import bench_ms, compile_clock, graph_ms, host_us, measure_ceilings


def environment() -> dict:
    import numpy
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": numpy.__version__,
        "path": runtime.default_path(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})",
        "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    return env


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextmanager
def _quiet_interpreter_math():
    """The Triton interpreter evaluates kernels in numpy: exp(+large) overflowing to inf, inf - inf in a
    masked-out lane and the like are the expected math of the kernels there (the results are compared
    with float64 right after), but numpy warns about each. Those warnings are not tilefuse problems."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=RuntimeWarning,
            message=r"(overflow|invalid value|divide by zero|underflow) encountered in ")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"triton\.runtime\.interpreter")
        yield


def accuracy_cases(spec: OpSpec, quick: bool = False) -> list[dict]:
    cases = list(spec.accuracy_cases["gpu" if torch.cuda.is_available() else "cpu"])
    return cases[:QUICK_ACCURACY_CASES] if quick else cases


def accuracy_for_op(spec: OpSpec, seeds: int, progress=None, quick: bool = False) -> list[dict]:
    with _quiet_interpreter_math():
        return _accuracy_for_op(spec, seeds, progress, quick)


def _accuracy_for_op(spec: OpSpec, seeds: int, progress=None, quick: bool = False) -> list[dict]:
    device = _device()
    rows = []
    for params in accuracy_cases(spec, quick):
        bound = spec.tolerance(params)
        rel, mx, nan_bad = [], [], 0
        baselines = spec.extra.get("accuracy_baselines", {})
        baseline_rel = {name: [] for name in baselines}
        for seed in range(seeds):
            inputs = spec.make_inputs(params, device, 1000 + seed)
            with torch.no_grad():
                ref = spec.reference(**to_float64(inputs))
                poison_outputs_like(ref, params["dtype"])
                out = spec.fused(**inputs)
                for name, fn in baselines.items():  # the same inputs through another method, for comparison
                    baseline_rel[name].append(error_stats(fn(**inputs), ref).rel_l2)
            st = error_stats(out, ref)
            rel.append(st.rel_l2)
            mx.append(st.max_abs)
            nan_bad += st.nan_mismatch
            if progress is not None:
                progress.advance(progress.SEED)
        rows.append({
            "case": spec.label(params), "dtype": dtype_name(params["dtype"]), "seeds": seeds,
            "rel_l2": rel, "max_abs": mx, "nan_mismatch": nan_bad, "bound": bound,
            "rel_l2_median": _median(rel), "rel_l2_max": max(rel), "max_abs_max": max(mx),
            "pass": nan_bad == 0 and max(rel) <= bound,
            **({"baselines": {name: _median(r) for name, r in baseline_rel.items()}} if baselines else {}),
        })
    return rows


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class _StepClock:
    """Seconds of each step of a benchmark row (GPU work included: it synchronizes), kept in the row
    as ``step_seconds`` so a slow report shows where its time went."""

    def __init__(self):
        self.steps, self.last = {}, time.perf_counter()

    def __call__(self, name: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.steps[name] = round(self.steps.get(name, 0.0) + now - self.last, 2)
        self.last = now


def speed_for_case(spec: OpSpec, params: dict, ceilings: dict, anchor_filter, skipped=()) -> dict:
    """One benchmark row: fused vs eager vs anchors, same inputs, same process. ``compiled`` in the row:
    the Triton kernels the row built (compiled or loaded from the disk cache) and their seconds."""
    with compile_clock() as clock:
        row = _speed_for_case(spec, params, ceilings, anchor_filter, skipped)
    row["compiled"] = clock
    return row


def _speed_for_case(spec: OpSpec, params: dict, ceilings: dict, anchor_filter, skipped=()) -> dict:
    device = _device()
    step = _StepClock()
    inputs = spec.make_inputs(params, device, 0)
    flops = spec.flops(params)
    bytes_model = spec.hbm_bytes(params)
    row = {"case": spec.label(params), "dtype": dtype_name(params["dtype"]),
           "flops": flops, "hbm_bytes": bytes_model, "step_seconds": step.steps}
    step("inputs")
    with torch.no_grad():
        with launches.recording() as recs, _quiet_interpreter_math():
            out = spec.fused(**inputs)
        row["config"] = describe_launches(recs)
        step("first call")
        try:
            ref = spec.reference(**to_float64(inputs))
        except torch.OutOfMemoryError:  # e.g. attention's float64 scores at N 16k: this row's times still count
            ref = None
            torch.cuda.empty_cache()
        if ref is None:
            row.update(rel_l2=None, max_abs=None, bound=spec.tolerance(params), accuracy_pass=None,
                       accuracy_note="float64 reference does not fit in device memory at this shape")
        else:
            st = error_stats(out, ref)
            row.update(rel_l2=st.rel_l2, max_abs=st.max_abs, bound=spec.tolerance(params),
                       accuracy_pass=st.ok(spec.tolerance(params)))
        del ref, out
        step("float64 reference")
        if device.type != "cuda":
            row["ms"] = None
            return row
        row["ms"] = bench_ms(lambda: spec.fused(**inputs))
        step("do_bench")
        # A slow call needs fewer repetitions for a stable host time and GPU-only time (each host round
        # waits for the GPU to drain the previous one): about 0.1 s and 0.5 s of GPU work per row.
        calls, reps = _repetitions(row["ms"])
        row["host_us"] = host_us(lambda: spec.fused(**inputs), calls=calls)
        step("host time")
        # Backward rows replay autograd.grad, whose kernels the autograd engine issues on the forward's
        # stream, not the capturing one: capturing them would fail (and may poison the context). Their
        # GPU-only time is the spec's "kernels_only" callable: the backward's own code, no engine.
        if "kernels_only" in spec.extra:
            row["graph_ms"] = graph_ms(lambda: spec.extra["kernels_only"](**inputs), reps=reps)
        elif "graph_cache" in inputs:
            row["graph_ms"] = "not captured (autograd)"
        else:
            row["graph_ms"] = graph_ms(lambda: spec.fused(**inputs), reps=reps)
        step("CUDA graph")
        with launches.recording() as recs:
            spec.fused(**inputs)  # what runs once tuned (the first call may have tuned)
        row["config"] = describe_launches(recs)
        timings = {"eager unfused": _safe_bench(lambda: spec.reference(**inputs))}
        if isinstance(timings["eager unfused"], float):  # what the op replaces costs the host this much a call
            # as many calls as its own time asks for: eager attention at N 16384 takes 115 ms a call
            row["eager_host_us"] = host_us(lambda: spec.reference(**inputs),
                                           calls=_repetitions(timings["eager unfused"])[0])
        step("eager unfused")
        torch._dynamo.reset()  # fresh compile per shape family (recompile limit, dynamic=False)
        for name, fn in _running_anchors(spec, params, anchor_filter, skipped).items():
            timings[name] = _safe_bench(lambda fn=fn: fn(**inputs))
            step(name)
    ms = row["ms"]
    row["tflops"] = flops / (ms * 1e-3) / 1e12
    row["tbps"] = bytes_model["fused"] / (ms * 1e-3) / 1e12
    row["anchors"] = timings
    row["speedup"] = {k: (v / ms if isinstance(v, float) else None) for k, v in timings.items()}
    row["roofline_pct"] = _roofline_pct(spec, params, row, ceilings)
    return row


def _repetitions(ms: float) -> tuple[int, int]:
    """(host_us calls per round, graph_ms replays) for a call of ``ms`` milliseconds: 20 and 50 up to 5
    and 10 ms, then about 100 ms and 500 ms of GPU work, never fewer than 3 calls or 5 replays."""
    calls = 20 if ms < 5 else max(3, int(100 / ms))
    reps = 50 if ms < 10 else max(5, int(500 / ms))
    return calls, reps


def warm_row(spec: OpSpec, params: dict, anchor_filter, skipped=()) -> None:
    """One untimed call of a benchmark row's fused op and of each anchor that runs, so that the kernels
    they compile (Triton's, Inductor's) are in the disk caches before the row is timed. An anchor that
    fails here is left to the timing, which reports it."""
    inputs = spec.make_inputs(params, _device(), 0)
    with torch.no_grad():
        spec.fused(**inputs)
        if "kernels_only" in spec.extra:
            spec.extra["kernels_only"](**inputs)
        torch._dynamo.reset()
        for fn in _running_anchors(spec, params, anchor_filter, skipped).values():
            try:
                fn(**inputs)
            except Exception:  # noqa: BLE001 - the timed run reports it in the row
                pass
    torch.cuda.synchronize()


def prepare_op(name: str, quick: bool, seeds: int, bench_indices: list[int], anchor_filter, skipped,
               accuracy: bool = True, stored_configs: bool = True) -> dict:
    """What a ``--jobs`` worker process does for one task of an op before any timing: its accuracy cases
    (``accuracy``), then :func:`warm_row` for each benchmark row of ``bench_indices`` (GPU only). A kernel key
    with no stored config runs its first config untuned (:func:`tuning.tune_missing_keys`): workers share the
    GPU, so their timings would measure each other; for a row's key it also compiles the rest of the space,
    which the timing process then tunes from Triton's disk cache. Returns the accuracy rows and the configs
    they used. ``stored_configs``: the main process's :func:`tuning.stored_configs_used` (False under ``--retune``:
    a spawned worker starts with its own default)."""
    tuning.use_stored_configs(stored_configs)
    tuning.tune_missing_keys(False)
    # The workers already fill the cores: one CPU thread each for torch (idle OpenMP threads spin) and a
    # small compile pool for Inductor.
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        import torch._inductor.config as inductor_config
        inductor_config.compile_threads = 2
    spec = registry.get(name)
    before = _record_keys()
    started = time.perf_counter()
    rows = accuracy_for_op(spec, seeds, None, quick) if accuracy else []
    accuracy_seconds = time.perf_counter() - started
    warm_notes = []
    if torch.cuda.is_available():
        # A row's key that no table has is tuned by the timing process: compile its whole space here.
        tuning.tune_missing_keys(False, compile_space=True)
        for i in bench_indices:
            try:
                warm_row(spec, spec.bench_cases[i], anchor_filter, skipped)
            except torch.OutOfMemoryError:  # other workers hold memory too: the timing process compiles it
                warm_notes.append(spec.label(spec.bench_cases[i]))
            torch.cuda.empty_cache()
    return {"accuracy": rows, "accuracy_seconds": round(accuracy_seconds, 1),
            "prepare_seconds": round(time.perf_counter() - started, 1), "not_warmed": warm_notes,
            "tuning": [r for r in tuning.tuning_records() if (r["kernel"], r["key"]) not in before]}


def prepare_tasks(specs, bench_index: dict, weights: dict) -> list[tuple[str, bool, list[int], float]]:
    """The workers' tasks: per op one that runs its accuracy cases, and one per benchmark row it warms
    (GPU only), so that an op whose rows compile for minutes (attention's torch.compile and FlexAttention
    anchors) spreads over the pool instead of bounding the phase in one worker. Each task is (op, runs its
    accuracy, row indices, weight), heaviest first, so the longest ones start at once."""
    tasks = [(s.name, True, [], weights[s.name][0]) for s in specs]
    if torch.cuda.is_available():
        tasks += [(s.name, False, [i], w) for s in specs for i, w in zip(bench_index[s.name], weights[s.name][1])]
    return sorted(tasks, key=lambda t: -t[3])


def merge_prepared(parts: list[dict]) -> dict:
    """One op's worker results (its tasks' :func:`prepare_op` returns, the accuracy task's first) as one:
    ``prepare_seconds`` is the worker time its tasks took together."""
    first = parts[0]
    return {"accuracy": first["accuracy"], "accuracy_seconds": first["accuracy_seconds"],
            "prepare_seconds": round(sum(p["prepare_seconds"] for p in parts), 1),
            "not_warmed": [n for p in parts for n in p["not_warmed"]],
            "tuning": [r for p in parts for r in p["tuning"]]}


def default_jobs(n_tasks: int) -> int:
    """Worker processes for ``tilefuse report`` by default: on a GPU one per task (see :func:`prepare_tasks`),
    up to the cores plus two and at most 20 (a worker spends most of its time compiling on one core); on a
    CPU 1 (the interpreter is the work, and the machine's cores are few)."""
    if not torch.cuda.is_available():
        return 1
    return max(1, min(n_tasks, (os.cpu_count() or 2) + 2, 20))


def describe_launches(records) -> str:
    """The launch records of one call as the report's config column (each distinct record once)."""
    texts = []
    for r in records:
        text = r.describe().replace(" (replayed)", "")
        if text not in texts:
            texts.append(text)
    return "; ".join(texts) or "no kernel (reference or empty input)"


def _host_bound_mark(row) -> str:
    ms, us = row.get("ms"), row.get("host_us")
    return " †" if isinstance(ms, float) and isinstance(us, float) and us >= 0.8 * ms * 1e3 else ""


def _roofline_pct(spec, params, row, ceilings) -> float | None:
    bound = spec.bound_for(params)
    if bound == "compute":
        # A row with "fp8" set runs its products in e4m3: its ceiling is the FP8 GEMM's, whatever its output dtype.
        key = "gemm_fp8_TFLOPs" if params.get("fp8") else {
            torch.bfloat16: "gemm_bf16_TFLOPs", torch.float16: "gemm_fp16_TFLOPs",
            torch.float32: "gemm_fp32_TFLOPs"}.get(params["dtype"])
        ceiling = ceilings.get(key)
        return 100 * row["tflops"] / ceiling if ceiling else None
    ceiling = ceilings.get("read_TBps" if bound == "read" else "copy_TBps")
    return 100 * row["tbps"] / ceiling if ceiling else None


def _safe_bench(fn):
    """An anchor that fails on a shape is reported as failing (with its error), never dropped."""
    try:
        return bench_ms(fn)
    except Exception as exc:  # noqa: BLE001 - recorded in the report, not hidden
        torch.cuda.synchronize()
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


class ReportArgumentError(ValueError):
    """A report argument that selects nothing (raised before any GPU work)."""


def check_anchor_filter(anchor_filter, specs, bench_plan) -> None:
    """Every --anchors pattern must match (whole) some anchor of the selected rows; one that matches
    nothing would silently drop the comparison it was meant to select."""
    if not anchor_filter:
        return
    names = {"eager unfused"} | {n for s in specs for p in bench_plan[s.name] for n in s.anchors(p)}
    unmatched = [f for f in anchor_filter if not any(re.fullmatch(f, n) for n in names)]
    if unmatched:
        raise ReportArgumentError(f"--anchors {' '.join(unmatched)} matches no anchor of the selected rows "
                         f"(whole names; they have: {', '.join(sorted(names))})")


# --quick: one benchmark row per op, the first QUICK_ACCURACY_CASES accuracy cases at QUICK_SEEDS seeds each, and
# no anchor that compiles (their compiles take seconds to minutes a row: torch.compile's, FlexAttention's) unless
# --anchors names it. On a cold Triton cache a run's time is mostly kernel compiles, one per case's specialization.
QUICK_ROWS = 1
QUICK_ACCURACY_CASES = 2
QUICK_SEEDS = 3
QUICK_SKIPPED_ANCHORS = (r"torch\.compile.*", r"flex_attention.*")


class _Progress:
    """What the terminal shows while the report runs: the op and the case in progress, and an estimate of the
    time left. Each step is weighted by what it typically costs (an accuracy seed, a benchmark row with its
    anchors), and the estimate is this phase's elapsed time per weight done so far times the weight still to do,
    plus ``after``: the seconds expected of the phases that follow (the worker phase's estimate includes the
    timing of every row). ``start`` is the run's start, so the elapsed clock runs on across phases. With a
    terminal and the bar on, a rich bar; otherwise (--no-progress, or output to a file) one line per op on
    stderr."""

    SEED, ROW, ANCHOR = 1.0, 8.0, 4.0  # relative weights: one accuracy seed, a row's own timings, each anchor
    # Seconds per weight of the timing phase, for the estimate made before any of its rows is timed: on the H200
    # the full report times rows of weight ~20 (the row and its anchors) in about 3 s each.
    TIMING_SECONDS_PER_WEIGHT = 0.15

    def __init__(self, total: float, ops: int, bar: bool, start: float | None = None, after: float = 0.0):
        self.total, self.done, self.ops, self.op_index = max(total, 1e-9), 0.0, ops, 0
        self.phase_start = time.perf_counter()
        self.start = self.phase_start if start is None else start
        self.after = after
        self.stream = sys.stderr
        self.bar = None
        if bar and self.stream.isatty():
            from rich.progress import Progress
            self.bar = Progress(transient=True)
            self.task = self.bar.add_task("tilefuse report", total=self.total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def left_text(self) -> str:
        now = time.perf_counter()
        elapsed = now - self.start
        if self.done <= 0:
            return f"{_clock(elapsed)} elapsed"
        left = (now - self.phase_start) / self.done * (self.total - self.done) + self.after
        return f"{_clock(elapsed)} elapsed, about {_clock(left)} left"

    def op(self, name: str, what: str) -> None:
        self.op_index += 1
        line = f"[{self.op_index}/{self.ops}] {name}: {what} ({self.left_text()})"
        if self.bar is not None:
            self.bar.update(self.task, description=line)
        else:
            print(f"tilefuse report {line}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        else:
            print(f"tilefuse report: {text}", file=self.stream, flush=True)

    def case(self, name: str, what: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=f"[{self.op_index}/{self.ops}] {name}: {what} ({self.left_text()})")

    def advance(self, weight: float) -> None:
        self.done += weight
        if self.bar is not None:
            self.bar.advance(self.task, weight)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def run_report(ops=None, quick=False, seeds=None, out_dir="report", anchor_filter=None,
               show_progress=True, dtypes=None, case_filter=None, jobs=None) -> dict:
    """Every selected op's accuracy, then its benchmark rows. With ``jobs`` above 1 (a GPU's default, see
    :func:`default_jobs`) a pool of that many processes first runs each op's accuracy cases and, as tasks of
    their own, the first, compiling call of each row (:func:`prepare_tasks`, :func:`prepare_op`); the rows are
    then timed here, one at a time, with the pool gone, so no timing shares the GPU."""
    on_gpu = torch.cuda.is_available()
    seeds = seeds or (QUICK_SEEDS if quick else 20 if on_gpu else 3)
    specs = [registry.get(n) for n in ops] if ops else list(registry.REGISTRY.values())

    def selected(spec, params):
        return ((dtypes is None or dtype_name(params["dtype"]) in dtypes)
                and (not case_filter or any(re.search(f, spec.label(params)) for f in case_filter)))

    bench_index = {s.name: [i for i, p in enumerate(s.bench_cases) if selected(s, p)] for s in specs}
    check_anchor_filter(anchor_filter, specs, {s.name: [s.bench_cases[i] for i in bench_index[s.name]]
                                               for s in specs})
    if quick:
        bench_index = {name: cases[:QUICK_ROWS] for name, cases in bench_index.items()}
    bench_plan = {s.name: [s.bench_cases[i] for i in bench_index[s.name]] for s in specs}
    skipped = () if anchor_filter or not quick else QUICK_SKIPPED_ANCHORS

    def row_weight(spec, params):
        return _Progress.ROW + _Progress.ANCHOR * len(_running_anchors(spec, params, anchor_filter, skipped))
    row_weights = {s.name: [row_weight(s, p) if on_gpu else 0.0 for p in bench_plan[s.name]] for s in specs}
    accuracy_weight = {s.name: len(accuracy_cases(s, quick)) * seeds * _Progress.SEED for s in specs}
    tasks = prepare_tasks(specs, bench_index, {s.name: (accuracy_weight[s.name], row_weights[s.name])
                                               for s in specs})
    jobs = default_jobs(len(tasks)) if jobs is None else jobs
    if jobs < 1:
        raise ReportArgumentError(f"jobs must be at least 1, got {jobs}")
    jobs = min(jobs, len(tasks))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "seeds": seeds, "quick": quick, "ops": {},
              "anchors_skipped": list(skipped), "jobs": jobs, "backend": runtime.backend()}
    ceilings_started = time.perf_counter()
    result["ceilings"] = measure_ceilings() if on_gpu else {}
    result["ceilings_seconds"] = round(time.perf_counter() - ceilings_started, 1)
    started = time.perf_counter()
    prepared = {}
    total = sum(sum(w) for w in row_weights.values())
    if jobs > 1:
        with _Progress(sum(t[3] for t in tasks), len(specs), show_progress, start=started,
                       after=total * _Progress.TIMING_SECONDS_PER_WEIGHT) as progress:
            progress.note(f"accuracy and each row's first call of {len(specs)} ops in {jobs} worker processes "
                          f"({len(tasks)} tasks)")
            context = multiprocessing.get_context("spawn")  # a CUDA context does not survive fork
            with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
                stored = tuning.stored_configs_used()
                pending = {pool.submit(prepare_op, name, quick, seeds, rows, anchor_filter, skipped, accuracy,
                                       stored): (name, accuracy, weight) for name, accuracy, rows, weight in tasks}
                parts: dict = {s.name: [] for s in specs}
                left = {s.name: sum(1 for t in tasks if t[0] == s.name) for s in specs}
                for future in as_completed(pending):
                    name, accuracy, weight = pending[future]
                    part = future.result()
                    if accuracy:
                        parts[name].insert(0, part)
                    else:
                        parts[name].append(part)
                    progress.advance(weight)
                    left[name] -= 1
                    if left[name]:
                        continue
                    prepared[name] = merge_prepared(parts[name])
                    running = [n for n, k in left.items() if k]
                    progress.op(name, f"accuracy done in a worker ({prepared[name]['prepare_seconds']}s of worker "
                                      f"time)" + (f"; still running: {', '.join(running[:jobs])}" if running else ""))
        result["prepare_seconds"] = round(time.perf_counter() - started, 1)
    if not prepared:
        total += sum(accuracy_weight.values())
    with _Progress(total, len(specs), show_progress, start=started) as progress:
        for spec in specs:
            records_before = _record_keys()
            op_started = time.perf_counter()
            rows = len(bench_plan[spec.name]) if on_gpu else 0
            if spec.name in prepared:
                ready = prepared[spec.name]
                progress.op(spec.name, f"timing {rows} benchmark rows")
                entry = {"summary": spec.summary, "bound": spec.bound, "accuracy": ready["accuracy"],
                         "speed": [], "accuracy_seconds": ready["accuracy_seconds"],
                         "prepare_seconds": ready["prepare_seconds"], "not_warmed": ready["not_warmed"]}
                worker_tuning = ready["tuning"]
            else:
                progress.op(spec.name, f"{len(accuracy_cases(spec, quick))} accuracy cases x {seeds} seeds, "
                                       f"{rows} benchmark rows")
                entry = {"summary": spec.summary, "bound": spec.bound,
                         "accuracy": accuracy_for_op(spec, seeds, progress, quick), "speed": []}
                entry["accuracy_seconds"] = round(time.perf_counter() - op_started, 1)
                worker_tuning = []
            result["ops"][spec.name] = entry
            _write(result, out)
            for params, weight in zip(bench_plan[spec.name], row_weights[spec.name]):
                progress.case(spec.name, spec.label(params))
                if on_gpu:
                    row_started = time.perf_counter()
                    entry["speed"].append(speed_for_case(spec, params, result["ceilings"], anchor_filter, skipped))
                    entry["speed"][-1]["seconds"] = round(time.perf_counter() - row_started, 1)
                    progress.advance(weight)
                    _write(result, out)  # after every row, so a run cut short still leaves its results
                else:  # the byte model still holds; times do not
                    entry["speed"].append({"case": spec.label(params),
                                           "dtype": dtype_name(params["dtype"]),
                                           "flops": spec.flops(params), "hbm_bytes": spec.hbm_bytes(params),
                                           "ms": None})
            here = [r for r in tuning.tuning_records() if (r["kernel"], r["key"]) not in records_before]
            seen = {(r["kernel"], r["key"]) for r in here}
            entry["tuning"] = [r for r in worker_tuning if (r["kernel"], r["key"]) not in seen] + here
            entry["plots"] = plots.write_op_plots(spec.name, entry, out)
            entry["seconds"] = round(time.perf_counter() - op_started, 1)
    result["seconds"] = round(time.perf_counter() - started, 1)
    _write(result, out)
    return result


def _running_anchors(spec: OpSpec, params: dict, anchor_filter, skipped) -> dict:
    """The row's anchors (name -> callable) that this run times: --anchors' selection, else all but --quick's
    skipped ones."""
    return {name: fn for name, fn in spec.anchors(params).items() if _anchor_runs(name, anchor_filter, skipped)}


def _anchor_runs(name: str, anchor_filter, skipped) -> bool:
    if anchor_filter:
        return any(re.fullmatch(f, name) for f in anchor_filter)
    return not any(re.fullmatch(f, name) for f in skipped)


def _record_keys() -> set:
    return {(r["kernel"], r["key"]) for r in tuning.tuning_records()}


def _write(result: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(result, indent=1, default=_json_default))
    (out / "REPORT.md").write_text(render_markdown(result))


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return str(o)


def _fmt(v, spec=".3g"):
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    return format(v, spec)


def render_markdown(result: dict) -> str:
    env, ceil = result["environment"], result["ceilings"]
    on_gpu = bool(ceil)
    lines = ["# tilefuse report", "", "## Summary", ""]
    lines += [f"- {line}" for line in summary_lines(result)]
    lines += ["",
             f"{env['device']} · path `{env['path']}` · torch {env['torch']} · triton {env['triton']} · "
             f"python {env['python']} · {env['time_utc']} UTC · {result['seeds']} seeds per accuracy case", ""]
    if result.get("jobs", 1) > 1:
        what = "Accuracy cases and the first (compiling) call of every benchmark row" if on_gpu else "Accuracy cases"
        lines += [f"{what} ran in {result['jobs']} "
                  "worker processes before any timing; there a kernel key with no stored config ran its first "
                  f"config untuned (source \"{tuning.autotuner.UNTUNED_SOURCE}\" in the configs tables). Every "
                  "time below was measured afterwards in one process, with the workers gone.", ""]
    if on_gpu:
        lines += ["## Ceilings measured in this run", "",
                  "| copy TB/s (read+write) | read-only TB/s | GEMM bf16 TFLOP/s | GEMM fp16 TFLOP/s | GEMM fp32 TFLOP/s "
                  "| GEMM fp8 TFLOP/s |",
                  "|---|---|---|---|---|---|",
                  f"| {ceil['copy_TBps']:.2f} | {ceil['read_TBps']:.2f} | {ceil['gemm_bf16_TFLOPs']:.0f} | "
                  f"{ceil['gemm_fp16_TFLOPs']:.0f} | {ceil['gemm_fp32_TFLOPs']:.1f} | "
                  f"{_fmt(ceil.get('gemm_fp8_TFLOPs'), '.0f')} |", ""]
    else:
        lines += ["**Timing is not meaningful here**: no GPU, so kernels ran in the Triton interpreter. "
                  "Accuracy and the HBM byte model below are real; speed columns are empty.", ""]
    for name, op in result["ops"].items():
        baseline_names = sorted({n for a in op["accuracy"] for n in a.get("baselines", {})})
        lines += [f"## {name}", "", op["summary"], "", "### Accuracy (rel-L2 and max-abs vs float64)", "",
                  "| case | dtype | seeds | rel-L2 median | rel-L2 max | bound | max-abs max | NaN mismatches | pass |"
                  + "".join(f" {n}: rel-L2 median |" for n in baseline_names),
                  "|---|---|---|---|---|---|---|---|---|" + "---|" * len(baseline_names)]
        for a in op["accuracy"]:
            lines.append(f"| {a['case']} | {a['dtype']} | {a['seeds']} | {a['rel_l2_median']:.2e} | "
                         f"{a['rel_l2_max']:.2e} | {a['bound']:.0e} | {a['max_abs_max']:.2e} | "
                         f"{a['nan_mismatch']} | {'yes' if a['pass'] else '**NO**'} |"
                         + "".join(f" {_fmt(a.get('baselines', {}).get(n), '.2e')} |" for n in baseline_names))
        lines.append("")
        if op["speed"]:
            if on_gpu:
                lines += ["### Speed and roofline", ""]
                anchor_names = sorted({k for r in op["speed"] for k in r.get("anchors", {})})
                head = ["case", "dtype", "ms", "host µs", "eager host µs", "GPU-only ms", "TFLOP/s",
                        "TB/s (fused bytes)", "% ceiling"]
                head += [f"× {a}" for a in anchor_names] + ["rel-L2", "config"]
                lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                for r in op["speed"]:
                    cells = [r["case"], r["dtype"], _fmt(r["ms"], ".4f") + _host_bound_mark(r),
                             _fmt(r.get("host_us"), ".0f"), _fmt(r.get("eager_host_us"), ".0f"),
                             _fmt(r.get("graph_ms"), ".4f"), _fmt(r.get("tflops"), ".1f"),
                             _fmt(r.get("tbps"), ".2f"), _fmt(r.get("roofline_pct"), ".0f")]
                    for a in anchor_names:
                        t = r.get("anchors", {}).get(a)
                        cells.append(t if isinstance(t, str) else _fmt(r["speedup"].get(a), ".3f"))
                    cells += [_fmt(r.get("rel_l2"), ".1e"), r.get("config", "")]
                    lines.append("| " + " | ".join(cells) + " |")
                lines += ["", "× anchor = anchor time / tilefuse time (above 1: tilefuse is faster). "
                          "Anchor times in ms are in report.json. host µs: CPU time to issue one call (eager host "
                          "µs: the same for the eager unfused composition it replaces); "
                          "† marks rows where it is at least 80% of ms, so ms may be the host's, not "
                          "the GPU's. GPU-only ms: the call captured in a CUDA graph and replayed after "
                          "the same L2 flush (the kernels alone; TFLOP/s and % use ms); for backward "
                          "rows, the backward's kernels launched without the autograd engine."]
                geo = _geomean_speedups(op["speed"])
                if geo:
                    lines += ["", "Geomean speedup by dtype: " + "; ".join(
                        f"{dt}: " + ", ".join(f"× {a} {v:.3f}" for a, v in sp.items()) for dt, sp in geo.items())]
            lines += ["", "### Modeled HBM bytes (minimum traffic)", "", "| case | dtype | unfused MB | fused MB | saved |",
                      "|---|---|---|---|---|"]
            for r in op["speed"]:
                u, f = r["hbm_bytes"]["unfused"], r["hbm_bytes"]["fused"]
                lines.append(f"| {r['case']} | {r['dtype']} | {u / 1e6:.1f} | {f / 1e6:.1f} | {1 - f / u:.0%} |")
        if op.get("tuning"):
            lines += ["", "### Configs chosen in this run (and the ones they beat)", "",
                      "| kernel | key | choice |", "|---|---|---|"]
            for r in op["tuning"]:
                lines.append(f"| {r['kernel']} | `{r['key']}` | {tuning.describe_record(r)} |")
        lines.append("")
        for title, png in op.get("plots", {}).items():
            lines += [f"![{title}]({png})", ""]
    return "\n".join(lines) + "\n"


def _geomean_speedups(rows) -> dict:
    by_dtype: dict = {}
    for r in rows:
        for a, v in (r.get("speedup") or {}).items():
            if isinstance(v, float):
                by_dtype.setdefault(r["dtype"], {}).setdefault(a, []).append(v)
    return {dt: {a: math.exp(sum(map(math.log, vs)) / len(vs)) for a, vs in d.items()}
            for dt, d in by_dtype.items()}


# ----------------------------------------------------------------------------------------------- summary

def _ratio(v: float) -> str:
    return f"{v:.3f}x" if v < 10 else f"{v:.1f}x"


def _is_time(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def best_anchor(row: dict):
    """(name, anchor ms / tilefuse ms) of the fastest anchor of one speed row: the anchor other than
    tilefuse itself with the smallest time ("eager unfused" counts; anchors that failed do not). None
    when the row is untimed or no anchor ran."""
    if not _is_time(row.get("ms")):
        return None
    return plots.best_anchor(row)


def _accuracy_line(result: dict) -> list[str]:
    cases, failed = 0, []
    for name, op in result["ops"].items():
        for a in op.get("accuracy", []):
            cases += 1
            if not a.get("pass", False):
                why = [f"{a['nan_mismatch']} NaN mismatches"] if a.get("nan_mismatch") else []
                rel, bound = a.get("rel_l2_max"), a.get("bound")
                if not why or (isinstance(rel, float) and isinstance(bound, float) and not rel <= bound):
                    why.append(f"rel-L2 max {_fmt(rel, '.2e')} > bound {_fmt(bound, '.0e')}")
                failed.append(f"{name} {a['case']} {a['dtype']} ({', '.join(why)})")
    if not cases:
        return ["accuracy: no accuracy cases in this report"]
    verdict = "PASS" if not failed else "FAIL"
    line = f"accuracy {verdict}: bounds met on {cases - len(failed)} of {cases} cases"
    if failed:
        shown = failed[:4]
        line += "; failed: " + "; ".join(shown) + (f"; and {len(failed) - 4} more" if len(failed) > 4 else "")
    lines = [line]
    bench_bad = [f"{name} {r['case']} {r['dtype']}" for name, op in result["ops"].items()
                 for r in op.get("speed", []) if r.get("accuracy_pass") is False]
    if bench_bad:
        lines.append(f"benchmark shapes outside the bound: {len(bench_bad)} rows ("
                     + ", ".join(bench_bad[:4]) + (", ..." if len(bench_bad) > 4 else "") + ")")
    return lines


def _speed_line(name: str, op: dict) -> str | None:
    rows = [r for r in op.get("speed", []) if _is_time(r.get("ms"))]
    if not rows:
        return None
    scored = [(r, b) for r in rows if (b := best_anchor(r)) is not None]
    beats = [(r, b) for r, b in scored if b[1] >= 1.0]  # as benchmarks/RESULTS.md counts them
    trails = [(r, b) for r, b in scored if b[1] < 1.0]
    line = f"{name}: beats the best anchor on {len(beats)} of {len(rows)} rows, trails on {len(trails)}"
    if len(scored) < len(rows):
        line += f", {len(rows) - len(scored)} without an anchor that ran"
    notes = []
    if beats:
        r, b = max(beats, key=lambda rb: rb[1][1])
        notes.append(f"best: {r['case']} {r['dtype']} at {_ratio(b[1])} {b[0]}")
    if trails:
        r, b = min(trails, key=lambda rb: rb[1][1])
        notes.append(f"worst: {r['case']} {r['dtype']} at {_ratio(b[1])} {b[0]}")
    if notes:
        line += " (" + "; ".join(notes) + ")"
    failed = sum(1 for r in rows for v in (r.get("anchors") or {}).values() if isinstance(v, str))
    if failed:
        line += f"; {failed} anchor runs failed (ignored)"
    return line


def summary_lines(result: dict) -> list[str]:
    """The pass/fail summary: accuracy bounds met, then per timed op how often tilefuse beats / trails the
    best (fastest) anchor of each row, with the ratio."""
    lines = _accuracy_line(result)
    speed = [line for name, op in result["ops"].items() if (line := _speed_line(name, op))]
    if speed:
        lines += speed
    elif any(op.get("speed") for op in result["ops"].values()):
        lines.append("speed: not timed (no GPU: kernels ran in the Triton interpreter)")
    if result.get("quick"):
        skipped = result.get("anchors_skipped") or []
        lines.append(f"quick run: {QUICK_ROWS} benchmark row and the first {QUICK_ACCURACY_CASES} accuracy cases "
                     f"per op, {result['seeds']} seeds per accuracy case"
                     + (f"; anchors not run: {', '.join(skipped)}" if skipped else ""))
    if result.get("backend"):
        lines.append(f"backend: {result['backend']} (TILEFUSE_BACKEND; the config column names what ran)")
    if isinstance(result.get("seconds"), (int, float)):
        lines.append(f"took {_clock(result['seconds'])}")
    return lines


def summary_text(result: dict) -> str:
    """The summary as plain text, one line per item (what the CLI prints on the terminal)."""
    return "\n".join(summary_lines(result))

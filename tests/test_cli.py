"""The CLI and the report on this device (on a CPU: interpreter accuracy, no timing)."""
import json

import pytest
import torch

from tilefuse.harness.report import run_report


def test_report_writes_markdown_json_and_plots(tmp_path):
    result = run_report(ops=["linear"], quick=True, seeds=2, out_dir=tmp_path, show_progress=False)
    assert (tmp_path / "REPORT.md").read_text().startswith("# tilefuse report")
    data = json.loads((tmp_path / "report.json").read_text())
    acc = data["ops"]["linear"]["accuracy"]
    assert acc and all(a["pass"] and len(a["rel_l2"]) == 2 for a in acc)
    assert (tmp_path / "linear_accuracy.png").stat().st_size > 1000
    assert (tmp_path / "linear_bytes.png").stat().st_size > 1000
    speed = result["ops"]["linear"]["speed"]
    assert speed and all(r["hbm_bytes"]["unfused"] > r["hbm_bytes"]["fused"] for r in speed)
    if not torch.cuda.is_available():
        assert all(r["ms"] is None for r in speed)
        assert "not meaningful" in (tmp_path / "REPORT.md").read_text()


def test_cli_info_and_unknown_op(tmp_path, capsys):
    # `python -m tilefuse` runs cli.main (tests/test_packaging.py runs the module itself once).
    from tilefuse import cli

    assert cli.main(["info"]) == 0
    info = capsys.readouterr().out
    assert "linear" in info and "path:" in info
    assert cli.main(["report", "--ops", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err


def test_report_selects_bench_rows_by_dtype_and_label(tmp_path):
    result = run_report(ops=["linear"], seeds=1, out_dir=tmp_path, show_progress=False,
                        dtypes=["bf16"], case_filter=[r"^M(1|16) "])
    rows = result["ops"]["linear"]["speed"]
    assert [(r["case"], r["dtype"]) for r in rows] == [("M1 K4096 N4096 gelu", "bf16"), ("M16 K4096 N4096 gelu", "bf16")]


def test_report_refuses_an_anchor_pattern_that_matches_nothing(tmp_path, capsys):
    # "cublaslt" is not a whole anchor name ("cublaslt_epilogue" is): the run would silently lose that
    # column, so the CLI stops before any work and lists the names there are.
    from tilefuse import cli

    assert cli.main(["report", "--ops", "linear", "--anchors", "cublaslt", "torch.compile", "--out",
                     str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--anchors cublaslt matches no anchor" in err and "cublaslt_epilogue" in err
    assert not (tmp_path / "report.json").exists()


def test_every_anchor_can_be_listed_without_running_it():
    # The --anchors check builds every selected row's anchors before any work, on any device: building
    # one must not run anything (flex_attention's block mask is made by its first call).
    from tilefuse import registry
    from tilefuse.harness.report import check_anchor_filter

    specs = list(registry.REGISTRY.values())
    plan = {s.name: s.bench_cases for s in specs}
    check_anchor_filter(["liger", "torch.compile", "torch.compile max-autotune", "cublaslt_epilogue",
                         "sdpa (flash|cudnn|efficient)", "flex_attention"], specs, plan)


def test_report_retune_ignores_stored_configs(monkeypatch, tmp_path):
    """--retune: the report tunes every key against the current space instead of taking the shipped table's
    (or the user cache's) choice."""
    from tilefuse import cli
    from tilefuse.harness import report
    from tilefuse.tuning import autotuner

    seen = {}

    def fake_run_report(**kwargs):
        seen["stored"] = autotuner._use_stored_configs  # the flag the tuners read
        return {"ops": {}}

    monkeypatch.setattr(autotuner, "_use_stored_configs", True)
    monkeypatch.setattr(report, "run_report", fake_run_report)
    assert cli.main(["report", "--ops", "linear", "--retune", "--out", str(tmp_path)]) == 0
    assert seen["stored"] is False


def test_report_config_column_comes_from_the_launch_records():
    """A speed row's config column is the launch records of one fused call (kernels.launches.recording),
    each distinct record once, a replayed launch reading as the launch it replays."""
    from tilefuse import registry
    from tilefuse.harness import report
    from tilefuse.kernels import launches

    replayed = launches.LaunchRecord("linear", "compiled", "tma", "128x256x64 w8 s3", replayed=True)
    direct = launches.LaunchRecord("linear", "compiled", "tma", "128x256x64 w8 s3")
    other = launches.LaunchRecord("norm_forward", "compiled", "block", "BLOCK_N=4096 w8 s1")
    assert report.describe_launches([replayed, direct, other]) == (
        "compiled tma: 128x256x64 w8 s3; compiled block: BLOCK_N=4096 w8 s1")
    assert report.describe_launches([]) == "no kernel (reference or empty input)"

    spec = registry.get("linear")
    params = spec.accuracy_cases["gpu" if torch.cuda.is_available() else "cpu"][0]
    inputs = spec.make_inputs(params, report._device(), 0)
    with torch.no_grad(), launches.recording() as recs:
        spec.fused(**inputs)
    assert recs and all(r.op == "linear" for r in recs), recs
    if torch.cuda.is_available():
        return  # a GPU row also benchmarks the case and its anchors: too slow for this check
    row = report.speed_for_case(spec, params, {}, None)  # on a CPU: accuracy and config, no timing
    assert row["ms"] is None and row["accuracy_pass"]
    assert row["config"] == report.describe_launches(recs), (row["config"], recs)
    assert row["config"].startswith("interpreter"), row["config"]


def test_quick_report_names_each_op_with_the_time_left_and_skips_compiling_anchors(tmp_path, capsys):
    """--quick: the first row per op, 3 seeds, no anchor that compiles unless --anchors names it; without a
    terminal bar one line per op on stderr names it and estimates the time left."""
    from tilefuse.harness import report

    result = run_report(ops=["softmax", "rms_norm"], quick=True, out_dir=tmp_path, show_progress=False, jobs=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tilefuse report [")]
    assert [line.split(":")[0] for line in lines] == ["tilefuse report [1/2] softmax", "tilefuse report [2/2] rms_norm"]
    assert "elapsed, about" in lines[1] and lines[1].endswith("left)")
    assert result["seeds"] == report.QUICK_SEEDS
    assert all(len(op["speed"]) == report.QUICK_ROWS and op["seconds"] >= 0 for op in result["ops"].values())
    assert all(len(a["rel_l2"]) == report.QUICK_SEEDS for op in result["ops"].values() for a in op["accuracy"])
    text = (tmp_path / "REPORT.md").read_text()
    assert "quick run: 1 benchmark row and the first 2 accuracy cases per op" in text and "torch\\.compile" in text
    skipped = report.QUICK_SKIPPED_ANCHORS
    assert not report._anchor_runs("torch.compile max-autotune", None, skipped)
    assert not report._anchor_runs("flex_attention", None, skipped)
    assert report._anchor_runs("sdpa cudnn", None, skipped) and report._anchor_runs("liger", None, skipped)
    assert report._anchor_runs("torch.compile", ["torch.compile"], skipped)  # --anchors overrides --quick


def test_report_jobs_run_accuracy_in_workers_with_the_same_results(tmp_path, capsys):
    """--jobs 2: two spawned processes run the accuracy cases (and, on a GPU, each row's first call);
    their rows are the in-process run's, and the progress names each op as its worker finishes."""
    from tilefuse.harness import report

    ops = ["softmax", "rms_norm"]
    pooled = run_report(ops=ops, quick=True, seeds=1, out_dir=tmp_path / "pool", show_progress=False, jobs=2)
    err = capsys.readouterr().err
    assert "in 2 worker processes" in err
    assert sorted(line.split("] ")[1].split(":")[0] for line in err.splitlines()
                  if "accuracy done in a worker" in line) == sorted(ops)
    alone = run_report(ops=ops, quick=True, seeds=1, out_dir=tmp_path / "alone", show_progress=False, jobs=1)
    assert pooled["jobs"] == 2 and alone["jobs"] == 1
    for name in ops:
        assert pooled["ops"][name]["accuracy"] == alone["ops"][name]["accuracy"]
        assert len(pooled["ops"][name]["speed"]) == report.QUICK_ROWS
    assert "worker processes before any timing" in (tmp_path / "pool" / "REPORT.md").read_text()
    assert "worker processes" not in (tmp_path / "alone" / "REPORT.md").read_text()
    with pytest.raises(report.ReportArgumentError, match="jobs must be at least 1"):
        run_report(ops=ops, quick=True, out_dir=tmp_path / "bad", show_progress=False, jobs=0)


def test_report_workers_take_each_row_as_a_task_of_its_own(monkeypatch):
    """An op whose rows compile for minutes (attention: torch.compile and FlexAttention anchors per row) must
    spread its rows over the pool: one task per op's accuracy and, on a GPU, one per row, heaviest first."""
    from tilefuse import registry
    from tilefuse.harness import report

    specs = [registry.get("softmax"), registry.get("attention")]
    index = {"softmax": [0, 1], "attention": [0, 1, 2]}
    weights = {"softmax": (6.0, [12.0, 12.0]), "attention": (9.0, [28.0, 20.0, 24.0])}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same split on a GPU machine
    on_cpu = report.prepare_tasks(specs, index, weights)
    assert [(t[0], t[1], t[2]) for t in on_cpu] == [("attention", True, []), ("softmax", True, [])]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tasks = report.prepare_tasks(specs, index, weights)
    assert sorted((t[0], tuple(t[2])) for t in tasks if not t[1]) == [
        ("attention", (0,)), ("attention", (1,)), ("attention", (2,)), ("softmax", (0,)), ("softmax", (1,))]
    assert [t[3] for t in tasks] == sorted((t[3] for t in tasks), reverse=True)
    merged = report.merge_prepared([
        {"accuracy": ["a"], "accuracy_seconds": 2.0, "prepare_seconds": 2.5, "not_warmed": [], "tuning": [1]},
        {"accuracy": [], "accuracy_seconds": 0.0, "prepare_seconds": 4.0, "not_warmed": ["row"], "tuning": [2]}])
    assert merged == {"accuracy": ["a"], "accuracy_seconds": 2.0, "prepare_seconds": 6.5, "not_warmed": ["row"],
                      "tuning": [1, 2]}


def test_report_runs_under_the_backend_it_is_given(monkeypatch, tmp_path, capsys):
    """--backend vendor: the run (its workers too, through the environment) takes the vendor compositions, and the
    report says which backend it ran under."""
    from tilefuse import cli, runtime

    monkeypatch.setenv("TILEFUSE_BACKEND", "auto")  # the CLI sets the variable: monkeypatch restores it after
    assert cli.main(["report", "--ops", "softmax", "--quick", "--seeds", "1", "--jobs", "1", "--no-progress",
                     "--backend", "vendor", "--out", str(tmp_path)]) == 0
    assert runtime.backend() == "vendor"
    result = json.loads((tmp_path / "report.json").read_text())
    assert result["backend"] == "vendor"
    assert "backend: vendor" in capsys.readouterr().out


def test_report_workers_read_stored_configs_as_the_main_process_does(monkeypatch, tmp_path):
    """--retune turns stored configs off in the main process; each spawned worker starts with its own default, so
    the main process's setting travels with every task."""
    from concurrent.futures import Future

    from tilefuse import tuning
    from tilefuse.harness import report

    seen = []

    class Pool:  # runs nothing: records what each task was given
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            seen.append(args[-1])
            done = Future()
            done.set_result({"accuracy": [], "accuracy_seconds": 0.0, "prepare_seconds": 0.0, "not_warmed": [],
                             "tuning": []})
            return done

    monkeypatch.setattr(report, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(tuning.autotuner, "_use_stored_configs", False)
    report.run_report(ops=["softmax", "rms_norm"], quick=True, seeds=1, out_dir=tmp_path, show_progress=False, jobs=2)
    # One task per op's accuracy, and on a GPU one more per benchmark row (each row's first call).
    tasks = 2 + (2 * report.QUICK_ROWS if torch.cuda.is_available() else 0)
    assert seen == [False] * tasks

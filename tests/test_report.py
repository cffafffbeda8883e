"""The report's summary and plots, on synthetic results (no kernels run, no GPU needed)."""
import math
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tilefuse.harness import plots, report  # noqa: E402

ENV = dict(device="NVIDIA H200", path="compiled", torch="t", triton="t", python="p", time_utc="now")
CEIL = dict(copy_TBps=4.2, read_TBps=4.0, gemm_bf16_TFLOPs=700, gemm_fp16_TFLOPs=660, gemm_fp32_TFLOPs=50)


def _acc(case, dtype, rel, bound, ok=None, nan=0):
    row = dict(case=case, dtype=dtype, seeds=len(rel), rel_l2=rel, max_abs=[r * 10 for r in rel], nan_mismatch=nan,
               bound=bound, rel_l2_median=sorted(rel)[len(rel) // 2], rel_l2_max=max(rel), max_abs_max=10 * max(rel))
    row["pass"] = (nan == 0 and max(rel) <= bound) if ok is None else ok
    return row


def _row(case, ms, anchors, dtype="bf16"):
    """A timed speed row; anchors: name -> ms, or a 'failed: ...' string."""
    return dict(case=case, dtype=dtype, ms=ms, host_us=10.0, eager_host_us=7.0, graph_ms=ms, tflops=1.0, tbps=1.0,
                roofline_pct=50.0,
                anchors=anchors, rel_l2=1e-3, bound=1e-2, accuracy_pass=True, config="c",
                speedup={k: (v / ms if isinstance(v, float) else None) for k, v in anchors.items()},
                hbm_bytes={"fused": 1e6, "unfused": 3e6}, flops=1e9)


def _accuracy():
    return [_acc("A", "fp32", [1.1e-7, 1.3e-7, 1.2e-7], 1e-5), _acc("A", "fp16", [2.0e-4, 2.1e-4, 2.05e-4], 2e-3),
            _acc("A", "bf16", [1.6e-3, 1.7e-3, 1.65e-3], 1e-2), _acc("B", "bf16", [2.1e-3, 2.2e-3, 2.3e-3], 1e-2)]


def _gpu_result():
    attention = [
        # best anchor: cudnn (1.0 ms) -> 0.8x, trails; eager far off
        _row("N1024 full", 1.25, {"eager unfused": 25.0, "sdpa flash": 1.5, "sdpa cudnn": 1.0}),
        # cudnn failed (ignored): best is flash at 1.2x, beats
        _row("N4096 full", 1.0, {"eager unfused": 40.0, "sdpa flash": 1.2, "sdpa cudnn": "failed: RuntimeError: x"}),
        # worst: cudnn at 0.5x
        _row("N16384 causal", 2.0, {"eager unfused": 90.0, "sdpa flash": 2.6, "sdpa cudnn": 1.0}),
    ]
    linear = [_row("M1 K4096 N4096 gelu", 1.0, {"eager unfused": 0.9, "cublaslt_epilogue": 1.1})]  # eager is best
    bad = _acc("M8 N8", "fp16", [1e-4, 5e-3], 2e-3)
    ops = {"attention": dict(summary="s", bound="compute", accuracy=_accuracy(), speed=attention),
           "linear": dict(summary="s", bound="compute", accuracy=[bad], speed=linear)}
    return dict(environment=ENV, ceilings=CEIL, seeds=3, quick=False, ops=ops)


def _cpu_result():
    speed = [dict(case="16384x4096 online", dtype="bf16", flops=1e9, hbm_bytes={"fused": 1e6, "unfused": 2e6}, ms=None)]
    ops = {"softmax": dict(summary="s", bound="copy", accuracy=_accuracy(), speed=speed)}
    return dict(environment=ENV, ceilings={}, seeds=3, quick=True, ops=ops)


def test_summary_counts_rows_against_the_best_anchor_and_ignores_failed_ones():
    text = report.summary_text(_gpu_result())
    lines = text.splitlines()
    assert len(lines) == 3, text
    assert lines[0].startswith("accuracy FAIL: bounds met on 4 of 5 cases")
    assert "linear M8 N8 fp16 (rel-L2 max 5.00e-03 > bound 2e-03)" in lines[0]
    att = next(line for line in lines if line.startswith("attention:"))
    assert "beats the best anchor on 1 of 3 rows, trails on 2" in att
    assert "best: N4096 full bf16 at 1.200x sdpa flash" in att  # not the failed cudnn, not eager's 40x
    assert "worst: N16384 causal bf16 at 0.500x sdpa cudnn" in att
    assert "1 anchor runs failed (ignored)" in att
    lin = next(line for line in lines if line.startswith("linear:"))
    assert "beats the best anchor on 0 of 1 rows, trails on 1" in lin
    assert "worst: M1 K4096 N4096 gelu bf16 at 0.900x eager unfused" in lin  # eager unfused counts as an anchor


def test_speed_table_shows_the_host_time_beside_eagers():
    md = report.render_markdown(_gpu_result())
    head = next(line for line in md.splitlines() if line.startswith("| case | dtype | ms | host µs"))
    cells = [c.strip() for c in head.strip("|").split("|")]
    assert cells[3:5] == ["host µs", "eager host µs"]
    row = next(line for line in md.splitlines() if line.startswith("| M1 K4096 N4096 gelu |"))
    assert [c.strip() for c in row.strip("|").split("|")][3:5] == ["10", "7"]


def test_best_anchor_is_the_fastest_that_ran():
    r = _gpu_result()["ops"]["attention"]["speed"]
    assert report.best_anchor(r[0]) == ("sdpa cudnn", pytest.approx(0.8))
    assert report.best_anchor(r[1]) == ("sdpa flash", pytest.approx(1.2))
    untimed = _cpu_result()["ops"]["softmax"]["speed"][0]
    assert report.best_anchor(untimed) is None
    assert report.best_anchor(_row("x", 1.0, {"a": "failed: E"})) is None


def test_summary_on_a_cpu_report_has_no_speed():
    text = report.summary_text(_cpu_result())
    assert text.splitlines() == ["accuracy PASS: bounds met on 4 of 4 cases",
                                 "speed: not timed (no GPU: kernels ran in the Triton interpreter)",
                                 "quick run: 1 benchmark row and the first 2 accuracy cases per op, 3 seeds per accuracy case"]
    assert "beats" not in text


def test_report_md_starts_with_the_summary():
    for result in (_gpu_result(), _cpu_result()):
        md = report.render_markdown(result)
        head = md.split("\n## ", 2)
        assert md.startswith("# tilefuse report\n\n## Summary\n\n")
        assert head[1].startswith("Summary")
        bullets = [line[2:] for line in head[1].splitlines() if line.startswith("- ")]
        assert bullets == report.summary_text(result).splitlines()


def test_accuracy_plot_bins_are_shared_and_colored_by_dtype():
    acc = _accuracy()
    fig, ax = plt.subplots()
    drawn = plots.draw_accuracy(ax, "op", acc)
    bins = drawn["bins"]
    ratios = [bins[i + 1] / bins[i] for i in range(len(bins) - 1)]
    assert all(r == pytest.approx(ratios[0]) for r in ratios)  # log-spaced
    assert bins[0] <= 1.1e-7 and bins[-1] >= 2.3e-3  # spans every series
    # every bar of every series sits on one of the shared edges, and each is a visible fraction of a decade
    edges = [math.log10(b) for b in bins]
    rects = [p for p in ax.patches if p.get_height() > 0]
    assert rects
    for p in rects:
        assert any(math.isclose(math.log10(p.get_x()), e, abs_tol=1e-9) for e in edges)
        assert math.log10(p.get_x() + p.get_width()) - math.log10(p.get_x()) >= 0.1
    # one colour per dtype: the series of a dtype share it, and its bound line has the same colour
    assert drawn["colors"] == [plots.dtype_color(a["dtype"]) for a in acc]
    assert len({plots.dtype_color(d) for d in ("fp32", "fp16", "bf16")}) == 3
    lines = {(ln.get_xdata()[0], ln.get_color()) for ln in ax.get_lines()}
    assert lines == {(1e-5, plots.dtype_color("fp32")), (2e-3, plots.dtype_color("fp16")),
                     (1e-2, plots.dtype_color("bf16"))}
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "bf16 bound 1e-02 (dashed)" in labels and any(lab.startswith("fp16 · A") for lab in labels)
    plt.close(fig)


def test_speedup_plot_log_axis_set_by_the_anchors_not_eager():
    rows = _gpu_result()["ops"]["attention"]["speed"]
    fig, ax = plt.subplots()
    drawn = plots.draw_speedup(ax, "attention", rows)
    lo, hi = ax.get_ylim()
    assert ax.get_yscale() == "log" and lo < 0.5 and 1.3 < hi < 3  # set by flash/cudnn, not eager's 45x
    assert {a for a, _, _ in drawn["clipped"]} == {"eager unfused"} and len(drawn["clipped"]) == 3
    assert [b[0] for b in drawn["best"]] == ["sdpa cudnn", "sdpa flash", "sdpa cudnn"]
    assert drawn["failed"] == 1
    assert any(ln.get_ydata()[0] == 1.0 and ln.get_color() == "black" for ln in ax.get_lines())  # the 1x line
    texts = [t.get_text() for t in ax.texts]
    assert "20×" in texts and "45×" in texts  # eager values written at the edge
    outlined = [p for p in ax.patches if p.get_linewidth() > 1]
    assert len(outlined) == 3  # the best anchor's bar of each row
    plt.close(fig)


def test_write_op_plots_writes_pngs_at_the_top_of_out(tmp_path):
    entry = _gpu_result()["ops"]["attention"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = plots.write_op_plots("attention", entry, tmp_path)
    assert written == {"accuracy histogram": "attention_accuracy.png", "HBM bytes": "attention_bytes.png",
                       "speedup": "attention_speedup.png"}
    for name in written.values():
        assert (tmp_path / name).stat().st_size > 1000
    cpu = plots.write_op_plots("softmax", _cpu_result()["ops"]["softmax"], tmp_path)
    assert set(cpu) == {"accuracy histogram", "HBM bytes"}  # no timing, no speedup plot
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(list(written.values()) + list(cpu.values()))


def test_summary_names_nan_mismatches_and_lists_at_most_a_few_failures():
    result = _cpu_result()
    result["ops"]["softmax"]["accuracy"] = [_acc(f"C{i}", "fp16", [1e-4], 2e-3, nan=2) for i in range(6)]
    first = report.summary_text(result).splitlines()[0]
    assert first.startswith("accuracy FAIL: bounds met on 0 of 6 cases; failed: softmax C0 fp16 (2 NaN mismatches)")
    assert "C3" in first and "C4" not in first and first.endswith("and 2 more")


def test_compile_clock_times_each_build_and_restores_the_hooks_set_before():
    """The report's compile clock chains triton's JIT hooks: each build between the miss and the done hook is
    counted with its seconds, the hooks set before still run, and they are back in place afterwards."""
    from triton import knobs

    from tilefuse.harness.timing import compile_clock

    calls = []
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    try:
        knobs.runtime.jit_cache_hook = lambda **kw: calls.append("miss")
        knobs.runtime.jit_post_compile_hook = lambda **kw: calls.append("done")
        mine = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        with compile_clock() as clock:
            for name in ("gemm_kernel[num_warps=8](x: *bf16)", "norm_kernel[num_warps=4](x: *bf16)"):
                assert knobs.runtime.jit_cache_hook(repr=name, key=None) is None  # None: triton compiles
                knobs.runtime.jit_post_compile_hook(repr=name, key=None)
        assert clock["kernels"] == 2 and clock["seconds"] >= 0
        assert sorted(n for n, _ in clock["slowest"]) == ["gemm_kernel", "norm_kernel"]
        assert calls == ["miss", "done", "miss", "done"]
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == mine
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def test_the_worker_phases_estimate_includes_the_rows_still_to_time_and_the_clock_runs_across_phases(
        monkeypatch, capsys):
    """The worker phase's "about ... left" includes the timing phase still to come (when the last worker task ends,
    what is left is every row's timing, not 0 s), and the timing phase's "elapsed" counts from the run's start."""
    now = [100.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    started = now[0]
    rows_after = 60.0  # seconds the timing phase is expected to take
    with report._Progress(10.0, 2, bar=False, start=started, after=rows_after) as workers:
        now[0] += 30.0
        workers.advance(5.0)  # half the worker weight in 30 s: 30 s of it left, then the rows
        workers.op("softmax", "accuracy done in a worker")
        now[0] += 30.0
        workers.advance(5.0)
        workers.op("rms_norm", "accuracy done in a worker")
    with report._Progress(4.0, 2, bar=False, start=started) as timing:
        timing.op("softmax", "timing 1 benchmark rows")
        now[0] += 10.0
        timing.advance(1.0)  # a quarter of the rows in 10 s: 30 s left
        timing.op("rms_norm", "timing 3 benchmark rows")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("(30s elapsed, about 1m30s left)"), lines[0]
    assert lines[1].endswith("(1m00s elapsed, about 1m00s left)"), lines[1]
    assert lines[2].endswith("(1m00s elapsed)"), lines[2]
    assert lines[3].endswith("(1m10s elapsed, about 30s left)"), lines[3]
    weight = report._Progress.ROW + report._Progress.ANCHOR
    assert 0.05 < report._Progress.TIMING_SECONDS_PER_WEIGHT * weight < 30  # a row and one anchor: seconds, not hours

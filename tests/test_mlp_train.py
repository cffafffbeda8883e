"""``tilefuse bench mlp-train``: every variant trains from the same weights on the same data, and the
run writes its JSON and loss-curve PNG. On a CPU: d=16, 32 tokens, 2 steps (1 warm-up, 1 timed), fp32,
the tilefuse GEMMs in the Triton interpreter, torch.compile in its default (Inductor) mode."""
import json
import math
import os
import subprocess
import sys

import torch

from tilefuse import cli, runtime
from tilefuse.harness import mlp_train
from tilefuse.harness.mlp_train import VARIANTS, run_mlp_train

ON_GPU = torch.cuda.is_available()
TINY = {"d": 16, "tokens": 32, "steps": 2}
# Loss curves of eager and tilefuse, step by step, as |loss - eager| / eager. fp32 (CPU): the accuracy
# policy's fp32 bound (1e-5): the two GEMMs differ only in summation order, and after one AdamW step
# (an update of about lr = 1e-4 per weight) the losses still agree to a few fp32 ulps of the mean.
# bf16 (GPU): the bf16 bound, 1e-2.
CURVE_RTOL = 1e-2 if ON_GPU else 1e-5


def _explain(v) -> str:
    return v["error"] + "\n" + "\n".join(v.get("traceback", [])) if v["error"] else ""


def test_every_variant_trains_from_the_same_start(tmp_path, monkeypatch):
    if not ON_GPU:  # Inductor's C++ code generation takes ~30 s on a cold cache here; aot_eager traces the same graph
        compile_ = torch.compile
        monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compile_(model, backend="aot_eager", **kwargs))
    result = run_mlp_train(**TINY, variants=None, out_dir=tmp_path, seed=0, progress=False)
    data = json.loads((tmp_path / mlp_train.JSON_NAME).read_text())
    assert list(data["variants"]) == list(VARIANTS)
    for key in ("device", "dtypes", "d", "steps", "tokens", "seed", "torch", "triton", "compile"):
        assert key in data, key
    assert (data["d"], data["steps"], data["tokens"], data["seed"]) == (16, 2, 32, 0)
    assert data["dtypes"]["params"] == ("bf16" if ON_GPU else "fp32")
    assert data["warmup_steps"] == 1 and data["timed_steps"] == 1
    assert data["compile"]["mode"] == ("max-autotune-no-cudagraphs" if ON_GPU else "default")

    for name, v in data["variants"].items():
        assert v["error"] is None, f"{name}: {_explain(v)}"
        assert v["tokens_per_s"] > 0, name
        assert len(v["loss_curve"]) == 2 and all(math.isfinite(loss) for loss in v["loss_curve"]), name
        assert v["final_loss"] == v["loss_curve"][-1]
        assert (v["peak_memory_bytes"] or 0) > 0 if ON_GPU else v["peak_memory_bytes"] is None
        assert v["final_loss_within_1pct_of_eager"] is True, (name, v["final_loss_rel_diff_vs_eager"])
        assert math.isclose(v["vs_eager"], v["tokens_per_s"] / data["variants"]["eager"]["tokens_per_s"])
        assert math.isclose(v["vs_torch_compile"],
                            v["tokens_per_s"] / data["variants"]["torch.compile"]["tokens_per_s"])
        if name.startswith("torch.compile"):  # the whole model in one graph: nothing ran eager by a break
            assert (v["compiled_graphs"], v["graph_breaks"]) == (1, 0), name
        else:
            assert v["compiled_graphs"] is None and v["graph_breaks"] is None
        # which kernels ran: tilefuse's own on its path, none for the torch-only variants
        if "tilefuse" in name:
            assert v["kernels"] and all(k.split()[1] == data["path"] for k in v["kernels"]), v["kernels"]
        else:
            assert v["kernels"] == [], v["kernels"]
    assert data["path"] == ("compiled" if ON_GPU else "interpreter")

    eager = data["variants"]["eager"]["loss_curve"]
    for name in ("tilefuse", "torch.compile over tilefuse"):
        curve = data["variants"][name]["loss_curve"]
        rel = [abs(a - b) / abs(b) for a, b in zip(curve, eager)]
        assert max(rel) <= CURVE_RTOL, (name, curve, eager, rel)
        assert math.isclose(data["variants"][name]["curve_max_rel_diff_vs_eager"], max(rel), abs_tol=1e-12)
        assert data["variants"][name]["curve_first_step_over_1pct_vs_eager"] is None
    # the same initial weights and data: step 0 (before any update) differs only by the forward's rounding
    step0 = {name: v["loss_curve"][0] for name, v in data["variants"].items()}
    assert all(math.isclose(loss, step0["eager"], rel_tol=CURVE_RTOL) for loss in step0.values()), step0
    assert data["variants"]["tilefuse"]["loss_curve"][1] < data["variants"]["tilefuse"]["loss_curve"][0]

    png = tmp_path / mlp_train.PNG_NAME
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["plot"] == mlp_train.PNG_NAME
    text = mlp_train.summary_text(result)
    assert "final loss within 1% of eager:" in text and "FAIL" not in text, text
    assert mlp_train.problems(result) == []


def test_cli_bench_mlp_train(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ)
    if not ON_GPU:
        env.pop("TRITON_INTERPRET", None)  # the CLI itself must select the interpreter before importing triton
    # The compiled variants run in-process above (test_every_variant_trains_from_the_same_start); the command's
    # own part is the interpreter selected before triton's import, its output and its files.
    variants = [name for name in VARIANTS if "compile" not in name]
    proc = subprocess.run([sys.executable, "-m", "tilefuse", "bench", "mlp-train", "--steps", "2", "--d", "16",
                           "--tokens", "32", "--out", str(out), "--no-progress", "--variants", *variants],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU" not in proc.stdout.splitlines()[0]  # all sizes given: no tiny-default line
    assert "final loss within 1% of eager: tilefuse PASS" in proc.stdout, proc.stdout
    for name in variants:
        assert any(line.startswith(name + " ") for line in proc.stdout.splitlines()), (name, proc.stdout)
    data = json.loads((out / mlp_train.JSON_NAME).read_text())
    assert list(data["variants"]) == variants
    assert data["path"] == ("compiled" if ON_GPU else "interpreter")
    assert (out / mlp_train.PNG_NAME).stat().st_size > 1000


def test_cli_bench_argument_errors_stop_before_any_work(tmp_path, capsys):
    out = tmp_path / "bench"
    assert cli.main(["bench", "mlp-train", "--variants", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tilefuse bench mlp-train: --variants: unknown variant 'nope'") and err.count("\n") == 1
    assert cli.main(["bench", "mlp-train", "--steps", "1", "--out", str(out)]) == 2
    assert "--steps must be an integer >= 2" in capsys.readouterr().err
    assert not out.exists()
    assert mlp_train.variant_name("Torch.Compile-over_tilefuse") == "torch.compile over tilefuse"


def test_cli_without_a_gpu_defaults_to_the_tiny_sizes(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))  # restored afterwards
    monkeypatch.setattr(runtime, "numpy_version", lambda: "2.3.5")  # the GPU machine's numpy fails the CPU check
    monkeypatch.setattr(mlp_train, "run_mlp_train",
                        lambda **kw: calls.append(kw) or {"variants": {}, "device": "CPU", "path": "interpreter",
                                                          "blocks": 4, "d": 16, "tokens": 32, "steps": 3,
                                                          "warmup_steps": 1, "dtypes": {"params": "fp32"},
                                                          "compile": {"mode": "default"}})
    assert cli.main(["bench", "mlp-train", "--variants", "eager", "--out", str(tmp_path), "--no-progress"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("no GPU: ") and "d=16, tokens=32, steps=3" in first, first
    assert calls == [{"d": None, "steps": None, "tokens": None, "variants": ["eager"], "out_dir": str(tmp_path),
                      "seed": 0, "progress": False, "compile_mode": None}]
    assert mlp_train.resolve_args(None, None, None, None, on_gpu=False)[:3] == (16, 3, 32)
    assert mlp_train.resolve_args(None, None, None, None, on_gpu=True)[:3] == (1024, 2000, 8192)

"""tilefuse bench prefill / train on a CPU: tiny configurations of each family, eager beside patched."""
import json
import math

import pytest
import torch

from helpers import ON_GPU
from tilefuse.harness import mlp_train, model_bench
from tilefuse.opspec import REL_L2_BOUND

# On a GPU the benchmarks build the full-size models (Llama-7B: minutes per variant); they are run there as
# benchmarks (NOTES.md), not as tests.
pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU-side check of the benchmark code; a GPU runs the real sizes")


@pytest.mark.parametrize("model", ["llama-7b", "gpt2-medium"])
def test_prefill_runs_eager_and_patched_and_compares_logits(model, tmp_path):
    result = model_bench.run("prefill", model, ["eager", "tilefuse"], str(tmp_path), repeats=1, progress=False)
    eager, fused = result["variants"]["eager"], result["variants"]["tilefuse"]
    assert eager["error"] is None and fused["error"] is None, result
    assert fused["rel_l2_vs_eager"] <= REL_L2_BOUND[torch.float32]
    assert fused["patch_s"] > 0 and eager["patch_s"] is None
    assert json.loads((tmp_path / "prefill.json").read_text())["model"] == model
    assert (tmp_path / "prefill.png").stat().st_size > 0


def test_train_runs_eager_and_patched_with_the_same_losses(tmp_path):
    result = model_bench.run("train", "llama-1b", ["eager", "tilefuse"], str(tmp_path), steps=2, progress=False)
    eager, fused = result["variants"]["eager"], result["variants"]["tilefuse"]
    assert eager["error"] is None and fused["error"] is None, result
    for a, b in zip(fused["loss_curve"], eager["loss_curve"]):
        assert abs(a - b) <= REL_L2_BOUND[torch.float32] * abs(b)
    assert fused["tokens_per_s"] > 0 and len(fused["loss_curve"]) == 2
    text = model_bench.summary_text(result)
    assert "train llama-1b" in text
    _assert_noise_floor(result, text, steps=2)


def _assert_noise_floor(result, text, steps):
    """The noise-floor reference (eager on another SDPA backend) and every variant's max loss difference."""
    floor = result["noise_floor"]
    assert floor["error"] is None, floor
    assert floor["variant"] == "eager, other SDPA backend (MATH)" and len(floor["loss_curve"]) == steps
    assert "noise_floor" not in result["variants"] and floor["variant"] not in result["variants"]
    assert result["loss_checkpoint_steps"] == [steps]  # the CPU run is shorter than 20: the last step only
    diffs = [floor["max_rel_loss_diff_vs_eager"]] + [v["max_rel_loss_diff_vs_eager"]
                                                     for v in result["variants"].values()]
    assert all(isinstance(d, float) and math.isfinite(d) and d >= 0 for d in diffs), diffs
    assert result["variants"]["eager"]["max_rel_loss_diff_vs_eager"] == 0.0
    assert "noise floor (eager, other SDPA backend (MATH)): loss differs from eager by up to" in text, text
    assert "max loss diff vs eager at the checkpoints 0%" in text, text  # eager's own line
    assert all(k in v for v in result["variants"].values()
               for k in ("loss_within_1pct_at_checked_steps", "loss_rel_diff_vs_eager_at_steps")), result


def test_train_noise_floor_on_gpt2_default_steps(tmp_path):
    """The CPU's default step count (3) on GPT-2: the noise floor's curve is as long, and is in the JSON."""
    result = model_bench.run("train", "gpt2-small", ["eager"], str(tmp_path), progress=False)
    assert result["variants"]["eager"]["error"] is None, result
    _assert_noise_floor(result, model_bench.summary_text(result), steps=result["steps"])
    written = json.loads((tmp_path / "train.json").read_text())
    assert written["noise_floor"]["loss_curve"] == result["noise_floor"]["loss_curve"]


def test_no_noise_floor_without_eager(tmp_path, monkeypatch):
    """Without eager there is nothing to drift from: no reference run (training stubbed: only run's choice)."""
    def fake_train(variant, name, batch, seq, steps, *args, other_sdpa_backend=False):
        assert not other_sdpa_backend, "noise floor trained without eager"
        return {"tokens_per_s": 1.0, "step_ms": 1.0, "peak_memory_bytes": None, "loss_curve": [1.0] * steps,
                "final_loss": 1.0, "patch_s": None, "compiled_graphs": None, "graph_breaks": None, "error": None}
    monkeypatch.setattr(model_bench, "_train", fake_train)
    result = model_bench.run("train", "gpt2-small", ["tilefuse"], str(tmp_path), steps=2, progress=False)
    assert "noise_floor" not in result and result["variants"]["tilefuse"]["max_rel_loss_diff_vs_eager"] is None
    assert "noise floor" not in model_bench.summary_text(result)


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(mlp_train.BenchArgumentError, match="unknown model"):
        model_bench.resolve("train", "llama-70b", None, False)
    with pytest.raises(mlp_train.BenchArgumentError, match="unknown variant"):
        model_bench.resolve("prefill", None, ["fast"], False)


def test_cli_compile_mode_reaches_the_compiled_variants(tmp_path, monkeypatch, capsys):
    """--compile-mode is the mode each compiled variant is built with, and the one the JSON records (training
    stubbed: only the argument's path is checked); a mode torch.compile does not have is refused by the parser."""
    from tilefuse import cli

    seen = []

    def fake_train(variant, name, batch, seq, steps, warmup, seed, on_gpu, compile_mode, *args,
                   other_sdpa_backend=False):
        seen.append((variant, compile_mode))
        return {"tokens_per_s": 1.0, "step_ms": 1.0, "peak_memory_bytes": None, "loss_curve": [1.0] * steps,
                "final_loss": 1.0, "patch_s": None, "compiled_graphs": 1, "graph_breaks": 0, "error": None}
    monkeypatch.setattr(model_bench, "_train", fake_train)
    out = tmp_path / "bench"
    rc = cli.main(["bench", "train", "--model", "gpt2-small", "--variants", "torch.compile", "--steps", "2",
                   "--compile-mode", "max-autotune", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr()
    assert seen == [("torch.compile", "max-autotune")]
    assert json.loads((out / "train.json").read_text())["compile"]["mode"] == "max-autotune"
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "prefill", "--compile-mode", "fastest"])
    assert exc.value.code == 2 and "--compile-mode" in capsys.readouterr().err

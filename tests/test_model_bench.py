"""tilefuse bench prefill / train on a CPU: tiny configurations of each family, eager beside patched."""
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

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


# ------------------------------------------------------------------------------------------ Liger-Kernel

def test_liger_variant_without_liger_installed_records_why_and_the_rest_run(tmp_path, monkeypatch):
    """liger-kernel absent (forced: None in sys.modules fails the import whatever is installed): the variant's
    entry is the failure naming the package to install, eager still runs and has no Liger ratio."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    result = model_bench.run("prefill", "llama-1b", ["eager", "liger-kernel"], str(tmp_path), repeats=1,
                             progress=False)
    liger, eager = result["variants"]["liger-kernel"], result["variants"]["eager"]
    assert liger["error"] == "ImportError: liger-kernel is not installed: pip install liger-kernel==0.8.5", liger
    assert eager["error"] is None and eager["ms"] > 0 and eager["speedup_vs_liger"] is None, eager
    assert json.loads((tmp_path / "prefill.json").read_text())["variants"]["liger-kernel"]["error"] == liger["error"]
    text = model_bench.summary_text(result)
    assert "liger-kernel: failed: ImportError: liger-kernel is not installed: pip install liger-kernel==0.8.5" in text


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in ``liger_kernel.transformers`` whose patch function records its calls and, as Liger's does,
    rebinds ``apply_rotary_pos_emb`` in transformers' Llama module (to a counting wrapper of the original)."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    seen = {"calls": [], "rope_calls": 0, "original": original}

    def counting_rope(*args, **kwargs):
        seen["rope_calls"] += 1
        return original(*args, **kwargs)

    def apply_liger_kernel_to_llama(model=None, **kwargs):
        seen["calls"].append({"model": model, **kwargs})
        modeling_llama.apply_rotary_pos_emb = counting_rope

    transformers_module = types.ModuleType("liger_kernel.transformers")
    transformers_module.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers_module)
    yield seen
    modeling_llama.apply_rotary_pos_emb = original  # the test's own safety net; run() must already have done it


@pytest.mark.parametrize("kind", ["prefill", "train"])
def test_liger_variant_patches_a_fresh_llama_and_is_compared(kind, tmp_path, fake_liger):
    """The Liger variant calls apply_liger_kernel_to_llama once with its own freshly built Llama, runs through
    what the patch installed, has its ratio keys (each variant against Liger), and leaves transformers' Llama
    module as it was: eager after it would not run Liger's code."""
    from transformers.models.llama import modeling_llama

    kwargs = dict(repeats=1) if kind == "prefill" else dict(steps=2)
    result = model_bench.run(kind, "llama-1b", ["eager", "liger-kernel"], str(tmp_path), progress=False, **kwargs)
    eager, liger = result["variants"]["eager"], result["variants"]["liger-kernel"]
    assert eager["error"] is None and liger["error"] is None, result
    [call] = fake_liger["calls"]
    assert isinstance(call["model"], modeling_llama.LlamaForCausalLM)
    assert call["rope"] and call["fused_linear_cross_entropy"] and not call["cross_entropy"], call
    assert fake_liger["rope_calls"] > 0  # the patched module function ran in the Liger variant
    assert modeling_llama.apply_rotary_pos_emb is fake_liger["original"]
    assert "peak_memory_bytes" in liger and liger["patch_s"] is not None
    text = model_bench.summary_text(result)
    if kind == "prefill":
        assert eager["speedup_vs_liger"] == pytest.approx(liger["ms"] / eager["ms"])
        assert liger["speedup_vs_liger"] == 1.0
        assert liger["rel_l2_vs_eager"] == 0.0  # the stand-in patch changes no numbers
    else:
        assert eager["vs_liger"] == pytest.approx(eager["tokens_per_s"] / liger["tokens_per_s"])
        assert liger["vs_liger"] == 1.0 and liger["loss_curve"] == eager["loss_curve"]
    assert text.count("x liger ") == 2, text


def test_liger_does_not_apply_to_gpt2(tmp_path, monkeypatch):
    """GPT-2 has no Liger patch: left out of its default variants and said so in the result and the summary;
    named explicitly, refused before any work. The Llama models take it by default."""
    _, chosen = model_bench.resolve("train", "gpt2-small", None, False)
    assert "liger-kernel" not in chosen and "tilefuse" in chosen
    assert model_bench.resolve("prefill", "llama-7b", None, False)[1][-1] == "liger-kernel"
    with pytest.raises(mlp_train.BenchArgumentError, match="Liger-Kernel has no GPT-2 patch"):
        model_bench.resolve("prefill", "gpt2-medium", ["eager", "liger"], False)
    assert mlp_train.VARIANTS == ("eager", "tilefuse", "torch.compile", "torch.compile over tilefuse")
    with pytest.raises(mlp_train.BenchArgumentError, match="unknown variant"):
        mlp_train.variant_name("liger-kernel")  # the MLP benchmark has none

    def fake_train(variant, name, batch, seq, steps, *args, other_sdpa_backend=False):
        return {"tokens_per_s": 1.0, "step_ms": 1.0, "peak_memory_bytes": None, "loss_curve": [1.0] * steps,
                "final_loss": 1.0, "patch_s": None, "compiled_graphs": None, "graph_breaks": None, "error": None}
    monkeypatch.setattr(model_bench, "_train", fake_train)
    result = model_bench.run("train", "gpt2-small", ["eager"], str(tmp_path), steps=2, progress=False)
    assert result["not_applicable"] == {"liger-kernel": "Liger-Kernel has no GPT-2 patch"}
    assert "liger-kernel: not applicable to gpt2-small: Liger-Kernel has no GPT-2 patch" in (
        model_bench.summary_text(result))


# ------------------------------------------------------------------------------- benchmarks/loss_curves.py

def _benchmark_script(name):
    """benchmarks/<name>.py loaded as a module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loss_curves():
    return _benchmark_script("loss_curves")


def test_loss_curves_verdict_takes_the_wider_band():
    lc = _loss_curves()
    wide = lc.verdict([4.0, 4.2, 4.4], [4.39, 4.39, 4.39])  # spread 0.4 > 2% of 4.2: the spread decides
    assert wide["band_kind"] == "eager seeds' spread" and wide["band"] == [4.0, 4.4] and wide["verdict"] == "PASS"
    assert lc.verdict([4.0, 4.2, 4.4], [4.5, 4.5, 4.5])["verdict"] == "FAIL"
    narrow = lc.verdict([4.0, 4.001, 4.002], [4.03, 4.03, 4.03])  # 0.75% off; the spread is only 0.002
    assert narrow["band_kind"] == "eager mean +-1%" and narrow["verdict"] == "PASS"
    assert lc.verdict([4.0, 4.001, 4.002], [4.05, 4.05, 4.05])["verdict"] == "FAIL"  # 1.2% off
    assert lc.verdict([4.0, math.inf, 4.2], [4.1, 4.1, 4.1])["within"] is False
    assert lc.default_tail_from(200) == 150 and lc.tail_mean([1.0, 2.0, 3.0, 5.0], 3, 4) == 4.0


def test_loss_curves_script_smoke(tmp_path):
    """One tiny model, one seed, two steps: both variants train, the check and the JSON are there."""
    lc = _loss_curves()
    out = tmp_path / "lc.json"
    result = lc.run(["gpt2-small"], [0], steps=2, out=str(out), log=lambda s: None)
    m = result["models"]["gpt2-small"]
    assert all(m["runs"][v]["0"]["error"] is None for v in ("eager", "tilefuse")), m["runs"]
    assert result["tail_steps"] == [2, 2] and m["runs"]["eager"]["0"]["tail_mean"] == m["runs"]["eager"]["0"][
        "loss_curve"][1]
    assert m["check"]["verdict"] == "PASS", m["check"]
    assert json.loads(out.read_text())["models"]["gpt2-small"]["check"]["verdict"] == "PASS"
    assert "gpt2-small" in lc.summary_text(result)


# ------------------------------------------------------------------------------- benchmarks/model_profile.py

def test_model_profile_reads_a_device_timeline():
    """The GPU analysis on a made-up timeline (µs): two marked steps, kernels on two streams overlapping in step 0,
    one kernel outside any step. Busy time counts an overlap once; gaps lie between merged kernels; families
    follow the kernel names."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    mp = _benchmark_script("model_profile")

    def event(name, start, end, device):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [event(mp.STEP_MARK, 0, 100, cpu), event(mp.STEP_MARK, 200, 260, cpu),
              event("nvjet_tst_128x256_gemm", 10, 40, gpu), event("triton_per_fused_native_layer_norm", 30, 50, gpu),
              event("_attention_forward_kernel", 70, 90, gpu),
              event("nvjet_tst_128x256_gemm", 210, 230, gpu), event("multi_tensor_apply_kernel", 240, 250, gpu),
              event("Memcpy HtoD", 500, 510, gpu), event(mp.STEP_MARK, 0, 100, gpu)]
    r = mp.analyse_gpu(events, steps=2, wall_s=0.0001)  # 100 µs a step unprofiled
    assert r["steps_profiled"] == 2 and r["kernels_outside_steps"] == 1 and r["kernels_per_step"] == 2.5
    assert r["gpu_busy_ms_per_step"] == pytest.approx((60 + 30) / 2 / 1e3)  # step 0: 10-50 and 70-90; step 1: 30
    assert r["host_gap_ms_per_step"] == pytest.approx(0.1 - 0.045)
    assert r["profiled_idle_ms_per_step"] == pytest.approx(((100 - 60) + (60 - 30)) / 2 / 1e3)
    assert r["lead_in_us_per_step"] == [10, 10]
    assert [(g["us"], g["after"], g["before"]) for g in r["largest_gaps"]] == [
        (20, "triton_per_fused_native_layer_norm", "_attention_forward_kernel"),
        (10, "nvjet_tst_128x256_gemm", "multi_tensor_apply_kernel")]
    fam = r["family_ms_per_step"]
    assert fam["gemm/matmul"] == pytest.approx(0.025) and fam["norm"] == pytest.approx(0.01)
    assert fam["attention"] == pytest.approx(0.01) and fam["optimizer"] == pytest.approx(0.005)
    assert fam["copy/memcpy"] == pytest.approx(0.005)
    assert r["top_kernels"][0] == {"name": "nvjet_tst_128x256_gemm", "family": "gemm/matmul", "ms_per_step": 0.025,
                                   "calls_per_step": 1.0}

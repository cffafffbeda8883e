"""tilefuse bench prefill / train on a CPU: tiny configurations of each family, eager beside patched."""
import json

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
    assert "train llama-1b" in model_bench.summary_text(result)


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(mlp_train.BenchArgumentError, match="unknown model"):
        model_bench.resolve("train", "llama-70b", None, False)
    with pytest.raises(mlp_train.BenchArgumentError, match="unknown variant"):
        model_bench.resolve("prefill", None, ["fast"], False)

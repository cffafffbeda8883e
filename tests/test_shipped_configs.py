"""The tuned configs shipped for the H200 (src/tilefuse/configs/nvidia-h200.json) give right answers.

The GPU suite pins every kernel to its first config (TILEFUSE_AUTOTUNE=0), so the configs users actually run
would otherwise never be checked. Here, on an H200 or any other GPU of its architecture (sm_90: an H100 compiles
and runs the same kernels with the same configs, so right answers there are right answers on the H200), the
tuners read the shipped table (an empty user cache, no
benchmarking: a key the table lacks takes the pinned first config), every GPU accuracy case and benchmark row
of the ops behind each table family runs once, its leading size moved off the power of two where that keeps the
key's bucket (ragged last tiles), against float64 -- and every entry of the table must have served one of them.
"""
import dataclasses
import json

import pytest
import torch

import tilefuse
from helpers import check_against_reference
from tilefuse import registry, sizes, tuning
from tilefuse.kernels import fastpath
from tilefuse.tuning import choices, tables

SLUG = "nvidia-h200"
TABLE = tables.load_shipped_table(tables.shipped_table_path(SLUG))
# Each kernel of the table, by the family of ops whose calls choose its configs. Training ops reach the forward GEMM with the slope stored (SAVE_SLOPE) and the backward GEMMs;
# layer_norm_linear reaches the norm's statistics pass and the GEMM with the norm in its epilogue.
FAMILIES = {
    "attention": (("attention_fwd",), ("attention", "sdpa")),
    "gemm": (("linear_portable", "linear_splitk", "linear_tma", "linear_grad_input"),
             ("linear", "gated_linear", "layer_norm_linear", "linear_train", "gated_linear_train",
              "layer_norm_linear_train", "qkv_projection_train")),
    "norms": (("norm_fwd",), ("layer_norm", "rms_norm", "layer_norm_linear")),
    "softmax": (("softmax_fwd_block", "softmax_fwd_long", "softmax_fwd_long_auto", "softmax_fwd_loop",
                 "softmax_fwd_loop_auto", "softmax_split_stats_auto", "softmax_bwd_block", "softmax_bwd_loop"),
                ("softmax", "softmax_backward")),
    # the measured choices between tilefuse's kernels and the vendor's (tuning.choices), under the default backend
    "backends": (("norm_forward_backend", "norm_backward_backend", "softmax_forward_backend",
                  "softmax_backward_backend", "linear_forward_backend", "gated_linear_forward_backend",
                  "layer_norm_linear_forward_backend", "linear_backward_backend"),
                 ("layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward", "softmax", "softmax_backward",
                  "linear", "gated_linear", "layer_norm_linear", "linear_train", "gated_linear_train",
                  "layer_norm_linear_train", "qkv_projection_train")),
}


# Entries the default dispatch reaches only for other layouts than the registry's cases have -- a weight without
# a unit inner stride (a transposed view, as GPT-2's Conv1D) takes split-K at decode sizes instead of the decode
# kernel; gated operands the cooperative kernel refuses take the TMA kernel -- reached here with the launch's
# switch for that kernel off, on the cases it would take.
SWITCHED = {"gemm": [("linear", "DECODE_KERNEL", lambda p: p["shape"][0] <= 64),
                     ("gated_linear", "COOP_GATED", lambda p: True)]}


# Anchors made of tilefuse's own ops: the report's rows reach their keys too, so they run here as well.
OWN_ANCHORS = {"layer_norm_linear": "tilefuse layer_norm then linear", "attention": "tilefuse.attention.portable"}


def _variants(spec, params):
    """The op itself, then its anchor that is tilefuse's own where the row has one, as a spec whose fused call
    is that anchor."""
    yield spec
    anchor = spec.anchors(params).get(OWN_ANCHORS.get(spec.name)) if spec.name in OWN_ANCHORS else None
    if anchor is not None:
        yield dataclasses.replace(spec, fused=anchor)


def test_every_shipped_kernel_belongs_to_a_family():
    kernels = {k for family in FAMILIES.values() for k in family[0]}
    assert set(TABLE) <= kernels, f"shipped kernels with no family here: {sorted(set(TABLE) - kernels)}"
    assert set(TABLE) >= kernels, f"families name kernels the table lacks: {sorted(kernels - set(TABLE))}"
    ops = [op for family in FAMILIES.values() for op in family[1]]
    assert all(op in registry.REGISTRY for op in ops)


def _ragged(params):
    """params with the leading size 3 below where that keeps its power-of-two bucket (the tuning key)."""
    shape = params.get("shape")
    if not shape or shape[0] < 8 or sizes.m_bucket(shape[0] - 3) != sizes.m_bucket(shape[0]):
        return params
    return dict(params, shape=(shape[0] - 3, *shape[1:]))


@pytest.fixture
def shipped_tuners(monkeypatch, tmp_path):
    """Every tuner unpinned, with empty in-process caches, reading an empty user cache and the shipped table;
    a key the table lacks runs the first pruned config instead of benchmarking the space."""
    from tilefuse.kernels.attention import launch as _a  # noqa: F401  (each family's tuners, registered)
    from tilefuse.kernels.gemm import launch as _g  # noqa: F401
    from tilefuse.kernels.norms import launch as _n  # noqa: F401
    from tilefuse.kernels.softmax import launch as _s  # noqa: F401

    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    # the H200's table whatever the sm_90 GPU's name
    monkeypatch.setattr(tuning.autotuner, "gpu_slug", lambda name: SLUG)
    monkeypatch.setattr(choices, "gpu_slug", lambda name: SLUG)
    monkeypatch.setattr(tuning.autotuner, "_use_stored_configs", True)
    original = tuning.TableAutotuner.choose

    def choose_without_benchmarking(self, args, kwargs):
        key, text, configs = original(self, args, kwargs)
        if len(configs) > 1:
            config = self._pruned(args, kwargs)[0]
            self._remember(key, text, config, "pinned (not in the shipped table)", None, {"timings": []})
            configs = [config]
        return key, text, configs

    monkeypatch.setattr(tuning.TableAutotuner, "choose", choose_without_benchmarking)
    for t in tuning.autotuner._TUNERS.values():
        monkeypatch.setattr(t, "pinned", False)
        monkeypatch.setattr(t, "cache", {})
        monkeypatch.setattr(t, "records", {})
    choices.clear_choices()  # backend choices: read from the table again, never timed (tuning is off in the suite)
    fastpath.clear_all()
    yield
    fastpath.clear_all()
    choices.clear_choices()


@pytest.mark.gpu_only
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_shipped_config_computes_its_bucket_against_float64(family, shipped_tuners):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the table is the H200's (sm_90); this GPU is {torch.cuda.get_device_name()}, "
                    f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    from tilefuse.kernels.gemm import launch

    kernels, ops = FAMILIES[family]
    device = torch.device("cuda")
    runs = [(op, None, lambda p: True) for op in ops] + SWITCHED.get(family, [])
    # The kernels' configs under tilefuse's backend (a shipped vendor choice would leave their keys unreached),
    # the backend choices under the default one.
    backend = "auto" if family == "backends" else "tilefuse"
    for op, switch, wanted in runs:
        spec = registry.get(op)
        with pytest.MonkeyPatch.context() as m, tilefuse.use_backend(backend):
            if switch is not None:
                m.setattr(launch, switch, False)
                fastpath.clear_all()
            for params in list(spec.accuracy_cases["gpu"]) + list(spec.bench_cases):
                if not wanted(params):
                    continue
                params = _ragged(params)
                for variant in _variants(spec, params):
                    check_against_reference(variant, params, device, seed=len(spec.label(params)))
                    torch.cuda.empty_cache()
        fastpath.clear_all()
    served = {(r["kernel"], r["key"]) for r in [*tuning.tuning_records(), *choices.choice_records()]
              if r["source"] == "shipped"}
    unserved = [(k, key) for k in kernels for key in TABLE.get(k, {}) if (k, key) not in served]
    assert not unserved, "shipped entries no case of " + ", ".join(ops) + " ran:\n" + json.dumps(unserved, indent=1)

"""The switches that choose which kernel runs (tilefuse.kernels.switches): checked values, the environment's
spelling, and the fast path dropping its plans at every change."""
import pytest
import torch

from tilefuse.kernels import fastpath, switches


def test_a_switch_takes_only_its_own_kind_of_value(monkeypatch):
    with pytest.raises(TypeError, match=r"switches\.gemm\.COOP_BACKWARD is True or False"):
        switches.gemm.COOP_BACKWARD = 0
    with pytest.raises(ValueError, match=r"switches\.gemm\.COOP_BACKWARD_CONFIG: 'fast' is not one of"):
        switches.gemm.COOP_BACKWARD_CONFIG = "fast"
    with pytest.raises(AttributeError, match=r"switches\.gemm has no switch 'COOP'"):
        switches.gemm.COOP = False
    with pytest.raises(ValueError):
        switches.attention.FP8_DESCRIPTORS = 1  # True, False or None, not a truthy int
    monkeypatch.setattr(switches.attention, "FP8_DESCRIPTORS", True)
    assert switches.attention.FP8_DESCRIPTORS is True


def test_overridden_restores_and_every_change_moves_the_generation():
    before = switches.GENERATION
    with switches.overridden(switches.gemm, COOP_GATED=False, COOP_BACKWARD_CONFIG="128x128x64_s3"):
        assert switches.gemm.COOP_GATED is False and switches.gemm.COOP_BACKWARD_CONFIG == "128x128x64_s3"
        assert switches.GENERATION == before + 2
    assert switches.gemm.COOP_GATED is True and switches.gemm.COOP_BACKWARD_CONFIG == "128x256x32_s4"
    assert switches.GENERATION == before + 4


def test_the_environment_spelling(monkeypatch):
    for family in switches.FAMILIES:
        for row in family.describe():
            monkeypatch.setattr(family, row["name"], row["value"])  # restored after the test
    switches.apply_environment("gemm.COOP_BACKWARD=0, attention.FP8_KERNEL=portable,attention.FP8_DESCRIPTORS=none")
    assert switches.gemm.COOP_BACKWARD is False and switches.attention.FP8_KERNEL == "portable"
    assert switches.attention.FP8_DESCRIPTORS is None
    for text, message in [("gemm.COOP_BACKWARD", "not family.NAME=value"), ("norms.X=1", "no family 'norms'"),
                          ("gemm.NOPE=1", "has no switch 'NOPE'"), ("gemm.DECODE_KERNEL=maybe", "1/0")]:
        with pytest.raises(ValueError, match=message):
            switches.apply_environment(text)


def test_a_change_drops_every_captured_plan(monkeypatch):
    plans = fastpath.Plans("switch_probe")
    plans._plans["a key"] = object()  # stands for a plan captured before the change
    monkeypatch.setattr(switches.gemm, "BACKWARD_TMA", False)
    x = torch.ones(2)
    assert plans.run((x,), (), lambda: x + 1).tolist() == [2.0, 2.0]
    assert plans._plans == {}


def test_the_cooperative_configs_are_the_kernels_own():
    from tilefuse.kernels.gemm import coop
    backward = switches.gemm._switches["COOP_BACKWARD_CONFIG"]
    gated = switches.gemm._switches["COOP_GATED_CONFIG"]
    assert set(backward.choices) <= set(coop.CONFIGS) and backward.default in backward.choices
    assert set(gated.choices) <= set(coop.gated_configs()) and gated.default in gated.choices

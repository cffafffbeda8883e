"""The switches that choose which kernel runs: one documented place for every op family's launch module.

Each switch's default is the form that measured fastest (or the only one that is deterministic) on the H200;
benchmarks/NOTES.md has the numbers. Turning one is for comparing forms side by side and for tests that force a
form. The launch modules read them on every full call, and the host's fast path (kernels/fastpath.py) drops
every captured plan when any switch changes, so the next call of any op decides afresh; a measured choice between
tilefuse's kernels and the vendor's is keyed by the switches away from their defaults (:func:`non_default`).

Three ways to set them::

    from tilefuse.kernels import switches
    switches.gemm.COOP_BACKWARD = False                      # from now on
    with switches.overridden(switches.gemm, COOP_BACKWARD=False):
        ...                                                  # inside the block only

    TILEFUSE_SWITCHES="gemm.COOP_BACKWARD=0,attention.FP8_KERNEL=portable"   # the environment, read at import

``tilefuse info`` lists every switch with its value and what it does. A name that is not a switch, or a value
of the wrong kind, raises at once (``AttributeError``, ``TypeError`` or ``ValueError``), naming both.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

GENERATION = 0  # bumped at every change; the fast path's plans are made under one generation
ENV = "TILEFUSE_SWITCHES"


@dataclasses.dataclass(frozen=True)
class Switch:
    """One switch: its default, what it does, and the values it takes (None: those of the default's type)."""
    default: object
    doc: str
    choices: tuple | None = None

    def check(self, family: str, name: str, value):
        """``value`` if this switch takes it, else a TypeError / ValueError naming the switch."""
        if self.choices is not None:
            if not any(value is c or (type(value) is type(c) and value == c) for c in self.choices):
                raise ValueError(f"switches.{family}.{name}: {value!r} is not one of {self.choices}")
            return value
        kind = type(self.default)
        if kind is bool and not isinstance(value, bool):
            raise TypeError(f"switches.{family}.{name} is True or False, got {value!r}")
        if not isinstance(value, kind):
            raise TypeError(f"switches.{family}.{name} is a {kind.__name__}, got {value!r}")
        return value

    def parse(self, family: str, name: str, text: str):
        """The value a ``TILEFUSE_SWITCHES`` entry spells."""
        word = text.strip()
        if self.choices is not None:
            spelled = {str(c).lower(): c for c in self.choices}
            if word.lower() not in spelled:
                raise ValueError(f"{ENV}: {family}.{name}={word!r} is not one of {self.choices}")
            return spelled[word.lower()]
        if isinstance(self.default, bool):
            truth = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
            if word.lower() not in truth:
                raise ValueError(f"{ENV}: {family}.{name}={word!r} is not one of 1/0, true/false, on/off")
            return truth[word.lower()]
        return self.check(family, name, type(self.default)(word))


class Switches:
    """One op family's switches, read as attributes (plain attribute reads: the launch modules read them per
    call). Setting one checks the value and bumps :data:`GENERATION`."""

    def __init__(self, family: str, **switches: Switch):
        object.__setattr__(self, "_family", family)
        object.__setattr__(self, "_switches", switches)
        for name, switch in switches.items():
            object.__setattr__(self, name, switch.default)

    def __setattr__(self, name: str, value):
        switch = self._switches.get(name)
        if switch is None:
            raise AttributeError(f"switches.{self._family} has no switch {name!r}; "
                                 f"its switches: {', '.join(self._switches)}")
        object.__setattr__(self, name, switch.check(self._family, name, value))
        _changed()

    def reset(self) -> None:
        """Every switch of the family back to its default."""
        for name, switch in self._switches.items():
            object.__setattr__(self, name, switch.default)
        _changed()

    def describe(self) -> list[dict]:
        """(family, name, value, default, doc) of every switch, in declaration order."""
        return [dict(family=self._family, name=name, value=getattr(self, name), default=s.default, doc=s.doc)
                for name, s in self._switches.items()]


def _changed() -> None:
    global GENERATION
    GENERATION += 1


_NON_DEFAULT = (-1, "")  # (GENERATION, text) of the last non_default() answer


def non_default() -> str:
    """Every switch away from its default as ``family.NAME=value`` joined by commas, "" when all are at their
    defaults. A measured choice between tilefuse's kernels and the vendor's holds only for the kernels the switches
    chose, so the fast path adds this to a choice's key (kernels/fastpath.py: ``run_chosen``)."""
    global _NON_DEFAULT
    generation, text = _NON_DEFAULT
    if generation != GENERATION:
        text = ",".join(f"{row['family']}.{row['name']}={row['value']}" for row in describe()
                        if row["value"] != row["default"] or type(row["value"]) is not type(row["default"]))
        _NON_DEFAULT = (GENERATION, text)
    return text


@contextlib.contextmanager
def overridden(family: Switches, **values):
    """Sets ``values`` on ``family`` for the block, then restores what was there (each change seen by the fast
    path, both ways)."""
    saved = {name: getattr(family, name) for name in values if name in family._switches}
    try:
        for name, value in values.items():
            setattr(family, name, value)
        yield family
    finally:
        for name, value in saved.items():
            setattr(family, name, value)


gemm = Switches(
    "gemm",
    DECODE_KERNEL=Switch(True, "Small-M Linear (M <= 64, K >= 1024, a wave of 32-column programs) on the decode "
                         "kernel, the weight read once; False leaves those shapes to split-K."),
    COOP_BACKWARD=Switch(True, "The linear backward's dx and dW (+ db) with a slope on sm_90 take the cooperative "
                         "warp-specialized Gluon GEMM where it measured faster; False keeps the TMA / pointer "
                         "kernels."),
    COOP_GATED=Switch(True, "The gated forward without slopes (inference) on sm_90 with at least a tile per SM "
                      "takes the cooperative kernel; False keeps the TMA gated kernel."),
    COOP_GATED_DX=Switch(True, "The gated dx as one cooperative launch (both branches' products in one "
                         "reduction) under COOP_BACKWARD's rule; False leaves it to the pointer kernel."),
    COOP_BACKWARD_CONFIG=Switch("128x256x32_s4", "The cooperative backward GEMM's tile and ring depth.",
                                ("128x256x32_s4", "128x128x64_s4", "128x128x64_s3")),
    COOP_GATED_CONFIG=Switch("128x128x64_s4", "The cooperative gated forward's tile (its two accumulators per "
                             "consumer fit at BLOCK_N 128 only).", ("128x128x64_s4", "128x128x64_s3")),
    BACKWARD_TMA=Switch(True, "dW on Hopper's persistent TMA kernel where its operands allow (measured faster "
                        "than the tuned pointer dW); False leaves dW to the pointer kernel."),
    FP8_FAST_ACCUM=Switch(False, "FP8 Linear accumulates the whole K loop in the tensor cores' fast accumulator "
                          "instead of promoting each 128-deep step to fp32 (cuBLASLt's default is off)."),
    LCE_TRAINING_FORM=Switch(True, "Autograd over a mean/sum linear_cross_entropy, eager or in a graph torch.compile "
                             "traces, takes the training form (loss and both gradients in one pass over token chunks)."),
    QKV_TMA=Switch(True, "qkv_projection on Hopper takes the TMA kernels where their tile table holds the head "
                   "dim; False leaves every call to the pointer kernels."),
    QKV_TMA_PARTS=Switch(True, "The TMA parts form of qkv_projection for the other rotate-half cases (d 80, 96, "
                         "160, 192, partial rotary); False leaves those to the pointer kernels."),
)

attention = Switches(
    "attention",
    BACKWARD_WS=Switch(True, "The warp-specialized backward passes where they apply (sm_90, d <= 128); False: "
                       "the portable passes everywhere."),
    BACKWARD_WS_WIDE=Switch(True, "The warp-specialized backward passes for head dims past 128 (160, 192, 256); "
                            "False: the portable passes there."),
    BACKWARD_DQ_ATOMIC=Switch(False, "The portable backward's dQ by fp32 atomics inside the dK/dV pass instead of "
                              "a pass of its own; on breaks bit-identical gradients, so only for measuring."),
    BACKWARD_REPLAY=Switch(True, "The backward through the fast path's plans (its launches replayed); False: "
                           "every backward call takes the full path."),
    FP8_KERNEL=Switch("auto", "FP8 attention: 'auto' runs the warp-specialized kernel where it applies, "
                      "'portable' forces the portable one.", ("auto", "portable")),
    FP8_FMA_SOFTMAX=Switch(False, "The warp-specialized FP8 kernel's softmax: True takes the row max over raw scores "
                           "and makes P_SCALE * exp2 by one FMA and one exp2 per score (for a positive softmax "
                           "scale); False scales every score first and P after (the measured form).", (False, True)),
    FP8_DESCRIPTORS=Switch(None, "The portable FP8 kernel's loads: None decides per call (TMA descriptors on "
                           "sm_90), True / False force one form.", (None, True, False)),
)

FAMILIES = (gemm, attention)


def describe() -> list[dict]:
    """Every switch of every family (:meth:`Switches.describe`)."""
    return [row for family in FAMILIES for row in family.describe()]


def apply_environment(text: str | None = None) -> None:
    """Sets the switches a ``TILEFUSE_SWITCHES`` string names ("family.NAME=value,..."); ``text`` None reads the
    environment. Raises ValueError naming a malformed entry, an unknown family or an unknown switch."""
    text = os.environ.get(ENV, "") if text is None else text
    families = {f._family: f for f in FAMILIES}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        target, sep, word = entry.partition("=")
        family_name, dot, name = target.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"{ENV}: {entry!r} is not family.NAME=value")
        family = families.get(family_name)
        if family is None:
            raise ValueError(f"{ENV}: {entry!r}: no family {family_name!r}; families: {', '.join(families)}")
        switch = family._switches.get(name)
        if switch is None:
            raise ValueError(f"{ENV}: {entry!r}: switches.{family_name} has no switch {name!r}")
        setattr(family, name, switch.parse(family_name, name, word))


apply_environment()

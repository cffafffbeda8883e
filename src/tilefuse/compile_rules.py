"""Which of a patched model's patterns stay tilefuse's under ``torch.compile``, and which go back to Inductor.

A tilefuse op is opaque to Inductor: inside a compiled graph it runs its own kernel, and Inductor can no longer
fuse the pointwise work around it. Where Inductor makes the same fusion itself (a norm with its residual add, a
GEMM's bias and activation in the kernel after cuBLAS's, RoPE on the projections), a patched model compiled is
then slower than the unpatched one compiled. So each pattern :func:`tilefuse.patch` replaces has a rule for
compiled graphs: ``inductor`` -- while ``torch.compile`` traces, the patched module runs the unpatched model's
own code for that pattern, which Inductor fuses as it would have; ``tilefuse`` -- the tilefuse op stays in the
graph. Eager calls always take tilefuse's ops; the rule is read only while torch.compile traces.

Patterns (the keyword arguments of ``patch``): ``norm``, ``linear`` (a Linear and its activation), ``mlp`` (a
gated MLP), ``qkv`` (the Q/K/V projections with RoPE), ``attention``, ``loss`` (the LM head's cross-entropy).
:data:`DEFAULT_RULES` gives each one's default with the reason (the measurements are in benchmarks/NOTES.md).

Set them process-wide by ``TILEFUSE_COMPILE_RULES`` (``"linear=tilefuse,norm=tilefuse"``; ``all=`` sets every
pattern) or for a block with :func:`use_compile_rules`, as :func:`tilefuse.use_backend` does for backends.
``torch.compile`` guards on the blocks' rules it read (a changed block recompiles the graph that read it), not on
the environment: set the variable before compiling.
"""
from __future__ import annotations

import os

import torch

from tilefuse import runtime

INDUCTOR, TILEFUSE = "inductor", "tilefuse"
RULES = (INDUCTOR, TILEFUSE)
PATTERNS = ("norm", "linear", "mlp", "qkv", "attention", "loss")
ENV = "TILEFUSE_COMPILE_RULES"

# pattern -> (rule, why), as measured on an H100 (bf16 training steps compiled in torch.compile's default mode;
# benchmarks/NOTES.md, results/h100/2026-12-07c): Inductor fuses a norm with its residual add, and a GEMM's bias and
# activation (or RoPE, or a gated MLP's gate) into one pointwise kernel after cuBLAS's GEMM, as well as tilefuse's
# epilogues do inside a compiled graph; what it does not make is the loss without the [tokens, vocab] logits.
DEFAULT_RULES = {
    "norm": (INDUCTOR, "Inductor fuses the norm and its residual add into one kernel of its own"),
    "linear": (INDUCTOR, "Inductor runs cuBLAS's GEMM and fuses bias and activation into the next kernel"),
    "mlp": (INDUCTOR, "measured no faster as tilefuse's gated GEMM than as cuBLAS's GEMMs and Inductor's gate "
                      "(Llama-1B training)"),
    "qkv": (INDUCTOR, "Inductor runs cuBLAS's GEMMs and fuses RoPE into its pointwise kernels"),
    "attention": (INDUCTOR, "measured faster as SDPA's kernels in the compiled graph (GPT-2 and Llama-1B training, "
                            "GPT-2-medium prefill)"),
    "loss": (TILEFUSE, "the [tokens, vocab] logits are never made: GPT-2-small training 1.12x faster compiled, "
                       "Llama-1B 5 GB less memory at 0.96x the speed"),
}

# The use_compile_rules blocks in force, innermost last (process-wide, like use_backend's).
_BLOCKS: list = []


def _check(pattern: str, rule: str, what: str) -> None:
    if pattern not in PATTERNS:
        raise ValueError(f"{what}: unknown pattern {pattern!r}; the patterns are {', '.join(PATTERNS)} (or all)")
    if rule not in RULES:
        raise ValueError(f"{what}: the rule for {pattern!r} must be 'inductor' or 'tilefuse', got {rule!r}")


def _expand(rules: dict, what: str) -> dict:
    """``rules`` with ``all`` expanded to every pattern (named patterns after it win), each entry checked."""
    out = {}
    if "all" in rules:
        out = dict.fromkeys(PATTERNS, rules["all"])
    for pattern, rule in rules.items():
        if pattern != "all":
            out[pattern] = rule
    for pattern, rule in out.items():
        _check(pattern, rule, what)
    return out


def _parse(value: str) -> dict:
    rules = {pattern: rule for pattern, (rule, _) in DEFAULT_RULES.items()}
    given = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        pattern, sep, rule = item.partition("=")
        if not sep:
            raise ValueError(f"the environment variable {ENV}: {item!r} is not pattern=rule")
        given[pattern.strip().lower()] = rule.strip().lower()
    rules.update(_expand(given, f"the environment variable {ENV}"))
    return rules


_PARSED: dict = {}  # the environment variable's value -> its rules


def _from_env() -> dict:
    value = os.environ.get(ENV, "")
    parsed = _PARSED.get(value)
    if parsed is None:
        parsed = _PARSED[value] = _parse(value)
    return parsed


def rules() -> dict:
    """pattern -> rule in force now: the innermost :func:`use_compile_rules` block's over ``TILEFUSE_COMPILE_RULES``
    over the defaults."""
    current = dict(_from_env())
    for block in _BLOCKS:
        current.update(block)
    return current


def rule(pattern: str) -> str:
    return rules()[pattern]


def hands_back(pattern: str) -> bool:
    """Whether a patched ``pattern`` runs the unpatched model's code here: only while torch.compile traces and the
    pattern's rule is ``inductor``."""
    return torch.compiler.is_compiling() and rule(pattern) == INDUCTOR


def use_compile_rules(**given: str):
    """``with tilefuse.use_compile_rules(linear="tilefuse"):`` -- graphs torch.compile traces inside take these
    rules (``all="tilefuse"`` for every pattern; named patterns after it win)."""
    return runtime.stacked(_BLOCKS, _expand({k.lower(): v for k, v in given.items()}, "use_compile_rules"))


def describe(given: dict | None = None) -> str:
    """One line, ``norm=inductor, ...``: each pattern's rule in ``given`` (a :func:`rules` result kept by a report)
    or in force now."""
    return ", ".join(f"{p}={r}" for p, r in (rules() if given is None else given).items())

"""tilefuse.patch: replace the parts of a model that tilefuse fuses, each one proven on a probe before it is kept.

The patcher recognises patterns, not model classes: a norm module (torch's LayerNorm / RMSNorm, or any
class named ``*RMSNorm`` with a 1-D ``weight`` and an ``eps`` / ``variance_epsilon``), a gated MLP
(``gate_proj`` / ``up_proj`` / ``down_proj`` Linears and an ``act_fn`` that computes SiLU or GELU), and a
Linear (or GPT-2's transposed ``Conv1D``) followed by an activation, inside an ``nn.Sequential`` or as the
two children of a module whose forward runs one into the other (BERT's intermediate, GPT-2's MLP). Each
candidate is built on the original parameters (shared, never copied: state dicts are unchanged) and, with
``verify=True``, run beside the original on a small random input; it is kept only if it matches within its
dtype's bound, otherwise the report says why it was skipped (Gemma's ``1 + weight`` norm, for example,
fails its check). Plain Linears are left alone: with no epilogue to fuse, cuBLAS is the faster GEMM.
LoRA-wrapped layers are left alone and reported. On Hugging Face models the attention function, the
rotary Q/K/V projections and the LM-head loss are patched too (patching_hf.py), each step proven on the
whole model. ``unpatch`` restores the original modules.

Under ``torch.compile`` each replaced pattern follows its compile rule (``tilefuse.compile_rules``): where
Inductor makes the same fusion itself, the patched module runs the unpatched model's code while torch.compile
traces it, so a patched model compiled is never the slower for an op Inductor cannot see into.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tilefuse import compile_rules
from tilefuse import nn as tnn
from tilefuse.opspec import REL_L2_BOUND
from tilefuse.patching_hf import rel_l2 as _rel_l2

_ORIGINALS = "_tilefuse_originals"  # attribute on the patched root: path -> the module it replaced


# What each backend means for the replaced modules' calls (the launch records name what each call ran).
BACKEND_MEANING = {"auto": "per shape bucket tilefuse's kernels or the vendor's, whichever measured faster",
                   "tilefuse": "tilefuse's kernels only", "vendor": "the vendor's compositions where there is one"}


@dataclass
class PatchReport:
    """What ``patch`` did: ``replaced`` (path, old class, new class, the check it passed) and ``skipped``
    (path, reason); ``backend``: the backend in force when it patched (``tilefuse.runtime.backend``), which the
    replaced modules' calls take unless a later ``use_backend`` block or ``TILEFUSE_BACKEND`` says otherwise;
    ``compile_rules``: the rules in force when it patched (pattern -> "inductor" | "tilefuse"), which graphs
    torch.compile traces take unless a ``use_compile_rules`` block says otherwise."""

    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    backend: str = ""
    compile_rules: dict = field(default_factory=dict)

    def __str__(self) -> str:
        head = f"tilefuse.patch: {len(self.replaced)} replaced, {len(self.skipped)} skipped"
        if self.backend:
            head += f" (backend {self.backend}: {BACKEND_MEANING[self.backend]})"
        lines = [head]
        if self.compile_rules:
            lines.append("  under torch.compile: " + compile_rules.describe(self.compile_rules))
        lines += [f"  replaced {path}: {old} -> {new} ({check})" for path, old, new, check in self.replaced]
        lines += [f"  skipped  {path}: {reason}" for path, reason in self.skipped]
        return "\n".join(lines)


class RMSNormModule(torch.nn.Module):
    """A tilefuse RMSNorm over a foreign RMSNorm's weight (shared), for classes that are not torch's."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tilefuse.ops.norms import rms_norm
        return rms_norm(x, (self.weight.shape[0],), self.weight, self.eps)


def _param(module):
    return next(iter(module.parameters()), None)


def _probe(features: int, like: torch.nn.Module) -> torch.Tensor:
    p = _param(like)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, features, generator=g)
    return x.to(device=p.device, dtype=p.dtype) if p is not None else x


@contextlib.contextmanager
def _eval_mode(*modules):
    """The modules (and all their submodules) in eval mode for a probe, each one's own mode restored after:
    a probe compares deterministic functions, and a model in training mode would compare two draws of its
    dropout masks."""
    saved = [(m, m.training) for root in modules for m in root.modules()]
    for root in modules:
        root.eval()
    try:
        yield
    finally:
        for m, training in saved:
            m.training = training


def _verify(original, candidate, features):
    """(ok, check text): the candidate against the original on a probe, within the dtype's rel-L2 bound."""
    x = _probe(features, original)
    bound = REL_L2_BOUND.get(x.dtype, 1e-2)
    try:
        with torch.no_grad(), _eval_mode(original, candidate):
            want, got = original(x), candidate(x)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the original, and say why
        return False, f"the candidate raised {type(exc).__name__}: {exc}"
    if got.shape != want.shape:
        return False, f"output shape {tuple(got.shape)} != the original's {tuple(want.shape)}"
    err = _rel_l2(got, want)
    if not err <= bound:
        return False, f"rel-L2 {err:.2e} against the original above the bound {bound:.0e}"
    return True, f"rel-L2 {err:.1e} <= {bound:.0e} on a probe"


def _activation_name(act) -> str | None:
    """The tilefuse activation an activation module computes, by type or, for foreign classes, by probe."""
    if isinstance(act, torch.nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    for cls, name in ((torch.nn.ReLU, "relu"), (torch.nn.SiLU, "silu")):
        if isinstance(act, cls):
            return name
    if not isinstance(act, torch.nn.Module) or list(act.parameters()):
        return None
    t = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = act(t)
    except Exception:  # noqa: BLE001
        return None
    for name, fn in (("silu", F.silu), ("gelu", F.gelu), ("gelu_tanh", lambda u: F.gelu(u, approximate="tanh")),
                     ("relu", F.relu)):
        if torch.allclose(out, fn(t), atol=1e-6):
            return name
    return None


def _is_lora(module) -> bool:
    return any(hasattr(module, a) for a in ("lora_A", "lora_B", "base_layer"))


def _norm_candidate(module):
    if isinstance(module, (tnn.LayerNorm, tnn.RMSNorm)):
        return None, "already tilefuse"
    if type(module) is torch.nn.LayerNorm:
        new = tnn.LayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                            bias=module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias
        return new, None
    if type(module) is torch.nn.RMSNorm:
        new = tnn.RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
        new.weight = module.weight
        return new, None
    if type(module).__name__.endswith("RMSNorm"):
        weight = getattr(module, "weight", None)
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        if isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 and isinstance(eps, (int, float)):
            return RMSNormModule(weight, float(eps)), None
        return None, "an RMSNorm-like class without a 1-D weight and an eps"
    return None, None


def _mlp_candidate(module):
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Linear) for p in parts):
        return None, None
    if isinstance(module, tnn.GatedMLP):
        return None, "already tilefuse"
    if any(_is_lora(p) for p in parts):
        return None, "LoRA-wrapped projections are left alone"
    act = _activation_name(getattr(module, "act_fn", None))
    if act not in ("silu", "gelu", "gelu_tanh"):
        return None, "the gate's activation is not SiLU or GELU"
    try:
        return tnn.GatedMLP.from_modules(*parts, activation=act), None
    except (TypeError, ValueError) as exc:
        return None, str(exc)


def _features(module) -> int:
    if isinstance(module, torch.nn.LayerNorm) or isinstance(module, torch.nn.RMSNorm):
        return int(module.normalized_shape[-1])
    if isinstance(getattr(module, "gate_proj", None), torch.nn.Linear):
        return module.gate_proj.in_features
    return int(module.weight.shape[-1])


def patch(model: torch.nn.Module, *, norm: bool = True, mlp: bool = True, qkv: bool = True, attention: bool = True,
          linear: bool = True, loss: bool = True, verify: bool = True) -> PatchReport:
    """Replace, in place, the parts of ``model`` tilefuse fuses (see the module doc); returns the report.
    Patching a patched model changes nothing and says so; :func:`unpatch` undoes it."""
    from tilefuse import patching_hf, runtime
    report = PatchReport(backend=runtime.backend())
    originals = getattr(model, _ORIGINALS, None)
    if originals or getattr(model, patching_hf._STATE, None):
        report.skipped.append(("", f"already patched ({len(originals or {})} modules); unpatch first to patch again"))
        return report
    hf = patching_hf.is_hf_model(model)
    reference = patching_hf.ProbeReference(model) if hf and verify and (attention or qkv) else None
    if originals is None:
        originals = {}
        object.__setattr__(model, _ORIGINALS, originals)
    report.compile_rules = compile_rules.rules()  # also checks TILEFUSE_COMPILE_RULES before anything is replaced
    swaps = []  # (parent, attribute, path, original, candidate, check, (pattern, unfused module) or None)
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            child_path = f"{path}.{name}" if path else name
            candidate, reason, pattern = None, None, None
            if norm:
                candidate, reason = _norm_candidate(child)
                pattern = "norm"
            if candidate is None and reason is None and mlp:
                candidate, reason = _mlp_candidate(child)
                pattern = "mlp"
            if candidate is None:
                if reason:
                    report.skipped.append((child_path, reason))
                continue
            ok, check = _verify(child, candidate, _features(child)) if verify else (True, "not verified")
            if ok:
                swaps.append((module, name, child_path, child, candidate, check, (pattern, child)))
            else:
                report.skipped.append((child_path, check))
        if linear and isinstance(module, torch.nn.Sequential):
            _fuse_sequential(module, path, swaps, report, verify)
        elif linear:
            _fuse_child_pair(module, path, swaps, report, verify)
    for parent, name, child_path, child, candidate, check, unfused in swaps:
        candidate.train(child.training)
        if unfused is not None:
            _follow_compile_rule(candidate, *unfused)
        setattr(parent, name, candidate)
        originals[child_path] = child
        report.replaced.append((child_path, type(child).__name__, type(candidate).__name__, check))
    if hf:
        patching_hf.patch(model, report, attention=attention, qkv=qkv, loss=loss, verify=verify, reference=reference)
    return report


def _forward_under_compile(self, *args, **kwargs):
    """A replaced module's forward: the unpatched code while torch.compile traces a pattern whose rule is
    ``inductor``, else the module's own (tilefuse's) forward."""
    if compile_rules.hands_back(self._tilefuse_pattern):
        return self._tilefuse_unfused(*args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def _follow_compile_rule(candidate, pattern, unfused):
    """Give ``candidate`` the forward above. The unfused module is held outside the module tree (not a
    submodule: the state dict keeps its keys, and the parameters are the candidate's own), and copies of the
    model copy it with them."""
    object.__setattr__(candidate, "_tilefuse_pattern", pattern)
    object.__setattr__(candidate, "_tilefuse_unfused", unfused)
    candidate.forward = types.MethodType(_forward_under_compile, candidate)


class _Unfused(torch.nn.Module):
    """A Linear and the activation after it, as the unpatched model ran them."""

    def __init__(self, linear: torch.nn.Module, activation: torch.nn.Module) -> None:
        super().__init__()
        self.linear, self.activation = linear, activation

    def forward(self, x):
        return self.activation(self.linear(x))


class Conv1DLinear(torch.nn.Module):
    """GPT-2's ``Conv1D`` (weight stored [in, out], i.e. nn.Linear's transposed) with an activation fused:
    tilefuse.linear reads the shared weight through its transposed view, no copy."""

    def __init__(self, conv: torch.nn.Module, activation: str) -> None:
        super().__init__()
        self.weight, self.bias, self.activation = conv.weight, conv.bias, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tilefuse.ops.linear import linear
        return linear(x, self.weight.t(), self.bias, self.activation)


def _is_conv1d(module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, torch.nn.Parameter) and w.dim() == 2
            and getattr(module, "nf", None) == w.shape[1])


def _fused_linear(lin, activation):
    """(fused module, in_features) for a Linear or a Conv1D child, or None."""
    if type(lin) is torch.nn.Linear and not _is_lora(lin):
        return tnn.Linear.from_linear(lin, activation), lin.in_features
    if _is_conv1d(lin):
        return Conv1DLinear(lin, activation), lin.weight.shape[0]
    return None


def _fuse_child_pair(parent, path, swaps, report, verify):
    """A module (not a Sequential) with one activation child and Linear / Conv1D children: the first of those
    whose output the forward feeds to the activation (proven by running the parent with the pair fused and
    the activation slot made Identity) is fused with it."""
    children = dict(parent.named_children())
    acts = [(n, a) for n, a in children.items() if not list(a.parameters()) and _activation_name(a)]
    if len(acts) != 1 or any(p is parent for p, *_ in swaps) or getattr(parent, "gate_proj", None) is not None:
        return
    act_name, act = acts[0]
    activation = _activation_name(act)
    prefix = f"{path}." if path else ""
    misses = []  # (child, why) for each Linear the probe ran but could not prove feeds the activation
    for name, lin in children.items():
        fused = _fused_linear(lin, activation)
        if fused is None:
            continue
        candidate, features = fused
        x = _probe(features, lin)
        try:
            with torch.no_grad(), _eval_mode(parent):
                want = parent(x)
                setattr(parent, name, candidate)
                setattr(parent, act_name, torch.nn.Identity())
                try:
                    got = parent(x)
                finally:
                    setattr(parent, name, lin)
                    setattr(parent, act_name, act)
        except Exception:  # noqa: BLE001 - a parent whose forward takes other inputs: not this pattern
            return
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            misses.append((name, "the output's shape changed"))
            continue
        err = _rel_l2(got, want)
        bound = REL_L2_BOUND.get(x.dtype, 1e-2)
        if verify and not err <= bound:
            misses.append((name, f"rel-L2 {err:.2e} above the bound {bound:.0e}"))
            continue
        check = f"rel-L2 {err:.1e} <= {bound:.0e} on a probe of {type(parent).__name__}, {type(act).__name__} fused"
        swaps.append((parent, name, prefix + name, lin, candidate, check, ("linear", _Unfused(lin, act))))
        swaps.append((parent, act_name, prefix + act_name, act, torch.nn.Identity(), "fused into " + prefix + name,
                      None))
        return
    if misses:
        tried = "; ".join(f"{name}: {why}" for name, why in misses)
        report.skipped.append((path or type(parent).__name__,
                               f"{type(act).__name__} {act_name!r} left unfused: no Linear child proved to feed it "
                               f"on a probe ({tried})"))


def _fuse_sequential(seq, path, swaps, report, verify):
    """Linear (or GPT-2's Conv1D) then an activation inside a Sequential: the pair fused (a tilefuse Linear /
    Conv1DLinear), and the activation slot replaced by Identity."""
    names = list(seq._modules)
    for first, second in zip(names, names[1:]):
        lin, act = seq._modules[first], seq._modules[second]
        prefix = f"{path}." if path else ""
        if isinstance(lin, torch.nn.Linear) and _is_lora(lin):
            report.skipped.append((prefix + first, "LoRA-wrapped Linear left alone"))
            continue
        activation = _activation_name(act)
        made = _fused_linear(lin, activation) if activation is not None else None
        if made is None:
            continue
        fused, features = made
        pair = torch.nn.Sequential(lin, act)
        ok, check = _verify(pair, fused, features) if verify else (True, "not verified")
        if not ok:
            report.skipped.append((prefix + first, check))
            continue
        swaps.append((seq, first, prefix + first, lin, fused, check + f", {type(act).__name__} fused",
                      ("linear", _Unfused(lin, act))))
        swaps.append((seq, second, prefix + second, act, torch.nn.Identity(), "fused into " + prefix + first, None))


def unpatch(model: torch.nn.Module) -> PatchReport:
    """Put back every module :func:`patch` replaced (the very objects); a no-op on an unpatched model."""
    from tilefuse import patching_hf
    report = PatchReport()
    patching_hf.unpatch(model, report)
    originals = getattr(model, _ORIGINALS, None) or {}
    for path, original in list(originals.items()):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        current = getattr(parent, name)
        setattr(parent, name, original)
        report.replaced.append((path, type(current).__name__, type(original).__name__, "restored"))
        del originals[path]
    return report

"""``tilefuse bench prefill`` and ``tilefuse bench train``: Hugging Face models built from their configs (random
weights, no downloads, dropout 0), up to five ways in one run: HF eager, ``tilefuse.patch``-ed, torch.compile of
the eager model, torch.compile over the patched one, and Liger-Kernel (``liger-kernel``) where it applies.

- Liger-Kernel: ``liger_kernel.transformers.apply_liger_kernel_to_llama`` on a freshly built instance (RoPE,
  RMSNorm, SwiGLU and the fused linear cross-entropy: Liger's defaults, passed explicitly), Llama models only.
  GPT-2 has no Liger patch function: the variant is left out of a GPT-2 run's defaults (the result's
  ``not_applicable`` and the summary say why) and naming it for GPT-2 is a BenchArgumentError. liger-kernel
  is an optional, benchmark-only dependency: where it is not installed, the variant's entry is a failure
  saying so (the other variants run). Liger also rebinds functions and classes of transformers' Llama module
  (RoPE, the norm and MLP classes); those are put back after the variant (``liger_scope``), so nothing built
  or run later in the process runs Liger's code.

- prefill: one forward of B sequences of N tokens in eval mode without grad; the median of ``repeats``
  forwards between CUDA events after a warm-up; peak memory over those forwards (``max_memory_allocated``,
  the stats reset after the warm-up); logits rel-L2 against eager's (fp32 norms of the bf16 logits).
- train: AdamW (lr 1e-4) on the model's bf16 parameters, labels = the inputs (HF shifts them), a fixed seeded
  batch per step index (the same data in every variant); tokens/s over the steps after the warm-up, peak memory
  (``torch.cuda.max_memory_allocated`` after the warm-up), the loss curve, and the loss against eager's at steps
  20, 40, ... (within 1% asked).
- train, noise floor: with eager among the variants, eager is trained a second time, built identically but with
  HF's SDPA attention forced onto another PyTorch SDPA backend (``noise_floor_backend``), in ``noise_floor``
  (not timed, not among the variants or the ratios): how far two equally valid implementations drift apart
  in this setting (bf16 AdamW on a loss plateau whose escape step is chaotic; benchmarks/NOTES.md has the
  runs). Each variant's ``max_rel_loss_diff_vs_eager`` (max of |loss - eager| / |eager| over the
  ``loss_checkpoint_steps``) reads against the noise floor's.
Models: Llama-7B shape (32 layers, hidden 4096, MLP 11008, 32 heads), GPT-2-medium shape (n_positions 2048),
Llama-1B shape (16 layers, hidden 2048, MLP 8192, GQA 32/8, vocab 128256, untied) and GPT-2-small shape; on a
CPU each becomes a tiny configuration of the same family (the kernels run in the Triton interpreter: the
numbers are real, the times are not). ``patch`` itself is timed in each patched variant (``patch_s``; for
Liger-Kernel, its patch function).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch

from tilefuse import compile_rules
from tilefuse.harness.mlp_train import (LINESTYLES, BenchArgumentError, _dtype_name, _dynamo_counts, _failure,
                                        _release, _sync, timed_steps)

LIGER = "liger-kernel"
# the MLP benchmark's four (harness/mlp_train.py, which has no Liger equivalent) and Liger-Kernel's patch
VARIANTS = ("eager", "tilefuse", "torch.compile", "torch.compile over tilefuse", LIGER)
LIGER_PIN = "liger-kernel==0.8.5"   # the version the registry's Liger anchors are measured with
LIGER_FAMILIES = ("llama",)          # model families with a Liger patch function used here
LIGER_NOT_APPLICABLE = "Liger-Kernel has no GPT-2 patch"
GPU_COMPILE_MODE = "max-autotune-no-cudagraphs"
LR = 1e-4
LOSS_RTOL = 0.01
LOSS_CHECK_EVERY = 20
NOISE_FLOOR_NAME = "eager, other SDPA backend"

# name -> (family, GPU config, prefill (batch, tokens), train (batch, seq, steps)); TINY holds the CPU configs
MODELS = {
    "llama-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                               max_position_embeddings=4096),
                 (1, 2048), (1, 2048, 100)),
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=4096, tie_word_embeddings=False),
                 (1, 2048), (4, 2048, 100)),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16, n_positions=2048, vocab_size=50257),
                    (1, 2048), (8, 1024, 200)),
    "gpt2-small": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257),
                   (1, 1024), (8, 1024, 200)),
}
TINY = {"llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=64),
        "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=64)}
TINY_PREFILL, TINY_TRAIN = (1, 16), (2, 16, 3)
JSON_NAMES = {"prefill": "prefill.json", "train": "train.json"}
PNG_NAMES = {"prefill": "prefill.png", "train": "train_loss.png"}


def build_model(name: str, on_gpu: bool, seed: int):
    """The named model from its config (eval mode, dropout 0), seeded, in bf16 on the GPU (fp32 on a CPU)."""
    import transformers

    family, config, *_ = MODELS[name]
    config = dict(config if on_gpu else TINY[family])
    if family == "llama":
        cfg = transformers.LlamaConfig(**config, attention_dropout=0.0)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(**config, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    cfg._attn_implementation = "sdpa"
    device = torch.device("cuda" if on_gpu else "cpu")
    with torch.random.fork_rng(devices=[device] if on_gpu else []):
        torch.manual_seed(seed)
        with device:
            model = cls(cfg).to(torch.bfloat16 if on_gpu else torch.float32)
    return model.eval()


def liger_patch_function():
    """``liger_kernel.transformers.apply_liger_kernel_to_llama``; ImportError saying how to install liger-kernel
    where it is not installed (an installed liger-kernel that fails to import raises its own error)."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "liger_kernel":
            raise
        raise ImportError(f"liger-kernel is not installed: pip install {LIGER_PIN}") from None
    return apply_liger_kernel_to_llama


@contextlib.contextmanager
def liger_scope():
    """Run the Liger-Kernel variant inside this: afterwards, transformers' Llama module
    (``transformers.models.llama.modeling_llama``: ``apply_rotary_pos_emb``, ``LlamaRMSNorm``, ``LlamaMLP``),
    ``LlamaForCausalLM.forward`` and ``torch.nn.functional.cross_entropy`` are what they were before.

    ``apply_liger_kernel_to_llama`` rebinds those module-level names even when given a model instance, and
    HF's attention looks ``apply_rotary_pos_emb`` up at call time: without this, every Llama run after the
    Liger variant in the same process (eager included) would run Liger's RoPE. The patched instance keeps
    its own bound methods, so the variant itself is unaffected while inside."""
    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama

    names = dict(vars(modeling_llama))
    causal_lm = modeling_llama.LlamaForCausalLM
    forward = causal_lm.__dict__.get("forward")
    cross_entropy = F.cross_entropy
    try:
        yield
    finally:
        for key in [k for k in vars(modeling_llama) if k not in names]:
            delattr(modeling_llama, key)
        for key, value in names.items():
            if vars(modeling_llama).get(key) is not value:
                setattr(modeling_llama, key, value)
        if causal_lm.__dict__.get("forward") is not forward:
            if forward is None:
                delattr(causal_lm, "forward")
            else:
                causal_lm.forward = forward
        F.cross_entropy = cross_entropy


def _variant_scope(variant):
    return liger_scope() if variant == LIGER else contextlib.nullcontext()


def _variant_model(variant, name, on_gpu, seed, compile_mode):
    """(callable, the module underneath, seconds patch took) for one variant, built afresh from the seed; for
    the Liger-Kernel variant the seconds are those of ``apply_liger_kernel_to_llama`` (call it inside
    ``liger_scope``)."""
    from tilefuse.patching import patch
    if variant == LIGER:
        if MODELS[name][0] not in LIGER_FAMILIES:
            raise ValueError(f"{LIGER_NOT_APPLICABLE} ({name})")
        apply_liger = liger_patch_function()  # before the build: a missing package costs no model
        model = build_model(name, on_gpu, seed)
        t0 = time.perf_counter()
        apply_liger(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                    model=model)
        return model, model, time.perf_counter() - t0
    model = build_model(name, on_gpu, seed)
    patch_s = None
    if "tilefuse" in variant:
        t0 = time.perf_counter()
        report = patch(model)
        patch_s = time.perf_counter() - t0
        if not report.replaced:
            raise RuntimeError(f"tilefuse.patch replaced nothing: {report}")
    if variant.startswith("torch.compile"):
        kwargs = {"dynamic": False}
        if compile_mode:
            kwargs["mode"] = compile_mode
        return torch.compile(model, **kwargs), model, patch_s
    return model, model, patch_s


def _tokens(vocab, batch, n, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=g).to(device)


def _prefill(variant, name, batch, n, repeats, seed, on_gpu, compile_mode, reference):
    fwd, model, patch_s = _variant_model(variant, name, on_gpu, seed, compile_mode)
    device = next(model.parameters()).device
    ids = _tokens(model.config.vocab_size, batch, n, seed + 1, device)
    with torch.no_grad():
        logits = fwd(input_ids=ids).logits  # warm-up: compiles, tunes
        logits = fwd(input_ids=ids).logits
        _sync(device)
        if on_gpu:  # the timed forwards' peak (the warm-up's autotuning buffers left out), logits of one kept
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(repeats):
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fwd(input_ids=ids)
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fwd(input_ids=ids)
                times.append(1e3 * (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated(device) if on_gpu else None
    times.sort()
    out = logits.float().cpu()
    entry = {"ms": times[len(times) // 2], "peak_memory_bytes": peak, "patch_s": patch_s, "error": None,
             "rel_l2_vs_eager": None if reference is None else float((out - reference).norm() / reference.norm())}
    return entry, out


def noise_floor_backend(model, on_gpu: bool):
    """The SDPA backend the noise-floor reference forces HF's attention onto: one other than the default,
    computing the same attention with another kernel (another blocking and summation order), equally valid.

    CPU: MATH (the default there is the CPU flash kernel). CUDA: EFFICIENT_ATTENTION (the default there for
    bf16 without a mask is flash, or cuDNN where a build prefers it); not MATH, which materialises the T x T
    scores of every head (seconds and GiBs per step at seq 1024-2048). Some torch builds' efficient kernel
    refuses grouped KV heads (``enable_gqa``, Llama-1B's 32/8), so a small forward + backward of the model's
    head shapes is tried first; where it is refused, MATH it is (the recorded name says which ran)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if not on_gpu:
        return SDPBackend.MATH
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    # zeros, not randn: the probe leaves the RNG alone (whether a kernel admits the inputs is about shapes)
    q = torch.zeros(1, heads, 64, dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.zeros(1, kv_heads, 64, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   enable_gqa=kv_heads != heads)
            out.float().sum().backward()
        return SDPBackend.EFFICIENT_ATTENTION
    except RuntimeError:
        return SDPBackend.MATH


def _train(variant, name, batch, seq, steps, warmup, seed, on_gpu, compile_mode, advance,
           other_sdpa_backend=False):
    """One variant's training run; ``other_sdpa_backend`` (the noise floor): every step's forward and backward
    under ``sdpa_kernel(noise_floor_backend(...))``, its name in the entry's ``sdpa_backend``."""
    import contextlib

    from torch.nn.attention import sdpa_kernel
    fwd, model, patch_s = _variant_model(variant, name, on_gpu, seed, compile_mode)
    model.train()
    device = next(model.parameters()).device
    backend = noise_floor_backend(model, on_gpu) if other_sdpa_backend else None
    attention = (lambda: sdpa_kernel(backend)) if backend is not None else contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = torch.empty(steps, device=device, dtype=torch.float32)
    data = [_tokens(model.config.vocab_size, batch, seq, seed + 10 + i, device) for i in range(min(steps, 8))]

    def step(i):
        ids = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        with attention():
            loss = fwd(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        losses[i] = loss.detach().float()
        advance()

    graphs_before = _dynamo_counts()
    for i in range(warmup):
        step(i)
    _sync(device)
    graphs_after = _dynamo_counts()
    seconds, peak = timed_steps(step, warmup, steps, device)
    curve = losses.tolist()
    entry = {"tokens_per_s": batch * seq * (steps - warmup) / seconds, "step_ms": 1e3 * seconds / (steps - warmup),
             "peak_memory_bytes": peak, "loss_curve": curve, "final_loss": curve[-1], "patch_s": patch_s,
             "compiled_graphs": graphs_after[0] - graphs_before[0] if fwd is not model else None,
             "graph_breaks": graphs_after[1] - graphs_before[1] if fwd is not model else None, "error": None}
    if backend is not None:
        entry["sdpa_backend"] = backend.name
    return entry


def variant_name(text: str) -> str:
    """A variant of this benchmark from its name, case-insensitive, '-' or '_' standing for spaces (and a
    space for the '-' of liger-kernel; "liger" alone is liger-kernel). Its own resolver, not mlp_train's:
    the MLP benchmark has no Liger variant."""
    def key(s):
        return " ".join(s.replace("-", " ").replace("_", " ").lower().split())
    wanted = key(text)
    if wanted == "liger":
        return LIGER
    for name in VARIANTS:
        if key(name) == wanted:
            return name
    raise BenchArgumentError(f"--variants: unknown variant {text!r}; known: {', '.join(VARIANTS)} "
                             "(on a command line '-' may stand for a space)")


def default_variants(model: str) -> tuple[str, ...]:
    """The variants a run of ``model`` takes when none are named: all those that apply to its family."""
    return tuple(v for v in VARIANTS if v != LIGER or MODELS[model][0] in LIGER_FAMILIES)


def not_applicable(model: str) -> dict:
    """{variant: why} for the variants that do not apply to ``model`` (recorded in the result, printed)."""
    return {} if MODELS[model][0] in LIGER_FAMILIES else {LIGER: LIGER_NOT_APPLICABLE}


def resolve(kind: str, model: str | None, variants, on_gpu: bool):
    """(model name, variants in canonical order); raises BenchArgumentError before any work, also for a
    variant named that does not apply to the model (liger-kernel on GPT-2)."""
    default = {"prefill": "llama-7b", "train": "gpt2-small"}[kind]
    model = model or default
    if model not in MODELS:
        raise BenchArgumentError(f"--model: unknown model {model!r}; known: {', '.join(MODELS)}")
    if variants is not None and not variants:
        raise BenchArgumentError(f"--variants: name at least one of {', '.join(VARIANTS)}")
    chosen = {variant_name(v) for v in (variants or default_variants(model))}
    for variant, why in not_applicable(model).items():
        if variant in chosen:
            llamas = ", ".join(n for n, m in MODELS.items() if m[0] in LIGER_FAMILIES)
            raise BenchArgumentError(f"--variants: {variant} does not apply to {model}: {why} (it runs on the "
                                     f"Llama models: {llamas})")
    return model, [v for v in VARIANTS if v in chosen]


def run(kind: str, model: str | None = None, variants=None, out_dir: str = "bench", seed: int = 0,
        steps: int | None = None, repeats: int = 10, progress: bool = True, compile_mode: str | None = None) -> dict:
    """Run the prefill or train benchmark over the chosen variants; writes JSON and a PNG into ``out_dir``.
    ``compile_mode``: torch.compile's mode for the compiled variants (None: GPU_COMPILE_MODE on a GPU, torch's
    default on a CPU)."""
    from rich.progress import Progress

    from tilefuse.harness.report import _quiet_interpreter_math, environment
    on_gpu = torch.cuda.is_available()
    name, chosen = resolve(kind, model, variants, on_gpu)
    _, _, prefill_shape, train_shape = MODELS[name]
    if compile_mode is None:
        compile_mode = GPU_COMPILE_MODE if on_gpu else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    result = {"benchmark": kind, "model": name, "device": env["device"], "path": env["path"], "environment": env,
              "dtype": _dtype_name(torch.bfloat16 if on_gpu else torch.float32), "seed": seed,
              "compile": {"mode": compile_mode or "default", "dynamic": False, "rules": compile_rules.rules()},
              "not_applicable": not_applicable(name), "variants": {}}
    if kind == "prefill":
        batch, n = prefill_shape if on_gpu else TINY_PREFILL
        result.update(batch=batch, tokens=n, repeats=repeats)
        total = len(chosen)
    else:
        batch, seq, default_steps = train_shape if on_gpu else TINY_TRAIN
        steps = steps or default_steps
        if steps < 2:
            raise BenchArgumentError(f"--steps must be an integer >= 2, got {steps!r}")
        warmup = min(10, steps // 2)
        result.update(batch=batch, seq=seq, steps=steps, warmup_steps=warmup, lr=LR)
        total = steps * (len(chosen) + ("eager" in chosen))
    reference = None
    with Progress(disable=not progress, transient=True) as bar, _quiet_interpreter_math():
        task = bar.add_task(kind, total=total)
        for variant in chosen:
            bar.update(task, description=f"{kind} {name}: {variant}")
            try:
                with _variant_scope(variant):
                    if kind == "prefill":
                        entry, logits = _prefill(variant, name, batch, n, repeats, seed, on_gpu, compile_mode,
                                                 reference)
                        if variant == "eager":
                            reference = logits
                        bar.advance(task)
                    else:
                        entry = _train(variant, name, batch, seq, steps, warmup, seed, on_gpu, compile_mode,
                                       lambda: bar.advance(task))
            except Exception as exc:  # noqa: BLE001 - recorded, never hidden
                entry = _failure(exc)
            result["variants"][variant] = entry
            if kind == "train" and variant == "eager":
                bar.update(task, description=f"{kind} {name}: noise floor ({NOISE_FLOOR_NAME})")
                result["noise_floor"] = _noise_floor(name, batch, seq, steps, warmup, seed, on_gpu,
                                                     lambda: bar.advance(task))
            if variant.startswith("torch.compile"):
                torch._dynamo.reset()
            _release(torch.device("cuda" if on_gpu else "cpu"))
            _ratios(result, kind)
            (out / JSON_NAMES[kind]).write_text(json.dumps(result, indent=1, default=str))
    result["plot"] = _plot(result, kind, out / PNG_NAMES[kind])
    (out / JSON_NAMES[kind]).write_text(json.dumps(result, indent=1, default=str))
    return result


def _noise_floor(name, batch, seq, steps, warmup, seed, on_gpu, advance):
    """The eager model trained again, identically but on another SDPA backend: only its loss curve is kept
    (its times are not compared with anything)."""
    try:
        entry = _train("eager", name, batch, seq, steps, warmup, seed, on_gpu, None, advance,
                       other_sdpa_backend=True)
        out = {"variant": f"{NOISE_FLOOR_NAME} ({entry['sdpa_backend']})", "sdpa_backend": entry["sdpa_backend"],
               "loss_curve": entry["loss_curve"], "error": None}
    except Exception as exc:  # noqa: BLE001 - recorded, never hidden
        failure = _failure(exc)
        out = {"variant": NOISE_FLOOR_NAME, "sdpa_backend": None, "loss_curve": [], "error": failure["error"],
               "traceback": failure["traceback"]}
    out["max_rel_loss_diff_vs_eager"] = None
    _release(torch.device("cuda" if on_gpu else "cpu"))
    return out


def _checkpoint_indices(n):
    """Curve indices of the loss checkpoints: the 1% check's steps (20, 40, ...) and the last step (already
    among them at the default 100 and 200 steps; the only one on the CPU's 3-step run)."""
    idx = list(range(LOSS_CHECK_EVERY - 1, n, LOSS_CHECK_EVERY))
    return idx + [n - 1] if n and (not idx or idx[-1] != n - 1) else idx


def _max_rel_diff(curve, base):
    """max over the checkpoints of |loss - eager| / |eager| (inf for a non-finite loss or eager's 0); None
    without both curves whole."""
    if not curve or len(curve) != len(base):
        return None
    return max(abs(curve[i] - base[i]) / abs(base[i]) if base[i] and math.isfinite(curve[i]) else math.inf
               for i in _checkpoint_indices(len(base)))


def _ratios(result, kind):
    """Each finished variant against eager, torch.compile and Liger-Kernel (None where that one did not run
    or failed): prefill ``speedup_vs_*`` (their ms over its ms), train ``vs_*`` (its tokens/s over theirs);
    train also the loss checks against eager."""
    vs = result["variants"]
    ok = {n: v for n, v in vs.items() if v.get("error") is None}
    if kind == "prefill":
        for v in ok.values():
            v["speedup_vs_eager"] = ok["eager"]["ms"] / v["ms"] if "eager" in ok else None
            v["speedup_vs_torch_compile"] = ok["torch.compile"]["ms"] / v["ms"] if "torch.compile" in ok else None
            v["speedup_vs_liger"] = ok[LIGER]["ms"] / v["ms"] if LIGER in ok else None
        return
    eager = ok.get("eager")
    for v in ok.values():
        v["vs_eager"] = v["tokens_per_s"] / eager["tokens_per_s"] if eager else None
        v["vs_torch_compile"] = (v["tokens_per_s"] / ok["torch.compile"]["tokens_per_s"]
                                 if "torch.compile" in ok else None)
        v["vs_liger"] = v["tokens_per_s"] / ok[LIGER]["tokens_per_s"] if LIGER in ok else None
        checks = {}
        if eager:
            for i in range(LOSS_CHECK_EVERY - 1, len(v["loss_curve"]), LOSS_CHECK_EVERY):
                a, b = v["loss_curve"][i], eager["loss_curve"][i]
                checks[i + 1] = abs(a - b) / abs(b) if b and math.isfinite(a) else math.inf
        v["loss_rel_diff_vs_eager_at_steps"] = checks
        v["loss_within_1pct_at_checked_steps"] = all(r <= LOSS_RTOL for r in checks.values()) if checks else None
        v["max_rel_loss_diff_vs_eager"] = _max_rel_diff(v["loss_curve"], eager["loss_curve"]) if eager else None
    result["loss_checkpoint_steps"] = [i + 1 for i in _checkpoint_indices(result["steps"])]
    floor = result.get("noise_floor")
    if floor is not None:
        floor["max_rel_loss_diff_vs_eager"] = (_max_rel_diff(floor["loss_curve"], eager["loss_curve"])
                                               if eager and floor["error"] is None else None)


STYLES = {**LINESTYLES, LIGER: ("#2ca02c", "-")}  # variant -> (colour, line style): mlp-train's four and Liger's


def _plot(result, kind, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: v for n, v in result["variants"].items() if v.get("error") is None}
    fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
    if kind == "prefill":
        names = list(ok)
        ax.barh(names, [ok[n]["ms"] for n in names], color=[STYLES[n][0] for n in names])
        ax.set_xlabel("ms per forward (median)")
        ax.set_title(f"prefill {result['model']}: B={result['batch']} N={result['tokens']}, {result['dtype']} · "
                     f"{result['device']}", fontsize=9)
    else:
        for n, v in ok.items():
            color, style = STYLES[n]
            ax.plot(range(1, len(v["loss_curve"]) + 1), v["loss_curve"], style, color=color, label=n)
        floor = result.get("noise_floor")
        if floor and floor["error"] is None:
            ax.plot(range(1, len(floor["loss_curve"]) + 1), floor["loss_curve"], color="black",
                    linestyle=(0, (5, 3)), linewidth=0.8, alpha=0.6, label=f"noise floor: {floor['variant']}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
        ax.set_title(f"train {result['model']}: batch {result['batch']} x seq {result['seq']}, {result['dtype']} · "
                     f"{result['device']}", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def summary_text(result) -> str:
    kind = result["benchmark"]
    lines = [f"{kind} {result['model']} on {result['device']} ({result['path']}), {result['dtype']}, "
             f"torch.compile mode {result['compile']['mode']}"]
    if "torch.compile over tilefuse" in result["variants"] and result["compile"].get("rules"):
        lines.append("  patched patterns under torch.compile: " + compile_rules.describe(result["compile"]["rules"]))
    with_liger = LIGER in result["variants"]
    for n, v in result["variants"].items():
        if v.get("error"):
            lines.append(f"  {n}: failed: {v['error']}")
        elif kind == "prefill":
            lines.append(f"  {n}: {v['ms']:.3f} ms, x eager {_f(v.get('speedup_vs_eager'))}, x compile "
                         f"{_f(v.get('speedup_vs_torch_compile'))}"
                         + (f", x liger {_f(v.get('speedup_vs_liger'))}" if with_liger else "")
                         + f", peak {_mib(v.get('peak_memory_bytes'))}, logits rel-L2 vs eager "
                         f"{_f(v['rel_l2_vs_eager'], '.1e')}"
                         + (f", patch {v['patch_s']:.2f} s" if v["patch_s"] is not None else ""))
        else:
            lines.append(f"  {n}: {v['tokens_per_s']:,.0f} tokens/s, x eager {_f(v.get('vs_eager'))}, x compile "
                         f"{_f(v.get('vs_torch_compile'))}"
                         + (f", x liger {_f(v.get('vs_liger'))}" if with_liger else "")
                         + f", peak {_mib(v['peak_memory_bytes'])}, "
                         f"final loss {v['final_loss']:.5g}, loss within 1% at every 20th step: "
                         f"{v.get('loss_within_1pct_at_checked_steps')}, max loss diff vs eager at the checkpoints "
                         f"{_pct(v.get('max_rel_loss_diff_vs_eager'))}")
    for n, why in result.get("not_applicable", {}).items():
        lines.append(f"  {n}: not applicable to {result['model']}: {why}")
    floor = result.get("noise_floor")
    if floor is not None:
        if floor["error"]:
            lines.append(f"  noise floor ({floor['variant']}): failed: {floor['error']}")
        else:
            lines.append(f"  noise floor ({floor['variant']}): loss differs from eager by up to "
                         f"{_pct(floor['max_rel_loss_diff_vs_eager'])} at the checkpoints (steps "
                         f"{_steps_text(result.get('loss_checkpoint_steps', []))}): differences of about this size "
                         f"are the setting's own noise, not a sign of error")
    if result["path"] != "compiled":
        lines.append("(no GPU: the kernels ran in the Triton interpreter; the times mean nothing)")
    return "\n".join(lines)


def _mib(v):
    return "–" if v is None else f"{v / 2**20:,.0f} MiB"


def _pct(v):
    return "–" if v is None else f"{100 * v:.3g}%"


def _steps_text(steps):
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


def _f(v, spec=".3f"):
    return "–" if v is None else format(v, spec)

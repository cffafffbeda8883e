"""The Hugging Face parts of tilefuse.patch: attention through transformers' attention-function registry,
and the Q/K/V projections with RoPE (and QK-norm) through qkv_projection.

Both are switched per model and proven layer by layer (:class:`ProbeReference`): the unpatched model runs a
probe batch (random tokens, the first row left-padded, so the padding mask is exercised), each of its layers'
inputs is kept with a float64 copy's output of that layer, and a step is kept only if every patched layer on
those inputs agrees with its float64 reference within the dtype's bound; otherwise it is undone and the
report says why.

- Attention: ``tilefuse`` is registered with ``AttentionInterface`` (HF's clean hook) and with the mask
  interface as SDPA's mask builder (:func:`causal_or_sdpa_mask`), so HF hands us SDPA's boolean masks (padding,
  sliding windows, packed sequences) or ``None`` with causal, under torch.compile too; packed sequences that come with HF's flash-attention offsets
  (``cu_seq_lens_q``, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives) run as one
  attention_varlen call. A call with dropout in training mode, ``output_attentions`` or a
  position bias runs HF's own SDPA code for that call: dropout is never silently dropped.
- QKV (GPT-2's transposed ``Conv1D`` ``c_attn`` too, read through its transposed view): an attention module
  with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` Linears, ``head_dim``,
  ``layer_idx`` and a ``forward(hidden_states, position_embeddings, ...)`` (Llama, Mistral, Qwen2, Qwen3 and
  their relatives) gets an instance ``forward`` that makes q, k, v in head layout with RoPE (and
  ``q_norm``/``k_norm``) applied in the GEMM epilogue, then continues as HF's does (KV cache, the attention
  interface, ``o_proj``). The parameters stay where they are; ``unpatch`` deletes the instance forward.
- Loss: a causal LM with an ``lm_head`` Linear, called in training mode with ``labels``, runs its base model
  and computes the loss with linear_cross_entropy from the final hidden states (the [tokens, vocab] logits
  are never made) and returns ``logits=None``, as Liger's integration does; a model whose forward does more
  between the base model and the head than Gemma 2's final softcap fails the loss check and is left alone. Labels are shifted, ``shift_labels``, ``ignore_index`` and ``num_items_in_batch`` honoured as HF's
  ``ForCausalLMLoss`` does, and Gemma 2's ``final_logit_softcapping`` becomes the loss's softcap. In eval
  mode or without labels the model runs as it always did.

Under torch.compile each step follows its pattern's rule (``tilefuse.compile_rules``: ``attention``, ``qkv``,
``loss``): handed to Inductor, it runs HF's own code while torch.compile traces (HF's SDPA function for
attention), so Inductor sees and fuses it as in the unpatched model.

transformers is imported only for models that are transformers models.
"""
from __future__ import annotations

import copy
import functools
import inspect
import types

import torch

from tilefuse import compile_rules
from tilefuse.opspec import REL_L2_BOUND

NAME = "tilefuse"
_STATE = "_tilefuse_hf_state"  # on the patched root: {"attn_implementation": ..., "qkv": [paths]}
_registered = False


def rel_l2(out, ref) -> float:
    """``|out - ref| / |ref|`` in float64: every patch check's measure."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def is_hf_model(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return hasattr(model, "set_attn_implementation") and hasattr(config, "_attn_implementation")


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, causal_or_sdpa_mask)
    _registered = True


def causal_or_sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                        attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """HF's SDPA mask builder, except that a plain causal mask over as many keys as queries with no padding mask is
    None (the attention then runs causal, no mask read) also while torch.compile traces. HF's own builder makes the
    [B, 1, N, N] mask whenever it traces, since with a padding mask only the data could say whether it can be
    skipped; with none, the shapes alone say so, and they are what the trace is specialized on."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    if mask_function is None:
        mask_function = causal_mask_function
    if (allow_is_causal_skip and attention_mask is None and mask_function is causal_mask_function and local_size is None
            and q_length == kv_length and q_offset == 0 and kv_offset == 0):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size,
                     allow_is_causal_skip, **kwargs)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """HF's attention-function signature (query/key/value ``[B, H, N, d]``, SDPA's boolean or additive mask)
    through tilefuse's SDPA; returns (``[B, N, H, d]`` contiguous, None) as HF's SDPA function does."""
    if dropout > 0.0 or kwargs.get("output_attentions") or kwargs.get("position_bias") is not None \
            or compile_rules.hands_back("attention"):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and query.shape[0] == 1:
        return _packed_attention(query, key, value, cu_q, cu_k, kwargs, bool(causal), scaling)
    from tilefuse.ops.attention import sdpa_heads_last
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:  # as HF's SDPA path: an empty static cache's tail is never attended
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    # The kernel writes [B, N, H, d] directly: the transpose HF's callers expect is then a view, not a copy.
    out = sdpa_heads_last(query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling,
                          enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _packed_attention(query, key, value, cu_q, cu_k, kwargs, causal, scaling):
    """Packed sequences as HF's flattening collator gives them (batch 1, ``cu_seq_lens_q/k`` and
    ``max_length_q/k``): one attention_varlen call over the [total, H, d] views, each sequence attending only
    to its own keys (the mask HF made from the restarting position ids says the same, at N^2 cost)."""
    from tilefuse.ops.attention import attention_varlen
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [total, H, d] views of [H, total, d]
    # The offsets come from HF's collator and are the same tensors in every layer: not validated here (a host
    # sync per layer; the kernels clamp offsets, so bad ones never address outside q, k, v or out), and the
    # longest sequence read once per offsets tensor when HF gives no Python int.
    out = attention_varlen(q, k, v, cu_q, cu_k, _longest(kwargs.get("max_length_q"), cu_q),
                           _longest(kwargs.get("max_length_k"), cu_k), causal=causal, scale=scaling, validate=False)
    return out[None], None


def _longest(given, cu) -> int:
    """The longest sequence: HF's Python int, else read once and kept on the offsets tensor itself (HF makes
    fresh offsets for every batch and never rewrites them in place)."""
    if isinstance(given, int):
        return given
    longest = getattr(cu, "_tilefuse_longest", None)
    if longest is None:
        longest = int(given) if given is not None else int((cu[1:] - cu[:-1]).max())
        cu._tilefuse_longest = longest
    return longest


# ---- Q/K/V projections with RoPE and QK-norm in the epilogue ------------------------------------------------

def _norm_weight_eps(norm):
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(eps, (int, float)):
        return weight, float(eps)
    return None


def qkv_candidate(module) -> str | None:
    """None when ``module`` is an attention module the fused forward can take over, else why not (or "" when it
    is not an attention module at all)."""
    parts = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(isinstance(p, torch.nn.Linear) for p in parts):
        return ""
    if any(hasattr(p, a) for p in parts for a in ("lora_A", "base_layer")):
        return "LoRA-wrapped projections are left alone"
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return "its forward's signature cannot be read"
    if "position_embeddings" not in params or not hasattr(module, "head_dim") or not hasattr(module, "layer_idx"):
        return "not a rotary attention module (no position_embeddings / head_dim / layer_idx)"
    for name in ("q_norm", "k_norm"):
        if getattr(module, name, None) is not None and _norm_weight_eps(getattr(module, name)) is None:
            return f"its {name} has no 1-D weight and eps"
    if (getattr(module, "q_norm", None) is None) != (getattr(module, "k_norm", None) is None):
        return "only one of q_norm / k_norm"
    return None


def _local_rows(t, name):
    """A projection's weight or bias as this rank's rows: itself, or a column-parallel DTensor's local shard."""
    from tilefuse.ops._dtensor import any_dtensor
    if not any_dtensor(t):
        return t
    from torch.distributed.tensor import Shard
    if t.device_mesh.ndim != 1 or t.placements[0] != Shard(0):
        raise ValueError(f"{name}: the fused QKV projection takes column-parallel (Shard(0)) projections, got "
                         f"{t.placements}")
    return t.to_local()


def _replicated(t, name):
    from tilefuse.ops._dtensor import any_dtensor
    if not any_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate
    if any(p != Replicate() for p in t.placements):
        raise ValueError(f"{name}: the QK-norm weight must be replicated, got {t.placements}")
    return t.to_local()


def fused_qkv_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                      **kwargs):
    """HF's rotary attention forward with q, k, v made by one qkv_projection call per layer (head layout,
    RoPE and QK-norm in the epilogue) in place of three projections, views, transposes and rotary kernels."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tilefuse.ops.qkv import qkv_projection
    if position_embeddings is None or hidden_states.dim() != 3 or compile_rules.hands_back("qkv"):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    d = self.head_dim
    # Under tensor parallelism (tilefuse.distributed.tensor_parallel_plan) the projections are column-parallel
    # DTensors: each rank makes its own whole heads from its local rows, and o_proj (row-parallel) sums.
    weights = tuple(_local_rows(p.weight, name) for p, name in ((self.q_proj, "q_proj.weight"),
                    (self.k_proj, "k_proj.weight"), (self.v_proj, "v_proj.weight")))
    heads, kv_heads = weights[0].shape[0] // d, weights[1].shape[0] // d
    biases = tuple(None if p.bias is None else _local_rows(p.bias, name) for p, name in (
        (self.q_proj, "q_proj.bias"), (self.k_proj, "k_proj.bias"), (self.v_proj, "v_proj.bias")))
    qk_norm = None
    if getattr(self, "q_norm", None) is not None:
        (qw, eps), (kw, _) = _norm_weight_eps(self.q_norm), _norm_weight_eps(self.k_norm)
        qk_norm = (_replicated(qw, "q_norm.weight"), _replicated(kw, "k_norm.weight"), eps)
    input_shape = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    if cos.dim() == 3 and cos.shape[0] == 1 != hidden_states.shape[0]:  # HF's [1, N, d] for shared positions
        cos, sin = cos[0], sin[0]
    q, k, v = qkv_projection(hidden_states, weights, biases if any(b is not None for b in biases) else None,
                             num_heads=heads, num_kv_heads=kv_heads, rotary=(cos, sin), qk_norm=qk_norm)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    if interface is None:  # "eager": HF's own eager function for this model class
        interface = inspect.getmodule(type(self)).eager_attention_forward
    if getattr(self, "sliding_window", None) is not None:
        kwargs.setdefault("sliding_window", self.sliding_window)
    out, weights = interface(self, q, k, v, attention_mask,
                             dropout=0.0 if not self.training else getattr(self, "attention_dropout", 0.0),
                             scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def conv1d_qkv_candidate(module) -> str | None:
    """None when ``module`` is GPT-2-style self-attention (one transposed ``Conv1D`` ``c_attn`` making q, k, v
    side by side, ``c_proj``, ``num_heads`` / ``head_dim``), else why not ("" when it is not one at all)."""
    c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if type(c_attn).__name__ != "Conv1D" or type(c_proj).__name__ != "Conv1D":
        return ""
    heads, d = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(d, int) or c_attn.weight.shape[1] != 3 * heads * d:
        return "c_attn is not q, k, v of num_heads * head_dim columns each"
    if getattr(module, "is_cross_attention", False):
        return "cross-attention is left alone"
    if not all(hasattr(module, a) for a in ("layer_idx", "scaling", "attn_dropout", "resid_dropout")):
        return "not a GPT-2 attention module (layer_idx / scaling / dropouts)"
    return None


def fused_conv1d_qkv_forward(self, hidden_states, past_key_values=None, attention_mask=None,
                             encoder_hidden_states=None, encoder_attention_mask=None, output_attentions=False,
                             **kwargs):
    """GPT-2's self-attention with q, k, v made in head layout by one qkv_projection call over ``c_attn``'s
    transposed weight (no split or head transposes), then as HF's forward: the KV cache, the attention
    interface (HF's eager reorder-and-upcast path stays HF's), ``c_proj`` and the residual dropout."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tilefuse.ops.qkv import qkv_projection
    eager_upcast = self.config._attn_implementation == "eager" and getattr(self, "reorder_and_upcast_attn", False)
    if encoder_hidden_states is not None or hidden_states.dim() != 3 or eager_upcast \
            or compile_rules.hands_back("qkv"):
        return type(self).forward(self, hidden_states, past_key_values, attention_mask, encoder_hidden_states,
                                  encoder_attention_mask, output_attentions, **kwargs)
    q, k, v = qkv_projection(hidden_states, self.c_attn.weight.t(), self.c_attn.bias, num_heads=self.num_heads)
    if past_key_values is not None:
        cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        k, v = cache.update(k, v, self.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    if interface is None:
        interface = inspect.getmodule(type(self)).eager_attention_forward
    out, weights = interface(self, q, k, v, attention_mask, dropout=self.attn_dropout.p if self.training else 0.0,
                             scaling=self.scaling, **kwargs)
    out = self.c_proj(out.reshape(*out.shape[:-2], -1).contiguous())
    return self.resid_dropout(out), weights


# ---- the LM-head loss without logits -------------------------------------------------------------------------

def loss_candidate(model) -> str | None:
    """None when the fused loss can take over ``model``'s training forward, else why not ("" when there is
    no LM head at all)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return "" if head is None else "its lm_head is not a Linear"
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        return "a LoRA-wrapped lm_head is left alone"
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return "its forward's signature cannot be read"
    if "labels" not in params or "logits_to_keep" not in params:
        return "not a causal LM forward (no labels / logits_to_keep)"
    if not isinstance(getattr(model, getattr(model, "base_model_prefix", ""), None), torch.nn.Module):
        return "no base model under its base_model_prefix"
    return None


def _fused_loss_call(model, args, kwargs, labels):
    """The base model (``model.<base_model_prefix>``) on the same inputs, then the loss from its final hidden
    states: the [tokens, vocab] logits are never made. No module is mutated, so torch.compile traces it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from tilefuse.ops.cross_entropy import linear_cross_entropy
    head = model.lm_head
    base = getattr(model, model.base_model_prefix)
    outputs = base(*args, **{k: v for k, v in kwargs.items()
                             if k not in ("shift_labels", "ignore_index", "logits_to_keep", "return_dict")})
    h = outputs[0]
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:  # tokens < n predict n, as ForCausalLMLoss shifts them
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items = kwargs.get("num_items_in_batch")
    loss = linear_cross_entropy(h, head.weight, shift_labels.to(h.device), head.bias, ignore_index=ignore_index,
                                reduction="sum" if num_items is not None else "mean",
                                softcap=getattr(model.config, "final_logit_softcapping", None), check_targets=False)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                                  hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))


@functools.lru_cache(maxsize=None)
def _forward_names(cls) -> tuple:
    return tuple(n for n in inspect.signature(cls.forward).parameters if n != "self")


def fused_loss_forward(self, *args, **kwargs):
    """Training with labels: the loss by linear_cross_entropy and no logits; otherwise the model's forward."""
    if args:  # by name from here on: the base model's positional order differs from the LM's (labels, use_cache)
        kwargs.update(zip(_forward_names(type(self)), args))
    labels = kwargs.pop("labels", None)
    if labels is None or not self.training or kwargs.get("logits_to_keep", 0) != 0 \
            or kwargs.get("return_dict") is False or compile_rules.hands_back("loss"):
        return type(self).forward(self, labels=labels, **kwargs)
    return _fused_loss_call(self, (), kwargs, labels)


# ---- whole-model verification and the steps ------------------------------------------------------------

def _probe_batch(model):
    """Random tokens, two rows, the first one left-padded (the padding mask is exercised), on the model's
    device: (input_ids, attention_mask)."""
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise ValueError("the model's config has no vocab_size to make probe tokens from")
    g = torch.Generator().manual_seed(0)
    n = 8
    ids = torch.randint(0, vocab, (2, n), generator=g)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[0, :3] = 0  # left padding on the first row
    device = next(model.parameters()).device
    return ids.to(device), mask.to(device)


def _run_probe(model, ids, mask):
    """The model's first output on the probe batch, in eval mode without grad (and without a KV cache, so
    that a layer can be called again on the inputs it got)."""
    kwargs = {"use_cache": False} if "use_cache" in _forward_names(type(model)) else {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **kwargs)
    finally:
        model.train(was_training)
    return out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))


def _tokens(t, mask):
    """Only the real tokens of a [B, N, ...] output: what a padded query row gets (it sees no key) differs
    between HF's own paths (CPU SDPA gives 0, CUDA kernels need not), and nothing downstream reads it."""
    if isinstance(t, (tuple, list)):
        t = t[0]
    if t.shape[:2] == mask.shape:
        t = t[mask.bool()]
    return t.double()


def _layer_stack(model):
    """The model's transformer layers: its longest ``nn.ModuleList`` whose entries share one class."""
    best = None
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            if best is None or len(m) > len(best):
                best = m
    return best


def _to_float64(value):
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_float64(v) for k, v in value.items()}
    return value


class ProbeReference:
    """What the unpatched model gives on the probe batch, to check a patch step against: for each of its
    layers, the inputs it received and, as the float64 reference (ENGINEERING's policy), the output of a
    float64 copy of that unpatched layer on them. A step's check then runs each (patched) layer on the same
    inputs, so every layer is held to the dtype's bound on its own: compared through the whole model, two
    correct bf16 implementations of a 12-layer model drift past 1e-2 apart. A model without a layer stack, or
    whose layers cannot be copied and run in float64, keeps the whole model's output (``whole``) and is compared
    against it."""

    def __init__(self, model):
        ids, self.mask = _probe_batch(model)
        self.layers, self.whole = [], None
        stack = _layer_stack(model)
        if stack is None:
            self.whole = _tokens(_run_probe(model, ids, self.mask), self.mask)
            return
        seen = {}

        def capture(layer, args, kwargs):
            seen.setdefault(id(layer), (layer, args, kwargs))
        hooks = [layer.register_forward_pre_hook(capture, with_kwargs=True) for layer in stack]
        try:
            whole = _run_probe(model, ids, self.mask)
        finally:
            for h in hooks:
                h.remove()
        try:
            with torch.no_grad():
                for layer in stack:
                    if id(layer) not in seen:
                        continue
                    _, args, kwargs = seen[id(layer)]
                    reference = copy.deepcopy(layer).double().eval()  # one layer's float64 copy at a time
                    want = _tokens(reference(*_to_float64(args), **_to_float64(kwargs)), self.mask)
                    del reference
                    self.layers.append((layer, args, kwargs, want))
        except Exception:  # noqa: BLE001 - a layer that cannot be copied or run in float64 (or memory for it)
            self.layers = []
        if not self.layers:  # compared through the whole model instead
            self.whole = _tokens(whole, self.mask)


def _agrees(model, reference: ProbeReference) -> tuple[bool, str]:
    dtype = next(model.parameters()).dtype
    bound = REL_L2_BOUND.get(dtype, 1e-2)
    try:
        if reference.whole is not None:
            ids, mask = _probe_batch(model)
            got = _tokens(_run_probe(model, ids, mask), mask)
            errors = [rel_l2(got, reference.whole)]
        else:
            errors = []
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    for layer, args, kwargs, want in reference.layers:
                        got = _tokens(layer(*args, **kwargs), reference.mask)
                        errors.append(rel_l2(got, want))
            finally:
                model.train(was_training)
    except Exception as exc:  # noqa: BLE001 - any failure means: undo the step, and say why
        return False, f"the patched model raised {type(exc).__name__}: {exc}"
    worst = max(errors) if errors else float("nan")
    where = "the whole model" if reference.whole is not None else \
        f"each of {len(errors)} layers against its unpatched float64 copy"
    if not worst <= bound:
        return False, f"rel-L2 {worst:.2e} ({where}, the worst) above the bound {bound:.0e}"
    return True, f"rel-L2 {worst:.1e} <= {bound:.0e} ({where}, the worst) on a left-padded probe batch"


def _loss_agrees(model) -> tuple[bool, str]:
    """The fused loss against the model's own on a probe batch with labels (eval mode: no dropout)."""
    g = torch.Generator().manual_seed(2)
    p = next(model.parameters())
    ids = torch.randint(0, int(model.config.vocab_size), (2, 8), generator=g).to(p.device)
    labels = ids.clone()
    labels[0, :3] = -100
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = type(model).forward(model, input_ids=ids, labels=labels).loss.double()
            got = _fused_loss_call(model, (), {"input_ids": ids}, labels).loss.double()
    except Exception as exc:  # noqa: BLE001
        return False, f"the fused loss raised {type(exc).__name__}: {exc}"
    finally:
        model.train(was_training)
    bound = REL_L2_BOUND.get(p.dtype, 1e-2)
    err = rel_l2(got, want)
    if not err <= bound:
        return False, f"loss rel error {err:.2e} against the model's own above the bound {bound:.0e}"
    return True, f"loss rel error {err:.1e} <= {bound:.0e} on a probe batch with ignored labels"


def patch(model, report, *, attention: bool, qkv: bool, loss: bool, verify: bool, reference=None) -> None:
    """The HF steps on ``model`` (in place), recorded in ``report``; ``reference`` is the unpatched model's
    probe output when the caller already has it."""
    state = {"attn_implementation": None, "qkv": [], "loss": False}
    object.__setattr__(model, _STATE, state)
    want = None
    if verify:
        want = reference if reference is not None else ProbeReference(model)
    if attention:
        _register()
        old = model.config._attn_implementation
        try:
            model.set_attn_implementation(NAME)
        except Exception as exc:  # noqa: BLE001
            report.skipped.append(("attention", f"transformers refused the attention function: {exc}"))
        else:
            ok, check = _agrees(model, want) if verify else (True, "not verified")
            if ok:
                state["attn_implementation"] = old
                report.replaced.append(("attention", f"attn_implementation={old!r}", "tilefuse attention", check))
            else:
                model.set_attn_implementation(old)
                report.skipped.append(("attention", check))
    if qkv:
        paths = []
        for path, module in model.named_modules():
            for candidate, forward in ((qkv_candidate, fused_qkv_forward),
                                       (conv1d_qkv_candidate, fused_conv1d_qkv_forward)):
                reason = candidate(module)
                if reason is None:
                    module.forward = types.MethodType(forward, module)
                    paths.append(path)
                    break
                if reason:
                    report.skipped.append((path, reason))
        if paths:
            ok, check = _agrees(model, want) if verify else (True, "not verified")
            if ok:
                state["qkv"] = paths
                for path in paths:
                    report.replaced.append((path, "q_proj/k_proj/v_proj + RoPE", "qkv_projection", check))
            else:
                for path in paths:
                    del model.get_submodule(path).forward
                report.skipped.append((f"{len(paths)} attention modules", "qkv_projection: " + check))
    if loss:
        reason = loss_candidate(model)
        if reason is None:
            ok, check = _loss_agrees(model) if verify else (True, "not verified")
            if ok:
                model.forward = types.MethodType(fused_loss_forward, model)
                state["loss"] = True
                report.replaced.append(("lm_head", "lm_head + cross-entropy (training, with labels)",
                                        "linear_cross_entropy", check))
            else:
                report.skipped.append(("lm_head", check))
        elif reason:
            report.skipped.append(("lm_head", reason))


def unpatch(model, report) -> None:
    state = getattr(model, _STATE, None)
    if not state:
        return
    if state["attn_implementation"] is not None:
        model.set_attn_implementation(state["attn_implementation"])
        report.replaced.append(("attention", "tilefuse attention",
                                f"attn_implementation={state['attn_implementation']!r}", "restored"))
    for path in state["qkv"]:
        del model.get_submodule(path).forward
        report.replaced.append((path, "qkv_projection", "q_proj/k_proj/v_proj + RoPE", "restored"))
    if state["loss"]:
        del model.forward
        report.replaced.append(("lm_head", "linear_cross_entropy", "lm_head + cross-entropy", "restored"))
    object.__delattr__(model, _STATE)

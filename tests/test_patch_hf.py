"""tilefuse.patch on Hugging Face models (tiny configs built from their config classes, no downloads): what each
family gets, outputs against the unpatched model on a left-padded batch, unpatch, state dicts, training,
dropout, gradient checkpointing."""
import contextlib
import copy
import io

import pytest
import torch
import transformers

import tilefuse
from helpers import ON_GPU, train_losses
from tilefuse import patching_hf
from tilefuse.opspec import REL_L2_BOUND

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)


def _build(family: str, **overrides):
    t = transformers
    if family == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**SMALL, **overrides))
    if family == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**SMALL, sliding_window=4, **overrides))
    if family == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**SMALL, **overrides))
    if family == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**SMALL, head_dim=16, **overrides))
    if family == "gpt2":
        config = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
        config.update(overrides)
        return t.GPT2LMHeadModel(t.GPT2Config(**config))
    assert family == "bert"
    return t.BertModel(t.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, max_position_embeddings=64, **overrides))


def _model(family, device, **overrides):
    torch.manual_seed(0)
    return _build(family, **overrides).to(device=device, dtype=DTYPE).eval()


def _batch(device, n=10):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, n), generator=g)
    mask = torch.ones(3, n, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids.to(device), mask.to(device)


def _out(model, ids, mask, **kwargs):
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    return out[0]


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# What each family's report must show replaced (a path suffix, the new class), beyond its norms.
EXPECTED = {
    "llama": [("layers.0.mlp", "GatedMLP"), ("attention", "tilefuse attention"),
              ("layers.1.self_attn", "qkv_projection")],
    "mistral": [("layers.0.mlp", "GatedMLP"), ("attention", "tilefuse attention"),
                ("layers.0.self_attn", "qkv_projection")],
    "qwen2": [("layers.1.mlp", "GatedMLP"), ("attention", "tilefuse attention"),
              ("layers.0.self_attn", "qkv_projection")],
    "qwen3": [("layers.0.mlp", "GatedMLP"), ("attention", "tilefuse attention"),
              ("layers.0.self_attn", "qkv_projection"), ("layers.0.self_attn.q_norm", "RMSNormModule")],
    "gpt2": [("h.0.mlp.c_fc", "Conv1DLinear"), ("h.0.mlp.act", "Identity"), ("attention", "tilefuse attention"),
             ("h.1.ln_1", "LayerNorm"), ("h.1.attn", "qkv_projection")],
    "bert": [("layer.0.intermediate.dense", "Linear"), ("attention", "tilefuse attention"),
             ("layer.1.output.LayerNorm", "LayerNorm")],
}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_each_family_is_patched_and_matches_unpatched_on_a_padded_batch(family, device, monkeypatch):
    model = _model(family, device)
    original = copy.deepcopy(model)
    report = tilefuse.patch(model)
    replaced = {(path, new) for path, _, new, _ in report.replaced}
    for suffix, new in EXPECTED[family]:
        assert any(p.endswith(suffix) and n == new for p, n in replaced), (suffix, new, str(report))
    # The tilefuse attention and (for the rotary families) qkv_projection are what runs now.
    calls = {"attention": 0, "qkv": 0}
    from tilefuse.ops import attention as attention_ops, qkv as qkv_ops
    sdpa, qkv = attention_ops.sdpa_heads_last, qkv_ops.qkv_projection

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(attention_ops, "sdpa_heads_last", counted("attention", sdpa))
    monkeypatch.setattr(qkv_ops, "qkv_projection", counted("qkv", qkv))
    ids, mask = _batch(device)
    with torch.no_grad():
        got = _out(model, ids, mask)
        want = _out(original.double(), ids, mask)
    assert calls["attention"] == 2
    assert calls["qkv"] == (2 if family != "bert" else 0)
    valid = mask.bool()  # padded positions' outputs are not defined the same way by every path
    assert _rel(got[valid], want[valid]) <= REL_L2_BOUND[DTYPE]


def test_attention_is_checked_layer_by_layer_against_float64_and_a_wrong_one_is_undone(device, monkeypatch):
    """The attention and QKV steps are checked per layer: each layer's probe inputs (from the unpatched run)
    with a float64 copy of the unpatched layer as the reference. An attention that is 50% too large in every
    call fails that check, is undone (the model keeps HF's attention) and the report gives the measured
    error; the rest of the patch stands."""
    model = _model("llama", device)
    reference = patching_hf.ProbeReference(model)
    assert len(reference.layers) == model.config.num_hidden_layers
    assert all(want.dtype == torch.float64 for *_, want in reference.layers)
    from tilefuse.ops import attention as attention_ops
    good = attention_ops.sdpa_heads_last
    monkeypatch.setattr(attention_ops, "sdpa_heads_last", lambda *a, **k: good(*a, **k) * 1.5)
    report = tilefuse.patch(model)
    skipped = dict(report.skipped)
    assert "above the bound" in skipped["attention"] and "layers against its unpatched float64 copy" in \
        skipped["attention"], skipped
    assert model.config._attn_implementation == "sdpa"
    assert any(p.endswith("mlp") for p, *_ in report.replaced)


def test_unpatch_restores_the_model_exactly_and_state_dicts_are_unchanged(device):
    model = _model("qwen3", device)
    before = dict(model.state_dict())
    modules = dict(model.named_modules())
    ids, mask = _batch(device)
    with torch.no_grad():
        want = _out(model, ids, mask)
    report = tilefuse.patch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)  # the same tensors, not copies
    again = tilefuse.patch(model)
    assert not again.replaced and "already patched" in again.skipped[0][1]
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = _model("qwen3", device)
    fresh.load_state_dict(torch.load(buf))
    with torch.no_grad():
        assert torch.equal(_out(fresh, ids, mask), want)
    undone = tilefuse.unpatch(model)
    assert len(undone.replaced) == len(report.replaced) - sum(1 for *_, c in report.replaced if c.startswith("fused"))
    assert model.config._attn_implementation == "sdpa"
    assert all(model.get_submodule(p) is m for p, m in modules.items() if p)
    assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(_out(model, ids, mask), want)
    assert not tilefuse.unpatch(model).replaced


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_model_patched_in_eval_mode_trains_like_the_unpatched_one(device, checkpointing):
    """Three AdamW steps after model.train(): the losses follow the unpatched model's within the dtype's bound."""
    torch.manual_seed(0)
    ref = _model("llama", device)
    model = copy.deepcopy(ref)
    tilefuse.patch(model)
    ids, mask = _batch(device)
    losses = {}
    for name, m in (("ref", ref), ("patched", model)):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses[name] = train_losses(lambda: m(input_ids=ids, attention_mask=mask, labels=ids).loss, opt, 3)
    for a, b in zip(losses["patched"], losses["ref"]):
        assert abs(a - b) <= REL_L2_BOUND[DTYPE] * abs(b), losses


@pytest.mark.gpu_only
def test_a_patched_model_trains_100_steps_like_the_unpatched_one():
    """100 AdamW steps (bf16, one batch) of the tiny Llama, patched in eval mode: at every 20th step the patched
    loss is within the dtype's bound (1% in bf16) of the unpatched model's. A failure message also gives the
    largest distance between two unpatched runs that differ only in SDPA's backend (the math one against the
    default), the setting's own noise, to tell a tilefuse error from bf16 training's drift."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    ref = _model("llama", "cuda")
    other, model = copy.deepcopy(ref), copy.deepcopy(ref)
    tilefuse.patch(model)
    ids, mask = _batch("cuda", n=32)
    losses = {}
    for name, m in (("ref", ref), ("other", other), ("patched", model)):
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        with sdpa_kernel(SDPBackend.MATH) if name == "other" else contextlib.nullcontext():
            losses[name] = train_losses(lambda: m(input_ids=ids, attention_mask=mask, labels=ids).loss, opt, 100)
    steps = range(19, 100, 20)
    ref_l = losses["ref"]
    noise = max(abs(losses["other"][i] - ref_l[i]) / abs(ref_l[i]) for i in steps)
    for i in steps:
        assert abs(losses["patched"][i] - ref_l[i]) <= REL_L2_BOUND[DTYPE] * abs(ref_l[i]), (i, noise, losses)
    assert losses["patched"][-1] < 0.9 * losses["patched"][0]  # it did train


def test_dropout_in_training_runs_as_hf_runs_it(device):
    """GPT-2 with its default dropouts (0.1), patched in training mode: the probes run with dropout off, so
    every pattern is replaced (the MLP's c_fc + GELU too) and nothing is skipped, and the model stays in
    training mode. In training the attention call runs HF's own SDPA, so the same seed gives the unpatched
    model's output; in eval mode tilefuse's attention runs."""
    ref = _model("gpt2", device, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    model = copy.deepcopy(ref).train()
    report = tilefuse.patch(model)
    assert not report.skipped, str(report)
    replaced = {(path, new) for path, _, new, _ in report.replaced}
    for layer in (0, 1):
        assert (f"transformer.h.{layer}.mlp.c_fc", "Conv1DLinear") in replaced, str(report)
    assert all(m.training for m in model.modules())
    ids, mask = _batch(device)
    outs = []
    for m in (ref, model):
        m.train()
        torch.manual_seed(5)
        with torch.no_grad():
            outs.append(_out(m, ids, mask))
    assert _rel(outs[1], outs[0]) <= REL_L2_BOUND[DTYPE]
    with torch.no_grad():
        torch.manual_seed(6)
        assert not torch.equal(_out(model, ids, mask), outs[1])  # dropout did run: another seed's draw differs


def test_attention_forward_falls_back_to_hf_for_dropout_and_attention_weights():
    q = torch.randn(1, 2, 5, 16)
    module = torch.nn.Module()
    module.is_causal = True
    torch.manual_seed(0)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    want = sdpa_attention_forward(module, q, q, q, None, dropout=0.5)[0]
    torch.manual_seed(0)
    got = patching_hf.attention_forward(module, q, q, q, None, dropout=0.5)[0]
    assert torch.equal(got, want)
    causal = patching_hf.attention_forward(module, q, q, q, None)[0]
    assert _rel(causal, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)) < 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_with_labels_takes_the_fused_loss_and_returns_no_logits(family, device, monkeypatch):
    """Training mode with labels: the loss comes from linear_cross_entropy on the final hidden states (HF's
    shift, ignore_index and num_items_in_batch), logits are None, and the gradients match the unpatched
    model's in float64 (on the GPU the unpatched bf16 model is no reference: with left padding HF's CUDA SDPA
    gives the padded rows gradients that differ from float64 by rel-L2 0.2-0.3, benchmarks/patch_step_grads.py);
    eval mode, or no labels, returns logits as before."""
    no_dropout = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0) if family == "gpt2" else {}
    model = _model(family, device, **no_dropout)
    ref = copy.deepcopy(model).double()
    report = tilefuse.patch(model)
    assert any(p == "lm_head" and n == "linear_cross_entropy" for p, _, n, _ in report.replaced), str(report)
    from tilefuse.ops import cross_entropy as ce_ops
    calls = []
    fused = ce_ops.linear_cross_entropy
    monkeypatch.setattr(ce_ops, "linear_cross_entropy", lambda *a, **k: calls.append(1) or fused(*a, **k))
    ids, mask = _batch(device)
    labels = ids.clone()
    labels[1, 5:] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(17)}):
        outs = []
        for m in (ref, model):
            m.train()
            m.zero_grad()
            out = m(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
            out.loss.backward()
            outs.append((out, m.lm_head.weight.grad.clone(), next(iter(m.parameters())).grad.clone()))
        (want, want_dw, want_demb), (got, got_dw, got_demb) = outs
        assert got.logits is None and want.logits is not None
        assert abs(got.loss.item() - want.loss.item()) <= REL_L2_BOUND[DTYPE] * abs(want.loss.item())
        assert _rel(got_dw, want_dw) <= REL_L2_BOUND[DTYPE]
        assert _rel(got_demb, want_demb) <= REL_L2_BOUND[DTYPE]
    assert len(calls) == 2
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is not None and out.loss is not None and len(calls) == 2


def test_packed_sequences_with_flash_offsets_run_as_one_varlen_call(device, monkeypatch):
    """Two sequences flattened into one row (position ids restart, HF's cu_seq_lens kwargs) give each
    sequence's own output, through one attention_varlen call per layer."""
    ref = _model("llama", device)
    model = copy.deepcopy(ref)
    tilefuse.patch(model)
    from tilefuse.ops import attention as attention_ops
    calls = []
    varlen = attention_ops.attention_varlen
    monkeypatch.setattr(attention_ops, "attention_varlen", lambda *a, **k: calls.append(1) or varlen(*a, **k))
    g = torch.Generator().manual_seed(3)
    lens = [5, 7]
    seqs = [torch.randint(0, 64, (1, n), generator=g).to(device) for n in lens]
    ids = torch.cat(seqs, 1)
    position_ids = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=7, max_length_k=7).logits
        # HF's own helper gives the longest length as a tensor: read once, for both layers
        cu2 = cu.clone()
        got2 = model(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu2, cu_seq_lens_k=cu2,
                     max_length_q=cu2.diff().max(), max_length_k=cu2.diff().max()).logits
        want = torch.cat([ref.double()(input_ids=s).logits for s in seqs], 1)
    assert len(calls) == 4 and cu2._tilefuse_longest == 7
    assert _rel(got, want) <= REL_L2_BOUND[DTYPE]
    assert torch.equal(got2, got)


def test_layers_that_cannot_be_copied_fall_back_to_the_whole_model_check(device, monkeypatch):
    """When a layer's float64 copy cannot be made (a module deepcopy refuses, or no memory for it), the probe keeps
    the whole model's output and the steps are checked through the whole model, as the report says."""
    model = _model("llama", device)

    def refuse(*args, **kwargs):
        raise RuntimeError("not copyable")
    monkeypatch.setattr(patching_hf.copy, "deepcopy", refuse)
    reference = patching_hf.ProbeReference(model)
    assert not reference.layers and reference.whole is not None
    report = tilefuse.patch(model)
    checks = {path: check for path, _, _, check in report.replaced}
    assert "the whole model" in checks["attention"], checks["attention"]

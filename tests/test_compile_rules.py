"""A patched model under torch.compile: each pattern follows its compile rule (tilefuse.compile_rules). Handed to
Inductor, the graph torch.compile traces holds the unpatched model's torch ops for that pattern and no tilefuse
op; kept, it holds the tilefuse op. Outputs match eager either way; state dicts and copies are unaffected."""
import copy

import pytest
import torch
import transformers
from torch._dynamo.backends.registry import lookup_backend

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse import compile_rules
from tilefuse.opspec import REL_L2_BOUND

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
DEV = "cuda" if ON_GPU else "cpu"
H = 64 if ON_GPU else 16
RUN = "inductor" if ON_GPU else "aot_eager"  # what runs the captured graph (inductor needs a C++ toolchain on CPU)


# ---- the rules themselves -----------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _no_rules_from_the_environment(monkeypatch):
    monkeypatch.delenv(compile_rules.ENV, raising=False)


def test_defaults_env_and_blocks(monkeypatch):
    assert compile_rules.rules() == {p: r for p, (r, _) in compile_rules.DEFAULT_RULES.items()}
    assert set(compile_rules.rules()) == set(compile_rules.PATTERNS)
    monkeypatch.setenv(compile_rules.ENV, "all=tilefuse, Norm=Inductor")
    assert compile_rules.rule("norm") == "inductor" and compile_rules.rule("linear") == "tilefuse"
    with tilefuse.use_compile_rules(all="inductor"):
        with tilefuse.use_compile_rules(loss="tilefuse"):
            assert compile_rules.rule("loss") == "tilefuse" and compile_rules.rule("mlp") == "inductor"
        assert compile_rules.rule("loss") == "inductor"
    assert compile_rules.rule("loss") == "tilefuse"
    assert not compile_rules.hands_back("norm")  # eager: never


@pytest.mark.parametrize("value, words", [("linear", "pattern=rule"), ("lineer=tilefuse", "unknown pattern"),
                                          ("norm=triton", "'inductor' or 'tilefuse'")])
def test_a_bad_environment_value_is_refused_naming_the_variable(monkeypatch, value, words):
    monkeypatch.setenv(compile_rules.ENV, value)
    with pytest.raises(ValueError, match=words) as err:
        tilefuse.patch(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    assert compile_rules.ENV in str(err.value)
    with pytest.raises(ValueError, match="use_compile_rules"):
        with tilefuse.use_compile_rules(attention="cudnn"):
            pass


# ---- a hand-built model: norm, linear + activation, gated MLP ---------------------------------------------------

class GatedMLP(torch.nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(h, i, bias=False), torch.nn.Linear(h, i, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(i, h, bias=False), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.mlp1 = torch.nn.RMSNorm(H), GatedMLP(H, 2 * H)
        self.norm2 = torch.nn.LayerNorm(H)
        self.mlp2 = torch.nn.Sequential(torch.nn.Linear(H, 3 * H), torch.nn.GELU(), torch.nn.Linear(3 * H, H))

    def forward(self, x):
        x = x + self.mlp1(self.norm1(x))
        return x + self.mlp2(self.norm2(x))


def _patched_block():
    torch.manual_seed(0)
    model = Block().to(DEV, DTYPE)
    report = tilefuse.patch(model)
    assert {path for path, *_ in report.replaced} >= {"norm1", "mlp1", "norm2", "mlp2.0", "mlp2.1"}, str(report)
    return model, report


def _tilefuse_ops(gm) -> set:
    return {str(node.target).split(".")[1] for node in gm.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("tilefuse.")}


def _compiled(fn):
    """fn compiled (fullgraph), and the set of tilefuse ops in each graph torch.compile traced."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, inputs):
        graphs.append(_tilefuse_ops(gm))
        return lookup_backend(RUN)(gm, inputs)
    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def _traced_under(given, want, fn, *args):
    """fn compiled under the rules ``given``: its first graph holds exactly the tilefuse ops ``want``, and its
    output (no grad) is fn's in eager."""
    with torch.no_grad():
        eager = fn(*args)
        with tilefuse.use_compile_rules(**given):
            compiled, graphs = _compiled(fn)
            got = compiled(*args)
    assert graphs and graphs[0] == want, f"rules {given}: the graph holds {graphs}, want {want}"
    assert_close(got, eager, REL_L2_BOUND[DTYPE], f"compiled under {given} vs eager")


@pytest.mark.parametrize("given, want", [
    ({}, set()),  # the defaults: norms, Linear + GELU and the gated MLP to Inductor
    ({"mlp": "tilefuse"}, {"gated_linear"}),
    ({"all": "tilefuse"}, {"gated_linear", "rms_norm", "layer_norm", "linear"}),
    ({"all": "inductor"}, set()),
    ({"norm": "tilefuse", "mlp": "inductor"}, {"rms_norm", "layer_norm"}),
])
def test_each_pattern_in_the_traced_graph_follows_its_rule(given, want):
    model, _ = _patched_block()
    _traced_under(given, want, model, torch.randn(2, 5, H, device=DEV, dtype=DTYPE))


def _float64_copy(model, unpatched):
    """``unpatched`` (a fresh module of the model's class before patching) in float64 with ``model``'s weights
    (patch keeps the state dict's keys)."""
    unpatched.load_state_dict(model.state_dict())
    return unpatched.to(DEV, torch.float64)


def _loss_and_grads(m, fn):
    m.zero_grad(set_to_none=True)
    loss = fn(m)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_a_changed_rule_recompiles_and_gradients_flow_either_way():
    model, _ = _patched_block()
    fn, graphs = _compiled(model)
    x = torch.randn(3, H, device=DEV, dtype=DTYPE)
    _, want = _loss_and_grads(_float64_copy(model, Block()), lambda m: m(x.double()).pow(2).sum())
    for given in ({}, {"all": "tilefuse"}):
        with tilefuse.use_compile_rules(**given):
            _, got = _loss_and_grads(model, lambda m: fn(x).float().pow(2).sum())
        for name in want:
            assert_close(got[name], want[name], REL_L2_BOUND[DTYPE], f"rules {given}: d {name} vs float64")
    assert len(graphs) == 2 and graphs[0] != graphs[1], f"the second rule set traced no new graph: {graphs}"


def test_state_dicts_reports_and_copies_are_unaffected():
    torch.manual_seed(0)
    keys = list(Block().state_dict())
    model, report = _patched_block()
    assert list(model.state_dict()) == keys
    assert "under torch.compile: norm=" in str(report) and report.compile_rules == compile_rules.rules()
    twin = copy.deepcopy(model)
    fused = twin.mlp2[0]
    assert fused._tilefuse_unfused.linear.weight is fused.weight  # the copy's own parameters, not the original's
    assert fused.forward.__self__ is fused
    x = torch.randn(2, H, device=DEV, dtype=DTYPE)
    with torch.no_grad():
        assert_close(twin(x), model(x), REL_L2_BOUND[DTYPE], "deep copy vs the model")


# ---- Hugging Face: attention, qkv and the loss --------------------------------------------------------------

def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(DEV, DTYPE).train()
    model.loss_type = "ForCausalLM"  # named: HF logs a warning for GPT-2's unnamed one, which breaks a fullgraph trace
    return model


@pytest.mark.parametrize("given, want", [
    ({}, {"linear_cross_entropy"}),
    ({"attention": "tilefuse"}, {"attention", "linear_cross_entropy"}),
    ({"all": "tilefuse"}, {"attention", "linear_cross_entropy", "qkv_projection", "layer_norm", "linear"}),
    ({"attention": "inductor", "loss": "inductor"}, set()),
])
def test_a_patched_hugging_face_model_compiled(given, want):
    model = _gpt2()
    report = tilefuse.patch(model)
    assert {"attention", "lm_head", "transformer.h.0.attn"} <= {path for path, *_ in report.replaced}, str(report)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEV)

    _traced_under(given, want, lambda ids: model(input_ids=ids, labels=ids).loss, ids)



def test_an_unpadded_causal_batch_reaches_attention_without_a_mask_under_compile():
    """HF builds the [B, 1, N, N] causal mask whenever torch.compile traces (only data could tell whether a padding
    mask may be skipped); with no padding mask the shapes alone tell, so the patched model's mask builder gives
    None and attention runs causal, reading no mask -- in eager and compiled graphs alike."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).to(DEV, DTYPE).train()
    tilefuse.patch(model)
    calls = []

    def backend(gm, inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target) == "tilefuse.attention.default":
                names = [a.name for a in node.target._schema.arguments]
                calls.append(dict(zip(names, node.args)))
        return lookup_backend(RUN)(gm, inputs)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEV)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with tilefuse.use_compile_rules(attention="tilefuse"):
        torch._dynamo.reset()
        fn = torch.compile(lambda ids, mask: model(input_ids=ids, attention_mask=mask, labels=ids).loss,
                           backend=backend)
        with torch.no_grad():
            got, want = fn(ids, None), model(input_ids=ids, labels=ids).loss
            fn(ids, padded)
    assert len(calls) == 2, calls
    assert calls[0]["mask"] is None and calls[0]["window_right"] == 0, f"unpadded: {calls[0]}"
    assert calls[1]["mask"] is not None, "a padded batch must still reach attention with its mask"
    assert_close(got, want, REL_L2_BOUND[DTYPE], "compiled loss vs eager")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("given", [{}, {"all": "tilefuse"}], ids=["default rules", "all tilefuse"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_reduce_overhead_over_a_patched_model_trains_and_prefills(family, given):
    """torch.compile(mode="reduce-overhead") -- CUDA graphs replayed -- over a patched model: three training steps
    on fresh batches give a float64 copy's losses and gradients within the dtype's bound, and a prefill its logits."""
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(config).to(DEV, DTYPE).train()
    else:
        model = _gpt2()
    ref = copy.deepcopy(model).to(torch.float64)  # unpatched, the same weights
    tilefuse.patch(model)
    vocab = model.config.vocab_size
    with tilefuse.use_compile_rules(**given):
        torch._dynamo.reset()
        compiled = torch.compile(model, mode="reduce-overhead")
        for i in range(3):
            ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(10 + i)).to(DEV)
            got_loss, got = _loss_and_grads(model, lambda m: compiled(input_ids=ids, labels=ids).loss)
            want_loss, want = _loss_and_grads(ref, lambda m: m(input_ids=ids, labels=ids).loss)
            assert_close(got_loss, want_loss, REL_L2_BOUND[DTYPE], f"step {i} loss vs float64")
            for name in want:
                assert_close(got[name], want[name], REL_L2_BOUND[DTYPE], f"step {i} d {name} vs float64")
        model.eval(), ref.eval()
        with torch.no_grad():
            ids = torch.randint(0, vocab, (1, 96), generator=torch.Generator().manual_seed(20)).to(DEV)
            for _ in range(2):  # the second call replays the graph
                got = compiled(input_ids=ids).logits.clone()
            assert_close(got, ref(input_ids=ids).logits, REL_L2_BOUND[DTYPE], "prefill logits vs float64")

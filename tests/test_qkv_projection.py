"""tilefuse.qkv_projection against the eager head-layout path (projections, split, transpose, QK-norm, RoPE)
in float64: weight forms, GQA, partial and interleaved rotary, layouts, bad input."""
import pytest
import torch

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse import reference
from tilefuse.opspec import REL_L2_BOUND

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BOUND = REL_L2_BOUND[DTYPE]
B, N, K = (2, 257, 1000) if ON_GPU else (2, 9, 40)


def _rand(*shape, seed, scale=1.0, device):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, DTYPE)


def _rotary(r, device, batched=False):
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    pos = torch.arange(N, dtype=torch.float64)[:, None] + (torch.arange(B)[:, None, None] * 3 if batched else 0)
    freqs = pos * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


@pytest.mark.parametrize("H,Hkv,d,r,interleaved,norm,form,layout,batched", [
    (4, 4, 16, 0, False, False, "triple", "bhnd", False),
    (4, 2, 16, 16, False, False, "cat", "bhnd", False),
    (6, 2, 24, 16, True, True, "triple", "bnhd", True),
    (2, 1, 80, 64, False, True, "cat", "bhnd", False),
])
def test_matches_the_eager_head_layout_path(device, H, Hkv, d, r, interleaved, norm, form, layout, batched):
    x = _rand(B, N, K, seed=0, device=device)
    ws = [_rand(h * d, K, seed=1 + i, scale=K ** -0.5, device=device) for i, h in enumerate((H, Hkv, Hkv))]
    bs = [_rand(h * d, seed=5 + i, device=device) for i, h in enumerate((H, Hkv, Hkv))]
    rotary = _rotary(r, device, batched) if r else None
    if interleaved and rotary is not None:  # GPT-J repeats each frequency for its pair
        rotary = tuple(t[..., : r // 2].repeat_interleave(2, -1) for t in rotary)
    qk = (_rand(d, seed=8, device=device) * 0.5 + 1, _rand(d, seed=9, device=device) * 0.5 + 1, 1e-6) if norm else None
    weight = tuple(ws) if form == "triple" else torch.cat(ws)
    bias = tuple(bs) if form == "triple" else torch.cat(bs)
    q, k, v = tilefuse.qkv_projection(x, weight, bias, num_heads=H, num_kv_heads=Hkv, rotary=rotary,
                                      rotary_interleaved=interleaved, qk_norm=qk, layout=layout)
    dbl = lambda t: None if t is None else t.double()  # noqa: E731
    want = reference.qkv_projection(x.double(), [w.double() for w in ws], [b.double() for b in bs], H, Hkv,
                                    None if rotary is None else tuple(map(dbl, rotary)), interleaved,
                                    None if qk is None else (qk[0].double(), qk[1].double(), qk[2]))
    for got, exp, name in zip((q, k, v), want, "qkv"):
        if layout == "bnhd":
            exp = exp.transpose(1, 2)
        assert got.shape == exp.shape and got.is_contiguous(), (name, got.shape, exp.shape)
        assert_close(got, exp, BOUND, name)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_heads=3), ValueError, "W_q must be"),
    (dict(num_heads=4, num_kv_heads=3), ValueError, "num_kv_heads must divide"),
    (dict(num_heads=4, layout="nbhd"), ValueError, "layout"),
    (dict(num_heads=4, rotary="cos"), ValueError, "rotary"),
])
def test_bad_input(device, kwargs, exc, match):
    x = _rand(B, N, K, seed=0, device=device)
    ws = tuple(_rand(4 * 16, K, seed=i, device=device) for i in range(3))
    with pytest.raises(exc, match=match):
        tilefuse.qkv_projection(x, ws, **kwargs)


@pytest.mark.parametrize("interleaved,norm,layout", [(False, True, "bhnd"), (True, False, "bnhd"),
                                                     (False, False, "bhnd")])
def test_gradients_through_rope_and_qk_norm(device, interleaved, norm, layout):
    H, Hkv, d, r = 4, 2, 24, 16
    x = _rand(B, N, K, seed=0, device=device)
    ws = [_rand(h * d, K, seed=1 + i, scale=K ** -0.5, device=device) for i, h in enumerate((H, Hkv, Hkv))]
    bs = [_rand(h * d, seed=5 + i, device=device) for i, h in enumerate((H, Hkv, Hkv))]
    rotary = _rotary(r, device)
    if interleaved:
        rotary = tuple(t[..., : r // 2].repeat_interleave(2, -1) for t in rotary)
    nw = [_rand(d, seed=8 + i, device=device) * 0.5 + 1 for i in range(2)]
    outs_g = [_rand(B, h, N, d, seed=20 + i, device=device) for i, h in enumerate((H, Hkv, Hkv))]
    if layout == "bnhd":
        outs_g = [g.transpose(1, 2).contiguous() for g in outs_g]
    leaves = [t.clone().requires_grad_() for t in (x, *ws, *bs, *(nw if norm else []))]
    lx, lws, lbs = leaves[0], leaves[1:4], leaves[4:7]
    lnw = leaves[7:9] if norm else None
    outs = tilefuse.qkv_projection(lx, tuple(lws), tuple(lbs), num_heads=H, num_kv_heads=Hkv, rotary=rotary,
                                   rotary_interleaved=interleaved, layout=layout,
                                   qk_norm=(lnw[0], lnw[1], 1e-6) if norm else None)
    torch.autograd.backward(list(outs), outs_g)
    ref = [t.detach().double().requires_grad_() for t in (x, *ws, *bs, *(nw if norm else []))]
    want = reference.qkv_projection(ref[0], ref[1:4], ref[4:7], H, Hkv, tuple(t.double() for t in rotary), interleaved,
                                    (ref[7], ref[8], 1e-6) if norm else None)
    if layout == "bnhd":
        want = [t.transpose(1, 2) for t in want]
    torch.autograd.backward(list(want), [g.double() for g in outs_g])
    for i, (got, exp) in enumerate(zip(leaves, ref)):
        assert_close(got.grad, exp.grad, BOUND, f"grad {i}")

def test_gradients_with_unused_outputs_frozen_weights_and_a_missing_bias(device):
    """The backward stacks the three projections' gradients: an unused output (v) counts as a zero gradient,
    a frozen weight and a missing bias get nothing, and the others still match float64."""
    H, Hkv, d = 4, 2, 16
    x = _rand(B, N, K, seed=0, device=device)
    ws = [_rand(h * d, K, seed=1 + i, scale=K ** -0.5, device=device) for i, h in enumerate((H, Hkv, Hkv))]
    bq, bk = _rand(H * d, seed=5, device=device), _rand(Hkv * d, seed=6, device=device)
    lx = x.clone().requires_grad_()
    lwq, lwv = ws[0].clone().requires_grad_(), ws[2].clone().requires_grad_()
    lbq = bq.clone().requires_grad_()
    q, k, v = tilefuse.qkv_projection(lx, (lwq, ws[1], lwv), (lbq, bk, None), num_heads=H, num_kv_heads=Hkv)
    gq, gk = _rand(*q.shape, seed=20, device=device), _rand(*k.shape, seed=21, device=device)
    torch.autograd.backward([q, k], [gq, gk])  # v unused: its gradient never arrives
    rx, rwq, rwv, rbq = (t.detach().double().requires_grad_() for t in (x, ws[0], ws[2], bq))
    want = reference.qkv_projection(rx, [rwq, ws[1].double(), rwv], [rbq, bk.double(), None], H, Hkv, None, False,
                                    None)
    torch.autograd.backward(list(want[:2]), [gq.double(), gk.double()])
    for name, got, exp in (("x", lx, rx), ("W_q", lwq, rwq), ("b_q", lbq, rbq)):
        assert_close(got.grad, exp.grad, BOUND, f"grad {name}")
    assert lwv.grad is not None and not lwv.grad.any(), "W_v's gradient with v unused is zero"


def test_module_state_dict_and_shared_parameters(device):
    H, Hkv, d = 4, 2, 16
    module = tilefuse.nn.QKVProjection(K, H, Hkv, d, bias=True, qk_norm=True, device=device, dtype=DTYPE)
    assert set(module.state_dict()) == {f"{p}.{t}" for p in ("q_proj", "k_proj", "v_proj") for t in ("weight", "bias")} \
        | {"q_norm.weight", "k_norm.weight"}
    shared = tilefuse.nn.QKVProjection.from_linears(module.q_proj, module.k_proj, module.v_proj, H, Hkv,
                                                    module.q_norm, module.k_norm)
    assert shared.q_proj is module.q_proj and shared.k_norm is module.k_norm
    x = _rand(B, N, K, seed=0, device=device)
    rotary = _rotary(d, device)
    with torch.no_grad():
        q, k, v = shared(x, rotary)
        want = reference.qkv_projection(x.double(), [m.weight.double() for m in (module.q_proj, module.k_proj,
                                                                                  module.v_proj)],
                                        [m.bias.double() for m in (module.q_proj, module.k_proj, module.v_proj)],
                                        H, Hkv, tuple(t.double() for t in rotary), False,
                                        (module.q_norm.weight.double(), module.k_norm.weight.double(), 1e-6))
    for got, exp, name in zip((q, k, v), want, "qkv"):
        assert_close(got, exp, BOUND, name)


@pytest.mark.parametrize("H,Hkv,d,r,norm,conv1d", [
    (3, 1, 64, 64, False, True),     # an odd head count: the last two-head tile's second head is past the end
    (4, 2, 128, 128, True, False),
    (2, 2, 256, 0, False, True),
    (4, 4, 64, 0, False, False),
])
def test_whole_head_tiles_and_the_conv1d_layout(device, H, Hkv, d, r, norm, conv1d):
    """The power-of-two head dims the Hopper TMA kernel takes (one or two whole heads per tile; K a multiple of
    8 on the GPU so x and W are TMA-able; N 257 so tiles cross sequence boundaries), with the weight as
    nn.Linear's one tensor or as GPT-2's Conv1D c_attn weight [K, rows] passed transposed, read in place; values
    and gradients against float64."""
    k_dim = 1024 if ON_GPU else 40
    x = _rand(B, N, k_dim, seed=0, device=device)
    rows = (H + 2 * Hkv) * d
    w = _rand(rows, k_dim, seed=1, scale=k_dim ** -0.5, device=device)
    stored = w.t().contiguous() if conv1d else w  # Conv1D keeps W^T: [K, rows]
    bias = _rand(rows, seed=2, device=device)
    rotary = _rotary(r, device) if r else None
    qk = (_rand(d, seed=8, device=device) * 0.5 + 1, _rand(d, seed=9, device=device) * 0.5 + 1, 1e-6) if norm else None
    leaf_w = stored.clone().requires_grad_()
    leaf_x = x.clone().requires_grad_()
    weight = leaf_w.t() if conv1d else leaf_w
    from tilefuse.kernels import launches
    with launches.recording() as records:
        outs = tilefuse.qkv_projection(leaf_x, weight, bias, num_heads=H, num_kv_heads=Hkv, rotary=rotary,
                                       qk_norm=qk)
    if ON_GPU:  # the H200 takes the TMA kernel for all three projections here
        (rec,) = [r for r in records if r.op == "qkv_projection"]
        assert rec.config.count("tma") == 3, rec.describe()
    ref_x, ref_w = x.double().requires_grad_(), stored.double().requires_grad_()
    ws = (ref_w.t() if conv1d else ref_w).split([H * d, Hkv * d, Hkv * d])
    want = reference.qkv_projection(ref_x, ws, bias.double().split([H * d, Hkv * d, Hkv * d]), H, Hkv,
                                    None if rotary is None else tuple(t.double() for t in rotary), False,
                                    None if qk is None else (qk[0].double(), qk[1].double(), qk[2]))
    for got, exp, name in zip(outs, want, "qkv"):
        assert got.shape == exp.shape and got.is_contiguous(), (name, got.shape, exp.shape)
        assert_close(got, exp, BOUND, name)
    grads = [_rand(*t.shape, seed=20 + i, device=device) for i, t in enumerate(outs)]
    torch.autograd.backward(list(outs), grads)
    torch.autograd.backward(list(want), [g.double() for g in grads])
    assert leaf_w.grad.shape == stored.shape
    assert_close(leaf_w.grad, ref_w.grad, BOUND, "grad W")
    assert_close(leaf_x.grad, ref_x.grad, BOUND, "grad x")


@pytest.mark.parametrize("H,Hkv,d,r,norm,conv1d,layout", [
    (2, 1, 96, 96, True, False, "bhnd"),    # Phi-3's d: the rotary halves (48) padded to 64 each
    (3, 1, 80, 32, False, True, "bnhd"),    # Phi-2's partial rotary, GPT-2's Conv1D layout
    (2, 2, 64, 16, True, False, "bhnd"),    # partial rotary on a power-of-two d
    (2, 1, 24, 0, True, True, "bhnd"),      # QK-norm alone on a small d: one pass-through part
    (2, 1, 64, 64, True, False, "bnhd"),    # the whole-head TMA kernel (two heads per tile) beside them
])
def test_hopper_tma_kernels_on_head_dims_that_are_not_split_in_registers(tma_launch_device, H, Hkv, d, r, norm,
                                                                         conv1d, layout):
    """The Hopper TMA kernels as the launch picks them at M >= 128 for 16-bit operands (on a CPU in the
    interpreter, an sm_90 of 3 SMs): the parts form for every rotate-half case the whole-head kernel does not
    take, the whole-head form for d 64; values against float64, and the forms the launch recorded."""
    from tilefuse.kernels import launches

    dev, dtype = tma_launch_device, torch.float16
    b_, n_, k_ = (2, 70, 40) if dev.type == "cpu" else (2, 257, 1000)
    gen = torch.Generator().manual_seed(3)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(dev, dtype)  # noqa: E731
    x = rnd(b_, n_, k_)
    rows = (H + 2 * Hkv) * d
    w = rnd(rows, k_, scale=k_ ** -0.5)
    weight = w.t().contiguous().t() if conv1d else w  # Conv1D's [K, rows] storage, passed transposed
    bias = rnd(rows)
    rotary = None
    if r:
        inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        freqs = torch.arange(n_, dtype=torch.float64)[:, None] * inv
        emb = torch.cat([freqs, freqs], -1)
        rotary = (emb.cos().float().to(dev), emb.sin().float().to(dev))
    qk = (rnd(d) * 0.5 + 1, rnd(d) * 0.5 + 1, 1e-6) if norm else None
    with launches.recording() as records:
        outs = tilefuse.qkv_projection(x, weight, bias, num_heads=H, num_kv_heads=Hkv, rotary=rotary, qk_norm=qk,
                                       layout=layout)
    (rec,) = [rec for rec in records if rec.op == "qkv_projection"]
    forms = rec.config.removeprefix("q/k/v: ").split(", ")
    assert len(forms) == 3, rec.describe()
    for i, form in enumerate(forms):  # whole heads where d is 64/128/256 and RoPE, if any, covers all of d
        whole = d in (64, 128, 256) and (not (r and i < 2) or r == d)
        assert form.startswith("tma ") and ("parts" in form) != whole, (i, rec.describe())
    split = [H * d, Hkv * d, Hkv * d]
    want = reference.qkv_projection(x.double(), w.double().split(split), bias.double().split(split), H, Hkv,
                                    None if rotary is None else tuple(t.double() for t in rotary), False,
                                    None if qk is None else (qk[0].double(), qk[1].double(), qk[2]))
    for got, exp, name in zip(outs, want, "qkv"):
        exp = exp if layout == "bhnd" else exp.transpose(1, 2)
        assert got.shape == exp.shape and got.is_contiguous(), (name, got.shape, exp.shape)
        assert_close(got, exp, REL_L2_BOUND[dtype], name)

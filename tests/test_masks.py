"""tilefuse.masks and tilefuse.attention(block_mask=...): every spec's tile classification against its dense
mask, the block-sparse forward and backward against the float64 reference with that mask, rows that see no
key, NaN, the plain-PyTorch path, torch.compile, and bad input."""
import pytest
import torch

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse import masks
from tilefuse.opspec import REL_L2_BOUND
from tilefuse.reference import attention as ref_attention

FP32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def block_sparse_kernels_for_every_mask(monkeypatch):
    """Band masks (causal, sliding windows) run the windowed kernels by default; these tests hold the block-sparse
    kernels to every mask (test_band_masks_run_the_windowed_kernels checks that route)."""
    from tilefuse.ops import attention as ops_attention

    monkeypatch.setattr(ops_attention, "BAND_MASKS_AS_WINDOWS", False)


def _rand(*shape, seed, device, dtype=FP32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _expected_classes(dense, block_q, block_k):
    """int8 [Bm, Hm, Tq, Tk] from a dense [Bm, Hm, Nq, Nk] mask: 2 where every in-range row sees every key of
    the tile (keys past Nk count as unseen), 1 where some are seen, 0 where none."""
    Bm, Hm, Nq, Nk = dense.shape
    Tq, Tk = -(-Nq // block_q), -(-Nk // block_k)
    seen = torch.zeros(Bm, Hm, Tq * block_q, Tk * block_k, dtype=torch.bool)
    seen[..., :Nq, :Nk] = dense
    rows = torch.zeros_like(seen)
    rows[..., :Nq, :] = True
    tile = lambda t: t.view(Bm, Hm, Tq, block_q, Tk, block_k).transpose(3, 4)  # noqa: E731
    some = (tile(seen) & tile(rows)).flatten(-2).any(-1)
    every = (tile(seen) | ~tile(rows)).flatten(-2).all(-1)
    return torch.where(every, 2, torch.where(some, 1, 0)).to(torch.int8)


def _doc_ids(n, docs, seed, batch=None, shuffled=False):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: docs - 1] + 1).values
    ids = torch.zeros(n, dtype=torch.int64)
    ids[cuts] = 1
    ids = ids.cumsum(0)
    if batch is not None:
        ids = torch.stack([ids.roll(i * 7) for i in range(batch)])
    if shuffled:
        ids = ids[..., torch.randperm(n, generator=g)]
    return ids


def _specs():
    docs = _doc_ids(90, 4, seed=1)
    return {
        "causal": (masks.causal(), 90, 77),
        "window": (masks.sliding_window(13, 6), 90, 100),
        "causal_window_global": ((masks.causal() & masks.sliding_window(20, 0)) | masks.global_tokens(5), 90, 90),
        "global": (masks.global_tokens(20), 50, 90),
        "document_sorted": (masks.document(docs), 90, 90),
        "document_unsorted_batched": (masks.document(_doc_ids(90, 3, seed=2, batch=2, shuffled=True)), 90, 90),
        "document_and_causal": (masks.document(docs) & masks.causal(), 90, 90),
        "function_heads": (masks.from_function(lambda b, h, q, k: (q + 2 * k + h) % 5 == 0, uses_batch=False),
                           50, 70),
        "function_or_window": (masks.from_function(lambda b, h, q, k: k == 3 * b) | masks.sliding_window(None, 2),
                               60, 70),
    }


SPECS = _specs()


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("block_q,block_k", [(16, 32), (32, 16)])
def test_tile_classes_and_lists_match_the_dense_mask(name, block_q, block_k):
    """A tile listed full is all visible, one listed partial is mixed, an unlisted one is empty; the transposed
    lists hold the same tiles; the bitmaps give back the dense mask."""
    spec, Nq, Nk = SPECS[name]
    B, H = 2, 3
    bm = spec.build(B, H, Nq, Nk, block_q=block_q, block_k=block_k)
    dense = spec.dense(B, H, Nq, Nk)
    assert (bm.batch, bm.heads) == dense.shape[:2]
    cls = bm.tile_classes()
    assert torch.equal(cls, _expected_classes(dense, block_q, block_k)), name
    assert torch.equal(bm.to_dense(), dense), name
    assert bm.visible_count() == int(dense.sum())
    # The per-key-tile lists are the transpose of the per-query-tile ones (ascending, padded with 0).
    Tq = cls.shape[2]
    for num, idx, value in ((bm.q_num_blocks, bm.q_indices, 1), (bm.full_q_num_blocks, bm.full_q_indices, 2)):
        sel = cls.transpose(-1, -2) == value
        assert torch.equal(num, sel.sum(-1, dtype=torch.int32))
        ar = torch.arange(Tq)
        want = torch.where(sel, ar, Tq).sort(-1).values
        used = ar < num[..., None]
        assert torch.equal(torch.where(used, idx, -1), torch.where(used, want.int(), -1))
    # The slots of a partial tile agree between the two directions.
    slots_kv = bm.kv_slots_dense()
    for_q = torch.zeros((*bm.q_indices.shape[:-1], Tq + 1), dtype=torch.int64)  # a spare column for unused entries
    used = torch.arange(Tq) < bm.q_num_blocks[..., None]
    for_q.scatter_(-1, torch.where(used, bm.q_indices.long(), Tq), bm.q_slots.long())
    partial = (cls == 1).transpose(-1, -2)
    assert torch.equal(for_q[..., :Tq][partial], slots_kv.transpose(-1, -2)[partial])
    assert torch.equal(slots_kv[cls == 1], torch.arange(bm.num_partial))  # row-major numbering


def test_masks_that_ignore_batch_and_head_are_stored_once():
    assert (masks.causal().build(4, 8, 64, 64).batch, masks.causal().build(4, 8, 64, 64).heads) == (1, 1)
    ids = _doc_ids(64, 3, seed=0, batch=4)
    bm = masks.document(ids).build(4, 8, 64, 64)
    assert (bm.batch, bm.heads) == (4, 1)
    bm = masks.from_function(lambda b, h, q, k: k <= q + h).build(4, 8, 64, 64)
    assert (bm.batch, bm.heads) == (4, 8)


# ---- attention with a block mask -----------------------------------------------------------------------
# (name, B, Hq, Hkv, d, dtype, block_q, block_k): odd lengths, GQA, both dtypes, mask tiles smaller than and equal
# to the interpreter's 64 x 64 kernel tiles.
CASES = [
    ("causal_window_global", 1, 4, 2, 40, FP32, 32, 32),
    ("document_unsorted_batched", 2, 2, 1, 64, BF16, 64, 32),
    ("function_heads", 1, 3, 1, 16, FP32, 16, 64),
]


def _reference(q, k, v, dense, dout, dlse=None):
    """out, lse and dq, dk, dv in float64 (autograd through the reference with the dense mask)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = ref_attention.attend(*leaves, dense, q.shape[-1] ** -0.5, 0, -1, -1)
    grads = [dout.double()] + ([dlse.double()] if dlse is not None else [])
    torch.autograd.backward([out, lse][: len(grads)], grads)
    return out.detach(), lse.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("name,B,Hq,Hkv,d,dtype,block_q,block_k", CASES)
def test_forward_and_backward_match_the_float64_reference(device, name, B, Hq, Hkv, d, dtype, block_q, block_k):
    spec, Nq, Nk = SPECS[name]
    q = _rand(B, Hq, Nq, d, seed=0, device=device, dtype=dtype)
    k = _rand(B, Hkv, Nk, d, seed=1, device=device, dtype=dtype)
    v = _rand(B, Hkv, Nk, d, seed=2, device=device, dtype=dtype)
    dout = _rand(B, Hq, Nq, d, seed=3, device=device, dtype=dtype)
    dlse = _rand(B, Hq, Nq, seed=4, device=device) if name == "function_heads" else None
    bm = spec.build(B, Hq, Nq, Nk, device, block_q=block_q, block_k=block_k)
    dense = spec.dense(B, Hq, Nq, Nk, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tilefuse.attention(*leaves, block_mask=bm, return_lse=True)
    torch.autograd.backward([out, lse] if dlse is not None else [out], [dout, dlse] if dlse is not None else [dout])
    ro, rl, rgrads = _reference(q, k, v, dense, dout, dlse)
    bound = REL_L2_BOUND[dtype]
    assert_close((out, lse), (ro, rl), bound, f"{name} forward")
    for t, want, what in zip(leaves, rgrads, ("dq", "dk", "dv")):
        assert_close(t.grad, want, bound, f"{name} {what}")


@pytest.mark.gpu_only
@pytest.mark.parametrize("mask", ["causal_window", "window_global", "document"])
@pytest.mark.parametrize("dtype,d,block", [(BF16, 128, (128, 128)), (torch.float16, 64, (64, 128)),
                                           (FP32, 96, (128, 64))])
def test_compiled_kernels_at_larger_shapes(device, mask, dtype, d, block):
    """The compiled kernels in their GPU tiles (64-128 rows, descriptors on sm_90), forward and backward, and a
    second call (the fast path's replay) bit-identical to the first."""
    from tilefuse.opspecs.block_sparse import mask_spec

    B, Hq, Hkv, N = 2, 8, 2, 1000
    spec = mask_spec(mask, N)
    bm = spec.build(B, Hq, N, N, device, block_q=block[0], block_k=block[1])
    q = _rand(B, Hq, N, d, seed=0, device=device, dtype=dtype)
    k, v = (_rand(B, Hkv, N, d, seed=s, device=device, dtype=dtype) for s in (1, 2))
    dout = _rand(B, Hq, N, d, seed=3, device=device, dtype=dtype)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = tilefuse.attention(*leaves, block_mask=bm, return_lse=True)
        out.backward(dout)
        runs.append([out, lse] + [t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    ro, rl, rgrads = _reference(q, k, v, spec.dense(B, Hq, N, N, device), dout)
    bound = REL_L2_BOUND[dtype] if dtype != FP32 or not torch.backends.cuda.matmul.allow_tf32 else 1e-3
    assert_close((runs[0][0], runs[0][1]), (ro, rl), bound, f"{mask} forward")
    for got, want, what in zip(runs[0][2:], rgrads, ("dq", "dk", "dv")):
        assert_close(got, want, bound, f"{mask} {what}")


def test_rows_that_see_no_key_give_zero_minus_inf_and_zero_gradient(device):
    """Rows 0-39 see nothing (whole tiles and parts of tiles): out 0, lse -inf, no NaN, dq 0 there."""
    Nq, Nk = 70, 45
    spec = masks.from_function(lambda b, h, q, k: (q >= 40) & (k <= q - 30), uses_batch=False, uses_head=False)
    bm = spec.build(1, 2, Nq, Nk, device, block_q=32, block_k=32)
    q, k, v = (_rand(1, 2, n, 32, seed=s, device=device) for s, n in ((0, Nq), (1, Nk), (2, Nk)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tilefuse.attention(*leaves, block_mask=bm, return_lse=True)
    assert torch.equal(out[:, :, :40], torch.zeros_like(out[:, :, :40]))
    assert torch.isneginf(lse[:, :, :40]).all() and torch.isfinite(lse[:, :, 40:]).all()
    dout = _rand(1, 2, Nq, 32, seed=3, device=device)
    out.backward(dout)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert leaves[0].grad[:, :, :40].abs().max() == 0
    ro, rl, rgrads = _reference(q, k, v, spec.dense(1, 2, Nq, Nk, device), dout)
    assert_close((out, lse), (ro, rl), REL_L2_BOUND[FP32], "forward")
    for t, want, what in zip(leaves, rgrads, ("dq", "dk", "dv")):
        assert_close(t.grad, want, REL_L2_BOUND[FP32], what)


def test_a_mask_with_no_visible_key_at_all(device):
    bm = masks.from_function(lambda b, h, q, k: q < 0, uses_batch=False, uses_head=False).build(1, 1, 20, 30, device)
    assert bm.num_partial == 0 and int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) == 0
    q, k, v = (_rand(1, 1, n, 16, seed=s, device=device) for s, n in ((0, 20), (1, 30), (2, 30)))
    out, lse = tilefuse.attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's numpy max
def test_nan_in_q_gives_nan_in_that_row_only(device):
    bm = masks.causal().build(1, 2, 50, 50, device, block_q=32, block_k=32)
    q, k, v = (_rand(1, 2, 50, 16, seed=s, device=device) for s in range(3))
    q[0, 1, 37, 3] = float("nan")
    out = tilefuse.attention(q, k, v, block_mask=bm)
    assert out[0, 1, 37].isnan().all()
    out[0, 1, 37] = 0
    assert not out.isnan().any()


@pytest.mark.skipif(ON_GPU, reason="the interpreter's descriptor path; the GPU takes descriptors by default")
def test_descriptor_loads_agree_with_pointer_loads(device):
    import triton
    from tilefuse.kernels.attention import launch

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    spec, Nq, Nk = SPECS["causal_window_global"]
    bm = spec.build(1, 2, Nq, Nk, device, block_q=32, block_k=32)
    q, k, v = (_rand(1, 2, n, 32, seed=s, device=device) for s, n in ((0, Nq), (1, Nk), (2, Nk)))
    runs = [launch.block_sparse_forward(q, k, v, bm.tensors(), 32, 32, 32 ** -0.5, True, "interpreter",
                                        use_desc=flag) for flag in (False, True)]
    ro, rl = ref_attention.attend(q.double(), k.double(), v.double(), spec.dense(1, 2, Nq, Nk), 32 ** -0.5, 0, -1, -1)
    for out, lse in runs:
        assert_close((out, lse), (ro, rl), REL_L2_BOUND[FP32], "descriptor / pointer")


@pytest.mark.skipif(ON_GPU, reason="the plain-PyTorch path is the CPU's without the interpreter")
def test_plain_pytorch_path_gives_the_same_result(device, monkeypatch):
    spec, Nq, Nk = SPECS["document_sorted"]
    bm = spec.build(1, 2, Nq, Nk, block_q=32, block_k=32)
    q, k, v = (_rand(1, 2, 90, 16, seed=s, device=device) for s in range(3))
    want = tilefuse.attention(q, k, v, block_mask=bm)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = tilefuse.attention(*leaves, block_mask=bm)
    got.sum().backward()
    assert_close(got, want.double(), 1e-6, "reference path")
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_under_torch_compile_with_autograd(device):
    """The op's fake implementations and autograd under torch.compile (aot_eager: tracing without codegen)."""
    spec = masks.causal() & masks.sliding_window(10, 0)
    bm = spec.build(1, 2, 40, 40, device, block_q=32, block_k=32)
    q, k, v = (_rand(1, 2, 40, 16, seed=s, device=device).requires_grad_() for s in range(3))
    fn = torch.compile(lambda q, k, v: tilefuse.attention(q, k, v, block_mask=bm), backend="aot_eager",
                       fullgraph=True)
    out = fn(q, k, v)
    out.sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = tilefuse.attention(*leaves, block_mask=bm)
    want.sum().backward()
    assert_close(out, want.double(), 1e-6, "compiled forward")
    for a, b in zip((q, k, v), leaves):
        assert_close(a.grad, b.grad.double(), 1e-6, "compiled backward")


def test_the_registered_op_passes_opcheck(device):
    """Schema, fake implementation, autograd registration and AOT dispatch of tilefuse::block_sparse_attention."""
    bm = masks.causal().build(1, 2, 40, 40, device, block_q=32, block_k=32)
    q, k, v = (_rand(1, 2, 40, 16, seed=s, device=device).requires_grad_() for s in range(3))
    torch.library.opcheck(torch.ops.tilefuse.block_sparse_attention.default,
                          (q, k, v, *bm.tensors(), 32, 32, None, True))


# ---- bad input ---------------------------------------------------------------------------------------
def test_bad_input_raises_before_any_launch(device):
    q, k, v = (_rand(1, 2, 40, 16, seed=s, device=device) for s in range(3))
    bm = masks.causal().build(1, 2, 40, 40, device, block_q=32, block_k=32)
    with pytest.raises(ValueError, match="block_mask was built for Nq=40"):
        tilefuse.attention(q[:, :, :30], k, v, block_mask=bm)
    with pytest.raises(ValueError, match="block_mask was built for batch"):
        tilefuse.attention(q, k, v, block_mask=masks.from_function(lambda b, h, q, k: k <= q).build(1, 3, 40, 40,
                                                                                                    device))
    with pytest.raises(ValueError, match="causal=False"):
        tilefuse.attention(q, k, v, block_mask=bm, causal=True)
    with pytest.raises(ValueError, match="causal=False"):
        tilefuse.attention(q, k, v, block_mask=bm, window=(4, 0))
    with pytest.raises(NotImplementedError, match="softcap"):
        tilefuse.attention(q, k, v, block_mask=bm, softcap=30.0)
    with pytest.raises(TypeError, match="block_mask must be"):
        tilefuse.attention(q, k, v, block_mask=torch.ones(40, 40, dtype=torch.bool))
    broken = masks.causal().build(1, 2, 40, 40, device, block_q=32, block_k=32)
    broken.kv_indices = broken.kv_indices[..., :1].contiguous()
    with pytest.raises(ValueError, match="block_mask.kv_indices"):
        tilefuse.attention(q, k, v, block_mask=broken)
    with pytest.raises(ValueError, match="block_q"):
        masks.causal().build(1, 1, 40, 40, block_q=48)
    with pytest.raises(ValueError, match="Nq == Nk"):
        masks.document(torch.zeros(40, dtype=torch.int64)).build(1, 1, 30, 40)
    with pytest.raises(ValueError, match="doc_ids has batch"):
        masks.document(torch.zeros(3, 40, dtype=torch.int64)).build(2, 1, 40, 40)
    with pytest.raises(TypeError, match="doc_ids"):
        masks.document(torch.zeros(40))
    with pytest.raises(ValueError, match="left"):
        masks.sliding_window(-1, 0)
    with pytest.raises(TypeError, match="combine"):
        masks.causal() & True
    with pytest.raises(TypeError, match="bool tensor"):
        masks.from_function(lambda b, h, q, k: q - k).build(1, 1, 40, 40)


def test_band_masks_run_the_windowed_kernels(device, monkeypatch):
    """A spec that is only a band (causal and sliding windows under ``&``) at Nq == Nk runs attention(window=):
    no block-sparse launch, forward and backward equal to the float64 reference with the dense mask; a band
    with a global token, or at Nq != Nk (the block mask's top-left alignment), stays on the block-sparse kernels."""
    from tilefuse.kernels import launches
    from tilefuse.ops import attention as ops_attention

    monkeypatch.setattr(ops_attention, "BAND_MASKS_AS_WINDOWS", True)
    assert (masks.causal() & masks.sliding_window(9, 4)).band() == (9, 0)
    assert (masks.sliding_window(None, 3) & masks.sliding_window(5, None)).band() == (5, 3)
    assert (masks.causal() | masks.sliding_window(2, 2)).band() is None
    assert (masks.causal() & masks.global_tokens(2)).band() is None
    cases = [(masks.causal(), 40, 40, "attention"), (masks.causal() & masks.sliding_window(9, 0), 40, 40, "attention"),
             (masks.sliding_window(3, 7), 40, 40, "attention"), (masks.sliding_window(None, None), 24, 24, "attention"),
             ((masks.causal() & masks.sliding_window(9, 0)) | masks.global_tokens(2), 40, 40, "block_sparse_attention"),
             (masks.causal(), 24, 40, "block_sparse_attention")]
    for i, (spec, Nq, Nk, op) in enumerate(cases):
        q = _rand(1, 2, Nq, 16, seed=i, device=device)
        k, v = _rand(1, 1, Nk, 16, seed=i + 10, device=device), _rand(1, 1, Nk, 16, seed=i + 20, device=device)
        dout = _rand(1, 2, Nq, 16, seed=i + 30, device=device)
        bm = spec.build(1, 2, Nq, Nk, device, block_q=16, block_k=16)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with launches.recording() as recs:
            out, lse = tilefuse.attention(*leaves, block_mask=bm, return_lse=True)
            out.backward(dout)
        ran = {r.op for r in recs}
        assert op in ran and ({"attention", "block_sparse_attention"} - {op}).isdisjoint(ran), (spec, ran)
        ro, rl, rgrads = _reference(q, k, v, spec.dense(1, 2, Nq, Nk, device), dout)
        assert_close((out, lse), (ro, rl), REL_L2_BOUND[FP32], f"{spec!r} forward")
        for t, want, what in zip(leaves, rgrads, ("dq", "dk", "dv")):
            assert_close(t.grad, want, REL_L2_BOUND[FP32], f"{spec!r} {what}")

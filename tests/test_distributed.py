"""tilefuse under torch.distributed, two processes: FSDP2 training of a patched model against the unpatched one,
the tensor-parallel plan against the single-process model, and the ops on DTensor shards. gloo on the CPU
(the kernels in the interpreter); NCCL on two GPUs where there are two."""
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tilefuse.opspec import REL_L2_BOUND

WORLD = 2
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs two GPUs"))]


def _config(**overrides):
    import transformers
    return transformers.LlamaConfig(**dict(dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64), **overrides))


def _llama(device):
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config()).to(device).eval()


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _fsdp(rank, device, mesh):
    from torch.distributed.fsdp import fully_shard

    import tilefuse
    losses = {}
    for name in ("unpatched", "patched"):
        model = _llama(device)
        if name == "patched":
            assert tilefuse.patch(model).replaced
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 64, (2, 8), generator=g).to(device)
        losses[name] = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    return losses


def _tensor_parallel(rank, device, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    import tilefuse
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        want = _llama(device)(input_ids=ids).logits
    model = _llama(device)
    tilefuse.patch(model)
    parallelize_module(model, mesh, tilefuse.distributed.tensor_parallel_plan(model, WORLD))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads_finite = all(torch.isfinite(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).all()
                       for p in model.parameters() if p.grad is not None)
    return {"rel_l2": _rel(got, want), "grads_finite": bool(grads_finite),
            "q_proj_local_rows": model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0]}


def _dtensor_ops(rank, device, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import tilefuse
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g).to(device)
    w = torch.randn(24, 16, generator=g).to(device)
    b = torch.randn(24, generator=g).to(device)
    full = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
    col = tilefuse.linear(x, distribute_tensor(w, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)]), "gelu")
    w2 = torch.randn(16, 24, generator=g).to(device)
    b2 = torch.randn(16, generator=g).to(device)
    row = tilefuse.linear(distribute_tensor(full, mesh, [Shard(1)]), distribute_tensor(w2, mesh, [Shard(1)]), b2)
    errors = {}
    for name, call in (
            ("row_with_activation", lambda: tilefuse.linear(distribute_tensor(full, mesh, [Shard(1)]),
                                                            distribute_tensor(w2, mesh, [Shard(1)]), None, "gelu")),
            ("norm_over_sharded_dim", lambda: tilefuse.rms_norm(distribute_tensor(x, mesh, [Shard(1)]), 16))):
        try:
            call()
        except ValueError as exc:
            errors[name] = str(exc)
    q, kv = torch.randn(2, 4, 6, 8, generator=g).to(device), torch.randn(2, 2, 6, 8, generator=g).to(device)
    att = tilefuse.attention(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q, kv, kv)), causal=True)
    try:
        tilefuse.attention(*(distribute_tensor(t, mesh, [Shard(2)]) for t in (q, kv, kv)))
    except ValueError as exc:
        errors["attention_over_sequence"] = str(exc)
    norm = tilefuse.rms_norm(distribute_tensor(x, mesh, [Shard(0)]), 16, distribute_tensor(
        torch.ones(16, device=device), mesh, [Replicate()]), 1e-6)
    return {"col_placement": str(col.placements[0]), "col_rel": _rel(col.full_tensor(), full),
            "row_rel": _rel(row.full_tensor(), torch.nn.functional.linear(full, w2, b2)),
            "norm_rel": _rel(norm.full_tensor(), torch.nn.functional.rms_norm(x, (16,), eps=1e-6)),
            "attention_rel": _rel(att.full_tensor(), torch.nn.functional.scaled_dot_product_attention(
                q, kv, kv, is_causal=True, enable_gqa=True)),
            "errors": errors}


SCENARIOS = {"fsdp": _fsdp, "tensor_parallel": _tensor_parallel, "dtensor_ops": _dtensor_ops}


def _scenarios(backend):
    return ["fsdp", "tensor_parallel"] + (["dtensor_ops"] if backend == "gloo" else [])


def _worker(rank, backend, port, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    try:
        device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        mesh = init_device_mesh(device.type, (WORLD,))
        results = {name: SCENARIOS[name](rank, device, mesh) for name in _scenarios(backend)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _run(backend, tmp_path):
    """Every scenario of the backend in one pair of processes (each start imports torch and transformers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(backend, port, str(tmp_path)), nprocs=WORLD)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _check_fsdp(result):
    """FSDP2 trains a patched model as the unpatched one."""
    bound = REL_L2_BOUND[torch.float32]  # the models are fp32 on either backend
    for a, b in zip(result["patched"], result["unpatched"]):
        assert abs(a - b) <= bound * abs(b), result


def _check_tensor_parallel(result):
    """The tensor-parallel plan matches the single-process model."""
    assert result["q_proj_local_rows"] == 4 * 8 // WORLD  # whole heads per rank: 2 of 4, head dim 8
    assert result["rel_l2"] <= REL_L2_BOUND[torch.float32], result
    assert result["grads_finite"]


def _check_dtensor_ops(result):
    """The ops run on local shards and name the placements they refuse."""
    assert result["col_placement"] == "S(1)"
    assert max(result["col_rel"], result["row_rel"], result["norm_rel"]) <= REL_L2_BOUND[torch.float32]
    assert "activation needs the row-parallel sum first" in result["errors"]["row_with_activation"]
    assert "got x S(1)" in result["errors"]["norm_over_sharded_dim"]
    assert result["attention_rel"] <= REL_L2_BOUND[torch.float32]
    assert "got q S(2)" in result["errors"]["attention_over_sequence"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_tensor_parallel_and_shard_ops_in_two_processes(backend, tmp_path):
    checks = {"fsdp": _check_fsdp, "tensor_parallel": _check_tensor_parallel, "dtensor_ops": _check_dtensor_ops}
    for rank, results in enumerate(_run(backend, tmp_path)):
        assert sorted(results) == sorted(_scenarios(backend)), rank
        for name in _scenarios(backend):
            checks[name](results[name])


def test_the_plan_refuses_what_it_cannot_split():
    import transformers

    import tilefuse
    model = transformers.LlamaForCausalLM(_config(num_attention_heads=4, num_key_value_heads=1))
    with pytest.raises(ValueError, match="k_proj: 1 heads do not split over 2 ranks"):
        tilefuse.distributed.tensor_parallel_plan(model, 2)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(NotImplementedError, match="Conv1D"):
        tilefuse.distributed.tensor_parallel_plan(gpt2)

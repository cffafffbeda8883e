"""tilefuse under torch.distributed: the tensor-parallel plan of a (patched) model.

FSDP2 (``fully_shard``) needs nothing from tilefuse: it gathers each module's parameters into plain tensors
before that module's forward, and the patched modules read their parameters at call time. Tensor parallelism
shards parameters as DTensors: :func:`tensor_parallel_plan` gives ``parallelize_module`` the plan that keeps
every fused op shard-local -- the Q, K, V projections and the gate / up pair column-parallel, so each rank
holds whole heads of each and matching gate and up rows (the fused kernels read the local shards in place),
and ``o_proj`` / ``down_proj`` row-parallel, whose all-reduce ends the block. Norms, embeddings and the LM
head stay replicated. The ops themselves take DTensors where they are shard-local (ops/_dtensor.py).
"""
from __future__ import annotations

import torch


def tensor_parallel_plan(model: torch.nn.Module, tp_size: int | None = None) -> dict:
    """``{module path: ColwiseParallel() | RowwiseParallel()}`` for ``parallelize_module(model, mesh, plan)``:
    every attention module with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` Linears and every gated MLP with
    ``gate_proj``/``up_proj``/``down_proj`` (Llama, Mistral, Qwen2, Qwen3 and their relatives, patched or
    not). With ``tp_size``, the head counts and the MLP width must divide by it (``ValueError`` naming the
    module otherwise). GPT-2's ``Conv1D`` projections (Q, K, V concatenated in one transposed weight) have no
    column-parallel style in torch: ``NotImplementedError``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if type(getattr(module, "c_attn", None)).__name__ == "Conv1D":
            raise NotImplementedError(f"{prefix}c_attn: GPT-2's Conv1D projections (Q, K, V in one transposed "
                                      "weight) have no tensor-parallel plan in tilefuse yet")
        attn = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if all(isinstance(p, torch.nn.Linear) for p in attn):
            d = getattr(module, "head_dim", None)
            if tp_size and d:
                for name, p in zip(("q_proj", "k_proj"), attn):
                    heads = p.out_features // d
                    if heads % tp_size:
                        raise ValueError(f"{prefix}{name}: {heads} heads do not split over {tp_size} ranks")
            plan.update({f"{prefix}{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
            plan[f"{prefix}o_proj"] = RowwiseParallel()
        mlp = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if all(isinstance(p, torch.nn.Linear) for p in mlp):
            if tp_size and mlp[0].out_features % tp_size:
                raise ValueError(f"{prefix}gate_proj: {mlp[0].out_features} rows do not split over {tp_size} ranks")
            plan.update({f"{prefix}gate_proj": ColwiseParallel(), f"{prefix}up_proj": ColwiseParallel(),
                         f"{prefix}down_proj": RowwiseParallel()})
    if not plan:
        raise ValueError("no attention (q_proj/k_proj/v_proj/o_proj) or gated MLP (gate_proj/up_proj/down_proj) "
                         "modules found to parallelize")
    return plan

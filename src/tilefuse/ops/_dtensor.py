"""DTensor arguments (torch.distributed.tensor) for the ops that are shard-local: they run on the local shards
and return a DTensor with the placement that result has; any other placement is a ValueError naming it.

One-dimensional meshes only. A plain tensor beside DTensors counts as replicated (as tensor parallelism
hands activations between modules). Shard-local cases:
- linear (and gated linear): a column-parallel weight (``Shard(0)``, biases ``Shard(0)``) with a replicated x
  gives ``Shard(-1)``; a row-parallel weight (``Shard(1)``) with x ``Shard(-1)`` gives ``Partial`` (then the
  replicated bias), without an activation only (an activation needs the full sum first); a replicated weight
  keeps x's placement unless x is sharded on its last dim.
- the norms: x replicated or sharded on any dim but the last (the normalised one), parameters replicated.
- attention (and SDPA): q, k, v [B, H, N, d] sharded alike on the batch or the heads, or replicated; a mask or
  ALiBi slopes plain / replicated or sharded as q.
"""
from __future__ import annotations

import torch


_DTENSOR = None  # the DTensor class once looked up (False: torch has no distributed package)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dtensor_class():
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor as _DTENSOR
        except ImportError:  # torch built without distributed
            _DTENSOR = False
    return _DTENSOR


def any_dtensor(*tensors) -> bool:
    """Whether any argument (or a member of a tuple argument) is a DTensor: a few type checks on the hot path of
    every call. Plain tensors are answered without the DTensor class, so a call traced by torch.compile neither
    looks the class up nor sets the module global that caches it (a guard on that global would recompile the
    function once the global is set)."""
    for t in tensors:
        for u in (t if isinstance(t, (tuple, list)) else (t,)):
            if u is None or type(u) in _PLAIN or not isinstance(u, torch.Tensor):
                continue
            cls = _dtensor_class()
            if cls is not False and isinstance(u, cls):
                return True
    return False


def _mesh_and_placement(tensors):
    from torch.distributed.tensor import DTensor, Replicate
    dts = [t for t in tensors if isinstance(t, DTensor)]
    mesh = dts[0].device_mesh
    for t in dts:
        if t.device_mesh != mesh:
            raise ValueError("tilefuse ops take DTensors on one device mesh; got two meshes")
        if mesh.ndim != 1:
            raise ValueError(f"tilefuse ops take DTensors on a 1-D device mesh; got a {mesh.ndim}-D mesh")

    def placement(t):
        return t.placements[0] if isinstance(t, DTensor) else Replicate()
    return mesh, placement


def _local(t):
    from torch.distributed.tensor import DTensor
    if isinstance(t, (tuple, list)):
        return type(t)(_local(u) for u in t)
    return t.to_local() if isinstance(t, DTensor) else t


def _describe(name, p):
    return f"{name} {p}"


def _wrap(local, mesh, placement, shape):
    """``local`` as this rank's part of a DTensor of global ``shape`` (given, so uneven shards are right)."""
    from torch.distributed.tensor import DTensor
    shape = torch.Size(shape)
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=tuple(reversed(stride)))


def linear(x, weight, bias, activation, run):
    """``run(x, weight, bias, activation)`` on the local shards of DTensor arguments (see the module doc)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    weights = tuple(weight) if isinstance(weight, (tuple, list)) else (weight,)
    biases = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    mesh, place = _mesh_and_placement([x, *weights, *[b for b in biases if b is not None]])
    xp, wps = place(x), {place(w) for w in weights}
    bps = {place(b) for b in biases if b is not None}
    last = x.dim() - 1
    out_shape = (*x.shape[:-1], weights[0].shape[0])  # the global output: rows of one weight (gated: of each)
    if len(wps) == 1:
        wp = wps.pop()
        if wp == Shard(0) and xp == Replicate() and bps <= {Shard(0)}:  # column parallel
            out = run(_local(x), _local(weight), _local(bias), activation)
            return _wrap(out, mesh, Shard(out.dim() - 1), out_shape)
        if wp == Shard(1) and xp == Shard(last) and bps <= {Replicate()} and activation is None:  # row parallel
            out = _wrap(run(_local(x), _local(weight), None, None), mesh, Partial(), out_shape)
            if bias is not None:
                b = bias if isinstance(bias, DTensor) else DTensor.from_local(bias, mesh, [Replicate()],
                                                                              run_check=False)
                out = out + b
            return out
        if wp == Replicate() and bps <= {Replicate()} and xp != Shard(last):
            out = run(_local(x), _local(weight), _local(bias), activation)
            return _wrap(out, mesh, xp, out_shape)
    shown = ", ".join([_describe("x", xp)] + [_describe(f"weight[{i}]" if len(weights) > 1 else "weight", place(w))
                                                for i, w in enumerate(weights)]
                      + [_describe("bias", p) for p in bps])
    hint = " (an activation needs the row-parallel sum first: apply it after the all-reduce)" \
        if activation is not None and Shard(1) in {place(w) for w in weights} else ""
    raise ValueError(f"tilefuse.linear runs on local shards for a column-parallel weight (Shard(0)) with a "
                     f"replicated x, a row-parallel weight (Shard(1)) with x Shard(-1) and no activation, or a "
                     f"replicated weight; got {shown}{hint}")


def rows(x, params, run):
    """``run(x_local, *params_local)`` for a row-wise op over x's last dim (the norms)."""
    from torch.distributed.tensor import Replicate, Shard
    present = [p for p in params if p is not None]
    mesh, place = _mesh_and_placement([x, *present])
    xp = place(x)
    bad = [f"parameter {place(p)}" for p in present if place(p) != Replicate()]
    if xp == Shard(x.dim() - 1) or xp == Shard(-1) or not (xp == Replicate() or isinstance(xp, Shard)) or bad:
        raise ValueError(f"tilefuse's norms run on local shards when x is replicated or sharded on a dim other "
                         f"than the normalised last one, with replicated parameters; got x {xp}"
                         + (", " + ", ".join(bad) if bad else ""))
    out = run(_local(x), *[_local(p) for p in params])
    if isinstance(out, tuple):
        return tuple(_wrap(o, mesh, xp, x.shape) for o in out)
    return _wrap(out, mesh, xp, x.shape)


def heads(q, k, v, extras, run):
    """``run(q, k, v, *extras)`` on local shards for attention over [B, H, N, d] DTensors: q, k and v sharded
    alike on the batch (dim 0) or the heads (dim 1), or replicated. ``extras`` (a mask, ALiBi slopes) must be
    None, plain / replicated, or sharded as q is. The outputs keep q's placement (the lse too: [B, H, N])."""
    from torch.distributed.tensor import Replicate, Shard
    if q.dim() != 4:
        raise ValueError(f"tilefuse attention takes DTensors as 4-D [B, H, N, d]; got a {q.dim()}-D query")
    mesh, place = _mesh_and_placement([q, k, v, *[e for e in extras if e is not None]])
    qp = place(q)
    ok = qp in (Replicate(), Shard(0), Shard(1)) and place(k) == qp and place(v) == qp
    for e in extras:
        if e is not None and place(e) not in (Replicate(), qp):
            ok = False
    if not ok:
        shown = ", ".join(f"{n} {place(t)}" for n, t in (("q", q), ("k", k), ("v", v)))
        shown += "".join(f", extra {place(e)}" for e in extras if e is not None)
        raise ValueError("tilefuse attention runs on local shards when q, k and v are sharded alike on the batch "
                         f"(Shard(0)) or heads (Shard(1)) of [B, H, N, d], or replicated; got {shown}")
    out = run(_local(q), _local(k), _local(v), *[_local(e) for e in extras])
    shapes = (q.shape, q.shape[:3])  # out [B, Hq, Nq, d]; lse [B, Hq, Nq]
    if isinstance(out, tuple):
        return tuple(_wrap(o, mesh, qp, s) for o, s in zip(out, shapes))
    return _wrap(out, mesh, qp, shapes[0])

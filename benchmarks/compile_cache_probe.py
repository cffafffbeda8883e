"""Does a kernel that a report worker built load from Triton's disk cache in the timing process?

  PYTHONPATH=src python benchmarks/compile_cache_probe.py [OP] [ROW]     (GPU; default: linear, row 0)

A spawned process does what a ``tilefuse report --jobs`` worker does for OP (``prepare_op``: accuracy, then
the row's untimed first call); then this process, which has touched neither CUDA nor Triton before, times
the row as the report's main process does. Both record every kernel specialization Triton builds (its JIT
hooks): the kernel, seconds, the compiled kernel's cache hash and its specialization (signature,
constants, options). Prints, per kernel built in the timing process, whether the worker built the same
specialization and whether it got the same hash -- a same specialization under another hash means the
backend's part of the key (the ptxas version) differs between the processes. One JSON line per kernel.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time


def _recording():
    """Installs hooks that append one dict per kernel built in this process to the returned list."""
    from triton import knobs

    built, started = [], {}

    def on_miss(**kwargs):
        started[kwargs["repr"]] = time.perf_counter()

    def on_done(**kwargs):
        seconds = time.perf_counter() - started.pop(kwargs["repr"], time.perf_counter())
        info = kwargs["fn"]
        compiled = None
        for caches in info.jit_function.device_caches.values():
            compiled = caches[0].get(kwargs["key"], compiled)
        built.append({"kernel": info.name, "seconds": round(seconds, 3),
                      "hash": getattr(compiled, "hash", None),
                      "specialization": kwargs["compile"]["specialization_data"]})

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = on_miss, on_done
    # The text triton hashes into a kernel's disk-cache key (its parts joined by '-'), per kernel in build order.
    from triton.compiler import compiler
    original = compiler.get_cache_key

    def get_cache_key(src, backend, options, env_vars):
        key = original(src, backend, options, env_vars)
        keys.setdefault(getattr(src, "name", "?"), []).append(key)
        parts.setdefault(getattr(src, "name", "?"), []).append(_key_parts(src, backend, options, env_vars))
        return key

    keys: dict = {}
    parts: dict = {}
    compiler.get_cache_key = get_cache_key
    built_keys.append(keys)
    built_parts.append(parts)
    return built


def _key_parts(src, backend, options, env_vars) -> dict:
    """The pieces triton hashes into the key, each as text: the source's (the function's cache_key, the
    attributes, the signature, each constant's key text), the backend's, every option, the environment."""
    fn = getattr(src, "fn", None)
    get_key = lambda v: v.cache_key if hasattr(v, "cache_key") else str(v)  # noqa: E731 - triton's rule
    out = {"backend": backend.hash(), "env": str(sorted(env_vars.items()))}
    if fn is not None:
        out["fn.cache_key"] = fn.cache_key
        out["fn.used_global_vals"] = str([(k[0], str(v[0])) for k, v in getattr(fn, "used_global_vals", {}).items()])
        out["attrs"] = str(src.attrs)
        out["signature"] = str([v for k, v in sorted(src.signature.items())])
        for k, v in sorted(src.constants.items()):
            out[f"constant {k}"] = get_key(v)
    for k, v in sorted(options.__dict__.items()):
        out[f"option {k}"] = str(v)
    return out


built_keys: list = []
built_parts: list = []


def _backend_facts() -> dict:
    from triton.backends.nvidia import compiler
    return {"TRITON_PTXAS_PATH": os.environ.get("TRITON_PTXAS_PATH"),
            "ptxas_version_hashed": compiler.get_ptxas_version(90).strip().splitlines()[-1]}


def worker(op: str, row: int) -> dict:
    built = _recording()
    from tilefuse.harness import report
    report.prepare_op(op, True, 1, [row], None, report.QUICK_SKIPPED_ANCHORS)
    return {"built": built, "cache_keys": built_keys[0], "key_parts": built_parts[0], **_backend_facts()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    op, row = (argv + ["linear"])[0], int((argv + ["linear", "0"])[1])
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        from_worker = pool.apply(worker, (op, row))
    worker_seconds = time.perf_counter() - started
    built = _recording()
    from tilefuse import registry
    from tilefuse.harness import report
    spec = registry.get(op)
    ceilings = report.measure_ceilings()
    started = time.perf_counter()
    timed = report.speed_for_case(spec, spec.bench_cases[row], ceilings, None, report.QUICK_SKIPPED_ANCHORS)
    print(json.dumps({"op": op, "row": timed["case"], "worker_seconds": round(worker_seconds, 1),
                      "row_seconds": round(time.perf_counter() - started, 1), "step_seconds": timed["step_seconds"],
                      "worker_backend": {k: v for k, v in from_worker.items() if k not in ("built", "cache_keys", "key_parts")},
                      "timing_backend": _backend_facts(), "worker_kernels": len(from_worker["built"])}))
    mine = built_keys[0]
    for name, texts in mine.items():  # where the disk-cache key text of a kernel differs from the worker's
        theirs = from_worker["cache_keys"].get(name, [])
        for text in texts:
            if text in theirs or not theirs:
                continue
            ours = text.split("-")
            nearest = min(theirs, key=lambda t: sum(a != b for a, b in zip(ours, t.split("-"))))
            print(json.dumps({"kernel": name, "key_parts_differing": [
                [a, b] for a, b in zip(ours, nearest.split("-")) if a != b][:6]}))
    for name, pieces in built_parts[0].items():  # which named piece of the key differs, in full
        theirs = from_worker["key_parts"].get(name, [])
        for mine_parts in pieces:
            if not theirs or mine_parts in theirs:
                continue
            nearest = min(theirs, key=lambda t: sum(t.get(k) != v for k, v in mine_parts.items()))
            print(json.dumps({"kernel": name, "pieces_differing": {
                k: [v, nearest.get(k)] for k, v in mine_parts.items() if nearest.get(k) != v}}))
    by_spec = {b["specialization"]: b for b in from_worker["built"]}
    by_kernel: dict = {}
    for b in from_worker["built"]:
        by_kernel.setdefault(b["kernel"], []).append(b)
    for b in built:
        twin = by_spec.get(b["specialization"])
        line = {"kernel": b["kernel"], "seconds": b["seconds"], "worker_built_same": twin is not None,
                "same_hash": twin is not None and twin["hash"] == b["hash"]}
        if twin is None and by_kernel.get(b["kernel"]):
            # The nearest specialization the worker built for this kernel, field by field.
            mine = json.loads(b["specialization"])
            theirs = [json.loads(o["specialization"]) for o in by_kernel[b["kernel"]]]
            diffs = [{k: (mine[k], t[k]) for k in mine if mine[k] != t.get(k)} for t in theirs]
            line["nearest_difference"] = min(diffs, key=lambda d: len(json.dumps(d)))
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

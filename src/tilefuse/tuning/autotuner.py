"""How each kernel's config is chosen on a GPU: ``autotune`` and its ``TableAutotuner``.

Autotuning never runs under the Triton interpreter (it would time Python, not the GPU, and take
minutes); launch modules give the interpreter one fixed large tile instead (e.g.
``kernels.gemm.configs.INTERPRETER_GEMM``), because the interpreter's cost is per program, not per
element. This package is a leaf: it imports torch and triton, nothing of tilefuse above it.

How a config is chosen on a GPU
-------------------------------
Every autotuned kernel goes through :func:`autotune` (a ``triton.autotune`` whose Autotuner also reads
and writes tables). A kernel's table is named by ``name=`` (e.g. ``linear_portable``), else by its
function, with ``_2``, ``_3``... for further autotuners over the same function in definition order. Its *key* is what
triton's Autotuner keys on -- the values of the ``key=`` arguments (M bucket, N, K, epilogue flags...)
plus the dtype of every tensor argument -- written as text, e.g.
``M_BUCKET=8192 N=16384 K=4096 HAS_BIAS=True ACTIVATION='gelu' dtypes=bfloat16,bfloat16,bfloat16,bfloat16``.
The first call of a key in a process looks, in order, at:

1. the user's cache for this GPU, ``~/.cache/tilefuse/<gpu-slug>/<kernel>.json`` (the directory is
   ``$TILEFUSE_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/tilefuse``); the slug is the CUDA device
   name in lower case with dashes (``NVIDIA H200`` -> ``nvidia-h200``);
2. the table shipped in the package, ``tilefuse/configs/<gpu-slug>.json``;
3. otherwise triton benchmarks the (pruned) space, and the winner with the timing of every config it
   beat is written to the user's cache (1.), so the next process does not tune again.

A config found in 1. or 2. runs without any benchmarking: it is put in the Autotuner's own in-process
cache for that key, so triton never times anything (a stored config outside today's space is still
used; one whose parameter *names* differ from the space's is ignored with a warning, and one that no
longer compiles on this GPU is dropped with a warning and the key is tuned). A corrupt or partial
file is ignored with a warning naming it. Writers take a lock file and replace the table atomically
(temp file + ``os.replace``), so concurrent processes neither tear a file nor lose each other's keys.
``TILEFUSE_AUTOTUNE=0`` pins every kernel to its first (pruned) config: no tables, no benchmarking;
:func:`tune_missing_keys` (False) keeps the tables but runs a key they lack on its first config untuned.
:func:`tuning_record` tells, per kernel, which config each key used, where it came from, and the
timings of the configs it beat (for the report).

Producing the shipped table on a GPU
------------------------------------
On the target GPU (a fresh process, ``TILEFUSE_AUTOTUNE`` unset)::

    tilefuse tune --retune --ops linear attention --out src/tilefuse/configs/nvidia-h200.json

runs every bench case of the named ops (so each kernel tunes each of its keys once), prints the
chosen configs and the ones they beat, writes the user cache, and merges the winners into the
``--out`` table (run it per op when one command has a time limit; the file accumulates). Commit that
file: ``pyproject.toml`` ships ``configs/*.json``. Never write a table by hand -- its numbers must come
from a real run on that GPU.
"""
from __future__ import annotations

import os
import threading
import time

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources, PTXASError

from tilefuse.tuning.tables import (_device_name, _warn, config_from_dict, config_to_dict, gpu_slug, lookup,
                                    make_entry, store_user_entry, user_cache_path)

# ----------------------------------------------------------------------------------------------------
# The autotuner every kernel uses
# ----------------------------------------------------------------------------------------------------

def autotune_enabled() -> bool:
    """``TILEFUSE_AUTOTUNE=0`` pins each kernel to its first (pruned) config: the GPU test run uses it so
    hundreds of small test shapes do not each benchmark a config space. Read when a kernel is decorated
    (at import)."""
    return os.environ.get("TILEFUSE_AUTOTUNE", "1") != "0"



_TUNERS: dict[str, "TableAutotuner"] = {}
_use_stored_configs = True


def use_stored_configs(enabled: bool) -> None:
    """False: ignore the user cache and shipped table (``tilefuse tune --retune``); winners are still written."""
    global _use_stored_configs
    _use_stored_configs = enabled


def stored_configs_used() -> bool:
    """Whether this process reads stored configs (see :func:`use_stored_configs`)."""
    return _use_stored_configs


_tune_missing_keys = True
_compile_missing_space = False
UNTUNED_SOURCE = "first config (not tuned)"


def tune_missing_keys(enabled: bool, compile_space: bool = False) -> None:
    """False: a key with no stored config runs its first (pruned) config, recorded with source
    ``UNTUNED_SOURCE``: nothing is benchmarked and nothing written. For processes that share a GPU with
    others (``tilefuse report``'s accuracy workers), whose timings would measure each other. With
    ``compile_space`` such a key also compiles, without running, the rest of its pruned space, so that
    the process that does tune it later finds every config in Triton's disk cache."""
    global _tune_missing_keys, _compile_missing_space
    _tune_missing_keys, _compile_missing_space = enabled, compile_space and not enabled


def _value_text(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


class TableAutotuner(Autotuner):
    """triton's Autotuner, plus: a stored config for a new key is put straight into its in-process cache
    (no benchmarking); a config it benchmarks is written to the user's cache."""

    def __init__(self, fn, configs, key, *, name: str, pinned: bool, prune_configs_by=None, **kwargs):
        super().__init__(fn, fn.arg_names, configs, key, kwargs.pop("reset_to_zero", None),
                         kwargs.pop("restore_value", None), prune_configs_by=prune_configs_by, **kwargs)
        self.name = name
        self.pinned = pinned
        self.records: dict[str, dict] = {}  # key text -> how this process chose its config
        names = {frozenset(c.kwargs) for c in self.configs}
        self._param_names = next(iter(names)) if len(names) == 1 else None
        # Hot path: launches whose key this process has settled skip triton's Autotuner.run and go
        # straight to the kernel (see run). Keyed by _fast_key; valid while cache and configs are the
        # objects it was filled for.
        self._key_slots = [(self.arg_names.index(k), k) for k in self.keys]
        self._settled: dict = {}
        self._settled_for = (None, None)
        self._launched = threading.local()  # the config of this thread's last launch (launched_config)

    def _key_parts(self, args, kwargs):
        all_args = {**dict(zip(self.arg_names, args)), **kwargs}
        named = {k: v for k, v in all_args.items() if k in self.arg_names}
        values = [(k, named[k]) for k in self.keys if k in named]
        dtypes = [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return values, dtypes

    def tuning_key(self, args, kwargs) -> tuple[tuple, str]:
        """(triton's key tuple, its text form). The tuple is built exactly as ``Autotuner.run`` builds
        it -- the key arguments' values, then the dtype of every argument that has one -- so a config
        put in ``self.cache`` under it is the one triton uses."""
        values, dtypes = self._key_parts(args, kwargs)
        key = tuple([v for _, v in values] + dtypes)
        text = " ".join(f"{k}={_value_text(v)}" for k, v in values)
        text += " dtypes=" + ",".join(d.replace("torch.", "") for d in dtypes)
        return key, text.strip()

    def _stored_config(self, entry: dict, path) -> triton.Config | None:
        config = config_from_dict(entry["config"])
        if self._param_names is not None and frozenset(config.kwargs) != self._param_names:
            _warn(f"tilefuse: ignoring stored config {config.kwargs} for {self.name} in {path}: its "
                  f"parameters are not the kernel's {sorted(self._param_names)}")
            return None
        return config

    def choose(self, args, kwargs) -> tuple[tuple, str, list[triton.Config]]:
        """The configs this launch would consider for its key: one (stored or pinned) or the space to
        benchmark. A chosen single config is also put in ``self.cache`` and recorded."""
        key, text = self.tuning_key(args, kwargs)
        if key in self.cache:
            return key, text, [self.cache[key]]
        if self.pinned:
            config = self._pruned(args, kwargs)[0]
            self._remember(key, text, config, "pinned (TILEFUSE_AUTOTUNE=0)", None, {"timings": []})
            return key, text, [config]
        device_name = _device_name(args)
        found = (lookup(gpu_slug(device_name), self.name, text)
                 if device_name and _use_stored_configs else None)
        if found is not None:
            entry, source, path = found
            config = self._stored_config(entry, path)
            if config is not None and not self._in_pruned_space(config, args, kwargs):
                # A table entry must be one the live space keeps for this launch: a config that cannot
                # fit it (shared memory) or does not describe it (a norm tile narrower than the row,
                # marked single-pass) would fail or compute something else.
                _warn(f"tilefuse: ignoring stored config {config.kwargs} for {self.name} in {path}: the "
                      f"kernel's prune rejects it for key {text}")
                config = None
            if config is not None:
                self._remember(key, text, config, source, path, entry)
                return key, text, [config]
        if not _tune_missing_keys:
            pruned = self._pruned(args, kwargs)
            if _compile_missing_space:
                self._compile_only(pruned[1:], args, kwargs)
            self._remember(key, text, pruned[0], UNTUNED_SOURCE, None, {"timings": []})
            return key, text, [pruned[0]]
        return key, text, list(self.configs)

    def _compile_only(self, configs, args, kwargs) -> None:
        """Compiles each config for this launch without running it (JITFunction.run's warmup)."""
        meta = {k: v for k, v in kwargs.items() if k != "warmup"}
        for config in configs:
            try:
                self.fn.run(*args, **meta, **config.all_kwargs(), warmup=True)
            except Exception:  # noqa: BLE001 - a config that cannot compile fails the same way when tuned
                pass

    def _pruned(self, args, kwargs, also: triton.Config | None = None) -> list[triton.Config]:
        """What the kernel's prune keeps for this launch from its space (plus ``also``, a stored config
        that may lie outside it); triton's prune reads self.nargs."""
        self.nargs = dict(zip(self.arg_names, args))
        try:
            if also is None:
                return self.prune_configs(kwargs)
            return self.early_config_prune(self.configs + [also], self.nargs, **kwargs)
        finally:
            self.nargs = None

    def _in_pruned_space(self, config: triton.Config, args, kwargs) -> bool:
        """A stored config passes the kernel's own prune rules for this launch (it may still be one the
        space does not list: hand-tuned entries are honoured)."""
        if not self.early_config_prune:
            return True
        wanted = config_to_dict(config)
        return any(config_to_dict(c) == wanted for c in self._pruned(args, kwargs, also=config))

    def _remember(self, key, text, config, source, path, entry) -> None:
        self.cache[key] = config
        self.records[text] = {"kernel": self.name, "key": text, "source": source,
                              "path": None if path is None else str(path), **entry,
                              "config": config_to_dict(config)}

    def _fast_key(self, args, kwargs) -> tuple:
        """Determines the same config as triton's key (the key arguments' values and every tensor
        argument's dtype) at a fraction of its cost: no dicts, no dtype strings."""
        n = len(args)
        values = tuple([args[i] if i < n else kwargs.get(name) for i, name in self._key_slots])
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        dtypes += [v.dtype for v in kwargs.values() if isinstance(v, torch.Tensor)]
        return values, tuple(dtypes)

    def run(self, *args, **kwargs):
        ret = self._run(args, kwargs)
        self._launched.config = self.best_config
        return ret

    def launched_config(self) -> triton.Config | None:
        """The config this thread's most recent launch through this tuner ran with."""
        return getattr(self._launched, "config", None)

    def _run(self, args, kwargs):
        if len(self.configs) <= 1:
            return super().run(*args, **kwargs)
        # Hot path. Python on the host costs tens of microseconds per step, and a memory-bound kernel
        # of 70 us is host-bound if its launch path is slower than that; so a settled key launches the
        # kernel directly with the config's arguments.
        if self._settled_for[0] is not self.cache or self._settled_for[1] is not self.configs:
            self._settled, self._settled_for = {}, (self.cache, self.configs)  # replaced (tests do)
        fast = self._fast_key(args, kwargs)
        hit = self._settled.get(fast)
        if hit is not None:
            self.best_config = hit[0]
            return self.fn.run(*args, **kwargs, **hit[1])
        ret = self._run_and_settle(args, kwargs)
        config = self.best_config
        if config is not None and config.pre_hook is None:
            self._settled[fast] = (config, config.all_kwargs())
        return ret

    def _run_and_settle(self, args, kwargs):
        key, text, _ = self.choose(args, kwargs)
        to_tune = key not in self.cache
        started = time.perf_counter()
        try:
            ret = super().run(*args, **kwargs)
        except (OutOfResources, PTXASError) as e:
            record = self.records.get(text, {})
            if record.get("source") not in ("user cache", "shipped"):
                raise
            _warn(f"tilefuse: stored config for {self.name} [{text}] from {record['path']} does not run "
                  f"on this GPU ({type(e).__name__}); tuning this key instead")
            del self.cache[key]
            del self.records[text]
            to_tune = True
            ret = super().run(*args, **kwargs)
        if to_tune and key in self.cache:
            self._after_tuning(args, key, text, time.perf_counter() - started)
        return ret

    def _after_tuning(self, args, key, text, seconds: float) -> None:
        best = self.cache[key]
        entry = make_entry(best, getattr(self, "configs_timings", None))
        device_name = _device_name(args)
        path = None
        if device_name is not None:
            slug = gpu_slug(device_name)
            try:
                path = store_user_entry(slug, self.name, text, entry, device_name)
            except OSError as e:
                _warn(f"tilefuse: could not write tuned config for {self.name} to "
                      f"{user_cache_path(slug, self.name)} ({e}); it will be tuned again next process")
        # The record (not the stored entry) also keeps how long tuning took: compiling and timing the space.
        self._remember(key, text, best, "autotuned", path, {**entry, "tuning_seconds": round(seconds, 2)})


def _unique_name(base: str) -> str:
    name, n = base, 1
    while name in _TUNERS:
        n += 1
        name = f"{base}_{n}"
    return name


def autotune(configs, key, prune_configs_by=None, name: str | None = None, **kwargs):
    """``triton.autotune`` for every tilefuse kernel: stored configs first (user cache, then the shipped
    table), benchmarking only for keys neither has, winners written to the user cache.
    ``TILEFUSE_AUTOTUNE=0`` pins the first (pruned) config. ``name`` names the kernel's table (default:
    the function's name, with ``_2``... for further autotuners over the same function)."""
    pinned = not autotune_enabled()

    def decorator(fn):
        base = fn
        while not hasattr(base, "__name__") and hasattr(base, "fn"):
            base = base.fn
        if name is not None and name in _TUNERS:
            raise ValueError(f"autotune name {name!r} is already used by another kernel")
        kernel = name or _unique_name(base.__name__)
        tuner = TableAutotuner(fn, configs, key, name=kernel, pinned=pinned,
                               prune_configs_by=prune_configs_by, **kwargs)
        _TUNERS[kernel] = tuner
        return tuner

    return decorator


def tuning_record(kernel_name: str) -> list[dict]:
    """How kernel ``kernel_name`` chose its config for each key it ran with in this process, in first-use
    order: ``{"kernel", "key", "source" ("autotuned" | "user cache" | "shipped" | "pinned ..."),
    "path", "config", "timings": [{"config", "ms"}, ...] fastest first}`` -- the chosen config and the
    ones it beat (empty timings when it was never benchmarked)."""
    if kernel_name not in _TUNERS:
        raise ValueError(f"unknown kernel {kernel_name!r}; autotuned kernels: {', '.join(_TUNERS)}")
    return [dict(r) for r in _TUNERS[kernel_name].records.values()]


def tuning_records() -> list[dict]:
    """:func:`tuning_record` of every autotuned kernel, concatenated."""
    return [dict(r) for t in _TUNERS.values() for r in t.records.values()]


def _config_text(config_dict: dict) -> str:
    config = config_from_dict(config_dict)
    if any(k in config.kwargs for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")):
        return describe(config)
    params = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{params} w{config.num_warps} s{config.num_stages}".strip()


def describe_record(record: dict, top: int = 4) -> str:
    """``128x256x64 w8 s3 [shipped] 0.512 ms; beat 128x128x64 w8 s4 0.601 ms (+17%), ...``"""
    chosen = config_from_dict(record["config"])
    text = f"{_config_text(record['config'])} [{record['source']}]"
    rows = record.get("timings") or []
    best_ms = next((r["ms"] for r in rows if config_from_dict(r["config"]) == chosen), None)
    if best_ms is not None:
        text += f" {best_ms:.3f} ms"
    beaten = [r for r in rows if config_from_dict(r["config"]) != chosen]
    parts = []
    for r in beaten[:top]:
        if r["ms"] is None:
            parts.append(f"{_config_text(r['config'])} failed")
        elif best_ms:
            parts.append(f"{_config_text(r['config'])} {r['ms']:.3f} ms (+{100 * (r['ms'] / best_ms - 1):.0f}%)")
        else:
            parts.append(f"{_config_text(r['config'])} {r['ms']:.3f} ms")
    if beaten:
        more = f", +{len(beaten) - top} more" if len(beaten) > top else ""
        text += "; beat " + ", ".join(parts) + more
    return text




def describe(config) -> str:
    """One-line text of a triton.Config or a kwargs dict, for reports."""
    if config is None:
        return "n/a"
    if isinstance(config, dict):
        kw, extra = config, ""
    else:
        kw, extra = config.kwargs, f" w{config.num_warps} s{config.num_stages}"
        if config.maxnreg is not None:
            extra += f" r{config.maxnreg}"
    tile = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in kw)
    flags = "".join(f" {name}" for key, name in (("WARP_SPECIALIZE", "ws"), ("EPILOGUE_SUBTILE", "subtile"))
                    if kw.get(key))
    # Row kernels: loop pipelining depth, persistent programs per SM, chunked (two-pass) rows.
    if kw.get("LOOP_STAGES", 1) > 1:
        flags += f" loop-stages {kw['LOOP_STAGES']}"
    if kw.get("PROGRAMS_PER_SM") not in (None, 0, 64):
        flags += f" {kw['PROGRAMS_PER_SM']}/SM"
    if kw.get("SINGLE_PASS") is False:
        flags += " chunked"
    return f"{tile}{extra}{flags}"

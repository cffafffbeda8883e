"""Tile configurations and how each kernel's config is chosen on a GPU.

Autotuning never runs under the Triton interpreter (it would time Python, not the GPU, and take
minutes); the interpreter uses ``INTERPRETER_GEMM`` -- large tiles, because the interpreter's cost is
per program, not per element.

How a config is chosen on a GPU
-------------------------------
Every autotuned kernel goes through :func:`autotune` (a ``triton.autotune`` whose Autotuner also reads
and writes tables). A kernel is named by its function (``linear_epilogue_kernel``; a second autotuner
over the same function gets ``_2``, ``_3``... in definition order, or pass ``name=``). Its *key* is what
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
``TILEFUSE_AUTOTUNE=0`` pins every kernel to its first (pruned) config: no tables, no benchmarking.
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

import contextlib
import datetime
import json
import math
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources, PTXASError

from tilefuse.kernels.tiling import next_pow2

try:  # POSIX advisory locks; elsewhere writers still replace atomically but may drop a concurrent key
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

TABLE_FORMAT = 1
SHIPPED_DIR = Path(__file__).with_name("configs")


def autotune_enabled() -> bool:
    """``TILEFUSE_AUTOTUNE=0`` pins each kernel to its first (pruned) config: the GPU test run uses it so
    hundreds of small test shapes do not each benchmark a config space. Read when a kernel is decorated
    (at import)."""
    return os.environ.get("TILEFUSE_AUTOTUNE", "1") != "0"


# ----------------------------------------------------------------------------------------------------
# Where tables live
# ----------------------------------------------------------------------------------------------------

def gpu_slug(device_name: str) -> str:
    """File-name form of a GPU name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def cache_dir() -> Path:
    """Root of the user's tuned-config cache (read on every use, so the variables can change)."""
    if os.environ.get("TILEFUSE_CACHE_DIR"):
        return Path(os.environ["TILEFUSE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tilefuse"


def user_cache_path(slug: str, kernel: str) -> Path:
    return cache_dir() / slug / f"{kernel}.json"


def shipped_table_path(slug: str) -> Path:
    return SHIPPED_DIR / f"{slug}.json"


def _device_name(args) -> str | None:
    """Name of the GPU the launch runs on (that of the first CUDA tensor argument); None off the GPU,
    so the interpreter never reads or writes a table."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return torch.cuda.get_device_name(a.device)
    return None


# ----------------------------------------------------------------------------------------------------
# Configs and table entries as JSON
# ----------------------------------------------------------------------------------------------------

def config_to_dict(config: triton.Config) -> dict:
    d = {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
         "num_ctas": config.num_ctas}
    if config.maxnreg is not None:
        d["maxnreg"] = config.maxnreg
    return d


def _is_count(v, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def config_from_dict(d) -> triton.Config:
    """Inverse of :func:`config_to_dict`; ValueError (saying what is wrong) on anything malformed."""
    if not isinstance(d, dict) or not isinstance(d.get("kwargs"), dict):
        raise ValueError(f"config must be an object with a 'kwargs' object, got {d!r}")
    unknown = set(d) - {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}
    if unknown:
        raise ValueError(f"config has unknown fields {sorted(unknown)}")
    for k, v in d["kwargs"].items():
        if not isinstance(v, (int, float, str, bool)) and v is not None:
            raise ValueError(f"config kwarg {k}={v!r} is not a number, string or bool")
    warps, stages, ctas = d.get("num_warps", 4), d.get("num_stages", 3), d.get("num_ctas", 1)
    maxnreg = d.get("maxnreg")
    if not (_is_count(warps, 1) and _is_count(stages, 0) and _is_count(ctas, 1)
            and (maxnreg is None or _is_count(maxnreg, 1))):
        raise ValueError(f"config num_warps/num_stages/num_ctas/maxnreg must be positive integers, got {d!r}")
    return triton.Config(dict(d["kwargs"]), num_warps=warps, num_stages=stages, num_ctas=ctas,
                         maxnreg=maxnreg)


def _median_ms(timing) -> float | None:
    """triton's timing of one config: a float or [median, p20, p80]; inf (failed to compile) -> None."""
    ms = timing[0] if isinstance(timing, (list, tuple)) else timing
    ms = float(ms)
    return ms if math.isfinite(ms) else None


def make_entry(best: triton.Config, timings: dict | None) -> dict:
    """A table entry: the chosen config and every timed config, fastest first (failed ones last)."""
    rows = [{"config": config_to_dict(c), "ms": _median_ms(t)} for c, t in (timings or {}).items()]
    rows.sort(key=lambda r: (r["ms"] is None, r["ms"] or 0.0))
    return {"config": config_to_dict(best), "timings": rows, "triton": triton.__version__,
            "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _check_entry(entry) -> None:
    if not isinstance(entry, dict):
        raise ValueError("entry is not an object")
    config_from_dict(entry.get("config"))
    timings = entry.get("timings", [])
    if not isinstance(timings, list):
        raise ValueError("entry 'timings' is not a list")
    for row in timings:
        if not isinstance(row, dict) or not (row.get("ms") is None or isinstance(row["ms"], (int, float))):
            raise ValueError(f"timing {row!r} is not {{config, ms}}")
        config_from_dict(row.get("config"))


# ----------------------------------------------------------------------------------------------------
# Reading and writing tables
# ----------------------------------------------------------------------------------------------------

def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _read_json(path: Path):
    """The file's JSON, or None if it does not exist. A file that cannot be read or parsed is ignored
    with a warning naming it (a torn or hand-broken table must not stop a kernel from running)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(f"tilefuse: ignoring tuned-config table {path}: cannot read it ({e})")
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        _warn(f"tilefuse: ignoring tuned-config table {path}: not valid JSON ({e})")
        return None


def _valid_entries(entries, path: Path, where: str) -> dict:
    if not isinstance(entries, dict):
        _warn(f"tilefuse: ignoring tuned-config table {path}: {where} is not an object")
        return {}
    kept = {}
    for key, entry in entries.items():
        try:
            _check_entry(entry)
        except ValueError as e:
            _warn(f"tilefuse: ignoring entry {key!r} of {path}: {e}")
            continue
        kept[key] = entry
    return kept


def _check_format(data, path: Path) -> bool:
    if not isinstance(data, dict):
        _warn(f"tilefuse: ignoring tuned-config table {path}: top level is not an object")
        return False
    if data.get("format") != TABLE_FORMAT:
        _warn(f"tilefuse: ignoring tuned-config table {path}: format {data.get('format')!r}, "
              f"this tilefuse reads format {TABLE_FORMAT}")
        return False
    return True


def load_user_entries(path: Path) -> dict:
    """{key: entry} of one kernel's user-cache file ({} when missing or unusable)."""
    data = _read_json(path)
    if data is None or not _check_format(data, path):
        return {}
    return _valid_entries(data.get("entries"), path, "'entries'")


def load_shipped_table(path: Path) -> dict:
    """{kernel: {key: entry}} of a shipped table ({} when missing or unusable)."""
    data = _read_json(path)
    if data is None or not _check_format(data, path):
        return {}
    kernels = data.get("kernels")
    if not isinstance(kernels, dict):
        _warn(f"tilefuse: ignoring tuned-config table {path}: 'kernels' is not an object")
        return {}
    return {name: _valid_entries(entries, path, f"kernel {name!r}") for name, entries in kernels.items()}


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive lock beside ``path`` for a read-merge-replace, so concurrent writers keep each other's keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def atomic_write_json(path: Path, data) -> None:
    """Write to a temp file in the same folder, then ``os.replace``: readers see the old or the new file,
    never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def store_user_entry(slug: str, kernel: str, key: str, entry: dict, gpu_name: str | None = None) -> Path:
    """Merge one key's entry into the user's cache for this GPU and kernel; returns the file."""
    path = user_cache_path(slug, kernel)
    with _locked(path):
        entries = load_user_entries(path)
        entries[key] = entry
        atomic_write_json(path, {"format": TABLE_FORMAT, "gpu": gpu_name or slug, "kernel": kernel,
                                 "entries": entries})
    return path


def write_table(path, records: list[dict], gpu_name: str) -> int:
    """Merge records (as returned by :func:`tuning_records`) into a table in the shipped format at
    ``path`` (created if missing; an existing valid table keeps its other keys). Returns the number of
    keys written."""
    path = Path(path)
    with _locked(path):
        kernels = load_shipped_table(path)
        for r in records:
            kernels.setdefault(r["kernel"], {})[r["key"]] = {
                k: r[k] for k in ("config", "timings", "triton", "tuned_at") if k in r}
        atomic_write_json(path, {"format": TABLE_FORMAT, "gpu": gpu_name, "kernels": kernels})
    return len(records)


def lookup(slug: str, kernel: str, key: str):
    """The stored entry for (GPU, kernel, key): the user's cache first, then the shipped table.
    Returns (entry, source, path) or None."""
    path = user_cache_path(slug, kernel)
    entry = load_user_entries(path).get(key)
    if entry is not None:
        return entry, "user cache", path
    path = shipped_table_path(slug)
    entry = load_shipped_table(path).get(kernel, {}).get(key)
    if entry is not None:
        return entry, "shipped", path
    return None


# ----------------------------------------------------------------------------------------------------
# The autotuner every kernel uses
# ----------------------------------------------------------------------------------------------------

_TUNERS: dict[str, "TableAutotuner"] = {}
_use_stored_configs = True


def use_stored_configs(enabled: bool) -> None:
    """False: ignore the user cache and shipped table (``tilefuse tune --retune``); winners are still written."""
    global _use_stored_configs
    _use_stored_configs = enabled


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
        self.keep_last_launch = False
        self.last_launch = None

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
        return key, text, list(self.configs)

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
        if self.keep_last_launch:  # kernels/relaunch.py asked for this launch's compiled kernel and arguments
            self.last_launch = (ret, args, kwargs, self.best_config)
        return ret

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
            self._after_tuning(args, key, text)
        return ret

    def _after_tuning(self, args, key, text) -> None:
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
        self._remember(key, text, best, "autotuned", path, entry)


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


def tune_ops(op_names: list[str], dtypes: list[str] | None = None, seed: int = 0, device="cuda",
             log=print) -> list[str]:
    """Run the fused function of each named registry op on each of its bench cases (optionally only
    the given dtype names, e.g. ``["bf16"]``), so every kernel behind them picks a config for each key
    they hit. A case that fails is logged and the others still run; returns the failures as text."""
    from tilefuse import registry
    from tilefuse.opspec import dtype_name

    device = torch.device(device)
    failures = []
    for op in op_names:
        spec = registry.get(op)
        cases = [p for p in spec.bench_cases if dtypes is None or dtype_name(p["dtype"]) in dtypes]
        for params in cases:
            label = f"{op} {spec.label(params)} {dtype_name(params['dtype'])}"
            start = time.perf_counter()
            try:
                inputs = spec.make_inputs(params, device, seed)
                with torch.no_grad():
                    spec.fused(**inputs)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as e:  # report it and go on with the other cases; the caller exits non-zero
                failures.append(f"{label}: {type(e).__name__}: {e}")
                log(f"  FAILED {label}: {type(e).__name__}: {e}")
                continue
            finally:
                inputs = None
            log(f"  {label}: {time.perf_counter() - start:.1f} s")
    return failures


# ----------------------------------------------------------------------------------------------------
# Config spaces
# ----------------------------------------------------------------------------------------------------

INTERPRETER_GEMM = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)


def _gemm_config(bm, bn, bk, warps, stages, group=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group),
                         num_warps=warps, num_stages=stages)


# Portable GEMM space: a few shapes that cover large square-ish problems (128x256), mid-size (128x128)
# and skinny M (64xN). Configs that do not fit in shared memory for fp32 are dropped by the autotuner
# (OutOfResources) rather than listed per dtype.
PORTABLE_GEMM_CONFIGS = [
    _gemm_config(128, 256, 64, 8, 3),
    _gemm_config(256, 128, 64, 8, 3),
    _gemm_config(128, 128, 64, 8, 4),
    _gemm_config(128, 128, 32, 4, 4),
    _gemm_config(64, 128, 64, 4, 4),
    _gemm_config(64, 64, 64, 4, 4),
    _gemm_config(32, 64, 32, 4, 4),
]


def m_bucket(m: int) -> int:
    """Autotune key for the row count: the next power of two, so a new batch size rarely retunes."""
    return next_pow2(m) if m > 0 else 0


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


# Hopper TMA persistent GEMM space (kernels/gemm_tma.py), as dicts so benchmarks can pin one.
# 128x256x64 with 3 stages is the classic Hopper bf16 shape (two consumer warpgroups of 64 rows);
# 128x128 serves mid-size N; 64-row tiles serve small M (wgmma's minimum M is 64).
# Small-M split-K GEMM (decode shapes): 16/32/64-row tiles, narrow columns for more programs, long K
# steps to keep loads in flight. SPLIT_K_ALIGN: K slices are multiples of it (the largest BLOCK_K here
# and in INTERPRETER_GEMM), so no K step straddles two slices.
SPLIT_K_GEMM_CONFIGS = [
    _gemm_config(bm, bn, bk, 4, stages, group=1)
    for bm, bn, bk, stages in ((16, 64, 128, 4), (16, 32, 128, 5), (32, 64, 128, 4), (64, 64, 128, 3),
                               (16, 128, 64, 4))
]
SPLIT_K_ALIGN = 128

TMA_GEMM_CONFIGS = [
    dict(bm=128, bn=256, bk=64, stages=3, warps=8),
    dict(bm=128, bn=128, bk=64, stages=4, warps=8),
    dict(bm=128, bn=128, bk=64, stages=4, warps=4),
    dict(bm=64, bn=128, bk=64, stages=4, warps=4),
    dict(bm=64, bn=256, bk=64, stages=4, warps=4),
    # One 128x128 store instead of two halves. The compiler gives the subtiled epilogue one staging buffer,
    # so the second half waits for the first half's TMA store to finish (sm_90a TTGIR: a
    # tma_store_wait{0} between them); with short K loops (K <= 1024) that stall is a visible share of a
    # tile. Unsplit, the only wait is at the next tile's epilogue. sm_90a: 133 registers, no spills.
    dict(bm=128, bn=128, bk=64, stages=4, warps=8, subtile=False),
    # Four stages on the largest tile: 229 KB shared (the H200 allows 227 KiB = 232 KB), with and without
    # NORM; sm_90a with NORM (x into wgmma from registers) and a GELU epilogue: 254 / 245 registers (layer / rms),
    # no spills.
    dict(bm=128, bn=256, bk=64, stages=4, warps=8),
]

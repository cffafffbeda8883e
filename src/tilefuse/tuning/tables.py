"""Tuned-config tables on disk: the user's per-GPU cache and the tables shipped in the package.

A table maps (GPU, kernel, key) to the chosen ``triton.Config`` and the timings of the configs it beat.
Writers take a lock file and replace a table atomically (temp file + ``os.replace``), so concurrent
processes neither tear a file nor lose each other's keys; a corrupt or partial file is ignored with a
warning naming it.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch
import triton

try:  # POSIX advisory locks; elsewhere writers still replace atomically but may drop a concurrent key
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

TABLE_FORMAT = 1
SHIPPED_DIR = Path(__file__).parent.parent / "configs"


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



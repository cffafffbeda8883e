"""Which implementation of an op a call takes: tilefuse's kernels or a vendor composition (cuBLAS, cuDNN,
torch's own kernels), chosen per shape bucket by measurement on the GPU, like a kernel's config.

A :class:`BackendChoice` is declared once per op family's entry point in its launch module, with the names of
its candidates (tilefuse's first). A call names the candidates its semantics allow (an erf GELU has no
cuBLASLt epilogue), the backend in force (``auto``, ``tilefuse`` or ``vendor``; ``tilefuse.runtime.backend``)
and a key text (shape bucket and dtypes); the choice answers one candidate:

- ``tilefuse``: tilefuse's candidate; ``vendor``: the vendor candidates only (tilefuse's when the call has
  none); either way, when one candidate is left, no lookup and no measurement;
- ``auto``: the in-process cache, then the stored choice of that key (the user cache, then the shipped table,
  as for kernel configs: the entry's config is ``{"kwargs": {"BACKEND": name}}``), then -- on a CUDA device,
  outside CUDA-graph capture and tracing, where tuning is enabled -- each allowed candidate is timed
  (``triton.testing.do_bench`` over the call itself, so a host-bound candidate pays its host time; those within
  CLOSE_CALL of the fastest a second time) and the fastest is kept and written to the user cache; otherwise
  tilefuse's candidate, recorded as not measured.

A candidate measured must be free of side effects on its inputs (it allocates its outputs). Records of the
choices made (:func:`choice_records`) feed the report, as :func:`tuning_records` do for kernels.
"""
from __future__ import annotations

import threading
import time

import torch
import triton

from tilefuse.tuning import autotuner
from tilefuse.tuning.tables import gpu_slug, lookup, make_entry, store_user_entry

TILEFUSE = "tilefuse"
NOT_MEASURED = "tilefuse's (not measured)"
_CHOICES: dict[str, "BackendChoice"] = {}


class ChoiceKey(tuple):
    """The key of one choice: its fields' values as a tuple (cheap to build and hash on every call) and, for
    the tables, their text ``N=4096 M_BUCKET=8192 ... dtypes=bfloat16`` (the ``dtype`` field last)."""

    def __new__(cls, **fields):
        return super().__new__(cls, tuple(fields.items()))

    def text(self) -> str:
        fields = dict(self)
        dtype = fields.pop("dtype", None)
        head = " ".join(f"{k}={autotuner._value_text(v)}" for k, v in fields.items())
        return head + ("" if dtype is None else f" dtypes={str(dtype).replace('torch.', '')}")


def _config(name: str) -> triton.Config:
    return triton.Config({"BACKEND": name})


# Candidates within this fraction of the fastest are timed a second time (BackendChoice._decide).
CLOSE_CALL = 0.10
# do_bench's timed window per candidate and round, in ms: two rounds of a close call cost what one of
# do_bench's default 100 ms did.
CHOICE_REP_MS = 50


def _median_ms(run, name: str) -> float:
    return triton.testing.do_bench(lambda: run(name), rep=CHOICE_REP_MS, return_mode="median")


class BackendChoice:
    """The measured choice among one entry point's implementations (see the module doc). ``name`` names its
    table (e.g. ``norm_forward_backend``); ``candidates`` lists every implementation, tilefuse's first."""

    def __init__(self, name: str, candidates: tuple[str, ...]):
        if name in _CHOICES:
            raise ValueError(f"a backend choice named {name!r} exists already")
        if not candidates or candidates[0] != TILEFUSE:
            raise ValueError(f"{name}: the first candidate must be {TILEFUSE!r}, got {candidates!r}")
        self.name, self.candidates = name, tuple(candidates)
        self.cache: dict = {}  # (allowed candidates, key text) -> candidate
        self.records: dict[str, dict] = {}  # key text -> how this process chose
        self._allowed: dict = {}  # (mode, available) -> allowed candidates
        self.generation = 0  # bumped by clear: replay plans made through this choice check it
        self._lock = threading.Lock()
        _CHOICES[name] = self

    def allowed(self, mode: str, available) -> tuple[str, ...]:
        """The candidates a call may take under backend ``mode`` among ``available`` (those its semantics allow);
        asked on every call that does not replay, hence kept per (mode, available)."""
        found = self._allowed.get((mode, available))
        if found is None:
            found = self._allowed[(mode, available)] = self._allowed_among(mode, tuple(available))
        return found

    def _allowed_among(self, mode: str, available: tuple) -> tuple[str, ...]:
        unknown = set(available) - set(self.candidates)
        if unknown:
            raise ValueError(f"{self.name}: unknown candidates {sorted(unknown)}")
        if mode == "tilefuse":
            return (TILEFUSE,)
        vendor = tuple(c for c in available if c != TILEFUSE)
        if mode == "vendor":
            return vendor or (TILEFUSE,)
        return (TILEFUSE, *vendor) if TILEFUSE in available or not vendor else vendor

    def choose(self, mode: str, available, key: ChoiceKey, device: torch.device, run) -> str:
        """The candidate this call takes. ``run(candidate)`` runs that candidate on the call's own arguments
        (only called to measure, on a CUDA device)."""
        allowed = self.allowed(mode, available)
        if len(allowed) == 1:
            return allowed[0]
        hit = self.cache.get((allowed, key))
        if hit is not None:
            return hit
        # auto's allowed set follows from the call's semantics, which its key already tells apart.
        text = key.text() if mode == "auto" else f"{key.text()} among={','.join(allowed)}"
        with self._lock:
            chosen = self._decide(allowed, text, device, run)
            self.cache[(allowed, key)] = chosen
        return chosen

    def _decide(self, allowed, text, device, run) -> str:
        cuda = device.type == "cuda"
        slug = gpu_slug(torch.cuda.get_device_name(device)) if cuda else None
        if slug is not None and autotuner._use_stored_configs:
            found = lookup(slug, self.name, text)
            if found is not None:
                entry, source, path = found
                name = entry["config"]["kwargs"].get("BACKEND")
                if name in allowed:
                    self._record(text, name, source, str(path), entry)
                    return name
        if not (cuda and autotuner.autotune_enabled() and autotuner._tune_missing_keys
                and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling()):
            self._record(text, allowed[0], NOT_MEASURED, None, {"timings": []})
            return allowed[0]
        started = time.perf_counter()
        timings = {}
        for name in allowed:
            try:
                timings[_config(name)] = _median_ms(run, name)
            except Exception:  # noqa: BLE001 - a candidate that fails on this shape is never chosen
                timings[_config(name)] = None
        usable = [(ms, c) for c, ms in timings.items() if ms is not None]
        if not usable:
            raise RuntimeError(f"{self.name}: every candidate failed for {text}")
        # A close call is timed again, in the reverse order, each candidate keeping its faster median: the GPU's
        # clocks drift over a measurement (a candidate timed later may run cooler or hotter), and two
        # implementations of the same math are often within that drift.
        fastest = min(ms for ms, _ in usable)
        close = [c for ms, c in usable if ms <= fastest * (1 + CLOSE_CALL)]
        if len(close) > 1:
            for c in reversed(close):
                try:
                    timings[c] = min(timings[c], _median_ms(run, c.kwargs["BACKEND"]))
                except Exception:  # noqa: BLE001 - it ran once: its first time stands
                    pass
            usable = [(ms, c) for c, ms in timings.items() if ms is not None]
        best = min(usable, key=lambda r: r[0])[1]
        entry = make_entry(best, {c: float("inf") if ms is None else ms for c, ms in timings.items()})
        name = best.kwargs["BACKEND"]
        path = None
        try:
            path = store_user_entry(slug, self.name, text, entry, torch.cuda.get_device_name(device))
        except OSError:
            pass  # measured again in the next process
        self._record(text, name, "measured", None if path is None else str(path),
                     {**entry, "tuning_seconds": round(time.perf_counter() - started, 2)})
        return name

    def _record(self, text, name, source, path, entry) -> None:
        self.records[text] = {"kernel": self.name, "key": text, "source": source, "path": path, **entry,
                              "config": {"kwargs": {"BACKEND": name}}}

    def clear(self) -> None:
        self.cache.clear()
        self.records.clear()
        self.generation += 1


def choice_records() -> list[dict]:
    """How every backend choice chose, per key, in this process (the format of ``tuning_records``)."""
    return [dict(r) for c in _CHOICES.values() for r in c.records.values()]


def clear_choices() -> None:
    """Forget every in-process choice (tests; after changing the backend tables)."""
    for c in _CHOICES.values():
        c.clear()

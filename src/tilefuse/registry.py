"""One OpSpec per op: tests, ``tilefuse bench``/``report`` and the plots all read this registry.

Adding an op means one kernel file, one op in ``tilefuse.ops`` and one module in
``tilefuse.opspecs`` that defines ``SPECS = [OpSpec(...), ...]``; nothing in the harness changes.
"""
from __future__ import annotations

import importlib
import pkgutil

from tilefuse.opspec import OpSpec


def _load() -> dict[str, OpSpec]:
    from tilefuse import opspecs

    specs: dict[str, OpSpec] = {}
    for mod in sorted(pkgutil.iter_modules(opspecs.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"tilefuse.opspecs.{mod.name}")
        for spec in module.SPECS:
            if spec.name in specs:
                raise RuntimeError(f"op {spec.name!r} is declared twice")
            specs[spec.name] = spec
    return specs


REGISTRY: dict[str, OpSpec] = _load()


def get(name: str) -> OpSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(REGISTRY)}") from None

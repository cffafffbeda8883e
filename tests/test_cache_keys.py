"""Triton's disk-cache key of every tilefuse kernel is the same whichever kernel a process keys first
(kernels/cache_keys.py): otherwise a kernel compiled in one process (a report worker) is compiled again in the next."""
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
KEYS = r'''
import importlib, json, pathlib, sys
import tilefuse.kernels as kernels
from triton.runtime.jit import JITFunction
root = pathlib.Path(kernels.__path__[0])
names = sorted("tilefuse.kernels." + ".".join(p.relative_to(root).with_suffix("").parts)
               for p in root.rglob("*.py") if p.name != "__init__.py")
fns = {}
for name in names:
    module = importlib.import_module(name)
    for attr, value in vars(module).items():
        if isinstance(value, JITFunction) and value.__module__ == name:
            fns[f"{name}.{attr}"] = value
order = sorted(fns, reverse=sys.argv[1] == "reverse")
print(json.dumps({n: fns[n].cache_key for n in order}))
'''


def _keys(*orders: str) -> list[dict]:
    """Each order's keys, from processes of their own run side by side."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter has no cache keys
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    runs = [subprocess.Popen([sys.executable, "-c", KEYS, order], env=env, stdout=subprocess.PIPE, text=True)
            for order in orders]
    outs = [run.communicate()[0] for run in runs]
    assert all(run.returncode == 0 for run in runs)
    return [json.loads(out.splitlines()[-1]) for out in outs]


def test_every_kernels_key_is_the_same_whichever_is_keyed_first():
    forward, reverse = _keys("forward", "reverse")
    assert len(forward) > 50  # every kernel and helper of the package was found
    differ = sorted(n for n in forward if forward[n] != reverse[n])
    assert not differ, differ

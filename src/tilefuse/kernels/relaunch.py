"""Issuing a compiled Triton kernel again without Triton's Python launch path.

Nothing is fused here; this is about the host. `JITFunction.run` binds and specializes every argument
on every call (alignment, ints equal to 1 or divisible by 16), hashes a cache key and builds launch
metadata before it reaches the C launcher: about 30 us of Python per call for the 33-parameter GEMM
kernel on our CPU VM (benchmarks/triton_launch_cpu.py). A decode GEMM runs for 20 us, so that call
is host-bound. A caller that knows a new launch specializes exactly as an earlier one (same shapes,
strides, dtypes, 16-byte alignment of every pointer: the caller's cache key says so) can capture the
earlier launch -- the compiled kernel, the grid, every argument in parameter order -- and issue it
again with only the tensors replaced. Launch hooks (profilers) still get their metadata.
"""
from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime.driver import driver


class Relaunch:
    """A captured launch. ``relaunch(*tensors)`` issues it again with the arguments at ``positions``
    replaced by ``tensors`` (same order), on the current stream of the device that was current at
    capture (a caller's key must include the current device)."""

    __slots__ = ("_kernel", "_grid", "_args", "_positions", "_tuner", "_tuner_state", "_device", "_stream_of")

    def __init__(self, kernel, grid, args, positions, tuner):
        self._kernel = kernel
        self._grid = grid
        self._args = args
        self._positions = positions
        self._tuner = tuner
        self._tuner_state = (tuner.cache, tuner.configs)
        # The compiled function belongs to the device current at capture: callers key replays on it.
        self._device = driver.active.get_current_device()
        self._stream_of = driver.active.get_current_stream

    def current(self) -> bool:
        """False once the tuner's config cache or space was replaced (tests, `tilefuse.tuning` resets):
        the captured config may no longer be the one the tuner would choose."""
        return self._tuner.cache is self._tuner_state[0] and self._tuner.configs is self._tuner_state[1]

    def __call__(self, *tensors):
        args = self._args.copy()
        for pos, t in zip(self._positions, tensors):
            args[pos] = t
        k = self._kernel
        g0, g1, g2 = self._grid
        stream = self._stream_of(self._device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = None if enter is None else k.launch_metadata(self._grid, stream, *args)
        k.run(g0, g1, g2, stream, k.function, k.packed_metadata, meta, enter, leave, *args)


class Replay:
    """An op's replay of a captured launch: ``call(...)`` (the op's tensors mapped to the launch's
    tensor arguments) and ``current()`` (Relaunch.current)."""

    __slots__ = ("call", "current")

    def __init__(self, relaunch: Relaunch, call):
        self.call = call
        self.current = relaunch.current


def launch_and_capture(tuner, grid, args: tuple, kwargs: dict, positions: tuple[int, ...]) -> Relaunch | None:
    """``tuner[grid](*args, **kwargs)`` (a tuning.TableAutotuner), and that launch as a Relaunch whose
    arguments at ``positions`` -- which must be every tensor argument -- are given per call. None when
    it cannot be replayed: the interpreter, a config with a pre-hook, a tensor argument outside
    ``positions`` (it would be a stale pointer on replay)."""
    tuner.keep_last_launch = True
    try:
        tuner[grid](*args, **kwargs)
        last, tuner.last_launch = tuner.last_launch, None
    finally:
        tuner.keep_last_launch = False
    if last is None:
        return None
    compiled, launched_args, kwargs, config = last
    if len(launched_args) != len(args) or any(a is not b for a, b in zip(launched_args, args)):
        return None  # another thread launched through this tuner in between: not our launch
    if config is None or config.pre_hook is not None or not hasattr(compiled, "packed_metadata"):
        return None
    kwargs = {**kwargs, **config.all_kwargs()}
    # Every parameter in order, as Triton's binder hands them to the C launcher (constexprs included).
    params = list(inspect.signature(tuner.base_fn).parameters.values())
    bound = []
    for i, param in enumerate(params):
        if i < len(args):
            bound.append(args[i])
        elif param.name in kwargs:
            bound.append(kwargs[param.name])
        elif param.default is not inspect.Parameter.empty:
            bound.append(param.default)
        else:
            return None
    grid = kwargs.get("grid")
    if callable(grid):
        grid = grid(dict(zip([p.name for p in params], bound)))
    if grid is None:
        return None
    grid = tuple(grid) + (1,) * (3 - len(grid))
    for pos in positions:
        bound[pos] = None  # the capture's tensors are not kept alive by the replay
    if any(isinstance(a, torch.Tensor) for a in bound):
        return None
    return Relaunch(compiled, grid, bound, tuple(positions), tuner)

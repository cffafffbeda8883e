"""The host's one fast path, used by every op family's launch module the same way.

Nothing is fused here; this is about the host. A decode GEMM or a small norm runs for 10-20 us on the
GPU, less than the Python of a full launch path: the dispatch's decisions, the autotuner's lookup and
Triton's ``JITFunction.run`` (which binds and specializes every argument on every call). A call whose
tensors have the shapes, strides, dtypes, devices and 16-byte alignment of an earlier call, with the
same scalar arguments on the same stream, decides everything the same way: the launch module then
replays that call's captured launches with only the pointers replaced.

How a launch module uses it (each family's ``launch.py``)::

    _PLANS = fastpath.Plans("linear")

    def linear(x, weight, bias, ...):
        return _PLANS.run((x, weight, bias), (activation, precision), lambda: _linear(x, weight, ...))

``Plans.run`` keys the call (:func:`signature`); on a hit it allocates the outputs the first call
returned (same shapes, strides, dtypes) and issues each captured launch through Triton's C launcher.
On a miss it runs the full path once under a capture: every kernel launch of the launch layer goes
through :func:`launch`, which records the compiled kernel, its grid and its bound arguments. The plan
is kept only when every tensor argument of every launch is one of the call's inputs or outputs (or a
view into one, at a fixed byte offset) or a buffer registered with :func:`persistent`, and every
output is written by some launch; anything else (a temporary, an output written by a torch op) makes
the key take the full path every time. The rule for launch modules: outputs are produced only by
kernels launched through :func:`launch`, and a temporary a launch reads is returned beside them.

A call that takes a vendor composition (torch's, cuBLAS's or cuDNN's kernels, chosen by ``run_chosen``) replays
too: the launch module runs the candidate through :func:`vendor`, and a call whose only work was that one
function, on the call's own input tensors, returning the call's outputs as they are, keeps a plan that calls the
function again on the next call's tensors, skipping the module's decisions (and the launch path of any kernel of
tilefuse's the composition itself launches). A plan of either kind made through a choice among candidates holds
until that choice forgets its answers (``BackendChoice.clear``).

A Gluon host TMA descriptor argument (``TensorDescriptor``) follows the same rule through its base
tensor: the plan keeps its view (shape, strides, padding: fixed by the key), and a replay hands
Triton's launcher a descriptor of the same view at the new call's address, which the launcher encodes
as it encodes the full path's. ``REPLAY_HOST_DESCRIPTORS = False`` keeps a launch with a host descriptor
on the full path.

Any change of a switch (kernels/switches.py: the forms an op may take) drops every family's plans at its next
call: a plan holds the kernels the switches chose when it was captured.

Interpreter and reference calls never replay (:func:`signature` is None off the compiled path).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading

import torch
from triton import knobs
from triton.runtime.driver import driver

from tilefuse import runtime
from tilefuse.kernels import launches, switches
from tilefuse.kernels.tiling import ensure_descriptor_allocator

if runtime.interpreter_enabled():  # every launch passes through this module: the interpreter's two fixes
    from tilefuse.kernels import interpreter

    interpreter.install()

_local = threading.local()
_PERSISTENT: dict[int, torch.Tensor] = {}  # data_ptr -> buffer kept for the process (split-K workspaces)
_NO_PLAN = object()
_FAMILIES: list["Plans"] = []  # every op family's plans, for clear_all
MAX_PLANS = 4096  # distinct keys kept per op family; beyond that new keys simply take the full path
# Plans may hold launches with Gluon host TMA descriptors (the attention passes), rebuilt at each replay's
# addresses; checked against the full path's descriptors on a CPU (tests/test_host_path.py) and bit for bit on the
# GPU (tests/test_attention_backward.py). False keeps such launches on the full path.
REPLAY_HOST_DESCRIPTORS = True


def persistent(t: torch.Tensor) -> torch.Tensor:
    """Registers a buffer that lives for the process (never freed or moved): replays may use its
    address as a constant. Returns ``t``."""
    _PERSISTENT[t.data_ptr()] = t
    return t


@contextlib.contextmanager
def aside():
    """Launches inside are neither captured into the plan being made nor recorded: a launch module's work
    besides the call itself, such as timing its candidate implementations once (``tuning.choices``)."""
    saved = getattr(_local, "capture", None)
    _local.capture = None
    try:
        with launches.paused():
            yield
    finally:
        _local.capture = saved


def run_aside(fn, *args):
    """``fn(*args)`` inside :func:`aside`."""
    with aside():
        return fn(*args)


def run_chosen(choice, mode: str, available: tuple, key, device, run):
    """``run(candidate)`` for the candidate ``choice`` (a ``tuning.BackendChoice``) takes under backend ``mode``
    among ``available``. ``key()`` makes the choice's key, only where more than one candidate is allowed (so a
    call with one, such as any call under ``tilefuse``, builds none); a candidate timed to choose runs aside, as its
    replays would run (:func:`_as_replayed`)."""
    allowed = choice.allowed(mode, available)
    if len(allowed) == 1:
        return run(allowed[0])
    candidate = choice.choose(mode, available, _with_switches(key()), device, _as_replayed(run))
    capture = getattr(_local, "capture", None)
    if capture is not None:  # a plan made of this call holds until the choice forgets what it answered
        capture.choices.append((choice, choice.generation))
    return run(candidate)


def _with_switches(key):
    """``key`` (a ``tuning.ChoiceKey``) with the switches away from their defaults as one more field: what was
    measured (or stored) for one setting of the switches is not the answer for another, since the switches decide
    which of tilefuse's kernels a candidate runs. At the defaults the key is unchanged (the shipped tables' keys)."""
    changed = switches.non_default()
    if not changed:
        return key
    return type(key)(**dict(key), switches=changed)


def _as_replayed(run):
    """``run(candidate)`` as a choice times it: each candidate as the calls after the choice take it, through this
    module's replays. A candidate's first call runs in full under a capture of its own (aside from the plan being
    made, if any); each later call reissues those launches through Triton's C launcher with the same arguments (and
    allocates outputs as a plan's replay does), so that tilefuse's kernels are timed with a replay's host cost, not
    with that of the full launch path (the autotuner's lookup, Triton's binding, TMA descriptors) that only a first
    call pays -- on a host-bound shape that full path would decide for the vendor. A candidate with nothing to
    reissue (a vendor composition, which its plan calls again; a launch whose arguments cannot be bound) is called
    in full each time. The reissue does not ask whether a plan would hold (a launch touching a temporary keeps a
    call off the fast path): the calls the families make replay (tests/test_host_path.py), and one that does not
    is timed here as if it did."""
    replays: dict = {}

    def call(candidate):
        replay = replays.get(candidate)
        if replay is not None:
            return replay()
        out, replays[candidate] = _first_call_and_replay(run, candidate)
        return out
    return call


def _first_call_and_replay(run, candidate):
    """(``run(candidate)``'s output, a callable reissuing its launches) -- see :func:`_as_replayed`."""
    saved = getattr(_local, "capture", None)
    capture = _local.capture = _Capture()
    try:
        with launches.paused():
            out = run(candidate)
    finally:
        _local.capture = saved
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else ()
    if (capture.vendor or not capture.ok or not capture.launches or not outs
            or not all(isinstance(t, torch.Tensor) for t in outs)):
        return out, lambda: run_aside(run, candidate)
    return out, _Reissue(capture.launches, outs)


class _Reissue:
    """A captured call's launches reissued with the same arguments, the outputs allocated anew as a plan's replay
    allocates them (and left unwritten: the launches write the first call's outputs again). It holds the captured
    arguments, so every tensor the addresses point into -- the first call's outputs, any temporary of the launch
    layer -- lives as long as it does."""

    def __init__(self, captured, outs):
        self.captured = captured
        # Pointers as addresses, as a plan passes them.
        self.steps = [(compiled, grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in bound])
                      for compiled, grid, bound, _ in captured]
        self.outputs = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in outs]
        self.device = outs[0].device
        self.scratch = any(getattr(getattr(c, "metadata", None), "global_scratch_size", 0) for c, _, _ in self.steps)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.stream = driver.active.get_current_stream(index)

    def __call__(self):
        if self.scratch:
            ensure_descriptor_allocator()
        fresh = [torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
                 for shape, stride, dtype in self.outputs]
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        stream = self.stream
        for k, grid, args in self.steps:
            meta = None if enter is None else k.launch_metadata(grid, stream, *args)
            k.run(grid[0], grid[1], grid[2], stream, k.function, k.packed_metadata, meta, enter, leave, *args)
        return fresh


def vendor(fn, *args):
    """``fn(*args)``: a launch module's vendor composition (torch's, cuBLAS's or cuDNN's kernels). While a plan is
    captured, the outermost such call is noted, so that the plan can replay it (see the module doc)."""
    capture = getattr(_local, "capture", None)
    if capture is None or getattr(_local, "in_vendor", False):
        return fn(*args)
    _local.in_vendor = True
    before = len(capture.launches)
    try:
        out = fn(*args)
    finally:
        _local.in_vendor = False
    capture.vendor.append((fn, args, out, len(capture.launches) - before))
    return out


def clear_all() -> None:
    """Forget every family's plans (tests; after changing tuned configs in this process)."""
    for family in _FAMILIES:
        family.clear()


def _tensor_key(t):
    return (t.shape, t.stride(), t.dtype, t.data_ptr() % 16)


def signature(tensors: tuple, scalars: tuple):
    """The key of a call: every tensor's (shape, strides, dtype, 16-byte alignment) or None, the scalar
    arguments, the device and the current stream. None (no fast path) unless the first tensor is a CUDA
    tensor on the compiled path."""
    x = tensors[0]
    if runtime.execution_path(x) != runtime.COMPILED:
        return None
    device = x.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (scalars, index, driver.active.get_current_stream(index),
            tuple([None if t is None else _tensor_key(t) for t in tensors]))


class _Address:
    """A device address where Triton's launcher takes a tensor: it reads only ``data_ptr()``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _ReplayDescriptor:
    """A host TMA descriptor of a captured view at a replay's address: what Triton's launcher reads of a
    ``TensorDescriptor`` (its base's address, shape, strides and padding) to encode the tensor map."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, padding: str):
        self.base, self.shape, self.strides, self.padding = _Address(ptr), shape, strides, padding


def _is_descriptor(value) -> bool:
    return isinstance(getattr(value, "base", None), torch.Tensor) and hasattr(value, "block_shape")


class _Step:
    """One captured launch: the compiled kernel, its grid, every parameter in order (tensors and host
    descriptors replaced by None), where each tensor parameter comes from: (position, slot, byte offset),
    slot indexing inputs then outputs (-1: a persistent buffer, the offset its address), and each host
    descriptor: (position, slot, byte offset, shape, strides, padding)."""

    __slots__ = ("compiled", "grid", "args", "sources", "descriptors", "tuner", "tuner_state")

    def __init__(self, compiled, grid, args, sources, descriptors, tuner):
        self.compiled, self.grid, self.args, self.sources = compiled, grid, args, sources
        self.descriptors = descriptors
        self.tuner = tuner
        self.tuner_state = None if tuner is None else (tuner.cache, tuner.configs)

    def current(self) -> bool:
        """False once the tuner's config cache or space was replaced: the captured config may no longer
        be the one the tuner would choose."""
        t = self.tuner
        return t is None or (t.cache is self.tuner_state[0] and t.configs is self.tuner_state[1])


def _choices_current(choices) -> bool:
    """Whether every (choice, generation) a plan went through still holds the answers it gave then."""
    return all(choice.generation == generation for choice, generation in choices)


class Plan:
    """A replayable call: the outputs to allocate and the launches to issue."""

    __slots__ = ("outputs", "steps", "stream", "records", "single", "scratch", "choices")

    def __init__(self, outputs, steps, stream, records, single, choices=()):
        self.outputs, self.steps, self.stream, self.records, self.single = outputs, steps, stream, records, single
        self.choices = choices  # (choice, generation) of the backend choices the call went through
        # A replay on another thread (autograd's backward, a loader) must set that thread's allocator too.
        self.scratch = any(getattr(getattr(s.compiled, "metadata", None), "global_scratch_size", 0) for s in steps)

    def current(self) -> bool:
        return _choices_current(self.choices) and all(s.current() for s in self.steps)

    def __call__(self, inputs):
        if self.scratch:  # Triton's launcher takes the kernel's global scratch from this thread's allocator
            ensure_descriptor_allocator()
        device = inputs[0].device
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in self.outputs]
        ptrs = [None if t is None else t.data_ptr() for t in inputs] + [t.data_ptr() for t in outs]
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        stream = self.stream
        for step in self.steps:
            args = step.args.copy()
            for pos, slot, offset in step.sources:
                args[pos] = ptrs[slot] + offset if slot >= 0 else offset
            for pos, slot, offset, shape, strides, padding in step.descriptors:
                args[pos] = _ReplayDescriptor(ptrs[slot] + offset if slot >= 0 else offset, shape, strides, padding)
            k = step.compiled
            g0, g1, g2 = step.grid
            meta = None if enter is None else k.launch_metadata(step.grid, stream, *args)
            k.run(g0, g1, g2, stream, k.function, k.packed_metadata, meta, enter, leave, *args)
        if self.records and launches.active():
            for rec in self.records:
                launches.emit(dataclasses.replace(rec, replayed=True))
        return outs[0] if self.single else tuple(outs)


class Plans:
    """One op family's plans, keyed by :func:`signature`."""

    def __init__(self, name: str):
        self.name = name
        self._plans: dict = {}
        self._generation = switches.GENERATION  # the switches' state the plans were made under
        _FAMILIES.append(self)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return sum(1 for p in self._plans.values() if p is not _NO_PLAN)

    def run(self, inputs: tuple, scalars: tuple, full):
        """``full()`` -- the launch module's full path, returning one output tensor or a tuple of them --
        or the replay of the plan an earlier call with this key captured."""
        if self._generation != switches.GENERATION:  # a switch changed: what the plans captured may not run now
            self._plans.clear()
            self._generation = switches.GENERATION
        key = signature(inputs, scalars)
        if key is None or getattr(_local, "capture", None) is not None:
            # Off the compiled path; or inside another entry's capture (one family's entry calling another's),
            # whose plan takes these launches as its own.
            return full()
        plan = self._plans.get(key)
        if plan is not None:
            if plan is _NO_PLAN:
                return full()
            if plan.current():
                return plan(inputs)
        capture = _Capture()
        _local.capture = capture
        try:
            with launches.recording() as recs:
                out = full()
        finally:
            _local.capture = None
        if len(self._plans) < MAX_PLANS:
            self._plans[key] = capture.plan(inputs, out, key[2], recs) or _NO_PLAN
        return out


class _Capture:
    def __init__(self):
        self.launches = []  # (compiled kernel, grid, bound arguments, tuner or None)
        self.vendor = []  # (function, arguments, result, launches inside) of each outermost vendor composition
        self.choices = []  # (choice, its generation) of each choice among candidates the call went through
        self.ok = True

    def add(self, compiled, grid, bound, tuner):
        if not hasattr(compiled, "packed_metadata"):
            self.ok = False
            return
        self.launches.append((compiled, grid, bound, tuner))

    def plan(self, inputs, out, stream, recs) -> "Plan | VendorPlan | None":
        if self.vendor:
            return self._vendor_plan(inputs, out)
        if not self.ok or not self.launches:
            return None
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else tuple(out)
        if not all(isinstance(t, torch.Tensor) for t in outs):
            return None
        slots = [t for t in inputs] + list(outs)
        spans = []
        for t in slots:
            if t is None or t.numel() == 0:
                spans.append(None)  # an empty tensor is never read or written
                continue
            extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) + 1
            spans.append((t.data_ptr(), t.data_ptr() + extent * t.element_size()))
        written = {len(inputs) + i for i, t in enumerate(outs) if t.numel() == 0}
        def locate(value):
            """(slot, byte offset) of a launch's tensor among the call's, (-1, address) for a persistent
            buffer, None for anything else (a temporary, or ambiguous between two of the call's tensors)."""
            ptr = value.data_ptr()
            hits = [i for i, sp in enumerate(spans) if sp is not None and sp[0] <= ptr < sp[1]]
            if len(hits) > 1:  # interleaved views (a Conv1D weight's q/k/v columns): the one passed
                same = [i for i in hits if slots[i] is value]
                hits = same if len(same) == 1 else hits
            if len(hits) == 1:
                if hits[0] >= len(inputs):
                    written.add(hits[0])
                return hits[0], ptr - spans[hits[0]][0]
            if not hits and ptr in _PERSISTENT:
                return -1, ptr
            return None

        steps = []
        for compiled, grid, bound, tuner in self.launches:
            args, sources, descriptors = [], [], []
            for pos, value in enumerate(bound):
                if isinstance(value, torch.Tensor):
                    found = locate(value)
                    if found is None:
                        return None
                    sources.append((pos, *found))
                    args.append(None)
                elif _is_descriptor(value) and REPLAY_HOST_DESCRIPTORS:
                    found = locate(value.base)
                    if found is None:
                        return None
                    descriptors.append((pos, *found, tuple(value.shape), tuple(value.strides), value.padding))
                    args.append(None)
                elif value is None or isinstance(value, (int, float, bool, str)):
                    args.append(value)
                else:
                    return None  # an argument object the plan cannot rebuild at a new address
            steps.append(_Step(compiled, grid, args, tuple(sources), tuple(descriptors), tuner))
        if len(written) != len(outs):
            return None
        outputs = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in outs]
        return Plan(outputs, steps, stream, tuple(recs), single, tuple(self.choices))

    def _vendor_plan(self, inputs, out):
        """The plan of a call whose only work was one vendor composition on its own inputs, returning its outputs as
        they are; None for anything else (a launch beside it, a tensor argument that is not an input). Launches
        inside the composition (its own kernels, such as the gated form's gate kernel) are its own: a replay
        calls it again, and they run again through it."""
        if len(self.vendor) != 1:
            return None
        fn, args, result, inside = self.vendor[0]
        if result is not out or len(self.launches) != inside:
            return None
        template, sources = list(args), []
        for pos, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                slot = next((i for i, t in enumerate(inputs) if t is value), None)
                if slot is None:
                    return None
                sources.append((pos, slot))
                template[pos] = None
            elif not (value is None or isinstance(value, (int, float, bool, str, tuple))):
                return None
        return VendorPlan(fn, template, tuple(sources), tuple(self.choices))


class VendorPlan:
    """A replayable vendor composition: the function, its arguments with the call's input tensors left out (filled
    from each replay's inputs), and the choices that led to it."""

    __slots__ = ("fn", "args", "sources", "choices")

    def __init__(self, fn, args, sources, choices):
        self.fn, self.args, self.sources, self.choices = fn, args, sources, choices

    def current(self) -> bool:
        """False once a choice it went through has forgotten its answers (``BackendChoice.clear``)."""
        return _choices_current(self.choices)

    def __call__(self, inputs):
        args = self.args.copy()
        for pos, slot in self.sources:
            args[pos] = inputs[slot]
        return self.fn(*args)


def _bind(fn, args, kwargs):
    """Every parameter of ``fn`` in order (constexprs included), as Triton's binder hands them to the C
    launcher; None when one has no value."""
    params = _PARAMS.get(id(fn))  # by identity: a JITFunction's hash is its source's cache key
    if params is None:
        params = _PARAMS[id(fn)] = list(inspect.signature(fn.fn).parameters.values())
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
    return bound


_PARAMS: dict = {}  # id(jit function) -> its parameters; jit functions live for the process


def launch_persistent(kernel, tiles: int, args: tuple, kwargs: dict, device) -> None:
    """A persistent kernel over ``tiles`` output tiles through :func:`launch`: one program per SM at most
    (NUM_SMS, the stride of its tile loop, joins ``kwargs``), with the allocator its in-kernel TMA descriptors
    take their scratch from."""
    ensure_descriptor_allocator()
    num_sms = runtime.device_facts(device)[1]
    launch(kernel, (min(num_sms, tiles),), args, dict(kwargs, NUM_SMS=num_sms))


def launch(kernel, grid, args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)`` -- a ``@triton.jit`` function or a tuning.TableAutotuner -- and,
    while a plan is being captured on this thread, that launch's compiled kernel and bound arguments."""
    compiled = kernel[grid](*args, **kwargs)
    capture = getattr(_local, "capture", None)
    if capture is None:
        return compiled
    tuner = None
    fn = kernel
    if hasattr(kernel, "base_fn"):  # an autotuner: the config it ran with joins the arguments
        tuner = kernel
        config = kernel.launched_config()
        if config is None or config.pre_hook is not None:
            capture.ok = False
            return compiled
        kwargs = {**kwargs, **config.all_kwargs()}
        fn = kernel.fn
    bound = _bind(fn, args, kwargs)
    if bound is None:
        capture.ok = False
        return compiled
    if callable(grid):
        grid = grid(dict(zip(fn.arg_names, bound)))
    grid = tuple(grid) + (1,) * (3 - len(grid))
    capture.add(compiled, grid, bound, tuner)
    return compiled

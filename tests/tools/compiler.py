"""Compile a Triton kernel for Hopper (sm_90a) on any machine, GPU or not, and read the compiler's facts.

Triton ships LLVM and ptxas, so a kernel variant can be compiled for the H200 here: it catches compile
errors the interpreter never sees (e.g. non-constexpr globals), and ``ptxas -v`` gives registers and
spill bytes, so register pressure can be studied without device time.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from tilefuse.kernels import switches

_TOOLS = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(_TOOLS)
REPO_DIR = os.path.dirname(TESTS_DIR)
SRC_DIR = os.path.join(REPO_DIR, "src")


def compile_sm90(module: str, kernel: str, signature: dict | str, constexprs: dict, num_warps: int = 4,
                 num_stages: int = 3, aligned: tuple = (), maxnreg: int | None = None, ones: tuple = ()) -> dict:
    """Compile ``module.kernel`` (a @triton.jit function) for sm_90a.

    ``signature``: arg name -> triton type string ("*bf16", "i32", ...) for runtime args, or one pointer
    type string (e.g. "*bf16"): then every runtime ``*_ptr`` argument gets it and every other runtime
    argument is "i32"; a dict entry whose value is a pointer type overrides single args (give the dict
    with key "*" for the default, e.g. {"*": "*fp16", "ws_ptr": "*fp32"}). ``constexprs``: arg name -> value. Returns regs, spill_store_bytes, shared bytes, wgmma (bool), wgmma_a_in_registers (bool) and the PTX atomics used. Under
    TRITON_INTERPRET=1 kernels are interpreter objects that cannot compile, so the work then runs in a
    child process without it. ``aligned``: runtime argument names to compile as multiples of 16 (as
    Triton specializes aligned pointers and strides at launch; ignored for the kernel's ``do_not_specialize``
    arguments, which a launch leaves unspecialized); without them loads are not vectorized
    and loops are not pipelined, so shared memory is under-counted for typical shapes. ``maxnreg``: the
    config's register cap, if it has one. ``ones``: runtime integer arguments a launch may pass as 1: Triton's
    launcher turns those into constexpr 1 unless the kernel lists them in ``do_not_specialize``, so they
    compile that way here (a ``.to()`` on such an argument only fails then).
    """
    if _interpreting():
        return _compile_in_child(f"{module}.{kernel}", [
            "--triton", json.dumps([module, kernel, signature, constexprs, num_warps, num_stages, list(aligned),
                                    maxnreg, list(ones)])])
    return _compile_here(getattr(importlib.import_module(module), kernel), signature, constexprs,
                         num_warps, num_stages, tuple(aligned), maxnreg, tuple(ones))


def _compile_here(fn, signature, constexprs, num_warps, num_stages, aligned=(), maxnreg=None, ones=()) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if isinstance(signature, str):
        signature = {"*": signature}
    if "*" in signature:  # derive the rest from the kernel's own parameter list
        default_ptr = signature["*"]
        sig = {p.name: (default_ptr if p.name.endswith("_ptr") else "i32")
               for p in fn.params if not p.is_constexpr and p.name not in constexprs}
        sig.update({k: v for k, v in signature.items() if k != "*"})
    else:
        sig = dict(signature)
    pinned = {p.name for p in fn.params if p.do_not_specialize}
    constexprs = {**constexprs, **{name: 1 for name in ones if name not in pinned}}
    # A launch specializes neither the value 1 nor the 16-divisibility of a do_not_specialize argument.
    aligned = tuple(name for name in aligned if name not in pinned)
    for name in constexprs:
        sig.pop(name, None)
    # Constexpr parameters left out take their defaults, as a launch binds them (else they compile as None).
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.has_default and p.name not in constexprs and p.name not in sig},
                  **constexprs}
    sig.update({name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return _facts(kernel)


def _facts(kernel) -> dict:
    import triton

    ptx = kernel.asm["ptx"]
    # The ptxas triton compiled for: its version sets the PTX version written. Not always the bundled one:
    # Inductor points TRITON_PTXAS_PATH at torch's own (CUDA 13 in a cu130 build) at its first compile.
    ptxas = triton.knobs.nvidia.ptxas.path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ptxas exited {done.returncode}: {(done.stderr or done.stdout).strip()[-2000:]}")
        info = done.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", info)]
    ttgir = kernel.asm["ttgir"]
    reqntid = re.search(r"\.reqntid (\d+)", ptx)  # a warp-specialized kernel's threads, workers included
    # wgmma's A operand: a shared-memory descriptor (memdesc) or registers (a dot_op layout tensor).
    a_in_registers = bool(re.search(r"ttng\.warp_group_dot [^\n]*: tensor<[^\n]*dot_op<\{opIdx = 0", ttgir))
    return {"regs": int(regs.group(1)) if regs else None, "spill_store_bytes": max(spills, default=0),
            # ptxas serialises async wgmma it cannot prove safe (e.g. register operands still being written).
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in info,
            "shared": kernel.metadata.shared, "wgmma": "wgmma" in ptx, "wgmma_a_in_registers": a_in_registers,
            "atomics": sorted(set(re.findall(r"\batom\.[\w.:]+", ptx))),
            # Global loads one 16-bit element at a time (a tile load the compiler could not vectorize).
            "scalar_16bit_loads": len(re.findall(r"\bld\.global(?:\.\w+)*\.b16\b", ptx)),
            # Global stores one byte at a time (an 8-bit tile store the compiler could not vectorize).
            "byte_stores": len(re.findall(r"\bst\.global(?:\.\w+)*\.b8\b", ptx)),
            # Warp specialization: partitions in the TTGIR, and the register moves between them.
            "warp_specialized": "ttg.warp_specialize" in ttgir,
            "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
            "threads": int(reqntid.group(1)) if reqntid else kernel.metadata.num_warps * 32}


def compile_gluon_sm90(module: str, job: str, kwargs: dict) -> dict:
    """Compile a Gluon kernel for sm_90a and return the facts ``compile_sm90`` gives, plus whether it is
    warp-specialized and its setmaxnreg values. ``module.job(**kwargs)`` returns (kernel, signature,
    constexprs, options): Gluon signatures name tensor descriptors with their shared layouts, built from
    the kernel's host side (the jobs for tilefuse's Gluon kernels are in this module:
    ``compile_gluon_sm90("tools.compiler", "attention_ws_compile_job", {...})`` and
    ``"gemm_coop_ws_compile_job"``). Runs in a child process under the interpreter, as above."""
    if _interpreting():
        return _compile_in_child(f"{module}.{job}", ["--gluon", json.dumps([module, job, kwargs])])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn, signature, constexprs, options = getattr(importlib.import_module(module), job)(**kwargs)
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                         attrs={})
    return _facts(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _CompileServer:
    """One child process per test process that compiles job after job (this file run with ``--serve``):
    a child per compile paid python's start and the imports of torch, triton and tilefuse (~1.5 s on the
    CI machine) every time, as long as most compiles take. Jobs go as JSON lines on its stdin; each answer is
    one line on its stdout behind ``_ANSWER`` (whatever else a compiler prints there is skipped)."""

    def __init__(self):
        self.child = None

    def ask(self, what: str, argv: list) -> dict:
        for attempt in (0, 1):
            if self.child is None or self.child.poll() is not None:
                env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                self.child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], env=env,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            try:
                self.child.stdin.write(json.dumps(argv) + "\n")
                self.child.stdin.flush()
                for line in self.child.stdout:
                    if line.startswith(_ANSWER):
                        answer = json.loads(line[len(_ANSWER):])
                        if "error" in answer:
                            raise RuntimeError(f"compiling {what} for sm_90a failed:\n{answer['error'][-4000:]}")
                        return answer["facts"]
            except BrokenPipeError:
                pass
            self.child = None  # it died mid-job (its stderr is the test's): start a fresh one, once
        raise RuntimeError(f"compiling {what} for sm_90a: the compile process exited")


_ANSWER = "@@tilefuse-compile-facts@@ "
_SERVER = _CompileServer()


def _compile_in_child(what: str, argv: list) -> dict:
    """Under TRITON_INTERPRET=1 kernels are interpreter objects that cannot compile: run the job in this
    file's compile process (by its path: it lives in tests/tools, outside the package), started without it,
    and read the facts it answers. The child puts tests/ and src/ on sys.path itself, so "tools.compiler"
    and tilefuse import."""
    return _SERVER.ask(what, argv)


def _run_job(argv: list) -> dict:
    if argv[0] == "--gluon":
        return compile_gluon_sm90(*json.loads(argv[1]))
    module, kernel, signature, constexprs, num_warps, num_stages, aligned, maxnreg, ones = json.loads(argv[1])
    return compile_sm90(module, kernel, signature, constexprs, num_warps, num_stages, tuple(aligned), maxnreg,
                        tuple(ones))


def _serve() -> None:
    import traceback

    for line in sys.stdin:
        try:
            answer = {"facts": _run_job(json.loads(line))}
        except Exception:  # noqa: BLE001 - the job's error goes back to the test that asked
            answer = {"error": traceback.format_exc()}
        sys.stdout.write(_ANSWER + json.dumps(answer) + "\n")
        sys.stdout.flush()


# ---- compile jobs for the Gluon kernels (compile_gluon_sm90's ``job``) -----------------------------------
def attention_ws_compile_job(head_dim: int = 128, dtype: str = "bfloat16", has_left: bool = False,
                             has_right: bool = False, store_lse: bool = True, config: dict | None = None,
                             flat_grid: bool = False):
    """(kernel, signature, constexprs, options) of tilefuse.kernels.attention.ws.attention_fwd_ws_kernel,
    as ``tilefuse.kernels.attention.launch._launch_ws`` launches it: host descriptors' signature strings
    are built from a CPU tensor, as a launch would specialize them. ``config`` overrides entries of
    ``ws_config_for(head_dim)`` (DEVICE_DESC defaults to True: descriptors made in the kernel)."""
    import torch
    from triton.runtime.jit import mangle_type

    from tilefuse.kernels.attention import ws
    from tilefuse.kernels.attention.launch import _descriptor, ws_config_for

    fn = ws.attention_fwd_ws_kernel
    cfg = {**ws_config_for(head_dim), "DEVICE_DESC": True, **(config or {})}
    constexprs = dict(HEAD_D=ws.tile_head_dim(head_dim), HAS_LEFT=has_left, HAS_RIGHT=has_right, STORE_LSE=store_lse,
                      FLAT_GRID=flat_grid, **cfg)
    signature = {name: "fp32" if name == "qk_scale" else "i32" for name in fn.arg_names if name not in constexprs}
    t = torch.empty(1, 2, 256, head_dim, dtype=getattr(torch, dtype))
    if cfg["DEVICE_DESC"]:
        q_sig = kv_sig = mangle_type(t)
    else:
        q_sig, kv_sig = mangle_type(_descriptor(t, ws.HALF_M)), mangle_type(_descriptor(t, cfg["BLOCK_N"]))
    signature.update(q_src=q_sig, o_src=q_sig, k_src=kv_sig, v_src=kv_sig, lse_ptr="*fp32")
    return fn, signature, constexprs, dict(num_warps=4, maxnreg=ws.LAUNCH_MAXNREG)


def attention_fp8_ws_compile_job(head_dim: int = 128, has_left: bool = False, has_right: bool = False,
                                 block_n: int = 128, stages: int = 2, fma_softmax: bool = False):
    """(kernel, signature, constexprs, options) of tilefuse.kernels.attention.ws_fp8.attention_fp8_ws_kernel as
    ``tilefuse.kernels.attention.launch.forward_fp8`` launches it (e4m3 q, k, v^T, bf16 out, fp32 scales)."""
    from tilefuse.kernels.attention import ws, ws_fp8

    fn = ws_fp8.attention_fp8_ws_kernel
    constexprs = dict(HEAD_D=head_dim, HAS_LEFT=has_left, HAS_RIGHT=has_right, BLOCK_N=block_n, STAGES=stages,
                      FLAT_GRID=False, FMA_SOFTMAX=fma_softmax)
    signature = {name: "fp32" if name == "qk_scale" else "i32" for name in fn.arg_names if name not in constexprs}
    signature.update(q_ptr="*fp8e4nv", k_ptr="*fp8e4nv", vt_ptr="*fp8e4nv", o_ptr="*bf16", qs_ptr="*fp32",
                     ks_ptr="*fp32", vs_ptr="*fp32")
    return fn, signature, constexprs, dict(num_warps=4, maxnreg=ws.LAUNCH_MAXNREG)


def gemm_coop_ws_compile_job(gemm: str = "dx", config: str | None = None, activation: str = "gelu",
                             dtype: str = "bfloat16", num_sms: int = 132, db: bool = True):
    """(kernel, signature, constexprs, options) of tilefuse.kernels.gemm.coop.gemm_coop_ws_kernel as its
    ``launch`` runs it for the forward ("forward", ``coop.linear``), the gated forward ("gated", with
    ``activation`` a GLU, else swiglu), dx ("dx"), the gated dx ("gated_dx": two slopes and weights) or dW ("dW",
    with db unless ``db`` is False), at one of its
    CONFIGS (default: the config the launch layer takes for that form, switches.gemm's COOP_*_CONFIG;
    for the plain forward, which the launch does not take, coop.DEFAULT)."""
    import torch
    from triton.runtime.jit import mangle_type

    from tilefuse.kernels.gemm import coop, launch

    if config is None:
        config = {"forward": coop.DEFAULT, "gated": switches.gemm.COOP_GATED_CONFIG}.get(gemm, switches.gemm.COOP_BACKWARD_CONFIG)
    cfg = coop.CONFIGS[config]
    trans_a, slope, b_kmajor = {"forward": (False, False, True), "gated": (False, False, True),
                                "dx": (False, True, False), "gated_dx": (False, True, False),
                                "dW": (True, True, False)}[gemm]
    t = torch.empty(256, 256, dtype=getattr(torch, dtype))
    signature = {name: mangle_type(t) for name in ("a_ptr", "s_ptr", "su_ptr", "b_ptr", "bu_ptr", "c_ptr",
                                                   "bias_ptr", "bias_up_ptr", "db_ptr")}
    signature.update({name: "i32" for name in ("Mc", "Nc", "R", "stride_a", "stride_s", "stride_su", "stride_b",
                                               "stride_bu", "stride_c")})
    forward = gemm in ("forward", "gated")
    if gemm == "gated" and activation not in ("swiglu", "geglu", "geglu_tanh"):
        activation = "swiglu"
    constexprs = dict(coop.constexprs(trans_a, slope, b_kmajor, forward, activation if forward else None,
                                      gemm == "dW" and db, cfg, gated=gemm == "gated",
                                      gated_dx=gemm == "gated_dx"), NUM_SMS=num_sms)
    return coop.gemm_coop_ws_kernel, signature, constexprs, dict(num_warps=4, maxnreg=coop.LAUNCH_MAXNREG)


def attention_bwd_wide_compile_job(causal: bool = True, dtype: str = "bfloat16", head_dim: int = 256,
                                   stages: int | None = None, which: str = "dkdv"):
    """(kernel, signature, constexprs, options) of the backward passes for head dims past 128, as
    ``tilefuse.kernels.attention.launch._backward_ws`` launches them: tilefuse.kernels.attention.ws_backward_wide's
    dK/dV kernel (``which`` "dkdv") or ws_backward's dQ kernel in 256-wide tiles with DQ_KEYS-key K/V boxes ("dq");
    ``stages`` the ring depth (default: ws_backward_wide.STAGES, the launch's)."""
    import torch
    from triton.runtime.jit import mangle_type

    from tilefuse.kernels.attention import ws, ws_backward, ws_backward_wide
    from tilefuse.kernels.gluon_host import host_descriptor

    t = torch.empty(1, 2, 256, head_dim, dtype=getattr(torch, dtype))
    tile = ws.tile_head_dim(head_dim)
    sig = mangle_type(host_descriptor(t, (1, 1, ws_backward.BLOCK_M.value, tile)))
    rest = dict(lse_ptr="*fp32", delta_ptr="*fp32", H_Q="i32", H_KV="i32", N_Q="i32", N_K="i32", qk_scale="fp32",
                scale="fp32", pos_offset="i32", window_right="i32")
    constexprs = dict(HAS_RIGHT=causal, STAGES=stages or ws_backward_wide.STAGES)
    options = dict(num_warps=4, maxnreg=ws_backward.LAUNCH_MAXNREG)
    if which == "dq":
        kv_sig = mangle_type(host_descriptor(t, (1, 1, ws_backward_wide.DQ_KEYS, tile)))
        signature = dict(q_desc=sig, k_desc=kv_sig, v_desc=kv_sig, do_desc=sig, dq_desc=sig, **rest,
                         window_left="i32")
        return ws_backward.attention_bwd_dq_ws_kernel, signature, dict(constexprs, HAS_LEFT=False), options
    signature = dict(q_desc=sig, k_desc=sig, v_desc=sig, do_desc=sig, dk_desc=sig, dv_desc=sig, **rest)
    return ws_backward_wide.attention_bwd_dkdv_wide_kernel, signature, constexprs, options


def attention_bwd_ws_compile_job(head_dim: int = 128, causal: bool = True, dtype: str = "bfloat16",
                                 which: str = "dkdv", sliding: bool = False):
    """(kernel, signature, constexprs, options) of tilefuse.kernels.attention.ws_backward's dK/dV kernel
    (``which`` "dkdv") or dQ kernel ("dq"), as ``tilefuse.kernels.attention.launch._backward_ws`` launches them;
    ``sliding``: with a left window too."""
    import torch
    from triton.runtime.jit import mangle_type

    from tilefuse.kernels.attention import launch, ws, ws_backward
    from tilefuse.kernels.gluon_host import host_descriptor

    t = torch.empty(1, 2, 256, head_dim, dtype=getattr(torch, dtype))
    tile = ws.tile_head_dim(head_dim)
    q_sig = mangle_type(host_descriptor(t, (1, 1, ws_backward.BLOCK_M.value, tile)))
    kv_sig = mangle_type(host_descriptor(t, (1, 1, ws_backward.KEYS, tile)))
    rest = dict(lse_ptr="*fp32", delta_ptr="*fp32", H_Q="i32", H_KV="i32", N_Q="i32", N_K="i32", qk_scale="fp32",
                scale="fp32", pos_offset="i32", window_right="i32", window_left="i32")
    constexprs = dict(HAS_LEFT=sliding, HAS_RIGHT=causal, STAGES=launch.BACKWARD_WS_STAGES)
    options = dict(num_warps=4, maxnreg=ws_backward.LAUNCH_MAXNREG)
    if which == "dq":
        signature = dict(q_desc=q_sig, k_desc=q_sig, v_desc=q_sig, do_desc=q_sig, dq_desc=q_sig, **rest)
        return ws_backward.attention_bwd_dq_ws_kernel, signature, constexprs, options
    signature = dict(q_desc=q_sig, k_desc=kv_sig, v_desc=kv_sig, do_desc=q_sig, dk_desc=kv_sig, dv_desc=kv_sig,
                     **rest)
    return ws_backward.attention_bwd_dkdv_ws_kernel, signature, constexprs, options


if __name__ == "__main__":
    # Run by path: sys.path[0] is tests/tools. Put tests/ (so "tools.compiler" imports as a package module)
    # and src/ (tilefuse, also without an install) first instead.
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _TOOLS:
        sys.path.pop(0)
    for path in (SRC_DIR, TESTS_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)
    if sys.argv[1] == "--serve":
        _serve()
    else:  # one job: --gluon or --triton, then its JSON
        print(json.dumps(_run_job(sys.argv[1:3])))

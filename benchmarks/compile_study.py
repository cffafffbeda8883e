"""Compiler facts (registers, spill bytes, shared memory, wgmma) for sm_90a, without a GPU, of the
attention, softmax and norm kernels, for the configs their launchers and autotune prunes can pick at
the bench shapes (bf16). Flags any config that spills or needs more than 227 KiB of shared memory.
Run: PYTHONPATH=src python benchmarks/compile_study.py OUT.json [attention|softmax|norms ...]

Arguments are specialised as the JIT does at launch: ints equal to 1 become constexprs, and pointers
(torch allocations) and ints divisible by 16 carry tt.divisibility=16, unless do_not_specialize.
compile_sm90 takes no such hints, so its ASTSource is wrapped here to add them (vectorised loads and
cp.async widths, hence registers, depend on them).
"""
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JITFunctions, not interpreter objects
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tools: the sm_90a compiler

import triton.compiler  # noqa: E402

import tilefuse.kernels.attention.portable  # noqa: E402,F401  (job() finds kernels in sys.modules)
import tilefuse.kernels.norms.kernels  # noqa: E402,F401
import tilefuse.kernels.softmax.kernels  # noqa: E402,F401
from tilefuse.kernels.attention import launch as att  # noqa: E402
from tilefuse.kernels.norms import launch as nm  # noqa: E402
from tilefuse.kernels.softmax import launch as sm  # noqa: E402
from tilefuse.sizes import m_bucket, next_pow2  # noqa: E402
from tools.compiler import compile_sm90  # noqa: E402

SMEM_LIMIT = 227 * 1024
BF16, FP32 = "*bf16", "*fp32"
SHAPES = [(16384, 4096), (4096, 16384), (65536, 1024), (2048, 131072)]
SPLIT_SHAPES = [(1, 1048576), (32, 1048576)]  # softmax's split-row bench shapes (extra)
# Not in any space today: what a fix could use (d = 256 pointer path; norm backward at N > 8192).
D256_CANDIDATES = [(64, 64, 8, 2), (64, 64, 8, 3), (64, 32, 8, 3), (64, 32, 4, 2)]
NORM_BWD_CANDIDATES = [(8192, 16), (8192, 8)]  # (BLOCK_N, warps) of the chunked backward
_HINTED = []  # arg names given tt.divisibility=16 in the current job (one job at a time per worker)


class _HintedSource(triton.compiler.ASTSource):
    def __init__(self, fn, signature, constexprs=None, attrs=None):
        attrs = attrs or {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in _HINTED}
        super().__init__(fn, signature, constexprs, attrs)


triton.compiler.ASTSource = _HintedSource


def job(kernel, args, consts, warps, stages=3, **meta):
    """One compile: runtime arg values (pointer dtype strings, ints, floats) -> signature + hints."""
    fn = getattr(sys.modules[kernel[0]], kernel[1])
    sig, consts, hints = {}, dict(consts), []
    for name, v in args.items():
        plain_int = isinstance(v, int) and name not in fn.do_not_specialize
        if plain_int and v == 1:
            consts[name] = 1
            continue
        sig[name] = (v if isinstance(v, str) else "fp32" if isinstance(v, float)
                     else "i32" if abs(v) < 2 ** 31 else "i64")
        if isinstance(v, str) or (plain_int and v % 16 == 0):
            hints.append(name)
    return dict(module=kernel[0], kernel=kernel[1], sig=sig, consts=consts, hints=hints,
                warps=warps, stages=stages, meta=dict(kernel=kernel[1], warps=warps, stages=stages, **meta))


def run_job(j):
    _HINTED[:] = j["hints"]
    try:
        facts = compile_sm90(j["module"], j["kernel"], j["sig"], j["consts"], j["warps"], j["stages"])
    except Exception as e:  # a config that does not compile is a finding too
        facts = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
    return {**j["meta"], **facts, "over_smem": (facts.get("shared") or 0) > SMEM_LIMIT,
            "spills": (facts.get("spill_store_bytes") or 0) > 0}


class _Elem2:  # stands in for q in the autotune prune (reads q.element_size() only)
    def element_size(self):
        return 2


def attention_jobs():
    A = "tilefuse.kernels.attention.portable", "attention_fwd_kernel"
    for d in (64, 128, 256):
        B, H, N = 4, 2048 // d, 4096  # the n = 4096 bench case: B = 16384 // n, H = 2048 // d, MHA
        kept = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in att._prune(att.GPU_CONFIGS, {"q_ptr": _Elem2()}, BLOCK_D=d)}
        h = att.heuristic_config(d, 2)
        small = (h.kwargs["BLOCK_M"], h.kwargs["BLOCK_N"], h.num_warps, h.num_stages)
        space = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in att.GPU_CONFIGS]
        strides = dict(b=H * N * d, h=N * d, m=d, d=1)
        args = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, o_ptr=BF16, lse_ptr=BF16, mask_ptr=BF16)
        for t, rows in (("q", "m"), ("k", "n"), ("v", "n"), ("o", "m")):
            args.update({f"stride_{t}b": strides["b"], f"stride_{t}h": strides["h"],
                         f"stride_{t}{rows}": strides["m"], f"stride_{t}d": 1})
        args.update(stride_maskb=0, stride_maskh=0, stride_maskm=0, stride_maskn=0, B=B, H_Q=H, N_Q=N,
                    N_K=N, HEAD_DIM=d, GROUP=1, H_KV=H, qk_scale=0.1, pos_offset=0, window_left=0,
                    window_right=0, Q_BUCKET=N, K_BUCKET=N)
        extra = [small] if small not in space else []
        for cfg in space + extra + (D256_CANDIDATES if d == 256 else []):
            bm, bn, w, s = cfg
            for causal in (False, True):
                for desc in (False, True):
                    consts = dict(HAS_LEFT=False, HAS_RIGHT=causal, HAS_MASK=False, MASK_IS_BOOL=False,
                                  STORE_LSE=False, EVEN_D=True, USE_DESC=desc, INPUT_PRECISION="tf32",
                                  UPCAST_DOT=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d)
                    yield job(A, args, consts, w, s, op="attention", d=d, causal=causal, desc=desc,
                              BLOCK_M=bm, BLOCK_N=bn, autotune_keeps=cfg in kept, small_work=cfg == small,
                              candidate=cfg in D256_CANDIDATES)


def softmax_jobs():
    M = "tilefuse.kernels.softmax.kernels"
    for R, N in SHAPES + SPLIT_SHAPES:
        p = sm.plan(R, R, N, False, 2, sm.GPU_CAPS)
        tens = lambda *names: {f"{k}_ptr": BF16 for k in names}  # noqa: E731
        st = lambda *names: {f"stride_{k}{s}": v for k in names for s, v in (("o", 0), ("i", N), ("n", 1))}  # noqa: E731
        keys = dict(KEY_N=m_bucket(N), KEY_R=m_bucket(R))
        common = dict(op="softmax", shape=[R, N], mode=p.mode)
        if p.mode == "split":
            seg = dict(N=N, R=R, R_INNER=R, SEG_LEN=p.seg_len, S=p.segments)
            ws = dict(BLOCK_N=p.block_n, WIDE=False)
            for alg in ("online", "two_pass"):
                yield job((M, "softmax_split_stats_kernel"), {**tens("x"), "m_ptr": FP32, "d_ptr": FP32, **seg,
                          **st("x")}, dict(ALGORITHM=alg, **ws), p.num_warps, **common, algorithm=alg, BLOCK_N=p.block_n)
                yield job((M, "softmax_split_write_kernel"), {**tens("x", "y"), "m_ptr": FP32, "d_ptr": FP32,
                          **seg, **st("x", "y")}, dict(ALGORITHM=alg, BLOCK_S=next_pow2(p.segments), **ws),
                          p.num_warps, **common, algorithm=alg, BLOCK_N=p.block_n)
            yield job((M, "softmax_bwd_split_dot_kernel"), {**tens("y", "dy"), "part_ptr": FP32, **seg,
                      **st("y", "dy")}, ws, p.num_warps, **common, BLOCK_N=p.block_n)
            yield job((M, "softmax_bwd_split_write_kernel"), {**tens("y", "dy", "dx"), "part_ptr": FP32, **seg,
                      **st("y", "dy", "dx")}, dict(BLOCK_S=next_pow2(p.segments), **ws), p.num_warps,
                      **common, BLOCK_N=p.block_n)
            continue
        fwd_args = {**tens("x", "y"), "N": N, "R_INNER": R, **st("x", "y"), **keys, "N_OUTER": 1}
        bwd_args = {**tens("y", "dy", "dx"), "N": N, "R_INNER": R, **st("y", "dy", "dx"), **keys, "N_OUTER": 1}
        if p.mode == "block":
            cfgs = [(c.kwargs["BLOCK_M"], p.block_n, c.num_warps) for c in
                    sm._prune_block(sm._block_config_space(), {"R_INNER": R}, BLOCK_N=p.block_n)]
            variants = [("softmax_fwd_kernel", fwd_args, dict(ALGORITHM="online")), ("softmax_bwd_kernel", bwd_args, {})]
        else:
            cfgs = [(1, c.kwargs["BLOCK_N"], c.num_warps) for c in sm._LOOP_CONFIGS]
            variants = [("softmax_fwd_kernel", fwd_args, dict(ALGORITHM=a)) for a in ("online", "two_pass")]
            variants.append(("softmax_bwd_kernel", bwd_args, {}))
        for kernel, args, extra in variants:
            for bm, bn, w in cfgs:
                consts = dict(SINGLE_BLOCK=p.mode == "block", WIDE=False, BLOCK_M=bm, BLOCK_N=bn, **extra)
                yield job((M, kernel), args, consts, w, **common, algorithm=extra.get("ALGORITHM"),
                          BLOCK_M=bm, BLOCK_N=bn, heuristic=(bm, bn, w) == (p.block_m, p.block_n, p.num_warps))


def norm_jobs():
    M = "tilefuse.kernels.norms.kernels"
    for m, n in SHAPES:
        bn = nm.block_n_for(n, False)
        single = n <= bn
        for is_rms in (False, True):
            for res in (False, True) if (m, n) in SHAPES[:2] else (False,):
                common = dict(op="rms_norm" if is_rms else "layer_norm", shape=[m, n], residual=res)
                args = dict(x_ptr=BF16, res_ptr=BF16 if res else FP32, w_ptr=BF16, b_ptr=FP32 if is_rms else BF16,
                            y_ptr=BF16, h_ptr=BF16 if res else FP32, mean_ptr=FP32, rstd_ptr=FP32, M=m, N=n,
                            stride_xm=n, stride_rm=n if res else 0, stride_ym=n, stride_hm=n if res else 0,
                            eps=1e-5, M_BUCKET=m_bucket(m))
                flags = dict(IS_RMS=is_rms, HAS_RESIDUAL=res, HAS_WEIGHT=True, HAS_BIAS=not is_rms, STORE_Y=True,
                             SINGLE_PASS=single, BLOCK_N=bn)
                kept = nm._prune_fwd(nm._fwd_configs(), {"M": m, "N": n}, **flags)
                per_sm = {}  # PROGRAMS_PER_SM sizes the grid only: one compile per (BLOCK_M, warps)
                for c in kept:
                    per_sm.setdefault((c.kwargs["BLOCK_M"], c.num_warps), []).append(c.kwargs["PROGRAMS_PER_SM"])
                for (bm, w), ps in per_sm.items():
                    yield job((M, "norm_fwd_kernel"), args, dict(flags, BLOCK_M=bm, PROGRAMS_PER_SM=ps[0]), w,
                              **common, BLOCK_M=bm, BLOCK_N=bn, programs_per_sm=ps)
                # Backward (the bench runs it with the same affine; dh when the forward had a residual).
                bargs = dict(dy_ptr=BF16, h_ptr=BF16, w_ptr=BF16, mean_ptr=FP32, rstd_ptr=FP32)
                bflags = dict(IS_RMS=is_rms, HAS_WEIGHT=True)
                dh = dict(dh_ptr=BF16 if res else FP32, dx_ptr=BF16)
                dstr = dict(stride_dhm=n if res else 0, stride_dxm=n)
                parts = dict(dw_part_ptr=FP32, db_part_ptr=FP32)
                if single:
                    bm = max(1, min(16, 4096 // bn))
                    yield job((M, "norm_bwd_kernel"), {**bargs, **dh, **parts, "M": m, "N": n, "stride_dym": n,
                              "stride_hm": n, **dstr}, dict(bflags, HAS_DH=res, COMPUTE_DW=True,
                              COMPUTE_DB=not is_rms, BLOCK_M=bm, BLOCK_N=bn), nm._warps_for(bm * bn),
                              **common, BLOCK_M=bm, BLOCK_N=bn)
                for cn, w in [(bn, nm._warps_for(bn))] * (not single) + NORM_BWD_CANDIDATES * (n > 8192 and not res):
                    chunks, cand = triton.cdiv(n, cn), (cn, w) in NORM_BWD_CANDIDATES
                    base = {"M": m, "N": n, "NUM_CHUNKS": chunks, "stride_dym": n, "stride_hm": n}
                    yield job((M, "norm_bwd_chunk_sums_kernel"), {**bargs, "dots_ptr": FP32, **parts, **base},
                              dict(bflags, COMPUTE_DW=True, COMPUTE_DB=not is_rms, BLOCK_M=1, BLOCK_N=cn), w,
                              **common, BLOCK_M=1, BLOCK_N=cn, candidate=cand)
                    yield job((M, "norm_bwd_dx_kernel"), {**bargs, "dots_ptr": FP32, **dh, **base, **dstr},
                              dict(bflags, HAS_DH=res, BLOCK_M=1, BLOCK_N=cn, BLOCK_C=triton.next_power_of_2(chunks)),
                              w, **common, BLOCK_M=1, BLOCK_N=cn, candidate=cand)


def main(out, *families, workers=2, budget_s=38 * 60):
    families = families or ("attention", "softmax", "norms")
    jobs = [j for f in families for j in {"attention": attention_jobs, "softmax": softmax_jobs,
                                          "norms": norm_jobs}[f]()]
    print(f"{len(jobs)} compiles", flush=True)
    rows, t0 = [], time.time()
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(run_job, j) for j in jobs]
        for f in as_completed(futures):
            rows.append(f.result())
            print(json.dumps(rows[-1]), flush=True)
            if time.time() - t0 > budget_s:  # keep what finished; the rest is reported as not run
                for g in futures:
                    g.cancel()
                break
    order = ("op", "kernel", "d", "shape", "residual", "causal", "desc", "algorithm", "BLOCK_M", "BLOCK_N", "warps")
    rows.sort(key=lambda r: json.dumps([r.get(k) for k in order + ("stages",)]))
    for r in rows:  # attention: the autotune prune or the small-work config; elsewhere every non-candidate row
        r["launcher_can_pick"] = not r.get("candidate") and (r.get("autotune_keeps", True) or r.get("small_work"))
    flagged = [r for r in rows if r["launcher_can_pick"] and (r["spills"] or r["over_smem"] or "error" in r)]
    summary = dict(target="sm_90a (compile only, triton 3.6)", smem_limit=SMEM_LIMIT, compiles=len(rows),
                   planned=len(jobs), wall_s=round(time.time() - t0), flagged=len(flagged))
    with open(out, "w") as fh:
        json.dump(dict(summary=summary, flagged=flagged, rows=rows), fh, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main(*sys.argv[1:])

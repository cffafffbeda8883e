"""Config tables and the autotune hook (tilefuse.tuning), on the CPU.

The hook's decisions (which configs a key considers, what is read and written) are pure Python around
triton's Autotuner. Here the kernel launch is replaced by a recorder and the benchmark by a fake timer,
so the tests show exactly when triton would benchmark and which config would run.
"""
import json
import threading

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from tilefuse import cli, sizes, tuning
from tilefuse.harness import tune as harness_tune
from tilefuse.tuning import autotuner, choices, tables as tables_mod

GPU_NAME = "NVIDIA Test GPU 80GB"
SLUG = "nvidia-test-gpu-80gb"


@triton.jit
def tiny_kernel(x_ptr, y_ptr, N, M_BUCKET, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


SPACE = [triton.Config({"BLOCK": 64}, num_warps=4), triton.Config({"BLOCK": 128}, num_warps=4),
         triton.Config({"BLOCK": 256}, num_warps=8, num_stages=2)]
FAKE_MS = {64: 3.0, 128: 1.0, 256: 2.0}


class Recorder:
    """Stands in for the compiled kernel: records the meta-parameters of every launch."""

    def __init__(self, fail_for=None):
        self.calls = []
        self.fail_for = fail_for

    def run(self, *args, **kwargs):
        self.calls.append(kwargs)
        if self.fail_for is not None and kwargs.get("BLOCK") == self.fail_for:
            raise OutOfResources(300000, 232448, "shared memory")


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """User cache and shipped tables in temp folders; every launch 'runs on' GPU_NAME."""
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tables_mod, "SHIPPED_DIR", tmp_path / "shipped")  # read by tables.shipped_table_path
    monkeypatch.setattr(autotuner, "_device_name", lambda args: GPU_NAME)  # the tuner's own import of it
    monkeypatch.setattr(autotuner, "_use_stored_configs", True)
    return tmp_path


def make_tuner(monkeypatch, name="tiny", configs=SPACE, pinned=False, prune=None, fail_for=None):
    """A TableAutotuner over tiny_kernel with a recorder for launches and a fake benchmark."""
    benched = []

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        block = tuner.fn.calls[-1]["BLOCK"]
        benched.append(block)
        ms = FAKE_MS[block]
        return [ms, ms * 0.9, ms * 1.1]

    tuner = tuning.TableAutotuner(tiny_kernel, configs, ["M_BUCKET", "N", "ACTIVATION"], name=name,
                                  pinned=pinned, do_bench=fake_bench,
                                  prune_configs_by={"early_config_prune": prune} if prune else None)
    tuner.fn = Recorder(fail_for)
    tuner.benched = benched
    monkeypatch.setitem(autotuner._TUNERS, name, tuner)
    return tuner


def launch(tuner, n=100, activation="gelu", dtype=torch.float16):
    x = torch.zeros(n, dtype=dtype)
    y = torch.zeros(n, dtype=torch.float32)
    tuner.run(x, y, n, sizes.m_bucket(n), grid=(1,), ACTIVATION=activation)
    return tuner.fn.calls[-1]


KEY_TEXT = "M_BUCKET=128 N=100 ACTIVATION='gelu' dtypes=float16,float32"


def store(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def entry_for(config, timings=()):
    return {"config": tuning.config_to_dict(config),
            "timings": [{"config": tuning.config_to_dict(c), "ms": ms} for c, ms in timings]}


def user_table(entries, kernel="tiny"):
    return {"format": tuning.TABLE_FORMAT, "gpu": GPU_NAME, "kernel": kernel, "entries": entries}


def shipped_table(kernels):
    return {"format": tuning.TABLE_FORMAT, "gpu": GPU_NAME, "kernels": kernels}


# --- names and paths ---------------------------------------------------------------------------------

def test_gpu_slug():
    assert tuning.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert tuning.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tuning.gpu_slug(" AMD Instinct MI300X (gfx942) ") == "amd-instinct-mi300x-gfx942"


def test_cache_dir_override_and_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path / "mine"))
    assert tuning.user_cache_path("nvidia-h200", "k") == tmp_path / "mine" / "nvidia-h200" / "k.json"
    monkeypatch.delenv("TILEFUSE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_dir() == tmp_path / "xdg" / "tilefuse"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_dir() == tmp_path / "home" / ".cache" / "tilefuse"
    assert tuning.shipped_table_path("nvidia-h200").name == "nvidia-h200.json"
    assert tuning.shipped_table_path("nvidia-h200").parent.name == "configs"


def test_every_package_kernel_has_its_own_table_name():
    import tilefuse.kernels.attention.launch  # noqa: F401
    import tilefuse.kernels.gemm.launch  # noqa: F401
    import tilefuse.kernels.norms.launch  # noqa: F401
    import tilefuse.kernels.softmax.launch as softmax

    names = [t.name for t in autotuner._TUNERS.values()]
    assert len(names) == len(set(names))
    # Each kernel names its table explicitly, so tables never depend on definition order.
    assert {"linear_portable", "linear_splitk", "attention_fwd", "softmax_fwd_block", "softmax_fwd_loop",
            "softmax_bwd_block", "softmax_bwd_loop", "norm_fwd", "norm_linear"} <= set(names)
    assert not any(n.endswith("_2") for n in names), names
    assert autotuner._TUNERS["softmax_fwd_block"] is softmax.softmax_fwd_block_tuned
    assert autotuner._TUNERS["softmax_fwd_loop"] is softmax.softmax_fwd_loop_tuned


def test_names_are_unique(monkeypatch):
    monkeypatch.setattr(autotuner, "_TUNERS", {})
    first = tuning.autotune(SPACE, key=["N"])(tiny_kernel)
    second = tuning.autotune(SPACE, key=["N"])(tiny_kernel)
    named = tuning.autotune(SPACE, key=["N"], name="tiny_loop")(tiny_kernel)
    assert (first.name, second.name, named.name) == ("tiny_kernel", "tiny_kernel_2", "tiny_loop")
    with pytest.raises(ValueError, match="'tiny_loop' is already used"):
        tuning.autotune(SPACE, key=["N"], name="tiny_loop")(tiny_kernel)


# --- configs as JSON ---------------------------------------------------------------------------------

def test_config_round_trip_keeps_every_field():
    c = triton.Config({"BLOCK_M": 128, "WARP_SPECIALIZE": True, "MODE": "x"}, num_warps=8, num_stages=3,
                      num_ctas=2, maxnreg=168)
    back = tuning.config_from_dict(json.loads(json.dumps(tuning.config_to_dict(c))))
    assert back == c and back.num_ctas == 2 and back.maxnreg == 168 and back.kwargs["WARP_SPECIALIZE"] is True


@pytest.mark.parametrize("bad", [
    {"num_warps": 4},                                   # no kwargs
    {"kwargs": {"BLOCK": 64}, "num_warps": 0},
    {"kwargs": {"BLOCK": 64}, "num_warps": "8"},
    {"kwargs": {"BLOCK": 64}, "num_stages": True},
    {"kwargs": {"BLOCK": [64]}},
    {"kwargs": {"BLOCK": 64}, "pre_hook": "x"},
    "BLOCK=64",
])
def test_malformed_config_is_rejected(bad):
    with pytest.raises(ValueError):
        tuning.config_from_dict(bad)


# --- key construction ----------------------------------------------------------------------------------

def test_key_is_triton_autotuners_own_key():
    """The tuple must be the one triton's Autotuner.run caches under, or a stored config would be
    ignored (or, worse, used for another key)."""
    plain = triton.autotune(configs=SPACE, key=["M_BUCKET", "N", "ACTIVATION"],
                            do_bench=lambda call, quantiles: [1.0, 1.0, 1.0])(tiny_kernel)
    plain.fn = Recorder()
    ours = tuning.TableAutotuner(tiny_kernel, SPACE, ["M_BUCKET", "N", "ACTIVATION"], name="k", pinned=False)
    x, y = torch.zeros(100, dtype=torch.float16), torch.zeros(100)
    plain.run(x, y, 100, 128, grid=(1,), ACTIVATION="gelu")
    key, text = ours.tuning_key((x, y, 100, 128), {"grid": (1,), "ACTIVATION": "gelu"})
    assert list(plain.cache) == [key] == [(128, 100, "gelu", "torch.float16", "torch.float32")]
    assert text == KEY_TEXT


def test_key_text_tells_strings_from_numbers_and_dtypes_apart():
    ours = tuning.TableAutotuner(tiny_kernel, SPACE, ["M_BUCKET", "N", "ACTIVATION"], name="k", pinned=False)
    _, as_str = ours.tuning_key((None, None, 1, 1), {"ACTIVATION": "1"})
    _, as_int = ours.tuning_key((None, None, 1, 1), {"ACTIVATION": 1})
    assert as_str != as_int
    x16, x32 = torch.zeros(1, dtype=torch.float16), torch.zeros(1)
    assert ours.tuning_key((x16, x32, 1, 1), {})[1] != ours.tuning_key((x32, x32, 1, 1), {})[1]


# --- the hook: stored configs, autotune, write-back -----------------------------------------------------

def test_user_cache_entry_runs_alone_without_benchmarking(tables, monkeypatch):
    outside_space = triton.Config({"BLOCK": 512}, num_warps=2, num_stages=1)
    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(outside_space)}))
    tuner = make_tuner(monkeypatch)
    key, _, candidates = tuner.choose(*_launch_args())
    assert candidates == [outside_space] and len(candidates) == 1 and tuner.cache[key] == outside_space
    call = launch(tuner)
    assert tuner.benched == [] and len(tuner.fn.calls) == 1
    assert (call["BLOCK"], call["num_warps"], call["num_stages"]) == (512, 2, 1)
    assert tuner.best_config == outside_space and tuner.launched_config() == outside_space
    [rec] = tuning.tuning_record("tiny")
    assert rec["source"] == "user cache" and rec["key"] == KEY_TEXT


def _launch_args(n=100, activation="gelu"):
    x, y = torch.zeros(n, dtype=torch.float16), torch.zeros(n)
    return (x, y, n, sizes.m_bucket(n)), {"grid": (1,), "ACTIVATION": activation}


def test_shipped_table_is_used_and_user_cache_wins_over_it(tables, monkeypatch):
    shipped_cfg, user_cfg = SPACE[2], SPACE[0]
    store(tuning.shipped_table_path(SLUG), shipped_table({"tiny": {KEY_TEXT: entry_for(shipped_cfg)}}))
    tuner = make_tuner(monkeypatch)
    assert launch(tuner)["BLOCK"] == 256 and tuner.benched == []
    assert tuning.tuning_record("tiny")[0]["source"] == "shipped"

    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(user_cfg)}))
    fresh = make_tuner(monkeypatch)  # a new process: nothing in triton's in-process cache
    assert launch(fresh)["BLOCK"] == 64 and fresh.benched == []
    # Another kernel's or another key's entry is not picked up.
    assert launch(fresh, n=1000)["BLOCK"] == 128 and sorted(fresh.benched) == [64, 128, 256]


def test_stored_config_the_prune_rejects_is_ignored(tables, monkeypatch):
    # A shipped entry the kernel's prune would not keep for this launch (e.g. too much shared memory,
    # or a tile that does not describe the row) is ignored with a warning; the pruned space is tuned.
    store(tuning.shipped_table_path(SLUG), shipped_table({"tiny": {KEY_TEXT: entry_for(SPACE[2])}}))
    tuner = make_tuner(monkeypatch, prune=lambda configs, named, **kw: [c for c in configs if c.kwargs["BLOCK"] < 256])
    with pytest.warns(RuntimeWarning, match="prune rejects it"):
        assert launch(tuner)["BLOCK"] == 128
    assert sorted(tuner.benched) == [64, 128]


def test_new_key_is_tuned_once_and_written_with_the_configs_it_beat(tables, monkeypatch):
    tuner = make_tuner(monkeypatch)
    assert launch(tuner)["BLOCK"] == 128 and sorted(tuner.benched) == [64, 128, 256]
    launch(tuner)
    assert len(tuner.benched) == 3  # in-process cache: no second tuning

    data = json.loads(tuning.user_cache_path(SLUG, "tiny").read_text())
    assert data["format"] == tuning.TABLE_FORMAT and data["gpu"] == GPU_NAME and data["kernel"] == "tiny"
    entry = data["entries"][KEY_TEXT]
    assert entry["config"]["kwargs"] == {"BLOCK": 128}
    assert [(r["config"]["kwargs"]["BLOCK"], r["ms"]) for r in entry["timings"]] == [(128, 1.0), (256, 2.0),
                                                                                       (64, 3.0)]
    [rec] = tuning.tuning_record("tiny")
    assert rec["source"] == "autotuned" and rec["path"] == str(tuning.user_cache_path(SLUG, "tiny"))
    assert rec["tuning_seconds"] >= 0 and "tuning_seconds" not in entry  # the run's record only, not the file
    text = tuning.describe_record(rec)
    assert text == ("BLOCK=128 w4 s3 [autotuned] 1.000 ms; "
                    "beat BLOCK=256 w8 s2 2.000 ms (+100%), BLOCK=64 w4 s3 3.000 ms (+200%)"), text

    fresh = make_tuner(monkeypatch)  # next process reads it back: no benchmark
    assert launch(fresh)["BLOCK"] == 128 and fresh.benched == []
    assert tuning.tuning_record("tiny")[0]["timings"] == entry["timings"]


def test_second_key_merges_into_the_same_file(tables, monkeypatch):
    tuner = make_tuner(monkeypatch)
    launch(tuner, n=100)
    launch(tuner, n=1000, activation="relu")
    entries = json.loads(tuning.user_cache_path(SLUG, "tiny").read_text())["entries"]
    assert set(entries) == {KEY_TEXT, "M_BUCKET=1024 N=1000 ACTIVATION='relu' dtypes=float16,float32"}


def test_retune_ignores_stored_configs(tables, monkeypatch):
    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(SPACE[0])}))
    monkeypatch.setattr(autotuner, "_use_stored_configs", False)
    tuner = make_tuner(monkeypatch)
    assert launch(tuner)["BLOCK"] == 128 and len(tuner.benched) == 3
    stored = json.loads(tuning.user_cache_path(SLUG, "tiny").read_text())["entries"][KEY_TEXT]
    assert stored["config"]["kwargs"] == {"BLOCK": 128}


def test_off_the_gpu_nothing_is_read_or_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    tuner = make_tuner(monkeypatch)  # real _device_name: CPU tensors -> no GPU
    launch(tuner)
    assert len(tuner.benched) == 3 and not any(tmp_path.iterdir())


def test_pinned_uses_first_pruned_config_without_tables_or_benchmark(tables, monkeypatch):
    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(SPACE[0])}))
    tuner = make_tuner(monkeypatch, pinned=True, prune=lambda configs, named, **kw: configs[1:])
    assert launch(tuner)["BLOCK"] == 128 and tuner.benched == []
    assert tuning.tuning_record("tiny")[0]["source"].startswith("pinned")


def test_untuned_keys_run_first_pruned_config_and_stored_ones_still_apply(tables, monkeypatch):
    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(SPACE[2])}))
    monkeypatch.setattr(autotuner, "_tune_missing_keys", True)  # both restored after the test
    monkeypatch.setattr(autotuner, "_compile_missing_space", False)
    tuning.tune_missing_keys(False)
    tuner = make_tuner(monkeypatch, prune=lambda configs, named, **kw: configs[1:])
    assert launch(tuner)["BLOCK"] == 256  # a stored key: its table's config
    assert launch(tuner, n=1000)["BLOCK"] == 128  # a key no table has: the first pruned config
    assert tuner.benched == []
    sources = {r["key"]: r["source"] for r in tuning.tuning_record("tiny")}
    assert sources[KEY_TEXT] == "user cache"
    assert sources["M_BUCKET=1024 N=1000 ACTIVATION='gelu' dtypes=float16,float32"] == autotuner.UNTUNED_SOURCE
    entries = json.loads(tuning.user_cache_path(SLUG, "tiny").read_text())["entries"]
    assert set(entries) == {KEY_TEXT}  # nothing written for the untuned key
    tuning.tune_missing_keys(False, compile_space=True)  # also compiles the rest of the space, runs none
    tuner.fn.calls.clear()
    assert launch(tuner, n=2000)["BLOCK"] == 128 and tuner.benched == []
    assert [(c["BLOCK"], c.get("warmup", False)) for c in tuner.fn.calls] == [(256, True), (128, False)]


def test_stored_config_that_fails_to_compile_is_dropped_and_key_tuned(tables, monkeypatch):
    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(SPACE[2])}))
    tuner = make_tuner(monkeypatch, fail_for=256)
    real_bench = tuner._do_bench

    def bench_or_inf(kernel_call, quantiles):  # triton's _bench turns OutOfResources into inf
        try:
            return real_bench(kernel_call, quantiles)
        except OutOfResources:
            return [float("inf")] * 3

    tuner._do_bench = bench_or_inf
    with pytest.warns(RuntimeWarning, match="does not run on this GPU"):
        assert launch(tuner)["BLOCK"] == 128
    entry = json.loads(tuning.user_cache_path(SLUG, "tiny").read_text())["entries"][KEY_TEXT]
    assert entry["config"]["kwargs"] == {"BLOCK": 128} and entry["timings"][-1]["ms"] is None


def test_stored_config_with_other_parameter_names_is_ignored(tables, monkeypatch):
    stale = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4)
    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(stale)}))
    tuner = make_tuner(monkeypatch)
    with pytest.warns(RuntimeWarning, match="not the kernel's"):
        assert launch(tuner)["BLOCK"] == 128
    assert len(tuner.benched) == 3


# --- corrupt files, atomic and concurrent writes ---------------------------------------------------------

@pytest.mark.parametrize("content", [
    '{"format": 1, "entries": {"M_BUCKET=128',            # torn write
    "[]",
    '{"format": 99, "entries": {}}',
    '{"format": 1, "entries": []}',
])
def test_corrupt_user_cache_warns_with_its_path_and_is_replaced(tables, monkeypatch, content):
    path = tuning.user_cache_path(SLUG, "tiny")
    path.parent.mkdir(parents=True)
    path.write_text(content)
    tuner = make_tuner(monkeypatch)
    with pytest.warns(RuntimeWarning, match=str(path)):
        assert launch(tuner)["BLOCK"] == 128
    assert len(tuner.benched) == 3
    assert set(json.loads(path.read_text())["entries"]) == {KEY_TEXT}


def test_one_bad_entry_is_skipped_the_rest_is_used(tables, monkeypatch):
    path = tuning.shipped_table_path(SLUG)
    good = entry_for(SPACE[0])
    bad_timing = {**good, "timings": [{"config": {"kwargs": {}, "num_stages": "3"}, "ms": 1.0}]}
    store(path, shipped_table({"tiny": {KEY_TEXT: good, "other": {"config": {"kwargs": {}, "num_warps": -1}},
                                        "third": bad_timing}}))
    with pytest.warns(RuntimeWarning, match="entry 'other'"), pytest.warns(RuntimeWarning, match="entry 'third'"):
        assert tuning.load_shipped_table(path) == {"tiny": {KEY_TEXT: good}}
    with pytest.warns(RuntimeWarning, match="'kernels' is not an object"):
        store(path, {"format": 1, "kernels": ["tiny"]})
        assert tuning.load_shipped_table(path) == {}


def test_missing_files_are_silent(tmp_path, monkeypatch, recwarn):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    assert tuning.load_user_entries(tmp_path / "none.json") == {}
    assert tuning.load_shipped_table(tmp_path / "none.json") == {}
    assert tuning.lookup("no-such-gpu", "tiny", KEY_TEXT) is None
    assert not recwarn.list


def test_atomic_write_leaves_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    tuning.atomic_write_json(path, {"v": 1})

    def dump_half_then_fail(obj, f, **kw):
        f.write('{"v": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(tables_mod.json, "dump", dump_half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        tuning.atomic_write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left behind


def test_concurrent_writers_keep_every_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    errors = []

    def writer(i):
        try:
            for j in range(5):
                tuning.store_user_entry(SLUG, "k", f"key{i}-{j}", entry_for(SPACE[j % 3]), GPU_NAME)
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    entries = tuning.load_user_entries(tuning.user_cache_path(SLUG, "k"))
    assert set(entries) == {f"key{i}-{j}" for i in range(8) for j in range(5)}


def test_write_table_merges_into_shipped_format(tables, monkeypatch):
    out = tables / "out" / "nvidia-test.json"
    old = tuning.config_to_dict(SPACE[0])
    store(out, shipped_table({"tiny": {"kept": {"config": old}, KEY_TEXT: {"config": old}},
                              "other_kernel": {"k": {"config": old}}}))
    tuner = make_tuner(monkeypatch)
    launch(tuner)
    assert tuning.write_table(out, tuning.tuning_record("tiny"), GPU_NAME) == 1
    table = tuning.load_shipped_table(out)
    assert set(table) == {"tiny", "other_kernel"} and set(table["tiny"]) == {"kept", KEY_TEXT}
    assert table["tiny"][KEY_TEXT]["config"]["kwargs"] == {"BLOCK": 128}
    assert len(table["tiny"][KEY_TEXT]["timings"]) == 3
    # The written table is what the lookup reads as a shipped table.
    monkeypatch.setattr(tables_mod, "SHIPPED_DIR", out.parent)
    found = tuning.lookup("nvidia-test", "tiny", KEY_TEXT)
    assert found[1] == "shipped" and found[0]["config"]["kwargs"] == {"BLOCK": 128}


def test_describe_record_of_a_gemm_config_with_a_failed_candidate():
    win = triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8), num_warps=8, num_stages=3)
    lost = triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8), num_warps=8, num_stages=4)
    huge = triton.Config(dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=128, GROUP_M=8), num_warps=8, num_stages=5)
    record = {"source": "shipped",
              **tuning.make_entry(win, {huge: [float("inf")] * 3, lost: [0.6, 0.5, 0.7], win: [0.5, 0.4, 0.6]})}
    assert [r["ms"] for r in record["timings"]] == [0.5, 0.6, None]
    assert tuning.describe_record(record) == ("128x256x64 w8 s3 [shipped] 0.500 ms; "
                                              "beat 128x128x64 w8 s4 0.600 ms (+20%), 256x256x128 w8 s5 failed")
    assert tuning.describe_record(record, top=1).endswith("(+20%), +1 more")


def test_unknown_kernel_record_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        tuning.tuning_record("nope")


# --- tilefuse tune -------------------------------------------------------------------------------------

def test_tune_ops_runs_each_bench_case_of_the_dtypes_asked_and_goes_on_after_a_failure(monkeypatch):
    from tilefuse import registry
    from tilefuse.opspec import OpSpec

    ran = []

    def fused(x, fail):
        if fail:
            raise RuntimeError("out of memory")
        ran.append((tuple(x.shape), x.dtype))

    spec = OpSpec(name="fake", summary="", fused=fused, reference=fused,
                  make_inputs=lambda p, device, seed: {"x": torch.zeros(p["n"], dtype=p["dtype"], device=device),
                                                       "fail": p.get("fail", False)},
                  test_grid={}, gpu_test_grid={}, accuracy_cases={}, flops=lambda p: 0,
                  hbm_bytes=lambda p: {}, bound="memory",
                  bench_cases=[dict(n=3, dtype=torch.bfloat16), dict(n=5, dtype=torch.float32),
                               dict(n=7, dtype=torch.bfloat16, fail=True), dict(n=9, dtype=torch.bfloat16)])
    monkeypatch.setitem(registry.REGISTRY, "fake", spec)
    lines = []
    failures = harness_tune.tune_ops(["fake"], dtypes=["bf16"], device="cpu", log=lines.append)
    assert ran == [((3,), torch.bfloat16), ((9,), torch.bfloat16)]
    assert len(failures) == 1 and "n=7" in failures[0] and "RuntimeError: out of memory" in failures[0]
    assert sum("FAILED" in line for line in lines) == 1 and len(lines) == 3


def test_tune_command_prints_choices_and_merges_out_table(tables, monkeypatch, capsys):
    tuner = make_tuner(monkeypatch)
    asked = {}

    def fake_tune_ops(names, dtypes=None, **kw):
        asked.update(names=names, dtypes=dtypes, stored=autotuner._use_stored_configs)
        launch(tuner)
        return []

    # The GPU test run pins configs (TILEFUSE_AUTOTUNE=0), which `tune` refuses: this test is about tuning.
    monkeypatch.delenv("TILEFUSE_AUTOTUNE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU_NAME)
    monkeypatch.setattr(harness_tune, "tune_ops", fake_tune_ops)  # cmd_tune imports it when it runs
    monkeypatch.setattr(autotuner, "_TUNERS", {"tiny": tuner})
    out = tables / f"{SLUG}.json"
    assert cli.main(["tune", "--ops", "linear", "--dtype", "bf16", "--retune", "--out", str(out)]) == 0
    assert asked == {"names": ["linear"], "dtypes": ["bf16"], "stored": False}
    text = capsys.readouterr().out
    assert f"tiny [{KEY_TEXT}]" in text and "beat BLOCK=256 w8 s2 2.000 ms (+100%)" in text
    assert f"configs/{SLUG}.json" in text
    assert tuning.load_shipped_table(out)["tiny"][KEY_TEXT]["config"]["kwargs"] == {"BLOCK": 128}


# --- CLI -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_tune_refuses_without_a_gpu(capsys):
    assert cli.main(["tune", "--ops", "linear", "--dtype", "bf16"]) == 2
    assert "tuning needs a CUDA device; interpreter timings mean nothing" in capsys.readouterr().err


def test_settled_key_skips_table_lookup_on_later_launches(tables, monkeypatch):
    # After the first launch of a key, later launches must not look anything up again (host hot path).
    store(tuning.user_cache_path(SLUG, "tiny"), user_table({KEY_TEXT: entry_for(SPACE[1])}))
    tuner = make_tuner(monkeypatch)
    launch(tuner)
    looked_up = []
    monkeypatch.setattr(tuner, "choose", lambda *a: looked_up.append(a) or (_ for _ in ()).throw(AssertionError))
    for _ in range(3):
        assert launch(tuner)["BLOCK"] == SPACE[1].kwargs["BLOCK"]
    assert looked_up == [] and len(tuner.fn.calls) == 4


def test_shipped_tables_match_the_kernels_they_name():
    """A shipped table must stay in step with the kernels: every entry loads, names a kernel that
    exists, keys it on that kernel's key arguments and holds a config of its parameters. (An entry the
    loader rejects is ignored at runtime with a warning, silently costing the user a tuning run.)"""
    import json
    from pathlib import Path

    import tilefuse.kernels.attention.launch  # noqa: F401
    import tilefuse.kernels.gemm.launch  # noqa: F401
    import tilefuse.kernels.norms.launch  # noqa: F401
    import tilefuse.kernels.softmax.launch  # noqa: F401

    assert tables_mod.SHIPPED_DIR == Path(tuning.tables.__file__).parent.parent / "configs"
    tables = sorted(tables_mod.SHIPPED_DIR.glob("*.json"))
    assert tables, "no shipped table"
    for path in tables:
        raw = json.loads(path.read_text())
        loaded = tuning.load_shipped_table(path)
        assert {k: len(v) for k, v in loaded.items()} == {k: len(v) for k, v in raw["kernels"].items()}, path
        for kernel, entries in loaded.items():
            if kernel in choices._CHOICES:  # a backend choice: its entries name one of its candidates
                assert all(set(e["config"]["kwargs"]) == {"BACKEND"}
                           and e["config"]["kwargs"]["BACKEND"] in choices._CHOICES[kernel].candidates
                           for e in entries.values()), kernel
                continue
            tuner = autotuner._TUNERS[kernel]
            for key, entry in entries.items():
                names = [part.split("=", 1)[0] for part in key.split(" dtypes=")[0].split()]
                assert names == [k for k in tuner.keys if k in names] and set(names) <= set(tuner.keys), (kernel, key)
                config = tuning.config_from_dict(entry["config"])
                assert frozenset(config.kwargs) == tuner._param_names, (kernel, key, config.kwargs)


def test_describe_tells_row_kernel_variants_apart():
    # The report lists the configs a choice beat: variants that differ only in pipelining depth,
    # persistence or register cap must not read the same.
    loop = dict(BLOCK_M=1, BLOCK_N=8192, LOOP_STAGES=3)
    texts = {tuning.describe(triton.Config({**loop, "PROGRAMS_PER_SM": p}, num_warps=16)) for p in (0, 1, 2)}
    texts.add(tuning.describe(triton.Config({**loop, "LOOP_STAGES": 1, "PROGRAMS_PER_SM": 0}, num_warps=16)))
    texts.add(tuning.describe(triton.Config(dict(BLOCK_M=128, BLOCK_N=64), num_warps=8, num_stages=2, maxnreg=128)))
    texts.add(tuning.describe(triton.Config(dict(BLOCK_M=128, BLOCK_N=64), num_warps=8, num_stages=2)))
    assert len(texts) == 6, texts


def test_shipped_table_keys_name_each_kernels_live_key_arguments():
    """A shipped entry is only found when its key text is the one the live tuner writes: the key argument
    names, in order, then the dtypes. A kernel that gains a key argument (linear_tma's NORM) must carry
    its table along, or every shipped shape silently autotunes again on first use."""
    import tilefuse.kernels.attention.launch  # noqa: F401
    import tilefuse.kernels.gemm.launch  # noqa: F401
    import tilefuse.kernels.norms.launch  # noqa: F401
    import tilefuse.kernels.softmax.launch  # noqa: F401

    path = tuning.shipped_table_path("nvidia-h200")
    table = json.loads(path.read_text())
    assert table["kernels"], path
    for kernel, entries in table["kernels"].items():
        if kernel in choices._CHOICES:  # a backend choice's key is its launch module's ChoiceKey text
            continue
        assert kernel in autotuner._TUNERS, f"{path} names {kernel!r}, which no tuner has"
        names = list(autotuner._TUNERS[kernel].keys)
        for key in entries:
            head, _, dtypes = key.partition(" dtypes=")
            assert dtypes, key
            assert [token.split("=", 1)[0] for token in head.split(" ")] == names, (kernel, key, names)

"""Capacity accounting: the article's MLA figures come out of configs/glm5.py exactly, and the per-session
breakdown is the engine's own memory report (one source of truth)."""

import importlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm53
from glm53 import memory
from glm53.config import CacheConfig, ModelConfig
from engine_common import MESH_CFG as CFG
import python_runner

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_articles_figures_from_the_glm5_config():
    c = importlib.import_module("configs.glm5").get_config()
    cfg, cc = ModelConfig.from_config_dict(c.model), CacheConfig.from_config_dict(c.cache)
    got = [(f["unit"], f["value"]) for f in memory.article_figures(cfg, cc)]
    # kv-offload-article.md, as printed
    want = [("B", 656), ("MiB", 31.281), ("GiB", 4.765), ("MiB", 1.28125), ("MiB", 20.5), ("GiB", 99.94),
            ("GiB", 1499.06), ("GiB", 46.85)]
    for (u, v), (wu, wv) in zip(got, want):
        places = len(str(wv).split(".")[1]) if "." in str(wv) else 0
        assert u == wu and round(v, places) == wv, (u, v, wu, wv)
    assert memory.article_figures(cfg, cc)[1]["bytes"] == 50_000 * 656


@pytest.mark.parametrize("mode,index_keys", [("resident", "model"), ("offload", "model"), ("offload", "fp8")])
def test_session_bytes_are_the_engines_per_slot_bytes(mode, index_keys):
    cc = CacheConfig(mode=mode, kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64, max_len=300,
                     index_keys=index_keys)
    model = glm53.from_config(CFG, seed=0, dtype="float32", cache_config=cc)
    e = glm53.Engine(model, max_sessions=3)
    report = e.memory_report()
    s = memory.session_bytes(CFG, cc, 300, jnp.float32)
    assert s["capacity"] == e.capacity
    assert sum(s["device"].values()) == report["device"]["per_slot_bytes"]
    assert sum(s["host"].values()) * 3 == report["host"]["pool_bytes"]
    assert s["transient"] == report["device"]["transient_bytes"]
    if mode == "offload":  # the parts the article left out are there
        assert {"index_keys", "slot_of_position", "ring", "hot", "page_table"} <= set(s["device"])


def test_capacity_entry_point(tmp_path):
    out = tmp_path / "cap.json"
    p = python_runner.run(["-m", "experiments.capacity", "--history=50000,1048576", f"--out={out}"],
                          cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert all(f["matches_article"] for f in r["article"]) and "DIFFERS" not in p.stdout
    assert set(r["session"]) == {"50000", "1048576"} and len(r["fit"]) == 2
    one_m = r["session"]["1048576"]
    assert one_m["host"]["pool"] == (1 << 20) * 656 * 79  # every cache layer (MTP too), one replica


def test_capacity_for_given_sizes():
    p = python_runner.run(["-m", "experiments.capacity", "--config=configs/h200_bench.py",
                          "--history=1048576", "--machine=custom", "--devices=1", "--device_gib=139", "--host_gib=125",
                          "--sessions=16"], cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "16 sessions on custom: 1 devices x 139.0 GiB, 125.0 GiB per host" in p.stdout
    # h200_bench's cache is resident: no host pool to fit, said so (it printed "fits None, at most None")
    assert "no host pool (resident" in p.stdout and "None" not in p.stdout


def test_a_hot_cache_larger_than_a_slot_is_counted_as_the_engine_cuts_it():
    """An offload engine cuts hot_rows to the slot's rows (a larger hot cache could never fill); the accounting
    counted the hot cache, its maps and pins at the configured size: 4,096 rows per layer for a 304-row slot."""
    cc = CacheConfig(mode="offload", kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=4096,
                     max_len=300)
    model = glm53.from_config(CFG, seed=0, dtype="float32", cache_config=cc)
    e = glm53.Engine(model, max_sessions=2)
    assert e.cache_config.hot_rows < cc.hot_rows
    report = e.memory_report()
    s = memory.session_bytes(CFG, cc, 300, jnp.float32)
    assert sum(s["device"].values()) == report["device"]["per_slot_bytes"]
    p = memory.plan(CFG, cc, sessions=2, history=300, dtype=jnp.float32)
    assert p["per_device"]["cache"] == report["device"]["cache_bytes"]
    assert p["per_host"]["pool"] == report["host"]["pool_bytes"]
    _, state, _ = memory.abstract_engine_state(CFG, cc, sessions=2, history=300, dtype=jnp.float32)
    assert sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state)) == sum(
        int(x.nbytes) for x in jax.tree_util.tree_leaves(e.cache))


@pytest.mark.parametrize("kw, message", [
    (dict(sessions=0), "sessions must be an int >= 1, got 0"),
    (dict(sessions=-1), "sessions must be an int >= 1, got -1"),
    (dict(sessions=1.5), "sessions must be an int >= 1, got 1.5"),
    (dict(history=0), "history must be an int >= 1, got 0"),
    (dict(history=True), "history must be an int >= 1, got True"),
    (dict(hot_rows=100), "offload: hot_rows=100 must be a power of two"),
    (dict(hot_rows=32), "offload: hot_rows=32 is below what a round can pin")])
def test_the_library_accounting_refuses_what_no_engine_could_be(kw, message):
    """memory.plan and memory.session_bytes called directly (the entry points check their flags themselves): zero,
    negative or fractional counts gave zero, negative or fractional bytes, and an offload cache the engine refuses
    was counted as if it could run."""
    cc = CacheConfig(mode="offload", kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64)
    if "hot_rows" in kw:
        cc = cc.replace(hot_rows=kw["hot_rows"])
    sessions, history = kw.get("sessions", 2), kw.get("history", 300)
    with pytest.raises(glm53.ConfigError, match=message):
        memory.plan(CFG, cc, sessions=sessions, history=history, dtype=jnp.float32)
    if "sessions" not in kw:
        with pytest.raises(glm53.ConfigError, match=message):
            memory.session_bytes(CFG, cc, history, jnp.float32)


@pytest.mark.parametrize("args,message", [
    (["--history=50k"], "--history=50k: give history lengths in tokens"),
    (["--history=100,0"], "--history=100,0: give history lengths in tokens"),
    (["--sessions=0"], "flag --sessions=0: 0 is not a positive integer"),
    (["--config.cache.mode=offload", "--config.cache.hot_rows=100"], "offload: hot_rows=100 is below what a round")])
def test_capacity_refuses_what_no_engine_could_be(args, message):
    """A history that is no token count (a traceback before), a history or session count of zero, an offload cache
    the engine refuses (counted as if it could run before): each a one-line error naming the problem."""
    p = python_runner.run(["-m", "experiments.capacity", "--config=configs/tiny.py", *args], cwd=ROOT, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert message in p.stderr, p.stderr[-2000:]


def test_capacity_records_its_command(tmp_path):
    """The JSON records the command that made it beside the git revision, as every other entry point's does."""
    out = tmp_path / "cap.json"
    p = python_runner.run(["-m", "experiments.capacity", "--config=configs/tiny.py", "--history=100",
                          f"--out={out}"], cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["git"]["commit"] and r["command"] == (f"python -m experiments.capacity --config=configs/tiny.py "
                                                  f"--history=100 --out={out}")
    # the default machine's 16-way tp cannot split tiny's 4 heads: sections 1 and 2 stand, the fit table says why not
    assert "does not divide num_attention_heads=4" in r["fit"]["not_planned"] and r["session"]["100"]["capacity"]


def test_capacity_refuses_a_layout_it_cannot_plan_in_one_line():
    """Its fit table is tensor parallel over the machine's devices: tp not dividing the heads was a traceback, and
    a --config.mesh override was silently ignored."""
    for args, what in [(["--machine=custom", "--devices=3", "--device_gib=1", "--host_gib=1"],
                        "mesh.tp=3 does not divide num_attention_heads=4"),
                       (["--config.mesh.stages=2"], "--config.mesh.stages=2: experiments.capacity counts")]:
        p = python_runner.run(["-m", "experiments.capacity", "--config=configs/tiny.py", *args], cwd=ROOT, timeout=120)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert what in p.stderr.strip().splitlines()[-1], p.stderr[-1000:]


def test_free_bytes_of_a_cpu_is_the_hosts_available_memory():
    """On the CPU (no allocator statistics) what a device can take is the host's available memory."""
    meminfo = dict(line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS=cuda (the GPU runs of the tests) leaves the CPU backend out
        pytest.skip("no CPU backend in this process")
    got = memory.free_bytes(cpu)
    assert got is not None and abs(got - available) < 512 << 20  # the page cache moves between the two reads


def test_weights_that_cannot_fit_are_refused_before_the_first_is_made(monkeypatch):
    """Random weights larger than the device's free memory: one ConfigError naming both sizes, before any
    parameter exists (it ran until the allocator or the OOM killer stopped the process; a checkpoint's: test_api).
    Weights that fit, or a device that reports nothing, go ahead; random FP8 experts count the FP8 model and the
    one expert stack being quantised in the model's dtype. A draw also holds one block's temporaries."""
    from glm53 import params as params_lib

    def no_weights(*a, **k):
        raise AssertionError("parameters were initialised")

    device = jax.local_devices()[0]  # where the weights are made: cpu:0 here, gpu:0 in the GPU runs
    shapes = jax.tree_util.tree_leaves(params_lib.param_shapes(CFG, "float32"))
    # the block being drawn: its values and XLA's temporaries (none on a GPU)
    drawing = params_lib.draw_transient_bytes(shapes, device.platform)
    need = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in shapes) + drawing
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1)
    with monkeypatch.context() as m:
        m.setattr(glm53.models, "init_params", no_weights)
        mib = f"{need / 2**20:.1f}".replace(".", r"\.")
        below = f"{(need - 1) / 2**20:.1f}".replace(".", r"\.")
        with pytest.raises(glm53.ConfigError, match=rf"random weights: {CFG.param_count() / 1e6:.1f}M parameters "
                                                    rf"need {mib} MiB on {device.platform}:{device.id} \(float32, "
                                                    rf"experts model\), which has {below} MiB free; use a smaller "
                                                    rf"config"):
            glm53.from_config(CFG, dtype="float32")
    monkeypatch.setattr(memory, "free_bytes", lambda device: need)
    assert glm53.from_config(CFG, dtype="float32").config == CFG
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)
    assert glm53.from_config(CFG, dtype="float32").config == CFG
    fp8 = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
              for x in jax.tree_util.tree_leaves(params_lib.param_shapes(CFG, "bfloat16", "fp8")))
    bf16 = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(params_lib.param_shapes(CFG, "bfloat16")))
    # each expert stack is quantised as soon as it is drawn: the FP8 model and the largest stack in bfloat16
    stack = max(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                for x in jax.tree_util.tree_leaves(params_lib.param_shapes(CFG, "bfloat16")))
    assert fp8 + stack < bf16
    monkeypatch.setattr(memory, "free_bytes", lambda device: fp8 + stack + drawing - 1)
    with pytest.raises(glm53.ConfigError, match="experts fp8"):
        glm53.from_config(CFG, dtype="bfloat16", expert_weights="fp8")
    monkeypatch.setattr(memory, "free_bytes", lambda device: fp8 + stack + drawing)
    assert glm53.from_config(CFG, dtype="bfloat16", expert_weights="fp8").expert_weights == "fp8"


def test_free_memory_problem_per_accelerator_and_for_the_shared_host():
    """An accelerator must hold one device's share; CPU devices and the host pool share the host's memory; memory
    that is not known is not checked."""
    from types import SimpleNamespace as NS

    need = {"cache": 600, "transient": 300, "step_buffers": 100}  # a share of 1,000 bytes
    gpus = [NS(platform="gpu", id=0), NS(platform="gpu", id=1)]
    room = {0: 1000, 1: 999}
    got = memory.free_memory_problem(need, 0, gpus, free_of=lambda d: room[d.id], host_free=lambda: 1 << 40)
    assert got.startswith("the engine's cache needs 0.0 MiB on gpu:1 (cache 600 bytes, transient 300, step buffers "
                          "100), which has 0.0 MiB free"), got
    room[1] = 1000
    assert memory.free_memory_problem(need, 0, gpus, free_of=lambda d: room[d.id], host_free=lambda: 0) is None
    # the host pool lives in host memory on every platform
    assert "host pool 5 bytes" in memory.free_memory_problem(need, 5, gpus, free_of=lambda d: room[d.id],
                                                             host_free=lambda: 4)
    assert memory.free_memory_problem(need, 0, gpus, free_of=lambda d: None, host_free=lambda: None) is None
    cpus = [NS(platform="cpu", id=i) for i in range(4)]
    assert memory.free_memory_problem(need, 24, cpus, host_free=lambda: 4024) is None
    got = memory.free_memory_problem(need, 25, cpus, host_free=lambda: 4024)
    assert "4 CPU device(s) x 1,000 bytes" in got and "host pool 25 bytes" in got, got


@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_an_engine_that_cannot_fit_is_refused_before_it_allocates(mode, monkeypatch):
    """A cache larger than the memory it goes to (on a CPU the host's available memory, which holds the devices'
    caches and the pool; on an accelerator its own free memory): AdmissionError naming the sizes, before any cache
    array exists (a 64-slot 1M-row cache ran into the OOM killer)."""
    model = glm53.from_config(CFG, seed=0, dtype="float32")
    cc = CacheConfig(mode=mode, kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64, max_len=300)
    built = glm53.Engine(model, cc, max_sessions=2)
    needed = sum(sum(p.values()) for p in memory.cache_bytes(CFG, built.cache_config, 2, built.capacity,
                                                              built.alloc_pages, model.dtype).values())
    del built
    monkeypatch.setattr(glm53.Engine, "_build", lambda self: pytest.fail("the cache was allocated"))
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        monkeypatch.setattr(memory, "host_available_bytes", lambda: needed - 1)
        refused = r"needs .* of host memory \(1 CPU device\(s\) x .* which has .* available; lower max_sessions"
    else:
        monkeypatch.setattr(memory, "free_bytes", lambda d: 1 << 10)
        refused = rf"the engine's cache needs .* on {device.platform}:{device.id} \(cache .*\), which has 0\.0 MiB free"
    with pytest.raises(glm53.AdmissionError, match=refused + ".*Nothing was allocated"):
        glm53.Engine(model, cc, max_sessions=2)

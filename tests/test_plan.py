"""The memory planner (glm53.memory.plan, experiments.plan): its figures are the ones a built engine reports, its
parameter shards follow the sharding rules (checked by hand on known shapes), and its session counts are exact."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm53
from glm53 import memory, sharding
from glm53.config import CacheConfig
from engine_common import MESH_CFG as CFG
from experiments.launch import xla_flags_with_devices
import python_runner

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_shard_bytes_by_hand():
    f32 = jnp.float32
    params = {"lm_head": jax.ShapeDtypeStruct((64, 256), f32),
              "layers_0": {"self_attn": {"o_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), f32)}},
                           "mlp": {"experts_down_proj": jax.ShapeDtypeStruct((8, 32, 64), jnp.bfloat16)}},
              "norm": {"weight": jax.ShapeDtypeStruct((64,), f32)}}
    # lm_head splits its vocabulary, o_proj its heads, the experts their width; the norm is whole everywhere
    assert sharding.shard_bytes(params, {"stage": 1, "tp": 4}) == 64 * 256 * 4 // 4 + 64 * 64 * 4 // 4 \
        + 8 * 32 * 64 * 2 // 4 + 64 * 4
    assert sharding.shard_bytes(params, {"stage": 1, "tp": 1}) == (64 * 256 + 64 * 64 + 64) * 4 + 8 * 32 * 64 * 2


@pytest.mark.devices(4)
@pytest.mark.parametrize("mode,stages,tp", [("resident", 1, 1), ("resident", 1, 2), ("offload", 1, 1),
                                           ("offload", 1, 2), ("offload", 3, 1), ("offload", 2, 2)])
def test_plan_equals_what_the_engine_allocates(mode, stages, tp):
    cc = CacheConfig(mode=mode, kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64, max_len=200)
    model = glm53.from_config(CFG, seed=0, dtype="float32", cache_config=cc,
                              mesh=glm53.MeshConfig(stages=stages, tp=tp))
    e = glm53.Engine(model, max_sessions=3)
    report = e.memory_report()
    p = memory.plan(CFG, cc, sessions=3, history=200, dtype=jnp.float32, mesh_shape={"stage": stages, "tp": tp})
    assert p["capacity"] == e.capacity
    assert p["per_device"]["params"] == report["device"]["params_bytes"]
    assert p["per_device"]["cache"] == report["device"]["cache_bytes"]
    assert p["per_device"]["transient"] == report["device"]["transient_bytes"]
    # the output rings' kept buffers (an engine on one GPU): in the device's total, as the engine's budget counts them
    assert p["per_device"]["step_buffers"] == e.step_buffers_bound() == 0  # (the CPU: no ring)
    e.output_ring = 3
    q = memory.plan(CFG, cc, sessions=3, history=200, dtype=jnp.float32, mesh_shape={"stage": stages, "tp": tp},
                    output_ring=3)
    assert q["per_device"]["step_buffers"] == e.step_buffers_bound() == e._device_need()["step_buffers"] > 0
    assert q["per_device"]["total"] == p["per_device"]["total"] + e.step_buffers_bound()
    assert p["per_host"]["pool"] == report["host"]["pool_bytes"]
    parts = e.cache.parts if stages > 1 else (e.cache,)
    if mode == "offload":  # one copy of its stage's pool per device, each in the host's memory
        assert p["per_host"]["pool_replicas"] == report["host"]["pool_replicas"] == tp
        held = sum(int(s.data.nbytes) for part in parts for x in jax.tree_util.tree_leaves(part.pool)
                   for s in x.addressable_shards)
        assert held == p["per_host"]["total"]
        if stages == 1:
            assert held == tp * p["per_host"]["pool"]
        else:  # by hand: a page holds copyback_every rows of each of the stage's cache layers
            from kernels_pallas import kv_formats

            row = kv_formats.get_format("q8g64").bytes_per_row
            for st, part, layers in zip(p["stages"], parts, model.pipeline.layers):
                assert st["layers"] == list(layers)
                assert st["pool"] == e.alloc_pages * len(st["layers"]) * 16 * row == sum(
                    int(x.nbytes) for x in jax.tree_util.tree_leaves(part.pool))
    # and the engine's own figure is what a device holds: its shard of every parameter it has (stages: the
    # device holding the most, the last stage's with its copy of the embedding)
    tree = model.pipeline.stage_params(model.params) if stages > 1 else model.params
    per_device = {}
    for x in jax.tree_util.tree_leaves(tree):
        for s in x.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + int(np.prod(s.data.shape)) * s.data.dtype.itemsize
    assert max(per_device.values()) == p["per_device"]["params"]


def test_session_counts_are_exact():
    cc = CacheConfig(mode="offload", kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64)
    base = memory.plan(CFG, cc, sessions=5, history=300, dtype=jnp.float32)
    total, pool = base["per_device"]["total"], base["per_host"]["pool"]
    p = memory.plan(CFG, cc, sessions=5, history=300, dtype=jnp.float32, device_bytes=total, host_bytes=pool)
    assert p["fits_device"] and p["fits_host"]
    assert p["max_sessions_by_device"] == 5 and p["max_sessions_by_host"] == 5
    q = memory.plan(CFG, cc, sessions=5, history=300, dtype=jnp.float32, device_bytes=total - 1, host_bytes=pool - 1)
    assert not q["fits_device"] and not q["fits_host"]
    assert q["max_sessions_by_device"] == 4 and q["max_sessions_by_host"] == 4


@pytest.mark.devices(2)
def test_plan_says_whether_the_weights_can_be_loaded():
    """The peak while the weights are made or read, as the constructors' check counts it (memory.weights_need):
    each device its share (with stages its stage's), the one they are made on (the first stage's) the largest weight
    twice more; one device its parameters."""
    from glm53.params import nbytes, param_shapes

    cc = CacheConfig(kv_format="f32", prefill_chunk=16)
    whole = nbytes(param_shapes(CFG, jnp.float32))
    largest = max(nbytes(x) for x in jax.tree_util.tree_leaves(param_shapes(CFG, jnp.float32)))
    for stages, tp in ((2, 1), (1, 2)):
        split = memory.plan(CFG, cc, sessions=1, history=32, dtype=jnp.float32,
                            mesh_shape={"stage": stages, "tp": tp})
        needs = memory.weights_need(CFG, jnp.float32, "model", jax.local_devices()[0],
                                    mesh=sharding.make_mesh(glm53.MeshConfig(stages=stages, tp=tp)))
        first = split["stages"][0]["params"] if stages > 1 else split["per_device"]["params"]
        assert needs[0][1] == first + 2 * largest and all(n == first for _, n in needs[1:tp])
        assert split["per_device"]["loading"] == max(n for _, n in needs) < whole
        for device_bytes in (split["per_device"]["loading"], split["per_device"]["loading"] - 1):
            p = memory.plan(CFG, cc, sessions=1, history=32, dtype=jnp.float32,
                            mesh_shape={"stage": stages, "tp": tp}, device_bytes=device_bytes)
            assert p["fits_loading"] == (device_bytes == split["per_device"]["loading"])
    one = memory.plan(CFG, cc, sessions=1, history=32, dtype=jnp.float32)
    assert one["per_device"]["loading"] == one["per_device"]["params"] == whole


@pytest.mark.devices(2)
def test_plan_entry_point(tmp_path):
    out = tmp_path / "plan.json"
    p = python_runner.run(["-m", "experiments.plan", "--config=configs/tiny.py", "--machine=custom",
                          "--devices=2", "--device_gib=0.01", "--host_gib=1", "--sessions=3", "--history=100,400",
                          "--compile", f"--out={out}"], cwd=ROOT, timeout=300,
                          # this run's (cheaper) compile flags; it makes its 2 devices
                          env={**os.environ,
                               "XLA_FLAGS": xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), None)})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [q["history"] for q in r["plans"]] == [100, 400] and r["devices"] == 2
    assert all(q["per_device"]["params"] > 0 and q["max_sessions_by_device"] >= 0 for q in r["plans"])
    assert "max by dev" in p.stdout
    for q in r["plans"]:  # the decode step compiled for the 2-device mesh, its peak above what is counted
        comp = q["compiled"]
        assert comp["step"] == "decode" and comp["devices"] == 2 and comp["temp_bytes"] > 0
        assert comp["peak_bytes"] > q["per_device"]["params"] + q["per_device"]["cache"]
    assert "compiled decode" in p.stdout


@pytest.mark.devices(2)
@pytest.mark.parametrize("mode,tp", [("resident", 1), ("offload", 2)])
def test_compiled_step_checks_the_counting(mode, tp):
    """XLA's own accounting of the MTP verify step compiled from shapes (nothing allocated) agrees with the
    planner's counting: the step's arguments are the parameters' shards, the cache with its host pool and the
    lanes' inputs, less the three sampling scalars a greedy step never reads (jit drops unused arguments); the
    whole cache is donated and written in place; the workspace is what the peak adds to what is held."""
    cc = CacheConfig(mode=mode, kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64)
    mesh = sharding.make_mesh(sharding.MeshConfig(tp=tp))
    r = memory.compiled_step_memory(CFG, cc, sessions=3, history=200, dtype="float32", mesh=mesh, mtp=1)
    c = r["counted"]
    assert c == {k: v for k, v in memory.plan(CFG, cc, sessions=3, history=200, dtype=jnp.float32,
                                             mesh_shape={"stage": 1, "tp": tp})["per_device"].items()
                 if k in ("params", "cache")} | {"pool": c["pool"]}
    assert (c["pool"] > 0) == (mode == "offload")
    seed_temperature_top_p = 3 * 4
    # a CPU has no separate host memory space: the pool is among the device arguments there
    assert r["argument_bytes"] + r["host_argument_bytes"] == (c["params"] + c["cache"] + c["pool"]
                                                              + r["small_input_bytes"] - seed_temperature_top_p)
    assert r["alias_bytes"] == c["cache"] + c["pool"]
    assert r["temp_bytes"] > 0 and r["output_bytes"] > r["alias_bytes"]  # the logits and tokens are new
    assert r["peak_bytes"] == (c["params"] + c["cache"] + r["small_input_bytes"] + r["temp_bytes"]
                               + r["output_bytes"] - r["alias_bytes"])
    assert r["step"] == "verify (MTP depth 1)" and r["devices"] == tp


@pytest.mark.devices(4)
@pytest.mark.parametrize("mtp", [0, 1])
def test_compiled_stages_check_the_counting(mtp):
    """Each stage's programs compiled from shapes (2 stages of tp=2, offload): the first stage's decode / verify
    reads exactly what the planner counts for its devices (its parameter shards, its cache and pool) plus the lanes'
    small inputs; a verify's earlier stage also compiles the commit it runs after the last stage's acceptance."""
    cc = CacheConfig(mode="offload", kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64)
    mesh = sharding.make_mesh(sharding.MeshConfig(stages=2, tp=2))
    r = memory.compiled_stage_memory(CFG, cc, sessions=3, history=200, dtype="float32", mesh=mesh, mtp=mtp)
    counted = memory.plan(CFG, cc, sessions=3, history=200, dtype=jnp.float32, mesh_shape={"stage": 2, "tp": 2})
    first, last = r["stages"]
    assert [s["layers"] for s in r["stages"]] == [s["layers"] for s in counted["stages"]]
    c = first["counted"]
    B = 3
    small = B * 4 + B * 1 + B * 4 + B * 4 + (B * mtp * 4)  # lanes (slot, active), tokens, remaining, drafts
    # a CPU has no separate host memory space: the pool is among the device arguments there
    assert first["argument_bytes"] + first["host_argument_bytes"] == c["params"] + c["cache"] + c["pool"] + small
    assert first["programs"] == (1 if mtp == 0 else 2) and last["programs"] == 1
    assert all(s["temp_bytes"] > 0 and s["peak_bytes"] > s["counted"]["params"] + s["counted"]["cache"]
               for s in r["stages"])
    assert r["peak_bytes"] == max(s["peak_bytes"] for s in r["stages"])


def test_device_memory_reports_the_fullest_device(monkeypatch):
    """Several devices (stages, tensor-parallel shards): in use and peak of the fullest, the limit of the smallest,
    and each device's own figures; one device: its figures alone; a CPU (no allocator stats): nothing."""
    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    devs = [Dev({"bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 100}),
            Dev({"bytes_in_use": 7, "peak_bytes_in_use": 8, "bytes_limit": 90, "num_allocs": 3})]
    monkeypatch.setattr(jax, "local_devices", lambda: devs)
    got = memory.device_memory()
    assert {k: got[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "devices")} == \
        {"bytes_in_use": 7, "peak_bytes_in_use": 9, "bytes_limit": 90, "devices": 2}
    assert got["per_device"][1] == {"bytes_in_use": 7, "peak_bytes_in_use": 8, "bytes_limit": 90}
    monkeypatch.setattr(jax, "local_devices", lambda: devs[:1])
    assert memory.device_memory() == {"bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 100}
    monkeypatch.setattr(jax, "local_devices", lambda: [Dev(None), Dev(None)])
    assert memory.device_memory() == {}


def test_plan_refuses_layouts_no_engine_could_run():
    """A layout the engine would refuse is refused by the planner too, naming what is wrong: tp not dividing the
    heads (GSPMD would split a head, or the widths happen to divide), more stages than layers, a ``mesh.tp`` that
    the machine's layout would silently replace, stages of 0."""
    cc = CacheConfig(mode="offload", kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64)
    with pytest.raises(glm53.ConfigError, match="mesh.tp=8 does not divide num_attention_heads=4"):
        memory.plan(CFG, cc, sessions=1, history=200, dtype=jnp.float32, mesh_shape={"stage": 1, "tp": 8})
    with pytest.raises(glm53.ConfigError, match="more than the model's 3 layers"):
        memory.plan(CFG, cc, sessions=1, history=200, dtype=jnp.float32, mesh_shape={"stage": 4, "tp": 1})
    assert memory.machine_mesh(CFG, {"stages": 2, "tp": 1}, 4) == {"stage": 2, "tp": 2}
    assert memory.machine_mesh(CFG, {"stages": 2, "tp": 2}, 4) == {"stage": 2, "tp": 2}
    for mesh, devices, what in [({"stages": 1, "tp": 1}, 8, "8 devices as 1 stage"),
                                ({"stages": 3, "tp": 1}, 4, "does not divide the machine's 4 devices"),
                                ({"stages": 1, "tp": 2}, 4, "mesh.tp=2: the planner lays"),
                                ({"stages": 0, "tp": 1}, 4, "mesh.stages must be an int >= 1")]:
        with pytest.raises(glm53.ConfigError, match=what):
            memory.machine_mesh(CFG, mesh, devices)
    p = python_runner.run(["-m", "experiments.plan", "--config=configs/tiny.py", "--machine=custom",
                          "--devices=3", "--device_gib=1", "--host_gib=1", "--history=100"], cwd=ROOT, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("experiments.plan: 3 devices as 1 stage(s) x tp=3: mesh.tp=3 does "
                                                 "not divide num_attention_heads=4")


def test_plan_compile_on_too_few_devices_is_one_line_before_any_table():
    env = {**os.environ, "XLA_FLAGS": xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), 2)}
    p = python_runner.run(["-m", "experiments.plan", "--config=configs/tiny.py", "--machine=custom",
                          "--devices=4", "--device_gib=1", "--host_gib=1", "--history=100", "--compile"], cwd=ROOT,
                          timeout=120, env=env)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith("experiments.plan: mesh 1 x 4 needs 4 devices, 2 are visible")
    assert "max by dev" not in p.stdout


@pytest.mark.parametrize("args,message", [
    (["--history=50k"], "--history=50k: give history lengths in tokens"),
    (["--history=100,0"], "--history=100,0: give history lengths in tokens"),
    (["--sessions=0"], "flag --sessions=0: 0 is not a positive integer"),
    (["--mtp=4"], "flag --mtp=4: 4 is not an integer in the range [0, 3]"),
    (["--config.cache.mode=offload", "--config.cache.hot_rows=100"], "offload: hot_rows=100 is below what a round"),
    (["--config.run.batch=3"], "--config.run.batch=3: experiments.plan counts")])
def test_plan_refuses_what_no_engine_could_be(args, message):
    """As experiments.capacity does: a history that is no token count, zero sessions, an MTP depth past 3, an
    offload cache the engine refuses and an override the planner would not read are each one line naming it."""
    p = python_runner.run(["-m", "experiments.plan", "--config=configs/tiny.py", "--machine=custom",
                          "--devices=2", "--device_gib=1", "--host_gib=1", *args], cwd=ROOT, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert message in p.stderr, p.stderr[-2000:]


def test_default_config_found_from_any_directory_and_a_missing_one_named(tmp_path):
    """``python -m experiments.plan`` from outside the repository reads its default config from the install's
    configs/ (it raised a two-traceback OSError from main); a --config that does not load is one flag error naming
    the path, the working directory it was read from and where the shipped configs are; a usage error one line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = python_runner.run(["-m", "experiments.plan", "--history=1000", "--sessions=1"], cwd=tmp_path,
                          timeout=300, env=env)
    assert p.returncode == 0 and "history" in p.stdout, p.stderr[-2000:]
    p = python_runner.run(["-m", "experiments.plan", "--config=configs/tiny.py"], cwd=tmp_path, timeout=300, env=env)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (f"--config=configs/tiny.py: cannot load it ([Errno 2] No such file or directory: 'configs/tiny.py'); "
            f"a relative path is read from the working directory, {tmp_path}; the shipped configs are in "
            f"{ROOT / 'configs'}") in p.stderr, p.stderr[-2000:]
    # a usage error is its one line too, not below the module's docstring and every flag's help (70 lines)
    p = python_runner.run(["-m", "experiments.plan", "--history=abc"], cwd=tmp_path, timeout=300, env=env)
    assert p.returncode == 1 and p.stderr.splitlines() == [
        "experiments.plan: --history=abc: give history lengths in tokens, whole numbers >= 1, comma-separated",
        "Pass --helpshort or --helpfull to see help on flags."], p.stderr[-2000:]

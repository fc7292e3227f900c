"""Tensor parallelism on the CPU's host devices (conftest gives 16): parameters split by glm53.sharding's rules,
the cache replicated over the mesh, the engine's steps partitioned by XLA. Split reductions sum in another order,
so tokens must be identical to one device and float32 logits within 1e-5 relative (not bit for bit)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import glm53
from glm53 import memory, sharding
from glm53.pipeline import needs_embed_copy
from glm53.config import CacheConfig, ConfigError
from engine_common import MESH_CFG as CFG

# Meshes of up to 4 of the CPU's host devices (tp=4 the widest; test_mesh_errors asks for more on purpose).
pytestmark = pytest.mark.devices(4)

CC = CacheConfig(kv_format="f32", prefill_chunk=16, max_len=96)


def model(tp: int):
    return glm53.from_config(CFG, seed=0, dtype="float32", cache_config=CC, mesh=glm53.MeshConfig(tp=tp))


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def one_device():
    return model(1)


def close(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


# Both tp sizes and both decode paths (plain and MTP verify), not every pairing: each layout compiles its own steps.
@pytest.mark.parametrize("tp,mtp", [(2, 0), (4, 2)])
def test_tensor_parallel_generate_matches_one_device(one_device, tp, mtp):
    ps = prompts([37, 22, 30])
    base = glm53.generate(one_device, ps, max_new_tokens=7, mtp=mtp, return_logits=True)
    m = model(tp)
    run = glm53.generate(m, ps, max_new_tokens=7, mtp=mtp, return_logits=True)
    assert run.tokens == base.tokens
    assert close(run.logits, base.logits) < 1e-5


def test_parameters_follow_the_rules_and_the_cache_is_replicated():
    m = model(4)
    assert m.mesh.shape == {"stage": 1, "tp": 4}
    layer = m.params["layers_2"]  # a MoE layer with its own indexer
    want = {("self_attn", "o_proj", "kernel"): P("tp", None), ("self_attn", "q_b_proj", "kernel"): P(None, "tp"),
            ("self_attn", "kv_b_proj"): P(None, "tp"), ("mlp", "experts_gate_proj"): P(None, None, "tp"),
            ("mlp", "experts_down_proj"): P(None, "tp", None), ("self_attn", "kv_a_proj_with_mqa", "kernel"): P(),
            ("self_attn", "indexer", "wq_b", "kernel"): P(None, "tp"),
            ("self_attn", "indexer", "weights_proj"): P(None, "tp"),
            ("mlp", "shared_experts", "up_proj", "kernel"): P(None, "tp"),
            ("mlp", "shared_experts", "down_proj", "kernel"): P("tp", None),
            # layers_0: the dense MLP
            (0, "mlp", "gate_proj", "kernel"): P(None, "tp"), (0, "mlp", "down_proj", "kernel"): P("tp", None)}
    # A rule lost (a split parameter replicated) still computes the same tokens: only the layout shows it.
    assert m.params["embed_tokens"].sharding.spec == P("tp", None)
    for path, spec in want.items():
        leaf = layer
        if path[0] == 0:
            leaf, path = m.params["layers_0"], path[1:]
        for k in path:
            leaf = leaf[k]
        assert leaf.sharding.spec == spec or (spec == P() and set(leaf.sharding.spec) <= {None}), (path, leaf.sharding)
    assert m.params["lm_head"].sharding.spec == P(None, "tp")
    e = glm53.Engine(m, max_sessions=2)
    sid = e.open(prompts([20])[0])
    e.generate({sid: 3})
    for leaf in jax.tree_util.tree_leaves(e.cache):
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == m.mesh
        assert set(leaf.sharding.spec) <= {None}  # replicated
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 4 and all(np.array_equal(shards[0], s) for s in shards[1:])  # the same bytes
    report = e.memory_report()["device"]
    assert report["devices"] == 4
    full = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(m.params))
    assert full / 4 < report["params_bytes"] < full  # this device's shards: the big matrices split, norms not


def test_engine_lifecycle_on_a_mesh_matches_one_device(one_device):
    """open / generate / append / rollback / fork on tp=2: every session's tokens equal one device's."""
    def script(m):
        e = glm53.Engine(m, max_sessions=3)
        a, b = e.open(prompts([33])[0]), e.open(prompts([18], seed=1)[0])
        out = [e.generate({a: 4, b: 6})]
        e.append(a, prompts([21], seed=2)[0])
        e.rollback(b, 3)
        c = e.fork(a)
        out.append(e.generate({a: 5, b: 2, c: 3}))
        return out, e._step("decode")

    mesh_out, decode = script(model(2))
    assert mesh_out == script(one_device)[0]
    # One executable per batch bucket (2 and 3 lanes): host-built inputs are placed like the step's outputs
    # (replicated over the mesh), or the first call of each generate would compile another.
    assert decode._cache_size() == 2


def test_a_layout_that_cannot_work_is_refused_before_any_weight(monkeypatch, tmp_path):
    """Random init, an HF directory and a glm53 checkpoint: a mesh the model cannot take (too many devices, tp not
    dividing the heads, more stages than layers) is refused from the config alone, before weights are initialised
    or read (for a large model that is minutes)."""
    import glm53.checkpoint
    import glm53.models

    saved = tmp_path / "native"
    glm53.from_config(CFG, seed=0, dtype="float32", cache_config=CC).save(str(saved))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights touched before the layout was checked")

    monkeypatch.setattr(glm53.models, "init_params", no_weights)
    monkeypatch.setattr(glm53.checkpoint, "read_hf", no_weights)
    import orbax.checkpoint

    monkeypatch.setattr(orbax.checkpoint.StandardCheckpointer, "restore", no_weights)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(__import__("json").dumps(CFG.to_hf()))
    layers = CFG.num_hidden_layers
    cases = [(glm53.MeshConfig(tp=32), "needs 32 devices"),
             (glm53.MeshConfig(tp=8), "mesh.tp=8 does not divide num_attention_heads=4"),
             (glm53.MeshConfig(stages=layers + 1),
              f"mesh.stages={layers + 1} is more than the model's {layers} layers")]
    for mesh, match in cases:
        with pytest.raises(ConfigError, match=match):
            glm53.from_config(CFG, seed=0, dtype="float32", cache_config=CC, mesh=mesh)
        with pytest.raises(ConfigError, match=match):
            glm53.from_pretrained(str(tmp_path / "hf"), dtype="float32", mesh=mesh)
        with pytest.raises(ConfigError, match=match):
            glm53.load(str(saved), mesh=mesh)


def test_mesh_errors_name_the_problem():
    with pytest.raises(ConfigError, match="needs 32 devices"):
        sharding.make_mesh(glm53.MeshConfig(tp=32))
    with pytest.raises(ConfigError, match="mesh.tp=8 does not divide num_attention_heads=4"):
        model(8)
    with pytest.raises(ConfigError, match="must be an int >= 1"):
        glm53.MeshConfig(tp=0)
    with pytest.raises(ConfigError, match="unknown mesh settings"):
        glm53.MeshConfig.from_config_dict({"pp": 2})
    assert sharding.make_mesh(glm53.MeshConfig()) is None and model(1).mesh is None  # one device: no mesh at all


def test_save_on_a_mesh_restores_on_one_device_and_back(one_device, tmp_path):
    """A saved session holds rows, not placements: saved from tp=2 it continues identically on one device and on
    tp=4."""
    m2 = model(2)
    e = glm53.Engine(m2, max_sessions=1)
    sid = e.open(prompts([29])[0])
    e.generate({sid: 3})
    e.save(sid, tmp_path / "s")
    want = e.generate({sid: 6})[sid]
    for m in (one_device, model(4)):
        r = glm53.Engine(m, max_sessions=1)
        got = r.restore(tmp_path / "s")
        assert r.generate({got: 6})[got] == want


OFFLOAD = CC.replace(kv_format="q8g64", copyback_every=16, hot_rows=64, max_len=192)


# MTP on a mesh runs by default in test_tensor_parallel_generate_matches_one_device; the MTP variant here is the
# slow one.
@pytest.mark.parametrize("mtp", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_offload_on_a_mesh_is_bit_identical_to_resident_there(one_device, mtp):
    """Offload on tp=2 (pool replicated into every device's host memory): bit-identical to resident on the same
    mesh through generate, a long append (past the hot cache), fork and rollback; tokens equal to one device; the
    two devices' replicas of every cache array byte-identical."""
    def script(m, mode):
        e = glm53.Engine(m, OFFLOAD.replace(mode=mode), max_sessions=3)
        a, b = e.open(prompts([37])[0]), e.open(prompts([22], seed=1)[0])
        outs, logits = [], []
        for reqs in ({a: 5, b: 7}, "append", {a: 6, b: 2}):
            if reqs == "append":
                e.append(a, prompts([80], seed=3)[0])  # more than hot_rows
                c = e.fork(a)
                e.rollback(b, 2)
                continue
            outs.append(e.generate(reqs, mtp=mtp, return_logits=True))
            logits.append(e.last_run.logits)
        outs.append(e.generate({c: 4}, mtp=mtp))
        stats = e.stats(a) if mode == "offload" else None
        return outs, logits, stats, e

    m2 = model(2)
    off, off_logits, stats, e = script(m2, "offload")
    res, res_logits, _, _ = script(m2, "resident")
    assert off == res
    for lo, lr in zip(off_logits, res_logits):
        assert lo.keys() == lr.keys() and all(np.array_equal(lo[k], lr[k]) for k in lo)
    assert script(one_device, "resident")[0] == res
    assert stats["misses"] > 0 and stats["copybacks"] > 0  # the host pool was really used
    pool = jax.tree_util.tree_leaves(e.cache.pool)[0]
    assert pool.sharding.memory_kind == "pinned_host" and len(pool.addressable_shards) == 2
    assert e.memory_report()["host"]["pool_replicas"] == 2
    # Owner and peer replicas: every device's copy of every cache array (each host pool replica, the hot caches,
    # the rings, the maps) holds the same bytes after all that.
    for path, leaf in jax.tree_util.tree_leaves_with_path(e.cache):
        copies = [np.asarray(sh.data) for sh in leaf.addressable_shards]
        assert len(copies) == 2 and all(c.shape == leaf.shape for c in copies), jax.tree_util.keystr(path)
        assert all(np.array_equal(copies[0].view(np.uint8), c.view(np.uint8)) for c in copies[1:]), \
            jax.tree_util.keystr(path)


def _gathered(compiled_text: str) -> list:
    """Elements of every all-gather's result in a compiled step."""
    return [int(np.prod([int(d) for d in m.group(1).split(",") if d]))
            for m in re.finditer(r"= \w+\[([0-9,]*)\]\{[^}]*\} all-gather", compiled_text)]


def test_pallas_experts_use_their_own_slice_on_a_mesh(one_device):
    """The Pallas grouped matmul has no partitioning rule, so on tp=2 the MoE calls it per device on that device's
    slice of the experts' width (shard_map) and sums the partial outputs: no step gathers an expert weight whole
    (what GSPMD does to a custom call's operands), and tokens equal one device's (logits within 1e-5)."""

    mesh = sharding.make_mesh(glm53.MeshConfig(tp=2))
    text = memory.lower_step(CFG, CC, sessions=2, history=64, dtype="float32", mesh=mesh,
                             kernels="pallas")[0].compile().as_text()
    # Left to GSPMD the interpreted kernel gathers each expert's matrix piece by piece (4 x [32, 64] and 4 x
    # [16, 32] here); with the slices the step gathers only small activations, less than one expert matrix in all.
    gathered = _gathered(text)
    assert gathered and sum(gathered) < CFG.hidden_size * CFG.moe_intermediate_size, gathered
    ps = prompts([37, 22])
    base = glm53.generate(one_device, ps, max_new_tokens=5, return_logits=True, kernels="pallas")
    run = glm53.generate(model(2), ps, max_new_tokens=5, return_logits=True, kernels="pallas")
    assert run.tokens == base.tokens
    assert close(run.logits, base.logits) < 1e-5


def test_fp8_pallas_experts_split_with_their_block_scales():
    """FP8 experts on tp=2 with the Pallas kernel: each device takes whole 128-wide scale blocks with its slice of
    the experts' width (an expert width of 256 here), so no FP8 weight is gathered, and tokens equal one device's."""
    import dataclasses


    cfg = dataclasses.replace(CFG, moe_intermediate_size=256)
    mesh = sharding.make_mesh(glm53.MeshConfig(tp=2))
    text = memory.lower_step(cfg, CC, sessions=2, history=64, dtype="float32", mesh=mesh, expert_weights="fp8",
                             kernels="pallas")[0].compile().as_text()
    # without the split: every expert's FP8 weights gathered whole (as f16 on the CPU: 4 x [8, 64, 256], ...)
    assert "f8e4m3fn" in text and sum(_gathered(text)) < cfg.hidden_size * cfg.moe_intermediate_size, _gathered(text)
    ps = prompts([29, 18])
    runs = [glm53.generate(glm53.from_config(cfg, seed=0, dtype="float32", cache_config=CC, expert_weights="fp8",
                                             mesh=glm53.MeshConfig(tp=tp)),
                           ps, max_new_tokens=4, return_logits=True, kernels="pallas") for tp in (1, 2)]
    assert runs[1].tokens == runs[0].tokens
    assert close(runs[1].logits, runs[0].logits) < 1e-5


@pytest.mark.parametrize("layout", [dict(tp=2), dict(stages=2, tp=2)])
def test_weights_go_to_their_devices_as_they_are_made_or_read(tmp_path, monkeypatch, layout):
    """Every weight is placed on its devices as soon as it is drawn or read (GLM-5 in FP8, ~750 GB, could not
    otherwise load onto a mesh: the whole model went to one device first), with tensor parallelism and with pipeline
    stages: random weights, an HF checkpoint and an FP8 one kept in FP8 (expert stacks and block scales) hold the
    same values and digest as on one device, each leaf placed once where the layout puts it (its shards; with stages
    its stage's, the embedding also on the last stage, which reads it for the MTP layer), the first before the last
    tensor is read; a native save restored by orbax onto those devices, in its dtype and in another."""
    import os
    import sys

    from flax.traverse_util import flatten_dict

    from glm53 import checkpoint
    from glm53 import params as params_lib
    from glm53.params import param_shapes

    sys.path.insert(0, os.path.dirname(__file__))
    from hf_reference import write_fp8_checkpoint

    write_fp8_checkpoint(str(tmp_path))
    events = []
    real_place, real_read = sharding.Placement.__call__, checkpoint._read

    dev0 = jax.local_devices()[0]  # where the weights are made

    def on_dev0() -> int:  # bytes of distinct buffers (a shard's .data is another live array of the same buffer)
        held = {s.data.unsafe_buffer_pointer(): s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards
                if s.device == dev0}
        return sum(held.values())

    def recording_place(self, path, array):
        out = real_place(self, path, array)
        events.append(("place", tuple(path), out.sharding, on_dev0()))
        return out

    def recording_read(*args, **kwargs):
        events.append(("read",))
        return real_read(*args, **kwargs)

    def where(model, path, shape):  # where the layout puts a weight
        if model.pipeline is not None:
            return model.pipeline.leaf_sharding(path, shape)
        return sharding.leaf_sharding("/".join(path), shape, model.mesh)

    monkeypatch.setattr(sharding.Placement, "__call__", recording_place)
    monkeypatch.setattr(checkpoint, "_read", recording_read)
    makers = {"random": lambda mesh: glm53.from_config(CFG, seed=0, dtype="float32", mesh=mesh),
              "hf": lambda mesh: glm53.from_pretrained(str(tmp_path), dtype="float32", mesh=mesh),
              "fp8": lambda mesh: glm53.from_pretrained(str(tmp_path), dtype="bfloat16", expert_weights="fp8",
                                                        mesh=mesh)}
    mesh = glm53.MeshConfig(**layout)
    copies, models = 0, {}
    for name, make in makers.items():
        first = make(None)
        one = {p: np.asarray(x) for p, x in flatten_dict(first.params).items()}
        first_digest, whole = first.params_digest(), sum(x.nbytes for x in one.values())
        del first
        events.clear()
        before = on_dev0()
        model = models[name] = make(mesh)
        got = flatten_dict(model.params)
        assert got.keys() == one.keys(), name
        for path, leaf in got.items():
            assert np.asarray(leaf).tobytes() == one[path].tobytes(), (name, path)
            assert leaf.sharding == where(model, path, leaf.shape), (name, path)
        assert model.params_digest() == first_digest, name
        placed = [e for e in events if e[0] == "place"]
        assert sorted(p for _, p, _, _ in placed) == sorted(got), name  # each leaf once, as it was made
        assert all(s == got[p].sharding for _, p, s, _ in placed), name
        assert any(s.spec != P() for _, _, s, _ in placed), name  # something was split
        # the device the weights are made on held at most what the memory check counts for it, less than the model
        (need,) = [n for d, n in memory.weights_need(model.config, model.dtype, model.expert_weights, dev0,
                                                     mesh=model.mesh, drawn=name == "random") if d == dev0]
        peak = max(b for *_, b in placed) - before
        drawing = params_lib.draw_transient_bytes(jax.tree_util.tree_leaves(param_shapes(model.config, model.dtype)),
                                                  dev0.platform)
        assert peak <= need and need - (drawing if name == "random" else 0) < whole, (name, peak, need, whole)
        if name != "random":
            reads = [i for i, e in enumerate(events) if e[0] == "read"]
            assert events.index(placed[0]) < reads[-1], name
        if model.pipeline is not None:  # the last stage's own copy of the embedding, and nothing else moved
            copies += needs_embed_copy(model.config, 2)
            if needs_embed_copy(model.config, 2):
                copy = model.pipeline.stage_params(model.params)[-1]["embed_tokens"]
                assert set(copy.sharding.device_set) == set(model.pipeline.stages[-1].mesh.devices.flat), name
                assert np.asarray(copy).tobytes() == one[("embed_tokens",)].tobytes(), name
            devices = [set(s.device_set) for _, _, s, _ in placed]
            assert all(d <= set(st.mesh.devices.flat) for d in devices for st in model.pipeline.stages
                       if d & set(st.mesh.devices.flat)), name  # no weight spans two stages
    assert any(str(p[-1]).endswith("_scale") for _, p, _, _ in placed)  # the FP8 checkpoint's scales, placed too
    # a native save: orbax restores every parameter onto its devices (the FP8 model's, scales and all)
    import orbax.checkpoint as ocp

    targets = []
    real_restore = ocp.PyTreeCheckpointer.restore

    def recording_restore(self, directory, *args, **kwargs):
        targets.append(kwargs["args"].item)
        return real_restore(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", recording_restore)
    from glm53 import checkpoint
    digests, real_digest = [], checkpoint.params_digest
    monkeypatch.setattr(checkpoint, "params_digest", lambda *a, **k: digests.append(1) or real_digest(*a, **k))
    # the random model (float32, with an MTP layer) and the FP8 one (bfloat16), each in its dtype and in the other
    for name, other in (("random", jnp.bfloat16), ("fp8", jnp.float32)):
        model = models[name]
        model.save(str(tmp_path / name))
        want = flatten_dict(model.params)
        copy = needs_embed_copy(model.config, 2 if model.pipeline is not None else 1)
        for dtype in (None, other):
            targets.clear()
            digests.clear()
            loaded = glm53.load(str(tmp_path / name), mesh=mesh, dtype=dtype)
            (target,) = targets
            # the digest read once to check the save; with stages a cast model's digest is computed on its stages
            assert len(digests) == 1 + (dtype is not None and loaded.pipeline is not None), (name, dtype)
            target = flatten_dict(target)
            dtypes = flatten_dict(param_shapes(model.config, dtype or model.dtype, model.expert_weights))
            assert dtype is None or any(want[p].dtype != s.dtype for p, s in dtypes.items())
            for path, leaf in flatten_dict(loaded.params).items():
                assert leaf.dtype == dtypes[path].dtype, (name, path)
                assert np.asarray(leaf).tobytes() == np.asarray(want[path].astype(leaf.dtype)).tobytes(), path
                assert leaf.sharding == want[path].sharding, (name, path)
                if path != ("embed_tokens",) or not copy:
                    assert target[path].sharding == leaf.sharding, (name, path)
            if copy:  # the embedding read once onto the first and the last stage, then taken apart
                stages = loaded.pipeline.stages
                assert set(target[("embed_tokens",)].sharding.device_set) == (
                    set(stages[0].mesh.devices.flat) | set(stages[-1].mesh.devices.flat))
                last = loaded.pipeline.stage_params(loaded.params)[-1]["embed_tokens"]
                assert set(last.sharding.device_set) == set(stages[-1].mesh.devices.flat)
                assert np.asarray(last).tobytes() == np.asarray(loaded.params["embed_tokens"]).tobytes()
            if dtype is None:
                assert loaded.params_digest() == model.params_digest() and len(digests) == 1
    assert copies == (1 if "stages" in layout else 0)


def test_a_mesh_counts_each_devices_share_of_the_weights(monkeypatch):
    """The weights' memory check on a mesh: each device its share, the device they are made on also the largest
    weight twice; CPU devices share the host's memory, so there a mesh needs more, not less (counted together);
    with pipeline stages each device its stage's share, which a device of the model's stages holds."""
    from glm53 import params as params_lib

    mesh = sharding.make_mesh(glm53.MeshConfig(tp=4))
    dev = jax.local_devices()[0]
    whole = params_lib.nbytes(params_lib.param_shapes(CFG, "float32"))
    largest = max(params_lib.nbytes(x) for x in jax.tree_util.tree_leaves(params_lib.param_shapes(CFG, "float32")))
    needs = memory.weights_need(CFG, "float32", "model", dev, mesh=mesh)
    assert [d for d, _ in needs] == list(mesh.devices.flat)
    share = needs[1][1]
    assert all(n == share for _, n in needs[1:]) and needs[0][1] == share + 2 * largest
    assert whole / 4 <= share < whole and 4 * share >= whole  # replicated norms and latents count on every device
    assert memory.weights_need(CFG, "float32", "model", dev) == [(dev, whole)]
    # with stages each device its stage's share (the last stage's with its copy of the embedding)
    staged = sharding.make_mesh(glm53.MeshConfig(stages=2, tp=2))
    model = glm53.from_config(CFG, seed=0, dtype="float32", mesh=staged)
    parts = model.pipeline.stage_params(model.params)
    held = [sum(sum(s.data.nbytes for s in x.addressable_shards if s.device == d)
                for x in jax.tree_util.tree_leaves(parts[i])) for i, row in enumerate(staged.devices) for d in row]
    need = memory.weights_need(CFG, "float32", "model", dev, mesh=staged)
    assert [d for d, _ in need] == list(staged.devices.flat)
    assert [n for _, n in need] == [held[0] + 2 * largest] + held[1:]
    # reading float32 weights into a bfloat16 model: the largest as read (4 bytes an element) beside its copy (2)
    shapes16 = params_lib.param_shapes(CFG, "bfloat16")
    elements = max(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes16))
    read = memory.weights_need(CFG, "bfloat16", "model", dev, mesh=staged, read_itemsize=4)
    plain = memory.weights_need(CFG, "bfloat16", "model", dev, mesh=staged)
    assert read[0][1] - plain[0][1] == 2 * elements and read[1:] == plain[1:]
    assert memory.weights_need(CFG, "bfloat16", "model", dev, read_itemsize=4)[0][1] == (
        params_lib.nbytes(shapes16) + 4 * elements)  # one device: the model and the largest as read
    assert held[2] > held[0] and sum(held) > whole  # the embedding twice, the norms and latents on every device
    # the host holds every CPU device's share: enough for the model on one device is too little for the mesh
    monkeypatch.setattr(memory, "host_available_bytes", lambda: whole)
    monkeypatch.setattr(memory, "free_bytes", lambda device: whole)
    memory.check_weights_fit(CFG, "float32", "model", dev, "random weights")
    with pytest.raises(ConfigError, match=r"random weights: .* need .* on the host \(4 CPU devices\), their shares "
                                          r"of a 4-device mesh \(float32, experts model\), which has .* free; use a "
                                          r"smaller config .* or a larger mesh"):
        memory.check_weights_fit(CFG, "float32", "model", dev, "random weights", mesh=mesh)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 4 * share + 2 * largest)
    memory.check_weights_fit(CFG, "float32", "model", dev, "random weights", mesh=mesh)

"""Pipeline stages (glm53.pipeline) on the CPU's host devices (conftest gives 16): each stage holds a run of layers,
their weights and their cache, and runs its own programs. Stage-only layouts must be bit-identical to one device,
offload bit-identical to resident, and every session operation (append, rollback, fork, save / restore, MTP) must
work across stages; layouts with tp > 1 give identical tokens and float32 logits within 1e-5 relative."""

import functools

import jax
import numpy as np
import pytest

import glm53
from glm53 import pipeline, session_io, sharding
from glm53.config import CacheConfig, ConfigError
from engine_common import MESH_CFG, PIPE_CFG

CC = CacheConfig(kv_format="f32", prefill_chunk=16, max_len=96)
OFFLOAD = CacheConfig(kv_format="q8g64", copyback_every=16, prefill_chunk=16, hot_rows=64, max_len=192,
                      mode="offload")


def model(cfg, stages: int = 1, tp: int = 1, cc=CC, microbatches: int = 1):
    return glm53.from_config(cfg, seed=0, dtype="float32", cache_config=cc,
                             mesh=glm53.MeshConfig(stages=stages, tp=tp, microbatches=microbatches))


def prompts(lengths, seed=0, vocab=MESH_CFG.vocab_size):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def close(a, b):
    return np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max()


def test_split_layers_balances_parameter_bytes():
    """Contiguous runs, one layer at least per stage, the MTP layer with the last, cut where the largest stage is
    smallest (checked against every cut by brute force)."""
    import itertools

    cfg = PIPE_CFG
    w = [1, 1] + [5] * 14  # two dense layers, then MoE
    for stages in (2, 3, 4, 16):
        got = pipeline.split_layers(cfg, stages, w, first_extra=3, last_extra=4)
        assert got[-1][-1] == cfg.num_hidden_layers  # the MTP layer
        main = [tuple(l for l in g if l < cfg.num_hidden_layers) for g in got]
        assert [l for g in main for l in g] == list(range(16)) and all(main)

        def worst(bounds):
            b = [0, *bounds, 16]
            return max(sum(w[b[s]:b[s + 1]]) + (3 if s == 0 else 0) + (4 if s == stages - 1 else 0)
                       for s in range(stages))

        best = min(worst(c) for c in itertools.combinations(range(1, 16), stages - 1))
        assert worst([g[0] for g in main[1:]]) == best
    with pytest.raises(ConfigError, match="mesh.stages=17 is more than the model's 16 layers"):
        pipeline.split_layers(cfg, 17, [1] * 16)


@pytest.fixture(scope="module")
def one_device():
    return model(MESH_CFG)


@pytest.mark.devices(3)
def test_stages_place_each_layer_and_its_cache_on_its_own_devices():
    m = model(MESH_CFG, stages=3)
    assert m.pipeline.layers == ((0,), (1,), (2, 3))  # the MTP layer (3) with the last
    devices = [set(st.mesh.devices.flat) for st in m.pipeline.stages]
    assert all(len(d) == 1 for d in devices) and len(set.union(*devices)) == 3
    for l in range(3):
        for leaf in jax.tree_util.tree_leaves(m.params[f"layers_{l}"]):
            assert leaf.sharding.device_set == devices[l]
    assert m.params["embed_tokens"].sharding.device_set == devices[0]
    assert m.params["lm_head"].sharding.device_set == devices[2]
    e = glm53.Engine(m, OFFLOAD, max_sessions=2)
    for s, part in enumerate(e.cache.parts):
        assert part.num_layers == len(m.pipeline.layers[s])
        for leaf in jax.tree_util.tree_leaves(part):
            assert leaf.sharding.device_set == devices[s]
    # Per device: a stage's share of the parameters and of the cache, its host pool holding its layers' pages.
    one = glm53.Engine(model(MESH_CFG, cc=OFFLOAD), OFFLOAD, max_sessions=2).memory_report()
    rep = e.memory_report()
    per_stage = [sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(p))
                 for p in m.pipeline.stage_params(m.params)]  # the last's with its copy of the embedding
    assert rep["device"]["params_bytes"] == max(per_stage) < one["device"]["params_bytes"]
    assert rep["host"]["pool_bytes"] == one["host"]["pool_bytes"] // 2  # 2 of the 4 cache layers on the last
    assert rep["device"]["cache_bytes"] < one["device"]["cache_bytes"]
    need = e._device_need()
    assert need["cache"] == rep["device"]["cache_bytes"]


@pytest.mark.devices(3)
def test_three_stages_with_mtp_bit_identical_to_one_device(one_device):
    """generate with MTP verify and drafts, Model.forward (the chunked prefill's logits) and Model.draft (the MTP
    layer over a whole sequence) on 3 stages: bit-identical to one device."""
    ps = prompts([37, 22, 30, 12])
    base = glm53.generate(one_device, ps, max_new_tokens=7, mtp=2, return_logits=True)
    m = model(MESH_CFG, stages=3)
    run = glm53.generate(m, ps, max_new_tokens=7, mtp=2, return_logits=True)
    assert run.tokens == base.tokens
    assert np.array_equal(run.logits, base.logits)
    assert np.array_equal(m.forward(ps[0]), one_device.forward(ps[0]))
    assert np.array_equal(m.draft(ps[1]), one_device.draft(ps[1]))


@pytest.mark.devices(4)
def test_stages_of_tensor_parallel_devices_match_one_device():
    """2 stages of tp=2 with MTP, offload: the same tokens as one device; float32 logits within 1e-5 relative (rows
    in float32: quantised rows would turn a split reduction's last-bit difference into a whole step)."""
    cc = OFFLOAD.replace(kv_format="f32")
    ps = prompts([37, 22, 30])
    base = glm53.generate(model(MESH_CFG, cc=cc), ps, max_new_tokens=6, mtp=2, return_logits=True,
                          cache=cc.replace(mode="resident"))
    m = model(MESH_CFG, stages=2, tp=2, cc=cc)
    assert [len(st.mesh.devices.flat) for st in m.pipeline.stages] == [2, 2]
    # Each device holds its shards of its stage's weights (the rules over the stage's tp devices), not whole
    # copies: those compute the same tokens with twice the memory.
    for st, p in zip(m.pipeline.stages, m.pipeline.stage_params(m.params)):
        for d in st.mesh.devices.flat:
            held = sum(int(sh.data.nbytes) for x in jax.tree_util.tree_leaves(p) for sh in x.addressable_shards
                       if sh.device == d)
            assert held == sharding.shard_bytes(p, {"tp": 2}) < sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(p))
    run = glm53.generate(m, ps, max_new_tokens=6, mtp=2, return_logits=True, cache=cc)
    assert run.tokens == base.tokens
    assert close(run.logits, base.logits) < 1e-5


@pytest.mark.devices(2)
def test_microbatched_decode_matches_one_device(one_device, monkeypatch):
    """Three sessions on 2 stages decode as two micro-batches of two (generate's engine rounds its lanes up to a
    multiple of the groups): the same tokens; logits within 1e-5 (programs of two lanes instead of four: XLA may
    round a matmul of another shape differently). An engine whose sessions the groups do not divide is refused."""
    ps = prompts([37, 22, 30])
    base = glm53.generate(one_device, ps, max_new_tokens=7, return_logits=True)
    m = model(MESH_CFG, stages=2, microbatches=2)
    # Lanes of the first stage's decode programs as traced: micro-batches silently left whole still give the same
    # tokens (and one compile), with no overlap between stages.
    decode, static = pipeline.EARLY["decode"]
    traced = []

    @functools.wraps(decode)
    def spy(stage, params, cache, lanes, *args, **kw):
        traced.append(int(lanes.slot.shape[0]))
        return decode(stage, params, cache, lanes, *args, **kw)

    monkeypatch.setitem(pipeline.EARLY, "decode", (spy, static))
    # The early stages' programs take their cache donated: one kept alive is a second cache on its devices.
    run_early, kept = m.steps._run_early, []

    def donating(name, s, params, part, args, kw):
        out = run_early(name, s, params, part, args, kw)
        kept.extend(x for x in jax.tree_util.tree_leaves(part) if not x.is_deleted())
        return out

    monkeypatch.setattr(m.steps, "_run_early", donating)
    with pytest.raises(ConfigError, match="mesh.microbatches=2 must divide max_sessions=3"):
        glm53.Engine(m, CC, max_sessions=3)
    run = glm53.generate(m, ps, max_new_tokens=7, return_logits=True, keep_cache=True)
    assert run.tokens == base.tokens
    assert close(run.logits, base.logits) < 1e-5
    # the first stage's decode program compiled once, for two lanes (the four sessions' micro-batches)
    (fn,) = [fn for k, fn in m.steps._jits.items() if k[:2] == ("decode", 0)]
    assert fn._cache_size() == 1 and traced == [2]
    assert not kept


def _lifecycle(m, mode, mtp, tmp_path):
    e = glm53.Engine(m, OFFLOAD.replace(mode=mode), max_sessions=3)
    a, b = e.open(prompts([37])[0]), e.open(prompts([22], seed=1)[0])
    outs, logits = [], []
    outs.append(e.generate({a: 5, b: 7}, mtp=mtp, return_logits=True))
    logits.append(e.last_run.logits)
    e.append(a, prompts([80], seed=3)[0])  # more than hot_rows
    c = e.fork(a, share_pages=False)  # offload: its pages copied stage by stage (read_pages / write_pages)
    e.rollback(b, 2)
    outs.append(e.generate({a: 6, b: 2}, mtp=mtp, return_logits=True))
    logits.append(e.last_run.logits)
    e.save(c, tmp_path / f"{mode}-{mtp}")
    outs.append(e.generate({c: 4}, mtp=mtp))
    stats = e.stats(a) if mode == "offload" else None
    return outs, logits, stats, e


@pytest.mark.devices(2)
def test_selection_trace_on_stages_is_one_devices(one_device):
    """A selection trace recorded on 2 stages (decode, MTP verify and drafts, rollback, fork) holds exactly what one
    device records: every record and entry, the hot caches' snapshots and the counters; a replay of it reproduces
    the engine's counters."""
    from glm53 import policies
    from glm53.trace import TraceRecorder

    def record(m):
        e = glm53.Engine(m, OFFLOAD, max_sessions=3)
        rec = TraceRecorder()
        a, b = e.open(prompts([37])[0]), e.open(prompts([22], seed=1)[0])
        out = [e.generate({a: 5, b: 4}, trace=rec, return_logits=True)]
        logits = [e.last_run.logits]
        e.rollback(a, 2)
        c = e.fork(b)
        out.append(e.generate({a: 4, c: 5}, mtp=1, trace=rec, return_logits=True))
        logits.append(e.last_run.logits)
        return (out, logits), rec.trace()

    staged_out, staged = record(model(MESH_CFG, stages=2))
    one_out, one = record(one_device)
    (staged_out, staged_logits), (one_out, one_logits) = staged_out, one_out
    assert staged_out == one_out
    for a, b in zip(staged_logits, one_logits):  # traced steps: bit-identical logits too
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert staged.num_records > 0 and len(staged.segments) == 2
    for f in ("step", "layer", "session", "start", "offset", "count", "positions", "valid", "in_ring"):
        assert np.array_equal(getattr(staged, f), getattr(one, f)), f
    assert set(staged.layer.tolist()) == set(range(MESH_CFG.num_cache_layers))  # every stage's layers, the MTP's too
    for a, b in zip(staged.segments, one.segments):
        assert a["sessions"] == b["sessions"] and a["first_step"] == b["first_step"]
        assert np.array_equal(a["counters_before"], b["counters_before"])
        assert np.array_equal(a["counters_after"], b["counters_after"])
        assert a["snapshot"].keys() == b["snapshot"].keys()
        assert all(np.array_equal(a["snapshot"][k], b["snapshot"][k]) for k in a["snapshot"])
    want = policies.segment_counts(staged)
    got = policies.replay(staged, "circular", from_snapshots=True)
    assert np.array_equal(np.stack([got.per_layer[n] for n in policies.COUNTS[:5]], 1), want)


# MTP with every session operation across stages runs by default in test_distributed.py (2 stages in 2 processes).
@pytest.mark.devices(2)
@pytest.mark.parametrize("mtp", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_offload_on_stages_bit_identical_to_resident_and_to_one_device(one_device, mtp, tmp_path):
    """Generate, a long append (past the hot cache), fork, rollback and save on 2 stages: offload bit-identical to
    resident there and to one device; the save restores on one device and continues identically."""
    m = model(MESH_CFG, stages=2)
    off, off_logits, stats, e = _lifecycle(m, "offload", mtp, tmp_path / "staged")
    res, res_logits, _, _ = _lifecycle(m, "resident", mtp, tmp_path / "staged")
    one, one_logits, _, _ = _lifecycle(one_device, "resident", mtp, tmp_path / "one")
    assert off == res == one
    for a, b, c in zip(off_logits, res_logits, one_logits):
        assert a.keys() == b.keys() == c.keys()
        assert all(np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]) for k in a)
    assert stats["misses"] > 0 and stats["copybacks"] > 0  # the host pools were really used
    assert len(stats["per_layer"]["hits"]) == MESH_CFG.num_cache_layers
    for part in e.cache.parts:
        pool = jax.tree_util.tree_leaves(part.pool)[0]
        assert pool.sharding.memory_kind == "pinned_host"
    # The saves hold the same bytes (every layer's rows to the last committed one, keys, hidden state), and a session
    # saved on stages continues on one device (and one saved there continues on stages) identically.
    _, staged_save = session_io.read(str(tmp_path / "staged" / f"offload-{mtp}"))
    _, one_save = session_io.read(str(tmp_path / "one" / f"resident-{mtp}"))
    flat = jax.tree_util.tree_leaves_with_path
    assert [k for k, _ in flat(staged_save)] == [k for k, _ in flat(one_save)]
    for (k, a), (_, b) in zip(flat(staged_save), flat(one_save)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), jax.tree_util.keystr(k)
    r = glm53.Engine(one_device, OFFLOAD.replace(mode="resident"), max_sessions=1)
    sid = r.restore(tmp_path / "staged" / f"offload-{mtp}")
    assert r.generate({sid: 4}, mtp=mtp)[sid] == off[-1][max(off[-1])]
    back = glm53.Engine(m, OFFLOAD, max_sessions=1)
    sid = back.restore(tmp_path / "one" / f"resident-{mtp}")
    assert back.generate({sid: 4}, mtp=mtp)[sid] == off[-1][max(off[-1])]


# The layouts on 16 devices, grouped by MTP depth (a group shares its one-device baseline): 16 x 1
# (stage-only: bit-identical) by default, the others slow (stages with tp > 1 by default: the 2 x 2 test below).
@pytest.mark.devices(16)
@pytest.mark.parametrize("mtp,layouts", [
    (0, [(16, 1, "resident")]),
    pytest.param(0, [(4, 4, "offload")], marks=pytest.mark.slow),
    pytest.param(2, [(16, 1, "offload"), (8, 2, "offload"), (2, 8, "resident")], marks=pytest.mark.slow)])
def test_sixteen_device_layouts_match_one_device(mtp, layouts):
    """Against one device's resident cache. The rows are float32: with tp > 1 a split reduction changes the last
    bits of a row, and quantising it (q8g64) would turn that into a whole quantisation step (stage-only layouts are
    bit-identical with q8g64 rows too: test_offload_on_stages_bit_identical_to_resident_and_to_one_device)."""
    cc = OFFLOAD.replace(kv_format="f32")
    ps = prompts([41, 18, 29])
    base = glm53.generate(model(PIPE_CFG, cc=cc), ps, max_new_tokens=5, mtp=mtp, return_logits=True,
                          cache=cc.replace(mode="resident"))
    for stages, tp, mode in layouts:
        m = model(PIPE_CFG, stages=stages, tp=tp, cc=cc)
        assert m.mesh.size == 16 and len(m.pipeline.stages) == stages
        run = glm53.generate(m, ps, max_new_tokens=5, mtp=mtp, return_logits=True, cache=cc.replace(mode=mode))
        assert run.tokens == base.tokens, (stages, tp, mode)
        if tp == 1:
            assert np.array_equal(run.logits, base.logits), (stages, tp, mode)
        else:
            assert close(run.logits, base.logits) < 1e-5, (stages, tp, mode)


@pytest.mark.devices(4)
def test_pipeline_errors_name_the_problem():
    with pytest.raises(ConfigError, match="mesh.stages=4 is more than the model's 3 layers"):
        model(MESH_CFG, stages=4)
    m = model(MESH_CFG, stages=2)
    with pytest.raises(ConfigError, match="not built for pipeline stages"):
        m.steps.lower("decode")
    with pytest.raises(ConfigError, match="compiler_options are not applied to pipeline stages"):
        glm53.Engine(m, OFFLOAD, compiler_options={"xla_cpu_enable_fast_math": False})
    with pytest.raises(ConfigError, match="it needs mesh.stages > 1"):
        glm53.MeshConfig(tp=2, microbatches=2)
    assert sharding.make_mesh(glm53.MeshConfig(stages=2, tp=2)).shape == {"stage": 2, "tp": 2}

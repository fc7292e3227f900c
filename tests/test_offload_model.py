"""Offload decode is bit-identical to resident decode: logits and tokens, same build, same inputs.

Sizes are chosen so that every mechanism runs: hot caches at the minimum that can work and far below the history
(evictions), above the history (no evictions), prompts ending just before / at / after copyback boundaries,
several sessions of different lengths in one batch, and every kv_format. Duplicate misses (several rows of one
round selecting the same missing position) are MTP verify rounds' and are tested in test_engine.py: the prefill
here reads its history in bulk, and this file's model has no MTP layer.
"""

import jax
import numpy as np
import pytest

import glm53
import kernels_pallas.kv_formats
from glm53.config import CacheConfig, ConfigError, ModelConfig

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  qk_nope_head_dim=8, v_head_dim=8, index_n_heads=16, index_head_dim=128, index_topk=16,
                  indexer_types=("full", "shared"), n_routed_experts=4, num_experts_per_tok=2,
                  num_nextn_predict_layers=0, max_position_embeddings=1024, eos_token_id=None,
                  initializer_range=0.1)


@pytest.fixture(scope="module")
def model():
    return glm53.from_config(CFG, seed=3, dtype="float32")


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lengths]


def run_both(model, cc, lengths, new_tokens, **kw):
    ps = prompts(lengths)
    res = glm53.generate(model, ps, max_new_tokens=new_tokens, cache=cc.replace(mode="resident"),
                         return_logits=True, **kw)
    off = glm53.generate(model, ps, max_new_tokens=new_tokens, cache=cc.replace(mode="offload"),
                         return_logits=True, **kw)
    return res, off


CASES = {
    # hot cache at its minimum (top-k 16 + ring 32 = 48 rows) far below ~190 rows of history: evictions;
    # prompts around the 16-row copyback boundary.
    "q8g64-min-hot": (CacheConfig(kv_format="q8g64", copyback_every=16, prefill_chunk=16, hot_rows=64),
                      [47, 48, 49], 40),
    # hot cache larger than the history: everything installed once, then hits.
    "f32-big-hot": (CacheConfig(kv_format="f32", copyback_every=32, prefill_chunk=32, hot_rows=1024),
                    [100, 31], 24),
    "fp8g128": (CacheConfig(kv_format="fp8g128", copyback_every=16, prefill_chunk=16, hot_rows=64), [64, 17], 24),
    "bf16": (CacheConfig(kv_format="bf16", copyback_every=16, prefill_chunk=16, hot_rows=128), [80], 24),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_offload_bit_identical_to_resident(model, case):
    cc, lengths, new = CASES[case]
    res, off = run_both(model, cc, lengths, new)
    assert off.tokens == res.tokens
    assert off.logits.dtype == res.logits.dtype and np.array_equal(off.logits, res.logits)
    stats = off.cache_stats
    assert stats is not None and res.cache_stats is None
    total_lookups = stats["hits"] + stats["misses"] + stats["ring_reads"]
    assert total_lookups > 0 and stats["misses"] > 0 and stats["hits"] > 0
    row = kernels_pallas.kv_formats.get_format(cc.kv_format).bytes_per_row
    assert stats["bytes_from_host"] == stats["misses"] * row
    assert stats["bulk_bytes_from_host"] > 0 and stats["bulk_bytes_from_host"] % row == 0  # prefill reads in bulk
    assert stats["copybacks"] == sum((n + new - 1) // cc.copyback_every for n in lengths)
    if case == "q8g64-min-hot":
        assert stats["evictions"] > 0  # the hot cache really turned over
    if case == "f32-big-hot":
        assert stats["evictions"] == 0


def test_forward_offload_matches_resident(model):
    ids = prompts([70])[0]
    cc = CacheConfig(kv_format="q8g64", copyback_every=16, prefill_chunk=16, hot_rows=64)
    a = model.forward(ids, cache_config=cc.replace(mode="resident"))
    b = model.forward(ids, cache_config=cc.replace(mode="offload"))
    assert np.array_equal(a, b)


def test_kernels_inside_the_model_match(model):
    """The Pallas kernels (interpreted on CPU) inside the whole offload model give the same tokens and logits as
    the jnp references do (bit-identical gathers; indexer scores may differ in summation order, so logits are
    compared to float tolerance)."""
    cc = CacheConfig(kv_format="q8g64", copyback_every=16, prefill_chunk=16, hot_rows=64, mode="offload")
    ps = prompts([40])
    ref = glm53.generate(model, ps, max_new_tokens=4, cache=cc, return_logits=True)
    ker = glm53.generate(model, ps, max_new_tokens=4, cache=cc, return_logits=True, kernels="pallas")
    assert ker.tokens == ref.tokens
    np.testing.assert_allclose(ker.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_offload_bit_identical_to_resident_with_the_kernels(model):
    """The GPU path, interpreted: with every Pallas kernel (hot gather, fill_round, fill_rows, gather_rows, indexer)
    in both modes, offload decode still gives resident's tokens and logits bit for bit, through decode fills that
    evict."""
    cc = CASES["q8g64-min-hot"][0]
    # prompts far longer than the 64 hot slots: prefill reads them in bulk (the hot cache starts empty), and decode
    # fills the hot cache and then evicts
    res, off = run_both(model, cc, [100, 90], 30, kernels="pallas")
    assert off.tokens == res.tokens
    assert np.array_equal(off.logits, res.logits)
    assert off.cache_stats["decode"]["evictions"] > 0 and off.cache_stats["decode"]["fills"] > 0


def test_invalid_hot_rows_is_a_config_error(model):
    with pytest.raises(ConfigError, match="below what a round can pin"):
        glm53.generate(model, prompts([10]), max_new_tokens=2,
                       cache=CacheConfig(mode="offload", copyback_every=16, prefill_chunk=16, hot_rows=32))


def test_a_cache_that_cannot_work_is_refused_before_any_weight(monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("parameters were initialised")

    monkeypatch.setattr(glm53.models, "init_params", no_weights)
    with pytest.raises(ConfigError, match="hot_rows=32 is below what a round can pin.*raise hot_rows to"):
        glm53.from_config(CFG, cache_config=CacheConfig(mode="offload", copyback_every=16, prefill_chunk=16,
                                                        hot_rows=32))


def test_history_planes_live_in_pinned_host(model):
    res = glm53.generate(model, prompts([40]), max_new_tokens=3, keep_cache=True,
                         cache=CacheConfig(mode="offload", kv_format="q8g64", copyback_every=16, prefill_chunk=16,
                                           hot_rows=64))
    kv = res.cache
    assert kv.mode == "offload"
    for plane in kv.pool.values():
        assert plane.sharding.memory_kind == "pinned_host"
    for plane in kv.hot.values():
        assert plane.sharding.memory_kind == "device"
    # 42 rows processed (the last sampled token is pending); complete 16-row pages are in host memory
    assert int(kv.host_len[0]) == 32 and int(kv.sessions.lengths[0]) == 42


def test_selection_override_controls_locality_and_stays_bit_identical(model):
    """A benchmark-supplied selection replaces the indexer's (which still runs): it changes the output, sees the
    right query positions, drives the hit rate, and keeps offload bit-identical to resident."""
    cc = CacheConfig(kv_format="q8g64", copyback_every=16, prefill_chunk=16, hot_rows=64)
    ps = prompts([40, 33])
    K = CFG.index_topk
    seen = []

    def fixed(step, positions):
        seen.append(positions.copy())
        return np.broadcast_to(np.arange(K, dtype=np.int32) * 2, (len(positions), K))  # positions 0, 2, ..., 30

    runs = {m: glm53.generate(model, ps, max_new_tokens=6, cache=cc.replace(mode=m), return_logits=True,
                              selection_override=fixed) for m in ("resident", "offload")}
    assert runs["offload"].tokens == runs["resident"].tokens
    assert np.array_equal(runs["offload"].logits, runs["resident"].logits)
    assert [p.tolist() for p in seen[:5]] == [[40 + i - 1, 33 + i - 1] for i in range(1, 6)]
    decode = runs["offload"].cache_stats["decode"]
    # Each fixed position misses at most once per layer and session (then it is hot): every later lookup hits.
    layers, sessions = CFG.num_hidden_layers, len(ps)
    assert 0 < decode["misses"] <= K * layers * sessions and decode["fills"] == decode["misses"]
    assert decode["hits"] + decode["misses"] == 5 * K * layers * sessions
    plain = glm53.generate(model, ps, max_new_tokens=6, cache=cc.replace(mode="resident"), return_logits=True)
    assert not np.array_equal(plain.logits[:, 1:], runs["resident"].logits[:, 1:])  # the override was used
    np.testing.assert_array_equal(plain.logits[:, 0], runs["resident"].logits[:, 0])  # prefill untouched
    with pytest.raises(ValueError, match="selection_override must return int"):
        glm53.generate(model, ps, max_new_tokens=3, cache=cc, selection_override=lambda s, p: np.zeros((2, 3)))

    def ahead(step, positions):  # the query's own row and K - 1 after it: rows not written yet
        return (positions[:, None] + np.arange(K)).astype(np.int32)

    with pytest.raises(ValueError, match="selected position 55 for session 0, whose queries this step are at most at "
                                         "position 40:"):
        glm53.generate(model, ps, max_new_tokens=3, cache=cc, selection_override=ahead)


def test_device_array_selection_equals_the_same_host_selection(model):
    """A ``jax.Array`` override (the benchmarks' device-side working sets) goes into the step without host checks:
    the same positions given as a device array or as numpy decode identically, in both modes; a wrong shape is
    still refused."""
    from experiments import workloads

    cc = CacheConfig(kv_format="q8g64", copyback_every=16, prefill_chunk=16, hot_rows=64)
    ps = prompts([40, 33])
    K = CFG.index_topk
    recorded = []
    device = workloads.local99_sessions(K, 32, seed=3, sessions=2, churn=0.1)

    def on_device(step, positions):
        sel = device(step, positions)
        assert isinstance(sel, jax.Array) and sel.shape == (2, K)
        recorded.append(np.asarray(sel))
        return sel

    a = glm53.generate(model, ps, max_new_tokens=6, cache=cc.replace(mode="offload"), return_logits=True,
                       selection_override=on_device)
    replay = iter(list(recorded))
    for mode in ("resident", "offload"):
        replay = iter(list(recorded))
        b = glm53.generate(model, ps, max_new_tokens=6, cache=cc.replace(mode=mode), return_logits=True,
                           selection_override=lambda step, positions: next(replay))
        assert b.tokens == a.tokens and np.array_equal(b.logits, a.logits)
    rows = np.stack(recorded)
    assert (np.diff(rows, axis=-1) > 0).all() and rows.min() >= 0 and rows.max() < 32  # sorted, distinct, in range
    assert (rows[1:] != rows[:-1]).any()  # the sets churn
    with pytest.raises(ValueError, match="selection_override must return int"):
        glm53.generate(model, ps, max_new_tokens=3, cache=cc,
                       selection_override=lambda s, p: jax.numpy.zeros((2, K - 1), jax.numpy.int32))


def test_offload_sizes_are_checked_when_the_model_is_configured():
    with pytest.raises(ConfigError, match="hot_rows=32 is below what a round can pin"):
        glm53.Model(CFG, params=None, dtype="float32",
                    cache_config=CacheConfig(mode="offload", copyback_every=16, prefill_chunk=16, hot_rows=32))
    with pytest.raises(ConfigError, match="must be a power of two"):
        CacheConfig(mode="offload", copyback_every=24)

"""Property tests of the offload cache state under random sequences of rounds (no model: rows are random data).

After every round: the slot map and its inverse are a bijection; slots read as hits in a round are not evicted by
it; every position below the logical length is readable from exactly the ring or host memory and holds the row
written there; the hot cache holds exactly the rows of its positions; the gather returns the right row for every
valid entry; nothing is lost across copyback; counters add up.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm53 import cache as kvcache
from kernels_pallas import kv_formats, offload
from glm53.config import CacheConfig, ConfigError, ModelConfig

B, N, T, K = 2, 256, 4, 16  # sessions, capacity rows, tokens per round, selected rows per token
FMT = "q8g64"
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=2, q_lora_rank=16,
                  qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2, index_topk=K,
                  indexer_types=("full", "shared"), n_routed_experts=2, num_experts_per_tok=1,
                  num_nextn_predict_layers=0, max_position_embeddings=1024)
CC = CacheConfig(mode="offload", kv_format=FMT, copyback_every=8, prefill_chunk=T, hot_rows=32)
L = CFG.num_cache_layers


def new_cache():
    base = kvcache.init_cache(CFG, CC.replace(mode="resident"), B, N, jnp.float32)
    return offload.to_offload(base, CFG, CC)


@functools.partial(jax.jit, donate_argnums=(0,))
def round_fn(cache, latent, rope, n_valid, selected):
    """Write T new rows per session (n_valid real) in every layer, then gather ``selected`` in every layer."""
    t = jnp.arange(T)[None, :]
    positions = cache.lengths[:, None] + t
    write_pos = jnp.where(t < n_valid[:, None], positions, N)
    valid = (selected <= positions[..., None]) & (t < n_valid[:, None])[..., None]
    outs = []
    before = [(cache.offload.position_of_slot[layer], cache.offload.counters[layer]) for layer in range(L)]
    for layer in range(L):
        cache = offload.write_rows(cache, layer, latent[layer], rope[layer], write_pos)
    for layer in range(L):
        src, _, slot = offload.classify(cache.offload, layer, selected.reshape(B, T * K), L)
        lat, rp, cache = offload.gather_rows(cache, layer, selected, valid, jnp.float32)
        outs.append((lat, rp, src.reshape(B, T, K), slot.reshape(B, T, K)))
    cache = offload.finish_round(cache)
    return kvcache.advance(cache, n_valid), outs, before, valid


def host_row(cache, b, layer, p):
    stt = cache.offload
    page = int(stt.page_table[b, p // stt.page_rows])
    r = (page * L + layer) * stt.page_rows + p % stt.page_rows
    return {n: np.asarray(v[r]) for n, v in cache.history.items()}


def packed(fmt, lat, rope):
    return {n: np.asarray(v) for n, v in kv_formats.pack(kv_formats.get_format(fmt), lat, rope).items()}


def check_invariants(cache, shadow, lengths, host_len):
    stt = cache.offload
    sop = np.asarray(stt.slot_of_position)
    pos = np.asarray(stt.position_of_slot)
    H = stt.hot_rows
    R = stt.ring_rows
    hot = {n: np.asarray(v) for n, v in stt.hot.items()}
    ring = {n: np.asarray(v) for n, v in stt.ring.items()}
    assert (np.asarray(stt.host_len) == host_len).all()
    for layer in range(L):
        for b in range(B):
            # bijection between occupied slots and hot positions
            occupied = np.nonzero(pos[layer, b] >= 0)[0]
            hot_positions = np.nonzero(sop[layer, b] >= 0)[0]
            assert len(occupied) == len(hot_positions)
            assert (sop[layer, b, pos[layer, b, occupied]] == occupied).all()
            assert (pos[layer, b, sop[layer, b, hot_positions]] == hot_positions).all()
            # hot positions are in host memory and hold their rows
            assert (hot_positions < host_len[b]).all()
            for s in occupied:
                p = pos[layer, b, s]
                for n in hot:
                    np.testing.assert_array_equal(hot[n][layer, b, s], shadow[layer][b][p][n])
            # every written position is readable from exactly one of host memory / ring, with its row
            for p in range(lengths[b]):
                want = shadow[layer][b][p]
                if p < host_len[b]:
                    got = host_row(cache, b, layer, p)
                else:
                    assert lengths[b] - host_len[b] <= R
                    got = {n: ring[n][layer, b, p % R] for n in ring}
                for n in want:
                    np.testing.assert_array_equal(got[n], want[n])
        assert (np.asarray(stt.clock[layer]) >= 0).all() and (np.asarray(stt.clock[layer]) < H).all()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.lists(st.tuples(st.integers(0, T), st.integers(0, T)), min_size=4,
                                            max_size=14))
def test_random_rounds_keep_invariants(seed, steps):
    rng = np.random.default_rng(seed)
    cache = new_cache()
    driver = offload.Driver(cache)
    fmt = kv_formats.get_format(FMT)
    shadow = [[dict() for _ in range(B)] for _ in range(L)]
    lengths = np.zeros(B, np.int64)
    for n0, n1 in steps:
        n_valid = np.array([n0, n1], np.int32)
        driver.before_step(n_valid)
        latent = rng.normal(size=(L, B, T, 512)).astype(np.float32) * rng.choice([0.01, 1.0, 30.0])
        rope = rng.normal(size=(L, B, T, 64)).astype(np.float32)
        # Mostly positions with locality (hits), some far (misses), some beyond the query (junk picks).
        qpos = lengths[:, None] + np.arange(T)[None, :]
        sel = np.minimum(rng.integers(0, np.maximum(qpos + 3, 1)[..., None], size=(B, T, K)), N - 1)
        sel[..., 0] = np.maximum(qpos - 1, 0)  # duplicates across the tokens of a round
        for layer in range(L):
            pk = packed(FMT, latent[layer], rope[layer])
            for b in range(B):
                for t in range(n_valid[b]):
                    shadow[layer][b][lengths[b] + t] = {n: v[b, t] for n, v in pk.items()}
        cache, outs, before, valid = round_fn(cache, jnp.asarray(latent), jnp.asarray(rope), jnp.asarray(n_valid),
                                              jnp.asarray(sel, jnp.int32))
        valid = np.asarray(valid)
        lengths += n_valid
        for layer, ((lat, rp, src, slot), (pos_before, counters_before)) in enumerate(zip(outs, before)):
            lat, rp, src, slot = map(np.asarray, (lat, rp, src, slot))
            pos_before = np.asarray(pos_before)
            pos_after = np.asarray(cache.offload.position_of_slot[layer])
            # the gather returned the written row for every valid entry
            for b in range(B):
                for t in range(T):
                    for k in range(K):
                        if valid[b, t, k]:
                            want = kv_formats.unpack(fmt, {n: jnp.asarray(v[None])
                                                           for n, v in shadow[layer][b][sel[b, t, k]].items()},
                                                     jnp.float32)
                            np.testing.assert_array_equal(lat[b, t, k], np.asarray(want[0][0]))
                            np.testing.assert_array_equal(rp[b, t, k], np.asarray(want[1][0]))
                # slots read as hits this round were pinned: still hold the same position afterwards
                hit_slots = slot[b][(src[b] == 1)]
                assert (pos_after[b, hit_slots] == pos_before[b, hit_slots]).all()
                pinned = np.asarray(cache.offload.pinned[layer, b])
                assert set(np.nonzero(pinned)[0]) == set(hit_slots.tolist())
            # counters add up
            delta = np.asarray(cache.offload.counters[layer]) - np.asarray(counters_before)
            hits, misses, ring_reads, fills, evictions = delta.T
            for b in range(B):
                v = valid[b]
                assert hits[b] == ((src[b] == 1) & v).sum()
                assert misses[b] == ((src[b] == 2) & v).sum()
                assert ring_reads[b] == ((src[b] == 0) & v).sum()
                assert hits[b] + misses[b] + ring_reads[b] == v.sum()
                unique_misses = len(set(sel[b][(src[b] == 2) & v].tolist()))
                assert fills[b] == min(unique_misses, (pos_before[b] >= 0).size - len(set(
                    slot[b][src[b] == 1].tolist())))
                assert evictions[b] <= fills[b]
                assert (pos_after[b] >= 0).sum() == (pos_before[b] >= 0).sum() + fills[b] - evictions[b]
        cache = driver.after_step(cache, n_valid)
        check_invariants(cache, shadow, lengths, driver.host_len)
    assert (np.asarray(cache.lengths) == lengths).all()
    total = np.asarray(cache.offload.counters).sum(axis=(0, 1))
    assert total[3] >= total[4]  # fills >= evictions overall


def test_hot_rows_below_a_round_is_a_config_error():
    with pytest.raises(ConfigError, match="hot_rows=16 is below what a round can pin"):
        offload.validate(CFG, CC.replace(hot_rows=16))


def test_copyback_writes_one_page_for_all_layers():
    """A page of copyback_every rows of every layer lands contiguously: one write per plane."""
    cache = new_cache()
    driver = offload.Driver(cache)
    rng = np.random.default_rng(0)
    sel = jnp.zeros((B, T, K), jnp.int32)
    for _ in range(3):
        n_valid = np.array([T, T], np.int32)
        driver.before_step(n_valid)
        cache, *_ = round_fn(cache, jnp.asarray(rng.normal(size=(L, B, T, 512)), jnp.float32),
                             jnp.asarray(rng.normal(size=(L, B, T, 64)), jnp.float32), jnp.asarray(n_valid), sel)
        cache = driver.after_step(cache, n_valid)
    assert (np.asarray(cache.offload.host_len) == 8).all()  # 12 rows written, one page of 8 copied back
    assert (np.asarray(cache.offload.copybacks) == 1).all()
    pt = np.asarray(cache.offload.page_table)
    assert sorted(pt[:, 0].tolist()) == [0, 1] and (pt[:, 1:] == -1).all()
    for name, plane in cache.history.items():
        assert plane.sharding.memory_kind == "pinned_host", name


def test_ring_overrun_and_capacity_are_refused():
    cache = new_cache()
    driver = offload.Driver(cache)
    with pytest.raises(ValueError, match="ring holds"):
        driver.before_step(np.array([cache.offload.ring_rows + 1, 0]))
    driver.lengths[:] = N - 1
    driver.host_len[:] = N - 8
    with pytest.raises(ValueError, match="exceed the cache capacity"):
        driver.before_step(np.array([2, 0]))


def test_a_full_host_pool_is_a_clear_error_and_loses_nothing():
    """A pool smaller than the sessions' histories (admission by real allocation): when it runs out, the step's
    rows stay in the ring, nothing is half-written, and the next step is refused instead of overrunning."""
    base = kvcache.init_cache(CFG, CC.replace(mode="resident"), B, N, jnp.float32)
    cache = offload.to_offload(base, CFG, CC.replace(host_pool_rows=8))  # one page for two sessions
    driver = offload.Driver(cache)
    rng = np.random.default_rng(0)
    sel = jnp.zeros((B, T, K), jnp.int32)
    n_valid = np.array([T, T], np.int32)
    for _ in range(2):  # 8 rows each: two pages due, one free
        driver.before_step(n_valid)
        cache, *_ = round_fn(cache, jnp.asarray(rng.normal(size=(L, B, T, 512)), jnp.float32),
                             jnp.asarray(rng.normal(size=(L, B, T, 64)), jnp.float32), jnp.asarray(n_valid), sel)
        if driver.lengths[0] + T < 8:
            cache = driver.after_step(cache, n_valid)
    history = {n: np.asarray(v) for n, v in cache.history.items()}
    with pytest.raises(MemoryError, match="host page pool exhausted: 2 pages due, 1 free"):
        driver.after_step(cache, n_valid)
    assert len(driver.free_pages) == 1 and list(driver.host_len) == [0, 0]
    for n, v in cache.history.items():
        np.testing.assert_array_equal(np.asarray(v), history[n])
    assert (np.asarray(cache.offload.host_len) == 0).all() and (np.asarray(cache.offload.page_table) == -1).all()
    with pytest.raises(ValueError, match="ring holds"):
        driver.before_step(np.array([T + 8, 0]))

"""Property tests of the offload cache under random sequences of rounds (no model: rows are random data), through
the cache interface the model uses (begin_step / write_rows / gather_rows / finish_step / advance).

Two lanes work on slots [2, 0] of a three-slot cache (slot 1 is never touched and must stay empty). After every
round: the slot map and its inverse are a bijection; slots read as hits in a round are not evicted by it; every
position below the logical length is readable from exactly the ring or host memory and holds the row written
there; the hot cache holds exactly the rows of its positions; the gather returns the right row for every valid
entry; nothing is lost across copyback (which runs at the start of the next round); counters add up.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm53 import offload
from glm53.cache import Lanes
from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.model import make_step
from kernels_pallas import kv_formats

S, N, T, K = 3, 256, 4, 16  # slots, capacity rows, tokens per round, selected rows per token
SLOTS = [2, 0]  # lane -> slot
B = len(SLOTS)
FMT = "q8g64"
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=2, q_lora_rank=16,
                  qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2, index_topk=K,
                  indexer_types=("full", "shared"), n_routed_experts=2, num_experts_per_tok=1,
                  num_nextn_predict_layers=0, max_position_embeddings=1024)
CC = CacheConfig(mode="offload", kv_format=FMT, copyback_every=8, prefill_chunk=T, hot_rows=32)
L = CFG.num_cache_layers
P = CC.copyback_every
G = offload.copy_pages_for(CC, T)


def lanes():
    return Lanes(slot=jnp.asarray(SLOTS, jnp.int32), active=jnp.ones((B,), bool))


def new_cache(pool_pages=S * N // P, assign=True):
    cache = offload.init_offload(CFG, CC, S, N, pool_pages, jnp.float32)
    if assign:  # every lane's slot gets its pages up front (the engine assigns them as sessions grow)
        for b, s in enumerate(SLOTS):
            cache = cache.set_pages(s, jnp.arange(N // P, dtype=jnp.int32) + b * (N // P))
    return cache


@functools.partial(jax.jit, donate_argnums=(0,))
def round_fn(cache, latent, rope, n_valid, selected):
    """One round: copy back what is due, write T new rows per lane (n_valid real) in every layer, gather
    ``selected`` in every layer, fill."""
    ln = lanes()
    start = cache.sessions.lengths[ln.slot]
    step = make_step(start, n_valid, T, N, CFG, jnp.float32, ln, kernels="auto", fill=True, repeats=T,
                     copy_pages=G)
    cache = cache.begin_step(step)
    valid = (selected <= step.positions[..., None]) & (jnp.arange(T)[None, :] < n_valid[:, None])[..., None]
    before = [(cache.position_of_slot[layer], cache.counters[layer]) for layer in range(L)]
    for layer in range(L):
        cache = cache.write_rows(layer, latent[layer], rope[layer], step)
    host_len = cache.host_len  # the copyback ran by now (first, or at layer 0's write), before any read
    outs, rounds = [], []
    for layer in range(L):
        src, _, slot = cache.classify(layer, selected.reshape(B, T * K), ln)
        lat, rp, cache, round_ = cache.gather_rows(layer, selected, valid, step, jnp.float32)
        outs.append((lat, rp, src.reshape(B, T, K), slot.reshape(B, T, K)))
        rounds.append(round_)
    cache = cache.finish_step(rounds, step)
    cache = cache.advance(step, n_valid, jnp.zeros((B, CFG.hidden_size)), None)
    return cache, outs, before, valid, host_len


def packed(lat, rope):
    return {n: np.asarray(v) for n, v in kv_formats.pack(kv_formats.get_format(FMT), lat, rope).items()}


def stacked(rows, like):
    """The rows (one plane's) as one [n, W] array, also when there are none."""
    return np.stack(rows) if rows else np.zeros((0,) + like.shape[-1:], like.dtype)


def check_invariants(cache, shadow, lengths, host_len):
    # Everything read to numpy once and compared a slot's rows at a time: indexing the device arrays and comparing
    # row by row took 17 s of this file's 26 (a dispatch per index, 130,000 tiny assert_array_equal calls).
    sop = np.asarray(cache.slot_of_position)
    pos = np.asarray(cache.position_of_slot)
    H, R = cache.hot_rows, cache.ring_rows
    hot = {n: np.asarray(v) for n, v in cache.hot_planes().items()}  # [L, S, H, W]
    ring = {n: np.asarray(v) for n, v in cache.ring_planes().items()}  # [L, S, R, W]
    pool = {n: np.asarray(jnp.copy(v)) for n, v in cache.pool.items()}  # a copy: see the no-pool-page test
    page_table = np.asarray(cache.page_table)
    assert (np.asarray(cache.host_len)[SLOTS] == host_len).all()
    assert int(cache.host_len[1]) == 0 and (pos[:, 1] == -1).all() and int(cache.sessions.lengths[1]) == 0
    for layer in range(L):
        for b, s in enumerate(SLOTS):
            occupied = np.nonzero(pos[layer, s] >= 0)[0]
            hot_positions = np.nonzero(sop[layer, s] >= 0)[0]
            assert len(occupied) == len(hot_positions)  # bijection between occupied slots and hot positions
            assert (sop[layer, s, pos[layer, s, occupied]] == occupied).all()
            assert (pos[layer, s, sop[layer, s, hot_positions]] == hot_positions).all()
            assert (hot_positions < host_len[b]).all()  # hot positions are in host memory, with their rows
            for n in hot:  # every occupied slot holds its position's row
                want = stacked([shadow[layer][b][p][n] for p in pos[layer, s, occupied]], hot[n])
                np.testing.assert_array_equal(hot[n][layer, s, occupied], want,
                                              err_msg=f"hot slots {occupied.tolist()}, layer {layer}, plane {n}")
            # every written position: in host memory (below host_len, through its page) or in the ring, with its row
            assert lengths[b] - host_len[b] <= R
            in_host = np.arange(host_len[b])
            in_ring = np.arange(host_len[b], lengths[b])
            pool_rows = (page_table[s, in_host // P] * L + layer) * P + in_host % P
            for n in pool:
                got = np.concatenate([pool[n][pool_rows], ring[n][layer, s, in_ring % R]])
                want = stacked([shadow[layer][b][p][n] for p in range(lengths[b])], got)
                np.testing.assert_array_equal(got, want,
                                              err_msg=f"positions 0-{lengths[b] - 1} (host below {host_len[b]}), "
                                                      f"layer {layer}, slot {s}, plane {n}")
        assert (np.asarray(cache.clock[layer]) >= 0).all() and (np.asarray(cache.clock[layer]) < H).all()


WARM = 20  # full rounds before the drawn ones: 80 rows, 72 in host memory, more than the 32 hot slots


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.lists(st.tuples(st.integers(0, T), st.integers(0, T)), min_size=4,
                                            max_size=14), st.booleans())
def test_random_rounds_keep_invariants(seed, steps, warm):
    """``warm``: the drawn rounds start after WARM full rounds, with a full hot cache, so their fills evict (the
    drawn rounds alone, at most 56 rows a lane, never filled the 32 slots: no example evicted, and a fill that
    left an evicted position mapped to its old slot passed)."""
    rng = np.random.default_rng(seed)
    cache = new_cache()
    fmt = kv_formats.get_format(FMT)
    shadow = [[dict() for _ in range(B)] for _ in range(L)]
    lengths = np.zeros(B, np.int64)
    evictions_seen = 0
    for n0, n1 in [(T, T)] * (WARM if warm else 0) + list(steps):
        n_valid = np.array([n0, n1], np.int32)
        latent = rng.normal(size=(L, B, T, 512)).astype(np.float32) * rng.choice([0.01, 1.0, 30.0])
        rope = rng.normal(size=(L, B, T, 64)).astype(np.float32)
        # Mostly positions with locality (hits), some far (misses), some beyond the query (junk picks); distinct
        # within a token's selection (as the indexer's are), repeated across the tokens of a round.
        qpos = lengths[:, None] + np.arange(T)[None, :]
        sel = np.empty((B, T, K), np.int64)
        for b in range(B):
            for t in range(T):
                q = int(qpos[b, t])
                row = rng.permutation(max(q + 3, K))[:K]
                if max(q - 1, 0) not in row:
                    row[0] = max(q - 1, 0)
                sel[b, t] = row
        for layer in range(L):
            pk = packed(latent[layer], rope[layer])
            for b in range(B):
                for t in range(n_valid[b]):
                    shadow[layer][b][lengths[b] + t] = {n: v[b, t] for n, v in pk.items()}
        cache, outs, before, valid, host_len = round_fn(cache, jnp.asarray(latent), jnp.asarray(rope),
                                                        jnp.asarray(n_valid), jnp.asarray(sel, jnp.int32))
        # the round's copyback wrote the pages complete before it
        assert (np.asarray(host_len)[SLOTS] == (lengths // P) * P).all()
        valid = np.asarray(valid)
        lengths += n_valid
        for layer, ((lat, rp, src, slot), (pos_before, counters_before)) in enumerate(zip(outs, before)):
            lat, rp, src, slot = map(np.asarray, (lat, rp, src, slot))
            pos_before = np.asarray(pos_before)
            pos_after = np.asarray(cache.position_of_slot[layer])
            for b, s in enumerate(SLOTS):
                # the gather returned the written row for every valid entry (all T x K unpacked at once; an invalid
                # entry's row is a written one's, not compared)
                v = valid[b].reshape(-1)
                if not v.any():
                    continue
                some = next(iter(shadow[layer][b].values()))
                rows = [shadow[layer][b][q] if ok else some for q, ok in zip(sel[b].reshape(-1), v)]
                want = kv_formats.unpack(fmt, {n: jnp.asarray(np.stack([r[n] for r in rows])) for n in some},
                                         jnp.float32)
                np.testing.assert_array_equal(lat[b].reshape(T * K, -1)[v], np.asarray(want[0])[v])
                np.testing.assert_array_equal(rp[b].reshape(T * K, -1)[v], np.asarray(want[1])[v])
                # slots read as hits this round were pinned: they still hold the same position afterwards
                hit_slots = slot[b][src[b] == 1]
                assert (pos_after[s, hit_slots] == pos_before[s, hit_slots]).all()
                pinned = np.asarray(cache.pin_round[layer, s] == cache.rounds[layer, s])
                assert set(np.nonzero(pinned)[0]) == set(hit_slots.tolist())
            delta = np.asarray(cache.counters[layer]) - np.asarray(counters_before)  # counters add up
            hits, misses, ring_reads, fills, evictions = delta.T
            for b, s in enumerate(SLOTS):
                v = valid[b]
                assert hits[s] == ((src[b] == 1) & v).sum()
                assert misses[s] == ((src[b] == 2) & v).sum()
                assert ring_reads[s] == ((src[b] == 0) & v).sum()
                unique_misses = len(set(sel[b][(src[b] == 2) & v].tolist()))  # repeated positions fill once
                assert fills[s] == min(unique_misses, cache.hot_rows - len(set(slot[b][src[b] == 1].tolist())))
                assert evictions[s] <= fills[s]
                evictions_seen += int(evictions[s])
                assert (pos_after[s] >= 0).sum() == (pos_before[s] >= 0).sum() + fills[s] - evictions[s]
        check_invariants(cache, shadow, lengths, (lengths - np.asarray([n0, n1])) // P * P)
    assert (np.asarray(cache.sessions.lengths)[SLOTS] == lengths).all()
    if warm:
        assert evictions_seen > 0


def test_hot_rows_below_a_round_is_a_config_error():
    with pytest.raises(ConfigError, match="hot_rows=16 is below what a round can pin"):
        offload.validate(CFG, CC.replace(hot_rows=16))


def _rounds(cache, n, seed=0):
    rng = np.random.default_rng(seed)
    sel = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, T, K))
    for _ in range(n):
        cache, *_ = round_fn(cache, jnp.asarray(rng.normal(size=(L, B, T, 512)), jnp.float32),
                             jnp.asarray(rng.normal(size=(L, B, T, 64)), jnp.float32), jnp.full((B,), T, jnp.int32),
                             sel)
    return cache


def test_copyback_writes_one_page_for_all_layers():
    """A page of copyback_every rows of every layer lands contiguously: one block per layer, at the start of the
    round after the one that completed it."""
    cache = _rounds(new_cache(), 3)
    # 12 rows written; the page [0, 8) completed in round 2 and was written at the start of round 3
    assert (np.asarray(cache.host_len)[SLOTS] == 8).all()
    assert (np.asarray(cache.copybacks)[SLOTS] == 1).all() and int(cache.copybacks[1]) == 0
    for name, plane in cache.pool.items():
        assert plane.sharding.memory_kind == "pinned_host", name
    # hot_rows <= 32,768: the slot map is int16, -1 where a position is not hot, and counted as such
    from glm53 import memory

    assert cache.slot_of_position.dtype == np.int16 and (np.asarray(cache.slot_of_position)[:, 1] == -1).all()
    parts = memory.cache_bytes(CFG, CC, S, N, S * N // P, jnp.float32)
    assert parts["device"]["slot_of_position"] == cache.slot_of_position.nbytes
    assert parts["host"]["pool"] == sum(v.nbytes for v in cache.pool.values())
    held = cache.nbytes()  # every part, as allocated
    assert held.pop("pool") == parts["host"]["pool"] and held == parts["device"]


def test_padding_rows_are_never_addressed(monkeypatch):
    """Padding rows in the 1-byte hot and ring planes (forced here; at the H200 target the hot latent plane gets
    3.7M): the same rounds read the same rows and leave the same hot cache, ring and pool as without them, the
    padding stays zero, and cache_bytes counts it."""
    from glm53 import cache as gcache
    from glm53 import memory

    want = _rounds(new_cache(), 6, seed=5)
    real = gcache.padded_rows
    monkeypatch.setattr(gcache, "padded_rows", lambda rows, row_shape, dtype: real(rows, row_shape, dtype) + (
        40 if np.dtype(dtype).itemsize == 1 else 0))
    cache = new_cache()
    H, R = cache.hot_rows, cache.ring_rows
    assert cache.hot["latent"].shape[0] == L * S * H + 40 and cache.hot["rope"].shape[0] == L * S * H
    assert cache.ring["latent"].shape[0] == L * S * R + 40 and cache.ring["scale"].shape[0] == L * S * R
    got = _rounds(cache, 6, seed=5)
    for name in ("hot_planes", "ring_planes"):
        for n, v in getattr(want, name)().items():
            np.testing.assert_array_equal(np.asarray(getattr(got, name)()[n]), np.asarray(v), err_msg=f"{name} {n}")
    for n, v in want.pool.items():
        np.testing.assert_array_equal(np.asarray(got.pool[n]), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(got.counters), np.asarray(want.counters))
    assert not np.asarray(got.hot["latent"])[L * S * H:].any() and not np.asarray(got.ring["latent"])[L * S * R:].any()
    held = got.nbytes()
    parts = memory.cache_bytes(CFG, CC, S, N, S * N // P, jnp.float32)
    assert held.pop("pool") == parts["host"]["pool"] and held == parts["device"]


def test_a_page_with_no_pool_page_stays_in_the_ring():
    """If a page comes due with no pool page assigned (an engine bug), nothing is written anywhere, the rows stay
    readable in the ring, host_len does not move, and the cache counts it so the engine can report it."""
    cache = new_cache(assign=False)
    # a copy: np.asarray of a pinned_host array can be a zero-copy view that jax caches on the array, and a buffer
    # with such an external reference cannot be donated to the next round (the H200 refuses it)
    before = {n: np.asarray(jnp.copy(v)) for n, v in cache.pool.items()}
    cache = _rounds(cache, 3)
    assert (np.asarray(cache.host_len) == 0).all()
    assert (np.asarray(cache.unassigned)[SLOTS] >= 1).all()
    for n, v in cache.pool.items():
        np.testing.assert_array_equal(np.asarray(v), before[n])


def test_bulk_reads_are_counted_in_pages():
    """A bulk round (prefill / append) counts the host pages it copies, in int32 pages (rows overflowed int32 at
    ~2M tokens of prefill: a 1M-token prefill reads ~5.4e8 rows per layer); the stats turn them into rows and
    bytes in int64."""
    cache = _rounds(new_cache(), 5)  # 20 rows per lane; the pages [0, 16) are in host memory
    assert (np.asarray(cache.host_len)[SLOTS] == 16).all()
    ln = lanes()
    step = make_step(cache.sessions.lengths[ln.slot], jnp.zeros((B,), jnp.int32), T, N, CFG, jnp.float32, ln,
                     kernels="auto", bulk=True)
    sel = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, T, K))  # positions 0..15: both host pages
    _, _, cache, round_ = cache.gather_rows(0, sel, jnp.ones((B, T, K), bool), step, jnp.float32)
    assert round_ is None
    pages = np.asarray(cache.bulk_pages)
    assert cache.bulk_pages.dtype == np.int32 and (pages[0, SLOTS] == 2).all() and pages.sum() == 2 * B
    row = kv_formats.get_format(FMT).bytes_per_row
    st = offload.slot_stats(cache, SLOTS[0])
    assert st["per_layer"]["bulk_pages"] == [2] + [0] * (L - 1)
    assert st["per_layer"]["bulk_rows"] == [2 * P] + [0] * (L - 1)
    assert st["bulk_bytes_from_host"] == 2 * P * row
    most = np.full((L, S), 2**31 - 1, np.int32)  # int32 pages at their limit: rows and bytes far past int32
    st = offload.slot_stats(cache, 0, bulk=most)
    assert st["per_layer"]["bulk_rows"] == [(2**31 - 1) * P] * L
    assert st["bulk_bytes_from_host"] == L * (2**31 - 1) * P * row

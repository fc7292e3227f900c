"""The offload fill's bookkeeping kernel (``kernels_pallas.fill_round``) at decode shapes, against its jnp reference.

One decode step's fill: ``--layers`` cache layers, one session, ``--hot_rows`` slots, top-k = 2,048 positions per
round with ``--miss_rate`` of them missed (the rest hits), on a hot cache already full (so every fill evicts).
``--rows=4`` is an MTP-3 verify step's fill instead: 4 rows of 2,048 positions each, every row sharing
``--overlap`` of its positions with the first (consecutive queries select mostly the same history), so a position
repeats up to 4 times and the kernel elects each one's first entry (``max_repeats`` = rows).
Each launch shape (``num_warps``) is first checked bit for bit against the reference, then timed inside one jitted
loop that carries the maps from call to call (no dispatch counted). With repeated positions two more variants
locate the election's cost (timing only, not valid fills: ``max_repeats=1`` elects some entry, not the first;
``distinct=True`` none).

    python -m experiments.bench_fill_round --out=experiments/results/bench_fill_round.json
    python -m experiments.bench_fill_round --rows=4 --out=experiments/results/bench_fill_round_verify4.json
    python -m experiments.bench_fill_round --tiny   # CPU smoke run (interpreted kernel, timings meaningless)
"""

import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import cli
from glm53.provenance import write_results

frd = importlib.import_module("kernels_pallas.fill_round")
hg = importlib.import_module("kernels_pallas.hot_gather")

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_bool("tiny", False, "small sizes for a CPU smoke run")
flags.DEFINE_integer("layers", 9, "cache layers filled per step (h200_bench: 8 + the MTP layer)", lower_bound=1)
flags.DEFINE_integer("hot_rows", 32768, "hot-cache slots per layer", lower_bound=1)
flags.DEFINE_float("miss_rate", 0.01, "fraction of each round's positions missed")
flags.DEFINE_integer("iters", 200, "calls per timed loop", lower_bound=1)
flags.DEFINE_list("num_warps", ["2", "4", "8", "16", "32"], "launch shapes to time")
flags.DEFINE_integer("rows", 1, "query rows per round (MTP depth + 1 in a verify step)", lower_bound=1)
flags.DEFINE_float("overlap", 0.9, "with --rows > 1: fraction of each later row's positions also in the first row")


def decode_case(rng, L, H, N, M, miss_rate, rows=1, overlap=0.9):
    """A full hot cache and one round per layer: ``rows`` rows of M distinct positions each, ``miss_rate`` of them
    not hot; a later row shares ``overlap`` of its positions with the first."""
    pos_of_slot = np.zeros((L, 1, H), np.int32)
    slot_of_pos = np.full((L, 1, N), -1, np.int32)
    rounds = []
    for l in range(L):
        hot_positions = rng.choice(N, H, replace=False)
        pos_of_slot[l, 0] = hot_positions
        slot_of_pos[l, 0, hot_positions] = np.arange(H)
        cold = np.setdiff1d(np.arange(N), hot_positions)
        n_miss = int(round(M * miss_rate))
        first = np.sort(np.concatenate([rng.choice(hot_positions, M - n_miss, replace=False),
                                        rng.choice(cold, n_miss, replace=False)]))
        row_positions = [first]
        for _ in range(rows - 1):
            shared = rng.choice(first, int(round(M * overlap)), replace=False)
            others_hot = np.setdiff1d(hot_positions, first)
            others_cold = np.setdiff1d(cold, first)
            k = M - len(shared)
            k_miss = int(round(k * miss_rate))
            row_positions.append(np.sort(np.concatenate([shared, rng.choice(others_hot, k - k_miss, replace=False),
                                                         rng.choice(others_cold, k_miss, replace=False)])))
        pos = np.concatenate(row_positions).astype(np.int32)[None]
        slot = slot_of_pos[l][0, pos[0]][None]
        source = np.where(slot >= 0, hg.HOT, hg.HOST).astype(np.int32)
        rounds.append(dict(pos=pos, source=source, slot=slot, valid=np.ones_like(pos, bool)))
    maps = dict(pin_round=np.zeros((L, 1, H), np.int32), position_of_slot=pos_of_slot,
                slot_of_position=slot_of_pos, rounds=np.zeros((L, 1), np.int32),
                clock=rng.integers(0, H, (L, 1)).astype(np.int32), counters=np.zeros((L, 1, 5), np.int32))
    return maps, rounds


def main(_):
    on_gpu = jax.default_backend() == "gpu"
    L, H, N, M = (FLAGS.layers, FLAGS.hot_rows, 50176, 2048) if not FLAGS.tiny else (3, 256, 1024, 64)
    iters = FLAGS.iters if not FLAGS.tiny else 2
    R = FLAGS.rows
    maps_np, rounds_np = decode_case(np.random.default_rng(0), L, H, N, M, FLAGS.miss_rate, R, FLAGS.overlap)
    layers = tuple(range(L))
    fresh = lambda: {n: jnp.asarray(v) for n, v in maps_np.items()}
    rounds = tuple({k: jnp.asarray(v) for k, v in r.items()} for r in rounds_np)
    lane_slot, lane_active = jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)  # one session in slot 0

    def timed(fn):
        @jax.jit
        def loop(maps, rounds):
            def body(_, carry):
                maps, acc = carry
                maps, entry, victim, n_fill = fn(maps, rounds, lane_slot, lane_active)
                return maps, acc + n_fill.sum() + entry[..., 0].sum() + victim[..., 0].sum()
            return jax.lax.fori_loop(0, iters, body, (maps, jnp.int32(0)))

        jax.block_until_ready(loop(fresh(), rounds))
        times = []
        for _ in range(5):
            maps = fresh()
            jax.block_until_ready(maps)
            t = time.perf_counter()
            jax.block_until_ready(loop(maps, rounds))
            times.append(time.perf_counter() - t)
        return float(np.median(times)) / iters * 1e6

    rule = dict(distinct=R == 1, max_repeats=R)
    want = frd.fill_round_reference(fresh(), rounds, lane_slot, lane_active, layers=layers, hot_rows=H, **rule)
    results = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "layers": L, "hot_rows": H, "capacity": N, "positions_per_row": M, "rows": R,
               "overlap": FLAGS.overlap if R > 1 else None, "miss_rate": FLAGS.miss_rate,
               "reference_us": timed(lambda m, r, s, a: frd.fill_round_reference(m, r, s, a, layers=layers,
                                                                                  hot_rows=H, **rule)),
               "kernel": []}
    print(f"reference: {results['reference_us']:.2f} us per fill of {L} layers")
    variants = [dict(rule, num_warps=int(nw)) for nw in FLAGS.num_warps]
    if R > 1:  # where the election's time goes (not valid fills: compared, not expected equal)
        variants += [dict(distinct=False, max_repeats=1, num_warps=int(nw)) for nw in FLAGS.num_warps]
        variants += [dict(distinct=True, max_repeats=1, num_warps=int(nw)) for nw in FLAGS.num_warps]
    for v in variants:
        kw = dict(layers=layers, hot_rows=H, interpret=not on_gpu, **v)
        got = frd.fill_round(fresh(), rounds, lane_slot, lane_active, **kw)
        equal = all(np.array_equal(np.asarray(g), np.asarray(w))
                    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
        us = timed(lambda m, r, s, a: frd.fill_round(m, r, s, a, **kw))
        results["kernel"].append({**v, "us": us, "bit_identical_to_reference": equal})
        print(f"kernel {v}: {us:.2f} us, identical {equal}")
    write_results(FLAGS.out, results)


if __name__ == "__main__":
    cli.run(main)

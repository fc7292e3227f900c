"""Does decode cost follow the live history, not the cache's capacity? A short history decoded in a cache of a
million rows per session against a cache of its own size.

    python -m experiments.live_history_ab --config=configs/h200_1m.py --config.cache.mode=resident \
        --config.run.prompt_len=10000 --large_capacity=1048576 --pairs=3 --out=$OUT/live_history_ab.json

For each of ``--modes`` (default: the config's cache mode), two engines of ``--sessions`` slots: ``small`` sized
for the run (history + new tokens + a margin, the capacity ``generate`` would choose) and ``large`` of
``--large_capacity`` rows per session (the config's ``max_position_embeddings`` must allow it: use
``configs/h200_1m.py``). Each opens the same ``--sessions`` random prompts of ``prompt_len`` tokens. After an untimed
warm-up that also compares the logits bit for bit (the selection rule makes a step's result independent of the
capacity: ``tests/test_indexer_cache.py``), ``--pairs`` interleaved pairs (small first, then large first, ...) each
generate ``max_new_tokens`` tokens per session and roll back. The default workload is the model's own indexer,
whose scoring and top-k are the parts that could pay for the capacity; the decode step skips key blocks past the
longest live session. Reported: tokens/s of each, the large cache's loss, outputs compared, device cache bytes.
"""

import json

import jax
import numpy as np
from absl import app, flags

import glm53
from experiments import cli, workloads
from experiments.engine_runs import figures, pooled_loss_pct, run, same_logits
from glm53.memory import device_memory
from glm53.provenance import provenance

FLAGS = flags.FLAGS
cli.define_config("configs/h200_1m.py", "experiment config")
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_integer("large_capacity", 1 << 20, "rows per session of the large cache", lower_bound=1)
flags.DEFINE_list("modes", [], "cache modes to compare in (default: the config's cache.mode)")
flags.DEFINE_integer("sessions", 1, "sessions decoding together (each its own random prompt)", lower_bound=1)
flags.DEFINE_integer("pairs", 3, "interleaved small/large pairs per mode", lower_bound=1)
flags.DEFINE_string("workload", "indexer", f"DSA selection: {workloads.WORKLOADS}")
flags.DEFINE_integer("check_tokens", 8, "tokens of the logits check run (also the warm-up)", lower_bound=1)


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "run.prompt_len", "run.max_new_tokens", "run.seed")
        + cli.cache_fields_but(c, "max_len"),
        "experiments.live_history_ab reads config.model, seed, dtype, run.{prompt_len,max_new_tokens,seed} and cache "
        "but its max_len (the two capacities: the run's own and --large_capacity); sessions come from --sessions, "
        "the output from --out, decoding is greedy without MTP, and it runs on one device")
    workloads.check_names("workload", [FLAGS.workload])
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    cli.check_modes(c, FLAGS.modes or [cc.mode], "modes")
    S, new, history = FLAGS.sessions, c.run.max_new_tokens, c.run.prompt_len
    small = history + max(new, FLAGS.check_tokens) + 64
    # Both before the model is built and the small engine prefilled (the large engine refused it after them)
    if FLAGS.large_capacity <= small:
        raise app.UsageError(f"--large_capacity={FLAGS.large_capacity} is not larger than the run's own capacity "
                             f"{small}")
    positions = c.model.max_position_embeddings
    if FLAGS.large_capacity > positions:
        raise app.UsageError(f"--large_capacity={FLAGS.large_capacity} exceeds the model's max_position_embeddings="
                             f"{positions}: use --config=configs/h200_1m.py, a smaller --large_capacity or "
                             f"--config.model.max_position_embeddings={FLAGS.large_capacity}")
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    K = min(model.config.index_topk, small)
    rng = np.random.default_rng(c.run.seed)
    prompts = [rng.integers(0, model.config.vocab_size, history).tolist() for _ in range(S)]
    results = {"config": c.to_dict(), **provenance(), "sessions": S, "history": history, "workload": FLAGS.workload,
               "capacities": {"small": small, "large": FLAGS.large_capacity}, "modes": {}}
    for mode in FLAGS.modes or [cc.mode]:
        engines, entry = {}, {"build": {}, "pairs": []}
        for size, rows in (("small", small), ("large", FLAGS.large_capacity)):
            e = glm53.Engine(model, cc.replace(mode=mode, max_len=rows), max_sessions=S)
            sids = [e.open(p) for p in prompts]
            jax.block_until_ready(e.cache)
            engines[size] = (e, sids)
            rep = e.memory_report()
            entry["build"][size] = {"capacity": e.capacity, "device_cache_bytes": rep["device"]["cache_bytes"],
                                    "device_memory": device_memory()}
            print(f"[{mode} {size}] capacity {e.capacity} rows, device cache "
                  f"{rep['device']['cache_bytes'] / 2**30:.2f} GiB", flush=True)

        def selection(seed):
            return workloads.selection(FLAGS.workload, K, history, seed, S)

        check = {size: run(e, sids, FLAGS.check_tokens, 0, None, selection(1), logits=True)
                 for size, (e, sids) in engines.items()}
        entry["check_tokens_identical"] = check["small"]["tokens"] == check["large"]["tokens"]
        entry["check_logits_identical"] = same_logits(check["small"], engines["small"][1], check["large"],
                                                      engines["large"][1])
        for p in range(FLAGS.pairs):
            order = ("small", "large") if p % 2 == 0 else ("large", "small")
            runs = {size: run(*engines[size], new, 0, None, selection(10 + p)) for size in order}
            fs, fl = figures(runs["small"], S), figures(runs["large"], S)
            pair = {"order": order, "tokens_identical": runs["small"]["tokens"] == runs["large"]["tokens"],
                    "small": fs, "large": fl,
                    "large_loss_pct": 100 * (1 - fl["aggregate_tokens_per_s"] / fs["aggregate_tokens_per_s"])}
            entry["pairs"].append(pair)
            print(f"[{mode} pair {p}] small {fs['aggregate_tokens_per_s']:.1f} tok/s, large "
                  f"{fl['aggregate_tokens_per_s']:.1f} tok/s, loss {pair['large_loss_pct']:.2f}%, tokens identical "
                  f"{pair['tokens_identical']}", flush=True)
        entry["summary"] = {
            "pooled_large_loss_pct": pooled_loss_pct([q["small"]["aggregate_tokens_per_s"] for q in entry["pairs"]],
                                                     [q["large"]["aggregate_tokens_per_s"] for q in entry["pairs"]]),
            "losses_pct": [q["large_loss_pct"] for q in entry["pairs"]],
            "all_tokens_identical": entry["check_tokens_identical"]
            and all(q["tokens_identical"] for q in entry["pairs"]),
            "logits_identical": entry["check_logits_identical"]}
        print(f"[{mode}] {entry['summary']}", flush=True)
        results["modes"][mode] = entry
        del engines, check
        if FLAGS.out:  # after every mode, so a run cut short still leaves what it measured
            with open(FLAGS.out, "w") as f:
                json.dump(results, f, indent=2, default=str)
    if FLAGS.out:
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)

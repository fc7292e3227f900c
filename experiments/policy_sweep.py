"""Hot-cache policies against hot-cache size, replayed offline over selection traces (``glm53.policies``).

    python -m experiments.policy_sweep --out=experiments/results/policy_sweep.json

Traces (``--workloads``):

- ``model``: recorded from the config's model (default ``configs/tiny.py``) in offload mode: ``config.run.batch``
  sessions of ``config.run.prompt_len`` random tokens, then ``config.run.max_new_tokens`` decoded together (MTP
  depth ``config.run.mtp``, sampling ``config.run.temperature`` / ``top_p`` / ``seed``), every layer's selection
  (``glm53.trace``). With random weights the selection is the indexer's reaction to noise, not to meaning: it tests
  the machinery, not a checkpoint's locality; record a real checkpoint's trace with ``Engine.generate(...,
  trace=...)`` and pass it with ``--traces``. The config is read for this trace only: ``config.model``, ``seed``,
  ``dtype``, ``config.cache`` (its mode is offload whatever the file says; an override to another mode is refused)
  and the ``config.run`` fields above; an override of any other field is refused, as is any override when no
  ``model`` workload runs.
- the synthetic workloads of ``experiments.workloads`` (``drift<c>``, ``window<s>``, ``uniform``, ``local99``) and
  ``zipf<s>`` (lasting popularity with a long tail, ``zipf_rows``): ``--steps`` selections of ``--topk`` positions
  over a ``--history``-token history, one layer.
- ``--traces``: saved trace files (``.npz``), named by their file.

Each trace is replayed through every policy in ``--policies`` at every hot-cache size (``--hot_rows`` for synthetic
and saved traces, ``--model_hot_rows`` for the model's), cold. A trace that carries an engine's snapshots (the
``model`` trace, and a saved one recorded from an engine) is also replayed through the engine's policy at the
engine's size, from the snapshots and cold, and both are checked against the engine's counters (``engine_check``
in the JSON; the run ends with an error if they differ). Policies are compared by the rows they read from host
memory (``host_rows``: misses and prefetched rows), not by hit rate alone, which leaves a prefetch's reads out.
Every flag is checked before any trace is recorded or built. Writes the JSON and a PNG beside it (rows from host per
lookup and victim-search length against hot-cache size, one panel per trace).
"""

import json
import os
import sys
import time

import numpy as np
from absl import flags

from experiments import cli
import glm53
from glm53 import offload, policies
from glm53.cache import capacity_for
from glm53.provenance import module_name, provenance
from glm53.trace import SelectionTrace, TraceRecorder

FLAGS = flags.FLAGS
cli.define_config("configs/tiny.py", "model config for the 'model' trace")
flags.DEFINE_string("out", "", "results JSON (the plot goes next to it, .png)")
flags.DEFINE_list("workloads", ["model", "drift0.05", "window256", "uniform", "zipf0.8", "zipf1.0"],
                  "model | drift<c> | window<s> | uniform | local99 | zipf<s>")
flags.DEFINE_list("traces", [], "saved selection traces (.npz) to replay as well")
flags.DEFINE_list("policies", ["circular", "clock", "lru", "lfu", "window4096+sticky", "circular+prefetch64"],
                  policies.POLICIES)
flags.DEFINE_list("hot_rows", ["2048", "4096", "8192", "16384", "32768", "65536"],
                  "hot-cache sizes for synthetic and saved traces (each at most the trace's capacity)")
flags.DEFINE_list("model_hot_rows", [],
                  "hot-cache sizes for the model trace; empty: five from the least the engine runs with "
                  "(offload.min_hot_rows) to the trace's capacity, and the engine's own")
flags.DEFINE_integer("history", 1_048_576, "synthetic traces: history length")
flags.DEFINE_integer("steps", 1000, "synthetic traces: decode steps", lower_bound=1)
flags.DEFINE_integer("topk", 2048, "synthetic traces: positions per selection")
flags.DEFINE_string("save_traces", "", "write every trace used here as <dir>/<name>.npz")

# What of the config the model trace reads (cli.unread_overrides refuses an override of anything else).
CONFIG_READ = ("model", "seed", "dtype", "cache", "run.prompt_len", "run.max_new_tokens", "run.mtp", "run.seed",
               "run.batch", "run.temperature", "run.top_p")


def zipf_rows(K: int, history: int, steps: int, exponent: float, seed: int = 0):
    """``zipf<s>``: each step K distinct positions drawn with probability proportional to ``rank ** -s``, the ranks a
    fixed random permutation of the history (rows with lasting popularity and a long tail: the reuse the
    drifting and sliding workloads lack, and where replacement policies differ). Sampling without replacement by
    Gumbel top-k."""
    rng = np.random.default_rng(seed)
    by_rank = rng.permutation(history)
    logp = -exponent * np.log(np.arange(1, history + 1, dtype=np.float64))
    for _ in range(steps):
        keys = logp + rng.gumbel(size=history)
        yield by_rank[np.argpartition(-keys, K - 1)[:K]]


def synthetic_trace(workload: str, K: int, history: int, steps: int, seed: int = 0) -> SelectionTrace:
    from experiments import workloads

    if workload.startswith("zipf"):
        try:
            exponent = float(workload[len("zipf"):])
        except ValueError:
            raise ValueError(f"zipf<s> needs an exponent, e.g. zipf1.0; got {workload!r}") from None
        rows = zipf_rows(K, history, steps, exponent, seed)
    elif workload == "uniform":  # numpy's sampler: jax's choice without replacement sorts the whole history
        rng = np.random.default_rng(seed)
        rows = (rng.choice(history, K, replace=False) for _ in range(steps))
    else:
        override = workloads.selection(workload, K, history, seed)
        if override is None:
            raise ValueError(f"{workload!r} is not a synthetic workload")
        rows = (np.asarray(override(t + 1, np.asarray([history])))[0] for t in range(steps))
    return SelectionTrace.from_rounds(((t, 0, 0, history, r) for t, r in enumerate(rows)),
                                      meta={"capacity": history, "source": f"synthetic {workload}", "topk": K,
                                            "row_bytes": 656})


def model_cache_config(c) -> glm53.CacheConfig:
    """The model trace's cache: the config's, in offload mode, sized to the run (``max_len`` 0: the run's rows + 64)."""
    cc = glm53.CacheConfig.from_config_dict(c.cache).replace(mode="offload")
    total = c.run.prompt_len + c.run.max_new_tokens + max(c.run.mtp, 0)
    return cc.replace(max_len=cc.max_len or total + 64)


def model_trace(c) -> SelectionTrace:
    cc = model_cache_config(c)
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    rng = np.random.default_rng(c.run.seed)
    e = glm53.Engine(model, cc, max_sessions=c.run.batch)
    sids = [e.open(rng.integers(0, model.config.vocab_size, c.run.prompt_len).tolist()) for _ in range(c.run.batch)]
    rec = TraceRecorder()
    e.generate({s: c.run.max_new_tokens for s in sids}, mtp=c.run.mtp, temperature=c.run.temperature,
               top_p=c.run.top_p, seed=c.run.seed, trace=rec, progress=True)
    return rec.trace()


def engine_check(trace: SelectionTrace) -> dict:
    """The engine's own policy at its size, replayed from the trace's snapshots and cold: both must give the
    engine's counters."""
    want = policies.segment_counts(trace)
    check = {"policy": trace.meta.get("policy", "circular"), "hot_rows": trace.meta["hot_rows"],
             "engine_counters": want.sum(0).tolist()}
    for name, snapshots in (("replayed", True), ("cold", False)):
        got = policies.replay(trace, check["policy"], from_snapshots=snapshots)
        table = np.stack([got.per_layer[n] for n in policies.COUNTS[:5]], 1)
        check[f"{name}_counters"] = table.sum(0).tolist()
        check[f"{name}_equal"] = bool(np.array_equal(table, want))
    return check


def _sizes(flag: str, values: list) -> list[int]:
    sizes = []
    for v in values:
        try:
            sizes.append(int(v))
        except ValueError:
            raise ValueError(f"--{flag}={','.join(values)}: {v!r} is not a whole number of rows") from None
        if sizes[-1] < 1:
            raise ValueError(f"--{flag}: hot_rows must be >= 1, got {sizes[-1]}")
    return sizes


def model_sizes(c, given: list) -> tuple[list[int], int]:
    """The model trace's hot-cache sizes and capacity, from the config alone (before anything is recorded)."""
    cc = model_cache_config(c)
    cfg = glm53.ModelConfig.from_config_dict(c.model)
    offload.validate(cfg, cc)  # a hot cache the engine cannot run: refused now, not after the model is built
    capacity = capacity_for(cc.max_len, cc)
    if given:
        sizes = _sizes("model_hot_rows", given)
        over = [h for h in sizes if h > capacity]
        if over:
            raise ValueError(f"--model_hot_rows={','.join(given)}: {', '.join(map(str, over))} exceed"
                             f"{'s' if len(over) == 1 else ''} the model trace's capacity ({capacity} rows per "
                             f"session): every position fits in {capacity} slots")
        return sizes, capacity
    least = min(offload.min_hot_rows(cfg, cc), capacity)
    auto = {int(round(h / 16)) * 16 for h in np.geomspace(least, capacity, 5)} | {least, capacity}
    if cc.hot_rows <= capacity:
        auto.add(cc.hot_rows)
    return sorted(h for h in auto if least <= h <= capacity), capacity


def plan(c, given: dict) -> dict:
    """Every flag and override checked, before any trace is recorded or built: a ValueError / ConfigError names
    the first mistake."""
    from experiments import workloads

    specs = list(FLAGS.policies)
    if not specs:
        raise ValueError("--policies: name at least one policy")
    for s in specs:
        policies.check_spec(s)
    names = list(FLAGS.workloads)
    if not names and not FLAGS.traces:
        raise ValueError("--workloads and --traces are both empty: nothing to replay")
    for w in names:
        try:
            own = w != "model" and workloads.Selections(w, 1, 1).factory is None  # a bad name raises here
        except ValueError as e:
            raise ValueError(f"--workloads={w}: {e}") from None
        if own:
            raise ValueError(f"--workloads={w}: the model's own selection is the 'model' workload")
    problem = cli.checkpoint_problem(c, given, reads_checkpoint=False)
    if problem:
        raise ValueError(problem)
    if "model" in names:
        if given.get("cache.mode", "offload") != "offload":
            raise ValueError(f"--config.cache.mode={given['cache.mode']}: the model trace records an offload engine "
                             "(only its steps classify what they read)")
        problem = cli.unread_overrides(given, CONFIG_READ, "the model trace reads config.model, seed, dtype, cache "
                                       "and run.{prompt_len,max_new_tokens,mtp,seed,batch,temperature,top_p} only")
        if not problem and (c.run.batch < 1 or c.run.prompt_len < 1 or c.run.max_new_tokens < 1):
            problem = (f"--config.run.batch={c.run.batch}, prompt_len={c.run.prompt_len} and max_new_tokens="
                       f"{c.run.max_new_tokens} must all be >= 1")
    else:
        problem = cli.unread_overrides(given, (), "no 'model' workload runs, and only its trace reads the config")
    if problem:
        raise ValueError(problem)
    synthetic = [w for w in names if w != "model"]
    if synthetic and not (1 <= FLAGS.topk <= FLAGS.history and FLAGS.steps >= 0):
        raise ValueError(f"--topk={FLAGS.topk}, --history={FLAGS.history}, --steps={FLAGS.steps}: synthetic "
                         "traces need 1 <= topk <= history and steps >= 0")
    sizes = _sizes("hot_rows", list(FLAGS.hot_rows))
    if not sizes and (synthetic or FLAGS.traces):
        raise ValueError("--hot_rows is empty: the synthetic and saved traces need at least one size")
    if synthetic and max(sizes, default=0) > FLAGS.history:
        raise ValueError(f"--hot_rows={','.join(FLAGS.hot_rows)}: sizes above --history={FLAGS.history} hold every "
                         "position of the synthetic traces")
    saved = {}
    for path in FLAGS.traces:
        saved[os.path.basename(path)] = t = SelectionTrace.load(path)
        for h in sizes:
            try:
                policies.check_hot_rows(t, h)
            except ValueError as e:
                raise ValueError(f"--traces={path} at --hot_rows={h}: {e}") from None
    out = {"specs": specs, "workloads": names, "sizes": sizes, "saved": saved}
    if "model" in names:
        out["model_sizes"], out["model_capacity"] = model_sizes(c, list(FLAGS.model_hot_rows))
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    return out


def host_rows_per_lookup(r: dict) -> float | None:
    """Rows read from host memory (misses and prefetched) per looked-up host row. Results written before
    ``host_rows`` was reported have its parts."""
    rows = r.get("host_rows", r["misses"] + r.get("prefetched", 0))
    looked = r["hits"] + r["misses"]
    return rows / looked if looked else None


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 6.5), squeeze=False)
    for j, name in enumerate(names):
        rows = results[name]["results"]
        for spec in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["hot_rows"], host_rows_per_lookup(r), r["scan"]["p99"]) for r in rows
                         if r["policy"] == spec)
            x = [p[0] for p in pts]
            axes[0, j].plot(x, [100 * (p[1] or 0) for p in pts], marker="o", label=spec)
            axes[1, j].plot(x, [max(p[2], 1) for p in pts], marker="o", label=spec)
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0, j].set_title(f"{name}\n{results[name]['summary']['source']}", fontsize=9)
        axes[1, j].set_yscale("log")
        axes[1, j].set_xlabel("hot-cache rows per layer and session")
    axes[0, 0].set_ylabel("rows from host per 100 lookups\n(misses + prefetched)")
    axes[1, 0].set_ylabel("victim search (demand fills),\np99 slots examined")
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def main(_):
    c = FLAGS.config
    try:
        p = plan(c, cli.overrides())
    except (glm53.ConfigError, ValueError) as e:
        sys.exit(f"{module_name()}: {e}")
    specs = p["specs"]
    traces, checks = {}, {}
    for w in p["workloads"]:
        t0 = time.perf_counter()
        traces[w] = model_trace(c) if w == "model" else synthetic_trace(w, FLAGS.topk, FLAGS.history, FLAGS.steps)
        print(f"[{w}] trace {traces[w].summary()} in {time.perf_counter() - t0:.1f} s", flush=True)
    traces.update(p["saved"])
    for name, t in traces.items():
        if t.segments:
            checks[name] = engine_check(t)
            print(f"[{name}] engine policy replayed from the engine's snapshots and cold: {checks[name]}", flush=True)
    if FLAGS.save_traces:
        for name, t in traces.items():
            t.save(os.path.join(FLAGS.save_traces, f"{name}.npz"))
    results = {}
    for name, t in traces.items():
        sizes = p["model_sizes"] if name == "model" else p["sizes"]
        t0 = time.perf_counter()
        rows = [r.to_dict() for r in policies.sweep(t, specs, sizes, progress=True)]
        results[name] = {"summary": t.summary(), "results": rows, "replay_seconds": time.perf_counter() - t0,
                         **({"engine_check": checks[name]} if name in checks else {})}
        for spec in specs:
            line = ", ".join(f"{r['hot_rows']}: {_pct(r['hit_rate'])} hits, {r['host_rows']:,} from host"
                             for r in rows if r["policy"] == spec)
            secs = sum(r["seconds"] for r in rows if r["policy"] == spec) / len(sizes)
            print(f"[{name}] {spec:>24}: {line}  ({secs:.2f} s a replay)", flush=True)
        fewest = []
        for h in sizes:
            at = [r for r in rows if r["hot_rows"] == h]
            best = min(at, key=lambda r: (r["host_rows"], r["policy"] != "circular"))  # ties: the engine's
            fewest.append(f"{h}: {best['policy']} {best['host_rows']:,}")
        print(f"[{name}] fewest rows from host: " + ", ".join(fewest), flush=True)
    out = {**provenance(), "policies": specs, "workloads": results,
           "flags": {"hot_rows": p["sizes"], "workloads": p["workloads"], "traces": list(FLAGS.traces)}}
    if "model" in p["workloads"]:
        out["config"] = c.to_dict()
        out["flags"]["model_hot_rows"] = p["model_sizes"]
    if any(w != "model" for w in p["workloads"]):
        out["flags"].update(history=FLAGS.history, steps=FLAGS.steps, topk=FLAGS.topk)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        plot(results, os.path.splitext(FLAGS.out)[0] + ".png")
        print(f"wrote {FLAGS.out} and its .png")
    bad = [name for name, ch in checks.items() if not (ch["replayed_equal"] and ch["cold_equal"])]
    if bad:
        sys.exit(f"{module_name()}: the replay of the engine's policy differs from the engine's counters on "
                 f"{', '.join(bad)} (engine_check above)")


if __name__ == "__main__":
    cli.run(main)

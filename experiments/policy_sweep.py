"""Hot-cache policies against hot-cache size, replayed offline over selection traces (``glm53.policies``).

    python -m experiments.policy_sweep --out=experiments/results/policy_sweep.json

Traces (``--workloads``):

- ``model``: recorded from the config's model (default ``configs/tiny.py``) in offload mode: ``--sessions``
  sessions of ``config.run.prompt_len`` random tokens, then ``config.run.max_new_tokens`` decoded together (MTP
  depth ``config.run.mtp``), every layer's selection (``glm53.trace``). With random weights the selection is the
  indexer's reaction to noise, not to meaning: it tests the machinery, not a checkpoint's locality; record a real
  checkpoint's trace with ``Engine.generate(..., trace=...)`` and pass it with ``--traces``.
- the synthetic workloads of ``experiments.workloads`` (``drift<c>``, ``window<s>``, ``uniform``, ``local99``) and
  ``zipf<s>`` (lasting popularity with a long tail, ``zipf_rows``): ``--steps`` selections of ``--topk`` positions
  over a ``--history``-token history, one layer.
- ``--traces``: saved trace files (``.npz``), named by their file.

Each trace is replayed through every policy in ``--policies`` at every hot-cache size (``--hot_rows`` for synthetic
and saved traces, ``--model_hot_rows`` for the model's), cold; a recorded trace is also replayed through the
engine's policy from the engine's own snapshots and checked against the engine's counters. Writes the JSON and a
PNG beside it (hit rate and victim-search length against hot-cache size, one panel per trace).
"""

import json
import os
import time

import numpy as np
from absl import flags
from ml_collections import config_flags

from experiments import cli
import glm53
from glm53 import policies
from glm53.provenance import provenance
from glm53.trace import SelectionTrace, TraceRecorder

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "configs/tiny.py", "model config for the 'model' trace")
flags.DEFINE_string("out", "", "results JSON (the plot goes next to it, .png)")
flags.DEFINE_list("workloads", ["model", "drift0.05", "window256", "uniform", "zipf0.8", "zipf1.0"],
                  "model | drift<c> | window<s> | uniform | local99 | zipf<s>")
flags.DEFINE_list("traces", [], "saved selection traces (.npz) to replay as well")
flags.DEFINE_list("policies", ["circular", "clock", "lru", "lfu", "window4096+sticky", "circular+prefetch64"],
                  policies.POLICIES)
flags.DEFINE_list("hot_rows", ["2048", "4096", "8192", "16384", "32768", "65536"],
                  "hot-cache sizes for synthetic and saved traces")
flags.DEFINE_list("model_hot_rows", ["64", "128", "256", "512", "1024"], "hot-cache sizes for the model trace")
flags.DEFINE_integer("history", 1_048_576, "synthetic traces: history length")
flags.DEFINE_integer("steps", 1000, "synthetic traces: decode steps")
flags.DEFINE_integer("topk", 2048, "synthetic traces: positions per selection")
flags.DEFINE_integer("sessions", 2, "model trace: sessions decoding together")
flags.DEFINE_string("save_traces", "", "write every trace used here as <dir>/<name>.npz")


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


def model_trace(c, sessions: int) -> tuple[SelectionTrace, dict]:
    cc = glm53.CacheConfig.from_config_dict(c.cache).replace(mode="offload")
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    rng = np.random.default_rng(c.run.seed)
    total = c.run.prompt_len + c.run.max_new_tokens + max(c.run.mtp, 0)
    e = glm53.Engine(model, cc.replace(max_len=cc.max_len or total + 64), max_sessions=sessions)
    sids = [e.open(rng.integers(0, model.config.vocab_size, c.run.prompt_len).tolist()) for _ in range(sessions)]
    rec = TraceRecorder()
    e.generate({s: c.run.max_new_tokens for s in sids}, mtp=c.run.mtp, trace=rec, progress=True)
    trace = rec.trace()
    # the engine's own policy, replayed from its snapshots, must give the engine's counters
    got = policies.replay(trace, "circular", from_snapshots=True)
    want = policies.segment_counts(trace)
    check = {"engine_counters": want.sum(0).tolist(),
             "replayed_counters": [got.total(n) for n in policies.COUNTS[:5]],
             "equal": bool(np.array_equal(np.stack([got.per_layer[n] for n in policies.COUNTS[:5]], 1), want))}
    return trace, check


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 6.5), squeeze=False)
    for j, name in enumerate(names):
        rows = results[name]["results"]
        for spec in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["hot_rows"], r["hit_rate"], r["scan"]["p99"]) for r in rows if r["policy"] == spec)
            x = [p[0] for p in pts]
            axes[0, j].plot(x, [100 * (p[1] or 0) for p in pts], marker="o", label=spec)
            axes[1, j].plot(x, [max(p[2], 1) for p in pts], marker="o", label=spec)
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0, j].set_title(f"{name}\n{results[name]['summary']['source']}", fontsize=9)
        axes[1, j].set_yscale("log")
        axes[1, j].set_xlabel("hot-cache rows per layer and session")
    axes[0, 0].set_ylabel("hit rate (%)")
    axes[1, 0].set_ylabel("victim search, p99 slots examined")
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    specs = list(FLAGS.policies)
    for s in specs:
        policies.make(s, 1, 1)
    traces, checks = {}, {}
    for w in FLAGS.workloads:
        t0 = time.perf_counter()
        if w == "model":
            traces[w], checks[w] = model_trace(c, FLAGS.sessions)
        else:
            traces[w] = synthetic_trace(w, FLAGS.topk, FLAGS.history, FLAGS.steps)
        print(f"[{w}] trace {traces[w].summary()} in {time.perf_counter() - t0:.1f} s", flush=True)
        if w in checks:
            print(f"[{w}] engine policy replayed from the engine's snapshots: {checks[w]}", flush=True)
    for path in FLAGS.traces:
        traces[os.path.basename(path)] = SelectionTrace.load(path)
    if FLAGS.save_traces:
        for name, t in traces.items():
            t.save(os.path.join(FLAGS.save_traces, f"{name}.npz"))
    results = {}
    for name, t in traces.items():
        sizes = [int(h) for h in (FLAGS.model_hot_rows if name == "model" else FLAGS.hot_rows)]
        t0 = time.perf_counter()
        rows = [r.to_dict() for r in policies.sweep(t, specs, sizes, progress=True)]
        results[name] = {"summary": t.summary(), "results": rows, "replay_seconds": time.perf_counter() - t0,
                         **({"engine_check": checks[name]} if name in checks else {})}
        for spec in specs:
            line = ", ".join(f"{r['hot_rows']}: {100 * (r['hit_rate'] or 0):.2f}%" for r in rows
                             if r["policy"] == spec)
            secs = sum(r["seconds"] for r in rows if r["policy"] == spec) / len(sizes)
            print(f"[{name}] {spec:>24}: {line}  ({secs:.2f} s a replay)", flush=True)
    out = {**provenance(), "config": c.to_dict(), "policies": specs, "workloads": results,
           "flags": {k: FLAGS[k].value for k in ("history", "steps", "topk", "sessions", "hot_rows",
                                                   "model_hot_rows")}}
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        plot(results, os.path.splitext(FLAGS.out)[0] + ".png")
        print(f"wrote {FLAGS.out} and its .png")


if __name__ == "__main__":
    cli.run(main)

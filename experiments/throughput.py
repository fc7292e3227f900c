"""Throughput across concurrent sessions: aggregate decode tokens/s at 1, 4, 16, 64 sessions, at 8K and 50K
history, resident and offload, each point beside its memory roofline; a JSON and a PNG plot.

    python -m experiments.throughput --config=configs/h200_bench.py --out=$OUT/throughput.json
    python -m experiments.throughput --config=configs/h200_bench.py --modes=resident --out=$OUT/tp_resident.json
    python -m experiments.throughput --plot_only=a.json,b.json --out=merged.json     # merge split runs, re-plot

**Engines.** One engine per cache mode, sized once for every point of the run: ``max_sessions`` = the largest
``--sessions`` whose cache fits the device (the others are skipped, with the bytes that do not fit), ``max_len`` =
the longest ``--histories`` + suffix + the longest decode, so every history and session count shares the same
compiled steps (a step's cost follows the live history, not the capacity: the indexer and top-k skip blocks past
it). Offload's host pool holds one history plus each session's own pages (``host_budget_bytes``).

**Sessions.** Per history, one prompt of that many random tokens is prefilled (timed) and the other sessions are
``Engine.fork`` s of it: offload forks *share* the history's host pages (copy-on-write; every session still
scores, gathers and fills its own rows, and its hot cache is its own copy), resident forks copy the rows on the
device. Shared pages are fine for throughput: what a step reads does not depend on whether two sessions' host pages
are the same memory. Each session then appends a distinct ``--suffix``-token tail, so the sessions decode different
tokens. A point with S sessions decodes the first S of them together.

**A point.** Untimed warm-up runs (``warm_up``: as long as the timed one unless ``--warmup_tokens`` says otherwise,
repeated while a run compiled anything) compile the steps of that batch bucket and let XLA record their CUDA graphs,
then ``--new_tokens`` tokens per session are timed (``Engine.last_run``: decode tokens after each session's first /
decode time); the sessions are rolled back after every run, so every point starts from the same state. DSA
selection: ``local99`` (``experiments.workloads.local99_sessions``: each session keeps its own K history positions,
1% replaced per step; the same seeds in both modes, so their tokens must be equal) or the model's indexer
(``--workload=indexer``).
Each point also records the host's side of its timed steps (``host``: step-call times, the reads' waits for the
device, the intervals between reads, the slowest calls beside the steps that ran the copyback): where the median
wait is near zero the host's loop set the pace, elsewhere the device did. Two modes whose median intervals agree but
whose tokens/s do not differ by a few slow calls, which a short point does not amortise (one offload session on an
H100 at 86e22e0, before ``warm_up`` repeated its runs: each ring executable's first call in the loop, 8-44 ms
against ~4 ms steps, recording CUDA graphs that XLA had dropped).

**Roofline** of each point (``glm53.roofline``): the bytes a step reads (weights once per step, i.e. amortised over
the batch; routed experts counted as the distinct experts the batch's tokens route to; KV rows gathered and indexer
keys scored per session at the point's mean history; offload: misses from host memory apart, at the point's
measured miss rate) against the HBM bandwidth measured before and after the points, the better of the two
(``measure_hbm_bandwidth``, ``best_bandwidth``). Routed experts: ``--routing=probe`` runs one instrumented decode
per history at the largest batch (an extra compile) and counts, for each S, the distinct experts of the first S
lanes' tokens (a lane's routing does not depend on the others); ``--routing=uniform`` uses the uniform-routing
expectation (labelled as such).

Tokens are compared between modes at every point both ran (a digest per point; ``--plot_only`` compares across
files too). The JSON is rewritten after every point.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import time
import traceback

import jax
import numpy as np
from absl import app, flags

import glm53
from glm53.engine import compile_seconds, slowest_calls_ms
from experiments import cli, workloads
from experiments.engine_runs import warm_up_rounds
from glm53 import memory, roofline
from glm53.memory import device_memory
from glm53.provenance import provenance
from kernels_pallas import kv_formats

FLAGS = flags.FLAGS
cli.define_config("configs/h200_bench.py", "experiment config")
flags.DEFINE_string("out", "", "results JSON (rewritten after every point); the plot goes next to it (.png)")
flags.DEFINE_list("sessions", ["1", "4", "16", "64"], "concurrent sessions per point")
flags.DEFINE_list("histories", ["8192", "50000"], "history lengths (tokens of the shared prompt)")
flags.DEFINE_list("modes", ["resident", "offload"], "cache modes")
flags.DEFINE_integer("new_tokens", 64, "timed tokens per session per point", lower_bound=2)
flags.DEFINE_integer("warmup_tokens", 0, "tokens per session of each untimed warm-up run (0: --new_tokens, the "
                     "timed run's length, so the warm-up meets every program the timed run does; at least 3: the "
                     "first steps take uncommitted inputs, later ones the previous step's outputs)", lower_bound=0)
flags.DEFINE_integer("warmup_runs", 1, "untimed runs before each point, then up to two more while a run compiled "
                     "anything (a new program makes XLA drop every program's CUDA graphs: see warm_up)",
                     lower_bound=1)
flags.DEFINE_integer("suffix", 16, "distinct tokens each session appends to the shared history", lower_bound=0)
flags.DEFINE_enum("workload", "local99", ["local99", "indexer"], "DSA selection: local99 override or the indexer's")
flags.DEFINE_enum("routing", "probe", ["probe", "uniform"],
                  "routed experts for the roofline: the model's routing (one instrumented decode per history) or the "
                  "uniform-routing expectation")
flags.DEFINE_integer("probe_tokens", 6, "--routing=probe: tokens per session of the instrumented decode (the first "
                     "may come from the stored hidden state: one step fewer)", lower_bound=1)
flags.DEFINE_integer("mtp", 0, "MTP depth (> 0: every draft accepted, forced, as in sessions_ab)",
                     lower_bound=0, upper_bound=glm53.engine.MAX_MTP_DEPTH)
flags.DEFINE_float("device_gib", 0.0, "device memory to plan for (0: the device's bytes_limit; none on a CPU)")
flags.DEFINE_float("host_gib", 0.0, "pinned host memory to plan for (0: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB or 64 GiB "
                   "on GPUs; none on a CPU)")
flags.DEFINE_float("margin_gib", 6.0, "device memory kept free for activations and programs when planning")
flags.DEFINE_integer("bandwidth_mib", 0, "array size of the HBM bandwidth benchmark (0: 1 GiB, 64 MiB on a CPU)",
                     lower_bound=0)
flags.DEFINE_list("plot_only", [], "merge these result JSONs (later files win), compare tokens, plot; no run")

GiB = 1 << 30


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------
def write(path: str, results: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, path)


def digest(tokens: list) -> str:
    return hashlib.sha256(json.dumps([list(map(int, t)) for t in tokens]).encode()).hexdigest()[:16]


def gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def png_path(out: str) -> str:
    return (out[:-5] if out.endswith(".json") else out) + ".png"


# ----------------------------------------------------------------------------------------------------------------
# Planning: which points fit
# ----------------------------------------------------------------------------------------------------------------
def pool_pages_for(cc: glm53.CacheConfig, history: int, sessions: int, extra_rows: int) -> int:
    """Host pages for one shared history and each session's own pages past it (its partial page, suffix, decode)."""
    P = cc.copyback_every
    return -(-history // P) + sessions * (-(-extra_rows // P) + 2) + 4


def extra_rows() -> int:
    """Rows a session needs past its history: the suffix, the most tokens any phase decodes, MTP drafts, spare."""
    return FLAGS.suffix + max(FLAGS.new_tokens, warmup_tokens(), FLAGS.probe_tokens) + FLAGS.mtp + 8


def warmup_tokens() -> int:
    return max(FLAGS.warmup_tokens or FLAGS.new_tokens, 3)


def plan(model, cc: glm53.CacheConfig, sessions: list, max_history: int, extra_rows: int) -> dict:
    """Bytes of an engine of S slots for every S, from the configuration; the largest S that fits is the engine's
    ``max_sessions``; the rest get a reason."""
    cfg = model.config
    capacity = glm53.cache.capacity_for(cc.max_len, cc)
    cc = memory.engine_cache_config(cfg, cc, capacity)  # offload's hot_rows as the engine cuts them
    params = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(model.params))
    row = kv_formats.get_format(cc.kv_format).bytes_per_row
    transient = capacity * row if cc.mode == "offload" else 0
    stats_limit = device_memory().get("bytes_limit")
    dev_limit = FLAGS.device_gib * GiB if FLAGS.device_gib else stats_limit
    host_limit = None
    if cc.mode == "offload":
        if FLAGS.host_gib:
            host_limit = FLAGS.host_gib * GiB
        elif jax.default_backend() == "gpu":
            host_limit = float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", 64)) * GiB
    rows = {}
    for S in sessions:
        pages = pool_pages_for(cc, max_history, S, extra_rows) if cc.mode == "offload" else 0
        slots = memory.allocated_slots(cfg, cc, S, capacity)
        alloc_pages = memory.allocated_pages(cfg, cc, pages) if cc.mode == "offload" else 0
        parts = memory.cache_bytes(cfg, cc, slots, capacity, alloc_pages, model.dtype)
        cache = sum(parts["device"].values())
        pool = sum(parts["host"].values())
        need = cache + params + transient + FLAGS.margin_gib * GiB
        why = None
        if dev_limit is not None and need > dev_limit:
            why = (f"device: cache {gib(cache)} ({S} slots x {capacity:,} rows, {cc.mode}/{cc.kv_format}) + parameters "
                   f"{gib(params)} + transient {gib(transient)} + margin {FLAGS.margin_gib:g} GiB = {gib(need)} > "
                   f"limit {gib(dev_limit)}")
        elif host_limit is not None and pool > host_limit:
            why = f"host: pinned pool {gib(pool)} > limit {gib(host_limit)} (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)"
        rows[S] = {"sessions": S, "device_cache_bytes": cache, "host_pool_bytes": pool, "pool_pages": pages,
                   "device_need_bytes": int(need), "fits": why is None, "why_not": why}
    fitting = [S for S in sessions if rows[S]["fits"]]
    return {"capacity": capacity, "params_bytes": params, "transient_bytes": transient,
            "device_limit_bytes": dev_limit, "device_bytes_limit_reported": stats_limit,
            "host_limit_bytes": host_limit, "per_sessions": rows, "max_sessions": max(fitting) if fitting else 0}


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------
def build_sessions(e: glm53.Engine, vocab: int, history: int, n: int, seed: int) -> tuple[list, dict]:
    rng = np.random.default_rng(seed + history)
    prompt = rng.integers(0, vocab, history).tolist()
    jax.block_until_ready(e.cache)
    compiled = compile_seconds()
    t = time.perf_counter()
    root = e.open(prompt, progress=True)
    jax.block_until_ready(e.cache)
    prefill_s = time.perf_counter() - t
    # the first history of a process compiles its chunk steps inside the prefill: said apart, not subtracted (the
    # compile overlaps the device's work)
    prefill_compile_s = compile_seconds() - compiled
    t = time.perf_counter()
    sids = [root] + [e.fork(root) for _ in range(n - 1)]
    jax.block_until_ready(e.cache)
    fork_s = time.perf_counter() - t
    t = time.perf_counter()
    for i, s in enumerate(sids):
        e.append(s, np.random.default_rng(1000 + i).integers(0, vocab, FLAGS.suffix).tolist())
    jax.block_until_ready(e.cache)
    rep = e.memory_report()
    return sids, {"prefill_s": prefill_s, "prefill_tokens_per_s": history / prefill_s,
                  "prefill_compile_s": prefill_compile_s, "forks_s": fork_s,
                  "suffix_appends_s": time.perf_counter() - t, "device_cache_bytes": rep["device"]["cache_bytes"],
                  "host_pool_bytes": rep["host"]["pool_bytes"], "host_used_bytes": rep["host"]["used_bytes"],
                  "device_memory": device_memory()}


def selection(K: int, history: int, seed: int, n: int):
    return _selections(K, history, n)(seed)


@functools.cache
def _selections(K: int, history: int, n: int) -> workloads.Selections:
    # One series per shape: every run of it reuses one set of device buffers (workloads.Selections says why).
    return workloads.Selections(FLAGS.workload, K, history, n)


def gen_kw(mtp: int) -> dict:
    # progress=False: a bar's terminal writes would land between the timed step calls
    return {"mtp": mtp, "accept_override": mtp if mtp else None, "progress": False}


def decode(e: glm53.Engine, sids: list, n: int, sel, mtp: int) -> dict:
    before = {s: e.stats(s) for s in sids} if e.offload else None
    out = e.generate({s: n for s in sids}, selection_override=sel, **gen_kw(mtp))
    r = e.last_run
    res = {"tokens": [out[s] for s in sids], "report": r}
    if e.offload:
        after = {s: e.stats(s) for s in sids}
        res["cache"] = {k: sum(after[s][k] - before[s][k] for s in sids) for k in ("hits", "misses", "ring_reads")}
    for s in sids:  # back to the same state for the next run
        e.rollback(s, len(out[s]))
    return res


def warm_up(e: glm53.Engine, sids: list, sel_of, mtp: int) -> dict:
    """Untimed runs of the point, each rolled back as the timed one is, by ``engine_runs.warm_up_rounds``'s rule
    (``--warmup_runs`` runs, then up to two more while a run compiled anything). Here the program that makes a second
    run necessary is the first warm-up's rollback (offload's ``truncate_slot``): with a single warm-up, one offload
    session lost 3.6-12% of its tokens/s at 8K to the timed run re-recording its ring executables' CUDA graphs, and
    resident, whose rollback has no graphs, lost nothing (cmdbuf_one_session_{offload,resident}_h100_3743e1f.json,
    throughput_8k_slow_calls_w{4,72}_h100_86e22e0.json)."""
    t = time.perf_counter()
    # each round's selection made before its count: a series' second selection compiles its own write
    compiled_s = warm_up_rounds(lambda sel: decode(e, sids, warmup_tokens(), sel, mtp), FLAGS.warmup_runs,
                                inputs=lambda k: sel_of(1 + k))
    return {"warmup_s": time.perf_counter() - t, "warmup_runs": len(compiled_s), "warmup_compile_s": compiled_s}


def routing_for(e: glm53.Engine, sids: list, K: int, history: int, mtp: int) -> dict:
    """The instrumented decode at the largest batch: the expert ids every MoE layer chose, per lane."""
    t = time.perf_counter()
    lengths = {s: len(e.tokens(s)) for s in sids}
    try:
        probe = roofline.probe_routing(e, {s: FLAGS.probe_tokens for s in sids},
                                       selection_override=selection(K, history, 10, len(sids)), **gen_kw(mtp))
    except BaseException:
        for s in sids:  # a probe that failed midway leaves its tokens: back to where the sessions were
            extra = len(e.tokens(s)) - lengths[s]
            if extra > 0:
                e.rollback(s, extra)
        raise
    probe["seconds"] = time.perf_counter() - t
    return probe


def point_roofline(model, e: glm53.Engine, S: int, history: float, res: dict, bandwidth: float, routing,
                   mtp: int) -> dict:
    r = res["report"]
    if r.steps == 0 or r.decode_s <= 0:
        return {"skipped": "no timed decode steps"}
    routed = mtp_routed = None
    source = None
    if routing is not None:
        routed, mtp_routed, source = routing["per_layer"], routing.get("mtp_draft"), routing["source"]
    miss = roofline.miss_fraction_of(res.get("cache"))
    b = roofline.decode_bytes(model.config, e.cache_config, history, S, routed, model.dtype, mtp=mtp,
                              mtp_routed_experts=mtp_routed, routed_source=source, miss_fraction=miss,
                              expert_weights=getattr(model, "expert_weights", "model"), capacity=e.capacity)
    rep = roofline.roofline_report(b, bandwidth, r.decode_s / r.steps, r.decode_tokens / r.steps)
    tokens = b["tokens_per_step"]
    rep["bytes_per_token_by_group"] = {
        "weights_amortised": b["weights"] / tokens, "kv_rows": b["parts"]["kv_rows"] / tokens,
        "indexer_keys": b["parts"]["indexer_keys"] / tokens,
        "other_cache": (b["cache"] - b["parts"]["kv_rows"] - b["parts"]["indexer_keys"]) / tokens,
        "host": b["host_total"] / tokens}
    return {**rep, "bytes": b}


def run_mode(model, mode: str, sessions: list, histories: list, results: dict, bandwidth: float,
             probes: dict) -> None:
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cfg = model.config
    mtp = FLAGS.mtp
    extra = extra_rows()
    cc = glm53.CacheConfig.from_config_dict(c.cache).replace(mode=mode, max_len=max(histories) + extra)
    p = plan(model, cc, sessions, max(histories), extra)
    results["plans"][mode] = p
    S_max = p["max_sessions"]
    for S in sessions:
        if not p["per_sessions"][S]["fits"]:
            for H in histories:
                results["skipped"].append({"mode": mode, "history": H, "sessions": S,
                                           "why": p["per_sessions"][S]["why_not"]})
            print(f"[{mode}] skip {S} sessions: {p['per_sessions'][S]['why_not']}", flush=True)
    write(FLAGS.out, results)
    if not S_max:
        return
    host_budget = p["per_sessions"][S_max]["pool_pages"] * glm53.offload.page_bytes(cfg, cc) if mode == "offload" \
        else None
    e = glm53.Engine(model, cc, max_sessions=S_max, host_budget_bytes=host_budget)
    K = e.topk
    rep = e.memory_report()
    print(f"[{mode}] engine: {S_max} sessions x {e.capacity:,} rows, device cache "
          f"{gib(rep['device']['cache_bytes'])}, host pool {gib(rep['host']['pool_bytes'])}", flush=True)
    try:
        for H in histories:
            if FLAGS.workload == "local99" and H < K:
                raise app.UsageError(f"--histories: {H} < top-k {K}: local99 needs a history of at least K positions")
            sids, build = build_sessions(e, cfg.vocab_size, H, S_max, c.run.seed)
            results["builds"].setdefault(mode, {})[str(H)] = build
            print(f"[{mode} {H}] prefill {build['prefill_s']:.2f} s ({build['prefill_tokens_per_s']:,.0f} tok/s, "
                  f"{build['prefill_compile_s']:.1f} s of it compiling), "
                  f"{S_max - 1} forks {build['forks_s']:.2f} s, suffixes {build['suffix_appends_s']:.2f} s", flush=True)
            routing_probe = None
            if FLAGS.routing == "probe":
                routing_probe = probes.get(H)
                if routing_probe is None or routing_probe.get("bucket", 0) < max(s for s in sessions if s <= S_max):
                    try:
                        routing_probe = probes[H] = routing_for(e, sids, K, H, mtp)
                        print(f"[{mode} {H}] routing probe: {routing_probe['steps']} steps of {S_max} lanes in "
                              f"{routing_probe['seconds']:.1f} s", flush=True)
                    except Exception as err:  # noqa: BLE001 - the roofline falls back to the uniform expectation
                        routing_probe = probes[H] = {"error": f"{type(err).__name__}: {err}"}
                        print(f"[{mode} {H}] routing probe failed ({routing_probe['error']}): uniform routing",
                              flush=True)
                        traceback.print_exc()
            for S in sessions:
                if S > S_max:
                    continue
                sub = sids[:S]
                warm = warm_up(e, sub, lambda seed: selection(K, H, seed, S), mtp)
                res = decode(e, sub, FLAGS.new_tokens, selection(K, H, 10, S), mtp)
                r = res["report"]
                routing = None
                if routing_probe is not None and "error" not in routing_probe:
                    routing = roofline.distinct_experts(routing_probe, cfg, lanes=S)
                mean_history = H + FLAGS.suffix + r.decode_tokens / S / 2
                point = {
                    "mode": mode, "history": H, "sessions": S, "bucket": r.bucket, "mtp": mtp,
                    "tokens_per_s": r.decode_tokens_per_s, "tokens_per_s_per_session": r.decode_tokens_per_s / S,
                    "step_ms": 1e3 * r.decode_s / max(r.steps, 1), "steps": r.steps,
                    "decode_tokens": r.decode_tokens, "decode_s": r.decode_s, "compile_s": r.compile_s,
                    **warm, "mean_history": mean_history,
                    # whether the host or the device set the pace: a median wait near zero means the host's loop
                    # (its calls, the working set's update) took as long as the device's step
                    "host": {"loop_s": r.host_loop_s, "step_call_ms": r.step_call_ms, "step_wait_ms": r.step_wait_ms,
                             "step_interval_ms": r.step_interval_ms,
                             # which calls were slow: (ms, step number), beside the steps that ran the copyback
                             "slowest_step_calls_ms": slowest_calls_ms(r.step_call_s, 6),
                             "copy_steps": list(r.copy_steps), "copyback_steps": list(r.copyback_steps)},
                    "tokens_sha256": digest(res["tokens"]),
                    "first_session_tokens": res["tokens"][0][:16],
                    "routing": routing or {"source": "uniform-routing expectation" + (
                        f" (probe failed: {routing_probe['error']})" if routing_probe else "")},
                    "device_memory": device_memory()}
                if e.offload:
                    cs = res["cache"]
                    n = cs["hits"] + cs["misses"]
                    point["cache"] = {**cs, "hit_rate": cs["hits"] / n if n else None,
                                      "miss_fraction": roofline.miss_fraction_of(cs)}
                point["roofline"] = point_roofline(model, e, S, mean_history, res, bandwidth, routing, mtp)
                other = next((q for q in results["points"] if q["history"] == H and q["sessions"] == S
                              and q["mode"] != mode and q["mtp"] == mtp), None)
                if other is not None:
                    point["tokens_identical_to"] = {other["mode"]: other["tokens_sha256"] == point["tokens_sha256"]}
                results["points"].append(point)
                write(FLAGS.out, results)
                rf = point["roofline"]
                print(f"[{mode} {H} x{S}] {point['tokens_per_s']:,.1f} tok/s ({point['tokens_per_s_per_session']:,.1f} "
                      f"per session, {point['step_ms']:.2f} ms/step); roofline {rf.get('ideal_tokens_per_s', 0):,.0f} "
                      f"tok/s ({100 * rf.get('fraction_of_roofline', 0):.1f}%), "
                      f"{rf.get('bytes_per_step', 0) / 1e9:.2f} GB/step"
                      + (f"; hits {point['cache']['hit_rate']:.4f}" if e.offload and point["cache"]["hit_rate"]
                         is not None else "")
                      + (f"; host waited {r.step_wait_ms['p50']:.2f} ms a step (median)" if r.step_wait_ms else "")
                      + (f"; tokens identical to {other['mode']}: {point['tokens_identical_to'][other['mode']]}"
                         if other is not None else ""), flush=True)
            for s in sids:
                e.close(s)
    except app.UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - keep what was measured, note where it stopped
        results.setdefault("errors", []).append({"mode": mode, "error": f"{type(err).__name__}: {err}",
                                                 "traceback": traceback.format_exc()[-4000:]})
        write(FLAGS.out, results)
        print(f"[{mode}] stopped: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc()
    finally:
        del e
        gc.collect()


# ----------------------------------------------------------------------------------------------------------------
# Comparison and plot
# ----------------------------------------------------------------------------------------------------------------
def compare(points: list) -> dict:
    """Per (history, sessions, mtp) run in both modes: are the tokens the same?"""
    by = {}
    for q in points:
        by.setdefault((q["history"], q["sessions"], q.get("mtp", 0)), {})[q["mode"]] = q["tokens_sha256"]
    rows = [{"history": h, "sessions": s, "mtp": m, "tokens_identical": len(set(v.values())) == 1}
            for (h, s, m), v in sorted(by.items()) if len(v) > 1]
    return {"points_compared": len(rows), "all_identical": all(r["tokens_identical"] for r in rows) if rows else None,
            "rows": rows}


def plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no plot: {err}"
    series = {}
    for q in results["points"]:
        series.setdefault((q["history"], q["mode"]), []).append(q)
    if not series:
        return "no plot: no points"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs = sorted({q["sessions"] for q in results["points"]})
    for i, ((H, mode), qs) in enumerate(sorted(series.items())):
        qs = sorted(qs, key=lambda q: q["sessions"])
        col = colors[i % len(colors)]
        x = [q["sessions"] for q in qs]
        ax.plot(x, [q["tokens_per_s"] for q in qs], "o-", color=col, label=f"{H:,} history, {mode}")
        roof = [q["roofline"].get("ideal_tokens_per_s") for q in qs]
        if all(v is not None for v in roof):
            ax.plot(x, roof, "--", color=col, alpha=0.8, label=f"{H:,} {mode} roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("concurrent sessions (lanes of one decode step)")
    ax.set_ylabel("aggregate decode tokens/s")
    bw = results.get("bandwidth", {}).get("bandwidth_Bps")
    model = results.get("model", {})
    title = "decode throughput vs sessions"
    if model:
        title += f" ({cli.params_text(model.get('params', 0))} params, {results.get('device_kind', '')})"
    if bw:
        title += f"\nroofline (dashed): bytes per step at {bw / 1e9:,.0f} GB/s measured HBM bandwidth"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def merge_only() -> None:
    merged = None
    for path in FLAGS.plot_only:
        with open(path) as f:
            r = json.load(f)
        if merged is None:
            merged = {**r, "points": [], "skipped": [], "merged_from": []}
        merged["merged_from"].append(path)
        keep = {(q["mode"], q["history"], q["sessions"], q.get("mtp", 0)) for q in r["points"]}
        merged["points"] = [q for q in merged["points"]
                            if (q["mode"], q["history"], q["sessions"], q.get("mtp", 0)) not in keep] + r["points"]
        merged["skipped"] += r.get("skipped", [])
        for k in ("plans", "builds"):
            merged.setdefault(k, {}).update(r.get(k, {}))
    merged["comparison"] = compare(merged["points"])
    out = FLAGS.out or FLAGS.plot_only[-1].replace(".json", "_merged.json")
    merged["plot"] = plot(merged, png_path(out))
    write(out, merged)
    print(f"merged {len(merged['points'])} points: {merged['comparison']}; plot {merged['plot']}; wrote {out}")


def main(_):
    if FLAGS.plot_only:
        merge_only()
        return
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "run.seed") + cli.cache_fields_but(c, "mode", "max_len"),
        "experiments.throughput reads config.model, seed, dtype, run.seed and cache but its mode (--modes) and "
        "max_len (from --histories); sessions come from --sessions, tokens from --new_tokens, MTP from --mtp, the "
        "output from --out, and it runs on one device")
    sessions = sorted(set(cli.token_counts("sessions", FLAGS.sessions, "session counts")))
    histories = sorted(set(cli.token_counts("histories", FLAGS.histories)))
    modes = list(FLAGS.modes)
    cli.check_modes(c, modes, "modes")  # counts: token_counts above and the flags' bounds
    if FLAGS.routing == "probe":
        try:  # before any run: a probe that cannot run would leave every roofline on the uniform expectation
            roofline.check_routing_probe_runs()
        except RuntimeError as err:
            raise app.UsageError(f"--routing=probe: {err}; or pass --routing=uniform") from err
    extra = extra_rows()
    positions = cli.model_config(c).max_position_embeddings
    if max(histories) + extra > positions:  # before the model: the engine refused it with a traceback after it
        raise app.UsageError(
            f"--histories={','.join(FLAGS.histories)}: a session of the longest needs {max(histories) + extra:,} "
            f"positions (with the suffix, tokens and MTP drafts) but the model has max_position_embeddings="
            f"{positions:,}: pass histories up to {positions - extra:,}")
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    t = time.perf_counter()
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    jax.block_until_ready(model.params)
    print(model, flush=True)
    results = {"config": c.to_dict(), **provenance(),
               "flags": {k: getattr(FLAGS, k) for k in ("sessions", "histories", "modes", "new_tokens",
                                                          "warmup_tokens", "warmup_runs", "suffix", "workload",
                                                          "routing", "probe_tokens", "mtp", "margin_gib")},
               "model": {"params": model.num_params(), "build_s": time.perf_counter() - t,
                         "params_bytes": sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(model.params)),
                         "expert_weights": getattr(model, "expert_weights", "model")},
               "histories_note": "one prefill per history; the other sessions are forks of it (offload: the "
                                 "history's host pages shared copy-on-write; resident: rows copied on the device) "
                                 f"plus a distinct {FLAGS.suffix}-token suffix each. Shared pages are fine for "
                                 "throughput: every session scores, gathers and fills its own rows",
               "plans": {}, "builds": {}, "points": [], "skipped": []}
    probe_bytes = FLAGS.bandwidth_mib << 20 if FLAGS.bandwidth_mib else None
    bw = roofline.measure_hbm_bandwidth(probe_bytes)
    results["bandwidth"] = bw
    print(f"HBM bandwidth: copy {bw['copy_GBps']:,.0f} GB/s, read {bw['read_GBps']:,.0f} GB/s "
          f"({bw['array_bytes'] / GiB:.2f} GiB x {bw['passes']} passes)", flush=True)
    write(FLAGS.out, results)
    probes: dict = {}
    for mode in modes:
        run_mode(model, mode, sessions, histories, results, bw["bandwidth_Bps"], probes)
    # A second probe after the points: every point's roofline against the better of the two (one probe scatters
    # ~6% between runs: roofline.best_bandwidth).
    bw = results["bandwidth"] = roofline.best_bandwidth(bw, roofline.measure_hbm_bandwidth(probe_bytes))
    print(f"HBM bandwidth probes {', '.join(f'{g:,.0f}' for g in bw['probes_GBps'])} GB/s: the rooflines take "
          f"{bw['bandwidth_Bps'] / 1e9:,.0f}", flush=True)
    for q in results["points"]:
        r = q.get("roofline", {})
        if "bytes" in r:
            r.update(roofline.roofline_report(r["bytes"], bw["bandwidth_Bps"], r["achieved_step_ms"] / 1e3,
                                              r["tokens_per_step"]))
    results["comparison"] = compare(results["points"])
    if FLAGS.out:
        results["plot"] = plot(results, png_path(FLAGS.out))
    write(FLAGS.out, results)
    print(f"tokens resident vs offload: {results['comparison']}", flush=True)
    if FLAGS.out:
        print(f"wrote {FLAGS.out} and {results.get('plot')}", flush=True)


if __name__ == "__main__":
    cli.run(main)

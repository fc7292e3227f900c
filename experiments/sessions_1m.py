"""N sessions of a million-token history decoding together in offload mode: capacity, prefill, TTFT and decode.

    python -m experiments.sessions_1m --config=configs/h200_1m.py --sessions=8 --out=$OUT/sessions_1m.json
    python -m experiments.sessions_1m --config=configs/h200_1m.py --sessions=1 --ab --pairs=2 --out=$OUT/ab_1m.json

**Capacity run** (default). One engine of ``--sessions`` slots (cache ``max_len`` = history + suffix + new tokens +
MTP depth; the host pool every slot's capacity in pages). The checks come first: the history must fit the
model's ``max_position_embeddings``, the pool (plus ``--host_margin_gib``) the host's available RAM, the cache plus
parameters the device's memory limit; each fails at once with what to change. Then:

1. warm-up: a one-chunk session compiles the chunk step (and, offload, the settle calls the prefill will make) and
   samples one token, then closes;
2. one session's history of ``config.run.prompt_len`` tokens is prefilled for real, in pieces of
   ``--prefill_piece`` tokens (the first opens the session, the rest are appends of whole chunks: the same chunk
   steps as one open), each timed until the cache is ready: tokens/s per piece (the JSON is rewritten after every
   piece, so a run cut short still has the prefill speed against the history); then the time to first token
   (prefill + sampling the first token, which is rolled back);
3. ``--sessions - 1`` forks with ``fork(share_pages=False)``: every fork's host pages are a *real copy* of the
   history (shared pages would not measure capacity); each session then appends its own ``--suffix`` random tokens,
   so the sessions decode different tokens;
4. all sessions decode ``config.run.max_new_tokens`` tokens together (an untimed ``--check_tokens`` generate first
   compiles the decode step), with the ``local99`` selection override (``experiments.workloads``: each session keeps
   its K history positions but 1% per step) or the model's own indexer (``--workload=model``).

Reported: host RAM allocated (``Engine.memory_report()``: the pool, used pages; the process RSS and peak RSS; the
host's available RAM before and after), device memory (cache, parameters, peak from ``memory_stats()``), prefill
tokens/s, TTFT, aggregate and per-session decode tokens/s, hit rates (``Engine.stats``: hits / misses per session),
bytes per second read from host memory during decode (zero-copy misses) and prefill (bulk reads).

**A/B run** (``--ab``): the decode of offload against resident at the same history. The offload engine prefills
once (timed as above) and saves the session (``Engine.save``, to ``--save_history`` or a temporary directory
removed after); a resident engine restores it (``--load_history``: both engines restore a saved history instead of
the prefill); both then fork and append the same suffixes and decode in interleaved pairs (resident first, then
offload first, ...; like ``experiments.sessions_ab``), rolling back after each run. An untimed ``--check_tokens`` run
per mode compares tokens and logits bit for bit; every pair compares tokens.

**Several devices** (``--config.mesh.stages=S --config.mesh.tp=T``, e.g. 8 stages on 8 H200s): the model and its
cache spread as in ``glm53.pipeline`` / ``glm53.sharding``; the plan (``glm53.memory.plan``) counts the device
holding the most and every device's host pool on this host (``host_pool_bytes``; ``host_pool_bytes_per_device`` is
one device's, what ``Engine.memory_report`` gives), and device memory is reported for the fullest device and each.

**Split runs** for a device-time limit per call: ``--prefill_only --save_history=DIR`` prefills (timed, TTFT) and
saves; later calls in the same machine pass ``--load_history=DIR`` (same config: the model, its seed and
``config.run.prompt_len`` size and check the restore) and restore the history in seconds instead of prefilling it.
"""

import json
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback

import jax
import numpy as np
from absl import flags
from tqdm.auto import tqdm

import glm53
from experiments import cli, workloads
from experiments.engine_runs import per_session_tokens_per_s
from glm53 import memory
from glm53.memory import device_memory
from glm53.engine import compile_seconds
from glm53.params import resolve_dtype
from glm53.provenance import provenance
from kernels_pallas import kv_formats

FLAGS = flags.FLAGS
cli.define_config("configs/h200_1m.py", "experiment config")
flags.DEFINE_string("out", "", "results JSON (rewritten at every milestone: a run cut short keeps what it measured)")
flags.DEFINE_integer("sessions", 8, "sessions of the history decoding together")
flags.DEFINE_enum("workload", "local99", ["local99", "model"],
                  "DSA selection in decode: local99's override (experiments.workloads) or the model's own indexer")
flags.DEFINE_integer("suffix", 16, "tokens each session appends to the shared history so the sessions diverge",
                     lower_bound=0)
flags.DEFINE_integer("prefill_piece", 16384, "tokens per timed prefill piece (rounded down to whole chunks)",
                     lower_bound=1)
flags.DEFINE_float("host_margin_gib", 8.0, "host RAM to leave free beyond the pool (and, --ab, the save's copies)")
flags.DEFINE_bool("ab", False, "decode A/B: offload vs resident at the same history (save / restore)")
flags.DEFINE_integer("pairs", 2, "--ab: interleaved resident/offload pairs", lower_bound=1)
flags.DEFINE_integer("check_tokens", 8, "tokens of the untimed decode warm-up (--ab: also the logits check)",
                     lower_bound=1)
flags.DEFINE_string("save_history", "", "save the prefilled session here (Engine.save), for later --load_history runs")
flags.DEFINE_string("load_history", "", "restore the history from this save instead of prefilling it (same config: "
                    "model, seed, kv_format and config.run.prompt_len)")
flags.DEFINE_bool("prefill_only", False, "stop after the prefill, the time to first token and --save_history")

GiB = 1 << 30


class CapacityError(RuntimeError):
    """The run cannot fit (positions, host RAM, device memory, disk): raised before anything big is allocated."""


# ----------------------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------------------
def host_memory() -> dict:
    """The host's total / available RAM and this process's RSS (psutil where installed, else /proc)."""
    out = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux reports KiB
    try:
        import psutil
        vm, mi = psutil.virtual_memory(), psutil.Process().memory_info()
        out.update(total=int(vm.total), available=int(vm.available), rss=int(mi.rss), vms=int(mi.vms),
                   source="psutil")
    except ImportError:
        def read(path, keys):
            vals = {}
            with open(path) as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in keys:
                        vals[k] = int(v.split()[0]) * 1024
            return vals
        m = read("/proc/meminfo", ("MemTotal", "MemAvailable"))
        s = read("/proc/self/status", ("VmRSS", "VmSize"))
        out.update(total=m.get("MemTotal"), available=m.get("MemAvailable"), rss=s.get("VmRSS"),
                   vms=s.get("VmSize"), source="/proc")
    return out


def gib(x) -> str:
    return "?" if x is None else f"{x / GiB:.2f} GiB"


class Recorder:
    """The results dict, written atomically to ``path`` whenever ``save`` is called."""

    def __init__(self, path: str, results: dict):
        self.path, self.results = path, results

    def save(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=2, default=str)
        os.replace(tmp, self.path)


# ----------------------------------------------------------------------------------------------------------------
# Sizing: everything checked before the engines allocate
# ----------------------------------------------------------------------------------------------------------------
def plan(cfg: glm53.ModelConfig, dtype, c, n_sessions: int, ab: bool) -> dict:
    """Sizes of the run from the configs alone (before the model or any cache exists), checked against the host's
    available RAM, the device's memory limit and the disk; ``CapacityError`` says what to change."""
    P, new, mtp = c.run.prompt_len, c.run.max_new_tokens, c.run.mtp
    # positions a session can hold: history, its suffix, the larger decode (+ the drafts of the last MTP step), and
    # the TTFT token (rolled back before the suffix)
    rows = P + FLAGS.suffix + max(new, FLAGS.check_tokens) + mtp + 1
    if rows > cfg.max_position_embeddings:
        raise CapacityError(
            f"a session needs {rows:,} positions (history {P:,} + suffix {FLAGS.suffix} + new tokens + MTP) but the "
            f"model has max_position_embeddings={cfg.max_position_embeddings:,}: use --config=configs/h200_1m.py or "
            f"--config.model.max_position_embeddings={rows:,} (it only bounds the positions)")
    cc = glm53.CacheConfig.from_config_dict(c.cache).replace(mode="offload", max_len=rows)
    glm53.offload.validate(cfg, cc)
    capacity = glm53.cache.capacity_for(rows, cc)
    page_rows = cc.copyback_every
    pages_per_session = capacity // page_rows  # the engine's default pool: every slot's capacity (<= 1 page more)
    pool_pages = n_sessions * pages_per_session
    page_bytes = glm53.offload.page_bytes(cfg, cc)
    # The engine's allocation on this run's mesh (glm53.memory.plan, what Engine.memory_report gives): the device
    # holding the most (with pipeline stages, its stage's weights and cache), and every device's host pool, all on
    # this one host. The copies below (a save's rows, a fork's pages) are the whole model's: an upper bound on a stage.
    mc = glm53.MeshConfig.from_config_dict(c.get("mesh") or {})
    planned = memory.plan(cfg, cc, sessions=n_sessions, history=rows, dtype=dtype,
                          mesh_shape={"stage": mc.stages, "tp": mc.tp},
                          output_ring=glm53.engine.output_ring_for(jax.default_backend(), mc.stages * mc.tp))
    alloc_slots = n_sessions
    alloc_pages = memory.allocated_pages(cfg, cc, pool_pages)
    pool = planned["per_host"]["total"]
    params = planned["per_device"]["params"]
    row_bytes = kv_formats.get_format(cc.kv_format).bytes_per_row
    session_bytes = pages_per_session * page_bytes  # one history in the pool
    keys_bytes = len(cfg.full_indexer_layers) * capacity * cfg.index_head_dim * np.dtype(dtype).itemsize
    device_cache = planned["per_device"]["cache"]
    transient = planned["per_device"]["transient"]  # one layer's bulk read (Engine.transient_bytes)
    fork_buffer = session_bytes if n_sessions > 1 else 0  # fork(share_pages=False) reads the pages to the device
    out = {"rows_per_session": rows, "capacity": capacity, "page_rows": page_rows, "page_bytes": page_bytes,
           "pages_per_session": pages_per_session, "pool_pages": pool_pages, "allocated_pages": alloc_pages,
           "allocated_slots": alloc_slots, "host_pool_bytes": pool, "host_budget_bytes": pool_pages * page_bytes,
           "history_bytes_per_session": session_bytes, "device_cache_bytes": device_cache,
           "device_cache_bytes_per_slot": device_cache // alloc_slots, "params_bytes": params,
           "transient_bytes": transient, "fork_buffer_bytes": fork_buffer,
           "mesh": planned["mesh"], "devices": planned["devices"],
           "host_pool_bytes_per_device": planned["per_host"]["pool"]}  # one device's pool (memory_report's)
    host_need = pool + FLAGS.host_margin_gib * GiB
    device_need = planned["per_device"]["total"] + fork_buffer  # the fullest device's (stage's) own total
    save = P * cfg.num_cache_layers * row_bytes + keys_bytes  # a saved history (rows + indexer keys)
    out["save_bytes"] = save
    copies = bool(ab or FLAGS.load_history or FLAGS.save_history)
    if copies:
        # a save fetches the rows to the host; a restore holds the read arrays and their padded copies (one
        # restore at a time), and puts the padded rows on the device before writing them into the cache
        host_need += 3 * save
        device_need += save
    if ab:
        out["resident_device_cache_bytes"] = memory.plan(cfg, cc.replace(mode="resident"), sessions=n_sessions,
                                                         history=rows, dtype=dtype,
                                                         mesh_shape=planned["mesh"])["per_device"]["cache"]
        device_need += out["resident_device_cache_bytes"]
    host = host_memory()
    out["host_need_bytes"], out["device_need_bytes"] = int(host_need), int(device_need)
    if host.get("available") is not None and host_need > host["available"]:
        fit = int((host["available"] - FLAGS.host_margin_gib * GiB - (3 * save if copies else 0))
                  // max(pool // n_sessions, 1))  # a session's share of every device's pool on this host
        raise CapacityError(
            f"host RAM: {n_sessions} sessions of {rows:,} rows need a {gib(pool)} pinned pool"
            + (f" + {gib(3 * save)} for the save / restore copies" if copies else "")
            + f" + {FLAGS.host_margin_gib:g} GiB margin = {gib(host_need)}, but {gib(host['available'])} of "
            f"{gib(host['total'])} is available: at most {max(fit, 0)} sessions fit (--sessions), or lower "
            "--host_margin_gib / config.run.prompt_len")
    limit = device_memory().get("bytes_limit")
    if limit is not None and device_need > limit:
        raise CapacityError(
            f"device memory: cache {gib(device_cache)} ({n_sessions} slots x {capacity:,} rows) + parameters "
            f"{gib(params)} + transient {gib(transient + fork_buffer)}"
            + (f" + resident engine {gib(out['resident_device_cache_bytes'])}" if ab else "")
            + (f" + a restore's rows {gib(save)}" if copies else "")
            + f" = {gib(device_need)} > the limit {gib(limit)}: lower --sessions or config.cache.hot_rows")
    if FLAGS.load_history and not os.path.isdir(FLAGS.load_history):
        raise CapacityError(f"--load_history={FLAGS.load_history}: no such directory (write one with --save_history)")
    if (ab or FLAGS.save_history) and not FLAGS.load_history:
        parent = os.path.dirname(os.path.abspath(FLAGS.save_history)) if FLAGS.save_history else tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        free = shutil.disk_usage(parent).free
        if free < 1.2 * save:
            raise CapacityError(f"disk: the save needs ~{gib(save)} but {parent} has {gib(free)} free "
                                "(--save_history)")
    return {"cache_config": cc, "sizes": out}


# ----------------------------------------------------------------------------------------------------------------
# Steps of the run
# ----------------------------------------------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pieces(n: int, chunk: int, piece: int) -> list:
    """(start, end) of the prefill pieces: whole chunks each, the last one holding the remainder, so every chunk
    step has the chunk shape of one open of the whole history."""
    C = min(chunk, _next_pow2(n))
    piece = max(C, piece // C * C)
    out = [[a, min(a + piece, n)] for a in range(0, n, piece)]
    if len(out) > 1 and out[-1][1] - out[-1][0] < C:
        last = out.pop()
        out[-1][1] = last[1]
    return [tuple(p) for p in out]


def settle_pages(ends: list, page_rows: int, lag: int) -> list:
    """The ``pages`` of the settle call that ends each prefill piece (as ``Engine._settle`` computes it)."""
    host, out = 0, set()
    for end in ends:
        committed = end - lag
        if committed // page_rows * page_rows > host:
            out.add(_next_pow2(-(-(committed - host) // page_rows)))
            host = committed // page_rows * page_rows
    return sorted(out)


def warm_up(e: glm53.Engine, ids: list, ends: list) -> dict:
    """Compile what the prefill runs on a one-chunk session (same chunk shape), the settle calls that end its
    pieces (offload; nothing is due, so they write nothing), and sampling the first token; the session is closed."""
    t, c0 = time.perf_counter(), compile_seconds()
    out = {}
    sid = e.open(ids[: min(len(ids), e.chunk)])
    if e.offload:
        try:  # engine internals: best effort (a settle compiled during the prefill shows in its compile_s)
            lanes, _ = e._lanes([e._session(sid).slot])
            for pages in settle_pages(ends, e.page_rows, 1 if e.cfg.num_nextn_predict_layers else 0):
                e._run("settle", e.cache, lanes, pages=pages, kernels=e.kernels)
        except Exception as err:  # noqa: BLE001
            out["settle_warmup_error"] = f"{type(err).__name__}: {err}"
    e.generate({sid: 1})
    jax.block_until_ready(e.cache)
    e.close(sid)
    return {"s": time.perf_counter() - t, "compile_s": compile_seconds() - c0, **out}


def prefill(e: glm53.Engine, ids: list, rec: Recorder, key: str) -> int:
    """Open a session on ``ids`` in timed pieces; ``rec.results[key]`` is updated (and saved) after each piece."""
    P = len(ids)
    C = min(e.chunk, _next_pow2(P))
    parts = pieces(P, e.chunk, FLAGS.prefill_piece)
    r = rec.results[key] = {"tokens": P, "chunk": C, "pieces_planned": len(parts), "pieces": [], "done_tokens": 0,
                            "method": "first piece opens the session, the others are appends of whole chunks; "
                                      "the cache is waited for after each piece"}
    bar = tqdm(total=-(-P // C), desc=f"prefill {P:,} tokens", unit="chunk", mininterval=2.0)
    c0, t0 = compile_seconds(), time.perf_counter()
    sid = None
    for a, b in parts:
        t = time.perf_counter()
        if sid is None:
            sid = e.open(ids[a:b])
        else:
            e.append(sid, ids[a:b])
        jax.block_until_ready(e.cache)
        dt = time.perf_counter() - t
        bar.update(-(-(b - a) // C))
        r["pieces"].append({"start": a, "end": b, "s": dt, "tokens_per_s": (b - a) / dt})
        r["done_tokens"] = b
        r["elapsed_s"] = time.perf_counter() - t0
        rec.save()
        tqdm.write(f"  prefill {b:>9,} / {P:,} tokens: piece {(b - a) / dt:,.0f} tok/s, overall "
                   f"{b / r['elapsed_s']:,.0f} tok/s, {r['elapsed_s']:.1f} s", file=sys.stdout)
        sys.stdout.flush()
    bar.close()
    r["prefill_s"] = time.perf_counter() - t0
    r["tokens_per_s"] = P / r["prefill_s"]
    r["compile_s_during_prefill"] = compile_seconds() - c0
    if e.offload:
        st = e.stats(sid)
        r["bulk_bytes_from_host"] = st["bulk_bytes_from_host"]
        r["bulk_bytes_from_host_per_s"] = st["bulk_bytes_from_host"] / r["prefill_s"]
        r["bytes_to_host"] = st["bytes_to_host"]
    # Time to first token: the prefill plus sampling the first token (then rolled back: the history stays P tokens)
    t = time.perf_counter()
    e.generate({sid: 1})
    r["first_token_s"] = time.perf_counter() - t
    r["first_token_compile_s"] = e.last_run.compile_s
    r["time_to_first_token_s"] = r["prefill_s"] + r["first_token_s"]
    e.rollback(sid, 1)
    rec.save()
    print(f"[{e.cache_config.mode}] prefill {P:,} tokens in {r['prefill_s']:.1f} s = {r['tokens_per_s']:,.0f} tok/s "
          f"(compile during it {r['compile_s_during_prefill']:.2f} s); time to first token "
          f"{r['time_to_first_token_s']:.1f} s", flush=True)
    return sid


def fork_and_diverge(e: glm53.Engine, root: int, n: int, rec_entry: dict) -> list:
    """``n - 1`` forks of ``root`` with their own host pages, then a distinct suffix for every session."""
    forks = []
    sids = [root]
    for _ in tqdm(range(n - 1), desc="forks (own pages)", unit="fork", disable=n < 2):
        t = time.perf_counter()
        sids.append(e.fork(root, share_pages=False))
        jax.block_until_ready(e.cache)
        forks.append(time.perf_counter() - t)
    rec_entry["fork_s"] = forks
    t = time.perf_counter()
    vocab = e.cfg.vocab_size
    for i, s in enumerate(sids if FLAGS.suffix > 0 else []):
        e.append(s, np.random.default_rng(1000 + i).integers(0, vocab, FLAGS.suffix).tolist())
    jax.block_until_ready(e.cache)
    rec_entry["suffix_append_s"] = time.perf_counter() - t
    kind = "with their own host pages" if e.offload else "(slot copies)"
    print(f"[{e.cache_config.mode}] {n - 1} forks {kind} ({sum(forks):.1f} s), {FLAGS.suffix}-token "
          f"suffixes ({rec_entry['suffix_append_s']:.1f} s)", flush=True)
    return sids


def memory_snapshot(e: glm53.Engine) -> dict:
    rep = e.memory_report()
    return {"engine": rep, "host": host_memory(), "device": device_memory()}


def run(e: glm53.Engine, sids: list, n: int, c, selection, *, logits: bool = False, rollback: bool = True,
        timed: bool = False) -> dict:
    """Generate ``n`` tokens for every session together; counters before/after; roll back if asked. ``timed``: no
    progress bar (its terminal writes would land between the timed step calls); untimed runs show theirs."""
    mtp = int(c.run.mtp)
    accept = None if c.run.accept_override < 0 or not mtp else int(c.run.accept_override)
    before = {s: e.stats(s) for s in sids}
    out = e.generate({s: n for s in sids}, mtp=mtp, accept_override=accept, selection_override=selection,
                     return_logits=logits, progress=not timed)
    r = e.last_run
    res = {"tokens": [out[s] for s in sids], "report": r}
    if e.offload:
        after = {s: e.stats(s) for s in sids}
        d = {k: [after[s][k] - before[s][k] for s in sids] for k in
             ("hits", "misses", "ring_reads", "fills", "evictions", "bytes_from_host", "bulk_bytes_from_host",
              "copybacks", "bytes_to_host")}
        res["hit_rate_per_session"] = [h / (h + m) if h + m else None for h, m in zip(d["hits"], d["misses"])]
        h, m = sum(d["hits"]), sum(d["misses"])
        res["hit_rate"] = h / (h + m) if h + m else None
        res["counters"] = {k: sum(v) for k, v in d.items()}
        res["per_layer_hit_rate"] = []
        for l in range(len(after[sids[0]]["per_layer"]["hits"])):
            hl = sum(after[s]["per_layer"]["hits"][l] - before[s]["per_layer"]["hits"][l] for s in sids)
            ml = sum(after[s]["per_layer"]["misses"][l] - before[s]["per_layer"]["misses"][l] for s in sids)
            res["per_layer_hit_rate"].append(hl / (hl + ml) if hl + ml else None)  # None: the layer looked nothing up
    if rollback:
        for s in sids:
            e.rollback(s, len(out[s]))
    return res


def figures(res: dict, n_sessions: int) -> dict:
    r = res["report"]
    pct = r.step_call_ms
    out = {
        # the tokens the decode loop emitted, over its time (a first token sampled before the loop is not in it)
        "aggregate_tokens_per_s": r.decode_tokens / r.decode_s if r.decode_s > 0 else None,
        "per_session_tokens_per_s": per_session_tokens_per_s(r, res["tokens"]),
        "tokens_total": sum(len(t) for t in res["tokens"]), "decode_s": r.decode_s, "first_token_s": r.first_token_s,
        "steps": r.steps, "ms_per_step": 1e3 * r.decode_s / max(r.steps, 1), "bucket": r.bucket, "mtp": r.mtp,
        "mtp_proposed": r.mtp_proposed, "mtp_accepted": r.mtp_accepted, "mtp_committed": r.mtp_committed,
        "acceptance_real": r.acceptance, "step_call_ms": pct,
        "step_call_p99_over_median": pct["p99"] / pct["p50"] if pct else None, "host_loop_s": r.host_loop_s,
        "step_interval_ms": r.step_interval_ms,
        "copyback_steps": r.copyback_steps, "compile_s": r.compile_s, "hit_rate": res.get("hit_rate"),
        "hit_rate_per_session": res.get("hit_rate_per_session"), "per_layer_hit_rate": res.get("per_layer_hit_rate"),
        "counters": res.get("counters"),
    }
    if res.get("counters") and r.decode_s > 0:
        # zero-copy misses read from host memory (the first token's step included: a small overcount)
        out["bytes_from_host_per_s"] = res["counters"]["bytes_from_host"] / r.decode_s
        out["bytes_to_host_per_s"] = res["counters"]["bytes_to_host"] / r.decode_s
    return out


def selection_for(K: int, history: int, n: int):
    """``seed -> override`` for a series of runs (one set of device buffers: ``workloads.Selections``)."""
    return workloads.Selections("indexer" if FLAGS.workload == "model" else "local99", K, history, n)


# ----------------------------------------------------------------------------------------------------------------
# The two runs
# ----------------------------------------------------------------------------------------------------------------
def history(e: glm53.Engine, ids: list, rec: Recorder) -> int:
    """The root session: restored from ``--load_history``, or prefilled (warm-up first, timed) and, with
    ``--save_history``, saved."""
    R = rec.results
    if FLAGS.load_history:
        t = time.perf_counter()
        root = e.restore(FLAGS.load_history)
        jax.block_until_ready(e.cache)
        n = len(e.tokens(root))
        R["history"] = {"loaded_from": FLAGS.load_history, "restore_s": time.perf_counter() - t, "tokens": n,
                        "host_after_restore": host_memory()}
        R["history_tokens"] = n
        print(f"[{e.cache_config.mode}] restored a {n:,}-token history from {FLAGS.load_history} in "
              f"{R['history']['restore_s']:.1f} s (no prefill: see the run that saved it)", flush=True)
        rec.save()
        return root
    R["warmup"] = warm_up(e, ids, [b for _, b in pieces(len(ids), e.chunk, FLAGS.prefill_piece)])
    rec.save()
    root = prefill(e, ids, rec, "prefill")
    if FLAGS.save_history:
        t = time.perf_counter()
        e.save(root, FLAGS.save_history)
        R["history"] = {"saved_to": FLAGS.save_history, "save_s": time.perf_counter() - t}
        print(f"saved the history to {FLAGS.save_history} in {R['history']['save_s']:.1f} s", flush=True)
        rec.save()
    return root


def capacity_run(model, c, planned: dict, rec: Recorder) -> None:
    R = rec.results
    n, P = FLAGS.sessions, c.run.prompt_len
    cc, sizes = planned["cache_config"], planned["sizes"]
    ids = np.random.default_rng(c.run.seed).integers(0, model.config.vocab_size, P).tolist()
    R["host_before_engine"] = host_memory()
    t = time.perf_counter()
    e = glm53.Engine(model, cc, max_sessions=n, host_budget_bytes=sizes["host_budget_bytes"],
                     device_budget_bytes=device_memory().get("bytes_limit"))
    jax.block_until_ready(e.cache)
    snap = R["engine"] = {"build_s": time.perf_counter() - t, **memory_snapshot(e)}
    print(f"[offload] engine: {n} slots x {e.capacity:,} rows; host pool {gib(snap['engine']['host']['pool_bytes'])} "
          f"pinned (RSS {gib(snap['host'].get('rss'))}), device cache {gib(snap['engine']['device']['cache_bytes'])}; "
          f"built in {snap['build_s']:.1f} s", flush=True)
    rec.save()
    root = history(e, ids, rec)
    if FLAGS.prefill_only:
        return
    P = len(e.tokens(root))
    build = R["build"] = {}
    sids = fork_and_diverge(e, root, n, build)
    build.update(memory_snapshot(e))
    rep = build["engine"]
    print(f"[offload] {n} sessions of {P + FLAGS.suffix:,} tokens: host pool {gib(rep['host']['pool_bytes'])} "
          f"({gib(rep['host']['used_bytes'])} in use), process RSS {gib(build['host'].get('rss'))}, available "
          f"{gib(build['host'].get('available'))}; device peak {gib(build['device'].get('peak_bytes_in_use'))}",
          flush=True)
    rec.save()

    select = selection_for(e.topk, P, n)
    warm = run(e, sids, FLAGS.check_tokens, c, select(1))
    R["decode_warmup"] = {"tokens": FLAGS.check_tokens, "compile_s": warm["report"].compile_s}
    rec.save()
    res = run(e, sids, c.run.max_new_tokens, c, select(10), rollback=False, timed=True)
    f = R["decode"] = figures(res, n)
    R["decode"]["tokens_head"] = [t[:16] for t in res["tokens"]]
    R["final"] = memory_snapshot(e)
    rec.save()
    per = f["per_session_tokens_per_s"]
    print(f"[offload] decode {n} x {c.run.max_new_tokens} tokens: {f['aggregate_tokens_per_s']:,.1f} tok/s aggregate "
          f"({np.mean(per) if per else float('nan'):,.2f} per session, {f['ms_per_step']:.1f} ms/step); hit rate "
          f"{f['hit_rate']}; from host {gib(f.get('bytes_from_host_per_s'))}/s; device peak "
          f"{gib(R['final']['device'].get('peak_bytes_in_use'))}; RSS {gib(R['final']['host'].get('rss'))}", flush=True)


def ab_run(model, c, planned: dict, rec: Recorder) -> None:
    R = rec.results
    n, P = FLAGS.sessions, c.run.prompt_len
    cc, sizes = planned["cache_config"], planned["sizes"]
    ids = np.random.default_rng(c.run.seed).integers(0, model.config.vocab_size, P).tolist()
    limit = device_memory().get("bytes_limit")
    eo = glm53.Engine(model, cc, max_sessions=n, host_budget_bytes=sizes["host_budget_bytes"],
                      device_budget_bytes=limit)
    root_o = history(eo, ids, rec)
    if FLAGS.prefill_only:
        return
    P = len(eo.tokens(root_o))
    save_dir = FLAGS.load_history or FLAGS.save_history
    own_dir = not save_dir
    io = R["save_restore"] = {}
    if own_dir:
        save_dir = tempfile.mkdtemp(prefix="sessions_1m_save_")
    try:
        if own_dir:
            t = time.perf_counter()
            eo.save(root_o, save_dir)
            io["save_s"] = time.perf_counter() - t
        io["dir"] = save_dir
        er = glm53.Engine(model, cc.replace(mode="resident"), max_sessions=n, device_budget_bytes=limit)
        t = time.perf_counter()
        root_r = er.restore(save_dir)
        jax.block_until_ready(er.cache)
        io["restore_s"] = time.perf_counter() - t
        io["host_after_restore"] = host_memory()
    finally:
        # A 1M-token save is tens of GB: removed even when the save (a full disk) or the restore (a device out of
        # memory) fails, where it used to stay in the temp directory.
        if own_dir:
            shutil.rmtree(save_dir, ignore_errors=True)
    print(f"restored the {P:,}-token session into a resident engine in {io['restore_s']:.1f} s", flush=True)
    rec.save()

    engines = {}
    R["build"] = {}
    for mode, e, root in (("offload", eo, root_o), ("resident", er, root_r)):
        entry = R["build"][mode] = {}
        engines[mode] = (e, fork_and_diverge(e, root, n, entry))
        entry.update(memory_snapshot(e))
    rec.save()

    select = selection_for(eo.topk, P, n)
    # The untimed check (it also compiles every decode shape): tokens and logits bit for bit.
    check = {mode: run(e, sids, FLAGS.check_tokens, c, select(1), logits=True) for mode, (e, sids) in engines.items()}
    r, o = check["resident"], check["offload"]
    R["check"] = {"tokens": FLAGS.check_tokens, "tokens_identical": r["tokens"] == o["tokens"],
                  "logits_identical": all(np.array_equal(r["report"].logits[a], o["report"].logits[b])
                                          for a, b in zip(engines["resident"][1], engines["offload"][1]))}
    print(f"check ({FLAGS.check_tokens} tokens per session): tokens identical {R['check']['tokens_identical']}, "
          f"logits bit-identical {R['check']['logits_identical']}", flush=True)
    rec.save()
    pairs = R["pairs"] = []
    for p in range(FLAGS.pairs):
        order = ("resident", "offload") if p % 2 == 0 else ("offload", "resident")
        runs = {}
        for mode in order:
            e, sids = engines[mode]
            runs[mode] = run(e, sids, c.run.max_new_tokens, c, select(10 + p), timed=True)
        fr, fo = figures(runs["resident"], n), figures(runs["offload"], n)
        pair = {"order": order, "tokens_identical": runs["resident"]["tokens"] == runs["offload"]["tokens"],
                "resident": fr, "offload": fo,
                "offload_loss_pct": 100 * (1 - fo["aggregate_tokens_per_s"] / fr["aggregate_tokens_per_s"]),
                "device_memory": device_memory()}
        pairs.append(pair)
        rec.save()
        print(f"[pair {p}, {order[0]} first] resident {fr['aggregate_tokens_per_s']:,.1f} tok/s, offload "
              f"{fo['aggregate_tokens_per_s']:,.1f} tok/s, loss {pair['offload_loss_pct']:.2f}%, tokens identical "
              f"{pair['tokens_identical']}, offload hit rate {fo['hit_rate']}", flush=True)
    if pairs:
        res_s = sum(1 / q["resident"]["aggregate_tokens_per_s"] for q in pairs)
        off_s = sum(1 / q["offload"]["aggregate_tokens_per_s"] for q in pairs)
        R["summary"] = {"pooled_loss_pct": 100 * (1 - res_s / off_s),
                        "losses_pct": [q["offload_loss_pct"] for q in pairs],
                        "all_tokens_identical": all(q["tokens_identical"] for q in pairs)
                        and R["check"]["tokens_identical"], "logits_identical": R["check"]["logits_identical"]}
        print(f"summary: {R['summary']}", flush=True)
    R["final"] = {mode: memory_snapshot(e) for mode, (e, _) in engines.items()}
    rec.save()


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "mesh", "run.prompt_len", "run.max_new_tokens", "run.mtp", "run.accept_override",
         "run.seed") + cli.cache_fields_but(c, "mode", "max_len"),
        "experiments.sessions_1m reads config.model, seed, dtype, mesh, run.{prompt_len,max_new_tokens,mtp,"
        "accept_override,seed} and cache but its mode (offload; --ab: both) and max_len (from the run's lengths); "
        "sessions come from --sessions, the output from --out, and decoding is greedy")
    if not FLAGS.load_history:  # found at the save, it came after the (timed, maybe hours-long) prefill it was for
        cli.refuse_an_unusable_save_directory(FLAGS.save_history, "save_history")
    R = {"config": c.to_dict(), **provenance(), "mode": "ab" if FLAGS.ab else "capacity",
         "sessions": FLAGS.sessions, "history_tokens": c.run.prompt_len, "workload": FLAGS.workload,
         "mtp": c.run.mtp, "accept_override": c.run.accept_override,
         "histories": "one prefill (timed); the other sessions are fork(share_pages=False) copies: every session's "
                      "history is its own host pages (shared pages would not measure capacity); then a distinct "
                      f"{FLAGS.suffix}-token suffix per session", "status": "started"}
    rec = Recorder(FLAGS.out, R)
    rec.save()
    t = time.perf_counter()
    cfg = glm53.ModelConfig.from_config_dict(c.model.to_dict())
    try:
        planned = plan(cfg, resolve_dtype(c.dtype), c, FLAGS.sessions, FLAGS.ab)
    except CapacityError as err:
        R["status"] = "refused"
        R["error"] = str(err)
        rec.save()
        print(f"refused: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    R["plan"] = planned["sizes"]
    s = planned["sizes"]
    print(f"plan: {FLAGS.sessions} sessions x {s['rows_per_session']:,} rows; host pool {gib(s['host_pool_bytes'])} "
          f"(need {gib(s['host_need_bytes'])} of {gib(host_memory().get('available'))} available); device need "
          f"{gib(s['device_need_bytes'])} (limit {gib(device_memory().get('bytes_limit'))})", flush=True)
    rec.save()
    try:
        tm = time.perf_counter()
        model = glm53.from_config(cfg, seed=c.seed, dtype=c.dtype,
                                  cache_config=glm53.CacheConfig.from_config_dict(c.cache), mesh=c.get("mesh"))
        jax.block_until_ready(model.params)
        R["model"] = {"params": model.num_params(), "build_s": time.perf_counter() - tm}
        print(model, flush=True)
        rec.save()
        (ab_run if FLAGS.ab else capacity_run)(model, c, planned, rec)
    except BaseException as err:  # what was measured stays in the JSON, with what stopped the run
        R["status"] = "failed"
        R["error"] = f"{type(err).__name__}: {str(err)[:3000]}"
        R["traceback"] = traceback.format_exc()[-5000:]
        rec.save()
        raise
    R["status"] = "done"
    R["wall_s"] = time.perf_counter() - t
    rec.save()
    if FLAGS.out:
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)

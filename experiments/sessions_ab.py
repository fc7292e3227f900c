"""Many sessions decoding together, offload vs resident: the article's ten-sessions experiment, and a large append.

    python -m experiments.sessions_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 \
        --config.run.max_new_tokens=128 --sessions=10 --pairs=2 --mtp=0,3 --append=4096 --out=$OUT/sessions_ab.json

Each mode builds one engine of ``--sessions`` slots. The histories: one prompt of ``prompt_len`` tokens is
prefilled, ``--sessions - 1`` forks copy it *with their own host pages* (``fork(share_pages=False)``: ten 50K
prefills would not fit the device time; the copies make every session's history its own host memory, as ten
prefills would), and each session then appends its own 16 random tokens, so they decode different tokens. With
``--prefill_once=DIR`` only the resident engine prefills; it saves the session to DIR and the offload engine restores
it (a 1M-token history: one prefill of minutes instead of two)::

    python -m experiments.sessions_ab --config=configs/h200_1m.py --sessions=1 --mtp=0 --append=0 \
        --workload=local99,indexer --prefill_once=/tmp/history_1m --out=$OUT/sessions_ab_1m.json

For every workload of ``--workload`` and MTP depth, after an untimed warm-up (compilation), ``--pairs`` interleaved
pairs (resident first, then offload first, ...) each generate ``max_new_tokens`` tokens for every session in one
``Engine.generate`` call, then roll the sessions back to where they were, so every run starts from the same state.
Random weights accept almost no drafts, so MTP runs force acceptance (``accept_override``: every draft accepted;
outputs are then compared between modes only) and also record the model's real verdicts on the same drafts
(``acceptance_real``). Reported per run: aggregate and per-session tokens/s, acceptance per draft position, hit
rates, host step-call percentiles (stalls), copyback steps, device memory (peak and in use) and host bytes actually
allocated; per setting the physical floor (misses per step x row bytes over the zero-copy bandwidth measured in the
run, GPU only); with several workloads, the loss against hit rate drawn next to ``--out`` (``.png``). Tokens must
be identical between modes in every pair; a short run per depth also compares the logits bit for bit.

Before a setting's pairs, ``--warmup_runs`` untimed runs per mode bring the hot caches to the hit rate they
settle at, so the pairs measure one steady state (and a setting's hits do not depend on which settings ran
before it).

Each setting's summary holds the pooled loss, a 95% interval over its pairs' losses (``loss_interval_pct``) and
its verdict against ``--target_pct`` (``target``: met / missed / undecided), and whether runs of one mode agreed
within 1% (``resolved``). ``--max_pairs=N`` keeps adding pairs past ``--pairs`` until the interval's half width is
at most ``--half_width_pct`` (a 10 x 50K pair takes ~6 s of decode on the H200, so a jittery host can be outlasted);
``--budget_s`` stops adding them once that many seconds have passed since the start; each setting gets an equal
share of what is left when it begins, so a jittering first setting cannot spend the later ones' time.

Last, ``--append`` tokens are appended to one session of each engine in interleaved pairs (``append_ab``): the time
of a large append to a long offloaded history against resident, outputs compared after it.
"""

import json
import time

import jax
import numpy as np
from absl import app, flags

import glm53
import glm53.roofline
from experiments import cli, loss_plot, workloads
from experiments.engine_runs import (figures, loss_interval_pct, more_pairs, pooled_loss_pct, run, same_logits,
                                     setting_deadline_s, target_verdict, warm_up_rounds)
from glm53.memory import device_memory
from glm53.engine import compile_seconds
from glm53.provenance import provenance
from kernels_pallas import kv_formats

FLAGS = flags.FLAGS
cli.define_config("configs/h200_bench.py", "experiment config")
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_integer("sessions", 10, "sessions decoding together", lower_bound=1)
flags.DEFINE_integer("pairs", 2, "interleaved resident/offload pairs per setting", lower_bound=1)
flags.DEFINE_integer("max_pairs", 0, "after --pairs, keep adding pairs while the loss's 95% interval is wider than "
                     "--half_width_pct, up to this many (0: --pairs only)", lower_bound=0)
flags.DEFINE_float("half_width_pct", 0.25, "the 95% interval half width (percentage points) --max_pairs aims for")
flags.DEFINE_float("budget_s", 0.0, "no pairs beyond --pairs once this many seconds have passed since the start, so a "
                   "run fits a machine's time limit (0: none), each setting stopping at an equal share of what is "
                   "left when it begins; settings cut short say so (stopped_by_budget)", lower_bound=0.0)
flags.DEFINE_float("target_pct", 1.0, "the loss target each setting's interval is judged against (met / missed / "
                   "undecided)")
flags.DEFINE_list("mtp", ["0", "3"], "MTP depths")
flags.DEFINE_list("workload", ["local99"], f"DSA selections, each session its own; several: each depth is run "
                  f"with each: {workloads.WORKLOADS}")
flags.DEFINE_integer("suffix", 16, "tokens each session appends to the shared history so the sessions diverge",
                     lower_bound=0)
flags.DEFINE_integer("warmup_runs", 1, "untimed runs of each mode per setting before its pairs (each as long as a timed "
                     "one), so the pairs start from hot caches at their plateau rather than climbing it: at 10 x 50K "
                     "the offload hits rose from 99.0% to 99.6% over 59a7e32's first five MTP 0 pairs; up to two more "
                     "while a round compiled anything (the report's warmup_runs: how many ran)", lower_bound=0)
flags.DEFINE_integer("check_tokens", 8, "tokens of the logits check run per depth (also the warm-up)", lower_bound=1)
flags.DEFINE_integer("append", 4096, "large append measured after the decode settings (0: skip)", lower_bound=0)
flags.DEFINE_string("prefill_once", "", "prefill the history in the resident engine only, save it to this directory "
                    "and restore it into the offload engine (a 1M-token prefill takes minutes; the restored session "
                    "continues exactly as the saved one, so both engines decode the same history)")

# The most two runs of one mode may differ (max / min - 1) for a setting's loss to count as resolved, against losses
# of ~1% being measured: fa830ed's machine repeated resident 10 x 50K within 0.1% and offload within 0.3% (62932c1's
# six workloads: 0.01-0.58%, but resident drift0.05 1.55%, whose pairs read 1.93% and 0.39%); the host-bound machine
# of 7f8511a 6-44%.
SPREAD_LIMIT_PCT = 1.0


def same_mode_spread_pct(tokens_per_s: list) -> float:
    """How far apart runs of one mode are: ``100 * (max / min - 1)`` of their tokens/s."""
    return 100 * (max(tokens_per_s) / min(tokens_per_s) - 1) if tokens_per_s else 0.0


def build(model, cc, c, n_sessions: int, save_to: str = "", restore_from: str = "", suffix: int | None = None
          ) -> tuple[glm53.Engine, list, dict]:
    """The engine and its sessions. ``save_to``: the prefilled history is also saved there; ``restore_from``: the
    history comes from that save instead of a prefill (its time is reported as ``restore_s``); ``suffix``: tokens
    each session appends (default ``--suffix``; scripts that parse no flags pass it)."""
    suffix = FLAGS.suffix if suffix is None else suffix
    rng = np.random.default_rng(c.run.seed)
    history = rng.integers(0, model.config.vocab_size, c.run.prompt_len).tolist()
    e = glm53.Engine(model, cc, max_sessions=n_sessions)
    compiled = compile_seconds()
    t = time.perf_counter()
    if restore_from:
        root = e.restore(restore_from)
        if e.tokens(root) != history:
            raise ValueError(f"{restore_from} holds another history than --config.run.prompt_len / seed give")
    else:
        root = e.open(history, progress=True)
    jax.block_until_ready(e.cache)
    t_prefill = time.perf_counter() - t
    # seconds of it spent compiling (the process's first history compiles its chunk steps there; not subtracted)
    fig = {"restore_s" if restore_from else "prefill_s": t_prefill, "compile_s": compile_seconds() - compiled}
    if not restore_from:
        fig["prefill_tokens_per_s"] = c.run.prompt_len / t_prefill
    if save_to:
        t = time.perf_counter()
        e.save(root, save_to)
        fig["save_s"] = time.perf_counter() - t
    sids = [root] + [e.fork(root, share_pages=False) for _ in range(n_sessions - 1)]
    for i, s in enumerate(sids):
        e.append(s, np.random.default_rng(1000 + i).integers(0, model.config.vocab_size, suffix).tolist())
    jax.block_until_ready(e.cache)
    return e, sids, fig


def main(_):
    t_start = time.perf_counter()
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "run.prompt_len", "run.max_new_tokens", "run.seed")
        + cli.cache_fields_but(c, "mode", "max_len"),
        "experiments.sessions_ab reads config.model, seed, dtype, run.{prompt_len,max_new_tokens,seed} and cache but "
        "its mode (both run) and max_len (from the run's lengths); sessions come from --sessions, MTP from --mtp "
        "(drafts forced), the output from --out, decoding is greedy, and it runs on one device")
    try:
        depths = [int(d) for d in FLAGS.mtp]
    except ValueError:
        depths = []
    if not depths or not all(0 <= d <= glm53.engine.MAX_MTP_DEPTH for d in depths):
        raise app.UsageError(f"--mtp={','.join(FLAGS.mtp)}: give MTP depths, whole numbers in [0, "
                             f"{glm53.engine.MAX_MTP_DEPTH}], comma-separated")
    workloads.check_names("workload", FLAGS.workload)
    if FLAGS.max_pairs and FLAGS.max_pairs < FLAGS.pairs:  # it would add none, silently
        raise app.UsageError(f"--max_pairs={FLAGS.max_pairs} is below --pairs={FLAGS.pairs}: give 0 (--pairs only) "
                             f"or a count of at least {FLAGS.pairs}")
    S, new = FLAGS.sessions, c.run.max_new_tokens
    max_len = c.run.prompt_len + FLAGS.suffix + max(new, FLAGS.append + FLAGS.check_tokens) + max(depths) + 64
    positions = cli.model_config(c).max_position_embeddings
    if max_len > positions:  # before the model: the engine refused it with a traceback after building it
        raise app.UsageError(
            f"a session needs {max_len:,} positions (prompt {c.run.prompt_len:,} + suffix {FLAGS.suffix} + the "
            f"larger of {new} new tokens and --append={FLAGS.append} + --check_tokens={FLAGS.check_tokens}, + MTP "
            f"{max(depths)} + 64 spare) but the model has max_position_embeddings={positions:,}: lower --append (0 "
            "skips it), --config.run.prompt_len or --config.run.max_new_tokens")
    cli.check_modes(c, ("resident", "offload"))
    cli.refuse_an_unusable_save_directory(FLAGS.prefill_once, "prefill_once")  # found at the save, after the prefill
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    K = min(model.config.index_topk, max_len)
    history = c.run.prompt_len
    results = {"config": c.to_dict(), **provenance(), "sessions": S, "workloads": FLAGS.workload,
               "histories": ("one prefill (resident), saved and restored into the offload engine" if FLAGS.prefill_once
                             else "one prefill per engine") + ", forks with their own host pages, a distinct "
                             f"{FLAGS.suffix}-token suffix each", "settings": {}}
    # A physical floor beside each setting's loss: its misses per step over the zero-copy bandwidth (GPU only)
    results["host_read_bandwidth"] = host_bw = glm53.roofline.measure_host_read_bandwidth(cc.kv_format)
    row_bytes = kv_formats.get_format(cc.kv_format).bytes_per_row
    engines = {}
    for mode in ("resident", "offload"):
        once = FLAGS.prefill_once
        e, sids, fig = build(model, cc.replace(mode=mode, max_len=max_len), c, S,
                             save_to=once if once and mode == "resident" else "",
                             restore_from=once if once and mode == "offload" else "")
        rep = e.memory_report()
        engines[mode] = (e, sids)
        results.setdefault("build", {})[mode] = {**fig, "output_ring": e.output_ring, "spin_reads": e.spin_reads,
                                                 "device_memory": device_memory(),
                                                 "device_cache_bytes": rep["device"]["cache_bytes"],
                                                 "host_pool_bytes": rep["host"]["pool_bytes"],
                                                 "host_used_bytes": rep["host"]["used_bytes"]}
        how = (f"restore {fig['restore_s']:.1f} s" if "restore_s" in fig else f"prefill {fig['prefill_s']:.1f} s")
        how += f" ({fig['compile_s']:.1f} s of it compiling)"
        print(f"[{mode}] {S} sessions of {history} + {FLAGS.suffix} tokens: {how}; "
              f"device cache {rep['device']['cache_bytes'] / 2**30:.2f} GiB, host pool "
              f"{rep['host']['pool_bytes'] / 2**30:.2f} GiB ({rep['host']['used_bytes'] / 2**30:.2f} GiB in use)",
              flush=True)

    # MTP: forced acceptance (every draft); its runs also record the model's real verdicts (acceptance_real).
    settings = [(w, d, None) for w in FLAGS.workload for d in depths if d == 0] + \
        [(w, d, d) for w in FLAGS.workload for d in depths if d > 0]
    for i_setting, (workload, depth, accept) in enumerate(settings):
        deadline_s = setting_deadline_s(time.perf_counter() - t_start, FLAGS.budget_s, len(settings) - i_setting)

        selection = workloads.Selections(workload, K, history, S)  # seed -> override, one set of device buffers

        name = f"mtp{depth}" + ("" if not depth else ("_forced" if accept is not None else "_real"))
        if len(FLAGS.workload) > 1:
            name = f"{workload}_{name}"
        entry = {"mtp": depth, "accept_override": accept, "workload": workload, "pairs": [], "stopped_by_budget": False,
                 "budget_deadline_s": deadline_s or None}
        # The warm-up (it compiles every shape of the setting) is also the logits check: offload == resident bit
        # for bit.
        check = {}
        for mode, (e, sids) in engines.items():
            check[mode] = run(e, sids, FLAGS.check_tokens, depth, accept, selection(1), logits=True)
            if depth:
                # The timed runs start from rolled-back sessions, whose pending token has no stored hidden state:
                # MTP then runs one plain decode step first, which the check (from freshly built sessions) never
                # compiled. An MTP-only run compiled it inside its first timed pair (8.6 s resident, 16.8 s offload:
                # sessions_ab_10x50k_mtp3_62932c1.json). One more untimed run takes that path.
                run(e, sids, FLAGS.check_tokens, depth, accept, selection(2))
        r, o = check["resident"], check["offload"]
        entry["check_tokens_identical"] = r["tokens"] == o["tokens"]
        entry["check_logits_identical"] = same_logits(r, engines["resident"][1], o, engines["offload"][1])
        # --warmup_runs rounds of the timed length, then up to two more while a round compiled anything: XLA drops
        # every executable's CUDA graphs when it loads a new one, and the next runs' first step calls record them
        # again, 5-10 ms each against a ~1.2 ms call. A round of the timed length compiles the end-of-run settle of
        # its page count as the round ends (cmdbuf_updates_ab8k_fbd74d3.json: the first pair's steps 1-3
        # recorded, in both modes): those recordings must fall in a warm-up round, not in a pair.
        compiled_s = warm_up_rounds(lambda k: [run(e, sids, new, depth, accept, selection(1000 + k))
                                               for e, sids in engines.values()], FLAGS.warmup_runs)
        entry["warmup_runs"] = len(compiled_s)
        entry["warmup_compile_s"] = compiled_s
        def another_pair() -> bool:
            go, by_budget = more_pairs([q["offload_loss_pct"] for q in entry["pairs"]], pairs=FLAGS.pairs,
                                       max_pairs=FLAGS.max_pairs, half_width_pct=FLAGS.half_width_pct,
                                       elapsed_s=time.perf_counter() - t_start, budget_s=deadline_s)
            entry["stopped_by_budget"] = by_budget
            return go

        p = 0
        while another_pair():
            order = ("resident", "offload") if p % 2 == 0 else ("offload", "resident")
            runs = {}
            for mode in order:
                e, sids = engines[mode]
                runs[mode] = run(e, sids, new, depth, accept, selection(10 + p))
                runs[mode]["device_memory"] = device_memory()
            fr, fo = figures(runs["resident"], S), figures(runs["offload"], S)
            # the host's own spread right after the pair: step calls spread no less than a fixed piece of Python
            # (a unit of the offload calls' median, at most 1.5 ms: a CPU's calls take tens of ms)
            host_speed = glm53.roofline.measure_host_speed_spread(
                unit_ms=min((fo["step_call_ms"] or {}).get("p50") or 1.5, 1.5))
            pair = {"order": order, "tokens_identical": runs["resident"]["tokens"] == runs["offload"]["tokens"],
                    "resident": fr, "offload": fo, "host_speed": host_speed,
                    "offload_loss_pct": 100 * (1 - fo["aggregate_tokens_per_s"] / fr["aggregate_tokens_per_s"]),
                    "device_memory": {m: runs[m]["device_memory"] for m in order}}
            entry["pairs"].append(pair)
            print(f"[{name} pair {p}] resident {fr['aggregate_tokens_per_s']:.1f} tok/s, offload "
                  f"{fo['aggregate_tokens_per_s']:.1f} tok/s, loss {pair['offload_loss_pct']:.2f}%, tokens identical "
                  f"{pair['tokens_identical']}; hit rate {fo['hit_rate']}; acceptance real {fo['acceptance_real']}, "
                  f"committed {fo['mtp_committed']}/{fo['mtp_proposed']}; step call p99/p50 resident "
                  f"{fr['step_call_p99_over_median']:.2f}, offload {fo['step_call_p99_over_median']:.2f} "
                  f"(ms {fo['step_call_ms']}), a fixed Python unit's {host_speed['p99_over_median']:.2f}; step "
                  f"interval p99/p50 resident {fr['step_interval_p99_over_median']:.2f}, offload "
                  f"{fo['step_interval_p99_over_median']:.2f}; "
                  f"copyback steps {fo['copyback_steps'][:8]}", flush=True)
            p += 1
        floors = [loss_plot.floor_pct(q["offload"]["misses"] / max(q["offload"]["steps"], 1), row_bytes, host_bw,
                                      q["resident"]["decode_s"] / max(q["resident"]["steps"], 1))
                  for q in entry["pairs"]]
        entry["summary"] = {
            "pooled_loss_pct": pooled_loss_pct([q["resident"]["aggregate_tokens_per_s"] for q in entry["pairs"]],
                                               [q["offload"]["aggregate_tokens_per_s"] for q in entry["pairs"]]),
            "losses_pct": [q["offload_loss_pct"] for q in entry["pairs"]],
            "hit_rate": float(np.mean([q["offload"]["hit_rate"] for q in entry["pairs"]])),
            "floor_pct": None if None in floors else float(np.mean(floors)),
            "all_tokens_identical": all(q["tokens_identical"] for q in entry["pairs"])
            and entry["check_tokens_identical"], "logits_identical": entry["check_logits_identical"],
            # A run that compiled while decoding timed the compiler too: its pair is not a decode figure.
            "timed_runs_compiled": any(q[m]["decode_compile_s"] > 0 for q in entry["pairs"]
                                       for m in ("resident", "offload")),
            "offload_step_call_p99_over_median": [q["offload"]["step_call_p99_over_median"] for q in entry["pairs"]],
            "host_speed_p99_over_median": [q["host_speed"]["p99_over_median"] for q in entry["pairs"]],
            "step_interval_p99_over_median": {m: [q[m]["step_interval_p99_over_median"] for q in entry["pairs"]]
                                              for m in ("resident", "offload")}}
        # Runs of one mode on one machine should agree: when they scatter by more than the loss being measured
        # (a host-bound machine: sessions_ab_10x50k_7f8511a.json's resident runs were 1,440 and 2,068 tok/s) the
        # pairs resolve nothing, whatever the pooled figure says.
        spread = {m: same_mode_spread_pct([q[m]["aggregate_tokens_per_s"] for q in entry["pairs"]])
                  for m in ("resident", "offload")}
        entry["summary"]["same_mode_spread_pct"] = spread
        entry["summary"]["resolved"] = len(entry["pairs"]) > 1 and max(spread.values()) <= SPREAD_LIMIT_PCT
        # The pairs' losses as an interval: on a host that jitters run by run (no setting of
        # sessions_ab_10x50k_abf301d.json was resolved by the spread rule), the interval says what the pairs do
        # establish, and --max_pairs adds pairs until it is narrow enough.
        interval = loss_interval_pct(entry["summary"]["losses_pct"])
        entry["summary"]["loss_interval_pct"] = interval
        entry["summary"]["target_pct"] = FLAGS.target_pct
        entry["summary"]["target"] = target_verdict(interval, FLAGS.target_pct)
        print(f"[{name}] {cli.readable(entry['summary'])}", flush=True)
        if len(entry["pairs"]) > 1 and not entry["summary"]["resolved"]:
            print(f"[{name}] WARNING: runs of one mode scatter by {max(spread.values()):.1f}% (over "
                  f"{SPREAD_LIMIT_PCT}%): this machine does not resolve the loss", flush=True)
        results["settings"][name] = entry
        if FLAGS.out and len(FLAGS.workload) > 1:
            results["plot"] = loss_plot.plot(
                loss_plot.sessions_ab_points(results["settings"]), FLAGS.out.rsplit(".", 1)[0] + ".png",
                f"offload loss vs hit rate ({S} sessions x {history:,}-token histories, "
                f"{jax.devices()[0].device_kind})")
        if FLAGS.out:  # after every setting, so a run cut short still leaves what it measured
            with open(FLAGS.out, "w") as f:
                json.dump(results, f, indent=2, default=str)
    if FLAGS.append:
        results["append"] = append_ab(engines, model.config.vocab_size, c)
        if FLAGS.out:
            with open(FLAGS.out, "w") as f:
                json.dump(results, f, indent=2, default=str)
    if FLAGS.out:
        print(f"wrote {FLAGS.out}" + (f" and {results['plot']}" if results.get("plot") else ""))


def append_ab(engines: dict, vocab: int, c) -> dict:
    """A large append to the first session of each engine (a long offloaded history against a resident one):
    timed until the cache is ready (chunks, their copybacks, the settle), then a few tokens generated and compared
    bit for bit, then rolled back. Interleaved pairs, after an untimed append of the same length to each engine
    (rolled back): an engine restored from ``--prefill_once`` has never run its chunk steps, and the first append
    would time their compilation (2.4 s of a 40-token append's 2.4 s on a CPU). ``compile_s`` records any left."""
    n = FLAGS.append
    out = {"append_tokens": n, "history_tokens": c.run.prompt_len + FLAGS.suffix, "pairs": []}
    warm = np.random.default_rng(4999).integers(0, vocab, n).tolist()
    for mode, (e, sids) in engines.items():
        e.append(sids[0], warm)
        e.rollback(sids[0], n)
        jax.block_until_ready(e.cache)
    for p in range(FLAGS.pairs):
        ids = np.random.default_rng(5000 + p).integers(0, vocab, n).tolist()
        order = ("resident", "offload") if p % 2 == 0 else ("offload", "resident")
        runs = {}
        for mode in order:
            e, sids = engines[mode]
            s = sids[0]
            before = e.stats(s)
            jax.block_until_ready(e.cache)
            compiled = compile_seconds()
            t = time.perf_counter()
            e.append(s, ids)
            jax.block_until_ready(e.cache)
            dt = time.perf_counter() - t
            compiled = compile_seconds() - compiled
            after = e.stats(s)
            # every session decodes a few tokens (the decode shape the settings compiled); session 0's are compared
            gen = e.generate({x: FLAGS.check_tokens for x in sids}, return_logits=True)
            runs[mode] = {"append_s": dt, "compile_s": compiled, "tokens": gen[s], "logits": e.last_run.logits[s],
                          "bulk_bytes_from_host": after.get("bulk_bytes_from_host", 0)
                          - before.get("bulk_bytes_from_host", 0), "transient_bytes": e.transient_bytes()}
            e.rollback(s, n + FLAGS.check_tokens)
            for x in sids[1:]:
                e.rollback(x, FLAGS.check_tokens)
        r, o = runs["resident"], runs["offload"]
        pair = {"order": order, "resident_append_s": r["append_s"], "offload_append_s": o["append_s"],
                "resident_append_tokens_per_s": n / r["append_s"], "offload_append_tokens_per_s": n / o["append_s"],
                "offload_extra_pct": 100 * (o["append_s"] / r["append_s"] - 1),
                "tokens_identical": r["tokens"] == o["tokens"],
                "logits_identical": bool(np.array_equal(r["logits"], o["logits"])),
                "offload_bulk_bytes_from_host": o["bulk_bytes_from_host"],
                "offload_transient_bytes": o["transient_bytes"],
                "compile_s": {"resident": r["compile_s"], "offload": o["compile_s"]}}
        out["pairs"].append(pair)
        print(f"[append pair {p}] {n} tokens onto {out['history_tokens']}: resident {r['append_s']:.3f} s, offload "
              f"{o['append_s']:.3f} s ({pair['offload_extra_pct']:+.2f}%), bulk read "
              f"{pair['offload_bulk_bytes_from_host'] / 2**30:.2f} GiB, outputs identical {pair['tokens_identical']}"
              f"/{pair['logits_identical']}", flush=True)
    r_s = sum(q["resident_append_s"] for q in out["pairs"])
    o_s = sum(q["offload_append_s"] for q in out["pairs"])
    out["summary"] = {"pooled_offload_extra_pct": 100 * (o_s / r_s - 1),
                      "all_identical": all(q["tokens_identical"] and q["logits_identical"] for q in out["pairs"]),
                      "timed_appends_compiled": any(v > 0 for q in out["pairs"] for v in q["compile_s"].values())}
    print(f"[append] {cli.readable(out['summary'])}", flush=True)
    return out


if __name__ == "__main__":
    cli.run(main)

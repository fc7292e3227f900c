"""Resident vs offload A/B: decode speed of the same build on the same inputs, with outputs compared bit-for-bit.

    python -m experiments.offload_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 \
        --out=experiments/results/offload_ab_50k.json

Workloads (``experiments.workloads.selection``): ``indexer`` (the model's own DSA selection), ``local99`` (a
fixed set of index_topk history positions of which 1% is replaced every step, so about 99% of lookups hit once the
set is hot — the article's high-reuse regime), ``drift<c>`` (the same with a fraction ``c`` replaced), ``window<s>``
(a window sliding by ``s`` positions a step) and ``uniform`` (fresh positions every step). Each workload runs
``--pairs`` interleaved pairs (resident then offload, then offload then resident, ...); ``config.run.mtp`` and
``config.run.accept_override`` apply to both modes. Compilation is excluded: every workload and mode first runs
with the timed prompts and token count until a round compiles nothing (a shorter warm-up leaves the end-of-prefill
and end-of-run settles of the timed page counts to compile inside the first timed run); each pair records the
compile seconds its runs still saw (``compile_s``) and the summary whether any did (``timed_runs_compiled``).

**Loss against hit rate.** One run can sweep the hit rate with the synthetic workloads:

    python -m experiments.offload_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 --pairs=2 \
        --workloads=drift0.001,local99,drift0.05,drift0.2,window512,uniform --out=$OUT/loss_vs_hits.json

Beside each workload's loss it reports the **physical floor**: the bytes its misses read from host memory per step
over the zero-copy bandwidth measured in the same run (``glm53.roofline.measure_host_read_bandwidth``; GPUs only), as
a share of the resident step. A PNG (loss and floor against the decode hit rate) goes next to the JSON.
"""

import json
import numpy as np
from absl import flags

import glm53
import glm53.engine
import glm53.roofline
import kernels_pallas.kv_formats
from experiments import cli, loss_plot, workloads
from experiments.engine_runs import loss_interval_pct, pooled_loss_pct, warm_up_rounds
from glm53.provenance import provenance

FLAGS = flags.FLAGS
cli.define_config("configs/h200_bench.py", "experiment config")
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_integer("pairs", 1, "interleaved resident/offload pairs per workload", lower_bound=1)
flags.DEFINE_list("workloads", ["indexer", "local99"],
                  "indexer (the model's own selection), local99, drift<c>, window<s>, uniform (experiments.workloads)")


def run_once(model, prompts, cc, new_tokens, selections: workloads.Selections, seed, run_cfg):
    return glm53.generate(model, prompts, max_new_tokens=new_tokens, cache=cc, return_logits=True, mtp=run_cfg.mtp,
                          accept_override=None if run_cfg.accept_override < 0 else run_cfg.accept_override,
                          selection_override=selections(seed), progress=False)  # timed: no terminal writes


def floor_pct(pairs: list, row_bytes: int, host_bw: dict | None) -> float | None:
    """The physical floor of a workload's offload loss, in % of the resident step, averaged over its pairs (None
    without a bandwidth measurement)."""
    pct = [loss_plot.floor_pct(p["cache_stats"]["decode"]["misses"] / max(p["decode_steps"], 1), row_bytes, host_bw,
                               p["resident_step_s"]) for p in pairs]
    return None if None in pct else float(np.mean(pct))


def plot(results: dict, path: str) -> str | None:
    points = [{"label": wl, "hit_rate": s.get("decode_hit_rate"), "loss_pct": s["pooled_loss_pct"],
               "loss_min": s["loss_pct_min"], "loss_max": s["loss_pct_max"], "floor_pct": s.get("floor_pct")}
              for wl, s in results.get("summary", {}).items()]
    return loss_plot.plot(points, path, f"offload loss vs hit rate ({results.get('device_kind', '')}, history "
                          f"{results['config']['run']['prompt_len']:,}, MTP {results['config']['run']['mtp']})")


def summarise(pairs: list) -> dict:
    """Across a workload's pairs: the loss of the pooled decode time (every pair's seconds per token added up, so
    each pair weighs the same), its spread, and whether outputs matched in all of them. Pairs scatter by +-0.5 to
    +-1.5% on the H200, with an occasional host-disturbed outlier (9% in offload_ab_50k_9a24c79.json), so one pair
    decides nothing."""
    losses = [p["offload_loss_pct"] for p in pairs]
    return {"pairs": len(pairs), "pooled_loss_pct": pooled_loss_pct([p["resident_decode_tok_s"] for p in pairs],
                                                                    [p["offload_decode_tok_s"] for p in pairs]),
            "loss_pct_min": min(losses), "loss_pct_median": float(np.median(losses)), "loss_pct_max": max(losses),
            "loss_interval_pct": loss_interval_pct(losses),
            "all_identical": all(p["tokens_identical"] and p["logits_identical"] for p in pairs)}


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "mesh", "run.prompt_len", "run.batch", "run.max_new_tokens", "run.seed", "run.mtp",
         "run.accept_override") + cli.cache_fields_but(c, "max_len", "mode"),
        "experiments.offload_ab runs both cache modes with a capacity of prompt + new tokens, greedy (it reads "
        "config.model, seed, dtype, mesh, run.{prompt_len,batch,max_new_tokens,seed,mtp,accept_override} and cache "
        "but its mode and max_len), and writes --out")
    workloads.check_names("workloads", FLAGS.workloads)
    cli.check_run_settings(c)  # before the model: generate refused these only after the weights, prefill and warm-up
    cli.check_modes(c, ("resident", "offload"))
    model, prompts, cc, K = workloads.setup(c)
    new = c.run.max_new_tokens
    modes = {"resident": cc.replace(mode="resident"), "offload": cc.replace(mode="offload")}
    # a bad name fails here, before any run
    series = {wl: workloads.Selections(wl, K, c.run.prompt_len, len(prompts)) for wl in FLAGS.workloads}
    warmup_compile_s = {}
    for wl in FLAGS.workloads:
        # Rounds of the timed shape, until one compiles nothing (at most 3): the prefill's and the run's last
        # settles compile for their page counts, which only the timed lengths have.
        warmup_compile_s[wl] = warm_up_rounds(lambda k: [run_once(model, prompts, m, new, series[wl], c.run.seed,
                                                                  c.run) for m in modes.values()])
    print(f"{model}; prompt {c.run.prompt_len} x {c.run.batch}, {new} new tokens; warm-up done (compile seconds per "
          f"round: {cli.readable(warmup_compile_s)})", flush=True)

    row_bytes = kernels_pallas.kv_formats.get_format(cc.kv_format).bytes_per_row
    host_bw = glm53.roofline.measure_host_read_bandwidth(cc.kv_format)
    if host_bw:
        print(f"zero-copy host reads: {host_bw['GBps']:.2f} GB/s", flush=True)
    results = {"config": c.to_dict(), **provenance(), "host_read_bandwidth": host_bw,
               "warmup_compile_s": warmup_compile_s, "workloads": {}}
    for wl in FLAGS.workloads:
        pairs = []
        for p in range(FLAGS.pairs):
            order = ("resident", "offload") if p % 2 == 0 else ("offload", "resident")
            runs = {m: run_once(model, prompts, modes[m], new, series[wl], c.run.seed + p, c.run)
                    for m in order}
            r, o = runs["resident"], runs["offload"]
            pair = {
                "order": order,
                "tokens_identical": r.tokens == o.tokens,
                "logits_identical": bool(np.array_equal(r.logits, o.logits)),
                "resident_decode_tok_s": r.decode_tokens_per_s, "offload_decode_tok_s": o.decode_tokens_per_s,
                "offload_loss_pct": 100 * (1 - o.decode_tokens_per_s / r.decode_tokens_per_s),
                "resident_ttft_s": r.time_to_first_token_s, "offload_ttft_s": o.time_to_first_token_s,
                "compile_s": {"resident": r.compile_s, "offload": o.compile_s},  # 0 unless the warm-up missed a shape
                "resident_prefill_tok_s": r.prefill_tokens_per_s, "offload_prefill_tok_s": o.prefill_tokens_per_s,
                "decode_hit_rate": o.cache_stats["decode"]["hit_rate"],
                "decode_steps": len(o.decode_step_call_s),
                # decode seconds (tokens after each prompt's first / rate) per step
                "resident_step_s": sum(len(t) - 1 for t in r.tokens) / r.decode_tokens_per_s
                / max(len(r.decode_step_call_s), 1),
                "decode_host_loop_s": {"resident": r.decode_host_loop_s, "offload": o.decode_host_loop_s},
                "decode_step_calls_s": {"resident": r.decode_step_calls_s, "offload": o.decode_step_calls_s},
                "decode_step_call_ms_percentiles": {
                    m: dict(zip(("p50", "p90", "p99", "max"),
                                (1e3 * np.percentile(x.decode_step_call_s, [50, 90, 99, 100])).tolist()))
                    for m, x in (("resident", r), ("offload", o))},
                "decode_step_interval_ms": {"resident": r.decode_step_interval_ms,
                                            "offload": o.decode_step_interval_ms},
                "offload_slowest_step_calls": glm53.engine.slowest_calls_ms(o.decode_step_call_s, 6),
                # The steps that also copied ring pages back, against the rest: what a copyback costs the host.
                "offload_copyback_step_call_ms": [(round(1e3 * o.decode_step_call_s[i - 1], 3), i)
                                                  for i in o.decode_copyback_steps],
                "offload_other_step_call_ms_p50": 1e3 * float(np.median(
                    [t for i, t in enumerate(o.decode_step_call_s, 1) if i not in o.decode_copyback_steps] or [0])),
                "cache_stats": o.cache_stats,
            }
            pairs.append(pair)
            print(f"[{wl} pair {p}] resident {pair['resident_decode_tok_s']:.2f} tok/s, offload "
                  f"{pair['offload_decode_tok_s']:.2f} tok/s, loss {pair['offload_loss_pct']:.2f}%, decode hit "
                  f"rate {100 * pair['decode_hit_rate']:.2f}%, tokens identical {pair['tokens_identical']}, logits "
                  f"identical {pair['logits_identical']}; TTFT {pair['resident_ttft_s']:.2f} s vs "
                  f"{pair['offload_ttft_s']:.2f} s; host loop {r.decode_host_loop_s:.3f} / {o.decode_host_loop_s:.3f} "
                  f"s, step calls {r.decode_step_calls_s:.3f} / {o.decode_step_calls_s:.3f} s; call ms percentiles "
                  f"{cli.readable(pair['decode_step_call_ms_percentiles'], 3)}; slowest offload calls (ms, step) "
                  f"{pair['offload_slowest_step_calls']}; copyback step calls (ms, step) "
                  f"{pair['offload_copyback_step_call_ms']} vs {pair['offload_other_step_call_ms_p50']:.2f} ms median "
                  "otherwise", flush=True)
        results["workloads"][wl] = pairs
        results.setdefault("summary", {})[wl] = summary = summarise(pairs)
        summary["decode_hit_rate"] = float(np.mean([p["decode_hit_rate"] for p in pairs]))
        summary["floor_pct"] = floor_pct(pairs, row_bytes, host_bw)
        summary["timed_runs_compiled"] = any(v > 0 for p in pairs for v in p["compile_s"].values())
        print(f"[{wl}] {cli.readable(summary)}", flush=True)
        if summary["timed_runs_compiled"]:
            print(f"[{wl}] WARNING: a timed run compiled ({[p['compile_s'] for p in pairs]} s): its figures include "
                  "compilation", flush=True)
        if FLAGS.out:  # after every workload, so a run cut short still leaves what it measured
            results["plot"] = plot(results, FLAGS.out.rsplit(".", 1)[0] + ".png")
            with open(FLAGS.out, "w") as f:
                json.dump(results, f, indent=2, default=str)
    if FLAGS.out:
        print(f"wrote {FLAGS.out}" + (f" and {results['plot']}" if results.get("plot") else ""))


if __name__ == "__main__":
    cli.run(main)

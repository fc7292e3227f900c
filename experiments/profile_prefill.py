"""Prefill speed, where a prefill chunk's device time goes, the model FLOPs per token and the MFU.

    python -m experiments.profile_prefill --config=configs/h200_bench.py --prompt_lens=8192,50000 \
        --out=experiments/results/profile_prefill.json

For each prompt length (``--prompt_lens``; default ``config.run.prompt_len``) an engine of one session slot with a
capacity of exactly that prompt (as ``glm53.generate`` sizes it) first compiles every step the prefill runs on a
short prompt of the same chunk shape (one chunk; offload: also the settle of the whole prompt's pages), then opens
the whole prompt, timed until the cache is ready (tokens/s; ``compile_s_during_prefill`` should be 0). The cache mode
is the config's (``--config.cache.mode=offload`` for offload's bulk reads).

Then (``--profile``) the same prompt is prefilled again under ``jax.profiler.trace`` (``--profile_chunks=N``: only
its last N chunks, at the longest history, after an untraced prefix), and every kernel of the chunk step's module
(``jit_chunk``) is summed per chunk step and attributed to a part of the model (``experiments.trace_util.PARTS``:
indexer scores, top-k, attention gather, attention math, attention projections, MoE, dense MLP, LM head, cache
writes, MTP rows, norms/residual, other, unattributed) through the compiled HLO's op_name metadata.
``--trace_dir=DIR`` keeps each length's trace (``DIR/prompt_<length>``) for TensorBoard or Perfetto; by default it is
removed once read.

FLOPs per token are counted from the config (2 per multiply-add): the weight matmuls of every main layer (attention
projections and the absorbed MLA matmuls, the indexer's projections in full-indexer layers, the dense MLP, the MoE
router and ``num_experts_per_tok`` routed + ``n_shared_experts`` shared experts), the indexer's q.k (and head
weighting) over the causal history of each position, the sparse attention over ``min(index_topk, position + 1)``
rows, and the MTP layer's KV rows that a chunk step writes (its eh_proj, kv_a and indexer key). The LM head is
counted apart (``lm_head``): a prefill chunk computes no logits, so it is not in ``flops_per_token`` nor the MFU.
MFU = FLOPs per token x prompt tokens/s / ``--peak_flops`` (the H200's dense bf16 peak by default).

With two or more lengths the chunk time is fit as ``a + b x history`` (the indexer's and, offload, the bulk read's
cost grow with the history) and the prefill time of ``--project_to`` tokens (default 1,048,576) is projected from it.
"""

import collections
import gc
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import glm53
from experiments import cli, trace_util
from experiments.trace_util import (PARTS, device_events, find_xplane, kernel_op_name, op_names_from_hlo, part_of,
                                    trace_options)
from glm53.engine import compile_seconds
from glm53.memory import device_memory
from glm53.provenance import provenance

FLAGS = flags.FLAGS
cli.define_config("configs/h200_bench.py", "experiment config")
flags.DEFINE_string("out", "", "write the results JSON here (rewritten after every prompt length)")
flags.DEFINE_list("prompt_lens", [], "prompt lengths to prefill (default: config.run.prompt_len)")
flags.DEFINE_float("peak_flops", 989e12, "accelerator peak FLOP/s for the MFU (H200 dense bf16: 989e12)")
flags.DEFINE_bool("profile", True, "trace a second prefill and split the chunk step's device time by part")
flags.DEFINE_integer("profile_chunks", 0, "chunks traced: the prompt's last N (0: every chunk of the prompt)",
                     lower_bound=0)
flags.DEFINE_integer("top", 30, "kernels listed per prompt length", lower_bound=0)
flags.DEFINE_string("trace_dir", "", trace_util.TRACE_DIR_HELP + " (a subfolder per prompt length)")
flags.DEFINE_integer("project_to", 1 << 20, "prompt length the prefill time is projected to (0: none)", lower_bound=0)

CHUNK_MODULE = "jit_chunk"  # glm53.steps names each compiled step jit_<step>


# ----------------------------------------------------------------------------------------------------------------
# FLOPs from the config
# ----------------------------------------------------------------------------------------------------------------
def _sum_positions(start: int, end: int) -> int:
    """sum of (t + 1) for t in [start, end): the causal history each position's indexer scores."""
    return (end * (end + 1) - start * (start + 1)) // 2


def _sum_min(k: int, start: int, end: int) -> int:
    """sum of min(k, t + 1) for t in [start, end): the rows each position's sparse attention reads."""
    a, b = start + 1, end
    if b < a:
        return 0
    if b <= k:
        return (a + b) * (b - a + 1) // 2
    if a > k:
        return k * (b - a + 1)
    return (a + k) * (k - a + 1) // 2 + k * (b - k)


def prefill_flops(cfg: glm53.ModelConfig, start: int, end: int) -> dict:
    """Model FLOPs (2 per multiply-add) of processing positions [start, end) of one sequence, by part. Keys match
    ``trace_util.PARTS`` where a part does arithmetic (``indexer_projections`` is timed with
    ``attention_projections``); ``lm_head`` is what logits for every position would cost (a prefill chunk computes
    none)."""
    n = end - start
    H, h = cfg.hidden_size, cfg.num_attention_heads
    qlr, kvl, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    L = cfg.num_hidden_layers
    full = sum(1 for t in cfg.indexer_types if t == "full")
    dense = min(cfg.first_k_dense_replace, L)
    moe = L - dense
    attn_w = (H * qlr + qlr * h * cfg.qk_head_dim + H * (kvl + rope) + h * v * H  # projections
              + h * nope * kvl + h * kvl * v)  # absorbed kv_b_proj: query -> latent, latent -> value heads
    idx_w = qlr * ih * idim + H * idim + H * ih
    moe_w = H * cfg.n_routed_experts + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * H * \
        cfg.moe_intermediate_size
    mtp_w = (2 * H * H + H * (kvl + rope) + H * idim) if cfg.num_nextn_predict_layers else 0
    K = cfg.index_topk
    out = {
        "attention_projections": 2 * n * L * attn_w,
        "indexer_projections": 2 * n * full * idx_w,
        # q.k per head over the history, then the per-head weighting of the scores
        "indexer_scores": 2 * full * ih * (idim + 1) * _sum_positions(start, end),
        # per head and row: latent + rope scores, then probs x latent
        "attention_math": 2 * L * h * (2 * kvl + rope) * _sum_min(K, start, end),
        "dense_mlp": 2 * n * dense * 3 * H * cfg.intermediate_size,
        "moe": 2 * n * moe * moe_w,
        "mtp": 2 * n * mtp_w,
    }
    out["total"] = sum(out.values())
    out["lm_head"] = 2 * n * H * cfg.vocab_size
    return out


# Time parts -> the FLOP parts they do.
PART_FLOPS = {"attention_projections": ("attention_projections", "indexer_projections"),
              "indexer_scores": ("indexer_scores",), "attention_math": ("attention_math",),
              "dense_mlp": ("dense_mlp",), "moe": ("moe",), "mtp": ("mtp",)}


# ----------------------------------------------------------------------------------------------------------------
# Trace summary
# ----------------------------------------------------------------------------------------------------------------
def summarise_chunks(events, op_names: dict, chunks: int, *, first_moe_layer: int, top: int) -> dict:
    """Device time of the chunk step's kernels per chunk step: by part, by kernel; busy, idle (gaps between
    kernels inside the chunk steps' window) and span."""
    chunks = max(chunks, 1)
    per_part = collections.Counter()
    per_kernel = collections.defaultdict(lambda: [0, 0.0, "", ""])
    per_module = collections.Counter()
    frontier, idle, t0, t1 = None, 0, None, None
    for name, start, dur, stats in sorted(events, key=lambda e: e[1]):
        module = str(stats.get("hlo_module", ""))
        per_module[module] += dur
        if not module.startswith(CHUNK_MODULE):
            continue
        op_name = kernel_op_name(name, str(stats.get("hlo_op", "")), op_names)
        part = part_of(name, op_name, first_moe_layer=first_moe_layer)
        per_part[part] += dur
        k = per_kernel[name]
        k[0] += 1
        k[1] += dur
        k[2], k[3] = op_name, part
        if frontier is not None and start > frontier:
            idle += start - frontier
        frontier = start + dur if frontier is None else max(frontier, start + dur)
        t0 = start if t0 is None else t0
        t1 = frontier
    busy = sum(per_part.values())
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    return {
        "chunks_profiled": chunks,
        "busy_us_per_chunk": busy / 1e3 / chunks,
        "idle_us_per_chunk": idle / 1e3 / chunks,
        "span_us_per_chunk": ((t1 - t0) / 1e3 / chunks) if t0 is not None else 0.0,
        "kernels_per_chunk": sum(v[0] for v in per_kernel.values()) / chunks,
        "per_part_us_per_chunk": {p: per_part.get(p, 0) / 1e3 / chunks for p in PARTS},
        "per_part_fraction": {p: (per_part.get(p, 0) / busy if busy else 0.0) for p in PARTS},
        "top_kernels": [{"kernel": n, "part": v[3], "op_name": v[2][-160:], "calls_per_chunk": v[0] / chunks,
                         "us_per_chunk": v[1] / 1e3 / chunks} for n, v in rows[:top]],
        "all_kernels": [[n, v[3], v[0], v[1]] for n, v in rows],  # kernel, part, calls, total ns
        "device_ms_per_module": {k: v / 1e6 for k, v in per_module.most_common(12)},
    }


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def warm_up(engine: glm53.Engine, prompt: list, rows: list) -> float:
    """Compile what a prefill of ``prompt`` runs, on its first chunk (the same chunk shape) in a session closed
    after; offload: also the settle calls that end prefills of ``rows`` rows. Returns the seconds it took."""
    t = time.perf_counter()
    sid = engine.open(prompt[: min(len(prompt), engine.chunk)])
    if engine.offload:
        try:  # engine internals: best effort (a settle compiled during the prefill shows in its compile_s)
            lanes, _ = engine._lanes([engine._session(sid).slot])
            lag = 1 if engine.cfg.num_nextn_predict_layers else 0  # the MTP layer's rows lag one position
            for pages in sorted({_next_pow2(-(-(r - lag) // engine.page_rows)) for r in rows}):
                engine._run("settle", engine.cache, lanes, pages=pages, kernels=engine.kernels)  # nothing due
        except Exception as err:  # noqa: BLE001
            print(f"settle warm-up skipped: {type(err).__name__}: {err}", flush=True)
    jax.block_until_ready(engine.cache)
    engine.close(sid)
    return time.perf_counter() - t


def chunk_hlo(model, engine: glm53.Engine, C: int) -> str:
    """The compiled chunk step's HLO text for chunks of ``C`` tokens (bulk reads in offload, as the prefill's)."""
    lanes, _ = engine._lanes([0])
    pages = glm53.offload.copy_pages_for(engine.cache_config, C) if engine.offload else 0
    return model.steps.lower("chunk", model.params, engine.cache, lanes, jnp.zeros((1, C), jnp.int32),
                             jnp.ones((1,), jnp.int32), outputs="none", kernels=engine.kernels, bulk=engine.offload,
                             copy_pages=pages).compile().as_text()


def run_length(model, cc: glm53.CacheConfig, P: int, seed: int) -> dict:
    cfg = model.config
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, P).tolist()
    engine = glm53.Engine(model, cc.replace(max_len=P), max_sessions=1)
    C = min(engine.chunk, _next_pow2(P))
    n_chunks = -(-P // C)
    res = {"prompt_len": P, "chunk": C, "chunks": n_chunks, "mode": cc.mode, "capacity": engine.capacity}
    print(f"[{P}] {n_chunks} chunks of {C} tokens, cache {cc.mode}/{cc.kv_format}: compiling on one chunk ...",
          flush=True)
    c0 = compile_seconds()
    res["warmup_s"] = warm_up(engine, prompt, [P])
    res["warmup_compile_s"] = compile_seconds() - c0

    jax.block_until_ready(engine.cache)
    c0, t = compile_seconds(), time.perf_counter()
    sid = engine.open(prompt, progress=True)
    jax.block_until_ready(engine.cache)
    dt = time.perf_counter() - t
    res.update(prefill_s=dt, tokens_per_s=P / dt, s_per_chunk=dt / n_chunks,
               compile_s_during_prefill=compile_seconds() - c0, device_memory=device_memory())
    if engine.offload:
        st = engine.stats(sid)
        res["bulk_bytes_from_host"] = st["bulk_bytes_from_host"]
        res["bulk_GBps_over_prefill"] = st["bulk_bytes_from_host"] / dt / 1e9
    flops = prefill_flops(cfg, 0, P)
    per_tok = {k: v / P for k, v in flops.items()}
    res["flops_per_token"] = per_tok
    res["achieved_tflops"] = per_tok["total"] * res["tokens_per_s"] / 1e12
    res["mfu"] = per_tok["total"] * res["tokens_per_s"] / FLAGS.peak_flops
    res["mfu_with_lm_head"] = (per_tok["total"] + per_tok["lm_head"]) * res["tokens_per_s"] / FLAGS.peak_flops
    print(f"[{P}] prefill {dt:.2f} s = {res['tokens_per_s']:,.0f} tok/s ({res['s_per_chunk'] * 1e3:.1f} ms/chunk; "
          f"compile during it {res['compile_s_during_prefill']:.2f} s); {per_tok['total'] / 1e9:.4g} GFLOP/token "
          f"-> {res['achieved_tflops']:.4g} TFLOP/s, MFU {100 * res['mfu']:.3g}% of {FLAGS.peak_flops / 1e12:.0f} "
          "TFLOP/s", flush=True)
    engine.close(sid)

    if FLAGS.profile:
        res["profile"] = profile_length(model, engine, prompt, C, n_chunks)
    del engine
    gc.collect()
    return res


def profile_length(model, engine: glm53.Engine, prompt: list, C: int, n_chunks: int) -> dict:
    cfg = model.config
    P = len(prompt)
    k = FLAGS.profile_chunks
    split = 0 if not k or k >= n_chunks else (n_chunks - k) * C
    if split and P - split < C:  # the traced part must keep the chunk shape
        split -= C
    hlo = chunk_hlo(model, engine, C)
    op_names = op_names_from_hlo(hlo, infer=True)
    sid = engine.open(prompt[:split]) if split else None
    jax.block_until_ready(engine.cache)
    with trace_util.trace_folder(FLAGS.trace_dir, f"prompt_{P}") as logdir:
        t = time.perf_counter()
        with jax.profiler.trace(logdir, profiler_options=trace_options()):
            if sid is None:
                sid = engine.open(prompt)
            else:
                engine.append(sid, prompt[split:])
            jax.block_until_ready(engine.cache)
        wall = time.perf_counter() - t
        events = device_events(find_xplane(logdir))
    engine.close(sid)
    traced = -(-(P - split) // C)
    summary = summarise_chunks(events, op_names, traced, first_moe_layer=cfg.first_k_dense_replace, top=FLAGS.top)
    summary["positions_profiled"] = [split, P]
    summary["wall_s_while_traced"] = wall
    flops = prefill_flops(cfg, split, P)
    part_ns = {p: summary["per_part_us_per_chunk"][p] * 1e3 * traced for p in PARTS}
    summary["part_tflops"] = {
        p: (sum(flops[f] for f in fs) / (part_ns[p] * 1e-9) / 1e12 if part_ns[p] else None)
        for p, fs in PART_FLOPS.items()}
    busy_s = summary["busy_us_per_chunk"] * 1e-6 * traced
    summary["busy_tflops"] = flops["total"] / busy_s / 1e12 if busy_s else None
    print(f"[{P}] chunk step (device, {traced} chunks traced from position {split}): busy "
          f"{summary['busy_us_per_chunk'] / 1e3:.2f} ms, idle {summary['idle_us_per_chunk'] / 1e3:.2f} ms, span "
          f"{summary['span_us_per_chunk'] / 1e3:.2f} ms per chunk", flush=True)
    for p in PARTS:
        us = summary["per_part_us_per_chunk"][p]
        if us:
            tf = summary["part_tflops"].get(p)
            print(f"    {p:>22}: {us / 1e3:9.3f} ms/chunk {100 * summary['per_part_fraction'][p]:5.1f}%"
                  + (f"  {tf:8.1f} TFLOP/s" if tf else ""))
    for r in summary["top_kernels"][:15]:
        print(f"    {r['us_per_chunk'] / 1e3:9.3f} ms  x{r['calls_per_chunk']:5.1f}  {r['part']:>22}  "
              f"{r['kernel'][:60]}")
    return summary


def projection(runs: list, target: int) -> dict | None:
    """Fit the mean chunk time as a + b x (mean history of a chunk's queries) over the lengths measured; project
    the prefill of ``target`` tokens (same chunk size)."""
    pts = [(r["chunk"], r["chunks"], r["s_per_chunk"]) for r in runs]
    if len(pts) < 2 or not target or len({c for c, _, _ in pts}) != 1:
        return None
    C = pts[0][0]
    x = np.array([C * (n - 1) / 2 + C / 2 for _, n, _ in pts])  # mean over chunks of (chunk start + C / 2)
    y = np.array([s for _, _, s in pts])
    b, a = np.polyfit(x, y, 1)
    n = math.ceil(target / C)
    total = n * a + b * C * (n * (n - 1) / 2 + n / 2)
    out = {"target_tokens": target, "chunk_s_intercept": float(a), "chunk_s_per_history_token": float(b),
           "projected_prefill_s": None, "projected_tokens_per_s": None,
           "note": "linear fit of the mean chunk time against the mean history over the lengths measured; "
                   "assumes the chunk time stays linear in the history (indexer q.k, top-k, bulk reads)"}
    if b <= 0 or total <= 0:
        out["note"] = "no projection: the chunk time did not grow with the history (timing noise dominates)"
    else:
        out.update(projected_prefill_s=float(total), projected_tokens_per_s=float(target / total))
    return out


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "run.prompt_len", "run.seed") + cli.cache_fields_but(c, "max_len"),
        "experiments.profile_prefill prefills one session on one device, its capacity each prompt's length (it reads "
        "config.model, seed, dtype, run.{prompt_len,seed} and cache but its max_len; --prompt_lens over "
        "run.prompt_len)")
    try:
        trace_util.check_trace_dir(FLAGS.trace_dir)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    lens = [int(x) for x in FLAGS.prompt_lens] or [int(c.run.prompt_len)]
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    results = {"config": c.to_dict(), **provenance(), "peak_flops": FLAGS.peak_flops, "prompt_lens": lens,
               "flops_definition": "2 per multiply-add; weight matmuls with routed experts counted as "
                                   "num_experts_per_tok + n_shared_experts, the absorbed MLA matmuls, the indexer's "
                                   "q.k over the causal history, sparse attention over min(index_topk, t + 1) rows, "
                                   "the MTP layer's KV-row projections; the LM head apart (prefill computes no "
                                   "logits)", "runs": []}

    def write():
        if FLAGS.out:
            os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
            tmp = FLAGS.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(results, f, indent=2, default=str)
            os.replace(tmp, FLAGS.out)

    t = time.perf_counter()
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    jax.block_until_ready(model.params)
    results["model"] = {"params": model.num_params(), "build_s": time.perf_counter() - t}
    print(model, flush=True)
    write()
    for P in lens:
        results["runs"].append(run_length(model, cc, P, c.run.seed))
        results["projection"] = projection(results["runs"], FLAGS.project_to)
        write()
    p = results.get("projection")
    if p and p["projected_prefill_s"]:
        print(f"projected prefill of {p['target_tokens']:,} tokens: {p['projected_prefill_s']:.0f} s "
              f"({p['projected_tokens_per_s']:,.0f} tok/s)", flush=True)
    if FLAGS.out:
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)

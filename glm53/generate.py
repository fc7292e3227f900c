"""``generate``: the simple front door. Opens one engine session per prompt (prefill), generates for all of them
together, and reports what it measured."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from glm53 import progress as progress_lib
from glm53.config import CacheConfig
from glm53.engine import (Engine, check_flag, check_on_token, check_sampling, check_selection_override,
                          compile_seconds, stop_token_ids)


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # generated ids per prompt (up to and including a stop token)
    logits: np.ndarray | None  # float32 [B, new_tokens, vocab] when return_logits
    time_to_first_token_s: float  # prefill of every prompt + the first sampled token (compile_s included)
    prefill_tokens_per_s: float  # prompt tokens (all prompts) / prefill time
    decode_tokens_per_s: float  # tokens generated after each prompt's first / decode time
    decode_tokens_per_s_per_session: float
    prompt_lengths: list[int]
    cache_stats: dict | None = None  # offload: hits, misses, fills, evictions, copybacks, bytes (+ "decode": after prefill)
    text: list[str] | None = None  # decoded text when the model has a tokenizer
    engine: Engine | None = None  # the engine, its sessions still open (keep_cache=True)
    # Seconds spent tracing and compiling during the call: the timing fields above include them. Run twice (or
    # warm up with the same shapes) to time without them.
    compile_s: float = 0.0
    # Where decode wall time went on the host: the whole loop (dispatching every step) and the calls of the step
    # itself. A loop that takes about the decode time means the host, not the device, set the pace; a step call
    # that takes long means it waited instead of queueing.
    decode_host_loop_s: float = 0.0
    decode_step_calls_s: float = 0.0
    decode_step_call_s: list[float] = dataclasses.field(default_factory=list)  # per step
    decode_step_call_ms: dict = dataclasses.field(default_factory=dict)  # p50 / p90 / p99 / max of those
    # The time between the host's reads of consecutive decode steps, ms (p50 / p90 / p99 / max): the token latency
    # a caller sees, where a stall shows (``glm53.engine.RunReport.step_interval_ms``).
    decode_step_interval_ms: dict = dataclasses.field(default_factory=dict)
    # How long the host waited in each read for a step's tokens, ms (p50 / p90 / p99 / max / mean): near zero, the
    # host set the pace (``glm53.engine.RunReport.step_wait_ms``).
    decode_step_wait_ms: dict = dataclasses.field(default_factory=dict)
    # Offload: the decode steps (1-based, as in decode_step_call_s[step - 1]) whose copyback wrote host pages.
    decode_copyback_steps: list[int] = dataclasses.field(default_factory=list)
    mtp: int = 0
    mtp_acceptance: list | None = None  # per draft position: accepted / proposed

    @property
    def cache(self):
        """The engine's final cache pytree (keep_cache=True), e.g. to inspect it."""
        return None if self.engine is None else self.engine.cache

    def summary(self) -> str:
        extra = f" (includes {self.compile_s:.1f} s of compilation)" if self.compile_s > 0.05 else ""
        mtp = ""
        if self.mtp:
            acc = ", ".join("-" if a is None else f"{a:.2f}" for a in self.mtp_acceptance or [])
            mtp = f" | MTP {self.mtp}, acceptance per draft [{acc}]"
        return (f"time to first token {self.time_to_first_token_s * 1e3:.1f} ms | prefill "
                f"{self.prefill_tokens_per_s:,.1f} tok/s | decode {self.decode_tokens_per_s:,.2f} tok/s "
                f"({self.decode_tokens_per_s_per_session:,.2f} tok/s per session){mtp}{extra}")


def _prompt_list(prompts) -> list:
    """``prompts`` as a list of prompts: a sequence of them, or a 2-D array (``[batch, tokens]``, numpy or JAX) of
    equal-length ones, row by row."""
    if hasattr(prompts, "ndim") and hasattr(prompts, "shape") and prompts.ndim == 2:
        if prompts.shape[0] == 0:
            raise ValueError(f"prompts is an empty batch (shape {tuple(prompts.shape)}): give at least one prompt")
        return list(np.asarray(prompts))
    if isinstance(prompts, str) or hasattr(prompts, "ndim") or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))):
        raise TypeError("prompts must be a list of prompts (each a list of token ids, an array or a string) or a "
                        "2-D array of them; wrap a single prompt in a list")
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts (each a list of token ids, an array or a string) or a "
                        f"2-D array of them, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    return list(prompts)


def generate(model, prompts, *, max_new_tokens: int, cache: str | CacheConfig = "resident",
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, return_logits: bool = False,
             on_token: Callable[[int, int, int], None] | None = None, stop_tokens: Sequence[int] | None = None,
             progress: bool | None = None, keep_cache: bool = False, mtp: int = 0, accept_override: int | None = None,
             kernels: str = "auto", compiler_options: Mapping | None = None,
             selection_override: Callable[[int, np.ndarray], np.ndarray] | None = None) -> GenerateResult:
    """Decode ``max_new_tokens`` tokens after each prompt.

    ``prompts``: a list of prompts, each a list of token ids, an array, or a string when the model has a tokenizer;
    lengths may differ; or a 2-D array, one prompt a row. ``cache``: "resident", "offload" or a ``CacheConfig``.
    ``temperature == 0`` is greedy. ``mtp``: MTP speculative decoding depth (0-3). ``on_token(prompt_index, step,
    token_id)`` is called for every generated token. ``stop_tokens`` defaults to the model's eos ids; a session
    stops at the first one (included). ``keep_cache=True`` keeps the engine (``result.engine``) with the sessions
    open. ``compiler_options``: XLA options for the engine's steps (``Engine``). ``progress``: bars over the
    prefills and the decode (True: at once; the default None: once a part has run 2 s, ``glm53.progress``; False:
    none).

    Benchmarks only: ``selection_override(step, positions) -> [B, K]`` replaces the DSA selection of decode steps
    (the indexer still runs, so the cost of a step is unchanged; a ``jax.Array`` result is used without host
    checks, see ``Engine.generate``); ``accept_override`` accepts that many MTP drafts
    per step whatever they are.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sampling(mtp, temperature, top_p, seed, accept_override, has_mtp=bool(model.config.num_nextn_predict_layers))
    check_flag("keep_cache", keep_cache)
    check_flag("return_logits", return_logits)
    check_selection_override(selection_override)
    # Before the prefill: the engine checks these at its generate, which comes after it (a long prefill wasted).
    check_on_token(on_token, "prompt_index, step, token")
    stop_token_ids(stop_tokens, model.config)
    progress_lib.check(progress)
    if isinstance(cache, str):
        cache_config = model.cache_config.replace(mode=cache)
    elif isinstance(cache, CacheConfig):
        cache_config = cache
    else:
        raise TypeError(f"cache must be 'resident', 'offload' or a glm53.CacheConfig, got {type(cache).__name__}")
    prompts = _prompt_list(prompts)
    toks = [model.token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
    lens = [len(t) for t in toks]
    # positions a run can write: the prompt, the new tokens, and the drafts of the last MTP step
    total = max(lens) + max_new_tokens + mtp
    model.check_length(total, f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens})"
                       + (f" + the last MTP step's {mtp} drafts" if mtp else ""))
    if cache_config.max_len and cache_config.max_len < total:
        raise ValueError(f"cache.max_len={cache_config.max_len} rows cannot hold the {total} positions this run "
                         f"needs (longest prompt {max(lens)} + {max_new_tokens} new tokens + MTP depth {mtp}); "
                         "raise cache.max_len or shorten the run")
    cc = cache_config.replace(max_len=cache_config.max_len or min(total, model.config.max_position_embeddings))
    # Pipeline micro-batches split the sessions into equal groups (Engine checks they divide its lanes): a lane
    # short of a multiple stays empty (one more slot of cache, never written).
    groups = getattr(getattr(model, "pipeline", None), "microbatches", 1)
    lanes = len(toks) if len(toks) == 1 else -(-len(toks) // groups) * groups
    engine = Engine(model, cc, max_sessions=lanes, kernels=kernels, compiler_options=compiler_options)

    # The prefill's clock runs until its steps have run, not until they are queued: ``open`` returns once they
    # are dispatched, and the rest of the prefill would otherwise land in whatever reads the device next (the
    # offload statistics below, or the first token).
    jax.block_until_ready(engine.cache)
    t0, c0 = time.perf_counter(), compile_seconds()
    sids = [engine.open(t, progress=progress) for t in toks]
    jax.block_until_ready(engine.cache)
    t_prefill, prefill_compile_s = time.perf_counter() - t0, compile_seconds() - c0
    index = {sid: i for i, sid in enumerate(sids)}
    stats0 = {sid: engine.stats(sid) for sid in sids} if engine.offload else None
    cb = None if on_token is None else (lambda sid, i, t: on_token(index[sid], i, t))
    out = engine.generate({sid: max_new_tokens for sid in sids}, mtp=mtp, temperature=temperature, top_p=top_p,
                          seed=seed, on_token=cb, stop_tokens=stop_tokens, return_logits=return_logits,
                          progress=progress, selection_override=selection_override, accept_override=accept_override)
    run = engine.last_run
    tokens = [out[sid] for sid in sids]
    logits = None
    if return_logits:
        n = max(len(t) for t in tokens)
        logits = np.zeros((len(sids), n, model.config.vocab_size), np.float32)
        for b, sid in enumerate(sids):
            logits[b, : len(run.logits[sid])] = run.logits[sid]
    stats = None
    if engine.offload:
        stats = _merge_stats([engine.stats(sid) for sid in sids])
        stats["decode"] = _decode_delta(stats, _merge_stats([stats0[sid] for sid in sids]))
        stats.update(hot_rows=engine.cache_config.hot_rows, page_rows=cc.copyback_every,
                     ring_rows=engine.cache.ring_rows)
    text = [model.tokenizer.decode(t) for t in tokens] if model.tokenizer is not None else None
    compile_s = run.compile_s + prefill_compile_s
    steady = max(run.decode_s, 1e-9)
    return GenerateResult(
        tokens=tokens, logits=logits, time_to_first_token_s=t_prefill + run.first_token_s,
        prefill_tokens_per_s=sum(lens) / max(t_prefill, 1e-9), decode_tokens_per_s=run.decode_tokens / steady,
        decode_tokens_per_s_per_session=run.decode_tokens / len(sids) / steady, prompt_lengths=lens,
        cache_stats=stats, text=text, engine=engine if keep_cache else None, compile_s=compile_s,
        decode_host_loop_s=run.host_loop_s, decode_step_calls_s=float(sum(run.step_call_s)),
        decode_step_call_s=list(run.step_call_s), decode_step_call_ms=run.step_call_ms,
        decode_step_interval_ms=run.step_interval_ms, decode_step_wait_ms=run.step_wait_ms,
        decode_copyback_steps=list(run.copyback_steps), mtp=mtp,
        mtp_acceptance=run.acceptance if mtp else None)


_SUMMED = ("hits", "misses", "ring_reads", "fills", "evictions", "bytes_from_host", "bulk_bytes_from_host",
           "copybacks", "bytes_to_host")


def _merge_stats(stats: list) -> dict:
    """Counters of several sessions, summed (per layer too)."""
    out = {k: sum(s[k] for s in stats) for k in _SUMMED}
    per = {}
    for k in stats[0]["per_layer"]:
        if k == "hit_rate":
            continue
        per[k] = [sum(v) for v in zip(*(s["per_layer"][k] for s in stats))]
    looked = [h + m for h, m in zip(per["hits"], per["misses"])]
    per["hit_rate"] = [h / n if n else None for h, n in zip(per["hits"], looked)]
    out["per_layer"] = per
    n = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / n if n else None
    return out


def _decode_delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in _SUMMED}
    n = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / n if n else None
    return d

"""``generate``: chunked prefill of a batch of prompts, then one jitted decode step per token."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from glm53 import cache as kvcache
from glm53 import offload
from glm53.config import CacheConfig
from glm53.steps import sample

_sample = jax.jit(sample, static_argnames=("greedy",))


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # generated ids per prompt (up to and including a stop token)
    logits: np.ndarray | None  # float32 [B, new_tokens, vocab] when return_logits
    time_to_first_token_s: float  # prefill of every prompt + the first sampled token
    prefill_tokens_per_s: float  # prompt tokens (all prompts) / prefill time
    decode_tokens_per_s: float  # tokens generated after the first (all prompts) / decode time
    decode_tokens_per_s_per_session: float
    prompt_lengths: list[int]
    cache_stats: dict | None = None  # offload mode: per-layer hits, misses, fills, evictions, copybacks, bytes
    text: list[str] | None = None  # decoded text when the model has a tokenizer
    cache: kvcache.KVCache | None = None  # the final cache (keep_cache=True), e.g. to inspect it
    # Where decode wall time went on the host: the whole loop (dispatching every step) and the calls of the step
    # itself. A loop that takes about the decode time means the host, not the device, set the pace; a step call
    # that takes long means it waited (on the device or on a transfer) instead of queueing.
    decode_host_loop_s: float = 0.0
    decode_step_calls_s: float = 0.0
    decode_step_call_s: list[float] = dataclasses.field(default_factory=list)  # per step: spikes show stalls
    # Offload: the decode steps (1-based, as in decode_step_call_s[step - 1]) after which ring pages were copied back
    # to host memory; their calls include the copyback's.
    decode_copyback_steps: list[int] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (f"time to first token {self.time_to_first_token_s * 1e3:.1f} ms | prefill "
                f"{self.prefill_tokens_per_s:,.1f} tok/s | decode {self.decode_tokens_per_s:,.2f} tok/s "
                f"({self.decode_tokens_per_s_per_session:,.2f} tok/s per session)")


def _chunk_len(longest: int, chunk: int) -> int:
    """Prefill step length: the configured chunk, or the next power of two above a shorter prompt (few shapes,
    so few compilations, and little padding)."""
    return min(chunk, 1 << max(0, (longest - 1).bit_length()))


def prefill(model, cache: kvcache.KVCache, prompts: Sequence[np.ndarray], *, all_logits: bool,
            return_hidden: bool = False, progress: bool = False, chunk: int = 256, driver=None):
    """Write every prompt into ``cache`` chunk by chunk. Returns (logits, hidden, cache): with ``all_logits`` the
    logits ``[B, T_max, V]`` of every position, else the logits ``[B, V]`` after each prompt's last token;
    ``hidden [B, T_max, H]`` when ``return_hidden``. ``driver``: the offload cache's ``glm53.offload.Driver``."""
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    longest = int(lens.max())
    C = _chunk_len(longest, chunk)
    n_chunks = -(-longest // C)
    padded = np.zeros((B, n_chunks * C), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    last_logits, all_out, hid_out = None, [], []
    for i in tqdm(range(n_chunks), desc="prefill", unit="chunk", disable=not progress, leave=False):
        n_valid = np.clip(lens - i * C, 0, C).astype(np.int32)
        if driver is not None:
            driver.before_step(n_valid)
        logits, hidden, cache = model.steps.forward(model.params, cache, jnp.asarray(padded[:, i * C:(i + 1) * C]),
                                                    jnp.asarray(n_valid), all_logits=all_logits)
        if driver is not None:  # offload: copy every completed page of this chunk to host memory
            cache = driver.after_step(cache, n_valid)
        if all_logits:
            all_out.append(logits)
        else:
            ends_here = jnp.asarray((lens > i * C) & (lens <= (i + 1) * C))
            last_logits = logits if last_logits is None else jnp.where(ends_here[:, None], logits, last_logits)
        if return_hidden:
            hid_out.append(hidden)
    out = jnp.concatenate(all_out, axis=1) if all_logits else last_logits
    hid = jnp.concatenate(hid_out, axis=1) if return_hidden else None
    return out, hid, cache


def _as_token_lists(model, prompts) -> list[np.ndarray]:
    if isinstance(prompts, (str, np.ndarray)) or (isinstance(prompts, Sequence) and prompts
                                                   and isinstance(prompts[0], (int, np.integer))):
        raise TypeError("prompts must be a list of prompts (each a list of token ids or a string); "
                        "wrap a single prompt in a list")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(f"prompt {i} is a string but the model has no tokenizer attached "
                                 "(glm53.Tokenizer.from_file(...), or from_pretrained on a directory with "
                                 "tokenizer.json)")
            p = model.tokenizer.encode(p)
        out.append(model.check_tokens(p, f"prompt {i}"))
    return out


def generate(model, prompts, *, max_new_tokens: int, cache: str | CacheConfig = "resident",
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, return_logits: bool = False,
             on_token: Callable[[int, int, int], None] | None = None, stop_tokens: Sequence[int] | None = None,
             progress: bool = False, keep_cache: bool = False,
             selection_override: Callable[[int, np.ndarray], np.ndarray] | None = None) -> GenerateResult:
    """Decode ``max_new_tokens`` tokens after each prompt.

    ``prompts``: a list of prompts, each a list of token ids (or a string when the model has a tokenizer); lengths
    may differ. ``cache``: "resident", "offload" or a ``CacheConfig``. ``temperature == 0`` is greedy.
    ``on_token(prompt_index, step, token_id)`` is called for every generated token as it is produced (this makes
    the loop wait for each token on the host). ``stop_tokens`` defaults to the model's eos ids; a session stops at
    the first one (it is included in its tokens).

    ``selection_override(step, positions)`` (benchmarks only): called before each decode step after the first
    token with the position ``[B]`` at which each session's input token is written (its query position); returns
    int ``[B, K]`` positions (K = the model's selection size) that every layer attends to instead of the indexer's
    choice. The indexer still runs; positions after a session's current one are masked, as causal attention
    requires. The default is always the indexer.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if isinstance(cache, str):
        cache_config = model.cache_config.replace(mode=cache)
    elif isinstance(cache, CacheConfig):
        cache_config = cache
    else:
        raise TypeError(f"cache must be 'resident', 'offload' or a glm53.CacheConfig, got {type(cache).__name__}")
    toks = _as_token_lists(model, prompts)
    lens = [len(p) for p in toks]
    total = max(lens) + max_new_tokens
    model.check_length(total, f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens})")
    if stop_tokens is None:
        eos = model.config.eos_token_id
        stop_tokens = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    stop = np.asarray(sorted(set(int(s) for s in stop_tokens)), np.int32)

    B = len(toks)
    kv = model.new_cache(B, total, cache_config)
    driver = offload.Driver(kv) if kv.mode == "offload" else None
    key = jax.random.key(seed)
    temp, tp = jnp.float32(temperature), jnp.float32(top_p)

    t0 = time.perf_counter()
    logits, _, kv = prefill(model, kv, toks, all_logits=False, progress=progress,
                            chunk=cache_config.prefill_chunk, driver=driver)
    greedy = temperature == 0
    first = _sample(logits, jax.random.fold_in(key, 0), temp, tp, greedy=greedy)
    first.block_until_ready()
    t1 = time.perf_counter()
    prefill_stats = None
    if kv.mode == "offload":  # counters after prefill, so decode-only figures can be told apart
        prefill_stats = offload.cache_stats(kv)
    t_decode0 = time.perf_counter()

    out_tokens, out_logits = [first], [logits] if return_logits else None
    finished = np.zeros(B, bool)

    def emit(step: int, tok_dev) -> None:
        nonlocal finished
        t = np.asarray(tok_dev)
        for b in range(B):
            if not finished[b] and on_token is not None:
                on_token(b, step, int(t[b]))
        finished |= np.isin(t, stop)

    emit(0, first)
    tok = first
    n_steps = 1
    # Tokens stay on the device; the host looks at them only when asked to (on_token) or every few steps to stop
    # early at eos, so steps are dispatched ahead of the device instead of syncing per token.
    check_every = 1 if on_token is not None else 16
    ones = np.ones(B, np.int32)
    call_times: list[float] = []
    copyback_steps: list[int] = []
    for i in range(1, max_new_tokens):
        if finished.all():
            break
        if driver is not None:
            driver.before_step(ones)
        sel = None
        if selection_override is not None:
            # decode step i writes the token sampled at step i - 1, at position len + i - 1
            sel = _checked_selection(selection_override(i, np.asarray(lens) + i - 1), B, kv, model.config)
        t_call = time.perf_counter()
        # Greedy steps ignore the key: skip deriving one (a separate dispatch and kernel every step).
        step_key = key if greedy else jax.random.fold_in(key, i)
        tok, lg, kv = model.steps.decode(model.params, kv, tok, step_key, temp, tp, sel, greedy=greedy)
        if driver is not None:
            rows_on_host = int(driver.host_len.sum())
            kv = driver.after_step(kv, ones)
            if driver.host_len.sum() != rows_on_host:
                copyback_steps.append(i)
        call_times.append(time.perf_counter() - t_call)
        out_tokens.append(tok)
        if return_logits:
            out_logits.append(lg)
        n_steps += 1
        if on_token is not None:
            emit(i, tok)
        elif i % check_every == 0 and stop.size:
            recent = np.stack([np.asarray(t) for t in out_tokens[-check_every:]], axis=1)
            finished |= np.isin(recent, stop).any(axis=1)
    t_loop = time.perf_counter()
    jax.block_until_ready(tok)
    t2 = time.perf_counter()

    all_tokens = np.stack([np.asarray(t) for t in out_tokens], axis=1)  # [B, n_steps]
    result_tokens = []
    for b in range(B):
        row = all_tokens[b].tolist()
        hits = [j for j, t in enumerate(row) if t in set(stop.tolist())]
        result_tokens.append(row[: hits[0] + 1] if hits else row)
    decode_time = max(t2 - t_decode0, 1e-9)
    decoded = B * (n_steps - 1)
    stats = None
    if kv.mode == "offload":
        stats = offload.cache_stats(kv, since=prefill_stats)
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(t) for t in result_tokens]
    return GenerateResult(
        tokens=result_tokens,
        logits=np.stack([np.asarray(l, np.float32) for l in out_logits], axis=1) if return_logits else None,
        time_to_first_token_s=t1 - t0, prefill_tokens_per_s=sum(lens) / max(t1 - t0, 1e-9),
        decode_tokens_per_s=decoded / decode_time, decode_tokens_per_s_per_session=(n_steps - 1) / decode_time,
        prompt_lengths=lens, cache_stats=stats, text=text, cache=kv if keep_cache else None,
        decode_host_loop_s=t_loop - t_decode0, decode_step_calls_s=float(sum(call_times)),
        decode_step_call_s=call_times, decode_copyback_steps=copyback_steps)


def _checked_selection(sel, B: int, kv: kvcache.KVCache, cfg) -> jax.Array:
    """Validate a benchmark's selection override: int [B, K] inside the cache. Positions after a session's
    current one are masked like any causal pick of the indexer."""
    K = min(cfg.index_topk, kv.capacity)
    arr = np.asarray(sel)
    if arr.shape != (B, K) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"selection_override must return int [{B}, {K}] positions, got {arr.dtype} {arr.shape}")
    if (arr < 0).any() or (arr >= kv.capacity).any():
        raise ValueError(f"selection_override returned positions outside [0, {kv.capacity})")
    return jnp.asarray(arr, jnp.int32)

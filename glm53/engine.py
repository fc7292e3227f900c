"""``Engine``: many long-lived sessions decoding against one cache pytree.

The engine's state is the cache pytree (``glm53.cache`` / ``glm53.offload``: every per-session array has a
leading axis of ``max_sessions`` slots) plus a small host-side session table that mirrors what each step did, so
scheduling needs no device reads. Sessions join and leave between steps; a step runs the sessions it is given as
*lanes* of a bucketed batch (powers of two up to ``max_sessions``, and ``max_sessions``), so what compiles is one
executable per (step kind, bucket, tokens per lane):

    chunk    (prefill / append)  bucket 1, T = prefill_chunk or the next power of two above a shorter input;
                                 offload: a bulk and a read-only variant (``glm53.offload``)
    decode                       each bucket, T = 1
    verify   (MTP depth D)       each bucket, T = D + 1; draft: each bucket
    lifecycle                    one each (clear, copy, truncate, pages, flush, read, write, settle)

A session's history is ``tokens``; the cache holds rows for the first ``processed`` of them. After a generate the
last sampled token is *pending* (emitted, not yet processed): the next append or generate processes it first.

Memory is counted as allocated, not as used: the cache's per-slot arrays exist for ``max_sessions`` slots from the
start (a device slot is taken or free), and offload's host pool is allocated once and handed out in pages. Every
operation that needs slots, pages or capacity checks all of it before it changes anything (``AdmissionError``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import inspect
import math
import os
import signal
import threading
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from glm53 import memory, offload, progress as progress_lib, session_io
from glm53 import steps as steps_lib
from glm53 import trace as trace_lib
from glm53.cache import Lanes, capacity_for, init_resident
from glm53.config import CacheConfig, ConfigError
from kernels_pallas import kv_formats, ops

MAX_MTP_DEPTH = memory.MAX_MTP_DEPTH  # (kept there: the step buffers' bound needs it, and memory cannot import this)
KERNEL_IMPLS = ("auto", "pallas", "reference")


class AdmissionError(RuntimeError):
    """An operation refused because it would exceed what the engine has (session slots, host pages, rows per
    slot, a budget). Nothing was changed: every session is as it was."""


# ----------------------------------------------------------------------------------------------------------------
# Compilation time: JAX reports tracing, lowering and compiling durations through jax.monitoring.
# ----------------------------------------------------------------------------------------------------------------
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]


def _on_duration(name: str, seconds: float, **_) -> None:
    if name in _COMPILE_EVENTS:
        _compile_seconds[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _bytes_per_device(tree, pinned_host: bool | None = None) -> int:
    """Bytes of a pytree's arrays on the device that holds the most of them (``pinned_host``: only arrays in /
    outside pinned host memory; None: all): a sharded array counts its shard on each of its devices, a replicated
    one all of it on each; pipeline stages hold different arrays on different devices."""
    per: dict = collections.Counter()
    for x in jax.tree_util.tree_leaves(tree):
        if pinned_host is not None and (x.sharding.memory_kind == "pinned_host") != pinned_host:
            continue
        b = int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for d in x.sharding.device_set:
            per[d] += b
    return max(per.values(), default=0)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling (all of JAX, not only glm53)."""
    return _compile_seconds[0]


def check_sampling(mtp, temperature, top_p, seed, accept_override, *, has_mtp: bool) -> None:
    """Refuse sampling settings that cannot work, before anything runs."""
    if isinstance(mtp, bool) or not isinstance(mtp, (int, np.integer)) or not 0 <= mtp <= MAX_MTP_DEPTH:
        raise ValueError(f"mtp must be an int depth in [0, {MAX_MTP_DEPTH}], got {mtp!r}")
    if mtp and not has_mtp:
        raise ValueError("mtp > 0 needs an MTP module, and this model has none (num_nextn_predict_layers=0)")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            kind = f"a {v.ndim}-D array" if hasattr(v, "ndim") else f"a {type(v).__name__}"
            raise TypeError(f"{name} must be a Python or NumPy number, got {kind} ({v!r})"
                            + (": pass float(...) of it" if getattr(v, "ndim", None) == 0 else ""))
        try:
            finite = math.isfinite(v)
        except OverflowError:  # an int past float's range
            finite = False
        if not finite:
            shown = repr(v) if len(repr(v)) <= 40 else f"{repr(v)[:12]}... ({len(repr(v))} digits)"
            raise ValueError(f"{name} must be a finite number, got {shown}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
    if accept_override is not None:
        if not mtp or isinstance(accept_override, bool) or not isinstance(accept_override, (int, np.integer)) \
                or not 0 <= accept_override <= mtp:
            raise ValueError(f"accept_override must be an int in [0, mtp={mtp}] (and needs mtp > 0), got "
                             f"{accept_override!r}")


# ----------------------------------------------------------------------------------------------------------------
# Host-side records
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Session:
    sid: int
    slot: int
    tokens: list  # the whole history: prompt, appended and generated token ids
    processed: int = 0  # rows in the cache (== device lengths[slot])
    mtp_processed: int = 0  # rows of the MTP layer (== device mtp_lengths[slot])
    host_rows: int = 0  # offload: rows in host pages (== device host_len[slot])
    hidden_valid: bool = False  # the stored hidden state is that of position processed - 1
    pages: list = dataclasses.field(default_factory=list)  # offload: pool page of each logical page (-1: none)
    sampler: dict = dataclasses.field(default_factory=lambda: {"seed": 0, "temperature": 0.0, "top_p": 1.0})
    generated: int = 0
    mtp_proposed: list = dataclasses.field(default_factory=lambda: [0] * MAX_MTP_DEPTH)
    mtp_accepted: list = dataclasses.field(default_factory=lambda: [0] * MAX_MTP_DEPTH)
    # offload: the hot cache's counters folded out of the device's int32 ones ([layers, 5] int64, offload.COUNTERS)
    counter_totals: np.ndarray | None = None
    # offload: the decode and verify steps' share of counter_totals (the rest: the chunk steps of open and append)
    decode_totals: np.ndarray | None = None

    @property
    def pending(self) -> list:
        return self.tokens[self.processed:]


@dataclasses.dataclass
class RunReport:
    """What the last ``Engine.generate`` measured (timings are host wall clock around device work)."""
    sids: list
    tokens: dict  # sid -> generated ids
    logits: dict | None  # sid -> float32 [n, V] when return_logits
    first_token_s: float  # until every session's first new token was on the host (includes any compilation)
    decode_s: float  # after that, until the last token was on the host
    decode_tokens: int  # tokens generated after each session's first
    steps: int  # decode / verify steps dispatched
    step_call_s: list  # host time of each step's call
    # When each step's outputs reached the host (perf_counter seconds), in step order: its tokens go to the sessions
    # (and ``on_token``) then, so the gaps are the token latency a caller sees (``step_interval_ms``).
    step_read_s: list
    # How long the host waited in each read for the step's outputs (the device still running it, or the transfer):
    # a host that keeps ahead of the device waits here; a host that paces the decode barely does.
    step_wait_s: list
    host_loop_s: float  # the decode loop's host time up to its last dispatch
    compile_s: float  # tracing + compilation inside this call
    decode_compile_s: float  # of it, between the first token and the last: nonzero means decode_s timed a compiler
    bucket: int
    mtp: int
    copyback_steps: list  # steps (1-based) whose copyback wrote host pages
    copy_steps: list  # steps (1-based) dispatched with the copyback in them (plain decode leaves it out where no page
    #                   can be due; a step that copies is always one of them)
    mtp_proposed: list  # per draft position: drafts verified
    mtp_accepted: list  # per draft position: drafts the verify accepted (the model's real acceptance)
    mtp_committed: list  # per draft position: drafts committed (forced ones included, after clamping to max / stop)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def acceptance(self) -> list:
        return [a / p if p else None for a, p in zip(self.mtp_accepted, self.mtp_proposed)]

    @property
    def step_call_ms(self) -> dict:
        """Host time of the step calls, ms: p50 / p90 / p99 / max ({} when no step ran)."""
        return _percentiles_ms(self.step_call_s)

    @property
    def step_wait_ms(self) -> dict:
        """The reads' waits for the device, ms: p50 / p90 / p99 / max and the mean ({} when no step ran). A median
        near zero at a step interval near the step calls says the host sets the decode's pace."""
        pct = _percentiles_ms(self.step_wait_s)
        return {**pct, "mean": 1e3 * float(np.mean(self.step_wait_s))} if pct else {}

    @property
    def step_interval_ms(self) -> dict:
        """Time between the host's reads of consecutive steps, ms: p50 / p90 / p99 / max ({} with under two steps).

        This, not ``step_call_ms``, is where a stall shows. The loop dispatches ``_Run.LAG`` steps ahead, so a host
        that keeps ahead of the device waits for it somewhere in every step, in the read or in the call (a call
        returns once XLA has launched the step's kernels, which can wait for the device's launch queue): call
        times then vary with the device's progress without the device ever waiting. A step that stalls the
        device (or a host that falls behind it) delays the read of that step and every later one."""
        return _percentiles_ms(np.diff(np.asarray(self.step_read_s)))


def slowest_calls_ms(seconds, n: int) -> list[tuple[float, int]]:
    """The ``n`` longest of a run's step calls (durations in seconds, in step order) as (ms rounded to the
    microsecond, 1-based step number), longest first: which steps a p99 is about."""
    return sorted(((round(1e3 * t, 3), i + 1) for i, t in enumerate(seconds)), reverse=True)[:n]


def _percentiles_ms(seconds) -> dict:
    """p50 / p90 / p99 / max of durations in seconds, as ms ({} when there are none)."""
    if len(seconds) == 0:
        return {}
    ms = np.asarray(seconds, np.float64) * 1e3
    return dict(zip(("p50", "p90", "p99", "max"), np.percentile(ms, [50, 90, 99, 100]).tolist()))


def check_compiler_options(options: Mapping | None, *, pipeline: bool = False) -> tuple:
    """``options`` as sorted (name, value) pairs, checked by compiling a trivial program with them: XLA names an
    unknown option or a value it cannot parse here, not at the first step's compile."""
    if not options:
        return ()
    if pipeline:
        raise ConfigError("compiler_options are not applied to pipeline stages' programs: leave them out with "
                          "mesh.stages > 1")
    if not isinstance(options, Mapping):
        raise ConfigError(f"compiler_options must be a mapping of XLA option names to values, got "
                          f"{type(options).__name__}")
    for name, value in options.items():
        if not isinstance(name, str) or not isinstance(value, (str, bool, int, float)):
            raise ConfigError(f"compiler_options: {name!r}: {value!r} is not an option name with a str, bool, int or "
                              "float value")
    pairs = tuple(sorted(options.items()))
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(pairs)).lower(np.int32(0)).compile()
    except Exception as err:  # noqa: BLE001 - XLA's own message names the option
        raise ConfigError(f"compiler_options {dict(pairs)} were refused: {err}") from None
    return pairs


def output_ring_for(platform: str, devices: int) -> int:
    """``Engine.output_ring`` for an engine on ``devices`` devices of ``platform`` in this process: ``_Run.LAG`` + 1
    on one GPU of one process, else 1 (see ``Engine.__init__``)."""
    return _Run.LAG + 1 if platform in ops.GPU_BACKENDS and devices == 1 and jax.process_count() == 1 else 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_flag(name: str, value) -> None:
    """Refuse a non-bool where True or False is asked for: a truthy "no" would do what was not asked for."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_selection_override(selection_override) -> None:
    """Refuse a ``selection_override`` that cannot be called, before anything runs (its first call comes after the
    prefill)."""
    if selection_override is not None and not callable(selection_override):
        raise TypeError(f"selection_override must be callable as selection_override(step, positions), got "
                        f"{selection_override!r}")


def check_on_token(on_token, arguments: str = "sid, index, token") -> None:
    """Refuse an ``on_token`` that cannot be called with three arguments (named ``arguments`` in the message),
    before anything runs: it is first called after the prefill."""
    if on_token is None:
        return
    if not callable(on_token):
        raise TypeError(f"on_token must be callable as on_token({arguments}), got {on_token!r}")
    try:
        signature = inspect.signature(on_token)
    except (TypeError, ValueError):  # some builtins have none: called as they are
        return
    try:
        signature.bind(0, 0, 0)
    except TypeError as e:
        raise TypeError(f"on_token must accept ({arguments}): {e}") from None


def stop_token_ids(stop_tokens, cfg) -> list[int]:
    """The sorted distinct ids of ``stop_tokens`` (None: the model's eos ids; an int; a list, tuple, set or 1-D
    array of ints), each checked to lie in the vocabulary."""
    if stop_tokens is None:
        eos = cfg.eos_token_id
        stop_tokens = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    elif isinstance(stop_tokens, (int, np.integer)) and not isinstance(stop_tokens, bool):
        stop_tokens = (stop_tokens,)
    elif isinstance(stop_tokens, np.ndarray) and stop_tokens.ndim == 1:
        stop_tokens = list(stop_tokens)
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (list, tuple, set, frozenset)) or any(
            isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in stop_tokens):
        raise TypeError(f"stop_tokens must be token ids (an int, or a list of ints), got {stop_tokens!r}")
    ids = sorted({int(t) for t in stop_tokens})
    for t in ids:
        if not 0 <= t < cfg.vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {cfg.vocab_size})")
    return ids


def _budget(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value <= 0 or value != int(value):
        raise ConfigError(f"{name} must be a whole number of bytes > 0 (or None), got {value!r}")
    return int(value)


def _saved_session(meta: dict, directory: str) -> dict:
    """The session record of a save's metadata, every field checked before a restore changes anything: a save whose
    record cannot be a session's is refused whole (its checksum already refuses one edited on disk)."""
    def bad(what):
        return session_io.SessionFileError(f"{directory}: {what}: the save is corrupted")

    def integer(key, default=None):
        v = meta.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(f"{key} is {v!r}, not an int")
        return v

    tokens = meta.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("its tokens are not a list of ints")
    n, n_mtp, generated = integer("processed"), integer("mtp_processed"), integer("generated", 0)
    # Tokens past the processed rows are pending: one sampled token, or more after an interrupted append (the
    # next generate or append processes them, as it would have in the saving engine).
    if not 0 < n <= len(tokens) or not 0 <= n_mtp <= n or generated < 0:
        raise bad(f"inconsistent lengths (processed {n}, MTP {n_mtp}, {len(tokens)} tokens, {generated} generated)")
    hidden_valid = meta.get("hidden_valid", True)
    if not isinstance(hidden_valid, bool):
        raise bad(f"hidden_valid is {hidden_valid!r}, not a bool")
    sampler = meta.get("sampler", {"seed": 0, "temperature": 0.0, "top_p": 1.0})
    if not isinstance(sampler, dict) or set(sampler) != {"seed", "temperature", "top_p"}:
        raise bad(f"the sampler record {sampler!r} is not {{seed, temperature, top_p}}")
    try:
        check_sampling(0, sampler["temperature"], sampler["top_p"], sampler["seed"], None, has_mtp=False)
    except (TypeError, ValueError) as e:
        raise bad(f"the sampler record: {e}") from None
    return {"tokens": tokens, "processed": n, "mtp_processed": n_mtp, "generated": generated,
            "hidden_valid": hidden_valid, "sampler": dict(sampler)}


# ----------------------------------------------------------------------------------------------------------------
# One call at a time; Ctrl-C at safe points
# ----------------------------------------------------------------------------------------------------------------
def _deliver_interrupt(handler) -> None:
    """What SIGINT would have done under ``handler`` (the one installed before the engine's call)."""
    if handler is signal.SIG_IGN:
        return
    if callable(handler):
        handler(signal.SIGINT, None)
    else:  # SIG_DFL, or installed outside Python: stop the call as the interpreter's own handler would
        raise KeyboardInterrupt


def _one_call_at_a_time(method):
    """An engine call runs alone, and a Ctrl-C waits for a safe point in it.

    A call made while another runs (from its ``on_token`` callback, or from another thread) is refused: the running
    call has steps in flight whose results it has not taken yet, and a rollback, append, fork or close of one of
    their sessions then would leave host and device disagreeing about it, silently.

    SIGINT during a call only sets a flag; the call raises ``KeyboardInterrupt`` at its next safe point (between two
    steps, once the last one's cache is stored and its results queued; or when the call ends): a Ctrl-C that landed
    between a step's return and the store of the cache it returned (the old one was donated to it) lost every
    session, and one that landed in a decode step's read dropped that step's tokens on the host while the device
    kept their rows (``tests/test_engine.py``). In the main thread only, where Python runs signal handlers."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if not self._call_lock.acquire(blocking=False):
            raise RuntimeError(f"Engine.{method.__name__} called while Engine.{self._running} is running (from its "
                               "on_token callback or another thread): an engine runs one call at a time, and the "
                               "running one still has steps in flight; call it once that one has returned")
        self._running = method.__name__
        deferred = threading.current_thread() is threading.main_thread()
        try:
            if deferred:
                previous = self._previous_sigint = signal.getsignal(signal.SIGINT)
                self._interrupted = []
                signal.signal(signal.SIGINT, lambda signum, frame: self._interrupted.append(signum))
            try:
                result = method(self, *args, **kwargs)
            finally:
                if deferred:
                    signal.signal(signal.SIGINT, previous)
            if deferred and self._interrupted:  # arrived after the last safe point: the call's work is whole
                self._interrupted = []
                _deliver_interrupt(previous)
            return result
        finally:
            self._interrupted = []
            self._running = None
            self._call_lock.release()

    return call


# ----------------------------------------------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------------------------------------------
class Engine:
    """Sessions of one model on its devices: one accelerator, a tensor-parallel mesh, pipeline stages, or those
    spread over several processes (the model's ``mesh`` / ``pipeline`` decide; the API is the same).

    ``Engine(model, cache=CacheConfig(...), max_sessions=8, host_budget_bytes=None, device_budget_bytes=None)``;
    ``sid = open(ids)``, ``append(sid, ids)``, ``generate({sid: n, ...}, mtp=0, ...)``, ``rollback(sid, n)``,
    ``fork(sid)``, ``save(sid, dir)`` / ``restore(dir)``, ``close(sid)``, ``memory_report()``, ``stats(sid)``.
    Token ids may be lists, numpy / JAX arrays, or strings when the model has a tokenizer.

    ``host_budget_bytes`` bounds offload's host page pool (default, and at most: every slot's full capacity, the
    most the sessions can use): the bytes of one copy of it; on a tensor-parallel mesh each of the ``tp`` devices
    keeps its own copy in its host's memory (``memory_report()["host"]["pool_replicas"]``), so one host may hold up
    to ``tp`` times this budget;
    ``device_budget_bytes`` is checked against the cache, the parameters, the largest transient buffer and the
    output rings' step buffers (``step_buffers_bound``) when the engine is built. ``kernels`` picks the Pallas
    kernels or their jnp references (``"auto"``: kernels on GPUs).
    One call runs at a time: a call made while another runs (from its ``on_token``, or another thread) is refused,
    and a Ctrl-C stops a call at its next safe point, every session consistent (``_one_call_at_a_time``).
    ``compiler_options`` (``{"xla_...": value}``) are XLA options the engine's steps compile with (``jax.jit``'s
    ``compiler_options``; not on pipeline stages): two engines of one model in one process then A/B an option with
    the same autotuned GEMMs, which two processes do not share (their greedy tokens part within tens of tokens).
    """

    def __init__(self, model, cache: CacheConfig | str | None = None, *, max_sessions: int = 1,
                 host_budget_bytes: int | None = None, device_budget_bytes: int | None = None,
                 kernels: str = "auto", compiler_options: Mapping | None = None):
        if isinstance(cache, str):
            cache = model.cache_config.replace(mode=cache)
        cc = cache or model.cache_config
        if not isinstance(cc, CacheConfig):
            raise TypeError(f"cache must be a glm53.CacheConfig or 'resident' / 'offload', got {type(cc).__name__}")
        if not isinstance(max_sessions, (int, np.integer)) or isinstance(max_sessions, bool) or max_sessions < 1:
            raise ConfigError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        if kernels not in KERNEL_IMPLS:
            raise ConfigError(f"kernels={kernels!r} unknown; choose one of {KERNEL_IMPLS}")
        host_budget_bytes = _budget("host_budget_bytes", host_budget_bytes)
        device_budget_bytes = _budget("device_budget_bytes", device_budget_bytes)
        self.model = model
        self.cfg = model.config
        self.cache_config = cc
        self.kernels = kernels
        self.max_sessions = int(max_sessions)
        self.offload = cc.mode == "offload"
        # On a mesh every array of the cache is replicated over its tensor-parallel devices, the host pool included:
        # each device holds a copy in its host memory (the owner / peer split of glm53.sharding's docstring is not
        # built yet). Pipeline stages each hold their layers' cache (glm53.pipeline).
        self.mesh = getattr(model, "mesh", None)
        self.pipeline = getattr(model, "pipeline", None)
        self.compiler_options = check_compiler_options(compiler_options, pipeline=self.pipeline is not None)
        groups = self.pipeline.microbatches if self.pipeline is not None else 1
        if self.max_sessions > 1 and self.max_sessions % groups:
            # The full bucket (max_sessions lanes) is where micro-batches pay; splitting it unevenly would compile
            # two group shapes, and falling back to whole batches would run something else than was asked for.
            # (One session cannot split: a single-session engine runs whole batches under any setting.)
            raise ConfigError(f"mesh.microbatches={groups} must divide max_sessions={self.max_sessions}: a decode "
                              f"step of {self.max_sessions} sessions splits into {groups} equal groups")
        if self.offload:
            offload.validate(self.cfg, cc)
        rows = cc.max_len or self.cfg.max_position_embeddings
        if rows > self.cfg.max_position_embeddings:
            raise ConfigError(f"cache.max_len={rows} exceeds the model's max_position_embeddings="
                              f"{self.cfg.max_position_embeddings}")
        self.capacity = capacity_for(rows, cc)
        # A hot cache with more rows than a slot's history could never fill; it would only hold device memory
        # (glm53.generate's default 32,768 rows for a 256-row run: 128x the history). It is cut to the slot's rows
        # (a power of two, at least what a round pins): every row fits either way, so nothing a step computes
        # changes. The capacity accounting counts the cache through the same function.
        cc = self.cache_config = memory.engine_cache_config(self.cfg, cc, self.capacity)
        self.max_rows = min(rows, self.capacity)
        self.page_rows = cc.copyback_every
        self.pages_per_slot = self.capacity // self.page_rows
        self.topk = min(self.cfg.index_topk, self.capacity)
        self.buckets = sorted({1 << i for i in range(max(self.max_sessions - 1, 0).bit_length())
                               if (1 << i) < self.max_sessions} | {self.max_sessions})
        self.chunk = cc.prefill_chunk
        if self.offload:
            page_bytes = offload.page_bytes(self.cfg, cc)
            if host_budget_bytes is None:
                pool_pages = self.max_sessions * self.pages_per_slot
            else:
                pool_pages = int(host_budget_bytes) // page_bytes
                if pool_pages < 1:
                    raise ConfigError(f"host_budget_bytes={host_budget_bytes} holds no page of {page_bytes} bytes "
                                      f"({cc.copyback_every} rows x {self.cfg.num_cache_layers} layers)")
                # A budget bounds the pool: pages beyond every slot's full capacity could never be used (a fork
                # shares its parent's), and the pool is allocated whole here, so a generous budget for a small
                # model (the README's 256 GiB) would allocate all of it, or fail to.
                pool_pages = min(pool_pages, self.max_sessions * self.pages_per_slot)
            self.pool_pages = pool_pages
            self.page_bytes = page_bytes
        else:
            self.pool_pages = 0
            self.page_bytes = 0
        # One slot per session: device planes a kernel could not address otherwise get padding rows, not phantom
        # slots (glm53.cache.addressable_planes). The host pool gets pages beyond the usable ones in that case
        # (glm53.memory.allocated_pages); nothing ever uses them.
        self.alloc_slots = self.max_sessions
        self.alloc_pages = (memory.allocated_pages(self.cfg, cc, self.pool_pages,
                                                   self.pipeline and self.pipeline.layer_counts)
                            if self.offload else 0)
        # Decode and verify steps called in turn from this many executables of one compilation, each writing into
        # the output buffers it wrote that many steps earlier (``Steps.ring``, ``_StepRing``): XLA then skips
        # re-recording the step's CUDA graphs, most of a call's host time and its slow tail. Only where steps
        # launch CUDA graphs, on one device of one process (the clones are loaded for that device); elsewhere 1,
        # one executable and fresh outputs. ``_Run.LAG`` + 1: the step that wrote a set of buffers has been read
        # when the set comes round again. Settable (tests run the ring on the CPU).
        platform = next(iter(jax.tree_util.tree_leaves(model.params)[0].sharding.device_set)).platform
        mesh = self.mesh if self.mesh is not None else getattr(self.pipeline, "mesh", None)
        self.output_ring = output_ring_for(platform, 1 if mesh is None else int(mesh.size))
        # A decode loop's reads poll for their step (``wait_spinning``) on GPUs, where the host thread waits most of
        # a step for the device; not on a CPU, whose cores run the steps themselves. Settable.
        self.spin_reads = platform in ops.GPU_BACKENDS
        # The device budget is checked on the configuration, before anything is allocated.
        need = self._device_need()
        if device_budget_bytes is not None and need["total"] > device_budget_bytes:
            raise AdmissionError(
                f"the engine needs {need['total']:,} device bytes, more than device_budget_bytes="
                f"{device_budget_bytes:,}: cache {need['cache']:,} ({self.max_sessions} slots x {self.capacity} rows), "
                f"parameters {need['params']:,}, largest transient buffer {need['transient']:,}, step buffers "
                f"{need['step_buffers']:,}; lower "
                "max_sessions, cache.max_len or (offload) cache.hot_rows")
        self._check_free_memory(need, mesh)
        self.device_budget_bytes = device_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.cache = self._build()
        self._inputs = steps_lib.Steps.outputs_placement(self.cache)
        self._steps: dict = {}
        self._decode_variants: set = set()  # (bucket, copy_pages) of the plain decode steps dispatched
        self._decode_buckets: set = set()  # buckets a plain decode loop has run in
        # (static, name, argument shapes, copies) -> (executables, output shapes): the rings this engine has used,
        # which the model's steps build once for every engine (``Steps.ring``)
        self._rings: dict = {}
        self._ring_buffers: dict = {}  # step name -> (argument shapes, _RingBuffers): the last loop's only
        self._free_slots = list(range(self.max_sessions))
        self._call_lock = threading.Lock()  # ``_one_call_at_a_time``
        self._running: str | None = None
        self._interrupted: list = []  # SIGINTs that arrived during the running call
        self._previous_sigint = signal.default_int_handler
        self._free_pages = collections.deque(range(self.pool_pages))
        self._refs = np.zeros(self.pool_pages, np.int64)
        self._sessions: dict[int, Session] = {}
        self._decoding: set = set()  # sessions of the generate running now: their unfolded counts are decode's
        self._next_sid = 0
        self.last_run: RunReport | None = None

    # ------------------------------------------------------------------------------------------------------------
    # construction and accounting
    # ------------------------------------------------------------------------------------------------------------
    def _build(self):
        if self.pipeline is not None:
            return self.pipeline.init_cache(self.offload, self.cache_config, self.alloc_slots, self.capacity,
                                            self.alloc_pages)
        if self.offload:
            return offload.init_offload(self.cfg, self.cache_config, self.alloc_slots, self.capacity,
                                        self.alloc_pages, self.model.dtype, mesh=self.mesh)
        return init_resident(self.cfg, self.cache_config, self.alloc_slots, self.capacity, self.model.dtype,
                             mesh=self.mesh)

    def _device_need(self) -> dict:
        if self.pipeline is not None:  # the stage with the largest cache: what one of its devices holds
            parts = self.pipeline.cache_bytes(self.cache_config, self.alloc_slots, self.capacity, self.alloc_pages)
        else:
            parts = memory.cache_bytes(self.cfg, self.cache_config, self.alloc_slots, self.capacity,
                                       self.alloc_pages, self.model.dtype)
        cache = sum(parts["device"].values())
        params = self._params_bytes()
        rings = self.step_buffers_bound()
        # offload's host pool, every copy (one per tensor-parallel device); pipeline stages' pools are not counted
        pool = (sum(parts["host"].values()) * (1 if self.mesh is None else int(self.mesh.shape["tp"]))
                if self.offload and self.pipeline is None else 0)
        return {"cache": cache, "params": params, "transient": self.transient_bytes(), "step_buffers": rings,
                "total": cache + params + self.transient_bytes() + rings, "host_pool": pool}

    def _check_free_memory(self, need: dict, mesh) -> None:
        """Refuse, before anything is allocated, an engine whose cache cannot fit in what its devices have free
        (``memory.free_memory_problem``), budget or not: a cache of many long slots otherwise failed in the
        allocator midway through the build on a GPU, or ran into the OOM killer on a CPU. ``mesh``: the engine's
        or its pipeline's (None: one device)."""
        devices = ([d for d in mesh.devices.flat if d.process_index == jax.process_index()] if mesh is not None
                   else sorted(jax.tree_util.tree_leaves(self.model.params)[0].sharding.device_set, key=str))
        problem = memory.free_memory_problem(need, need["host_pool"], devices)
        if problem:
            fix = ("lower max_sessions, cache.max_len or cache.hot_rows, or host_budget_bytes" if self.offload
                   else "lower max_sessions or cache.max_len")
            raise AdmissionError(f"{problem}; {fix}. Nothing was allocated")

    def _params_bytes(self) -> int:
        """Parameter bytes of the device holding the most: tensor parallelism splits them; pipeline stages hold
        their own (the last stage with its copy of the embedding)."""
        if self.pipeline is not None:
            return _bytes_per_device(self.pipeline.stage_params(self.model.params))
        return _bytes_per_device(self.model.params)

    def step_buffers_bound(self) -> int:
        """The most device bytes the output rings keep between generate calls (``glm53.memory.step_buffers_bytes``
        at the largest bucket); the device budget counts it."""
        return memory.step_buffers_bytes(self.cfg, self.buckets[-1], self.topk, self.output_ring)

    def transient_bytes(self) -> int:
        """The largest buffer a step creates beside the cache that grows with the history: offload's bulk read of
        one layer's history for a prefill / append chunk (one lane)."""
        if not self.offload:
            return 0
        return self.capacity * kv_formats.get_format(self.cache_config.kv_format).bytes_per_row

    def __repr__(self):
        return (f"Engine({self.cache_config.mode}/{self.cache_config.kv_format}, {len(self._sessions)}/"
                f"{self.max_sessions} sessions, {self.capacity} rows per slot"
                + (f", {len(self._free_pages)}/{self.pool_pages} free host pages" if self.offload else "") + ")")

    # ------------------------------------------------------------------------------------------------------------
    # inputs
    # ------------------------------------------------------------------------------------------------------------
    def _ids(self, ids, what: str) -> list:
        return self.model.token_ids(ids, what)

    def _session(self, sid) -> Session:
        if isinstance(sid, bool) or not isinstance(sid, (int, np.integer)):
            raise TypeError(f"session id must be an int, got {type(sid).__name__}")
        s = self._sessions.get(int(sid))
        if s is None:
            raise KeyError(f"no open session {sid} (open: {sorted(self._sessions)})")
        return s

    @property
    def sessions(self) -> list[int]:
        return sorted(self._sessions)

    def tokens(self, sid) -> list[int]:
        """The session's history: every token id it holds (the last one may not be processed yet)."""
        return list(self._session(sid).tokens)

    # ------------------------------------------------------------------------------------------------------------
    # slots and pages (host-side allocation; the device sees page tables)
    # ------------------------------------------------------------------------------------------------------------
    def _check_rows(self, rows: int, what: str) -> None:
        if rows > self.max_rows:
            raise AdmissionError(f"{what} needs {rows} rows but a session slot holds {self.max_rows} "
                                 f"(cache.max_len); nothing was changed")

    def _pages_needed(self, s: Session | None, rows: int) -> int:
        """New pool pages a session needs so that every logical page below ``rows`` has one."""
        if not self.offload:
            return 0
        have = s.pages if s is not None else []
        want = _ceil_div(rows, self.page_rows)
        return sum(1 for k in range(want) if k >= len(have) or have[k] < 0)

    def _admit(self, slots: int, pages: int, what: str) -> None:
        if slots > len(self._free_slots):
            raise AdmissionError(f"{what} needs {slots} session slot(s) but {len(self._free_slots)} of "
                                 f"{self.max_sessions} are free; close a session or build the engine with more "
                                 "max_sessions. Nothing was changed")
        if pages > len(self._free_pages):
            raise AdmissionError(
                f"{what} needs {pages} host pages ({pages * self.page_bytes:,} bytes) but {len(self._free_pages)} of "
                f"{self.pool_pages} are free (host pool {self.pool_pages * self.page_bytes:,} bytes); close or roll "
                "back sessions, or raise host_budget_bytes. Nothing was changed")

    def _assign_pages(self, s: Session, rows: int) -> bool:
        """Give ``s`` a pool page for every logical page below ``rows`` (admission checked before). Returns
        whether the page table changed."""
        if not self.offload:
            return False
        want = _ceil_div(rows, self.page_rows)
        changed = False
        while len(s.pages) < want:
            s.pages.append(-1)
        for k in range(want):
            if s.pages[k] < 0:
                p = self._free_pages.popleft()
                self._refs[p] += 1
                s.pages[k] = p
                changed = True
        return changed

    def _release_pages(self, s: Session, first: int) -> bool:
        """Drop ``s``'s references to its pages from logical page ``first`` on; a page nobody references goes back
        to the pool."""
        changed = False
        for k in range(first, len(s.pages)):
            p = s.pages[k]
            if p >= 0:
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free_pages.append(p)
                changed = True
        del s.pages[first:]
        return changed

    def _push_pages(self, s: Session) -> None:
        row = np.full(self.pages_per_slot, -1, np.int32)
        row[: len(s.pages)] = s.pages
        self._run("set_pages", self.cache, jnp.int32(s.slot), jnp.asarray(row))

    # ------------------------------------------------------------------------------------------------------------
    # running steps
    # ------------------------------------------------------------------------------------------------------------
    def _step(self, name: str):
        """The jitted step ``name`` for this engine's cache (its placement never changes)."""
        fn = self._steps.get(name)
        if fn is None:
            fn = self._steps[name] = self.model.steps.for_cache(name, self.cache, self.compiler_options)
        return fn

    def _ring_step(self, name: str, args: tuple, static: dict) -> tuple:
        """The ``output_ring`` executables of step ``name`` for these arguments (``Steps.ring``: built once per
        model, for all its engines), the shapes of their outputs and the buffers they keep (this engine's
        ``_RingBuffers``, one set for all of the step's static variants with these argument shapes). Building or
        loading the executables counts as compilation time."""
        small = jax.tree_util.tree_flatten(args[2:])
        shapes = (name, small[1], tuple((x.shape, x.dtype) for x in small[0]))
        key = (tuple(sorted(static.items())), *shapes, self.output_ring)
        ring = self._rings.get(key)
        if ring is None:
            t = time.perf_counter()
            before = compile_seconds()
            ring = self._rings[key] = self.model.steps.ring(name, self.cache, self.compiler_options, args, static,
                                                            self.output_ring)
            _compile_seconds[0] += max(time.perf_counter() - t - (compile_seconds() - before), 0.0)
        # One set of buffers per step, the last loop's: what the rings keep stays bounded (``step_buffers_bound``);
        # a loop of other shapes than the last (another bucket, stop list or depth) starts with new ones.
        kept, held = self._ring_buffers.get(name, (None, None))
        if kept != shapes or len(held.outputs) != self.output_ring:
            self._ring_buffers[name] = (shapes, _RingBuffers(self.output_ring))
        return (*ring, self._ring_buffers[name][1])

    def _run(self, name: str, *args, **kw):
        """Run a lifecycle step on the cache (donated) and keep the new cache."""
        self.cache, out = self._step(name)(*args, **kw)
        return out

    def _put(self, x, dtype=None) -> jax.Array:
        """A step input built on the host, placed where the steps put their outputs (``Steps.outputs_placement``):
        the loops feed each step the previous one's outputs, and an input placed otherwise on the first call
        compiles the step a second time."""
        value = np.asarray(x, dtype)
        if self._inputs.is_fully_addressable:
            return jax.device_put(value, self._inputs)
        # Several processes: every process holds the same host value (each runs the same session table), so the
        # array is built from it shard by shard. jax.device_put would first check that the value is equal across
        # the processes (multihost_utils.assert_equal: a cross-process all-gather for every input of every step).
        return jax.make_array_from_callback(value.shape, self._inputs, lambda index: value[index])

    def _lanes(self, slots: list) -> tuple[Lanes, int]:
        bucket = next(b for b in self.buckets if b >= len(slots))
        slot = np.zeros(bucket, np.int32)
        slot[: len(slots)] = slots
        active = np.zeros(bucket, bool)
        active[: len(slots)] = True
        return Lanes(slot=self._put(slot), active=self._put(active)), bucket

    def _chunk_steps(self, s: Session, ids: list, *, outputs: str | None = None, progress: bool | None = None):
        """Process ``ids`` (the session's unprocessed tokens) in chunk steps; returns the chunks' outputs."""
        n = len(ids)
        C = min(self.chunk, _next_pow2(n))
        lanes, _ = self._lanes([s.slot])
        pages = offload.copy_pages_for(self.cache_config, C) if self.offload else 0
        outs = []
        n_chunks = _ceil_div(n, C)
        try:
            for i in progress_lib.bar(range(n_chunks), progress=progress, desc="prefill", unit="chunk",
                                      disable=n_chunks < 2, leave=False):
                part = ids[i * C:(i + 1) * C]
                toks = np.zeros((1, C), np.int32)
                toks[0, : len(part)] = part
                committed = min(s.processed, s.mtp_processed) if self._has_mtp else s.processed
                # Bulk when the chunk's selections could touch more rows than the whole host history holds.
                bulk = self.offload and C * self.topk >= (committed // self.page_rows) * self.page_rows
                self.cache, out = self._step("chunk")(
                    self.model.params, self.cache, lanes, jnp.asarray(toks),
                    jnp.asarray([len(part)], jnp.int32), outputs=outputs or "none", kernels=self.kernels, bulk=bulk,
                    copy_pages=pages)
                start = s.processed
                s.processed += len(part)
                if self._has_mtp:
                    s.mtp_processed = max(s.mtp_processed, start - 1 + len(part))
                s.hidden_valid = True
                if outputs:
                    outs.append(out)
                self._safe_point()
        finally:
            # Interrupted or not, every page the chunks completed goes to host memory, as between any two API calls:
            # a save's flush writes only the partial page past them.
            self._settle([s])
        return outs

    @property
    def _has_mtp(self) -> bool:
        return bool(self.cfg.num_nextn_predict_layers)

    def _committed(self, s: Session) -> int:
        return min(s.processed, s.mtp_processed) if self._has_mtp else s.processed

    def _settle(self, sessions: list) -> None:
        """Offload: write every final page of these sessions to host memory (a call of its own), so between API
        calls host memory holds every complete page and the ring at most one."""
        if not self.offload:
            return
        due = [s for s in sessions if self._committed(s) // self.page_rows * self.page_rows > s.host_rows]
        if not due:
            return
        for group in self._groups(due):
            lanes, _ = self._lanes([s.slot for s in group])
            pages = max(_ceil_div(self._committed(s) - s.host_rows, self.page_rows) for s in group)
            self._run("settle", self.cache, lanes, pages=_next_pow2(pages), kernels=self.kernels)
        for s in due:
            s.host_rows = self._committed(s) // self.page_rows * self.page_rows

    def session_counters(self, sessions: list) -> np.ndarray:
        """Offload: the hot cache's counters of ``sessions``, ``[n, layers, 5]`` int64 (``offload.COUNTERS``): what
        the device counted since the last fold plus the folded totals."""
        dev = np.asarray(self.cache.counters).astype(np.int64)  # [L, S, 5]
        return np.stack([dev[:, s.slot] + self._totals(s) for s in sessions])

    def _totals(self, s: Session, part: str = "counter_totals") -> np.ndarray:
        """The session's int64 counters ``[layers, 5]``: all of them, or ``part="decode_totals"``: the decode's."""
        if getattr(s, part) is None:
            setattr(s, part, np.zeros((self.cache.num_layers, len(offload.COUNTERS)), np.int64))
        return getattr(s, part)

    def _fold_counters(self, sessions: list) -> None:
        """Move the sessions' device counters (int32, which one session's decode would overflow after ~1M tokens:
        up to index_topk lookups per layer and token) into their int64 host totals, and zero them on the device.
        Called after every generate and every ``fold_every`` steps inside one."""
        if not self.offload or not sessions:
            return
        dev = np.array(self.cache.counters)  # a copy: a CPU view would keep the donated counters from staying put
        for s in sessions:
            self._totals(s)[:] += dev[:, s.slot]
        mask = np.zeros(self.alloc_slots, bool)
        mask[[s.slot for s in sessions]] = True
        self._run("clear_counters", self.cache, jnp.asarray(mask))

    def fold_every(self, mtp: int) -> int:
        """Steps between counter folds inside a generate: a step adds at most index_topk x (mtp + 1) lookups per
        layer to a counter (its drafts, to the MTP layer's, as many again), so this keeps each below 2**30."""
        return max(1, (1 << 30) // (self.topk * 2 * (mtp + 1)))

    def _groups(self, sessions: list) -> list:
        big = self.buckets[-1]
        return [sessions[i:i + big] for i in range(0, len(sessions), big)]

    # ------------------------------------------------------------------------------------------------------------
    # public API: lifecycle
    # ------------------------------------------------------------------------------------------------------------
    @_one_call_at_a_time
    def open(self, prompt, *, progress: bool | None = None) -> int:
        """A new session holding ``prompt`` (processed now: prefill). Returns its id. ``progress``: a bar over the
        prefill's chunks (True: at once; None: once it has run 2 s, ``glm53.progress``; False: none)."""
        ids = self._ids(prompt, "prompt")
        self._check_rows(len(ids), f"a prompt of {len(ids)} tokens")
        self._admit(1, self._pages_needed(None, len(ids)), f"open (a prompt of {len(ids)} tokens)")
        s = self._new_session(ids)
        try:
            self._chunk_steps(s, ids, progress=progress)
            self._safe_point()
        except BaseException:
            self._drop(s)
            raise
        return s.sid

    def _new_session(self, ids: list) -> Session:
        slot = self._free_slots.pop(0)
        s = Session(sid=self._next_sid, slot=slot, tokens=list(ids))
        self._next_sid += 1
        self._sessions[s.sid] = s
        self._run("clear_slot", self.cache, jnp.int32(slot))
        if self._assign_pages(s, len(ids)):
            self._push_pages(s)
        return s

    def _safe_point(self) -> None:
        """Where a Ctrl-C that arrived during the call is raised (``_one_call_at_a_time``): every step dispatched so
        far has its cache stored and its results queued, so the call's cleanup leaves every session consistent."""
        if self._interrupted:
            self._interrupted = []
            _deliver_interrupt(self._previous_sigint)

    def _drop(self, s: Session) -> None:
        self._release_pages(s, 0)
        self._sessions.pop(s.sid, None)
        self._free_slots.append(s.slot)
        self._free_slots.sort()

    @_one_call_at_a_time
    def append(self, sid, token_ids, *, progress: bool | None = None) -> None:
        """Add ``token_ids`` to the session's history and process them (and a pending generated token) now
        (``progress`` as in ``open``)."""
        s = self._session(sid)
        ids = self._ids(token_ids, "token_ids")
        rows = len(s.tokens) + len(ids)
        self._check_rows(rows, f"append of {len(ids)} tokens to session {sid} ({len(s.tokens)} tokens)")
        self._admit(0, self._pages_needed(s, rows), f"append of {len(ids)} tokens to session {sid}")
        if self._assign_pages(s, rows):
            self._push_pages(s)
        s.tokens.extend(ids)
        self._chunk_steps(s, s.tokens[s.processed:], progress=progress)

    @_one_call_at_a_time
    def close(self, sid) -> None:
        """End a session: its slot is free again and its host pages go back to the pool (shared ones when their
        last holder closes)."""
        self._drop(self._session(sid))

    @_one_call_at_a_time
    def fork(self, sid, *, share_pages: bool = True) -> int:
        """A new session with the same history. Offload: the parent's host pages are shared (they are immutable
        once written); the ring, the hot cache and the indexer keys are copied on the device. ``share_pages=False``
        copies the host pages instead (benchmarks that need every session's history in its own host memory)."""
        s = self._session(sid)
        if not isinstance(share_pages, bool):
            raise TypeError(f"share_pages must be True or False, got {share_pages!r}")
        shared = s.host_rows // self.page_rows if self.offload else 0  # complete pages in host memory
        self._admit(1, 0 if share_pages else shared, f"fork of session {sid}")
        slot = self._free_slots.pop(0)
        # Its own counters, from zero as the device's (copy_slot zeroes them): replace() would share the parent's
        # totals array, and each session's lookups would then be added into both.
        child = dataclasses.replace(s, sid=self._next_sid, slot=slot, tokens=list(s.tokens), pages=[],
                                    sampler=dict(s.sampler), generated=0, mtp_proposed=[0] * MAX_MTP_DEPTH,
                                    mtp_accepted=[0] * MAX_MTP_DEPTH, counter_totals=None, decode_totals=None)
        self._next_sid += 1
        self._run("copy_slot", self.cache, jnp.int32(s.slot), jnp.int32(slot))
        if self.offload:
            if share_pages:
                child.pages = list(s.pages[:shared])
                for p in child.pages:
                    self._refs[p] += 1
            elif shared:
                self._assign_pages(child, shared * self.page_rows)
                src = jnp.asarray(s.pages[:shared], jnp.int32)
                buf = self.model.steps.read_pages(self.cache, src, kernels=self.kernels)
                self._run("write_pages", self.cache, buf, jnp.asarray(child.pages, jnp.int32), kernels=self.kernels)
            self._push_pages(child)
        self._sessions[child.sid] = child
        try:
            self._safe_point()
        except BaseException:  # a Ctrl-C during the fork: no child the caller never heard of
            self._drop(child)
            raise
        return child.sid

    @_one_call_at_a_time
    def rollback(self, sid, n_tokens: int) -> None:
        """Remove the last ``n_tokens`` tokens of the session's history (at least one token stays). Rows past the
        new end are rolled out of the cache; offload: host pages past it are released (shared ones only lose this
        session's reference) and the page holding the new end comes back into the ring."""
        s = self._session(sid)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)):
            raise TypeError(f"n_tokens must be an int, got {type(n_tokens).__name__}")
        if len(s.tokens) == 1:  # no range to offer: "between 1 and 0" read as a bug
            raise ValueError(f"rollback of {n_tokens} tokens: session {sid} holds a single token, and one must stay: "
                             "there is nothing to roll back")
        if not 1 <= n_tokens < len(s.tokens):
            raise ValueError(f"rollback of {n_tokens} tokens: session {sid} holds {len(s.tokens)}; roll back between "
                             f"1 and {len(s.tokens) - 1} (one token must stay)")
        m = len(s.tokens) - int(n_tokens)
        del s.tokens[m:]
        if m > s.processed or (m == s.processed and s.hidden_valid):
            # Only pending tokens went: the cache is untouched, and the next token comes from a pending token's
            # step or from the stored hidden state of row m - 1.
            return
        # The hidden state of position m - 1 is not stored anywhere: token m - 1 becomes pending again. This holds
        # for m == processed too when the stored state is stale (a second rollback right after one that cut rows:
        # its pending token went, and the next token would have been sampled from the hidden state of a position
        # that no longer exists).
        new = m - 1
        s.processed = new
        s.mtp_processed = min(s.mtp_processed, new)
        s.hidden_valid = False
        self._run("truncate_slot", self.cache, jnp.int32(s.slot), jnp.int32(new), jnp.int32(s.mtp_processed),
                  kernels=self.kernels)
        if self.offload:
            host = min(s.host_rows, self._committed(s) // self.page_rows * self.page_rows)
            s.host_rows = host
            if self._release_pages(s, host // self.page_rows):
                self._push_pages(s)

    # ------------------------------------------------------------------------------------------------------------
    # public API: generate
    # ------------------------------------------------------------------------------------------------------------
    @_one_call_at_a_time
    def generate(self, requests: Mapping[int, int], *, mtp: int = 0, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, on_token: Callable[[int, int, int], None] | None = None,
                 stop_tokens=None, return_logits: bool = False, progress: bool | None = None,
                 selection_override: Callable[[int, np.ndarray], np.ndarray] | None = None,
                 accept_override: int | None = None, trace=None) -> dict[int, list[int]]:
        """Generate ``requests[sid]`` new tokens for each session, all of them decoding together in one jitted
        step per token (sessions of any lengths). Returns ``{sid: [new ids]}``; ``self.last_run`` holds what was
        measured.

        ``mtp``: MTP speculative decoding depth (0-3): D drafts per step from the model's MTP module, verified in
        one step of D + 1 rows; greedy output is the same as without MTP. ``temperature == 0`` is greedy;
        ``top_p`` the nucleus mass; draws depend only on ``seed`` and the token's position, so a session's
        output does not depend on which sessions decode beside it. ``on_token(sid, i, token)`` is called for every
        new token (the host reads each step's tokens ``_Run.LAG`` steps later, so the device never waits for it);
        an exception it raises ends the call and propagates, and the steps already dispatched are still taken into
        their sessions: a session may then hold a few tokens ``on_token`` never saw (``tokens(sid)`` has them,
        ``rollback`` drops them).
        ``stop_tokens`` (default: the model's eos ids) end a session's generation (the stop token is included).
        ``return_logits``: keep every new token's logits, ``self.last_run.logits[sid]`` (float32 ``[n, vocab]``: a
        copy of each step's logits to the host). ``progress``: a tqdm bar over the new tokens
        (True: at once; None: once the decode has run 2 s; False: none).
        Benchmarks only: ``selection_override(step, positions [B]) -> [B, K]`` replaces the DSA selection
        (positions may lag the steps in flight under MTP): host arrays are checked (range, no position past its
        query, distinct rows), a ``jax.Array`` goes into the step as it is (shape and dtype checked; no host work,
        no sync: what ``experiments.workloads`` returns); ``accept_override`` accepts that many drafts per step
        whatever they are. ``trace``: a ``glm53.trace.TraceRecorder`` that records every position the steps look
        up in the hot cache, for offline policy replays (``glm53.policies``; offload engines only)."""
        reqs = self._check_generate(requests, mtp, temperature, top_p, seed, accept_override)
        check_flag("return_logits", return_logits)  # a truthy "no" kept every step's logits (a host copy each)
        check_on_token(on_token)
        progress_lib.check(progress)
        check_selection_override(selection_override)
        if trace is not None and not isinstance(trace, trace_lib.TraceRecorder):
            raise TypeError(f"trace must be a glm53.trace.TraceRecorder, got {type(trace).__name__}")
        if trace is not None and not self.offload:
            raise ConfigError("trace: record with an offload engine (mode='offload'): the selections are the same "
                              "bit for bit, and only the offload steps classify what they read")
        sessions = [self._session(sid) for sid in reqs]
        stop = self._stop_ids(stop_tokens)
        for s in sessions:  # positions it can write: its tokens, the new ones, the last step's drafts
            self._check_rows(len(s.tokens) + reqs[s.sid] + mtp,
                             f"generate of {reqs[s.sid]} tokens (MTP depth {mtp}) for session {s.sid} "
                             f"({len(s.tokens)} tokens)")
        rows = {s.sid: len(s.tokens) + reqs[s.sid] for s in sessions}  # rows that can become final
        self._admit(0, sum(self._pages_needed(s, rows[s.sid]) for s in sessions),
                    f"generate for sessions {list(reqs)}")
        before = None
        try:  # pages reserved here go back in the finally, whatever fails before or during the run
            for s in sessions:
                if self._assign_pages(s, rows[s.sid]):
                    self._push_pages(s)
                if len(s.pending) > 1:  # only after an interrupted append: process all but the last first
                    self._chunk_steps(s, s.pending[:-1])
            run = _Run(self, sessions, reqs, mtp=mtp, greedy=float(temperature) == 0.0, seed=int(seed),
                       temperature=float(temperature), top_p=float(top_p), stop=stop, on_token=on_token,
                       return_logits=return_logits, progress=progress, selection_override=selection_override,
                       accept_override=accept_override, trace=trace)
            # What the chunk steps of open / append counted is folded first, so that the run's own lookups can be
            # told apart (``stats``: "decode" and "prefill"); a prefill's per-row history reads would otherwise
            # swamp the decode's hit rate.
            self._fold_counters(sessions)
            before = [self._totals(s).copy() for s in sessions] if self.offload else None
            self._decoding = {s.sid for s in sessions}
            for s in sessions:  # what a save records as the session's sampler: the run's, once it runs
                s.sampler = {"seed": int(seed), "temperature": float(temperature), "top_p": float(top_p)}
            run.execute()
        finally:
            self._decoding = set()
            self._settle(sessions)
            self._fold_counters(sessions)
            if before is not None:
                for s, b in zip(sessions, before):
                    self._totals(s, "decode_totals")[:] += self._totals(s) - b
            for s in sessions:  # pages reserved for rows that were not generated go back
                keep = _ceil_div(len(s.tokens), self.page_rows)
                if self.offload and len(s.pages) > keep and self._release_pages(s, keep):
                    self._push_pages(s)
        self.last_run = run.report()
        return {s.sid: list(run.out[s.sid]) for s in sessions}

    def _check_generate(self, requests, mtp, temperature, top_p, seed, accept_override) -> dict[int, int]:
        if not isinstance(requests, Mapping) or not requests:
            raise TypeError("requests must be a non-empty dict {session id: max_new_tokens}")
        out = {}
        for sid, n in requests.items():
            self._session(sid)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
                raise TypeError(f"max_new_tokens for session {sid} must be an int, got {n!r}")
            if n < 1:
                raise ValueError(f"max_new_tokens for session {sid} must be >= 1, got {n}")
            out[int(sid)] = int(n)
        check_sampling(mtp, temperature, top_p, seed, accept_override, has_mtp=self._has_mtp)
        return out

    def _stop_ids(self, stop_tokens) -> jax.Array:
        ids = stop_token_ids(stop_tokens, self.cfg)
        # -1 never matches a token; a fixed length keeps one compiled shape per step.
        padded = np.full(max(8, _next_pow2(len(ids))), -1, np.int32)
        padded[: len(ids)] = ids
        return self._put(padded)

    # ------------------------------------------------------------------------------------------------------------
    # public API: save / restore
    # ------------------------------------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """What a saved session must match to be restored here: the model (config, dtype, a digest of its
        parameters) and the row format."""
        return {"model_config": self.cfg.to_hf(), "dtype": jnp.dtype(self.model.dtype).name,
                "params_digest": self.model.params_digest(), "kv_format": self.cache_config.kv_format,
                "index_keys": self.cache_config.index_keys}

    @_one_call_at_a_time
    def save(self, sid, directory: str) -> str:
        """Save a session to ``directory`` (atomic; a later save to the same directory replaces it). The flush
        barrier comes first: the partial ring page is written to host memory and the write waited for, then the
        rows in host memory are checked against the logical length. The save holds the history rows, indexer keys,
        lengths, the MTP hidden state, the tokens and the sampler settings; not the hot cache: a restored session
        starts cold. Returns the version directory written."""
        s = self._session(sid)
        if s.processed == 0:
            # Rolled back to its first token, now pending: no row to save (orbax refuses zero-size arrays, after
            # leaving a half-written version behind), and a restore needs at least one.
            raise ValueError(f"session {sid} has no processed rows to save (rolled back to its first token, which is "
                             "pending): generate or append first, or open a new session from tokens(sid). Nothing "
                             "was written")
        if self.offload:
            self._admit(0, self._pages_needed(s, s.processed), f"save of session {sid} (its partial page)")
            if self._assign_pages(s, s.processed):
                self._push_pages(s)
            self._run("flush_slot", self.cache, jnp.int32(s.slot), kernels=self.kernels)
        data = self.model.steps.read_slot(self.cache, jnp.int32(s.slot), kernels=self.kernels)
        data = jax.device_get(data)  # waits for the flush and the reads: an enqueued copy is not a completed one
        if int(data["length"]) != s.processed or (self._has_mtp and int(data["mtp_length"]) != s.mtp_processed):
            raise RuntimeError(f"session {sid}: the device holds {int(data['length'])} rows ({int(data['mtp_length'])} "
                               f"MTP rows) but the engine counted {s.processed} ({s.mtp_processed}): refusing to save "
                               "an inconsistent session")
        n = s.processed
        # The planes' values, not the bits the cache stores them as (kv_formats.stored_dtype): a save reads the same
        # whatever the storage.
        values = kv_formats.get_format(self.cache_config.kv_format).value_dtypes
        arrays = {"rows": {k: np.asarray(v[:, :n]).view(values[k]) for k, v in data["rows"].items()},
                  "index_keys": np.asarray(data["index_keys"][:, :n]).view(self.cache.index_key_dtype),
                  **({} if data["index_key_scale"] is None
                     else {"index_key_scale": np.asarray(data["index_key_scale"][:, :n])}),
                  "hidden": np.asarray(data["hidden"])}
        meta = {"fingerprint": self.fingerprint(), "tokens": list(map(int, s.tokens)), "processed": n,
                "mtp_processed": s.mtp_processed, "hidden_valid": s.hidden_valid, "sampler": dict(s.sampler),
                "generated": s.generated}
        if jax.process_count() == 1:
            return session_io.write(directory, arrays, meta)
        # Several processes: each holds the same rows (the read is replicated over the mesh); process 0 writes, to a
        # directory every process sees (a shared file system across hosts) for restore.
        path = self._agreed(lambda: session_io.write(directory, arrays, meta),
                            f"save of session {sid} to {directory} (the session is unchanged)", RuntimeError,
                            process_0_only=True)
        return path or session_io.latest(os.path.abspath(directory))

    @staticmethod
    def _agreed(action, what: str, error_type, *, process_0_only: bool = False):
        """``action()`` with several processes (``glm53.distributed``): run in every process (or only in process 0),
        then every process learns whether it failed anywhere, and all raise if it did. A process that raised alone
        would leave the others waiting forever in the next collective."""
        from jax.experimental import multihost_utils

        result, error = None, None
        if not process_0_only or jax.process_index() == 0:
            try:
                result = action()
            except Exception as e:  # every process must reach the exchange below
                error = e
        failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(-1)
        if error is not None:
            raise error
        if failed.any():
            raise error_type(f"{what}: process(es) {np.nonzero(failed)[0].tolist()} failed (their logs say why)")
        return result

    @_one_call_at_a_time
    def restore(self, directory: str) -> int:
        """A new session from a save (made by this or any engine of the same model and kv_format, in either cache
        mode, with any hot_rows). Returns its id; it continues exactly as the saved session would have."""
        if jax.process_count() == 1:
            meta, arrays = session_io.read(directory)
        else:  # every process reads the files itself, and none goes on unless all could
            meta, arrays = self._agreed(lambda: session_io.read(directory),
                                        f"{directory}: reading the save (nothing was restored)",
                                        session_io.SessionFileError)
        self._check_fingerprint(meta.get("fingerprint"), directory)
        saved = _saved_session(meta, directory)
        tokens, n, n_mtp = saved["tokens"], saved["processed"], saved["mtp_processed"]
        try:
            rows_saved = arrays["rows"]
            keys_saved, hidden = arrays["index_keys"], arrays["hidden"]
            scale_saved = arrays["index_key_scale"] if self.cache_config.index_keys == "fp8" else None
        except (KeyError, TypeError) as e:
            raise session_io.SessionFileError(f"{directory}: the save lacks the array {e}: it is corrupted") from e
        L = self.cfg.num_cache_layers
        planes = kv_formats.get_format(self.cache_config.kv_format).plane_shapes(L, n, values=True)
        for name, (shape, dt) in planes.items():
            got = rows_saved.get(name)
            if got is None or tuple(got.shape) != shape or got.dtype != dt:
                raise session_io.SessionFileError(
                    f"{directory}: row plane {name!r} is {None if got is None else (got.dtype, got.shape)}, expected "
                    f"{dt}{shape}: the save is corrupted")
        keys_want = (self.cache.index_key_dtype, (len(self.cfg.full_indexer_layers), n, self.cfg.index_head_dim))
        if not isinstance(keys_saved, np.ndarray) or (keys_saved.dtype, keys_saved.shape) != keys_want:
            raise session_io.SessionFileError(
                f"{directory}: the indexer keys are {getattr(keys_saved, 'dtype', None)}"
                f"{list(getattr(keys_saved, 'shape', []))}, expected {keys_want[0]}{list(keys_want[1])}: the save is "
                "corrupted")
        self.model.check_tokens(tokens, f"the tokens saved in {directory}")
        if n == len(tokens) and not saved["hidden_valid"]:
            # Saved by glm53 before stop 79's fix, after two rollbacks in a row: no token pending, and a stored hidden
            # state that is not row n - 1's. Restored as rollback leaves such a session now: row n - 1 dropped and
            # its token pending, so the next step computes it again.
            if n == 1:
                raise session_io.SessionFileError(
                    f"{directory}: the session's only row has no stored hidden state to continue from (saved after "
                    f"two rollbacks in a row by an older glm53): open a new session from its tokens {tokens}")
            n, n_mtp = n - 1, min(n_mtp, n - 1)
            rows_saved = {k: v[:, :n] for k, v in rows_saved.items()}
            keys_saved = keys_saved[:, :n]
            scale_saved = None if scale_saved is None else scale_saved[:, :n]
        self._check_rows(len(tokens), f"restore of a session of {len(tokens)} tokens")
        self._admit(1, self._pages_needed(None, n), f"restore of a session of {len(tokens)} tokens")
        s = self._new_session([])
        s.tokens = tokens
        try:
            if self._assign_pages(s, n):
                self._push_pages(s)
            N = self.capacity
            rows = {k: jnp.asarray(np.pad(v, ((0, 0), (0, N - n), (0, 0))).view(kv_formats.stored_dtype(v.dtype)))
                    for k, v in rows_saved.items()}
            keys = jnp.asarray(np.pad(keys_saved, ((0, 0), (0, N - n), (0, 0))).view(self.cache.index_keys.dtype))
            scale = None if scale_saved is None else jnp.asarray(np.pad(scale_saved, ((0, 0), (0, N - n)),
                                                                         constant_values=1.0))
            self._run("write_slot", self.cache, jnp.int32(s.slot), rows, keys, scale, jnp.asarray(hidden),
                      jnp.int32(n), jnp.int32(n_mtp), kernels=self.kernels)
        except BaseException:
            self._drop(s)
            raise
        s.processed, s.mtp_processed = n, n_mtp
        s.host_rows = self._committed(s) // self.page_rows * self.page_rows if self.offload else 0
        s.hidden_valid, s.sampler, s.generated = saved["hidden_valid"], saved["sampler"], saved["generated"]
        try:
            self._safe_point()
        except BaseException:  # a Ctrl-C during the restore: no session the caller never heard of
            self._drop(s)
            raise
        return s.sid

    def _check_fingerprint(self, saved, directory: str) -> None:
        if not isinstance(saved, dict):
            raise session_io.SessionFileError(f"{directory}: the save has no engine fingerprint (found "
                                              f"{type(saved).__name__}): it is corrupted")
        mine = self.fingerprint()
        diffs = []
        for key in ("kv_format", "dtype", "index_keys"):
            if saved.get(key, "model" if key == "index_keys" else None) != mine[key]:
                diffs.append(f"{key}: saved {saved.get(key)!r}, engine {mine[key]!r}")
        if saved.get("model_config") != mine["model_config"]:
            a, b = saved.get("model_config") or {}, mine["model_config"]
            fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            diffs.append("model config fields " + ", ".join(f"{k} (saved {a.get(k)!r}, engine {b.get(k)!r})"
                                                             for k in fields[:6]))
        elif saved.get("params_digest") != mine["params_digest"]:
            diffs.append("model parameters (same config, different weights)")
        if diffs:
            raise session_io.SessionFileError(f"{directory} was saved by an incompatible engine: " + "; ".join(diffs))

    # ------------------------------------------------------------------------------------------------------------
    # public API: accounting
    # ------------------------------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes allocated, per session and in total, on the device and in host memory: counted from the arrays
        the cache really holds (a session's device bytes are its slot's share of every per-slot array, allocated
        whether or not the slot is full; its host bytes are the pages it holds, a page shared by k sessions counted
        1/k to each). ``step_buffers_bytes``: what the output rings keep between generate calls (``_RingBuffers``:
        ``output_ring`` sets of the last decode and verify loops' outputs, and their fixed inputs; at most
        ``step_buffers_bound()``, which the device budget counts)."""
        # Per device: the cache is replicated over tensor-parallel devices, and split by layer over stages.
        device = _bytes_per_device(self.cache, pinned_host=False)
        host = _bytes_per_device(self.cache, pinned_host=True)
        per_slot_device = device // self.alloc_slots
        sessions = {}
        for sid, s in sorted(self._sessions.items()):
            pages = [p for p in s.pages if p >= 0]
            shared = sum(1 for p in pages if self._refs[p] > 1)
            sessions[sid] = {
                "slot": s.slot, "tokens": len(s.tokens), "rows": s.processed, "device_bytes": per_slot_device,
                "host_pages": len(pages), "shared_pages": shared,
                "host_bytes": int(sum(self.page_bytes / self._refs[p] for p in pages)),
                "host_rows_written": s.host_rows}
        used_pages = int((self._refs > 0).sum()) if self.offload else 0
        return {
            "mode": self.cache_config.mode, "kv_format": self.cache_config.kv_format,
            # On a mesh every figure is per device (the cache is replicated; parameters are this device's shards).
            "device": {"devices": 1 if self.mesh is None else int(self.mesh.size),
                       "cache_bytes": device, "per_slot_bytes": per_slot_device,
                       "params_bytes": self._params_bytes(),
                       "transient_bytes": self.transient_bytes(),
                       "step_buffers_bytes": sum(b.nbytes() for _, b in self._ring_buffers.values()),
                       "budget_bytes": self.device_budget_bytes,
                       "slots": self.max_sessions, "allocated_slots": self.alloc_slots,
                       "free_slots": len(self._free_slots)},
            "host": {"pool_bytes": host, "pool_replicas": 1 if self.mesh is None else int(self.mesh.shape["tp"]),
                     "page_bytes": self.page_bytes, "pages": self.pool_pages,
                     "allocated_pages": self.alloc_pages,
                     "used_pages": used_pages, "free_pages": len(self._free_pages),
                     "used_bytes": used_pages * self.page_bytes, "budget_bytes": self.host_budget_bytes},
            "sessions": sessions,
        }

    def stats(self, sid) -> dict:
        """Counters of one session: tokens, MTP acceptance per draft position, and (offload) hits, misses, fills,
        evictions and the bytes moved between host and device, per layer and in total; and the lookups split by
        what made them: ``"decode"`` (decode and verify steps: the hot cache at work) and ``"prefill"`` (the chunk
        steps of open and append, which past ``prefill_chunk x index_topk`` rows read each selected history row
        from host memory as a miss and fill nothing)."""
        s = self._session(sid)
        out = {"tokens": len(s.tokens), "processed": s.processed, "generated": s.generated,
               "mtp_proposed": list(s.mtp_proposed), "mtp_accepted": list(s.mtp_accepted),
               "mtp_acceptance": [a / p if p else None for a, p in zip(s.mtp_accepted, s.mtp_proposed)]}
        if self.offload:
            counters = np.asarray(self.cache.counters).astype(np.int64)  # [L, S, 5]: since the last fold
            unfolded = counters[:, s.slot].copy()
            counters[:, s.slot] += self._totals(s)
            out.update(offload.slot_stats(self.cache, s.slot, counters=counters))
            decode = self._totals(s, "decode_totals") + (unfolded if s.sid in self._decoding else 0)
            row_bytes = self.cache.fmt.bytes_per_row
            out["decode"] = offload.lookup_stats(decode, row_bytes)
            out["prefill"] = offload.lookup_stats(counters[:, s.slot] - decode, row_bytes)
            out["host_rows"] = s.host_rows
            unassigned = int(np.asarray(self.cache.unassigned)[s.slot])
            if unassigned:
                raise RuntimeError(f"session {sid}: {unassigned} pages came due with no host page assigned (an engine "
                                   "bug: their rows stayed in the ring)")
        return out

    # ------------------------------------------------------------------------------------------------------------
    # helpers for Model.forward / Model.draft
    # ------------------------------------------------------------------------------------------------------------
    def forward_outputs(self, ids: list, outputs: str, progress: bool | None = None) -> tuple[int, list]:
        """Open a session on ``ids`` and return (its id, the chunk steps' outputs)."""
        self._check_rows(len(ids), f"a sequence of {len(ids)} tokens")
        self._admit(1, self._pages_needed(None, len(ids)), "forward")
        s = self._new_session(ids)
        return s.sid, self._chunk_steps(s, ids, outputs=outputs, progress=progress)


# ----------------------------------------------------------------------------------------------------------------
# One generate call
# ----------------------------------------------------------------------------------------------------------------
def start_host_copies(*arrays) -> None:
    """Enqueue the device-to-host copies of a step's small outputs as soon as the step is dispatched: they run when
    the step ends, and the read ``_Run.LAG`` steps later finds them on the host instead of waiting for a copy of its
    own (each ``np.asarray`` of a device array is one round trip of its own, after the step). Arrays other
    processes hold shards of are left to the read."""
    for a in arrays:
        if a is not None and a.is_fully_addressable:
            a.copy_to_host_async()


def wait_spinning(x) -> None:
    """Polls until ``x`` is computed instead of blocking on it (``Engine.spin_reads``).

    On the H200 the slow step calls of a 10 x 50K MTP 3 run were the dispatching thread running slower, not waiting:
    their thread CPU time equals their wall time, with no context switch and no steal
    (``experiments/results/probes/call_jitter_50k_mtp3_2b1106b.json``), and they came in clusters whether the host
    kept two steps, one or none in flight. A thread that blocks ~7.5 ms a step in the read lets its core idle
    between calls; one that polls keeps it busy: 0 / 18 / 2 calls over 1.25x the median in three 512-call runs against
    51 / 63 / 29 blocking, interleaved in one process, the same tokens/s (the probe's own loop, a true spin that
    kept the GIL). Until stop 54 this loop slept at each poll instead (see ``_poll_pause``): in the H100 runs of
    ``call_jitter_50k_mtp3_canary_h100_f31a144.json`` the reads waited ~78% of each step, yet the whole machine was
    1.9% busy in user time, less than one polling core. With the pause that keeps the core (stop 55) the machine's
    user time is 4.8-5.0%, and the calls' p99 / median fell from 4.69 / 6.31 to 3.75 / 3.26 on an H100 host whose own
    Python spread 5.8-11.4x from median to p99 (``call_jitter_50k_mtp3_poll_h100_24d90f4.json``). On an H200 host,
    1.30 / 1.14 against 1.11 / 1.52 (``call_jitter_50k_mtp3_poll_h200_4bcd68d.json``): the host's spread decides.

    Each poll gives up the GIL but not the core (``_poll_pause``): a loop that kept the GIL would hand it to another
    Python thread only every switch interval (5 ms), and a step whose host callbacks need it
    (``glm53.roofline.probe_routing``'s) would wait that long for each."""
    if hasattr(x, "is_ready"):
        while not x.is_ready():
            _poll_pause()


# A poll's pause: sched_yield returns at once when no other thread wants this core, so the polling thread stays on
# it, and CPython lets the GIL go around the call. Until stop 54 the pause was ``time.sleep(0)``, which is no
# spin: it sleeps for the kernel's timer slack and switches context at every poll, so the thread was off its core
# most of each wait (a 2 s loop of it: 0.64 s on the CPU and 25,448 voluntary switches, against 2.0 s and none for
# sched_yield, on this project's CI machine). The polling measured against blocking reads in stop 46
# (``call_jitter_50k_mtp3_2b1106b.json``, 0 / 18 / 2 slow calls of 512 against 51 / 63 / 29) was a true spin;
# the engine's sleeping poll was what every GPU A/B since dde4f65 ran. A platform without sched_yield sleeps.
_poll_pause = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


# Step inputs copied into buffers of their own (donated, written in place): see ``_StepRing``. Updates, not
# ``lambda buf, x: x``: JAX hands an output that is an input straight back instead of writing it into ``buf``. A
# smaller ``x`` (the selection override of fewer sessions than the bucket has lanes) fills the leading rows and the
# rest is zeroed, as ``jnp.pad`` would: the pad then allocates nothing (see ``_StepRing``). Pytrees: a loop's first
# call copies all of its inputs in one dispatch, not one each (~10 calls at a loop's first step).
def _written(buf, x):
    out = jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), (0,) * x.ndim)
    # Zeroing the tail of ``buf``, not starting from zeros: a ``buf`` the computation does not read is pruned from
    # it, and its donation with it.
    return out.at[x.shape[0]:].set(0) if x.ndim and x.shape[0] < buf.shape[0] else out


@functools.partial(jax.jit, donate_argnums=0)
def _write_into(bufs, xs):
    return jax.tree_util.tree_map(_written, bufs, xs)


def _into(pairs: list) -> list:
    """Each ``(held, value)``'s value (an array or a pytree of them, or None) copied into ``held``'s buffers (None:
    new ones), all in one dispatch; the copies in order (None for a None value)."""
    writes = [(k, _zeros(value) if held is None else held, value)
              for k, (held, value) in enumerate(pairs) if value is not None]
    copies = [None] * len(pairs)
    if writes:
        for (k, _, _), c in zip(writes, _write_into([h for _, h, _ in writes], [v for _, _, v in writes])):
            copies[k] = c
    return copies


# The ring steps' inputs that a loop takes from the step before: argument index -> index in the step's outputs.
_CARRIED = {"decode": {3: 0, 4: 2},  # tokens, remaining
            "verify": {3: 3, 4: 4, 5: 5, 6: 6}}  # pending, drafts, draft_p, remaining


class _RingBuffers:
    """What a ring's executables keep between their calls and between generate calls (``Engine._ring_buffers``,
    one per step and argument shapes, shared by the step's static variants so a loop can switch between them):
    each executable's outputs (the buffers its next call writes into), its copy of the selection override, and
    the loop's fixed inputs (lanes, seed, temperature, top_p, stop ids), argument index -> buffers."""

    def __init__(self, copies: int):
        self.outputs: list = [None] * copies
        self.selections: list = [None] * copies
        self.fixed: dict = {}

    def make_missing(self, output_shapes, selection_shape) -> None:
        """Every executable's outputs and, with an override (``selection_shape``, else None), its selection buffer,
        where it has none yet."""
        for k in range(len(self.outputs)):
            if self.outputs[k] is None:
                self.outputs[k] = _zeros(output_shapes)
            if selection_shape is not None and self.selections[k] is None:
                self.selections[k] = _zeros(selection_shape)

    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves((self.outputs, self.selections, self.fixed)))


class _StepRing:
    """One loop's step calls through the engine's ring executables (``Engine.output_ring``, ``Steps.ring``): call
    k runs executable k mod N, which writes its outputs into the buffers it wrote at its last call (donated).
    Every argument an executable meets then sits where it sat at its last call, in this loop and the ones before
    (XLA then launches its CUDA graphs as recorded): the cache is donated and aliased; the inputs a step takes
    from the step before (``_CARRIED``) are the previous executable's outputs, and at a loop's first call the
    loop's own first inputs are copied into those; the selection override (the last positional argument, a new
    array every step, one row a session) is copied, padded to the bucket's lanes, into the executable's own
    buffer; the loop's other inputs into the ring's fixed ones. XLA also records the graphs again when the step's
    temporaries moved, which the allocator places anew at every call, where an array made between two calls may
    have gone: so the loops allocate nothing between two calls (the pad happens in the copy). A caller must have
    read a step's outputs before the ring comes round to its buffers (``_Run.LAG`` < N), and must not read a
    step's inputs after it (they are the outputs of the step N - 1 before the one that overwrites them)."""

    def __init__(self, engine: Engine):
        self.e = engine
        self.copies = engine.output_ring
        self.calls = 0
        self.rings: dict = {}  # (name, static) -> (executables, output shapes, _RingBuffers)
        self.fixed: dict = {}  # id(_RingBuffers) -> {argument index: its buffers}, as copied in this loop

    def __call__(self, name: str, args: list, static: dict):
        """``args``: a list the caller keeps no other reference to its entries in (the loops ``del`` their names):
        the entries copied into the ring's buffers are replaced in it, so at a loop's first call its first inputs
        are freed before the executable runs, not after: alive through that call, their allocations could sit
        where the step's temporaries go at the next calls (and a GPU record the graphs again at the next call)."""
        memo = (name, *static.items())
        ring = self.rings.get(memo)
        sel = args[-1]
        if ring is None:
            lanes = args[2].slot.shape[0]
            if sel is not None and sel.shape[0] != lanes:  # the step takes it padded to the bucket
                args[-1] = jnp.pad(sel, ((0, lanes - sel.shape[0]), (0, 0)))
            ring = self.rings[memo] = self.e._ring_step(name, tuple(args), static)
        executables, shapes, held = ring
        i = self.calls % self.copies
        carried = _CARRIED[name]
        fixed = self.fixed.get(id(held))
        first = fixed is None  # the loop's first call on these buffers
        if first:
            # Every executable's buffers are made here, before the loop calls any of them, not at each one's own
            # first call: made between two calls of a loop (the ring's third executable, first called by the third
            # step of a run after two-step runs), they went where the steps' temporaries had been, every later call
            # found its temporaries elsewhere and, on a GPU, recorded its CUDA graphs again, in that run and the
            # next (experiments/results/probes/cmdbuf_updates_ab8k_fbd74d3.json).
            held.make_missing(shapes, None if sel is None else
                              jax.ShapeDtypeStruct((args[2].slot.shape[0], *sel.shape[1:]), jnp.int32,
                                                   sharding=sel.sharding))
        fixed_args = [j for j in range(2, len(args) - 1) if j not in carried] if first else []
        carried_args = list(carried.items()) if self.calls == 0 else []
        previous = (i - 1) % self.copies
        outs = list(held.outputs[previous]) if carried_args else None
        # The selection padded here to the bucket's lanes (``_Run._selection(padded=False)``), into the executable's
        # buffer; at a loop's first call with the loop's fixed and first inputs, in the same dispatch.
        copies = _into([(held.fixed.get(j), args[j]) for j in fixed_args]
                       + [(outs[k], args[j]) for j, k in carried_args] + [(held.selections[i], sel)])
        if first:
            fixed = self.fixed[id(held)] = dict(zip(fixed_args, copies))
            held.fixed.update(fixed)
        for j, buffers in fixed.items():
            args[j] = buffers
        for (j, k), c in zip(carried_args, copies[len(fixed_args):]):
            outs[k] = args[j] = c
        if carried_args:
            held.outputs[previous] = tuple(outs)
        if sel is not None:
            held.selections[i] = args[-1] = copies[-1]
        del sel, copies
        buffers = held.outputs[i]
        held.outputs[i] = None  # donated
        self.calls += 1
        cache, outs = executables[i](*args, out_buffers=buffers)
        held.outputs[i] = outs
        return cache, outs


def _zeros(shapes):
    """Zeros shaped and placed like ``shapes`` (arrays or ``jax.ShapeDtypeStruct`` s), in buffers JAX owns: on the
    CPU ``jax.device_put`` of a numpy array may keep the numpy memory, whose donation is then declined."""
    return jax.tree_util.tree_map(lambda b: jnp.zeros(b.shape, b.dtype, device=b.sharding), shapes)


class _Run:
    """The decode loop of one ``Engine.generate``: dispatch steps ahead of the device and read each step's small
    outputs ``LAG`` steps later (the device always has the next steps queued; the host learns lengths, acceptances
    and stops with a lag of ``LAG`` steps)."""

    # Two steps queued, not one: a step's host call (argument handling and XLA's kernel launches, 1.8-3 ms at 10
    # lanes on the H200's host) is well under the device's ~5 ms step on average, but its slow tail (p90 4.4 ms,
    # p99 5.9 ms in sessions_ab_10x50k_8f038d6.json) reached the step time: with one step queued the device then
    # idled until the host caught up. A second queued step absorbs such a call. Nothing is dispatched for nothing
    # (``_dispatch_ok`` counts every step in flight), and the host learns stops a step later.
    LAG = 2

    def __init__(self, engine: Engine, sessions: list, reqs: dict, *, mtp, greedy, seed, temperature, top_p, stop,
                 on_token, return_logits, progress, selection_override, accept_override, trace=None):
        self.e = engine
        self.trace = trace  # a glm53.trace.TraceRecorder, or None (the steps then return no rounds)
        self.sessions = sessions
        self.reqs = reqs
        self.mtp, self.greedy = mtp, greedy
        self.seed = engine._put(seed, np.int32)
        self.temperature, self.top_p = engine._put(temperature, np.float32), engine._put(top_p, np.float32)
        self.stop = stop
        self.on_token = on_token
        self.return_logits = return_logits
        self.progress = progress
        self.selection_override = selection_override
        self.accept_override = accept_override
        self.lanes, self.bucket = engine._lanes([s.slot for s in sessions])
        self.copy_reads = engine.output_ring > 1 and next(iter(engine._inputs.device_set)).platform == "cpu"
        self.spin_reads = engine.spin_reads
        self.out = {s.sid: [] for s in sessions}
        self.logits = {s.sid: [] for s in sessions} if return_logits else None
        self.remaining = np.zeros(self.bucket, np.int64)
        self.remaining[: len(sessions)] = [reqs[s.sid] for s in sessions]
        self.call_s: list[float] = []
        self.read_s: list[float] = []
        self.wait_s: list[float] = []
        self.copyback_steps: list[int] = []
        self.copy_steps: list[int] = []
        self.proposed = [0] * MAX_MTP_DEPTH
        self.accepted = [0] * MAX_MTP_DEPTH
        self.committed = [0] * MAX_MTP_DEPTH
        self.steps = 0
        self.t_first = self.t_end = self.t0 = self.t_loop = 0.0
        self.compile0 = compile_seconds()
        self.decode_compile_s = 0.0
        self.decode_tokens = 0
        self.bar = None
        self.inflight: collections.deque = collections.deque()  # dispatched steps not yet read
        self.absorb = None
        self.callbacks: list = []

    # ---- emission ----
    def _emit(self, b: int, tokens, logits=None) -> None:
        """Take a lane's new tokens into its session. Callbacks are queued and run by ``_notify`` once every lane of
        the step is accounted for: a callback that raises then leaves no session half-updated."""
        s = self.sessions[b]
        for i, t in enumerate(tokens):
            t = int(t)
            self.callbacks.append((s.sid, len(self.out[s.sid]), t))
            self.out[s.sid].append(t)
            s.tokens.append(t)
            s.generated += 1
            if self.logits is not None and logits is not None:
                self.logits[s.sid].append(np.asarray(logits[i], np.float32))
        if self.bar is not None:
            self.bar.update(len(tokens))

    def _notify(self) -> None:
        calls, self.callbacks = self.callbacks, []
        if self.on_token is not None:
            for c in calls:
                self.on_token(*c)

    def _pending(self) -> np.ndarray:
        p = np.zeros(self.bucket, np.int32)
        for b, s in enumerate(self.sessions):
            p[b] = s.tokens[s.processed] if s.pending else 0
        return p

    def _selection(self, inflight: int, padded: bool = True):
        """The benchmark's DSA selection for the next step. Query positions: exact for decode (each step in flight
        adds one row to an active lane); under MTP they may lag by the steps in flight. ``padded=False``: a device
        array comes back with one row per session, for the ring to pad into its own buffer (``_StepRing``)."""
        if self.selection_override is None:
            return None
        pos = np.array([s.processed + (inflight if self.remaining[b] > inflight else 0)
                        for b, s in enumerate(self.sessions)], np.int64)
        sel = self.selection_override(self.steps + 1, pos)
        K = self.e.topk
        n = len(self.sessions)
        if isinstance(sel, jax.Array):
            # A device array goes in as it is: checking its values would sync the device at every step (the
            # benchmarks' device-side working sets, experiments.workloads.WorkingSets, are distinct by
            # construction). Shape and dtype are checked.
            if sel.shape != (n, K) or not jnp.issubdtype(sel.dtype, jnp.integer):
                raise ValueError(f"selection_override must return int [{n}, {K}] positions, got {sel.dtype} "
                                 f"{sel.shape}")
            # Under the ring every array made between two steps matters: the allocator may place it where the
            # step's temporaries were, XLA then finds them elsewhere at the next call and records the step's CUDA
            # graphs again (~1.3 ms of host time a 10-lane step, every step, on the H200: cmdbuf_updates_*.json).
            if sel.dtype != jnp.int32:
                sel = sel.astype(jnp.int32)
            return sel if n == self.bucket or not padded else jnp.pad(sel, ((0, self.bucket - n), (0, 0)))
        sel = np.asarray(sel)
        if sel.shape != (n, K) or not np.issubdtype(sel.dtype, np.integer):
            raise ValueError(f"selection_override must return int [{n}, {K}] positions, got {sel.dtype} {sel.shape}")
        if (sel < 0).any() or (sel >= self.e.capacity).any():
            raise ValueError(f"selection_override returned positions outside [0, {self.e.capacity})")
        # A query reads only rows written before it or by its own step: a later position is a row not yet written
        # (it would be read as whatever the slot last held). Under MTP the host's positions may lag: each step in
        # flight writes at most depth + 1 rows, the verify rows reach depth past the first.
        reach = pos[:n] + self.mtp * (inflight + 1)
        active = self.remaining[:n] > inflight
        late = active[:, None] & (sel > reach[:, None])
        if late.any():
            b = int(np.nonzero(late.any(axis=1))[0][0])
            raise ValueError(f"selection_override selected position {int(sel[b].max())} for session "
                             f"{self.sessions[b].sid}, whose queries this step are at most at position "
                             f"{int(reach[b])}: rows past a query are not written yet")
        # Vectorised: a per-row np.unique costs ~0.4 ms a row on a GPU machine's host, between every two steps.
        srt = np.sort(sel, axis=1)
        if (srt[:, 1:] == srt[:, :-1]).any():
            raise ValueError("selection_override must return distinct positions in each row")
        full = np.zeros((self.bucket, K), np.int32)
        full[:n] = sel
        return self.e._put(full)

    # ---- the loop ----
    def execute(self) -> None:
        e = self.e
        self.t0 = time.perf_counter()
        if self.progress is not False:
            self.bar = progress_lib.bar(progress=self.progress, total=int(self.remaining.sum()), desc="decode",
                                        unit="tok", leave=False)
        # No garbage collection while steps are dispatched: a full collection traverses every live container, the
        # sessions' token lists included (millions of entries at long histories), and stalls the host between two
        # step calls; the loop itself makes almost no reference cycles. Step-call spikes of 2-3x the median were
        # measured in both modes on the H200 (sessions_ab_10x50k_8eb8e6a.json); with this and the loop-free grouped
        # matmul they were 1.7-1.9x (sessions_ab_10x50k_43c288c.json): the two were not measured apart.
        gc_enabled = gc.isenabled()
        gc.disable()
        if self.trace is not None:
            self.trace.begin(e, self.sessions)
        try:
            self._first_tokens()
            self.t_first = time.perf_counter()
            compile_first = compile_seconds()
            if self.mtp:
                self._mtp_loop()
            else:
                self._decode_loop()
            self.t_end = time.perf_counter()
            self.decode_compile_s = compile_seconds() - compile_first
        finally:
            # If anything on the host failed mid-loop (a callback, an override), the steps already dispatched have
            # run on the device: take their tokens into the sessions, so the host table matches the cache.
            self.on_token = None
            while self.inflight:
                self.absorb(*self.inflight.popleft())
            # ``absorb`` is a bound method of this run, a reference cycle: left, the run and its device arrays (the
            # loop's inputs, the last step's outputs: 19 in a tiny engine's two generate calls) outlived the call
            # until Python's collector found them, at some point of a later call. (Not what makes a run's first
            # step calls record their CUDA graphs again on a GPU: they still did without the cycle,
            # ``experiments/results/probes/cmdbuf_updates_8k_no_cycle_ef2570b.json``.)
            self.absorb = None
            if self.trace is not None:
                self.trace.end(e, self.sessions)
            if self.bar is not None:
                self.bar.close()
            if gc_enabled:
                gc.enable()
        del e

    def _first_tokens(self) -> None:
        """Every session gets a pending token: sessions whose history ends with a processed token sample it from
        their stored hidden state (it is a new token)."""
        e = self.e
        need = [b for b, s in enumerate(self.sessions) if not s.pending]
        if not need:
            return
        lanes, _ = e._lanes([self.sessions[b].slot for b in need])
        tok, logits = e.model.steps.sample_first(e.model.params, e.cache, lanes, self.seed, self.temperature,
                                                 self.top_p, greedy=self.greedy)
        tok, logits = np.asarray(tok), (np.asarray(logits) if self.return_logits else None)
        stops = set(np.asarray(self.stop).tolist()) - {-1}
        for i, b in enumerate(need):
            self._emit(b, [tok[i]], None if logits is None else logits[i:i + 1])
            self.remaining[b] -= 1
            if int(tok[i]) in stops:
                self.remaining[b] = 0
        self._notify()

    def _dispatch_ok(self, inflight: collections.deque, absorb, tokens_per_step: int) -> bool:
        """Whether to dispatch another step. The host knows each lane's remaining count as of the last step it
        read; each step in flight emits between 1 and ``tokens_per_step`` tokens per active lane. Dispatch when some
        lane surely still needs a step; stop when none can; in between (only near the end) read the steps in
        flight first, so no step is dispatched for nothing."""
        while True:
            n = len(inflight)
            if not (self.remaining - n > 0).any():
                return False
            if (self.remaining - n * tokens_per_step > 0).any() or not n:
                return True
            while inflight:
                absorb(*inflight.popleft())

    def _record(self, rounds) -> None:
        """A step's fill rounds into the trace (``rounds`` is None when not tracing)."""
        if self.trace is not None:
            self.trace.add_step(jax.device_get(rounds), [s.sid for s in self.sessions])

    def _copybacks(self, before: list, after: list, active: np.ndarray) -> None:
        """``before`` / ``after``: the lanes' committed rows (``Engine._committed``: the MTP layer's lag included,
        as the device's ``OffloadCache.committed`` counts them) around the step being read; ``active``: which lanes
        the next step still runs. The next step writes every page those rows completed, for its active lanes only
        (a lane that stopped has its pages written by the settle after the run). The step being read is not the
        last dispatched: those still in flight came after it (``self.steps`` counts them all)."""
        P = self.e.page_rows
        if any(a // P > b // P and on for a, b, on in zip(after, before, active)):
            self.copyback_steps.append(self.steps - len(self.inflight) + 1)

    def _copy_pages(self, pages: int, copied: np.ndarray, in_flight: int) -> int:
        """The copyback pages of the next plain decode step: ``pages``, or, in a single lane's loop, 0 (a step
        compiled without the copyback) when no page can be due at its start. The copyback's bookkeeping runs whether
        a page is due or not (seven small kernels, 12.3 us of a 4.9 ms 10-lane step on the H200:
        ``profile_decode_50k_b10_drift0.001_7c8b9f2.json``), and a lane completes a page once in ``page_rows``
        steps. A plain decode step commits at most one row a lane, so the host bounds the lane's committed rows at
        the step's start by what it has read plus the steps in flight; ``copied`` bounds from below the rows in
        host memory (the device's ``host_len``), raised at every step that copies. A page that can be due gets a
        step that copies, so none waits in the ring past the step that would have written it (verify steps, which
        commit up to D + 1 rows, always copy). The first step of a bucket copies, and the variant without the
        copyback compiles only in the first decode loop of a bucket, so neither compiles later inside a timed decode.

        Only a single lane's steps go without the copyback. The host pays for switching between the two
        executables, 1.7-2.5 ms a page on the H200 however many steps copy (``probes/host_calls_exact_ffe5736.json``),
        and at 10 lanes the device sets the pace (the host waits ~1.45 ms a step for it:
        ``sessions_ab_10x50k_mtp0_902d246.json``). There every step copying ran as fast (2,061-2,087 against
        2,055-2,092 tok/s at 10 x 50K) with a lower step-call p99 / median (1.28 / 1.38 / 1.69 / 1.61 against 1.79 /
        1.63 / 1.66 / 1.82, there and in ``probes/host_calls_cmdbuf_on_24e896a.json``), and sessions whose lengths
        differ would switch at every lane's page end. A single lane keeps the copy-free steps: there the host's call
        sets the pace (``generate_8k_1024_2a6c374.json``), and it switches once a page. 2 to 8 lanes: not measured.

        A lane that commits a row every step could be bounded exactly, one copy step a page instead of 3 at ``LAG``
        2 (tried at ffe5736): the switch's cost, in one step, then set the 10-session step-call p99 (3.7-3.9 ms
        against 2.6-3.1 ms over 3 steps, the same tokens/s), so the looser bound stays."""
        e = self.e
        if self.bucket > 1:
            e._decode_variants.add((self.bucket, pages))
            return pages
        n = len(self.sessions)
        P = e.page_rows
        known = np.array([e._committed(s) for s in self.sessions], np.int64)
        live = self.remaining[:n] > 0
        may_be_due = live & ((known + in_flight) // P > copied // P)
        copy_free_ready = (self.bucket, 0) in e._decode_variants or self.bucket not in e._decode_buckets
        if may_be_due.any() or (self.bucket, pages) not in e._decode_variants or not copy_free_ready:
            e._decode_variants.add((self.bucket, pages))
            np.maximum(copied, known // P * P, out=copied)  # the copy writes every page final at the step's start
            return pages
        e._decode_variants.add((self.bucket, 0))
        return 0

    def _decode_loop(self) -> None:
        e = self.e
        fold = e.fold_every(0)
        pages = offload.copy_pages_for(e.cache_config, 1) if e.offload else 0
        copied = np.array([s.host_rows for s in self.sessions], np.int64)  # rows surely in host memory, per lane
        tokens = e._put(self._pending())
        remaining = e._put(self.remaining, np.int32)
        inflight = self.inflight = collections.deque()
        self.absorb = self._absorb_decode
        ring = self._ring()
        t_loop0 = time.perf_counter()
        while self._dispatch_ok(inflight, self._absorb_decode, 1):
            sel = self._selection(len(inflight), padded=ring is None)
            step_pages = self._copy_pages(pages, copied, len(inflight)) if pages else 0
            args = [e.model.params, e.cache, self.lanes, tokens, remaining, self.seed, self.temperature, self.top_p,
                    self.stop, sel]
            del tokens, remaining, sel  # the list holds them alone (``_StepRing.__call__``)
            static = dict(greedy=self.greedy, kernels=e.kernels, copy_pages=step_pages, trace=self.trace is not None)
            t = time.perf_counter()
            e.cache, outs = ring("decode", args, static) if ring else e._step("decode")(*args, **static)
            del args
            tokens, logits, remaining = outs[:3]
            self.call_s.append(time.perf_counter() - t)
            start_host_copies(tokens, remaining, logits if self.return_logits else None)
            self.steps += 1
            if step_pages:
                self.copy_steps.append(self.steps)
            if self.steps % fold == 0:
                e._fold_counters(self.sessions)
            # The step's input counts are the previous step's outputs, which the host has read (``_absorb_decode``):
            # under the ring their buffers are written again before this step is read.
            inflight.append((tokens, remaining, logits if self.return_logits else None, None,
                             outs[3] if len(outs) > 3 else None))
            e._safe_point()
            if len(inflight) > self.LAG:
                self._absorb_decode(*inflight.popleft())
        self.t_loop = time.perf_counter() - t_loop0
        e._decode_buckets.add(self.bucket)
        while inflight:
            self._absorb_decode(*inflight.popleft())

    def _read(self, x) -> np.ndarray:
        """A step's output on the host. Under a ring, on the CPU a copy: ``np.asarray`` there is a view of the
        device buffer, and while a view lives the ring's donation of that buffer is declined (the step then writes
        its outputs elsewhere). A GPU's ``np.asarray`` is a copy already."""
        return np.array(x) if self.copy_reads else np.asarray(x)

    def _read_step(self, x) -> np.ndarray:
        """A step's first output read, which waits for the step: polling for it under ``spin_reads``."""
        if self.spin_reads:
            wait_spinning(x)
        return self._read(x)

    def _ring(self) -> _StepRing | None:
        """This loop's calls through the engine's ring executables, or None (one executable, fresh outputs): a
        traced run's steps return their fill rounds, which the ring does not carry."""
        copies = self.e.output_ring
        if copies > 1 and copies <= self.LAG:
            raise ValueError(f"output_ring must be 1 or more than the {self.LAG} steps in flight (a step's outputs "
                             f"are read before its buffers come round again), got {copies}")
        return _StepRing(self.e) if copies > 1 and self.trace is None else None

    def _absorb_decode(self, tokens, remaining, logits, remaining_in, rounds=None) -> None:
        """``remaining_in``: what the step was given (the device's own count): a lane was active iff it was > 0.
        None: the previous step's ``remaining``, which the host read last (the plain decode loop: each step takes
        the one before it's output, and the first the host's ``self.remaining``)."""
        self._record(rounds)
        t = time.perf_counter()
        tokens = self._read_step(tokens)
        self.wait_s.append(time.perf_counter() - t)
        remaining_in = self.remaining.copy() if remaining_in is None else np.asarray(remaining_in)
        remaining = self._read(remaining)
        logits = None if logits is None else self._read(logits)
        self.read_s.append(time.perf_counter())
        before = [self.e._committed(s) for s in self.sessions]
        for b, s in enumerate(self.sessions):
            if remaining_in[b] > 0:  # the lane was active: it processed its pending token and sampled one
                s.processed += 1
                if self.e._has_mtp:
                    s.mtp_processed = max(s.mtp_processed, s.processed - 1)
                s.hidden_valid = True
                self._emit(b, [tokens[b]], None if logits is None else logits[b:b + 1])
                self.decode_tokens += 1
        self.remaining = remaining.astype(np.int64)
        self._copybacks(before, [self.e._committed(s) for s in self.sessions], self.remaining > 0)
        self._notify()

    def _mtp_loop(self) -> None:
        e = self.e
        fold = e.fold_every(self.mtp)
        pages = offload.copy_pages_for(e.cache_config, self.mtp + 1) if e.offload else 0
        # A session rolled back into its past has no stored hidden state for its pending token's predecessor:
        # one plain decode step first gives it one.
        stale = [b for b, s in enumerate(self.sessions) if not s.hidden_valid and self.remaining[b] > 0]
        if stale:
            rem = np.zeros(self.bucket, np.int32)
            rem[stale] = self.remaining[stale]
            before = self.remaining.copy()
            t = time.perf_counter()
            e.cache, outs = e._step("decode")(
                e.model.params, e.cache, self.lanes, e._put(self._pending()), e._put(rem),
                self.seed, self.temperature, self.top_p, self.stop, self._selection(0), greedy=self.greedy,
                kernels=e.kernels, copy_pages=pages, trace=self.trace is not None)
            tok, logits, rem_after = outs[:3]
            self.call_s.append(time.perf_counter() - t)  # a step like the others: call_s[k - 1] is step k's
            self.steps += 1
            if pages:
                self.copy_steps.append(self.steps)
            mask = np.zeros(self.bucket, bool)
            mask[stale] = True
            before_rem = np.where(mask, before, 0)
            rem_after = np.asarray(rem_after)
            self._absorb_decode(tok, np.where(mask, rem_after, self.remaining), logits if self.return_logits
                                else None, before_rem, outs[3] if len(outs) > 3 else None)
            # Freed now, not at the first verify call: alive through it, its 6 MB of logits (10 lanes) put that
            # call's temporaries elsewhere than the next calls', and on a GPU the first verify executable of the
            # ring recorded its CUDA graphs again at its first two calls of every run
            # (experiments/results/probes/cmdbuf_updates_8k_series_mtp3_8d78e85.json).
            del outs, tok, logits, rem_after  # (rem_after: on a CPU its numpy view holds the device buffer)
        pending = e._put(self._pending())
        e.cache, outs = e._step("draft")(
            e.model.params, e.cache, self.lanes, pending, self.seed, self.temperature, self.top_p,
            self._selection(0), depth=self.mtp, greedy=self.greedy, kernels=e.kernels, trace=self.trace is not None)
        drafts, draft_p = outs[:2]
        self._record(outs[2] if len(outs) > 2 else None)
        del outs
        remaining = e._put(self.remaining, np.int32)
        inflight = self.inflight = collections.deque()
        self.absorb = self._absorb_verify
        ring = self._ring()
        t_loop0 = time.perf_counter()
        while self._dispatch_ok(inflight, self._absorb_verify, self.mtp + 1):
            sel = self._selection(len(inflight), padded=ring is None)
            args = [e.model.params, e.cache, self.lanes, pending, drafts, draft_p, remaining, self.seed,
                    self.temperature, self.top_p, self.stop, sel]
            del pending, drafts, draft_p, remaining, sel  # the list holds them alone (``_StepRing.__call__``)
            static = dict(greedy=self.greedy, accept_override=self.accept_override, kernels=e.kernels,
                          copy_pages=pages, trace=self.trace is not None)
            t = time.perf_counter()
            e.cache, outs = ring("verify", args, static) if ring else e._step("verify")(*args, **static)
            del args
            emitted, n_emit, logits, pending, drafts, draft_p, remaining, accepted = outs[:8]
            self.call_s.append(time.perf_counter() - t)
            start_host_copies(emitted, n_emit, remaining, accepted, logits if self.return_logits else None)
            self.steps += 1
            if pages:
                self.copy_steps.append(self.steps)
            if self.steps % fold == 0:
                e._fold_counters(self.sessions)
            inflight.append((emitted, n_emit, remaining, accepted, logits if self.return_logits else None,
                             outs[8] if len(outs) > 8 else None))
            e._safe_point()
            if len(inflight) > self.LAG:
                self._absorb_verify(*inflight.popleft())
        self.t_loop = time.perf_counter() - t_loop0
        while inflight:
            self._absorb_verify(*inflight.popleft())

    def _absorb_verify(self, emitted, n_emit, remaining, accepted, logits, rounds=None) -> None:
        self._record(rounds)
        t = time.perf_counter()
        emitted = self._read_step(emitted)
        self.wait_s.append(time.perf_counter() - t)
        n_emit = self._read(n_emit)
        remaining, accepted = self._read(remaining), self._read(accepted)
        logits = None if logits is None else self._read(logits)
        self.read_s.append(time.perf_counter())
        before = [self.e._committed(s) for s in self.sessions]
        for b, s in enumerate(self.sessions):
            n = int(n_emit[b])
            if n == 0:
                continue
            s.processed += n
            if self.e._has_mtp:
                s.mtp_processed = max(s.mtp_processed, s.processed - 1)
            s.hidden_valid = True
            self._emit(b, emitted[b, :n].tolist(), None if logits is None else logits[b, :n])
            self.decode_tokens += n
            for j in range(self.mtp):
                self.proposed[j] += 1
                self.accepted[j] += int(accepted[b] > j)
                self.committed[j] += int(n - 1 > j)
                s.mtp_proposed[j] += 1
                s.mtp_accepted[j] += int(accepted[b] > j)
        self.remaining = remaining.astype(np.int64)
        self._copybacks(before, [self.e._committed(s) for s in self.sessions], self.remaining > 0)
        self._notify()

    def report(self) -> RunReport:
        logits = None
        if self.logits is not None:
            logits = {sid: (np.stack(v) if v else np.zeros((0, self.e.cfg.vocab_size), np.float32))
                      for sid, v in self.logits.items()}
        return RunReport(
            sids=[s.sid for s in self.sessions], tokens={k: list(v) for k, v in self.out.items()}, logits=logits,
            first_token_s=self.t_first - self.t0, decode_s=max(self.t_end - self.t_first, 0.0),
            decode_tokens=self.decode_tokens, steps=self.steps, step_call_s=list(self.call_s),
            step_read_s=list(self.read_s), step_wait_s=list(self.wait_s),
            host_loop_s=self.t_loop, compile_s=compile_seconds() - self.compile0,
            decode_compile_s=self.decode_compile_s, bucket=self.bucket, mtp=self.mtp,
            # a page that became final in the run's last step is written by the settle after the run
            copyback_steps=[k for k in self.copyback_steps if k <= self.steps], copy_steps=list(self.copy_steps),
            mtp_proposed=self.proposed[: self.mtp],
            mtp_accepted=self.accepted[: self.mtp], mtp_committed=self.committed[: self.mtp])

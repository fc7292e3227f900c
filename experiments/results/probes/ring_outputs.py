"""Probe: can a decode step's host call skip XLA's CUDA-graph update?

host_calls_rot*_a8c5a7a.json: a call costs ~2-3 ms of host time even with nothing in flight (``sync``), so the
update is not caused by the temporaries of steps in flight; one run of ``rot2`` (two executables in turn) called in
1.29 ms (p99 / median 1.23), the others in 1.9-3.2 ms. Hypothesis: XLA re-records a command buffer whenever any
buffer it references moved since its last launch, and a step's fresh outputs (tokens, logits, remaining) and the
previous step's outputs as inputs move at every call (the cache is donated and aliased, so it stays put).

``ring<N>``: the decode step as N separately compiled executables called in turn, each also taking its own output
buffers as donated arguments (XLA aliases each output to the donated buffer of its shape: written in place), the
buffers it wrote N steps earlier. With LAG 2 and N = 3 every executable then meets, at every call, the buffers and
(if the allocator hands back the same block) the temporaries it met at its last call. ``default``: the engine's
loop. Both without a selection override (the model's indexer), every step copying (one static variant).

``clone<N>``: the same from one compilation cloned through its serialized form (``Clones``); a ``fixed`` suffix
(``clone3fixed``): the selection override's array copied into the executable's own donated buffer before each step.
PROBE_WORKLOAD: a selection override (``local99``: a new array every step, as the A/Bs run), default none.

Env: PROBE_SESSIONS (10), PROBE_HISTORY (50000), PROBE_VARIANTS (default,ring3,ring4), PROBE_REPS (2), PROBE_TAG,
PROBE_WORKLOAD, OUT. Prints and writes one JSON record per run: call / wait / interval percentiles, tok/s, whether the outputs sat
in the donated buffers, and a hash of the tokens (equal across variants: the same program)."""
import collections
import functools
import importlib
import json
import os
import time

import jax
import numpy as np
from jax.experimental import serialize_executable

import glm53
from glm53 import engine as eng
from glm53 import offload
from glm53 import steps as steps_mod
from experiments import sessions_ab, workloads

S = int(os.environ.get("PROBE_SESSIONS", "10"))
HIST = int(os.environ.get("PROBE_HISTORY", "50000"))
NEW = int(os.environ.get("PROBE_NEW", "512"))
c = importlib.import_module("configs." + os.environ.get("PROBE_CONFIG", "h200_bench")).get_config()
c.run.prompt_len = HIST
c.cache.mode = "offload"
cc = glm53.CacheConfig.from_config_dict(c.cache)
model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
cc = cc.replace(max_len=HIST + 16 + NEW + 64)
e, sids, fig = sessions_ab.build(model, cc, c, S, suffix=16)
print(f"prefill {fig['prefill_s']:.1f} s", flush=True)

f, STATIC, _ = steps_mod.STEPS["decode"]
base = functools.partial(f, model.steps.net)


def with_outputs(params, cache, lanes, tokens, remaining, seed, temperature, top_p, stop, sel, out_buffers, **kw):
    del out_buffers  # donated (and kept, though unused): XLA writes the outputs of their shapes into them
    return base(params, cache, lanes, tokens, remaining, seed, temperature, top_p, stop, sel, **kw)


def ring_fns(n):
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, e.cache)
    return [jax.jit(steps_mod._named(with_outputs, "decode"), static_argnames=STATIC, donate_argnums=(1, 10), keep_unused=True,
                    out_shardings=(shardings, model.steps.outputs_placement(e.cache))) for _ in range(n)]


class Clones:
    """``clone<N>``: N executables from one compilation of the ring's step, cloned through its serialized form (the
    same binary, hence the same GEMM algorithms, in each: the engine's ring of 84c6a66 compiled each copy and its
    tokens differed), built at the first call."""

    def __init__(self, n):
        self.n, self.execs = n, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        def call(*args, **static):
            if self.execs is None:
                first = ring_fns(1)[0].lower(*args, **static).compile()
                payload = serialize_executable.serialize(first)
                devices = list(e._inputs.device_set)
                self.execs = [first] + [serialize_executable.deserialize_and_load(*payload, execution_devices=devices)
                                        for _ in range(self.n - 1)]
            return self.execs[i](*args)
        return call


# ``...fixed``: the selection override's array (a new one every step) copied into the slot's own donated buffer
# before the step, so that input stays put too.
# (An update, not ``lambda buf, x: x``: JAX hands an output that is an input straight back, not written into buf.)
put = jax.jit(lambda buf, x: jax.lax.dynamic_update_slice(buf, x, (0,) * x.ndim), donate_argnums=0)
RING = {}
orig_absorb = eng._Run._absorb_decode
orig_copy_pages = eng._Run._copy_pages
eng._Run._copy_pages = lambda self, pages, copied, n: pages  # every step copies: one static variant
aliased, sel_aliased = [], []


def ring_absorb(self, tokens, remaining, logits, remaining_in, rounds=None):
    """The ring donates a step's outputs 3 steps later, before the read of the step after it, which would read them
    as its ``remaining_in``: that value is the previous read's ``remaining``, kept on the host."""
    if remaining_in is None:
        remaining_in = self._ring_prev
    rem = np.array(remaining)  # a copy: on the CPU np.asarray is a view, which would keep the buffer from donation
    orig_absorb(self, tokens, remaining, logits, remaining_in, rounds)
    self._ring_prev = rem


def ring_decode_loop(self):
    """The engine's ``_Run._decode_loop`` with N executables in turn, each writing into the output buffers it wrote
    N steps earlier."""
    e = self.e
    fns = RING[self.ring]  # by variant name
    N = len(fns)
    fold = e.fold_every(0)
    pages = offload.copy_pages_for(e.cache_config, 1)
    copied = np.array([s.host_rows for s in self.sessions], np.int64)
    tokens = e._put(self._pending())
    remaining = e._put(self.remaining, np.int32)
    self._ring_prev = self.remaining.astype(np.int32)
    V = model.config.vocab_size
    bufs = [(e._put(np.zeros(self.bucket, np.int32)), e._put(np.zeros((self.bucket, V), np.float32)),
             e._put(np.zeros(self.bucket, np.int32))) for _ in range(N)]
    selbufs = [None] * N
    inflight = self.inflight = collections.deque()
    self.absorb = self._absorb_decode
    t_loop0 = time.perf_counter()
    while self._dispatch_ok(inflight, self._absorb_decode, 1):
        sel = self._selection(len(inflight))
        step_pages = self._copy_pages(pages, copied, len(inflight))
        i = self.steps % N
        if sel is not None and self.ring.endswith("fixed"):
            before = None if selbufs[i] is None else selbufs[i].unsafe_buffer_pointer()
            selbufs[i] = put(jax.numpy.zeros_like(sel) if selbufs[i] is None else selbufs[i], sel)
            sel_aliased.append(before == selbufs[i].unsafe_buffer_pointer())
            sel = selbufs[i]
        ptrs = [b.unsafe_buffer_pointer() for b in bufs[i]]
        t = time.perf_counter()
        e.cache, outs = fns[i](e.model.params, e.cache, self.lanes, tokens, remaining, self.seed, self.temperature,
                               self.top_p, self.stop, sel, bufs[i], greedy=self.greedy, kernels=e.kernels,
                               copy_pages=step_pages, trace=False)
        tokens, logits, remaining = outs[:3]
        self.call_s.append(time.perf_counter() - t)
        got = [tokens.unsafe_buffer_pointer(), logits.unsafe_buffer_pointer(), remaining.unsafe_buffer_pointer()]
        aliased.append(ptrs == got)
        if os.environ.get("PROBE_DEBUG"):
            print([p == g for p, g in zip(ptrs, got)], [(x.dtype, x.shape) for x in outs[:3]], flush=True)
        bufs[i] = (tokens, logits, remaining)
        eng.start_host_copies(tokens, remaining, logits if self.return_logits else None)
        self.steps += 1
        self.copy_steps.append(self.steps)
        if self.steps % fold == 0:
            e._fold_counters(self.sessions)
        inflight.append((tokens, remaining, logits if self.return_logits else None, None, None))
        if len(inflight) > self.LAG:
            self._absorb_decode(*inflight.popleft())
    self.t_loop = time.perf_counter() - t_loop0
    e._decode_buckets.add(self.bucket)
    while inflight:
        self._absorb_decode(*inflight.popleft())


orig_loop = eng._Run._decode_loop


WORKLOAD = os.environ.get("PROBE_WORKLOAD", "")  # a selection override (experiments.workloads), or the model's


def run_variant(name):
    ring = name.split("/")[-1]
    ring = ring if ring.startswith(("ring", "clone")) else ""
    eng._Run._decode_loop = ring_decode_loop if ring else orig_loop
    eng._Run._absorb_decode = ring_absorb if ring else orig_absorb
    eng._Run.ring = ring
    aliased.clear()
    sel_aliased.clear()
    override = (workloads.selection(WORKLOAD, min(model.config.index_topk, cc.max_len), HIST, 7, S) if WORKLOAD
                else None)
    t = time.perf_counter()
    out = e.generate({s: NEW for s in sids}, selection_override=override)
    wall = time.perf_counter() - t
    r = e.last_run
    for s in sids:
        e.rollback(s, len(out[s]))
    calls = np.asarray(r.step_call_s) * 1e3
    res = {"variant": name, "tok_s": S * NEW / r.decode_s, "decode_s": r.decode_s, "wall_s": wall,
           "steps": r.steps, "call": r.step_call_ms, "p99/p50": float(np.percentile(calls, 99) / np.median(calls)),
           "wait": r.step_wait_ms, "interval": r.step_interval_ms,
           "interval_p99/p50": r.step_interval_ms["p99"] / r.step_interval_ms["p50"],
           "loop_per_step_ms": 1e3 * r.host_loop_s / max(r.steps, 1),
           "outputs_in_donated_buffers": (sum(aliased), len(aliased)) if ring else None,
           "selection_in_fixed_buffers": (sum(sel_aliased), len(sel_aliased)) if sel_aliased else None,
           "slowest": sorted(((round(float(x), 2), i + 1) for i, x in enumerate(calls)), reverse=True)[:8],
           "decode_compile_s": r.decode_compile_s, "tokens_hash": hash(tuple(tuple(out[s]) for s in sids))}
    print(json.dumps(res), flush=True)
    return res


variants = os.environ.get("PROBE_VARIANTS", "default,ring3,ring4").split(",")
tag = os.environ.get("PROBE_TAG", "ring")
for v in variants:
    if v.startswith("ring"):
        RING[v] = ring_fns(int(v[4:].removesuffix("fixed")))
    elif v.startswith("clone"):
        RING[v] = Clones(int(v[5:].removesuffix("fixed")))
    run_variant(f"warmup/{v}")  # compiles (the ring's executables once each) and records every command buffer
results = [run_variant(f"{tag}/{v}") for _ in range(int(os.environ.get("PROBE_REPS", "2"))) for v in variants]
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"ring_outputs_{tag}.json"), "w") as fh:
    json.dump(results, fh, indent=1)

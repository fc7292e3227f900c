"""The engine's jitted steps: pure functions ``(params, cache, ...) -> (cache, outputs)``, the cache donated.

A step runs B *lanes*, each on one session slot (``glm53.cache.Lanes``); the batch is bucketed to a few sizes so
sessions joining and leaving do not recompile. Every step that processes tokens first lets the cache do what is
due before any read (``begin_step``: the offload copyback), then runs the model, then lets the cache finish what
needs every layer's reads (``finish_step``: the offload fill), and last commits the rows it keeps (``advance``).

    chunk         prefill / append: T tokens per lane, nothing sampled
    decode        one token per lane; samples the next
    verify        MTP speculative decoding: the pending token and D drafts in one step of T = D + 1, the longest
                  accepted prefix committed, the rest rolled out (never copied back: rows past the committed
                  lengths are just beyond them), and the next D drafts proposed in the same step
    draft         the first D drafts of a generate call (later ones come out of verify)
    sample_first  the first token of a session whose history ends with a processed token
    settle        offload: write every final page to host memory (a call of its own, between steps)
    lifecycle     clear / copy (fork) / truncate (rollback) / flush / read / write (save, restore) one slot

**The MTP layer runs one position behind.** Its row i pairs the main model's final-normed hidden state at i with
the token at i + 1, so it exists once token i + 1 is processed: a step that processes tokens at [s, s + n) writes
the MTP rows s - 1 .. s + n - 2 (``_mtp_catch_up``, only the rows' KV and indexer key: no attention, MLP or head),
using the stored hidden state of position s - 1 for the first. Rows below ``mtp_lengths`` are never rewritten: after
a rollback the stored hidden state is stale, and the rows it would recompute are already there. Drafts write MTP
rows past ``mtp_lengths`` as scratch (the recursive drafts use the MTP layer's own output, not the main model's);
the next step overwrites them with the true rows, and copyback only writes rows below ``min(lengths,
mtp_lengths)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from glm53 import offload, sampling
from glm53.cache import Lanes
from glm53.model import GLM5, make_step

F32 = jnp.float32


def _apply(module: GLM5, params, *args, method=None):
    return module.apply({"params": params}, *args, method=method)


class WholeModel:
    """What the steps below ask of a model: its main layers (``forward``), its head (``logits``) and its MTP layer
    (``mtp``, ``mtp_kv``). This one is the whole model on one device or one tensor-parallel mesh; a pipeline's last
    stage (``glm53.pipeline``) is another, whose ``forward`` runs only its layers on the activation the stage before
    it sent, so the steps' logic (sampling, MTP verify, drafts, commits) is written once."""

    def __init__(self, module: GLM5):
        self.module, self.cfg, self.dtype = module, module.cfg, module.dtype

    def forward(self, params, tokens, step, cache):
        """Main layers on ``tokens [B, T]``: (final-normed hidden [B, T, H], cache, rounds)."""
        return _apply(self.module, params, tokens, step, cache)

    def logits(self, params, hidden):
        return _apply(self.module, params, hidden, method=GLM5.logits)

    def mtp(self, params, hidden, next_tokens, step, cache):
        return _apply(self.module, params, hidden, next_tokens, step, cache, method=GLM5.mtp)

    def mtp_kv(self, params, hidden, next_tokens, step, cache):
        return _apply(self.module, params, hidden, next_tokens, step, cache, method=GLM5.mtp_kv)


def _last_valid(x: jax.Array, n: jax.Array) -> jax.Array:
    """x[b, n[b] - 1] (index 0 for lanes with nothing valid: their output is ignored)."""
    idx = jnp.maximum(n - 1, 0)
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


def _mtp_catch_up(net: WholeModel, params, cache, lanes: Lanes, hidden: jax.Array, tokens: jax.Array,
                  start: jax.Array, n_commit: jax.Array, kernels: str):
    """The MTP layer's rows for the pairs (hidden at i - 1, token i) of this step's committed input tokens.
    ``hidden`` is read only when T > 1: a one-token step's MTP row needs only the stored hidden state, so decode
    writes it before the main layers. Returns (cache, end of the MTP layer's final rows [B]) or (cache, None) for
    models without MTP."""
    if not net.cfg.num_nextn_predict_layers:
        return cache, None
    B, T = tokens.shape
    stored = cache.sessions.hidden[lanes.slot][:, None]
    prev = stored.astype(net.dtype) if T == 1 else jnp.concatenate([stored.astype(hidden.dtype), hidden[:, :-1]], 1)
    rows = start[:, None] - 1 + jnp.arange(T, dtype=jnp.int32)[None, :]
    fresh = rows >= cache.sessions.mtp_lengths[lanes.slot][:, None]
    step = make_step(start - 1, n_commit, T, cache.capacity, net.cfg, net.dtype, lanes, write_mask=fresh,
                     kernels=kernels)
    cache = net.mtp_kv(params, prev, tokens, step, cache)
    return cache, start - 1 + n_commit


def _drafts(net: WholeModel, params, cache, lanes: Lanes, hidden: jax.Array, token: jax.Array, row: jax.Array,
            depth: int, seed, temperature, top_p, selection=None, *, greedy: bool, kernels: str):
    """``depth`` drafts by the MTP module applied recursively from (final-normed hidden at ``row``, the token at
    ``row + 1``). Returns (drafts [B, D], their proposal distributions [B, D, V] or None, cache, rounds).

    ``selection`` (int32 [B, K], benchmarks): the DSA selection override of the step, which the drafts' MTP layer
    takes too. Without it the drafts selected with the MTP layer's own indexer, which on random weights picks
    nearly random rows: at MTP 3 on the H200 the MTP layer's hot cache thrashed (the 10 x 50K A/B's 96.1% hits
    against MTP 0's 99.1%, ``sessions_ab_10x50k_mtp3_62932c1.json``; 47% of the MTP layer's lookups hit on the
    tiny config with a history larger than its hot cache)."""
    drafts, dists, rounds = [], [], []
    g, tok = hidden, token
    active = lanes.active.astype(jnp.int32)
    sel = None if selection is None else selection[:, None, :]
    for j in range(depth):
        step = make_step(row + j, active, 1, cache.capacity, net.cfg, net.dtype, lanes, kernels=kernels,
                         fill=True, selection=sel)
        mh, cache, round_ = net.mtp(params, g[:, None].astype(net.dtype), tok[:, None], step, cache)
        logits = net.logits(params, mh[:, 0])
        if greedy:
            d = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            q = sampling.distribution(logits, temperature, top_p)
            d = sampling.draw(q, sampling.position_keys(seed, row + j + 2, sampling.DRAFT))
            dists.append(q)
        drafts.append(d)
        rounds.append(round_)
        g, tok = mh[:, 0], d
    return jnp.stack(drafts, 1), (jnp.stack(dists, 1) if dists else None), cache, rounds


def _fill_step(net: WholeModel, cache, lanes: Lanes, repeats: int, kernels: str):
    """A step context that only carries what ``finish_step`` reads."""
    z = jnp.zeros(lanes.slot.shape, jnp.int32)
    return make_step(z, z, 1, cache.capacity, net.cfg, net.dtype, lanes, kernels=kernels, fill=True,
                     repeats=repeats)


# ----------------------------------------------------------------------------------------------------------------
# Step contexts: how each step places its tokens (shared with glm53.pipeline's stages, which must place them the same)
# ----------------------------------------------------------------------------------------------------------------
def chunk_context(net, cache, lanes: Lanes, n_valid, T: int, *, kernels: str, bulk: bool, copy_pages: int):
    """(lanes without the empty ones, start [B], Step) of a chunk of T tokens (``n_valid[b]`` real). ``net``: anything
    with the model's ``cfg`` and ``dtype``."""
    lanes = lanes.replace(active=lanes.active & (n_valid > 0))
    start = cache.sessions.lengths[lanes.slot]
    return lanes, start, make_step(start, n_valid, T, cache.capacity, net.cfg, net.dtype, lanes, kernels=kernels,
                                   bulk=bulk, copy_pages=copy_pages)


def decode_context(net, cache, lanes: Lanes, remaining, selection, *, kernels: str, copy_pages: int):
    """(lanes without the finished ones, rows committed per lane [B], start [B], Step) of a one-token decode step."""
    active = lanes.active & (remaining > 0)
    lanes = lanes.replace(active=active)
    n = active.astype(jnp.int32)
    start = cache.sessions.lengths[lanes.slot]
    sel = None if selection is None else selection[:, None, :]
    return lanes, n, start, make_step(start, n, 1, cache.capacity, net.cfg, net.dtype, lanes, selection=sel,
                                      kernels=kernels, fill=True, copy_pages=copy_pages)


def verify_context(net, cache, lanes: Lanes, remaining, T: int, selection, *, kernels: str, copy_pages: int):
    """(lanes without the finished ones, start [B], Step) of an MTP verify step of T = D + 1 rows a lane."""
    active = lanes.active & (remaining > 0)
    lanes = lanes.replace(active=active)
    start = cache.sessions.lengths[lanes.slot]
    sel = None if selection is None else jnp.broadcast_to(selection[:, None, :],
                                                           (lanes.slot.shape[0], T, selection.shape[-1]))
    return lanes, start, make_step(start, jnp.where(active, T, 0), T, cache.capacity, net.cfg, net.dtype, lanes,
                                   selection=sel, kernels=kernels, fill=True, repeats=T, copy_pages=copy_pages)


# ----------------------------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------------------------
def chunk(net: WholeModel, params, cache, lanes: Lanes, tokens, n_valid, *, outputs: str, kernels: str, bulk: bool,
          copy_pages: int):
    """Process ``tokens [B, T]`` (``n_valid[b]`` real) at positions ``lengths + t``: prefill and append. Returns
    (cache, out): out is None, the logits ``[B, T, V]`` of every position (``outputs="logits"``) or the final-normed
    hidden states ``[B, T, H]`` (``outputs="hidden"``)."""
    lanes, start, step = chunk_context(net, cache, lanes, n_valid, tokens.shape[1], kernels=kernels, bulk=bulk,
                                       copy_pages=copy_pages)
    cache = cache.begin_step(step)
    hidden, cache, rounds = net.forward(params, tokens, step, cache)
    cache = cache.finish_step(rounds, step)
    cache, mtp_end = _mtp_catch_up(net, params, cache, lanes, hidden, tokens, start, n_valid, kernels)
    cache = cache.advance(step, n_valid, _last_valid(hidden, n_valid), mtp_end)
    if outputs == "logits":
        return cache, net.logits(params, hidden)
    if outputs == "hidden":
        return cache, hidden
    return cache, None


def decode(net: WholeModel, params, cache, lanes: Lanes, tokens, remaining, seed, temperature, top_p, stop_ids,
           selection=None, *, greedy: bool, kernels: str, copy_pages: int, trace: bool = False):
    """One token per lane: ``tokens [B]`` (each session's pending token) is processed and the next sampled.
    ``remaining [B]`` counts the tokens each lane may still emit (0: inert); a sampled stop token ends the lane.
    ``selection``: optional int32[B, K] DSA selection override (benchmarks). Returns (cache, (next tokens [B],
    logits [B, V], remaining [B])), and with ``trace`` the step's rounds (``glm53.offload.trace_rounds``)."""
    lanes, n, start, step = decode_context(net, cache, lanes, remaining, selection, kernels=kernels,
                                           copy_pages=copy_pages)
    active = lanes.active
    cache = cache.begin_step(step)
    # The MTP row (the stored hidden state and this token) first: written after the main layers it would depend on
    # none of their reads of the ring / history, and XLA would keep the old buffer alive with a copy every step.
    cache, mtp_end = _mtp_catch_up(net, params, cache, lanes, None, tokens[:, None], start, n, kernels)
    hidden, cache, rounds = net.forward(params, tokens[:, None], step, cache)
    cache = cache.finish_step(rounds, step)
    h = hidden[:, 0]
    logits = net.logits(params, h)
    nxt = sampling.sample(logits, seed, start + 1, temperature, top_p, greedy=greedy)
    # The lengths are updated in place, and every layer (the MTP row first) reads their old values. Nothing but
    # ``active`` decides a decode step's commits, so without a data path from those reads XLA updated the lengths
    # early and kept the old values alive with two copies each of ``lengths`` and ``mtp_lengths`` (four ~1.1 us
    # MemcpyD2D a step at 10 x 50K on the H200, decode_hlo_offload_copy_free.txt of
    # profile_decode_50k_b10_drift0.001_fc98c9a). A sampled token is never negative, which XLA cannot know, and it
    # depends on every read: the update waits for them instead.
    after_reads = nxt >= 0
    cache = cache.advance(step, jnp.where(after_reads, n, 0), h,
                          None if mtp_end is None else jnp.where(after_reads, mtp_end, 0))
    stop = jnp.isin(nxt, stop_ids)
    remaining = jnp.where(active, jnp.where(stop, 0, remaining - 1), remaining)
    if trace:
        return cache, (nxt, logits, remaining, offload.trace_rounds(rounds, step))
    return cache, (nxt, logits, remaining)


def verify(net: WholeModel, params, cache, lanes: Lanes, pending, drafts, draft_p, remaining, seed, temperature, top_p,
           stop_ids, selection=None, *, greedy: bool, accept_override: int | None, kernels: str, copy_pages: int,
           trace: bool = False):
    """MTP speculative decoding, one round: the pending tokens ``[B]`` and ``drafts [B, D]`` go through the main
    model as one step of T = D + 1 rows; the longest accepted prefix of the drafts (greedy: equal to the main
    model's argmax; sampling: the speculative rule, ``draft_p [B, D, V]`` the drafts' proposal distributions) plus
    the main model's next token are emitted; the next D drafts are proposed from the last committed row.

    ``accept_override`` (benchmarks, static): accept that many drafts whatever they are, so random weights can be
    measured at a realistic acceptance (outputs are then compared between modes only).

    Emission is clamped to ``remaining`` and ends at a stop token. Returns (cache, (emitted [B, T], n_emitted [B],
    logits [B, T, V], next pending [B], next drafts [B, D], their distributions or None, remaining [B],
    accepted [B] before clamping)), and with ``trace`` the step's rounds (``glm53.offload.trace_rounds``)."""
    B, D = drafts.shape
    T = D + 1
    lanes, start, step = verify_context(net, cache, lanes, remaining, T, selection, kernels=kernels,
                                        copy_pages=copy_pages)
    active = lanes.active
    tokens = jnp.concatenate([pending[:, None], drafts], axis=1)
    cache = cache.begin_step(step)
    hidden, cache, rounds = net.forward(params, tokens, step, cache)
    logits = net.logits(params, hidden)  # [B, T, V]
    if greedy:
        accepted, target = sampling.accept_greedy(logits, drafts)
    else:
        accepted, target = sampling.accept_sampled(logits, drafts, draft_p, start + 1, seed, temperature, top_p)
    a = accepted
    if accept_override is not None:
        a = jnp.full_like(accepted, min(accept_override, D))
        if greedy:
            bonus = jnp.argmax(jnp.take_along_axis(logits, a[:, None, None], 1)[:, 0], axis=-1).astype(jnp.int32)
        else:
            p_a = sampling.distribution(jnp.take_along_axis(logits, a[:, None, None], 1)[:, 0], temperature, top_p)
            bonus = sampling.draw(p_a, sampling.position_keys(seed, start + 1 + a, sampling.SAMPLE))
        target = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
        target = jnp.where(jnp.arange(T)[None, :] == a[:, None], bonus[:, None], target)
    j = jnp.arange(T, dtype=jnp.int32)[None, :]
    emitted = jnp.where(j < a[:, None], jnp.concatenate([drafts, drafts[:, :1]], 1), target)
    # Clamp: at most `remaining` tokens, and nothing after a stop token.
    is_stop = jnp.isin(emitted, stop_ids) & (j <= a[:, None])
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), T).astype(jnp.int32)
    a = jnp.minimum(jnp.minimum(a, remaining - 1), first_stop)
    a = jnp.where(active, a, 0)
    n_emit = jnp.where(active, a + 1, 0)
    nxt = jnp.take_along_axis(emitted, a[:, None], 1)[:, 0]
    ended = jnp.take_along_axis(is_stop, a[:, None], 1)[:, 0]
    remaining = jnp.where(active, jnp.where(ended, 0, remaining - n_emit), remaining)
    # Commit the pending token and the accepted drafts; the rest of the rows stay past the lengths.
    cache, mtp_end = _mtp_catch_up(net, params, cache, lanes, hidden, tokens, start, n_emit, kernels)
    h_last = jnp.take_along_axis(hidden, a[:, None, None], 1)[:, 0]
    cache = cache.advance(step, n_emit, h_last, mtp_end)
    draft_lanes = lanes.replace(active=active & (remaining > 0))
    next_drafts, next_p, cache, draft_rounds = _drafts(net, params, cache, draft_lanes, h_last, nxt, start + a, D,
                                                       seed, temperature, top_p, selection, greedy=greedy,
                                                       kernels=kernels)
    cache = cache.finish_step(list(rounds) + list(draft_rounds), step)
    out = (emitted, n_emit, logits, nxt, next_drafts, next_p, remaining, jnp.where(active, accepted, 0))
    if trace:
        return cache, out + (offload.trace_rounds(list(rounds) + list(draft_rounds), step),)
    return cache, out


def draft(net: WholeModel, params, cache, lanes: Lanes, pending, seed, temperature, top_p, selection=None, *,
          depth: int, greedy: bool, kernels: str, trace: bool = False):
    """The first ``depth`` drafts of a generate call, from each session's stored hidden state and pending token
    (``selection``: the benchmarks' DSA override, as in ``verify``). Returns (cache, (drafts [B, D], distributions
    [B, D, V] or None)), and with ``trace`` the step's rounds."""
    row = cache.sessions.lengths[lanes.slot] - 1
    hidden = cache.sessions.hidden[lanes.slot]
    drafts, dists, cache, rounds = _drafts(net, params, cache, lanes, hidden, pending, row, depth, seed,
                                           temperature, top_p, selection, greedy=greedy, kernels=kernels)
    fill_step = _fill_step(net, cache, lanes, depth, kernels)
    cache = cache.finish_step(rounds, fill_step)
    if trace:
        # the drafts' query rows start after the last committed one (the fill step's own positions are dummies)
        return cache, (drafts, dists, offload.trace_rounds(rounds, fill_step.replace(positions=row[:, None] + 1)))
    return cache, (drafts, dists)


def sample_first(net: WholeModel, params, cache, lanes: Lanes, seed, temperature, top_p, *, greedy: bool):
    """The token after each session's last processed position, from its stored hidden state (reads the cache
    only). Returns (tokens [B], logits [B, V])."""
    hidden = cache.sessions.hidden[lanes.slot]
    logits = net.logits(params, hidden)
    positions = cache.sessions.lengths[lanes.slot]
    return sampling.sample(logits, seed, positions, temperature, top_p, greedy=greedy), logits


def mtp_forward(net: WholeModel, params, cache, lanes: Lanes, hidden, next_tokens, n_valid, *, kernels: str):
    """The MTP module over committed rows (``Model.draft``): rows ``0..T-1`` of the MTP layer exist already (the
    chunk steps wrote them), so this only reads. Returns (cache, logits [B, T, V])."""
    B, T = next_tokens.shape
    rows = jnp.arange(T, dtype=jnp.int32)[None, :]
    fresh = rows >= cache.sessions.mtp_lengths[lanes.slot][:, None]
    step = make_step(jnp.zeros((B,), jnp.int32), n_valid, T, cache.capacity, net.cfg, net.dtype, lanes,
                     write_mask=fresh, kernels=kernels)
    mh, cache, _ = net.mtp(params, hidden, next_tokens, step, cache)
    return cache, net.logits(params, mh)


# ---- lifecycle (offload-only ones are never called on a resident cache) ----
def settle(cache, lanes: Lanes, *, pages: int, kernels: str):
    return cache.settle(lanes, pages, kernels), None


def clear_slot(cache, slot):
    return cache.clear_slot(slot), None


def clear_counters(cache, slots):
    """Zero the hit / miss counters of the slots marked in ``slots`` (bool[S]): the engine has added them to its
    host totals (int64: the device's int32 would overflow after ~1M decoded tokens of one session)."""
    return cache.replace(counters=jnp.where(slots[None, :, None], 0, cache.counters)), None


def copy_slot(cache, src, dst):
    return cache.copy_slot(src, dst), None


def set_pages(cache, slot, row):
    return cache.set_pages(slot, row), None


def read_pages(cache, pages, *, kernels: str):
    return cache.read_pages(pages, kernels)


def write_pages(cache, buf, pages, *, kernels: str):
    return cache.write_pages(buf, pages, kernels), None


def truncate_slot(cache, slot, length, mtp_length, *, kernels: str):
    return cache.truncate_slot(slot, length, mtp_length, kernels), None


def flush_slot(cache, slot, *, kernels: str):
    return cache.flush_slot(slot, kernels), None


def read_slot(cache, slot, *, kernels: str):
    """Everything a save needs of one slot, on the device: rows ``{plane: [L, N, W]}``, indexer keys
    ``[Lf, N, D]``, the stored hidden state and the lengths."""
    s = cache.sessions
    scale = None if cache.index_key_scale is None else cache.index_key_scale[:, slot]
    return dict(rows=cache.read_slot_rows(slot, kernels), index_keys=cache.index_keys[:, slot],
                index_key_scale=scale, hidden=s.hidden[slot], length=s.lengths[slot],
                mtp_length=s.mtp_lengths[slot])


def write_slot(cache, slot, rows, index_keys, index_key_scale, hidden, length, mtp_length, *, kernels: str):
    """Restore a saved session into a cleared slot (offload: whose page table is set)."""
    cache = cache.write_slot_rows(slot, rows, length, mtp_length, kernels)
    s = cache.sessions
    if cache.index_key_scale is not None:
        cache = cache.replace(index_key_scale=cache.index_key_scale.at[:, slot].set(index_key_scale))
    cache = cache.replace(
        index_keys=cache.index_keys.at[:, slot].set(index_keys.astype(cache.index_keys.dtype)),
        sessions=s.replace(lengths=s.lengths.at[slot].set(length), mtp_lengths=s.mtp_lengths.at[slot].set(mtp_length),
                           hidden=s.hidden.at[slot].set(hidden.astype(s.hidden.dtype))))
    return cache, None


# ----------------------------------------------------------------------------------------------------------------
# Jitting
# ----------------------------------------------------------------------------------------------------------------
# name -> (function, static argument names, takes the module and params first)
STEPS: dict[str, tuple[Any, tuple[str, ...], bool]] = {
    "chunk": (chunk, ("outputs", "kernels", "bulk", "copy_pages"), True),
    "decode": (decode, ("greedy", "kernels", "copy_pages", "trace"), True),
    "verify": (verify, ("greedy", "accept_override", "kernels", "copy_pages", "trace"), True),
    "draft": (draft, ("depth", "greedy", "kernels", "trace"), True),
    "mtp_forward": (mtp_forward, ("kernels",), True),
    "settle": (settle, ("pages", "kernels"), False),
    "clear_slot": (clear_slot, (), False),
    "clear_counters": (clear_counters, (), False),
    "copy_slot": (copy_slot, (), False),
    "set_pages": (set_pages, (), False),
    "write_pages": (write_pages, ("kernels",), False),
    "truncate_slot": (truncate_slot, ("kernels",), False),
    "flush_slot": (flush_slot, ("kernels",), False),
    "write_slot": (write_slot, ("kernels",), False),
}


class Steps:
    """The jitted steps of one model: one ``jax.jit`` per (step, placement of the cache), shared by every engine of
    the model, so engines with the same shapes share compiled executables. Cache-returning steps donate the cache
    and return it with the placement it came with (``out_shardings``: the offload pool must come back in
    pinned_host memory); other outputs land on the cache's device."""

    def __init__(self, module: GLM5, net=None):
        self.module = module
        self.net = net or WholeModel(module)  # a pipeline's last stage brings its own (glm53.pipeline.LastStage)
        self._jits: dict = {}
        self._others: dict = {}  # (name, mesh or None) -> jitted sample_first / read_slot / read_pages
        self._rings: dict = {}  # ``ring``'s executables, by what they were compiled for

    def _jit(self, name: str, cache, compiler_options: tuple = ()):
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, cache)
        key = (name, jax.tree_util.tree_structure(cache), tuple(jax.tree_util.tree_leaves(shardings)),
               compiler_options)
        fn = self._jits.get(key)
        if fn is None:
            f, static, with_model = STEPS[name]
            if with_model:
                f = functools.partial(f, self.net)
                donate = (1,)  # (params, cache, ...)
            else:
                donate = (0,)
            fn = jax.jit(_named(f, name), static_argnames=static, donate_argnums=donate,
                         out_shardings=(shardings, self.outputs_placement(cache)),
                         compiler_options=dict(compiler_options) or None)
            self._jits[key] = fn
        return fn

    @staticmethod
    def outputs_placement(cache) -> jax.sharding.Sharding:
        """Where the steps for ``cache`` put their outputs other than the cache (tokens, remaining counts, logits):
        its device, or replicated over its mesh. Inputs a caller builds on the host for the same arguments belong
        there too (``Engine._put``): a jitted function compiles once per placement of its arguments, so a decode
        loop whose first call took host-built tokens (uncommitted) and later calls the previous step's outputs
        compiled the step twice."""
        staged = getattr(cache, "outputs_placement", None)  # glm53.pipeline.StagedCache: its last stage's
        if staged is not None:
            return staged()
        first = jax.tree_util.tree_leaves(cache)[0].sharding
        if isinstance(first, jax.sharding.NamedSharding):  # a cache on a mesh: outputs replicated over it
            return jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
        return jax.sharding.SingleDeviceSharding(next(iter(first.device_set)))

    def __call__(self, name: str, *args, **kw):
        """Run step ``name``: ``(params, cache, ...)`` for model steps, ``(cache, ...)`` for lifecycle ones.
        Returns (cache, outputs)."""
        with_model = STEPS[name][2]
        cache = args[1] if with_model else args[0]
        return self._jit(name, cache)(*args, **kw)

    def for_cache(self, name: str, cache, compiler_options: tuple = ()):
        """The jitted step ``name`` for caches placed like ``cache``: callers whose cache keeps its placement (an
        engine) look it up once instead of walking the cache's leaves at every call (~15 us a step).
        ``compiler_options``: sorted (name, value) pairs of XLA options the step compiles with (``Engine``'s)."""
        return self._jit(name, cache, compiler_options)

    def _other(self, name: str, cache):
        """The jitted ``name`` for a cache placed like ``cache``. On a mesh its outputs are replicated over it: the
        host reads them, and with several processes only an array every process holds whole can be read."""
        first = jax.tree_util.tree_leaves(cache)[0].sharding
        mesh = first.mesh if isinstance(first, jax.sharding.NamedSharding) else None
        fn = self._others.get((name, mesh))
        if fn is None:
            f, static = {"sample_first": (functools.partial(sample_first, self.net), ("greedy",)),
                         "read_slot": (read_slot, ("kernels",)), "read_pages": (read_pages, ("kernels",))}[name]
            out = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            fn = self._others[(name, mesh)] = jax.jit(f, static_argnames=static, out_shardings=out)
        return fn

    def sample_first(self, params, cache, lanes, seed, temperature, top_p, *, greedy: bool):
        return self._other("sample_first", cache)(params, cache, lanes, seed, temperature, top_p, greedy=greedy)

    def read_slot(self, cache, slot, *, kernels: str):
        return self._other("read_slot", cache)(cache, slot, kernels=kernels)

    def read_pages(self, cache, pages, *, kernels: str):
        return self._other("read_pages", cache)(cache, pages, kernels=kernels)

    def ring(self, name: str, cache, compiler_options: tuple, args: tuple, static: dict, copies: int) -> tuple:
        """``copies`` executables of step ``name`` for arguments shaped like ``args``, each taking a keyword
        ``out_buffers``: its outputs other than the cache, donated, which XLA writes the step's outputs into (in
        place). Returns (executables, the outputs as ``jax.ShapeDtypeStruct`` s placed where they go: the buffers'
        structure).

        Why (H200, ``experiments/results/probes/ring_outputs_*.json``): XLA re-records a step's CUDA graphs before
        a launch whenever a buffer they reference moved since their last launch, and a step's fresh outputs (the
        next step's inputs) move at every call; that update was most of a decode call's 2-3 ms of host time, and
        its spread was the step-call tail. A caller that calls these executables in turn, giving each the buffers
        it wrote ``copies`` steps earlier (and every other input in buffers of its own, ``engine._StepRing``), has
        every executable meet the buffers it met at its last call: 10 x 50K offload decode calls of 1.0-1.3 ms
        against one executable's 1.9-2.1, tokens identical (``probes/host_calls_ring_v1v2_engine10_b4ac251.json``).

        One compilation, cloned through its serialized form: the clones are one binary, so they choose the same
        GEMM algorithms. Compiling each copy (tried at 84c6a66) let XLA's autotuning on a busy GPU pick different
        algorithms for the copies, and their tokens differed from one executable's. An executable that a
        persistent compilation cache loaded is not cloned (on the CPU it serializes without its code, and its
        clones fail to run: "Function ... not found"): the copies are then loaded from that cache one by one, the
        same binary too."""
        if static.get("trace"):
            raise ValueError("a ring's steps return no trace")
        # Kept here, like the jits, so that every engine of this model shares them: ``glm53.generate`` makes an
        # engine per call, and an AOT ``compile()`` has no cache of its own, so a per-engine memo compiled the step
        # again at every call (a timed 1,024-token generate on the H200 spent 7.3 s of its 10.7 s compiling:
        # ``probes/generate_8k_1024_ring_fe97dc0.json``). Engines of one shape calling the same executables in turn
        # cost only their graphs' recording at each switch; their buffers are their own (``engine._RingBuffers``).
        leaves, treedef = jax.tree_util.tree_flatten(_abstract(args))
        key = (name, treedef, tuple(leaves), compiler_options, tuple(sorted(static.items())), copies)
        memo = self._rings.get(key)
        if memo is None:
            memo = self._rings[key] = self._build_ring(name, cache, compiler_options, args, static, copies)
        return memo

    def _build_ring(self, name, cache, compiler_options, args, static, copies) -> tuple:
        from jax.experimental import serialize_executable

        f, static_names, with_model = STEPS[name]
        plain = self._jit(name, cache, compiler_options)
        outs = plain.trace(*args, **static).out_info[1]
        placement = self.outputs_placement(cache)
        buffers = jax.tree_util.tree_map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=placement), outs)
        if with_model:
            f = functools.partial(f, self.net)

        def into_buffers(*a, out_buffers, **kw):
            del out_buffers  # donated and kept though unused: XLA aliases each output to the buffer of its shape
            return f(*a, **kw)

        shardings = jax.tree_util.tree_map(lambda x: x.sharding, cache)
        # The cache comes before out_buffers in the flattened arguments, so each cache leaf's output is aliased to
        # its own input (outputs take the first donated input of their shape, in argument order) and each other
        # output to its buffer in out_buffers.
        fn = jax.jit(_named(into_buffers, name), static_argnames=static_names,
                     donate_argnums=(1,) if with_model else (0,), donate_argnames=("out_buffers",), keep_unused=True,
                     out_shardings=(shardings, placement), compiler_options=dict(compiler_options) or None)
        lowered = fn.lower(*args, out_buffers=buffers, **static)
        hits = _persistent_cache_hits[0]
        first = lowered.compile()
        if _persistent_cache_hits[0] > hits:
            return (first, *(lowered.compile() for _ in range(copies - 1))), buffers
        payload = serialize_executable.serialize(first)
        devices = list(placement.device_set)
        clones = [serialize_executable.deserialize_and_load(*payload, execution_devices=devices)
                  for _ in range(copies - 1)]
        return (first, *clones), buffers

    def lower(self, name: str, *args, **kw):
        """The lowered (not run, nothing donated) call of step ``name`` with these arguments: for profiling and
        memory analysis (``.compile().memory_analysis()``, ``.compile().as_text()``)."""
        with_model = STEPS[name][2]
        cache = args[1] if with_model else args[0]
        return self._jit(name, cache).lower(*_abstract(args), **kw)


_persistent_cache_hits = [0]  # executables this process loaded from JAX's persistent compilation cache


def _on_event(name: str, **_) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        _persistent_cache_hits[0] += 1


jax.monitoring.register_event_listener(_on_event)


def _named(f, name: str):
    """``f`` under the step's name: the compiled module is ``jit_<name>`` in profiles."""
    def run(*args, **kw):
        return f(*args, **kw)

    functools.update_wrapper(run, f)  # keeps f's signature (jit maps static_argnames through it)
    run.__name__ = run.__qualname__ = name
    return run


def _abstract(tree):
    """Shapes, dtypes and placements (memory kinds included) of a call's arrays; other leaves as they are."""
    # An uncommitted array (jnp.asarray of host data) goes wherever the call's committed ones are: no placement.
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=x.sharding if getattr(x, "_committed", True) else None)
                        if isinstance(x, jax.Array) else x, tree)

"""Jitted steps: pure functions ``(params, cache, inputs) -> (outputs, cache)`` with the cache donated.

One step function serves prefill chunks (T = chunk), decode (T = 1) and, later, MTP verify (T = depth + 1): the
tokens of a step are written to the cache first and then every token selects and attends over the rows at or before
its own position. ``n_valid[b]`` tokens of row ``b`` are real; the rest is padding that writes nothing, so sessions
of different lengths share one batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm53 import cache as kvcache
from glm53.model import GLM5, make_step

F32 = jnp.float32


def _finish_round(cache: kvcache.KVCache) -> kvcache.KVCache:
    if cache.mode != "offload":
        return cache
    from glm53 import offload
    return offload.finish_round(cache)


def _last_valid(x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """x[b, n_valid[b] - 1] (index 0 for rows with no valid token: their output is ignored)."""
    idx = jnp.maximum(n_valid - 1, 0)
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
           greedy: bool = False) -> jax.Array:
    """Greedy (argmax, first index on ties) when temperature == 0, else nucleus sampling. ``logits [B, V]``.

    ``greedy`` (static) compiles the argmax alone. Without it the nucleus path (a sort of the whole vocabulary, a
    dozen kernels) runs every step and is discarded by a select when the traced temperature is 0: ~50 us of device
    time and a dozen host launches per decode step (experiments.profile_decode), for nothing."""
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return greedy_tokens
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    keep_sorted = (cum - probs) < top_p  # always keeps the most likely token
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    sampled = jax.random.categorical(key, jnp.where(keep, scaled, -jnp.inf), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy_tokens)


class Steps:
    """The jitted steps of one module (one compiled executable per distinct input shape)."""

    def __init__(self, module: GLM5):
        self.module = module
        self.forward = _Jitted(functools.partial(_forward, module), static_argnames=("all_logits",))
        self.decode = _Jitted(functools.partial(_decode, module), static_argnames=("greedy",))
        self.mtp = _Jitted(functools.partial(_mtp, module))


def _cache_first(fn):
    """The step with the cache moved to the front of its outputs. JAX pairs each donated input buffer with the
    first output of the same shape and dtype, in output order: with the sampled tokens (int32[B]) first, they took
    the buffer of ``lengths``, ``lengths`` the next int32[B] field's, and so on, and XLA added a copy for every
    field the chain displaced (small, but one launch each, every step). Outputs in the inputs' order pair up 1:1."""
    def run(params, cache, *args, **kw):
        *out, cache = fn(params, cache, *args, **kw)
        return (cache, *out)
    return run


def _with_history(fn):
    def run(params, rest, history, *args, **kw):
        cache, *out = fn(params, rest.replace(history=history), *args, **kw)
        return (cache.replace(history=None), *out)
    return run


class _Jitted:
    """A step jitted with the cache donated. In offload mode the host history is passed beside the cache as a
    read-only input: the step only reads it (hot gather) and copyback alone writes it, so XLA never has to decide
    where to place a returned pinned_host array, and nothing can copy the history."""

    def __init__(self, fn, static_argnames=()):
        name = getattr(getattr(fn, "func", fn), "__name__", "step")  # the profile's module name: jit_<name>
        resident = _cache_first(fn)
        offload = _with_history(resident)
        resident.__name__ = offload.__name__ = name
        self._resident = jax.jit(resident, static_argnames=static_argnames, donate_argnums=(1,))
        self._offload = jax.jit(offload, static_argnames=static_argnames, donate_argnums=(1,))

    def __call__(self, params, cache: kvcache.KVCache, *args, **kw):
        if cache.mode != "offload":
            cache, *out = self._resident(params, cache, *args, **kw)
            return (*out, cache)
        history = cache.history
        rest = cache.replace(history=None)
        rest, *out = self._offload(params, rest, history, *args, **kw)
        return (*out, rest.replace(history=history))

    def compiled_text(self, params, cache: kvcache.KVCache, *args, **kw) -> str:
        """The optimised HLO of the executable a call with these arguments runs (nothing is run or donated): for
        profiling, to map kernels back to source through their ``op_name`` metadata."""
        if cache.mode != "offload":
            fn, call = self._resident, (params, cache, *args)
        else:
            fn, call = self._offload, (params, cache.replace(history=None), cache.history, *args)
        return fn.lower(*_abstract(call), **kw).compile().as_text()


def _abstract(tree):
    """Shapes, dtypes and placements (memory kinds included) of a call's arrays; other leaves as they are."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def _forward(module: GLM5, params, cache: kvcache.KVCache, tokens, n_valid, selection=None, *, all_logits: bool):
    """Process ``tokens [B, T]`` at positions ``cache.lengths + t``. Returns (logits, hidden, cache): logits
    ``[B, T, V]`` if ``all_logits`` else the logits of each row's last valid token ``[B, V]``; hidden ``[B, T, H]``
    final-normed (the MTP module's input). ``selection``: optional int32[B, T, K] DSA selection override (entries
    < 0 keep the indexer's choice)."""
    B, T = tokens.shape
    step = make_step(cache.lengths, n_valid, T, cache.capacity, module.cfg, module.dtype, selection)
    hidden, cache = module.apply({"params": params}, tokens, step, cache)
    cache = _finish_round(cache)
    h = hidden if all_logits else _last_valid(hidden, n_valid)
    logits = module.apply({"params": params}, h, method=GLM5.logits)
    return logits, hidden, kvcache.advance(cache, n_valid)


def _decode(module: GLM5, params, cache: kvcache.KVCache, tokens, key, temperature, top_p, selection=None, *,
            greedy: bool = False):
    """One token per session: ``tokens [B]`` -> (next tokens [B], their logits [B, V], cache). ``selection``:
    optional int32[B, K] DSA selection override for benchmarks. ``greedy`` (static): the caller guarantees
    temperature == 0, so only the argmax is compiled."""
    n_valid = jnp.ones(tokens.shape[:1], jnp.int32)
    sel = None if selection is None else selection[:, None, :]
    logits, _, cache = _forward(module, params, cache, tokens[:, None], n_valid, sel, all_logits=False)
    return sample(logits, key, temperature, top_p, greedy=greedy), logits, cache


def _mtp(module: GLM5, params, cache: kvcache.KVCache, hidden, next_tokens, n_valid):
    """MTP draft: main-model hidden at positions ``cache.mtp_lengths + t`` and the tokens one position later ->
    (draft logits [B, T, V] predicting the tokens two positions later, MTP hidden [B, T, H], cache)."""
    B, T = next_tokens.shape
    step = make_step(cache.mtp_lengths, n_valid, T, cache.capacity, module.cfg, module.dtype)
    mtp_hidden, cache = module.apply({"params": params}, hidden, next_tokens, step, cache, method=GLM5.mtp)
    cache = _finish_round(cache)
    logits = module.apply({"params": params}, mtp_hidden, method=GLM5.logits)
    return logits, mtp_hidden, kvcache.advance_mtp(cache, n_valid)

"""Sampling and speculative acceptance, as pure functions of logits and keys.

Randomness is a function of the session's sampler seed and the absolute position of the token being drawn
(``position_keys``), never of the batch a session happens to share or of how many steps produced it: a session
decoded alone, in a batch of ten, or resumed from a save draws the same numbers for the same positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Streams of one position's key: the token drawn there, the MTP draft proposed there, the acceptance test of that
# draft.
SAMPLE, DRAFT, ACCEPT = 0, 1, 2


def position_keys(seed: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """One key per lane: ``fold_in(fold_in(key(seed), position), stream)``. ``positions`` int32[B]."""
    base = jax.random.key(seed)
    return jax.vmap(lambda p: jax.random.fold_in(jax.random.fold_in(base, p), stream))(positions)


def distribution(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """The sampling distribution ``[..., V]`` f32: softmax(logits / temperature) restricted to the nucleus (the
    most likely tokens whose mass reaches top_p; the most likely token always kept), renormalised."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    p_sorted = jax.nn.softmax(sorted_logits, axis=-1)
    keep_sorted = (jnp.cumsum(p_sorted, axis=-1) - p_sorted) < top_p
    keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
    p = jnp.where(keep, jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1), 0.0)
    return p


def sample(logits: jax.Array, seed: jax.Array, positions: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
           greedy: bool) -> jax.Array:
    """Tokens int32[B] from ``logits [B, V]``: argmax (first index on ties) when ``greedy`` (static: only the
    argmax is compiled; the nucleus path sorts the whole vocabulary, ~50 us and a dozen kernels per step on the
    H200), else one draw per lane from ``distribution`` with the key of the position drawn (``positions [B]``,
    stream SAMPLE).

    The keys are made here, not by the caller, so a greedy step never traces them: XLA would drop the unused
    keys, but only after JAX had lowered their threefry hashes: ~60 ms of a greedy decode program's lowering on the
    CPU, where the test suite lowers ~230 decode programs."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draw(distribution(logits, temperature, top_p), position_keys(seed, positions, SAMPLE))


def draw(p: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per lane from probabilities ``p [B, V]`` (zero-probability tokens are never drawn)."""
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
    return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, logp).astype(jnp.int32)


def accept_greedy(logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy verification: ``logits [B, T, V]`` of the verify rows (row j predicts the token after draft j - 1),
    ``drafts [B, D]`` with T = D + 1. Returns (accepted drafts a [B], the main model's tokens [B, T]); the tokens a
    step emits are drafts[:a] then target[a]: exactly what greedy decoding without drafts would produce."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    match = (drafts == target[:, :-1]).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32), target


def accept_sampled(logits: jax.Array, drafts: jax.Array, draft_p: jax.Array, positions: jax.Array, seed,
                   temperature, top_p) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling (Leviathan et al. / Chen et al.): draft j, proposed from ``draft_p[:, j]``, is accepted
    with probability min(1, p_j(d) / q_j(d)) while all earlier ones were; at the first rejection the token is drawn
    from normalise(max(p_j - q_j, 0)); if every draft is accepted the next is drawn from p_D. The emitted tokens are
    then distributed exactly as sampling from the main model one token at a time. ``positions [B]`` is the position
    of the first emitted token (draft 0). Returns (a [B], tokens [B, T]) as ``accept_greedy``."""
    B, T, V = logits.shape
    D = T - 1
    p = distribution(logits, temperature, top_p)  # [B, T, V]
    pd = jnp.take_along_axis(p[:, :D], drafts[..., None], axis=-1)[..., 0]  # [B, D]
    qd = jnp.take_along_axis(draft_p, drafts[..., None], axis=-1)[..., 0]
    u = jnp.stack([jax.vmap(jax.random.uniform)(position_keys(seed, positions + j, ACCEPT)) for j in range(D)], 1)
    ok = (u * qd <= pd).astype(jnp.int32)  # u < p/q without dividing by a zero q
    a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    # The distribution of the token at the first rejected (or the bonus) row.
    q_pad = jnp.concatenate([draft_p, jnp.zeros((B, 1, V), draft_p.dtype)], axis=1)
    resid = jnp.maximum(p - q_pad, 0.0)
    resid = jnp.where(jnp.arange(T)[None, :, None] == D, p, resid)  # after every draft: p itself
    norm = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(norm > 0, resid / jnp.maximum(norm, 1e-38), p)
    r_a = jnp.take_along_axis(resid, a[:, None, None], axis=1)[:, 0]  # [B, V]
    last = draw(r_a, position_keys(seed, positions + a, SAMPLE))
    tokens = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(T)[None, :] == a[:, None], last[:, None], tokens)
    return a, tokens

"""Selection workloads for benchmarks (``glm53.generate(selection_override=...)``): they control the locality of
the DSA selection so an experiment can fix the hot cache's hit rate. The indexer's own choice needs no override.
Also the setup the resident/offload experiments share (model, prompts, fixed-capacity cache config)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import glm53


def setup(c):
    """From an experiment config: ``(model, prompts, cache_config, K)``. The cache capacity is fixed to prompt + new
    tokens, so warm-up and timed runs share every shape; K is the number of positions a selection holds."""
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc, mesh=c.get("mesh"))
    rng = np.random.default_rng(c.run.seed)
    prompts = [rng.integers(0, model.config.vocab_size, c.run.prompt_len).tolist() for _ in range(c.run.batch)]
    total = c.run.prompt_len + c.run.max_new_tokens
    cc = cc.replace(max_len=total)
    K = min(model.config.index_topk, glm53.cache.capacity_for(total, cc))
    return model, prompts, cc, K


def selection(workload: str, K: int, history: int, seed: int):
    """The ``selection_override`` of a workload: ``"local99"`` or ``"indexer"`` (None: the model's own choice)."""
    if workload == "local99":
        return local99(K, history, seed)
    if workload == "indexer":
        return None
    raise ValueError(f"unknown workload {workload!r}: indexer | local99")


def local99(K: int, history: int, seed: int, churn: float = 0.01):
    """A selection override factory: the same positions every step but for ``churn`` of them (one set for every
    session: each row of the selection is the same)."""
    sets = WorkingSets(K, history, seed, 1, churn)

    def override(step: int, positions: np.ndarray) -> jax.Array:
        return jnp.broadcast_to(sets.step()[0], (len(positions), K))

    return override


def local99_sessions(K: int, history: int, seed: int, sessions: int, churn: float = 0.01):
    """``local99`` for several sessions at once: each session (row) keeps its own set of K history positions,
    replacing ``churn`` of them every step."""
    sets = WorkingSets(K, history, seed, sessions, churn)

    def override(step: int, positions: np.ndarray) -> jax.Array:
        rows = sets.step()
        return rows if len(positions) == sessions else rows[np.arange(len(positions)) % sessions]

    return override


class WorkingSets:
    """S sets of K distinct positions in ``[0, history)``; each step replaces about ``churn * K`` positions of every
    set with positions it does not hold.

    The sets live on the device and a step is one small jitted call: the override runs between decode steps, and
    on the H200 host-side numpy sets (a ``np.unique`` per row and step, ~0.4 ms each) plus the selection's transfer
    set the pace of the decode loop (105 ms a step at 16 sessions against 5.9 ms with the model's own indexer);
    a device array goes into the step with no host work and no transfer. A drawn position the set already holds
    (or one drawn twice) is not swapped in that step, so a step replaces ``churn * K * (1 - ~K / history)``
    positions: the sets stay distinct without a rejection loop (a loop would sync the device)."""

    def __init__(self, K: int, history: int, seed: int, sessions: int, churn: float = 0.01):
        if history < K:
            raise ValueError(f"a working set of {K} distinct positions needs a history of at least {K} (got {history})")
        rng = np.random.default_rng(seed)
        first = np.stack([np.sort(rng.choice(history, K, replace=False)) for _ in range(sessions)])
        self.chosen = jnp.asarray(first.astype(np.int32))
        self.key = jax.random.key(seed)
        self.n_new = max(1, int(round(churn * K)))
        self.history = history

    def step(self) -> jax.Array:
        """The sets after one more step of churn, ``int32 [S, K]`` (each row sorted)."""
        self.chosen, self.key = _churn(self.chosen, self.key, n_new=self.n_new, history=self.history)
        return self.chosen


@functools.partial(jax.jit, static_argnames=("n_new", "history"))
def _churn(chosen: jax.Array, key: jax.Array, *, n_new: int, history: int):
    S, K = chosen.shape
    key, k_slot, k_pos = jax.random.split(key, 3)
    slots = jax.random.randint(k_slot, (S, n_new), 0, K)
    fresh = jax.random.randint(k_pos, (S, n_new), 0, history, dtype=jnp.int32)
    at = jnp.minimum(jax.vmap(jnp.searchsorted)(chosen, fresh), K - 1)
    held = jnp.take_along_axis(chosen, at, 1) == fresh
    earlier = jnp.tril(jnp.ones((n_new, n_new), bool), -1)  # [i, j]: j drawn before i
    seen = ((fresh[:, :, None] == fresh[:, None, :]) & earlier).any(-1)
    old = jnp.take_along_axis(chosen, slots, 1)
    value = jnp.where(held | seen, old, fresh)
    # A slot drawn twice takes the value of its first draw at every occurrence: a scatter with repeated indices
    # writes them in no fixed order, so all of them must carry the same value.
    first = jnp.argmax(slots[:, :, None] == slots[:, None, :], axis=-1)
    value = jnp.take_along_axis(value, first, 1)
    new = chosen.at[jnp.arange(S)[:, None], slots].set(value)
    return jnp.sort(new, axis=1), key

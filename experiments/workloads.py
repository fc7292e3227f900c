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


WORKLOADS = ("indexer | local99 | drift<churn> (e.g. drift0.05) | uniform | window<stride> (e.g. window64) | "
             "zipf<exponent> (e.g. zipf1.0)")


def selection(workload: str, K: int, history: int, seed: int, sessions: int = 1):
    """The ``selection_override`` of a workload (None: the model's own choice). Every synthetic workload keeps its
    state on the device (no host work between steps); each session (row) has its own positions unless
    ``sessions=1``, where every row is the same. A series of runs takes ``Selections`` instead.

    - ``indexer``: the model's DSA selection (no override);
    - ``local99``: ``drift0.01``;
    - ``drift<c>``: a working set of K positions of which a fraction ``c`` is replaced each step (hits ~ 1 - c once
      the set is hot);
    - ``uniform``: K fresh distinct positions each step, uniform over the history (hits ~ hot rows / history);
    - ``window<s>``: K consecutive positions that slide by ``s`` each step, wrapping around the history (hits ~
      1 - s / K while the window fits the hot cache);
    - ``zipf<e>``: K distinct positions drawn afresh each step with probability proportional to ``rank ** -e``
      over a fixed random ranking of the history per session: lasting popularity with a long tail, the reuse where
      replacement policies differ (``glm53.policies``: LFU keeps more of it hot than circular)."""
    return Selections(workload, K, history, sessions)(seed)


def _state_factory(workload: str):
    """``(K, history, seed, sessions) -> device state`` of a workload's name, or None for ``indexer``."""
    if workload == "indexer":
        return None
    if workload == "local99":
        workload = "drift0.01"
    try:
        if workload.startswith("drift"):
            churn = float(workload[len("drift"):])
            if not 0 < churn <= 1:
                raise ValueError
            return functools.partial(WorkingSets, churn=churn)
        if workload == "uniform":
            return UniformSets
        if workload.startswith("window"):
            stride = int(workload[len("window"):])
            if stride < 1:
                raise ValueError
            return functools.partial(SlidingWindows, stride=stride)
        if workload.startswith("zipf"):
            exponent = float(workload[len("zipf"):])
            if not exponent > 0:
                raise ValueError
            return functools.partial(ZipfSets, exponent=exponent)
    except ValueError:
        pass
    raise ValueError(f"unknown workload {workload!r}: {WORKLOADS}")


def check_names(flag: str, names) -> None:
    """A usage error naming ``--flag`` for an empty list or a workload name ``selection`` would refuse, for the entry
    points to call before they build a model (its weights, prefill and warm-up came before the refusal)."""
    from absl import app

    if not names:
        raise app.UsageError(f"--{flag}: give at least one workload: {WORKLOADS}")
    for name in names:
        try:
            _state_factory(name)
        except ValueError as e:
            raise app.UsageError(f"--{flag}: {e}") from None


class Selections:
    """The overrides of one workload for a series of runs: ``selections(seed)`` is ``selection(workload, K,
    history, seed, sessions)``, but every override of the series keeps its device state in the same buffers: each
    new one writes its start over the last one's state (so one run at a time: an older override then continues
    from the new start).

    Why: a device array made between two ``generate`` calls and kept through the next one can be placed where the
    decode steps' temporaries were. XLA then finds the temporaries elsewhere at that run's first call of each step
    executable and records its CUDA graphs again, 2-8 ms a call on the H200 against a ~1.3 ms step
    (``experiments/results/probes/cmdbuf_updates_8k_alloc_da1a864.json``: a fresh 80 KiB working set per run moved
    the 139 MB of temporaries by 160 KiB, run after run, and set the 10-session step-call p99)."""

    def __init__(self, workload: str, K: int, history: int, sessions: int = 1):
        self.factory = _state_factory(workload)  # a bad name fails here
        self.K, self.history, self.sessions = K, history, sessions
        self.state = None

    def __call__(self, seed: int):
        if self.factory is None:
            return None
        if self.state is None:
            self.state = self.factory(self.K, self.history, seed, self.sessions)
        else:
            self.state.reset(seed)
        return _rows_override(self.state, self.sessions, self.K)


def _in_place(old, new):
    """``new`` (numpy or device arrays) on the device, in ``old``'s buffers when there are any (see ``Selections``)."""
    if old is None:
        return jax.tree_util.tree_map(jnp.asarray, new)
    return _write_over(old, new)


# An update of the whole of ``old``, not ``return new``: JAX drops an unused argument, and its donation with it.
@functools.partial(jax.jit, donate_argnums=0)
def _write_over(old, new):
    return jax.tree_util.tree_map(lambda o, n: jax.lax.dynamic_update_slice(o, n, (0,) * o.ndim), old, new)


def _rows_override(sets, sessions: int, K: int):
    def override(step: int, positions: np.ndarray) -> jax.Array:
        rows = sets.step()
        if len(positions) == sessions:  # the sets as they are: nothing new allocated between two decode steps
            return rows
        if sessions == 1:
            return jnp.broadcast_to(rows[0], (len(positions), K))
        return rows[np.arange(len(positions)) % sessions]
    override.sets = sets  # the device-side state, for inspection (tests trace one step of it)
    return override


class UniformSets:
    """S rows of K distinct positions drawn afresh, uniformly over ``[0, history)``, at every step (on the device)."""

    def __init__(self, K: int, history: int, seed: int, sessions: int):
        if history < K:
            raise ValueError(f"{K} distinct positions need a history of at least {K} (got {history})")
        self.K, self.history, self.sessions = K, history, sessions
        self.key = None
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """The state of a fresh ``UniformSets`` of ``seed``, written over this one's buffers (``Selections``)."""
        self.key = _in_place(self.key, jax.random.key(seed))

    def step(self) -> jax.Array:
        self.key, rows = _uniform(self.key, K=self.K, history=self.history, sessions=self.sessions)
        return rows


@functools.partial(jax.jit, static_argnames=("K", "history", "sessions"))
def _uniform(key, *, K: int, history: int, sessions: int):
    key, sub = jax.random.split(key)
    keys = jax.random.split(sub, sessions)
    rows = jax.vmap(lambda k: jnp.sort(jax.random.choice(k, history, (K,), replace=False)))(keys)
    return key, rows.astype(jnp.int32)


class SlidingWindows:
    """S windows of K consecutive positions (mod ``history``), each starting at its own random offset and moving by
    ``stride`` positions per step (on the device)."""

    def __init__(self, K: int, history: int, seed: int, sessions: int, stride: int):
        if history < K:
            raise ValueError(f"a window of {K} distinct positions needs a history of at least {K} (got {history})")
        self.K, self.history, self.stride, self.sessions = K, history, stride, sessions
        self.start = None
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """The state of a fresh ``SlidingWindows`` of ``seed``, written over this one's buffers (``Selections``)."""
        rng = np.random.default_rng(seed)
        self.start = _in_place(self.start, rng.integers(0, self.history, self.sessions).astype(np.int32))

    def step(self) -> jax.Array:
        self.start, rows = _window(self.start, K=self.K, history=self.history, stride=self.stride)
        return rows


@functools.partial(jax.jit, static_argnames=("K", "history", "stride"), donate_argnums=0)
def _window(start, *, K: int, history: int, stride: int):
    start = (start + stride) % history
    rows = (start[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]) % history
    return start, jnp.sort(rows, axis=1)


class ZipfSets:
    """S rows of K distinct positions drawn afresh each step, position ``p`` with probability proportional to
    ``rank(p) ** -exponent``, each session ranking the history by its own fixed random permutation (on the device;
    without replacement by Gumbel top-k, as ``experiments.policy_sweep.zipf_rows`` draws its traces)."""

    def __init__(self, K: int, history: int, seed: int, sessions: int, exponent: float):
        if history < K:
            raise ValueError(f"{K} distinct positions need a history of at least {K} (got {history})")
        self.logp = jnp.asarray(-exponent * np.log(np.arange(1, history + 1, dtype=np.float64)), jnp.float32)
        self.K, self.history, self.sessions = K, history, sessions
        self.by_rank = self.key = None
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """The state of a fresh ``ZipfSets`` of ``seed``, written over this one's buffers (``Selections``)."""
        rng = np.random.default_rng(seed)
        by_rank = np.stack([rng.permutation(self.history) for _ in range(self.sessions)]).astype(np.int32)
        state = None if self.key is None else (self.by_rank, self.key)
        self.by_rank, self.key = _in_place(state, (by_rank, jax.random.key(seed)))

    def step(self) -> jax.Array:
        self.key, rows = _zipf(self.key, self.by_rank, self.logp, K=self.K)
        return rows


@functools.partial(jax.jit, static_argnames=("K",))
def _zipf(key, by_rank, logp, *, K: int):
    key, sub = jax.random.split(key)
    keys = logp[None, :] + jax.random.gumbel(sub, by_rank.shape)
    _, ranks = jax.lax.top_k(keys, K)
    return key, jnp.sort(jnp.take_along_axis(by_rank, ranks, 1), axis=1)


def local99(K: int, history: int, seed: int, churn: float = 0.01):
    """A selection override factory: the same positions every step but for ``churn`` of them (one set for every
    session: each row of the selection is the same)."""
    return _rows_override(WorkingSets(K, history, seed, 1, churn), 1, K)


def local99_sessions(K: int, history: int, seed: int, sessions: int, churn: float = 0.01):
    """``local99`` for several sessions at once: each session (row) keeps its own set of K history positions,
    replacing ``churn`` of them every step."""
    return _rows_override(WorkingSets(K, history, seed, sessions, churn), sessions, K)


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
        self.n_new = max(1, int(round(churn * K)))
        self.K, self.history, self.sessions = K, history, sessions
        self.chosen = self.key = None
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """The state of a fresh ``WorkingSets`` of ``seed``, written over this one's buffers (``Selections``)."""
        rng = np.random.default_rng(seed)
        first = np.stack([np.sort(rng.choice(self.history, self.K, replace=False)) for _ in range(self.sessions)])
        state = None if self.key is None else (self.chosen, self.key)
        self.chosen, self.key = _in_place(state, (first.astype(np.int32), jax.random.key(seed)))

    def step(self) -> jax.Array:
        """The sets after one more step of churn, ``int32 [S, K]`` (each row sorted)."""
        self.chosen, self.key = _churn(self.chosen, self.key, n_new=self.n_new, history=self.history)
        return self.chosen


# Donated: the new sets are written where the old ones were. An array made between two decode steps can land where
# the step's temporaries were, and the step's CUDA graphs are then recorded again (glm53.engine._StepRing).
@functools.partial(jax.jit, static_argnames=("n_new", "history"), donate_argnums=(0, 1))
def _churn(chosen: jax.Array, key: jax.Array, *, n_new: int, history: int):
    S, K = chosen.shape
    key, k_slot, k_pos = jax.random.split(key, 3)
    slots = jax.random.randint(k_slot, (S, n_new), 0, K)
    fresh = jax.random.randint(k_pos, (S, n_new), 0, history, dtype=jnp.int32)
    # compare_all, not the default binary search: that is a while loop, and on a GPU each trip copies its predicate
    # to the host and waits for it, ~12 round trips between two decode steps (446 us of host time a profiled
    # 10-lane step: profile_decode_8k_b10_host_e0171ab.json). The [S, n_new, K] comparison is small.
    at = jnp.minimum(jax.vmap(functools.partial(jnp.searchsorted, method="compare_all"))(chosen, fresh), K - 1)
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

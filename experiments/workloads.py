"""Selection workloads for benchmarks (``glm53.generate(selection_override=...)``): they control the locality of
the DSA selection so an experiment can fix the hot cache's hit rate. The indexer's own choice needs no override.
Also the setup the resident/offload experiments share (model, prompts, fixed-capacity cache config)."""

import numpy as np

import glm53


def setup(c):
    """From an experiment config: ``(model, prompts, cache_config, K)``. The cache capacity is fixed to prompt + new
    tokens, so warm-up and timed runs share every shape; K is the number of positions a selection holds."""
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
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
    """A selection override factory: the same positions every step but for ``churn`` of them."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice(history, K, replace=history < K)

    def override(step: int, positions: np.ndarray) -> np.ndarray:
        n_new = max(1, int(round(churn * K)))
        idx = rng.choice(K, n_new, replace=False)
        chosen[idx] = rng.integers(0, history, n_new)
        while history >= K and len(np.unique(chosen)) < K:  # selections hold distinct positions, as the indexer's do
            dup = np.setdiff1d(np.arange(K), np.unique(chosen, return_index=True)[1])
            chosen[dup] = rng.integers(0, history, len(dup))
        return np.broadcast_to(np.sort(chosen), (len(positions), K)).astype(np.int32)

    return override


def local99_sessions(K: int, history: int, seed: int, sessions: int, churn: float = 0.01):
    """``local99`` for several sessions at once: each session (row) keeps its own set of K history positions,
    replacing ``churn`` of them every step."""
    rngs = [np.random.default_rng(seed * 1000 + b) for b in range(sessions)]
    chosen = [r.choice(history, K, replace=history < K) for r in rngs]

    def override(step: int, positions: np.ndarray) -> np.ndarray:
        n_new = max(1, int(round(churn * K)))
        out = np.empty((len(positions), K), np.int32)
        for b in range(len(positions)):
            r, c = rngs[b % sessions], chosen[b % sessions]
            idx = r.choice(K, n_new, replace=False)
            fresh = r.integers(0, history, n_new)
            c[idx] = fresh
            # distinct positions: redraw the (rare) duplicates among the K
            while history >= K and len(np.unique(c)) < K:
                dup = np.setdiff1d(np.arange(K), np.unique(c, return_index=True)[1])
                c[dup] = r.integers(0, history, len(dup))
            out[b] = np.sort(c)
        return out

    return override

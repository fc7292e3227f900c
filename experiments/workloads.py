"""Selection workloads for benchmarks (``glm53.generate(selection_override=...)``): they control the locality of
the DSA selection so an experiment can fix the hot cache's hit rate. The indexer's own choice needs no override."""

import numpy as np


def local99(K: int, history: int, seed: int, churn: float = 0.01):
    """A selection override factory: the same positions every step but for ``churn`` of them."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice(history, K, replace=history < K)

    def override(step: int, positions: np.ndarray) -> np.ndarray:
        n_new = max(1, int(round(churn * K)))
        idx = rng.choice(K, n_new, replace=False)
        chosen[idx] = rng.integers(0, history, n_new)
        return np.broadcast_to(np.sort(chosen), (len(positions), K)).astype(np.int32)

    return override

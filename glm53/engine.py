"""``Model``: a module, its parameters and its jitted steps, with the public entry points research scripts use."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from glm53 import cache as kvcache
from glm53.config import CacheConfig, ModelConfig
from glm53.model import GLM5, Step
from glm53.steps import Steps

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "bf16": jnp.bfloat16}


def resolve_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} unknown; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype {dt} unsupported; use float32 or bfloat16")
    return dt.type


def _dummy_inputs(cfg: ModelConfig, dtype):
    cache = kvcache.init_cache(cfg, CacheConfig(kv_format="f32"), 1, 128, dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    step = Step(positions=jnp.zeros((1, 1), jnp.int32), write_positions=jnp.zeros((1, 1), jnp.int32),
                cos=jnp.ones((1, 1, cfg.qk_rope_head_dim // 2), dtype),
                sin=jnp.zeros((1, 1, cfg.qk_rope_head_dim // 2), dtype))
    return tokens, step, cache


def _init_all(module: GLM5, key, tokens, step, cache):
    """Create every parameter (main layers and MTP) by running each method once."""
    cfg = module.cfg

    def run(m, tokens, step, cache):
        hidden, cache = m(tokens, step, cache)
        m.logits(hidden)
        if cfg.num_nextn_predict_layers:
            m.mtp(hidden, tokens, step, cache)

    return module.init(key, tokens, step, cache, method=run)["params"]


def param_shapes(cfg: ModelConfig, dtype) -> Any:
    """The parameter pytree as ShapeDtypeStructs, without allocating anything."""
    module = GLM5(cfg, dtype)
    return jax.eval_shape(lambda: _init_all(module, jax.random.key(0), *_dummy_inputs(cfg, dtype)))


_ONES = ("weight", "k_norm_weight")  # RMSNorm / LayerNorm scales
_ZEROS = ("k_norm_bias", "e_score_correction_bias")


def init_params(cfg: ModelConfig, dtype, seed: int = 0) -> Any:
    """Random parameters: normal(0, initializer_range) matrices, unit norm scales, zero biases (as transformers
    initialises GLM-5). Filled leaf by leaf from the shapes, so the model itself is never compiled for this."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    flat = flatten_dict(param_shapes(cfg, dtype))
    paths = sorted(flat)

    @jax.jit
    def make(key):
        out = {}
        for i, path in enumerate(paths):
            s = flat[path]
            if path[-1] in _ONES:
                out[path] = jnp.ones(s.shape, s.dtype)
            elif path[-1] in _ZEROS:
                out[path] = jnp.zeros(s.shape, s.dtype)
            else:
                k = jax.random.fold_in(key, i)
                out[path] = (cfg.initializer_range * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
        return out

    return unflatten_dict(make(jax.random.key(seed)))


class Model:
    """GLM-5 weights plus the jitted steps that run them.

    ``forward(token_ids)`` gives the logits of a whole sequence; ``glm53.generate`` decodes; ``draft`` runs the MTP
    module; ``save`` writes an orbax checkpoint that ``glm53.load`` reads.
    """

    def __init__(self, config: ModelConfig, params: Any, dtype=jnp.bfloat16, *,
                 cache_config: CacheConfig | None = None, tokenizer=None):
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.params = params
        self.cache_config = cache_config or CacheConfig(kv_format="f32" if self.dtype == jnp.float32 else "bf16")
        if self.cache_config.mode == "offload":  # sizes that cannot work fail here, before any run
            from glm53 import offload
            offload.validate(config, self.cache_config)
        self.tokenizer = tokenizer
        self.module = GLM5(config, self.dtype)
        self.steps = Steps(self.module)

    def __repr__(self):
        return (f"Model({self.config.num_hidden_layers} layers, hidden {self.config.hidden_size}, "
                f"{self.num_params() / 1e6:.1f}M params, dtype {jnp.dtype(self.dtype).name}, "
                f"cache {self.cache_config.mode}/{self.cache_config.kv_format})")

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self.params))

    # ---- validation shared by every entry point ----
    def check_tokens(self, ids, what: str = "prompt") -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"{what} is empty: at least one token is needed")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.config.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{what} has token id {int(arr[i])} at index {i}, outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        return arr.astype(np.int32)

    def check_length(self, total: int, what: str) -> None:
        if total > self.config.max_position_embeddings:
            raise ValueError(f"{what} needs {total} positions but the model has max_position_embeddings="
                             f"{self.config.max_position_embeddings}")

    def new_cache(self, batch: int, capacity_rows: int, cache_config: CacheConfig | None = None) -> kvcache.KVCache:
        cc = cache_config or self.cache_config
        if cc.mode == "offload":
            from glm53 import offload
            offload.validate(self.config, cc)
        capacity = kvcache.capacity_for(cc, capacity_rows)
        cache = kvcache.init_cache(self.config, cc, batch, capacity, self.dtype)
        if cc.mode == "offload":
            from glm53 import offload
            cache = offload.to_offload(cache, self.config, cc)
        return cache

    # ---- public API ----
    def forward(self, token_ids, *, cache_config: CacheConfig | None = None, progress: bool = False) -> np.ndarray:
        """Float32 logits ``[T, vocab]`` of every position of one sequence (the chunked prefill path)."""
        from glm53.generate import prefill

        ids = self.check_tokens(token_ids, "token_ids")
        self.check_length(len(ids), "forward")
        cache = self.new_cache(1, len(ids), cache_config)
        driver = None
        if cache.mode == "offload":
            from glm53 import offload
            driver = offload.Driver(cache)
        logits, _, _ = prefill(self, cache, [ids], all_logits=True, progress=progress,
                               chunk=(cache_config or self.cache_config).prefill_chunk, driver=driver)
        return np.asarray(logits[0][: len(ids)], np.float32)

    def draft(self, token_ids) -> np.ndarray:
        """MTP draft logits of one sequence: row i predicts token i+2 from the main model's hidden state at i and
        token i+1. Returns float32 ``[T-1, vocab]``."""
        if not self.config.num_nextn_predict_layers:
            raise ValueError("this model has no MTP module (num_nextn_predict_layers=0)")
        from glm53.generate import prefill

        ids = self.check_tokens(token_ids, "token_ids")
        if len(ids) < 2:
            raise ValueError("draft needs at least 2 tokens (a position and its next token)")
        self.check_length(len(ids), "draft")
        # Resident: in offload mode the MTP layer runs one position behind the copyback of its pages, which is
        # the speculative-decoding engine's job to schedule.
        cache = self.new_cache(1, len(ids), self.cache_config.replace(mode="resident"))
        _, hidden, cache = prefill(self, cache, [ids], all_logits=False, return_hidden=True,
                                   chunk=self.cache_config.prefill_chunk)
        T = len(ids) - 1
        h = hidden[:, :T]
        nxt = jnp.asarray(ids[1:], jnp.int32)[None]
        logits, _, cache = self.steps.mtp(self.params, cache, h, nxt, jnp.asarray([T], jnp.int32))
        return np.asarray(logits[0], np.float32)

    def save(self, directory: str) -> None:
        from glm53 import checkpoint
        checkpoint.save(self, directory)

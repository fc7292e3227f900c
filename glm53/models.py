"""``Model``: a GLM-5 module, its parameters, its tokenizer and its jitted steps; and the ways to get one
(``from_config``, ``from_pretrained``, ``load``)."""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from glm53 import checkpoint, memory, offload, sharding
from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.engine import Engine
from glm53.model import GLM5
from glm53.params import expert_weights_of, init_params, num_params, resolve_dtype
from glm53.steps import Steps


class Model:
    """GLM-5 weights plus the jitted steps that run them.

    ``forward(token_ids)`` gives the logits of a whole sequence; ``glm53.generate`` and ``glm53.Engine`` decode;
    ``draft`` runs the MTP module; ``save`` writes an orbax checkpoint that ``glm53.load`` reads. ``cache_config``
    is the default cache of engines built on the model.
    """

    def __init__(self, config: ModelConfig, params: Any, dtype=jnp.bfloat16, *,
                 cache_config: CacheConfig | None = None, tokenizer=None):
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.params = params
        self.cache_config = cache_config or CacheConfig(kv_format="f32" if self.dtype == jnp.float32 else "bf16")
        if self.cache_config.mode == "offload":  # sizes that cannot work fail here, before any run
            offload.validate(config, self.cache_config)
        self.tokenizer = tokenizer
        self.module = GLM5(config, self.dtype)
        self.steps = Steps(self.module)
        self.mesh = None  # a jax.sharding.Mesh once glm53.sharding.shard_model placed the parameters on one
        self.pipeline = None  # a glm53.pipeline.Pipeline when that mesh has stages
        self._digest: str | None = None

    @property
    def tokenizer(self):
        """The attached ``glm53.Tokenizer`` (strings in, text out), or None."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        # Checked when attached, not at the first string that happens to encode past the vocabulary.
        if tokenizer is not None and tokenizer.vocab_size > self.config.vocab_size:
            raise ConfigError(f"the tokenizer has {tokenizer.vocab_size:,} ids but the model's vocabulary holds "
                              f"{self.config.vocab_size:,} (ids 0-{self.config.vocab_size - 1}): a tokenizer of "
                              "another model?")
        self._tokenizer = tokenizer

    def __repr__(self):
        experts = ", fp8 experts" if self.expert_weights == "fp8" else ""
        return (f"Model({self.config.num_hidden_layers} layers, hidden {self.config.hidden_size}, "
                f"{self.num_params() / 1e6:.1f}M params, dtype {jnp.dtype(self.dtype).name}{experts}, "
                f"cache {self.cache_config.mode}/{self.cache_config.kv_format})")

    @property
    def expert_weights(self) -> str:
        """"fp8" when the MoE experts are held in FP8 (``from_config`` / ``from_pretrained(expert_weights=)``)."""
        return expert_weights_of(self.params)

    def num_params(self) -> int:
        return num_params(self.params)

    def params_digest(self) -> str:
        """A digest of the parameters (shapes, dtypes and up to 4,096 values of every tensor): what a saved session
        records, so it is never restored into other weights."""
        if self._digest is None:
            self._digest = checkpoint.params_digest(self.params)
        return self._digest

    def set_params_digest(self, digest: str) -> None:
        """The digest of the current parameters, computed where they were placed (``glm53.sharding.shard_model``) or
        read (``load``)."""
        self._digest = digest

    @property
    def has_params_digest(self) -> bool:
        """Whether ``params_digest()`` is known without computing it."""
        return self._digest is not None

    # ---- validation shared by every entry point ----
    def check_tokens(self, ids, what: str = "prompt") -> np.ndarray:
        if not hasattr(ids, "shape") and (not isinstance(ids, collections.abc.Sequence)
                                          or isinstance(ids, (str, bytes, bytearray))):
            # a generator, set, dict or bytes: numpy makes a 0-d object array of it, which says nothing useful
            raise TypeError(f"{what} must be a 1-D sequence of token ids (a list, a numpy or JAX array, or a string "
                            f"with a tokenizer), got a {type(ids).__name__}")
        if isinstance(ids, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) for t in ids):
            # numpy would read True as token 1
            raise TypeError(f"{what} must hold integer token ids, got a bool at index "
                            f"{next(i for i, t in enumerate(ids) if isinstance(t, (bool, np.bool_)))}")
        try:
            arr = np.asarray(ids)
        except ValueError:  # ragged nesting
            raise ValueError(f"{what} must be a 1-D sequence of token ids, got nested sequences of unequal "
                             "lengths") from None
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

    def token_ids(self, ids, what: str = "prompt") -> list[int]:
        """Token ids from a list, a numpy / JAX array or a string (with the attached tokenizer), checked."""
        if isinstance(ids, str):
            if self.tokenizer is None:
                raise ValueError(f"{what} is a string but the model has no tokenizer attached "
                                 "(glm53.Tokenizer.from_file(...), or from_pretrained on a directory with "
                                 "tokenizer.json)")
            ids = self.tokenizer.encode(ids)
        return self.check_tokens(ids, what).tolist()

    def check_length(self, total: int, what: str) -> None:
        if total > self.config.max_position_embeddings:
            raise ValueError(f"{what} needs {total} positions but the model has max_position_embeddings="
                             f"{self.config.max_position_embeddings}")

    # ---- public API ----
    def forward(self, token_ids, *, cache_config: CacheConfig | None = None, progress: bool | None = None,
                kernels: str = "auto") -> np.ndarray:
        """Float32 logits ``[T, vocab]`` of every position of one sequence (the chunked prefill path; ``token_ids``
        as ``Engine.open`` takes them, a string too with a tokenizer; ``progress`` as there)."""
        ids = self.token_ids(token_ids, "token_ids")
        self.check_length(len(ids), "forward")
        cc = (cache_config or self.cache_config).replace(max_len=len(ids))
        engine = Engine(self, cc, max_sessions=1, kernels=kernels)
        _, outs = engine.forward_outputs(ids, "logits", progress=progress)
        return np.concatenate([np.asarray(o[0], np.float32) for o in outs], axis=0)[: len(ids)]

    def draft(self, token_ids, *, kernels: str = "auto") -> np.ndarray:
        """MTP draft logits of one sequence: row i predicts token i+2 from the main model's hidden state at i and
        token i+1. Returns float32 ``[T-1, vocab]``."""
        if not self.config.num_nextn_predict_layers:
            raise ValueError("this model has no MTP module (num_nextn_predict_layers=0)")
        ids = self.token_ids(token_ids, "token_ids")
        if len(ids) < 2:
            raise ValueError("draft needs at least 2 tokens (a position and its next token)")
        self.check_length(len(ids), "draft")
        engine = Engine(self, self.cache_config.replace(mode="resident", max_len=len(ids)), max_sessions=1,
                        kernels=kernels)
        _, outs = engine.forward_outputs(ids, "hidden")
        hidden = jnp.concatenate(outs, axis=1)[:, : len(ids) - 1]
        T = len(ids) - 1
        lanes, _ = engine._lanes([0])
        nxt = jnp.asarray(ids[1:], jnp.int32)[None]
        engine.cache, logits = self.steps("mtp_forward", self.params, engine.cache, lanes, hidden, nxt,
                                          jnp.asarray([T], jnp.int32), kernels=kernels)
        return np.asarray(logits[0], np.float32)

    def save(self, directory: str) -> None:
        checkpoint.write_native(directory, self.config, self.params, self.dtype, self.cache_config, self.tokenizer,
                                params_digest=self.params_digest())


# ----------------------------------------------------------------------------------------------------------------
# Constructors
# ----------------------------------------------------------------------------------------------------------------
def _default_device():
    """Where weights are made or read before any mesh placement: JAX's default device (this process's first, in a
    run of several processes, unless ``jax_default_device`` says otherwise)."""
    device = jax.config.jax_default_device
    if isinstance(device, str):  # a platform's name
        return jax.local_devices(backend=device)[0]
    return device if device is not None else jax.local_devices()[0]


def _check_cache(config: ModelConfig, cache_config: CacheConfig | None) -> None:
    """What ``Model`` refuses of a cache config, checked before any weight is read or initialised."""
    if cache_config is not None and cache_config.mode == "offload":
        offload.validate(config, cache_config)


def from_config(config: ModelConfig | Mapping[str, Any], seed: int = 0, *, dtype="bfloat16",
                cache_config: CacheConfig | None = None, expert_weights: str = "model", mesh=None,
                progress: bool | None = None) -> Model:
    """A randomly initialised model (normal(0, initializer_range) matrices, unit norms) for research/benchmarks.
    ``config``: a ``ModelConfig``, or a mapping/ConfigDict of its fields. ``expert_weights="fp8"`` keeps the MoE
    experts in FP8 with 128 x 128 block scales on the device (the same random values, quantised). ``mesh`` (a
    ``glm53.sharding.MeshConfig``, its dict, or a ``jax.sharding.Mesh``) places the parameters on a mesh by
    ``glm53.sharding``'s rules (with pipeline stages each on its stage's devices), each as soon as it is drawn, so
    a device holds only its share (``glm53.sharding.Placement``); engines built on the model put their cache there.
    ``progress``: a bar over the weights filled (``glm53.progress``: by default once the fill has run 2 s)."""
    if not isinstance(config, ModelConfig):
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        config = ModelConfig.from_config_dict(config)
    dtype = resolve_dtype(dtype)
    mesh, microbatches = sharding.resolve_mesh(mesh)
    sharding.check_layout(config, mesh)
    _check_cache(config, cache_config)  # before the parameters: initialising a large model takes a while
    memory.check_weights_fit(config, dtype, expert_weights, _default_device(), "random weights", mesh=mesh,
                             drawn=True)
    placed = sharding.placement(config, dtype, expert_weights, mesh, microbatches)
    params = init_params(config, dtype, seed, expert_weights, progress=progress, place=placed)
    model = Model(config, params, dtype, cache_config=cache_config)
    return sharding.shard_model(model, mesh, placed=placed)


def from_pretrained(path: str, *, dtype="bfloat16", kv_format: str | None = None,
                    cache_config: CacheConfig | None = None, expert_weights: str = "model", mesh=None,
                    mtp: bool = True, progress: bool | None = None) -> Model:
    """Load an HF-format GLM-5 (``glm_moe_dsa``) directory: ``config.json`` plus ``model.safetensors`` or shards
    with ``model.safetensors.index.json``; per-expert tensor names (``mlp.experts.E.gate_proj.weight``) as published
    and as transformers' ``save_pretrained`` writes them, or fused ``mlp.experts.gate_up_proj``. Tensors stream one
    at a time from the memory-mapped files to the device and are checked to be finite; a ``tokenizer.json`` beside
    the weights is attached. ``expert_weights="fp8"`` keeps the MoE experts in FP8 on the device (an FP8
    checkpoint's own bytes and block scales; other checkpoints' experts quantised), dequantised inside the grouped
    matmul on the same bf16 operands as dequantising on load: decode reads half the expert bytes (outputs
    bit-identical on the CPU; compiled on a GPU the kernel's summation order may differ). ``mesh``: as in
    ``from_config``: each tensor goes to its devices as soon as it is read, so a device holds its share and the
    tensor being read. ``mtp=False`` loads without the MTP module (checkpoints re-saved by
    transformers keep the config's MTP layer but not its tensors). ``progress``: a bar over the bytes read (True:
    at once; None: once loading has run 2 s; False: none)."""
    dtype = resolve_dtype(dtype)
    if kv_format is not None:
        cache_config = (cache_config or CacheConfig()).replace(kv_format=kv_format)
    if not isinstance(mtp, bool):
        raise TypeError(f"mtp must be True or False, got {mtp!r}")
    hf_config = checkpoint.read_hf_config(path)
    if not mtp:
        hf_config = dataclasses.replace(hf_config, num_nextn_predict_layers=0)
    mesh, microbatches = sharding.resolve_mesh(mesh)
    sharding.check_layout(hf_config, mesh)
    _check_cache(hf_config, cache_config)
    memory.check_weights_fit(hf_config, dtype, expert_weights, _default_device(), f"loading {path}", mesh=mesh,
                             read_itemsize=checkpoint.stored_itemsize(path))
    placed = sharding.placement(hf_config, dtype, expert_weights, mesh, microbatches)
    cfg, params, tokenizer = checkpoint.read_hf(path, dtype, expert_weights, mtp=mtp, progress=progress, place=placed)
    model = Model(cfg, params, dtype, cache_config=cache_config, tokenizer=tokenizer)
    return sharding.shard_model(model, mesh, placed=placed)


def load(directory: str, *, dtype=None, mesh=None) -> Model:
    """Read a directory written by ``Model.save`` (``mesh``: as in ``from_config``; orbax restores each parameter
    straight onto its devices)."""
    mesh, microbatches = sharding.resolve_mesh(mesh)
    cfg, params, dtype, cache_config, tokenizer, placed, digest = checkpoint.read_native(
        directory, dtype, check_config=lambda cfg: sharding.check_layout(cfg, mesh), mesh=mesh,
        microbatches=microbatches)
    try:
        model = Model(cfg, params, dtype, cache_config=cache_config, tokenizer=tokenizer)
    except ConfigError as e:
        raise checkpoint.CheckpointError(f"{directory}: its cache config cannot work with its model: {e}") from e
    if digest is not None:  # computed to check the save: not again (with stages it reads every stage's weights)
        model.set_params_digest(digest)
    return sharding.shard_model(model, mesh, placed=placed)

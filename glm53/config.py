"""Typed, frozen configuration of the model and of the KV cache.

Experiments describe runs with ml_collections ConfigDicts (``configs/*.py``); library code never reads loose
dicts: ``ModelConfig.from_config_dict`` / ``CacheConfig.from_config_dict`` map them onto these dataclasses at the
boundary, and ``ModelConfig.from_hf`` / ``to_hf`` map HF ``config.json`` files (transformers' ``glm_moe_dsa``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from kernels_pallas import indexer_topk, kv_formats

# The cache modes an engine can run in: everything on the accelerator, or history in host memory + hot cache.
CACHE_MODES = ("resident", "offload")
CACHE_POLICIES = ("circular", "lfu")
INDEX_KEY_FORMATS = indexer_topk.KEY_FORMATS
INDEXER_PRECISIONS = indexer_topk.PRECISIONS


class ConfigError(ValueError):
    """A configuration that cannot work (the message names the field and why)."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GLM-5 (transformers ``GlmMoeDsaConfig``) hyper-parameters. Defaults are the full-size model."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288  # dense SwiGLU MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    first_k_dense_replace: int = 3
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    # Per layer: "full" runs its own indexer, "shared" reuses the previous full layer's top-k.
    indexer_types: tuple[str, ...] = ()
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 202752
    num_nextn_predict_layers: int = 1  # MTP modules, stored as layer index num_hidden_layers in checkpoints
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    initializer_range: float = 0.02

    def __post_init__(self):
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * self.num_hidden_layers)
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        self.validate()

    # ---- derived sizes ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rope key (576 for GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def num_cache_layers(self) -> int:
        """Decoder layers that own KV rows: the main layers plus the MTP layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def layer_indexer_type(self, layer: int) -> str:
        # MTP layers (index >= num_hidden_layers) run their own indexer: they have no earlier full layer in their
        # own forward pass to share with.
        return self.indexer_types[layer] if layer < self.num_hidden_layers else "full"

    @property
    def cache_holds_mtp_layer(self) -> bool:
        """Whether the last cache layer is the MTP layer (a pipeline stage's cache may hold main layers only)."""
        return bool(self.num_nextn_predict_layers)

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """Cache layers with an indexer of their own (these, and only these, cache indexer keys)."""
        return tuple(l for l in range(self.num_cache_layers) if self.layer_indexer_type(l) == "full")

    def validate(self) -> None:
        # Types first: a config.json with "hidden_size": "64" must be named, not fail as a comparison of str and int.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                _require(isinstance(value, numbers.Integral) and not isinstance(value, bool),
                         f"{f.name} must be an int, got {value!r}")
            elif f.type == "float":
                _require(isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value),
                         f"{f.name} must be a finite number, got {value!r}")
            elif f.type == "bool":
                _require(isinstance(value, bool), f"{f.name} must be true or false, got {value!r}")
        _require(self.vocab_size > 0 and self.hidden_size > 0, "vocab_size and hidden_size must be positive")
        # Sizes of zero build empty weights that load and then compute nothing meaningful (or divide by zero).
        for name in ("num_attention_heads", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
                     "max_position_embeddings"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(self.first_k_dense_replace == 0 or self.intermediate_size >= 1,
                 f"intermediate_size must be >= 1 (the dense MLP of the first {self.first_k_dense_replace} layers), "
                 f"got {self.intermediate_size}")
        _require(self.n_shared_experts >= 0, f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        # generate stops at these ids: one outside the vocabulary would fail every generate call, far from the config.
        eos = tuple(self.eos_token_id) if isinstance(self.eos_token_id, (tuple, list)) else (self.eos_token_id,)
        bad_eos = [t for t in eos if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                                       or not 0 <= t < self.vocab_size)]
        _require(not bad_eos and (None not in eos or self.eos_token_id is None),
                 f"eos_token_id must be None or token ids in [0, vocab_size={self.vocab_size}), got "
                 f"{self.eos_token_id!r}")
        _require(self.num_hidden_layers >= 1, f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        _require(len(self.indexer_types) == self.num_hidden_layers,
                 f"indexer_types has {len(self.indexer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.indexer_types) - {"full", "shared"})
        _require(not bad, f"indexer_types entries must be 'full' or 'shared', got {bad}")
        _require(self.indexer_types[0] == "full",
                 "indexer_types[0] must be 'full': a 'shared' layer reuses the previous full layer's top-k")
        _require(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
                 f"first_k_dense_replace={self.first_k_dense_replace} outside [0, {self.num_hidden_layers}]")
        # The KV row formats and kernels are built for GLM-5's 576-value rows (512-d latent + 64-d rope key).
        _require(self.kv_lora_rank == 512, f"kv_lora_rank={self.kv_lora_rank}: glm53's KV row formats hold a "
                 "512-d latent (GLM-5's); other widths are not supported")
        _require(self.qk_rope_head_dim == 64, f"qk_rope_head_dim={self.qk_rope_head_dim}: glm53's KV row formats "
                 "hold a 64-d rope key (GLM-5's); other widths are not supported")
        _require(self.index_head_dim >= self.qk_rope_head_dim,
                 f"index_head_dim={self.index_head_dim} < qk_rope_head_dim={self.qk_rope_head_dim}: the indexer "
                 "applies RoPE to its first qk_rope_head_dim dims")
        _require(self.index_topk >= 1, "index_topk must be >= 1")
        _require(self.num_nextn_predict_layers in (0, 1),
                 f"num_nextn_predict_layers={self.num_nextn_predict_layers}: glm53 supports 0 or 1 MTP module")
        if self.num_hidden_layers > self.first_k_dense_replace or self.num_nextn_predict_layers:
            _require(self.n_routed_experts >= 1, "n_routed_experts must be >= 1")
            _require(self.moe_intermediate_size >= 1,
                     f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
            _require(1 <= self.num_experts_per_tok <= self.n_routed_experts,
                     f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, n_routed_experts="
                     f"{self.n_routed_experts}]")
            _require(self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
                     f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
            _require(1 <= self.topk_group <= self.n_group,
                     f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            _require(per_group >= 2 or self.n_group == 1,
                     "each expert group needs >= 2 experts (group score = sum of its top-2)")
            _require(self.topk_group * per_group >= self.num_experts_per_tok,
                     f"topk_group={self.topk_group} groups of {per_group} experts cannot supply "
                     f"num_experts_per_tok={self.num_experts_per_tok} experts")

    # ---- conversions ----
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """From a transformers ``config.json`` dict (``model_type`` glm_moe_dsa)."""
        mt = hf.get("model_type")
        if mt not in (None, "glm_moe_dsa"):
            raise ConfigError(f"config.json has model_type={mt!r}; glm53 reads 'glm_moe_dsa' checkpoints")
        if hf.get("num_key_value_heads", hf.get("num_attention_heads")) != hf.get("num_attention_heads"):
            raise ConfigError("num_key_value_heads must equal num_attention_heads for MLA")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"rope_parameters must be an object of rope_type / rope_theta, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type={rope_type!r} is not supported (glm53 implements the default RoPE)")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        n_layers = hf["num_hidden_layers"]
        indexer_types = hf.get("indexer_types")
        if indexer_types is None:
            pattern = hf.get("index_topk_pattern")
            if pattern is not None:
                if isinstance(pattern, str) and set(pattern) - set("FS"):
                    raise ConfigError(f"index_topk_pattern={pattern!r} holds letters other than F (full) and S "
                                      "(shared)")
                indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) \
                    else list(pattern)
            else:  # transformers' freq/offset schedule
                freq = max(hf.get("index_topk_freq", 1), 1)
                offset = hf.get("index_skip_topk_offset", 2)
                indexer_types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared"
                                 for i in range(n_layers)]
        mlp_types = hf.get("mlp_layer_types")
        first_dense = hf.get("first_k_dense_replace", 3)
        if mlp_types is not None:
            n_dense = sum(1 for t in mlp_types if t == "dense")
            if list(mlp_types) != ["dense"] * n_dense + ["sparse"] * (len(mlp_types) - n_dense):
                raise ConfigError("mlp_layer_types must be dense layers followed by sparse layers")
            if isinstance(n_layers, int) and len(mlp_types) != n_layers:
                raise ConfigError(f"mlp_layer_types has {len(mlp_types)} entries for num_hidden_layers={n_layers}")
            # transformers follows mlp_layer_types and ignores first_k_dense_replace (clamped to the layers) when both
            # are given: one edited without the other would be silently ignored.
            if "first_k_dense_replace" in hf and isinstance(first_dense, int) and isinstance(n_layers, int) \
                    and min(first_dense, n_layers) != n_dense:
                raise ConfigError(f"first_k_dense_replace={first_dense} but mlp_layer_types has {n_dense} dense "
                                  "layers: one was edited without the other")
            first_dense = n_dense
        eos = hf.get("eos_token_id", 1)
        if isinstance(eos, list):
            eos = tuple(eos)
        kw = dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], moe_intermediate_size=hf["moe_intermediate_size"],
            num_hidden_layers=n_layers, first_k_dense_replace=first_dense,
            num_attention_heads=hf["num_attention_heads"], q_lora_rank=hf["q_lora_rank"],
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            index_n_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
            indexer_types=tuple(indexer_types), n_routed_experts=hf["n_routed_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"], n_shared_experts=hf.get("n_shared_experts", 1),
            n_group=hf.get("n_group", 1), topk_group=hf.get("topk_group", 1),
            norm_topk_prob=hf.get("norm_topk_prob", True),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 202752),
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0),
            # not bool(): the string "false" is truthy
            tie_word_embeddings=False if hf.get("tie_word_embeddings") is None else hf["tie_word_embeddings"],
            bos_token_id=hf.get("bos_token_id"), eos_token_id=eos,
            initializer_range=hf.get("initializer_range", 0.02),
        )
        if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
            raise ConfigError("attention_bias / mlp_bias checkpoints are not supported (GLM-5 has none)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf.get('hidden_act')!r}: GLM-5 uses silu")
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """A transformers ``config.json`` dict for this model."""
        n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
        return {
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "first_k_dense_replace": self.first_k_dense_replace,
            "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense),
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "indexer_types": list(self.indexer_types), "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group, "topk_group": self.topk_group, "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "initializer_range": self.initializer_range,
        }

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg.keys()) - fields)
        if unknown:
            raise ConfigError(f"unknown model config fields {unknown}")
        kw = {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in cfg.items()}
        return cls(**kw)

    def param_count(self) -> int:
        """Parameters of the model, MTP module included (embedding and head counted once each)."""
        h, qk = self.hidden_size, self.qk_head_dim
        attn = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_attention_heads * qk
                + h * self.kv_row_dim + self.kv_lora_rank
                + self.kv_lora_rank * self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim)
                + self.num_attention_heads * self.v_head_dim * h)
        indexer = (self.q_lora_rank * self.index_n_heads * self.index_head_dim + h * self.index_head_dim
                   + 2 * self.index_head_dim + h * self.index_n_heads)
        dense = 3 * h * self.intermediate_size
        moe = (3 * h * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts)
               + self.n_routed_experts * (h + 1))
        total = 2 * h * self.vocab_size + h
        for l in range(self.num_cache_layers):
            total += attn + 2 * h
            total += indexer if self.layer_indexer_type(l) == "full" else 0
            total += moe if self.is_moe_layer(l) else dense
        total += self.num_nextn_predict_layers * (2 * h * h + 3 * h)
        return total


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Where the MLA history lives and how it is stored.

    ``mode="resident"`` keeps every row on the accelerator. ``mode="offload"`` keeps the history in host memory
    (``pinned_host``) and a bounded hot cache of ``hot_rows`` slots per layer and session on the accelerator.
    Sizes that only make sense for one mode are checked where that mode's cache is built
    (``glm53.offload.validate``).
    """

    mode: str = "resident"
    kv_format: str = "bf16"  # f32 | bf16 | q8g64 | fp8g128 (kernels_pallas.kv_formats)
    # Rows of history per session slot. 0: an Engine uses the model's max_position_embeddings; generate() sizes it
    # to the run (longest prompt + new tokens + MTP depth).
    max_len: int = 0
    prefill_chunk: int = 256  # tokens per prefill / append step: bounds the transient device memory of a step
    # offload: hot-cache slots per layer and session (an Engine cuts it to the slot's rows, a power of two: more
    # could never fill)
    hot_rows: int = 32768
    # offload: rows per host page; a page (all layers) is written to host memory in one copy once its rows are final
    copyback_every: int = 64
    # offload: recent-ring rows, at least; raised to a power of two that holds a page plus one step's new rows
    # (glm53.offload.ring_rows_for)
    ring_rows: int = 0
    # DSA indexer keys as stored: "model" (the model dtype) or "fp8" (e4m3 with one f32 scale per key, as
    # DeepSeek-V3.2's indexer cache: 132 B per key at index_head_dim 128 instead of 256 in bf16)
    index_keys: str = "model"
    # How indexer scores are computed: "highest" (f32 products, what the parity tests use), "bf16" (bf16 inputs,
    # f32 accumulation) or "fp8" (fp8 queries and keys; needs index_keys="fp8"). Resident and offload compute the
    # same selection at every setting.
    indexer_precision: str = "highest"
    # offload: which hot slot a miss evicts. "circular" (the first slots from a clock that no row read this round
    # holds; the Pallas fill kernel) or "lfu" (the slots hit least often since they were filled, then the least
    # recently used; its fill runs in jnp: glm53.offload, glm53.policies for the offline replay).
    policy: str = "circular"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        _require(self.mode in CACHE_MODES, f"cache mode {self.mode!r} unknown; choose one of {CACHE_MODES}")
        # A format's name only: a KVFormat object (which kv_formats.get_format passes through) or a list would be
        # accepted here and fail in the first save or fingerprint, which record the name.
        _require(isinstance(self.kv_format, str) and self.kv_format in kv_formats.KV_FORMATS,
                 f"kv_format {self.kv_format!r} unknown; choose one of {sorted(kv_formats.KV_FORMATS)}")
        for name in ("max_len", "prefill_chunk", "hot_rows", "copyback_every", "ring_rows"):
            value = getattr(self, name)
            _require(isinstance(value, numbers.Integral) and not isinstance(value, bool),
                     f"{name} must be an int, got {value!r}")
        _require(self.max_len >= 0, f"max_len must be an int >= 0, got {self.max_len!r}")
        _require(self.prefill_chunk >= 1 and (self.prefill_chunk & (self.prefill_chunk - 1)) == 0,
                 f"prefill_chunk={self.prefill_chunk} must be a power of two")
        _require(self.copyback_every >= 4 and (self.copyback_every & (self.copyback_every - 1)) == 0,
                 f"copyback_every={self.copyback_every} must be a power of two >= 4")
        _require(self.ring_rows == 0 or (self.ring_rows >= self.copyback_every
                                         and self.ring_rows % self.copyback_every == 0),
                 f"ring_rows={self.ring_rows} must be a multiple of copyback_every={self.copyback_every}")
        _require(self.hot_rows >= 1, f"hot_rows must be >= 1, got {self.hot_rows}")
        _require(self.index_keys in INDEX_KEY_FORMATS, f"index_keys {self.index_keys!r} unknown; choose one of "
                 f"{INDEX_KEY_FORMATS}")
        _require(self.indexer_precision in INDEXER_PRECISIONS, f"indexer_precision {self.indexer_precision!r} "
                 f"unknown; choose one of {INDEXER_PRECISIONS}")
        _require(self.policy in CACHE_POLICIES, f"cache policy {self.policy!r} unknown; choose one of "
                 f"{CACHE_POLICIES}")
        _require(self.indexer_precision != "fp8" or self.index_keys == "fp8",
                 "indexer_precision='fp8' scores fp8 keys: set index_keys='fp8' too")

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any]) -> "CacheConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg.keys()) - fields)
        if unknown:
            raise ConfigError(f"unknown cache config fields {unknown}; known: {sorted(fields)}")
        return cls(**dict(cfg))

    def replace(self, **kw) -> "CacheConfig":
        return dataclasses.replace(self, **kw)


def round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)

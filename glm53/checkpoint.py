"""Checkpoint I/O as plain functions of configs and parameter pytrees: HF-format safetensors in (``read_hf``), the
native orbax layout out and in (``write_native`` / ``read_native``). ``glm53.models`` builds ``Model`` objects from
them (``from_pretrained``, ``load``, ``Model.save``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from typing import Any

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.params import EXPERT_WEIGHTS, expert_weights_of, param_shapes, quantize_experts, resolve_dtype
from kernels_pallas.grouped_matmul import dequantize_blocks
from glm53.tokenizer import Tokenizer

NATIVE_META = "glm53.json"
NATIVE_FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into (the message names tensors and shapes)."""


# ----------------------------------------------------------------------------------------------------------------
# HF names -> parameter paths
# ----------------------------------------------------------------------------------------------------------------
_LINEAR = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"}
_NORMS = {"input_layernorm", "post_attention_layernorm"}
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _layer_path(rest: str) -> tuple[tuple[str, ...], bool] | None:
    """Path inside a DecoderLayer for the HF name suffix ``rest``; (path, transpose)."""
    parts = rest.split(".")
    if len(parts) == 2 and parts[0] in _NORMS and parts[1] == "weight":
        return (parts[0], "weight"), False
    if parts[0] == "self_attn":
        if len(parts) == 3 and parts[1] in _LINEAR and parts[2] == "weight":
            return ("self_attn", parts[1], "kernel"), True
        if parts[1:] == ["kv_b_proj", "weight"]:
            return ("self_attn", "kv_b_proj"), True
        if len(parts) == 3 and parts[1] in ("q_a_layernorm", "kv_a_layernorm") and parts[2] == "weight":
            return ("self_attn", parts[1], "weight"), False
        if len(parts) == 4 and parts[1] == "indexer":
            if parts[2] in ("wq_b", "wk") and parts[3] == "weight":
                return ("self_attn", "indexer", parts[2], "kernel"), True
            if parts[2] == "k_norm" and parts[3] in ("weight", "bias"):
                return ("self_attn", "indexer", f"k_norm_{parts[3]}"), False
            if parts[2] == "weights_proj" and parts[3] == "weight":
                return ("self_attn", "indexer", "weights_proj"), True
    if parts[0] == "mlp":
        if len(parts) == 3 and parts[1] in ("gate_proj", "up_proj", "down_proj") and parts[2] == "weight":
            return ("mlp", parts[1], "kernel"), True
        if parts[1:] == ["gate", "weight"]:
            return ("mlp", "gate"), True
        if parts[1:] == ["gate", "e_score_correction_bias"]:
            return ("mlp", "e_score_correction_bias"), False
        if len(parts) == 4 and parts[1] == "shared_experts" and parts[3] == "weight":
            return ("mlp", "shared_experts", parts[2], "kernel"), True
    return None


def hf_to_path(name: str, cfg: ModelConfig) -> tuple[tuple[str, ...], bool] | str | None:
    """Map an HF tensor name to (param path, transpose). Returns "skip" for tensors glm53 knowingly does not use
    and None for unknown names. Expert tensors are handled by the caller."""
    if name == "model.embed_tokens.weight":
        return ("embed_tokens",), False
    if name == "lm_head.weight":
        return ("lm_head",), True
    if name == "model.norm.weight":
        return ("norm", "weight"), False
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if not m:
        return None
    i, rest = int(m.group(1)), m.group(2)
    if i < cfg.num_hidden_layers:
        sub = _layer_path(rest)
        return ((f"layers_{i}",) + sub[0], sub[1]) if sub else None
    if i < cfg.num_cache_layers:  # the MTP module
        if rest in ("enorm.weight", "hnorm.weight"):
            return ("mtp_layer", rest.split(".")[0], "weight"), False
        if rest == "eh_proj.weight":
            return ("mtp_layer", "eh_proj", "kernel"), True
        if rest == "shared_head.norm.weight":
            return ("mtp_layer", "shared_head_norm", "weight"), False
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            return "skip"  # copies of the main embedding / LM head, which the MTP module shares
        sub = _layer_path(rest)
        return (("mtp_layer", "block") + sub[0], sub[1]) if sub else None
    if i >= cfg.num_hidden_layers and cfg.num_nextn_predict_layers == 0:
        return "skip"  # an MTP layer the config does not ask for (transformers itself ignores these)
    return None


# ----------------------------------------------------------------------------------------------------------------
# from_pretrained
# ----------------------------------------------------------------------------------------------------------------
def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index} names shards that are not in {path}: {missing}")
        return [os.path.join(path, f) for f in files]
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"no weights in {path}: expected model.safetensors or model.safetensors.index.json")


# safetensors' numpy and flax readers (0.8) cannot build FP8 arrays ("module 'numpy' has no attribute
# 'float8_e4m3fn'"), which is how published FP8 checkpoints store their weights: such tensors are read from the file's
# bytes directly (the format is an 8-byte header length, a JSON header of dtype / shape / offsets, then the data).
_RAW_DTYPES = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}


def _safetensors_header(file: str) -> tuple[int, dict]:
    with open(file, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return 8 + n, json.loads(fh.read(n))


def _raw_tensor(file: str, data_start: int, info: dict) -> jax.Array:
    import numpy as np

    start, end = info["data_offsets"]
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=data_start + start, shape=(end - start,))
    return jnp.asarray(data.view(_RAW_DTYPES[info["dtype"]]).reshape(info["shape"]))


def _dequant_fp8_block(w: jax.Array, scale_inv: jax.Array, dtype) -> jax.Array:
    """Block-wise FP8 weights (published FP8 checkpoints): w [out, in] e4m3 times a per-128x128-block scale; the
    grouped matmul's in-kernel dequantisation computes the same (``dequantize_blocks``), bit for bit."""
    return dequantize_blocks(w, scale_inv, dtype)


def read_hf_config(path: str) -> ModelConfig:
    """The ``ModelConfig`` of an HF-format directory's ``config.json``, read without its weights."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        where = "" if os.path.isdir(path) else (" (not a local directory: glm53 reads HF-format checkpoints from disk; "
                                                "download one first, e.g. huggingface-cli download REPO --local-dir DIR)")
        raise CheckpointError(f"{path} has no config.json{where}")
    with open(cfg_path) as f:
        try:
            hf_cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    try:
        return ModelConfig.from_hf(hf_cfg)
    except KeyError as e:
        raise CheckpointError(f"{cfg_path} lacks the field {e.args[0]!r}") from e
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path} does not describe a model glm53 can run: {e}") from e


def read_hf(path: str, dtype, expert_weights: str = "model") -> tuple[ModelConfig, Any, Tokenizer | None]:
    """Read an HF-format GLM-5 (``glm_moe_dsa``) directory: ``config.json`` plus ``model.safetensors`` or shards
    with ``model.safetensors.index.json``; per-expert tensor names (``mlp.experts.E.gate_proj.weight``) as published
    and as transformers' ``save_pretrained`` writes them, or fused ``mlp.experts.gate_up_proj``.

    Tensors stream one at a time from the memory-mapped files to the device (an expert stack is assembled per
    layer), so the model is never held twice. A ``tokenizer.json`` beside the weights is attached.

    ``expert_weights="fp8"`` keeps MoE experts in FP8 on the device: an FP8 checkpoint's expert tensors and block
    scales as they are (not dequantised), other checkpoints' experts quantised after loading
    (``glm53.params.quantize_experts``).
    """
    if expert_weights not in EXPERT_WEIGHTS:
        raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
    from safetensors import safe_open

    dtype = resolve_dtype(dtype)
    cfg = read_hf_config(path)
    expected = {k: v for k, v in flatten_dict(param_shapes(cfg, dtype)).items()}
    loaded: dict[tuple[str, ...], jax.Array] = {}
    experts: dict[tuple[str, ...], dict[int, jax.Array]] = {}
    fp8_experts: dict[tuple[str, ...], dict[int, tuple[jax.Array, jax.Array]]] = {}  # expert_weights="fp8"
    unexpected: list[str] = []

    def put(path_, arr, name):
        want = expected.get(path_)
        if want is None:
            unexpected.append(name)
            return
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(f"tensor {name}: shape {tuple(arr.shape)} (after layout conversion) does not match "
                                  f"the model's {tuple(want.shape)} for parameter {'/'.join(path_)}; does "
                                  "config.json describe these weights?")
        if path_ in loaded:
            raise CheckpointError(f"tensor {name} appears twice in the checkpoint")
        _check_finite(arr, name)
        loaded[path_] = arr.astype(want.dtype)

    for file in _weight_files(path):
        try:
            handle = safe_open(file, framework="flax")
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt headers
            raise CheckpointError(f"cannot read {file}: {e}") from e
        try:
            data_start, header = _safetensors_header(file)
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"cannot read the header of {file}: {e}") from e

        def tensor(f, name):
            info = header.get(name, {})
            if info.get("dtype") in _RAW_DTYPES:
                return _raw_tensor(file, data_start, info)
            return f.get_tensor(name)

        with handle as f:
            names = list(f.keys())
            scales = {n[: -len("_scale_inv")] for n in names if n.endswith("weight_scale_inv")}
            for name in names:
                if name.endswith("weight_scale_inv"):
                    continue
                try:
                    t = tensor(f, name)
                except Exception as e:
                    raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from e
                m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(.+)$", name)
                raw_scale = None
                if name in scales:
                    raw_scale = tensor(f, name + "_scale_inv")
                    if not (m and expert_weights == "fp8"):
                        t, raw_scale = _dequant_fp8_block(t, raw_scale, dtype), None
                if m:
                    i = int(m.group(1))
                    prefix = (f"layers_{i}",) if i < cfg.num_hidden_layers else ("mtp_layer", "block")
                    if i >= cfg.num_cache_layers:
                        if cfg.num_nextn_predict_layers == 0 and i == cfg.num_hidden_layers:
                            continue
                        unexpected.append(name)
                        continue
                    em = _EXPERT_RE.search(name)
                    if em:
                        e, kind = int(em.group(1)), em.group(2)
                        if e >= cfg.n_routed_experts:
                            raise CheckpointError(f"tensor {name}: expert {e} but config has n_routed_experts="
                                                  f"{cfg.n_routed_experts}")
                        if raw_scale is not None:  # [out, in] e4m3 and [out/128, in/128]: our layout is [in, out]
                            _check_finite(t, name)
                            fp8_experts.setdefault(prefix + ("mlp", f"experts_{kind}_proj"), {})[e] = (
                                t.T, raw_scale.astype(jnp.float32).T)
                            continue
                        experts.setdefault(prefix + ("mlp", f"experts_{kind}_proj"), {})[e] = t.T
                        continue
                    if m.group(2) == "gate_up_proj":  # fused [E, 2I, H] as transformers holds it in memory
                        I = cfg.moe_intermediate_size
                        put(prefix + ("mlp", "experts_gate_proj"), jnp.transpose(t[:, :I], (0, 2, 1)), name)
                        put(prefix + ("mlp", "experts_up_proj"), jnp.transpose(t[:, I:], (0, 2, 1)), name)
                        continue
                    if m.group(2) == "down_proj":
                        put(prefix + ("mlp", "experts_down_proj"), jnp.transpose(t, (0, 2, 1)), name)
                        continue
                    unexpected.append(name)
                    continue
                target = hf_to_path(name, cfg)
                if target == "skip":
                    continue
                if target is None:
                    unexpected.append(name)
                    continue
                p, transpose = target
                put(p, t.T if transpose else t, name)
        # Stack each layer's experts as soon as all of them have arrived: one layer's experts exist twice, briefly.
        for p in [p for p, parts in experts.items() if len(parts) == cfg.n_routed_experts]:
            parts = experts.pop(p)
            put(p, jnp.stack([parts[e] for e in range(cfg.n_routed_experts)]), f"{'/'.join(p)} (stacked experts)")
        for p in [p for p, parts in fp8_experts.items() if len(parts) == cfg.n_routed_experts]:
            parts = fp8_experts.pop(p)
            w8 = jnp.stack([parts[e][0] for e in range(cfg.n_routed_experts)])
            want = expected.get(p)
            if want is not None and tuple(w8.shape) != tuple(want.shape):
                raise CheckpointError(f"{'/'.join(p)} (stacked FP8 experts): shape {tuple(w8.shape)} does not match "
                                      f"the model's {tuple(want.shape)}")
            if p in loaded:
                raise CheckpointError(f"{'/'.join(p)} appears twice in the checkpoint")
            loaded[p] = w8
            loaded[p[:-1] + (p[-1] + "_scale",)] = jnp.stack([parts[e][1] for e in range(cfg.n_routed_experts)])
    experts.update(fp8_experts)
    for p, parts in experts.items():
        missing_e = sorted(set(range(cfg.n_routed_experts)) - set(parts))
        raise CheckpointError(f"parameter {'/'.join(p)}: experts {missing_e[:8]} missing from the checkpoint")
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} unexpected tensors (not part of a {cfg.num_hidden_layers}-layer "
                              f"model per config.json): {sorted(unexpected)[:10]}")
    if cfg.tie_word_embeddings:
        expected.pop(("lm_head",), None)
    missing = sorted("/".join(p) for p in expected if p not in loaded)
    if missing:
        raise CheckpointError(f"{len(missing)} parameters missing from the checkpoint: {missing[:10]}")
    tok_path = os.path.join(path, "tokenizer.json")
    tokenizer = Tokenizer.from_file(tok_path) if os.path.exists(tok_path) else None
    params = unflatten_dict(loaded)
    if expert_weights == "fp8":
        params = quantize_experts(params)
    return cfg, params, tokenizer


def _check_finite(arr, name: str) -> None:
    """Corrupted tensor bytes load without complaint and surface much later as non-finite logits: refuse them
    here, naming the tensor."""
    if jnp.issubdtype(arr.dtype, jnp.floating) and not bool(jnp.isfinite(arr).all()):
        bad = int(jnp.size(arr) - jnp.isfinite(arr).sum())
        raise CheckpointError(f"tensor {name} holds {bad} non-finite values (NaN or inf): the checkpoint file is "
                              "corrupted or was written from a diverged model")


# ----------------------------------------------------------------------------------------------------------------
# native (orbax) save / load
# ----------------------------------------------------------------------------------------------------------------
def write_native(directory: str, cfg: ModelConfig, params, dtype, cache_config: CacheConfig,
                 tokenizer: Tokenizer | None) -> None:
    """Write ``directory/glm53.json`` (configs) and ``directory/params`` (orbax); tokenizer.json if attached."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    params_dir = os.path.join(directory, "params")
    if os.path.exists(params_dir):
        raise FileExistsError(f"{params_dir} exists; save into a new directory")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(params_dir, params)
    ckptr.wait_until_finished()
    meta = {"format": "glm53", "version": NATIVE_FORMAT_VERSION, "model_config": cfg.to_hf(),
            "dtype": jnp.dtype(dtype).name, "cache_config": dataclasses.asdict(cache_config),
            "expert_weights": expert_weights_of(params)}
    with open(os.path.join(directory, NATIVE_META), "w") as f:
        json.dump(meta, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(directory, "tokenizer.json"))


def read_native_config(directory: str) -> tuple[ModelConfig, Any, str, CacheConfig | None]:
    """(config, saved dtype, expert weights, cache config) of a ``write_native`` directory, read without its
    parameters."""
    directory = os.path.abspath(directory)
    meta_path = os.path.join(directory, NATIVE_META)
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{directory} has no {NATIVE_META}: not a glm53 checkpoint (HF directories load "
                              "with glm53.from_pretrained)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is not valid JSON (a corrupted or truncated glm53 checkpoint): {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != "glm53" or meta.get("version") != NATIVE_FORMAT_VERSION:
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_path}: format/version {got}, expected glm53 version {NATIVE_FORMAT_VERSION}")
    try:
        cfg = ModelConfig.from_hf(meta["model_config"])
        saved_dtype = resolve_dtype(meta["dtype"])
        expert_weights = meta.get("expert_weights", "model")
        if expert_weights not in EXPERT_WEIGHTS:
            raise ValueError(f"expert_weights {expert_weights!r} unknown")
        # Fields of earlier versions that no longer exist (the pool is sized by the Engine now) are dropped.
        cc = {k: v for k, v in meta.get("cache_config", {}).items() if k not in ("page_rows", "host_pool_rows")}
        cache_config = CacheConfig.from_config_dict(cc) if "cache_config" in meta else None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_path} is incomplete or inconsistent: {type(e).__name__}: {e}") from e
    return cfg, saved_dtype, expert_weights, cache_config


def read_native(directory: str, dtype=None, check_config=None
                ) -> tuple[ModelConfig, Any, Any, CacheConfig | None, Tokenizer | None]:
    """Read a directory written by ``write_native``: (config, params, dtype, cache config, tokenizer). The parameter
    tree is checked against the config's. ``check_config(config)``, when given, runs before any parameter is read."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    cfg, saved_dtype, expert_weights, cache_config = read_native_config(directory)
    if check_config is not None:
        check_config(cfg)
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev),
                                    param_shapes(cfg, saved_dtype, expert_weights))
    try:
        params = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), target)
    except Exception as e:  # orbax raises several types for missing/mismatched arrays
        raise CheckpointError(f"cannot restore parameters from {directory}/params: {e}") from e
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        _check_finite(leaf, "params" + jax.tree_util.keystr(path))
    dtype = resolve_dtype(dtype) if dtype is not None else saved_dtype
    if dtype != saved_dtype:
        shapes = param_shapes(cfg, dtype, expert_weights)
        params = jax.tree_util.tree_map(lambda p, s: p.astype(s.dtype), params, shapes)
    tok_path = os.path.join(directory, "tokenizer.json")
    tokenizer = Tokenizer.from_file(tok_path) if os.path.exists(tok_path) else None
    return cfg, params, dtype, cache_config, tokenizer

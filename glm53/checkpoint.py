"""Checkpoint I/O as plain functions of configs and parameter pytrees: HF-format safetensors in (``read_hf``), the
native orbax layout out and in (``write_native`` / ``read_native``). ``glm53.models`` builds ``Model`` objects from
them (``from_pretrained``, ``load``, ``Model.save``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import struct
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.params import (EXPERT_WEIGHTS, expert_weights_of, param_shapes, quantize_leaf, quantizes, resolve_dtype,
                          scale_path)
from kernels_pallas.grouped_matmul import SCALE_BLOCK, dequantize_blocks
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
    if i == cfg.num_hidden_layers and cfg.num_nextn_predict_layers == 0:
        # An MTP layer the config does not ask for (transformers itself ignores these): read_hf checks the
        # checkpoint's layer is one (it holds MTP-only tensors), not a main layer the config has one too few of.
        return "skip"
    return None


# ----------------------------------------------------------------------------------------------------------------
# from_pretrained
# ----------------------------------------------------------------------------------------------------------------
def _weight_files(path: str) -> tuple[list[str], dict | None]:
    """The checkpoint's safetensors files, and the index's weight_map (None for a single file)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index) and os.path.exists(single):
        # transformers reads the single file here and glm53 would read the shards: a parity check could then compare
        # two different sets of weights without knowing it.
        raise CheckpointError(f"{path} holds both model.safetensors and model.safetensors.index.json: one of them is "
                              "left over from another save; remove it")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names, got "
                                  f"{str(weight_map)[:200]}")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index} names shards that are not in {path}: {missing}")
        return [os.path.join(path, f) for f in files], weight_map
    if os.path.exists(single):
        return [single], None
    raise CheckpointError(f"no weights in {path}: expected model.safetensors or model.safetensors.index.json")


def _check_weight_map(path: str, weight_map: dict | None, index: dict[str, "_Stored"]) -> None:
    """An index that disagrees with its shards about where a tensor lies means shards of different saves were mixed
    (a download resumed after the repository was re-sharded, a shard copied from another model): refuse it rather
    than load whatever the mixed shards happen to hold."""
    if weight_map is None:  # a single file
        return
    index_file = os.path.join(path, "model.safetensors.index.json")
    moved = [f"{n} (index: {weight_map[n]}, found in {os.path.basename(st.file)})" for n, st in index.items()
             if n in weight_map and os.path.join(path, weight_map[n]) != st.file]
    absent = sorted(n for n in weight_map if n not in index)
    unlisted = sorted(n for n in index if n not in weight_map)
    for what, names in (("maps tensors to shards that do not hold them", sorted(moved)),
                        ("names tensors that no shard holds", absent),
                        ("does not list tensors its shards hold", unlisted)):
        if names:
            raise CheckpointError(f"{index_file} {what}: {names[:5]}{' ...' if len(names) > 5 else ''} "
                                  f"({len(names)} in all): the shards and the index come from different saves")


# Every tensor is read from its file's memory-mapped bytes (the format is an 8-byte header length, a JSON header of
# dtype / shape / offsets, then the data): safetensors' numpy and flax readers (0.8) cannot build FP8 arrays ("module
# 'numpy' has no attribute 'float8_e4m3fn'"), which is how published FP8 checkpoints store their weights, and one index
# over all shards pairs each FP8 weight with its block scale wherever the shards put them.
_TENSOR_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                  "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_SCALE_SUFFIX = "_scale_inv"
# Tensors only an MTP layer has: a layer past the main ones holding them is an MTP layer.
_MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes lie."""
    file: str
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]


def _safetensors_header(file: str) -> tuple[int, dict]:
    with open(file, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return 8 + n, json.loads(fh.read(n))


def _tensor_index(files: list[str]) -> dict[str, _Stored]:
    """Every tensor of every file, by name, checked for what can be checked without reading its data."""
    from safetensors import safe_open

    index: dict[str, _Stored] = {}
    for file in files:
        try:  # safetensors checks the header against the file's size: truncated / corrupt files fail here
            with safe_open(file, framework="numpy"):
                pass
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {file}: {e}") from e
        try:
            data_start, header = _safetensors_header(file)
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"cannot read the header of {file}: {e}") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in index:
                raise CheckpointError(f"tensor {name} appears twice in the checkpoint ({index[name].file} and {file})")
            if info.get("dtype") not in _TENSOR_DTYPES:
                raise CheckpointError(f"tensor {name} in {file} is stored as {info.get('dtype')}: weights are floating "
                                      f"point ({', '.join(_TENSOR_DTYPES)}); is the file corrupted?")
            a, b = info["data_offsets"]
            index[name] = _Stored(file, data_start + a, data_start + b, info["dtype"], tuple(info["shape"]))
    return index


def _read(stored: _Stored, name: str) -> np.ndarray:
    """The tensor's bytes in its file, memory-mapped: nothing is read until they are used."""
    dt = _TENSOR_DTYPES[stored.dtype]
    try:
        if stored.end == stored.start:
            return np.zeros(stored.shape, dt)
        data = np.memmap(stored.file, dtype=np.uint8, mode="r", offset=stored.start, shape=(stored.end - stored.start,))
        return data.view(dt).reshape(stored.shape)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read tensor {name} from {stored.file}: {e}") from e


@functools.partial(jax.jit, static_argnames=("transpose", "dequantise_to", "dtype"))
def _arranged(x, raw_scale, *, transpose: bool, dequantise_to, dtype):
    """``(the tensor made the model's, _finite_rows of it)``."""
    # A tensor as read made the model's in one program (block scales applied, last two axes swapped, cast), so the
    # device holds it as read and as kept, never a transposed or cast copy beside both: the memory check counts the
    # largest weight twice. Dequantising is per element, so the same values before or after the swap.
    if raw_scale is not None:
        x = _dequant_fp8_block(x, raw_scale, dequantise_to)
    # The kept weight's rows checked as read, before the swap (a 2-D weight's are the read one's columns): after
    # it, XLA's CPU compiler made a float32 copy of the swapped weight for the reduction (3.7 GiB beside
    # h200_bench's 1.8 GiB embedding), and the swap and the check took 12 s instead of 4.
    finite = _finite_rows(x, leading=1 if transpose and x.ndim == 2 else 0, kept=dtype)
    if transpose:
        x = jnp.swapaxes(x, -1, -2)
    return x.astype(dtype), finite


def _finite_rows(x, leading: int = 0, kept=None) -> jax.Array:
    """Whether each index of axis ``leading`` of ``x`` (a weight's rows, or a stack of experts' weights' experts)
    selects only finite values, as of the dtype ``kept`` (default x's) they are kept in (a float32 value past
    bfloat16's range is inf once cast)."""
    # Computed inside ``_arranged``, the program that makes the weight: an eager ``isfinite(x).all()`` after it was
    # two more programs per weight shape (isfinite, then the reduction, each compiled on its first use) and a bool
    # array of the weight's size between them.
    x = x.reshape(1) if x.ndim == 0 else x
    if not jnp.issubdtype(x.dtype, jnp.inexact) or not jnp.issubdtype(kept or x.dtype, jnp.inexact):
        return jnp.ones((x.shape[leading],), bool)
    return _finite(x, axis=tuple(a for a in range(x.ndim) if a != leading), kept=kept)


def _finite(x, axis=None, kept=None) -> jax.Array:
    """Whether ``x``'s values (reduced over ``axis``) are finite, and once cast to ``kept`` (x's dtype by default,
    or bfloat16 for a float32 x) still are."""
    # x * 0 is 0 for a finite x and NaN for an inf or a NaN, and a sum of such terms is 0 or NaN in any order, so
    # this reduction reads x once and holds nothing else. The obvious forms held more or missed NaNs on XLA's CPU
    # compiler (h200_bench's 1.8 GiB bfloat16 embedding): ``isfinite(x).all()`` kept a bool array of x's size
    # (0.9 GiB, which the memory check does not count); counting ``~isfinite(x)`` kept a float32 copy (3.5 GiB);
    # ``max(|x|) < inf`` held nothing but its vectorised max dropped the NaN in 30 of 100 random tensors, and a
    # second reduction beside the sum made XLA keep a float32 copy again.
    kept = jnp.dtype(kept or x.dtype)
    wide = x.astype(jnp.float32)
    if x.dtype == jnp.float32 and kept == jnp.bfloat16:
        # Read from the values as read, not the cast ones: XLA's GPU compiler may keep a value made bfloat16 in the
        # same program at float32 precision (excess precision), where a float32 value past bfloat16's range is
        # still finite. Such a value rounds to bfloat16's inf from 2^128 - 2^119 (half an ulp past its largest, ties
        # to even), and exactly those |x| overflow float32 when 2^119 - 2^103 is added (float32's inf begins at
        # 2^128 - 2^103, with the same rule), so one sum still says it.
        wide = jnp.abs(wide) + np.float32(2.0 ** 119 - 2.0 ** 103)
    elif kept.itemsize < x.dtype.itemsize and jnp.issubdtype(kept, jnp.floating):
        # No read takes this path: models keep float32 or bfloat16 (``resolve_dtype``), device arrays are at most
        # float32 (x64 off), and FP8 experts are kept as stored. A narrowing added later must say how it overflows
        # rather than pass values the cast makes inf.
        raise NotImplementedError(f"finite once cast from {x.dtype} to {kept}")
    return jnp.sum(wide * 0, axis=axis) == 0


@jax.jit
def _all_finite(x) -> jax.Array:
    # A restored parameter of any sharding: a scalar, readable in every process that holds a part of ``x``.
    return _finite(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)


def _dequant_fp8_block(w: jax.Array, scale_inv: jax.Array, dtype) -> jax.Array:
    """Block-wise FP8 weights (published FP8 checkpoints): w [out, in] e4m3 times a per-128x128-block scale; the
    grouped matmul's in-kernel dequantisation computes the same (``dequantize_blocks``), bit for bit."""
    return dequantize_blocks(w, scale_inv, dtype)


def _check_fp8_pair(name: str, weight: _Stored, scale: _Stored | None) -> None:
    """An FP8 weight needs its block scale, of one value per SCALE_BLOCK x SCALE_BLOCK block: without it the raw e4m3
    values would load unscaled (wrong by the scale, silently)."""
    if scale is None:
        raise CheckpointError(f"tensor {name} is {weight.dtype} (FP8) but the checkpoint has no {name}{_SCALE_SUFFIX} "
                              f"(its block scales) in any file")
    if len(weight.shape) != 2:
        raise CheckpointError(f"tensor {name}: an FP8 weight must be 2-D [out, in], got shape {weight.shape}")
    want = tuple(-(-d // SCALE_BLOCK) for d in weight.shape)
    if scale.shape != want:
        raise CheckpointError(f"tensor {name}{_SCALE_SUFFIX}: shape {scale.shape}, but {name} {weight.shape} in "
                              f"{SCALE_BLOCK} x {SCALE_BLOCK} blocks needs {want}")


def stored_itemsize(path: str) -> int | None:
    """The element width (bytes) of an HF-format directory's largest tensor, from the files' headers: a weight is on
    the device as read beside its model-dtype copy while it is made the model's (``glm53.memory.loading_bytes``),
    and float32 weights read into a bfloat16 model take three bytes an element more than two. None where the files
    cannot be read: ``read_hf`` says why, once it has checked the tokenizer (found in a second, not after a memory
    check of weights that are not there)."""
    try:
        index = _tensor_index(_weight_files(path)[0])
    except CheckpointError:
        return None
    stored = [st for st in index.values() if st.dtype in _TENSOR_DTYPES]
    if not stored:
        return None
    largest = max(stored, key=lambda st: st.end - st.start)
    return np.dtype(_TENSOR_DTYPES[largest.dtype]).itemsize


def read_hf_config(path: str) -> ModelConfig:
    """The ``ModelConfig`` of an HF-format directory's ``config.json``, read without its weights."""
    return _model_config(path, _hf_config_dict(path))


def _hf_config_dict(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        if os.path.exists(os.path.join(path, NATIVE_META)):
            where = " (it is a glm53 checkpoint written by Model.save: load it with glm53.load)"
        elif not os.path.isdir(path):
            where = (" (not a local directory: glm53 reads HF-format checkpoints from disk; download one first, e.g. "
                     "huggingface-cli download REPO --local-dir DIR)")
        else:
            where = ""
        raise CheckpointError(f"{path} has no config.json{where}")
    with open(cfg_path) as f:
        try:
            hf_cfg = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(hf_cfg, dict):
        raise CheckpointError(f"{cfg_path} holds a JSON {type(hf_cfg).__name__}, not the object of a model config")
    return hf_cfg


def _model_config(path: str, hf_cfg: dict) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    try:
        return ModelConfig.from_hf(hf_cfg)
    except KeyError as e:
        raise CheckpointError(f"{cfg_path} lacks the field {e.args[0]!r}") from e
    except (ConfigError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{cfg_path} does not describe a model glm53 can run: {e}") from e


def _hf_names(cfg: ModelConfig, paths) -> dict[tuple[str, ...], str]:
    """The HF tensor name of each parameter path (the inverse of ``hf_to_path``), for messages that should be
    searchable in a checkpoint's index."""
    layer_suffixes = (
        [f"{n}.weight" for n in _NORMS] + [f"self_attn.{n}.weight" for n in _LINEAR | {"kv_b_proj"}]
        + [f"self_attn.{n}.weight" for n in ("q_a_layernorm", "kv_a_layernorm")]
        + [f"self_attn.indexer.{n}.weight" for n in ("wq_b", "wk", "weights_proj", "k_norm")]
        + ["self_attn.indexer.k_norm.bias", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"]
        + [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        + [f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")] + list(_MTP_ONLY))
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{rest}" for i in range(cfg.num_cache_layers) for rest in layer_suffixes]
    out = {}
    for name in names:
        target = hf_to_path(name, cfg)
        if isinstance(target, tuple):
            out[target[0]] = name
    for p in paths:
        if p not in out and str(p[-1]).startswith("experts_"):
            i = cfg.num_hidden_layers if p[0] == "mtp_layer" else int(p[0].split("_")[1])
            kind = p[-1][len("experts_"):].replace("_scale", "")
            out[p] = f"model.layers.{i}.mlp.experts.*.{kind}.weight"
    return out


def read_hf(path: str, dtype, expert_weights: str = "model", *, mtp: bool = True, progress: bool | None = None,
            place=None) -> tuple[ModelConfig, Any, Tokenizer | None]:
    """Read an HF-format GLM-5 (``glm_moe_dsa``) directory: ``config.json`` plus ``model.safetensors`` or shards
    with ``model.safetensors.index.json``; per-expert tensor names (``mlp.experts.E.gate_proj.weight``) as published
    and as transformers' ``save_pretrained`` writes them, or fused ``mlp.experts.gate_up_proj``.

    Tensors stream one at a time from the memory-mapped files to the device (each expert stack assembled in host
    memory, then sent whole), each made the model's in one program (transposed, dequantised, cast), so the device
    holds the model once plus one tensor as read and as kept. A ``tokenizer.json`` beside the weights is read and
    checked first.
    ``mtp=False`` loads without the MTP module (``num_nextn_predict_layers`` 0; its layer's tensors skipped):
    checkpoints re-saved by transformers keep the config's MTP layer but drop its tensors. ``progress``: a bar over
    the bytes read (``glm53.progress``).

    ``expert_weights="fp8"`` keeps MoE experts in FP8 on the device: an FP8 checkpoint's expert tensors and block
    scales as they are (not dequantised), other checkpoints' experts quantised a layer's stack at a time as it is
    complete (``glm53.params.quantize_leaf``).

    ``place(path, array)``: where each parameter goes as soon as it is complete (``glm53.sharding.Placement``:
    straight onto its devices, so the device the tensors are read onto holds one of them, or one layer's expert
    stack, at a time beside its share).
    """
    from glm53 import progress as progress_lib

    if expert_weights not in EXPERT_WEIGHTS:
        raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
    progress_lib.check(progress)
    dtype = resolve_dtype(dtype)
    hf_cfg = _hf_config_dict(path)
    cfg = _model_config(path, hf_cfg)
    if not mtp:
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    # The tokenizer before the weights: a broken or oversized one is found in a second, not after the whole model.
    tokenizer = _read_tokenizer(os.path.join(path, "tokenizer.json"), cfg, "config.json")

    files, weight_map = _weight_files(path)
    index = _tensor_index(files)
    _check_weight_map(path, weight_map, index)
    N = cfg.num_hidden_layers
    checkpoint_has_mtp_layer = any(f"model.layers.{N}.{rest}" in index for rest in _MTP_ONLY)
    if cfg.num_nextn_predict_layers and not any(n.startswith(f"model.layers.{N}.") for n in index):
        raise CheckpointError(f"config.json has num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the "
                              f"checkpoint holds no tensor of its MTP layer (model.layers.{N}.*): transformers' "
                              "save_pretrained drops it; load with mtp=False to run without MTP")
    fp8 = [n for n, st in index.items() if st.dtype in _FP8_DTYPES]
    block = (hf_cfg.get("quantization_config") or {}).get("weight_block_size")
    if fp8 and block is not None and list(block) != [SCALE_BLOCK, SCALE_BLOCK]:
        raise CheckpointError(f"config.json's quantization_config.weight_block_size={block}: glm53 reads FP8 block "
                              f"scales of {SCALE_BLOCK} x {SCALE_BLOCK}")
    for n in fp8:
        _check_fp8_pair(n, index[n], index.get(n + _SCALE_SUFFIX))
    scales = {n for n in index if n.endswith(_SCALE_SUFFIX)}
    unexpected: list[str] = sorted(scales - {n + _SCALE_SUFFIX for n in fp8})  # scales of no FP8 weight

    expected = {k: v for k, v in flatten_dict(param_shapes(cfg, dtype)).items()}
    loaded: dict[tuple[str, ...], jax.Array] = {}
    experts: dict[tuple[str, ...], dict[int, tuple]] = {}  # per layer stack: expert -> (weight, scales, name)

    def keep(path_, arr):
        made = [(path_, arr)]
        if quantizes(path_, arr, expert_weights):  # a layer's stack at a time: never the whole model twice
            q, s = quantize_leaf(arr)
            made = [(path_, q), (scale_path(path_), s)]
        for p, a in made:
            loaded[p] = a if place is None else place(p, a)

    def put(path_, t, name, *, transpose=False, raw_scale=None, names=None):
        """Tensor ``t`` (memory-mapped, or already on the device; FP8 with ``raw_scale``) as the parameter at
        ``path_``: its last two axes swapped with ``transpose``, dequantised, cast, checked finite (``names``: of
        a stack's tensors, to name a bad one)."""
        want = expected.get(path_)
        if want is None:
            unexpected.append(name)
            return
        shape = tuple(t.shape[:-2]) + tuple(t.shape[-2:][::-1]) if transpose else tuple(t.shape)
        if shape != tuple(want.shape):
            raise CheckpointError(f"tensor {name}: shape {shape} (after layout conversion) does not match "
                                  f"the model's {tuple(want.shape)} for parameter {'/'.join(path_)}; does "
                                  "config.json describe these weights?")
        if path_ in loaded:
            raise CheckpointError(f"tensor {name} appears twice in the checkpoint")
        try:
            arr, finite = _arranged(jnp.asarray(t), None if raw_scale is None else jnp.asarray(raw_scale),
                                    transpose=transpose, dequantise_to=dtype, dtype=want.dtype)
        except Exception as e:
            if raw_scale is None:
                raise
            raise CheckpointError(f"cannot dequantise tensor {name} with its block scales: {e}") from e
        _check_finite(arr, finite, names or [name])
        keep(path_, arr)

    def expert(name, stack, e, t, raw_scale):
        """One expert's [out, in] weight (memory-mapped, with its block scales in an FP8 checkpoint), checked as it
        arrives; the layer's stack is built once all its experts have (``keep_stack``)."""
        want = expected.get(stack)
        if want is None:
            unexpected.append(name)
            return
        if tuple(t.shape[::-1]) != tuple(want.shape[1:]):
            raise CheckpointError(f"tensor {name} ({index[name].file}): shape {tuple(t.shape)}, but the model's "
                                  f"experts are [out, in] = {tuple(want.shape[1:][::-1])}; does config.json describe "
                                  "these weights?")
        if stack in loaded or e in experts.get(stack, {}):
            raise CheckpointError(f"tensor {name}: expert {e} of {'/'.join(stack)} appears twice in the checkpoint")
        parts = experts.setdefault(stack, {})
        parts[e] = (t, raw_scale, name)
        if len(parts) == cfg.n_routed_experts:
            del experts[stack]
            keep_stack(stack, [parts[k] for k in range(cfg.n_routed_experts)])

    def keep_stack(stack, parts):
        """A layer's expert stack, assembled in host memory from the memory-mapped files and sent to the device
        whole. A layer's three stacks arrive interleaved, expert by expert: kept on the device as they arrived, up
        to four stacks' bytes would be there at once (three in parts, one stacked), more than the memory check's
        largest weight twice; this way the device holds one stack as read and as kept beside its share."""
        names = [n for _, _, n in parts]
        if len({sc is None for _, sc, _ in parts}) > 1:
            raise CheckpointError(f"{'/'.join(stack)}: some experts are stored in FP8 with block scales and some are "
                                  f"not ({names[0]}, {names[-1]}, ...): one checkpoint mixes two formats")
        w = np.stack([t for t, _, _ in parts])  # [E, out, in]: read from the files here
        scales = None if parts[0][1] is None else np.stack([sc for _, sc, _ in parts])
        label = f"{'/'.join(stack)} (stacked experts)"
        if scales is None or expert_weights != "fp8":
            put(stack, w, label, transpose=True, raw_scale=scales, names=names)
            return
        # kept as stored: e4m3 and one f32 scale per 128 x 128 block
        for path_, x, ns in ((stack, w, names), (scale_path(stack), scales, [n + _SCALE_SUFFIX for n in names])):
            x, finite = _arranged(jnp.asarray(x), None, transpose=True, dequantise_to=None,
                                  dtype=x.dtype if x is w else np.float32)
            _check_finite(x, finite, ns)
            keep(path_, x)

    def check_fused(name, t, want):
        # Whole, before slicing: a misshaped stack would fail inside jnp, or split into a wrong but plausible half.
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor {name} ({index[name].file}): shape {tuple(t.shape)}, but the model's fused "
                                  f"experts are {want}; does config.json describe these weights?")

    weights = sorted(set(index) - scales, key=lambda n: (index[n].file, index[n].start))  # in file order
    total = sum(st.end - st.start for st in index.values())
    with progress_lib.bar(progress=progress, total=total, unit="B", unit_scale=True, unit_divisor=1024,
                          desc=f"loading {os.path.basename(os.path.normpath(path))}", leave=False) as bar:
        for name in weights:
            stored = index[name]
            scale = index.get(name + _SCALE_SUFFIX) if stored.dtype in _FP8_DTYPES else None
            bar.update(stored.end - stored.start + (scale.end - scale.start if scale else 0))
            # What the tensor is, from its name, before its bytes are read: skipped and unexpected tensors (an MTP
            # layer loaded with mtp=False holds a whole MoE layer) are never read.
            m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(.+)$", name)
            target = None
            if m:
                i = int(m.group(1))
                if i >= cfg.num_cache_layers:
                    if not (i == N and cfg.num_nextn_predict_layers == 0 and checkpoint_has_mtp_layer):
                        unexpected.append(name)
                    continue  # else an MTP layer the config does not ask for (transformers itself ignores these)
            else:
                target = hf_to_path(name, cfg)
                if target == "skip":
                    lm = re.match(r"model\.layers\.(\d+)\.", name)
                    if lm and int(lm.group(1)) == N and not cfg.num_nextn_predict_layers \
                            and not checkpoint_has_mtp_layer:
                        unexpected.append(name)  # a layer past the config's, and not an MTP layer: a mismatch
                    continue
                if target is None:
                    unexpected.append(name)
                    continue
            t = _read(stored, name)  # memory-mapped
            raw_scale = None if scale is None else _read(scale, name + _SCALE_SUFFIX)
            em = _EXPERT_RE.search(name) if m else None
            if m:
                prefix = (f"layers_{i}",) if i < N else ("mtp_layer", "block")
                if em:
                    e, kind = int(em.group(1)), em.group(2)
                    if e >= cfg.n_routed_experts:
                        raise CheckpointError(f"tensor {name}: expert {e} but config has n_routed_experts="
                                              f"{cfg.n_routed_experts}")
                    expert(name, prefix + ("mlp", f"experts_{kind}_proj"), e, t, raw_scale)
                elif m.group(2) == "gate_up_proj":  # fused [E, 2I, H] as transformers holds it in memory
                    I = cfg.moe_intermediate_size
                    check_fused(name, t, (cfg.n_routed_experts, 2 * I, cfg.hidden_size))
                    put(prefix + ("mlp", "experts_gate_proj"), t[:, :I], name, transpose=True)
                    put(prefix + ("mlp", "experts_up_proj"), t[:, I:], name, transpose=True)
                elif m.group(2) == "down_proj":
                    check_fused(name, t, (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size))
                    put(prefix + ("mlp", "experts_down_proj"), t, name, transpose=True)
                else:
                    unexpected.append(name)
                continue
            p, transpose = target
            put(p, t, name, transpose=transpose, raw_scale=raw_scale)
    for p, parts in experts.items():
        missing_e = sorted(set(range(cfg.n_routed_experts)) - set(parts))
        raise CheckpointError(f"parameter {'/'.join(p)}: experts {missing_e[:8]} missing from the checkpoint "
                              f"({_hf_names(cfg, [p]).get(p, '')})")
    if cfg.tie_word_embeddings and "lm_head.weight" in unexpected:
        raise CheckpointError("config.json has tie_word_embeddings=true (the LM head is the embedding) but the "
                              "checkpoint holds its own lm_head.weight: one of them does not belong to this model")
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} unexpected tensors (not part of a {cfg.num_hidden_layers}-layer "
                              f"model per config.json): {sorted(unexpected)[:10]}")
    if cfg.tie_word_embeddings:
        expected.pop(("lm_head",), None)
    missing = sorted(p for p in expected if p not in loaded)
    if missing:
        hf_names = _hf_names(cfg, missing)  # only for the message
        named = [f"{'/'.join(p)} ({hf_names[p]})" if p in hf_names else "/".join(p) for p in missing]
        raise CheckpointError(f"{len(missing)} parameters missing from the checkpoint: {named[:10]}")
    return cfg, unflatten_dict(loaded), tokenizer


def _read_tokenizer(tok_path: str, cfg: ModelConfig, config_file: str) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, if it has one, checked against the config it is loaded with."""
    if not os.path.exists(tok_path):
        return None
    try:
        tokenizer = Tokenizer.from_file(tok_path)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{tok_path} has {tokenizer.vocab_size:,} ids but {config_file}'s vocab_size is "
                              f"{cfg.vocab_size:,}: the tokenizer belongs to another model")
    return tokenizer


def _check_finite(arr, finite_rows, names: list[str]) -> None:
    """Corrupted tensor bytes load without complaint and surface much later as non-finite logits: refuse them
    here, naming the tensor. ``finite_rows``: ``_finite_rows(arr)``; ``names``: the tensor's, or a stack's tensors'
    (one per leading index), of which the first bad one is named."""
    ok = np.asarray(finite_rows)
    if not ok.all():
        row = int(np.argmin(ok))
        if len(names) > 1:
            arr, names = arr[row], [names[row]]
        _refuse_non_finite(arr, names[0])


def _refuse_non_finite(arr, name: str):
    bad = int(jnp.size(arr) - jnp.isfinite(arr).sum())
    raise CheckpointError(f"tensor {name} holds {bad} non-finite values (NaN or inf): the checkpoint file is "
                          "corrupted or was written from a diverged model")


# ----------------------------------------------------------------------------------------------------------------
# native (orbax) save / load
# ----------------------------------------------------------------------------------------------------------------
DIGEST_VALUES = 4096  # values of each tensor a params digest reads


@functools.partial(jax.jit, static_argnames=("n", "replicated"))
def _replicated_head(x, *, n: int, replicated):
    # One jitted function for every leaf: a lambda jitted per call compiled again for every leaf of the same shape
    # (a model's layers repeat a handful of shapes).
    return jax.lax.with_sharding_constraint(x.reshape(-1)[:n], replicated)


def _head(x):
    """The first ``DIGEST_VALUES`` values of ``x``, readable by every process: on a mesh spanning several processes
    a process holds only its shards, so the slice is taken replicated over the mesh first."""
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding) and not x.is_fully_addressable:
        replicated = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
        return _replicated_head(x, n=DIGEST_VALUES, replicated=replicated)
    return x.reshape(-1)[:DIGEST_VALUES]


def params_digest(params, heads: dict | None = None) -> str:
    """A digest of a parameter tree (paths, shapes, dtypes and up to 4,096 values of every tensor). ``heads``:
    those values by ``jax.tree_util.keystr`` path, where they were gathered already (a pipeline over several
    processes, whose stages' parameters no single process holds)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        h.update(name.encode())
        h.update(f"{leaf.shape}{leaf.dtype}".encode())
        h.update(np.asarray(heads[name] if heads is not None else _head(leaf)).tobytes())
    return h.hexdigest()


def write_native(directory: str, cfg: ModelConfig, params, dtype, cache_config: CacheConfig,
                 tokenizer: Tokenizer | None, params_digest: str | None = None) -> None:
    """Write ``directory/glm53.json`` (configs, and ``params_digest`` when given) and ``directory/params`` (orbax);
    tokenizer.json if attached."""
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
    if params_digest is not None:
        meta["params_digest"] = params_digest
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
        for key in ("model_config", "cache_config"):
            if not isinstance(meta.get(key, {}), dict):
                raise TypeError(f"{key} must be an object, got {type(meta[key]).__name__}")
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


def read_native(directory: str, dtype=None, check_config=None, mesh=None, microbatches: int = 1):
    """Read a directory written by ``write_native``: (config, params, dtype, cache config, tokenizer, placement,
    digest). The parameter tree is checked against the config's. ``digest``: the params digest, checked against the
    save's, when the params are as saved (None when the save has none, or they were cast to another dtype).
    ``check_config(config)``, when given, runs before any parameter is read. ``mesh`` (a ``jax.sharding.Mesh``):
    orbax restores each parameter straight onto its devices (``glm53.sharding.Placement``, returned, None without a
    mesh) instead of onto this process's first device."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    cfg, saved_dtype, expert_weights, cache_config = read_native_config(directory)
    if check_config is not None:
        check_config(cfg)
    from glm53 import memory  # here: memory imports the cache modules, which reading a checkpoint does not need
    from glm53 import sharding

    memory.check_weights_fit(cfg, saved_dtype, expert_weights, jax.local_devices()[0], f"loading {directory}",
                             mesh=mesh)
    tokenizer = _read_tokenizer(os.path.join(directory, "tokenizer.json"), cfg, NATIVE_META)
    dtype = resolve_dtype(dtype) if dtype is not None else saved_dtype
    # With stages the layers' split follows the model's bytes, in the dtype it will run in.
    placed = sharding.placement(cfg, dtype, expert_weights, mesh, microbatches)
    shapes = param_shapes(cfg, saved_dtype, expert_weights)
    if placed is not None:
        target = placed.restore_target(shapes)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
    # A leaf on no device of this process (a pipeline stage of another process) is not read here: orbax would make
    # an array of it and fail (no shard to take its dtype from); it becomes a global array this process holds no
    # part of, as the constructors' placement makes it.
    mine = set(jax.local_devices())
    elsewhere = lambda s: not (set(s.sharding.device_set) & mine)  # noqa: E731
    item = jax.tree_util.tree_map(lambda s: ocp.PLACEHOLDER if elsewhere(s) else s, target)
    restore_args = jax.tree_util.tree_map(
        lambda s: s if s is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                                                      dtype=s.dtype), item)
    try:
        params = ocp.PyTreeCheckpointer().restore(os.path.join(directory, "params"),
                                                  args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    except Exception as e:  # orbax raises several types for missing/mismatched arrays
        raise CheckpointError(f"cannot restore parameters from {directory}/params: {e}") from e
    params = jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_single_device_arrays(s.shape, s.sharding, [], dtype=s.dtype)
        if elsewhere(s) else x, params, target)
    if placed is not None:
        params = placed.restored(params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if leaf.addressable_shards and not bool(_all_finite(leaf)):  # no shard here: its process checks it
            _refuse_non_finite(leaf, "params" + jax.tree_util.keystr(path))
    # A params folder of another save of the same architecture restores without complaint: only the digest
    # glm53.json recorded at save tells them apart (saves older than it have none).
    with open(os.path.join(directory, NATIVE_META)) as f:
        saved_digest = json.load(f).get("params_digest")
    digest = None
    if saved_digest is not None:
        digest = placed.params_digest(params) if placed is not None else params_digest(params)
        if digest != saved_digest:
            raise CheckpointError(f"{directory}/params does not hold the parameters {NATIVE_META} was saved with "
                                  "(their digest differs): the params folder comes from another save")
    if dtype != saved_dtype:
        final = param_shapes(cfg, dtype, expert_weights)
        params = (placed.cast(params, final) if placed is not None
                  else jax.tree_util.tree_map(lambda p, s: p.astype(s.dtype), params, final))
        digest = None  # the saved weights' digest, not the cast ones'
    return cfg, params, dtype, cache_config, tokenizer, placed, digest

"""The public API (glm53.from_config / generate / Model.forward / draft / save / load / from_pretrained / Tokenizer)
on one small float32 model, and the errors every entry point must raise with a clear message.

One module-scoped model and few distinct shapes keep jit compilation (which dominates on CPU) bounded. Prompts are
longer than index_topk so the DSA selection is sparse.
"""

import json
import os
import re
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tqdm

import glm53
from glm53 import CacheConfig, CheckpointError, ConfigError, ModelConfig
from kernels_pallas import kv_formats

VOCAB = 128
TOPK = 8

CFG = ModelConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16,
    qk_rope_head_dim=64, v_head_dim=16, index_n_heads=16, index_head_dim=128, index_topk=TOPK,
    indexer_types=("full", "shared"), n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
    topk_group=1, rope_theta=10000.0, max_position_embeddings=64, num_nextn_predict_layers=1,
    bos_token_id=0, eos_token_id=None, initializer_range=0.2)  # larger init: sharper logits, real routing

# 24 and 19 tokens: both prefill in one 32-token chunk, and prompt + NEW = 32 = the forward length below, so the
# tests share a handful of compiled shapes.
P1 = [int(x) for x in np.random.RandomState(1).randint(0, VOCAB, 24)]
P2 = [int(x) for x in np.random.RandomState(2).randint(0, VOCAB, 19)]
NEW = 8
# rel L2 of the first logits vs the f32 cache: roughly the format's precision (bf16 8-bit mantissa, q8g64 int8 per
# 64 values, fp8 e4m3 3-bit mantissa).
KV_TOLERANCE = {"bf16": 0.01, "q8g64": 0.04, "fp8g128": 0.1}


def rel_l2(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model():
    return glm53.from_config(CFG, seed=0, dtype="float32", cache_config=CacheConfig(kv_format="f32"))


@pytest.fixture(scope="module")
def batched(model):
    return glm53.generate(model, [P1, P2], max_new_tokens=NEW, return_logits=True)


@pytest.fixture(scope="module")
def alone(model):
    return [glm53.generate(model, [p], max_new_tokens=NEW, return_logits=True) for p in (P1, P2)]


# ---------------------------------------------------------------------------------------------------------------
# model, forward, generate
# ---------------------------------------------------------------------------------------------------------------
def test_param_count_matches_config(model):
    assert model.num_params() == CFG.param_count()
    leaves = jax.tree_util.tree_leaves(model.params)
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
    assert "mtp_layer" in model.params and "layers_1" in model.params


def test_a_weight_of_another_shape_is_named_when_a_step_is_traced(model):
    """Weights handed to a Model directly (not through a checkpoint, whose loader checks them) are checked against
    the config when a step is traced: the error names the weight and both shapes (glm53.model._weight)."""
    from flax.errors import ScopeParamShapeError

    params = jax.tree_util.tree_map(lambda x: x, model.params)  # a new tree, the same arrays
    params["layers_1"]["self_attn"]["kv_b_proj"] = params["layers_1"]["self_attn"]["kv_b_proj"][:, :-1]
    bad = glm53.Model(CFG, params, dtype="float32", cache_config=model.cache_config)
    named = r'"kv_b_proj" in "/layers_1/self_attn".* shape \(512, 64\).* has shape \(512, 63\)'
    with pytest.raises(ScopeParamShapeError, match=named):
        bad.forward(P1)


def test_tracing_a_step_reads_the_weights_without_tracing_their_initialisers(model, monkeypatch):
    """Flax's ``param`` traces each weight's initialiser at every apply to check its shape (~1 ms a weight: GLM-5's
    decode step traced in ~4.1 s instead of ~2.8 s); glm53.model._weight reads a stored weight without it."""
    import flax.core.scope

    import glm53.model

    read, flax_params = [], []
    weight, param = glm53.model._weight, flax.core.scope.Scope.param
    monkeypatch.setattr(glm53.model, "_weight", lambda m, name, *a: read.append(name) or weight(m, name, *a))
    monkeypatch.setattr(flax.core.scope.Scope, "param",
                        lambda self, name, *a, **k: flax_params.append(name) or param(self, name, *a, **k))
    fresh = glm53.Model(CFG, model.params, dtype="float32", cache_config=model.cache_config)  # its steps untraced
    np.testing.assert_array_equal(fresh.forward(P1), model.forward(P1))
    assert "kv_b_proj" in read and "experts_down_proj" in read and not flax_params


def test_forward_shape_and_dtype(model):
    logits = model.forward(P1)
    assert logits.shape == (len(P1), VOCAB) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    # The first rows see only themselves: a prefix's logits do not depend on what follows.
    np.testing.assert_allclose(model.forward(P1[:18]), logits[:18], rtol=1e-5, atol=1e-5)


def test_cached_decode_equals_no_cache_recompute(model, alone):
    """Greedy tokens of generate (prefill + one cached step per token) are the argmax of a no-cache forward over
    prompt + generated, and the decode logits equal the recomputed ones."""
    res = alone[0]
    toks = res.tokens[0]
    assert len(toks) == NEW
    full = model.forward(P1 + toks)
    rows = full[len(P1) - 1: len(P1) - 1 + NEW]
    assert np.argmax(rows, axis=-1).tolist() == toks
    np.testing.assert_allclose(res.logits[0], rows, rtol=1e-4, atol=1e-4)
    assert len(set(toks)) > 1  # not a degenerate constant output


def test_batched_prompts_of_different_lengths_equal_alone(batched, alone):
    assert batched.prompt_lengths == [len(P1), len(P2)]
    assert batched.logits.shape == (2, NEW, VOCAB) and batched.logits.dtype == np.float32
    for b in range(2):
        assert batched.tokens[b] == alone[b].tokens[0]
        np.testing.assert_allclose(batched.logits[b], alone[b].logits[0], rtol=1e-5, atol=1e-5)
    assert batched.tokens[0] != batched.tokens[1]


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(model, alone):
    def run(seed, top_p=1.0):
        return glm53.generate(model, [P1], max_new_tokens=NEW, temperature=1.5, top_p=top_p, seed=seed).tokens[0]

    a, b, c = run(0), run(0), run(1)
    assert a == b
    assert a != c
    assert run(0, top_p=1e-6) == alone[0].tokens[0]


def test_on_token_called_for_every_token_in_order(model, batched):
    calls = []
    res = glm53.generate(model, [P1, P2], max_new_tokens=NEW, on_token=lambda b, i, t: calls.append((b, i, t)))
    assert res.tokens == batched.tokens
    for b in range(2):
        mine = [(i, t) for bb, i, t in calls if bb == b]
        assert mine == list(enumerate(res.tokens[b]))
    assert [i for _, i, _ in calls] == sorted(i for _, i, _ in calls)  # step by step, sessions interleaved
    assert len(calls) == 2 * NEW


def test_generate_refuses_bad_callbacks_and_stop_tokens_before_the_prefill(model, monkeypatch):
    """The engine checks on_token and stop_tokens at its generate, which comes after the prefill: the front door
    checks them first (an uncallable on_token failed at the first token, its prefill wasted), naming its own
    callback's arguments."""
    import sys

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the arguments were checked")

    monkeypatch.setattr(sys.modules["glm53.generate"], "Engine", no_engine)
    with pytest.raises(TypeError, match=r"on_token must be callable as on_token\(prompt_index, step, token\), got 5"):
        glm53.generate(model, [P1], max_new_tokens=2, on_token=5)
    with pytest.raises(TypeError, match=r"on_token must accept \(prompt_index, step, token\)"):
        glm53.generate(model, [P1], max_new_tokens=2, on_token=lambda i, t: None)
    with pytest.raises(ValueError, match=f"stop token {VOCAB} is outside the vocabulary"):
        glm53.generate(model, [P1], max_new_tokens=2, stop_tokens=[1, VOCAB])
    with pytest.raises(TypeError, match="stop_tokens must be token ids"):
        glm53.generate(model, [P1], max_new_tokens=2, stop_tokens="a")


@pytest.mark.parametrize("kv_format", ["bf16", "q8g64", "fp8g128"])
def test_kv_formats_run_end_to_end(model, alone, kv_format):
    cc = CacheConfig(kv_format=kv_format)
    res = glm53.generate(model, [P1], max_new_tokens=NEW, cache=cc, return_logits=True, keep_cache=True)
    assert res.cache.kv_format == kv_format
    assert len(res.tokens[0]) == NEW and all(0 <= t < VOCAB for t in res.tokens[0])
    assert np.isfinite(res.logits).all()
    # The first logits come from the prefill through the quantised cache on the same prompt as the f32 run.
    err = rel_l2(res.logits[0, 0], alone[0].logits[0, 0])
    assert 0 < err < KV_TOLERANCE[kv_format], err


# ---------------------------------------------------------------------------------------------------------------
# MTP draft
# ---------------------------------------------------------------------------------------------------------------
def test_draft_shape_determinism_and_causality(model):
    ids = P1
    d = model.draft(ids)
    assert d.shape == (len(ids) - 1, VOCAB) and d.dtype == np.float32 and np.isfinite(d).all()
    np.testing.assert_array_equal(model.draft(ids), d)
    k = 18
    np.testing.assert_allclose(model.draft(ids[:k]), d[: k - 1], rtol=1e-5, atol=1e-5)
    # The draft depends on its inputs: changing token k changes rows >= k-1 only.
    other = list(ids)
    other[k] = (other[k] + 1) % VOCAB
    d2 = model.draft(other)
    np.testing.assert_allclose(d2[: k - 1], d[: k - 1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(d2[k - 1], d[k - 1])


# ---------------------------------------------------------------------------------------------------------------
# save / load, tokenizer
# ---------------------------------------------------------------------------------------------------------------
def test_save_load_round_trip(model, alone, tmp_path):
    model.save(str(tmp_path / "ckpt"))
    assert os.path.exists(tmp_path / "ckpt" / "glm53.json")
    loaded = glm53.load(str(tmp_path / "ckpt"))
    assert loaded.config == model.config
    flat_a = jax.tree_util.tree_leaves_with_path(model.params)
    flat_b = dict(jax.tree_util.tree_leaves_with_path(loaded.params))
    assert len(flat_a) == len(flat_b)
    for path, a in flat_a:
        b = flat_b[path]
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    assert glm53.generate(loaded, [P1], max_new_tokens=NEW).tokens == alone[0].tokens
    with pytest.raises(FileExistsError):
        model.save(str(tmp_path / "ckpt"))


def _word_tokenizer(path, vocab=VOCAB):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return str(path)


def test_tokenizer_strings_in_text_out(model, alone, tmp_path):
    tok = glm53.Tokenizer.from_file(_word_tokenizer(tmp_path / "tokenizer.json"))
    text = " ".join(f"w{i}" for i in P1)
    assert tok.encode(text) == P1
    model.tokenizer = tok
    try:
        res = glm53.generate(model, [text], max_new_tokens=NEW)
    finally:
        model.tokenizer = None
    assert res.tokens == alone[0].tokens
    assert res.text == [" ".join(f"w{t}" for t in res.tokens[0])]
    assert alone[0].text is None
    # A tokenizer with ids the model has no embedding for is refused when attached, not at the first string
    # that encodes past the vocabulary.
    wide = glm53.Tokenizer.from_file(_word_tokenizer(tmp_path / "wide.json", VOCAB + 5))
    with pytest.raises(ConfigError, match=f"the tokenizer has {VOCAB + 5} ids but the model's vocabulary holds "
                                          f"{VOCAB}"):
        model.tokenizer = wide
    assert model.tokenizer is None
    # One with fewer ids than the model's vocabulary is fine (checkpoints pad their vocabulary).
    model.tokenizer = glm53.Tokenizer.from_file(_word_tokenizer(tmp_path / "narrow.json", VOCAB - 5))
    model.tokenizer = None


def test_string_prompt_without_tokenizer_raises(model):
    assert model.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        glm53.generate(model, ["w1 w2"], max_new_tokens=2)


def test_tokenizer_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        glm53.Tokenizer.from_file(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        glm53.Tokenizer.from_file(str(bad))


# ---------------------------------------------------------------------------------------------------------------
# input errors
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_id", [-1, VOCAB, VOCAB + 1000])
def test_token_ids_outside_vocab(model, bad_id):
    with pytest.raises(ValueError, match=rf"token id {bad_id} at index 2, outside the vocabulary \[0, {VOCAB}\)"):
        glm53.generate(model, [[1, 2, bad_id, 3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward([bad_id])


def test_a_2d_array_of_prompts_is_a_batch_of_rows(model):
    """A [batch, tokens] array (numpy or JAX) is that many prompts, as the same rows in a list are."""
    rows = np.array([P1, P1[::-1]], np.int32)
    want = glm53.generate(model, [list(r) for r in rows], max_new_tokens=2).tokens
    assert glm53.generate(model, rows, max_new_tokens=2).tokens == want
    assert glm53.generate(model, jnp.asarray(rows), max_new_tokens=2).tokens == want


def test_prompt_errors(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        glm53.generate(model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts is empty"):
        glm53.generate(model, [], max_new_tokens=2)
    with pytest.raises(TypeError, match="list of prompts"):
        glm53.generate(model, [1, 2, 3], max_new_tokens=2)
    for one in (np.array(P1), jnp.array(P1), "w1 w2"):  # one prompt, not wrapped
        with pytest.raises(TypeError, match="wrap a single prompt in a list"):
            glm53.generate(model, one, max_new_tokens=2)
    for bad in (5, None, {0: P1}):  # not prompts at all: named, not a len() error
        with pytest.raises(TypeError, match=f"list of prompts .* got {type(bad).__name__}"):
            glm53.generate(model, bad, max_new_tokens=2)
    with pytest.raises(TypeError, match="integer token ids"):
        glm53.generate(model, [[1.5, 2.0]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        glm53.generate(model, [P1], max_new_tokens=64 - len(P1) + 1)
    # fits without MTP; with it the last verify step writes its drafts past position 63, refused before the prefill
    with pytest.raises(ValueError, match=r"\+ the last MTP step's 2 drafts needs 66 positions but the model has "
                                         "max_position_embeddings=64"):
        glm53.generate(model, [P1], max_new_tokens=64 - len(P1), mtp=2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.forward(list(range(65)))
    for n in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            glm53.generate(model, [P1], max_new_tokens=n)
    with pytest.raises(ValueError, match="top_p"):
        glm53.generate(model, [P1], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        glm53.generate(model, [P1], max_new_tokens=2, temperature=-1.0)


def test_model_dtype_errors():
    """glm53 runs in float32 or bfloat16: anything else is a ConfigError naming it, before a weight is drawn (None
    was read by NumPy as float64)."""
    for bad, match in (("float16", r"dtype 'float16' unknown; choose one of \['bf16', 'bfloat16', 'f32', 'float32'\]"),
                       (np.float16, "dtype float16 unsupported; use float32 or bfloat16"),
                       (None, "dtype None unsupported; use float32 or bfloat16"),
                       (3.5, "dtype 3.5 is not a dtype; use float32 or bfloat16")):
        with pytest.raises(ConfigError, match=match):
            glm53.from_config(CFG, seed=0, dtype=bad)


def test_cache_config_errors(model):
    with pytest.raises(ConfigError, match=r"kv_format 'int4' unknown; choose one of \['bf16', 'f32'"):
        CacheConfig(kv_format="int4")
    # Not a name: a KVFormat object was accepted and failed in the first save (JSON), a list as unhashable.
    for bad in (kv_formats.get_format("bf16"), ["bf16"], None):
        with pytest.raises(ConfigError, match="kv_format .* unknown; choose one of"):
            CacheConfig(kv_format=bad)
    with pytest.raises(ConfigError, match="cache mode 'disk' unknown"):
        CacheConfig(mode="disk")
    with pytest.raises(ConfigError, match="cache mode 'disk' unknown"):
        glm53.generate(model, [P1], max_new_tokens=2, cache="disk")
    with pytest.raises(TypeError, match="cache must be"):
        glm53.generate(model, [P1], max_new_tokens=2, cache=3)
    with pytest.raises(ConfigError, match="prefill_chunk=100 must be a power of two"):
        CacheConfig(prefill_chunk=100)
    with pytest.raises(ConfigError, match="unknown cache config fields"):
        CacheConfig.from_config_dict({"mode": "resident", "hot_row": 4})
    with pytest.raises(ConfigError, match="hot_rows must be an int, got '256'"):
        CacheConfig(mode="offload", hot_rows="256")
    with pytest.raises(ConfigError, match="copyback_every must be an int, got True"):
        CacheConfig(copyback_every=True)
    # max_len too small for prompt + new tokens (24 + 8 = 32 positions).
    with pytest.raises(ValueError, match=r"cache.max_len=16 rows cannot hold the 32 positions"):
        glm53.generate(model, [P1], max_new_tokens=NEW, cache=CacheConfig(kv_format="f32", max_len=16))


def test_a_hot_cache_larger_than_the_history_is_cut_to_it(model, batched):
    """``hot_rows`` past a slot's rows could never fill: the engine allocates a power of two that holds the slot
    (and what a round pins), says so in its config and statistics, and computes exactly what resident does."""
    small = CacheConfig(mode="offload", kv_format="f32", copyback_every=16, prefill_chunk=32, hot_rows=1 << 14)
    res = glm53.generate(model, [P1, P2], max_new_tokens=NEW, cache=small, return_logits=True, keep_cache=True)
    e = res.engine
    fits = 1 << (max(e.capacity, glm53.offload.min_hot_rows(model.config, small)) - 1).bit_length()
    assert e.cache_config.hot_rows == fits < small.hot_rows and res.cache_stats["hot_rows"] == fits
    assert res.tokens == batched.tokens and np.array_equal(res.logits, batched.logits)
    asked = glm53.Engine(model, small.replace(hot_rows=fits, max_len=e.cache_config.max_len), max_sessions=2)
    assert e.memory_report()["device"]["cache_bytes"] == asked.memory_report()["device"]["cache_bytes"]
    assert glm53.Engine(model, small.replace(hot_rows=fits), max_sessions=2).cache_config.hot_rows == fits


@pytest.mark.parametrize("change, match", [
    (dict(indexer_types=("full",) * 3), "indexer_types has 3 entries for 2 layers"),
    (dict(indexer_types=("shared", "full")), r"indexer_types\[0\] must be 'full'"),
    (dict(indexer_types=("full", "dense")), "must be 'full' or 'shared'"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, n_routed_experts=4\]"),
    (dict(n_group=3), "n_group=3 must divide n_routed_experts=4"),
    (dict(topk_group=3), r"topk_group=3 must be in \[1, n_group=2\]"),
    (dict(kv_lora_rank=256), "kv_lora_rank=256"),
    (dict(qk_rope_head_dim=32), "qk_rope_head_dim=32"),
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers=2"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace=3"),
    (dict(q_lora_rank=0), "q_lora_rank must be >= 1, got 0"),
    (dict(index_n_heads=0), "index_n_heads must be >= 1, got 0"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size must be >= 1, got 0"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be >= 1, got 0"),
    (dict(rope_theta=0.0), "rope_theta must be > 0"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps must be > 0"),
    (dict(eos_token_id=VOCAB), rf"eos_token_id must be None or token ids in \[0, vocab_size={VOCAB}\), got {VOCAB}"),
    (dict(eos_token_id=(1, "</s>")), "eos_token_id must be None or token ids"),
])
def test_impossible_model_configs(change, match):
    import dataclasses

    kw = {f.name: getattr(CFG, f.name) for f in dataclasses.fields(CFG)}
    kw.update(change)
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**kw)


def test_model_config_dict_errors():
    with pytest.raises(ConfigError, match=r"unknown model config fields \['hiden_size'\]"):
        ModelConfig.from_config_dict({"hiden_size": 3})
    with pytest.raises(ConfigError, match="model_type='llama'"):
        ModelConfig.from_hf({**CFG.to_hf(), "model_type": "llama"})
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        ModelConfig.from_hf({**CFG.to_hf(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    # fields of config.json that contradict each other or cannot be read are named, never resolved silently
    hf = CFG.to_hf()
    with pytest.raises(ConfigError, match="mlp_layer_types has 1 entries for num_hidden_layers=2"):
        ModelConfig.from_hf({**hf, "mlp_layer_types": ["dense"]})
    with pytest.raises(ConfigError, match="first_k_dense_replace=2 but mlp_layer_types has 1 dense layers"):
        ModelConfig.from_hf({**hf, "first_k_dense_replace": 2})
    assert ModelConfig.from_hf({**hf, "first_k_dense_replace": 5, "mlp_layer_types": ["dense"] * 2}) \
        .first_k_dense_replace == 2  # transformers clamps it to the layers: consistent
    with pytest.raises(ConfigError, match="index_topk_pattern='FX' holds letters other than F"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "indexer_types"} | {"index_topk_pattern": "FX"})
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false, got 'false'"):
        ModelConfig.from_hf({**hf, "tie_word_embeddings": "false"})
    with pytest.raises(ConfigError, match="rope_parameters must be an object"):
        ModelConfig.from_hf({**hf, "rope_parameters": "default"})


# ---------------------------------------------------------------------------------------------------------------
# checkpoint errors: a tiny HF checkpoint written by transformers, then corrupted one way per test
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from hf_reference import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("hf_ok")
    write_tiny_checkpoint(str(path), seed=0, num_hidden_layers=2, indexer_types=["full", "shared"])
    return path


@pytest.fixture
def ckpt(hf_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_dir, dst)
    return dst


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    f = str(path / "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_a_checkpoint_that_cannot_fit_is_refused_before_its_first_tensor(ckpt, monkeypatch):
    """from_pretrained counts the weights from config.json (and load from glm53.json) against the device's free
    memory before reading any."""
    from glm53 import memory

    def no_read(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1024)
    device = jax.local_devices()[0]  # cpu:0 here, gpu:0 in the GPU runs
    with monkeypatch.context() as m:
        m.setattr(glm53.checkpoint, "read_hf", no_read)
        with pytest.raises(ConfigError, match=rf"loading {ckpt}: .*M parameters need .* MiB on {device.platform}:"
                                              rf"{device.id} \(float32, experts model\), which has 0\.0 MiB free"):
            glm53.from_pretrained(str(ckpt), dtype="float32")
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)
    model = glm53.from_pretrained(str(ckpt), dtype="float32")
    assert model.config.num_hidden_layers == 2
    model.save(str(ckpt / "native"))  # a native save too, before orbax reads any array
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1024)
    with pytest.raises(ConfigError, match=rf"loading {ckpt / 'native'}: .* which has 0\.0 MiB free"):
        glm53.load(str(ckpt / "native"))


def test_valid_checkpoint_loads_with_tokenizer(ckpt):
    _word_tokenizer(ckpt / "tokenizer.json")
    m = glm53.from_pretrained(str(ckpt), dtype="float32", kv_format="f32")
    assert m.config.num_hidden_layers == 2 and m.cache_config.kv_format == "f32"
    assert m.tokenizer is not None and m.tokenizer.encode("w3 w5") == [3, 5]


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 parameters missing.*layers_1/self_attn/kv_b_proj"):
        glm53.from_pretrained(str(ckpt))


def test_missing_expert(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"experts \[5\] missing"):
        glm53.from_pretrained(str(ckpt))


def test_unexpected_tensor(ckpt):
    import torch

    _rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensors.*model.layers.0.self_attn.extra_proj.weight"):
        glm53.from_pretrained(str(ckpt))


def test_misshaped_tensor(ckpt):
    import torch

    _rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 8)}))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.self_attn.o_proj.weight: shape \(8, 64\)"):
        glm53.from_pretrained(str(ckpt))


def test_config_json_mismatch(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_size"] = 48
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not match the model's"):
        glm53.from_pretrained(str(ckpt))


def test_config_json_missing_or_broken(ckpt):
    cfg_text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        glm53.from_pretrained(str(ckpt))
    cfg = json.loads(cfg_text)
    del cfg["kv_lora_rank"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks the field 'kv_lora_rank'"):
        glm53.from_pretrained(str(ckpt))
    os.remove(ckpt / "config.json")
    with pytest.raises(CheckpointError, match="has no config.json"):
        glm53.from_pretrained(str(ckpt))


def test_no_weights_file(ckpt):
    os.remove(ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="no weights in"):
        glm53.from_pretrained(str(ckpt))


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        glm53.from_pretrained(str(ckpt))
    f.write_bytes(b"\x00" * 64)  # garbage header
    with pytest.raises(CheckpointError, match="cannot read"):
        glm53.from_pretrained(str(ckpt))


def test_shard_missing_from_index(ckpt):
    from transformers import GlmMoeDsaForCausalLM

    hf = GlmMoeDsaForCausalLM.from_pretrained(str(ckpt))
    shard_dir = ckpt.parent / "sharded"
    hf.save_pretrained(str(shard_dir), max_shard_size="300KB")
    index = json.loads((shard_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    glm53.from_pretrained(str(shard_dir))  # complete: loads
    os.remove(shard_dir / shards[1])
    with pytest.raises(CheckpointError, match=f"names shards that are not in .*{shards[1]}"):
        glm53.from_pretrained(str(shard_dir))


def test_index_that_disagrees_with_its_shards(ckpt):
    """Shards of different saves mixed under one index (a re-sharded repository, a shard copied from another model)
    are refused with the tensor and the shards named, not loaded with whatever the shards hold."""
    from transformers import GlmMoeDsaForCausalLM

    shard_dir = ckpt.parent / "sharded"
    GlmMoeDsaForCausalLM.from_pretrained(str(ckpt)).save_pretrained(str(shard_dir), max_shard_size="300KB")
    index_file = shard_dir / "model.safetensors.index.json"
    good = json.loads(index_file.read_text())
    shards = sorted(set(good["weight_map"].values()))

    def index_with(**weight_map):
        index_file.write_text(json.dumps({**good, "weight_map": weight_map}))

    name = next(n for n, f in good["weight_map"].items() if f == shards[0])
    index_with(**{**good["weight_map"], name: shards[1]})
    with pytest.raises(CheckpointError, match=rf"maps tensors to shards that do not hold them: \['{name} \(index: "
                                              rf"{shards[1]}, found in {shards[0]}\)'\]"):
        glm53.from_pretrained(str(shard_dir))
    index_with(**{n: f for n, f in good["weight_map"].items() if n != name})
    with pytest.raises(CheckpointError, match=rf"does not list tensors its shards hold: \['{name}'\]"):
        glm53.from_pretrained(str(shard_dir))
    index_with(**{**good["weight_map"], "model.layers.0.self_attn.extra.weight": shards[0]})
    with pytest.raises(CheckpointError, match="names tensors that no shard holds"):
        glm53.from_pretrained(str(shard_dir))
    index_file.write_text(json.dumps({"weight_map": [shards[0]]}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to shard file names"):
        glm53.from_pretrained(str(shard_dir))
    index_with(**{**good["weight_map"], name: None})
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to shard file names"):
        glm53.from_pretrained(str(shard_dir))


def test_fused_experts_of_the_wrong_shape_are_named(ckpt):
    import torch

    def fused(gate_up_shape):
        def edit(t):
            for k in [k for k in t if k.startswith("model.layers.1.mlp.experts.")]:
                t.pop(k)
            t["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(gate_up_shape)
            t["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 64, 32)
        return edit

    _rewrite(ckpt, fused((64, 64)))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.1.mlp.experts.gate_up_proj \(.*\): shape "
                                              r"\(64, 64\), but the model's fused experts are \(8, 64, 64\)"):
        glm53.from_pretrained(str(ckpt))
    _rewrite(ckpt, fused((8, 64, 64)))
    glm53.from_pretrained(str(ckpt))  # the right shapes load


def test_tied_config_with_its_own_lm_head(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match="tie_word_embeddings=true .* holds its own lm_head.weight"):
        glm53.from_pretrained(str(ckpt))


def test_native_checkpoint_with_parts_of_another_save(model, tmp_path):
    """A params folder, tokenizer.json or glm53.json field that does not belong to the save is refused by name."""
    d, other = tmp_path / "a", tmp_path / "b"
    model.save(str(d))
    glm53.from_config(CFG, seed=1, dtype="float32").save(str(other))
    shutil.rmtree(d / "params")
    shutil.copytree(other / "params", d / "params")  # same architecture, other values
    with pytest.raises(CheckpointError, match="does not hold the parameters glm53.json was saved with"):
        glm53.load(str(d))
    shutil.rmtree(d / "params")
    shutil.copytree(other / "params", d / "params")
    shutil.copy(other / "glm53.json", d / "glm53.json")
    assert glm53.load(str(d)).config == model.config  # both parts of one save
    _word_tokenizer(d / "tokenizer.json", VOCAB + 5)
    with pytest.raises(CheckpointError, match=f"tokenizer.json has {VOCAB + 5} ids but glm53.json's vocab_size is "
                                              f"{VOCAB}"):
        glm53.load(str(d))
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json is not a valid tokenizer.json"):
        glm53.load(str(d))
    os.remove(d / "tokenizer.json")
    meta = json.loads((d / "glm53.json").read_text())
    (d / "glm53.json").write_text(json.dumps({**meta, "cache_config": "resident"}))
    with pytest.raises(CheckpointError, match="cache_config must be an object, got str"):
        glm53.load(str(d))


def test_load_on_non_glm53_dir(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="not a glm53 checkpoint"):
        glm53.load(str(ckpt))
    with pytest.raises(CheckpointError, match="not a glm53 checkpoint"):
        glm53.load(str(tmp_path / "empty"))


def test_non_finite_weights_are_refused_by_name(ckpt):
    """Corrupted tensor bytes (here: NaNs and infs written into a weight) load without complaint from safetensors;
    glm53 refuses them on load and names the tensor."""
    import torch

    def corrupt(t):
        w = t["model.layers.1.self_attn.q_b_proj.weight"].clone()
        w[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        t["model.layers.1.self_attn.q_b_proj.weight"] = w

    _rewrite(ckpt, corrupt)
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.q_b_proj.weight holds 3 non-finite"):
        glm53.from_pretrained(str(ckpt))


def test_non_finite_experts_and_native_parameters_are_refused_by_name(ckpt, tmp_path):
    """An expert's weight is checked inside its layer's stack, which names the expert's own tensor (the second of
    two bad ones is not named); a value finite as stored but past the model dtype's range is refused once cast; and
    a native save of a diverged model is refused on load, naming the parameter."""
    expert = "model.layers.1.mlp.experts.{}.up_proj.weight"

    def corrupt(t):
        for e in (1, 3):
            w = t[expert.format(e)].clone()
            w[2, 1] = float("nan")
            t[expert.format(e)] = w

    _rewrite(ckpt, corrupt)
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(expert.format(1))} holds 1 non-finite"):
        glm53.from_pretrained(str(ckpt), dtype="float32")

    def huge(t):
        for e in (1, 3):
            t[expert.format(e)] = t[expert.format(e)].nan_to_num(0.0)
        w = t["model.layers.0.mlp.down_proj.weight"].clone()
        w[0, 0] = 3.4e38  # float32's largest values round to inf in bfloat16
        t["model.layers.0.mlp.down_proj.weight"] = w

    _rewrite(ckpt, huge)
    assert glm53.from_pretrained(str(ckpt), dtype="float32").config.num_hidden_layers == 2
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight holds 1 non-finite"):
        glm53.from_pretrained(str(ckpt), dtype="bfloat16")

    model = glm53.from_config(CFG, seed=0, dtype="float32")
    q = model.params["layers_0"]["self_attn"]["q_b_proj"]["kernel"]
    model.params["layers_0"]["self_attn"]["q_b_proj"]["kernel"] = q.at[0, :2].set(jnp.inf)
    model.save(str(tmp_path / "diverged"))
    with pytest.raises(CheckpointError, match=r"params\['layers_0'\]\['self_attn'\]\['q_b_proj'\]\['kernel'\] "
                                              r"holds 2 non-finite"):
        glm53.load(str(tmp_path / "diverged"))


def test_corrupt_native_checkpoint_metadata(model, tmp_path):
    d = tmp_path / "ckpt"
    model.save(str(d))
    meta = d / "glm53.json"
    good = meta.read_text()
    meta.write_text(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="glm53.json is not valid JSON"):
        glm53.load(str(d))
    meta.write_text(json.dumps({**json.loads(good), "dtype": "float7"}))
    with pytest.raises(CheckpointError, match="incomplete or inconsistent"):
        glm53.load(str(d))
    meta.write_text(good)
    assert glm53.load(str(d)).config == model.config


def test_generate_rejects_bad_numbers_up_front(model):
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        glm53.generate(model, [P1], max_new_tokens=2, temperature=float("nan"))
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        glm53.generate(model, [P1], max_new_tokens=2.5)
    with pytest.raises(ValueError, match="top_p must be a finite number"):
        glm53.generate(model, [P1], max_new_tokens=2, top_p=float("inf"))
    with pytest.raises(ValueError, match="mtp > 0 needs an MTP module|accept_override"):
        glm53.generate(model, [P1], max_new_tokens=2, accept_override=2)
    with pytest.raises(ValueError, match=r"prompts is an empty batch \(shape \(0, 5\)\)"):
        glm53.generate(model, np.zeros((0, 5), np.int32), max_new_tokens=2)  # was max()'s "empty sequence"
    with pytest.raises(TypeError, match="keep_cache must be True or False, got 'yes'"):
        glm53.generate(model, [P1], max_new_tokens=2, keep_cache="yes")
    with pytest.raises(TypeError, match="selection_override must be callable"):
        glm53.generate(model, [P1], max_new_tokens=2, selection_override=3)


def test_progress_bars_appear_on_long_work_by_default(model, capsys, monkeypatch):
    """progress=None (the default) shows the decode's and a long prefill's bars once they have run DELAY_S seconds:
    none for short work, at once when it is 0; False never; True at once. Anything else is refused up front."""
    from glm53 import progress

    def bars(**kw):
        capsys.readouterr()
        # 24 tokens: two 16-token prefill chunks
        glm53.generate(model, [P1], max_new_tokens=2, cache=CacheConfig(kv_format="f32", prefill_chunk=16), **kw)
        err = capsys.readouterr().err
        return ("prefill" in err, "decode" in err)

    monkeypatch.setattr(progress, "DELAY_S", 3600.0)
    assert bars() == (False, False)
    assert bars(progress=True) == (True, True)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    assert bars() == (True, True)
    assert bars(progress=False) == (False, False)
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        glm53.generate(model, [P1], max_new_tokens=2, progress="yes")


def test_random_weights_show_progress_and_equal_themselves_without(capsys, monkeypatch):
    """from_config's fill of random weights: a bar over the bytes (the 8.9B benchmark model takes minutes on a CPU
    and printed nothing until it was done) at once with progress=True, after DELAY_S by default, never with False;
    the weights are the same either way."""
    from glm53 import progress

    def bar_of(**kw):
        capsys.readouterr()
        m = glm53.from_config(CFG, seed=0, dtype="float32", **kw)
        return m, capsys.readouterr().err

    monkeypatch.setattr(progress, "DELAY_S", 3600.0)
    quiet, err = bar_of()
    assert "random weights" not in err
    shown, err = bar_of(progress=True)
    total = glm53.params.nbytes(shown.params)
    assert "random weights" in err and "100%" in err
    size = tqdm.tqdm.format_sizeof(total, divisor=1024)  # the bar's total is the weights' bytes, all filled
    assert f"{size}/{size}" in err, err
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    assert "random weights" in bar_of()[1] and "random weights" not in bar_of(progress=False)[1]
    for a, b in zip(jax.tree_util.tree_leaves(quiet.params), jax.tree_util.tree_leaves(shown.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        glm53.from_config(CFG, dtype="float32", progress="yes")


def test_compiler_options_are_checked_up_front(model):
    """Engine's compiler_options: XLA's own words for an unknown option or an unparsable value, before any session
    (the check compiles a trivial program, not a step)."""
    with pytest.raises(glm53.ConfigError, match="No such compile option"):
        glm53.Engine(model, "resident", compiler_options={"xla_no_such_option": True})
    with pytest.raises(glm53.ConfigError, match="xla_cpu_enable_fast_math"):
        glm53.Engine(model, "resident", compiler_options={"xla_cpu_enable_fast_math": "maybe"})
    with pytest.raises(glm53.ConfigError, match="str, bool, int or float"):
        glm53.Engine(model, "resident", compiler_options={"xla_dump_to": None})
    with pytest.raises(glm53.ConfigError, match="mapping"):
        glm53.Engine(model, "resident", compiler_options=["xla_dump_to=/tmp"])
    e = glm53.Engine(model, "resident", compiler_options={"xla_cpu_enable_fast_math": False})
    assert e.compiler_options == (("xla_cpu_enable_fast_math", False),)


def test_prefill_time_counts_the_prefill_running_not_its_queueing(model, monkeypatch):
    """``Engine.open`` returns once the prefill's steps are queued. ``generate``'s prefill clock (and so
    ``prefill_tokens_per_s``) must stop when they have run: each open here leaves the cache behind a computation that
    runs ~0.2 s after it was queued, which a clock stopped at queueing would not see. (Not a host callback: on a CPU
    a program with one runs synchronously at its call.)"""

    @jax.jit
    def late(x):  # x + 0, after 20 dependent 1000 x 1000 matmuls
        y = jax.lax.fori_loop(0, 20, lambda i, y: jnp.tanh(y @ y), jnp.full((1000, 1000), 1e-3, jnp.float32))
        return x + (y[0, 0] * 0).astype(x.dtype)

    opened = []
    open_now = glm53.Engine.open

    def open_late(self, *args, **kw):
        sid = open_now(self, *args, **kw)
        leaves, tree = jax.tree.flatten(self.cache)
        i = min((j for j, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.integer)), key=lambda j: leaves[j].size)
        leaves[i] = late(leaves[i])
        self.cache = jax.tree.unflatten(tree, leaves)
        opened.append(sid)
        return sid

    glm53.generate(model, [P1], max_new_tokens=2)  # compiled before the clock matters
    probe = jnp.zeros(3, jnp.int32)
    late(probe).block_until_ready()
    t = time.perf_counter()
    late(probe).block_until_ready()
    running = time.perf_counter() - t
    monkeypatch.setattr(glm53.Engine, "open", open_late)
    res = glm53.generate(model, [P1], max_new_tokens=2)
    assert opened and len(P1) / res.prefill_tokens_per_s >= running / 2, (len(P1) / res.prefill_tokens_per_s, running)


def test_generate_reports_compilation_apart(model):
    fresh = glm53.from_config(CFG, seed=0, dtype="float32", cache_config=CacheConfig(kv_format="f32"))
    first = glm53.generate(fresh, [P1[:7]], max_new_tokens=3)
    again = glm53.generate(fresh, [P1[:7]], max_new_tokens=3)
    assert first.compile_s > 0 and "compilation" in first.summary()
    assert again.compile_s < first.compile_s and again.tokens == first.tokens


def _with_mtp_layer(ckpt):
    """The tiny checkpoint with an MTP layer appended as published GLM-5 checkpoints store one (model.layers.N: a
    decoder layer plus enorm / hnorm / eh_proj / shared_head), and config.json asking for it."""
    import torch

    cfg = json.loads((ckpt / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]

    def add(t):
        gen = torch.Generator().manual_seed(5)
        for name in [k for k in t if k.startswith(f"model.layers.{n - 1}.")]:  # an MoE layer
            t[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = t[name].clone()
        for name in [k for k in t if k.startswith("model.layers.0.self_attn.indexer.")]:  # MTP runs its own indexer
            t[name.replace("layers.0.", f"layers.{n}.")] = t[name].clone()
        for rest, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("shared_head.norm.weight", (h,)),
                            ("eh_proj.weight", (h, 2 * h))):
            t[f"model.layers.{n}.{rest}"] = 1.0 + 0.1 * torch.randn(shape, generator=gen)

    _rewrite(ckpt, add)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return cfg


def test_mtp_layers_and_layer_counts_are_matched_to_config(ckpt):
    """An MTP layer loads when config.json asks for it and is skipped when it does not (as transformers does); a
    config asking for one the checkpoint lacks is refused with the way out (mtp=False); a config with a main layer too
    few is refused, not loaded without that layer."""
    cfg = _with_mtp_layer(ckpt)
    m = glm53.from_pretrained(str(ckpt), dtype="float32")
    assert m.config.num_nextn_predict_layers == 1 and m.draft(P1).shape == (len(P1) - 1, 256)
    read = []
    real = glm53.checkpoint._read
    glm53.checkpoint._read = lambda stored, name: read.append(name) or real(stored, name)
    try:  # a skipped MTP layer is never read (GLM-5's is a whole MoE layer)
        assert glm53.from_pretrained(str(ckpt), dtype="float32", mtp=False).config.num_nextn_predict_layers == 0
    finally:
        glm53.checkpoint._read = real
    assert read and not [n for n in read if n.startswith(f"model.layers.{cfg['num_hidden_layers']}.")]
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    assert glm53.from_pretrained(str(ckpt), dtype="float32").config.num_nextn_predict_layers == 0
    # a config with one main layer fewer: the last main layer is not an MTP layer
    n = cfg["num_hidden_layers"]
    _rewrite(ckpt, lambda t: [t.pop(k) for k in [k for k in t if k.startswith(f"model.layers.{n}.")]])
    short = {**cfg, "num_hidden_layers": n - 1, "indexer_types": cfg["indexer_types"][: n - 1],
             "mlp_layer_types": cfg["mlp_layer_types"][: n - 1]}
    (ckpt / "config.json").write_text(json.dumps(short))
    with pytest.raises(CheckpointError, match=rf"unexpected tensors.*model.layers.{n - 1}\."):
        glm53.from_pretrained(str(ckpt), dtype="float32")
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match="holds no tensor of its MTP layer.*mtp=False"):
        glm53.from_pretrained(str(ckpt), dtype="float32")
    assert glm53.from_pretrained(str(ckpt), dtype="float32", mtp=False).config.num_nextn_predict_layers == 0


def test_expert_and_dtype_problems_are_named(ckpt):
    import torch

    _rewrite(ckpt, lambda t: t.update({"model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.1.mlp.experts.3.up_proj.weight \(.*\): shape "
                                              r"\(16, 64\), but the model's experts are \[out, in\] = \(32, 64\)"):
        glm53.from_pretrained(str(ckpt))
    _rewrite(ckpt, lambda t: t.update({"model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(32, 64,
                                                                                                  dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match="experts.3.up_proj.weight in .* is stored as I32"):
        glm53.from_pretrained(str(ckpt))
    _rewrite(ckpt, lambda t: t.update({"model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(32, 64),
                                       "model.norm.weight_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensors.*model.norm.weight_scale_inv"):
        glm53.from_pretrained(str(ckpt))


def test_missing_tensors_are_named_as_the_checkpoint_names_them(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"))
    with pytest.raises(CheckpointError, match=r"layers_1/mlp/e_score_correction_bias "
                                              r"\(model.layers.1.mlp.gate.e_score_correction_bias\)"):
        glm53.from_pretrained(str(ckpt))


def test_tokenizer_and_directory_problems_come_before_the_weights(ckpt, tmp_path):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)  # weights that cannot be read: the tokenizer is first
    (ckpt / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json is not a valid tokenizer.json"):
        glm53.from_pretrained(str(ckpt))
    _word_tokenizer(ckpt / "tokenizer.json", vocab=1000)
    with pytest.raises(CheckpointError, match="tokenizer.json has 1,000 ids but config.json's vocab_size is 256"):
        glm53.from_pretrained(str(ckpt))
    os.remove(ckpt / "tokenizer.json")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        glm53.from_pretrained(str(ckpt))
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "hidden_size": "64"}))
    with pytest.raises(CheckpointError, match="hidden_size must be an int, got '64'"):
        glm53.from_pretrained(str(ckpt))
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not the object of a model config"):
        glm53.from_pretrained(str(ckpt))
    native = tmp_path / "native"
    glm53.from_config(CFG, seed=0, dtype="float32").save(str(native))
    with pytest.raises(CheckpointError, match="written by Model.save: load it with glm53.load"):
        glm53.from_pretrained(str(native))


def test_loading_shows_progress_and_forward_takes_strings(ckpt, capsys):
    _word_tokenizer(ckpt / "tokenizer.json", vocab=256)
    m = glm53.from_pretrained(str(ckpt), dtype="float32", progress=True)
    assert "loading ckpt" in capsys.readouterr().err
    text = " ".join(f"w{i}" for i in P1)
    np.testing.assert_array_equal(m.forward(text), m.forward(P1))

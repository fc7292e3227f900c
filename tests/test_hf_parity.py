"""glm53 against transformers' own ``glm_moe_dsa`` (the reference implementation), on tiny random checkpoints
written by transformers' ``save_pretrained``.

The configs have 16 indexer heads, so exact top-k score ties (which the reference breaks arbitrarily) do not occur,
and prompts well longer than ``index_topk`` so the DSA selection is really sparse.

torch and transformers (the reference; the test extra installs them) are imported where the tests use them, never
through ``importorskip``: without them these tests fail, and CI cannot skip them. Not at the top of the file: every
pytest worker imports every test file to collect it, and these two took 3.5 s of each worker's start.
"""

import copy
import json
import os

import numpy as np
import pytest

import glm53
from hf_reference import hf_greedy, hf_logits, write_tiny_checkpoint

INDEX_TOPK = 8


def rel_l2(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Default tiny config: full/shared/full/shared indexers, group-limited routing (n_group 2, topk_group 1)."""
    path = str(tmp_path_factory.mktemp("hf_single"))
    hf = write_tiny_checkpoint(path, seed=0, index_topk=INDEX_TOPK)
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    model = glm53.from_pretrained(path, dtype="float32", kv_format="f32")
    return path, hf, model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A second variant: other seed, 4 groups of 2 experts choosing 2 groups, a full/full/shared/full pattern, 3
    experts per token, and the weights split into shards with an index json."""
    path = str(tmp_path_factory.mktemp("hf_sharded"))
    hf = write_tiny_checkpoint(path, seed=3, index_topk=INDEX_TOPK, n_group=4, topk_group=2, num_experts_per_tok=3,
                               indexer_types=["full", "full", "shared", "full"])
    os.remove(os.path.join(path, "model.safetensors"))
    hf.save_pretrained(path, max_shard_size="300KB")
    return path, hf


def prompt(n, seed):
    """Random ids with token 0 planted in the middle: a real token for glm53 (it has no pad id), so the reference
    must be told it is not padding (see hf_reference.hf_greedy)."""
    ids = np.random.RandomState(seed).randint(0, 256, size=n)
    ids[n // 2] = 0
    return ids


def test_config_from_hf_matches_hf_fields(single):
    path, hf, model = single
    hc, c = hf.config, model.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                  "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
                  "routed_scaling_factor", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                  "first_k_dense_replace"):
        assert getattr(c, field) == getattr(hc, field), field
    assert c.indexer_types == tuple(hc.indexer_types) == ("full", "shared", "full", "shared")
    assert c.rope_theta == hc.rope_parameters["rope_theta"]
    assert c.num_nextn_predict_layers == 0  # the tiny HF config has no MTP module
    assert [("sparse" if c.is_moe_layer(i) else "dense") for i in range(c.num_hidden_layers)] == hc.mlp_layer_types
    # to_hf -> from_hf is the identity, and the written config.json parses to the same thing.
    assert glm53.ModelConfig.from_hf(c.to_hf()) == c
    with open(os.path.join(path, "config.json")) as f:
        assert glm53.ModelConfig.from_hf(json.load(f)) == c


def test_forward_logits_match_hf(single):
    _, hf, model = single
    ids = prompt(56, seed=1)  # 7x index_topk: every later query attends to a strict subset of its history
    ours = model.forward(ids)
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (56, 256)
    assert rel_l2(ours, ref) < 1e-4
    # Per position too: the tail (sparse selection) must match as well as the head (dense, T <= index_topk).
    per_pos = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert per_pos.max() < 1e-3, per_pos


def test_greedy_generate_matches_hf_batched(single):
    _, hf, model = single
    prompts = [prompt(40, seed=2), prompt(27, seed=5)]  # different lengths, one generate call
    n = 14
    res = glm53.generate(model, [p.tolist() for p in prompts], max_new_tokens=n, cache="resident")
    assert res.prompt_lengths == [40, 27]
    for p, toks in zip(prompts, res.tokens):
        assert toks == hf_greedy(hf, p, n)


def test_sharded_checkpoint_loads_and_matches(sharded):
    path, hf = sharded
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 2 and not os.path.exists(os.path.join(path, "model.safetensors"))
    model = glm53.from_pretrained(path, dtype="float32", kv_format="f32")
    assert model.config.n_group == 4 and model.config.topk_group == 2
    assert model.config.indexer_types == ("full", "full", "shared", "full")
    ids = prompt(56, seed=4)
    assert rel_l2(model.forward(ids), hf_logits(hf, ids)) < 1e-4
    res = glm53.generate(model, [ids.tolist()], max_new_tokens=12)
    assert res.tokens[0] == hf_greedy(hf, ids, 12)


def test_bfloat16_forward_close_to_hf_float32(single):
    """The bf16 path works. This random checkpoint is chaotic (unit-gain matrices, sigmoid routing and top-k picks
    that flip under bf16 rounding): transformers' *own* bf16 forward is ~0.4 rel L2 from its float32 one over the
    whole prompt. So: the dense-attention head of the prompt (positions < index_topk + 1, before any selection
    can flip) is within 3e-2 of HF float32, and over the whole prompt glm53's bf16 error is no worse than the
    reference's own bf16 error."""
    import torch

    path, hf, _ = single
    model = glm53.from_pretrained(path, dtype="bfloat16", kv_format="bf16")
    assert model.params["embed_tokens"].dtype == np.dtype("bfloat16")
    assert model.params["layers_1"]["mlp"]["experts_gate_proj"].dtype == np.dtype("bfloat16")
    ids = prompt(56, seed=1)
    ours = model.forward(ids)
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    ref = hf_logits(hf, ids)
    head = INDEX_TOPK + 1
    err_head = rel_l2(ours[:head], ref[:head])
    assert 1e-5 < err_head < 3e-2, err_head  # really bf16 (not silently float32), and close
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        ref_bf16 = hf_bf16(torch.tensor([ids.tolist()])).logits[0].float().numpy()
    err, err_hf = rel_l2(ours, ref), rel_l2(ref_bf16, ref)
    assert err <= 1.25 * err_hf, (err, err_hf)

"""A small float32 GLM-5 with an MTP module and the cache sizes the engine tests share (few distinct shapes: the
engine's executables are compiled once per model and shape and shared by every engine of the model)."""

import dataclasses

import numpy as np

import glm53
from glm53 import CacheConfig, ModelConfig

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                  qk_nope_head_dim=8, v_head_dim=8, index_n_heads=16, index_head_dim=128, index_topk=8,
                  indexer_types=("full", "shared"), n_routed_experts=4, num_experts_per_tok=2,
                  num_nextn_predict_layers=1, max_position_embeddings=2048, eos_token_id=None,
                  initializer_range=0.1)
# 16-row pages and chunks: a 64-row ring, so the smallest hot cache is 8 + 64 -> 128 slots, far below the
# histories of a few hundred rows the tests build (evictions, misses, pages in host memory).
CC = CacheConfig(kv_format="q8g64", copyback_every=16, prefill_chunk=16, hot_rows=128, max_len=512)


# Head counts that tp = 2 and 4 divide, GLM-5's 512-d latent: the sharding, planner, capacity and lowering tests.
MESH_CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=32,
                       kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, index_n_heads=16,
                       index_head_dim=128, index_topk=16, indexer_types=("full", "shared", "full"),
                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                       max_position_embeddings=512, num_nextn_predict_layers=1, eos_token_id=None)

# Sixteen layers (one per stage of a 16-stage pipeline), heads that tp = 8 divides: the pipeline layouts' tests.
PIPE_CFG = dataclasses.replace(MESH_CFG, num_hidden_layers=16, num_attention_heads=8,
                               indexer_types=("full", "shared") * 8, first_k_dense_replace=2)


def make_model(seed: int = 3):
    return glm53.from_config(CFG, seed=seed, dtype="float32")


def ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=n).tolist()


def engine(model, mode: str, max_sessions: int = 1, **kw):
    return glm53.Engine(model, CC.replace(mode=mode), max_sessions=max_sessions, **kw)

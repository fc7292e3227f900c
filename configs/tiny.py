"""Tiny GLM-5: every code path of the full model (dense + MoE layers, full + shared indexers, MTP, sparse top-k
selection with index_topk well below the prompt length) at sizes that run in seconds on a laptop CPU."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=512,  # token ids in [0, vocab_size)
        hidden_size=64,  # residual stream width
        intermediate_size=128,  # dense SwiGLU width (first first_k_dense_replace layers)
        moe_intermediate_size=32,  # per-expert SwiGLU width
        num_hidden_layers=4,  # decoder layers (MTP layer not counted)
        first_k_dense_replace=1,  # leading dense-MLP layers, then MoE
        num_attention_heads=4,
        q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
        # kv_lora_rank 512 + rope 64 keep the real 576-value KV row, so kv formats and kernels run at real widths.
        index_n_heads=16,  # >= 16 heads: exact score ties (all-negative ReLU sums) practically vanish
        index_head_dim=128,
        index_topk=32,  # selection is really sparse beyond 32 tokens of history
        indexer_types=("full", "shared", "full", "shared"),
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5,
        rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096,
        num_nextn_predict_layers=1,  # one MTP module
        tie_word_embeddings=False, bos_token_id=0,
        # random weights: never stop early (a placeholder: None, and an int from the command line,
        # --config.model.eos_token_id=7; ml_collections refuses to override a plain None)
        eos_token_id=ml_collections.config_dict.placeholder(int),
        initializer_range=0.02,
    ))
    c.dtype = "float32"  # parameter and activation dtype: float32 | bfloat16
    c.checkpoint = ""  # HF directory (glm53.from_pretrained) or glm53 directory (glm53.load); "" = random init
    c.seed = 0  # parameter init seed
    c.cache = ml_collections.ConfigDict(dict(
        mode="resident",  # resident | offload
        kv_format="f32",  # f32 | bf16 | q8g64 | fp8g128
        max_len=0,  # rows per session; 0 = prompt + new tokens
        prefill_chunk=64,  # tokens per prefill step (power of two)
        index_keys="model",  # DSA indexer keys: model (the model dtype) | fp8 (e4m3 + a scale per key)
        indexer_precision="highest",  # indexer scores: highest | bf16 | fp8 (needs index_keys=fp8)
        hot_rows=256,  # offload: hot-cache slots per layer (>= index_topk + ring rows, a power of two)
        copyback_every=16,  # offload: rows per batched ring -> host copy
        ring_rows=0,  # offload: ring rows, at least (raised to a power of two holding a page + a chunk)
        policy="circular",  # offload: hot-slot replacement, circular (the Pallas fill) | lfu (jnp fill; glm53.policies)
    ))
    c.mesh = ml_collections.ConfigDict(dict(
        stages=1,  # pipeline stages (glm53.pipeline): each a run of layers with its weights and cache
        tp=1,  # tensor-parallel devices (glm53.sharding: heads, MLP widths, vocab split; cache replicated)
        microbatches=1,  # with stages: session groups a decode step splits into (1: bit-identical to one device)
    ))
    c.run = ml_collections.ConfigDict(dict(
        prompt_len=200,  # random prompt tokens per session
        batch=2,  # sessions decoded together
        max_new_tokens=24,
        temperature=0.0,  # 0 = greedy
        top_p=1.0,
        seed=0,  # prompt and sampling seed
        output_json="",  # write the measured figures here (experiments/results/...)
        compare_resident=False,  # also decode with a resident cache and check tokens + logits are identical
        mtp=0,  # MTP speculative decoding depth (0-3; the model's one MTP module applied recursively)
        accept_override=-1,  # benchmarks: accept this many drafts per step whatever they are (-1: off)
    ))
    return c

"""GLM-5 at its real per-layer widths (attention, indexer, experts, vocab) with fewer layers and experts, so one
H200 (141 GB) holds it: every kernel and cache row runs at the full model's sizes.

Parameters (``ModelConfig.param_count()``, MTP module included): 8,871,964,544 ~ 8.87B -> 17.7 GB in bf16.
Cache at prompt_len 50,000: 9 cache layers x 50K rows x 656 B (q8g64) ~ 295 MB + indexer keys (5 full-indexer
layers x 50K x 128 x bf16 ~ 64 MB).

    python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=50000
"""

import ml_collections

_LAYERS = 8


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=154880,  # GLM-5's vocabulary: the LM head and embedding at full size
        hidden_size=6144,  # residual stream width (GLM-5's)
        intermediate_size=12288,  # dense SwiGLU width (GLM-5's)
        moe_intermediate_size=2048,  # per-expert SwiGLU width (GLM-5's)
        num_hidden_layers=_LAYERS,  # 8 decoder layers instead of 78 (MTP layer not counted)
        first_k_dense_replace=1,  # one dense layer, then MoE layers
        num_attention_heads=64,  # MLA query heads (GLM-5's)
        q_lora_rank=2048,  # query low-rank bottleneck (GLM-5's)
        kv_lora_rank=512,  # compressed KV latent per token (GLM-5's)
        qk_nope_head_dim=192,  # per-head query/key dims without RoPE
        qk_rope_head_dim=64,  # per-head rope dims; one shared 64-d rope key per token
        v_head_dim=256,  # per-head value width
        index_n_heads=32,  # DSA indexer heads (GLM-5's)
        index_head_dim=128,  # indexer query/key width
        index_topk=2048,  # positions each query attends to (GLM-5's)
        indexer_types=("full", "shared") * (_LAYERS // 2),  # alternate: exercises both indexer kinds
        n_routed_experts=16,  # 16 routed experts instead of 256 (fits one GPU)
        num_experts_per_tok=8,  # routed experts chosen per token (GLM-5's)
        n_shared_experts=1,  # always-on shared expert per MoE layer
        n_group=1, topk_group=1,  # no group-limited routing
        norm_topk_prob=True,  # normalise the chosen experts' scores
        routed_scaling_factor=2.5,  # routed-expert weight scale (GLM-5's)
        rms_norm_eps=1e-5,  # RMSNorm epsilon
        rope_theta=1e6,  # RoPE base (GLM-5's)
        max_position_embeddings=202752,  # longest supported sequence
        num_nextn_predict_layers=1,  # one MTP module
        tie_word_embeddings=False,  # separate LM head
        bos_token_id=0,  # HF default
        # random weights: never stop early, so every run decodes max_new_tokens (a placeholder: None, and an int
        # from the command line, --config.model.eos_token_id=7; ml_collections refuses to override a plain None)
        eos_token_id=ml_collections.config_dict.placeholder(int),
        initializer_range=0.02,  # std of random-init matrices
    ))
    c.dtype = "bfloat16"  # parameter and activation dtype: float32 | bfloat16
    c.checkpoint = ""  # HF directory (glm53.from_pretrained) or glm53 directory (glm53.load); "" = random init
    c.seed = 0  # parameter init seed
    c.cache = ml_collections.ConfigDict(dict(
        mode="resident",  # resident | offload (override with --config.cache.mode=offload)
        kv_format="q8g64",  # f32 | bf16 | q8g64 | fp8g128; q8g64 = 656 B per row
        max_len=0,  # rows per session; 0 = prompt + new tokens
        prefill_chunk=1024,  # tokens per prefill step (power of two)
        index_keys="model",  # DSA indexer keys: model (the model dtype) | fp8 (e4m3 + a scale per key)
        indexer_precision="highest",  # indexer scores: highest | bf16 | fp8 (needs index_keys=fp8)
        hot_rows=32768,  # offload: hot-cache slots per layer and session
        copyback_every=64,  # offload: rows per batched ring -> host copy
        ring_rows=0,  # offload: ring rows, at least (raised to a power of two holding a page + a chunk)
        policy="circular",  # offload: hot-slot replacement, circular (the Pallas fill) | lfu (jnp fill; glm53.policies)
    ))
    c.mesh = ml_collections.ConfigDict(dict(
        stages=1,  # pipeline stages (glm53.pipeline): each a run of layers with its weights and cache
        tp=1,  # tensor-parallel devices (glm53.sharding: heads, MLP widths, vocab split; cache replicated)
        microbatches=1,  # with stages: session groups a decode step splits into (1: bit-identical to one device)
    ))
    c.run = ml_collections.ConfigDict(dict(
        prompt_len=8192,  # random prompt tokens per session (--config.run.prompt_len=50000 for the long run)
        batch=1,  # sessions decoded together
        max_new_tokens=64,  # tokens generated per session
        temperature=0.0,  # 0 = greedy
        top_p=1.0,  # nucleus sampling mass (temperature > 0)
        seed=0,  # prompt and sampling seed
        output_json="",  # write the measured figures here (experiments/results/...)
        compare_resident=False,  # also decode with a resident cache and check tokens + logits are identical
        mtp=0,  # MTP speculative decoding depth (0-3; the model's one MTP module applied recursively)
        accept_override=-1,  # benchmarks: accept this many drafts per step whatever they are (-1: off)
    ))
    return c

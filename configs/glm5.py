"""Full-size GLM-5 (transformers ``GlmMoeDsaConfig`` defaults, HF checkpoint zai-org/GLM-5): 78 layers, 256 routed
experts, ~754B parameters by ``ModelConfig.param_count()`` (MTP module included; published: ~744B total / 40B
active). Offloaded KV history in Q8G64 rows, as in the article. Needs a multi-GPU host and a real checkpoint:
``--config.checkpoint=/path/to/GLM-5``."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=154880,  # token ids in [0, vocab_size)
        hidden_size=6144,  # residual stream width
        intermediate_size=12288,  # dense SwiGLU width (first first_k_dense_replace layers)
        moe_intermediate_size=2048,  # per-expert SwiGLU width (routed and shared experts)
        num_hidden_layers=78,  # decoder layers (MTP layer not counted)
        first_k_dense_replace=3,  # 3 leading dense-MLP layers, then 75 MoE layers
        num_attention_heads=64,  # MLA query heads (MLA has no separate KV heads)
        q_lora_rank=2048,  # query low-rank bottleneck (q_a_proj output, also the indexer's query input)
        kv_lora_rank=512,  # compressed KV latent per token: what the cache stores (with the rope key)
        qk_nope_head_dim=192,  # per-head query/key dims without RoPE
        qk_rope_head_dim=64,  # per-head query dims with RoPE; one shared 64-d rope key per token
        v_head_dim=256,  # per-head value width
        index_n_heads=32,  # DSA lightning-indexer heads
        index_head_dim=128,  # indexer query/key width (first 64 dims get RoPE)
        index_topk=2048,  # positions each query attends to (k = min(index_topk, history length))
        # Every layer runs its own indexer: the HF default when the checkpoint's config.json gives no pattern
        # (no indexer_types / index_topk_pattern, index_topk_freq 1) is all "full".
        indexer_types=("full",) * 78,
        n_routed_experts=256,  # routed experts per MoE layer
        num_experts_per_tok=8,  # routed experts chosen per token
        n_shared_experts=1,  # always-on shared expert per MoE layer
        n_group=1, topk_group=1,  # no group-limited routing (one group holding all experts)
        norm_topk_prob=True,  # normalise the chosen experts' sigmoid scores to sum to 1
        routed_scaling_factor=2.5,  # ...then scale the routed experts' weights by this
        rms_norm_eps=1e-5,  # RMSNorm epsilon of the layer norms
        rope_theta=1e6,  # RoPE base (checkpoint config)
        max_position_embeddings=202752,  # longest supported sequence (prompt + generated)
        num_nextn_predict_layers=1,  # one MTP module (checkpoint layer index 78)
        tie_word_embeddings=False,  # separate LM head
        bos_token_id=0,  # HF config default
        eos_token_id=1,  # HF config default; generation stops here
        initializer_range=0.02,  # std of random-init matrices (random init only)
    ))
    c.dtype = "bfloat16"  # parameter and activation dtype: float32 | bfloat16
    c.checkpoint = ""  # HF directory (glm53.from_pretrained) or glm53 directory (glm53.load); "" = random init
    c.seed = 0  # parameter init seed (random init only)
    c.cache = ml_collections.ConfigDict(dict(
        mode="offload",  # resident | offload: history in pinned host memory, hot rows on the accelerator
        kv_format="q8g64",  # f32 | bf16 | q8g64 | fp8g128; q8g64 = 656 B per row (the article's format)
        max_len=0,  # rows per session; 0 = prompt + new tokens
        prefill_chunk=2048,  # tokens per prefill step (power of two)
        index_keys="model",  # DSA indexer keys: model (the model dtype) | fp8 (e4m3 + a scale per key)
        indexer_precision="highest",  # indexer scores: highest | bf16 | fp8 (needs index_keys=fp8)
        hot_rows=32768,  # offload: hot-cache slots per layer and session (20.5 MiB per layer in q8g64)
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
        prompt_len=50000,  # random prompt tokens per session (the article's 50K-token sessions)
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

"""Tiny random GLM-5 checkpoints written by transformers' own ``save_pretrained`` (the parity reference)."""

import os

import numpy as np


def tiny_hf_config(**overrides):
    from transformers import GlmMoeDsaConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64,
              v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              index_topk=8, index_head_dim=128, index_n_heads=16, first_k_dense_replace=1,
              indexer_types=["full", "shared", "full", "shared"], eos_token_id=None, bos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=2048)
    kw.update(overrides)
    return GlmMoeDsaConfig(**kw)


def write_tiny_checkpoint(path, seed=0, **overrides):
    """Random float32 weights (std 0.02 is too flat to exercise routing, so matrices get larger scales and the
    router's correction bias is random), saved with transformers' save_pretrained. Returns the torch model."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(**overrides)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("k_norm.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(path)
    # torch 2.13's CPU build sometimes computes a process's first forward wrongly: in 7 of 30 fresh
    # processes the first forward of test_hf_parity's prompt differed from every later one by 1.06e-4 rel L2, its
    # rotary `cos` off by up to 1.5e-4 (a process's first `Tensor.cos` of those angles, once the intra-op threads
    # exist, had 1,440 and 1,642 of 3,584 values off in 2 of 82 processes; the calls after it were right), while
    # the second and third forwards of all 30 agreed. That alone failed test_forward_logits_match_hf's 1e-4 bound
    # in 2 of ~30 suite runs. So the reference's first forward is this throwaway one: after it, the first reference
    # forward of 30 of 30 processes matched.
    with torch.no_grad():
        model(torch.zeros((1, 8), dtype=torch.long))
    return model


def write_fp8_checkpoint(path):
    """A tiny HF checkpoint rewritten as FP8 checkpoints are published: expert and attention-output weights in
    e4m3 with ``weight_scale_inv`` per 128 x 128 block, the rest as they were."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file, save_file

    from kernels_pallas.grouped_matmul import quantize_blocks

    write_tiny_checkpoint(path, seed=2, index_topk=8)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and (".mlp.experts." in name or name.endswith("self_attn.o_proj.weight")):
            q, s = quantize_blocks(jnp.asarray(t))
            out[name] = np.asarray(q)
            out[name + "_scale_inv"] = np.asarray(s)
        else:
            out[name] = t
    save_file(out, file, metadata={"format": "pt"})
    return out


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def hf_greedy(model, ids, n):
    import torch

    x = torch.tensor([list(ids)])
    with torch.no_grad():  # an explicit mask: without one, transformers takes every pad_token_id in x for padding
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, use_cache=True)
    return out[0, len(ids):].tolist()

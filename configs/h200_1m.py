"""``configs/h200_bench.py`` (GLM-5's per-layer widths, 8 layers + MTP, 16 experts, 8.9B parameters) for histories
of a million tokens: ``max_position_embeddings`` raised past 1,048,576 (it only bounds the positions a cache may
hold; RoPE here has no scaling, so nothing else changes), offload mode, 128 new tokens.

Per session at 1,048,576 tokens (q8g64, 9 cache layers): host pool 9 x 1M x 656 B = 5.77 GiB; device 1.46 GiB
(indexer keys of 5 full-indexer layers 1.25 GiB, 32,768 hot slots x 9 layers 0.18 GiB, slot maps 0.02 GiB, ring
0.01 GiB: ``glm53.memory.session_bytes``).

    python -m experiments.sessions_1m --config=configs/h200_1m.py --sessions=8 --out=$OUT/sessions_1m.json
"""

from configs import h200_bench


def get_config():
    c = h200_bench.get_config()
    c.model.max_position_embeddings = (1 << 20) + (1 << 16)  # 1,114,112: a 1M history + new tokens + MTP rows
    c.cache.mode = "offload"
    c.run.prompt_len = 1 << 20  # 1,048,576 tokens of history per session
    c.run.max_new_tokens = 128
    return c

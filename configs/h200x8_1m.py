"""``configs/h200_1m.py`` (GLM-5's per-layer widths, 16 experts, million-token histories) at 40 layers instead of 8
(34.8B parameters), for the multi-GPU capacity run of issue 15: at least 16 concurrent 1M-token sessions with more
layers than the one-GPU run, as 8 pipeline stages, one per GPU of an 8 x H200 machine (``nvidia-h200-x8``, 560 GiB
of host RAM). Configs default to one device: pass ``--config.mesh.stages=8``.

Per session at 1,048,576 tokens (q8g64, 41 cache layers) the host pool is 41 x 1M x 656 B = 26.27 GiB. The planner
(``glm53.memory.plan``, from shapes) puts 16 sessions at 420 GiB of pinned host memory over the 8 GPUs' pools (21
sessions fit the host), and the fullest stage (layers 20-25) at 9.1 GiB of weights and 14.3 GiB of cache (12 GiB
of it indexer keys) per device. Check the plan, then run:

    python -m experiments.plan --config=configs/h200x8_1m.py --config.mesh.stages=8 --machine=h200x8 --sessions=16 \
        --history=1048576
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=... python -m experiments.sessions_1m --config=configs/h200x8_1m.py \
        --config.mesh.stages=8 --sessions=16 --out=$OUT/sessions_1m_x8.json
"""

from configs import h200_1m

_LAYERS = 40


def get_config():
    c = h200_1m.get_config()
    c.model.num_hidden_layers = _LAYERS
    c.model.indexer_types = ("full", "shared") * (_LAYERS // 2)
    return c

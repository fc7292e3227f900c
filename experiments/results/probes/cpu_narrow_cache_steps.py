"""CPU decode step time of the tiny model with bf16 / fp8 cache buffers, by session slots (stop 71).

XLA:CPU has no arithmetic below float32 and rewrote every one-row write into a bf16 cache array as a conversion of
the whole array, so a step cost the whole cache; since 8e5255c such buffers are stored as their bits
(``kernels_pallas.kv_formats.stored_dtype``). One session of a 100-token prompt in a 4,096-row cache; 4 tokens to
warm up, then 20 timed (the engine's own loop, progress bar included).

    PYTHONPATH=. python experiments/results/probes/cpu_narrow_cache_steps.py DTYPE KV_FORMAT SLOTS [INDEX_KEYS [MODE]]
    e.g. bfloat16 bf16 64            (resident)
         bfloat16 q8g64 64 model offload
"""
import sys
import time

import numpy as np

import glm53
from configs import tiny

dtype, kv_format, slots = sys.argv[1], sys.argv[2], int(sys.argv[3])
index_keys = sys.argv[4] if len(sys.argv) > 4 else "model"
mode = sys.argv[5] if len(sys.argv) > 5 else "resident"
model = glm53.from_config(glm53.ModelConfig(**tiny.get_config().model.to_dict()), seed=0, dtype=dtype, progress=False)
cache = dict(mode=mode, kv_format=kv_format, max_len=4096, index_keys=index_keys)
if mode == "offload":
    cache["hot_rows"] = 1024
engine = glm53.Engine(model, cache=glm53.CacheConfig(**cache), max_sessions=slots)
sid = engine.open(list(np.random.default_rng(0).integers(0, 512, 100)))
engine.generate({sid: 4})
t = time.perf_counter()
out = engine.generate({sid: 20})
step_ms = (time.perf_counter() - t) / 20 * 1e3
print(f"dtype={dtype} kv_format={kv_format} index_keys={index_keys} mode={mode} max_sessions={slots}: "
      f"{step_ms:.1f} ms a step; first tokens {out[sid][:6]}")

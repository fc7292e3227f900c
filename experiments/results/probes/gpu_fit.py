import time, jax, glm53
from configs import h200_bench
from glm53 import memory
c = h200_bench.get_config()
t = time.time()
m = glm53.from_config(c.model, seed=0, dtype="bfloat16", progress=False)
print("model", round(time.time() - t, 1), "s; free after weights GiB", round(memory.free_bytes(jax.local_devices()[0]) / 2**30, 1))
cc = glm53.CacheConfig.from_config_dict(c.cache)
for mode, max_len in (("resident", 52300), ("offload", 52300)):
    e = glm53.Engine(m, cc.replace(mode=mode, max_len=max_len, hot_rows=32768), max_sessions=10)
    need = e._device_need()
    print(mode, "admitted; need GiB", {k: round(v / 2**30, 2) for k, v in need.items()}, "free after build GiB", round(memory.free_bytes(jax.local_devices()[0]) / 2**30, 1))
    del e
try:
    glm53.Engine(m, cc.replace(mode="resident", max_len=52300), max_sessions=1024)
    print("huge engine built?!")
except glm53.AdmissionError as err:
    print("huge engine refused:", str(err)[:300])

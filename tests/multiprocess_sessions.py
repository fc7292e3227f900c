"""A session's life on a mesh spanning several processes (run by tests/test_distributed.py through
experiments.launch): open, generate, save mid-stream, keep generating; then a fresh engine restores the save and
continues. Every process runs this same script; process 0 writes what each engine produced as JSON.

    python -m experiments.launch --processes=2 --devices_per_process=1 -- \
        python tests/multiprocess_sessions.py OUT DIR MODE
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # engine_common, and glm53 where it is not installed

from glm53 import distributed  # noqa: E402
from multiprocess_compile import share_compilations  # noqa: E402

distributed.initialize()
share_compilations()

import numpy as np  # noqa: E402

import glm53  # noqa: E402
from engine_common import MESH_CFG  # noqa: E402


def main(out: str, directory: str, mode: str) -> None:
    cc = glm53.CacheConfig(mode=mode, kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64, max_len=192)
    tp = len(__import__("jax").devices())
    model = glm53.from_config(MESH_CFG, seed=0, dtype="float32", cache_config=cc,
                              mesh=None if tp == 1 else glm53.MeshConfig(tp=tp))
    rng = np.random.default_rng(0)
    e = glm53.Engine(model, max_sessions=2)
    a, b = e.open(rng.integers(0, 256, 37).tolist()), e.open(rng.integers(0, 256, 22).tolist())
    first = e.generate({a: 5, b: 3})
    e.append(a, rng.integers(0, 256, 21).tolist())
    path = e.save(a, directory)
    rest = e.generate({a: 6, b: 4})
    # as many slots as the first engine: the same shapes, so its compiled steps serve this one too
    r = glm53.Engine(model, max_sessions=2)
    got = r.restore(directory)
    restored = r.generate({got: 6})
    # A save process 0 cannot write (its directory is a file): every process raises, none waits forever.
    blocked = os.path.join(os.path.dirname(out), "not-a-directory")
    if distributed.is_writer():
        open(blocked, "w").close()
    try:
        e.save(b, blocked)
        failed = None
    except Exception as err:  # noqa: BLE001 -- the type is what the test checks
        failed = type(err).__name__
    # A save one process cannot read (process 1's copy is gone, as on a host without the shared file system):
    # every process refuses the restore, none waits forever.
    me = __import__("jax").process_index()
    e.save(b, os.path.join(os.path.dirname(out), f"only-p0-{me}"))  # a directory per process: process 0's is real
    try:
        glm53.Engine(model, max_sessions=1).restore(os.path.join(os.path.dirname(out), f"only-p0-{me}"))
        unreadable = None
    except Exception as err:  # noqa: BLE001 -- the type is what the test checks
        unreadable = type(err).__name__
    with open(f"{out}.p{me}", "w") as f:
        json.dump({"failed_save": failed, "failed_restore": unreadable, "after": e.generate({b: 2})[b]}, f)
    if distributed.is_writer():
        with open(out, "w") as f:
            json.dump({"processes": __import__("jax").process_count(), "devices": tp, "saved": path,
                       "first": {str(k): v for k, v in first.items()}, "rest": {str(k): v for k, v in rest.items()},
                       "restored": restored[got], "a": a}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])

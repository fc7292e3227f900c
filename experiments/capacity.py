"""Capacity accounting from a config: the article's MLA figures reproduced, what they left out, and how many
sessions of a history fit a machine.

    python -m experiments.capacity --config=configs/glm5.py
    python -m experiments.capacity --config=configs/glm5.py --history=50000,1048576 --machine=h200x8 --out=cap.json

1. **The article's table** (``glm53.memory.article_figures``): 656 B rows (q8g64), the 78 main-model layers, the
   owner and peer replicas, 2,048 selected rows, 32,768 hot rows, 15 sessions; each figure beside the article's.
2. **One session in glm53, by part** (``glm53.memory.session_bytes``: one slot of the engine's cache, what
   ``Engine.memory_report()`` counts): host history over every cache layer (the MTP layer too) with page rounding,
   the device's indexer keys (model dtype and FP8), slot maps, ring, hot cache and tables, and the transient bulk
   read; at each ``--history``.
3. **Sessions that fit** ``--machine`` (a preset, or ``custom`` with ``--devices --device_gib --host_gib``;
   ``glm53.memory.plan``, as ``experiments.plan``): per device and per host.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from absl import app, flags

from experiments import cli
import glm53
from glm53 import memory
from glm53.params import resolve_dtype
from glm53.provenance import provenance

# The article's figures as printed (kv-offload-article.md), in the units it prints them.
ARTICLE = [(656, "B"), (31.281, "MiB"), (4.765, "GiB"), (1.28125, "MiB"), (20.5, "MiB"), (99.94, "GiB"),
           (1499.06, "GiB"), (46.85, "GiB")]

FLAGS = flags.FLAGS
cli.define_config("configs/glm5.py", "experiment config (model, cache)")
flags.DEFINE_list("history", ["50000", "1048576"], "history lengths for the per-session table")
flags.DEFINE_enum("machine", "article", list(memory.MACHINES) + ["custom"],
                  "machine for the sessions-that-fit table (custom: the three flags below)")
flags.DEFINE_integer("devices", 0, "--machine=custom: devices (the tp mesh)")
flags.DEFINE_float("device_gib", 0.0, "--machine=custom: GiB per device")
flags.DEFINE_float("host_gib", 0.0, "--machine=custom: GiB of host memory per host (all devices on one host)")
flags.DEFINE_integer("sessions", 15, "sessions for the fit table", lower_bound=1)
flags.DEFINE_string("out", "", "write the tables as JSON here")


def decimals(x: float) -> int:
    s = f"{x}"
    return len(s.split(".")[1]) if "." in s else 0


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=True)  # its config: the shapes counted are the checkpoint's
    cli.refuse_unread_overrides(
        ("model", "dtype", "checkpoint") + cli.cache_fields_but(c, "max_len"),
        "experiments.capacity counts config.model (or the checkpoint's), dtype and cache but its max_len: the rows "
        "come from --history, the sessions from --sessions and the devices from --machine (tensor parallel over them: "
        "plan stages with experiments.plan)")
    cfg = cli.model_config(c)
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    cli.refuse_an_unrunnable_cache(cfg, cc)  # what Engine refuses is no engine to count
    hs = cli.token_counts("history", FLAGS.history)
    if FLAGS.machine == "custom" and (FLAGS.devices < 1 or FLAGS.device_gib <= 0 or FLAGS.host_gib <= 0):
        raise app.UsageError("--machine=custom needs --devices, --device_gib and --host_gib")  # before any table
    dtype = resolve_dtype(c.dtype)
    out = {"config": c.to_dict(), **provenance()}  # the git revision, the command, the environment

    print(f"1. The article's MLA payload ({cc.kv_format} rows, {cfg.num_hidden_layers} main-model layers, owner + "
          "peer replicas; MLA only)")
    figs = memory.article_figures(cfg, cc, sessions=FLAGS.sessions)
    for f, (want, unit) in zip(figs, ARTICLE):
        got = round(f["value"], decimals(want))
        f["article"], f["matches_article"] = want, got == want and unit == f["unit"]
        print(f"   {f['what']:<72} {f['value']:>14,.5f} {f['unit']:<4} article {want:>10,} {unit:<4} "
              f"{'=' if f['matches_article'] else 'DIFFERS'}")
    out["article"] = figs

    print("\n2. One session in glm53 (one replica), by part")
    out["session"] = {}
    for h in hs:
        parts = memory.session_bytes(cfg, cc, h, dtype)
        fp8 = memory.session_bytes(cfg, cc.replace(index_keys="fp8"), h, dtype)
        parts["index_keys_fp8"] = fp8["device"]["index_keys"] + fp8["device"].get("index_key_scale", 0)
        out["session"][str(h)] = parts
        dev, host = parts["device"], parts["host"]
        print(f"   history {h:,} (capacity {parts['capacity']:,} rows): device {sum(dev.values()) / 2**30:.3f} GiB, "
              f"host {sum(host.values()) / 2**30:.3f} GiB, transient {parts['transient'] / 2**20:.1f} MiB")
        for side, d in (("device", dev), ("host", host)):
            for k, v in sorted(d.items(), key=lambda kv: -kv[1]):
                if v:
                    print(f"      {side:<6} {k:<20} {v / 2**20:>12,.2f} MiB")
        print(f"      (device index keys with index_keys=fp8: {parts['index_keys_fp8'] / 2**20:,.2f} MiB)")

    if FLAGS.machine == "custom":
        if FLAGS.devices < 1 or FLAGS.device_gib <= 0 or FLAGS.host_gib <= 0:
            raise app.UsageError("--machine=custom needs --devices, --device_gib and --host_gib")
        devices, device_gib, host_gib, per_host = FLAGS.devices, FLAGS.device_gib, FLAGS.host_gib, FLAGS.devices
    else:
        devices, device_gib, host_gib, per_host = memory.MACHINES[FLAGS.machine]
    print(f"\n3. {FLAGS.sessions} sessions on {FLAGS.machine}: {devices} devices x {device_gib} GiB, {host_gib} GiB per "
          f"host, {per_host} devices per host (tensor parallel; experiments.plan has the details)")
    try:
        memory.machine_mesh(cfg, None, devices)
    except glm53.ConfigError as e:
        if FLAGS.machine == "custom":  # asked for by hand: a mistake to name
            sys.exit(f"experiments.capacity: {e}")
        # a shipped machine too wide for a small model (configs/tiny.py's 4 heads on 16 devices): sections 1 and 2
        # stand; the table is not made for a layout no engine could run
        print(f"   not planned: {e} (--machine=custom sets another machine)")
        out["fit"] = {"not_planned": str(e)}
        hs = []
    else:
        out["fit"] = []
    for h in hs:
        p = memory.plan(cfg, cc, sessions=FLAGS.sessions, history=h, dtype=dtype, mesh_shape={"stage": 1, "tp": devices},
                        device_bytes=int(device_gib * 2**30), host_bytes=int(host_gib * 2**30),
                        devices_per_host=per_host)
        out["fit"].append(p)
        print(f"   history {h:>9,}: per device {p['per_device']['total'] / 2**30:,.1f} GiB (fits {p['fits_device']}, "
              f"at most {p['max_sessions_by_device']} sessions); "
              + (f"per host {p['per_host']['total'] / 2**30:,.1f} GiB (fits {p['fits_host']}, at most "
                 f"{p['max_sessions_by_host']})" if "fits_host" in p else "no host pool (resident: the history stays "
                 "on the devices)"))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=2, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)

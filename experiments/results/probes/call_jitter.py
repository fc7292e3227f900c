"""Probe: what the slow step calls of a 10 x 50K MTP 3 run are doing, on the host.

The 10-session A/B's step-call p99 / median at MTP 3 is set by slow calls in both modes, resident more than offload
(sessions_ab_10x50k_mtp3_series_2048_d4f22e4.json: 1.8-2.6, many in clusters of consecutive calls), while the step
interval stays near the device's pace. For every verify call this records, beside its wall time, the calling
thread's CPU time (``time.thread_time``) and its voluntary and involuntary context switches (``getrusage`` of the
thread): a slow call whose CPU time is slow too did more work or ran slower (frequency, caches, a sibling thread);
one whose CPU time is at the median waited (a lock, the driver's launch queue: voluntary switches) or was preempted
(involuntary switches). Per run it also reads the machine's steal and iowait time (``/proc/stat``) and load.

Variants, interleaved (PROBE_VARIANTS): ``default`` (the engine as it is: blocking reads before dde4f65, polling ones
on a GPU since, ``Engine.spin_reads``); ``blocking``; ``spin`` (the read of each step's outputs polls ``is_ready``
instead of blocking, so the dispatching thread never sleeps between calls: a host whose cores drop into idle states
or whose hypervisor deschedules an idle vCPU would show it here; before dde4f65 the probe's own polling read);
``lag1`` (one step in flight, not ``_Run.LAG`` 2: the device's queue holds one step less when a call launches its
graphs); ``sync`` (none in flight: each step read before the next is dispatched, so a call never launches behind
queued work; slower, a diagnosis only); ``pinned`` (the default with the dispatching thread held on the one core it
started the run on: the slow calls of the 6e25b47 A/B come in regimes of tens of consecutive calls, the window
median moving between ~0.85 and ~1.3 ms in both modes, as a thread moved to a slower or busier core would; each
call's core is recorded in every variant, ``calls_cpu_core``, read after the call from /proc/thread-self/stat);
``nocanary`` (the default without the canary below: whether the canary's own work around each call changes the
tail); ``sleep_poll`` (the default with the engine's polls pausing as they did until stop 54, ``time.sleep(0)``,
which sleeps for the timer slack at every poll, instead of ``os.sched_yield``, which keeps the core).
Each call's kernel (system) time and minor page faults are recorded too (``calls_system_ms``,
``calls_minor_faults``; from stop 54): a slow call whose extra time is kernel time touching freshly mapped memory
would show faults, and a process started with glibc's malloc held from returning memory (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, recorded in ``machine.malloc_env``) would lose them. And a canary: a fixed piece of
pure-Python work timed just before and just after every call (``calls_canary_us``), which says whether the core was
slow then, whatever the call did.

PROBE_HISTORY (50000), PROBE_NEW (2048), PROBE_REPS (3), PROBE_MODE (offload), PROBE_MTP (3, drafts forced),
PROBE_CONFIG (h200_bench), PROBE_RING (the engine's default; a CPU's is 1, no ring, and only ring calls are measured).
"""
import importlib
import json
import os
import platform
import resource
import sys
import time

import jax
import numpy as np

import glm53
from glm53 import engine as eng
from glm53 import roofline
from experiments import sessions_ab, workloads


def machine_facts() -> dict:
    facts = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "platform": platform.platform()}
    for name, path in [("numa_balancing", "/proc/sys/kernel/numa_balancing"),
                       ("thp", "/sys/kernel/mm/transparent_hugepage/enabled"),
                       ("governor", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
                       ("loadavg", "/proc/loadavg")]:
        try:
            facts[name] = open(path).read().strip()
        except OSError as err:
            facts[name] = f"unreadable: {err.strerror}"
    try:
        facts["numa_nodes"] = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")])
    except OSError:
        pass
    return facts


def cpu_times() -> np.ndarray:
    """The machine's cpu line of /proc/stat: user nice system idle iowait irq softirq steal (jiffies)."""
    return np.array(open("/proc/stat").readline().split()[1:9], np.int64)


STATE = {"wall": [], "cpu": [], "vol": [], "invol": [], "core": [], "sys": [], "minflt": [], "majflt": [], "canary": []}


def canary() -> float:
    """Seconds of a fixed piece of pure-Python work (~40 us; ``measure_host_speed_spread``'s unit): how fast this
    thread's core runs user code just now, whatever the engine does. Slow calls whose canary is slow too ran on a
    slowed core (its clock, a busy sibling hyperthread, the hypervisor); a canary at its median beside a slow call
    says the call itself did more."""
    return roofline._timed(roofline._python_work, 1000)


def current_core() -> int:
    """The core the calling thread last ran on (field 39 of its stat line; the name field may hold spaces)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])
ring_call = eng._StepRing.__call__


CANARY = {"on": True}


def measured_call(self, name, args, static):
    before = canary() if CANARY["on"] else 0.0
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time(), time.perf_counter()
    out = ring_call(self, name, args, static)
    t1, c1, r1 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
    if name in ("decode", "verify"):
        STATE["wall"].append(t1 - t0)
        STATE["cpu"].append(c1 - c0)
        STATE["vol"].append(r1.ru_nvcsw - r0.ru_nvcsw)
        STATE["invol"].append(r1.ru_nivcsw - r0.ru_nivcsw)
        STATE["core"].append(current_core())
        STATE["sys"].append(r1.ru_stime - r0.ru_stime)
        STATE["minflt"].append(r1.ru_minflt - r0.ru_minflt)
        STATE["majflt"].append(r1.ru_majflt - r0.ru_majflt)
        # the slower of the two, just before and just after
        STATE["canary"].append(max(before, canary()) if CANARY["on"] else 0.0)
    return out


eng._StepRing.__call__ = measured_call
POLL_PAUSE = getattr(eng, "_poll_pause", None)  # None: an engine before stop 54, whose polls slept
plain_read = eng._Run._read
LAG = eng._Run.LAG


def spin_read(self, x):
    if hasattr(x, "is_ready"):
        while not x.is_ready():
            pass
    return plain_read(self, x)


def main():
    hist = int(os.environ.get("PROBE_HISTORY", "50000"))
    new = int(os.environ.get("PROBE_NEW", "2048"))
    mtp = int(os.environ.get("PROBE_MTP", "3"))
    S = 10
    c = importlib.import_module("configs." + os.environ.get("PROBE_CONFIG", "h200_bench")).get_config()
    c.run.prompt_len = hist
    c.cache.mode = os.environ.get("PROBE_MODE", "offload")
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    cc = cc.replace(max_len=hist + 16 + new + 64)
    K = min(model.config.index_topk, cc.max_len)
    e, sids, fig = sessions_ab.build(model, cc, c, S, suffix=16)
    if os.environ.get("PROBE_RING"):  # a CPU engine has no ring by default, and only ring calls are measured
        e.output_ring = int(os.environ["PROBE_RING"])
    print(f"prefill {fig['prefill_s']:.1f} s, ring {e.output_ring}", flush=True)
    selections = workloads.Selections("local99", K, hist, S)
    facts = machine_facts()
    facts["malloc_env"] = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    print(json.dumps(facts), flush=True)
    results, digests = [], {}
    variants = os.environ.get("PROBE_VARIANTS", "default,spin,lag1,sync").split(",")
    reps = int(os.environ.get("PROBE_REPS", "3"))
    runs = [("warmup", "default"), ("warmup_after_rollback", "default")]
    runs += [(k, v) for k in range(reps) for v in variants]
    path = os.path.join(os.environ.get("OUT", "/tmp"), sys.argv[1] if len(sys.argv) > 1 else "call_jitter.json")
    engine_spins = getattr(e, "spin_reads", None)  # None: an engine before dde4f65, which always blocked
    for rep, v in runs:
        if engine_spins is None:
            eng._Run._read = spin_read if v == "spin" else plain_read
        else:
            e.spin_reads = {"blocking": False, "spin": True}.get(v, engine_spins)
        eng._Run.LAG = {"lag1": 1, "sync": 0}.get(v, LAG)
        CANARY["on"] = v != "nocanary"
        if POLL_PAUSE is not None:
            eng._poll_pause = (lambda: time.sleep(0)) if v == "sleep_poll" else POLL_PAUSE
        for k in STATE:
            STATE[k].clear()
        allowed = os.sched_getaffinity(0)  # pid 0: this thread alone
        if v == "pinned":
            os.sched_setaffinity(0, {current_core()})
        stat0, t0 = cpu_times(), time.perf_counter()
        out = e.generate({s: new for s in sids}, selection_override=selections(7), mtp=mtp,
                         accept_override=mtp if mtp else None)
        wall, stat1 = time.perf_counter() - t0, cpu_times()
        os.sched_setaffinity(0, allowed)
        r = e.last_run
        for s in sids:
            e.rollback(s, len(out[s]))
        digest = hash(tuple(tuple(out[s]) for s in sids))
        if rep != "warmup":  # the first warm-up starts from the prefill's hidden states, the others after a rollback
            digests.setdefault("tokens", digest)
        w, cpu = np.asarray(STATE["wall"]) * 1e3, np.asarray(STATE["cpu"]) * 1e3
        vol, invol, core = np.asarray(STATE["vol"]), np.asarray(STATE["invol"]), np.asarray(STATE["core"])
        sys_ms, minflt = np.asarray(STATE["sys"]) * 1e3, np.asarray(STATE["minflt"])
        can = np.asarray(STATE["canary"]) * 1e6
        med = np.median(w)
        slow = w > 1.25 * med
        d = (stat1 - stat0).astype(float)
        total = max(d.sum(), 1.0)
        res = {
            "run": rep, "variant": v, "lag": eng._Run.LAG,
            "spin_reads": v == "spin" if engine_spins is None else e.spin_reads,
            "tokens_per_s": r.decode_tokens_per_s, "wall_s": wall,
            "tokens_identical_to_first_timed": digests.get("tokens") == digest if rep != "warmup" else None,
            # (the second warm-up compiles the plain decode step a rolled-back session's MTP loop starts with)
            "calls": len(w), "call_p50_ms": float(med), "call_p99_ms": float(np.percentile(w, 99)),
            "call_p99_over_median": float(np.percentile(w, 99) / med), "slow_calls": int(slow.sum()),
            "cpu_p50_ms": float(np.median(cpu)),
            "slow_calls_cpu_over_wall": float(cpu[slow].sum() / max(w[slow].sum(), 1e-9)) if slow.any() else None,
            "other_calls_cpu_over_wall": float(cpu[~slow].sum() / w[~slow].sum()),
            "slow_calls_voluntary_switches": float(vol[slow].mean()) if slow.any() else None,
            "other_calls_voluntary_switches": float(vol[~slow].mean()),
            "slow_calls_involuntary_switches": float(invol[slow].mean()) if slow.any() else None,
            "other_calls_involuntary_switches": float(invol[~slow].mean()),
            # kernel time and page faults: a slow call busy in the kernel (first touches of freshly mapped host
            # memory, the driver's ioctls) rather than in user code
            "slow_calls_system_ms": float(sys_ms[slow].mean()) if slow.any() else None,
            "other_calls_system_ms": float(sys_ms[~slow].mean()),
            "slow_calls_minor_faults": float(minflt[slow].mean()) if slow.any() else None,
            "other_calls_minor_faults": float(minflt[~slow].mean()),
            "major_faults": int(np.sum(STATE["majflt"])),
            "canary": CANARY["on"],
            "canary_p50_us": float(np.median(can)),
            "slow_calls_canary_over_median": (float(np.median(can[slow]) / np.median(can))
                                              if slow.any() and CANARY["on"] else None),
            "canary_slow_when_call_slow": float(np.mean(can[slow] > 1.25 * np.median(can))) if slow.any() else None,
            "canary_slow_when_call_not": float(np.mean(can[~slow] > 1.25 * np.median(can))),
            "call_canary_correlation": float(np.corrcoef(w, can)[0, 1]) if CANARY["on"] else None,
            "cores_used": len(set(core.tolist())), "core_changes": int((np.diff(core) != 0).sum()),
            "slow_calls_after_a_core_change": int((slow[1:] & (np.diff(core) != 0)).sum()),
            "step_interval_ms": r.step_interval_ms, "step_wait_ms": r.step_wait_ms,
            "machine_pct": {k: round(100 * d[i] / total, 3) for i, k in
                            enumerate(["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"])},
            "loadavg": open("/proc/loadavg").read().strip(),
            "calls_ms": [round(float(x), 3) for x in w], "calls_cpu_ms": [round(float(x), 3) for x in cpu],
            "calls_voluntary": vol.tolist(), "calls_involuntary": invol.tolist(), "calls_cpu_core": core.tolist(),
            "calls_system_ms": [round(float(x), 3) for x in sys_ms], "calls_minor_faults": minflt.tolist(),
            "calls_canary_us": [round(float(x), 2) for x in can],
        }
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if not k.startswith("calls_")}), flush=True)
        with open(path, "w") as f:  # after every run: a call cut by its time limit keeps the runs it finished
            json.dump({"machine": facts, "history": hist, "new_tokens": new, "mtp": mtp, "sessions": S,
                       "mode": c.cache.mode, "revision": os.environ.get("GLM53_GIT_REVISION"), "runs": results}, f)


if __name__ == "__main__":
    main()

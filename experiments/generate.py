"""Decode random prompts with a GLM-5 model and report the speeds (the main job of the framework).

    python -m experiments.generate                 # configs/tiny.py: a tiny random model, seconds on a laptop CPU
    python -m experiments.generate --config=configs/tiny.py --config.run.prompt_len=500
    python -m experiments.generate --config=configs/h200_bench.py --config.run.output_json=experiments/results/x.json

An untimed warm-up generate with the same shapes runs first, so jit compilation is not timed.

The JSON's ``roofline`` entry (``--roofline``, on by default; ``glm53.roofline``): the HBM bandwidth measured at the
start of the run (a jitted copy / read loop, before any engine exists), the bytes a decode step reads for this
config, history (the prompt plus half the new tokens: the mean over the timed decode) and batch, by part (weights
with the routed experts the batch really uses, KV rows gathered, indexer keys scored; offload: misses from host
memory apart, at the run's measured miss rate), and the ideal vs achieved step time and their ratio. Routed experts
(``--routing``): ``auto`` is exact without any device work for one token per step (it routes to
``num_experts_per_tok`` distinct experts) and otherwise runs ``--probe_tokens`` more tokens through an instrumented
decode step that reports the model's expert choices (one extra compile); ``uniform`` uses the uniform-routing
expectation (labelled as such); ``probe`` always probes.

XLA options for the engine's steps (``--compiler_options=name=value,...``), and their A/B in one process
(``--baseline_compiler_options=...``, '' for none): two processes autotune their GEMMs apart and their greedy
tokens part within tens of tokens, so only a same-process pair can check that an option leaves the outputs alone.
An option that needs a process-wide setting as well (``xla_gpu_command_buffer_update_mode=SKIP_TEMP`` needs the VMM
allocator, which only ``XLA_FLAGS`` selects) then runs both sides on that setting (resident only: the offload
engine's pinned host pool segfaults under the VMM allocator, probes/sessions_ab_skip_temp_segfault_902d246.log):

    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP python -m experiments.generate \
        --config=configs/h200_bench.py --compiler_options=xla_gpu_command_buffer_update_mode=SKIP_TEMP \
        --baseline_compiler_options=xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE
"""

import json
import os
import time

import jax
import numpy as np
from absl import flags

from experiments import cli
import glm53
from glm53 import distributed, offload, roofline
from glm53.provenance import provenance

_CONFIG = cli.define_config("configs/tiny.py", "experiment config (configs/*.py); the default, a tiny random model, "
                            "runs on a laptop CPU in under a minute", lock_config=True)
_ROOFLINE = flags.DEFINE_bool("roofline", True, "measure the HBM bandwidth and report the decode roofline")
_ROUTING = flags.DEFINE_enum("routing", "auto", ["auto", "probe", "uniform"],
                             "routed experts for the roofline: auto (exact for one token per step, else probe), "
                             "probe (the model's routing, one instrumented decode), uniform (the expectation)")
_PROBE_TOKENS = flags.DEFINE_integer("probe_tokens", 4, "tokens per session of the routing probe", lower_bound=1)
_EXPERT_WEIGHTS = flags.DEFINE_enum("expert_weights", "model", ["model", "fp8"],
                                    "routed experts in the model dtype, or kept in FP8 on the device (block-scaled "
                                    "e4m3, dequantised in the grouped matmul): fewer bytes per decode step")
_COMPARE_ONE_DEVICE = flags.DEFINE_integer(
    "compare_one_device", 0, "with a mesh (config.mesh): also generate this many tokens with the same weights on one "
    "device and on the mesh (an untimed run each) and compare tokens and logits: bit-identical for stage-only layouts, "
    "within 1e-5 relative in float32 with tp > 1 (split reductions sum in another order); the one-device copy of the "
    "weights needs room on the first device beside its share of the mesh's")
_COMPILER_OPTIONS = flags.DEFINE_list(
    "compiler_options", [], "XLA options the engine's steps compile with, name=value (glm53.Engine's "
    "compiler_options), e.g. xla_gpu_command_buffer_update_mode=SKIP_TEMP")
_BASELINE_COMPILER_OPTIONS = flags.DEFINE_list(
    "baseline_compiler_options", None, "also run the same generate with these step options instead (name=value; "
    "'' for none) in this process, compare tokens and logits and report both speeds: an A/B of XLA options with the "
    "same autotuned GEMMs (two processes pick their own, and their greedy tokens part)")
_BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 0, "array size of the bandwidth benchmark (0: 1 GiB on "
                                      "accelerators, 64 MiB on a CPU)", lower_bound=0)


def parse_options(items) -> dict:
    """``name=value`` strings as XLA compiler options: true / false as bools, integers and floats as numbers."""
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--compiler_options: {item!r} is not name=value")
        value = value.strip()
        if value.lower() in ("true", "false"):
            out[name.strip()] = value.lower() == "true"
            continue
        for kind in (int, float):
            try:
                out[name.strip()] = kind(value)
                break
            except ValueError:
                pass
        else:
            out[name.strip()] = value
    return out


def build_model(config, expert_weights: str = "model", one_device: bool = False) -> glm53.Model:
    cache_config = glm53.CacheConfig.from_config_dict(config.cache)
    path = config.checkpoint
    # --config.mesh.tp=4: parameters split over 4 devices (glm53.sharding); one_device: the config's mesh ignored
    mesh = None if one_device else config.get("mesh")
    if not path:
        return glm53.from_config(config.model, config.seed, dtype=config.dtype, cache_config=cache_config, mesh=mesh,
                                 expert_weights=expert_weights)
    if os.path.exists(os.path.join(path, "glm53.json")):
        model = glm53.load(path, dtype=config.dtype, mesh=mesh)
        if model.expert_weights != expert_weights:
            raise glm53.ConfigError(f"--expert_weights={expert_weights}: {path} holds its experts as "
                                    f"{model.expert_weights!r} (a glm53 checkpoint keeps what it was saved with)")
        model.cache_config = cache_config
        return model
    return glm53.from_pretrained(path, dtype=config.dtype, cache_config=cache_config, mesh=mesh,
                                 expert_weights=expert_weights)


def check_run(config, given: dict | None = None) -> None:
    """The run's settings against each other and the model's config, before the model is built (initialising or
    reading its weights takes a while): a mistake is a one-line error naming the flag. ``given``: the overrides the
    command line set (``cli.overrides()``)."""
    problem = cli.checkpoint_problem(config, given or {}, reads_checkpoint=True)
    if problem:
        raise glm53.ConfigError(problem)
    cli.check_run_settings(config)
    run, cfg = config.run, cli.model_config(config)
    need = run.prompt_len + run.max_new_tokens + run.mtp
    cache = glm53.CacheConfig.from_config_dict(config.cache)
    if cache.max_len and cache.max_len < need:
        raise glm53.ConfigError(f"--config.cache.max_len={cache.max_len} rows cannot hold the {need} positions the "
                                f"run writes (prompt_len {run.prompt_len} + max_new_tokens {run.max_new_tokens} + mtp "
                                f"{run.mtp}); raise it, or set 0 to size the cache to the run")
    if cache.mode == "offload":
        offload.validate(cfg, cache)
    problem = cli.output_problem(run.output_json, "config.run.output_json")  # found out now, not after the run
    if problem:
        raise glm53.ConfigError(problem)


def figures(result: glm53.GenerateResult) -> dict:
    return {"time_to_first_token_s": result.time_to_first_token_s, "prefill_tokens_per_s": result.prefill_tokens_per_s,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "decode_tokens_per_s_per_session": result.decode_tokens_per_s_per_session,
            "compile_s": result.compile_s, "mtp": result.mtp, "mtp_acceptance": result.mtp_acceptance,
            **host_pace(result)}


def compared(result: glm53.GenerateResult, baseline: glm53.GenerateResult) -> dict:
    """Outputs and decode speed of ``result`` against a baseline run of the same inputs (both with logits)."""
    return {"tokens_identical": result.tokens == baseline.tokens,
            "logits_bit_identical": bool(np.array_equal(result.logits, baseline.logits)),
            "decode_ratio": result.decode_tokens_per_s / baseline.decode_tokens_per_s}


def host_pace(result: glm53.GenerateResult) -> dict:
    """Whether the host or the device set the decode's pace: reads that barely wait for the device, step calls near
    the step interval, mean the device waited for the host (at batch 1 on the H200 the step calls take 2.0-2.7 ms
    of a ~3.4 ms step: generate_{8k,50k}_1024_2a6c374.json)."""
    names = ("decode_host_loop_s", "decode_step_calls_s", "decode_step_call_ms", "decode_step_interval_ms",
             "decode_step_wait_ms")
    return {name: getattr(result, name) for name in names}


def compare_one_device(config, model, prompts, kw: dict, capacity: int, tokens: int) -> dict:
    """``tokens`` new tokens per prompt on the model's mesh and on one device (the same weights, built again without
    the mesh), untimed, logits returned: what a layout changes in the outputs."""
    mc = glm53.MeshConfig.from_config_dict(config.get("mesh"))
    cache = model.cache_config.replace(max_len=max(capacity, max(map(len, prompts)) + tokens + kw["mtp"]))
    on_mesh = glm53.generate(model, prompts, max_new_tokens=tokens, cache=cache, return_logits=True, **kw)
    one = build_model(config, model.expert_weights, one_device=True)
    base = glm53.generate(one, prompts, max_new_tokens=tokens, cache=cache, return_logits=True, **kw)
    del one
    exact = mc.tp == 1 and mc.microbatches == 1
    err = float(np.abs(on_mesh.logits - base.logits).max() / max(float(np.abs(base.logits).max()), 1e-30))
    # The 1e-5 bound holds for float32 rows of a float32 model; quantised or bf16 rows turn a split reduction's
    # last-bit difference into a whole rounding step of the row (README: 1.7e-3 with q8g64 rows and tp=4).
    float32_rows = np.dtype(model.dtype) == np.float32 and cache.kv_format == "f32"
    if exact:
        expected = "bit-identical (stages only)"
    elif float32_rows:
        expected = ("identical tokens; logits within 1e-5 relative (float32 rows; tp > 1 or micro-batches: matmuls "
                    "of other shapes or split reductions round differently)")
    else:
        expected = (f"identical tokens; logits not bit-identical and not within 1e-5: a split reduction's last-bit "
                    f"difference can move a stored {cache.kv_format} row by a whole rounding step (model "
                    f"{np.dtype(model.dtype).name})")
    out = {"mesh": {"stages": mc.stages, "tp": mc.tp, "microbatches": mc.microbatches}, "tokens": tokens,
           "cache_mode": cache.mode, "kv_format": cache.kv_format, "tokens_identical": on_mesh.tokens == base.tokens,
           "logits_bit_identical": bool(np.array_equal(on_mesh.logits, base.logits)), "logits_max_rel_err": err,
           "expected": expected}
    out["as_expected"] = bool(out["tokens_identical"] and (out["logits_bit_identical"] if exact else
                                                           err < 1e-5 if float32_rows else True))
    print(f"mesh {mc.stages} x {mc.tp} vs one device ({tokens} tokens, {cache.mode}): tokens identical "
          f"{out['tokens_identical']}, logits bit-identical {out['logits_bit_identical']}, max relative error "
          f"{err:.2e}; expected {out['expected']}: {'as expected' if out['as_expected'] else 'NOT as expected'}",
          flush=True)
    return out


def print_cache_stats(stats: dict, main_layers: int, indent: str = "  ") -> None:
    """Scalars as ``name: value``; per-layer sequences (also inside nested dicts) as one table row per layer (cache
    layers past the ``main_layers`` are the MTP module's, labelled so)."""
    per_layer = {k: v for k, v in stats.items() if not isinstance(v, (dict, str)) and np.ndim(v) >= 1}
    for k, v in stats.items():
        if isinstance(v, dict):
            print(f"{indent}{k}:")
            print_cache_stats(v, main_layers, indent + "  ")
        elif k not in per_layer:
            print(f"{indent}{k}: {cli.readable(v)}")
    if per_layer:
        names = list(per_layer)
        width = max(10, *(len(k) for k in names))
        print(f"{indent}layer " + " ".join(f"{k:>{width}}" for k in names))
        for l in range(max(len(v) for v in per_layer.values())):
            cells = []
            for k in names:
                x = per_layer[k][l] if l < len(per_layer[k]) else ""
                cells.append(f"{x:.4f}" if isinstance(x, float) else "-" if x is None else str(x))
            label = str(l) if l < main_layers else "mtp" if l == main_layers else f"mtp{l - main_layers}"
            print(f"{indent}{label:>5} " + " ".join(f"{c:>{width}}" for c in cells))


def routing_of(model, engine, run, mtp: int, kw: dict) -> tuple:
    """Routed experts per main MoE layer (and per MTP draft) for the roofline of the timed ``run`` (a
    ``RunReport``): ``(routed, mtp_routed, source, probe_info)``; ``routed`` None means the uniform expectation
    (exact for one token per step). A probe generates on ``engine`` (its sessions are left changed)."""
    batch = len(run.sids)
    one_token = batch * (mtp + 1) == 1
    want = _ROUTING.value
    if want == "uniform" or (want == "auto" and one_token):
        return None, None, None, None
    if jax.process_count() > 1:  # the probe's host callbacks would run in every process: not built for that
        return None, None, None, {"error": "several processes: uniform-routing expectation"}
    if engine.pipeline is not None:  # before the rollback below: the probe cannot run on stages (probe_routing)
        return None, None, None, {"error": "pipeline stages: the routing probe instruments whole-model steps; "
                                           "uniform-routing expectation"}
    t = time.perf_counter()
    try:
        # The timed run's last n tokens again (rolled back, then regenerated: the same tokens, the same routing;
        # the slots hold no rows beyond the timed run's).
        n = max(1, min(_PROBE_TOKENS.value, min(len(v) for v in run.tokens.values())))
        for sid in run.sids:
            engine.rollback(sid, n)
        probe = roofline.probe_routing(engine, {sid: n for sid in run.sids}, rollback=False, **kw)
        d = roofline.distinct_experts(probe, model.config)
    except Exception as err:  # noqa: BLE001 - the roofline falls back to the uniform expectation
        print(f"routing probe failed ({type(err).__name__}: {err}): uniform-routing expectation instead", flush=True)
        return None, None, None, {"error": f"{type(err).__name__}: {err}"}
    info = {"steps": probe["steps"], "bucket": probe["bucket"], "seconds": time.perf_counter() - t,
            "per_layer": d["per_layer"], "mtp_draft": d["mtp_draft"],
            "tokens_identical_to_the_timed_run": all(probe["tokens"][sid] == run.tokens[sid][-n:] for sid in run.sids)}
    return d["per_layer"], d["mtp_draft"], d["source"], info


def roofline_entry(model, engine, run, result, bandwidth: dict, prompt_len: int, mtp: int, routing: tuple) -> dict:
    """The roofline of one timed generate (``run``: its ``RunReport``)."""
    if run.steps == 0 or run.decode_s <= 0:
        return {"skipped": "no timed decode steps (max_new_tokens < 2)"}
    routed, mtp_routed, source, probe_info = routing
    batch = len(run.sids)
    miss = roofline.miss_fraction_of((result.cache_stats or {}).get("decode"))
    history = prompt_len + run.decode_tokens / batch / 2  # the mean over the timed decode
    b = roofline.decode_bytes(model.config, engine.cache_config, history, batch, routed, model.dtype, mtp=mtp,
                              mtp_routed_experts=mtp_routed, routed_source=source, miss_fraction=miss,
                              expert_weights=getattr(model, "expert_weights", "model"), capacity=engine.capacity)
    rep = roofline.roofline_report(b, bandwidth["bandwidth_Bps"], run.decode_s / run.steps,
                                   run.decode_tokens / run.steps)
    return {**rep, "bytes": b, "routing_probe": probe_info, "steps": run.steps, "decode_s": run.decode_s,
            "history": history}


def main(argv):
    del argv
    # Several processes (experiments.launch sets GLM53_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID): join them before
    # anything touches a device. One process: nothing happens.
    distributed.initialize()
    config = _CONFIG.value
    run = config.run
    # Every mistake below ends the run with one line before the model is built (distributed.fail: at once, in a
    # run of several processes, so the launcher can stop the others).
    if _COMPARE_ONE_DEVICE.value and glm53.sharding.MeshConfig.from_config_dict(config.get("mesh")).devices == 1:
        distributed.fail("experiments.generate: --compare_one_device compares a mesh layout with one device: set "
                         "config.mesh")
    if _COMPARE_ONE_DEVICE.value and jax.process_count() > 1:
        distributed.fail("experiments.generate: --compare_one_device runs in one process (the one-device model is "
                         "another process's copy in each)")
    try:
        check_run(config, cli.overrides())
        options = parse_options(_COMPILER_OPTIONS.value)
        baseline_options = (None if _BASELINE_COMPILER_OPTIONS.value is None
                            else parse_options([o for o in _BASELINE_COMPILER_OPTIONS.value if o]))
        if baseline_options is not None and baseline_options == options:
            raise glm53.ConfigError("--baseline_compiler_options equal --compiler_options: nothing to compare")
        # XLA's verdict on the names and values now, not at the first step's compile (after the model, or for the
        # baseline after the whole timed run)
        for flag, opts in (("--compiler_options", options), ("--baseline_compiler_options", baseline_options)):
            try:
                glm53.engine.check_compiler_options(opts)
            except glm53.ConfigError as e:
                raise glm53.ConfigError(f"{flag}: {e}") from None
    except (glm53.ConfigError, ValueError) as e:
        distributed.fail(f"experiments.generate: {e}")
    try:
        model = build_model(config, _EXPERT_WEIGHTS.value)
    except (glm53.ConfigError, glm53.CheckpointError) as e:  # a mesh the model or the devices cannot take, a
        distributed.fail(f"experiments.generate: {e}")       # checkpoint that cannot load
    print(model)
    rng = np.random.default_rng(run.seed)
    prompts = [rng.integers(0, model.config.vocab_size, run.prompt_len).tolist() for _ in range(run.batch)]
    kw = dict(temperature=run.temperature, top_p=run.top_p, seed=run.seed, mtp=run.mtp,
              accept_override=None if run.accept_override < 0 else run.accept_override)

    # One cache capacity for the warm-up and the timed run, so they share every compiled shape; the warm-up decodes
    # past a copyback boundary so offload's one-page copyback is compiled too.
    capacity = max(model.cache_config.max_len, run.prompt_len + run.max_new_tokens + run.mtp)
    warm_tokens = min(run.max_new_tokens, model.cache_config.copyback_every + 2)

    bandwidth = None
    probe_bytes = _BANDWIDTH_MIB.value << 20 if _BANDWIDTH_MIB.value else None
    if _ROOFLINE.value:  # before any engine exists (and again after the runs): the probe has the device to itself
        bandwidth = roofline.measure_hbm_bandwidth(probe_bytes)
        print(f"HBM bandwidth (measured): copy {bandwidth['copy_GBps']:,.1f} GB/s, read {bandwidth['read_GBps']:,.1f} "
              f"GB/s ({bandwidth['array_bytes'] / 2**30:.2f} GiB x {bandwidth['passes']} passes)", flush=True)
    rooflines = {}
    routing_cache = []

    compare_options = baseline_options is not None

    def timed(mode, step_options, label=None):
        cache = model.cache_config.replace(mode=mode, max_len=capacity)
        opts = dict(kw, compiler_options=step_options)
        glm53.generate(model, prompts, max_new_tokens=warm_tokens, cache=cache, **opts)  # compile: not timed
        res = glm53.generate(model, prompts, max_new_tokens=run.max_new_tokens, cache=cache, progress=True,
                             return_logits=run.compare_resident or compare_options, keep_cache=_ROOFLINE.value,
                             **opts)
        mode = label or mode
        if _ROOFLINE.value:
            engine, res.engine = res.engine, None
            timed_run = engine.last_run
            entry = roofline_entry(model, engine, timed_run, res, bandwidth, run.prompt_len, run.mtp, (None,) * 4)
            if "skipped" not in entry:
                if not routing_cache:  # the same tokens in every mode: one probe serves all
                    routing_cache.append(routing_of(model, engine, timed_run, run.mtp, kw))
                entry = roofline_entry(model, engine, timed_run, res, bandwidth, run.prompt_len, run.mtp,
                                       routing_cache[0])
            rooflines.setdefault(mode, entry)  # compare_resident in resident mode: the first run's
            del engine
        return res

    mode = model.cache_config.mode
    print(f"{run.batch} x {run.prompt_len}-token prompts, {run.max_new_tokens} new tokens, cache {mode}/"
          f"{model.cache_config.kv_format} (an untimed warm-up generate with the same shapes ran first: compile is "
          "not timed; a line below says so if some shape escaped it)")
    if options:
        print(f"the engine's steps compile with {options}")
    result = timed(mode, options)
    for b, toks in enumerate(result.tokens):
        print(f"session {b}: {toks[:32]}{' ...' if len(toks) > 32 else ''}")
    print(f"[{mode}] {result.summary()}")
    pace = host_pace(result)
    if pace["decode_step_call_ms"]:
        c, g = pace["decode_step_call_ms"], pace["decode_step_interval_ms"]
        w = pace["decode_step_wait_ms"]
        print(f"[{mode}] host: dispatch loop {pace['decode_host_loop_s']:.3f} s, step calls p50 / p99 "
              f"{c['p50']:.3f} / {c['p99']:.3f} ms, step interval p50 / p99 {g.get('p50', float('nan')):.3f} / "
              f"{g.get('p99', float('nan')):.3f} ms, reads waited for the device p50 / mean {w['p50']:.3f} / "
              f"{w['mean']:.3f} ms")
    if result.compile_s > 0.05:
        print(f"  ({result.compile_s:.2f} s of the run was compilation the warm-up did not cover)")
    if result.cache_stats is not None:
        print("cache stats:")
        print_cache_stats(result.cache_stats, model.config.num_hidden_layers)
    out = {"mode": mode, "run": figures(result), "compiler_options": options}

    if compare_options:
        label = f"{mode}, baseline options"
        other = timed(mode, baseline_options, label)
        c = compared(result, other)
        print(f"[{label}] {other.summary()}")
        print(f"options {options} vs {baseline_options} (same process, same inputs): tokens identical "
              f"{c['tokens_identical']}, logits bit-identical {c['logits_bit_identical']}; decode "
              f"{result.decode_tokens_per_s:,.2f} vs {other.decode_tokens_per_s:,.2f} tok/s (ratio "
              f"{c['decode_ratio']:.3f}); step calls p50 {result.decode_step_call_ms['p50']:.3f} vs "
              f"{other.decode_step_call_ms['p50']:.3f} ms")
        out["baseline_options"] = {"compiler_options": baseline_options, "run": figures(other), **c}

    if run.compare_resident:
        base = timed("resident", options)
        c = compared(result, base)
        print(f"[resident] {base.summary()}")
        print(f"{mode} vs resident (same build, same inputs): tokens identical {c['tokens_identical']}, logits "
              f"bit-identical {c['logits_bit_identical']}; decode {result.decode_tokens_per_s:,.2f} vs "
              f"{base.decode_tokens_per_s:,.2f} tok/s (ratio {c['decode_ratio']:.3f}), prefill "
              f"{result.prefill_tokens_per_s:,.1f} vs {base.prefill_tokens_per_s:,.1f} tok/s")
        out["resident_baseline"] = figures(base)
        out["comparison"] = c

    if _COMPARE_ONE_DEVICE.value:
        out["one_device"] = compare_one_device(config, model, prompts, kw, capacity, _COMPARE_ONE_DEVICE.value)

    if bandwidth is not None:
        # A second probe now the timed runs are done: the fraction is taken against the better of the two.
        bandwidth = roofline.best_bandwidth(bandwidth, roofline.measure_hbm_bandwidth(probe_bytes))
        print(f"HBM bandwidth probes {', '.join(f'{g:,.1f}' for g in bandwidth['probes_GBps'])} GB/s: the roofline "
              f"takes {bandwidth['bandwidth_Bps'] / 1e9:,.1f}", flush=True)
        for name, entry in rooflines.items():
            if "skipped" not in entry:
                entry.update(roofline.roofline_report(entry["bytes"], bandwidth["bandwidth_Bps"],
                                                      entry["decode_s"] / entry["steps"], entry["tokens_per_step"]))
                print(f"[{name}] roofline: {roofline.summary_line(entry['bytes'], entry)}", flush=True)
        out_roofline = {"bandwidth": bandwidth, "run": rooflines.get(mode)}
        if compare_options:
            out_roofline["baseline_options"] = rooflines.get(f"{mode}, baseline options")
        if run.compare_resident and mode != "resident":
            out_roofline["resident_baseline"] = rooflines.get("resident")
    if run.output_json and distributed.is_writer():
        report = {"config": config.to_dict(), "model": model.config.to_hf(), "expert_weights": model.expert_weights,
                  "processes": jax.process_count(), "figures": out,
                  "tokens": result.tokens,
                  **({"roofline": out_roofline} if bandwidth is not None else {}),
                  "cache_stats": jax.tree_util.tree_map(lambda x: np.asarray(x).tolist(), result.cache_stats),
                  "jax_version": jax.__version__, "backend": jax.default_backend(),
                  **provenance()}
        os.makedirs(os.path.dirname(os.path.abspath(run.output_json)), exist_ok=True)
        with open(run.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"wrote {run.output_json}")


if __name__ == "__main__":
    cli.run(main)

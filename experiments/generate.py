"""Decode random prompts with a GLM-5 model and report the speeds (the main job of the framework).

    python -m experiments.generate --config=configs/tiny.py --config.run.prompt_len=500
    python -m experiments.generate --config=configs/h200_bench.py --config.run.output_json=experiments/results/x.json

An untimed warm-up generate with the same shapes runs first, so jit compilation is not timed.
"""

import json
import os

import jax
import numpy as np
from absl import app
from ml_collections import config_flags

import glm53
from glm53.provenance import provenance

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config (configs/*.py)", lock_config=True)


def build_model(config) -> glm53.Model:
    cache_config = glm53.CacheConfig.from_config_dict(config.cache)
    path = config.checkpoint
    if not path:
        return glm53.from_config(config.model, config.seed, dtype=config.dtype, cache_config=cache_config)
    if os.path.exists(os.path.join(path, "glm53.json")):
        model = glm53.load(path, dtype=config.dtype)
        model.cache_config = cache_config
        return model
    return glm53.from_pretrained(path, dtype=config.dtype, cache_config=cache_config)


def figures(result: glm53.GenerateResult) -> dict:
    return {"time_to_first_token_s": result.time_to_first_token_s, "prefill_tokens_per_s": result.prefill_tokens_per_s,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "decode_tokens_per_s_per_session": result.decode_tokens_per_s_per_session,
            "compile_s": result.compile_s, "mtp": result.mtp, "mtp_acceptance": result.mtp_acceptance}


def print_cache_stats(stats: dict, indent: str = "  ") -> None:
    """Scalars as ``name: value``; per-layer sequences (also inside nested dicts) as one table row per layer."""
    per_layer = {k: v for k, v in stats.items() if not isinstance(v, (dict, str)) and np.ndim(v) >= 1}
    for k, v in stats.items():
        if isinstance(v, dict):
            print(f"{indent}{k}:")
            print_cache_stats(v, indent + "  ")
        elif k not in per_layer:
            print(f"{indent}{k}: {v}")
    if per_layer:
        names = list(per_layer)
        width = max(10, *(len(k) for k in names))
        print(f"{indent}layer " + " ".join(f"{k:>{width}}" for k in names))
        for l in range(max(len(v) for v in per_layer.values())):
            cells = []
            for k in names:
                x = per_layer[k][l] if l < len(per_layer[k]) else ""
                cells.append(f"{x:.4f}" if isinstance(x, float) else "-" if x is None else str(x))
            print(f"{indent}{l:>5} " + " ".join(f"{c:>{width}}" for c in cells))


def main(argv):
    del argv
    config = _CONFIG.value
    run = config.run
    model = build_model(config)
    print(model)
    rng = np.random.default_rng(run.seed)
    prompts = [rng.integers(0, model.config.vocab_size, run.prompt_len).tolist() for _ in range(run.batch)]
    kw = dict(temperature=run.temperature, top_p=run.top_p, seed=run.seed, mtp=run.mtp,
              accept_override=None if run.accept_override < 0 else run.accept_override)

    # One cache capacity for the warm-up and the timed run, so they share every compiled shape; the warm-up decodes
    # past a copyback boundary so offload's one-page copyback is compiled too.
    capacity = max(model.cache_config.max_len, run.prompt_len + run.max_new_tokens + run.mtp)
    warm_tokens = min(run.max_new_tokens, model.cache_config.copyback_every + 2)

    def timed(mode):
        cache = model.cache_config.replace(mode=mode, max_len=capacity)
        glm53.generate(model, prompts, max_new_tokens=warm_tokens, cache=cache, **kw)  # compile: not timed
        return glm53.generate(model, prompts, max_new_tokens=run.max_new_tokens, cache=cache, progress=True,
                              return_logits=run.compare_resident, **kw)

    mode = model.cache_config.mode
    print(f"{run.batch} x {run.prompt_len}-token prompts, {run.max_new_tokens} new tokens, cache {mode}/"
          f"{model.cache_config.kv_format} (an untimed warm-up generate with the same shapes ran first: compile is "
          "not timed)")
    result = timed(mode)
    for b, toks in enumerate(result.tokens):
        print(f"session {b}: {toks[:32]}{' ...' if len(toks) > 32 else ''}")
    print(f"[{mode}] {result.summary()}")
    if result.compile_s > 0.05:
        print(f"  ({result.compile_s:.2f} s of the run was compilation the warm-up did not cover)")
    if result.cache_stats is not None:
        print("cache stats:")
        print_cache_stats(result.cache_stats)
    out = {"mode": mode, "run": figures(result)}

    if run.compare_resident:
        base = timed("resident")
        same_tokens = result.tokens == base.tokens
        same_logits = bool(np.array_equal(result.logits, base.logits))
        ratio = result.decode_tokens_per_s / base.decode_tokens_per_s
        print(f"[resident] {base.summary()}")
        print(f"{mode} vs resident (same build, same inputs): tokens identical {same_tokens}, logits bit-identical "
              f"{same_logits}; decode {result.decode_tokens_per_s:,.2f} vs {base.decode_tokens_per_s:,.2f} tok/s "
              f"(ratio {ratio:.3f}), prefill {result.prefill_tokens_per_s:,.1f} vs {base.prefill_tokens_per_s:,.1f} "
              "tok/s")
        out["resident_baseline"] = figures(base)
        out["comparison"] = {"tokens_identical": same_tokens, "logits_bit_identical": same_logits,
                             "decode_ratio": ratio}

    if run.output_json:
        report = {"config": config.to_dict(), "figures": out, "tokens": result.tokens,
                  "cache_stats": jax.tree_util.tree_map(lambda x: np.asarray(x).tolist(), result.cache_stats),
                  "jax_version": jax.__version__, "backend": jax.default_backend(),
                  **provenance()}
        os.makedirs(os.path.dirname(os.path.abspath(run.output_json)), exist_ok=True)
        with open(run.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"wrote {run.output_json}")


if __name__ == "__main__":
    app.run(main)

"""The same config's model in transformers' ``glm_moe_dsa`` (PyTorch): prefill tokens/s, the baseline for
``experiments.profile_prefill``.

    python -m experiments.hf_prefill --config=configs/h200_bench.py --prompt_lens=8192,50000 \
        --out=experiments/results/hf_prefill.json

The model is ``GlmMoeDsaForCausalLM`` built from ``glm53.ModelConfig.to_hf()`` of the experiment config (the mapping
the HF parity tests check), with transformers' own random initialisation, in ``--dtype`` (bf16) on CUDA when
available (``--device``). It has no MTP module (transformers implements none; glm53's chunk steps also write the
MTP layer's rows). Timing: ``torch.cuda.synchronize()`` around each prefill, after an untimed warm-up forward.

Two ways to prefill (``--modes``), each timed on its own:

* ``whole``: one forward over the whole prompt (``use_cache=False``). transformers builds a dense causal mask and
  its indexer scores every query against every key in float32 (a [T, index_n_heads, T] tensor: 8.6 GB at 8K,
  320 GB at 50K), then masks a dense attention down to the top-k (SDPA with a boolean mask).
* ``chunked``: forwards of ``--chunk`` tokens with a ``DynamicCache`` (transformers supports chunked prefill for
  this model: the compressed latents and indexer keys are cached; every chunk re-expands K/V for the whole history
  through ``kv_b_proj``). The outputs equal the whole forward's.

Only the last position's logits are computed (``logits_to_keep=1``; glm53's prefill computes none). A length and
mode that fails (out of memory, typically) is recorded with its error instead of stopping the run; the JSON is
rewritten after every prefill.
"""

import os

# JAX is only needed for glm53's config here: keep it off the GPU, which PyTorch needs whole.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from experiments import cli  # noqa: E402
import glm53  # noqa: E402
from glm53.provenance import provenance  # noqa: E402

FLAGS = flags.FLAGS
cli.define_config("configs/h200_bench.py", "experiment config (its model section is used)")
flags.DEFINE_string("out", "", "write the results JSON here (rewritten after every prefill)")
flags.DEFINE_list("prompt_lens", [], "prompt lengths (default: config.run.prompt_len)")
flags.DEFINE_list("modes", ["whole", "chunked"], "whole: one forward; chunked: --chunk tokens per forward + cache")
flags.DEFINE_integer("chunk", 2048, "tokens per forward in chunked mode", lower_bound=1)
flags.DEFINE_enum("device", "auto", ["auto", "cuda", "cpu"], "auto: CUDA when torch has it, else the CPU")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "parameter and activation dtype")
flags.DEFINE_enum("attn_implementation", "sdpa", ["sdpa", "eager"], "transformers' attention implementation")
flags.DEFINE_integer("warmup_tokens", 256, "tokens of the untimed warm-up forward", lower_bound=0)
flags.DEFINE_integer("seed", 0, "weights and prompt seed")


def write(results: dict) -> None:
    if not FLAGS.out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    tmp = FLAGS.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, FLAGS.out)


def build_model(torch, cfg: glm53.ModelConfig, device: str, dtype):
    """``GlmMoeDsaForCausalLM`` with transformers' random initialisation, created on ``device`` directly (a
    CPU build of an 8.9B model would take minutes and tens of GB of host RAM)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    hf_cfg = GlmMoeDsaConfig(**cfg.to_hf())
    torch.manual_seed(FLAGS.seed)
    try:
        with torch.device(device):
            model = GlmMoeDsaForCausalLM._from_config(hf_cfg, dtype=dtype,
                                                      attn_implementation=FLAGS.attn_implementation)
        where = f"built on {device}"
    except Exception as e:  # an older torch / transformers: build on the CPU, then move
        print(f"building on {device} failed ({type(e).__name__}: {e}); building on the CPU, then moving", flush=True)
        model = GlmMoeDsaForCausalLM._from_config(hf_cfg, dtype=dtype, attn_implementation=FLAGS.attn_implementation)
        model = model.to(device)
        where = f"built on the CPU, moved to {device}"
    return model.eval(), where


def sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prefill(torch, model, ids, mode: str, cache_kw: str, chunk: int):
    """One prefill of ``ids [1, T]`` (chunked: ``chunk`` tokens per forward); returns the last position's logits
    (float32, on the CPU)."""
    from transformers import DynamicCache

    with torch.no_grad():
        if mode == "whole":
            out = model(ids, use_cache=False, logits_to_keep=1)
            return out.logits[0, -1].float().cpu()
        cache = DynamicCache(config=model.config)
        T, C = ids.shape[1], chunk
        out = None
        for i in tqdm(range(0, T, C), desc=f"hf chunked prefill {T:,}", unit="chunk", leave=False,
                      disable=T <= C):
            out = model(ids[:, i:i + C], use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        logits = out.logits[0, -1].float().cpu()
        del cache, out
        return logits


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "run.prompt_len"),
        "experiments.hf_prefill builds transformers' model from config.model alone, in --dtype, with its own random "
        "weights, and reads run.prompt_len when --prompt_lens is empty")
    lens = [int(x) for x in FLAGS.prompt_lens] or [int(c.run.prompt_len)]
    bad = sorted(set(FLAGS.modes) - {"whole", "chunked"})
    if bad:
        raise app.UsageError(f"--modes: unknown {bad}; choose from whole, chunked")
    results = {"config": c.to_dict(), **provenance(), "prompt_lens": lens,
               "modes": list(FLAGS.modes), "chunk": FLAGS.chunk, "dtype": FLAGS.dtype,
               "attn_implementation": FLAGS.attn_implementation,
               "method": {"whole": "one forward over the prompt, use_cache=False (dense causal mask, float32 "
                                   "indexer scores of every query against every key)",
                          "chunked": f"forwards of {FLAGS.chunk} tokens with a transformers DynamicCache",
                          "logits": "last position only (logits_to_keep=1)",
                          "mtp": "transformers' glm_moe_dsa has no MTP module: not run"},
               "runs": []}
    results["jax_note"] = "JAX ran on the CPU here (only glm53's config is used); device_kind is torch's"
    try:
        import torch
        import transformers
    except ImportError as e:
        results["error"] = f"torch / transformers missing: {e}"
        write(results)
        print(results["error"], file=sys.stderr)
        sys.exit(2)
    cuda = torch.cuda.is_available()
    device = FLAGS.device if FLAGS.device != "auto" else ("cuda" if cuda else "cpu")
    results.update(torch=torch.__version__, torch_cuda=torch.version.cuda, transformers=transformers.__version__,
                   torch_device=device, device_kind=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                   jax=jax.__version__, torch_allow_tf32={"matmul": torch.backends.cuda.matmul.allow_tf32,
                                                          "cudnn": torch.backends.cudnn.allow_tf32})
    if device == "cuda" and not cuda:
        results["error"] = f"--device=cuda but torch {torch.__version__} has no CUDA (torch.version.cuda=" \
                           f"{torch.version.cuda})"
        write(results)
        print(results["error"], file=sys.stderr)
        sys.exit(2)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[FLAGS.dtype]
    cfg = glm53.ModelConfig.from_config_dict(c.model.to_dict())
    t = time.perf_counter()
    model, where = build_model(torch, cfg, device, dtype)
    sync(torch, device)
    n_params = sum(p.numel() for p in model.parameters())
    results["model"] = {"params": n_params, "build_s": time.perf_counter() - t, "where": where,
                        "experts_implementation": getattr(model.config, "_experts_implementation", None),
                        "attn_implementation": model.config._attn_implementation}
    print(f"transformers {transformers.__version__} GlmMoeDsaForCausalLM: {n_params / 1e9:.2f}B params on {device} "
          f"({FLAGS.dtype}, {model.config._attn_implementation} attention, experts "
          f"{results['model']['experts_implementation']}), {where} in {results['model']['build_s']:.1f} s",
          flush=True)
    write(results)
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"

    rng = np.random.default_rng(FLAGS.seed)
    warm = torch.as_tensor(rng.integers(0, cfg.vocab_size, (1, FLAGS.warmup_tokens)), device=device)
    t = time.perf_counter()
    prefill(torch, model, warm, "whole", cache_kw, FLAGS.chunk)
    if "chunked" in FLAGS.modes:  # the cached path too: two chunks (the second one reads the cache)
        prefill(torch, model, warm, "chunked", cache_kw, max(1, FLAGS.warmup_tokens // 2))
    sync(torch, device)
    results["warmup"] = {"tokens": FLAGS.warmup_tokens, "s": time.perf_counter() - t,
                         "what": "one whole forward, and a chunked prefill in two chunks (untimed)"}
    write(results)

    for P in lens:
        ids = torch.as_tensor(np.random.default_rng(FLAGS.seed + P).integers(0, cfg.vocab_size, (1, P)),
                              device=device)
        last = {}
        for mode in FLAGS.modes:
            run = {"prompt_len": P, "mode": mode}
            if mode == "chunked":
                run["chunk"] = FLAGS.chunk
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            gc.collect()
            try:
                sync(torch, device)
                t = time.perf_counter()
                logits = prefill(torch, model, ids, mode, cache_kw, FLAGS.chunk)
                sync(torch, device)
                dt = time.perf_counter() - t
                run.update(ok=True, prefill_s=dt, tokens_per_s=P / dt, last_token_argmax=int(logits.argmax()))
                last[mode] = logits
                print(f"[hf {mode} {P:,}] {dt:.2f} s = {P / dt:,.0f} tok/s", flush=True)
            except Exception as e:  # out of memory, typically: record it and go on
                run.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}",
                           traceback=traceback.format_exc()[-3000:])
                print(f"[hf {mode} {P:,}] failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if device == "cuda":
                run["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
                run["memory_total_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            results["runs"].append(run)
            write(results)
        if len(last) == 2:  # chunked prefill computes the same function as the whole forward
            a, b = last.values()
            results["runs"][-1]["last_logits_max_abs_diff_vs_whole"] = float((a - b).abs().max())
            results["runs"][-1]["last_logits_max_abs"] = float(a.abs().max())
            write(results)
    if FLAGS.out:
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)

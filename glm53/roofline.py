"""Decode at the memory roofline: the bytes a decode step must move, the bandwidth the device delivers, and how
close a measured step comes.

Accounting (pure Python, no device work):

    parameter_bytes(cfg, dtype)            every parameter's bytes, by part (equals the parameter pytree's nbytes)
    decode_bytes(cfg, cache_config, history, batch, routed_experts=None, dtype=...)
                                           the bytes one decode step (or MTP verify step) reads, by part
    expected_distinct_experts(E, k, n)     distinct experts n tokens route to under uniform routing
    roofline_report(bytes_per_step, bandwidth_Bps, step_s, tokens_per_step)
                                           ideal vs achieved step time and tokens/s

Measurement (device work, kept apart):

    measure_hbm_bandwidth()                a jitted copy / read loop over a large array, best of n (on a CPU this
                                           measures RAM bandwidth)
    measure_host_speed_spread()            a fixed piece of pure-Python work timed back to back: the spread of
                                           this thread's own speed, beside a decode loop's step-call p99 / median
    probe_routing(engine, requests)        one ``Engine.generate`` through an instrumented copy of the decode (or
                                           verify) step that sends every MoE layer's expert choices to the host
    distinct_experts(probe, cfg, lanes)    the distinct routed experts per MoE layer and step, from a probe

What a decode step reads (``decode_bytes``), for B lanes of T tokens each (T = 1; MTP verify: T = depth + 1):

* weights, each read once per step however many lanes run: the attention projections of every main layer
  (``q_a``, ``q_b``, ``kv_a``, ``kv_b``, ``o_proj``), the indexer of every full-indexer layer (``wq_b``, ``wk``,
  the key norm, the f32 ``weights_proj``), the dense MLPs, per MoE layer the f32 router (and its bias), the shared
  experts and the *distinct* routed experts the B x T tokens choose (the grouped-matmul kernel visits only experts
  with tokens), the final norm and the LM head (once per logits call), the norms, and one embedding row per
  token. Every step also writes the MTP layer's KV row and indexer key of each token (``steps._mtp_catch_up``):
  its ``enorm`` / ``hnorm``, ``eh_proj``, input norm, ``kv_a`` projection and norm, and indexer key path. With MTP
  depth D, each of the D drafts runs the whole MTP module on B tokens and its LM head.
* the cache: per main layer and token, ``min(index_topk, position + 1)`` KV rows gathered in the cache's
  ``kv_format`` (``kv_formats.bytes_per_row``); per full-indexer layer and lane, the indexer keys of the live
  history (positions 0 .. last query position: the kernels skip blocks past it), in the model dtype or FP8 (1 byte
  per value + one f32 scale per key); the rows and keys the step writes.
* offload: the gathered rows that miss the hot cache (``miss_fraction``) come from host memory, not HBM: they are
  reported apart (``host``), with the copyback of the step's rows to host pages; their fills into the hot cache and
  the copyback's ring reads are HBM traffic (``offload_hbm``).

Not counted in the roofline (``extras``, for diagnosis): the dequantised rows the gather materialises in the model
dtype (written once, read by the two attention einsums: a fused attention kernel would not write them), and the
f32 indexer scores the top-k passes read (written over the slot capacity, read by 10 radix / tie / compact passes
over the selectable positions). Activations, the offload slot maps and pins, and the sampler are not counted.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Mapping

import numpy as np

from glm53.config import CacheConfig, ModelConfig
from kernels_pallas import kv_formats

F32 = 4
FP8_SCALE_BLOCK = 128  # FP8 experts: one f32 scale per 128 x 128 block (kernels_pallas.grouped_matmul)
TOPK_PASSES = 10  # radix count (8 passes of 4 bits), tie count, compact: reads of the selectable scores
WEIGHT_PARTS = ("attention_weights", "indexer_weights", "dense_mlp", "shared_experts", "routed_experts", "router",
                "mtp_projection", "lm_head", "embeddings", "norms")
CACHE_PARTS = ("kv_rows", "indexer_keys", "cache_writes", "offload_hbm")
HOST_PARTS = ("kv_rows_from_host", "copyback_to_host")
_DTYPE_BYTES = {"float32": 4, "f32": 4, "bfloat16": 2, "bf16": 2}


def _itemsize(dtype) -> int:
    if isinstance(dtype, str):
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r} unknown; choose one of {sorted(_DTYPE_BYTES)}")
        return _DTYPE_BYTES[dtype]
    return int(np.dtype(dtype).itemsize)


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


# ----------------------------------------------------------------------------------------------------------------
# Sizes of the model's pieces (bytes)
# ----------------------------------------------------------------------------------------------------------------
class _Sizes:
    """Bytes of each piece of one layer (model dtype ``w``; routers and ``weights_proj`` are f32 in the model)."""

    def __init__(self, cfg: ModelConfig, dtype, expert_weights: str = "model"):
        if expert_weights not in ("model", "fp8"):
            raise ValueError(f"expert_weights must be 'model' or 'fp8', got {expert_weights!r}")
        c = cfg
        w = self.w = _itemsize(dtype)
        h, H, qk = c.hidden_size, c.num_attention_heads, c.qk_head_dim
        self.q_a = h * c.q_lora_rank * w
        self.q_b = c.q_lora_rank * H * qk * w
        self.kv_a = h * c.kv_row_dim * w
        self.kv_b = c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim) * w
        self.o_proj = H * c.v_head_dim * h * w
        self.attention = self.q_a + self.q_b + self.kv_a + self.kv_b + self.o_proj
        self.q_a_norm = c.q_lora_rank * w
        self.kv_a_norm = c.kv_lora_rank * w
        self.layer_norms = 2 * h * w  # input_layernorm + post_attention_layernorm
        self.index_q = c.q_lora_rank * c.index_n_heads * c.index_head_dim * w + h * c.index_n_heads * F32
        self.index_k = h * c.index_head_dim * w + 2 * c.index_head_dim * w  # wk + the key LayerNorm (weight, bias)
        self.indexer = self.index_q + self.index_k
        self.dense = 3 * h * c.intermediate_size * w
        self.router = (h * c.n_routed_experts + c.n_routed_experts) * F32  # gate + e_score_correction_bias
        self.shared = 3 * h * c.moe_intermediate_size * c.n_shared_experts * w
        if expert_weights == "fp8":
            blocks = -(-h // FP8_SCALE_BLOCK) * -(-c.moe_intermediate_size // FP8_SCALE_BLOCK)
            self.expert = 3 * (h * c.moe_intermediate_size + blocks * F32)
        else:
            self.expert = 3 * h * c.moe_intermediate_size * w
        self.embed_row = h * w
        self.vocab = c.vocab_size * h * w  # the embedding table, or the LM head
        self.hidden_norm = h * w
        self.eh_proj = 2 * h * h * w


def parameter_bytes(cfg: ModelConfig, dtype="bfloat16", expert_weights: str = "model") -> dict:
    """Bytes of every parameter of the model, MTP module included, by part (``WEIGHT_PARTS``; ``embeddings`` is
    the whole table here) and ``total``: what ``glm53.params.param_shapes(cfg, dtype)`` allocates (the routers,
    their biases and the indexer's ``weights_proj`` are f32 whatever the model dtype)."""
    s = _Sizes(cfg, dtype, expert_weights)
    out = dict.fromkeys(WEIGHT_PARTS, 0)
    for l in range(cfg.num_cache_layers):
        out["attention_weights"] += s.attention
        out["norms"] += s.layer_norms + s.q_a_norm + s.kv_a_norm
        if cfg.layer_indexer_type(l) == "full":
            out["indexer_weights"] += s.indexer
        if cfg.is_moe_layer(l):
            out["router"] += s.router
            out["shared_experts"] += s.shared
            out["routed_experts"] += cfg.n_routed_experts * s.expert
        else:
            out["dense_mlp"] += s.dense
    out["embeddings"] = s.vocab
    out["lm_head"] = 0 if cfg.tie_word_embeddings else s.vocab
    out["norms"] += s.hidden_norm  # final norm
    if cfg.num_nextn_predict_layers:
        out["mtp_projection"] = s.eh_proj
        out["norms"] += 3 * s.hidden_norm  # enorm, hnorm, shared_head_norm
    out["total"] = sum(out[p] for p in WEIGHT_PARTS)
    return out


def expected_distinct_experts(n_experts: int, k: int, tokens: float) -> float:
    """Distinct experts ``tokens`` tokens route to when each picks ``k`` of ``n_experts`` uniformly:
    ``E * (1 - (1 - k/E)**tokens)`` (exactly ``k`` for one token)."""
    if tokens <= 0:
        return 0.0
    return float(n_experts * (1.0 - (1.0 - k / n_experts) ** tokens))


def index_key_bytes(cfg: ModelConfig, cache_config: CacheConfig, dtype) -> int:
    """Bytes of one cached indexer key: ``index_head_dim`` values in the model dtype, or FP8 plus one f32 scale."""
    if cache_config.index_keys == "fp8":
        return cfg.index_head_dim + F32
    return cfg.index_head_dim * _itemsize(dtype)


def _per_lane(history, batch: int) -> list[float]:
    if isinstance(history, (int, float, np.integer, np.floating)):
        return [float(history)] * batch
    h = [float(x) for x in history]
    if len(h) != batch:
        raise ValueError(f"history has {len(h)} entries for batch={batch}")
    return h


def _rows_read(history: float, T: int, K: int) -> float:
    """KV rows the T queries at positions history .. history + T - 1 gather: sum of min(K, position + 1)."""
    return float(sum(min(K, history + t + 1) for t in range(T)))


def _routed_list(routed_experts, n_moe: int, what: str) -> list[float]:
    if isinstance(routed_experts, (int, float, np.integer, np.floating)):
        return [float(routed_experts)] * n_moe
    r = [float(x) for x in routed_experts]
    if len(r) != n_moe:
        raise ValueError(f"{what} has {len(r)} entries for {n_moe} MoE layers")
    return r


def decode_bytes(cfg: ModelConfig, cache_config: CacheConfig, history, batch: int = 1, routed_experts=None,
                 dtype="bfloat16", *, mtp: int = 0, mtp_routed_experts=None, routed_source: str | None = None,
                 miss_fraction: float = 0.0, expert_weights: str = "model", capacity: int | None = None) -> dict:
    """Bytes one decode step of ``batch`` lanes moves, by part (see the module doc), and totals.

    ``history``: rows already in each lane's cache before the step (a number, or one per lane). ``routed_experts``:
    distinct routed experts the step's tokens use, per main MoE layer (a sequence, in layer order) or one number for
    all; None: the uniform-routing expectation for ``batch x T`` tokens (exact for one token). ``mtp``: MTP depth D
    (a verify step of T = D + 1 tokens per lane and D drafts, each the MTP module on ``batch`` tokens;
    ``mtp_routed_experts``: distinct experts per draft, default the uniform expectation). ``miss_fraction``
    (offload): the share of gathered rows read from host memory. ``capacity``: rows per slot (sets the top-k, and
    the size of the score rows in ``extras``). ``routed_source`` labels where ``routed_experts`` came from.

    Returns ``{"parts": {part: HBM bytes}, "host": {part: host-memory bytes}, "weights", "cache", "total" (HBM),
    "host_total", "tokens_per_step" (tokens the step processes: batch x T), "per_session" (cache bytes per lane),
    "routed_experts": {...}, "extras": {...}, "inputs": {...}}``.
    """
    c = cfg
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not 0 <= mtp <= 3:
        raise ValueError(f"mtp must be a depth in [0, 3], got {mtp}")
    if mtp and not c.num_nextn_predict_layers:
        raise ValueError("mtp > 0 needs an MTP module (num_nextn_predict_layers=1)")
    if not 0.0 <= miss_fraction <= 1.0:
        raise ValueError(f"miss_fraction must be in [0, 1], got {miss_fraction}")
    if miss_fraction and cache_config.mode != "offload":
        raise ValueError("miss_fraction > 0 needs an offload cache: a resident cache reads every row from HBM")
    s = _Sizes(c, dtype, expert_weights)
    w = s.w
    B, T, D = int(batch), mtp + 1, mtp
    tokens = B * T
    hist = _per_lane(history, B)
    L = c.num_hidden_layers
    has_mtp = bool(c.num_nextn_predict_layers)
    main_full = [l for l in range(L) if c.layer_indexer_type(l) == "full"]
    main_moe = [l for l in range(L) if c.is_moe_layer(l)]
    n_dense = L - len(main_moe)
    K = c.index_topk if capacity is None else min(c.index_topk, int(capacity))
    row_bytes = kv_formats.get_format(cache_config.kv_format).bytes_per_row
    key_bytes = index_key_bytes(c, cache_config, dtype)
    E, k = c.n_routed_experts, c.num_experts_per_tok

    # distinct routed experts: main layers (B x T tokens per step), MTP drafts (B tokens per draft)
    if routed_experts is None:
        routed = [expected_distinct_experts(E, k, tokens)] * len(main_moe)
        source = ("exact: one token routes to num_experts_per_tok distinct experts" if tokens == 1
                  else f"uniform-routing expectation E*(1-(1-k/E)^N), N = {tokens} tokens")
    else:
        routed = _routed_list(routed_experts, len(main_moe), "routed_experts")
        source = routed_source or "given"
    mtp_moe = has_mtp and c.is_moe_layer(L)
    if D and mtp_moe:
        draft_routed = float(mtp_routed_experts) if mtp_routed_experts is not None \
            else expected_distinct_experts(E, k, B)
    else:
        draft_routed = 0.0

    p = dict.fromkeys(WEIGHT_PARTS + CACHE_PARTS, 0.0)
    host = dict.fromkeys(HOST_PARTS, 0.0)
    # ---- main layers ----
    p["attention_weights"] += L * s.attention
    p["norms"] += L * (s.layer_norms + s.q_a_norm + s.kv_a_norm) + s.hidden_norm  # + the final norm
    p["indexer_weights"] += len(main_full) * s.indexer
    p["dense_mlp"] += n_dense * s.dense
    p["router"] += len(main_moe) * s.router
    p["shared_experts"] += len(main_moe) * s.shared
    p["routed_experts"] += sum(routed) * s.expert
    p["lm_head"] += s.vocab  # one logits call over all the step's rows
    p["embeddings"] += tokens * s.embed_row
    rows_per_lane = [_rows_read(h, T, K) for h in hist]
    keys_per_lane = [h + T for h in hist]  # the live history up to the last query position
    kv_rows = L * sum(rows_per_lane)
    keys = len(main_full) * sum(keys_per_lane)
    rows_written = L * tokens
    keys_written = len(main_full) * tokens
    # ---- the MTP layer's rows of the processed tokens (KV row + indexer key only) ----
    if has_mtp:
        p["embeddings"] += tokens * s.embed_row
        p["norms"] += 3 * s.hidden_norm + s.kv_a_norm  # enorm, hnorm, input norm; kv_a norm
        p["mtp_projection"] += s.eh_proj
        p["attention_weights"] += s.kv_a
        p["indexer_weights"] += s.index_k
        rows_written += tokens
        keys_written += tokens
    # ---- MTP drafts: the whole MTP module on B tokens, D times ----
    draft_rows = draft_keys = 0.0
    if D:
        for j in range(D):
            p["embeddings"] += B * s.embed_row
            p["norms"] += 3 * s.hidden_norm + s.layer_norms + s.q_a_norm + s.kv_a_norm  # enorm, hnorm, head norm
            p["mtp_projection"] += s.eh_proj
            p["attention_weights"] += s.attention
            p["indexer_weights"] += s.indexer
            if mtp_moe:
                p["router"] += s.router
                p["shared_experts"] += s.shared
                p["routed_experts"] += draft_routed * s.expert
            else:
                p["dense_mlp"] += s.dense
            p["lm_head"] += s.vocab
            # the MTP layer's row j of the drafts sits at about history + j
            draft_rows += sum(_rows_read(h + j, 1, K) for h in hist)
            draft_keys += sum(h + j + 1 for h in hist)
        rows_written += D * B
        keys_written += D * B
    kv_rows += draft_rows
    keys += draft_keys
    # ---- cache traffic ----
    p["kv_rows"] = kv_rows * (1.0 - miss_fraction) * row_bytes
    p["indexer_keys"] = keys * key_bytes
    p["cache_writes"] = rows_written * row_bytes + keys_written * key_bytes
    if cache_config.mode == "offload":
        misses = kv_rows * miss_fraction
        committed = tokens * (L + int(has_mtp))  # rows that reach host pages, amortised over steps
        host["kv_rows_from_host"] = misses * row_bytes
        host["copyback_to_host"] = committed * row_bytes
        p["offload_hbm"] = misses * row_bytes + committed * row_bytes  # fills into the hot cache, ring reads
    p = {k_: float(v) for k_, v in p.items()}
    weights = sum(p[x] for x in WEIGHT_PARTS)
    cache = sum(p[x] for x in CACHE_PARTS)

    # ---- implementation traffic the roofline leaves out ----
    cap = capacity if capacity is not None else max(128, int(math.ceil((max(hist) + T + D) / 128.0) * 128))
    deq_row = c.kv_row_dim * w
    n_full_scored = len(main_full) * T  # score rows per lane (main); drafts add D rows of the MTP layer
    score_rows = B * (n_full_scored + D)
    selectable = sum(len(main_full) * sum(max(h + t + 1, K) for t in range(T)) + sum(max(h + j + 1, K)
                     for j in range(D)) for h in hist)
    extras = {
        "kv_rows_dequantised": kv_rows * deq_row * 3,  # written by the gather, read by two einsums
        "indexer_scores_f32": score_rows * cap * F32 + TOPK_PASSES * selectable * F32,
        "note": "implementation traffic not in the roofline: the gather's dequantised rows in the model dtype "
                "(written once, read twice) and the f32 indexer scores (written over the slot capacity, read by "
                f"{TOPK_PASSES} top-k passes over the selectable positions)",
    }
    return {
        "parts": p, "host": {k_: float(v) for k_, v in host.items()},
        "weights": weights, "cache": cache, "total": weights + cache, "host_total": float(sum(host.values())),
        "tokens_per_step": tokens,
        "per_session": {"kv_rows": p["kv_rows"] / B, "indexer_keys": p["indexer_keys"] / B,
                        "cache": cache / B, "weights_amortised": weights / B,
                        "kv_rows_from_host": host["kv_rows_from_host"] / B},
        "routed_experts": {"per_layer": routed, "layers": main_moe, "mean": float(np.mean(routed)) if routed
                           else 0.0, "of": E, "tokens": tokens, "source": source,
                           **({"mtp_draft": draft_routed} if D and mtp_moe else {})},
        "extras": extras,
        "inputs": {"history": hist if len(set(hist)) > 1 else hist[0], "batch": B, "tokens_per_lane": T, "mtp": D,
                   "mode": cache_config.mode, "kv_format": cache_config.kv_format,
                   "index_keys": cache_config.index_keys, "dtype": _dtype_name(dtype),
                   "expert_weights": expert_weights, "topk": K, "kv_row_bytes": row_bytes,
                   "index_key_bytes": key_bytes, "miss_fraction": miss_fraction},
    }


def roofline_report(bytes_per_step, bandwidth_Bps: float, step_s: float, tokens_per_step: float, *,
                    host_bytes_per_step: float | None = None, host_bandwidth_Bps: float | None = None) -> dict:
    """Ideal vs achieved: ``bytes_per_step`` (a number, or a ``decode_bytes`` dict: its HBM ``total``, and its
    ``host_total`` unless ``host_bytes_per_step`` is given) at ``bandwidth_Bps`` against a measured ``step_s``.
    ``tokens_per_step``: tokens the step emits (all lanes). ``ratio`` = achieved / ideal step time (1.0 = at the
    roofline); ``fraction_of_roofline`` = ideal / achieved. Host-memory bytes (offload misses, copyback) are not in
    the HBM roofline; with ``host_bandwidth_Bps`` their time is reported too (``ideal_step_ms_with_host``: both
    serially, an upper bound of the ideal)."""
    if isinstance(bytes_per_step, Mapping):
        if host_bytes_per_step is None:
            host_bytes_per_step = bytes_per_step.get("host_total", 0.0)
        bytes_per_step = bytes_per_step["total"]
    host_bytes_per_step = float(host_bytes_per_step or 0.0)
    if bandwidth_Bps <= 0 or step_s <= 0 or tokens_per_step <= 0:
        raise ValueError(f"bandwidth ({bandwidth_Bps}), step time ({step_s}) and tokens per step "
                         f"({tokens_per_step}) must be positive")
    ideal = float(bytes_per_step) / bandwidth_Bps
    out = {
        "bytes_per_step": float(bytes_per_step), "bytes_per_token": float(bytes_per_step) / tokens_per_step,
        "tokens_per_step": float(tokens_per_step), "bandwidth_GBps": bandwidth_Bps / 1e9,
        "ideal_step_ms": ideal * 1e3, "achieved_step_ms": step_s * 1e3,
        "ideal_ms_per_token": ideal * 1e3 / tokens_per_step, "achieved_ms_per_token": step_s * 1e3 / tokens_per_step,
        "ideal_tokens_per_s": tokens_per_step / ideal, "achieved_tokens_per_s": tokens_per_step / step_s,
        "ratio": step_s / ideal, "fraction_of_roofline": ideal / step_s,
        "achieved_GBps": float(bytes_per_step) / step_s / 1e9,
        "host_bytes_per_step": host_bytes_per_step,
    }
    if host_bandwidth_Bps:
        host_s = host_bytes_per_step / host_bandwidth_Bps
        out.update(host_bandwidth_GBps=host_bandwidth_Bps / 1e9, ideal_host_ms=host_s * 1e3,
                   ideal_step_ms_with_host=(ideal + host_s) * 1e3)
    return out


def summary_line(b: dict, r: dict | None = None) -> str:
    """One line: GB per step by group, and the roofline figures when ``r`` (a ``roofline_report``) is given."""
    p = b["parts"]
    txt = (f"{b['total'] / 1e9:.3f} GB/step HBM (weights {b['weights'] / 1e9:.3f}: routed experts "
           f"{p['routed_experts'] / 1e9:.3f} at {b['routed_experts']['mean']:.2f}/{b['routed_experts']['of']} per "
           f"layer [{b['routed_experts']['source']}]; KV rows {p['kv_rows'] / 1e9:.4f}, indexer keys "
           f"{p['indexer_keys'] / 1e9:.4f})")
    if b["host_total"]:
        txt += f", host {b['host_total'] / 1e6:.2f} MB/step"
    if r is not None:
        txt += (f" | {r['bandwidth_GBps']:.0f} GB/s: ideal {r['ideal_step_ms']:.3f} ms/step, achieved "
                f"{r['achieved_step_ms']:.3f} ms/step ({100 * r['fraction_of_roofline']:.1f}% of the roofline)")
    return txt


# ----------------------------------------------------------------------------------------------------------------
# Measured HBM bandwidth
# ----------------------------------------------------------------------------------------------------------------
def measure_hbm_bandwidth(nbytes: int | None = None, *, iters: int | None = None, repeats: int | None = None,
                          device=None) -> dict:
    """The device's memory bandwidth, measured: a jitted loop of ``iters`` passes over a ``nbytes`` uint32 array,
    best of ``repeats`` timed calls (after a compiling call), as (1) a copy ``y = y + 1`` (read + write per pass; an
    optimisation barrier keeps XLA from fusing passes) and (2) a read ``acc += sum(x ^ acc)`` (each pass depends on
    the previous sum, so passes cannot share a read). Defaults: 1 GiB x 8 passes, best of 10, on accelerators; 64
    MiB x 2, best of 3, on a CPU (there it measures RAM). ``bandwidth_Bps`` is the higher of the two (what the
    device demonstrably delivers). Best of 10, not 3: on the H200 the read's best of 3 scattered 3,764-4,019 GB/s
    across four runs of one call (``generate_8k_ab_62932c1_fa830ed.json``), and the roofline fraction with it; a
    timed call costs ~2.5 ms there, and the reference a fraction is measured against should be the device's best."""
    import jax
    import jax.numpy as jnp

    dev = device or jax.local_devices()[0]
    accel = dev.platform != "cpu"
    nbytes = int(nbytes or ((1 << 30) if accel else (64 << 20)))
    iters = int(iters or (8 if accel else 2))
    repeats = int(repeats or (10 if accel else 3))
    n = max(nbytes // 4, 1024)

    def copy_loop(x):
        return jax.lax.fori_loop(0, iters, lambda i, y: jax.lax.optimization_barrier(y + jnp.uint32(1)), x)

    def read_loop(x):
        return jax.lax.fori_loop(0, iters, lambda i, acc: acc + jnp.sum(x ^ acc, dtype=jnp.uint32), jnp.uint32(0))

    with jax.default_device(dev):
        x = jax.jit(lambda: jnp.arange(n, dtype=jnp.uint32))()
        x.block_until_ready()
        timings = {}
        for name, fn in (("copy", jax.jit(copy_loop)), ("read", jax.jit(read_loop))):
            jax.block_until_ready(fn(x))  # compile
            best = math.inf
            for _ in range(max(repeats, 1)):
                t = time.perf_counter()
                out = fn(x)
                jax.block_until_ready(out)
                best = min(best, time.perf_counter() - t)
            timings[name] = best
            if name == "copy":  # the loop really ran every pass
                ok = int(np.asarray(out[:4])[1]) == (1 + iters) & 0xFFFFFFFF
                if not ok:
                    raise RuntimeError("bandwidth benchmark: the copy loop's result is wrong")
            del out
        del x
    copy = 2 * 4 * n * iters / timings["copy"]
    read = 4 * n * iters / timings["read"]
    return {"bandwidth_Bps": max(copy, read), "copy_GBps": copy / 1e9, "read_GBps": read / 1e9,
            "array_bytes": 4 * n, "passes": iters, "repeats": repeats, "copy_s": timings["copy"],
            "read_s": timings["read"], "platform": dev.platform, "device_kind": dev.device_kind,
            "method": "jitted loop over a uint32 array, best of repeats: copy (read + write per pass) and read "
                      "(a dependent sum per pass); bandwidth_Bps = the higher"}


def best_bandwidth(*probes: dict) -> dict:
    """The highest of several ``measure_hbm_bandwidth`` probes of one run (``probes_GBps`` lists them all). One probe,
    even best of 10, scattered 3,750-3,983 GB/s between runs of one call on the H200 (``generate_8k_*_c53beac.json``),
    moving the roofline fraction by 6%: probing before and after the timed work and keeping the best makes the
    reference the device's best in that run, so a slow probe cannot flatter the fraction."""
    best = dict(max(probes, key=lambda p: p["bandwidth_Bps"]))
    best["probes_GBps"] = [p["bandwidth_Bps"] / 1e9 for p in probes]
    return best


def measure_host_read_bandwidth(kv_format: str = "q8g64", rows: int = 65536, history_rows: int = 1 << 20, *,
                                iters: int = 10, repeats: int = 3, device=None) -> dict | None:
    """Zero-copy reads from pinned host memory, measured the way offload reads a miss: the hot-gather kernel
    (``kernels_pallas.hot_gather``) with every one of ``rows`` sorted random rows a miss, over a pinned_host pool of
    ``history_rows`` rows of ``kv_format``, ``iters`` gathers per jitted loop, best of ``repeats``. Returns
    ``{"bandwidth_Bps", "GBps", "rows", "row_bytes", ...}``, or None on a CPU (the interpreter cannot read
    pinned_host operands: there is no zero-copy path to measure). A decode step's physical floor in offload mode is
    its misses x row bytes over this bandwidth."""
    import importlib

    import jax
    import jax.numpy as jnp

    from kernels_pallas import kv_formats as kvf

    hg = importlib.import_module("kernels_pallas.hot_gather")  # the module: the package re-exports its function

    dev = device or jax.local_devices()[0]
    if dev.platform == "cpu":
        return None
    fmt = kvf.get_format(kv_format)
    host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    with jax.default_device(dev):
        pool = {k: jax.device_put(jnp.zeros(shape, dt), host_sh)
                for k, (shape, dt) in fmt.plane_shapes(history_rows).items()}
        small = {k: jnp.zeros(shape, dt) for k, (shape, dt) in fmt.plane_shapes(8).items()}
        rng = np.random.default_rng(0)
        src = jnp.full((rows,), hg.HOST, jnp.int32)
        row = jnp.asarray(np.sort(rng.choice(history_rows, rows, replace=False)).astype(np.int32))

        @jax.jit
        def loop(pool):
            def body(i, acc):
                out = hg.hot_gather(src, (row + i) % history_rows, small, small, pool, kv_format=fmt.name,
                                    out_dtype=jnp.bfloat16)
                return acc + sum(jnp.ravel(v)[0].astype(jnp.float32) for v in jax.tree_util.tree_leaves(out))
            return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

        jax.block_until_ready(loop(pool))
        best = math.inf
        for _ in range(max(repeats, 1)):
            t = time.perf_counter()
            jax.block_until_ready(loop(pool))
            best = min(best, time.perf_counter() - t)
    bw = rows * fmt.bytes_per_row * iters / best
    return {"bandwidth_Bps": bw, "GBps": bw / 1e9, "rows": rows, "row_bytes": fmt.bytes_per_row,
            "history_rows": history_rows, "iters": iters, "seconds": best, "platform": dev.platform,
            "method": "hot_gather with every row a miss (zero-copy reads of pinned_host memory), best of repeats"}


def _python_work(iterations: int) -> int:
    x = 0
    for i in range(iterations):
        x += i * i
    return x


def measure_host_speed_spread(calls: int = 512, unit_ms: float = 1.0) -> dict:
    """How steadily this thread runs a fixed piece of pure-Python work of about ``unit_ms`` (a decode step call's
    host time), timed ``calls`` times back to back: ``{"unit_ms_p50", "p99_ms", "p99_over_median",
    "over_1_25x_median", ...}``.

    A decode loop's step-call p99 / median measures the host as much as the engine: on H100 hosts a fixed ~85 us of
    Python timed beside every MTP 3 verify call had rank correlation 0.59-0.70 with the call's time
    (``experiments/results/probes/call_jitter_50k_mtp3_canary_h100_f31a144.json``), and the same code's p99 / median
    was 1.24-1.42 on one host and 3.36-5.26 on another. Where this figure is as large as the step calls', their
    spread is the machine's speed, not work the engine does on some calls."""
    if calls < 2 or unit_ms <= 0:
        raise ValueError(f"measure_host_speed_spread: calls={calls} and unit_ms={unit_ms}; need calls >= 2 and "
                         "unit_ms > 0")
    probe = 2000
    fastest = min(_timed(_python_work, probe) for _ in range(5))
    iterations = max(1, round(probe * unit_ms * 1e-3 / max(fastest, 1e-9)))
    times = np.array([_timed(_python_work, iterations) for _ in range(calls)]) * 1e3
    med = float(np.median(times))
    p99 = float(np.percentile(times, 99))
    return {"unit_ms_p50": med, "p99_ms": p99, "max_ms": float(times.max()), "p99_over_median": p99 / med,
            "over_1_25x_median": int(np.count_nonzero(times > 1.25 * med)), "calls": calls,
            "iterations": iterations, "method": "a pure-Python loop of fixed length, timed back to back"}


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------------------
# Routed experts, from the model
# ----------------------------------------------------------------------------------------------------------------
_PROBE_SINK: list = []  # the running probe's records (the instrumented steps' callbacks append here)
_PROBE_STEPS: dict = {}  # id(module) -> (module, Steps): instrumented steps, traced once per shape and reused


def _record(path: str, idx) -> None:
    if _PROBE_SINK:
        _PROBE_SINK[-1].setdefault(path, []).append(np.asarray(idx))


def _interceptor(next_fun, args, kwargs, context):
    """At trace time: after each MoE layer, send its expert choices (the model's router on the layer's input) to the
    host."""
    import jax

    from glm53.model import MoE, route

    out = next_fun(*args, **kwargs)
    m = context.module
    if isinstance(m, MoE) and context.method_name == "__call__":
        cfg = m.cfg
        x = args[0] if args else kwargs["x"]
        idx, _ = route(x.reshape(-1, cfg.hidden_size), m.get_variable("params", "gate"),
                       m.get_variable("params", "e_score_correction_bias"), cfg)
        jax.debug.callback(functools.partial(_record, "/".join(m.scope.path)), idx)
    return out


def check_routing_probe_runs() -> None:
    """Raise, saying how to fix it, when ``probe_routing`` cannot run in this process: its host callbacks need
    JAX's CPU backend, which ``JAX_PLATFORMS=cuda`` leaves out. Experiments call it before their timed runs."""
    import jax

    try:
        jax.devices("cpu")
    except RuntimeError as err:
        raise RuntimeError("the routing probe sends expert choices to the host with jax.debug.callback, which needs "
                           "JAX's CPU backend: leave JAX_PLATFORMS unset or list cpu in it (e.g. 'cuda,cpu')") from err


def probe_routing(engine, requests: Mapping[int, int], *, rollback: bool = True, **generate_kw) -> dict:
    """Run ``engine.generate(requests, **generate_kw)`` once through instrumented copies of the engine's decode /
    verify / draft steps: every MoE layer's expert choices (the model's own router on the layer's real input) are
    sent to the host each step (``jax.debug.callback``). The copies are jitted apart (a ``glm53.steps.Steps`` of
    their own, traced under a Flax method interceptor: one extra compile per shape, reused by later probes), so the
    engine's own compiled steps stay free of callbacks; outputs are those of an uninstrumented run. With
    ``rollback`` the generated tokens are rolled back after (the sessions end where they began, their last token
    pending).

    Returns ``{"calls": {module path: [int32[N, k] expert ids of each call, rows lane-major (lane b: rows b*T ..
    b*T + T - 1), N = bucket x T]}, "tokens": {sid: [ids]}, "bucket", "tokens_per_lane", "steps", "lanes": [sid of
    each lane]}``. Module paths: ``layers_<i>/mlp`` for main layers, ``mtp_layer/block/mlp`` for the MTP drafts."""
    import flax.linen as nn
    import jax

    from glm53.steps import Steps

    # Checked first: a callback that fails inside a step poisons every later read of the device's results.
    check_routing_probe_runs()
    if engine.pipeline is not None:
        # Its copies are the whole model's steps; a pipeline's cache holds each stage's layers only (its steps
        # failed with an IndexError on the layer tables).
        raise NotImplementedError("the routing probe instruments the whole model's decode steps, and an engine on "
                                  "pipeline stages (mesh.stages > 1) runs a program per stage: probe the routing on "
                                  "one device or a tensor-parallel mesh, or take the uniform expectation")
    module = engine.model.module
    entry = _PROBE_STEPS.get(id(module))
    if entry is None or entry[0] is not module:
        entry = _PROBE_STEPS[id(module)] = (module, Steps(module))
    probe_steps = entry[1]
    mtp = int(generate_kw.get("mtp", 0))
    names = ("verify", "draft", "decode") if mtp else ("decode",)
    calls: dict[str, list] = {}
    saved, saved_ring = dict(engine._steps), engine.output_ring
    for name in names:
        engine._steps[name] = probe_steps.for_cache(name, engine.cache)
    # The probe's steps are the engine's plain jits (engine._steps). An engine on one GPU decodes through its output
    # rings instead (Engine.output_ring), which the model builds from its own steps: under the interceptor those were
    # the instrumented ones, and their callbacks cannot be cloned into a ring (pickling failed on an H100 at
    # 86aeb5b: experiments.throughput fell back to uniform routing). One executable, fresh outputs: the probe's
    # step calls are not timed.
    engine.output_ring = 1
    _PROBE_SINK.append(calls)
    try:
        with nn.intercept_methods(_interceptor):
            out = engine.generate(dict(requests), **generate_kw)
            jax.effects_barrier()
    finally:
        _PROBE_SINK.pop()
        engine._steps.clear()
        engine._steps.update(saved)
        engine.output_ring = saved_ring
    run = engine.last_run
    if rollback:
        for sid, toks in out.items():
            engine.rollback(sid, len(toks))
    return {"calls": calls, "tokens": out, "bucket": run.bucket, "tokens_per_lane": mtp + 1, "steps": run.steps,
            "lanes": list(run.sids)}


def distinct_experts(probe: dict, cfg: ModelConfig, lanes: int | None = None) -> dict:
    """Distinct routed experts per step from ``probe_routing``'s records, over the rows of the first ``lanes``
    lanes (default: every lane of the bucket, padding lanes included: the kernel computes them too).

    Returns ``{"per_layer": [mean distinct experts per step, one per main MoE layer in layer order], "mtp_draft":
    mean per draft call or None, "calls": steps averaged, "lanes", "source"}``."""
    T = probe["tokens_per_lane"]
    n_lanes = probe["bucket"] if lanes is None else int(lanes)
    rows = n_lanes * T

    def mean_distinct(arrs, rows_):
        vals = [len(np.unique(a[:rows_])) for a in arrs]
        return float(np.mean(vals)) if vals else None

    per_layer = []
    calls = 0
    for l in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(l):
            continue
        arrs = probe["calls"].get(f"layers_{l}/mlp", [])
        # Under MTP a generate may begin with one plain decode step (T = 1) before its verify steps: keep the
        # calls of the step kind being measured where there are any.
        full = [a for a in arrs if a.shape[0] == probe["bucket"] * T]
        arrs = full or arrs
        if not arrs:
            raise ValueError(f"the routing probe recorded nothing for MoE layer {l}")
        per_layer.append(mean_distinct(arrs, rows))
        calls = len(arrs)
    drafts = probe["calls"].get("mtp_layer/block/mlp", [])
    return {"per_layer": per_layer, "mtp_draft": mean_distinct(drafts, n_lanes), "calls": calls,
            "lanes": n_lanes, "source": f"probe: the model's routing of {n_lanes} lane(s) x {T} token(s), mean of "
                                        f"{calls} step(s)"}


def miss_fraction_of(stats: Mapping[str, Any] | None) -> float:
    """Offload: the share of gathered rows read from host memory, from cache-stat deltas (hits, misses,
    ring_reads); 0.0 without stats."""
    if not stats:
        return 0.0
    n = stats.get("hits", 0) + stats.get("misses", 0) + stats.get("ring_reads", 0)
    return float(stats.get("misses", 0) / n) if n else 0.0

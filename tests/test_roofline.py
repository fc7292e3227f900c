"""glm53.roofline: decode byte accounting against the parameter pytree and hand-computed numbers (tiny and
h200_bench), the roofline report, the bandwidth benchmark (on the CPU) and the routing probe on the tiny model."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm53
from configs import h200_bench, tiny
from glm53 import roofline
from glm53.params import param_shapes

TINY = glm53.ModelConfig.from_config_dict(tiny.get_config().model)
BENCH = glm53.ModelConfig.from_config_dict(h200_bench.get_config().model)
BENCH_CC = glm53.CacheConfig.from_config_dict(h200_bench.get_config().cache)  # resident, q8g64, model-dtype keys


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("cfg,dtype", [(TINY, "float32"), (TINY, "bfloat16"), (BENCH, "bfloat16")],
                         ids=["tiny-f32", "tiny-bf16", "h200_bench-bf16"])
def test_parameter_bytes_are_what_the_parameters_allocate(cfg, dtype):
    pb = roofline.parameter_bytes(cfg, dtype)
    assert pb["total"] == _nbytes(param_shapes(cfg, jnp.dtype(dtype)))
    # param_count() x itemsize, with the f32 leaves (routers, their biases, the indexer's weights_proj) at 4 bytes
    w = np.dtype(dtype).itemsize
    moe = sum(cfg.is_moe_layer(l) for l in range(cfg.num_cache_layers))
    f32 = moe * (cfg.hidden_size + 1) * cfg.n_routed_experts + len(cfg.full_indexer_layers) * cfg.hidden_size * \
        cfg.index_n_heads
    assert pb["total"] == cfg.param_count() * w + f32 * (4 - w)


def test_h200_bench_parameters_by_hand():
    pb = roofline.parameter_bytes(BENCH, "bfloat16")
    assert pb["total"] == 17_747_468_288  # configs/h200_bench.py: 8,871,964,544 params, 17.7 GB
    attn = (6144 * 2048 + 2048 * 64 * 256 + 6144 * 576 + 512 * 64 * (192 + 256) + 64 * 256 * 6144) * 2
    assert pb["attention_weights"] == 9 * attn  # 8 layers + the MTP layer
    assert pb["routed_experts"] == 8 * 16 * 3 * 6144 * 2048 * 2  # 7 MoE layers + the MTP layer's
    assert pb["lm_head"] == pb["embeddings"] == 154880 * 6144 * 2


def test_decode_bytes_h200_bench_one_token_by_hand():
    """One session at a 50,000-row history: every number below is computed by hand from configs/h200_bench.py."""
    b = roofline.decode_bytes(BENCH, BENCH_CC, 50_000, 1)
    p = b["parts"]
    expert = 3 * 6144 * 2048 * 2
    assert b["routed_experts"]["per_layer"] == [8.0] * 7 and b["routed_experts"]["source"].startswith("exact")
    assert p["routed_experts"] == 7 * 8 * expert  # one token: num_experts_per_tok of 16 experts in 7 MoE layers
    assert p["shared_experts"] == 7 * expert
    assert p["router"] == 7 * (6144 * 16 + 16) * 4
    assert p["dense_mlp"] == 3 * 6144 * 12288 * 2
    attn = (6144 * 2048 + 2048 * 64 * 256 + 6144 * 576 + 512 * 64 * 448 + 64 * 256 * 6144) * 2
    assert p["attention_weights"] == 8 * attn + 6144 * 576 * 2  # + the MTP layer's kv_a (its row of the token)
    idx_q = 2048 * 32 * 128 * 2 + 6144 * 32 * 4
    idx_k = (6144 * 128 + 2 * 128) * 2
    assert p["indexer_weights"] == 4 * (idx_q + idx_k) + idx_k  # 4 full layers; the MTP layer's key path
    assert p["lm_head"] == 154880 * 6144 * 2
    assert p["embeddings"] == 2 * 6144 * 2  # the token's row, for the main model and the MTP layer
    assert p["mtp_projection"] == 2 * 6144 * 6144 * 2
    # KV rows: 8 layers x 2,048 selected rows x 656 B (q8g64); keys: 4 full layers x 50,001 positions x 128 x 2 B
    assert p["kv_rows"] == 8 * 2048 * 656
    assert p["indexer_keys"] == 4 * 50_001 * 256
    assert p["cache_writes"] == 9 * 656 + 5 * 256
    assert b["host_total"] == 0 and p["offload_hbm"] == 0
    assert b["total"] == sum(p.values()) and b["tokens_per_step"] == 1
    assert 9.9e9 < b["weights"] < 10.1e9  # ~10 GB per token (README: 8 of 16 experts + shared, attention, head)


def test_every_expert_read_is_the_parameters_minus_what_decode_skips():
    """With every routed expert read, a decode step reads every parameter except the embedding table (one row per
    token instead, for the main model and the MTP layer) and the MTP module's parts that only drafts run."""
    for cfg, dtype, cc in ((TINY, "float32", glm53.CacheConfig(kv_format="f32")), (BENCH, "bfloat16", BENCH_CC)):
        w = np.dtype(dtype).itemsize
        pb = roofline.parameter_bytes(cfg, dtype)
        moe_layers = sum(cfg.is_moe_layer(l) for l in range(cfg.num_hidden_layers))
        b = roofline.decode_bytes(cfg, cc, 100, 3, [cfg.n_routed_experts] * moe_layers, dtype)
        h, q = cfg.hidden_size, cfg.q_lora_rank
        mtp_skipped = (  # the MTP block's query / output path, indexer query path, MLP and post norm; the head norm
            (h * q + q * cfg.num_attention_heads * cfg.qk_head_dim
             + cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
             + cfg.num_attention_heads * cfg.v_head_dim * h) * w
            + q * cfg.index_n_heads * cfg.index_head_dim * w + h * cfg.index_n_heads * 4
            + 3 * h * cfg.moe_intermediate_size * (cfg.n_routed_experts + cfg.n_shared_experts) * w
            + (h * cfg.n_routed_experts + cfg.n_routed_experts) * 4
            + h * w + q * w + h * w)
        assert b["weights"] == pb["total"] - pb["embeddings"] + 2 * 3 * h * w - mtp_skipped
        assert b["routed_experts"]["source"] == "given"


def test_uniform_routing_expectation():
    E, k = 16, 8
    assert roofline.expected_distinct_experts(E, k, 1) == 8
    assert roofline.expected_distinct_experts(E, k, 2) == 12  # 16 * (1 - 1/4)
    assert roofline.expected_distinct_experts(E, k, 4) == 15
    assert abs(roofline.expected_distinct_experts(E, k, 64) - 16) < 1e-9
    b = roofline.decode_bytes(BENCH, BENCH_CC, 8192, 4)
    assert b["routed_experts"]["per_layer"] == [15.0] * 7 and "uniform" in b["routed_experts"]["source"]
    assert b["parts"]["routed_experts"] == 7 * 15 * 3 * 6144 * 2048 * 2
    # weights are per step: the batch shares them
    assert b["per_session"]["weights_amortised"] == b["weights"] / 4


def test_given_routing_per_layer_and_batch_scaling():
    cc = glm53.CacheConfig(kv_format="bf16")
    b1 = roofline.decode_bytes(TINY, cc, 100, 1, dtype="float32")
    b = roofline.decode_bytes(TINY, cc, [100, 200], 2, [3, 4, 5], "float32", routed_source="probe")
    expert = 3 * 64 * 32 * 4
    assert b["parts"]["routed_experts"] == 12 * expert and b["routed_experts"]["source"] == "probe"
    # per lane: min(top-k 32, position + 1) rows in each of 4 layers, keys of the live history in 2 full layers
    assert b["parts"]["kv_rows"] == 2 * 4 * 32 * 1152
    assert b["parts"]["indexer_keys"] == 2 * (101 + 201) * 128 * 4
    assert b["parts"]["kv_rows"] == 2 * b1["parts"]["kv_rows"]
    # a history shorter than the top-k reads what exists
    short = roofline.decode_bytes(TINY, cc, 10, 1, dtype="float32")
    assert short["parts"]["kv_rows"] == 4 * 11 * 1152
    with pytest.raises(ValueError):
        roofline.decode_bytes(TINY, cc, 100, 1, [1, 2], "float32")  # 3 MoE layers


def test_fp8_index_keys_and_kv_formats():
    b = roofline.decode_bytes(BENCH, BENCH_CC.replace(index_keys="fp8"), 50_000, 1)
    assert b["parts"]["indexer_keys"] == 4 * 50_001 * (128 + 4)  # e4m3 values + one f32 scale per key
    b16 = roofline.decode_bytes(BENCH, BENCH_CC.replace(kv_format="bf16"), 50_000, 1)
    assert b16["parts"]["kv_rows"] == 8 * 2048 * 1152


def test_offload_misses_come_from_host_memory():
    cc = BENCH_CC.replace(mode="offload")
    hit = roofline.decode_bytes(BENCH, cc, 50_000, 2)
    b = roofline.decode_bytes(BENCH, cc, 50_000, 2, miss_fraction=0.25)
    rows = 2 * 8 * 2048
    assert b["parts"]["kv_rows"] == 0.75 * rows * 656 and b["host"]["kv_rows_from_host"] == 0.25 * rows * 656
    assert b["host"]["copyback_to_host"] == 2 * 9 * 656  # the step's rows of every cache layer, amortised
    assert b["parts"]["offload_hbm"] == 0.25 * rows * 656 + 2 * 9 * 656  # fills + the copyback's ring reads
    assert hit["host"]["kv_rows_from_host"] == 0 and b["weights"] == hit["weights"]
    # a miss trades its HBM read for a host read plus a fill (an HBM write)
    assert b["total"] == hit["total"] and b["host_total"] > hit["host_total"]
    with pytest.raises(ValueError):
        roofline.decode_bytes(BENCH, BENCH_CC, 50_000, 1, miss_fraction=0.1)  # resident reads no host memory


def test_mtp_verify_step():
    D, B = 2, 3
    b0 = roofline.decode_bytes(BENCH, BENCH_CC, 50_000, B)
    b = roofline.decode_bytes(BENCH, BENCH_CC, 50_000, B, mtp=D)
    p = b["parts"]
    assert b["tokens_per_step"] == B * (D + 1)
    assert p["lm_head"] == (1 + D) * 154880 * 6144 * 2  # the verify's logits, then one per draft
    assert p["embeddings"] == (2 * B * (D + 1) + D * B) * 6144 * 2
    assert p["kv_rows"] == B * (8 * (D + 1) + D) * 2048 * 656  # main layers x T rows, the MTP layer per draft
    assert b["routed_experts"]["tokens"] == B * (D + 1) and "mtp_draft" in b["routed_experts"]
    assert b["weights"] > b0["weights"]


def test_roofline_report():
    r = roofline.roofline_report(4e9, 4e12, 2e-3, 1)
    assert r["ideal_step_ms"] == pytest.approx(1.0) and r["achieved_step_ms"] == pytest.approx(2.0)
    assert r["ratio"] == pytest.approx(2.0) and r["fraction_of_roofline"] == pytest.approx(0.5)
    assert r["ideal_tokens_per_s"] == pytest.approx(1000) and r["achieved_tokens_per_s"] == pytest.approx(500)
    b = roofline.decode_bytes(BENCH, BENCH_CC.replace(mode="offload"), 50_000, 16, miss_fraction=0.01)
    r = roofline.roofline_report(b, 4e12, 10e-3, 16, host_bandwidth_Bps=40e9)
    assert r["bytes_per_step"] == b["total"] and r["bytes_per_token"] == b["total"] / 16
    assert r["host_bytes_per_step"] == b["host_total"] > 0
    assert r["ideal_step_ms_with_host"] == pytest.approx(r["ideal_step_ms"] + b["host_total"] / 40e9 * 1e3)
    assert "GB/step" in roofline.summary_line(b, r)
    with pytest.raises(ValueError):
        roofline.roofline_report(1e9, 0, 1e-3, 1)


def test_fp8_experts_bytes():
    for cfg in (TINY, BENCH):
        pb = roofline.parameter_bytes(cfg, "bfloat16", "fp8")
        assert pb["total"] == _nbytes(param_shapes(cfg, jnp.bfloat16, expert_weights="fp8"))
    b = roofline.decode_bytes(BENCH, BENCH_CC, 1000, 1, expert_weights="fp8")
    assert b["parts"]["routed_experts"] == 7 * 8 * 3 * (6144 * 2048 + 48 * 16 * 4)


def test_measure_bandwidth_on_the_cpu():
    bw = roofline.measure_hbm_bandwidth(4 << 20, iters=2, repeats=2)
    assert bw["bandwidth_Bps"] > 0 and bw["copy_GBps"] > 0 and bw["read_GBps"] > 0
    assert bw["bandwidth_Bps"] == pytest.approx(max(bw["copy_GBps"], bw["read_GBps"]) * 1e9, rel=1e-12)
    assert bw["array_bytes"] == 4 << 20 and bw["passes"] == 2 and bw["platform"] == "cpu"


def test_host_speed_spread_times_a_unit_near_the_one_asked_for():
    r = roofline.measure_host_speed_spread(calls=64, unit_ms=0.5)
    assert r["calls"] == 64 and r["iterations"] > 0
    # calibrated on the fastest of five probes, so the median unit is at least roughly the size asked for; a busy
    # CI machine may run it slower, never 10x faster
    assert 0.05 < r["unit_ms_p50"] < 50
    assert r["unit_ms_p50"] <= r["p99_ms"] <= r["max_ms"] and r["p99_over_median"] >= 1
    assert 0 <= r["over_1_25x_median"] <= 64
    for bad in ({"calls": 1}, {"unit_ms": 0}):
        with pytest.raises(ValueError, match="need calls >= 2 and unit_ms > 0"):
            roofline.measure_host_speed_spread(**bad)


def test_best_bandwidth_keeps_the_fastest_probe():
    slow, fast = ({"bandwidth_Bps": g * 1e9, "read_GBps": g} for g in (3750.0, 3983.0))
    best = roofline.best_bandwidth(slow, fast)
    assert best["bandwidth_Bps"] == fast["bandwidth_Bps"] and best["read_GBps"] == 3983.0
    assert best["probes_GBps"] == [3750.0, 3983.0] and "probes_GBps" not in fast  # the probes are left as they were
    assert roofline.best_bandwidth(fast, slow)["bandwidth_Bps"] == fast["bandwidth_Bps"]


@pytest.mark.devices(2)
def test_routing_probe_refuses_pipeline_stages_before_running():
    """On pipeline stages the probe's whole-model steps met a per-stage cache and failed inside a generate
    (IndexError on the layer tables, caught by the experiments as a failed probe): now a clear error, sessions
    untouched."""
    model = glm53.from_config(TINY, seed=0, dtype="float32", mesh=glm53.MeshConfig(stages=2))
    e = glm53.Engine(model, glm53.CacheConfig(kv_format="f32", max_len=128), max_sessions=1, kernels="reference")
    sid = e.open(list(range(1, 30)))
    with pytest.raises(NotImplementedError, match="pipeline stages"):
        roofline.probe_routing(e, {sid: 4})
    assert e.tokens(sid) == list(range(1, 30)) and e.generate({sid: 2})[sid]


@pytest.mark.parametrize("ring", [False, True])
def test_routing_probe_on_the_tiny_model(ring):
    """ring: the engine's decode loop through its output rings, as on one GPU (``engine.output_ring_for``). The
    probe's instrumented steps are plain jits: through a ring the loop built the model's own steps under the probe's
    interceptor, whose callbacks an executable cannot be cloned with (an H100 run's probe failed so at 86aeb5b)."""
    model = glm53.from_config(TINY, seed=0, dtype="float32")
    e = glm53.Engine(model, glm53.CacheConfig(kv_format="f32", max_len=128), max_sessions=2, kernels="reference")
    e.output_ring = glm53.engine._Run.LAG + 1 if ring else 1  # either way on any platform (a GPU's default: rings)
    rng = np.random.default_rng(0)
    sids = [e.open(rng.integers(0, TINY.vocab_size, 40).tolist()) for _ in range(2)]
    probe = roofline.probe_routing(e, {s: 4 for s in sids})
    # the instrumented run decodes what the engine's own steps decode (sessions rolled back in between)
    plain = e.generate({s: 4 for s in sids})
    assert probe["tokens"] == plain
    moe = [l for l in range(TINY.num_hidden_layers) if TINY.is_moe_layer(l)]
    assert sorted(probe["calls"]) == [f"layers_{l}/mlp" for l in moe]
    k = TINY.num_experts_per_tok
    for arrs in probe["calls"].values():
        assert len(arrs) == probe["steps"] == 3 and all(a.shape == (2, k) for a in arrs)
    one = roofline.distinct_experts(probe, TINY, lanes=1)
    both = roofline.distinct_experts(probe, TINY)
    assert one["per_layer"] == [float(k)] * len(moe)  # one token: exactly k distinct experts
    assert all(k <= d <= min(TINY.n_routed_experts, 2 * k) for d in both["per_layer"])
    assert both["calls"] == 3 and "probe" in both["source"]
    b = roofline.decode_bytes(TINY, e.cache_config, 45, 2, both["per_layer"], "float32", routed_source=both["source"])
    assert b["parts"]["routed_experts"] == sum(both["per_layer"]) * 3 * 64 * 32 * 4
    # the engine's own steps stayed uninstrumented: nothing is recorded outside a probe
    assert not roofline._PROBE_SINK
    e.generate({s: 2 for s in sids})
    assert e.output_ring == (glm53.engine._Run.LAG + 1 if ring else 1)  # the engine's own setting, back after it
    if ring:
        assert e._rings, "the engine's own decode went through its rings"



def test_routing_probe_without_the_cpu_backend_fails_first(monkeypatch):
    """JAX_PLATFORMS=cuda leaves out the CPU backend the probe's callbacks need: the check says how to fix it, and
    the throughput experiment refuses before building anything (an H200 run once lost its probe this way)."""
    import os
    import subprocess
    import sys

    import jax

    real = jax.devices

    def devices(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return real(backend)

    monkeypatch.setattr(jax, "devices", devices)
    with pytest.raises(RuntimeError, match="list cpu in it"):
        roofline.check_routing_probe_runs()
    # a platform list without cpu (nothing here has a TPU: the CPU backend is what is missing)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "experiments.throughput", "--config=configs/tiny.py"], cwd=root,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "tpu"})
    assert p.returncode == 1 and "--routing=uniform" in p.stderr, p.stderr[-2000:]

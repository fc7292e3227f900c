"""Every configs/*.py maps onto the typed configs; the full-size and H200 configs have the sizes they claim; the
absl entry point runs with command-line overrides."""

import glob
import importlib
import json
import os

import pytest

import glm53
import python_runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not p.endswith("__init__.py"))


def get(name):
    return importlib.import_module(f"configs.{name}").get_config()


def test_expected_configs_exist():
    assert {"tiny", "glm5", "h200_bench"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_maps_onto_typed_configs(name):
    c = get(name)
    model = glm53.ModelConfig.from_config_dict(c.model)
    cache = glm53.CacheConfig.from_config_dict(c.cache)
    assert model.param_count() > 0 and cache.mode in ("resident", "offload")
    assert c.dtype in ("float32", "bfloat16")
    assert {"prompt_len", "batch", "max_new_tokens", "temperature", "top_p", "seed", "output_json",
            "compare_resident"} <= set(c.run.keys())
    assert c.run.prompt_len + c.run.max_new_tokens <= model.max_position_embeddings
    assert model == glm53.ModelConfig.from_hf(model.to_hf())
    assert glm53.MeshConfig.from_config_dict(c.mesh) == glm53.MeshConfig()  # one device by default


def test_h200x8_1m_plans_16_million_token_sessions_on_8_h200s():
    """What configs/h200x8_1m.py claims, from shapes: 16 sessions of 1M tokens fit 8 x H200 (139 GiB each, 560 GiB of
    host RAM) as 8 stages, with more layers than the one-GPU configs."""
    from glm53 import memory

    c = get("h200x8_1m")
    cfg = glm53.ModelConfig.from_config_dict(c.model)
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    assert cfg.num_hidden_layers > glm53.ModelConfig.from_config_dict(get("h200_1m").model).num_hidden_layers
    p = memory.plan(cfg, cc, sessions=16, history=c.run.prompt_len, dtype=c.dtype, mesh_shape={"stage": 8, "tp": 1},
                    device_bytes=139 << 30, host_bytes=560 << 30)
    assert p["fits_device"] and p["fits_host"] and p["max_sessions_by_host"] >= 16
    assert len(p["stages"]) == 8 and sum(len(s["layers"]) for s in p["stages"]) == cfg.num_cache_layers


def test_glm5_full_size():
    c = get("glm5")
    m = glm53.ModelConfig.from_config_dict(c.model)
    assert m == glm53.ModelConfig()  # exactly the library's full-size defaults (transformers GlmMoeDsaConfig)
    n = m.param_count()
    print(f"GLM-5 parameters: {n:,} ({n / 1e9:.2f}B)")
    assert 744e9 <= n <= 754e9  # published ~744B total (MTP included)
    assert (c.cache.mode, c.cache.kv_format, c.cache.hot_rows, c.cache.copyback_every, c.cache.prefill_chunk) == \
        ("offload", "q8g64", 32768, 64, 2048)
    assert c.dtype == "bfloat16" and m.num_cache_layers == 79 and set(m.indexer_types) == {"full"}


def test_h200_bench_fits_one_h200():
    c = get("h200_bench")
    m = glm53.ModelConfig.from_config_dict(c.model)
    full = glm53.ModelConfig()
    for f in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "vocab_size",
              "intermediate_size", "moe_intermediate_size", "num_experts_per_tok"):
        assert getattr(m, f) == getattr(full, f), f
    assert (m.num_hidden_layers, m.first_k_dense_replace, m.n_routed_experts) == (8, 1, 16)
    assert m.indexer_types == ("full", "shared") * 4
    gb = 2 * m.param_count() / 1e9  # bf16
    print(f"h200_bench: {m.param_count():,} params, {gb:.1f} GB in bf16")
    assert gb < 60
    assert c.run.prompt_len == 8192 and c.cache.mode == "resident" and c.cache.kv_format == "q8g64"


def _run_generate(*extra, config=("--config=configs/tiny.py",)):
    return python_runner.run(["-m", "experiments.generate", *config, "--config.run.max_new_tokens=3",
                              "--config.run.prompt_len=20", "--config.run.batch=1", *extra], cwd=ROOT, timeout=300)


def test_generate_entry_point_with_overrides(tmp_path):
    """Without --config the main job runs the tiny config (a new user's first command: it once ended in an
    AttributeError on a config of None)."""
    out = tmp_path / "res" / "run.json"
    p = _run_generate(f"--config.run.output_json={out}", config=())
    assert p.returncode == 0, p.stderr[-3000:]
    assert "1 x 20-token prompts, 3 new tokens" in p.stdout
    lines = [l for l in p.stdout.splitlines() if l.startswith("session 0: [")]
    assert len(lines) == 1 and len(json.loads(lines[0].split(": ", 1)[1])) == 3
    assert "decode" in p.stdout and "tok/s" in p.stdout and "Model(" in p.stdout
    report = json.loads(out.read_text())
    assert report["config"]["run"]["prompt_len"] == 20 and report["config"]["run"]["max_new_tokens"] == 3
    assert report["config"]["model"] == json.loads(json.dumps(get("tiny").model.to_dict()))
    assert len(report["git"]["commit"]) == 40 and isinstance(report["git"]["dirty"], bool)
    assert "--config.run.prompt_len=20" in report["command"] and "experiments" in report["command"]
    assert report["figures"]["run"]["decode_tokens_per_s"] > 0 and report["jax_version"]
    assert len(report["tokens"]) == 1 and len(report["tokens"][0]) == 3


def test_generate_entry_point_rejects_unknown_override():
    p = _run_generate("--config.run.no_such_field=1")
    assert p.returncode != 0


@pytest.mark.devices(2)
def test_generate_entry_point_on_a_tensor_parallel_mesh(tmp_path):
    """--config.mesh.tp=2 and --config.mesh.stages=2 on the CPU's host devices, each against one device in the same
    run (--compare_one_device): stages bit-identical; tp the same tokens, float32 logits within 1e-5."""
    for flag, exact in (("--config.mesh.tp=2", False), ("--config.mesh.stages=2", True)):
        out = tmp_path / f"{flag[-7:]}.json"
        p = _run_generate(flag, "--config.dtype=float32", "--compare_one_device=4", f"--config.run.output_json={out}")
        assert p.returncode == 0, p.stderr[-3000:]
        cmp = json.loads(out.read_text())["figures"]["one_device"]
        assert cmp["tokens"] == 4 and cmp["tokens_identical"], cmp
        assert cmp["logits_bit_identical"] if exact else cmp["logits_max_rel_err"] < 1e-5, cmp
        assert cmp["as_expected"] and "1e-5" in cmp["expected"] or exact, cmp
    p = _run_generate("--compare_one_device=4")  # nothing to compare with on one device
    assert p.returncode != 0 and "set config.mesh" in p.stderr
    p = _run_generate("--config.mesh.stages=8")  # tiny has 4 layers
    assert p.returncode != 0 and "mesh.stages=8 is more than the model's 4 layers" in p.stderr
    assert "Traceback" not in p.stderr, p.stderr[-3000:]  # one line, as the other settings


@pytest.mark.devices(2)
def test_compare_one_device_expects_no_1e5_bound_of_quantised_rows(tmp_path):
    """With q8g64 rows a tp=2 mesh's logits differ from one device's by a rounding step of a row (7e-4 here), not
    within 1e-5: the comparison must not promise the float32 rows' bound, and says whether the run met its own."""
    out = tmp_path / "q8.json"
    p = _run_generate("--config.mesh.tp=2", "--config.cache.kv_format=q8g64", "--compare_one_device=8",
                      "--config.run.prompt_len=100", f"--config.run.output_json={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    cmp = json.loads(out.read_text())["figures"]["one_device"]
    assert "1e-5 relative" not in cmp["expected"] and "q8g64" in cmp["expected"], cmp
    assert cmp["tokens_identical"] and cmp["kv_format"] == "q8g64", cmp
    assert cmp["as_expected"] and "as expected" in p.stdout

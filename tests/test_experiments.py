"""The offload experiments' entry points run end to end on the tiny config (CPU: timings meaningless, structure and
output equality checked): the resident/offload A/B, the decode profiler and the kernel benchmarks."""

import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest

from experiments import compare_profiles
from kernels_pallas import ops
import python_runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
# configs/tiny.py cut to its first two layers (dense + MoE, a full and a shared indexer; MTP kept): every code path
# of the entry points at half the layers XLA compiles, each entry point being a process of its own
TINY = ["--config=configs/tiny.py", "--config.run.prompt_len=100", "--config.run.batch=1",
        "--config.model.num_hidden_layers=2", "--config.model.indexer_types=('full','shared')"]


# The fields of TINY an entry point does not read, and so refuses (cli.refuse_unread_overrides)
UNREAD = {"experiments.throughput": ("run.prompt_len", "run.batch"), "experiments.sessions_ab": ("run.batch",),
          "experiments.live_history_ab": ("run.batch",), "experiments.sessions_1m": ("run.batch",),
          "experiments.profile_prefill": ("run.batch",)}


def tiny(module):
    """TINY without the overrides ``module`` would refuse."""
    return [a for a in TINY if not any(a.startswith(f"--config.{f}=") for f in UNREAD.get(module, ()))]


def _run(module, *args, env=None):
    p = python_runner.run(["-m", module, *tiny(module), *args], cwd=ROOT, timeout=600,
                          env=None if env is None else {**os.environ, **env})
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_offload_ab(tmp_path):
    out = tmp_path / "ab.json"
    _run("experiments.offload_ab", "--config.run.max_new_tokens=20", "--workloads=local99", f"--out={out}",
         env={"XLA_GLM53_PROVENANCE_CHECK": "set"})
    report = json.loads(out.read_text())
    # what the run's XLA / JAX environment was travels with its command (an A/B under other XLA flags is another
    # experiment)
    assert report["environment"]["XLA_GLM53_PROVENANCE_CHECK"] == "set"
    assert all(k.startswith(("XLA_", "JAX_", "TF_CPP_")) for k in report["environment"])
    (pair,) = report["workloads"]["local99"]
    assert pair["tokens_identical"] and pair["logits_identical"]
    # the warm-up ran the timed shapes until nothing compiled: the timed runs compiled nothing (a prompt-chunk
    # warm-up left the settles of the timed page counts to compile inside the first timed offload run)
    assert report["warmup_compile_s"]["local99"][-1] == 0
    assert pair["compile_s"] == {"resident": 0.0, "offload": 0.0}
    assert not report["summary"]["local99"]["timed_runs_compiled"]
    assert pair["decode_hit_rate"] > 0.5 and pair["resident_decode_tok_s"] > 0 and pair["offload_decode_tok_s"] > 0
    for mode in ("resident", "offload"):
        # the host diagnostics: the step calls are part of the loop, and there is one time per decode step
        assert 0 < pair["decode_step_calls_s"][mode] <= pair["decode_host_loop_s"][mode]
        p = pair["decode_step_call_ms_percentiles"][mode]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
        gaps = pair["decode_step_interval_ms"][mode]  # when each step's tokens reached the host
        assert 0 < gaps["p50"] <= gaps["p99"] <= gaps["max"]
    assert len(pair["offload_slowest_step_calls"]) == 6
    summary = report["summary"]["local99"]
    assert summary["pairs"] == 1 and summary["all_identical"]
    assert summary["loss_pct_min"] == summary["loss_pct_median"] == summary["loss_pct_max"]
    assert summary["loss_interval_pct"]["pairs"] == 1 and summary["loss_interval_pct"]["hi"] is None
    assert abs(summary["pooled_loss_pct"] - pair["offload_loss_pct"]) < 1e-9
    # the decode's copybacks are accounted to steps (tiny: copyback_every=16; one step may copy a page per session)
    assert 0 < len(pair["offload_copyback_step_call_ms"]) <= pair["cache_stats"]["decode"]["copybacks"]
    assert pair["offload_other_step_call_ms_p50"] > 0


def test_profile_decode(tmp_path):
    # --out in a folder not made yet, as the README's prof/p.json: its HLO files beside it failed after the profile
    out, tmp = tmp_path / "prof" / "profile.json", tmp_path / "tmp"
    tmp.mkdir()
    p = _run("experiments.profile_decode", "--config.run.max_new_tokens=6", "--workload=drift0.001", f"--out={out}",
             env={"TMPDIR": str(tmp)})
    assert f"wrote {out}" in p.stdout
    assert {"decode_hlo_offload.txt", "decode_hlo_resident.txt", "profile.json"} <= {f.name for f in
                                                                                     out.parent.iterdir()}
    # without --trace_dir each mode's profiler trace is read, then removed (every run used to leave its traces in
    # the temp directory)
    assert not list(tmp.rglob("*.xplane.pb")), list(tmp.rglob("*"))
    report = json.loads(out.read_text())
    assert report["tokens_identical"]
    off, res = report["modes"]["offload"], report["modes"]["resident"]
    # offload's own work is attributed to its scopes, the resident cache's to its own
    for scope in ("offload_gather", "offload_fill", "offload_ring_write", "offload_classify"):
        assert off["per_scope_us_per_step"].get(scope, 0) > 0, scope
        assert scope not in res["per_scope_us_per_step"]
    assert res["per_scope_us_per_step"].get("resident_gather", 0) > 0
    # device time by op, layers summed: it adds up to the busy time, and both layers' cache writes are one entry
    ops = res["us_per_step_by_op"]
    assert sum(us for _, us in ops.values()) == pytest.approx(res["busy_us_per_step"])
    assert not any("layers_0" in k or "layers_1" in k for k in ops), list(ops)
    assert ops["GLM5/layers_*/self_attn/resident_write/scatter"][0] >= 2, list(ops)
    # experiments.compare_profiles matches two reports by op: offload against resident shows offload's own ops
    diff = compare_profiles.compare(report, {"modes": {"resident": off}}, "resident")
    assert diff["matched_by"] == "op"
    assert diff["busy_us_per_step"] == [res["busy_us_per_step"], off["busy_us_per_step"]]
    moved = {r["op"]: r for r in diff["ops"]}
    assert sum(r["us_delta"] for r in diff["ops"]) == pytest.approx(off["busy_us_per_step"] - res["busy_us_per_step"])
    assert any("offload_fill" in op and r["us_before"] == 0 and r["us_delta"] > 0 for op, r in moved.items())
    with pytest.raises(ValueError, match="no 'offload' profile"):
        compare_profiles.compare(report, {"modes": {"resident": res}}, "offload")
    assert off["busy_us_per_step"] > 0 and off["kernels_per_step"] > res["kernels_per_step"]
    # the CPU has no command buffers: every kernel is its own launch (on a GPU, 0 here is warned about)
    assert res["kernels_in_command_buffers_per_step"] == 0
    assert sum(res["kernels_outside_command_buffers_by_scope_per_step"].values()) == pytest.approx(
        res["kernels_per_step"])
    assert off["idle_us_per_step"] >= 0 and off["idle_before_scope_us_per_step"]
    # one step's kernels, in order, with offload's scopes among them (5 decode steps profiled: the middle one)
    seq = off["middle_step_sequence"]
    assert seq and {"offload_gather", "offload_fill"} <= {k[1] for k in seq}
    assert all(k[2] in ("graph", "lone") and k[4] >= 0 and k[5] >= 0 for k in seq)
    # in start order from the step's first kernel, and one step of several, not the whole run
    assert seq[0][3] == 0 and all(a[3] <= b[3] for a, b in zip(seq, seq[1:]))
    assert len(seq) < off["kernels_per_step"] * off["decode_steps_profiled"] / 2
    assert {"busy", "idle"} <= set(report["offload_minus_resident_us_per_step"])
    # the steady state: every profiled step, the median step's scopes and the first step apart
    steady = off["steady_state"]
    assert steady["steps"] == off["decode_steps_profiled"] == len(steady["busy_us_by_step"])
    assert steady["median_us"]["offload_gather"] > 0 and steady["first_step_us"]["offload_gather"] > 0
    # the host's side of the decode window: busy threads, and self times that never exceed the busy time
    host = off["host"]
    assert host["thread_busy_us_per_step"] and max(host["thread_busy_us_per_step"].values()) > 0
    assert 0 < sum(host["self_us_per_step"].values()) <= sum(host["thread_busy_us_per_step"].values()) + 1
    assert all(host["inclusive_us_per_step"][k] >= v - 0.01 for k, v in host["self_us_per_step"].items()
               if k in host["inclusive_us_per_step"])
    assert off["step_call_ms_while_profiled"]["p50"] > 0
    assert abs(sum(steady["busy_us_by_step"]) / steady["steps"] - off["busy_us_per_step"]) < 0.01 * off[
        "busy_us_per_step"] + 0.1
    assert "offload_gather" in report["offload_minus_resident_median_step_us"]
    assert (out.parent / "decode_hlo_offload.txt").read_text().startswith("HloModule")


def _bench(module, *args):
    p = python_runner.run(["-m", module, "--tiny", *args], cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


def test_loss_interval_and_target_verdict():
    from experiments.engine_runs import loss_interval_pct, target_verdict

    # abf301d's 10 x 50K local99 MTP 3 pairs: mean 1.3425, sample sd 0.61169, t(3) = 3.182
    iv = loss_interval_pct([0.52, 1.43, 2.00, 1.42])
    assert iv["pairs"] == 4 and abs(iv["mean"] - 1.3425) < 1e-9
    assert abs(iv["half_width"] - 3.182 * 0.61169 / 2) < 1e-4 and abs(iv["lo"] + iv["hi"] - 2 * iv["mean"]) < 1e-9
    assert target_verdict(iv, 1.0) == "undecided" and target_verdict(iv, 5.0) == "met"
    assert target_verdict(iv, 0.2) == "missed"
    one = loss_interval_pct([0.4])
    assert one["mean"] == 0.4 and one["hi"] is None and target_verdict(one, 1.0) == "undecided"
    # many pairs: the normal quantile
    many = loss_interval_pct([0.0, 1.0] * 20)
    assert abs(many["half_width"] - 1.96 * np.std([0.0, 1.0] * 20, ddof=1) / np.sqrt(40)) < 1e-9


def test_more_pairs_until_the_interval_is_narrow_or_the_budget_is_spent():
    from experiments.engine_runs import more_pairs

    kw = dict(pairs=2, max_pairs=6, half_width_pct=0.5, elapsed_s=10.0, budget_s=100.0)
    assert more_pairs([], **kw) == (True, False) and more_pairs([3.0], **kw) == (True, False)  # up to --pairs
    assert more_pairs([3.0, -1.0], **kw) == (True, False)  # wide: one more
    assert more_pairs([1.0, 1.01], **kw) == (False, False)  # narrow enough
    assert more_pairs([3.0, -1.0, 2.0, 0.0, 1.0, 2.0], **kw) == (False, False)  # max_pairs
    assert more_pairs([3.0, -1.0], **{**kw, "elapsed_s": 101.0}) == (False, True)  # the budget stops it
    assert more_pairs([3.0], **{**kw, "elapsed_s": 101.0}) == (True, False)  # but never below --pairs
    assert more_pairs([3.0, -1.0], **{**kw, "max_pairs": 0}) == (False, False)  # no --max_pairs: --pairs only


def test_each_setting_gets_a_share_of_the_budget_left():
    from experiments.engine_runs import setting_deadline_s

    assert setting_deadline_s(0.0, 300.0, 2) == 150.0  # the first of two settings: half
    assert setting_deadline_s(200.0, 300.0, 1) == 300.0  # the last: all that is left
    assert setting_deadline_s(100.0, 400.0, 3) == 200.0
    assert setting_deadline_s(350.0, 300.0, 2) == 350.0  # past the budget: stops now (its --pairs still run)
    assert setting_deadline_s(10.0, 0.0, 2) == 0.0  # no budget


def test_step_copies_names_a_copied_cache_parameter():
    """``experiments.step_copies`` finds a copy of a donated cache parameter in a compiled program, and none in one
    that updates it in place."""
    import functools

    import jax
    import jax.numpy as jnp

    from experiments.trace_util import copied_cache_params

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def keeps_old(cache, y):  # returns the old contents beside the updated ones: XLA must copy
        return {"a": cache["a"].at[0].set(y), "b": cache["b"] + 1}, cache["a"] * 1

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def in_place(cache, y):
        return {"a": cache["a"].at[0].set(y), "b": cache["b"] + 1}

    cache = {"a": jnp.zeros((64,)), "b": jnp.zeros((8,))}
    assert copied_cache_params(keeps_old.lower(cache, 1.0).compile().as_text()) == ["cache__a__.1"]
    assert copied_cache_params(in_place.lower(cache, 1.0).compile().as_text()) == []


def test_step_copies(tmp_path):
    out = tmp_path / "copies.json"
    _run("experiments.step_copies", "--modes=offload", "--mtp=1", f"--out={out}")
    report = json.loads(out.read_text())
    assert report["lanes"] == 1
    assert sorted(report["steps"]) == sorted(
        [f"offload decode, copy_pages={p}, selection override {s}" for p in (0, 2) for s in ("yes", "no")]
        + ["offload verify, depth 1", "offload draft, depth 1"])
    # No step copies a row plane or a slot map. The CPU's compiler copies some per-slot scalars (lengths, host_len,
    # the fill's round counters) that a GPU's does not (tests/test_step_copies); this run names them all the same.
    big = ("ring", "hot", "pool", "history", "index_key", "slot_of_position", "position_of_slot", "pin_round")
    copied = [n for names in report["steps"].values() for n in names]
    assert not [n for n in copied if any(b in n for b in big)], report["steps"]
    assert report["no_copies"] == (not any(report["steps"].values()))


def test_bench_hot_gather(tmp_path):
    out = tmp_path / "hg.json"
    # 512 decode rows, not --tiny's 2,048: the interpreted kernel's time grows with the rows (2,048 rows took ~30 s
    # of the bench's ~60 on 2 cores), and 512 rows at 99% hits are still the decode step's hits with a few misses
    _bench("experiments.bench_hot_gather", "--iters=1", "--sweep", "--sweep_block_rows=8", "--sweep_num_warps=2",
           "--decode_cases=512:0.99", f"--out={out}")
    report = json.loads(out.read_text())
    for case in ("all_hits", "half_hits", "all_misses", "insitu_step_order", "insitu_slots_by_position"):
        assert report["cases"][case]["bit_identical_to_reference"], case
    assert report["cases"]["insitu_resident_gather_rows_dequant"]["lanes"] == 2
    assert report["cases"]["all_hits"]["host_GBps"] == 0 and report["cases"]["all_misses"]["host_GBps"] > 0
    (shape,) = report["sweep"]
    assert (shape["block_rows"], shape["num_warps"]) == (8, 2) and shape["bit_identical_to_reference"]
    assert report["zero_copy_GBps"] > 0 and report["all_misses_fraction_of_zero_copy"] > 0
    (decode,) = [c for name, c in report["cases"].items() if name.startswith("rows")]  # the decode step's shape
    assert decode["bit_identical_to_reference"] and decode["hit_fraction"] == 0.99 and decode["rows"] == 512
    assert decode["resident_gather_rows_dequant_ms"] > 0
    assert list(shape["decode_ms"]) == ["rows512_hits0.99", "insitu_step_order"]
    assert all(ms > 0 for ms in shape["decode_ms"].values())


def test_bench_copyback(tmp_path):
    out = tmp_path / "cb.json"
    _bench("experiments.bench_copyback", "--steps=8", "--every=4", "--matmuls=1", "--repeats=1", f"--out={out}")
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"separate", "in_step_first", "in_step_after"}
    for name, v in report["variants"].items():
        # every variant wrote its pages into host memory, read back bit for bit, and the history stayed there
        assert v["pages_read_back_identical_and_pinned_host"], name
        assert v["wall_with_ms"] > 0 and v["wall_without_ms"] > 0 and v["call_p99_over_median"] >= 1
    assert report["variants"]["in_step_first"]["history_copies_in_step"] == 0


def test_live_history_ab(tmp_path):
    out = tmp_path / "live.json"
    _run("experiments.live_history_ab", "--config.run.max_new_tokens=6", "--check_tokens=4", "--large_capacity=2048",
         "--modes=resident,offload", "--sessions=2", "--pairs=2", f"--out={out}")
    report = json.loads(out.read_text())
    assert report["capacities"] == {"small": 100 + 6 + 64, "large": 2048}
    assert sorted(report["modes"]) == ["offload", "resident"]
    for m in report["modes"].values():
        assert m["build"]["large"]["capacity"] >= 2048 > m["build"]["small"]["capacity"]
        assert m["build"]["large"]["device_cache_bytes"] > m["build"]["small"]["device_cache_bytes"]
        assert m["summary"]["all_tokens_identical"] and m["summary"]["logits_identical"]
        assert len(m["pairs"]) == 2 and m["pairs"][1]["order"] == ["large", "small"]
        assert all(q[s]["tokens_total"] == 2 * 6 for q in m["pairs"] for s in ("small", "large"))


def test_sessions_ab(tmp_path):
    out = tmp_path / "sessions.json"
    # --max_pairs with a half width nothing reaches: every setting runs to 2 pairs
    _run("experiments.sessions_ab", "--config.run.max_new_tokens=10", "--sessions=2", "--pairs=1", "--max_pairs=2",
         "--half_width_pct=0", "--mtp=2", "--suffix=4", "--check_tokens=4", "--append=40",
         "--workload=zipf1.0,local99", f"--prefill_once={tmp_path / 'history'}", f"--out={out}")
    report = json.loads(out.read_text())
    # one prefill: the resident engine's, saved; the offload engine restored it and decodes the same tokens
    assert "save_s" in report["build"]["resident"] and "restore_s" in report["build"]["offload"]
    assert "prefill_s" not in report["build"]["offload"]
    # the resident prefill is the process's first: its chunk steps compiled inside it, and the figure says how long
    assert report["build"]["resident"]["compile_s"] > 0 and report["build"]["offload"]["compile_s"] >= 0
    assert sorted(report["settings"]) == ["local99_mtp2_forced", "zipf1.0_mtp2_forced"]
    for s in report["settings"].values():
        assert s["summary"]["all_tokens_identical"] and s["summary"]["logits_identical"]
        assert 0 < s["summary"]["hit_rate"] <= 1 and s["summary"]["floor_pct"] is None  # no zero-copy on a CPU
        # the warm-up compiled every step the timed runs take (rolled-back sessions' plain decode step included)
        assert s["summary"]["timed_runs_compiled"] is False
        assert len(s["pairs"]) == 2 and [q["order"][0] for q in s["pairs"]] == ["resident", "offload"]
        assert set(s["summary"]["same_mode_spread_pct"]) == {"resident", "offload"}
        spread = max(s["summary"]["same_mode_spread_pct"].values())
        assert s["summary"]["resolved"] is (spread <= 1.0)
        iv = s["summary"]["loss_interval_pct"]
        assert iv["pairs"] == 2 and iv["lo"] <= iv["mean"] <= iv["hi"]
        assert abs(iv["mean"] - sum(s["summary"]["losses_pct"]) / 2) < 1e-9
        assert s["summary"]["target"] in ("met", "missed", "undecided") and s["summary"]["target_pct"] == 1.0
        assert s["stopped_by_budget"] is False
        # the host's own spread beside each pair's step calls: a fixed piece of Python, timed 512 times
        speed = [q["host_speed"] for q in s["pairs"]]
        assert [h["calls"] for h in speed] == [512, 512] and all(h["iterations"] > 0 for h in speed)
        assert all(1 <= h["p99_over_median"] == h["p99_ms"] / h["unit_ms_p50"] for h in speed)
        assert s["summary"]["host_speed_p99_over_median"] == [h["p99_over_median"] for h in speed]
        # warm-up rounds: one, then more only while the last compiled something (at most two more)
        rounds, compiled = s["warmup_runs"], s["warmup_compile_s"]
        assert 1 <= rounds == len(compiled) <= 3 and all(c > 0 for c in compiled[:-1])
        assert compiled[-1] == 0 or rounds == 3
    assert report["host_read_bandwidth"] is None and report["plot"] == str(tmp_path / "sessions.png")
    assert (tmp_path / "sessions.png").stat().st_size > 0
    s = report["settings"]["zipf1.0_mtp2_forced"]
    pair = s["pairs"][0]
    for mode in ("resident", "offload"):
        f = pair[mode]
        assert f["aggregate_tokens_per_s"] > 0 and len(f["per_session_tokens_per_s"]) == 2
        assert f["tokens_total"] == 2 * 10
        # forced acceptance: drafts committed but where the 10-token budget clamps; real verdicts recorded too
        assert 0 < f["mtp_committed"][0] <= f["mtp_proposed"][0]
        assert all(a <= p for a, p in zip(f["mtp_accepted"], f["mtp_proposed"]))
        assert 0 < len(f["slowest_step_calls_ms"]) <= 8 and f["other_step_call_ms_median"] > 0
        calls = f["step_calls_ms"]
        assert len(calls) == f["steps"] and max(calls) == f["slowest_step_calls_ms"][0][0]
        assert f["step_calls_over_1_25x_median"] == sum(c > 1.25 * np.median(calls) for c in calls)
        gaps = f["step_interval_ms"]
        assert 0 <= gaps["p50"] <= gaps["p99"] <= gaps["max"]
        assert f["step_interval_p99_over_median"] == pytest.approx(gaps["p99"] / gaps["p50"])
        assert 0 <= f["step_wait_ms"]["p50"] <= f["step_wait_ms"]["max"]
        # which steps ran the copying executable: offload MTP verify steps always copy; resident has no copyback
        assert len(f["copy_step_numbers"]) == f["copy_steps"]
        if mode == "offload":
            assert f["copy_steps"] > 0 and f["copy_step_call_ms_median"] > 0
        else:
            assert f["copy_steps"] == 0 and f["copy_step_call_ms_median"] is None
    assert 0 < pair["offload"]["hit_rate"] <= 1 and len(pair["offload"]["hit_rate_per_session"]) == 2
    assert report["build"]["offload"]["host_used_bytes"] > 0
    # how the loops read their steps, so a GPU file says whether its calls were measured with polling reads
    assert report["build"]["offload"]["spin_reads"] is (jax.default_backend() in ops.GPU_BACKENDS)
    app = report["append"]
    assert app["summary"]["all_identical"] and len(app["pairs"]) == 1
    assert app["pairs"][0]["offload_bulk_bytes_from_host"] > 0
    # the offload engine, restored from the resident one's save, compiled its append's chunks before the timing
    assert app["summary"]["timed_appends_compiled"] is False


def test_bench_fill_round(tmp_path):
    out = tmp_path / "fr.json"
    # a verify step's fill (2 rows repeating positions): the election's variants beside the valid one
    _bench("experiments.bench_fill_round", "--num_warps=4", "--rows=2", f"--out={out}")
    report = json.loads(out.read_text())
    kernel, one_election, no_election = report["kernel"]
    assert kernel["num_warps"] == 4 and kernel["max_repeats"] == 2 and not kernel["distinct"]
    assert kernel["bit_identical_to_reference"] and kernel["us"] > 0
    assert one_election["max_repeats"] == 1 and no_election["distinct"]
    assert report["reference_us"] > 0 and report["rows"] == 2


def test_sessions_1m(tmp_path):
    """A history prefilled in two timed pieces and saved (--prefill_only), then two sessions of it (the restored one
    and a fork with its own host pages) decoding together."""
    hist, first, out = tmp_path / "history", tmp_path / "prefill.json", tmp_path / "s1m.json"
    _run("experiments.sessions_1m", "--config.run.prompt_len=160", "--sessions=1", "--prefill_piece=64",
         "--prefill_only", f"--save_history={hist}", f"--out={first}")
    report = json.loads(first.read_text())
    assert report["status"] == "done" and report["history"]["saved_to"] == str(hist) and "decode" not in report
    assert report["git"] and report["device_kind"] and report["jax"]
    pre = report["prefill"]
    assert [(p["start"], p["end"]) for p in pre["pieces"]] == [(0, 64), (64, 160)]
    assert pre["tokens_per_s"] > 0 and pre["time_to_first_token_s"] > pre["prefill_s"] > 0
    assert pre["bulk_bytes_from_host"] > 0 and pre["compile_s_during_prefill"] >= 0

    _run("experiments.sessions_1m", "--config.run.prompt_len=160", "--config.run.max_new_tokens=6", "--sessions=2",
         "--check_tokens=3", "--suffix=4", f"--load_history={hist}", f"--out={out}")
    report = json.loads(out.read_text())
    assert report["status"] == "done" and report["mode"] == "capacity" and report["history"]["tokens"] == 160
    assert "share_pages=False" in report["histories"] and "prefill" not in report
    assert len(report["build"]["fork_s"]) == 1
    host = report["build"]["engine"]["host"]
    # every session's history in its own pages: 2 x (160 + 4) rows of pages in use, none shared
    assert host["used_pages"] >= 2 * (164 // report["plan"]["page_rows"]) and host["pool_bytes"] > 0
    assert all(s["shared_pages"] == 0 for s in report["build"]["engine"]["sessions"].values())
    assert report["build"]["host"]["rss"] > 0 and report["plan"]["host_pool_bytes"] == host["pool_bytes"]
    d = report["decode"]
    assert d["aggregate_tokens_per_s"] > 0 and len(d["per_session_tokens_per_s"]) == 2 and d["tokens_total"] == 12
    assert 0 < d["hit_rate"] <= 1 and len(d["hit_rate_per_session"]) == 2 and d["bytes_from_host_per_s"] >= 0


def test_sessions_1m_ab(tmp_path):
    """Offload prefills and saves; a resident engine restores; the decodes agree bit for bit."""
    out, tmp = tmp_path / "ab.json", tmp_path / "tmp"
    tmp.mkdir()
    _run("experiments.sessions_1m", "--config.run.max_new_tokens=5", "--sessions=1", "--ab", "--pairs=1",
         "--check_tokens=3", f"--out={out}", env={"TMPDIR": str(tmp)})
    report = json.loads(out.read_text())
    assert report["status"] == "done" and report["mode"] == "ab"
    assert report["save_restore"]["dir"].startswith(str(tmp)) and not list(tmp.glob("sessions_1m_save_*"))
    assert report["check"]["tokens_identical"] and report["check"]["logits_identical"]
    (pair,) = report["pairs"]
    assert pair["tokens_identical"] and pair["offload"]["aggregate_tokens_per_s"] > 0
    assert pair["resident"]["aggregate_tokens_per_s"] > 0 and 0 < pair["offload"]["hit_rate"] <= 1
    assert report["summary"]["all_tokens_identical"] and report["save_restore"]["restore_s"] > 0


@pytest.mark.devices(2)
def test_sessions_1m_ab_on_stages(tmp_path):
    """The same A/B on 2 pipeline stages (issue 15's capacity run spreads the layers over a machine's GPUs): outputs
    bit-identical between the modes, and the plan per device and per host what the engines allocate."""
    out = tmp_path / "ab2.json"
    _run("experiments.sessions_1m", "--config.mesh.stages=2", "--config.run.max_new_tokens=5", "--sessions=1",
         "--ab", "--pairs=1", "--check_tokens=3", f"--out={out}")
    report = json.loads(out.read_text())
    assert report["status"] == "done" and report["check"]["tokens_identical"] and report["check"]["logits_identical"]
    plan, eng = report["plan"], report["build"]["offload"]["engine"]
    assert plan["mesh"] == {"stage": 2, "tp": 1} and plan["devices"] == 2 and eng["device"]["devices"] == 2
    assert plan["params_bytes"] == eng["device"]["params_bytes"]
    assert plan["device_cache_bytes"] == eng["device"]["cache_bytes"]
    assert plan["host_pool_bytes_per_device"] == eng["host"]["pool_bytes"] < plan["host_pool_bytes"]
    assert plan["resident_device_cache_bytes"] == report["build"]["resident"]["engine"]["device"]["cache_bytes"]


def test_sessions_1m_refuses_what_host_ram_cannot_hold(tmp_path):
    out = tmp_path / "refused.json"
    p = python_runner.run(["-m", "experiments.sessions_1m", *tiny("experiments.sessions_1m"),
                          "--host_margin_gib=1e9", f"--out={out}"], cwd=ROOT, timeout=600)
    assert p.returncode == 2 and "host RAM" in p.stderr and "sessions fit" in p.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "refused" and "host RAM" in report["error"]


def test_profile_prefill(tmp_path):
    out, traces = tmp_path / "pp.json", tmp_path / "traces"
    _run("experiments.profile_prefill", "--config.cache.mode=offload", "--prompt_lens=64,128", f"--out={out}",
         f"--trace_dir={traces}")
    # --trace_dir keeps each length's trace, for TensorBoard or Perfetto
    for n in (64, 128):
        assert len(list((traces / f"prompt_{n}").rglob("*.xplane.pb"))) == 1, n
        assert list((traces / f"prompt_{n}").rglob("*.trace.json.gz")), n
    # a folder that holds a trace already is refused before any work: this run's could not be told from that one's
    p = python_runner.run(["-m", "experiments.profile_prefill", *tiny("experiments.profile_prefill"),
                           "--prompt_lens=64", f"--trace_dir={traces}"], cwd=ROOT, timeout=300)
    assert p.returncode != 0 and f"--trace_dir={traces} already holds a profiler trace" in p.stderr, p.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["prompt_len"] for r in report["runs"]] == [64, 128] and report["peak_flops"] == 989e12
    for r in report["runs"]:
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["chunks"] == r["prompt_len"] // 64
        f = r["flops_per_token"]
        assert f["total"] > 0 and f["lm_head"] > 0 and f["indexer_scores"] > 0 and f["moe"] > 0
        prof = r["profile"]
        parts = prof["per_part_us_per_chunk"]
        for part in ("indexer_scores", "topk", "attention_gather", "attention_math", "moe"):
            assert parts[part] > 0, part
        assert parts["lm_head"] == 0  # a prefill chunk computes no logits
        assert abs(sum(parts.values()) - prof["busy_us_per_chunk"]) < 1e-6 * prof["busy_us_per_chunk"] + 1e-6
        assert prof["chunks_profiled"] == r["chunks"] and prof["top_kernels"]
    # the indexer's FLOPs per token grow with the history; the weights' do not
    a, b = (r["flops_per_token"] for r in report["runs"])
    assert b["indexer_scores"] > a["indexer_scores"] and b["moe"] == a["moe"]
    assert "projection" in report


def test_hf_prefill(tmp_path):
    import torch  # noqa: F401  (the test extra installs it: CI must run this, not skip it)
    import transformers  # noqa: F401
    out = tmp_path / "hf.json"
    p = python_runner.run(["-m", "experiments.hf_prefill", "--config=configs/tiny.py",
                          "--prompt_lens=64", "--chunk=32", "--warmup_tokens=64", "--device=cpu", f"--out={out}"],
                          cwd=ROOT, timeout=600, fresh=True)  # it sets JAX_PLATFORMS=cpu before importing JAX
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["torch_device"] == "cpu" and report["model"]["params"] > 0
    runs = report["runs"]
    assert [(r["prompt_len"], r["mode"]) for r in runs] == [(64, "whole"), (64, "chunked")]
    assert all(r["ok"] and r["tokens_per_s"] > 0 for r in runs)
    # chunked prefill with transformers' cache computes what the whole forward does
    whole, chunked = runs
    assert whole["last_token_argmax"] == chunked["last_token_argmax"]
    assert chunked["last_logits_max_abs_diff_vs_whole"] <= 1e-2 * chunked["last_logits_max_abs"]


def test_generate_refuses_bad_settings_before_building_the_model():
    """Settings that cannot work end the run with one line naming the flag, before the model is built."""
    for args, message in ((["--config.run.batch=0"], "--config.run.batch=0: the run needs at least one prompt"),
                          (["--config.cache.mode=offload", "--config.cache.hot_rows=64"],
                           "hot_rows=64 is below what a round can pin.*raise hot_rows to 256"),
                          (["--config.run.prompt_len=5000"], "prompt_len=5000 .* needs 5024 positions"),
                          (["--config.cache.max_len=100"], "max_len=100 rows cannot hold the 124 positions"),
                          (["--config.run.output_json=/proc/no/such/out.json"],
                           "output_json=/proc/no/such/out.json: cannot write a file in /proc/no/such"),
                          # os.access says yes to root here; the write after the run said no, as a traceback
                          (["--config.run.output_json=/proc/out.json"], "output_json=/proc/out.json: cannot write"),
                          (["--config.checkpoint=/tmp/any_ckpt", "--config.model.num_hidden_layers=2"],
                           "--config.model.num_hidden_layers: the model comes from --config.checkpoint"),
                          (["--config.cache.hot_row=5"],
                           "flag --config.cache.hot_row=5: the config has no field 'hot_row'; did you mean "
                           '"hot_rows"')):
        p = python_runner.run(["-m", "experiments.generate", *TINY, *args], cwd=ROOT, timeout=600)
        assert p.returncode == 1 and "Model(" not in p.stdout and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert re.search(message, "\n".join(p.stderr.strip().splitlines()[-2:])), p.stderr[-2000:]  # absl's flag
        # errors end on a line of their own pointing at --helpshort


def test_generate_runs_a_checkpoint_and_records_the_model_it_loaded(tmp_path):
    """``--config.checkpoint``: the model is the checkpoint's (here 2 layers, where the config file says 4), the JSON
    records it, and orbax's INFO lines about the read stay out of the output."""
    import glm53
    from configs import tiny

    model_dict = dict(tiny.get_config().model, num_hidden_layers=2, indexer_types=("full", "shared"))
    glm53.from_config(glm53.ModelConfig(**model_dict), seed=3, dtype="float32").save(str(tmp_path / "ckpt"))
    out = tmp_path / "gen.json"
    p = python_runner.run(["-m", "experiments.generate", "--config=configs/tiny.py",
                          "--config.run.prompt_len=100", "--config.run.batch=1", "--config.run.max_new_tokens=3",
                          f"--config.checkpoint={tmp_path / 'ckpt'}", f"--config.run.output_json={out}"],
                          cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "orbax" not in p.stderr + p.stdout and "Model(2 layers" in p.stdout, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["model"]["num_hidden_layers"] == 4 and report["model"]["num_hidden_layers"] == 2
    # The planner counts the checkpoint's shapes, not the config file's.
    p = python_runner.run(["-m", "experiments.plan", "--config=configs/tiny.py", "--history=1000",
                          "--machine=custom", "--devices=2", "--device_gib=1", "--host_gib=1",
                          f"--config.checkpoint={tmp_path / 'ckpt'}"], cwd=ROOT, timeout=600)
    assert p.returncode == 0 and p.stdout.startswith("2 layers + 1 MTP"), p.stderr[-3000:] + p.stdout[:500]


def test_random_weight_experiments_refuse_a_checkpoint_they_would_ignore():
    p = python_runner.run(["-m", "experiments.sessions_ab", *tiny("experiments.sessions_ab"),
                          "--config.checkpoint=/tmp/any_ckpt"], cwd=ROOT, timeout=600)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert re.search("experiments.sessions_ab: --config.checkpoint=/tmp/any_ckpt: this experiment builds random "
                     "weights", p.stderr.strip().splitlines()[-1]), p.stderr[-2000:]


def test_run_notebooks_refuses_a_name_no_notebook_has():
    p = python_runner.run(["-m", "experiments.run_notebooks", "99_nothing"], cwd=ROOT, timeout=120)
    assert p.returncode != 0 and "no notebook's name starts with 99_nothing" in p.stderr + p.stdout


def test_generate_roofline(tmp_path):
    """generate's JSON carries the roofline: the measured bandwidth, the bytes of a step by part (routed experts from
    the model's routing: 2 sessions per step), ideal vs achieved, for the run and its resident baseline."""
    out = tmp_path / "gen.json"
    _run("experiments.generate", "--config.run.batch=2", "--config.run.max_new_tokens=6", "--config.cache.mode=offload",
         "--config.run.compare_resident=True", f"--config.run.output_json={out}", "--bandwidth_mib=8")
    report = json.loads(out.read_text())
    assert report["model"]["num_hidden_layers"] == 2  # the model that ran, as _run's flags built it
    assert report["processes"] == 1
    roof = report["roofline"]
    bw = roof["bandwidth"]
    assert bw["bandwidth_Bps"] > 0 and bw["array_bytes"] == 8 << 20
    # probed before and after the timed runs, the better one kept
    assert len(bw["probes_GBps"]) == 2 and bw["bandwidth_Bps"] / 1e9 == pytest.approx(max(bw["probes_GBps"]))
    run, base = roof["run"], roof["resident_baseline"]
    for r in (run, base):
        b = r["bytes"]
        assert r["bandwidth_GBps"] == pytest.approx(bw["bandwidth_Bps"] / 1e9)
        assert r["ideal_step_ms"] == pytest.approx(b["total"] / bw["bandwidth_Bps"] * 1e3)
        assert r["bytes_per_step"] == b["total"] > 0 and r["ideal_step_ms"] > 0 and r["achieved_step_ms"] > 0
        assert r["ratio"] == pytest.approx(r["achieved_step_ms"] / r["ideal_step_ms"])
        assert r["tokens_per_step"] == 2 and b["inputs"]["batch"] == 2
        assert b["routed_experts"]["source"].startswith("probe") and len(b["routed_experts"]["per_layer"]) == 1
        assert b["parts"]["kv_rows"] > 0 and b["parts"]["indexer_keys"] > 0
    assert run["routing_probe"]["tokens_identical_to_the_timed_run"]
    assert run["bytes"]["inputs"]["mode"] == "offload" and base["bytes"]["inputs"]["mode"] == "resident"
    assert run["bytes"]["host"]["copyback_to_host"] > 0 and base["bytes"]["host_total"] == 0
    assert run["bytes"]["routed_experts"]["per_layer"] == base["bytes"]["routed_experts"]["per_layer"]
    # where the decode's pace came from: the host loop and the step calls within the decode time
    fig = report["figures"]["run"]
    calls, gaps = fig["decode_step_call_ms"], fig["decode_step_interval_ms"]
    assert 0 < fig["decode_step_calls_s"] <= fig["decode_host_loop_s"]
    assert 0 < calls["p50"] <= calls["p90"] <= calls["p99"] <= calls["max"]
    assert 0 < gaps["p50"] <= gaps["max"]
    waits = fig["decode_step_wait_ms"]  # the reads' waits for the device
    assert 0 <= waits["p50"] <= waits["p99"] <= waits["max"] and 0 <= waits["mean"] <= waits["max"]


def test_generate_compiler_options_ab(tmp_path):
    """--compiler_options reach the engine's steps (an XLA dump of them appears), and --baseline_compiler_options
    runs the same generate without them in the same process: outputs compared, both speeds reported."""
    out, dump = tmp_path / "gen.json", tmp_path / "dump"
    _run("experiments.generate", "--config.run.max_new_tokens=5", "--config.cache.mode=offload",
         f"--compiler_options=xla_dump_to={dump}", "--baseline_compiler_options=", "--roofline=False",
         f"--config.run.output_json={out}")
    report = json.loads(out.read_text())
    assert report["figures"]["compiler_options"] == {"xla_dump_to": str(dump)}
    ab = report["figures"]["baseline_options"]
    assert ab["compiler_options"] == {} and ab["tokens_identical"] and ab["logits_bit_identical"]
    assert ab["run"]["decode_tokens_per_s"] > 0 and ab["decode_ratio"] > 0
    assert any(".jit_decode." in f.name for f in dump.iterdir())


def test_generate_fp8_experts(tmp_path):
    """--expert_weights=fp8: the experts stay FP8 on the device, the roofline counts their bytes, offload equals
    resident on the same FP8 model."""
    out = tmp_path / "gen.json"
    _run("experiments.generate", "--expert_weights=fp8", "--config.run.max_new_tokens=5",
         "--config.cache.mode=offload", "--config.run.compare_resident=True", f"--config.run.output_json={out}",
         "--bandwidth_mib=8")
    report = json.loads(out.read_text())
    assert report["expert_weights"] == "fp8"
    assert report["roofline"]["run"]["bytes"]["inputs"]["expert_weights"] == "fp8"
    comparison = report["figures"]["comparison"]
    assert comparison["tokens_identical"] and comparison["logits_bit_identical"]


def test_throughput(tmp_path):
    """Sessions x histories x modes: every point timed with its roofline, tokens equal between modes, the plot; a
    point that cannot fit is skipped with the reason; --plot_only merges result files."""
    out = tmp_path / "tp.json"
    _run("experiments.throughput", "--sessions=1,2", "--histories=40,72", "--new_tokens=4", "--warmup_tokens=3",
         "--suffix=4", "--probe_tokens=3", "--bandwidth_mib=8", f"--out={out}")
    report = json.loads(out.read_text())
    points = report["points"]
    assert sorted((q["mode"], q["history"], q["sessions"]) for q in points) == sorted(
        (m, h, s) for m in ("resident", "offload") for h in (40, 72) for s in (1, 2))
    assert report["comparison"]["points_compared"] == 4 and report["comparison"]["all_identical"]
    # each mode's first point compiled in its first warm-up run, so a second one ran
    assert {q["mode"] for q in points if q["warmup_runs"] >= 2 and q["warmup_compile_s"][0] > 0} == {"resident",
                                                                                                   "offload"}
    assert all(b["prefill_compile_s"] >= 0 for m in report["builds"].values() for b in m.values())
    assert max(b["prefill_compile_s"] for m in report["builds"].values() for b in m.values()) > 0
    bw = report["bandwidth"]
    assert bw["bandwidth_Bps"] > 0 and not report["skipped"] and "errors" not in report
    assert len(bw["probes_GBps"]) == 2 and bw["bandwidth_Bps"] / 1e9 == pytest.approx(max(bw["probes_GBps"]))
    for q in points:
        assert q["roofline"]["bandwidth_GBps"] == pytest.approx(bw["bandwidth_Bps"] / 1e9)
        assert q["tokens_per_s"] > 0 and q["steps"] == 4 and q["decode_tokens"] == 4 * q["sessions"]
        assert q["compile_s"] == 0  # the warm-up compiled every step of the point
        # ... in runs repeated until one compiled nothing (the rollback's first load drops the CUDA graphs)
        assert q["warmup_runs"] == len(q["warmup_compile_s"]) and 1 <= q["warmup_runs"] <= 3
        assert q["warmup_compile_s"][-1] == 0 and q["warmup_s"] > 0
        h = q["host"]  # whether the host or the device set the pace
        assert 0 < h["loop_s"] and h["step_call_ms"]["p50"] > 0 and h["step_wait_ms"]["p50"] >= 0
        assert set(h["step_interval_ms"]) >= {"p50", "p99", "max"}
        slowest = h["slowest_step_calls_ms"]
        assert 0 < len(slowest) <= 6 and all(1 <= i <= q["steps"] for _, i in slowest)
        assert all(1 <= i <= q["steps"] for i in h["copy_steps"] + h["copyback_steps"])
        r = q["roofline"]
        assert r["ideal_tokens_per_s"] > 0 and r["tokens_per_step"] == q["sessions"]
        b = r["bytes"]
        assert b["inputs"]["batch"] == q["sessions"] and b["routed_experts"]["source"].startswith("probe")
        assert b["per_session"]["weights_amortised"] == pytest.approx(b["weights"] / q["sessions"])
        if q["mode"] == "offload":
            assert 0 < q["cache"]["hit_rate"] <= 1 and b["host"]["copyback_to_host"] > 0
    # one token per step routes to exactly num_experts_per_tok experts
    assert all(d == 2.0 for q in points if q["sessions"] == 1 for d in q["routing"]["per_layer"])
    assert (tmp_path / "tp.png").stat().st_size > 0

    merged = tmp_path / "merged.json"
    _run("experiments.throughput", f"--plot_only={out}", f"--out={merged}")
    m = json.loads(merged.read_text())
    assert len(m["points"]) == 8 and m["comparison"]["all_identical"] and (tmp_path / "merged.png").exists()

    small = tmp_path / "skip.json"
    _run("experiments.throughput", "--sessions=1", "--histories=40", "--modes=resident", "--device_gib=0.001",
         "--margin_gib=0", "--bandwidth_mib=8", f"--out={small}")
    s = json.loads(small.read_text())
    assert not s["points"] and s["skipped"] and "device" in s["skipped"][0]["why"]


@pytest.mark.parametrize("sessions,history", [(1, 4096), (5, 50_000), (3, 2100)])
def test_working_sets_stay_distinct_and_churn(sessions, history):
    """The benchmarks' device-side local99 sets: every step each row is sorted, distinct, inside the history, and
    differs from the last in at most churn * K positions (fewer where a draw hit a held position)."""
    import numpy as np

    from experiments import workloads

    K = 2048
    sets = workloads.WorkingSets(K, history, seed=7, sessions=sessions)
    prev = np.asarray(sets.chosen)
    replaced = []
    for _ in range(12):
        rows = np.asarray(sets.step())
        assert rows.shape == (sessions, K) and rows.dtype == np.int32
        assert (np.diff(rows, axis=1) > 0).all() and rows.min() >= 0 and rows.max() < history
        replaced += [len(np.setdiff1d(r, p)) for r, p in zip(rows, prev)]
        prev = rows
    assert max(replaced) <= 20
    expected = 20 * (1 - K / history)  # a draw the set already holds is not swapped in
    assert abs(np.mean(replaced) - expected) < 3 + 0.2 * expected
    with pytest.raises(ValueError, match="history of at least"):
        workloads.WorkingSets(K, K - 1, seed=0, sessions=1)


@pytest.mark.parametrize("name", ["local99", "uniform", "window32", "zipf1.0"])
def test_a_series_of_selections_reuses_its_device_buffers(name):
    """``workloads.Selections``: each run's override gives the rows a fresh ``workloads.selection`` of its seed
    gives, and its device state is written over the last one's buffers (nothing new kept on the device between
    two runs: it would move the decode steps' temporaries, and their CUDA graphs would be recorded again)."""
    import jax
    import numpy as np

    from experiments import workloads

    def rows(override):
        return [np.array(override(i, np.zeros(3))).copy() for i in range(4)]

    def buffers(state):
        return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(vars(state))
                if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]

    series = workloads.Selections(name, 64, 500, sessions=3)
    for seed in (1, 5, 1):
        override = series(seed)
        before = buffers(series.state)
        assert override.sets is series.state
        got = rows(override)
        expected = rows(workloads.selection(name, 64, 500, seed, sessions=3))
        assert all((g == x).all() for g, x in zip(got, expected)), seed
        series(seed)  # the next run's start, written over the same buffers
        assert buffers(series.state) == before
    assert workloads.Selections("indexer", 64, 500, 3)(0) is None
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.Selections("drift2", 64, 500, 3)


def test_offload_ab_sweeps_hit_rates_with_a_plot(tmp_path):
    """Synthetic locality workloads sweep the hit rate in one run; outputs identical in every pair; a PNG beside
    the JSON (the floor needs a GPU's zero-copy path: None on the CPU)."""
    out = tmp_path / "sweep.json"
    _run("experiments.offload_ab", "--config.run.max_new_tokens=10", "--workloads=drift0.005,window16,uniform",
         f"--out={out}")
    r = json.loads(out.read_text())
    s = r["summary"]
    assert set(s) == {"drift0.005", "window16", "uniform"} and all(v["all_identical"] for v in s.values())
    assert s["drift0.005"]["decode_hit_rate"] > s["uniform"]["decode_hit_rate"]  # locality shows in the hit rate
    assert r["host_read_bandwidth"] is None and all(v["floor_pct"] is None for v in s.values())
    assert pathlib.Path(r["plot"]).exists() and r["plot"].endswith("sweep.png")


def test_loss_plot_labels_crowded_points_apart_and_inside_the_axes():
    """Workloads near 99% hits lie a fraction of a point apart: each label inside the axes, over no other label and
    no other point's marker (one fixed offset drew two names over each other and past the right edge)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import Bbox

    from experiments import loss_plot

    xs, ys = [65.5, 76.3, 98.3, 99.15, 99.2], [16.8, 7.4, 0.67, 0.50, 0.55]
    labels = ["uniform_mtp0", "window512_mtp0", "drift0.05_mtp0", "local99_mtp0", "zipf1.0_mtp0"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(xs, ys, "o")
    fig.tight_layout()
    texts = loss_plot.label_points(ax, labels, xs, ys)
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in texts]
    frame = ax.get_window_extent(renderer)
    assert [t.get_text() for t in texts] == labels
    for i, b in enumerate(boxes):
        assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1, labels[i]
        assert not any(b.overlaps(c) for j, c in enumerate(boxes) if j != i), labels[i]
        for j, (u, v) in enumerate(ax.transData.transform(list(zip(xs, ys)))):
            if j != i:
                assert not b.overlaps(Bbox.from_extents(u - 6, v - 6, u + 6, v + 6)), (labels[i], labels[j])
    plt.close(fig)


@pytest.mark.parametrize("name", ["local99", "drift0.3", "uniform", "window32", "zipf1.0"])
def test_synthetic_workloads_give_valid_selections(name):
    import numpy as np

    from experiments import workloads

    for sessions in (1, 3):
        override = workloads.selection(name, 64, 500, seed=1, sessions=sessions)
        rows = [np.asarray(override(i, np.zeros(3))) for i in range(5)]
        for r in rows:
            assert r.shape == (3, 64) and (np.diff(r, axis=1) > 0).all() and r.min() >= 0 and r.max() < 500
        assert (rows[-1][0] == rows[-1][1]).all() == (sessions == 1)  # one shared set, or one per session
        assert any((a != b).any() for a, b in zip(rows, rows[1:]))  # it moves


@pytest.mark.parametrize("name", ["local99", "drift0.3", "uniform", "window32", "zipf1.0"])
def test_synthetic_workloads_never_loop_on_the_device(name):
    """A workload's step runs between two decode steps: a while loop in it copies its predicate to the host and waits
    for it at every trip on a GPU (local99's binary search did, ~12 trips a step:
    profile_decode_8k_b10_host_e0171ab.json)."""
    import copy

    import jax

    from experiments import workloads

    sets = workloads.selection(name, 64, 500, seed=1, sessions=3).sets
    jaxpr = str(jax.make_jaxpr(copy.copy(sets).step)())  # a copy: step() stores its new state on the object
    assert "while[" not in jaxpr and "scan[" not in jaxpr, jaxpr[:2000]


def test_zipf_rows_reuse_the_popular_positions():
    """zipf<e>: the most popular positions come back step after step, the tail rarely, and a larger exponent
    concentrates the draws (what makes LFU beat circular in glm53.policies)."""
    import numpy as np

    from experiments import workloads

    K, history = 64, 5000

    def mean_overlap(exponent):
        sets = workloads.ZipfSets(K, history, seed=3, sessions=2, exponent=exponent)
        rows = [np.asarray(sets.step()) for _ in range(20)]
        for s in range(2):
            seen = np.zeros(history)
            for r in rows:
                assert r.shape == (2, K) and (np.diff(r[s]) > 0).all()
                seen[r[s]] += 1
            by_rank = seen[np.asarray(sets.by_rank)[s]]  # how often each rank was drawn
            assert by_rank[:16].mean() > 5 * by_rank[1000:].mean()  # the head comes back, the tail rarely
        return np.mean([len(np.intersect1d(a[0], b[0])) / K for a, b in zip(rows, rows[1:])])

    assert mean_overlap(1.2) > mean_overlap(0.8) > 5 * K / history  # uniform draws would share K / history


def test_unknown_workloads_are_named():
    from experiments import workloads

    for bad in ("drift0", "drift1.5", "window0", "windowx", "zipf", "zipf0", "zipf-1", "nope"):
        with pytest.raises(ValueError, match="unknown workload"):
            workloads.selection(bad, 64, 500, seed=0)
    assert workloads.selection("indexer", 64, 500, seed=0) is None


def test_kernel_scopes_name_the_pallas_kernels():
    """A Pallas kernel event is attributed by its own name (its HLO op may be a command buffer); an XLA kernel by
    the op_name of its instruction."""
    from experiments.trace_util import kernel_scope
    ops = {"fusion_12": "jit(decode)/GLM5/layers_3/self_attn/q_b_proj/dot_general"}
    assert kernel_scope("grouped_matmul", "command_buffer_7", "jit_decode", ops) == ("mlp", "")
    assert kernel_scope("glm53_hot_gather", "command_buffer_7", "jit_decode", ops) == ("offload_gather", "")
    assert kernel_scope("fusion_12", "command_buffer_7", "jit_decode", ops) == ("self_attn", ops["fusion_12"])
    assert kernel_scope("fusion_99", "command_buffer_7", "jit_decode", ops) == ("unattributed", "")


def test_bench_mla_decode(tmp_path):
    out = tmp_path / "mla.json"
    _bench("experiments.bench_mla_decode", "--queries=2", "--block_rows=16", "--num_warps=4", "--parts=16x2,8x1",
           f"--out={out}")
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    (kernel,) = case["kernel"]  # 8 heads a program is below what the kernel takes: not launched
    assert case["queries"] == 2 and case["reference_us"] > 0 and kernel["us"] > 0 and case["best"] == kernel
    assert kernel["block_rows"] == 16 and kernel["head_block"] == 16 and kernel["column_parts"] == 2
    assert kernel["max_abs_diff"] < 0.1  # bf16 probabilities' rounding


def test_per_session_tokens_per_s_add_up_to_the_aggregate():
    """A run's per-session rates count the tokens its timed decode emitted: a session's first token comes from the
    loop when the session has a pending token (every rolled-back, timed run of the A/Bs), and from its stored hidden
    state before the loop only after a prefill. They add up to the aggregate either way (they counted one token a
    session too few on rolled-back runs: sessions_1m_16x.json's 41.2 tok/s per session against 664.8 / 16 = 41.6)."""
    from engine_common import make_model, ids, engine
    from experiments import engine_runs

    e = engine(make_model(), "resident", max_sessions=2)
    sids = [e.open(ids(40, seed=s)) for s in range(2)]
    for _ in range(2):  # the first run samples each first token before the loop; the second, rolled back, does not
        res = engine_runs.run(e, sids, 5, 0, None, None)
        f = engine_runs.figures(res, 2)
        assert f["tokens_total"] == 10
        assert sum(f["per_session_tokens_per_s"]) == pytest.approx(f["aggregate_tokens_per_s"], rel=1e-9)
    assert engine_runs.per_session_decode_tokens(res["report"], res["tokens"]) == [5, 5]


@pytest.mark.parametrize("module,flag,reads", [
    ("experiments.throughput", "--config.run.mtp=2", "--mtp"),
    ("experiments.sessions_ab", "--config.mesh.tp=2", "one device"),
    ("experiments.live_history_ab", "--config.run.temperature=0.7", "greedy"),
    ("experiments.sessions_1m", "--config.cache.mode=resident", "offload"),
    ("experiments.capacity", "--config.cache.max_len=100", "--history"),
    ("experiments.offload_ab", "--config.run.temperature=0.7", "greedy"),
    ("experiments.profile_decode", "--config.run.mtp=3", "without MTP"),
    ("experiments.profile_prefill", "--config.mesh.tp=2", "one device"),
    ("experiments.step_copies", "--config.run.seed=4", "runs nothing"),
    ("experiments.hf_prefill", "--config.dtype=float32", "in --dtype")])
def test_experiments_refuse_config_overrides_they_would_ignore(module, flag, reads):
    """An override an entry point does not read would have gone into its results' config as if it had run (a
    throughput run at --config.run.mtp=2 decoded at MTP 0): refused at once, on one line naming the flag."""
    p = python_runner.run(["-m", module, "--config=configs/tiny.py", flag], cwd=ROOT, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert last.startswith(f"{module}: {flag}: ") and reads in last, last


@pytest.mark.parametrize("module", ["experiments.generate", "experiments.profile_decode"])
def test_a_dtype_that_cannot_work_is_one_line(module):
    """glm53's ConfigError raised inside an entry point's main, past its own checks (here the model's dtype, met
    when the weights are about to be drawn), ends the run on one line naming it, not a traceback through glm53."""
    p = python_runner.run(["-m", module, "--config=configs/tiny.py", "--config.dtype=float16"], cwd=ROOT, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == (f"{module}: dtype 'float16' unknown; choose one of "
                                                 "['bf16', 'bfloat16', 'f32', 'float32']"), p.stderr[-2000:]


def test_sessions_1m_times_its_decode_without_a_progress_bar(tmp_path):
    """The timed decode shows no bar (its writes would fall between the timed step calls); the untimed warm-up,
    which compiles, shows its own."""
    p = _run("experiments.sessions_1m", "--config.run.prompt_len=40", "--config.run.max_new_tokens=5",
             "--sessions=2", "--check_tokens=3", "--suffix=2", f"--out={tmp_path / 's.json'}")
    assert "/6 [" in p.stderr  # the warm-up's bar: 2 sessions x 3 tokens
    assert "/10 [" not in p.stderr, p.stderr[-2000:]  # none for the timed 2 x 5


@pytest.mark.parametrize("module,message", [
    ("experiments.sessions_ab", "a session needs 4,387 positions (prompt 200 + suffix 16 + the larger of 24 new "
                                "tokens and --append=4096 + --check_tokens=8, + MTP 3 + 64 spare) but the model has "
                                "max_position_embeddings=4,096: lower --append (0 skips it)"),
    ("experiments.throughput", "--histories=8192,50000: a session of the longest needs 50,088 positions (with the "
                               "suffix, tokens and MTP drafts) but the model has max_position_embeddings=4,096: pass "
                               "histories up to 4,008")])
def test_entry_points_refuse_sessions_longer_than_the_model_before_building_it(module, message):
    """configs/tiny.py (4,096 positions) with the GPU configs' default lengths: one line naming the flags, before
    the model is built (the engine's own ConfigError came as a traceback after the weights were drawn)."""
    p = python_runner.run(["-m", module, "--config=configs/tiny.py"], cwd=ROOT, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert message in p.stderr and "random weights" not in p.stderr and "Model(" not in p.stdout, p.stderr[-2000:]


@pytest.mark.parametrize("flag,message", [
    ("--large_capacity=1048576", "--large_capacity=1048576 exceeds the model's max_position_embeddings=4096"),
    ("--large_capacity=64", "--large_capacity=64 is not larger than the run's own capacity")])
def test_live_history_ab_refuses_a_large_capacity_it_cannot_build_before_prefilling(flag, message):
    """configs/tiny.py with the default 1M-row large cache: refused on one line before any model or prefill (it was
    a traceback from the large engine, after the small one had prefilled)."""
    p = python_runner.run(["-m", "experiments.live_history_ab", "--config=configs/tiny.py", flag],
                          cwd=ROOT, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert message in p.stderr and "prefill" not in p.stdout + p.stderr.replace(message, ""), p.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    (["experiments.sessions_ab", "--config=configs/tiny.py", "--append=0", "--mtp=0,7"],
     "experiments.sessions_ab: --mtp=0,7: give MTP depths, whole numbers in [0, 3], comma-separated"),
    (["experiments.sessions_ab", "--config=configs/tiny.py", "--append=0", "--workload=zipfx"],
     "experiments.sessions_ab: --workload: unknown workload 'zipfx': "),
    (["experiments.sessions_ab", "--config=configs/tiny.py", "--pairs=0"], "flag --pairs=0: 0 is not a positive integer"),
    (["experiments.offload_ab", "--config=configs/tiny.py", "--workloads=bogus"],
     "experiments.offload_ab: --workloads: unknown workload 'bogus': "),
    (["experiments.offload_ab", "--config=configs/tiny.py", "--config.run.mtp=7"],
     "experiments.offload_ab: --config.run: mtp must be an int depth in [0, 3], got 7"),
    (["experiments.throughput", "--config=configs/tiny.py", "--histories=abc"],
     "experiments.throughput: --histories=abc: give history lengths in tokens, whole numbers >= 1, comma-separated"),
    (["experiments.live_history_ab", "--config=configs/tiny.py", "--large_capacity=2048", "--pairs=0"],
     "flag --pairs=0: 0 is not a positive integer"),
    (["experiments.generate", "--config=configs/tiny.py", "--bandwidth_mib=-5"],
     "flag --bandwidth_mib=-5: -5 is not a non-negative integer"),
    (["experiments.bench_fill_round", "--tiny", "--rows=0"], "flag --rows=0: 0 is not a positive integer"),
    (["experiments.bench_kernels", "--tiny", "--iters=0"], "argument --iters: '0' is not a whole number >= 1"),
    (["experiments.run_notebooks", "--cell_timeout_s=0", "00_quickstart"],  # 0 ran without a limit, and saved
     "flag --cell_timeout_s=0: 0 is not a positive integer"),
    (["experiments.compare_profiles", "/nonexistent/before.json", "/nonexistent/after.json"],
     "experiments.compare_profiles: /nonexistent/before.json: cannot read a profile_decode report ([Errno 2]"),
    # Found before the work since stop 79's audit (after it, most as tracebacks: a results file that cannot be
    # written, an offload cache too small for a round after the resident half had run, a save directory holding
    # other files after the prefill it was for, a --config file that does not load once an override is given)
    (["experiments.offload_ab", "--config=configs/tiny.py", "--out=/proc/x.json"],
     "experiments.offload_ab: --out=/proc/x.json: cannot write a file in /proc"),
    (["experiments.sessions_ab", "--config=configs/tiny.py", "--append=0", "--config.cache.hot_rows=16"],
     "experiments.sessions_ab: offload: hot_rows=16 is below what a round can pin"),
    (["experiments.profile_decode", "--config=configs/tiny.py", "--config.cache.hot_rows=16"],
     "experiments.profile_decode: offload: hot_rows=16 is below what a round can pin"),
    (["experiments.throughput", "--config=configs/tiny.py", "--histories=128", "--config.cache.hot_rows=16"],
     "experiments.throughput: offload: hot_rows=16 is below what a round can pin"),
    (["experiments.live_history_ab", "--config=configs/tiny.py", "--modes=ofload"],
     "experiments.live_history_ab: --modes=ofload: the cache modes are resident, offload (got 'ofload')"),
    (["experiments.sessions_ab", "--config=configs/tiny.py", "--append=0", "--prefill_once=configs"],
     "experiments.sessions_ab: --prefill_once=configs: "),
    (["experiments.sessions_1m", "--config=configs/tiny.py", "--sessions=1", "--prefill_only",
      "--save_history=configs"], "experiments.sessions_1m: --save_history=configs: "),
    (["experiments.sessions_ab", "--config=configs/tiny.py", "--append=0", "--pairs=3", "--max_pairs=2"],
     "experiments.sessions_ab: --max_pairs=2 is below --pairs=3"),
    (["experiments.sessions_ab", "--config=configs/tiny.py", "--budget_s=-5"],
     "flag --budget_s=-5: -5.0 is not a non-negative number"),
    (["experiments.policy_sweep", "--steps=0"], "flag --steps=0: 0 is not a positive integer"),
    (["experiments.capacity", "--machine=custom"],
     "experiments.capacity: --machine=custom needs --devices, --device_gib and --host_gib"),
    (["experiments.generate", "--config=configs/tiny.py", "--baseline_compiler_options=xla_bogus=1"],
     "experiments.generate: --baseline_compiler_options: compiler_options {'xla_bogus': 1} were refused"),
    (["experiments.generate", "--config=configs/tiyn.py", "--config.cache.mode=offload"],
     "--config=configs/tiyn.py: cannot load it ([Errno 2] No such file or directory"),
    # a placeholder, so it can be set at all (ml_collections refused any override of a None field): checked as a value
    (["experiments.generate", "--config=configs/tiny.py", "--config.model.eos_token_id=600"],
     "experiments.generate: eos_token_id must be None or token ids in [0, vocab_size=512), got 600")])
def test_entry_points_refuse_bad_flags_in_one_line(args, message):
    """A count of zero, a word for a number, an unknown workload or MTP depth, a missing report, an unwritable
    output, an unrunnable cache, an unusable save directory: one line naming the flag, before anything is built
    (these were tracebacks, a ZeroDivisionError after the whole run, or timings of nothing)."""
    p = python_runner.run(["-m", *args], cwd=ROOT, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert message in p.stderr, p.stderr[-2000:]

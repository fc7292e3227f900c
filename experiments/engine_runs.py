"""What the A/B entry points share: one timed ``Engine.generate`` run that leaves the sessions as it found them,
the figures reported for it, the logits check, and the pooled loss over interleaved pairs (``offload_ab`` too)."""

import numpy as np

import glm53
import glm53.engine


def run(e: glm53.Engine, sids: list, n: int, depth: int, accept, selection, logits=False) -> dict:
    """``n`` tokens for every session of ``sids`` in one ``generate`` call (MTP ``depth``, ``accept`` the forced
    acceptance or None, ``selection`` the workload's override or None), then every session rolled back to where it
    was, so the next run starts from the same state. Returns the tokens, the run report and, offloaded, hit rates."""
    before = {s: e.stats(s) for s in sids}
    # progress=False: a bar's terminal writes would land between the timed step calls
    out = e.generate({s: n for s in sids}, mtp=depth, accept_override=accept, selection_override=selection,
                     return_logits=logits, progress=False)
    r = e.last_run
    res = {"tokens": [out[s] for s in sids], "report": r}
    if e.offload:
        after = {s: e.stats(s) for s in sids}
        hits = [after[s]["hits"] - before[s]["hits"] for s in sids]
        misses = [after[s]["misses"] - before[s]["misses"] for s in sids]
        res["hit_rate_per_session"] = [h / (h + m) if h + m else None for h, m in zip(hits, misses)]
        h, m = sum(hits), sum(misses)
        res["hit_rate"] = h / (h + m) if h + m else None
        res["misses"] = m
    for s in sids:  # back to the same state for the next run
        e.rollback(s, len(out[s]))
    return res


def warm_up_rounds(one_round, runs: int = 1, inputs=lambda k: k) -> list:
    """Untimed rounds until the timed ones will compile nothing: ``one_round(inputs(k))`` for k = 0, 1, ...
    (``runs`` rounds, then up to two more while the last compiled anything); each round's compile seconds, which do
    not count ``inputs``. XLA drops every executable's CUDA graphs when it loads a new one, and the next calls
    record them again (5-10 ms each against a ~1.2 ms call): a round that compiled something (a settle of a new page
    count as the run ends, an offload session's first rollback) must be followed by an untimed one, not a timed
    one."""
    compiled_s = []
    while len(compiled_s) < runs or (runs and compiled_s[-1] > 0 and len(compiled_s) < runs + 2):
        x = inputs(len(compiled_s))
        before = glm53.engine.compile_seconds()
        one_round(x)
        compiled_s.append(glm53.engine.compile_seconds() - before)
    return compiled_s


def pooled_loss_pct(base_tokens_per_s: list, other_tokens_per_s: list) -> float:
    """The loss of ``other`` against ``base`` over interleaved pairs, from the pooled time per token (every pair's
    seconds per token added up, so each pair weighs the same)."""
    return 100 * (1 - sum(1 / x for x in base_tokens_per_s) / sum(1 / x for x in other_tokens_per_s))


# Two-sided 95% quantiles of Student's t for 1-30 degrees of freedom (then the normal's 1.96 is within 2%).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def loss_interval_pct(losses_pct: list) -> dict:
    """A 95% confidence interval of the loss from its interleaved pairs' losses: their mean plus or minus t times
    their standard error (Student's t, n - 1 degrees of freedom). Each pair's loss compares two runs that ran
    back to back, so a machine's slow drift cancels within a pair and shows only as scatter between pairs, which
    the interval then carries; a host that jitters run by run widens it instead of moving the figure. ``lo`` /
    ``hi`` are None with fewer than two pairs."""
    x = np.asarray(losses_pct, float)
    n = len(x)
    mean = float(x.mean()) if n else None
    if n < 2:
        return {"pairs": n, "mean": mean, "half_width": None, "lo": None, "hi": None}
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    half = float(t * x.std(ddof=1) / np.sqrt(n))
    return {"pairs": n, "mean": mean, "half_width": half, "lo": mean - half, "hi": mean + half}


def target_verdict(interval: dict, target_pct: float) -> str:
    """``met`` when the whole interval lies at or below ``target_pct``, ``missed`` when above it, else
    ``undecided`` (too few pairs or too much scatter to tell)."""
    if interval["hi"] is None:
        return "undecided"
    if interval["hi"] <= target_pct:
        return "met"
    return "missed" if interval["lo"] > target_pct else "undecided"


def more_pairs(losses_pct: list, *, pairs: int, max_pairs: int, half_width_pct: float, elapsed_s: float,
               budget_s: float) -> tuple[bool, bool]:
    """Whether an A/B setting runs another pair, and whether the time budget is what stopped it: always up to
    ``pairs``; then, up to ``max_pairs``, while the losses' 95% interval is wider than ``half_width_pct`` and
    ``elapsed_s`` has not passed ``budget_s`` (0: no budget)."""
    done = len(losses_pct)
    if done < pairs:
        return True, False
    if done >= max_pairs:
        return False, False
    interval = loss_interval_pct(losses_pct)
    if interval["half_width"] is not None and interval["half_width"] <= half_width_pct:
        return False, False
    if budget_s and elapsed_s > budget_s:
        return False, True
    return True, False


def setting_deadline_s(elapsed_s: float, budget_s: float, settings_left: int) -> float:
    """When a setting's extra pairs must stop, in seconds since the start: an equal share of the budget left for
    this setting and the ones after it (0: no budget). Without shares a jittering host made the first setting add
    pairs until the whole budget was spent (``sessions_ab_10x50k_59a7e32.json``: ten MTP 0 pairs, then the call's
    time limit ended the run before its MTP 3 setting began)."""
    if not budget_s:
        return 0.0
    return elapsed_s + max(budget_s - elapsed_s, 0.0) / max(settings_left, 1)


def same_logits(a: dict, sids_a: list, b: dict, sids_b: list) -> bool:
    """Whether two ``run(..., logits=True)`` results hold bit-identical logits, session by session."""
    return all(np.array_equal(a["report"].logits[x], b["report"].logits[y]) for x, y in zip(sids_a, sids_b))


def per_session_decode_tokens(report, tokens: list) -> list | None:
    """Each session's tokens that ``report.decode_s`` timed (the loop's steps emitted them), for tokens/s per session
    that add up to ``report.decode_tokens``. A session whose history ends with a processed token samples its first
    new token from its stored hidden state before the loop (timed in ``first_token_s``); one with a pending token (a
    session rolled back after an earlier run, as every timed run of the A/Bs is) gets every token from the loop.
    ``tokens``: each session's tokens of the run. None when some sessions took their first token before the loop and
    others did not: the report does not say which."""
    before_loop = sum(len(t) for t in tokens) - report.decode_tokens
    if before_loop == 0:
        return [len(t) for t in tokens]
    if before_loop == len(tokens):
        return [len(t) - 1 for t in tokens]
    return None


def per_session_tokens_per_s(report, tokens: list) -> list | None:
    """``per_session_decode_tokens`` over ``report.decode_s`` (None entries without a timed decode)."""
    n = per_session_decode_tokens(report, tokens)
    if n is None:
        return None
    return [k / report.decode_s if report.decode_s > 0 else None for k in n]


def _median_ms(seconds: list) -> float | None:
    return 1e3 * float(np.median(seconds)) if seconds else None


def figures(res: dict, n_sessions: int) -> dict:
    """The reported figures of one ``run``: tokens/s, MTP counts, step-call percentiles and the slowest calls."""
    r = res["report"]
    pct, gaps = r.step_call_ms, r.step_interval_ms
    total = sum(len(t) for t in res["tokens"])
    copyback, copying = set(r.copyback_steps), set(r.copy_steps)
    calls_ms = [round(1e3 * t, 3) for t in r.step_call_s]
    return {
        # the tokens the decode loop emitted, over its time (a first token sampled before the loop is not in it)
        "aggregate_tokens_per_s": r.decode_tokens / r.decode_s,
        "per_session_tokens_per_s": per_session_tokens_per_s(r, res["tokens"]),
        "tokens_total": total, "decode_s": r.decode_s, "first_token_s": r.first_token_s, "steps": r.steps,
        "mtp_proposed": r.mtp_proposed, "mtp_accepted": r.mtp_accepted, "mtp_committed": r.mtp_committed,
        "acceptance_real": r.acceptance, "tokens_per_step_per_session": r.decode_tokens / max(r.steps, 1) / n_sessions,
        "step_call_ms": pct, "step_call_p99_over_median": pct["p99"] / pct["p50"] if pct else None,
        # the token latency a caller sees (RunReport.step_interval_ms): where a stall of the device shows
        "step_interval_ms": gaps, "step_interval_p99_over_median": gaps["p99"] / gaps["p50"] if gaps else None,
        # how long each read waited for the device (RunReport.step_wait_ms): near zero, the host set the pace
        "step_wait_ms": r.step_wait_ms,
        "copyback_steps": r.copyback_steps, "copy_steps": len(r.copy_steps),  # steps dispatched with the copyback
        "hit_rate": res.get("hit_rate"), "misses": res.get("misses"),
        # every call, in step order: where the slow ones fall (periodic, clustered, at copybacks) says what they are
        "step_calls_ms": calls_ms,
        # counted on the listed (rounded) figures, so a reader recounting them gets the same number: counted on the
        # unrounded times, a call within rounding of the 1.25x line could fall on the other side (CI at 87b339c)
        "step_calls_over_1_25x_median": int(np.sum(np.asarray(calls_ms) > 1.25 * np.median(calls_ms)))
        if calls_ms else 0,
        # which calls are slow: the p99 target is about them (copyback steps against the others, the slowest)
        "slowest_step_calls_ms": glm53.engine.slowest_calls_ms(r.step_call_s, 8),
        "copyback_step_call_ms_median": _median_ms([r.step_call_s[i - 1] for i in r.copyback_steps
                                                    if 0 < i <= len(r.step_call_s)]),
        "other_step_call_ms_median": _median_ms([t for i, t in enumerate(r.step_call_s, 1)
                                                 if i not in copyback]),
        # Plain offload decode runs two executables, with and without the copyback (glm53.engine._Run._copy_pages):
        # at abf301d the copying one's host calls were the slow ones (4.1-4.8 ms against 2.5-3.1 ms).
        "copy_step_numbers": list(r.copy_steps),
        "copy_step_call_ms_median": _median_ms([r.step_call_s[i - 1] for i in r.copy_steps
                                                if 0 < i <= len(r.step_call_s)]),
        "copy_free_step_call_ms_median": _median_ms([t for i, t in enumerate(r.step_call_s, 1)
                                                     if i not in copying]),
        "hit_rate_per_session": res.get("hit_rate_per_session"), "compile_s": r.compile_s,
        "decode_compile_s": r.decode_compile_s,
    }

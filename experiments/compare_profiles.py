"""Two decode profiles side by side, by the model's op: where a change moved device time.

    python -m experiments.compare_profiles BEFORE.json AFTER.json [--mode=resident] [--top=25] [--out=diff.json]

Reads ``experiments.profile_decode`` reports. XLA numbers its fusions per build (``gemm_fusion_dot_199`` in one is
another dot in the next), so kernels are matched by the op they ran for, layers summed (``us_per_step_by_op``).
A report from before that field (profiles of d9ae3a9 and older) is matched by kernel name, which holds only for
builds that compile alike: the output says which.
"""

import json

from absl import app, flags

from experiments import cli
from experiments.trace_util import by_op

FLAGS = flags.FLAGS
flags.DEFINE_string("mode", "resident", "the cache mode whose profile to compare (a key of the reports' modes)")
flags.DEFINE_integer("top", 25, "ops to list, the largest changes first")
flags.DEFINE_string("out", "", "also write the comparison here as JSON")


def ops_of(mode_report: dict, match_by_op: bool) -> dict:
    """``{op or kernel: [kernels a step, us a step]}``: by op, or by kernel name for reports from before
    ``us_per_step_by_op`` (they carry no op per kernel; then both sides must be keyed by name to meet)."""
    if match_by_op:
        return mode_report["us_per_step_by_op"]
    rows = [(name, (calls, ns, "", scope)) for name, scope, calls, ns, *_ in mode_report["all_kernels"]]
    return by_op(rows, mode_report["decode_steps_profiled"])


def compare(before: dict, after: dict, mode: str) -> dict:
    for name, report in (("before", before), ("after", after)):
        if mode not in report.get("modes", {}):
            raise ValueError(f"the {name} report has no {mode!r} profile (it has {sorted(report.get('modes', {}))})")
    b, a = before["modes"][mode], after["modes"][mode]
    match_by_op = "us_per_step_by_op" in b and "us_per_step_by_op" in a
    ops_b, ops_a = ops_of(b, match_by_op), ops_of(a, match_by_op)
    rows = []
    for key in set(ops_b) | set(ops_a):
        kb, ub = ops_b.get(key, [0.0, 0.0])
        ka, ua = ops_a.get(key, [0.0, 0.0])
        rows.append({"op": key, "us_before": ub, "us_after": ua, "us_delta": ua - ub,
                     "kernels_before": kb, "kernels_after": ka})
    rows.sort(key=lambda r: -abs(r["us_delta"]))
    return {
        "mode": mode,
        "matched_by": "op" if match_by_op else "kernel name",
        "revisions": [before.get("git", {}).get("commit"), after.get("git", {}).get("commit")],
        "busy_us_per_step": [b["busy_us_per_step"], a["busy_us_per_step"]],
        "kernels_per_step": [b["kernels_per_step"], a["kernels_per_step"]],
        "ops": rows,
    }


def main(argv):
    if len(argv) != 3:
        raise app.UsageError("give two profile_decode reports: BEFORE.json AFTER.json")
    reports = []
    for path in argv[1:]:
        try:
            with open(path) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as e:  # missing, unreadable or not JSON: named, not a traceback
            raise app.UsageError(f"{path}: cannot read a profile_decode report ({e})") from None
    try:
        diff = compare(*reports, FLAGS.mode)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    (rb, ra), (bb, ba), (kb, ka) = diff["revisions"], diff["busy_us_per_step"], diff["kernels_per_step"]
    print(f"{FLAGS.mode}: {rb} -> {ra}: busy {bb:,.1f} -> {ba:,.1f} us a step ({ba - bb:+,.1f}), "
          f"kernels {kb:.0f} -> {ka:.0f} ({ka - kb:+.0f}); matched by {diff['matched_by']}")
    print(f"{'us before':>10} {'us after':>10} {'delta':>9} {'kernels':>11}  op")
    for r in diff["ops"][:FLAGS.top]:
        print(f"{r['us_before']:10.1f} {r['us_after']:10.1f} {r['us_delta']:+9.1f} "
              f"{r['kernels_before']:5.1f}>{r['kernels_after']:<5.1f}  {r['op'][-110:]}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(diff, f, indent=1)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)

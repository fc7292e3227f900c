"""Summarise a compile profile (``tests/compile_profile/sitecustomize.py``): seconds of tracing, lowering and XLA
compiling by jitted function, by test file and by test, cache misses apart from persistent-cache loads.

    python -m tests.compile_profile.summarize DIR [--top N]
"""

import argparse
import collections
import glob
import os


def read(directory: str):
    """Yield (process argv, kind, seconds, function, test); a compile right after a cache hit of the same process is
    kind "load" (a persistent-cache hit's loading), else "compile" (a miss)."""
    for path in sorted(glob.glob(os.path.join(directory, "events-*.tsv"))):
        argv, hit = "", False
        for line in open(path):
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "#argv":
                argv = fields[1]
                continue
            kind, seconds, fun, test = fields
            if kind == "cache_hit":
                hit = True
                continue
            if kind == "compile":
                kind, hit = ("load" if hit else "compile"), False
            yield argv, kind, float(seconds), fun.removeprefix("jit(").removesuffix(")"), test


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    kinds = ("trace", "lower", "compile", "load")
    total = collections.Counter()
    by = {k: collections.defaultdict(collections.Counter) for k in ("function", "file", "test")}
    for argv, kind, s, fun, test in read(a.directory):
        total[kind] += s
        total["n_" + kind] += 1
        test = test or f"(process: {argv[:60]})"
        for key, name in (("function", fun), ("file", test.split("::")[0]), ("test", test)):
            by[key][name][kind] += s
            by[key][name]["n_compile"] += kind == "compile"
    print("all processes: " + ", ".join(f"{k} {total[k]:.1f} s ({total['n_' + k]})" for k in kinds))
    for key, rows in by.items():
        print(f"\nby {key} (seconds: trace / lower / compile / load; misses compiled)")
        for name, c in sorted(rows.items(), key=lambda kv: -sum(kv[1][k] for k in kinds))[:a.top]:
            print(f"{sum(c[k] for k in kinds):8.1f}  " + " / ".join(f"{c[k]:.1f}" for k in kinds)
                  + f"  {c['n_compile']:5d}  {name[:110]}")


if __name__ == "__main__":
    main()

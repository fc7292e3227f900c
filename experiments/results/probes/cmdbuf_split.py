"""Which instructions of a compiled decode step run outside XLA's command buffers (CUDA graphs), and how XLA
compiled the matrix-vector products that profile as a loop fusion plus a reduce fusion (the indexer's wq_b).

Reads an XLA dump folder (``--xla_dump_to=D --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_decode``), takes the
largest ``*jit_decode*after_optimizations.txt`` (the step with the model's layers) and writes a JSON summary to
argv[2]: the ENTRY computation's instructions in order, each either a ``command_buffer`` call or not, the runs of
non-command-buffer instructions with their op names, and every fusion whose metadata names ``wq_b`` with its root
and operand shapes. A gzip of the HLO text goes beside it (argv[2] + ".hlo.gz").

    python experiments/results/probes/cmdbuf_split.py DUMP_DIR OUT.json
"""
import glob
import gzip
import json
import os
import re
import sys

dump, out = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(os.path.join(dump, "*jit_decode*after_optimizations.txt")), key=os.path.getsize)
if not files:
    sys.exit(f"no jit_decode after_optimizations dump in {dump}: {sorted(os.listdir(dump))[:20]}")
path = files[-1]
text = open(path).read()
with gzip.open(out + ".hlo.gz", "wt") as f:
    f.write(text)

# Computations: "name {" ... "}" blocks; ENTRY marked.
comps, entry, cur, body = {}, None, None, []
for line in text.splitlines():
    m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m and cur is None:
        cur, body = m.group(2), []
        if m.group(1):
            entry = cur
        continue
    if cur is not None:
        if line.startswith("}"):
            comps[cur] = body
            cur = None
        else:
            body.append(line.strip())


def parse(inst: str) -> dict:
    m = re.match(r"^(ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$", inst)
    if not m:
        return {"raw": inst[:200]}
    name, shape, opcode, rest = m.group(2), m.group(3), m.group(4), m.group(5)
    op_name = re.search(r'op_name="([^"]*)"', inst)
    calls = re.search(r"(?:calls|to_apply)=%?([\w.\-]+)", inst)
    kind = re.search(r"kind=(\w+)", inst)
    return {"name": name, "opcode": opcode, "shape": shape[:120], "op_name": op_name.group(1) if op_name else "",
            "calls": calls.group(1) if calls else "", "kind": kind.group(1) if kind else ""}


entry_insts = [parse(i) for i in comps.get(entry, [])]
trivial = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
seq, runs, run = [], [], []
for i in entry_insts:
    if i.get("opcode") in trivial or "opcode" not in i:
        continue
    in_cb = i["opcode"] == "call" and "command_buffer" in i["calls"]
    seq.append({"name": i["name"], "opcode": i["opcode"], "command_buffer": in_cb, "op_name": i["op_name"][-120:]})
    if in_cb:
        if run:
            runs.append(run)
        run = []
    else:
        run.append(f'{i["opcode"]}:{i["name"]}:{i["kind"]}:{i["op_name"][-100:]}')
if run:
    runs.append(run)

wq_b = []
for cname, insts in comps.items():
    for raw in insts:
        if "wq_b" in raw and (raw.startswith("ROOT") or " fusion(" in raw or " dot(" in raw):
            p = parse(raw)
            wq_b.append({"computation": cname, **p, "raw": raw[:400]})

summary = {
    "file": os.path.basename(path),
    "files": [os.path.basename(f) for f in files],
    "entry": entry,
    "entry_instructions": len(seq),
    "command_buffer_calls": sum(s["command_buffer"] for s in seq),
    "outside_command_buffers": sum(not s["command_buffer"] for s in seq),
    "outside_runs": [{"length": len(r), "first": r[:12], "last": r[-3:]} for r in runs],
    "entry_sequence": seq,
    "wq_b": wq_b[:40],
}
json.dump(summary, open(out, "w"), indent=1)
print(f"{summary['file']}: {summary['entry_instructions']} entry instructions, {summary['command_buffer_calls']} "
      f"command buffers, {summary['outside_command_buffers']} outside, runs {[len(r) for r in runs]}; "
      f"wq_b lines {len(wq_b)}")

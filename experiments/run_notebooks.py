"""Execute every notebook in notebooks/ in place, outputs kept, so the committed notebooks show their pictures.

    python -m experiments.run_notebooks                  # all of them
    python -m experiments.run_notebooks 01_capacity      # by name (a prefix of the file name)
"""

import glob
import logging
import os

import nbformat
from absl import app, flags
from nbclient import NotebookClient

from experiments import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# nbclient logs each notebook it starts at INFO (traitlets' logger, printed by absl's handler): "executed ..." below
# says it once
logging.getLogger("traitlets").setLevel(logging.WARNING)

_TIMEOUT = flags.DEFINE_integer("cell_timeout_s", 600, "seconds a notebook cell may run", lower_bound=1)


def as_a_terminal_leaves_it(text: str) -> str:
    """``text`` as a terminal shows it once written: each line's last carriage-return segment. Progress bars redraw a
    line with ``\\r`` and clear it at the end (``leave=False``); a notebook keeps every redraw in its stream output, and
    the saved notebook would show them all."""
    lines = []
    for line in text.split("\n"):
        shown = line.split("\r")[-1]
        if shown.strip() or not line.strip():  # a line that only held redrawn bars goes
            lines.append(shown)
    return "\n".join(lines)


def without_progress_bars(nb) -> None:
    """Every stream output of ``nb`` as a terminal would leave it (progress bars gone, everything else kept)."""
    for cell in nb.cells:
        merged = []  # a bar's draws and its clearing arrive as separate outputs: one stream's run of them is one text
        for out in cell.get("outputs", []):
            last = merged[-1] if merged else None
            if (out.get("output_type") == "stream" and last is not None and last.get("output_type") == "stream"
                    and last.get("name") == out.get("name")):
                last["text"] += out["text"]
            else:
                merged.append(out)
        outputs = []
        for out in merged:
            if out.get("output_type") == "stream":
                out["text"] = as_a_terminal_leaves_it(out["text"])
                if not out["text"].strip():
                    continue
            outputs.append(out)
        if "outputs" in cell:
            cell["outputs"] = outputs


def main(argv) -> None:
    names = argv[1:]
    paths = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    unknown = [n for n in names if not any(os.path.basename(p).startswith(n) for p in paths)]
    if unknown:  # a typo would otherwise run nothing and succeed
        raise app.UsageError(f"no notebook's name starts with {', '.join(unknown)}; the notebooks: "
                             + ", ".join(os.path.basename(p) for p in paths))
    if names:
        paths = [p for p in paths if any(os.path.basename(p).startswith(n) for n in names)]
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, kernel_name="python3", timeout=_TIMEOUT.value,
                       resources={"metadata": {"path": ROOT}}).execute()
        without_progress_bars(nb)
        nbformat.write(nb, path)
        print(f"executed {os.path.relpath(path, ROOT)}", flush=True)


if __name__ == "__main__":
    cli.run(main)

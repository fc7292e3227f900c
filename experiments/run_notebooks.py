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

_TIMEOUT = flags.DEFINE_integer("cell_timeout_s", 600, "seconds a notebook cell may run")


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
        nbformat.write(nb, path)
        print(f"executed {os.path.relpath(path, ROOT)}", flush=True)


if __name__ == "__main__":
    cli.run(main)

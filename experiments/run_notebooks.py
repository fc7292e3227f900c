"""Execute every notebook in notebooks/ in place, outputs kept, so the committed notebooks show their pictures.

    python -m experiments.run_notebooks                  # all of them
    python -m experiments.run_notebooks 01_capacity      # by name
"""

import glob
import os
import sys

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(names: list[str]) -> None:
    paths = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    if names:
        paths = [p for p in paths if any(os.path.basename(p).startswith(n) for n in names)]
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": ROOT}}).execute()
        nbformat.write(nb, path)
        print(f"executed {os.path.relpath(path, ROOT)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

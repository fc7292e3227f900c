"""Every notebook in notebooks/ is committed executed and executes again top to bottom without an error (kernel
python3 from this environment)."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_notebooks_exist():
    assert NOTEBOOKS, "no notebooks in notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    # Committed executed, so a reader on the web sees the pictures (python -m experiments.run_notebooks refreshes
    # them); here they are executed again from the top.
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), \
        "commit notebooks executed: python -m experiments.run_notebooks"
    # Raises CellExecutionError (with the cell and traceback) on the first failing cell. Run from notebooks/, where
    # Jupyter opens them: each finds the repository above it. The kernel is stopped at once after the last cell
    # instead of asked to exit: a graceful exit freed JAX's programs first, ~1 s a notebook.
    NotebookClient(nb, kernel_name="python3", timeout=300, shutdown_kernel="immediate",
                   resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


def test_committed_outputs_keep_no_progress_bar_redraws():
    """A bar's redraws (``\\r``) stay out of the saved notebooks: run_notebooks keeps what a terminal would show."""
    from experiments.run_notebooks import as_a_terminal_leaves_it

    assert as_a_terminal_leaves_it("a\rb\nkept\n\rdecode:  12%|#  | 3/24\r                \r\nend") == "b\nkept\nend"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        redrawn = [c.source[:40] for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream" and "\r" in o.text]
        assert not redrawn, f"{os.path.basename(path)}: re-run python -m experiments.run_notebooks"

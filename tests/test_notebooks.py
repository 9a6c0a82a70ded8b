"""The notebooks in notebooks/ run top to bottom in a real Jupyter kernel (nbclient) in
the project's environment, with CI=1 (their slow paths take a smaller setting), and are
committed without outputs (`make notebooks` renders them with outputs to HTML)."""

import glob
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"cells {dirty} keep outputs: clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_runs_top_to_bottom(path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("CI", "1")  # the kernel inherits it: slow paths take their small setting
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors

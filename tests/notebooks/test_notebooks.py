"""The notebooks in notebooks/ run top to bottom in a real Jupyter kernel (nbclient) in
the project's environment, with CI=1 (their slow paths take a smaller setting), and are
committed without outputs (`make notebooks` renders them with outputs to HTML).

Each notebook's run is its own test file (test_<notebook>.py), so `make test`'s workers,
which take whole files, share them out: together they would hold one worker for minutes."""

import glob
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_every_notebook_runs_in_a_test():
    assert NOTEBOOKS
    here = os.path.dirname(os.path.abspath(__file__))
    missing = [p for p in NOTEBOOKS if not os.path.exists(os.path.join(here, f"test_{_stem(p)}.py"))]
    assert not missing, f"add tests/notebooks/test_<name>.py running {missing}"


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"cells {dirty} keep outputs: clear them before committing"


def run_top_to_bottom(name: str, monkeypatch) -> None:
    """Run notebooks/<name> in a fresh kernel; fails on any cell's error."""
    from nbclient import NotebookClient

    path = os.path.join(ROOT, "notebooks", name)
    monkeypatch.setenv("CI", "1")  # the kernel inherits it: slow paths take their small setting
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors

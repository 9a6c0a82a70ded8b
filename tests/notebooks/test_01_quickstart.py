from tests.notebooks.test_notebooks import run_top_to_bottom


def test_runs_top_to_bottom(monkeypatch):
    run_top_to_bottom("01_quickstart.ipynb", monkeypatch)

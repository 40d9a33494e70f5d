"""The attention-sink notebook: its .ipynb matches the jupytext source, and it runs top to bottom."""

from __future__ import annotations

from pathlib import Path

import pytest

NB_DIR = Path(__file__).resolve().parents[1] / "experiments" / "notebooks"
SOURCE = NB_DIR / "attention_sinks.py"
NOTEBOOK = NB_DIR / "attention_sinks.ipynb"


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_ipynb_is_generated_from_the_source():
    jupytext = pytest.importorskip("jupytext")
    assert _cells(jupytext.read(SOURCE)) == _cells(jupytext.read(NOTEBOOK)), (
        "attention_sinks.ipynb is out of date: run "
        "`jupytext --to ipynb experiments/notebooks/attention_sinks.py`"
    )


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(bundled):
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    nb = jupytext.read(SOURCE)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NB_DIR)}}
    )
    client.execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "ME layer: 11 (0-based)" in outputs
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors

"""The notebooks: each .ipynb matches its jupytext source, and each runs top to bottom on the bundled
model (attention_sinks: the ME layer, the CircuitsVis views and the widget controls; causal_patching:
activation patching, a weight swap and the sink after a causal edit; quickstart: the public API from
strings, also on the planted model in the quick suite). Each runs in a fresh kernel that imports
this checkout's me_interp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "experiments" / "notebooks"
NOTEBOOKS = ("attention_sinks", "causal_patching", "quickstart")


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_ipynb_is_generated_from_the_source(name):
    jupytext = pytest.importorskip("jupytext")
    assert _cells(jupytext.read(NB_DIR / f"{name}.py")) == _cells(
        jupytext.read(NB_DIR / f"{name}.ipynb")
    ), f"{name}.ipynb is out of date: run `jupytext --to ipynb experiments/notebooks/{name}.py`"


def _execute(name: str, needs: tuple[str, ...] = ("circuitsvis",), model: str | None = None):
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    for module in needs:
        pytest.importorskip(module)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if model is not None:
        env["ME_INTERP_NOTEBOOK_MODEL"] = model
    with pytest.MonkeyPatch.context() as mp:  # the kernel inherits the environment
        for k, v in env.items():
            mp.setenv(k, v)
        return _run(jupytext, nbclient, name)


def _run(jupytext, nbclient, name: str):
    nb = jupytext.read(NB_DIR / f"{name}.py")
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NB_DIR)}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, [(o.get("ename"), o.get("evalue")) for o in errors]
    text = "".join(o.get("text", "") for o in outputs)
    views = [
        o["data"]["text/html"]
        for o in outputs
        if "CircuitsVis.render(" in o.get("data", {}).get("text/html", "")
    ]
    return text, views, outputs


@pytest.mark.slow
def test_attention_sinks_runs_top_to_bottom(bundled):
    text, views, outputs = _execute("attention_sinks")
    assert "ME layer: 11 (0-based)" in text
    # the layer strip and the default-parameter WeMask view render, the massive token marked
    assert len(views) == 2 and all("★" in v for v in views)
    assert "WeMask weight r=0.3 (layers >= 11): attention on ★" in text
    # the widget controls were built (ipywidgets is part of the notebook extra)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)


@pytest.mark.slow
def test_causal_patching_runs_top_to_bottom(bundled):
    text, views, outputs = _execute("causal_patching")
    assert "activation_patching.ffn_writes" in text and "weight_swap.ffn_path" in text
    assert "massive activation removed: attention on ★" in text
    assert len(views) == 1
    plots = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(plots) == 2


QUICKSTART = [  # what a fresh kernel prints: find, locate, WeMask on a string, patch, load_run
    "MELocation(me_layer={me} (1-based {me1}) of {n}, made by the ffn",
    "Site(layer={me} (the detected ME layer; ME layer {me}), position 0",
    "WeMaskEffect(weight r=0.1, layers {me}..{last}, positions [0]; 1 text(s)",
    "logit_diff clean [",
    "me_interp.experiments.me_layer.Result: ME layer {me}\n",
]


def _quickstart_text(model: str | None) -> str:
    text, _, outputs = _execute("quickstart", needs=(), model=model)
    plain = "".join(o.get("data", {}).get("text/plain", "") for o in outputs)
    return text + plain


def test_quickstart_runs_headless_on_the_planted_model():
    text = _quickstart_text("synthetic:planted")
    for line in QUICKSTART:
        assert line.format(me=2, me1=3, n=5, last=4) in text, line


@pytest.mark.slow
def test_quickstart_runs_headless_on_the_bundled_model():
    text = _quickstart_text(None)
    for line in QUICKSTART:
        assert line.format(me=11, me1=12, n=30, last=29) in text, line
    assert "ME layer: 11 (0-based)" in text and "restores " in text

"""The report and the attention viewer in a real browser (headless Chromium, offline): the pages load
without script errors, make no network request, and draw their figures.

Needs Chromium (Debian package ``chromium``) and the Python ``playwright`` package, which drives the
system browser (no ``playwright install``). Screenshots go to ``$ME_INTERP_SHOTS`` (default
``/tmp/shots``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from me_interp import __main__ as cli
from me_interp import battery, report, synthetic

CHROMIUM = os.environ.get("ME_INTERP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = Path(os.environ.get("ME_INTERP_SHOTS", "/tmp/shots"))

if not Path(CHROMIUM).is_file():
    pytest.skip(
        f"no Chromium at {CHROMIUM} (apt-get install chromium, or set ME_INTERP_CHROMIUM)",
        allow_module_level=True,
    )
playwright = pytest.importorskip(
    "playwright.sync_api", reason="the browser tests need playwright (pip install playwright)"
)


@pytest.fixture(scope="module")
def browser():
    # playwright starts the browser with a fresh temporary profile (--user-data-dir) of its own
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


def _open(browser, path: Path, width: int = 1400):
    """Open ``path`` with every non-file request refused; returns (page, errors, requests)."""
    page = browser.new_page(viewport={"width": width, "height": 1000})
    errors: list[str] = []
    remote: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)

    def route(r):
        if r.request.url.startswith("file:"):
            r.continue_()
        else:
            remote.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(path.resolve().as_uri(), wait_until="load")
    return page, errors, remote


@pytest.fixture(scope="module")
def battery_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(synthetic.planted_prompts(4, 10)) + "\n")
    out = root / "out"
    argv = ["--model", "synthetic:planted", "--prompts", str(prompts), "--out", str(out)]
    assert cli.main(argv) == 0
    return out


@pytest.mark.slow  # end to end: the whole battery, then its report in a browser
def test_report_draws_every_figure_offline(browser, battery_out):
    page, errors, remote = _open(browser, battery_out / report.REPORT_FILE)
    plots = page.locator("div.plot")
    n = plots.count()
    state = json.loads((battery_out / report.STATE_FILE).read_text())
    expected = 1 + sum(
        len(report.key_figures(exp, state["experiments"][exp.name]["figures"]))
        for exp in battery.EXPERIMENTS
    )
    assert n == expected
    page.wait_for_function(
        "() => [...document.querySelectorAll('div.plot')].every(d => d.querySelector('.main-svg'))",
        timeout=30_000,
    )
    # every plot drew data: a plotly trace layer with at least one trace in it
    drawn = page.evaluate(
        "() => [...document.querySelectorAll('div.plot')].map(d => "
        "d.querySelectorAll('g.trace, g.hm, image').length)"
    )
    assert all(k > 0 for k in drawn), drawn
    assert page.locator("table.card").inner_text().count("LlamaForCausalLM") == 1
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "report_top.png"))
    page.screenshot(path=str(SHOTS / "report_full.png"), full_page=True)
    assert errors == [] and remote == []
    page.close()


def test_viewer_renders_offline(browser, planted, tmp_path):
    from me_interp import viewer
    from me_interp.interventions.wemask import we_mask

    pytest.importorskip("circuitsvis")
    model, plant = planted
    prompt = synthetic.planted_prompts(1, 10)[0]
    view = viewer.compare_view(
        model,
        prompt,
        [plant.layer - 1, plant.layer + 1],
        fwd_hooks=we_mask(model, 1.0, "weight", me_layer=plant.layer),
        label="WeMask weight r=1",
    )
    path = view.save_html(tmp_path / "view.html")
    page, errors, remote = _open(browser, path, width=1300)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.me-interp-cv')].every(d => d.querySelector('canvas'))",
        timeout=30_000,
    )
    texts = page.locator(".me-interp-cv").all_inner_texts()
    assert len(texts) == 2
    for text in texts:  # the head selector lists every shown head
        assert all(f"L{layer} H0" in text for layer in (plant.layer - 1, plant.layer + 1))
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "viewer.png"), full_page=True)
    assert errors == [] and remote == []
    page.close()
    # the iframe form (an ipywidgets.HTML value in the notebook) renders inside its own document
    framed = tmp_path / "framed.html"
    framed.write_text(f"<!doctype html><html><body>{view.iframe(700)}</body></html>")
    page, errors, remote = _open(browser, framed, width=1300)
    frame = page.frames[1]
    frame.wait_for_function(
        "() => document.querySelectorAll('.me-interp-cv canvas').length >= 2", timeout=30_000
    )
    assert errors == [] and remote == []
    page.close()


def test_a_figure_copied_out_of_its_run_folder_still_renders(browser, tmp_path):
    """A figure's page loads the results folder's plotly.js; copied out, it loads a copy beside it,
    and with none it says what it needs instead of staying blank."""
    import plotly.graph_objects as go

    from me_interp import io, plotting

    run_dir = tmp_path / "out" / "exp" / "run"
    run_dir.mkdir(parents=True)
    fig = go.Figure(go.Bar(x=[1, 2, 3], y=[2.0, 200.0, 20000.0])).update_yaxes(type="log")
    io.write_figures(run_dir, {"bars": plotting.tidy(fig)}, out_root=tmp_path / "out")
    alone, beside = tmp_path / "alone", tmp_path / "beside"
    for d in (alone, beside):
        d.mkdir()
        shutil.copy(run_dir / "bars.html", d / "bars.html")
    shutil.copy(tmp_path / "out" / io.PLOTLY_JS, beside / io.PLOTLY_JS)
    for where in (run_dir, beside):
        page, errors, remote = _open(browser, where / "bars.html")
        page.wait_for_function("() => document.querySelector('g.trace.bars')", timeout=30_000)
        assert page.locator(".no-plotly").count() == 0 and remote == []
        if where is run_dir:  # beside: the missing shared copy is one file-not-found, no error
            assert errors == []
        assert all("ERR_FILE_NOT_FOUND" in e for e in errors), errors
        ticks = page.evaluate(  # a log axis: every label a full value
            "() => [...document.querySelectorAll('g.ytick text')].map(t => t.textContent)"
        )
        assert len(set(ticks)) == len(ticks) and {"20", "200", "2000"} <= set(ticks), ticks
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"figure_{where.name}.png"))
        page.close()
    page, errors, remote = _open(browser, alone / "bars.html")
    assert "needs plotly.js" in page.locator(".no-plotly").inner_text() and remote == []
    page.close()

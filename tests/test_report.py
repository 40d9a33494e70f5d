"""The battery (python -m me_interp): every experiment, the HTML report, resuming after a crash."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from me_interp import __main__ as cli
from me_interp import battery, claims, report, synthetic, terminal
from me_interp.study import CommonConfig


@pytest.fixture()
def args(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(synthetic.planted_prompts(4, 12)) + "\n")
    out = tmp_path / "out"
    return ["--model", "synthetic:planted", "--prompts", str(p), "--out", str(out)], out


@pytest.mark.slow  # end to end: the whole battery from the command line
def test_full_battery_on_planted_model(args, capsys):
    argv, out = args
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    state = json.loads((out / report.STATE_FILE).read_text())
    assert [state["experiments"][n]["status"] for n in battery.NAMES] == ["done"] * len(
        battery.NAMES
    )
    html = (out / report.REPORT_FILE).read_text()
    for name in battery.NAMES:
        assert name in html
        run_dir = out / name
        assert len(list(run_dir.iterdir())) == 1
    for path in out.glob("*/*/*.json"):  # every figure: no annotation placed in data units of a
        fig = json.loads(path.read_text())  # log axis (plotly reads it as log10: a broken range)
        if not isinstance(fig, dict) or "layout" not in fig:
            continue
        lay = fig["layout"]
        for a in lay.get("annotations", []):
            for ax in ("x", "y"):
                ref = a.get(f"{ax}ref", ax)
                key = ref.split(" ")[0].replace(ax, f"{ax}axis", 1)
                if ref.endswith("domain") or ref == "paper" or key not in lay:
                    continue
                assert lay[key].get("type") != "log", (path, a.get("text"), key)
    # every experiment states at least one claim, in the one claim format
    for name, entry in state["experiments"].items():
        assert entry["claims"], name
        for c in entry["claims"]:
            assert c["verdict"] in claims.VERDICTS and c["id"].startswith(name + "."), c["id"]
            assert {"statement", "statistic", "rule", "control", "estimate", "line"} <= set(c)
    # the planted ME layer is what the report says
    me = state["experiments"]["me_layer"]["claims"][0]
    assert me["verdict"] == claims.HOLDS and "ME layer 2" in me["line"]
    assert "holds:" in html and "95% CI" in html
    md = (out / report.SUMMARY_FILE).read_text()
    n_claims = sum(len(e["claims"]) for e in state["experiments"].values())
    table, _, rest = md.partition("\n\nEach claim in full")
    assert table.count("\n| ") == n_claims + 2  # header, rule, one row per claim
    # each experiment's wall time and peak memory: in battery.json, report.md and report.html
    costs = rest.split("Cost per experiment", 1)[1]
    for name, entry in state["experiments"].items():
        assert 0 < entry["seconds"] < 600 and entry["peak_rss_mib"] > 50, (name, entry)
        assert f"| {name} | done | " in costs and report.cost_text(entry) in html
    assert "| me_layer | `me_layer.sudden_birth` | claim | **holds** | holds |" in md
    # raw and Holm-adjusted counts, controls and sanity checks apart: the same numbers everywhere
    t = state["tally"]
    assert t == claims.tally([c for e in state["experiments"].values() for c in e["claims"]])
    assert sum(t["raw"].values()) == sum(  # corollaries are shown, never counted
        c["kind"] == "claim" and not c.get("implied_by")
        for e in state["experiments"].values()
        for c in e["claims"]
    )
    assert claims.tally_text(t) in md and claims.tally_text(t) in printed.out
    assert "claims, Holm-adjusted" in html and "controls (not counted)" in html
    assert (
        "report:" in printed.out
        and f"[{len(battery.NAMES)}/{len(battery.NAMES)}] sink_causality" in printed.err
    )
    _check_report_figures(out, state, html)


def _embedded(html: str) -> dict[str, dict]:
    """The plotly figures embedded in a report page, by div id."""
    return {
        m.group(1): json.loads(m.group(2))
        for m in re.finditer(
            r"<script type='application/json' id='([^']+)-data'>(.*?)</script>", html
        )
    }


def _check_report_figures(out: Path, state: dict, html: str) -> None:
    """The page draws each experiment's key figures from their files with the one local plotly.js,
    opens with the model card, and every relative link resolves."""
    assert (out / "plotly.min.js").is_file()
    assert '<script src="plotly.min.js"></script>' in html
    assert not re.search(r"<script[^>]*src=[\"']?https?:", html)
    # every key figure names a figure its experiment writes (the mapping follows the experiments)
    for exp in battery.EXPERIMENTS:
        assert set(exp.key_figures) <= set(state["experiments"][exp.name]["figures"]), exp.name
    embedded = _embedded(html)
    expected = {"fig-top": ("me_layer", report.TOP_FIGURE[1])}
    for exp in battery.EXPERIMENTS:
        for i, stem in enumerate(exp.key_figures):
            expected[f"fig-{exp.name}-{i}"] = (exp.name, stem)
    assert set(embedded) == set(expected)
    for div, (name, stem) in expected.items():
        assert f"<div class=plot id='{div}'></div>" in html
        on_disk = json.loads(
            (Path(state["experiments"][name]["run_dir"]) / f"{stem}.json").read_text()
        )
        assert embedded[div]["data"] == on_disk["data"], div  # the figure's data, unchanged
        assert "width" not in embedded[div]["layout"]
    # the model card: what was loaded and which code ran
    card = html[html.index("model card") : html.index("claims of the paper")]
    env = json.loads(next((out / "me_layer").glob("*/env.json")).read_text())
    for key, value in (
        ("architecture", env["architecture"]),
        ("layers", env["n_layers"]),
        ("d_model", env["d_model"]),
        ("dtype", "float32"),
        ("device", "cpu"),
    ):
        assert f"<th>{key}</th><td>{value}</td>" in card, key
    assert "layer 2 (0-based) = 3 (1-based), made by the ffn" in card
    assert "n = 4 in the ME-layer scan" in card and state["settings"]["git_commit"] in card
    assert "every prompt starts with BOS" in card
    total = sum(e["seconds"] for e in state["experiments"].values())
    assert (
        f"<th>cost</th><td>{terminal.fmt_seconds(total)} over {len(state['experiments'])} " in card
    )
    for href in re.findall(r"href='([^'#][^']*)'", html):
        assert (out / href).is_file(), href


def test_report_links_a_figure_too_large_to_embed(args, monkeypatch):
    argv, out = args
    monkeypatch.setattr(report, "MAX_INLINE_BYTES", 1000)
    assert cli.main(argv + ["--only", "me_layer"]) == 0
    html = (out / report.REPORT_FILE).read_text()
    assert _embedded(html) == {}
    assert "too large to embed" in html and "ratios (full figure)</a>" in html


def test_inline_titles_wrap_and_subplot_grids_are_wide(tmp_path):
    import plotly.io as pio
    from plotly.subplots import make_subplots

    for cols, wide in ((1, False), (report.WIDE_AXES, True)):
        path = tmp_path / f"f{cols}.json"
        path.write_text(pio.to_json(make_subplots(rows=1, cols=cols).update_layout(width=900)))
        text, got = report._figure_json(path)
        assert got is wide and "width" not in json.loads(text)["layout"]
    layout = {"title": {"text": "word " * 40 + "<br><sup>sub</sup>"}}
    report._wrap_title(layout)
    first = layout["title"]["text"].split("<br><sup>")[0]
    assert all(len(line) <= report.TITLE_WIDTH for line in first.split("<br>"))
    assert first.replace("<br>", " ").split() == ["word"] * 40
    assert layout["margin"]["t"] >= 40 + 22 * layout["title"]["text"].count("<br>")


def test_battery_resumes_after_a_crash(args, monkeypatch, capsys):
    argv, out = args
    from me_interp.experiments import mechanism

    def crash(cfg, model=None, site=None):
        raise RuntimeError("simulated crash")

    only = ["--only", "me_layer", "mechanism", "invariance"]
    monkeypatch.setitem(battery.BY_NAME, "mechanism", replace(mechanism.EXPERIMENT, run=crash))
    assert cli.main(argv + only) == 1
    state = json.loads((out / report.STATE_FILE).read_text())
    assert state["experiments"]["me_layer"]["status"] == "done"
    assert state["experiments"]["mechanism"]["status"] == "failed"
    assert "simulated crash" in state["experiments"]["mechanism"]["error"]
    assert (
        state["experiments"]["invariance"]["status"] == "done"
    )  # a failure does not stop the battery
    assert "failed: RuntimeError: simulated crash" in (out / report.REPORT_FILE).read_text()
    first_me_run = state["experiments"]["me_layer"]["run_dir"]

    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main(argv + only) == 0
    printed = capsys.readouterr()
    skipped = [line for line in printed.out.splitlines() if "(finished earlier: skipped)" in line]
    assert [line.split()[0] for line in skipped] == ["me_layer", "invariance"]
    assert "[2/3] mechanism … (" in printed.err and "[1/3]" not in printed.err
    state = json.loads((out / report.STATE_FILE).read_text())
    assert state["experiments"]["mechanism"]["status"] == "done"
    assert state["experiments"]["me_layer"]["run_dir"] == first_me_run
    assert len(list((out / "me_layer").iterdir())) == 1

    # other settings start over; --fresh re-runs
    assert cli.main(argv + ["--only", "me_layer", "--seed", "1"]) == 0
    assert len(list((out / "me_layer").iterdir())) == 2
    assert cli.main(argv + ["--only", "me_layer", "--seed", "1", "--fresh"]) == 0
    assert len(list((out / "me_layer").iterdir())) == 3


def test_battery_bad_input(args, capsys):
    argv, _ = args
    with pytest.raises(SystemExit):
        cli.main(argv + ["--only", "nonsense"])
    assert cli.main(argv + ["--only", "me_layer", "--skip", "me_layer"]) == 2
    assert "no experiments selected" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown experiments"):
        battery.run_battery(CommonConfig(), ["nope"])


def test_battery_starts_over_when_the_code_or_resolved_dtype_changes(args, monkeypatch):
    argv, out = args
    only = ["--only", "me_layer"]
    assert cli.main(argv + only) == 0
    state = json.loads((out / report.STATE_FILE).read_text())
    assert state["settings"]["dtype_resolved"] == "float32"
    assert state["settings"]["device_resolved"] == "cpu"
    assert cli.main(argv + only) == 0
    assert len(list((out / "me_layer").iterdir())) == 1  # same code, same settings: reused
    from me_interp import io

    monkeypatch.setattr(io, "_git_commit", lambda: "another-commit")
    assert cli.main(argv + only) == 0
    assert len(list((out / "me_layer").iterdir())) == 2  # results of other code are not reused
    html = (out / report.REPORT_FILE).read_text()
    assert "another-commit" in html and "float32" in html


def test_battery_starts_over_when_the_placement_changes(args):
    """A model placed otherwise (a device map, offloaded modules) is another model run: not
    reused."""
    argv, out = args
    only = ["--only", "me_layer"]
    assert cli.main(argv + only) == 0
    state = json.loads((out / report.STATE_FILE).read_text())
    assert state["settings"]["placement"] is None
    assert cli.main(argv + only + ["--device-map", "sequential"]) == 0
    assert len(list((out / "me_layer").iterdir())) == 2
    state = json.loads((out / report.STATE_FILE).read_text())
    assert state["settings"]["placement"] is not None


def test_a_placebo_curve_and_a_corollary_are_shown_beside_their_claims():
    pl = claims.Placebo(3, (0, 1, 2, 3, 4), (0.37, 0.21, 0.3, 0.273, 0.33)).judged(">=")
    c = claims.Claim("x.a", "§0", "s", "t", "r", "", claims.FAILS, placebo=pl)
    d = claims.Claim("x.b", "§0", "s", "t", "r", "", claims.HOLDS, implied_by="x.a")
    html_lines = report._claim_lines([c.to_dict(), d.to_dict()])
    rows = "".join(report._claim_rows([c.to_dict(), d.to_dict()]))
    for out in (html_lines, rows):
        assert out.count("<svg") == 1 and "placebo layers: ME 0.273 (layer 3)" in out
        assert "other layers 0.21–0.37" in out and "corollary of <code>x.a</code>" in out


_DEF = "a unit counts when its outcome holds on more than half of the prompts (k of n units)"


def _state(tmp_path: Path) -> dict:
    """A battery state with two judged claims that share a definition, one not applicable, one
    failed experiment and one not run."""
    specs = (
        claims.Spec(
            "weight_swap.a",
            "§1",
            "Part a moves it",
            f"fraction for a; {_DEF}",
            ">=",
            "moved_fraction",
            stat=lambda r: claims.Outcomes([True] * 8, list("abcdefgh"), unit="partner layers"),
        ),
        claims.Spec(
            "weight_swap.b",
            "§1",
            "Part b moves it",
            f"fraction for b; {_DEF}",
            ">=",
            "moved_fraction",
            stat=lambda r: claims.Outcomes([False], ["l0"], unit="partner layers"),
        ),
        claims.Spec(
            "weight_swap.c",
            "§1",
            "Part c moves it",
            "fraction for c",
            ">=",
            "moved_fraction",
            stat=lambda r: claims.Outcomes([True], ["l0"]),
            applies=lambda r: "part c was not swapped",
        ),
    )
    judged = [c.to_dict() for c in claims.judge(specs, object())]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return {
        "settings": {},
        "experiments": {
            "weight_swap": {
                "status": "done",
                "claims": judged,
                "run_dir": str(run_dir),
                "figures": [],
            },
            "transplant": {"status": "failed", "error": "RuntimeError: boom", "seconds": 1.0},
        },
    }


def test_report_opens_with_findings_and_every_claim(tmp_path):
    state = _state(tmp_path)
    exps = [battery.BY_NAME[n] for n in ("weight_swap", "transplant", "sink_causality")]
    out = tmp_path / "out"
    out.mkdir()
    report.write_report(out, state, exps)
    html = (out / report.REPORT_FILE).read_text()
    top, card = html.index("<h2>Findings</h2>"), html.index("model card")
    table = html[html.index("<table class=claimtable>") : html.index("</section>")]
    assert top < html.index("Every claim") < card < html.index("<h2 id='weight_swap'>")
    # one row per claim and per experiment that did not finish, in the battery's order
    assert table.count("<tr") == 1 + 3 + 2
    assert "<td>0</td><td>[0, 0.975]</td><td>1 partner layer</td>" in table  # singular
    assert "8 partner layers" in table and "part c was not swapped" in table
    assert table.index("weight_swap") < table.index("transplant") < table.index("sink_causality")
    # a finding line per measured headline, none for what did not run
    assert (
        "weight_swap: Part a moves it — holds (1 [0.631, 1], n = 8 partner layers); its other "
        "claims: 1 inconclusive." in html
    )
    assert "sink_causality:" not in html.split("<h3>Every claim")[0]
    # the shared definition once, the claims' statistics without it
    assert html.count(_DEF) == 1 and "fraction for a (see the definitions above)" in html
    # no "0 sanity checks" / "1 controls"
    assert "sanity" not in claims.tally_text(
        state_tally := claims.tally(state["experiments"]["weight_swap"]["claims"])
    )
    md = (out / report.SUMMARY_FILE).read_text()
    assert md.startswith("Findings:\n\n- weight_swap: Part a moves it")
    assert claims.tally_text(state_tally) in md and "sanity checks (not counted)" not in html


def test_small_wording():
    assert report.spans_text(list(range(100))) == "0–99 (100)"
    assert report.spans_text([0, 3, 7]) == "0, 3, 7"
    assert report.spans_text([0, *range(2, 30, 2)], show=3) == "0, 2, 4, … (15 in all)"
    assert claims.unit_text(1, "pairs") == "pair" and claims.unit_text(2, "pairs") == "pairs"
    assert claims.unit_text(1, "prompts × seeds") == "prompts × seeds"
    assert claims.unit_text(1, "massive-token prefixes") == "massive-token prefix"
    assert claims.unit_text(1, "target layers") == "target layer"
    long = "not applicable: " + "the massive activation emerges at layer zero " * 3
    cut = terminal._fit(long, 60)
    assert len(cut) <= 60 and cut.endswith("…") and long.startswith(cut[:-1])
    assert cut[:-1].split()[-1] in long.split()  # the last word is whole
    t = {"raw": {"holds": 1}, "holm": {"holds": 1}, "control": {"holds": 1}, "sanity": {}}
    assert claims.tally_text(t) == "1 claim: 1 holds; Holm-adjusted: 1 holds | 1 control: 1 holds"

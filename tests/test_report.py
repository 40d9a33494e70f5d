"""The battery (python -m me_interp): every experiment, the HTML report, resuming after a crash."""

from __future__ import annotations

import json

import pytest

from me_interp import __main__ as cli
from me_interp import claims, report, synthetic


@pytest.fixture()
def args(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(synthetic.planted_prompts(4, 12)) + "\n")
    out = tmp_path / "out"
    return ["--model", "synthetic:planted", "--prompts", str(p), "--out", str(out)], out


def test_full_battery_on_planted_model(args, capsys):
    argv, out = args
    assert cli.main(argv) == 0
    state = json.loads((out / report.STATE_FILE).read_text())
    assert [state["experiments"][n]["status"] for n in report.EXPERIMENTS] == ["done"] * len(
        report.EXPERIMENTS
    )
    html = (out / report.REPORT_FILE).read_text()
    for name in report.EXPERIMENTS:
        assert name in html
        run_dir = out / name
        assert len(list(run_dir.iterdir())) == 1
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
    assert md.count("\n| ") == n_claims + 2  # header, rule, one row per claim
    assert "| me_layer | `me_layer.sudden_birth` | **holds** |" in md
    printed = capsys.readouterr()
    assert (
        "report:" in printed.out
        and f"[{len(report.EXPERIMENTS)}/{len(report.EXPERIMENTS)}] sink_causality" in printed.err
    )


def test_battery_resumes_after_a_crash(args, monkeypatch, capsys):
    argv, out = args
    from me_interp.experiments import mechanism

    def crash(cfg, model=None):
        raise RuntimeError("simulated crash")

    only = ["--only", "me_layer", "mechanism", "invariance"]
    monkeypatch.setattr(mechanism, "run", crash)
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
    err = capsys.readouterr().err
    assert "me_layer: already done, skipped" in err and "invariance: already done, skipped" in err
    assert "[2/3] mechanism ..." in err
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
        report.run_battery(report.CommonConfig(), ["nope"])


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

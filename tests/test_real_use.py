"""Real use: nothing lost and one line for every fault — concurrent batteries into one folder, an
``--out`` that cannot be written, Ctrl-C, a prompt longer than the model's context."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from me_interp import __main__ as cli
from me_interp import battery, io, report, study
from me_interp.experiments import me_layer

ROOT = Path(__file__).resolve().parents[1]


def test_an_out_that_cannot_be_written_is_one_line_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = str(blocker / "runs")  # a folder inside a file: mkdir fails
    assert me_layer.main(["--model", "synthetic:planted", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: out {out} is not writable") and err.count("\n") == 1
    assert cli.main(["--model", "synthetic:planted", "--out", out, "--only", "me_layer"]) == 2
    assert capsys.readouterr().err.startswith(f"error: out {out} is not writable")
    with pytest.raises(ValueError, match="not writable"):
        io.check_writable(out)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    def interrupted(cfg, model=None, site=None):
        raise KeyboardInterrupt

    stopped = dataclasses.replace(me_layer.EXPERIMENT, run=interrupted)
    argv = ["--model", "synthetic:planted", "--out", str(tmp_path)]
    assert study.main(stopped, argv) == study.INTERRUPTED == 130
    err = capsys.readouterr().err
    assert err == "interrupted: me_layer wrote no results (run it again)\n"
    # the battery: what finished is kept, and the line says how to resume
    monkeypatch.setitem(battery.BY_NAME, "invariance", dataclasses.replace(
        battery.BY_NAME["invariance"], run=interrupted))  # fmt: skip
    assert cli.main([*argv, "--only", "me_layer", "invariance"]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("interrupted (during invariance): every finished experiment is saved")
    state = json.loads((tmp_path / report.STATE_FILE).read_text())
    assert state["experiments"]["me_layer"]["status"] == "done"


def test_a_prompt_longer_than_the_context_is_refused(planted):
    model, _ = planted
    assert model.context_length == model.hf.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"more than the {model.context_length} positions"):
        model.tokenize(["w1 " * (model.context_length + 5)])


@pytest.mark.slow  # two processes, each loading torch (~20 s)
def test_two_batteries_into_one_folder_keep_every_experiment(tmp_path):
    out = tmp_path / "runs"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "me_interp", "--model", "synthetic:planted", "--out", str(out)]
    procs = [
        subprocess.Popen(
            [*base, "--only", *names],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for names in (("me_layer", "invariance"), ("transplant", "sink_causality"))
    ]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()
    state = json.loads((out / report.STATE_FILE).read_text())
    want = {"me_layer", "invariance", "transplant", "sink_causality"}
    assert want <= set(state["experiments"])
    assert all(state["experiments"][n]["status"] in report.FINISHED for n in want)
    html = (out / report.REPORT_FILE).read_text()
    assert all(f"<h2 id='{n}'>" in html for n in want)

"""The terminal view: compact claim lines, colour rules, JSON lines, quiet mode, the battery's
progress and cost records, the ``me-interp`` subcommands, quiet loading."""

from __future__ import annotations

import json

import pytest

from me_interp import __main__ as cli
from me_interp import battery, claims, report, terminal, usage
from me_interp.experiments import me_layer

MODEL = "synthetic:planted"


def _claim(verdict="holds", kind="claim", unit="prompts", n=82, n_eff=None, why="", cid=None):
    est = None
    if verdict != claims.NOT_APPLICABLE:
        est = claims.Estimate(0.1234567, 0.01, 1234.5678, n, unit=unit, n_eff=n_eff)
    return claims.Claim(
        cid or "ffn_svd_ablation.svd_gate_random_keeps",
        "§2.1",
        "a statement " * 30,
        "a statistic " * 30,
        "holds if " * 20,
        "a control " * 20,
        verdict,
        why=why,
        estimate=est,
        kind=kind,
        details="details " * 40,
    )


@pytest.mark.parametrize("verdict", claims.VERDICTS)
@pytest.mark.parametrize("kind", claims.KINDS)
def test_a_compact_line_is_short_and_says_verdict_id_estimate_n_kind(verdict, kind):
    c = _claim(
        verdict,
        kind,
        unit="prompts × seeds (crossed two-way bootstrap)",
        n_eff=3,
        why="no massive activation " * 10,
    )
    line = terminal.claim_line(c)
    assert len(line) <= terminal.WIDTH and line.startswith(verdict) and c.id in line
    if kind != "claim":
        assert line.endswith(f"({claims.KIND_LABEL[kind]})")
    if verdict == claims.NOT_APPLICABLE:
        assert "no massive activation" in line
    else:
        assert "0.123 [0.01, 1.23e+03]" in line and "n=82" in line and "3 distinct" in line
    assert "\033[" not in line  # no colour unless asked


def test_the_unit_is_shown_when_it_fits():
    assert "n=82 prompts" in terminal.claim_line(_claim(cid="me_layer.carried"))


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert terminal.use_color(Tty())
    assert not terminal.use_color(open(__file__))  # a file is not a terminal
    monkeypatch.setenv("NO_COLOR", "1")
    assert not terminal.use_color(Tty())
    painted = terminal.claim_line(_claim("fails"), color=True)
    assert painted.startswith("\033[31mfails\033[0m")


def test_experiment_line_counts_kinds_apart_and_gives_the_cost():
    entry = {
        "status": "done",
        "seconds": 75.2,
        "peak_rss_mib": 812.4,
        "claims": [
            _claim("holds").to_dict(),
            _claim("fails").to_dict(),
            _claim("holds", kind="control").to_dict(),
        ],
    }
    line = terminal.experiment_line("mechanism", entry)
    assert line == (
        "mechanism  done in 1 min 15 s (peak 812 MiB): 2 claims: 1 holds, 1 fails; "
        "1 control: 1 holds"
    )
    failed = terminal.experiment_line("x", {"status": "failed", "error": "boom " * 50})
    assert "FAILED" in failed and len(failed) <= terminal.WIDTH


def test_fmt_seconds():
    assert [terminal.fmt_seconds(s) for s in (4.21, 65.0, 3725.0)] == [
        "4.2 s",
        "1 min 05 s",
        "1 h 02 min",
    ]


def _run_me_layer(tmp_path, capsys, *flags):
    rc = me_layer.main(["--model", MODEL, "--out", str(tmp_path), *flags])
    assert rc == 0
    return capsys.readouterr()


def test_experiment_cli_modes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    compact = _run_me_layer(tmp_path, capsys)
    lines = [ln for ln in compact.out.splitlines() if ln.split(" ")[0] in claims.VERDICTS]
    assert len(lines) == len(me_layer.SPECS) and all(len(ln) <= terminal.WIDTH for ln in lines)
    verbose = _run_me_layer(tmp_path, capsys, "--verbose")
    assert sum(ln.startswith("[") for ln in verbose.out.splitlines()) == len(me_layer.SPECS)
    assert max(map(len, verbose.out.splitlines())) > terminal.WIDTH  # the full text
    js = _run_me_layer(tmp_path, capsys, "--json")
    rows = [json.loads(ln) for ln in js.out.splitlines()]  # nothing but JSON on stdout
    assert [r["id"] for r in rows] == [s.id for s in me_layer.SPECS]
    assert {r["experiment"] for r in rows} == {"me_layer"} and "results: " in js.err
    quiet = _run_me_layer(tmp_path, capsys, "--quiet")
    assert quiet.err == "" and "ME layer" not in quiet.out  # no summary table, no notes
    assert len(quiet.out.splitlines()) == len(me_layer.SPECS) + 1  # claims + results path
    terminal.set_quiet(False)


def test_battery_prints_as_it_goes_records_cost_and_estimates_time(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ME_INTERP_CACHE", str(tmp_path / "cache"))
    argv = ["run", "me_layer", "transplant", "--model", MODEL, "--out", str(tmp_path / "b")]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert "[1/2] me_layer … (0.0 s elapsed; about " in first.err  # from the cost model
    heads = [ln for ln in first.out.splitlines() if ln.startswith(("me_layer  ", "transplant  "))]
    assert len(heads) == 2 and all(" done in " in h and "MiB" in h for h in heads)
    state = json.loads((tmp_path / "b" / report.STATE_FILE).read_text())
    for entry in state["experiments"].values():
        assert entry["seconds"] > 0 and entry["peak_rss_mib"] > 0 and entry["rss_scope"]
    recorded = json.loads((tmp_path / "cache" / battery.DURATIONS_FILE).read_text())
    (key,) = recorded
    assert key.startswith(MODEL) and set(recorded[key]) == {"me_layer", "transplant"}
    # a second battery elsewhere estimates from the first one's durations
    argv[-1] = str(tmp_path / "c")
    assert cli.main(argv) == 0
    second = capsys.readouterr()
    assert "[1/2] me_layer … (0.0 s elapsed; about " in second.err
    total = sum(recorded[key].values())
    assert f"about {terminal.fmt_seconds(total)} left" in second.err


def test_battery_quiet_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ME_INTERP_CACHE", str(tmp_path / "cache"))
    base = ["run", "me_layer", "--model", MODEL, "--out", str(tmp_path / "b")]
    assert cli.main([*base, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and not any(ln.startswith("me_layer  ") for ln in quiet.out.splitlines())
    terminal.set_quiet(False)
    assert cli.main([*base, "--json", "--fresh"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in me_layer.SPECS]


def test_report_subcommand_rebuilds_the_report(tmp_path, capsys):
    out = tmp_path / "b"
    assert cli.main(["run", "me_layer", "--model", MODEL, "--out", str(out), "--quiet"]) == 0
    terminal.set_quiet(False)
    (out / report.REPORT_FILE).unlink()
    (out / report.SUMMARY_FILE).unlink()
    capsys.readouterr()
    assert cli.main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {out / report.REPORT_FILE}"
    assert "me_layer.sudden_birth" in (out / report.REPORT_FILE).read_text()
    assert "me_layer.sudden_birth" in (out / report.SUMMARY_FILE).read_text()


def test_claims_and_models_subcommands(capsys):
    assert cli.main(["claims"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ids = [s.id for e in battery.EXPERIMENTS for s in e.specs]
    assert [ln.split(":")[0].split(" ")[0] for ln in lines] == ids
    assert any("(control)" in ln for ln in lines) and any("(sanity check)" in ln for ln in lines)
    assert cli.main(["claims", "me_layer", "--json"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in me_layer.SPECS]
    assert rows[0]["value"] == claims.threshold(rows[0]["threshold"])
    assert cli.main(["models"]) == 0
    names = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()]
    assert names[0] == "bundled" and "gemma-3-270m" in names
    assert {"synthetic:planted", "synthetic:twin-gemma3", "synthetic:decoy-attention"} <= set(names)


def test_python_dash_m_me_interp_keeps_only(tmp_path, capsys):
    argv = ["--only", "me_layer", "--model", MODEL, "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    terminal.set_quiet(False)
    assert "report: " in capsys.readouterr().out


def test_usage_tracks_time_and_the_block_peak():
    import numpy as np

    with usage.track() as big:
        a = np.ones((64, 2**20))  # 512 MiB
        a.sum()
        del a
    with usage.track() as small:
        pass
    assert big.seconds > 0 and small.seconds >= 0
    if big.rss_scope == "block":  # Linux: the high-water mark is reset per block
        assert big.peak_rss_mib - small.peak_rss_mib > 400


def test_loading_shows_no_library_bars(tmp_path, capfd):
    """A load from a saved directory (as the bundled cache loads) prints nothing: transformers'
    weight-loading bar is hidden; a conversion says one me_interp line."""
    from me_interp import models, synthetic

    hf, tok = synthetic.tiny_llama()
    hf.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    capfd.readouterr()
    models.load_model(str(tmp_path / "m"))
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "%|" not in err, err

    def convert(out):
        for name in (models.WEIGHTS_FILE, "config.json", "tokenizer_config.json"):
            (out / name).write_bytes(b"{}")
        return {"source": "test"}

    models.ensure_cache(tmp_path / "cache" / "x-fp32", convert)
    assert capfd.readouterr().err.count("me_interp: converting x-fp32 once") == 1
    models.ensure_cache(tmp_path / "cache" / "x-fp32", convert)  # cached: silent
    assert capfd.readouterr().err == ""


def test_quiet_libraries_hides_the_gguf_conversion_bar_and_restores_it(capfd):
    """transformers' GGUF conversion draws a plain ``tqdm`` that its own progress-bar switch does
    not reach: inside ``quiet_libraries`` it draws nothing, and afterwards it is the module's own."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    before = gguf_utils.tqdm
    capfd.readouterr()
    with terminal.quiet_libraries():
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert capfd.readouterr().err == ""
    assert gguf_utils.tqdm is before


def test_me_interp_help_lists_the_commands_and_experiments(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {c} " in out for c in cli.COMMANDS)
    assert all(name in out for name in battery.NAMES)


def test_the_battery_bar_estimates_from_its_first_run_and_the_speed_it_sees(monkeypatch):
    """Without earlier durations or a cost model the time left is unknown until an experiment
    finishes; then each experiment never run before counts as the mean of those finished. Earlier
    durations and the cost model's predictions are scaled by the speed observed (real over guessed
    seconds of the finished experiments), the current experiment's elapsed time is subtracted, and
    the end says nothing is left."""
    clock = [100.0]
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    fmt = terminal.fmt_seconds
    bar = cli.BatteryBar(terminal.Output())
    bar.names, bar.previous, bar.predicted, bar.left = ["a", "b", "c"], {}, {}, ["a", "b", "c"]
    assert bar._eta() == ""
    bar.left.remove("a")
    bar.done["a"] = 60.0
    assert bar._eta() == f"about {fmt(120.0)} left"  # b and c as the mean of a
    bar.previous = {"b": 10.0, "c": 20.0}
    assert bar._eta() == f"about {fmt(30.0)} left"  # a had no guess: speed 1
    bar.previous["a"] = 30.0
    assert bar._eta() == f"about {fmt(60.0)} left"  # a took twice its guess: so will b and c
    bar.previous, bar.predicted = {"a": 30.0}, {"b": 10.0, "c": 20.0}
    assert bar._eta() == f"about {fmt(60.0)} left"  # the cost model where no earlier run
    bar.start("b")
    clock[0] += 15.0
    assert bar._eta() == f"about {fmt(45.0)} left"  # 15 s of b's 20 s have passed
    clock[0] += 100.0
    assert bar._eta() == f"about {fmt(40.0)} left"  # b overran: only c's 40 s remain
    bar.left.clear()
    assert bar._eta() == "nothing left"

"""Bad input from the shell, flag by flag: every flag of every experiment and of the battery, given a
wrong type, an out-of-range value, a missing file or an unreadable one, exits 2 with one line that
names the flag or the file — never a traceback.

The table :data:`BAD` holds the refused values per field name; :func:`test_every_flag_is_in_the_table`
fails when a new config field has no entry, so a new flag cannot skip the check."""

from __future__ import annotations

import dataclasses
import importlib
import json
import typing

import pytest

from me_interp import __main__ as cli
from me_interp.battery import NAMES as EXPERIMENTS
from me_interp.study import cli as study_cli

MODULES = {
    n: importlib.import_module(f"me_interp.experiments.{n}") for n in (*EXPERIMENTS, "survey")
}
MODEL = "synthetic:planted"  # 4 layers: layer 999 is out of range

# file fixtures, made per test in tmp_path
MISSING, NOT_UTF8, BAD_JSON, EMPTY, DIRECTORY, A_FILE = (
    "<missing>",
    "<not-utf8>",
    "<bad-json>",
    "<empty>",
    "<directory>",
    "<a-file>",
)
PROMPT_FILES = [MISSING, NOT_UTF8, BAD_JSON, EMPTY, DIRECTORY]

BAD: dict[str, list[str]] = {
    # shared by every experiment and the battery
    "model": ["synthetic:nope", MISSING],
    "prompts": PROMPT_FILES,
    "bos": ["maybe"],
    "dtype": ["float64"],
    "device": ["nodevice"],
    "seed": ["-1", str(2**32), "x"],
    "out": [A_FILE],
    "threads": ["0", "x"],
    "device_map": ["everywhere", MISSING, BAD_JSON],
    "max_memory": ["cpu=lots", "gpu=1GiB", "cpu"],
    "offload_folder": [A_FILE],
    # detection
    "criterion": ["nope"],
    "abs_threshold": ["-1", "x"],
    "rel_threshold": ["-1"],
    "norm_ratio": ["0.5"],
    "min_prompt_fraction": ["1.5", "-0.1"],
    "top_k": ["0", "x"],
    # sites
    "layer": ["-1", "999", "x"],
    "position": ["-1", "999", "bogus"],
    "me_layer": ["-1", "999"],
    "metric_layer": ["-1", "999"],
    "neuron_layer": ["-2", "999"],
    "rank_layer": ["-999", "999"],  # negative: from the end
    "dst": ["-1", "999"],
    "targets": ["-1", "999", "x"],
    "partners": ["-1", "999"],
    # sizes
    "k_frac": ["1.5", "-0.1"],
    "k_abs": ["-1"],
    "top_neurons": ["0"],
    "n_seeds": ["0"],
    "max_texts": ["-1"],
    "detect_tokens": ["1"],
    "batch_tokens": ["0"],
    "max_tokens": ["1", "x"],
    "long_tokens": ["1", "x"],
    "long_rows": ["0", "x"],
    "max_prompts": ["0"],
    "batch_size": ["0"],
    "n_prompts": ["-1"],
    "n_random": ["-1"],
    "n_sink_heads": ["0", "x"],
    "ks": ["0", "x"],
    "claim_k": ["0"],
    "n_neurons": ["-1"],
    "max_targets": ["-1"],
    "max_partners": ["-1"],
    "text_tokens": ["1", "x"],
    "pool": ["0"],
    "control_weights": ["0"],
    "weight": ["-1", "x"],
    # rates and strengths
    "rates": ["1.5", "x"],
    "claim_rate": ["1.0", "0"],
    "soft_rate": ["1.5"],
    "alphas": ["-0.5", "x"],
    "alpha": ["-0.5", "x"],
    # choices
    "variants": ["bogus"],
    "start": ["bogus"],
    "mc": ["bogus"],
    "positions": ["bogus"],
    "sites": ["bogus"],
    "corruption": ["bogus"],
    "norms": ["bogus"],
    "matrices": ["bogus"],
    "parts": ["bogus"],
    "mode": ["bogus"],
    "component": ["bogus"],
    "conditions": ["bogus"],
    "models": ["synthetic:nope"],
    "all_positions": ["maybe"],
    "sink": ["maybe"],
    # files
    "texts": PROMPT_FILES,
    "mc_items": [MISSING, NOT_UTF8, BAD_JSON],
    "source_model": [MISSING],
    "pairs": PROMPT_FILES,
    "metric": ["bogus"],
    "heads": ["-1", "x"],
    "head_positions": ["bogus"],
    "method": ["bogus", "attribution"],  # attribution without --pairs
    # backends (me_layer, survey, attention_sinks, wemask)
    "backend": ["bogus"],
    "remote": ["maybe", "yes"],  # yes: remote without --backend nnsight
}


def _materialise(value: str, tmp_path) -> str:
    path = tmp_path / "input.txt"
    if value == MISSING:
        return str(tmp_path / "no-such-file.txt")
    if value == NOT_UTF8:
        path.write_bytes(b"caf\xe9 au lait\nsecond prompt here\n")
    elif value == BAD_JSON:
        path = tmp_path / "input.json"
        path.write_text('["one prompt", "two', encoding="utf-8")
    elif value == EMPTY:
        path.write_text("\n\n", encoding="utf-8")
    elif value == DIRECTORY:
        path = tmp_path / "a-directory"
        path.mkdir()
    elif value == A_FILE:
        path.write_text("not a directory\n", encoding="utf-8")
    else:
        return value
    return str(path)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


RECORDED = {
    ("survey", "models"): "a model that cannot be loaded is a row of the survey (its error)"
}
"""(experiment, field) whose bad values are recorded in the result by design, not refused."""


def _cases():
    for name, module in MODULES.items():
        for f in dataclasses.fields(module.Config):
            if (name, f.name) in RECORDED:
                continue
            for value in BAD.get(f.name, []):
                yield pytest.param(name, f.name, value, id=f"{name}-{f.name}={value}")


def _run(main, argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _check_one_line(rc: int, err: str, names: tuple[str, ...]) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"exit {rc}, stderr: {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert any(n in lines[0] for n in names), f"names none of {names}: {lines[0]}"


def _base_argv(name: str, field: str, out: str) -> list[str]:
    argv = [] if field == "model" else ["--model", MODEL]
    if name == "survey":
        argv = [] if field == "models" else ["--models", MODEL]
    return argv + ([] if field == "out" else ["--out", out])


@pytest.mark.parametrize(("name", "field", "value"), list(_cases()))
def test_a_bad_flag_value_is_one_line_and_exit_2(name, field, value, tmp_path, capsys):
    module = MODULES[name]
    given = _materialise(value, tmp_path)
    argv = _base_argv(name, field, str(tmp_path / "runs")) + [_flag(field), given]
    rc, err = _run(module.main, argv, capsys)
    _check_one_line(rc, err, (_flag(field), given))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (f, v)
        for f in ("prompts", "seed", "threads", "bos", "dtype", "out", "device_map", "max_memory")
        for v in BAD[f]
    ]
    + [("only", "bogus"), ("skip", "bogus")],
)
def test_the_battery_refuses_bad_flags_in_one_line(field, value, tmp_path, capsys):
    given = _materialise(value, tmp_path)
    out = [] if field == "out" else ["--out", str(tmp_path / "runs")]
    argv = ["--model", MODEL, *out, _flag(field), given]
    rc, err = _run(cli.main, argv, capsys)
    _check_one_line(rc, err, (_flag(field), given, "invalid choice"))


def test_me_interp_subcommands_refuse_bad_input_in_one_line(tmp_path, capsys):
    rc, err = _run(cli.main, ["run", "bogus", "--model", MODEL], capsys)
    _check_one_line(rc, err, ("bogus",))
    rc, err = _run(cli.main, ["report", str(tmp_path)], capsys)
    _check_one_line(rc, err, (str(tmp_path),))
    (tmp_path / "battery.json").write_text("{not json", encoding="utf-8")
    rc, err = _run(cli.main, ["report", str(tmp_path)], capsys)
    _check_one_line(rc, err, ("battery.json",))
    (tmp_path / "battery.json").write_text(json.dumps([1, 2]), encoding="utf-8")
    rc, err = _run(cli.main, ["report", str(tmp_path)], capsys)
    _check_one_line(rc, err, ("battery.json",))
    rc, err = _run(cli.main, ["claims", "bogus"], capsys)
    _check_one_line(rc, err, ("bogus",))


def test_every_flag_is_in_the_table():
    """A new config field must say which of its values are refused (an entry of :data:`BAD`)."""
    missing = [
        f"{name}.{f.name}"
        for name, module in MODULES.items()
        for f in dataclasses.fields(module.Config)
        if not BAD.get(f.name)
    ]
    assert not missing, f"no bad values for {missing}: add them to BAD"


def test_every_numeric_flag_is_tried_with_a_wrong_type():
    """Each int or float flag appears with a non-number somewhere in the table, or is covered by
    the generic argparse check (one representative per type is enough: argparse does the rest)."""
    tried = {f for f, vs in BAD.items() if "x" in vs}
    types_tried = set()
    for module in MODULES.values():
        hints = typing.get_type_hints(module.Config)
        for f in dataclasses.fields(module.Config):
            if f.name in tried:
                types_tried.add(study_cli._base_type(hints[f.name]))
    assert {(int, False), (float, False), (int, True), (float, True)} <= types_tried

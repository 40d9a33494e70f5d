"""A misspelled model name: one line, exit 2, the known name it resembles and where the names are
(``me-interp models``), never HF's "check your internet connection" second line; and ``me-interp
models`` describes every constructed model in its own words (from ``me_interp.synthetic``)."""

from __future__ import annotations

import pytest

from me_interp import __main__ as cli
from me_interp import loading, synthetic
from me_interp.experiments import me_layer
from me_interp.loading import synthetic as synthetic_source

MISSPELLED = [  # (given, what the one line says)
    ("gemma-3-27m", "did you mean gemma-3-270m? see `me-interp models`"),
    ("Gemma-3-270", "did you mean gemma-3-270m? see `me-interp models`"),
    ("google/gemma-3-270x", "did you mean gemma-3-270m? see `me-interp models`"),
    ("smollm", "did you mean bundled? see `me-interp models`"),
    ("SmolLM2-135M-Instruc", "did you mean bundled? see `me-interp models`"),
    ("planted", "did you mean synthetic:planted? see `me-interp models`"),
    ("synthetic:plantd", "did you mean synthetic:planted? see `me-interp models`"),
    ("synthetic:twin-gema3", "did you mean synthetic:twin-gemma3? see `me-interp models`"),
    ("qqq-no-such-model", "see `me-interp models` for the names it knows"),
]


def _run(main, argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("given", "says"), MISSPELLED, ids=[g for g, _ in MISSPELLED])
@pytest.mark.parametrize("entry", ["experiment", "battery"])
def test_a_misspelled_model_is_one_line_with_a_suggestion(given, says, entry, tmp_path, capsys):
    argv = ["--model", given, "--out", str(tmp_path)]
    main = me_layer.main if entry == "experiment" else cli.main
    rc, err = _run(main, argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert says in lines[0] and repr(given) in lines[0]
    assert "internet" not in err.lower()


@pytest.mark.parametrize(
    ("given", "hit"),
    [("gemma-3-270", "gemma-3-270m"), ("BUNDLED", "bundled"), ("synthetic:decoy-erase",
     "synthetic:decoy-erased"), ("abc", None), ("", None)],
)  # fmt: skip
def test_did_you_mean(given, hit):
    said = loading.did_you_mean(given)
    if hit is None:
        assert said == "see `me-interp models` for the names it knows"
    else:
        assert said == f"did you mean {hit}? see `me-interp models`"


def test_a_local_directory_that_does_not_load_gets_no_suggestion(tmp_path, capsys):
    (tmp_path / "gemma-3-270m").mkdir()  # exists, so it is a directory, not a misspelled name
    rc, err = _run(me_layer.main, ["--model", str(tmp_path / "gemma-3-270m")], capsys)
    assert rc == 2 and "did you mean" not in err and len(err.strip().splitlines()) == 1


def test_every_constructed_model_has_its_own_description():
    rows = synthetic_source.catalogue_rows()
    about = {r["name"]: r["about"] for r in rows}
    assert all(about.values()), [n for n, a in about.items() if not a]
    assert len(set(about.values())) == len(about), "two constructed models share a description"
    described = synthetic.describe_models()
    for name in synthetic_source.SYNTHETIC_MODELS:
        assert about["synthetic:" + name] == described[name]
    # the construction's own numbers, read from its registries
    for name, (layer, planted) in synthetic.DEEP.items():
        assert (f"planted at layer {layer}" in described[name]) == planted
    for name, (gain, _) in synthetic.NEEDSINK.items():
        assert f"gain {gain:g}" in described[name]


def test_me_interp_models_lists_them(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("synthetic:superweight-spread "))
    assert "none of the sink" in line

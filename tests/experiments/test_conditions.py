"""The conditions experiment: its claims on models built for and against them, the round trip, the
CLI, bad input."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from me_interp import claims, io, load_model, study, synthetic
from me_interp.experiments import conditions

H, F, NA = claims.HOLDS, claims.FAILS, claims.NOT_APPLICABLE
EXPECTED = {
    # the mechanism on token 0 only: nothing but position 0 is massive
    "synthetic:planted-nobos": {"first_only": H, "padding_invariant": H, "secondary_shares": NA},
    # the same mechanism also at the delimiter (position 2): same layer, same dim, a sink
    "synthetic:decoy-secondary": {
        "first_only": F,
        "padding_invariant": H,
        "secondary_shares": H,
        "secondary_sink": H,
    },
    # the delimiter massive from its embedding on another dim: born at 0, not read by the sink head
    "synthetic:decoy-secondary-apart": {"secondary_shares": F, "secondary_sink": F},
}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "prompts.json"
    path.write_text(json.dumps(synthetic.distinct_first_prompts(16)))
    return str(path)


def _run(name, prompt_file, **kw):
    cfg = conditions.Config(
        model=name, prompts=prompt_file, max_prompts=None, long_tokens=(64,), **kw
    )
    model = load_model(name, device="cpu")
    return study.execute(conditions.EXPERIMENT, cfg, model)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_claims_on_constructed_models(name, prompt_file):
    out = _run(name, prompt_file)
    got = {c.id.removeprefix("conditions."): c.verdict for c in out.claims}
    assert {k: got[k] for k in EXPECTED[name]} == EXPECTED[name]
    r = out.result
    assert io.to_jsonable(study.roundtrip(r)) == io.to_jsonable(r)
    as_is = r.condition("as_is")
    positions = {t.position for t in as_is.tokens}
    if name == "synthetic:planted-nobos":
        assert positions == {0}
    else:  # the second massive token at the delimiter, listed with its layer and dims
        assert positions == {0, synthetic.DELIMITER_POSITION}
        sec = [t for t in as_is.tokens if t.position]
        assert len(sec) == as_is.n_rows
        assert {t.birth for t in sec} == ({2} if name.endswith("secondary") else {0})
    chat = r.condition("chat")
    assert chat.n_rows == 0 and "no chat template" in chat.note
    assert len(r.padding_diffs) == r.condition("left_pad").n_rows and max(r.padding_diffs) < 1e-4
    assert r.condition("long_64").n_rows == 1 and r.condition("packed").n_rows == 8
    assert set(conditions.figures(r)) == {"ratios", "secondary_tokens"}


def test_cli_and_bad_input(tmp_path, prompt_file, capsys):
    argv = [
        "--model",
        "synthetic:decoy-secondary",
        "--prompts",
        prompt_file,
        "--out",
        str(tmp_path),
    ]
    assert conditions.main([*argv, "--conditions", "as_is", "left_pad", "--max-prompts", "4"]) == 0
    (run,) = (tmp_path / "conditions").iterdir()
    body = json.loads((run / "result.json").read_text())
    assert [c["name"] for c in body["conditions"]] == ["as_is", "left_pad"]
    assert (run / "ratios.html").exists()
    assert conditions.main([*argv, "--max-prompts", "1"]) == 2
    assert "--max-prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        conditions.main([*argv, "--conditions", "sideways"])
    capsys.readouterr()
    # asked for explicitly, a condition the tokenizer cannot build is refused in one line
    assert conditions.main([*argv, "--conditions", "as_is", "chat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --conditions chat: ") and "no chat template" in err
    assert err.count("\n") == 1
    with pytest.raises(ValueError, match="at least one"):
        conditions.Config(conditions=())
    model = load_model("synthetic:planted-nobos", device="cpu")
    from me_interp.loading import layouts

    with pytest.raises(ValueError, match="no chat template"):
        layouts.chat_rows(model, ["w0 w1"])
    with pytest.raises(ValueError, match="beyond the 1024 positions"):
        layouts.long_row(model, ["w0 w1"], 4096)
    with pytest.raises(ValueError, match="unknown layout"):
        layouts.layout_rows(model, "sideways", ["w0 w1"])
    assert layouts.layout_rows(model, "long", ["w0 w1 w2"], 5) == [
        layouts.long_row(model, ["w0 w1 w2"], 5)
    ]
    windowed = SimpleNamespace(hf=SimpleNamespace(config=SimpleNamespace(sliding_window=512)))
    assert (
        layouts.window_note(windowed, 1024) == "beyond the sliding window (512) of the local layers"
    )
    assert layouts.window_note(windowed, 512) == layouts.window_note(model, 4096) == ""


def test_a_condition_with_the_rows_of_as_is_reuses_its_forward(prompt_file):
    out = _run("synthetic:planted-nobos", prompt_file, conditions=("no_bos", "left_pad"))
    r = out.result
    as_is, no_bos = r.condition("as_is"), r.condition("no_bos")
    assert no_bos.note == "the rows of as_is" and no_bos.tokens == as_is.tokens
    assert r.condition("left_pad").note == ""  # its own (left-padded) forward

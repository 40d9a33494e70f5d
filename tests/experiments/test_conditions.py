"""The conditions experiment: its claims on models built for and against them, the round trip, the
CLI, bad input."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from me_interp import claims, io, load_model, study, synthetic
from me_interp.experiments import conditions
from me_interp.loading import layouts

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
    kw = {"long_tokens": (64,), **kw}
    cfg = conditions.Config(model=name, prompts=prompt_file, max_prompts=None, **kw)
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


LONG = 512  # planted-washout: BOS's share of the washing head 0.16 at 512 tokens
EXPECTED_BEYOND = {
    # <s> is the chat template's first token and the marker: massive, alone, at every length
    "synthetic:planted": {"chat_first": H, "long_first": H},
    # the template's <s> ordinary, the user turn's delimiter massive; token 0 never massive
    "synthetic:decoy-later": {"chat_first": F, "long_first": NA},
    # no chat template; the other tokens rise with length until <s> is not 1,000x the median
    "synthetic:planted-washout": {"chat_first": NA, "long_first": F},
}

BUILD = {
    "synthetic:planted": synthetic.planted_llama,
    "synthetic:decoy-later": lambda: synthetic.decoy("later"),
    "synthetic:planted-washout": synthetic.planted_washout,
}


def _massive_at(hf, rows, layer):
    """Independent of the scan: per row, its massive positions at ``layer``'s output by the Sun
    rule (|a| > 100 and >= 1000 x the median |a| of the row), from the HF model's hidden states."""
    out = []
    for r in rows:
        with torch.no_grad():
            h = hf(input_ids=torch.tensor([r]), output_hidden_states=True).hidden_states[layer + 1]
        a = h[0].abs()
        top = a.amax(-1)
        out.append(torch.nonzero((top > 100) & (top >= 1000 * a.median())).flatten().tolist())
    return out


@pytest.mark.parametrize("name", list(EXPECTED_BEYOND))
def test_chat_and_long_claims_on_constructed_models(name, prompt_file):
    out = _run(name, prompt_file, long_tokens=(LONG,), long_rows=16)
    got = {c.id.removeprefix("conditions."): c for c in out.claims}
    assert {k: got[k].verdict for k in EXPECTED_BEYOND[name]} == EXPECTED_BEYOND[name]
    r, model = out.result, load_model(name, device="cpu")
    hf = BUILD[name]()[0]  # the HF model itself, not through the bridge
    long = r.condition(f"long_{LONG}")
    assert long.n_rows == 16 and r.condition("as_is").layer == 2
    rows = layouts.long_rows(model, synthetic.distinct_first_prompts(16), LONG, 16)
    assert len({tuple(x) for x in rows}) == 16 and {len(x) for x in rows} == {LONG}
    want = _massive_at(hf, rows[:3], 2)  # the scan's rule, recomputed by hand
    if long.layer == 2:
        assert long.positions[:3] == want
    if name == "synthetic:planted-washout":
        assert want == [[], [], []] and got["long_first"].estimate.n == 16
        assert "no chat template" in got["chat_first"].why
        return
    chat = r.condition("chat")
    ids = layouts.chat_rows(model, synthetic.distinct_first_prompts(16))
    assert chat.n_rows == 16 and {x[0] for x in ids} == {synthetic.BOS_ID}  # the template's <s>
    hand = _massive_at(hf, ids[:3], 2)
    assert chat.positions[:3] == hand
    if name == "synthetic:planted":
        assert hand == [[0]] * 3 and want == [[0]] * 3
    else:  # decoy-later: the delimiter of the user turn, never the template's first token
        assert all(
            p and 0 not in p and ids[b][p[0]] == synthetic.DELIMITER_ID for b, p in enumerate(hand)
        )
        assert got["long_first"].why == "the first token is not massive as it is"


def test_planted_washout_keeps_bos_state_but_not_its_margin():
    """Causal attention: <s>'s state is the same at every length; the washing head's share on it
    falls as 1 / (1 + t e^-gap), so the other tokens rise until <s> is no longer 1,000x the median."""
    hf, tok, plant = synthetic.planted_washout()
    ids = tok(" ".join(synthetic.planted_prompts(16) * 20))["input_ids"]
    states = {}
    for n in (10, 1024):
        with torch.no_grad():
            o = hf(
                input_ids=torch.tensor([ids[:n]]), output_hidden_states=True, output_attentions=True
            )
        h = o.hidden_states[plant.layer + 1][0]
        states[n] = (h[0], float(h[0].abs().max() / h.abs().median()))
        share = o.attentions[synthetic.WASHOUT_LAYER][0, 2, -1, 0]
        gap = synthetic.WASHOUT_GAP
        assert float(share) == pytest.approx(1 / (1 + (n - 1) * math.exp(-gap)), rel=0.25)
    torch.testing.assert_close(states[10][0], states[1024][0], atol=1e-2, rtol=1e-4)
    assert states[10][1] > 2000 and states[1024][1] < 700
    # the unwashed planted model keeps the margin at 1,024 tokens
    hf0, _, _ = synthetic.planted_llama()
    with torch.no_grad():
        h = hf0(input_ids=torch.tensor([ids[:1024]]), output_hidden_states=True).hidden_states[3]
    assert float(h[0, 0].abs().max() / h[0].abs().median()) > 2000


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
    with pytest.raises(ValueError, match="no chat template"):
        layouts.chat_rows(model, ["w0 w1"])
    with pytest.raises(ValueError, match="beyond the 1024 positions"):
        layouts.long_row(model, ["w0 w1"], 4096)
    with pytest.raises(ValueError, match="unknown layout"):
        layouts.layout_rows(model, "sideways", ["w0 w1"])
    assert layouts.layout_rows(model, "long", ["w0 w1 w2"], 5) == [
        layouts.long_row(model, ["w0 w1 w2"], 5)
    ]
    assert layouts.layout_rows(model, "long", ["w0 w1", "w2 w3"], 5, n_rows=3) == [
        layouts.long_row(model, ["w0 w1", "w2 w3"], 5),
        layouts.long_row(model, ["w2 w3", "w0 w1"], 5),
    ]  # one row per prompt at most, row i opening with prompt i
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

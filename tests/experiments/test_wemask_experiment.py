"""The mask-rate experiment: run() and its claims on the planted model, "not applicable" without a
massive activation, per-text metrics against independent computations, the CLI, and the bundled model
with two-sided bounds."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from me_interp import claims, evaluation, io, study, synthetic
from me_interp.claims import FAILS, HOLDS, INCONCLUSIVE, NOT_APPLICABLE, NotApplicable
from me_interp.experiments import wemask as exp
from me_interp.interventions import we_mask
from me_interp.study import execute

# What the planted construction implies for the claims it decides: its sink head reads the massive
# dim 7 of the attention input, so zeroing that input at r = 1 removes most of the sink; the rest of
# the planted model is random, so its next-token distribution hardly depends on the masked token and
# no mask changes perplexity or MC accuracy (the "unchanged" claims hold, nothing "hurts more"). No MC
# item changes its answer, so that claim's interval is [0, 0]: not decided (issue 17, finding 4: a
# zero-width interval is no evidence; it used to "hold").
PLANTED = {
    "wemask.small_rate_ppl_unchanged": HOLDS,
    "wemask.small_rate_mc_unchanged": INCONCLUSIVE,
    "wemask.beats_random": FAILS,
    "wemask.beats_magnitude": FAILS,
    "wemask.activation_like_weight": HOLDS,
    "wemask.full_mask_collapses": FAILS,
    "wemask.full_mask_removes_sink": HOLDS,
}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("\n".join(synthetic.planted_prompts(8)) + "\n")
    return str(p)


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("texts") / "texts.txt"
    texts = [synthetic.words(6 + i % 7, start=5 * i) for i in range(12)]
    p.write_text("\n".join(texts) + "\n")
    return str(p)


@pytest.fixture(scope="module")
def items_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("items") / "items.json"
    items = [
        {
            "context": synthetic.words(4, start=3 * i),
            "choices": [" w1", " w2", " w3"],
            "answer": i % 3,
        }
        for i in range(10)
    ]
    p.write_text(json.dumps(items))
    return str(p)


@pytest.fixture(scope="module")
def planted_result(planted, prompt_file, texts_file, items_file):
    model, _ = planted
    cfg = exp.Config(
        prompts=prompt_file,
        texts=texts_file,
        mc_items=items_file,
        rates=(0.0, 0.5, 1.0),
        alphas=(0.5, 1.0),
        mc="all",
        batch_tokens=40,  # several length groups
    )
    return exp.run(cfg, model)


def test_conditions_are_deduplicated():
    cfg = exp.Config(rates=(0.0, 0.1, 0.5, 1.0), alphas=(0.5, 1.0), n_seeds=5)
    conds = exp.conditions(cfg)
    assert len(set(conds)) == len(conds)
    full = [c for c in conds if c.kind == "wemask" and c.rate == 1.0]
    assert len(full) == 1  # every selection masks every dim at r = 1
    rand = [c for c in conds if c.variant == "random"]
    assert [(c.rate, c.seed) for c in rand] == [(0.1, s) for s in range(5)] + [(0.5, 0)]
    soft = [c for c in conds if c.kind == "dim_projection"]
    assert [c.alpha for c in soft] == [0.5]  # α = 1 is WeMask weight at soft_rate, already run
    assert exp.Config(rates=(0.5,)).run_rates() == [0.1, 0.5]  # the claim rate is always run


def test_result_layout_and_fixed_points(planted_result, planted):
    _, plant = planted
    r = planted_result
    assert r.me_layer == plant.layer and r.layers == [2, 3, 4] and r.massive_at_me
    assert r.n_texts == 12 and r.n_items == 10
    json.dumps(io.to_jsonable(r))
    assert io.to_jsonable(study.roundtrip(r)) == io.to_jsonable(r)
    assert r.header.layer_1based == plant.layer + 1 and r.claim_rate == 0.1
    for m in [r.baseline, *(row.metrics for row in r.rows)]:
        per_text = dataclasses.asdict(m.per_text)
        assert set(per_text) == set(exp.PER_TEXT)
        assert all(len(v) == r.n_texts for v in per_text.values())
        assert len(m.per_item.correct) == r.n_items  # mc="all"
        assert m.perplexity == pytest.approx(
            evaluation.pooled_perplexity(m.per_text.nll, m.per_text.n_pred)
        )
    # r = 0 rows are the baseline; r = 1 rows are one forward shared by every selection
    for row in r.rows:
        if row.condition.is_wemask(rate=0.0):
            assert all(getattr(row.metrics, m) == getattr(r.baseline, m) for m in exp.METRICS)
    full = [row for row in r.rows if row.condition.is_wemask(rate=1.0)]
    assert sorted(row.condition.variant for row in full) == sorted(exp.VARIANTS)
    assert all(row.metrics.perplexity == full[0].metrics.perplexity for row in full)
    assert (
        r.metrics("dim_projection", "weight", 0.1, 1.0).perplexity
        == r.metrics("wemask", "weight", 0.1).perplexity
    )
    assert len(r.random_rows(0.1)) == 5 and len(r.random_rows(0.5)) == 1
    # the planted sink head reads the masked attention input: masking lowers attention to position 0
    assert full[0].metrics.sink < r.baseline.sink
    assert r.baseline.kl == 0.0 and r.baseline.top1 == 1.0


def test_per_text_perplexity_matches_evaluation(planted, planted_result, texts_file):
    """Pooled per-text NLL (length-grouped batches) = evaluation.perplexity on one padded batch."""
    model, _ = planted
    texts = exp.Config(texts=texts_file).load_texts()
    assert planted_result.baseline.perplexity == pytest.approx(
        evaluation.perplexity(model, texts), rel=1e-5
    )
    w = planted_result.metrics("wemask", "weight", 0.5)
    hooks = we_mask(model, 0.5, "weight", layers=planted_result.layers)
    assert w.perplexity == pytest.approx(evaluation.perplexity(model, texts, hooks), rel=1e-5)
    ag = evaluation.next_token_agreement(model, texts, hooks)
    assert w.kl == pytest.approx(ag.kl, rel=1e-4, abs=1e-6)
    assert w.top1 == pytest.approx(ag.top1)


def test_planted_verdicts(planted_result):
    cs = claims.judge(exp.SPECS, planted_result)
    assert [c.id for c in cs] == [s.id for s in exp.SPECS]
    assert {c.id: c.verdict for c in cs} == PLANTED
    by = {c.id: c for c in cs}
    # texts × seeds (was a t interval over the 5 seeds alone, blind to which texts were drawn)
    rnd = by["wemask.beats_random"].estimate
    assert (rnd.unit, rnd.n, rnd.method) == ("texts × seeds", 12, "two-way bootstrap (crossed)")
    assert by["wemask.small_rate_mc_unchanged"].estimate.unit == "items"
    assert "zero width" in by["wemask.small_rate_mc_unchanged"].why
    assert by["wemask.full_mask_removes_sink"].kind == "sanity"
    assert [s.id for s in exp.SPECS if s.kind == "claim"] == [s.id for s in exp.SPECS][:-1]
    for c in cs:
        assert c.estimate.unit in ("texts", "items", "texts × seeds") and c.rule and c.control
        json.dumps(c.to_dict())
    assert not hasattr(exp, "verdicts")  # claims.judge is the only place a verdict is computed


def _text_ppl(model, text, hooks=()):
    return evaluation.perplexity(model, [text], hooks)


def test_random_and_magnitude_gaps_match_by_hand(planted, planted_result, texts_file):
    """beats_random: the mean over texts × seeds of (ppl_random − ppl_weight) / ppl_unmasked of each
    text, every perplexity recomputed here text by text; beats_magnitude: the same over texts."""
    model, _ = planted
    r = planted_result
    texts = exp.Config(texts=texts_file).load_texts()
    hooks = lambda v, seed=0: we_mask(model, 0.1, v, layers=r.layers, seed=seed)  # noqa: E731
    base = np.array([_text_ppl(model, t) for t in texts])
    w = np.array([_text_ppl(model, t, hooks("weight")) for t in texts])
    rand = np.array(
        [[_text_ppl(model, t, hooks("random", s)) for s in range(5)] for t in texts]
    )  # [text seed]
    mag = np.array([_text_ppl(model, t, hooks("magnitude")) for t in texts])
    gaps = (rand - w[:, None]) / base[:, None]
    recorded = r.random_gaps()
    assert recorded.seeds == [0, 1, 2, 3, 4]
    # one text at a time vs length-grouped batches: float32 noise of ~1e-6 on gaps of ~1e-4
    np.testing.assert_allclose(r.baseline.per_text.perplexity(), base, rtol=1e-5)
    np.testing.assert_allclose(recorded.per_text, gaps, rtol=0, atol=2e-6)
    assert np.abs(gaps).max() > 5e-5  # the tolerance is well below the values
    by = {c.id: c for c in claims.judge(exp.SPECS, r)}
    assert by["wemask.beats_random"].estimate.value == pytest.approx(gaps.mean(), abs=2e-6)
    mag_gap = ((mag - w) / base).mean()
    assert by["wemask.beats_magnitude"].estimate.value == pytest.approx(mag_gap, abs=2e-6)


def test_random_interval_carries_the_texts(planted_result):
    """Five identical seeds: a t interval over seeds would have zero width; the texts × seeds
    interval still spans the texts' spread of the (same) gap."""
    r = planted_result
    first = r.random_rows(r.claim_rate)[0]
    rows = [
        dataclasses.replace(row, metrics=first.metrics)
        if row in r.random_rows(r.claim_rate)
        else row
        for row in r.rows
    ]
    mod = dataclasses.replace(r, rows=rows)
    gaps = np.asarray(mod.random_gaps().per_text)
    assert np.ptp(gaps, axis=1).max() == 0  # the seeds agree
    c = next(c for c in claims.judge(exp.SPECS, mod) if c.id == "wemask.beats_random")
    assert c.estimate.value == pytest.approx(gaps[:, 0].mean())
    assert gaps[:, 0].min() <= c.estimate.lo < gaps[:, 0].mean() < c.estimate.hi <= gaps[:, 0].max()


def _sink_reliant(massive_gain: float):
    """The planted model turned into a language model that *needs* its sink
    (:func:`synthetic.planted_needsink`): a bigram unembedding (the word texts have a perplexity near
    1), and after the ME layer a sink head with a zero value for the massive token and large values
    for the others, written out 20 × larger. ``massive_gain`` is the pre-attention gain of dim 7 after
    the ME layer: 0.5 (``planted-needsink``: the smallest, so the weight selection leaves the sink
    alone) or 2.0 (``planted-needsink-wide``: the largest, so the weight selection masks it).
    """
    from me_interp import load_model

    name = {0.5: "planted-needsink", 2.0: "planted-needsink-wide"}[massive_gain]
    hf, tok, _ = synthetic.planted_needsink(name)
    return load_model(hf, tokenizer=tok, device="cpu")


@pytest.fixture(scope="module")
def sink_items_file(tmp_path_factory):
    """Items the bigram model answers: the next word, against two others."""
    p = tmp_path_factory.mktemp("sink_items") / "items.json"
    items = [
        {
            "context": synthetic.words(6, start=3 * i),
            "choices": [synthetic.words(1, start=3 * i + k) for k in (6, 20, 40)],
            "answer": 0,
        }
        for i in range(20)
    ]
    p.write_text(json.dumps(items))
    return str(p)


@pytest.mark.parametrize(
    ("gain", "rate", "expected"),
    [
        # the weight dims miss the massive dim: WeMask is harmless, the full mask, the magnitude
        # and activation dims (which take dim 7) break the model; random dims hit dim 7 only at a
        # large rate (16 of 32 dims)
        (
            0.5,
            0.1,
            {"small_rate_ppl_unchanged": HOLDS, "beats_random": FAILS, "beats_magnitude": HOLDS,
             "activation_like_weight": FAILS, "full_mask_collapses": HOLDS},
        ),
        (0.5, 0.5, {"small_rate_ppl_unchanged": HOLDS, "beats_random": HOLDS}),
        # the weight dims take the massive dim: WeMask breaks the model like the activation dims
        (
            2.0,
            0.1,
            {"small_rate_ppl_unchanged": FAILS, "small_rate_mc_unchanged": FAILS,
             "beats_random": FAILS, "activation_like_weight": HOLDS, "full_mask_collapses": HOLDS},
        ),
    ],
)  # fmt: skip
def test_claims_hold_and_fail_on_a_model_that_needs_its_sink(
    gain, rate, expected, prompt_file, texts_file, sink_items_file
):
    """With the planted model (where the random language model needs nothing: the "unchanged" claims
    hold, the "hurts" claims fail), every LM claim is shown to come out both ways."""
    model = _sink_reliant(gain)
    cfg = exp.Config(
        prompts=prompt_file, texts=texts_file, mc_items=sink_items_file, rates=(1.0,),
        claim_rate=rate, alphas=(),
    )  # fmt: skip
    r = exp.run(cfg, model)
    assert r.me_layer == 2 and r.baseline.perplexity < 2  # the bigram model reads the texts
    got = {c.id.split(".", 1)[1]: c.verdict for c in claims.judge(exp.SPECS, r)}
    assert {k: got[k] for k in expected} == expected


def test_claims_not_measured_are_not_judged(planted, prompt_file, texts_file):
    model, _ = planted
    cfg = exp.Config(
        prompts=prompt_file, texts=texts_file, rates=(0.1,), variants=("weight", "random"),
        n_seeds=2, alphas=(), mc="none",
    )  # fmt: skip
    by = {c.id: c for c in claims.judge(exp.SPECS, exp.run(cfg, model))}
    assert by["wemask.beats_random"].verdict == NOT_APPLICABLE
    assert "at least 5" in by["wemask.beats_random"].why
    assert "--mc none" in by["wemask.small_rate_mc_unchanged"].why
    assert "magnitude" in by["wemask.beats_magnitude"].why
    assert "r = 1 was not run" in by["wemask.full_mask_collapses"].why
    assert by["wemask.small_rate_ppl_unchanged"].verdict == HOLDS


@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_not_applicable_without_massive_activation(fixture, request, prompt_file, texts_file):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    cfg = exp.Config(prompts=prompt_file, texts=texts_file)
    with pytest.raises(NotApplicable, match="no massive activation"):
        exp.run(cfg, model)
    out = execute(exp.EXPERIMENT, cfg, model)
    assert out.result is None
    assert [c.verdict for c in out.claims] == [NOT_APPLICABLE] * len(exp.SPECS)
    assert all("massive" in c.why for c in out.claims)
    # the intervention itself: no ME layer to start from and no layers given
    with pytest.raises(NotApplicable, match="no massive activation"):
        we_mask(model, 0.1, batch=model.tokenize(synthetic.planted_prompts(4)))


def test_given_me_layer_without_massive_activation(twin, prompt_file, texts_file):
    """me_layer on a model without a massive activation: the sweep runs, no claim is judged."""
    model, plant = twin
    cfg = exp.Config(
        prompts=prompt_file, texts=texts_file, me_layer=plant.layer, rates=(0.1, 1.0), alphas=(),
        mc="none",
    )  # fmt: skip
    r = exp.run(cfg, model)
    assert r.me_layer_given and not r.massive_at_me
    cs = claims.judge(exp.SPECS, r)
    assert {c.verdict for c in cs} == {NOT_APPLICABLE}
    assert all("no massive activation at the ME layer 2" in c.why for c in cs)


def test_constructed_straddle_is_inconclusive(planted_result):
    """A perplexity change whose interval straddles the 'unchanged' tolerance is inconclusive."""
    r = planted_result
    base, w = r.baseline, r.metrics("wemask", "weight", 0.1)
    n = len(base.per_text.nll)
    shift = [0.0] * n  # make half of the texts 10 % more surprising under the mask
    for i in range(0, n, 2):
        shift[i] = math.log(1.1) * base.per_text.n_pred[i]
    nll = list(np.add(base.per_text.nll, shift))
    fake = dataclasses.replace(w, per_text=dataclasses.replace(w.per_text, nll=nll))
    rows = [dataclasses.replace(row, metrics=fake) if row.metrics is w else row for row in r.rows]
    mod = dataclasses.replace(r, rows=rows)
    c = next(c for c in claims.judge(exp.SPECS, mod) if c.id == "wemask.small_rate_ppl_unchanged")
    assert c.estimate.lo < claims.threshold("ppl_unchanged") < c.estimate.hi
    assert c.verdict == claims.INCONCLUSIVE


def test_figures_and_summary(planted_result):
    figs = exp.figures(planted_result)
    assert set(figs) == {"mask_rate", "soft_alpha"}
    text = exp.summary(planted_result)
    assert "baseline" in text and "direction_projection" in text


def test_bad_config():
    with pytest.raises(ValueError, match="rates must all be <= 1"):
        exp.Config(rates=(0.1, 2.0))
    with pytest.raises(ValueError, match="alphas must all be >= 0"):
        exp.Config(alphas=(-1.0,))
    with pytest.raises(ValueError, match="unknown variant"):
        exp.Config(variants=("top",))
    with pytest.raises(ValueError, match="unknown start 'gte'"):
        exp.Config(start="gte")
    with pytest.raises(ValueError, match="claim_rate"):
        exp.Config(claim_rate=1.0)
    # ValueError from __post_init__; jaxtyping's TypeCheckError (a TypeError) when checks are on
    with pytest.raises((ValueError, TypeError)):
        exp.Config(mc="some")
    with pytest.raises(ValueError, match="unknown positions 'all'"):
        exp.Config(positions="all")


def test_cli_smoke(tmp_path, prompt_file, texts_file, capsys):
    rc = exp.main(
        [
            "--model", "synthetic:planted", "--prompts", prompt_file, "--texts", texts_file,
            "--rates", "0", "1", "--variants", "weight", "random", "--alphas", "1",
            "--mc", "none", "--out", str(tmp_path), "--verbose",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "[holds] wemask.full_mask_removes_sink" in out
    run_dir = next((tmp_path / "wemask").iterdir())
    run = io.read_run(run_dir)
    assert run["result"]["header"]["layer"] == 2 and run["result"]["n_texts"] == 12
    assert {c["id"] for c in run["result"]["claims"]} == {s.id for s in exp.SPECS}
    assert (run_dir / "mask_rate.html").is_file()
    assert exp.main(["--model", "synthetic:planted", "--rates", "3", "--out", str(tmp_path)]) == 2
    rc = exp.main(["--model", "synthetic:twin", "--prompts", prompt_file, "--out", str(tmp_path)])
    assert rc == 0 and "not applicable" in capsys.readouterr().out


def test_massive_positions_option(planted, prompt_file, texts_file):
    model, _ = planted
    common = dict(
        prompts=prompt_file, texts=texts_file, rates=(1.0,), variants=("weight",), alphas=(),
        mc="none",
    )  # fmt: skip
    r = exp.run(exp.Config(positions="massive", **common), model)
    assert r.positions == [[0]] * r.n_texts  # the planted massive token is the BOS at position 0
    first = exp.run(exp.Config(**common), model)
    assert (
        r.metrics("wemask", "weight", 1.0).perplexity
        == first.metrics("wemask", "weight", 1.0).perplexity
    )


@pytest.mark.slow
def test_bundled_small_sweep(bundled):
    """Two-sided bounds on the real model (32 shipped texts): r = 0.1 weight WeMask is mild, the
    magnitude selection and the full mask are not, the full mask halves the sink."""
    cfg = exp.Config(rates=(0.1, 1.0), variants=("weight", "magnitude"), alphas=(), mc="none")
    r = exp.run(cfg, bundled)
    assert r.me_layer == 11 and r.n_texts == 32 and r.layers == list(range(11, 30))
    base = r.baseline.perplexity
    assert 20 < base < 60
    w01 = r.metrics("wemask", "weight", 0.1).perplexity / base
    w1 = r.metrics("wemask", "weight", 1.0).perplexity / base
    m01 = r.metrics("wemask", "magnitude", 0.1).perplexity / base
    assert 0.97 < w01 < 1.08
    assert 1.3 < w1 < 2.0
    assert 1.3 < m01 < 2.0
    drop = 1 - r.metrics("wemask", "weight", 1.0).sink / r.baseline.sink
    assert 0.3 < drop < 0.6
    v = {c.id: c.verdict for c in claims.judge(exp.SPECS, r)}
    assert v["wemask.beats_magnitude"] == HOLDS
    assert v["wemask.full_mask_removes_sink"] == HOLDS
    assert v["wemask.full_mask_collapses"] == FAILS
    assert v["wemask.beats_random"] == NOT_APPLICABLE  # not run here


def test_default_rates_are_the_papers_and_every_selection_has_its_own_line(planted_result):
    cfg = exp.Config()
    assert cfg.rates == (0.0, 0.1, 0.3, 0.5, 0.7, 1.0)  # paper.md §2.5, with 0 as the reference
    rates = {c.rate for c in exp.conditions(cfg) if c.kind == "wemask"}
    assert rates == {0.1, 0.3, 0.5, 0.7, 1.0}
    fig = exp.figures(planted_result)["mask_rate"]
    styles = {
        t.name: (t.line.dash, t.marker.symbol)
        for t in fig.data
        if t.name in exp.VARIANTS and t.showlegend
    }
    assert sorted(styles) == sorted(exp.VARIANTS)
    # the activation line is not hidden under another: its own dash and marker
    assert len(set(styles.values())) == len(styles)
    xs = {t.name: list(t.x) for t in fig.data if t.name == "activation"}
    assert xs["activation"] == [0.0, 0.1, 0.5, 1.0]  # the planted run's rates, the claim rate added
